"""Cut-through for Produce requests on tansu: real clients send large batches through kproxy, which
streams each large Produce request to the broker while it arrives; every record is then consumed back
(straight from the broker), and /metrics says the requests were streamed. With cut-through off the
same counter stays at zero: the test that fails when streaming is off."""

from __future__ import annotations

import asyncio
from typing import Any

import aiokafka
import confluent_kafka
import pytest

from tests.e2e.scenarios import (  # kafka-python, quietly imported
    _ck_consume_assigned,
    confluent_create_topic,
    kafka,
)
from tests.e2e.tansu import Tansu, TansuBroker, free_port
from tests.e2e.test_cut_through import CuttingRelay, cleanup, metrics, proxy  # noqa: F401 - cleanup is a fixture

pytestmark = pytest.mark.e2e

N = 300
VALUE = 2000   # 300 x 2 KB in about one batch: Produce requests of about 600 KB
STREAMED = ("kproxy_frames_total", (("api", "produce"), ("direction", "request"), ("path", "streamed")))
STORED = ("kproxy_frames_total", (("api", "produce"), ("direction", "request"), ("path", "stored")))
BROKEN = ("kproxy_streamed_requests_broken_total", (("side", "broker"),))
LOST = ("kproxy_request_outcomes_total", (("api", "produce"), ("outcome", "upstream_lost")))


def records(tag: str) -> list[tuple[bytes, bytes]]:
    return [(f"{tag}-{i:05d}".encode(), (b"%05d|" % i) * (VALUE // 6)) for i in range(N)]


def confluent_produce(bootstrap: str, topic: str, acks: str = "all", landed: Any = None) -> None:
    p = confluent_kafka.Producer({"bootstrap.servers": bootstrap, "acks": acks, "linger.ms": 200,
                                  "batch.size": 2_000_000, "message.max.bytes": 4_000_000})
    for key, value in records(topic):
        p.produce(topic, value, key, partition=0)
    assert p.flush(30) == 0
    if landed is not None:
        # acks=0: flush returns once the request is in the client's socket. Closing the producer then
        # may reset the connection and drop what the socket still holds (the client's choice, not
        # kproxy's), so the producer stays open until the records are on the broker.
        assert landed(), "the acks=0 records did not all land"


def kafka_python_produce(bootstrap: str, topic: str) -> None:
    p = kafka.KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=200, batch_size=2_000_000,
                            max_request_size=4_000_000, enable_idempotence=False, request_timeout_ms=10_000)
    try:
        futures = [p.send(topic, key=k, value=v, partition=0) for k, v in records(topic)]
        p.flush(timeout=30)
        for f in futures:
            f.get(timeout=30)
    finally:
        p.close(timeout=5)


async def aiokafka_produce(bootstrap: str, topic: str) -> None:
    p = aiokafka.AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=200,
                                  max_batch_size=2_000_000, max_request_size=4_000_000, request_timeout_ms=10_000)
    try:
        await p.start()
        futures = [await p.send(topic, key=k, value=v, partition=0) for k, v in records(topic)]
        await p.flush()
        await asyncio.gather(*futures)
    finally:
        await p.stop()


def all_back(broker: TansuBroker, topic: str) -> bool:
    got = _ck_consume_assigned(broker.bootstrap, topic, N, 1)
    return sorted((key, value) for _, key, value, _ in got) == records(topic)


# Each takes the bootstrap, the topic and a check that every record landed (used by acks=0 only).
CLIENTS: dict[str, Any] = {
    "confluent-kafka": lambda b, t, landed: confluent_produce(b, t),
    "confluent-kafka acks=0": lambda b, t, landed: confluent_produce(b, t, acks="0", landed=landed),
    "kafka-python": lambda b, t, landed: kafka_python_produce(b, t),
    "aiokafka": lambda b, t, landed: asyncio.run(aiokafka_produce(b, t)),
}


def test_real_clients_produce_through_the_streaming_path_and_every_record_lands(
        broker: TansuBroker, topic: str, cleanup: list[str]) -> None:  # noqa: F811
    with proxy(broker.bootstrap) as (p, admin):
        for i, (name, produce) in enumerate(CLIENTS.items()):
            t = f"{topic}-{i}"
            cleanup.append(t)
            confluent_create_topic(broker.bootstrap, t, partitions=1)
            before = metrics(admin)
            produce(p.bootstrap, t, lambda t=t: all_back(broker, t))
            after = metrics(admin)
            assert after.get(STREAMED, 0) > before.get(STREAMED, 0), f"{name}: no Produce request was streamed"
            assert all_back(broker, t), f"{name}: the records did not all land"


def test_with_cut_through_off_produce_requests_are_stored(broker: TansuBroker, topic: str,
                                                          cleanup: list[str]) -> None:  # noqa: F811
    cleanup.append(topic)
    confluent_create_topic(broker.bootstrap, topic, partitions=1)
    with proxy(broker.bootstrap, cut_through=False) as (p, admin):
        confluent_produce(p.bootstrap, topic)
        m = metrics(admin)
        assert m.get(STREAMED, 0) == 0 and m.get(STORED, 0) > 0
    assert all_back(broker, topic)


def test_a_broker_cut_mid_request_has_the_client_retry_and_nothing_is_lost(tansu_binary: str) -> None:
    relay_port = free_port()
    tansu = Tansu(tansu_binary, advertised=("127.0.0.1", relay_port))
    relay = CuttingRelay(("127.0.0.1", tansu.port), relay_port, towards_broker=True)
    relay.start()
    try:
        with tansu, proxy(relay.bootstrap) as (p, admin):
            topic = f"cut-up-{relay_port}"
            confluent_create_topic(relay.bootstrap, topic, partitions=1)
            relay.armed.set()
            # Half of the first large Produce request reaches the broker, then the connection is cut.
            # While kproxy is still sending it, it reads the rest and drops it (a broken streamed
            # request); if its last bytes were already in the socket, the request is one in flight on
            # a lost connection. Either way the client is told NOT_LEADER_OR_FOLLOWER, and its retry
            # lands on a new broker connection, once: the broker never saw a whole request.
            confluent_produce(p.bootstrap, topic)
            assert relay.cuts == 1
            got = _ck_consume_assigned(relay.bootstrap, topic, N, 1)
            assert sorted((key, value) for _, key, value, _ in got) == records(topic)
            m = metrics(admin)
            assert m.get(LOST, 0) == 1 and m.get(BROKEN, 0) in (0, 1) and m.get(STREAMED, 0) >= 2
    finally:
        relay.stop()

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
from tests.e2e.tansu import TansuBroker
from tests.e2e.test_cut_through import cleanup, metrics, proxy  # noqa: F401 - cleanup is a fixture

pytestmark = pytest.mark.e2e

N = 300
VALUE = 2000   # 300 x 2 KB in about one batch: Produce requests of about 600 KB
STREAMED = ("kproxy_frames_total", (("api", "produce"), ("direction", "request"), ("path", "streamed")))
STORED = ("kproxy_frames_total", (("api", "produce"), ("direction", "request"), ("path", "stored")))


def records(tag: str) -> list[tuple[bytes, bytes]]:
    return [(f"{tag}-{i:05d}".encode(), (b"%05d|" % i) * (VALUE // 6)) for i in range(N)]


def confluent_produce(bootstrap: str, topic: str, acks: str = "all") -> None:
    p = confluent_kafka.Producer({"bootstrap.servers": bootstrap, "acks": acks, "linger.ms": 200,
                                  "batch.size": 2_000_000, "message.max.bytes": 4_000_000})
    for key, value in records(topic):
        p.produce(topic, value, key, partition=0)
    assert p.flush(30) == 0


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


CLIENTS: dict[str, Any] = {
    "confluent-kafka": confluent_produce,
    "confluent-kafka acks=0": lambda b, t: confluent_produce(b, t, acks="0"),
    "kafka-python": kafka_python_produce,
    "aiokafka": lambda b, t: asyncio.run(aiokafka_produce(b, t)),
}


def test_real_clients_produce_through_the_streaming_path_and_every_record_lands(
        broker: TansuBroker, topic: str, cleanup: list[str]) -> None:  # noqa: F811
    with proxy(broker.bootstrap) as (p, admin):
        for i, (name, produce) in enumerate(CLIENTS.items()):
            t = f"{topic}-{i}"
            cleanup.append(t)
            confluent_create_topic(broker.bootstrap, t, partitions=1)
            before = metrics(admin)
            produce(p.bootstrap, t)
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

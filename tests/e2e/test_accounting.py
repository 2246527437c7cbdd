"""Every request accounted for exactly once, and a request kproxy holds executed exactly once.

- A consumer that closes during a Fetch long poll: kproxy's metrics and traffic log count the same
  requests as the client's own statistics (librdkafka's), the cut Fetch as ``client_gone``.
- A Produce held by kproxy longer than the request timeout (a chaos delay; a long throttle behaves
  the same) reaches the broker once: the broker holds each record once.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import confluent_kafka

from tests.e2e.conftest import TansuBroker, free_port, unique_name
from tests.e2e.proxied import start_proxy
from tests.e2e.test_telemetry import Telemetered, metric


def _create(bootstrap: str, topic: str) -> None:
    admin = confluent_kafka.admin.AdminClient({"bootstrap.servers": bootstrap})
    for f in admin.create_topics([confluent_kafka.admin.NewTopic(topic, 1, 1)]).values():
        f.result(timeout=30)


def _count_direct(bootstrap: str, topic: str, expect: int, deadline_s: float = 30.0) -> list[bytes]:
    """Every record of partition 0, read straight from the broker (no kproxy)."""
    c = confluent_kafka.Consumer({"bootstrap.servers": bootstrap, "group.id": f"count-{uuid.uuid4()}",
                                  "enable.auto.commit": False, "session.timeout.ms": 6000})
    try:
        c.assign([confluent_kafka.TopicPartition(topic, 0, confluent_kafka.OFFSET_BEGINNING)])
        got: list[bytes] = []
        end = time.monotonic() + deadline_s
        # Read until the expected count and then a quiet second more: a duplicate would show up.
        quiet_until = None
        while time.monotonic() < end:
            m = c.poll(0.2)
            if m is not None and m.error() is None:
                got.append(m.value())
                quiet_until = None
            elif len(got) >= expect:
                quiet_until = quiet_until or time.monotonic() + 1.0
                if time.monotonic() >= quiet_until:
                    break
        return got
    finally:
        c.close()


def test_a_produce_held_past_the_request_timeout_is_written_once(broker: TansuBroker, tmp_path: Path) -> None:
    topic = unique_name("held")
    _create(broker.bootstrap, topic)
    rules = tmp_path / "rules.yaml"
    # Held 4 s against a 1.5 s request timeout: the hold must not read as a dead broker.
    rules.write_text("rules:\n  - {name: hold, match: {client_id: 'held-*', api: produce}, action: chaos,\n"
                     "     chaos: {rate: 1.0, latency_ms: 4000}}\n")
    proxy = start_proxy(broker.bootstrap, rules=[str(rules)], chaos=True,
                        upstream_settings={"request_timeout_s": 1.5})
    try:
        p = confluent_kafka.Producer({"bootstrap.servers": proxy.bootstrap, "client.id": "held-producer",
                                      "acks": "all", "enable.idempotence": False, "linger.ms": 0,
                                      "message.timeout.ms": 60000, "request.timeout.ms": 30000})
        reports: list = []
        values = [f"record-{i}".encode() for i in range(3)]
        # Produced without waiting for each (librdkafka sends one or more Produce requests, each
        # held): every record is still written once, and the test waits about one hold, not three.
        for v in values:
            p.produce(topic, v, partition=0, on_delivery=lambda err, msg: reports.append(err))
            p.poll(0)
        p.flush(60)
        assert reports == [None, None, None]
    finally:
        proxy.stop()
    assert sorted(_count_direct(broker.bootstrap, topic, len(values))) == sorted(values)


def test_requests_cut_by_a_closing_consumer_are_counted_as_the_client_counted_them(
        broker: TansuBroker, tmp_path: Path) -> None:
    topic = unique_name("longpoll")
    _create(broker.bootstrap, topic)
    admin = f"127.0.0.1:{free_port()}"
    log_dir = tmp_path / "traffic"
    proxy = start_proxy(broker.bootstrap, admin={"listen": admin}, traffic_log={"dir": str(log_dir)})
    tel = Telemetered(proxy, None, log_dir, admin)  # type: ignore[arg-type]  # no spans here
    stats: list[dict] = []
    try:
        c = confluent_kafka.Consumer({
            "bootstrap.servers": proxy.bootstrap, "group.id": f"g-{uuid.uuid4()}", "client.id": "longpoll",
            "enable.auto.commit": False, "fetch.wait.max.ms": 5000, "statistics.interval.ms": 100,
            "stats_cb": lambda s: stats.append(json.loads(s))})
        c.assign([confluent_kafka.TopicPartition(topic, 0, 0)])
        # Poll an empty topic until the client has a Fetch waiting in its long poll, after at least
        # one earlier Fetch completed; then close in the middle of that long poll.
        end = time.monotonic() + 60
        while time.monotonic() < end:
            c.poll(0.05)
            if stats:
                s = stats[-1]
                fetches = sum(b.get("req", {}).get("Fetch", 0) for b in s["brokers"].values())
                waiting = sum(b.get("waitresp_cnt", 0) for b in s["brokers"].values()
                              if b.get("nodeid", -1) >= 0)
                if fetches >= 2 and waiting >= 1:
                    break
        else:
            raise AssertionError("the consumer never had a Fetch in a long poll")
        client = stats[-1]
        c.close()
        # Per request type. (librdkafka drops the statistics of a bootstrap connection once it has
        # learned the brokers, so only the Fetches, all sent to a learned broker, compare exactly.)
        sent: dict[str, int] = {}
        for b in client["brokers"].values():
            for name, n in b.get("req", {}).items():
                sent[name] = sent.get(name, 0) + n
        # kproxy completes the cut Fetch when the connection ends; wait for it, with a deadline.
        end = time.monotonic() + 30
        while time.monotonic() < end:
            m = tel.metrics()
            if metric(m, "kproxy_requests_total", api="fetch") >= sent["Fetch"]:
                break
            time.sleep(0.1)
        m = tel.metrics()
        assert metric(m, "kproxy_requests_total", api="fetch") == sent["Fetch"]
        assert metric(m, "kproxy_request_outcomes_total", api="fetch", outcome="client_gone") >= 1
        total = sum(v for (name, _), v in m.items() if name == "kproxy_requests_total")
    finally:
        tel.stop()
    lines = tel.lines()
    assert sum(1 for line in lines if line["api"] == "fetch") == sent["Fetch"]
    assert len(lines) == total            # the traffic log and the metrics count the same requests
    assert any(line["outcome"] == "client_gone" for line in lines if line["api"] == "fetch")

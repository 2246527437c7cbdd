"""``kproxy report`` on a traffic log that real clients made: confluent-kafka through kproxy on tansu,
with the traffic log on; the report's totals must equal what the clients sent and received."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import confluent_kafka
import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from tests.e2e.conftest import broker, tansu_binary  # noqa: F401 (the e2e broker fixtures)
from tests.e2e.proxied import start_proxy
from tests.e2e.tansu import TansuBroker, unique_name

pytestmark = [pytest.mark.spark, pytest.mark.e2e]

N = 2000
VALUE = b"v" * 1000


def produce_and_consume(bootstrap: str, topic: str) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap, "client.id": "report-admin"})
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])[topic].result(30)
    producer = confluent_kafka.Producer({"bootstrap.servers": bootstrap, "client.id": "report-producer",
                                         "acks": "all", "linger.ms": 20})
    for i in range(N):
        producer.produce(topic, VALUE, key=b"%06d" % i, partition=0)
        if i % 500 == 0:
            producer.poll(0)
    assert producer.flush(30) == 0
    consumer = confluent_kafka.Consumer({"bootstrap.servers": bootstrap, "client.id": "report-consumer",
                                         "group.id": unique_name("report-group"), "enable.auto.commit": False})
    try:
        consumer.assign([confluent_kafka.TopicPartition(topic, 0, 0)])
        got = 0
        while got < N:
            msgs = consumer.consume(min(500, N - got), 10)
            assert msgs, f"consumed {got} of {N}"
            assert all(m.error() is None for m in msgs)
            got += len(msgs)
    finally:
        consumer.close()


def test_the_report_of_a_real_log_adds_up_to_what_the_clients_moved(
        spark: Any, broker: TansuBroker, tmp_path: Path) -> None:  # noqa: F811
    from kproxy.cli import main

    logs = tmp_path / "traffic"
    topic = unique_name("report-real")
    p = start_proxy(broker.bootstrap, advertised_host="127.0.0.1", traffic_log={"dir": str(logs)})
    try:
        produce_and_consume(p.bootstrap, topic)
    finally:
        p.stop()             # closes the writer: the files being written get their final names

    out = tmp_path / "report"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["report", str(logs), "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["produced_records"] == N
    assert s["fetched_records"] == N
    # The same record batches went in and came out; each carries its value, key and framing.
    assert s["produce_bytes"] == s["fetch_bytes"]
    assert N * len(VALUE) < s["produce_bytes"] < N * (len(VALUE) + 100)
    lines = [json.loads(line) for f in logs.rglob("*.jsonl*") for line in _read(f).splitlines()]
    assert s["requests"] == len(lines)
    by_client = {r["client_id"] for r in spark.read.parquet(str(out / "tables" / "traffic_by_client")).collect()}
    assert {"report-producer", "report-consumer", "report-admin"} <= by_client
    e2e = spark.read.parquet(str(out / "tables" / "e2e_latency")).collect()
    assert any(r["topic"] == topic for r in e2e)


def _read(path: Path) -> str:
    import gzip

    return gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()

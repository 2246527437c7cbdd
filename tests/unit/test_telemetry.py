"""Telemetry without sockets: the facts read from completed entries, traffic log lines against their
schema, the writer's partitions, rotation, compression and drops, spans (name, attributes, the
latency split, traceparent links, sampling), the metrics text (promtool), and the admin listener's
answers and config redaction."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any

import attrs
import h11
import jsonschema
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from kproxy.config import HostPort, MetricsConfig, TracingConfig, TrafficLogConfig, config_from_args
from kproxy.protocol.messages import Request, Response, body_class
from kproxy.protocol.records import Compression, build_batch
from kproxy.proxy.filters import ConnectionContext
from kproxy.proxy.inflight import InFlight
from kproxy.server import admin
from kproxy.telemetry.exchange import Exchange, Learned, produced_records
from kproxy.telemetry.metrics import (
    BUCKETS,
    FOLD_EVERY_MASK,
    Histogram,
    Metrics,
    ProcessMetrics,
    rule_families,
)
from kproxy.telemetry.spans import Tracing, parse_traceparent, span_name
from kproxy.telemetry.traffic_log import IN_PROGRESS, SCHEMA_PATH, TrafficLogWriter, rfc3339, traffic_line

PRODUCE, FETCH, METADATA, JOIN_GROUP = 0, 1, 3, 11
TRACEPARENT = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def ctx(client_id: str = "app-1") -> ConnectionContext:
    c = ConnectionContext(7, client_address=("10.0.0.5", 40000), listener="broker-1", client_id=client_id)
    c.client_software_name, c.client_software_version = "librdkafka", "2.16.0"
    return c


def batch(n: int, base_offset: int = 0, compression: Compression = Compression.NONE, headers=(),
          ts: int = 1_700_000_000_000) -> bytes:
    return build_batch([(b"key-%d" % i, b"secret-value-%d" % i, list(headers), ts + i) for i in range(n)],
                       base_offset=base_offset, compression=compression)


def produce_entry(records: dict[tuple[str, int], bytes], base_offsets: dict[tuple[str, int], int],
                  errors: dict[tuple[str, int], int] | None = None, version: int = 9) -> InFlight:
    req_cls, resp_cls = body_class(PRODUCE, "request"), body_class(PRODUCE, "response")
    topics: dict[str, list[Any]] = {}
    for (t, p), recs in records.items():
        topics.setdefault(t, []).append(req_cls.PartitionProduceData(index=p, records=recs))
    body = req_cls(acks=-1, timeout_ms=1000,
                   topic_data=[req_cls.TopicProduceData(name=t, partition_data=ps) for t, ps in topics.items()])
    answers: dict[str, list[Any]] = {}
    for (t, p), base in base_offsets.items():
        code = (errors or {}).get((t, p), 0)
        answers.setdefault(t, []).append(resp_cls.PartitionProduceResponse(index=p, base_offset=base, error_code=code))
    resp_body = resp_cls(responses=[resp_cls.TopicProduceResponse(name=t, partition_responses=ps)
                                    for t, ps in answers.items()], throttle_time_ms=5)
    req = Request.build(PRODUCE, version, 11, "app-1", body)
    return InFlight(11, PRODUCE, version, 10.0, req, request_bytes=500, response_bytes=80,
                    response=Response.build(PRODUCE, version, 11, resp_body), forwarded_at=10.001,
                    answered_at=10.004, finished_at=10.0045, broker=("kafka-1", 9092), throttle_ms=5)


def fetch_entry(parts: dict[tuple[str, int], tuple[int, bytes]], version: int = 12,
                ids: dict[str, uuid.UUID] | None = None) -> InFlight:
    """parts: (topic, partition) -> (fetch offset, records)."""
    req_cls, resp_cls = body_class(FETCH, "request"), body_class(FETCH, "response")
    by_topic: dict[str, list[tuple[int, int, bytes]]] = {}
    for (t, p), (offset, recs) in parts.items():
        by_topic.setdefault(t, []).append((p, offset, recs))

    def named(t: str) -> dict[str, Any]:
        return {"topic_id": ids[t]} if ids else {"topic": t}

    req = req_cls(max_wait_ms=500, min_bytes=1, topics=[
        req_cls.FetchTopic(**named(t), partitions=[req_cls.FetchPartition(partition=p, fetch_offset=o)
                                                   for p, o, _ in ps]) for t, ps in by_topic.items()])
    resp = resp_cls(responses=[
        resp_cls.FetchableTopicResponse(**named(t), partitions=[
            resp_cls.PartitionData(partition_index=p, high_watermark=100, records=r) for p, _, r in ps])
        for t, ps in by_topic.items()])
    return InFlight(3, FETCH, version, 20.0, Request.build(FETCH, version, 3, "app-1", req),
                    request_bytes=200, response_bytes=5000, response=Response.build(FETCH, version, 3, resp),
                    forwarded_at=20.0002, answered_at=20.5, finished_at=20.501, broker=("kafka-2", 9093))


def metadata_entry(topics: dict[str, uuid.UUID], error_topic: str | None = None) -> InFlight:
    req_cls, resp_cls = body_class(METADATA, "request"), body_class(METADATA, "response")
    req = Request.build(METADATA, 12, 1, "app-1", req_cls(topics=None))
    resp = resp_cls(brokers=[], topics=[resp_cls.MetadataResponseTopic(
        name=t, topic_id=tid, error_code=3 if t == error_topic else 0) for t, tid in topics.items()])
    return InFlight(1, METADATA, 12, 1.0, req, request_bytes=40, response_bytes=300,
                    response=Response.build(METADATA, 12, 1, resp), forwarded_at=1.0, answered_at=1.001,
                    finished_at=1.0012, broker=("kafka-1", 9092))


# -- facts from entries ----------------------------------------------------------------------------


def test_produce_partitions_count_records_and_take_offsets_from_the_response() -> None:
    e = produce_entry({("orders", 0): batch(3) + batch(2, base_offset=3), ("orders", 1): batch(4)},
                      {("orders", 0): 100, ("orders", 1): 7}, errors={("orders", 1): 6})
    x = Exchange(e, ctx(), Learned())
    p0, p1 = x.partitions
    assert (p0.topic, p0.partition, p0.records, p0.first_offset, p0.last_offset) == ("orders", 0, 5, 100, 104)
    assert p0.bytes == len(batch(3) + batch(2, base_offset=3))
    assert (p0.first_timestamp, p0.max_timestamp, p0.compression) == (1_700_000_000_000, 1_700_000_000_002, "none")
    # A failed partition has no offsets, only its error.
    assert (p1.records, p1.first_offset, p1.last_offset, p1.error_code) == (4, None, None, 6)
    assert x.topics == ["orders"] and x.acks == -1
    assert x.error == "NOT_LEADER_OR_FOLLOWER" and x.errors == (0, {6: 1})


def test_fetch_partitions_start_at_the_offset_asked_for() -> None:
    # The broker sends whole batches: the first starts before the fetch offset the client asked for.
    e = fetch_entry({("orders", 0): (12, batch(10, base_offset=5) + batch(4, base_offset=15)),
                     ("orders", 1): (0, b"")})
    x = Exchange(e, ctx(), Learned())
    p0, p1 = x.partitions
    assert (p0.first_offset, p0.last_offset, p0.records) == (12, 18, 14)
    assert (p1.first_offset, p1.last_offset, p1.records) == (None, None, 0)
    assert x.max_wait_ms == 500


def test_topic_ids_resolve_through_metadata_answers_and_groups_follow_the_client() -> None:
    learned = Learned()
    tid = uuid.uuid4()
    c = ctx()
    # The session fills the process's table from the broker's Metadata answers (test_session.py).
    learned.topic_names.learn(metadata_entry({"orders": tid}).response.body.topics)
    x = Exchange(fetch_entry({("orders", 0): (0, batch(2))}, version=13, ids={"orders": tid}), c, learned)
    assert x.topics == ["orders"] and x.partitions[0].topic == "orders"
    assert x.group is None
    join = body_class(JOIN_GROUP, "request")(group_id="billing", session_timeout_ms=6000, member_id="",
                                             protocol_type="consumer", protocols=[])
    learned.observe(InFlight(2, JOIN_GROUP, 5, 1.0, Request.build(JOIN_GROUP, 5, 2, "app-1", join)), c)
    assert Exchange(fetch_entry({("orders", 0): (0, b"")}), c, learned).group == "billing"
    assert Exchange(fetch_entry({("orders", 0): (0, b"")}), ctx("other"), learned).group is None


def test_nested_errors_are_found_from_the_schema() -> None:
    e = metadata_entry({"a": uuid.uuid4(), "b": uuid.uuid4()}, error_topic="b")
    x = Exchange(e, ctx(), Learned())
    assert x.errors == (0, {3: 1}) and x.error == "UNKNOWN_TOPIC_OR_PARTITION"


# -- traffic log lines -----------------------------------------------------------------------------

VALIDATOR = jsonschema.Draft202012Validator(json.loads(SCHEMA_PATH.read_text()))


def test_lines_validate_against_the_schema_and_carry_no_record_bytes() -> None:
    c = ctx()
    c.tls_subject = "CN=app"
    e = produce_entry({("orders", 0): batch(3)}, {("orders", 0): 40})
    e.notes = {"rule": "cap-orders", "action": "allow", "quota": {"rule": "q1", "key": "client_id=app-1",
                                                                  "throttle_ms": 30}}
    for entry in (e, fetch_entry({("orders", 0): (0, batch(2))}), metadata_entry({"a": uuid.uuid4()})):
        line = traffic_line(Exchange(entry, c, Learned()), 1_700_000_000.0, "host:1")
        VALIDATOR.validate(line)
        text = json.dumps(line)
        assert "secret-value" not in text and "key-0" not in text
    line = traffic_line(Exchange(e, c, Learned()), 1_700_000_000.0)
    assert line["ts"] == "2023-11-14T22:13:30.000000Z"
    assert (line["duration_ms"], line["queued_ms"], line["broker_ms"], line["return_ms"]) == (4.5, 1.0, 3.0, 0.5)
    assert (line["principal"], line["client_address"], line["listener"]) == ("User:CN=app", "10.0.0.5:40000",
                                                                           "broker-1")
    assert (line["rule"], line["action"], line["quota"]["throttle_ms"], line["throttle_ms"]) == (
        "cap-orders", "allow", 30, 5)
    assert {k: line["partitions"][0][k] for k in ("topic", "partition", "records", "first_offset", "last_offset")} \
        == {"topic": "orders", "partition": 0, "records": 3, "first_offset": 40, "last_offset": 42}


def test_rfc3339_keeps_microseconds_across_second_boundaries() -> None:
    assert rfc3339(1_700_000_000.9999996) == "2023-11-14T22:13:21.000000Z"
    assert rfc3339(1_700_000_000.25) == "2023-11-14T22:13:20.250000Z"


# -- the writer --------------------------------------------------------------------------------------


class FakeTime:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def finished(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def read_lines(path: Path) -> list[dict]:
    data = gzip.decompress(path.read_bytes()) if path.name.endswith(".gz") else path.read_bytes()
    return [json.loads(line) for line in data.decode().splitlines()]


def test_writer_partitions_by_hour_rotates_by_size_and_compresses(tmp_path: Path) -> None:
    clock = FakeTime(1_700_000_000.0)          # 2023-11-14 22:13:20 UTC
    w = TrafficLogWriter(TrafficLogConfig(dir=str(tmp_path), rotate_bytes=4096), clock=clock)
    for i in range(200):
        w._write({"n": i, "pad": "x" * 50})    # the worker's own step, driven here without a thread
    clock.t += 3600                            # the next hour: a new partition
    w._write({"n": 200})
    w._finish()
    files = finished(tmp_path)
    assert all(p.name.endswith(".jsonl.gz") and IN_PROGRESS not in p.name for p in files)
    hours = {p.parent.relative_to(tmp_path).as_posix() for p in files}
    assert hours == {"dt=2023-11-14/hour=22", "dt=2023-11-14/hour=23"}
    assert len(files) > 3                      # ~13 KB of lines in 4 KiB files
    ns = [line["n"] for p in sorted(files, key=lambda p: p.name.split("-")[-1]) for line in read_lines(p)]
    assert ns == list(range(201)) and w.written == 201 and w.files == len(files)


def test_writer_rotates_by_age_and_can_skip_compression(tmp_path: Path) -> None:
    clock = FakeTime(1_700_000_000.0)
    w = TrafficLogWriter(TrafficLogConfig(dir=str(tmp_path), rotate_s=60, compression="none"), clock=clock)
    w._write({"n": 1})
    open_files = finished(tmp_path)
    assert len(open_files) == 1 and open_files[0].name.endswith(".jsonl" + IN_PROGRESS)
    clock.t += 61
    w._idle()
    assert [p.name.endswith(".jsonl") for p in finished(tmp_path)] == [True]
    assert read_lines(finished(tmp_path)[0]) == [{"n": 1}]


def test_a_full_queue_drops_and_counts_without_waiting(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    w = TrafficLogWriter(TrafficLogConfig(dir=str(tmp_path), queue_size=2))
    assert [w.offer({"n": i}) for i in range(5)] == [True, True, False, False, False]
    assert w.dropped == 3
    assert sum("traffic log queue full" in r.getMessage() for r in caplog.records) == 1  # rate-limited
    w.start()
    w.close()
    assert w.written == 2 and [line["n"] for p in finished(tmp_path) for line in read_lines(p)] == [0, 1]


# -- spans ---------------------------------------------------------------------------------------------


def tracing(exporter: InMemorySpanExporter, **cfg: Any) -> Tracing:
    return Tracing(TracingConfig(enabled=True, **cfg), 1 << 20, exporter, env={}, seed=1)


def test_server_span_with_broker_child_and_the_split() -> None:
    exp = InMemorySpanExporter()
    t = tracing(exp)
    e = produce_entry({("orders", 2): batch(3)}, {("orders", 2): 10})
    t.emit(Exchange(e, ctx(), Learned()), 1_000_000_000)
    t.shutdown()
    server, = [s for s in exp.get_finished_spans() if s.kind is SpanKind.SERVER]
    client, = [s for s in exp.get_finished_spans() if s.kind is SpanKind.CLIENT]
    assert server.name == client.name == "produce orders"
    assert client.parent.span_id == server.context.span_id
    assert (server.start_time, server.end_time) == (int(10.0 * 1e9) + 1_000_000_000, int(10.0045 * 1e9) + 1_000_000_000)
    assert (client.start_time, client.end_time) == (int(10.001 * 1e9) + 1_000_000_000, int(10.004 * 1e9) + 1_000_000_000)
    a = server.attributes
    assert a["messaging.operation.type"] == "send" and a["messaging.destination.name"] == "orders"
    assert a["messaging.destination.partition.id"] == "2" and a["messaging.batch.message_count"] == 3
    assert a["messaging.client.id"] == "app-1" and (a["server.address"], a["server.port"]) == ("kafka-1", 9092)
    assert abs(a["kproxy.queued"] - 1.0) < 1e-6 and abs(a["kproxy.broker"] - 3.0) < 1e-6
    assert abs(a["kproxy.return"] - 0.5) < 1e-6 and a["kproxy.throttle_ms"] == 5
    assert "secret" not in repr(dict(a))


def test_traceparent_headers_become_links_only_where_allowed() -> None:
    traced = batch(2, headers=[("traceparent", TRACEPARENT)])
    compressed = batch(2, base_offset=2, compression=Compression.GZIP,
                       headers=[("traceparent", TRACEPARENT.replace(b"4bf9", b"5bf9"))])
    e = fetch_entry({("orders", 0): (0, traced + compressed)})
    for mode, expected in (("uncompressed", {"4bf9"}), ("all", {"4bf9", "5bf9"}), ("off", set())):
        exp = InMemorySpanExporter()
        t = tracing(exp, link_record_traces=mode)
        t.emit(Exchange(e, ctx(), Learned()), 0)
        t.shutdown()
        server, = [s for s in exp.get_finished_spans() if s.kind is SpanKind.SERVER]
        assert {f"{link.context.trace_id:032x}"[:4] for link in server.links} == expected, mode
        assert server.attributes["kproxy.max_wait_ms"] == 500


def test_parse_traceparent() -> None:
    sc = parse_traceparent(TRACEPARENT)
    assert sc is not None and sc.is_remote and f"{sc.span_id:016x}" == "00f067aa0ba902b7"
    for bad in (b"", b"01" + TRACEPARENT[2:], TRACEPARENT.replace(b"4bf9", b"zzzz"),
                b"00-" + b"0" * 32 + b"-00f067aa0ba902b7-01", TRACEPARENT[:40]):
        assert parse_traceparent(bad) is None, bad


def test_sampling_zero_builds_no_span() -> None:
    exp = InMemorySpanExporter()
    t = tracing(exp, sample_ratio=0.0)
    for _ in range(50):
        t.emit(Exchange(metadata_entry({}), ctx(), Learned()), 0)
    t.shutdown()
    assert exp.get_finished_spans() == () and t.spans == 0
    assert span_name(Exchange(metadata_entry({}), ctx(), Learned())) == "metadata"


# -- metrics -------------------------------------------------------------------------------------------


def promtool_check(text: bytes) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is not installed: `make test` installs it (Debian package prometheus)"
    done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr


def test_metrics_count_by_api_and_pass_promtool() -> None:
    m = Metrics(MetricsConfig(client_labels=True, topic_labels=True, label_cap=2))
    learned = Learned()
    for client in ("a", "b", "c", "d"):
        m.record(Exchange(produce_entry({("orders", 0): batch(3)}, {("orders", 0): 0}), ctx(client), learned))
    denied = metadata_entry({})
    denied.notes = {"rule": "no-metadata", "action": "deny"}
    m.record(Exchange(denied, ctx(), learned))
    m.add_reader(lambda: rule_families(None))
    text = m.exposition()
    promtool_check(text)
    lines = text.decode().splitlines()
    assert 'kproxy_requests_total{api="produce"} 4.0' in lines
    assert 'kproxy_records_total{direction="produced"} 12.0' in lines
    assert 'kproxy_denied_requests_total{rule="no-metadata"} 1.0' in lines
    assert 'kproxy_throttle_seconds_total{rule="broker"} 0.02' in lines
    assert 'kproxy_request_duration_seconds_bucket{api="produce",le="0.005"} 4.0' in lines
    assert 'kproxy_broker_duration_seconds_count{api="produce"} 4.0' in lines
    # Two client ids get series of their own; the rest are "other".
    assert 'kproxy_by_client_requests_total{api="produce",client_id="other"} 2.0' in lines
    assert 'kproxy_rule_reloads_total{outcome="ok"} 0.0' in lines


def _legacy_message(value: bytes) -> bytes:
    """One magic-0 message (offset, size, crc, magic, attributes, null key, value); its CRC is not checked here."""
    body = b"\x00\x00" + (-1).to_bytes(4, "big", signed=True) + len(value).to_bytes(4, "big") + value
    return (0).to_bytes(8, "big") + (len(body) + 4).to_bytes(4, "big") + b"\x00\x00\x00\x00" + body


@pytest.mark.parametrize("records, errors, fast", [
    ({("orders", 0): batch(3) + batch(2, base_offset=3), ("orders", 1): batch(4), ("audit", 0): batch(1)},
     {("orders", 1): 6}, True),
    ({("orders", 0): batch(5, compression=Compression.GZIP)}, {}, True),
    ({("orders", 0): b""}, {}, True),
    # A partial batch at the end, and a legacy message set: read in full, with the same count.
    ({("orders", 0): batch(3) + batch(2)[:30]}, {}, False),
    ({("orders", 0): _legacy_message(b"v1") + _legacy_message(b"v2")}, {}, False),
])
def test_metrics_count_produced_records_from_batch_headers_as_the_partition_facts_do(
        records: dict[tuple[str, int], bytes], errors: dict[tuple[str, int], int], fast: bool) -> None:
    e = produce_entry(records, dict.fromkeys(records, 100), errors=errors)
    facts = sum(p.records for p in Exchange(e, ctx(), Learned()).partitions if not p.error_code)
    assert (produced_records(e) is not None) is fast
    if fast:
        assert produced_records(e) == facts
    # Without topic labels metrics take the headers' counts; with them, the facts per partition.
    plain, by_topic = Metrics(), Metrics(MetricsConfig(topic_labels=True))
    for m in (plain, by_topic):
        m.record(Exchange(e, ctx(), Learned()))
    assert plain.records["produced"] == by_topic.records["produced"] == facts


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.sampled_from([0.0, *BUCKETS, 61.0]),
                          st.floats(min_value=0.0, max_value=100.0, allow_nan=False)), max_size=300))
def test_histogram_folded_in_a_batch_counts_as_observing_one_by_one(values: list[float]) -> None:
    one, batched = Histogram(), Histogram()
    for v in values:
        one.observe(v)
    batched.pending.extend(values)
    assert batched.buckets == one.buckets and batched.count == one.count == len(values)
    assert batched.sum == pytest.approx(one.sum) and batched.cumulative() == one.cumulative()
    assert not batched.pending


def test_metrics_hold_at_most_a_fold_of_pending_durations() -> None:
    m = Metrics()
    e = metadata_entry({})
    for _ in range(FOLD_EVERY_MASK + 1):
        m.record(Exchange(e, ctx(), Learned()))
    (c,) = m.apis.values()
    assert not c.duration.pending and not c.broker.pending and not c.added.pending
    m.record(Exchange(e, ctx(), Learned()))
    assert len(c.duration.pending) == 1
    assert c.duration.count == FOLD_EVERY_MASK + 2 and not c.duration.pending


def test_metrics_without_opt_in_have_no_client_or_topic_labels() -> None:
    m = Metrics()
    m.record(Exchange(produce_entry({("orders", 0): batch(3)}, {("orders", 0): 0}), ctx(), Learned()))
    text = m.exposition().decode()
    assert "client_id=" not in text and "topic=" not in text


# -- the admin listener ----------------------------------------------------------------------------


@attrs.frozen
class WithSecrets:
    user: str = "svc"
    password: str | None = "hunter2"
    sasl: dict = attrs.field(factory=lambda: {"token": "t0k3n", "mechanism": "PLAIN"})
    key_file: str = "/etc/kproxy/tls.key"


def test_public_config_leaves_secrets_out() -> None:
    assert admin.public_config(WithSecrets()) == {"user": "svc", "password": "<redacted>",
                                                  "sasl": {"token": "<redacted>", "mechanism": "PLAIN"},
                                                  "key_file": "/etc/kproxy/tls.key"}
    cfg = config_from_args("kafka:9092", "127.0.0.1:9092", admin={"listen": "127.0.0.1:9644"})
    shown = admin.public_config(cfg)
    assert shown["admin"]["listen"] == "127.0.0.1:9644" and shown["upstream"]["bootstrap_servers"] == ["kafka:9092"]
    json.dumps(shown)


class View:
    def __init__(self) -> None:
        self.config = config_from_args("kafka:9092", "127.0.0.1:9092")
        self.rule_store: Any = None
        self.ready = (False, "not ready: draining")
        self.metrics = ProcessMetrics()
        self.metrics.cluster("default")

    def readiness(self) -> tuple[bool, str]:
        return self.ready

    def rules(self) -> dict[str, Any]:
        return admin.rules_view(self.rule_store)

    def clients_view(self) -> dict[str, Any]:
        return {"connections": []}


async def test_admin_over_http() -> None:
    view = View()
    listener = admin.bind(HostPort("127.0.0.1", _free_port()))
    server = admin.AdminServer(view, listener)
    host, port = server.address
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.serve)
        stream = await trio.open_tcp_stream(host, port)
        client = h11.Connection(h11.CLIENT)

        async def get(path: str) -> tuple[int, bytes]:
            await stream.send_all(client.send(h11.Request(method="GET", target=path, headers=[("Host", "x")])))
            await stream.send_all(client.send(h11.EndOfMessage()))
            status, body = 0, b""
            while True:
                event = client.next_event()
                if event is h11.NEED_DATA:
                    client.receive_data(await stream.receive_some(65536))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    client.start_next_cycle()
                    return status, body

        # Several requests on one kept-alive connection.
        assert await get("/readyz") == (503, b"not ready: draining\n")
        view.ready = (True, "ready")
        assert await get("/readyz") == (200, b"ready\n")
        assert await get("/livez") == (200, b"ok\n")
        status, body = await get("/metrics")
        assert status == 200 and b"# TYPE kproxy_requests_total counter" in body
        status, body = await get("/rules")
        assert status == 200 and json.loads(body) == {"configured": False, "message": "no rule files are configured"}
        assert (await get("/config"))[0] == 200 and (await get("/x"))[0] == 404
        await stream.aclose()
        nursery.cancel_scope.cancel()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_admin_refuses_other_methods() -> None:
    server = admin.AdminServer(View(), None)  # type: ignore[arg-type]
    assert server.respond("POST", "/metrics")[0] == 405


def test_traffic_log_dir_and_sample_are_checked(tmp_path: Path) -> None:
    from kproxy.config import ConfigError, parse_config

    head = 'listen: "127.0.0.1:9092"\nupstream: {bootstrap_servers: "k:9092"}\n'
    (tmp_path / "file").write_text("")
    for text, message in (
        (f"traffic_log: {{dir: {tmp_path / 'file'}}}\n", "<string>:3: traffic_log.dir: not a directory"),
        ("traffic_log:\n  sample: {fetchh: 0.5}\n", "<string>:4: traffic_log.sample: unknown API 'fetchh' "
                                                    "(did you mean 'fetch'?)"),
        ("traffic_log:\n  sample:\n    fetch: 2\n", "<string>:5: traffic_log.sample.fetch: must be a number from 0 to 1"),
        ("tracing: {sample_ratio: 1.5}\n", "tracing.sample_ratio: must be at most 1"),
    ):
        with pytest.raises(ConfigError) as info:
            parse_config(head + text)
        assert message in str(info.value), str(info.value)
    cfg = parse_config(head + f"traffic_log: {{dir: {tmp_path / 'new'}, sample: {{fetch: 0.1, default: 1}}}}\n")
    assert cfg.traffic_log.sample == {"fetch": 0.1, "default": 1}


@pytest.mark.usefixtures("root_logger")
def test_an_otel_exporter_kproxy_cannot_use_is_a_config_error(capsys: pytest.CaptureFixture,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from kproxy import cli

    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    assert cli.main(["run", "--upstream", "k:9092", "--listen", "127.0.0.1:19092", "--tracing"]) == 2
    assert "OTEL_TRACES_EXPORTER='zipkin'" in capsys.readouterr().err

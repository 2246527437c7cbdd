"""Telemetry through real clients on tansu: spans (names, attributes, parent and child, the latency
split, traceparent links, nothing secret), /metrics (counts equal what the test sent, promtool
passes), /readyz before discovery and while draining, the traffic log (schema, offsets and record
counts equal what the clients produced and consumed), OTLP over HTTP to a receiver, and
verify_reencode on every frame finding no mismatch, and an admin answer that fails with a bug (a 500,
logged) while Kafka traffic through the same process goes on.

One proxy with every output on serves the module; the tests run in order and the last ones stop it
to read what was flushed.
"""

from __future__ import annotations

import collections
import gzip
import http.server
import json
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import confluent_kafka
import jsonschema
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from kproxy.protocol import Request, decode_response, encode_request_frame
from kproxy.protocol.messages import body_class
from kproxy.server.embedded import ProxyThread
from kproxy.telemetry.traffic_log import SCHEMA_PATH
from tests.e2e.proxied import start_proxy
from tests.e2e.relay import Relay
from tests.e2e.scenarios import (
    CONFLUENT,
    KAFKA_PYTHON,
    N_RECORDS,
    PARTITIONS,
    AdminTopicsResult,
    expected_records,
    partition_for,
    sent_records,
)
from tests.e2e.tansu import TansuBroker, free_port, unique_name
from tests.polling import wait_until

pytestmark = pytest.mark.e2e

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


class RuleStoreStandIn:
    """What the policy helper's RuleStore offers the admin listener and metrics."""

    generation = 3
    loaded_at = 1_700_000_000.5
    rule_count = 2
    sources = ("rules/a.yaml",)
    reloads_ok = 2
    reloads_failed = 1

    def describe(self) -> list[dict[str, Any]]:
        return [{"name": "deny-deletes", "action": "deny"}, {"name": "cap-fetch", "action": "cap"}]


class Telemetered:
    def __init__(self, proxy: ProxyThread, spans: InMemorySpanExporter, log_dir: Path, admin: str) -> None:
        self.proxy, self.spans, self.log_dir, self.admin = proxy, spans, log_dir, admin
        self.stopped = False

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://{self.admin}{path}", timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        status, text = self.get("/metrics")
        assert status == 200
        return parse_exposition(text)

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.proxy.stop()   # flushes the traffic log and the span processor

    def lines(self) -> list[dict[str, Any]]:
        out = []
        for path in sorted(self.log_dir.rglob("*")):
            if path.name.endswith(".jsonl.gz"):
                text = gzip.decompress(path.read_bytes()).decode()
            elif path.name.endswith(".jsonl"):
                text = path.read_text()
            else:
                continue
            out += [json.loads(line) for line in text.splitlines()]
        return out


def parse_exposition(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, value = line.rsplit(" ", 1)
        if "{" in name_labels:
            name, rest = name_labels.split("{", 1)
            labels = tuple(tuple(kv.split("=", 1)) for kv in rest.rstrip("}").split(",") if kv)
            labels = tuple((k, v.strip('"')) for k, v in labels)
        else:
            name, labels = name_labels, ()
        out[(name, tuple(sorted(labels)))] = float(value)
    return out


def metric(values: dict, name: str, **labels: str) -> float:
    """The samples of ``name`` with ``labels`` (others, such as virtual_cluster, may be anything), added up."""
    return sum(v for (n, have), v in values.items()
               if n == name and all(dict(have).get(k) == want for k, want in labels.items()))


@pytest.fixture(scope="module")
def tel(broker: TansuBroker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Telemetered]:
    spans = InMemorySpanExporter()
    log_dir = tmp_path_factory.mktemp("traffic")
    admin = f"127.0.0.1:{free_port()}"
    proxy = start_proxy(
        broker.bootstrap, server_options={"span_exporter": spans},
        admin={"listen": admin}, traffic_log={"dir": str(log_dir)},
        tracing={"enabled": True, "link_record_traces": "all"}, verify_reencode=1.0,
        metrics={"topic_labels": True, "client_labels": True},
    )
    t = Telemetered(proxy, spans, log_dir, admin)
    proxy.server.rule_store = RuleStoreStandIn()
    try:
        yield t
    finally:
        t.stop()


# -- what the tests share ------------------------------------------------------------------------


def raw_metadata_requests(bootstrap: str, n: int) -> None:
    """n Metadata v12 round trips on one connection: exactly n requests, nothing else."""
    host, port = bootstrap.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        for cid in range(n):
            req = Request.build(3, 12, cid, "telemetry-test", body_class(3, "request")(topics=[]))
            s.sendall(b"".join(bytes(b) for b in encode_request_frame(req)))
            size = int.from_bytes(_recv_exactly(s, 4), "big")
            resp = decode_response(_recv_exactly(s, size), 3, 12)
            assert resp.correlation_id == cid


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        assert chunk, "connection closed"
        buf += chunk
    return bytes(buf)


def traced_produce_consume(bootstrap: str, topic: str) -> None:
    """Three records with a traceparent header, produced and consumed with confluent-kafka."""
    p = confluent_kafka.Producer({"bootstrap.servers": bootstrap, "client.id": "traced-producer"})
    for i in range(3):
        p.produce(topic, key=b"k%d" % i, value=b"secret-value-%d" % i, partition=0,
                  headers=[("traceparent", TRACEPARENT.encode())])
    assert p.flush(30) == 0
    c = confluent_kafka.Consumer({"bootstrap.servers": bootstrap, "group.id": unique_name("g"),
                                  "client.id": "traced-consumer", "auto.offset.reset": "earliest",
                                  "enable.auto.commit": False})
    try:
        c.assign([confluent_kafka.TopicPartition(topic, 0, 0)])
        got = 0
        deadline = time.monotonic() + 30
        while got < 3 and time.monotonic() < deadline:
            m = c.poll(0.5)
            if m is not None and not m.error():
                got += 1
        assert got == 3
    finally:
        c.close()


# -- the scenarios (in order) --------------------------------------------------------------------


def test_readyz_and_livez_on_a_discovered_proxy(tel: Telemetered) -> None:
    assert tel.get("/livez") == (200, "ok\n")
    assert tel.get("/readyz") == (200, "ready\n")


def test_metrics_count_the_requests_sent(tel: Telemetered) -> None:
    before = tel.metrics()
    raw_metadata_requests(tel.proxy.bootstrap, 7)
    after = tel.metrics()
    assert metric(after, "kproxy_requests_total", api="metadata") - \
        metric(before, "kproxy_requests_total", api="metadata") == 7
    assert metric(after, "kproxy_request_duration_seconds_count", api="metadata") - \
        metric(before, "kproxy_request_duration_seconds_count", api="metadata") == 7
    assert metric(after, "kproxy_by_client_requests_total", client_id="telemetry-test", api="metadata") == 7
    assert metric(after, "kproxy_connections_opened_total", listener="bootstrap") >= 1


def test_produce_consume_records_in_metrics_and_traffic_log(tel: Telemetered, topic: str) -> None:
    before = tel.metrics()
    assert CONFLUENT.produce_consume(tel.proxy.bootstrap, topic) == expected_records()
    after = tel.metrics()
    produced = metric(after, "kproxy_records_total", direction="produced") - \
        metric(before, "kproxy_records_total", direction="produced")
    assert produced == N_RECORDS
    assert metric(after, "kproxy_topic_records_total", topic=topic, direction="produced") == N_RECORDS
    assert metric(after, "kproxy_topic_records_total", topic=topic, direction="fetched") >= N_RECORDS
    assert metric(after, "kproxy_requests_total", api="produce") > metric(before, "kproxy_requests_total",
                                                                          api="produce")


def test_group_and_admin_scenarios(tel: Telemetered, topic: str) -> None:
    result = KAFKA_PYTHON.group(tel.proxy.bootstrap, topic, unique_name("tgroup"))
    assert result.records == tuple(expected_records())
    names = [f"{topic}-x", f"{topic}-y"]
    assert CONFLUENT.admin_topics(tel.proxy.bootstrap, names) == AdminTopicsResult(
        (PARTITIONS, PARTITIONS), (True, True), (False, False))


def test_traceparent_records(tel: Telemetered, topic: str) -> None:
    CONFLUENT.create_topic(tel.proxy.bootstrap, topic, 1)
    traced_produce_consume(tel.proxy.bootstrap, topic)
    tel.traced_topic = topic  # type: ignore[attr-defined]


def test_metrics_text_passes_promtool(tel: Telemetered) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is not installed: `make test` installs it (Debian package prometheus)"
    status, text = tel.get("/metrics")
    assert status == 200
    done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    values = parse_exposition(text)
    for name in ("kproxy_connections_open", "kproxy_decode_errors_total", "kproxy_buffered_bytes",
                 "kproxy_traffic_log_lines_dropped_total", "kproxy_spans_total", "kproxy_rule_reloads_total"):
        assert any(key[0] == name for key in values), name
    assert metric(values, "kproxy_rule_reloads_total", outcome="failed") == 1
    assert metric(values, "kproxy_rules_generation") == 3


def test_reencode_checked_every_frame_without_a_mismatch(tel: Telemetered) -> None:
    values = tel.metrics()
    requests = sum(v for (name, _), v in values.items() if name == "kproxy_requests_total")
    assert metric(values, "kproxy_reencode_checks_total") >= requests > 100
    assert metric(values, "kproxy_reencode_mismatches_total") == 0


def test_config_and_rules_endpoints(tel: Telemetered) -> None:
    status, body = tel.get("/config")
    assert status == 200
    cfg = json.loads(body)
    assert cfg["traffic_log"]["dir"] == str(tel.log_dir)
    assert cfg["admin"]["listen"] == tel.admin
    assert cfg["lane"] == "auto"
    status, body = tel.get("/rules")
    assert status == 200
    rules = json.loads(body)
    assert rules["generation"] == 3 and rules["rule_count"] == 2 and rules["sources"] == ["rules/a.yaml"]
    assert [r["name"] for r in rules["rules"]] == ["deny-deletes", "cap-fetch"]
    assert tel.get("/nope")[0] == 404


# -- after the proxy stopped: what was flushed -----------------------------------------------------


def test_zz_spans(tel: Telemetered) -> None:
    tel.stop()
    spans = tel.spans.get_finished_spans()
    servers = {s.context.span_id: s for s in spans if s.kind is SpanKind.SERVER}
    clients = [s for s in spans if s.kind is SpanKind.CLIENT]
    names = {s.name for s in servers.values()}
    for expected in ("metadata", "api_versions", "join_group", "sync_group", "create_topics", "delete_topics",
                     "find_coordinator"):
        assert expected in names, (expected, sorted(names))
    assert any(n.startswith("produce ") for n in names) and any(n.startswith("fetch ") for n in names)
    # Every CLIENT span is the broker round trip of one SERVER span, inside it.
    for c in clients:
        parent = servers[c.parent.span_id]
        assert c.name == parent.name and parent.start_time <= c.start_time <= c.end_time <= parent.end_time
    forwarded = [s for s in servers.values() if s.attributes["kproxy.outcome"] == "forwarded"]
    assert len(clients) >= len(forwarded) > 50
    for s in forwarded:
        a = s.attributes
        total_ms = (s.end_time - s.start_time) / 1e6
        split = a["kproxy.queued"] + a["kproxy.broker"] + a["kproxy.return"]
        assert abs(split - total_ms) < 0.01, (s.name, split, total_ms)
        assert a["messaging.system"] == "kafka" and a["server.port"] > 0 and a["client.address"] == "127.0.0.1"
    produce = [s for s in servers.values() if s.name.startswith("produce ")]
    assert {s.attributes["messaging.operation.type"] for s in produce} == {"send"}
    fetch = [s for s in servers.values() if s.name.startswith("fetch ")]
    assert all("kproxy.max_wait_ms" in s.attributes for s in fetch)
    assert any(s.attributes.get("messaging.consumer.group.name", "").startswith("tgroup") for s in fetch)
    # The traceparent in the records links the produce span and the fetch span that delivered them.
    topic = tel.traced_topic  # type: ignore[attr-defined]
    for kind in ("produce", "fetch"):
        linked = [s for s in servers.values() if s.name == f"{kind} {topic}"
                  and any(f"{link.context.trace_id:032x}" == TRACE_ID for link in s.links)]
        assert linked, f"no {kind} span linked to the producer's trace"
        assert f"{linked[0].links[0].context.span_id:016x}" == PARENT_ID
    # Nothing secret or private: no record key or value in any attribute.
    text = repr([(s.name, dict(s.attributes)) for s in spans])
    assert "secret-value" not in text and "value-0" not in text


def test_zz_traffic_log(tel: Telemetered) -> None:
    tel.stop()
    files = [p for p in tel.log_dir.rglob("*") if p.is_file()]
    assert files and all(p.name.endswith(".jsonl.gz") for p in files), files
    for p in files:
        assert p.parent.name.startswith("hour=") and p.parent.parent.name.startswith("dt=")
    lines = tel.lines()
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA_PATH.read_text()))
    for line in lines:
        validator.validate(line)
        datetime.fromisoformat(line["ts"].replace("Z", "+00:00"))
    assert "secret-value" not in json.dumps(lines)
    # The confluent produce_consume topic: offsets and counts equal what was produced and consumed.
    per_partition = collections.Counter(partition_for(k) for k, _, _ in sent_records())
    topics = {t for line in lines if line["api"] == "produce" for p in line["partitions"] for t in [p["topic"]]}
    counted = []
    for topic in topics:
        produced = [p for line in lines if line["api"] == "produce" for p in line["partitions"]
                    if p["topic"] == topic]
        if sum(p["records"] for p in produced) != N_RECORDS or len({p["partition"] for p in produced}) != 3:
            continue
        counted.append(topic)
        for part, n in per_partition.items():
            mine = sorted((p["first_offset"], p["last_offset"], p["records"]) for p in produced
                          if p["partition"] == part)
            offsets = [o for first, last, _ in mine for o in range(first, last + 1)]
            assert offsets == list(range(n)), (topic, part, mine)
            fetched = [p for line in lines if line["api"] == "fetch" for p in line["partitions"]
                       if p["topic"] == topic and p["partition"] == part and p["records"]]
            assert min(p["first_offset"] for p in fetched) == 0
            assert max(p["last_offset"] for p in fetched) == n - 1
    assert counted, "no topic whose produce lines add up to the records sent"
    apis = {line["api"] for line in lines}
    assert {"produce", "fetch", "metadata", "join_group", "create_topics"} <= apis
    groups = {line["group"] for line in lines if line["api"] == "fetch" and line["group"]}
    assert any(g.startswith("tgroup") for g in groups)


# -- separate proxies --------------------------------------------------------------------------------


def test_readyz_before_discovery_and_while_draining(broker: TansuBroker) -> None:
    relay = Relay((broker.host, broker.port), free_port())
    admin = f"127.0.0.1:{free_port()}"
    proxy = start_proxy(relay.bootstrap, admin={"listen": admin},
                        upstream_settings={"connect_timeout_s": 1.0, "request_timeout_s": 2.0})
    try:
        def readyz() -> int:
            try:
                with urllib.request.urlopen(f"http://{admin}/readyz", timeout=5) as r:
                    return r.status
            except urllib.error.HTTPError as e:
                return e.code

        assert readyz() == 503   # nothing answers discovery yet
        relay.start()
        deadline = time.monotonic() + 15
        while readyz() != 200:
            assert time.monotonic() < deadline, "never ready after the broker came up"
            time.sleep(0.2)
        # A request the broker never answers keeps the drain going while /readyz is asked.
        relay.hung.set()
        conn = socket.create_connection(("127.0.0.1", int(proxy.bootstrap.rsplit(":", 1)[1])), timeout=5)
        req = Request.build(3, 12, 1, "drain-test", body_class(3, "request")(topics=[]))
        conn.sendall(b"".join(bytes(b) for b in encode_request_frame(req)))
        time.sleep(0.3)
        drainer = threading.Thread(target=proxy.drain, args=(3.0,), daemon=True)
        drainer.start()
        time.sleep(0.3)
        assert drainer.is_alive() and readyz() == 503
        drainer.join(10)
        conn.close()
    finally:
        relay.hung.clear()
        proxy.stop()
        relay.stop()


class _OtlpReceiver(http.server.BaseHTTPRequestHandler):
    received: list[ExportTraceServiceRequest] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        assert self.headers["Content-Type"] == "application/x-protobuf"
        msg = ExportTraceServiceRequest()
        msg.ParseFromString(gzip.decompress(body) if self.headers.get("Content-Encoding") == "gzip" else body)
        type(self).received.append(msg)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_otlp_http_export_reaches_a_receiver(broker: TansuBroker, monkeypatch: pytest.MonkeyPatch) -> None:
    server = http.server.HTTPServer(("127.0.0.1", 0), _OtlpReceiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _OtlpReceiver.received = []
    try:
        # Only this proxy sees the variables: the session's broker was started before them.
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        monkeypatch.setenv("OTEL_SERVICE_NAME", "kproxy-e2e")
        proxy = start_proxy(broker.bootstrap, tracing={"enabled": True})
        try:
            raw_metadata_requests(proxy.bootstrap, 2)
        finally:
            proxy.stop()
    finally:
        server.shutdown()
        server.server_close()
    spans = [(rs, s) for msg in _OtlpReceiver.received for rs in msg.resource_spans
             for ss in rs.scope_spans for s in ss.spans]
    kinds = collections.Counter((s.name, Span.SpanKind.Name(s.kind)) for _, s in spans)
    assert kinds == {("metadata", "SPAN_KIND_SERVER"): 2, ("metadata", "SPAN_KIND_CLIENT"): 2}, kinds
    service = {a.value.string_value for rs, _ in spans for a in rs.resource.attributes if a.key == "service.name"}
    assert service == {"kproxy-e2e"}
    assert os.environ["OTEL_EXPORTER_OTLP_PROTOCOL"] == "http/protobuf"


def test_a_failing_admin_answer_is_a_500_and_kafka_traffic_goes_on(broker: TansuBroker, topic: str) -> None:
    admin = f"127.0.0.1:{free_port()}"
    proxy = start_proxy(broker.bootstrap, admin={"listen": admin})
    host, port = proxy.bootstrap.rsplit(":", 1)

    def get(path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(f"http://{admin}{path}", timeout=10) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def broken_reader() -> list:
        raise RuntimeError("a metric reader with a bug")

    try:
        # A client connected before the failure keeps its connection and its answers.
        with socket.create_connection((host, int(port)), timeout=10) as before:
            req = Request.build(3, 12, 7, "admin-500", body_class(3, "request")(topics=[]))
            assert get("/metrics")[0] == 200
            metrics = proxy.server.metrics
            assert metrics is not None
            proxy.call(lambda: metrics.add_reader(broken_reader))
            status, body = get("/metrics")
            assert status == 500 and b"internal error" in body
            assert get("/metrics")[0] == 500    # the listener still answers, again
            assert get("/livez") == (200, b"ok\n")
            assert proxy.server.admin is not None and proxy.server.admin.failures == 2
            before.sendall(b"".join(bytes(b) for b in encode_request_frame(req)))
            size = int.from_bytes(_recv_exactly(before, 4), "big")
            assert decode_response(_recv_exactly(before, size), 3, 12).correlation_id == 7
        # New connections, and a real client's produce and consume, go through the same process.
        raw_metadata_requests(proxy.bootstrap, 3)
        traced_produce_consume(proxy.bootstrap, topic)
    finally:
        proxy.stop()


@pytest.mark.parametrize("client", [KAFKA_PYTHON, CONFLUENT], ids=lambda c: c.name)
def test_metrics_alone_count_a_real_clients_produce_from_the_relayed_bytes(
        broker: TansuBroker, topic: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, client: Any) -> None:
    # Metrics alone (no per-topic labels, no rules): Produce goes both ways undecoded and its records
    # are read from the batch headers (kproxy.proxy.produce_bytes); the count is what was acknowledged.
    from kproxy.protocol.compiler import native_skip
    from kproxy.proxy import session as session_module

    read_from_bytes: list[int] = []
    counts = session_module.request_counts

    def counting(frame: Any, pos: int, version: int) -> Any:
        out = counts(frame, pos, version)
        if out is not None:
            read_from_bytes.append(out[1])
        return out

    monkeypatch.setattr(session_module, "request_counts", counting)
    relay = session_module._RELAY_REQUEST
    if relay is not None:
        # The accelerator's relay step reads the counts in C (the same walk): what it read is the entry's.
        def relaying(s: Any, frame: Any) -> Any:
            out = relay(s, frame)
            if out is not None and out[0].entry.produced is not None:
                read_from_bytes.append(out[0].entry.produced)
            return out

        monkeypatch.setattr(session_module, "_RELAY_REQUEST", relaying)
    admin = f"127.0.0.1:{free_port()}"
    proxy = start_proxy(broker.bootstrap, admin={"listen": admin})
    tel = Telemetered(proxy, InMemorySpanExporter(), tmp_path, admin)
    try:
        assert client.produce_consume(proxy.bootstrap, topic) == expected_records()
        values = tel.metrics()
        assert metric(values, "kproxy_records_total", direction="produced") == N_RECORDS
        # The path counter: the client's Produce requests were relayed, their records read from bytes.
        # Without the accelerator nothing is relayed, and the decoded path counts the same.
        if native_skip() is not None:
            assert sum(read_from_bytes) == N_RECORDS
        else:
            assert read_from_bytes == []
    finally:
        tel.stop()


@pytest.mark.parametrize("client", [KAFKA_PYTHON, CONFLUENT], ids=lambda c: c.name)
def test_metrics_alone_count_a_real_consumers_fetches_from_the_relayed_bytes(
        broker: TansuBroker, topic: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, client: Any) -> None:
    # Metrics alone: Fetch goes both ways undecoded (small answers) and the records fetched are read
    # from the answers' batch headers (kproxy.proxy.fetch_bytes); the count is what the consumer got.
    from kproxy.protocol.compiler import native_skip
    from kproxy.proxy import session as session_module

    read_from_bytes: list[tuple[int, int]] = []
    counts = session_module.fetch_counts

    def counting(request: Any, answer: Any, version: int) -> Any:
        out = counts(request, answer, version)
        if out is not None and not out[2]:
            read_from_bytes.append((version, out[0]))
        return out

    monkeypatch.setattr(session_module, "fetch_counts", counting)
    admin = f"127.0.0.1:{free_port()}"
    proxy = start_proxy(broker.bootstrap, admin={"listen": admin})
    tel = Telemetered(proxy, InMemorySpanExporter(), tmp_path, admin)
    try:
        assert client.produce_consume(proxy.bootstrap, topic) == expected_records()
        values = tel.metrics()
        assert metric(values, "kproxy_records_total", direction="fetched") == N_RECORDS
        # The path counter: the consumer's Fetch answers were relayed, their records read from bytes
        # (by whichever version the client and tansu agreed on: v16+ passes the address rewriter too).
        # Without the accelerator nothing is relayed, and the decoded path counts the same.
        if native_skip() is not None:
            assert sum(n for _, n in read_from_bytes) == N_RECORDS
    finally:
        tel.stop()


def test_metrics_alone_and_rules_for_produce_and_fetch_count_what_goes_by_undecoded(
        broker: TansuBroker, topic: str, tmp_path: Path) -> None:
    # Production's shape: metrics on, rules that address only Produce and Fetch. The other apis go
    # by undecoded (tests/unit/test_relay.py holds the figures equal to a decoded path's); here, a
    # real client's traffic is counted, and a rule added on reload reaches an open connection.
    admin = f"127.0.0.1:{free_port()}"
    rules = tmp_path / "rules.yaml"
    only = ("rules:\n  - {name: audited, match: {api: produce, topic: 'audited-*'}, action: log}\n"
            "  - {name: secrets, match: {api: fetch, topic: 'secret-*'}, action: deny}\n")
    rules.write_text(only)
    proxy = start_proxy(broker.bootstrap, admin={"listen": admin}, rules=[str(rules)])
    tel = Telemetered(proxy, InMemorySpanExporter(), tmp_path, admin)
    try:
        assert CONFLUENT.produce_consume(proxy.bootstrap, topic) == expected_records()
        values = tel.metrics()
        assert metric(values, "kproxy_records_total", direction="produced") == N_RECORDS
        assert metric(values, "kproxy_records_total", direction="fetched") >= N_RECORDS
        for api in ("api_versions", "metadata", "produce", "fetch"):
            assert metric(values, "kproxy_requests_total", api=api) >= 1, api
            assert metric(values, "kproxy_client_bytes_total", api=api, direction="request") > 0, api
            assert metric(values, "kproxy_client_bytes_total", api=api, direction="response") > 0, api
        host, port = proxy.bootstrap.rsplit(":", 1)
        store = proxy.server.rule_store
        assert store is not None
        with socket.create_connection((host, int(port)), timeout=10) as s:
            def metadata(cid: int) -> Any:
                mt: Any = body_class(3, "request")
                req = Request.build(3, 12, cid, "relay-e2e", mt(topics=[mt.MetadataRequestTopic(name=topic)]))
                s.sendall(b"".join(bytes(b) for b in encode_request_frame(req)))
                return decode_response(_recv_exactly(s, int.from_bytes(_recv_exactly(s, 4), "big")), 3, 12)

            assert [t.error_code for t in metadata(1).body.topics] == [0]
            rules.write_text(only + "  - {name: no-metadata, match: {api: metadata}, action: deny}\n")
            wait_until(lambda: store.generation >= 2, "the rules were not reloaded", timeout=30)
            assert store.generation == 2
            # The same connection's next Metadata meets the new rule.
            assert [t.error_code for t in metadata(2).body.topics] == [29]     # TOPIC_AUTHORIZATION_FAILED
        # Both of this connection's Metadata requests were counted: exactly, on its own row of
        # /clients, and in the metric, which the produce_consume clients (their librdkafka handles
        # not yet destroyed) may still add a Metadata refresh of their own to.
        def own_requests() -> int:
            with urllib.request.urlopen(f"http://{admin}/clients", timeout=10) as r:
                table = json.loads(r.read())
            return sum(row["requests"] for row in table["connections"] + table["recent"]
                       if row["client_id"] == "relay-e2e")

        wait_until(lambda: own_requests() == 2, lambda: f"relay-e2e's requests: {own_requests()}", timeout=10)
        after = tel.metrics()
        assert metric(after, "kproxy_requests_total", api="metadata") >= \
            metric(values, "kproxy_requests_total", api="metadata") + 2
        assert metric(after, "kproxy_denied_requests_total", rule="no-metadata") == 1
    finally:
        tel.stop()


def test_a_sampled_traffic_log_logs_only_the_apis_it_samples_and_names_their_topics(
        broker: TansuBroker, topic: str, tmp_path: Path) -> None:
    # Metadata (and every other api) at 0: relayed undecoded, unlogged, but still counted, and its
    # answers still teach topic names. Produce and Fetch at 1: every one logged, naming the topic
    # (Fetch from v13 names it by id only, learned from a Metadata answer nobody logged).
    admin = f"127.0.0.1:{free_port()}"
    log_dir = tmp_path / "traffic"
    log_dir.mkdir()
    proxy = start_proxy(broker.bootstrap, admin={"listen": admin},
                        traffic_log={"dir": str(log_dir), "sample": {"default": 0.0, "metadata": 0.0,
                                                                     "produce": 1.0, "fetch": 1.0}})
    tel = Telemetered(proxy, InMemorySpanExporter(), log_dir, admin)
    try:
        assert CONFLUENT.produce_consume(proxy.bootstrap, topic) == expected_records()
        values = tel.metrics()
        assert metric(values, "kproxy_requests_total", api="metadata") >= 1
        assert metric(values, "kproxy_records_total", direction="produced") == N_RECORDS
    finally:
        tel.stop()
    lines = tel.lines()
    assert {line["api"] for line in lines} == {"produce", "fetch"}
    produced = [p for line in lines if line["api"] == "produce" for p in line["partitions"]]
    assert {p["topic"] for p in produced} == {topic}
    assert sum(p["records"] for p in produced) == N_RECORDS
    fetched = [(line["api_version"], p) for line in lines if line["api"] == "fetch" for p in line["partitions"]]
    assert fetched and {p["topic"] for _, p in fetched} == {topic}
    assert sum(p["records"] for _, p in fetched) >= N_RECORDS
    print("fetch versions logged:", sorted({v for v, _ in fetched}))

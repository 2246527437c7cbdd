"""Several virtual clusters in one kproxy process, in front of two tansu brokers (each with its own
cluster id and its own topics) and a fake cluster with other node ids, with real clients.

Each virtual cluster reaches its own cluster only, by its port range or by its SNI names on a port it
shares with others. A client of one that reaches for another's broker ports is served as the virtual
cluster whose port it reached (that one's cluster, rules and metrics), never as its own; node ids of
another cluster lead to the bootstrap of the virtual cluster asked; an SNI name nobody serves on a
shared port is closed with one log line naming the host, the listener and the names tried. Metrics,
spans, the traffic log, /readyz, /clients and /config name the virtual cluster. tansu gives every
broker node id 111, so the fake cluster (kproxy's own codec, nodes 1, 2 and 3) stands in for a cluster
whose node ids differ.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import confluent_kafka.admin
import jsonschema
import pytest
import trustme
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from kproxy.config import ProxyConfig, derived_cluster_id, parse_config
from kproxy.protocol.messages import Request, body_class, decode_response, encode_request_frame
from kproxy.server.embedded import ProxyThread
from kproxy.telemetry.traffic_log import SCHEMA_PATH
from tests.e2e.fake_cluster import FakeCluster
from tests.e2e.proxied import free_port_block
from tests.e2e.sasl_gate import expected_pairs, kafka_python_roundtrip
from tests.e2e.scenarios import (
    TIMEOUT,
    confluent_describe_cluster,
    confluent_produce_consume,
    expected_records,
    kafka_python_produce_consume,
)
from tests.e2e.tansu import TansuBroker, free_port, unique_name
from tests.e2e.wire import Wire
from tests.polling import wait_until

pytestmark = pytest.mark.e2e

METADATA, PRODUCE, FIND_COORDINATOR, API_VERSIONS = 3, 0, 10, 18
TOPIC_AUTHORIZATION_FAILED = 29
TANSU_NODE = 111
# The cluster id each virtual cluster presents (its own, derived from its name: never its broker's,
# so the id in an answer says which virtual cluster answered).
ID = {name: derived_cluster_id(name) for name in ("team-a", "team-b", "team-c", "team-d")}
# Broker ports by node id from the first one (node_id_base 0), so node 111 and the fake cluster's
# nodes 1..3 each have a port in every virtual cluster's range.
PORTS = 112


class ClusterTansu(TansuBroker):
    """A tansu broker with a cluster id of its own (tansu gives every broker the same default)."""

    def __init__(self, binary: str, kafka_cluster_id: str, log_path: Path) -> None:
        super().__init__(binary)
        self.kafka_cluster_id = kafka_cluster_id
        self.log_path = log_path

    def argv(self) -> list[str]:
        return [*super().argv(), "--cluster-id", self.kafka_cluster_id]


@pytest.fixture(scope="module")
def tansus(tansu_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ClusterTansu, ClusterTansu]]:
    logs = tmp_path_factory.mktemp("tansus")
    a = ClusterTansu(tansu_binary, "cluster-a", logs / "a.log")
    b = ClusterTansu(tansu_binary, "cluster-b", logs / "b.log")
    try:
        a.start()
        b.start()
        assert (a.cluster_id, b.cluster_id, a.node_id, b.node_id) == ("cluster-a", "cluster-b", TANSU_NODE, TANSU_NODE)
        yield a, b
    finally:
        a.stop()
        b.stop()


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeCluster]:
    with FakeCluster((1, 2, 3), coordinator_id=2) as cluster:
        yield cluster
        assert cluster.errors == []


def port_cluster(name: str, upstream: str, port: int, extra: str = "") -> str:
    """One virtual cluster with a port per broker: bootstrap ``port``, node N on ``port + 1 + N``."""
    return (f"  - name: {name}\n    listen: \"127.0.0.1:{port}\"\n"
            f"    upstream: {{bootstrap_servers: [\"{upstream}\"], connect_timeout_s: 5, request_timeout_s: 10}}\n"
            f"    exposure: {{advertised_host: 127.0.0.1, broker_port_start: {port + 1}, "
            f"broker_port_count: {PORTS}, node_id_base: 0}}\n{extra}")


def broker_port(cfg: ProxyConfig, name: str, node_id: int) -> int:
    vc = next(vc for vc in cfg.clusters if vc.name == name)
    return vc.broker_port_start + node_id


def http(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, ConnectionError) as e:     # not listening yet
        return 0, str(e)


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def value(text: str, name: str, **labels: str) -> float:
    return sum(v for n, have, v in samples(text) if n == name and all(have.get(k) == w for k, w in labels.items()))


def metadata_all(wire: Wire, correlation_id: int = 1) -> Any:
    """Metadata v12 for every topic."""
    wire.send(METADATA, 12, correlation_id, body_class(METADATA, "request")(topics=None))
    return wire.receive(METADATA, 12).body


def metadata_topic(wire: Wire, topic: str, correlation_id: int = 1) -> Any:
    cls: Any = body_class(METADATA, "request")
    wire.send(METADATA, 12, correlation_id, cls(topics=[cls.MetadataRequestTopic(name=topic)],
                                                allow_auto_topic_creation=True))
    return wire.receive(METADATA, 12).body


def topic_names(bootstrap: str) -> set[str]:
    admin = confluent_kafka.admin.AdminClient({"bootstrap.servers": bootstrap})
    return set(admin.list_topics(timeout=TIMEOUT).topics)


# -- port ranges: three virtual clusters in one process ----------------------------------------------------


@attrs.frozen
class Three:
    proxy: ProxyThread
    cfg: ProxyConfig
    admin: str
    a: ClusterTansu
    b: ClusterTansu
    fake: FakeCluster
    bootstrap: dict[str, str]

    def metrics(self) -> str:
        status, text = http(f"http://{self.admin}/metrics")
        assert status == 200
        return text


@pytest.fixture(scope="module")
def three(tansus: tuple[ClusterTansu, ClusterTansu], fake: FakeCluster,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Three]:
    """team-a in front of tansu A, team-b of tansu B (whose rules refuse topics secret-*), team-c of
    the fake cluster; one admin listener."""
    a, b = tansus
    rules = tmp_path_factory.mktemp("rules") / "no-secrets.yaml"
    rules.write_text("rules:\n  - name: no-secrets\n    match: {topic: \"secret-*\"}\n    action: deny\n")
    pa, pb, pc = (free_port_block(PORTS + 1) for _ in range(3))
    admin = f"127.0.0.1:{free_port()}"
    cfg = parse_config("virtual_clusters:\n" + port_cluster("team-a", a.bootstrap, pa)
                       + port_cluster("team-b", b.bootstrap, pb, f"    rules: [{rules}]\n")
                       + port_cluster("team-c", fake.bootstrap.split(",")[0], pc)
                       + f"admin: {{listen: \"{admin}\"}}\n")
    with ProxyThread(cfg) as proxy:
        yield Three(proxy, cfg, admin, a, b, fake, {vc.name: f"127.0.0.1:{vc.listen.port}" for vc in cfg.clusters})


def test_each_virtual_cluster_serves_its_own_cluster_to_real_clients(three: Three) -> None:
    topic_a, topic_b = unique_name("only-a"), unique_name("only-b")
    assert confluent_produce_consume(three.bootstrap["team-a"], topic_a) == expected_records()
    assert kafka_python_produce_consume(three.bootstrap["team-b"], topic_b) == expected_records()
    # Each virtual cluster shows its own cluster: its id, its topics, never the other's.
    assert confluent_describe_cluster(three.bootstrap["team-a"]).cluster_id == ID["team-a"]
    assert confluent_describe_cluster(three.bootstrap["team-b"]).cluster_id == ID["team-b"]
    seen_a, seen_b = topic_names(three.bootstrap["team-a"]), topic_names(three.bootstrap["team-b"])
    assert topic_a in seen_a and topic_b not in seen_a
    assert topic_b in seen_b and topic_a not in seen_b
    # And the records are where they belong, as the brokers themselves say.
    assert topic_a in topic_names(three.a.bootstrap) and topic_a not in topic_names(three.b.bootstrap)
    assert topic_b in topic_names(three.b.bootstrap) and topic_b not in topic_names(three.a.bootstrap)
    text = three.metrics()
    assert value(text, "kproxy_requests_total", api="produce", virtual_cluster="team-a") >= 1
    assert value(text, "kproxy_requests_total", api="produce", virtual_cluster="team-b") >= 1
    assert value(text, "kproxy_requests_total", api="produce", virtual_cluster="team-c") == 0


def test_a_client_of_one_on_anothers_broker_port_is_served_as_that_one(three: Three) -> None:
    """A client of team-a that guesses team-b's broker port gets team-b: its cluster, its ports, its
    rules, and it counts in team-b's metrics, never in team-a's."""
    before = three.metrics()
    b_port = broker_port(three.cfg, "team-b", TANSU_NODE)
    a_range = range(broker_port(three.cfg, "team-a", 0), broker_port(three.cfg, "team-a", PORTS))
    wire = Wire(f"127.0.0.1:{b_port}")
    try:
        meta = metadata_all(wire)
        assert meta.cluster_id == ID["team-b"]
        assert [(br.node_id, br.port) for br in meta.brokers] == [(TANSU_NODE, b_port)]
        assert not any(br.port in a_range for br in meta.brokers)
        # team-b's rules: a topic team-b refuses is refused here.
        refused = metadata_topic(wire, "secret-plans", 2)
        assert [t.error_code for t in refused.topics] == [TOPIC_AUTHORIZATION_FAILED]
    finally:
        wire.close()
    # The same question on team-a's own broker port: team-a has no such rule, and its own cluster answers.
    wire = Wire(f"127.0.0.1:{broker_port(three.cfg, 'team-a', TANSU_NODE)}")
    try:
        allowed = metadata_topic(wire, "secret-plans", 1)
        assert allowed.cluster_id == ID["team-a"] and allowed.topics[0].error_code != TOPIC_AUTHORIZATION_FAILED
    finally:
        wire.close()
    after = three.metrics()
    listener = f"broker-{TANSU_NODE}"
    opened = "kproxy_connections_opened_total"
    assert value(after, opened, listener=listener, virtual_cluster="team-b") == \
        value(before, opened, listener=listener, virtual_cluster="team-b") + 1
    assert value(after, "kproxy_denied_requests_total", rule="no-secrets", virtual_cluster="team-b") >= 1
    assert value(after, "kproxy_denied_requests_total", virtual_cluster="team-a") == 0


def test_node_ids_of_another_cluster_lead_to_the_bootstrap_of_the_one_asked(three: Three) -> None:
    """Node 2 is the fake cluster's (team-c's), not tansu A's: team-a's port for node 2 is served by
    team-a's bootstrap (its own cluster), and the fake cluster hears nothing of it. The other way,
    team-c's port for tansu's node 111 is served by the fake cluster."""
    three.fake.clear()
    wire = Wire(f"127.0.0.1:{broker_port(three.cfg, 'team-a', 2)}")
    try:
        meta = metadata_all(wire)
        assert meta.cluster_id == ID["team-a"]
        assert [br.node_id for br in meta.brokers] == [TANSU_NODE]
        cls: Any = body_class(FIND_COORDINATOR, "request")
        wire.send(FIND_COORDINATOR, 2, 2, cls(key="group-of-c", key_type=0))
        coordinator = wire.receive(FIND_COORDINATOR, 2).body
        assert coordinator.node_id == TANSU_NODE
        assert coordinator.port == broker_port(three.cfg, "team-a", TANSU_NODE)
    finally:
        wire.close()
    assert all(not broker.received() for broker in three.fake.brokers.values())

    wire = Wire(f"127.0.0.1:{broker_port(three.cfg, 'team-c', TANSU_NODE)}")
    try:
        meta = metadata_all(wire)
        assert meta.cluster_id == ID["team-c"]
        assert sorted((br.node_id, br.port) for br in meta.brokers) == \
            [(n, broker_port(three.cfg, "team-c", n)) for n in (1, 2, 3)]
    finally:
        wire.close()


def test_readyz_and_the_admin_pages_cover_every_virtual_cluster(three: Three) -> None:
    assert http(f"http://{three.admin}/readyz") == (200, "ready: team-a, team-b, team-c\n")
    text = three.metrics()
    for name in ("team-a", "team-b", "team-c"):
        assert value(text, "kproxy_ready", virtual_cluster=name) == 1
    config = json.loads(http(f"http://{three.admin}/config")[1])
    assert [vc["name"] for vc in config["virtual_clusters"]] == ["team-a", "team-b", "team-c"]
    rules = json.loads(http(f"http://{three.admin}/rules")[1])["virtual_clusters"]
    assert rules["team-a"]["configured"] is False and rules["team-b"]["rule_count"] == 1
    with contextlib.closing(Wire(three.bootstrap["team-c"])) as wire:
        wire.metadata()
        clients = json.loads(http(f"http://{three.admin}/clients")[1])
        assert "team-c" in {row["virtual_cluster"] for row in clients["connections"]}


# -- telemetry: every series, span and traffic log line names its virtual cluster ---------------------------


def test_metrics_spans_and_traffic_log_name_the_virtual_cluster(tansus: tuple[ClusterTansu, ClusterTansu],
                                                                 tmp_path: Path) -> None:
    a, b = tansus
    pa, pb = free_port_block(PORTS + 1), free_port_block(PORTS + 1)
    admin = f"127.0.0.1:{free_port()}"
    cfg = parse_config("virtual_clusters:\n" + port_cluster("team-a", a.bootstrap, pa)
                       + port_cluster("team-b", b.bootstrap, pb)
                       + f"admin: {{listen: \"{admin}\"}}\ntraffic_log: {{dir: \"{tmp_path / 'log'}\"}}\n"
                       + "tracing: {enabled: true}\nmetrics: {client_labels: true, topic_labels: true}\n")
    spans = InMemorySpanExporter()
    with ProxyThread(cfg, span_exporter=spans) as proxy:
        for port, n in ((pa, 3), (pb, 5)):
            with contextlib.closing(Wire(f"127.0.0.1:{port}")) as wire:
                for cid in range(n):
                    wire.metadata(cid)
        status, text = http(f"http://{admin}/metrics")
        assert status == 200
        promtool = shutil.which("promtool")
        assert promtool, "promtool is not installed: `make test` installs it (Debian package prometheus)"
        done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True,
                              timeout=30)
        assert done.returncode == 0, done.stdout + done.stderr
        proxy.stop()    # writes out the traffic log and the spans
    kproxy_samples = [(n, labels) for n, labels, _ in samples(text) if n.startswith("kproxy_")]
    assert kproxy_samples and all("virtual_cluster" in labels for _, labels in kproxy_samples)
    assert value(text, "kproxy_requests_total", api="metadata", virtual_cluster="team-a") == 3
    assert value(text, "kproxy_requests_total", api="metadata", virtual_cluster="team-b") == 5
    # The process's own families (the buffer budget, the event loop, the traffic log) belong to none.
    assert {labels["virtual_cluster"] for n, labels in kproxy_samples if n.startswith("kproxy_buffered")} == {""}

    lines = []
    for path in sorted((tmp_path / "log").rglob("*.jsonl*")):
        data = gzip.decompress(path.read_bytes()) if path.name.endswith(".gz") else path.read_bytes()
        lines += [json.loads(line) for line in data.decode().splitlines()]
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA_PATH.read_text()))
    for line in lines:
        validator.validate(line)
    by_cluster = {name: sum(1 for line in lines if line["virtual_cluster"] == name and line["api"] == "metadata")
                  for name in ("team-a", "team-b")}
    assert by_cluster == {"team-a": 3, "team-b": 5}
    # Every span names its virtual cluster: the request's (SERVER) and its broker round trip's (CLIENT).
    named = [(s.kind.name, s.attributes.get("kproxy.virtual_cluster")) for s in spans.get_finished_spans()
             if s.attributes and s.attributes.get("messaging.operation.name") == "metadata"]
    assert sorted(named) == sorted([("CLIENT", "team-a"), ("SERVER", "team-a")] * 3
                                   + [("CLIENT", "team-b"), ("SERVER", "team-b")] * 5)


def test_readyz_names_the_virtual_cluster_that_is_not_ready(tansus: tuple[ClusterTansu, ClusterTansu]) -> None:
    a, _ = tansus
    admin = f"127.0.0.1:{free_port()}"
    nobody = f"127.0.0.1:{free_port()}"     # nothing listens there
    cfg = parse_config("virtual_clusters:\n" + port_cluster("good", a.bootstrap, free_port_block(PORTS + 1))
                       + port_cluster("orphan", nobody, free_port_block(PORTS + 1))
                       + f"admin: {{listen: \"{admin}\"}}\n")
    with ProxyThread(cfg):
        status, body = http(f"http://{admin}/readyz")
        assert status == 503
        assert body.startswith("not ready: orphan (no bootstrap server has answered yet); ready: good"), body
        text = http(f"http://{admin}/metrics")[1]
        assert value(text, "kproxy_ready", virtual_cluster="good") == 1
        assert value(text, "kproxy_ready", virtual_cluster="orphan") == 0


# -- SNI: several virtual clusters on one port, each with its own certificate ---------------------------------

DOMAIN_A, DOMAIN_B, DOMAIN_D = "a.kproxy.test", "b.kproxy.test", "d.kproxy.test"


@attrs.frozen
class Sni:
    proxy: ProxyThread
    cfg: ProxyConfig
    ca: Path
    shared: int         # the port team-a and team-b share
    alone: int          # team-d's port of its own
    admin: str


@pytest.fixture(scope="module")
def sni(tansus: tuple[ClusterTansu, ClusterTansu], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sni]:
    a, b = tansus
    d = tmp_path_factory.mktemp("sni-pki")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    for name, domain in (("a", DOMAIN_A), ("b", DOMAIN_B), ("d", DOMAIN_D)):
        leaf = ca.issue_cert(f"*.{domain}")
        leaf.private_key_pem.write_to_path(str(d / f"{name}.key"))
        with open(d / f"{name}.pem", "wb") as f:
            for blob in leaf.cert_chain_pems:
                f.write(blob.bytes())
    shared, alone = free_port(), free_port()
    admin = f"127.0.0.1:{free_port()}"

    def cluster(name: str, upstream: str, port: int, domain: str) -> str:
        return (f"  - name: team-{name}\n    listen: \"127.0.0.1:{port}\"\n"
                f"    upstream: {{bootstrap_servers: [\"{upstream}\"], connect_timeout_s: 5}}\n"
                f"    tls: {{enabled: true, cert_file: \"{d / f'{name}.pem'}\", key_file: \"{d / f'{name}.key'}\"}}\n"
                f"    exposure: {{mode: sni, sni: {{domain: {domain}}}}}\n")

    cfg = parse_config("virtual_clusters:\n" + cluster("a", a.bootstrap, shared, DOMAIN_A)
                       + cluster("b", b.bootstrap, shared, DOMAIN_B) + cluster("d", a.bootstrap, alone, DOMAIN_D)
                       + f"admin: {{listen: \"{admin}\"}}\n")
    with ProxyThread(cfg) as proxy:
        yield Sni(proxy, cfg, d / "ca.pem", shared, alone, admin)


def tls_wire(port: int, name: str | None, ca: Path) -> ssl.SSLSocket:
    ctx = ssl.create_default_context(cafile=str(ca))
    if name is None:
        ctx.check_hostname = False
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    return ctx.wrap_socket(raw, server_hostname=name)


def tls_metadata(sock: ssl.SSLSocket, correlation_id: int = 1) -> Any:
    req = Request.build(METADATA, 12, correlation_id, "vc-test", body_class(METADATA, "request")(topics=None))
    sock.sendall(b"".join(bytes(x) for x in encode_request_frame(req)))
    buf = b""
    while len(buf) < 4 or len(buf) < 4 + int.from_bytes(buf[:4], "big"):
        chunk = sock.recv(65536)
        assert chunk, "closed instead of an answer"
        buf += chunk
    return decode_response(buf[4:], METADATA, 12).body


@pytest.fixture
def sni_names_resolve(monkeypatch: pytest.MonkeyPatch) -> None:
    """``*.kproxy.test`` resolves to loopback, for this process only (kafka-python resolves with it)."""
    real = socket.getaddrinfo

    def resolve(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(host, str) and host.endswith(".kproxy.test"):
            host = "127.0.0.1"
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)


@pytest.mark.usefixtures("sni_names_resolve")
def test_two_virtual_clusters_share_a_port_by_host_name_with_kafka_python(sni: Sni) -> None:
    for domain, cluster_id in ((DOMAIN_A, ID["team-a"]), (DOMAIN_B, ID["team-b"])):
        topic = unique_name(f"sni-{domain[0]}")
        settings = {"bootstrap_servers": f"bootstrap.{domain}:{sni.shared}", "security_protocol": "SSL",
                    "ssl_cafile": str(sni.ca), "request_timeout_ms": 30000}
        assert kafka_python_roundtrip(settings, topic) == expected_pairs()
        with contextlib.closing(tls_wire(sni.shared, f"bootstrap.{domain}", sni.ca)) as sock:
            meta = tls_metadata(sock)
        # Each virtual cluster presents its own certificate (verified against the name) and cluster.
        assert meta.cluster_id == cluster_id
        assert [(br.host, br.port) for br in meta.brokers] == [(f"broker-{TANSU_NODE}.{domain}", sni.shared)]
        assert topic in {t.name for t in meta.topics}
    text = http(f"http://{sni.admin}/metrics")[1]
    for vc in ("team-a", "team-b"):
        assert value(text, "kproxy_requests_total", api="produce", virtual_cluster=vc) >= 1


def test_a_host_name_nobody_serves_on_a_shared_port_is_closed_with_one_line(sni: Sni,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kproxy")
    for name in (f"broker-{TANSU_NODE}.{DOMAIN_D}", "kafka.elsewhere.test", f"x.broker-{TANSU_NODE}.{DOMAIN_A}"):
        caplog.clear()
        with pytest.raises((ssl.SSLError, ConnectionError)), \
                contextlib.closing(tls_wire(sni.shared, name, sni.ca)) as sock:
            tls_metadata(sock)
        wait_until(lambda name=name: any(name in r.getMessage() for r in caplog.records), "the log line")
        lines = [r.getMessage() for r in caplog.records if r.name.startswith("kproxy")]
        assert len(lines) == 1, lines
        assert lines[0].startswith("connection from 127.0.0.1:")
        assert f"on 127.0.0.1:{sni.shared}: no virtual cluster serves the TLS host name '{name}' (tried team-a: " \
               f"bootstrap.{DOMAIN_A}, broker-<id>.{DOMAIN_A}, controller-<id>.{DOMAIN_A}; team-b: " in lines[0]
    # No name at all (a client that connects by address), and bytes that are not TLS.
    caplog.clear()
    with pytest.raises((ssl.SSLError, ConnectionError)), contextlib.closing(tls_wire(sni.shared, None, sni.ca)) as sock:
        tls_metadata(sock)
    with contextlib.closing(Wire(f"127.0.0.1:{sni.shared}")) as wire:
        wire.send(API_VERSIONS, 0, 1, body_class(API_VERSIONS, "request")())
        assert wire.closed_by_peer()
    wait_until(lambda: len([r for r in caplog.records if r.name.startswith("kproxy")]) >= 2, "two lines")
    messages = " | ".join(r.getMessage() for r in caplog.records)
    assert "the ClientHello names no host (SNI)" in messages
    assert "not a TLS ClientHello (not a TLS handshake)" in messages
    text = http(f"http://{sni.admin}/metrics")[1]
    listener = f"127.0.0.1:{sni.shared}"
    assert value(text, "kproxy_shared_port_refused_total", listener=listener, reason="unknown_name") == 3
    assert value(text, "kproxy_shared_port_refused_total", listener=listener, reason="no_name") == 1
    assert value(text, "kproxy_shared_port_refused_total", listener=listener, reason="not_tls") == 1
    # The port still serves both after all that.
    for domain in (DOMAIN_A, DOMAIN_B):
        with contextlib.closing(tls_wire(sni.shared, f"bootstrap.{domain}", sni.ca)) as sock:
            assert tls_metadata(sock).brokers


def test_another_clusters_name_on_a_port_of_its_own_is_never_that_cluster(sni: Sni,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """team-d has its own port (tansu A behind it). team-b's name there is not team-b: a name outside
    team-d's domain is team-d's bootstrap, as before virtual clusters, and team-b's certificate is not
    the one presented (the client refuses team-d's for team-b's name). A name under team-d's domain that
    it does not serve is closed with one line naming the host, the listener and the names it serves."""
    b_name = f"broker-{TANSU_NODE}.{DOMAIN_B}"
    ctx = ssl.create_default_context(cafile=str(sni.ca))
    ctx.check_hostname = False      # see what is served, whatever the certificate
    with ctx.wrap_socket(socket.create_connection(("127.0.0.1", sni.alone), timeout=10),
                         server_hostname=b_name) as sock:
        meta = tls_metadata(sock)
        assert meta.cluster_id == ID["team-d"]
        assert [(br.host, br.port) for br in meta.brokers] == [(f"broker-{TANSU_NODE}.{DOMAIN_D}", sni.alone)]
    with pytest.raises(ssl.SSLCertVerificationError):
        tls_wire(sni.alone, b_name, sni.ca)
    caplog.set_level(logging.INFO, logger="kproxy")
    caplog.clear()
    with pytest.raises((ssl.SSLError, ConnectionError)), \
            contextlib.closing(tls_wire(sni.alone, f"junk.{DOMAIN_D}", sni.ca)) as sock:
        tls_metadata(sock)
    wait_until(lambda: any("junk" in r.getMessage() for r in caplog.records), "the log line")
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("kproxy") and "junk" in r.getMessage()]
    assert len(lines) == 1, lines
    assert f"on 127.0.0.1:{sni.alone}: no broker of this listener has the TLS host name 'junk.{DOMAIN_D}' (it " \
           f"serves bootstrap.{DOMAIN_D}, broker-<id>.{DOMAIN_D}, controller-<id>.{DOMAIN_D}); closed" in lines[0]


# -- workers: every worker process serves every virtual cluster ---------------------------------------------------


def test_two_workers_serve_two_virtual_clusters(tansus: tuple[ClusterTansu, ClusterTansu], tmp_path: Path) -> None:
    a, b = tansus
    pa, pb = free_port_block(PORTS + 1), free_port_block(PORTS + 1)
    admin = f"127.0.0.1:{free_port()}"
    config = tmp_path / "kproxy.yaml"
    config.write_text("virtual_clusters:\n" + port_cluster("team-a", a.bootstrap, pa)
                      + port_cluster("team-b", b.bootstrap, pb) + f"admin: {{listen: \"{admin}\"}}\nworkers: 2\n")
    log = tmp_path / "kproxy.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kproxy", "run", "--config", str(config)], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: http(f"http://{admin}/readyz")[0] == 200 or proc.poll() is not None, "both workers ready",
                 timeout=60)
        assert proc.poll() is None, log.read_text()
        assert http(f"http://{admin}/readyz")[1] == "ready (2 workers)\n"
        for port, cluster_id in ((pa, ID["team-a"]), (pb, ID["team-b"])):
            for cid in range(8):     # enough connections that both workers take some
                with contextlib.closing(Wire(f"127.0.0.1:{port}")) as wire:
                    assert wire.metadata(cid).body.cluster_id == cluster_id
        text = http(f"http://{admin}/metrics")[1]
        assert value(text, "kproxy_requests_total", api="metadata", virtual_cluster="team-a") >= 8
        assert value(text, "kproxy_requests_total", api="metadata", virtual_cluster="team-b") >= 8
        # Each worker took connections, and its log lines name the virtual cluster of each.
        wait_until(lambda: "[worker 0] [team-" in log.read_text()
                 and "[worker 1] [team-" in log.read_text(), "both workers' log lines", timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

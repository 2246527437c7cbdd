"""The PROXY protocol end to end: a real HAProxy in front of kproxy sends v1 or v2 headers, and the
client address they carry is what a ``source`` rule, the context and the logs see; headers from
peers outside ``trusted``, missing or malformed headers close the connection with a log line.

Addresses: the client connects from 127.0.0.1 to HAProxy on 127.0.0.2; HAProxy connects to kproxy
from 127.0.0.3 (``source``), the only trusted peer. kproxy advertises 127.0.0.2, so broker
connections go through HAProxy too, as behind a cloud load balancer.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import confluent_kafka
import pytest

from kproxy.config import parse_config
from kproxy.identity.proxy_header import V2_SIGNATURE, encode_v1, encode_v2
from kproxy.protocol.messages import Request, body_class, encode_request_frame
from kproxy.proxy.filters import ALL, ConnectionContext, Filter
from kproxy.server.embedded import ProxyThread
from tests.e2e.proxied import free_port_block
from tests.e2e.tansu import TansuBroker, unique_name

pytestmark = pytest.mark.e2e

CLIENT, BALANCER_FRONT, BALANCER_BACK = "127.0.0.1", "127.0.0.2", "127.0.0.3"
TIMEOUT = 20.0


class Sources(Filter):
    """The client address kproxy's filters saw, per request."""

    name = "sources"
    request_api_keys = ALL

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self._lock = threading.Lock()

    def on_request(self, ctx: ConnectionContext, exchange: object) -> None:
        with self._lock:
            self.seen.add(ctx.client_address[0] if ctx.client_address else "?")


def kproxy_config(upstream: str, port: int, rules: str, mode: str = "optional") -> object:
    return parse_config(f"""\
listen: "127.0.0.1:{port}"
upstream:
  bootstrap_servers: ["{upstream}"]
exposure:
  advertised_host: {BALANCER_FRONT}
  broker_port_start: {port + 1}
  broker_port_count: 1
rules: [{rules}]
proxy_protocol:
  mode: {mode}
  trusted: ["{BALANCER_BACK}/32"]
  timeout_s: 5
""")


@pytest.fixture(scope="session")
def haproxy_binary() -> str:
    found = shutil.which("haproxy") or "/usr/sbin/haproxy"
    assert Path(found).exists(), "haproxy is needed (Debian package haproxy; make system-deps installs it)"
    return found


@pytest.fixture
def balancer(haproxy_binary: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[int]:
    """HAProxy in TCP mode on 127.0.0.2:P and P+1 -> kproxy on 127.0.0.1, with send-proxy(-v2)."""
    port = free_port_block(2)
    option = "send-proxy-v2" if request.param == 2 else "send-proxy"
    sections = "".join(f"""
listen kafka{i}
  bind {BALANCER_FRONT}:{port + i}
  server kproxy 127.0.0.1:{port + i} {option} source {BALANCER_BACK}
""" for i in range(2))
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(f"""\
global
  maxconn 200
defaults
  mode tcp
  timeout connect 5s
  timeout client 60s
  timeout server 60s
{sections}""")
    log = tmp_path / "haproxy.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([haproxy_binary, "-f", str(cfg), "-db"], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + TIMEOUT
        while True:
            try:
                socket.create_connection((BALANCER_FRONT, port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, "haproxy did not listen in time"
                time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def _rules(tmp_path: Path) -> str:
    path = tmp_path / "rules.yaml"
    # Only the PROXY header says the client is 127.0.0.1: kproxy's peer is the balancer, 127.0.0.3.
    path.write_text(f"rules: [{{name: no-direct-clients, match: {{source: {CLIENT}/32, topic: 'guarded-*'}}, "
                    "action: deny}]\n")
    return str(path)


@pytest.mark.parametrize("balancer", [2, 1], indirect=True, ids=["v2", "v1"])
def test_source_rules_see_the_address_in_the_header(broker: TansuBroker, balancer: int, tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kproxy")
    sources = Sources()
    with ProxyThread(kproxy_config(broker.bootstrap, balancer, _rules(tmp_path)), [sources]):
        producer = confluent_kafka.Producer({
            "bootstrap.servers": f"{BALANCER_FRONT}:{balancer}", "acks": "all", "linger.ms": 5,
            "message.timeout.ms": int(TIMEOUT * 1000), "topic.metadata.refresh.interval.ms": 1000})
        errors: list[object] = []
        open_topic, guarded = unique_name("open"), unique_name("guarded-pp")
        producer.produce(open_topic, value=b"hello", on_delivery=lambda err, _m: errors.append(err))
        producer.produce(guarded, value=b"no", on_delivery=lambda err, _m: errors.append(err))
        assert producer.flush(TIMEOUT) == 0
        by_code = sorted(str(e.code()) if e is not None else "ok" for e in errors)    # type: ignore[attr-defined]
        assert by_code == sorted(["ok", str(confluent_kafka.KafkaError.TOPIC_AUTHORIZATION_FAILED)])
        del producer
    assert sources.seen == {CLIENT}
    assert f"via {BALANCER_BACK}:" in caplog.text


def _refused(proxy: ProxyThread, payload: bytes, source: str, caplog: pytest.LogCaptureFixture,
             reason: str) -> None:
    host, port = proxy.bootstrap.rsplit(":", 1)
    with socket.socket() as s:
        s.bind((source, 0))
        s.settimeout(TIMEOUT)
        s.connect((host, int(port)))
        s.sendall(payload)
        # kproxy closes without answering; a reset is also a close.
        with contextlib.suppress(ConnectionResetError):
            assert s.recv(4096) == b""
    deadline = time.monotonic() + TIMEOUT
    while reason not in caplog.text:
        assert time.monotonic() < deadline, f"no log line saying {reason!r}"
        time.sleep(0.02)


def _api_versions() -> bytes:
    req = Request.build(18, 0, 1, "probe", body_class(18, "request")())
    return b"".join(bytes(b) for b in encode_request_frame(req))


def test_untrusted_missing_and_malformed_headers_close_the_connection(
        broker: TansuBroker, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kproxy")
    port = free_port_block(2)
    spoof = encode_v2(("198.51.100.9", 1234), ("127.0.0.1", port))
    sources = Sources()
    with ProxyThread(kproxy_config(broker.bootstrap, port, _rules(tmp_path)), [sources]) as proxy:
        # A peer outside trusted may not claim another address, in either form.
        _refused(proxy, spoof + _api_versions(), CLIENT, caplog,
                 f"peer {CLIENT} sent a PROXY header but is not in proxy_protocol.trusted")
        _refused(proxy, encode_v1(("198.51.100.9", 1234), ("127.0.0.1", port)), CLIENT, caplog,
                 "sent a PROXY header")
        # From the trusted balancer: malformed and oversized headers are clean closes.
        _refused(proxy, b"PROXY TCP4 1.2.3.4 5.6.7.8 99999 1\r\n", BALANCER_BACK, caplog, "'99999' is not a port")
        _refused(proxy, V2_SIGNATURE + b"\x21\x11\xff\xff", BALANCER_BACK, caplog, "longer than the 4096")
        # optional: a client with no header is served under its own address.
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as s:
            s.sendall(_api_versions())
            assert len(s.recv(4096)) > 4
        assert proxy.call(lambda: proxy.server.proxy_protocol.refused) == {"untrusted": 2, "malformed": 2}
    assert sources.seen == {CLIENT}          # only the header-less client got a request through


def test_required_mode_closes_connections_without_a_header(broker: TansuBroker, tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kproxy")
    port = free_port_block(2)
    with ProxyThread(kproxy_config(broker.bootstrap, port, _rules(tmp_path), mode="required")) as proxy:
        _refused(proxy, _api_versions(), BALANCER_BACK, caplog, "no PROXY header (proxy_protocol.mode: required)")
        _refused(proxy, _api_versions(), CLIENT, caplog, f"peer {CLIENT} is not in proxy_protocol.trusted")
        # A LOCAL header (the balancer's own health check) keeps the balancer's address.
        with socket.socket() as s:
            s.bind((BALANCER_BACK, 0))
            s.settimeout(TIMEOUT)
            s.connect(("127.0.0.1", port))
            s.sendall(V2_SIGNATURE + b"\x20\x00\x00\x00" + _api_versions())
            assert len(s.recv(4096)) > 4

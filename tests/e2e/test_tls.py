"""TLS through kproxy with real clients: termination, mTLS principals, origination, SNI routing.

Certificates come from trustme. tansu 0.6 cannot serve TLS itself (its ``--cert``/``--key`` options
cannot be given together, and with either alone the listener still speaks plain TCP), so upstream
TLS is tested against ``TlsRelay``, a small TLS-terminating relay in front of a tansu that advertises
the relay's address. SNI names ``*.kproxy.test`` do not resolve here: the codec-level test drives
them over a raw ssl socket, and kafka-python gets them from a patched ``socket.getaddrinfo``.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trustme
from cryptography import x509

from kproxy.config import parse_config
from kproxy.protocol.messages import Request, body_class, decode_response, encode_request_frame
from kproxy.proxy.filters import ALL, ConnectionContext, Filter
from kproxy.server.embedded import ProxyThread
from tests.e2e.relay import pipe
from tests.e2e.sasl_gate import (
    confluent_roundtrip,
    expected_pairs,
    free_ports,
    kafka_python_roundtrip,
)
from tests.e2e.tansu import Tansu, TansuBroker, unique_name

pytestmark = pytest.mark.e2e

DOMAIN = "kproxy.test"
METADATA, API_VERSIONS = 3, 18


@attrs.frozen
class Pki:
    ca: Path
    server_cert: Path      # chain: leaf then CA
    server_key: Path
    client_cert: Path      # alice, issued by the same CA
    client_key: Path
    client_subject: str    # RFC 4514, as cryptography prints it
    rogue_cert: Path       # a client cert from another CA
    rogue_key: Path
    other_ca: Path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost", f"*.{DOMAIN}")
    client = ca.issue_cert("alice.clients.test", common_name="alice", organization_name="Acme",
                           organization_unit_name="Payments")
    other = trustme.CA()
    rogue = other.issue_cert("mallory.clients.test", common_name="alice")
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    other.cert_pem.write_to_path(str(d / "other-ca.pem"))
    server.private_key_pem.write_to_path(str(d / "server.key"))
    client.private_key_pem.write_to_path(str(d / "client.key"))
    rogue.private_key_pem.write_to_path(str(d / "rogue.key"))
    for name, leaf in (("server.pem", server), ("client.pem", client), ("rogue.pem", rogue)):
        with open(d / name, "wb") as f:
            for blob in leaf.cert_chain_pems:
                f.write(blob.bytes())
    subject = x509.load_pem_x509_certificate(client.cert_chain_pems[0].bytes()).subject.rfc4514_string()
    return Pki(d / "ca.pem", d / "server.pem", d / "server.key", d / "client.pem", d / "client.key",
               subject, d / "rogue.pem", d / "rogue.key", d / "other-ca.pem")


class ContextRecorder(Filter):
    """Keeps, per request, what kproxy knew about the connection's identity and route."""

    name = "context-recorder"
    request_api_keys = ALL

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, str, str | None, str | None]] = []
        self._lock = threading.Lock()

    def on_request(self, ctx: ConnectionContext, exchange) -> None:
        request = exchange.request
        with self._lock:
            self.seen.append((ctx.connection_id, request.api_key, ctx.listener, ctx.tls_subject, ctx.principal))

    def snapshot(self) -> list[tuple[int, int, str, str | None, str | None]]:
        with self._lock:
            return list(self.seen)


def kproxy_config(upstream: str, extra: str = "", sni: bool = False, upstream_tls: str = "") -> Any:
    port, broker_port = free_ports(2)
    exposure = (f"  mode: sni\n  sni: {{domain: {DOMAIN}}}\n" if sni else
                f"  advertised_host: 127.0.0.1\n  broker_port_start: {broker_port}\n  broker_port_count: 1\n")
    return parse_config(f"""\
listen: "127.0.0.1:{port}"
upstream:
  bootstrap_servers: ["{upstream}"]
  connect_timeout_s: 5
{upstream_tls}exposure:
{exposure}{extra}""")


def server_tls(pki: Pki, mtls: bool = False) -> str:
    text = f"tls:\n  enabled: true\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n"
    if mtls:
        text += f"  ca_file: {pki.ca}\n  require_client_cert: true\n"
    return text


def origination_tls(pki: Pki, ca: Path | None = None) -> str:
    """upstream.tls: verify the broker against ``ca`` and present alice's certificate to it."""
    return (f"  tls:\n    enabled: true\n    ca_file: {ca or pki.ca}\n"
            f"    cert_file: {pki.client_cert}\n    key_file: {pki.client_key}\n")


# --------------------------------------------------------------------------------------------------
# (a) termination
# --------------------------------------------------------------------------------------------------


def test_termination_confluent(broker: TansuBroker, pki: Pki) -> None:
    recorder = ContextRecorder()
    with ProxyThread(kproxy_config(broker.bootstrap, server_tls(pki)), [recorder]) as proxy:
        settings = {"bootstrap.servers": proxy.bootstrap, "security.protocol": "SSL",
                    "ssl.ca.location": str(pki.ca)}
        assert confluent_roundtrip(settings, unique_name("tls-ck")) == expected_pairs()
    seen = recorder.snapshot()
    assert {listener for _, _, listener, _, _ in seen} == {"bootstrap", f"broker-{broker.node_id}"}
    assert all(subject is None and principal is None for _, _, _, subject, principal in seen)


def test_termination_kafka_python(broker: TansuBroker, pki: Pki) -> None:
    with ProxyThread(kproxy_config(broker.bootstrap, server_tls(pki))) as proxy:
        settings = {"bootstrap_servers": proxy.bootstrap, "security_protocol": "SSL",
                    "ssl_cafile": str(pki.ca), "request_timeout_ms": 20000}
        assert kafka_python_roundtrip(settings, unique_name("tls-kp")) == expected_pairs()


def test_termination_plain_client_is_not_served(broker: TansuBroker, pki: Pki) -> None:
    with ProxyThread(kproxy_config(broker.bootstrap, server_tls(pki))) as proxy, \
            socket.create_connection(_split(proxy.bootstrap), timeout=10) as sock:
        sock.sendall(_api_versions_frame())
        # kproxy waits for a ClientHello; plaintext Kafka is garbage to it and the connection ends.
        with contextlib.suppress(ConnectionError):
            assert sock.recv(4096)[:1] in (b"", b"\x15")   # nothing, or a TLS alert record


# --------------------------------------------------------------------------------------------------
# (b) mTLS
# --------------------------------------------------------------------------------------------------


def test_mtls_principal_is_the_certificate_subject(broker: TansuBroker, pki: Pki) -> None:
    recorder = ContextRecorder()
    with ProxyThread(kproxy_config(broker.bootstrap, server_tls(pki, mtls=True)), [recorder]) as proxy:
        settings = {"bootstrap.servers": proxy.bootstrap, "security.protocol": "SSL",
                    "ssl.ca.location": str(pki.ca), "ssl.certificate.location": str(pki.client_cert),
                    "ssl.key.location": str(pki.client_key)}
        assert confluent_roundtrip(settings, unique_name("mtls")) == expected_pairs()
    assert pki.client_subject.startswith("CN=alice,")
    seen = recorder.snapshot()
    assert seen
    assert {(subject, principal) for _, _, _, subject, principal in seen} == {
        (pki.client_subject, f"User:{pki.client_subject}")}


@pytest.mark.parametrize("cert", ["none", "other-ca"])
def test_mtls_refuses_clients_without_a_trusted_cert(broker: TansuBroker, pki: Pki, cert: str,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    recorder = ContextRecorder()
    caplog.set_level(logging.INFO, logger="kproxy")
    with ProxyThread(kproxy_config(broker.bootstrap, server_tls(pki, mtls=True)), [recorder]) as proxy:
        ctx = ssl.create_default_context(cafile=str(pki.ca))
        if cert == "other-ca":
            ctx.load_cert_chain(str(pki.rogue_cert), str(pki.rogue_key))
        # TLS 1.3: the client finishes its side first; the refusal arrives as an alert or EOF.
        _assert_refused(ctx, proxy.bootstrap, "127.0.0.1")
        if cert == "none":
            # A real client is refused too, and says so promptly.
            import confluent_kafka

            errors: list[Any] = []
            producer = confluent_kafka.Producer({
                "bootstrap.servers": proxy.bootstrap, "security.protocol": "SSL",
                "ssl.ca.location": str(pki.ca), "error_cb": errors.append, "log_level": 0})
            deadline = time.monotonic() + 10
            while not errors and time.monotonic() < deadline:
                producer.poll(0.1)
            del producer
            assert errors
        deadline = time.monotonic() + 5
        while "TLS handshake failed" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    assert recorder.snapshot() == []     # no request got through
    assert "TLS handshake failed" in caplog.text


def _assert_refused(ctx: ssl.SSLContext, address: str, server_hostname: str) -> None:
    with socket.create_connection(_split(address), timeout=10) as raw, \
            pytest.raises((ssl.SSLError, ConnectionError)), \
            ctx.wrap_socket(raw, server_hostname=server_hostname) as tls:
        tls.sendall(_api_versions_frame())
        if not tls.recv(4096):
            raise ConnectionResetError("closed without an answer")


# --------------------------------------------------------------------------------------------------
# (c) origination
# --------------------------------------------------------------------------------------------------


class TlsRelay:
    """Terminates TLS (optionally requiring a client certificate) and relays bytes to ``target``."""

    def __init__(self, context: ssl.SSLContext) -> None:
        self.context = context
        self.target: tuple[str, int] | None = None
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self.peer_subjects: list[str] = []
        self.handshake_errors: list[str] = []
        self._sockets: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def __enter__(self) -> TlsRelay:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for s in list(self._sockets):
            with contextlib.suppress(OSError):
                s.close()
        self._thread.join(5)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        self._sockets.append(conn)
        conn.settimeout(10)
        try:
            tls = self.context.wrap_socket(conn, server_side=True)
        except (ssl.SSLError, OSError) as e:
            self.handshake_errors.append(str(e))
            conn.close()
            return
        tls.settimeout(None)
        self.peer_subjects.append(_subject(tls.getpeercert()))
        assert self.target is not None
        up = socket.create_connection(self.target)
        self._sockets += [tls, up]
        threading.Thread(target=pipe, args=(up, tls), daemon=True).start()
        pipe(tls, up)


_SHORT = {"commonName": "CN", "organizationName": "O", "organizationalUnitName": "OU"}


def _subject(cert: Any) -> str:
    return ",".join(f"{_SHORT.get(k, k)}={v}" for rdn in reversed((cert or {}).get("subject", ())) for k, v in rdn)


@pytest.fixture(scope="module")
def tls_upstream(tansu_binary: str, pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsRelay]:
    """tansu behind a TLS relay that requires a client certificate; metadata names the relay."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki.ca))
    ctx.load_cert_chain(str(pki.server_cert), str(pki.server_key))
    ctx.verify_mode = ssl.CERT_REQUIRED
    with TlsRelay(ctx) as relay:
        log = tmp_path_factory.mktemp("tansu-tls") / "broker.log"
        with Tansu(tansu_binary, advertised=relay.address, log_path=log) as tansu:
            relay.target = (tansu.host, tansu.port)
            yield relay


def test_origination_to_a_tls_broker(tls_upstream: TlsRelay, pki: Pki) -> None:
    relay = tls_upstream
    cfg = kproxy_config(f"{relay.address[0]}:{relay.address[1]}", upstream_tls=origination_tls(pki))
    before = len(relay.peer_subjects)
    with ProxyThread(cfg) as proxy:
        settings = {"bootstrap.servers": proxy.bootstrap}
        assert confluent_roundtrip(settings, unique_name("orig")) == expected_pairs()
    # Discovery, the bootstrap connection and the broker connection all went over verified TLS,
    # each presenting kproxy's client certificate.
    assert len(relay.peer_subjects) - before >= 3
    assert set(relay.peer_subjects[before:]) == {pki.client_subject}
    assert relay.handshake_errors == []


def test_origination_with_an_untrusted_broker_cert(tls_upstream: TlsRelay, pki: Pki,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """kproxy verifies the broker: with the wrong CA it keeps running, logs why, and the client
    gets errors instead of a connection to an unverified broker."""
    import confluent_kafka

    caplog.set_level(logging.INFO, logger="kproxy")
    relay = tls_upstream
    cfg = kproxy_config(f"{relay.address[0]}:{relay.address[1]}",
                        upstream_tls=origination_tls(pki, pki.other_ca))
    with ProxyThread(cfg) as proxy:
        producer = confluent_kafka.Producer({"bootstrap.servers": proxy.bootstrap, "log_level": 0})
        with pytest.raises(confluent_kafka.KafkaException):
            producer.list_topics(timeout=3)
        del producer
        # Still serving (before the fix, discovery's TLS failure stopped kproxy at start-up).
        assert proxy.call(lambda: proxy.server.stats.connections_total) >= 1
    assert "certificate verify failed" in caplog.text


# --------------------------------------------------------------------------------------------------
# (d) SNI
# --------------------------------------------------------------------------------------------------


def _split(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def _api_versions_frame() -> bytes:
    req = Request.build(API_VERSIONS, 0, 1, "probe", body_class(API_VERSIONS, "request")())
    return b"".join(bytes(b) for b in encode_request_frame(req))


def _read_frame(sock: ssl.SSLSocket) -> bytes:
    buf = b""
    while len(buf) < 4 or len(buf) < 4 + int.from_bytes(buf[:4], "big"):
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf[4:]


def _metadata(sock: ssl.SSLSocket, correlation_id: int, topics: list[str] | None) -> Any:
    cls: Any = body_class(METADATA, "request")
    body = cls(topics=None if topics is None else [cls.MetadataRequestTopic(name=t) for t in topics],
               allow_auto_topic_creation=True)
    req = Request.build(METADATA, 12, correlation_id, "sni-probe", body)
    sock.sendall(b"".join(bytes(b) for b in encode_request_frame(req)))
    return decode_response(_read_frame(sock), METADATA, 12).body


def test_sni_routing_with_kproxy_codec(broker: TansuBroker, pki: Pki) -> None:
    recorder = ContextRecorder()
    cfg = kproxy_config(broker.bootstrap, server_tls(pki), sni=True)
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    with ProxyThread(cfg, [recorder]) as proxy:
        address = _split(proxy.bootstrap)
        with ctx.wrap_socket(socket.create_connection(address, timeout=10),
                             server_hostname=f"bootstrap.{DOMAIN}") as boot:
            meta = _metadata(boot, 1, None)
        brokers = [(b.node_id, b.host, b.port) for b in meta.brokers]
        broker_name = f"broker-{broker.node_id}.{DOMAIN}"
        assert brokers == [(broker.node_id, broker_name, address[1])]
        topic = unique_name("sni")
        with ctx.wrap_socket(socket.create_connection(address, timeout=10),
                             server_hostname=broker_name) as direct:
            meta = _metadata(direct, 2, [topic])
        assert [t.name for t in meta.topics] == [topic]
        assert [(b.node_id, b.host, b.port) for b in meta.brokers] == brokers
    listeners = {listener for _, key, listener, _, _ in recorder.snapshot() if key == METADATA}
    assert listeners == {"bootstrap", f"broker-{broker.node_id}"}


def test_sni_routing_with_kafka_python(broker: TansuBroker, pki: Pki, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real client on SNI names: ``*.kproxy.test`` resolves to loopback for this process only."""
    real = socket.getaddrinfo

    def resolve(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(host, str) and host.endswith(f".{DOMAIN}"):
            host = "127.0.0.1"
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    recorder = ContextRecorder()
    cfg = kproxy_config(broker.bootstrap, server_tls(pki), sni=True)
    with ProxyThread(cfg, [recorder]) as proxy:
        port = _split(proxy.bootstrap)[1]
        settings = {"bootstrap_servers": f"bootstrap.{DOMAIN}:{port}", "security_protocol": "SSL",
                    "ssl_cafile": str(pki.ca), "request_timeout_ms": 20000}
        assert kafka_python_roundtrip(settings, unique_name("sni-kp")) == expected_pairs()
    by_listener = {listener for _, key, listener, _, _ in recorder.snapshot() if key == 0}
    assert by_listener == {f"broker-{broker.node_id}"}   # Produce went over the broker's SNI name


def test_sni_with_mtls_refusal_then_a_certificate_routes(broker: TansuBroker, pki: Pki) -> None:
    """The SNI callback sees the name before the client certificate is checked; refused handshakes
    leave nothing behind, and the same name then routes once a certificate is presented."""
    cfg = kproxy_config(broker.bootstrap, server_tls(pki, mtls=True), sni=True)
    with ProxyThread(cfg) as proxy:
        ctx = ssl.create_default_context(cafile=str(pki.ca))     # no client certificate
        for _ in range(3):
            _assert_refused(ctx, proxy.bootstrap, f"broker-{broker.node_id}.{DOMAIN}")
        ctx.load_cert_chain(str(pki.client_cert), str(pki.client_key))
        with ctx.wrap_socket(socket.create_connection(_split(proxy.bootstrap), timeout=10),
                             server_hostname=f"broker-{broker.node_id}.{DOMAIN}") as tls:
            assert [b.host for b in _metadata(tls, 1, None).brokers] == [f"broker-{broker.node_id}.{DOMAIN}"]


def test_sni_junk_names_are_refused_and_brokers_stay_routable(broker: TansuBroker, pki: Pki) -> None:
    """Issue 16 fault 7: 1,024 ClientHellos naming things kproxy does not serve are each refused at
    the ClientHello (unrecognized_name), and a broker's name still routes to it afterwards."""
    recorder = ContextRecorder()
    cfg = kproxy_config(broker.bootstrap, server_tls(pki), sni=True)
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    junk = [f"junk-{i}.{DOMAIN}" if i % 4 == 0 else f"broker-{i}x.{DOMAIN}" if i % 4 == 1
            else f"broker-0{i}.{DOMAIN}" if i % 4 == 2 else f"controller-.{DOMAIN}" for i in range(1024)]
    with ProxyThread(cfg, [recorder]) as proxy:
        address = _split(proxy.bootstrap)
        for name in junk:
            # kproxy ends the handshake before its certificate goes out (trio closes without sending
            # the alert, so the client sees EOF).
            with socket.create_connection(address, timeout=10) as raw, \
                    pytest.raises((ssl.SSLError, ConnectionError)):
                ctx.wrap_socket(raw, server_hostname=name)
        assert proxy.call(lambda: proxy.server.sni_names.refused) == len(junk)
        broker_name = f"broker-{broker.node_id}.{DOMAIN}"
        with ctx.wrap_socket(socket.create_connection(address, timeout=10), server_hostname=broker_name) as tls:
            assert [b.host for b in _metadata(tls, 1, None).brokers] == [broker_name]
        # A name outside the domain is the bootstrap, as before SNI routing.
        with ctx.wrap_socket(socket.create_connection(address, timeout=10), server_hostname="localhost") as tls:
            assert [b.host for b in _metadata(tls, 2, None).brokers] == [broker_name]
    listeners = [listener for _, key, listener, _, _ in recorder.snapshot() if key == METADATA]
    assert listeners == [f"broker-{broker.node_id}", "bootstrap"]

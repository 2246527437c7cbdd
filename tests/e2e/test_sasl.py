"""SASL through kproxy with real clients, against a broker that enforces authentication.

The enforcing broker is tansu behind ``sasl_gate.SaslGate`` (tansu 0.6's own ``--authentication``
cannot get its first user with memory storage; see that module). kproxy sits in front of the gate
and must relay the SASL exchange untouched, learn the principal only once the broker said yes, keep
every token out of its logs, and follow KIP-368 re-authentication on a live connection.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import trio

from kproxy.config import parse_config
from kproxy.protocol.messages import Request, body_class, decode_response, encode_request_frame
from kproxy.proxy.filters import ALL, ConnectionContext, Filter
from kproxy.server.embedded import ProxyThread
from tests.e2e.sasl_gate import (
    SaslGate,
    confluent_roundtrip,
    expected_pairs,
    free_ports,
    kafka_python_roundtrip,
)
from tests.e2e.tansu import Tansu, unique_name
from tests.polling import wait_until

pytestmark = pytest.mark.e2e

USER, PASSWORD = "alice", "alice-Secret-9f3c"
WRONG = "not-alice's-password"
SASL_HANDSHAKE, SASL_AUTHENTICATE, API_VERSIONS, METADATA = 17, 36, 18, 3


class PrincipalRecorder(Filter):
    """Notes, for every request, the connection and what kproxy believed about its principal."""

    name = "principal-recorder"
    request_api_keys = ALL

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, str | None, bool]] = []
        self._lock = threading.Lock()

    def on_request(self, ctx: ConnectionContext, exchange) -> None:
        request = exchange.request
        with self._lock:
            self.seen.append((ctx.connection_id, request.api_key, ctx.principal, ctx.authenticated))

    def snapshot(self) -> list[tuple[int, int, str | None, bool]]:
        with self._lock:
            return list(self.seen)


@pytest.fixture(scope="module")
def gate(tansu_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SaslGate]:
    g = SaslGate(None, {USER: PASSWORD, "bob": "bob-password"})
    log = tmp_path_factory.mktemp("tansu-sasl") / "broker.log"
    with Tansu(tansu_binary, advertised=g.address, log_path=log) as tansu:
        g.upstream = (tansu.host, tansu.port)
        with g:
            yield g
    assert g.errors == []


@pytest.fixture
def recorder() -> PrincipalRecorder:
    return PrincipalRecorder()


@pytest.fixture
def proxy(gate: SaslGate, recorder: PrincipalRecorder) -> Iterator[ProxyThread]:
    port, broker_port = free_ports(2)
    cfg = parse_config(f"""\
listen: "127.0.0.1:{port}"
upstream:
  bootstrap_servers: ["{gate.bootstrap}"]
exposure:
  advertised_host: 127.0.0.1
  broker_port_start: {broker_port}
  broker_port_count: 1
""")
    with ProxyThread(cfg, [recorder]) as p:
        yield p
    # Every connection of this test served to its end before the next test marks the gate's lists.
    gate.wait_idle()


@pytest.fixture
def kproxy_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG)
    return caplog


def kproxy_text(caplog: pytest.LogCaptureFixture) -> str:
    """Everything kproxy logged: messages, raw arguments and tracebacks."""
    parts = []
    for r in caplog.records:
        if r.name.startswith("kproxy"):
            parts += [r.getMessage(), repr(r.args), r.exc_text or ""]
    return "\n".join(parts)


def assert_no_secrets(caplog: pytest.LogCaptureFixture, gate: SaslGate, passwords: list[str]) -> None:
    text = kproxy_text(caplog)
    assert "authenticated as" in text   # the capture works: kproxy's own SASL log line is there
    secrets = {p for pw in passwords for p in (pw, base64.b64encode(pw.encode()).decode())}
    for token in gate.tokens:
        secrets |= {repr(token), token.hex(), base64.b64encode(token).decode()}
        if b"p=" in token:      # a SCRAM client-final message: its proof
            secrets.add(token.rsplit(b"p=", 1)[1].decode())
    assert gate.tokens
    leaked = sorted(s for s in secrets if s and s in text)
    assert not leaked


def librdkafka_settings(bootstrap: str, mechanism: str, password: str, **extra: Any) -> dict[str, Any]:
    return {"bootstrap.servers": bootstrap, "security.protocol": "SASL_PLAINTEXT",
            "sasl.mechanism": mechanism, "sasl.username": USER, "sasl.password": password,
            "log_level": 0, **extra}


def assert_principal_only_after_success(recorder: PrincipalRecorder) -> None:
    seen = recorder.snapshot()
    assert seen
    by_conn: dict[int, list[tuple[int, str | None, bool]]] = {}
    for cid, key, principal, authenticated in seen:
        by_conn.setdefault(cid, []).append((key, principal, authenticated))
    for requests in by_conn.values():
        # Before the broker accepted the exchange nobody is anybody; after it, everyone is alice.
        sasl_end = max((i for i, (k, _, _) in enumerate(requests) if k == SASL_AUTHENTICATE), default=-1)
        if sasl_end < 0:
            # A connection the client closed before it logged in (librdkafka drops a coordinator
            # connection still in its handshake when the consumer closes): it asked nothing else.
            assert all(k in (API_VERSIONS, SASL_HANDSHAKE) and p is None and not a for k, p, a in requests), \
                f"a connection skipped SASL: {requests}"
            continue
        assert all(p is None and not a for _, p, a in requests[: sasl_end + 1])
        assert all(p == f"User:{USER}" and a for _, p, a in requests[sasl_end + 1:])
    assert any(k == METADATA and p == f"User:{USER}" for _, k, p, _ in seen)


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_confluent_sasl_produce_consume(mechanism: str, gate: SaslGate, proxy: ProxyThread,
                                        recorder: PrincipalRecorder,
                                        kproxy_log: pytest.LogCaptureFixture) -> None:
    before = len(gate.authentications)
    settings = librdkafka_settings(proxy.bootstrap, mechanism, PASSWORD)
    assert confluent_roundtrip(settings, unique_name("sasl")) == expected_pairs()
    done = gate.authentications[before:]
    assert done and all(a.ok and a.user == USER and a.mechanism == mechanism for a in done)
    assert_principal_only_after_success(recorder)
    assert_no_secrets(kproxy_log, gate, [PASSWORD])


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256"])
def test_kafka_python_sasl_produce_consume(mechanism: str, gate: SaslGate, proxy: ProxyThread,
                                           recorder: PrincipalRecorder,
                                           kproxy_log: pytest.LogCaptureFixture) -> None:
    settings = {"bootstrap_servers": proxy.bootstrap, "security_protocol": "SASL_PLAINTEXT",
                "sasl_mechanism": mechanism, "sasl_plain_username": USER, "sasl_plain_password": PASSWORD,
                "request_timeout_ms": 20000}
    assert kafka_python_roundtrip(settings, unique_name("sasl-kp")) == expected_pairs()
    assert_principal_only_after_success(recorder)
    assert_no_secrets(kproxy_log, gate, [PASSWORD])


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256"])
def test_confluent_wrong_password_is_an_authentication_error(
        mechanism: str, gate: SaslGate, proxy: ProxyThread, recorder: PrincipalRecorder,
        kproxy_log: pytest.LogCaptureFixture) -> None:
    import confluent_kafka

    errors: list[Any] = []
    got_auth_error = threading.Event()

    def on_error(err: Any) -> None:
        errors.append(err)
        if err.code() == confluent_kafka.KafkaError._AUTHENTICATION:
            got_auth_error.set()

    before = len(gate.authentications)
    producer = confluent_kafka.Producer(librdkafka_settings(
        proxy.bootstrap, mechanism, WRONG, error_cb=on_error, **{"reconnect.backoff.ms": 1000}))
    deadline = time.monotonic() + 10
    while not got_auth_error.is_set() and time.monotonic() < deadline:
        producer.poll(0.1)
    assert got_auth_error.is_set(), errors
    assert "Authentication failed" in next(
        e.str() for e in errors if e.code() == confluent_kafka.KafkaError._AUTHENTICATION)
    del producer
    failed = gate.authentications[before:]
    assert failed and not any(a.ok for a in failed)
    # Nothing but ApiVersions and SASL ever went out, and no request carried a principal.
    assert {k for _, k, _, _ in recorder.snapshot()} <= {API_VERSIONS, SASL_HANDSHAKE, SASL_AUTHENTICATE}
    assert all(p is None for _, _, p, _ in recorder.snapshot())
    text = kproxy_text(kproxy_log)
    assert "authenticated as" not in text
    assert WRONG not in text and base64.b64encode(WRONG.encode()).decode() not in text
    assert not any(t.hex() in text or repr(t) in text for t in gate.tokens)


def test_kafka_python_wrong_password_is_an_authentication_error(
        gate: SaslGate, proxy: ProxyThread, kproxy_log: pytest.LogCaptureFixture) -> None:
    import kafka
    import kafka.errors

    # kafka-python 3.0 retries a failed bootstrap until bootstrap_timeout_ms, logging each failure.
    started = time.monotonic()
    with pytest.raises(kafka.errors.KafkaTimeoutError):
        kafka.KafkaConsumer(
            bootstrap_servers=proxy.bootstrap, security_protocol="SASL_PLAINTEXT",
            sasl_mechanism="SCRAM-SHA-256", sasl_plain_username=USER, sasl_plain_password=WRONG,
            bootstrap_timeout_ms=2000)
    assert time.monotonic() - started < 10
    assert gate.errors == []
    client_saw = [r.getMessage() for r in kproxy_log.records
                  if r.name.startswith("kafka") and r.levelno >= logging.WARNING]
    assert any("SaslAuthenticationFailedError" in m and "invalid credentials" in m for m in client_saw)
    assert WRONG not in kproxy_text(kproxy_log)


def test_reauthentication_kip368(gate: SaslGate, proxy: ProxyThread, recorder: PrincipalRecorder) -> None:
    """The broker grants 1.5 s sessions; librdkafka re-authenticates on the same connections through
    kproxy, which keeps serving them as alice (an expired session would be closed by the gate)."""
    import confluent_kafka

    gate.session_lifetime_ms = 1500
    expired = len(gate.expired)
    try:
        before = len(gate.authentications)
        producer = confluent_kafka.Producer(librdkafka_settings(proxy.bootstrap, "SCRAM-SHA-256", PASSWORD))
        topic = unique_name("reauth")
        delivered: list[Any] = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            producer.produce(topic, value=b"x", on_delivery=lambda err, msg: delivered.append(err))
            producer.flush(10)
            time.sleep(0.25)
        del producer
    finally:
        gate.session_lifetime_ms = 0
    done = gate.authentications[before:]
    reauths = [a for a in done if a.reauthentication]
    assert all(a.ok and a.user == USER for a in done)
    assert len(reauths) >= 2, done
    assert gate.expired[expired:] == []
    assert delivered and all(err is None for err in delivered)
    # kproxy saw the re-authentications on connections that already were alice, and stayed alice.
    seen = recorder.snapshot()
    reauth_conns = {cid for cid, k, p, a in seen if k == SASL_HANDSHAKE and a and p == f"User:{USER}"}
    assert reauth_conns
    assert all(p == f"User:{USER}" for cid, k, p, _ in seen if cid in reauth_conns and k == 0)


def _frame(sock: Any) -> bytes:
    head = b""
    while len(head) < 4:
        chunk = sock.recv(4 - len(head))
        if not chunk:
            raise ConnectionError("closed")
        head += chunk
    size = int.from_bytes(head, "big")
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def test_unauthenticated_request_is_refused(gate: SaslGate, proxy: ProxyThread) -> None:
    """The gate really enforces: Metadata before SASL gets the connection closed, through kproxy too."""
    import socket

    host, port = proxy.bootstrap.rsplit(":", 1)
    refused = len(gate.refused)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        req = Request.build(METADATA, 12, 7, "probe", body_class(METADATA, "request")(topics=None))
        sock.sendall(b"".join(bytes(b) for b in encode_request_frame(req)))
        with contextlib.suppress(ConnectionError):
            data = _frame(sock)
            pytest.fail(f"got an answer: {decode_response(data, METADATA, 12)!r}")
    assert gate.refused[refused:] == [(gate.refused[-1][0], METADATA)]



def _roundtrip(sock: Any, api_key: int, version: int, correlation_id: int, body: Any) -> Any:
    req = Request.build(api_key, version, correlation_id, "wire", body)
    sock.sendall(b"".join(bytes(b) for b in encode_request_frame(req)))
    return decode_response(_frame(sock), api_key, version).body


def test_broker_connection_lost_after_sasl_closes_the_client(gate: SaslGate, proxy: ProxyThread,
                                                              recorder: PrincipalRecorder) -> None:
    """A new broker connection would not be authenticated and only the client can authenticate it:
    kproxy must close the client connection, not replay its requests on an unauthenticated one."""
    import socket

    host, port = proxy.bootstrap.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        hs = _roundtrip(sock, SASL_HANDSHAKE, 1, 1, body_class(SASL_HANDSHAKE, "request")(mechanism="PLAIN"))
        assert hs.error_code == 0
        token = f"\0{USER}\0{PASSWORD}".encode()
        auth = _roundtrip(sock, SASL_AUTHENTICATE, 2, 2, body_class(SASL_AUTHENTICATE, "request")(auth_bytes=token))
        assert auth.error_code == 0
        meta = _roundtrip(sock, METADATA, 12, 3, body_class(METADATA, "request")(topics=None))
        assert meta.brokers
        refused = len(gate.refused)
        gate.drop_connections()
        time.sleep(0.2)
        with contextlib.suppress(OSError):
            req = Request.build(METADATA, 12, 4, "wire", body_class(METADATA, "request")(topics=None))
            sock.sendall(b"".join(bytes(b) for b in encode_request_frame(req)))
        with pytest.raises(ConnectionError):
            _frame(sock)
    assert gate.refused[refused:] == []   # nothing was sent to the broker unauthenticated


# -- readiness and discovery in front of a broker that requires SASL ---------------------------------


@pytest.fixture
def admin_proxy(gate: SaslGate) -> Iterator[tuple[ProxyThread, str, int]]:
    """kproxy with an admin listener and deterministic broker ports (listening from the start, not
    mapped to a broker until discovery or a client's Metadata says where each one is)."""
    from tests.e2e.proxied import free_port_block

    port = free_port_block(3)            # the bootstrap port, then the two broker ports
    broker_port = port + 1
    (admin,) = free_ports(1)
    cfg = parse_config(f"""\
listen: "127.0.0.1:{port}"
upstream:
  bootstrap_servers: ["{gate.bootstrap}"]
exposure:
  advertised_host: 127.0.0.1
  broker_port_start: {broker_port}
  broker_port_count: 2
  node_id_base: 111    # tansu's node id
admin:
  listen: "127.0.0.1:{admin}"
""")
    with ProxyThread(cfg) as p:
        yield p, f"127.0.0.1:{admin}", broker_port
    gate.wait_idle()


def readyz(admin: str) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{admin}/readyz", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_ready_in_front_of_a_broker_that_requires_sasl(gate: SaslGate,
                                                       admin_proxy: tuple[ProxyThread, str, int]) -> None:
    proxy, admin, _ = admin_proxy
    wait_until(lambda: readyz(admin)[0] == 200, "never ready in front of a SASL-only broker")
    assert readyz(admin) == (200, "ready\n")
    # Discovery's Metadata was refused (no SASL yet), and that does not stop readiness.
    assert any(api == METADATA for _, api in gate.refused)
    assert proxy.call(lambda: (proxy.server.bootstrap_answered, proxy.server.discovered)) == (True, False)
    # Clients authenticate and go on as before.
    settings = {"bootstrap.servers": proxy.bootstrap, "security.protocol": "SASL_PLAINTEXT",
                "sasl.mechanism": "PLAIN", "sasl.username": USER, "sasl.password": PASSWORD}
    assert confluent_roundtrip(settings, unique_name("ready")) == expected_pairs()


def test_a_storm_to_an_unmapped_port_starts_one_discovery(gate: SaslGate,
                                                          admin_proxy: tuple[ProxyThread, str, int]) -> None:
    import socket

    from kproxy.server.app import DISCOVERY_REUSE_S

    proxy, admin, broker_port = admin_proxy
    server = proxy.server
    wait_until(lambda: readyz(admin)[0] == 200, "never ready")
    # Past the time the last attempt answers for, so the storm needs an attempt of its own.
    wait_until(lambda: proxy.call(lambda: server._discovery is None and server.discovery_ended_at is not None
                                and trio.current_time() - server.discovery_ended_at > DISCOVERY_REUSE_S),
             "discovery never settled")
    attempts = proxy.call(lambda: server.discovery_attempts)
    refused = sum(1 for _, api in gate.refused if api == METADATA)
    storm = [socket.create_connection(("127.0.0.1", broker_port), timeout=10) for _ in range(30)]
    try:
        wait_until(lambda: proxy.call(lambda: len(server.connections)) == len(storm),
                 "the storm's connections were not all served")
        assert proxy.call(lambda: server.discovery_attempts) == attempts + 1
        assert sum(1 for _, api in gate.refused if api == METADATA) == refused + 1
    finally:
        for s in storm:
            s.close()

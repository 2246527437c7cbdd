"""kproxy handling identity itself, with real clients: SASL termination (SCRAM against its users file,
OAUTHBEARER against a JWKS), origination (kproxy logs in to the brokers as a service account by
SCRAM or by an OAuth client-credentials token), both at once, and KIP-368 re-authentication on both
sides under a steady producer.

The broker is tansu behind ``sasl_gate.SaslGate``: an open listener for the termination tests
(a cluster without SASL, which counts what reaches it) and an enforcing one for origination (the
stand-in for Apache Kafka's SASL listener; see that module). ``oidc.OidcProvider`` is the identity
provider: a JWKS and a client-credentials token endpoint on loopback.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kproxy.config import parse_config
from kproxy.protocol.messages import body_class
from kproxy.server.embedded import ProxyThread
from kproxy.userfile import add_user
from tests.e2e.oidc import OidcProvider
from tests.e2e.sasl_gate import (
    SaslGate,
    confluent_roundtrip,
    expected_pairs,
    free_ports,
    kafka_python_roundtrip,
)
from tests.e2e.tansu import Tansu, unique_name
from tests.e2e.test_sasl import PrincipalRecorder, kproxy_text
from tests.e2e.wire import Wire

pytestmark = pytest.mark.e2e

ALICE, ALICE_PASSWORD = "alice", "alice-Pw-7c1e"
SERVICE, SERVICE_PASSWORD = "svc-kproxy", "svc-Pw-d41f"
ORDERS_SECRET, KPROXY_SECRET = "orders-secret-5e2a", "kproxy-secret-0b9d"
WRONG = "not-the-password-3f"


@pytest.fixture(scope="module")
def oidc() -> Iterator[OidcProvider]:
    with OidcProvider({"orders": ORDERS_SECRET, "kproxy": KPROXY_SECRET, "stranger": "s"}) as provider:
        provider.audiences["stranger"] = "billing"      # its tokens are for another audience
        yield provider


@pytest.fixture(scope="module")
def gate(tansu_binary: str, tmp_path_factory: pytest.TempPathFactory, oidc: OidcProvider) -> Iterator[SaslGate]:
    g = SaslGate(None, {SERVICE: SERVICE_PASSWORD}, bearer=(oidc.jwks, oidc.issuer, "kafka"))
    log = tmp_path_factory.mktemp("tansu-identity") / "broker.log"
    with Tansu(tansu_binary, advertised=g.address, log_path=log) as tansu:
        g.upstream = (tansu.host, tansu.port)
        with g:
            yield g
    assert g.errors == []


@pytest.fixture
def users_file(tmp_path: Path) -> Path:
    path = tmp_path / "users.yaml"
    add_user(str(path), ALICE, ALICE_PASSWORD)
    assert ALICE_PASSWORD not in path.read_text()
    return path


@pytest.fixture
def recorder() -> PrincipalRecorder:
    return PrincipalRecorder()


@pytest.fixture
def kproxy_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO)
    return caplog


def start_proxy(gate: SaslGate, recorder: PrincipalRecorder | None, *, upstream_sasl: str = "", sasl: str = "",
                extra: str = "", advertised_host: str = "127.0.0.1") -> ProxyThread:
    """kproxy in front of the SASL gate, with the given SASL sections (``advertised_host``: the name
    clients reach its broker port by; Kerberos needs ``localhost``, the host in a service ticket)."""
    port, broker_port = free_ports(2)
    cfg = parse_config(f"""\
listen: "127.0.0.1:{port}"
upstream:
  bootstrap_servers: ["{gate.bootstrap}"]
{upstream_sasl}
exposure:
  advertised_host: {advertised_host}
  broker_port_start: {broker_port}
  broker_port_count: 1
{sasl}
{extra}
""")
    return ProxyThread(cfg, [recorder] if recorder is not None else []).start()


def termination(users_file: Path, oidc: OidcProvider, max_session_s: float = 3600) -> str:
    return f"""\
sasl:
  mechanisms: [SCRAM-SHA-512, SCRAM-SHA-256, PLAIN, OAUTHBEARER]
  users_file: {users_file}
  max_session_s: {max_session_s}
  failed_login_delay_s: 0.2
  oauth:
    jwks_url: {oidc.jwks_url}
    issuer: {oidc.issuer}
    audience: kafka
"""


def origination_scram(password_file: Path, mechanism: str = "SCRAM-SHA-512") -> str:
    return f"""\
  sasl:
    mechanism: {mechanism}
    username: {SERVICE}
    password_file: {password_file}
"""


def librdkafka(bootstrap: str, mechanism: str = "SCRAM-SHA-512", password: str = ALICE_PASSWORD,
               **extra: Any) -> dict[str, Any]:
    return {"bootstrap.servers": bootstrap, "security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": mechanism,
            "sasl.username": ALICE, "sasl.password": password, "log_level": 0, **extra}


def librdkafka_oidc(bootstrap: str, oidc: OidcProvider, client_id: str = "orders", secret: str = ORDERS_SECRET,
                    **extra: Any) -> dict[str, Any]:
    return {"bootstrap.servers": bootstrap, "security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "OAUTHBEARER",
            "sasl.oauthbearer.method": "oidc", "sasl.oauthbearer.client.id": client_id,
            "sasl.oauthbearer.client.secret": secret, "sasl.oauthbearer.token.endpoint.url": oidc.token_url,
            "sasl.oauthbearer.scope": "kafka", "log_level": 0, **extra}


def principals(recorder: PrincipalRecorder) -> set[str | None]:
    return {p for _, _, p, _ in recorder.snapshot()}


def aiokafka_roundtrip(bootstrap: str, topic: str, n: int = 10, **security: Any) -> list[tuple[bytes, bytes]]:
    import aiokafka

    async def main() -> list[tuple[bytes, bytes]]:
        producer = aiokafka.AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", **security)
        await producer.start()
        try:
            for key, value in expected_pairs(n):
                await producer.send_and_wait(topic, value=value, key=key, partition=0)
        finally:
            await producer.stop()
        consumer = aiokafka.AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, **security)
        await consumer.start()
        try:
            tp = aiokafka.TopicPartition(topic, 0)
            consumer.assign([tp])
            await consumer.seek_to_beginning(tp)
            seen: list[tuple[bytes, bytes]] = []
            while len(seen) < n:
                batch = await consumer.getmany(tp, timeout_ms=1000)
                seen += [(m.key, m.value) for m in batch.get(tp, [])]
            return seen
        finally:
            await consumer.stop()

    async def bounded() -> list[tuple[bytes, bytes]]:
        return await asyncio.wait_for(main(), 30)

    return asyncio.run(bounded())


def wait_for_auth_error(settings: dict[str, Any], seconds: float = 10) -> list[Any]:
    """Start a librdkafka producer that must fail to authenticate; its errors once one says so."""
    import confluent_kafka

    errors: list[Any] = []
    failed = threading.Event()

    def on_error(err: Any) -> None:
        errors.append(err)
        if err.code() == confluent_kafka.KafkaError._AUTHENTICATION:
            failed.set()

    producer = confluent_kafka.Producer({**settings, "error_cb": on_error, "reconnect.backoff.ms": 1000})
    deadline = time.monotonic() + seconds
    while not failed.is_set() and time.monotonic() < deadline:
        producer.poll(0.1)
    del producer
    assert failed.is_set(), errors
    return errors


# -- termination: clients log in to kproxy; the cluster has no SASL


@pytest.mark.parametrize("client", ["confluent", "kafka-python", "aiokafka", "confluent-plain"])
def test_clients_log_in_to_kproxy_by_scram(client: str, gate: SaslGate, users_file: Path, oidc: OidcProvider,
                                           recorder: PrincipalRecorder, kproxy_log: pytest.LogCaptureFixture) -> None:
    gate.require_sasl = False
    before = len(gate.authentications)
    topic = unique_name(f"term-{client}")
    logs = users_file.parent / "traffic"
    extra = f"traffic_log: {{dir: {logs}, compression: none}}" if client == "confluent" else ""
    with start_proxy(gate, recorder, sasl=termination(users_file, oidc), extra=extra) as proxy:
        if client == "confluent":
            got = confluent_roundtrip(librdkafka(proxy.bootstrap), topic)
        elif client == "confluent-plain":
            got = confluent_roundtrip(librdkafka(proxy.bootstrap, "PLAIN"), topic)
        elif client == "kafka-python":
            got = kafka_python_roundtrip({"bootstrap_servers": proxy.bootstrap, "security_protocol": "SASL_PLAINTEXT",
                                         "sasl_mechanism": "SCRAM-SHA-256", "sasl_plain_username": ALICE,
                                         "sasl_plain_password": ALICE_PASSWORD, "request_timeout_ms": 20000}, topic)
        else:
            got = aiokafka_roundtrip(proxy.bootstrap, topic, security_protocol="SASL_PLAINTEXT",
                                     sasl_mechanism="SCRAM-SHA-512", sasl_plain_username=ALICE,
                                     sasl_plain_password=ALICE_PASSWORD)
    assert got == expected_pairs()
    # Every request the filters saw (none before the login) was alice's; the broker saw no SASL at all.
    assert principals(recorder) == {f"User:{ALICE}"}
    assert gate.authentications[before:] == [] and gate.tokens == []
    text = kproxy_text(kproxy_log)
    assert "authenticated as User:alice" in text and "verified by kproxy" in text
    assert ALICE_PASSWORD not in text
    if extra:
        # The traffic log names the verified principal on every request that reached the broker.
        lines = [json.loads(line) for f in logs.rglob("*.jsonl*") for line in f.read_text().splitlines()]
        produced = [r for r in lines if r.get("api") == "produce"]
        assert produced and all(r["principal"] == f"User:{ALICE}" for r in produced)


def test_wrong_password_is_refused_and_reaches_no_broker(gate: SaslGate, users_file: Path, oidc: OidcProvider,
                                                         recorder: PrincipalRecorder,
                                                         kproxy_log: pytest.LogCaptureFixture) -> None:
    gate.require_sasl = False
    with start_proxy(gate, recorder, sasl=termination(users_file, oidc)) as proxy:
        accepted, forwarded = gate.accepted, len(gate.forwarded)
        errors = wait_for_auth_error(librdkafka(proxy.bootstrap, password=WRONG))
        # kafka-python too, with PLAIN (checked against the same SCRAM keys).
        import kafka
        import kafka.errors

        with pytest.raises(kafka.errors.KafkaTimeoutError):
            kafka.KafkaConsumer(bootstrap_servers=proxy.bootstrap, security_protocol="SASL_PLAINTEXT",
                                sasl_mechanism="PLAIN", sasl_plain_username=ALICE, sasl_plain_password=WRONG,
                                bootstrap_timeout_ms=2000)
        assert gate.accepted == accepted and len(gate.forwarded) == forwarded   # the broker saw nothing
    assert any("Authentication failed" in e.str() for e in errors)
    assert recorder.snapshot() == []
    text = kproxy_text(kproxy_log)
    assert "SASL login failed (SCRAM-SHA-512)" in text and "SASL login failed (PLAIN)" in text
    assert WRONG not in text and "authenticated as" not in text


def test_clients_log_in_to_kproxy_by_oauth(gate: SaslGate, users_file: Path, oidc: OidcProvider,
                                           recorder: PrincipalRecorder,
                                           kproxy_log: pytest.LogCaptureFixture) -> None:
    """confluent-kafka fetches its own token (OIDC client credentials); kafka-python and aiokafka hand
    one in. The provider rotates its signing key after the first: kproxy fetches the JWKS again for
    the new kid."""
    from kafka.net.sasl.oauth import AbstractTokenProvider

    gate.require_sasl = False
    with start_proxy(gate, recorder, sasl=termination(users_file, oidc)) as proxy:
        got = confluent_roundtrip(librdkafka_oidc(proxy.bootstrap, oidc), unique_name("oauth-c"))
        assert got == expected_pairs()
        fetched = oidc.jwks_requests
        oidc.signing_kid = oidc.add_key("k-rotated")

        class Tokens(AbstractTokenProvider):
            def token(self) -> str:
                return oidc.token("inventory")

        got = kafka_python_roundtrip({"bootstrap_servers": proxy.bootstrap, "security_protocol": "SASL_PLAINTEXT",
                                      "sasl_mechanism": "OAUTHBEARER", "sasl_oauth_token_provider": Tokens(),
                                      "request_timeout_ms": 20000}, unique_name("oauth-kp"))
        assert got == expected_pairs()
        assert oidc.jwks_requests > fetched

        import aiokafka.abc

        class AsyncTokens(aiokafka.abc.AbstractTokenProvider):
            async def token(self) -> str:
                return oidc.token("shipping")

        got = aiokafka_roundtrip(proxy.bootstrap, unique_name("oauth-ak"), security_protocol="SASL_PLAINTEXT",
                                 sasl_mechanism="OAUTHBEARER", sasl_oauth_token_provider=AsyncTokens())
        assert got == expected_pairs()
    assert principals(recorder) == {"User:orders", "User:inventory", "User:shipping"}
    assert "unknown kid k-rotated" in kproxy_text(kproxy_log)


def test_bad_tokens_are_refused_and_reach_no_broker(gate: SaslGate, users_file: Path, oidc: OidcProvider,
                                                    recorder: PrincipalRecorder,
                                                    kproxy_log: pytest.LogCaptureFixture) -> None:
    gate.require_sasl = False
    with start_proxy(gate, recorder, sasl=termination(users_file, oidc)) as proxy:
        accepted, forwarded = gate.accepted, len(gate.forwarded)
        errors = wait_for_auth_error(librdkafka_oidc(proxy.bootstrap, oidc, "stranger", "s"))
        assert gate.accepted == accepted and len(gate.forwarded) == forwarded
    assert any("invalid_token" in e.str() for e in errors), [e.str() for e in errors]
    assert recorder.snapshot() == []
    assert "token refused: wrong audience" in kproxy_text(kproxy_log)


# -- origination: kproxy logs in to an enforcing broker as its service account


def test_kproxy_originates_scram_for_clients_without_credentials(
        gate: SaslGate, tmp_path: Path, recorder: PrincipalRecorder, kproxy_log: pytest.LogCaptureFixture) -> None:
    gate.require_sasl = True
    secret = tmp_path / "password"
    secret.write_text(SERVICE_PASSWORD + "\n")
    before = len(gate.authentications)
    with start_proxy(gate, recorder, upstream_sasl=origination_scram(secret)) as proxy:
        got = confluent_roundtrip({"bootstrap.servers": proxy.bootstrap, "log_level": 0}, unique_name("orig"))
        assert got == expected_pairs()
        # A client that brings its own SASL is told kproxy holds the credentials; nothing is relayed.
        wait_for_auth_error(librdkafka(proxy.bootstrap))
    done = gate.authentications[before:]
    assert done and all(a.ok and a.user == SERVICE and a.mechanism == "SCRAM-SHA-512" for a in done)
    assert ALICE_PASSWORD.encode() not in b"".join(gate.tokens)
    assert gate.refused == [] or all(c for c, _ in gate.refused)
    text = kproxy_text(kproxy_log)
    assert "kproxy holds the cluster's credentials" in text
    assert SERVICE_PASSWORD not in text


def test_a_refused_origination_login_is_said_and_is_no_unreachable_broker(
        gate: SaslGate, tmp_path: Path, recorder: PrincipalRecorder, kproxy_log: pytest.LogCaptureFixture) -> None:
    gate.require_sasl = True
    secret = tmp_path / "password"
    secret.write_text("not the service password\n")
    with start_proxy(gate, recorder, upstream_sasl=origination_scram(secret)) as proxy:
        w = Wire(proxy.bootstrap, timeout=10)
        w.send(3, 12, 1, body_class(3, "request")(topics=[]))
        assert w.closed_by_peer()                   # no broker connection to be had: closed, with the reason
        w.close()
        # The broker was reached, so it is not counted as one kproxy cannot connect to.
        assert proxy.server.stats.upstream_connect_failures == {}
    text = kproxy_text(kproxy_log)
    refused = "the broker refused kproxy's SCRAM-SHA-512 login"
    assert f"discovery via {gate.bootstrap} failed: {refused}" in text, text
    assert f"lost the connection to {gate.bootstrap}: cannot connect: {refused}" in text, text
    assert "not the service password" not in text


def test_an_unanswered_origination_login_is_said_to_have_timed_out(
        tmp_path: Path, kproxy_log: pytest.LogCaptureFixture) -> None:
    # A listener that never accepts: the kernel completes the handshake and keeps what kproxy sends,
    # and nothing ever answers its login.
    silent = socket.create_server(("127.0.0.1", 0))
    bootstrap = f"127.0.0.1:{silent.getsockname()[1]}"
    port, broker_port = free_ports(2)
    cfg = parse_config(f"""\
listen: "127.0.0.1:{port}"
upstream:
  bootstrap_servers: ["{bootstrap}"]
  request_timeout_s: 0.5
  sasl: {{mechanism: PLAIN, username: {SERVICE}, password: {SERVICE_PASSWORD}}}
exposure: {{advertised_host: 127.0.0.1, broker_port_start: {broker_port}, broker_port_count: 1}}
""")
    try:
        with ProxyThread(cfg).start() as proxy:
            w = Wire(proxy.bootstrap, timeout=10)
            w.send(3, 12, 1, body_class(3, "request")(topics=[]))
            assert w.closed_by_peer()
            w.close()
            assert proxy.server.stats.upstream_connect_failures == {}
    finally:
        silent.close()
    text = kproxy_text(kproxy_log)
    assert f"discovery via {bootstrap} failed: timed out" in text, text
    assert f"lost the connection to {bootstrap}: cannot connect: timed out" in text, text
    assert SERVICE_PASSWORD not in text


def test_kproxy_originates_oauthbearer_with_a_client_credentials_token(
        gate: SaslGate, oidc: OidcProvider, tmp_path: Path, recorder: PrincipalRecorder,
        kproxy_log: pytest.LogCaptureFixture) -> None:
    gate.require_sasl = True
    secret = tmp_path / "client-secret"
    secret.write_text(KPROXY_SECRET)
    before, asked = len(gate.authentications), len(oidc.token_requests)
    upstream_sasl = f"""\
  sasl:
    mechanism: OAUTHBEARER
    oauth:
      token_endpoint_url: {oidc.token_url}
      client_id: kproxy
      client_secret_file: {secret}
      scope: kafka
"""
    with start_proxy(gate, recorder, upstream_sasl=upstream_sasl) as proxy:
        got = kafka_python_roundtrip({"bootstrap_servers": proxy.bootstrap, "request_timeout_ms": 20000},
                                     unique_name("orig-oauth"))
    assert got == expected_pairs()
    done = gate.authentications[before:]
    assert done and all(a.ok and a.user == "kproxy" and a.mechanism == "OAUTHBEARER" for a in done)
    # One token, reused by every broker connection until it nears its expiry.
    assert oidc.token_requests[asked:] == [("kproxy", "kafka")]
    assert KPROXY_SECRET not in kproxy_text(kproxy_log)


# -- both at once, with KIP-368 on both sides


def produce_steadily_and_read_back(settings: dict[str, Any], topic: str, seconds: float,
                                   pause: Callable[[int], float]) -> None:
    """librdkafka produces numbered records to partition 0 of ``topic`` for ``seconds`` (``pause(n)``
    after the n-th), then reads them back: every one delivered without error, once, in order."""
    import confluent_kafka

    producer = confluent_kafka.Producer({**settings, "acks": "all", "linger.ms": 5})
    delivered: list[Any] = []
    sent = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        producer.produce(topic, value=b"%07d" % sent, partition=0, on_delivery=lambda err, msg: delivered.append(err))
        sent += 1
        producer.poll(pause(sent))
    assert producer.flush(20) == 0
    del producer
    consumer = confluent_kafka.Consumer({**settings, "group.id": "unused", "enable.auto.commit": False})
    try:
        consumer.assign([confluent_kafka.TopicPartition(topic, 0, confluent_kafka.OFFSET_BEGINNING)])
        values: list[bytes] = []
        end = time.monotonic() + 30
        while len(values) < sent and time.monotonic() < end:
            m = consumer.poll(0.2)
            if m is not None and not m.error():
                values.append(m.value() or b"")
    finally:
        consumer.close()
    assert len(delivered) == sent and all(err is None for err in delivered)
    assert values == [b"%07d" % i for i in range(sent)]


def test_reauthentication_on_both_sides_loses_no_record(gate: SaslGate, users_file: Path, oidc: OidcProvider,
                                                         tmp_path: Path, recorder: PrincipalRecorder,
                                                         kproxy_log: pytest.LogCaptureFixture) -> None:
    """Clients log in to kproxy by SCRAM with 3 s sessions; kproxy logs in to the broker as its
    service account, which grants 3 s sessions too. A producer keeps sending for 8 s: both sides
    re-authenticate on their live connections, and every record arrives once, in order. (With 2 s
    sessions on a loaded machine, a client connection was seen closed at its session's end before
    librdkafka's re-authentication was handled.)"""
    gate.require_sasl = True
    gate.session_lifetime_ms = 3000
    secret = tmp_path / "password"
    secret.write_text(SERVICE_PASSWORD)
    before = len(gate.authentications)
    topic = unique_name("reauth-both")
    try:
        with start_proxy(gate, recorder, upstream_sasl=origination_scram(secret, "SCRAM-SHA-256"),
                         sasl=termination(users_file, oidc, max_session_s=3)) as proxy:
            produce_steadily_and_read_back(librdkafka(proxy.bootstrap), topic, 8, lambda sent: 0.02)
    finally:
        gate.session_lifetime_ms = 0
    upstream = gate.authentications[before:]
    assert all(a.ok and a.user == SERVICE for a in upstream)
    assert any(a.reauthentication for a in upstream), upstream   # kproxy re-authenticated to the broker
    assert gate.expired == []                                      # and never let a session lapse
    assert gate.too_soon == []                                     # nor began one within a second
    text = kproxy_text(kproxy_log)
    # The client re-authenticated to kproxy, session after session, never refused as too soon.
    assert text.count("re-authenticated as User:alice") >= 2, text
    assert "refused: it began" not in text
    assert "re-authenticated kproxy to" in text
    assert principals(recorder) == {f"User:{ALICE}"}


def test_a_reauthentication_within_a_second_of_the_last_is_refused_and_the_connection_goes_on(
        gate: SaslGate, users_file: Path, oidc: OidcProvider, kproxy_log: pytest.LogCaptureFixture) -> None:
    """On a real socket: PLAIN login, a re-authentication at once (the first is never too soon), then
    a SaslHandshake sent straight after it: refused ILLEGAL_SASL_STATE, as Kafka's broker refuses
    it, with no password checked; the connection still serves requests, and a second later the
    next re-authentication is accepted."""
    from kproxy.protocol.messages import Request, encode_request_frame

    gate.require_sasl = False
    plain = f"\x00{ALICE}\x00{ALICE_PASSWORD}".encode()

    def frame(key: int, version: int, cid: int, **fields: Any) -> bytes:
        req = Request.build(key, version, cid, "reauth-probe", body_class(key, "request")(**fields))
        return b"".join(bytes(b) for b in encode_request_frame(req))

    def login(w: Wire, cid: int) -> None:
        w.send_raw(frame(17, 1, cid, mechanism="PLAIN") + frame(36, 2, cid + 1, auth_bytes=plain))
        assert w.receive(17, 1).body.error_code == 0
        assert w.receive(36, 2).body.error_code == 0

    with start_proxy(gate, None, sasl=termination(users_file, oidc, max_session_s=60)) as proxy:
        w = Wire(proxy.bootstrap, timeout=20)
        try:
            login(w, 1)
            # The first re-authentication and, in the same write, the start of another.
            w.send_raw(frame(17, 1, 3, mechanism="PLAIN") + frame(36, 2, 4, auth_bytes=plain)
                       + frame(17, 1, 5, mechanism="PLAIN"))
            assert w.receive(17, 1).body.error_code == 0
            started = time.monotonic()              # kproxy began that one before it answered
            assert w.receive(36, 2).body.error_code == 0
            refused = w.receive(17, 1).body
            assert (refused.error_code, refused.mechanisms) == (34, [])    # ILLEGAL_SASL_STATE
            assert w.metadata(6).body.brokers                                # still logged in
            time.sleep(max(0.0, started + 1.05 - time.monotonic()))
            login(w, 7)                                                      # a second on: accepted
            assert w.metadata(9).body.brokers
        finally:
            w.close()
        assert proxy.server.identity.logins == {("PLAIN", "ok"): 1, ("PLAIN", "reauthenticated"): 2,
                                                ("PLAIN", "reauth_too_soon"): 1}
    text = kproxy_text(kproxy_log)
    assert "re-authentication of User:alice (PLAIN) refused: it began " in text, text
    assert ALICE_PASSWORD not in text


def test_with_max_session_0_reauthentication_and_a_stray_saslauthenticate_are_refused_as_kafka_refuses_them(
        gate: SaslGate, users_file: Path, oidc: OidcProvider, kproxy_log: pytest.LogCaptureFixture) -> None:
    """On a real socket, with ``max_session_s: 0`` (Kafka's ``connections.max.reauth.ms=0``): after a
    PLAIN login, a re-authentication's SaslHandshake and SaslAuthenticate both get ILLEGAL_SASL_STATE
    and no password is checked (KafkaChannel does not begin it, KafkaApis answers both); so does a
    SaslAuthenticate with no handshake; the connection serves requests throughout. No client library
    sends these on a session with no end, so the frames are written by hand."""
    from kproxy.protocol.messages import Request, encode_request_frame

    gate.require_sasl = False
    plain = f"\x00{ALICE}\x00{ALICE_PASSWORD}".encode()

    def frame(key: int, version: int, cid: int, **fields: Any) -> bytes:
        req = Request.build(key, version, cid, "reauth-probe", body_class(key, "request")(**fields))
        return b"".join(bytes(b) for b in encode_request_frame(req))

    with start_proxy(gate, None, sasl=termination(users_file, oidc, max_session_s=0)) as proxy:
        w = Wire(proxy.bootstrap, timeout=20)
        try:
            w.send_raw(frame(17, 1, 1, mechanism="PLAIN") + frame(36, 2, 2, auth_bytes=plain))
            assert w.receive(17, 1).body.error_code == 0
            assert w.receive(36, 2).body.session_lifetime_ms == 0
            w.send_raw(frame(17, 1, 3, mechanism="PLAIN") + frame(36, 2, 4, auth_bytes=b"\x00alice\x00wrong")
                       + frame(36, 1, 5, auth_bytes=plain))
            refused = w.receive(17, 1).body
            assert (refused.error_code, refused.mechanisms) == (34, [])      # ILLEGAL_SASL_STATE
            assert w.receive(36, 2).body.error_code == 34
            assert w.receive(36, 1).body.error_code == 34
            assert w.metadata(6).body.brokers                                 # still logged in
        finally:
            w.close()
        assert proxy.server.identity.logins == {("PLAIN", "ok"): 1, ("PLAIN", "reauth_disabled"): 1,
                                                ("PLAIN", "authenticate_after_login"): 2}
    text = kproxy_text(kproxy_log)
    assert "re-authentication of User:alice (PLAIN) refused: the session has no end" in text, text
    assert "SASL login failed" not in text and ALICE_PASSWORD not in text


def test_before_login_a_request_or_a_big_frame_closes_the_connection(gate: SaslGate, users_file: Path,
                                                                     oidc: OidcProvider,
                                                                     recorder: PrincipalRecorder) -> None:
    from kproxy.protocol.messages import Request, body_class, encode_request_frame

    gate.require_sasl = False
    with start_proxy(gate, recorder, sasl=termination(users_file, oidc)) as proxy:
        accepted, forwarded = gate.accepted, len(gate.forwarded)
        host, port = proxy.bootstrap.rsplit(":", 1)
        metadata = Request.build(3, 12, 1, "probe", body_class(3, "request")(topics=None))
        for payload in (b"".join(bytes(b) for b in encode_request_frame(metadata)),
                        struct.pack(">i", 1 << 20) + b"\x00" * 65536):    # 1 MiB claimed before login
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                try:
                    sock.sendall(payload)
                    got = sock.recv(4096)
                except ConnectionResetError:     # closed with unread bytes pending: a reset
                    got = b""
                assert got == b""                    # closed, not answered
        assert gate.accepted == accepted and len(gate.forwarded) == forwarded
    assert recorder.snapshot() == []


def test_an_idle_broker_connection_is_re_authenticated_not_replaced(gate: SaslGate, tmp_path: Path,
                                                                   recorder: PrincipalRecorder,
                                                                   kproxy_log: pytest.LogCaptureFixture) -> None:
    """A client that sends nothing for several of the broker's session lifetimes keeps its broker
    connection: kproxy logs in again on it before each session ends (KIP-368), and the next request
    goes on the same connection. The gate closes a connection whose session has ended at its next
    request, a SaslHandshake included, so a login again that came too late would show."""
    gate.require_sasl = True
    gate.session_lifetime_ms = 2000
    secret = tmp_path / "password"
    secret.write_text(SERVICE_PASSWORD)
    expired = len(gate.expired)
    try:
        with start_proxy(gate, recorder, upstream_sasl=origination_scram(secret)) as proxy:
            forwarded = len(gate.forwarded)
            w = Wire(proxy.bootstrap, timeout=20)
            try:
                assert w.metadata(1).body.brokers
                (connection,) = {c for c, api, _ in gate.forwarded[forwarded:] if api == 3}
                accepted = gate.accepted

                def again_on_it() -> int:
                    return len([a for a in gate.authentications if a.connection == connection and a.reauthentication])

                # The client idles while the broker's sessions (2 s) end one after another.
                deadline = time.monotonic() + 30
                while again_on_it() < 2:
                    assert time.monotonic() < deadline, gate.authentications
                    time.sleep(0.05)
                assert w.metadata(2).body.brokers
            finally:
                w.close()
            assert gate.accepted == accepted                          # no connection opened meanwhile
            assert {c for c, api, _ in gate.forwarded[forwarded:] if api == 3} == {connection}
    finally:
        gate.session_lifetime_ms = 0
    assert all(a.ok for a in gate.authentications if a.connection == connection)
    assert gate.expired[expired:] == []                              # no session ever ran out
    assert gate.too_soon == []                                       # nor was one begun too soon
    text = kproxy_text(kproxy_log)
    assert "re-authenticated kproxy to" in text and "lost the connection" not in text


def test_a_steady_producer_loses_nothing_while_kproxy_re_authenticates(gate: SaslGate, tmp_path: Path,
                                                                       recorder: PrincipalRecorder) -> None:
    """librdkafka with its default pipelining (five requests in flight) produces for 8 s through
    kproxy, whose broker sessions last 3 s: kproxy logs in again on the producer's broker
    connection at least twice, and every record arrives once, in order."""
    gate.require_sasl = True
    gate.session_lifetime_ms = 3000
    secret = tmp_path / "password"
    secret.write_text(SERVICE_PASSWORD)
    topic = unique_name("reauth-steady")
    before, expired = len(gate.authentications), len(gate.expired)
    try:
        with start_proxy(gate, recorder, upstream_sasl=origination_scram(secret, "SCRAM-SHA-256")) as proxy:
            produce_steadily_and_read_back({"bootstrap.servers": proxy.bootstrap, "log_level": 0}, topic, 8,
                                           lambda sent: 0.002 if sent % 50 else 0.02)
    finally:
        gate.session_lifetime_ms = 0
    done = gate.authentications[before:]
    assert all(a.ok and a.user == SERVICE for a in done)
    per_connection: dict[int, int] = {}
    for a in done:
        if a.reauthentication:
            per_connection[a.connection] = per_connection.get(a.connection, 0) + 1
    assert max(per_connection.values(), default=0) >= 2, done      # the producer's connection, again and again
    assert gate.expired[expired:] == []
    assert gate.too_soon == []


@pytest.fixture(scope="module")
def sasl_ssl(tansu_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, SaslGate, Path]]:
    """A SASL_SSL listener: TLS (a relay with a trustme certificate) in front of the SASL gate in
    front of tansu, which advertises the TLS address."""
    import ssl

    import trustme

    from tests.e2e.test_tls import TlsRelay

    d = tmp_path_factory.mktemp("sasl-ssl")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1", "localhost").configure_cert(ctx)
    g = SaslGate(None, {SERVICE: SERVICE_PASSWORD})
    with TlsRelay(ctx) as relay, Tansu(tansu_binary, advertised=relay.address, log_path=d / "broker.log") as tansu:
        g.upstream = (tansu.host, tansu.port)
        relay.target = g.address
        with g:
            yield relay, g, d / "ca.pem"
    assert g.errors == []


def test_kproxy_originates_sasl_ssl(sasl_ssl: tuple[Any, SaslGate, Path], tmp_path: Path,
                                    recorder: PrincipalRecorder) -> None:
    relay, tls_gate, ca = sasl_ssl
    secret = tmp_path / "password"
    secret.write_text(SERVICE_PASSWORD)
    port, broker_port = free_ports(2)
    cfg = parse_config(f"""\
listen: "127.0.0.1:{port}"
upstream:
  bootstrap_servers: ["{relay.address[0]}:{relay.address[1]}"]
  tls: {{enabled: true, ca_file: {ca}}}
{origination_scram(secret)}
exposure: {{advertised_host: 127.0.0.1, broker_port_start: {broker_port}, broker_port_count: 1}}
""")
    tls_connections = len(relay.peer_subjects)
    with ProxyThread(cfg, [recorder]) as proxy:
        got = confluent_roundtrip({"bootstrap.servers": proxy.bootstrap, "log_level": 0}, unique_name("sasl-ssl"))
    assert got == expected_pairs()
    assert len(relay.peer_subjects) > tls_connections and relay.handshake_errors == []
    done = tls_gate.authentications
    assert done and all(a.ok and a.user == SERVICE for a in done)
    assert tls_gate.tokens and not any(SERVICE_PASSWORD.encode() in t for t in tls_gate.tokens)  # SCRAM never sends it


def fleet_coordination(tmp_path: Path, fleet: str, stale_after_s: float) -> str:
    """Configuration for a quota rule and fleet coordination every 100 ms on a topic of its own."""
    rules = tmp_path / "rules.yaml"
    rules.write_text("quotas:\n  - name: q\n    match: {client_id: x}\n    produce_bytes_per_s: 1000\n")
    return (f"rules: [{rules}]\nquota:\n  coordination: {{fleet: {fleet}, topic: {unique_name('kproxy-quotas')}, "
            f"publish_interval_ms: 100, stale_after_s: {stale_after_s:g}}}\n")


def test_fleet_quota_coordination_logs_in_as_kproxy(gate: SaslGate, tmp_path: Path,
                                                    recorder: PrincipalRecorder) -> None:
    # The coordinator's own broker connections go through the same origination as every other one.
    gate.require_sasl = True
    secret = tmp_path / "password"
    secret.write_text(SERVICE_PASSWORD + "\n")
    before = len(gate.authentications)
    with start_proxy(gate, recorder, upstream_sasl=origination_scram(secret),
                     extra=fleet_coordination(tmp_path, "sasl", stale_after_s=1)) as proxy:
        coordinator = proxy.server.coordinator
        assert coordinator is not None
        deadline = time.monotonic() + 20
        while not proxy.call(lambda: coordinator.up):
            assert time.monotonic() < deadline, coordinator.last_error
            time.sleep(0.05)
    done = gate.authentications[before:]
    assert len(done) >= 2 and all(a.ok and a.user == SERVICE for a in done)   # discovery and coordination


def test_fleet_quota_coordination_re_authenticates_on_its_connection(gate: SaslGate, tmp_path: Path,
                                                                     recorder: PrincipalRecorder) -> None:
    """The broker grants 3 s sessions: the coordinator's connection logs in again before each ends
    (KIP-368), as a client's does, instead of being closed by the broker and opened anew."""
    gate.require_sasl = True
    gate.session_lifetime_ms = 3000
    secret = tmp_path / "password"
    secret.write_text(SERVICE_PASSWORD + "\n")
    before, expired = len(gate.authentications), len(gate.expired)
    try:
        with start_proxy(gate, recorder, upstream_sasl=origination_scram(secret),
                         extra=fleet_coordination(tmp_path, "sasl-reauth", stale_after_s=5)) as proxy:
            coordinator = proxy.server.coordinator
            assert coordinator is not None
            deadline = time.monotonic() + 30
            while len([a for a in gate.authentications[before:] if a.reauthentication]) < 2:
                assert time.monotonic() < deadline, (gate.authentications[before:], coordinator.last_error)
                time.sleep(0.05)
            up, switches, last_error = proxy.call(lambda: (coordinator.up, coordinator.switches,
                                                           coordinator.last_error))
    finally:
        gate.session_lifetime_ms = 0
    done = gate.authentications[before:]
    assert all(a.ok and a.user == SERVICE for a in done)
    again = [a for a in done if a.reauthentication]
    # Both re-authentications on one connection, which had logged in first; none lapsed.
    assert len({a.connection for a in again}) == 1
    assert any(a.connection == again[0].connection and not a.reauthentication for a in done)
    assert gate.expired[expired:] == [], (done, gate.expired)
    assert up and switches == 1 and last_error is None, (up, switches, last_error)

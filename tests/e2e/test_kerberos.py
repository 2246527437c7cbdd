"""Kerberos (SASL/GSSAPI) through kproxy with a real MIT KDC (the session's test realm, tests/kdc.py)
and real clients: kafka-python logs in to kproxy with a ticket from the KDC and policy rules judge the
mapped principal; a wrong keytab, an expired ticket and a principal no rule maps are refused before
anything reaches the broker; kproxy logs in to a Kerberos-secured broker as its own principal,
renewing its ticket and re-authenticating (KIP-368) under a steady producer; and both at once.

The broker is tansu behind ``sasl_gate.SaslGate``: open for the termination tests (it counts what
reaches it), enforcing GSSAPI for origination, with a real ``gssapi`` acceptor and the KDC's keytab
for ``kafka/127.0.0.1`` (tansu has no Kerberos). kproxy is advertised as ``localhost``, so clients
ask for ``kafka/localhost``, the principal its keytab holds, as in a sidecar. The process's Kerberos
environment points at the realm for each test (``kerberos_env``), with ``KRB5_KTNAME`` naming a
keytab that holds nothing useful: kproxy uses the keytabs its configuration names.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gssapi
import pytest

from kproxy.protocol.messages import body_class
from kproxy.server.embedded import ProxyThread
from kproxy.telemetry.metrics import kerberos_families
from tests.e2e.sasl_gate import SaslGate, expected_pairs, kafka_python_roundtrip
from tests.e2e.tansu import Tansu, unique_name
from tests.e2e.test_identity import produce_steadily_and_read_back
from tests.e2e.test_identity import start_proxy as identity_proxy
from tests.e2e.test_sasl import PrincipalRecorder, kproxy_text
from tests.e2e.wire import Wire
from tests.kdc import Realm

pytestmark = pytest.mark.e2e

KPROXY_SERVICE = "kafka/localhost"          # what clients of kproxy ask for (kproxy is advertised as localhost)
BROKER_SERVICE = "kafka/127.0.0.1"          # the gate's principal (kproxy reaches it at 127.0.0.1)
SASL_HANDSHAKE, SASL_AUTHENTICATE, PRODUCE = 17, 36, 0
SASL_AUTHENTICATION_FAILED = 58


@pytest.fixture(scope="module")
def gate(kerberos_realm: Realm, tansu_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SaslGate]:
    folder = tmp_path_factory.mktemp("kerberos-gate")
    principal = kerberos_realm.add_principal(BROKER_SERVICE)
    keytab = kerberos_realm.keytab(folder / "broker.keytab", principal)
    g = SaslGate(None, {}, mechanisms=(), gssapi=(str(keytab), principal))
    g.require_sasl = False
    with Tansu(tansu_binary, advertised=g.address, log_path=folder / "broker.log") as tansu:
        g.upstream = (tansu.host, tansu.port)
        with kerberos_realm.environment(folder / "gate-cc"), g:
            yield g
    assert g.errors == []


@pytest.fixture
def kproxy_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO)
    return caplog


def user(realm: Realm, name: str, tmp_path: Path, lifetime: str | None = None) -> str:
    """A user with a ticket-granting ticket in the test's credential cache (KRB5CCNAME)."""
    principal = realm.add_principal(name)
    realm.kinit(principal, realm.keytab(tmp_path / f"{name}.keytab", principal), tmp_path / "krb5cc",
                lifetime=lifetime)
    return principal


def kproxy_keytab(realm: Realm, tmp_path: Path) -> Path:
    """kproxy's service keytab for kafka/localhost, with a fresh key (any keytab written before is stale)."""
    realm.add_principal(KPROXY_SERVICE)
    return realm.keytab(tmp_path / "kproxy.keytab", KPROXY_SERVICE)


def termination(realm: Realm, keytab: Path, rules: tuple[str, ...] = ("DEFAULT",)) -> str:
    listed = ", ".join(f"'{r}'" for r in rules)
    return f"""\
sasl:
  mechanisms: [GSSAPI]
  failed_login_delay_s: 0.1
  gssapi:
    principal: {realm.principal(KPROXY_SERVICE)}
    keytab: {keytab}
    principal_to_local: [{listed}]
"""


def origination(realm: Realm, principal: str, keytab: Path) -> str:
    return f"""\
  sasl:
    mechanism: GSSAPI
    principal: {principal}
    keytab: {keytab}
    service_name: kafka
"""


def start_proxy(gate: SaslGate, recorder: PrincipalRecorder | None = None, **sections: str) -> ProxyThread:
    """test_identity's kproxy, advertising ``localhost``: a client's service ticket names that host."""
    return identity_proxy(gate, recorder, advertised_host="localhost", **sections)


def kafka_python(proxy: ProxyThread, **extra: Any) -> dict[str, Any]:
    port = proxy.bootstrap.rsplit(":", 1)[1]
    return {"bootstrap_servers": f"localhost:{port}", "security_protocol": "SASL_PLAINTEXT",
            "sasl_mechanism": "GSSAPI", "sasl_kerberos_service_name": "kafka", "request_timeout_ms": 20000, **extra}


def failures(proxy: ProxyThread) -> dict[tuple[str, str], float]:
    """kproxy_kerberos_failures as /metrics shows it."""
    (family,) = kerberos_families(proxy.server.identity.kerberos)
    return {(s.labels["side"], s.labels["kind"]): s.value for s in family.samples if s.name.endswith("_total")}


def raw_login(proxy: ProxyThread, token: bytes) -> Any:
    """SaslHandshake GSSAPI and one SaslAuthenticate with ``token``, on a bare connection: the answer."""
    w = Wire(proxy.bootstrap, timeout=20)
    try:
        w.send(SASL_HANDSHAKE, 1, 1, body_class(SASL_HANDSHAKE, "request")(mechanism="GSSAPI"))
        assert w.receive(SASL_HANDSHAKE, 1).body.error_code == 0
        w.send(SASL_AUTHENTICATE, 2, 2, body_class(SASL_AUTHENTICATE, "request")(auth_bytes=token))
        answer = w.receive(SASL_AUTHENTICATE, 2).body
        assert w.closed_by_peer()                       # a failed login ends the connection
        return answer
    finally:
        w.close()


def first_token(realm: Realm) -> bytes:
    name = gssapi.Name(f"{KPROXY_SERVICE}@{realm.realm}", gssapi.NameType.kerberos_principal)
    return gssapi.SecurityContext(name=name, usage="initiate").step(None)


# -- termination: clients log in to kproxy with Kerberos; the cluster has no SASL


def test_kafka_python_logs_in_by_kerberos_and_rules_judge_the_mapped_principal(
        gate: SaslGate, kerberos_env: Realm, tmp_path: Path, kproxy_log: pytest.LogCaptureFixture) -> None:
    import kafka
    import kafka.errors

    alice = user(kerberos_env, "alice", tmp_path)
    keytab = kproxy_keytab(kerberos_env, tmp_path)
    allowed, denied = unique_name("krb-payments"), unique_name("krb-audit")
    rules = tmp_path / "rules.yaml"
    rules.write_text("""\
rules:
  - name: alice-payments
    match: {principal: "User:alice", topic: "krb-payments-*"}
    action: allow
  - name: alice-nothing-else
    match: {principal: "User:alice", topic: "krb-*"}
    action: deny
""")
    recorder = PrincipalRecorder()
    sasl = termination(kerberos_env, keytab, ("RULE:[1:$1@$0](.*@KPROXY.TEST)s/@.*//",))
    with start_proxy(gate, recorder, sasl=sasl, extra=f"rules: [{rules}]") as proxy:
        settings = kafka_python(proxy)
        got = kafka_python_roundtrip(settings, allowed)
        assert got == expected_pairs()
        produced = sum(1 for _, api, _ in gate.forwarded if api == PRODUCE)
        producer = kafka.KafkaProducer(acks="all", max_block_ms=20000, **settings)
        try:
            with pytest.raises(kafka.errors.TopicAuthorizationFailedError):
                producer.send(denied, b"refused").get(20)
        finally:
            producer.close(10)
        # kproxy answered the refused Produce itself: no Produce of it reached the broker.
        assert sum(1 for _, api, _ in gate.forwarded if api == PRODUCE) == produced
    assert {p for _, _, p, _ in recorder.snapshot()} == {"User:alice"}
    assert gate.authentications == [] and gate.tokens == []        # the broker saw no SASL at all
    text = kproxy_text(kproxy_log)
    assert "authenticated as User:alice (GSSAPI, verified by kproxy" in text
    assert alice == "alice@KPROXY.TEST"


def test_a_wrong_keytab_is_refused_and_reaches_no_broker(gate: SaslGate, kerberos_env: Realm, tmp_path: Path,
                                                         kproxy_log: pytest.LogCaptureFixture) -> None:
    import kafka
    import kafka.errors

    user(kerberos_env, "alice", tmp_path)
    stale = kproxy_keytab(kerberos_env, tmp_path).rename(tmp_path / "stale.keytab")
    kproxy_keytab(kerberos_env, tmp_path)               # the KDC now issues tickets for a newer key
    with start_proxy(gate, sasl=termination(kerberos_env, stale)) as proxy:
        accepted, forwarded = gate.accepted, len(gate.forwarded)
        answer = raw_login(proxy, first_token(kerberos_env))
        assert answer.error_code == SASL_AUTHENTICATION_FAILED
        assert answer.error_message == "Authentication failed: invalid credentials"
        with pytest.raises(kafka.errors.KafkaTimeoutError):
            kafka.KafkaConsumer(bootstrap_timeout_ms=3000, **kafka_python(proxy))
        assert gate.accepted == accepted and len(gate.forwarded) == forwarded     # the broker saw nothing
        assert failures(proxy)[("accept", "keytab")] >= 2
    text = kproxy_text(kproxy_log)
    refused = f"SASL login failed (GSSAPI): GSSAPI: a client's ticket for kafka/*@KPROXY.TEST refused (keytab {stale})"
    assert refused in text, text
    assert "authenticated as" not in text


def test_an_expired_ticket_is_refused_and_reaches_no_broker(gate: SaslGate, kerberos_env: Realm, tmp_path: Path,
                                                            kproxy_log: pytest.LogCaptureFixture) -> None:
    keytab = kproxy_keytab(kerberos_env, tmp_path)
    user(kerberos_env, "brief", tmp_path, lifetime="2s")
    ends = time.time() + gssapi.Credentials(usage="initiate").lifetime
    token = first_token(kerberos_env)                   # made while the ticket was good
    while time.time() <= ends + kerberos_env.clockskew + 1.5:   # the clock passes its end and the skew allowed
        time.sleep(0.1)
    with start_proxy(gate, sasl=termination(kerberos_env, keytab)) as proxy:
        accepted, forwarded = gate.accepted, len(gate.forwarded)
        answer = raw_login(proxy, token)
        assert answer.error_code == SASL_AUTHENTICATION_FAILED
        assert gate.accepted == accepted and len(gate.forwarded) == forwarded
        assert failures(proxy)[("accept", "expired")] == 1
    assert "Ticket expired" in kproxy_text(kproxy_log)


def test_a_principal_no_rule_maps_is_refused_and_reaches_no_broker(
        gate: SaslGate, kerberos_env: Realm, tmp_path: Path, kproxy_log: pytest.LogCaptureFixture) -> None:
    import kafka
    import kafka.errors

    user(kerberos_env, "mallory", tmp_path)
    keytab = kproxy_keytab(kerberos_env, tmp_path)
    sasl = termination(kerberos_env, keytab, ("RULE:[1:$1@$0](alice@KPROXY.TEST)s/@.*//",))
    with start_proxy(gate, sasl=sasl) as proxy:
        accepted, forwarded = gate.accepted, len(gate.forwarded)
        with pytest.raises(kafka.errors.KafkaTimeoutError):
            kafka.KafkaConsumer(bootstrap_timeout_ms=3000, **kafka_python(proxy))
        assert gate.accepted == accepted and len(gate.forwarded) == forwarded
    assert "'mallory@KPROXY.TEST' has no local name" in kproxy_text(kproxy_log)


# -- origination: kproxy logs in to a Kerberos-secured broker as its own principal


def test_kproxy_re_authenticates_and_renews_its_ticket_under_a_steady_producer(
        gate: SaslGate, kerberos_env: Realm, tmp_path: Path, kproxy_log: pytest.LogCaptureFixture) -> None:
    """The broker grants 3 s sessions; kproxy's tickets last 8 s. librdkafka produces in plaintext to
    kproxy for 12 s: kproxy logs in again on its live broker connections before each session ends
    (KIP-368), gets a new ticket from its keytab before the old one ends, and every record arrives
    once, in order."""
    principal = kerberos_env.add_principal("kproxy/127.0.0.1", max_life="8 seconds")
    keytab = kerberos_env.keytab(tmp_path / "kproxy.keytab", principal)
    gate.require_sasl = True
    gate.session_lifetime_ms = 3000
    before, expired = len(gate.authentications), len(gate.expired)
    try:
        with start_proxy(gate, upstream_sasl=origination(kerberos_env, principal, keytab)) as proxy:
            produce_steadily_and_read_back({"bootstrap.servers": proxy.bootstrap, "log_level": 0},
                                           unique_name("krb-steady"), 12, lambda sent: 0.002 if sent % 50 else 0.02)
            assert proxy.server.identity.originator.kerberos.tickets >= 2       # renewed from the keytab
    finally:
        gate.require_sasl = False
        gate.session_lifetime_ms = 0
    done = gate.authentications[before:]
    assert done and all(a.ok and a.user == principal and a.mechanism == "GSSAPI" for a in done), done
    again: dict[int, int] = {}
    for a in done:
        if a.reauthentication:
            again[a.connection] = again.get(a.connection, 0) + 1
    assert max(again.values(), default=0) >= 2, done
    assert gate.expired[expired:] == []
    issued = [line for line in kerberos_env.kdc_log().splitlines() if f"{principal} for krbtgt/" in line
              and "ISSUE" in line]
    assert len(issued) >= 2
    text = kproxy_text(kproxy_log)
    assert "re-authenticated kproxy to" in text and f"kproxy got a Kerberos ticket for {principal}" in text


def test_kerberos_on_both_sides(gate: SaslGate, kerberos_env: Realm, tmp_path: Path) -> None:
    """kafka-python logs in to kproxy as alice with Kerberos; kproxy logs in to the broker as itself."""
    user(kerberos_env, "alice", tmp_path)
    keytab = kproxy_keytab(kerberos_env, tmp_path)
    principal = kerberos_env.add_principal("kproxy/both")
    own = kerberos_env.keytab(tmp_path / "own.keytab", principal)
    recorder = PrincipalRecorder()
    gate.require_sasl = True
    before = len(gate.authentications)
    try:
        with start_proxy(gate, recorder, upstream_sasl=origination(kerberos_env, principal, own),
                         sasl=termination(kerberos_env, keytab)) as proxy:
            got = kafka_python_roundtrip(kafka_python(proxy), unique_name("krb-both"))
    finally:
        gate.require_sasl = False
    assert got == expected_pairs()
    assert {p for _, _, p, _ in recorder.snapshot()} == {"User:alice"}
    done = gate.authentications[before:]
    assert done and {a.user for a in done} == {principal}


def test_an_origination_login_the_kdc_refuses_is_said_with_its_reason(
        gate: SaslGate, kerberos_env: Realm, tmp_path: Path, kproxy_log: pytest.LogCaptureFixture) -> None:
    principal = kerberos_env.add_principal("kproxy/retired")
    keytab = kerberos_env.keytab(tmp_path / "kproxy.keytab", principal)
    kerberos_env.delete_principal(principal)            # the KDC no longer knows kproxy
    gate.require_sasl = True
    try:
        with start_proxy(gate, upstream_sasl=origination(kerberos_env, principal, keytab)) as proxy:
            w = Wire(proxy.bootstrap, timeout=20)
            w.send(3, 12, 1, body_class(3, "request")(topics=[]))
            assert w.closed_by_peer()
            w.close()
            assert failures(proxy)[("initiate", "unknown_principal")] >= 1
    finally:
        gate.require_sasl = False
    text = kproxy_text(kproxy_log)
    reason = f"SASL GSSAPI login to {gate.bootstrap} failed: {principal} could not get a ticket from the KDC"
    assert reason in text and "not found in Kerberos database" in text, text

"""SASL GSSAPI (RFC 4752) on kproxy's accepting side, with real tickets from the session's test KDC
(tests/kdc.py): the state machine in kproxy.identity.termination driving kproxy's keytab acceptor
(kproxy.server.kerberos), a client written here on the ``gssapi`` package, and the refusals a person
has to act on (a wrong keytab, an expired ticket, a principal no rule maps, a ticket for another
service), each with its reason and its kind counted. Also kproxy's own ticket renewal (origination)
and the keytab check behind ``kproxy check``."""

from __future__ import annotations

import time
from pathlib import Path

import gssapi
import pytest

from kproxy.identity.kerberos import GssapiSettings, KerberosMapper
from kproxy.identity.termination import (
    SASL_AUTHENTICATION_FAILED,
    SaslState,
    SaslTermination,
    TerminationSettings,
)
from kproxy.protocol.messages import body_class
from kproxy.server.kerberos import KerberosLogin, KerberosStats, KeytabAcceptor, failure, keytab_problem
from tests.kdc import Realm

SERVICE = "kafka/127.0.0.1"


class Client:
    """The client side of RFC 4752 as Kafka's clients run it, on python-gssapi."""

    def __init__(self, target: str = SERVICE, realm: str = "KPROXY.TEST") -> None:
        name = gssapi.Name(f"{target}@{realm}", gssapi.NameType.kerberos_principal)
        self.context = gssapi.SecurityContext(name=name, usage="initiate")

    def first(self) -> bytes:
        return self.context.step(None)

    def after_mutual(self, token: bytes) -> bytes:
        out = self.context.step(token)
        assert self.context.complete
        return out or b""

    def choose(self, offer: bytes, layer: int = 1, authzid: bytes = b"kafka@127.0.0.1") -> bytes:
        message = self.context.unwrap(offer).message
        assert message[0] & 1                    # "no security layer" is offered
        return self.context.wrap(bytes((layer, 0, 0, 0)) + authzid, False).message


def termination(realm: Realm, keytab: Path, stats: KerberosStats, rules: tuple[str, ...] = ("DEFAULT",),
                principal: str = SERVICE) -> SaslTermination:
    full = realm.principal(principal)
    settings = TerminationSettings(("GSSAPI",), max_session_s=600, gssapi=GssapiSettings(
        KeytabAcceptor(full, str(keytab), stats), KerberosMapper.from_config(rules, realm.realm)))
    t = SaslTermination(settings, clock=time.monotonic, wall_clock=time.time)
    assert t.handshake("GSSAPI", 1) == 0
    return t


def log_in(realm: Realm, name: str, tmp_path: Path) -> None:
    """Give the test's credential cache a ticket-granting ticket for ``name``."""
    principal = realm.add_principal(name)
    realm.kinit(principal, realm.keytab(tmp_path / f"{name.replace('/', '_')}.keytab", principal),
                tmp_path / "krb5cc")


@pytest.fixture
def service_keytab(kerberos_env: Realm, tmp_path: Path) -> Path:
    kerberos_env.add_principal(SERVICE)
    return kerberos_env.keytab(tmp_path / "kproxy.keytab", SERVICE)


def test_a_client_logs_in_and_its_principal_is_mapped(kerberos_env: Realm, service_keytab: Path,
                                                      tmp_path: Path) -> None:
    log_in(kerberos_env, "alice", tmp_path)
    stats = KerberosStats(("accept",))
    t = termination(kerberos_env, service_keytab, stats,
                    rules=("RULE:[1:$1@$0](.*@KPROXY.TEST)s/@.*/-kerberos/", "DEFAULT"))
    c = Client()
    o = t.authenticate(c.first())
    assert not o.failed and not o.done and o.auth_bytes           # the mutual authentication token
    o = t.authenticate(c.after_mutual(o.auth_bytes))
    assert not o.failed and not o.done and o.auth_bytes           # the wrapped offer
    o = t.authenticate(c.choose(o.auth_bytes))
    assert o.done and not o.failed and o.auth_bytes == b""
    assert t.state is SaslState.AUTHENTICATED and t.user == "alice-kerberos"
    assert o.session_lifetime_ms == 600_000 and not o.raw_answer   # v0 framing sends no last answer
    assert sum(stats.failures.values()) == 0


def test_the_keytab_may_hold_a_principal_per_host_name(kerberos_env: Realm, tmp_path: Path) -> None:
    """Clients ask for kafka/<the host they connected to>: a ticket for another host name of the same
    service and realm in kproxy's keytab is accepted, one for another service in it is not."""
    keytab = tmp_path / "kproxy.keytab"
    for name in (SERVICE, "kafka/localhost", "host/127.0.0.1"):
        kerberos_env.add_principal(name)
        kerberos_env.keytab(keytab, name)
    log_in(kerberos_env, "alice", tmp_path)
    stats = KerberosStats(("accept",))
    t = termination(kerberos_env, keytab, stats)
    o = t.authenticate(Client("kafka/localhost").first())
    assert not o.failed
    t = termination(kerberos_env, keytab, stats)
    o = t.authenticate(Client("host/127.0.0.1").first())
    assert o.failed and o.error_code == SASL_AUTHENTICATION_FAILED
    assert "brought a ticket for host/127.0.0.1@KPROXY.TEST, which is not one of kproxy's principals" in o.reason
    assert stats.failures[("accept", "keytab")] == 1


def test_a_wrong_keytab_is_refused_with_its_reason(kerberos_env: Realm, service_keytab: Path, tmp_path: Path) -> None:
    stale = tmp_path / "stale.keytab"
    service_keytab.rename(stale)
    kerberos_env.keytab(service_keytab, SERVICE)        # a new key: the stale keytab no longer fits
    log_in(kerberos_env, "alice", tmp_path)
    stats = KerberosStats(("accept",))
    t = termination(kerberos_env, stale, stats)
    o = t.authenticate(Client().first())
    assert o.failed and o.error_code == SASL_AUTHENTICATION_FAILED
    assert o.error_message == "Authentication failed: invalid credentials"     # the reason is not the client's
    assert f"keytab {stale}" in o.reason and "kafka/*@KPROXY.TEST" in o.reason
    assert stats.failures[("accept", "keytab")] == 1, (stats.failures, o.reason)
    assert t.state is SaslState.FAILED


def test_a_missing_keytab_fails_each_login_with_its_name(kerberos_env: Realm, tmp_path: Path) -> None:
    log_in(kerberos_env, "alice", tmp_path)
    kerberos_env.add_principal(SERVICE)
    stats = KerberosStats(("accept",))
    gone = tmp_path / "gone.keytab"
    t = termination(kerberos_env, gone, stats)
    o = t.authenticate(Client().first())
    assert o.failed and f"cannot accept as {SERVICE}@KPROXY.TEST: keytab {gone}" in o.reason
    assert stats.failures[("accept", "keytab")] == 1, o.reason


def test_an_expired_ticket_is_refused(kerberos_env: Realm, service_keytab: Path, tmp_path: Path) -> None:
    """A ticket is good until its end plus the clock skew allowed (2 s in the test realm); past that, a
    token made while it was good is refused, and said to be expired."""
    principal = kerberos_env.add_principal("shortlived")
    kerberos_env.kinit(principal, kerberos_env.keytab(tmp_path / "short.keytab", principal), tmp_path / "krb5cc",
                       lifetime="2s")
    # The ticket ends 2 s after the KDC issued it, which was before kinit returned: a bound that does
    # not move with the machine's load. (Now + gssapi's remaining lifetime, read after a call that a
    # loaded machine made slow, came out early: the token was then accepted as unexpired and refused
    # for its age instead, "Clock skew too great".)
    ends = time.time() + 2
    token = Client().first()                        # made while the ticket is good
    while time.time() <= ends + kerberos_env.clockskew + 1.5:   # the clock passes the end and the skew allowed
        time.sleep(0.1)
    stats = KerberosStats(("accept",))
    t = termination(kerberos_env, service_keytab, stats)
    o = t.authenticate(token)
    assert o.failed and o.error_code == SASL_AUTHENTICATION_FAILED
    assert o.reason.endswith("refused (keytab " + str(service_keytab) + "): Ticket expired"), o.reason
    assert stats.failures[("accept", "expired")] == 1


def test_a_principal_no_rule_maps_is_refused(kerberos_env: Realm, service_keytab: Path, tmp_path: Path) -> None:
    log_in(kerberos_env, "mallory", tmp_path)
    t = termination(kerberos_env, service_keytab, KerberosStats(), rules=("RULE:[1:$1@$0](alice@.*)s/@.*//",))
    o = t.authenticate(Client().first())
    assert o.failed and "'mallory@KPROXY.TEST' has no local name: no sasl.gssapi.principal_to_local rule" in o.reason


@pytest.mark.parametrize("bad", ["layer", "reply"])
def test_a_security_layer_or_a_stray_reply_is_refused(kerberos_env: Realm, service_keytab: Path, tmp_path: Path,
                                                      bad: str) -> None:
    log_in(kerberos_env, "alice", tmp_path)
    t = termination(kerberos_env, service_keytab, KerberosStats())
    c = Client()
    o = t.authenticate(c.first())
    if bad == "reply":
        o = t.authenticate(b"not empty")
        assert o.failed and "expected an empty reply" in o.reason
        return
    o = t.authenticate(c.after_mutual(o.auth_bytes))
    o = t.authenticate(c.choose(o.auth_bytes, layer=4))        # confidentiality: kproxy offers none
    assert o.failed and "chose security layer 4; kproxy offers none" in o.reason


def test_a_replayed_token_is_refused(kerberos_env: Realm, service_keytab: Path, tmp_path: Path) -> None:
    log_in(kerberos_env, "alice", tmp_path)
    token = Client().first()
    assert not termination(kerberos_env, service_keytab, KerberosStats()).authenticate(token).failed
    o = termination(kerberos_env, service_keytab, KerberosStats()).authenticate(token)
    assert o.failed and "replay" in o.reason.lower(), o.reason


@pytest.mark.parametrize(("offset", "kind"), [
    (37, "clock_skew"), (6, "unknown_principal"), (7, "unknown_principal"), (32, "expired"), (44, "keytab"),
    (45, "keytab"), (181, "keytab"), (41, "keytab"), (1, "other"),
])
def test_failures_are_sorted_by_mit_error_code(offset: int, kind: str) -> None:
    """MIT's krb5 error table (krb5_err.et), as the GSS-API minor codes carry it (unsigned)."""
    from gssapi.raw.misc import GSSError

    f = failure(GSSError(851968, (-1765328384 + offset) & 0xFFFFFFFF), "kproxy/h@R could not get a ticket")
    assert f.kind == kind and f.reason.startswith("kproxy/h@R could not get a ticket: ")


def test_keytab_problem_names_what_is_missing(kerberos_env: Realm, service_keytab: Path, tmp_path: Path) -> None:
    assert keytab_problem(kerberos_env.principal(SERVICE), str(service_keytab)) is None
    problem = keytab_problem("kafka/elsewhere@KPROXY.TEST", str(service_keytab))
    assert problem is not None and "kafka/elsewhere@KPROXY.TEST" in problem and "No key table entry" in problem
    problem = keytab_problem(kerberos_env.principal(SERVICE), str(tmp_path / "none.keytab"))
    assert problem is not None and "none.keytab" in problem


def test_kproxys_ticket_is_renewed_before_it_ends(kerberos_env: Realm, tmp_path: Path) -> None:
    """Origination: kproxy's ticket-granting ticket comes from its keytab into a private cache and is
    got again once 80-85% of its lifetime has passed, never from the process's default cache."""
    principal = kerberos_env.add_principal("kproxy/renewal", max_life="10 seconds")
    keytab = kerberos_env.keytab(tmp_path / "kproxy.keytab", principal)
    now = [1000.0]
    login = KerberosLogin(principal, str(keytab), stats=KerberosStats(("initiate",)), clock=lambda: now[0])
    first = login.credentials()
    assert login.tickets == 1 and first.lifetime <= 10
    now[0] += 7.9                                   # before 80%: the same ticket
    assert login.credentials() is first and login.tickets == 1
    now[0] += 0.7                                   # past 85%: a new one from the keytab
    assert login.credentials() is not first and login.tickets == 2
    issued = [line for line in kerberos_env.kdc_log().splitlines()
              if "ISSUE" in line and f"{principal} for krbtgt/" in line]
    assert len(issued) >= 2
    assert not (tmp_path / "krb5cc").exists()       # the test's default cache was never used


def test_kproxys_login_names_the_principal_the_kdc_does_not_know(kerberos_env: Realm, tmp_path: Path) -> None:
    principal = kerberos_env.add_principal("kproxy/deleted")
    keytab = kerberos_env.keytab(tmp_path / "kproxy.keytab", principal)
    kerberos_env.delete_principal(principal)
    stats = KerberosStats(("initiate",))
    login = KerberosLogin(principal, str(keytab), stats=stats)
    with pytest.raises(Exception) as e:
        login.start("127.0.0.1")
    reason = getattr(e.value, "reason", str(e.value))
    assert "kproxy/deleted@KPROXY.TEST could not get a ticket from the KDC" in reason
    assert "not found in Kerberos database" in reason
    assert stats.failures[("initiate", "unknown_principal")] == 1


def test_handshake_v0_raw_tokens_and_no_answer_to_the_last(kerberos_env: Realm, service_keytab: Path,
                                                           tmp_path: Path) -> None:
    """Before KIP-152 the tokens travel unframed after SaslHandshake v0; Kafka's broker sends nothing
    after GSSAPI's last one, and neither does kproxy. Then the session's requests flow as the user."""
    from kproxy.proxy.actions import ToClient, ToUpstream
    from kproxy.proxy.filters import ConnectionContext, FilterChain
    from kproxy.proxy.sasl import SaslFront
    from kproxy.proxy.session import Session
    from tests.unit.test_session import (
        SASL_HANDSHAKE,
        Clock,
        answered,
        kinds,
        metadata_request,
        request_frame,
    )

    log_in(kerberos_env, "alice", tmp_path)
    clock = Clock()
    ctx = ConnectionContext(1, client_address=("10.1.2.3", 5555), clock=clock)
    t = termination(kerberos_env, service_keytab, KerberosStats())
    t.state = SaslState.REQUIRING_HANDSHAKE
    s = Session(ctx, FilterChain([]), front=SaslFront(ctx, t, broker_versions=lambda: [(3, 0, 12)]))
    body = body_class(SASL_HANDSHAKE, "request")(mechanism="GSSAPI")
    assert answered(s.client_frame(request_frame(SASL_HANDSHAKE, 0, 1, body))[0], SASL_HANDSHAKE, 0).body.error_code == 0

    def raw(token: bytes) -> bytes:
        (reply,) = s.client_frame(memoryview(token))
        assert isinstance(reply, ToClient)
        data = b"".join(bytes(b) for b in reply.buffers)
        assert int.from_bytes(data[:4], "big") == len(data) - 4
        return data[4:]

    c = Client()
    mutual = raw(c.first())
    offer = raw(c.after_mutual(mutual))
    assert s.client_frame(memoryview(c.choose(offer))) == []        # the last token: no answer
    assert ctx.principal == "User:alice"
    assert kinds(s.client_frame(request_frame(3, 12, 9, metadata_request()))) == [ToUpstream]


def test_kproxy_check_says_which_keytab_lacks_its_principal(kerberos_env: Realm, service_keytab: Path,
                                                            tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kproxy.cli import main

    config = tmp_path / "kproxy.yaml"
    text = f"""\
listen: "127.0.0.1:9092"
upstream:
  bootstrap_servers: ["kafka:9092"]
sasl:
  mechanisms: [GSSAPI]
  gssapi:
    principal: {{principal}}
    keytab: {service_keytab}
"""
    config.write_text(text.format(principal=kerberos_env.principal(SERVICE)))
    assert main(["check", str(config)]) == 0
    assert "ok:" in capsys.readouterr().out
    config.write_text(text.format(principal="kafka/other.host@KPROXY.TEST"))
    assert main(["check", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{config}:8: sasl.gssapi.keytab: the keytab {service_keytab} has no usable key for "
                          "kafka/other.host@KPROXY.TEST: "), err
    assert "No key table entry found" in err


def test_kproxy_check_finds_the_keytab_of_a_virtual_cluster_and_ignores_gssapi_not_offered(
        kerberos_env: Realm, service_keytab: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each virtual cluster's keytab is checked at its own line; a gssapi section whose virtual cluster
    does not offer GSSAPI is not read (the example configuration carries one)."""
    from kproxy.cli import main

    config = tmp_path / "kproxy.yaml"
    config.write_text(f"""\
virtual_clusters:
  - name: plain
    listen: "127.0.0.1:9092"
    exposure: {{broker_port_start: 9093}}
    upstream: {{bootstrap_servers: ["a:9092"]}}
    sasl:
      mechanisms: [OAUTHBEARER]
      oauth: {{jwks_url: "https://idp.example/jwks", issuer: "https://idp.example", audience: kafka}}
      gssapi: {{principal: "kafka/nowhere@KPROXY.TEST", keytab: {tmp_path / "missing.keytab"}}}
  - name: kerberos
    listen: "127.0.0.1:9192"
    exposure: {{broker_port_start: 9193}}
    upstream: {{bootstrap_servers: ["b:9092"]}}
    sasl:
      mechanisms: [GSSAPI]
      gssapi:
        principal: "kafka/other.host@KPROXY.TEST"
        keytab: {service_keytab}
""")
    assert main(["check", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{config}:18: virtual_clusters[1].sasl.gssapi.keytab: the keytab {service_keytab} "
                          "has no usable key for kafka/other.host@KPROXY.TEST: "), err

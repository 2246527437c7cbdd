"""The session with kproxy's SASL front, sans-I/O: before a client logs in only ApiVersions and SASL are
answered and nothing goes upstream; failures are held to a fixed delay then close; raw v0 tokens;
credential APIs hidden; KIP-368 expiry; origination refuses a client's own SASL."""

from __future__ import annotations

import pytest
from scramp import ScramClient

from kproxy.identity.termination import FailedLogins, SaslTermination, TerminationSettings
from kproxy.identity.users import UserBook, new_credential
from kproxy.protocol.messages import body_class
from kproxy.proxy.actions import Close, Hold, ToClient, ToUpstream
from kproxy.proxy.filters import ConnectionContext, FilterChain
from kproxy.proxy.sasl import HIDDEN_APIS, SaslFront
from kproxy.proxy.session import Session
from tests.unit.test_session import (
    API_VERSIONS,
    METADATA,
    PRODUCE,
    SASL_AUTHENTICATE,
    SASL_HANDSHAKE,
    Clock,
    answered,
    kinds,
    metadata_request,
    produce_request,
    request_frame,
)

USERS = UserBook({"alice": {m: new_credential(m, "pw") for m in ("SCRAM-SHA-256", "SCRAM-SHA-512")}})
BROKER = [(0, 0, 11), (3, 0, 12), (18, 0, 4), (38, 0, 3), (50, 0, 0), (51, 0, 0)]


def session(*, terminate: bool = True, clock: Clock | None = None, max_session_s: float = 3600,
            limiter: FailedLogins | None = None, broker=BROKER, on_login=None) -> Session:
    clock = clock or Clock()
    ctx = ConnectionContext(1, client_address=("10.1.2.3", 5555), clock=clock)
    termination = None
    if terminate:
        settings = TerminationSettings(("SCRAM-SHA-256", "PLAIN"), USERS, max_session_s=max_session_s,
                                       failure_delay_s=0.5)
        termination = SaslTermination(settings, clock=clock, wall_clock=lambda: 1.7e9)
    front = SaslFront(ctx, termination, broker_versions=lambda: broker, failed_logins=limiter, failure_delay_s=0.5,
                      on_login=on_login)
    return Session(ctx, FilterChain([]), front=front)


def handshake(s: Session, mechanism: str = "PLAIN", version: int = 1, cid: int = 1):
    body = body_class(SASL_HANDSHAKE, "request")(mechanism=mechanism)
    return s.client_frame(request_frame(SASL_HANDSHAKE, version, cid, body))


def authenticate(s: Session, token: bytes, version: int = 2, cid: int = 2):
    body = body_class(SASL_AUTHENTICATE, "request")(auth_bytes=token)
    return s.client_frame(request_frame(SASL_AUTHENTICATE, version, cid, body))


def metadata(s: Session, cid: int = 9):
    return s.client_frame(request_frame(METADATA, 12, cid, metadata_request()))


def test_api_versions_is_answered_locally_without_credential_apis() -> None:
    s = session()
    (reply,) = s.client_frame(request_frame(API_VERSIONS, 3, 1, body_class(API_VERSIONS, "request")(
        client_software_name="app", client_software_version="1")))
    keys = {e.api_key: (e.min_version, e.max_version) for e in answered(reply, API_VERSIONS, 3).body.api_keys}
    assert keys[3] == (0, 12) and keys[SASL_HANDSHAKE] and keys[SASL_AUTHENTICATE]
    assert not set(keys) & HIDDEN_APIS
    assert s.ctx.client_software_name == "app"


def test_nothing_goes_upstream_before_login() -> None:
    s = session()
    actions = metadata(s)
    assert kinds(actions) == [Close] and "before SASL authentication" in actions[0].reason


def test_plain_login_then_requests_flow_as_the_user() -> None:
    s = session()
    assert s.sasl_in_progress          # the unauthenticated timeout runs from the start
    hs = answered(handshake(s)[0], SASL_HANDSHAKE, 1).body
    assert hs.error_code == 0 and hs.mechanisms == ["SCRAM-SHA-256", "PLAIN"]
    auth = answered(authenticate(s, b"\x00alice\x00pw")[0], SASL_AUTHENTICATE, 2).body
    assert auth.error_code == 0 and auth.session_lifetime_ms == 3_600_000
    assert s.ctx.principal == "User:alice" and not s.sasl_in_progress
    assert kinds(metadata(s)) == [ToUpstream]


def test_scram_login_over_the_session() -> None:
    s = session()
    handshake(s, "SCRAM-SHA-256")
    client = ScramClient(["SCRAM-SHA-256"], "alice", "pw")
    first = answered(authenticate(s, client.get_client_first().encode())[0], SASL_AUTHENTICATE, 2).body
    client.set_server_first(bytes(first.auth_bytes).decode())
    final = answered(authenticate(s, client.get_client_final().encode(), cid=3)[0], SASL_AUTHENTICATE, 2).body
    client.set_server_final(bytes(final.auth_bytes).decode())
    assert final.error_code == 0 and s.ctx.principal == "User:alice"


def test_a_failed_login_is_held_to_the_fixed_delay_then_closes() -> None:
    s = session()
    handshake(s)
    actions = authenticate(s, b"\x00alice\x00wrong")
    assert kinds(actions) == [Hold, ToClient, Close]
    assert actions[0].seconds == pytest.approx(0.5, abs=0.05)
    body = answered(actions[1], SASL_AUTHENTICATE, 2).body
    assert body.error_code == 58 and body.error_message == "Authentication failed: invalid credentials"
    assert s.ctx.principal is None and not s.ctx.authenticated


def test_an_unoffered_mechanism_is_refused_and_closes() -> None:
    s = session()
    actions = handshake(s, "OAUTHBEARER")
    assert kinds(actions) == [Hold, ToClient, Close]
    assert answered(actions[1], SASL_HANDSHAKE, 1).body.error_code == 33


def test_failed_logins_are_rate_limited_per_address() -> None:
    limiter = FailedLogins(per_minute=2)
    for _ in range(2):
        s = session(limiter=limiter)
        handshake(s)
        authenticate(s, b"\x00alice\x00wrong")
    s = session(limiter=limiter)
    handshake(s)
    actions = authenticate(s, b"\x00alice\x00pw")          # the right password, but too many failures
    assert kinds(actions) == [Hold, ToClient, Close]
    assert "too many failed logins" in answered(actions[1], SASL_AUTHENTICATE, 2).body.error_message
    assert not s.ctx.authenticated


def test_v0_handshake_then_raw_tokens() -> None:
    s = session()
    assert answered(handshake(s, "PLAIN", version=0)[0], SASL_HANDSHAKE, 0).body.error_code == 0
    (reply,) = s.client_frame(memoryview(b"\x00alice\x00pw"))
    assert isinstance(reply, ToClient) and b"".join(bytes(b) for b in reply.buffers) == b"\x00\x00\x00\x00"
    assert s.ctx.principal == "User:alice"
    assert kinds(metadata(s)) == [ToUpstream]


def test_v0_raw_token_failure_closes_without_an_answer() -> None:
    s = session()
    handshake(s, "PLAIN", version=0)
    actions = s.client_frame(memoryview(b"\x00alice\x00nope"))
    assert kinds(actions) == [Hold, Close]


def test_credential_apis_are_refused_after_login() -> None:
    s = session()
    handshake(s)
    authenticate(s, b"\x00alice\x00pw")
    body = body_class(50, "request")(users=[])
    (reply,) = s.client_frame(request_frame(50, 0, 5, body))
    assert answered(reply, 50, 0).body.error_code == 35


def test_session_expiry_closes_at_the_next_request_and_reauthentication_extends_it() -> None:
    clock = Clock(100.0)
    s = session(clock=clock, max_session_s=10)
    handshake(s)
    authenticate(s, b"\x00alice\x00pw")
    clock.now = 109.0
    handshake(s, cid=5)
    assert answered(authenticate(s, b"\x00alice\x00pw", cid=6)[0], SASL_AUTHENTICATE, 2).body.error_code == 0
    clock.now = 118.9
    assert not s.front.termination.expired(clock())          # renewed at 109 until 119
    clock.now = 119.5
    actions = metadata(s, cid=10)
    assert kinds(actions) == [Close] and "KIP-368" in actions[0].reason


def test_broker_loss_after_a_kproxy_login_does_not_close_the_client() -> None:
    s = session()
    handshake(s)
    authenticate(s, b"\x00alice\x00pw")
    s.client_frame(request_frame(PRODUCE, 9, 7, produce_request()))
    actions = s.upstream_lost("reset")
    assert Close not in kinds(actions)                       # answered with a retriable error instead
    assert answered(actions[0], PRODUCE, 9).body.responses[0].partition_responses[0].error_code != 0


def test_origination_refuses_a_clients_own_sasl() -> None:
    s = session(terminate=False)
    actions = handshake(s, "SCRAM-SHA-512")
    assert kinds(actions) == [ToClient, Close]
    body = answered(actions[0], SASL_HANDSHAKE, 1).body
    assert body.error_code == 33 and body.mechanisms == []
    s = session(terminate=False)
    actions = authenticate(s, b"x")
    assert "kproxy holds the cluster's credentials" in answered(actions[0], SASL_AUTHENTICATE, 2).body.error_message
    s = session(terminate=False)
    assert kinds(metadata(s)) == [ToUpstream]                # no SASL: requests flow (kproxy logs in upstream)


def logged_in_until_110(clock: Clock) -> Session:
    """A session logged in at 100 (PLAIN) for 10 s sessions."""
    clock.now = 100.0
    s = session(clock=clock, max_session_s=10)
    handshake(s)
    authenticate(s, b"\x00alice\x00pw")
    return s


def test_a_late_reauthentication_is_accepted_as_a_broker_accepts_it() -> None:
    """Kafka's broker checks a SaslHandshake for re-authentication before it checks the session's
    expiry (SocketServer), so a client whose re-authentication comes after its session ended logs in
    again on the same connection; any other request after the end closes it."""
    clock = Clock()
    s = logged_in_until_110(clock)
    clock.now = 110.5
    assert answered(handshake(s, cid=5)[0], SASL_HANDSHAKE, 1).body.error_code == 0
    clock.now = 111.0
    assert answered(authenticate(s, b"\x00alice\x00pw", cid=6)[0], SASL_AUTHENTICATE, 2).body.error_code == 0
    clock.now = 120.9
    assert not s.front.termination.expired(clock())          # renewed at 111 until 121
    clock.now = 121.5
    actions = metadata(s, cid=8)
    assert kinds(actions) == [Close] and "KIP-368" in actions[0].reason


def test_after_the_session_ended_only_a_reauthentication_is_answered() -> None:
    clock = Clock()
    s = logged_in_until_110(clock)
    clock.now = 110.5
    handshake(s, cid=5)
    actions = metadata(s, cid=6)                             # re-authentication begun, not finished
    assert kinds(actions) == [Close] and "KIP-368" in actions[0].reason
    s = logged_in_until_110(clock)                           # a SaslAuthenticate without its handshake
    clock.now = 110.5
    actions = authenticate(s, b"\x00alice\x00pw", cid=7)
    assert kinds(actions) == [Close] and "KIP-368" in actions[0].reason


def test_a_late_reauthentication_that_fails_closes() -> None:
    clock = Clock()
    s = logged_in_until_110(clock)
    clock.now = 110.5
    handshake(s, cid=5)
    actions = authenticate(s, b"\x00alice\x00wrong", cid=6)
    assert kinds(actions) == [Hold, ToClient, Close]
    assert answered(actions[1], SASL_AUTHENTICATE, 2).body.error_code == 58


def reauthenticated_at(clock: Clock, s: Session, at: float, cid: int) -> None:
    clock.now = at
    assert answered(handshake(s, cid=cid)[0], SASL_HANDSHAKE, 1).body.error_code == 0
    reply = authenticate(s, b"\x00alice\x00pw", cid=cid + 1)[0]
    assert answered(reply, SASL_AUTHENTICATE, 2).body.error_code == 0


def test_a_reauthentication_within_a_second_of_the_previous_one_is_refused_as_kafka_refuses_it(caplog) -> None:
    """Kafka's broker begins at most one re-authentication a second on a connection (KafkaChannel):
    a SaslHandshake sooner is answered ILLEGAL_SASL_STATE with no mechanisms, as on any authenticated
    connection, and the connection and its session go on. No credential is checked."""
    clock = Clock(100.0)
    counted: list[tuple[str, str]] = []
    s = session(clock=clock, max_session_s=10, on_login=lambda m, o: counted.append((m, o)))
    handshake(s)
    authenticate(s, b"\x00alice\x00pw")
    reauthenticated_at(clock, s, 100.2, 3)                  # the first re-authentication: never too soon
    clock.now = 100.7                                        # 0.5 s after the previous one began
    with caplog.at_level("INFO", logger="kproxy.identity"):
        actions = handshake(s, cid=5)
    assert kinds(actions) == [ToClient]                     # answered at once, not held, not closed
    body = answered(actions[0], SASL_HANDSHAKE, 1).body
    assert (body.error_code, body.mechanisms) == (34, [])
    assert counted[-1] == ("PLAIN", "reauth_too_soon") and counted.count(("PLAIN", "reauthenticated")) == 1
    (line,) = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert line.startswith("connection 1: re-authentication of User:alice (PLAIN) refused: it began 500 ms "
                           "after the previous one")
    t = s.front.termination
    assert t.authenticated and t.expires_at == pytest.approx(110.2)      # the session as it was
    assert kinds(metadata(s, cid=6)) == [ToUpstream]         # and the connection goes on


def test_with_max_session_0_a_reauthentication_is_refused_and_the_connection_goes_on(caplog) -> None:
    """Kafka with ``connections.max.reauth.ms=0`` does not begin a re-authentication
    (KafkaChannel.maybeBeginServerReauthentication): the SaslHandshake gets ILLEGAL_SASL_STATE with no
    mechanisms at once, and the SaslAuthenticate a client might send next gets ILLEGAL_SASL_STATE too
    (KafkaApis); nothing is checked, the login stays and the connection carries on."""
    counted: list[tuple[str, str]] = []
    s = session(max_session_s=0, on_login=lambda m, o: counted.append((m, o)))
    handshake(s)
    first = authenticate(s, b"\x00alice\x00pw")
    assert answered(first[0], SASL_AUTHENTICATE, 2).body.session_lifetime_ms == 0
    with caplog.at_level("INFO", logger="kproxy.identity"):
        actions = handshake(s, cid=3)
        assert kinds(actions) == [ToClient]                 # answered at once, not held, not closed
        body = answered(actions[0], SASL_HANDSHAKE, 1).body
        assert (body.error_code, body.mechanisms) == (34, [])
        actions = authenticate(s, b"\x00alice\x00wrong", cid=4)
    assert kinds(actions) == [ToClient]
    assert answered(actions[0], SASL_AUTHENTICATE, 2).body.error_code == 34
    assert counted == [("PLAIN", "ok"), ("PLAIN", "reauth_disabled"), ("PLAIN", "authenticate_after_login")]
    (line,) = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]     # one a second
    assert line == ("connection 1: re-authentication of User:alice (PLAIN) refused: the session has no end "
                    "(max_session_s: 0), and a Kafka broker re-authenticates only sessions that end")
    t = s.front.termination
    assert t.authenticated and t.user == "alice" and t.expires_at is None
    assert kinds(metadata(s, cid=6)) == [ToUpstream]


def test_a_saslauthenticate_after_the_login_gets_illegal_sasl_state_and_the_connection_goes_on(caplog) -> None:
    """KafkaApis answers a SaslAuthenticate on an authenticated connection ILLEGAL_SASL_STATE with a
    message, at once, and keeps the connection; kproxy does the same, checking nothing."""
    counted: list[tuple[str, str]] = []
    s = session(on_login=lambda m, o: counted.append((m, o)))
    handshake(s)
    authenticate(s, b"\x00alice\x00pw")
    with caplog.at_level("INFO", logger="kproxy.identity"):
        for version, cid in ((0, 3), (2, 4)):
            actions = authenticate(s, b"\x00alice\x00pw", version=version, cid=cid)
            assert kinds(actions) == [ToClient]
            body = answered(actions[0], SASL_AUTHENTICATE, version).body
            assert body.error_code == 34 and "send SaslHandshake first" in body.error_message
            assert body.auth_bytes == b""
    assert counted == [("PLAIN", "ok"), *[("PLAIN", "authenticate_after_login")] * 2]
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert lines == ["connection 1: SaslAuthenticate from User:alice (PLAIN) refused: the login had completed "
                     "and no SaslHandshake began another"]
    reauthenticated_at(s.ctx.clock, s, s.ctx.clock() + 1, 7)          # re-authentication still works
    assert s.front.termination.user == "alice" and kinds(metadata(s, cid=9)) == [ToUpstream]


def test_a_reauthentication_a_second_after_the_previous_one_began_is_accepted() -> None:
    clock = Clock(100.0)
    counted: list[tuple[str, str]] = []
    s = session(clock=clock, max_session_s=10, on_login=lambda m, o: counted.append((m, o)))
    handshake(s)
    authenticate(s, b"\x00alice\x00pw")
    reauthenticated_at(clock, s, 100.5, 3)
    reauthenticated_at(clock, s, 101.5, 5)                  # exactly 1.0 s after the previous start
    clock.now = 102.0
    assert answered(handshake(s, cid=7)[0], SASL_HANDSHAKE, 1).body.error_code == 34     # 0.5 s: refused
    reauthenticated_at(clock, s, 102.5, 9)                  # the refused one started nothing
    assert counted == [("PLAIN", "ok"), *[("PLAIN", "reauthenticated")] * 2, ("PLAIN", "reauth_too_soon"),
                       ("PLAIN", "reauthenticated")]
    assert s.front.termination.expires_at == pytest.approx(112.5)


def test_a_too_soon_reauthentication_after_the_session_ended_closes() -> None:
    """Kafka's broker checks the session's end when it does not begin a re-authentication: a
    handshake refused as too soon on an ended session closes the connection."""
    clock = Clock(100.0)
    s = session(clock=clock, max_session_s=0.5)
    handshake(s)
    authenticate(s, b"\x00alice\x00pw")
    reauthenticated_at(clock, s, 100.6, 3)                  # late, accepted: the session ends at 101.1
    clock.now = 101.2
    actions = handshake(s, cid=5)
    assert kinds(actions) == [ToClient, Close] and "KIP-368" in actions[1].reason
    assert answered(actions[0], SASL_HANDSHAKE, 1).body.error_code == 34


def test_refusals_of_a_looping_client_are_logged_once_a_second_with_the_count(caplog) -> None:
    clock = Clock(100.0)
    s = session(clock=clock, max_session_s=10)
    handshake(s)
    authenticate(s, b"\x00alice\x00pw")
    reauthenticated_at(clock, s, 100.0, 3)
    with caplog.at_level("INFO", logger="kproxy.identity"):
        for i in range(10):                                  # ten handshakes 0.1 s apart
            clock.now = 100.05 + i * 0.1
            handshake(s, cid=10 + i)
        reauthenticated_at(clock, s, 101.0, 30)
        for i in range(3):
            clock.now = 101.2 + i * 0.1
            handshake(s, cid=40 + i)
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "more refused" not in lines[0] and lines[1].endswith("(9 more refused since the last line)")


def test_passthrough_of_undecodable_versions_waits_for_the_login() -> None:
    """passthrough_unknown_versions forwards frames kproxy cannot decode, but never before login."""
    s = session()
    s.passthrough = True
    frame = bytearray(request_frame(METADATA, 12, 3, metadata_request()))
    frame[2:4] = (99).to_bytes(2, "big")             # a Metadata version from the future
    actions = s.client_frame(memoryview(bytes(frame)))
    assert kinds(actions) == [Close] and "before SASL authentication" in actions[0].reason
    handshake(s)
    authenticate(s, b"\x00alice\x00pw")
    assert kinds(s.client_frame(memoryview(bytes(frame)))) == [ToUpstream]

"""kproxy's broker login (``kproxy.server.upstream``): the one way every broker connection is opened and
logged in, and logging in again (KIP-368) with the same exchange and timeouts whoever uses it.

A fake broker answers SASL/PLAIN itself and grants a session lifetime; trio's MockClock lets its
minutes pass at once. On a client's broker connection the real pumps run (``ClientConnection.run``),
so the tests see what the broker would: which requests arrive on which connection, in what order.
"""

from __future__ import annotations

import itertools
import logging
import struct
from typing import Any

import pytest
import trio

from kproxy.config import UpstreamSasl, parse_config
from kproxy.protocol.messages import Request, Response, body_class, decode_request
from kproxy.proxy.filters import Filter
from kproxy.server import upstream as upstream_module
from kproxy.server.connection import ClientConnection
from kproxy.server.origination import Originator
from kproxy.server.transport import Transport
from kproxy.server.upstream import (
    REAUTH_MARGIN_S,
    LoginTimedOut,
    UpstreamLogin,
    UpstreamSettings,
    open_upstream,
    reauth_after,
    renew_login,
)

from .test_connection import Harness, Pipe, settle
from .test_session import (
    HEARTBEAT,
    METADATA,
    Asker,
    heartbeat_request,
    metadata_request,
    metadata_response,
    response_frame,
)

_I32 = struct.Struct(">i")
SASL_HANDSHAKE, SASL_AUTHENTICATE = 17, 36


class SaslBroker(Pipe):
    """A broker end that answers kproxy's SaslHandshake and SaslAuthenticate itself (PLAIN, any
    password), granting ``lifetime_ms``; ``logins`` holds when each login ended (trio time). Other
    requests stay in ``requests`` for the test to answer. ``silent`` answers nothing; ``refuse``
    refuses every login from then on."""

    def __init__(self, lifetime_ms: int, *, silent: bool = False) -> None:
        super().__init__()
        self.lifetime_ms = lifetime_ms
        self.silent = silent
        self.refuse = False
        self.logins: list[float] = []
        self.requests: list = []
        self._seen = 0

    async def send(self, buffers: list) -> None:
        await super().send(buffers)
        while self._seen < len(self.frames):
            req = decode_request(self.frames[self._seen])
            self._seen += 1
            if req.api_key not in (SASL_HANDSHAKE, SASL_AUTHENTICATE):
                self.requests.append(req)
                continue
            if self.silent:
                continue
            cls = body_class(req.api_key, "response")
            if req.api_key == SASL_HANDSHAKE:
                body = cls(error_code=0, mechanisms=["PLAIN"])
            elif self.refuse:
                body = cls(error_code=58, error_message="Authentication failed", auth_bytes=b"")
            else:
                assert bytes(req.body.auth_bytes).split(b"\x00")[1] == b"svc"
                body = cls(error_code=0, auth_bytes=b"", session_lifetime_ms=self.lifetime_ms)
                self.logins.append(trio.current_time())
            frame = response_frame(req.api_key, req.api_version, req.correlation_id, body)
            self.push(_I32.pack(len(frame)) + frame)


def plain_settings(request_timeout_s: float = 30.0) -> UpstreamSettings:
    return UpstreamSettings(1.0, originator=Originator(UpstreamSasl("PLAIN", "svc", "pw")),
                            request_timeout_s=request_timeout_s)


@pytest.fixture
def brokers(monkeypatch: pytest.MonkeyPatch) -> list[SaslBroker]:
    """The broker connections ``open_upstream`` opened (its ``connect`` replaced), 10 s sessions each."""
    opened: list[SaslBroker] = []

    async def fake_connect(*args, **kwargs) -> Transport:
        opened.append(SaslBroker(10_000))
        return opened[-1]

    monkeypatch.setattr(upstream_module, "connect", fake_connect)
    return opened


def test_settings_from_the_configuration_alone_log_in_when_upstream_sasl_is_set() -> None:
    # A fleet coordinator built without the server opens its connections from these.
    base = 'listen: "127.0.0.1:9092"\nupstream:\n  bootstrap_servers: ["b:9092"]\n'
    with_sasl = parse_config(base + "  sasl: {mechanism: SCRAM-SHA-256, username: svc, password: pw}\n")
    originator = UpstreamSettings.from_config(with_sasl.upstream).originator
    assert originator is not None and originator.mechanism == "SCRAM-SHA-256"
    assert UpstreamSettings.from_config(parse_config(base).upstream).originator is None


async def test_open_upstream_logs_in_and_says_when_the_login_is_due_again(brokers, autojump_clock) -> None:
    start = trio.current_time()
    t = await open_upstream("broker", 9092, plain_settings())
    (broker,) = brokers
    assert t is broker and broker.logins == [start]
    login = t.login
    assert login is not None and login.lifetime_ms == 10_000 and login.where == "broker:9092"
    assert login.session_end == start + 10.0
    # 80-90% of a 10 s session: Kafka's 85-95%, moved to keep REAUTH_MARGIN_S before its end.
    assert login.reauth_at is not None and start + 8.0 <= login.reauth_at <= start + 9.0
    assert not login.due(login.reauth_at - 0.001) and login.due(login.reauth_at)


def test_a_long_session_is_renewed_at_85_to_95_percent_and_a_short_one_a_margin_before_its_end() -> None:
    hour = 3600.0
    assert reauth_after(hour, 0.0) == pytest.approx(0.85 * hour)     # Kafka's client, unchanged
    assert reauth_after(hour, 0.999) == pytest.approx(0.95 * hour, rel=1e-3)
    for lifetime in (1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 60.0):
        early, late = reauth_after(lifetime, 0.0), reauth_after(lifetime, 0.999)
        assert lifetime / 2 <= early <= late <= lifetime * 0.95
        # A margin before the end (never before half the lifetime: a broker starts at most one
        # re-authentication a second), and a spread while the lifetime leaves room for one.
        assert lifetime - late >= min(REAUTH_MARGIN_S, lifetime / 2) - 1e-9
        assert late - early == pytest.approx(0.1 * lifetime, rel=0.01) or early == lifetime / 2
    # A 3 s session (the tests' brokers): 1.7-2.0 s, where 85-95% left 150-450 ms.
    assert (reauth_after(3.0, 0.0), reauth_after(3.0, 1.0)) == (pytest.approx(1.7), pytest.approx(2.0))


async def test_a_session_counts_from_when_the_last_login_request_was_sent(autojump_clock) -> None:
    """The broker starts the session when it reads the login's last request: kproxy counts from when
    it sent it, so an answer slow on its way back does not push the next login past the end."""
    login = UpstreamLogin(Originator(UpstreamSasl("PLAIN", "svc", "pw")), "broker:9092", 30.0)
    sent: list[float] = []

    async def slow_answers(req: Request) -> Response:
        sent.append(trio.current_time())
        await trio.sleep(1.0)                       # each answer takes 1 s to come back
        cls = body_class(req.api_key, "response")
        body = (cls(error_code=0, mechanisms=["PLAIN"]) if req.api_key == SASL_HANDSHAKE
                else cls(error_code=0, auth_bytes=b"", session_lifetime_ms=3000))
        return Response.build(req.api_key, req.api_version, req.correlation_id, body)

    await login.log_in(slow_answers)
    assert len(sent) == 2 and login.session_end == sent[-1] + 3.0
    assert login.reauth_at is not None and sent[-1] + 1.7 <= login.reauth_at <= sent[-1] + 2.0


async def test_kproxy_never_begins_a_reauthentication_within_a_second_of_the_previous_one(autojump_clock) -> None:
    """A broker begins at most one re-authentication a second on a connection and refuses a sooner
    one (KafkaChannel; the first login does not count): with 1.2 s sessions, half the lifetime
    would come sooner, so kproxy waits until a second after the broker had begun the previous one."""
    login = UpstreamLogin(Originator(UpstreamSasl("PLAIN", "svc", "pw")), "broker:9092", 30.0)
    begun: list[float] = []                         # when the broker read each handshake

    async def broker(req: Request) -> Response:
        await trio.sleep(0.1)                       # on the way to the broker
        cls = body_class(req.api_key, "response")
        if req.api_key == SASL_HANDSHAKE:
            now = trio.current_time()
            too_soon = len(begun) >= 2 and now - begun[-1] < 1.0
            if not too_soon:
                begun.append(now)
            body = cls(error_code=34 if too_soon else 0, mechanisms=[] if too_soon else ["PLAIN"])
        else:
            body = cls(error_code=0, auth_bytes=b"", session_lifetime_ms=1200)
        await trio.sleep(0.1)                       # and back
        return Response.build(req.api_key, req.api_version, req.correlation_id, body)

    await login.log_in(broker)
    for _ in range(5):
        assert login.reauth_at is not None and login.session_end is not None
        assert login.reauth_at <= login.session_end
        await trio.sleep_until(login.reauth_at)
        await login.log_in(broker)                  # OriginationError if the broker refused it
    assert len(begun) == 6
    gaps = [b - a for a, b in itertools.pairwise(begun[1:])]
    assert all(g >= 1.0 for g in gaps), gaps
    # The first re-authentication is not held back: half the session after the login's last request
    # was sent (0.1 s after the broker read its handshake), read 0.1 s later.
    assert begun[1] - begun[0] == pytest.approx(0.1 + 0.6 + 0.1)


async def test_renew_login_logs_in_again_on_the_same_connection_once_due(brokers, autojump_clock) -> None:
    t = await open_upstream("broker", 9092, plain_settings())
    (broker,) = brokers
    login = t.login
    assert login is not None and login.reauth_at is not None
    await renew_login(t)                                  # not due: nothing sent
    assert len(broker.logins) == 1 and len(broker.frames) == 2
    await trio.sleep_until(login.reauth_at)
    await renew_login(t)
    assert len(broker.logins) == 2 and brokers == [broker]        # the same connection, logged in again
    assert login.session_end == broker.logins[-1] + 10.0 and not login.due(trio.current_time())
    # A caller that sends every 2 s renews at its last request before the login falls due.
    due = login.reauth_at
    assert due is not None
    await trio.sleep_until(due - 1.5)
    await renew_login(t, ahead=2.0)
    assert len(broker.logins) == 3 and broker.logins[-1] == due - 1.5


async def test_a_login_the_broker_never_answers_times_out_after_the_request_timeout(
        monkeypatch, autojump_clock) -> None:
    silent = SaslBroker(10_000, silent=True)

    async def fake_connect(*args, **kwargs) -> Transport:
        return silent

    monkeypatch.setattr(upstream_module, "connect", fake_connect)
    start = trio.current_time()
    with pytest.raises(LoginTimedOut):
        await open_upstream("broker", 9092, plain_settings(request_timeout_s=2.0))
    assert trio.current_time() - start == pytest.approx(2.0)
    assert silent.closed


async def test_a_session_without_a_lifetime_is_never_due(monkeypatch, autojump_clock) -> None:
    forever = SaslBroker(0)

    async def fake_connect(*args, **kwargs) -> Transport:
        return forever

    monkeypatch.setattr(upstream_module, "connect", fake_connect)
    t = await open_upstream("broker", 9092, plain_settings())
    assert t.login is not None and t.login.reauth_at is None and t.login.session_end is None
    await trio.sleep(86_400)
    await renew_login(t)
    assert len(forever.logins) == 1


# -- on a client's broker connection: logged in again before each session ends, busy or idle


def proxied(monkeypatch: pytest.MonkeyPatch, *filters: Filter) -> Harness:
    """A ClientConnection over a fake client whose broker connections log in (PLAIN) to SaslBrokers
    granting 10 s sessions."""
    return Harness(monkeypatch, *filters, upstream=plain_settings(), broker=lambda: SaslBroker(10_000))


async def connected(h: Harness, *request: Any) -> tuple[SaslBroker, float]:
    """The client sends ``request`` (api key, version, correlation id, body): the broker connection
    it opened, and when its login is due again."""
    h.ask(*request)
    await settle()
    (broker,) = h.brokers
    assert isinstance(broker, SaslBroker)
    login = broker.login
    assert login is not None and login.reauth_at is not None
    return broker, login.reauth_at


def answer(h: Harness, broker: SaslBroker, req: Any, body: Any) -> None:
    h.answer(req.api_key, req.api_version, req.correlation_id, body, broker=h.brokers.index(broker))


def api_keys(broker: SaslBroker) -> list[int]:
    return [decode_request(f).api_key for f in broker.frames]


async def test_an_idle_broker_connection_logs_in_again_before_each_session_ends(monkeypatch, autojump_clock):
    h = proxied(monkeypatch)
    async with trio.open_nursery() as n:
        n.start_soon(h.conn.run)
        broker, _ = await connected(h, METADATA, 12, 1, metadata_request())
        answer(h, broker, broker.requests[0], metadata_response())
        await settle()
        assert h.answered_ids() == [1]
        # The scenario is time passing: the client sends nothing for six session lifetimes.
        await trio.sleep(60)
        logins = broker.logins
        assert len(logins) >= 7, logins
        # Each login came 80-90% into the session the one before it began (a margin before its end).
        assert all(8.0 <= b - a <= 9.0 for a, b in itertools.pairwise(logins)), logins
        assert h.brokers == [broker] and not broker.closed           # re-authenticated, never replaced
        h.ask(METADATA, 12, 2, metadata_request())
        await settle()
        assert h.brokers == [broker] and len(broker.requests) == 2
        n.cancel_scope.cancel()


async def test_answers_to_requests_sent_before_a_login_again_still_reach_the_client(monkeypatch, autojump_clock):
    h = proxied(monkeypatch)
    async with trio.open_nursery() as n:
        n.start_soon(h.conn.run)
        broker, due = await connected(h, METADATA, 12, 1, metadata_request())
        await trio.sleep_until(due)
        await settle()
        # The request's answer is still owed while kproxy logs in again: the login's answers go to
        # kproxy, the request's to the client.
        assert api_keys(broker) == [17, 36, METADATA, 17, 36] and len(broker.logins) == 2
        answer(h, broker, broker.requests[0], metadata_response())
        await settle()
        assert h.answered_ids() == [1]
        n.cancel_scope.cancel()


async def test_a_write_that_finds_the_login_due_logs_in_again_before_it_is_sent(monkeypatch, autojump_clock):
    """As Kafka's client checks before each send: a request written once the login is due goes out
    after a login again, even when the timer has not had its turn (here it never does)."""

    async def timer_not_yet(self: Any) -> None:
        await trio.sleep_forever()

    monkeypatch.setattr(ClientConnection, "_keep_login", timer_not_yet)
    h = proxied(monkeypatch)
    async with trio.open_nursery() as n:
        n.start_soon(h.conn.run)
        broker, due = await connected(h, METADATA, 12, 1, metadata_request())
        answer(h, broker, broker.requests[0], metadata_response())
        await trio.sleep_until(due - 0.01)
        h.ask(METADATA, 12, 2, metadata_request())               # not yet due: no login
        await settle()
        assert api_keys(broker) == [17, 36, METADATA, METADATA] and len(broker.logins) == 1
        answer(h, broker, broker.requests[1], metadata_response())
        await trio.sleep_until(due)
        h.ask(METADATA, 12, 3, metadata_request())
        await settle()
        assert api_keys(broker) == [17, 36, METADATA, METADATA, 17, 36, METADATA]
        assert len(broker.logins) == 2 and h.brokers == [broker]
        answer(h, broker, broker.requests[2], metadata_response())
        await settle()
        assert h.answered_ids() == [1, 2, 3]
        n.cancel_scope.cancel()


async def test_a_write_and_the_timer_due_together_log_in_again_once_before_the_request(monkeypatch, autojump_clock):
    h = proxied(monkeypatch)
    async with trio.open_nursery() as n:
        n.start_soon(h.conn.run)
        broker, due = await connected(h, METADATA, 12, 1, metadata_request())
        answer(h, broker, broker.requests[0], metadata_response())
        await trio.sleep_until(due)
        h.ask(METADATA, 12, 2, metadata_request())               # both runnable at once
        await settle()
        assert api_keys(broker) == [17, 36, METADATA, 17, 36, METADATA] and len(broker.logins) == 2
        n.cancel_scope.cancel()


async def test_a_login_again_waits_for_a_filters_question_and_the_request_it_holds(monkeypatch, autojump_clock):
    # The upstream pump sends the request a question held once the answer is in; a login holding
    # the broker write lock meanwhile would wait for answers that pump could never read.
    h = proxied(monkeypatch, Asker())
    async with trio.open_nursery() as n:
        n.start_soon(h.conn.run)
        broker, due = await connected(h, HEARTBEAT, 4, 1, heartbeat_request())
        (question,) = broker.requests
        await trio.sleep_until(due + 0.5)
        await settle()
        assert api_keys(broker) == [17, 36, METADATA]                  # not while the question waits
        answer(h, broker, question, metadata_response())
        await settle()
        assert api_keys(broker) == [17, 36, METADATA, HEARTBEAT, 17, 36]
        answer(h, broker, broker.requests[1], body_class(HEARTBEAT, "response")())
        await settle()
        assert h.answered_ids() == [1] and len(broker.logins) == 2
        n.cancel_scope.cancel()


async def test_a_broker_connection_lost_during_a_login_again_ends_it_at_once(monkeypatch, autojump_clock):
    h = proxied(monkeypatch)
    async with trio.open_nursery() as n:
        n.start_soon(h.conn.run)
        broker, due = await connected(h, METADATA, 12, 1, metadata_request())
        answer(h, broker, broker.requests[0], metadata_response())
        broker.silent = True                    # the login again gets no answer ...
        await trio.sleep_until(due)
        await settle()
        assert api_keys(broker)[-1] == 17
        lost_at = trio.current_time()
        broker.end()                            # ... and the broker goes away
        await settle()
        # Not held until the request timeout (30 s): the next request goes on a new connection now.
        h.ask(METADATA, 12, 2, metadata_request())
        await settle()
        assert trio.current_time() == lost_at
        renewed = h.brokers[1]
        assert isinstance(renewed, SaslBroker) and len(renewed.logins) == 1 and len(renewed.requests) == 1
        n.cancel_scope.cancel()


async def test_a_refused_login_again_ends_the_broker_connection_as_a_lost_one(monkeypatch, autojump_clock, caplog):
    # A Metadata request waiting on the connection cannot be answered with a retriable error: the
    # client connection closes (as a broker's loss would close it), with the reason, not as a fault.
    h = proxied(monkeypatch)
    caplog.set_level(logging.INFO, logger="kproxy.server")
    async with trio.open_nursery() as n:
        n.start_soon(h.conn.run)
        broker, due = await connected(h, METADATA, 12, 1, metadata_request())
        broker.refuse = True
        await trio.sleep_until(due)
        await settle()
        assert broker.closed and h.client.closed
        n.cancel_scope.cancel()
    text = caplog.text
    assert "re-authentication failed" in text and "the broker refused kproxy's PLAIN login" in text
    assert "internal error" not in text

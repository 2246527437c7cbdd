"""kproxy's broker login (``kproxy.server.upstream``): the one way every broker connection is opened and
logged in, and logging in again (KIP-368) with the same exchange and timeouts whoever uses it.

A fake broker answers SASL/PLAIN itself and grants a session lifetime; trio's MockClock lets its
minutes pass at once.
"""

from __future__ import annotations

import struct

import pytest
import trio

from kproxy.config import UpstreamSasl, parse_config
from kproxy.protocol.messages import body_class, decode_request
from kproxy.server import upstream as upstream_module
from kproxy.server.origination import Originator
from kproxy.server.transport import Transport
from kproxy.server.upstream import LoginTimedOut, UpstreamSettings, open_upstream, renew_login

from .test_connection import Pipe
from .test_session import response_frame

_I32 = struct.Struct(">i")
SASL_HANDSHAKE, SASL_AUTHENTICATE = 17, 36


class SaslBroker(Pipe):
    """A broker end that answers kproxy's SaslHandshake and SaslAuthenticate itself (PLAIN, any
    password), granting ``lifetime_ms``; ``logins`` holds when each login ended (trio time). Other
    requests stay in ``requests`` for the test to answer. ``silent`` answers nothing."""

    def __init__(self, lifetime_ms: int, *, silent: bool = False) -> None:
        super().__init__()
        self.lifetime_ms = lifetime_ms
        self.silent = silent
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
    assert login.reauth_at is not None and start + 8.5 <= login.reauth_at < start + 10.0
    assert not login.due(login.reauth_at - 0.001) and login.due(login.reauth_at)


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

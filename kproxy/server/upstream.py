"""Opening a connection to a broker, and keeping kproxy's login on it: the one place that discovery,
client connections and fleet quota coordination all go through.

Whatever every broker connection needs before its first request (TCP, TLS with the configured
server name, and kproxy's own SASL login when ``upstream.sasl`` is set) is done here once, so no
caller can open a connection that skips a step. The login stays on the connection (``Transport.login``)
with what the broker said of its session, and logging in again before that session ends (KIP-368)
is the same exchange, with the same timeouts, whoever asks for it. Callers handle OSError and
trio.TooSlowError as "cannot connect"; the two kinds that mean "connected, but the login failed" are
subclasses of those.
"""

from __future__ import annotations

import random
import ssl

import attrs
import trio

from kproxy.config import UpstreamConfig
from kproxy.identity.termination import MIN_REAUTH_INTERVAL_S
from kproxy.protocol.messages import Request, Response
from kproxy.server.origination import (
    SASL_HANDSHAKE,
    OriginationError,
    Originator,
    Roundtrip,
    direct_roundtrip,
)
from kproxy.server.transport import Transport, client_context, connect

# KIP-368: log in again once 85-95% of the broker's session lifetime has passed, as Kafka's own
# client does: time left for the exchange before the broker would close the connection, and a
# random spread so that connections opened together do not all log in again at once.
REAUTH_FROM, REAUTH_SPREAD = 0.85, 0.10
# ...but at least this long before the session ends: 5-15% of a short session (a 3 s one left
# 150-450 ms) is less than a busy machine can take to wake the timer and send the handshake, and a
# broker closes a connection whose session has ended at its next request. Never before half the
# lifetime, though: a broker starts at most one re-authentication a second on a connection (counted
# between the starts of two; under 2 s, half the lifetime is sooner, which ``UpstreamLogin.log_in``
# puts right).
REAUTH_MARGIN_S = 1.0


def reauth_after(lifetime_s: float, draw: float) -> float:
    """Seconds into a session of ``lifetime_s`` to log in again, for a ``draw`` in [0, 1): 85-95% of
    a long session, as Kafka's client; a short one moves earlier to keep REAUTH_MARGIN_S before its
    end, with the same spread, down to half its lifetime."""
    latest = max(0.5, min(REAUTH_FROM + REAUTH_SPREAD, 1.0 - REAUTH_MARGIN_S / lifetime_s))
    earliest = max(0.5, min(REAUTH_FROM, latest - REAUTH_SPREAD))
    return (earliest + draw * (latest - earliest)) * lifetime_s


@attrs.frozen
class UpstreamSettings:
    """How kproxy reaches the brokers, fixed when the server starts (certificates loaded once)."""

    connect_timeout_s: float
    tls: ssl.SSLContext | None = None
    server_hostname: str | None = None      # None: the host connected to
    # upstream.sasl: kproxy logs in on every broker connection before any request goes on it, each
    # of the login's requests answered within request_timeout_s.
    originator: Originator | None = attrs.field(default=None, eq=False)
    request_timeout_s: float = 30.0

    @classmethod
    def from_config(cls, cfg: UpstreamConfig, tls: ssl.SSLContext | None = None,
                    originator: Originator | None = None) -> UpstreamSettings:
        """From ``upstream:``; ``tls`` is the context already built, else it is built here when TLS is
        on, and ``originator`` the server's (which counts logins for /metrics), else one is made here
        when ``upstream.sasl`` is set."""
        if tls is None and cfg.tls.enabled:
            tls = client_context(cfg.tls)
        if originator is None and cfg.sasl is not None:
            originator = Originator(cfg.sasl)
        return cls(cfg.connect_timeout_s, tls, cfg.tls.server_hostname, originator, cfg.request_timeout_s)


class LoginTimedOut(trio.TooSlowError):
    """The broker connection was made, but the broker did not answer kproxy's login in time."""


def login_failed(e: BaseException) -> bool:
    """Whether ``e``, raised by open_upstream or a login, means the login failed (refused or unanswered)."""
    return isinstance(e, (OriginationError, LoginTimedOut))


class UpstreamLogin:
    """kproxy's login on one broker connection, and when it is due again (KIP-368): the broker's
    session lifetime counts from when the login's last request was sent. The broker starts the
    session when it reads that request, so this is never later than the broker's own count; timing
    from the answer would add the answer's way back, which a busy machine stretches."""

    __slots__ = ("lifetime_ms", "logged_in", "originator", "reauth_at", "reauth_begun", "session_end", "timeout",
                 "where")

    def __init__(self, originator: Originator, where: str, timeout: float) -> None:
        self.originator = originator
        self.where = where                      # host:port, for messages
        self.timeout = timeout                  # for each of the login's requests
        self.lifetime_ms = 0                    # what the broker said of the session (0: no limit)
        self.reauth_at: float | None = None     # when to log in again (trio time); None: never
        self.session_end: float | None = None   # when the broker ends the session
        self.logged_in = False
        # When the broker had surely begun the last re-authentication (its SaslHandshake answered);
        # None until one has been made: the first login does not count against the limit.
        self.reauth_begun: float | None = None

    async def log_in(self, roundtrip: Roundtrip) -> None:
        """Log in over ``roundtrip``: the first time on a fresh connection, or again on a live one
        (KIP-368 re-authentication is the same exchange). Each answer is waited for within the
        timeout: LoginTimedOut past it, OriginationError when refused."""
        timeout = self.timeout
        last_sent = trio.current_time()
        begun: float | None = None

        async def timed(req: Request) -> Response:
            nonlocal last_sent, begun
            last_sent = trio.current_time()
            with trio.fail_after(timeout):
                resp = await roundtrip(req)
            if req.api_key == SASL_HANDSHAKE and begun is None:
                begun = trio.current_time()      # the broker read the handshake before answering it
            return resp

        try:
            lifetime_ms = await self.originator.login(timed, self.where)
        except trio.TooSlowError:
            raise LoginTimedOut() from None
        if self.logged_in:
            self.reauth_begun = begun
        self.logged_in = True
        self.lifetime_ms = lifetime_ms
        if lifetime_ms > 0:
            at = last_sent + reauth_after(lifetime_ms / 1000, random.random())
            if self.reauth_begun is not None:
                # A broker refuses a re-authentication less than a second after the previous one
                # began (ILLEGAL_SASL_STATE, which would end this connection): with a session
                # shorter than 2 s, half its lifetime is sooner than that.
                at = max(at, self.reauth_begun + MIN_REAUTH_INTERVAL_S)
            self.reauth_at = at
            self.session_end = last_sent + lifetime_ms / 1000
        else:
            self.reauth_at = self.session_end = None

    def due(self, now: float) -> bool:
        """Whether it is time to log in again."""
        return self.reauth_at is not None and now >= self.reauth_at


async def open_upstream(host: str, port: int, settings: UpstreamSettings) -> Transport:
    """A connection to the broker at ``host``:``port``, ready for Kafka requests: connected (within
    ``settings.connect_timeout_s``), TLS when configured, and logged in as kproxy when
    ``settings.originator`` is set, with that login on the transport (``Transport.login``).

    OSError or trio.TooSlowError when it cannot be had; a refused login is an OriginationError (an
    OSError) and an unanswered one a LoginTimedOut (a TooSlowError), so ``login_failed`` tells them
    from a connection that could not be made."""
    t = await connect(host, port, settings.connect_timeout_s, settings.tls, settings.server_hostname)
    originator = settings.originator
    if originator is None:
        return t
    login = UpstreamLogin(originator, f"{host}:{port}", settings.request_timeout_s)
    try:
        await login.log_in(direct_roundtrip(t))
    except BaseException:
        t.close()
        raise
    t.login = login
    return t


async def renew_login(transport: Transport, ahead: float = 0.0) -> None:
    """Before the next request on a connection that one task uses a request at a time (discovery,
    fleet coordination): log in again if the login falls due within ``ahead`` seconds (KIP-368). A
    caller that sends at least every so often passes that period, so the login is renewed at the
    last request before its time rather than the first after it. The errors are
    ``UpstreamLogin.log_in``'s."""
    login = transport.login
    if login is not None and login.due(trio.current_time() + ahead):
        await login.log_in(direct_roundtrip(transport))

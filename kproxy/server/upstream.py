"""Opening a connection to a broker: the one function that discovery, client connections and fleet
quota coordination all call.

Whatever every broker connection needs before its first request (TCP, TLS with the configured
server name, and kproxy's own SASL login when ``upstream.sasl`` is set) is done here once, so no
caller can open a connection that skips a step. Callers handle OSError and trio.TooSlowError as "cannot
connect"; the two kinds that mean "connected, but the login failed" are subclasses of those.
"""

from __future__ import annotations

import ssl

import attrs
import trio

from kproxy.config import UpstreamConfig
from kproxy.server.origination import OriginationError, Originator, direct_roundtrip
from kproxy.server.transport import Transport, client_context, connect


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
        """From ``upstream:``; ``tls`` is the context already built, else it is built here when TLS is on."""
        if tls is None and cfg.tls.enabled:
            tls = client_context(cfg.tls)
        return cls(cfg.connect_timeout_s, tls, cfg.tls.server_hostname, originator, cfg.request_timeout_s)


class LoginTimedOut(trio.TooSlowError):
    """The broker connection was made, but the broker did not answer kproxy's login in time."""


def login_failed(e: BaseException) -> bool:
    """Whether ``e``, raised by open_upstream, means the connection was made and the login failed."""
    return isinstance(e, (OriginationError, LoginTimedOut))


async def open_upstream(host: str, port: int, settings: UpstreamSettings) -> Transport:
    """A connection to the broker at ``host``:``port``, ready for Kafka requests: connected (within
    ``settings.connect_timeout_s``), TLS when configured, and logged in as kproxy when
    ``settings.originator`` is set; ``session_lifetime_ms`` on the transport is what the broker said
    of that login's session (KIP-368; 0: no limit, or no login).

    OSError or trio.TooSlowError when it cannot be had; a refused login is an OriginationError (an
    OSError) and an unanswered one a LoginTimedOut (a TooSlowError), so ``login_failed`` tells them
    from a connection that could not be made."""
    t = await connect(host, port, settings.connect_timeout_s, settings.tls, settings.server_hostname)
    originator = settings.originator
    if originator is None:
        return t
    try:
        t.session_lifetime_ms = await originator.login(direct_roundtrip(t, settings.request_timeout_s),
                                                       f"{host}:{port}")
    except trio.TooSlowError:
        t.close()
        raise LoginTimedOut() from None
    except BaseException:
        t.close()
        raise
    return t

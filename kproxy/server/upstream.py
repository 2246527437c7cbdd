"""Opening a connection to a broker: the one function that discovery, client connections and fleet
quota coordination all call.

Whatever every broker connection needs before its first request (TCP, TLS with the configured
server name, and SASL origination once ``upstream.sasl`` exists) is done here once, so no caller can
open a connection that skips a step. Callers handle OSError and trio.TooSlowError as "cannot connect".
"""

from __future__ import annotations

import ssl

import attrs

from kproxy.config import UpstreamConfig
from kproxy.server.transport import Transport, client_context, connect


@attrs.frozen
class UpstreamSettings:
    """How kproxy reaches the brokers, fixed when the server starts (certificates loaded once)."""

    connect_timeout_s: float
    tls: ssl.SSLContext | None = None
    server_hostname: str | None = None      # None: the host connected to

    @classmethod
    def from_config(cls, cfg: UpstreamConfig, tls: ssl.SSLContext | None = None) -> UpstreamSettings:
        """From ``upstream:``; ``tls`` is the context already built, else it is built here when TLS is on."""
        if tls is None and cfg.tls.enabled:
            tls = client_context(cfg.tls)
        return cls(cfg.connect_timeout_s, tls, cfg.tls.server_hostname)


async def open_upstream(host: str, port: int, settings: UpstreamSettings) -> Transport:
    """A connection to the broker at ``host``:``port``, ready for Kafka requests; OSError or
    trio.TooSlowError (after ``settings.connect_timeout_s``) when it cannot be had."""
    return await connect(host, port, settings.connect_timeout_s, settings.tls, settings.server_hostname)

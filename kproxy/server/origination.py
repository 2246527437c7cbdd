"""SASL origination: kproxy logs in to a broker as itself (PLAIN, SCRAM-SHA-256/512, OAUTHBEARER,
GSSAPI) before any client request goes on the connection, and again before the broker's session ends
(KIP-368).

The exchange is written once over a ``roundtrip`` (send a request, get its response): on a fresh
connection it reads the socket directly; on a live one the connection's upstream pump hands kproxy
the answers to its own correlation ids, while the client's answers keep flowing to the client.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from scramp import ScramClient, ScramException

from kproxy.config import UpstreamSasl
from kproxy.identity.kerberos import GssFailure
from kproxy.identity.tokens import bearer_message
from kproxy.logs import safe
from kproxy.protocol.errors import KProxyError
from kproxy.protocol.framing import FrameReader
from kproxy.protocol.messages import Request, Response, body_class, decode_response, encode_request_frame
from kproxy.server.kerberos import KerberosLogin, KerberosStats
from kproxy.server.oauth import ClientCredentials, OAuthError
from kproxy.server.transport import Transport

log = logging.getLogger("kproxy.origination")

SASL_HANDSHAKE, SASL_AUTHENTICATE = 17, 36
# kproxy's own login requests use correlation ids from here; a client's never reach them while
# a login is under way on its connection (the session's ids start at 0 and re-authentication is
# short), and the pump tells them apart by this set, not by range.
LOGIN_CORRELATION_BASE = 0x7FFF0000
LOGIN_FRAME_CAP = 1 << 20
# RFC 4752: the security layer "none", the only one Kafka uses.
NO_SECURITY_LAYER = 1
# How long kproxy waits for the KDC (krb5's own retries included) before a GSSAPI login times out.
KDC_TIMEOUT_S = 30.0

Roundtrip = Callable[[Request], Awaitable[Response]]


class OriginationError(OSError):
    """The broker refused kproxy's login, or the login could not be made; an OSError so callers
    treat it as a connection that could not be had."""


def _read_secret(value: str | None, file: str | None) -> str:
    if value is not None:
        return value
    assert file is not None
    # Read at each login, so a rotated Secret mounted as a file is picked up without a restart.
    with open(file, encoding="utf-8") as f:
        return f.readline().rstrip("\r\n")


class Originator:
    """kproxy's credentials for the cluster, and the login exchange that uses them."""

    def __init__(self, cfg: UpstreamSasl, *, client_id: str = "kproxy",
                 tokens: ClientCredentials | None = None, kerberos_stats: KerberosStats | None = None) -> None:
        self.cfg = cfg
        self.client_id = client_id
        self.mechanism = cfg.mechanism
        oauth = cfg.oauth
        if tokens is None and oauth is not None:
            tokens = ClientCredentials(oauth.token_endpoint_url, oauth.client_id,
                                       lambda: _read_secret(oauth.client_secret, oauth.client_secret_file),
                                       oauth.scope)
        self.tokens = tokens
        self.kerberos: KerberosLogin | None = None
        if cfg.mechanism == "GSSAPI":
            assert cfg.principal is not None and cfg.keytab is not None
            self.kerberos = KerberosLogin(cfg.principal, cfg.keytab, cfg.service_name, kerberos_stats)
        self.logins = 0
        self.failures = 0
        self._ids = iter(range(LOGIN_CORRELATION_BASE, 1 << 31))

    def next_correlation_id(self) -> int:
        cid = next(self._ids, None)
        if cid is None:
            self._ids = iter(range(LOGIN_CORRELATION_BASE, 1 << 31))
            cid = next(self._ids)
        return cid

    async def login(self, roundtrip: Roundtrip, where: str) -> int:
        """Log in over ``roundtrip``; the broker's session_lifetime_ms (0: no limit).
        OriginationError when refused."""
        try:
            lifetime = await self._exchange(roundtrip, where)
        except GssFailure as e:
            self.failures += 1
            raise OriginationError(f"SASL GSSAPI login to {where} failed: {safe(e.reason, 400)}") from None
        except (ScramException, OAuthError, KProxyError, OSError) as e:
            self.failures += 1
            if isinstance(e, OriginationError):
                raise
            raise OriginationError(f"SASL {self.mechanism} login to {where} failed: {type(e).__name__}: "
                                   f"{safe(str(e), 200)}") from None
        self.logins += 1
        log.debug("logged in to %s as kproxy (%s, session %s)", where, self.mechanism,
                  f"{lifetime} ms" if lifetime else "unlimited")
        return lifetime

    def _request(self, api_key: int, version: int, **fields: Any) -> Request:
        return Request.build(api_key, version, self.next_correlation_id(), self.client_id,
                             body_class(api_key, "request")(**fields))

    async def _exchange(self, roundtrip: Roundtrip, where: str) -> int:
        mech = self.mechanism
        hs = await roundtrip(self._request(SASL_HANDSHAKE, 1, mechanism=mech))
        if hs.body.error_code != 0:
            raise OriginationError(f"the broker does not offer {mech} (it offers "
                                   f"{', '.join(map(safe, hs.body.mechanisms)) or 'none'}; error {hs.body.error_code})")

        async def step(auth_bytes: bytes) -> tuple[bytes, int]:
            resp = await roundtrip(self._request(SASL_AUTHENTICATE, 1, auth_bytes=auth_bytes))
            b = resp.body
            if b.error_code != 0:
                raise OriginationError(f"the broker refused kproxy's {mech} login (error {b.error_code}: "
                                       f"{safe(b.error_message or '', 200)})")
            return bytes(b.auth_bytes), int(b.session_lifetime_ms or 0)

        cfg = self.cfg
        if mech == "PLAIN":
            password = _read_secret(cfg.password, cfg.password_file)
            _, lifetime = await step(b"\x00" + (cfg.username or "").encode() + b"\x00" + password.encode())
            return lifetime
        if mech == "OAUTHBEARER":
            assert self.tokens is not None and cfg.oauth is not None
            token = await self.tokens.token()
            _, lifetime = await step(bearer_message(token, cfg.oauth.extensions))
            return lifetime
        if mech == "GSSAPI":
            return await self._gssapi(step, where)
        client = ScramClient([mech], cfg.username or "", _read_secret(cfg.password, cfg.password_file))
        server_first, _ = await step(client.get_client_first().encode())
        client.set_server_first(server_first.decode("utf-8", "replace"))
        server_final, lifetime = await step(client.get_client_final().encode())
        # The broker proves it knows the stored key too (mutual authentication, RFC 5802).
        client.set_server_final(server_final.decode("utf-8", "replace"))
        return lifetime


    async def _gssapi(self, step: Callable[[bytes], Awaitable[tuple[bytes, int]]], where: str) -> int:
        """RFC 4752 as Kafka's Java client runs it: context tokens until the broker has proved itself
        (mutual authentication), an empty reply to its last one, then its wrapped offer of security
        layers answered with a wrapped choice of none and kproxy's principal as authorization id."""
        kerberos = self.kerberos
        assert kerberos is not None
        host = where.rpartition(":")[0].strip("[]")
        # The first token may need the KDC (a ticket for this broker, kproxy's own renewed): a thread.
        with trio.fail_after(KDC_TIMEOUT_S):
            context, token = await trio.to_thread.run_sync(kerberos.start, host, abandon_on_cancel=True)
        reply, lifetime = await step(token)
        while not context.complete:
            out = context.step(reply)
            reply, lifetime = await step(out)
        offer = context.unwrap(reply)
        if len(offer) < 4 or not offer[0] & NO_SECURITY_LAYER:
            raise GssFailure(f"{context.target} offers no login without a security layer (offer "
                             f"{offer[:1].hex() or 'empty'}); kproxy relays Kafka frames in clear inside "
                             "the connection's TLS, if any")
        choice = bytes((NO_SECURITY_LAYER, 0, 0, 0)) + kerberos.principal.encode()
        _, lifetime = await step(context.wrap(choice))
        return lifetime


def direct_roundtrip(transport: Transport, timeout: float | None = None,
                     frame_cap: int = LOGIN_FRAME_CAP) -> Roundtrip:
    """A roundtrip that reads the answer straight from ``transport`` (nothing else reads it while it
    runs): kproxy's login on a broker connection only one task uses, and discovery. Each answer
    within ``timeout`` (None: the caller times it, as ``UpstreamLogin`` does)."""
    reader = FrameReader(frame_cap)

    async def exchange(req: Request) -> memoryview:
        await transport.send(encode_request_frame(req))
        while (frame := reader.next_frame()) is None:
            n = await transport.recv_into(reader.recv_buffer())
            if n == 0:
                raise OriginationError("the broker closed the connection")
            reader.received(n)
        return frame

    async def roundtrip(req: Request) -> Response:
        if timeout is None:
            frame = await exchange(req)
        else:
            with trio.fail_after(timeout):
                frame = await exchange(req)
        return decode_response(frame, req.api_key, req.api_version)

    return roundtrip

"""Byte transports for the pumps: plain TCP with recv_into and vectored sends, or TLS over trio.

Plain sockets are used directly (no SocketStream) so a frame is received straight into the frame
reader's buffer and an encoded message with zero-copy records goes out in one ``sendmsg``. TLS
contexts for both sides are built here from the config.
"""

from __future__ import annotations

import socket
import ssl
from typing import Any

import trio

from kproxy.config import TlsClientSide, TlsServerSide

# Cap on buffers per sendmsg call (IOV_MAX is 1024 on Linux).
_IOV_MAX = 512


class Transport:
    """One side of a proxied connection."""

    peer_subject: str | None = None
    server_name: str | None = None

    def readable_now(self) -> bool:
        """Whether a receive would return at once; transports that cannot tell say True."""
        return True

    async def recv_into(self, buf: memoryview) -> int:
        raise NotImplementedError

    async def send(self, buffers: list) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class PlainTransport(Transport):
    __slots__ = ("raw", "sock")

    def __init__(self, sock: trio.socket.SocketType, raw: socket.socket | None = None) -> None:
        self.sock = sock
        self.raw = raw            # the same socket as a stdlib object, when kproxy created it

    async def recv_into(self, buf: memoryview) -> int:
        return await self.sock.recv_into(buf)

    def readable_now(self) -> bool:
        """Whether a receive would return at once (bytes or end of stream); True when unknown."""
        if self.raw is None:
            return True
        try:
            self.raw.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True
        return True

    async def send(self, buffers: list) -> None:
        sock = self.sock
        if len(buffers) == 1:
            # Most frames are one buffer: plain send, no list bookkeeping.
            view = memoryview(buffers[0]).cast("B")
            while view:
                view = view[await sock.send(view):]
            return
        bufs = [memoryview(b).cast("B") if not isinstance(b, bytes | bytearray) else b for b in buffers]
        while bufs:
            sent = await sock.sendmsg(bufs[:_IOV_MAX])
            # Drop what went out; a partial send leaves the tail of one buffer.
            while sent:
                n = len(bufs[0])
                if sent >= n:
                    sent -= n
                    bufs.pop(0)
                else:
                    bufs[0] = memoryview(bufs[0])[sent:]
                    sent = 0

    def close(self) -> None:
        self.sock.close()


class TlsTransport(Transport):
    __slots__ = ("stream",)

    def __init__(self, stream: trio.SSLStream) -> None:
        self.stream = stream

    async def recv_into(self, buf: memoryview) -> int:
        data = await self.stream.receive_some(len(buf))
        n = len(data)
        buf[:n] = data
        return n

    async def send(self, buffers: list) -> None:
        await self.stream.send_all(b"".join(buffers) if len(buffers) != 1 else buffers[0])

    def close(self) -> None:
        # The TCP socket closes at once; a TLS close_notify is skipped on purpose (no await here).
        self.stream.transport_stream.socket.close()


def tune(sock: Any) -> None:
    # Kafka frames are latency-sensitive request/response pairs: no Nagle delay.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


def format_subject(cert: dict) -> str | None:
    """RFC 4514-style subject of a peer certificate dict (``CN=client,O=Acme``)."""
    parts = []
    for rdn in reversed(cert.get("subject", ())):
        for key, value in rdn:
            short = {"commonName": "CN", "organizationName": "O", "organizationalUnitName": "OU",
                     "countryName": "C", "localityName": "L", "stateOrProvinceName": "ST"}.get(key, key)
            parts.append(f"{short}={value}")
    return ",".join(parts) or None


class SniNames:
    """Which SNI name a finished TLS handshake asked for, through public APIs only.

    The SNI callback switches the handshake to a context of the name's own (a copy of the server
    context, made once per name under ``domain``); after the handshake the stream's public
    ``context`` attribute says which one, so no private attribute of trio or ssl is read. Names
    outside the domain, or beyond ``max_names``, keep the shared context and read as None.
    """

    def __init__(self, domain: str | None, max_names: int = 1024) -> None:
        self.suffix = f".{domain.lower().rstrip('.')}" if domain else None
        self.max_names = max_names
        self._contexts: dict[str, ssl.SSLContext] = {}
        self._names: dict[int, str] = {}     # id(context) -> name
        self._make: Any = None

    def install(self, base: ssl.SSLContext, make: Any) -> None:
        self._make = make

        def switch(sslobj: Any, name: str | None, _ctx: ssl.SSLContext) -> None:
            ctx = self.context_for(name) if name else None
            if ctx is not None:
                sslobj.context = ctx

        base.sni_callback = switch

    def context_for(self, name: str) -> ssl.SSLContext | None:
        name = name.lower()
        if self.suffix is None or not name.endswith(self.suffix) or self._make is None:
            return None
        ctx = self._contexts.get(name)
        if ctx is None:
            if len(self._contexts) >= self.max_names:
                return None
            ctx = self._contexts[name] = self._make()
            self._names[id(ctx)] = name
        return ctx

    def known_names(self) -> list[str]:
        return sorted(self._contexts)

    def name_of(self, ctx: ssl.SSLContext) -> str | None:
        return self._names.get(id(ctx))


def server_context(cfg: TlsServerSide, names: SniNames | None = None) -> ssl.SSLContext:
    """TLS for client connections; with ``names``, each SNI name under its domain is remembered."""
    def make() -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        assert cfg.cert_file is not None
        ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
        if cfg.ca_file:
            ctx.load_verify_locations(cfg.ca_file)
            ctx.verify_mode = ssl.CERT_REQUIRED if cfg.require_client_cert else ssl.CERT_OPTIONAL
        return ctx

    base = make()
    if names is not None:
        names.install(base, make)
    return base


def client_context(cfg: TlsClientSide) -> ssl.SSLContext:
    """TLS from kproxy to the brokers."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=cfg.ca_file)
    if cfg.cert_file:
        ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
    if not cfg.verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


async def connect(host: str, port: int, timeout: float, tls: ssl.SSLContext | None,
                  server_hostname: str | None = None) -> Transport:
    """Open a connection to a broker; OSError (or trio.TooSlowError) when it cannot be had."""
    with trio.fail_after(timeout):
        infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        last: Exception | None = None
        for family, type_, proto, _, addr in infos:
            raw = socket.socket(family, type_, proto)
            raw.setblocking(False)
            sock = trio.socket.from_stdlib_socket(raw)
            try:
                await sock.connect(addr)
            except OSError as e:
                sock.close()
                last = e
                continue
            tune(sock)
            if tls is None:
                return PlainTransport(sock, raw)
            stream = trio.SSLStream(trio.SocketStream(sock), tls, server_hostname=server_hostname or host)
            try:
                await stream.do_handshake()
            except trio.BrokenResourceError as e:
                sock.close()
                # trio wraps the ssl error (bad certificate, reset); callers handle OSError as "cannot connect".
                raise OSError(f"TLS handshake with {host}:{port} failed: {e.__cause__ or 'connection closed'}") from e
            except BaseException:
                sock.close()
                raise
            return TlsTransport(stream)
        raise last or OSError(f"no address for {host}:{port}")

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

    async def recv_into(self, buf: memoryview) -> int:
        raise NotImplementedError

    async def send(self, buffers: list) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class PlainTransport(Transport):
    __slots__ = ("sock",)

    def __init__(self, sock: trio.socket.SocketType) -> None:
        self.sock = sock

    async def recv_into(self, buf: memoryview) -> int:
        return await self.sock.recv_into(buf)

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


def server_context(cfg: TlsServerSide, names: dict[int, str] | None = None) -> ssl.SSLContext:
    """TLS for client connections; ``names`` collects SNI server names by SSLObject id."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    assert cfg.cert_file is not None
    ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
    if cfg.ca_file:
        ctx.load_verify_locations(cfg.ca_file)
        ctx.verify_mode = ssl.CERT_REQUIRED if cfg.require_client_cert else ssl.CERT_OPTIONAL
    if names is not None:
        def remember(sslobj: Any, name: str | None, _ctx: ssl.SSLContext) -> None:
            if name:
                names[id(sslobj)] = name

        ctx.sni_callback = remember
    return ctx


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
            sock = trio.socket.socket(family, type_, proto)
            try:
                await sock.connect(addr)
            except OSError as e:
                sock.close()
                last = e
                continue
            tune(sock)
            if tls is None:
                return PlainTransport(sock)
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

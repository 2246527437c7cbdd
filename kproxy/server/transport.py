"""Byte transports for the pumps: plain TCP with recv_into and vectored sends, or TLS over trio.

Plain sockets are used directly (no SocketStream) so a frame is received straight into the frame
reader's buffer and an encoded message with zero-copy records goes out in one ``sendmsg``. TLS
contexts for both sides are built here from the config.
"""

from __future__ import annotations

import socket
import ssl
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import trio

from kproxy.config import TlsClientSide, TlsServerSide

if TYPE_CHECKING:                       # upstream.py opens transports: only the type is named here
    from kproxy.server.upstream import UpstreamLogin

# Cap on buffers per sendmsg call (IOV_MAX is 1024 on Linux).
_IOV_MAX = 512
# Socket operations that complete at once between two yields to the scheduler (fairness).
_YIELD_EVERY = 16
# The most one receive or send copies before the event loop gets a turn: a 5 MB Fetch answer goes
# through in slices of this, so other connections are not held for the whole copy. Measured: 512 KiB
# slices cost 1 KiB produce throughput (1 MB requests, 0.83x against 0.93x unsliced); 2 MiB keeps
# most of it and still holds the loop under 5 ms for a 4.4 MB Metadata answer (bench/big_metadata.py).
_SLICE = 2 * 1024 * 1024
_SMALL = 16 * 1024
# The most one TLS receive asks to decrypt. OpenSSL returns at most one record (16 KiB of plaintext;
# measured: 8 MiB read with 1 MiB asks came back as 512 reads of 16 KiB), but Python's SSLObject.read
# allocates the size asked for first: asking for the rest of a 50 MB frame cost 50 MB per 16 KiB.
_TLS_READ = 64 * 1024
_TLS_RECORD = 16 * 1024


# A plain int: or-ing the socket module's flag enums costs more than the peek itself.
PEEK_NOW = int(socket.MSG_PEEK | socket.MSG_DONTWAIT)


def socket_readable(raw: socket.socket) -> bool:
    """Whether a receive on ``raw`` would return at once (bytes, end of stream or an error): a peek,
    not a copy."""
    try:
        raw.recv(1, PEEK_NOW)
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True
    return True


class Transport:
    """One side of a proxied connection."""

    peer_subject: str | None = None
    server_name: str | None = None
    # A broker connection kproxy logged in on (upstream.sasl): that login and its session (KIP-368).
    # Set by kproxy.server.upstream.open_upstream.
    login: UpstreamLogin | None = None
    # Whether a large frame may be forwarded while it arrives (cut-through): the transport receives
    # into the frame reader's own chunk and sends views without copying them.
    can_stream = False

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
    """A plain TCP socket, driven directly: a receive or send that can complete at once does, with no
    trip through trio's scheduler; only a socket that would block waits (``wait_readable`` /
    ``wait_writable``). Every ``_YIELD_EVERY`` immediate operations yield once, so a connection that
    always has data ready cannot starve the others."""

    __slots__ = ("_drained", "_ready_ops", "raw", "sock")
    can_stream = True

    def __init__(self, sock: trio.socket.SocketType, raw: socket.socket) -> None:
        self.sock = sock
        self.raw = raw                # the same socket as the stdlib object kproxy created or accepted
        self._ready_ops = 0
        # The last receive was small and left the socket empty (it returned less than there was
        # room for): the next one waits for readiness first instead of trying a receive that would
        # fail. A peer that waits for an answer before its next request (most clients, most of the
        # time) sends nothing meanwhile, so this saves a failing system call per request and answer.
        self._drained = False

    async def _fair(self) -> None:
        self._ready_ops += 1
        if self._ready_ops >= _YIELD_EVERY:
            self._ready_ops = 0
            await trio.lowlevel.checkpoint()

    async def recv_into(self, buf: memoryview) -> int:
        raw = self.raw
        if len(buf) > _SLICE:
            # One receive copies at most a slice, so a multi-megabyte frame does not hold the event
            # loop (and every other connection) for the whole copy.
            buf = buf[:_SLICE]
        if self._drained:
            self._drained = False
            self._ready_ops = 0
            await trio.lowlevel.wait_readable(raw)
        while True:
            try:
                n = raw.recv_into(buf)
            except (BlockingIOError, InterruptedError):
                await trio.lowlevel.wait_readable(raw)
                continue
            # Small and short: a request or an answer, not a piece of a bulk transfer (whose next
            # bytes are usually there already, and would then cost a turn of the loop to wait for).
            self._drained = 0 < n < len(buf) and n < _SMALL
            if self._drained:
                return n       # about to wait for readiness anyway: no extra turn of the loop
            if n == _SLICE:
                await trio.lowlevel.checkpoint()
            else:
                await self._fair()
            return n

    def readable_now(self) -> bool:
        """Whether a receive would return at once (bytes or end of stream)."""
        return socket_readable(self.raw)

    async def send(self, buffers: list) -> None:
        raw = self.raw
        if len(buffers) == 1:
            first = buffers[0]
            if type(first) is bytes and len(first) <= _SMALL:
                # A small answer or request: one send that almost always takes it whole.
                try:
                    sent = raw.send(first)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                if sent == len(first):
                    # ``_fair`` inlined: a small request or answer costs no coroutine for it.
                    self._ready_ops += 1
                    if self._ready_ops >= _YIELD_EVERY:
                        self._ready_ops = 0
                        await trio.lowlevel.checkpoint()
                    return
                buffers = [first[sent:]]
            # Most frames are one buffer: plain send, no list bookkeeping.
            view = memoryview(buffers[0]).cast("B")
            while view:
                try:
                    sent = raw.send(view[:_SLICE])
                except (BlockingIOError, InterruptedError):
                    await trio.lowlevel.wait_writable(raw)
                    continue
                view = view[sent:]
                if view:
                    await trio.lowlevel.checkpoint()
            await self._fair()
            return
        bufs = [memoryview(b).cast("B") if not isinstance(b, bytes | bytearray) else b for b in buffers]
        while bufs:
            batch: list = []
            size = 0
            for b in bufs[:_IOV_MAX]:
                if size + len(b) > _SLICE and batch:
                    break
                batch.append(b if size + len(b) <= _SLICE else memoryview(b)[: _SLICE - size])
                size += len(batch[-1])
            try:
                sent = raw.sendmsg(batch)
            except (BlockingIOError, InterruptedError):
                await trio.lowlevel.wait_writable(raw)
                continue
            if sent >= _SLICE:
                await trio.lowlevel.checkpoint()    # a big frame goes out a slice at a time
            # Drop what went out; a partial send leaves the tail of one buffer.
            while sent:
                n = len(bufs[0])
                if sent >= n:
                    sent -= n
                    bufs.pop(0)
                else:
                    bufs[0] = memoryview(bufs[0])[sent:]
                    sent = 0
        await self._fair()

    def close(self) -> None:
        # trio's close wakes any task waiting on the descriptor (ClosedResourceError), then closes it.
        self.sock.close()


class TlsTransport(Transport):
    """TLS over trio's SSLStream, with the plain transport's guarantees: a receive decrypts at most
    ``_TLS_READ`` bytes (trio hands the size to ``SSLObject.read``, which allocates that much before it
    returns one record), a send encrypts at most a slice per turn of the loop, and ``readable_now``
    says False when nothing is known to be waiting, so an idle connection's grown buffer is given
    back. ``raw`` is the stdlib socket under the stream, peeked at like the plain transport's."""

    __slots__ = ("_full_record", "_left", "raw", "stream")
    # Cut-through is safe over TLS too: a receive copies decrypted bytes into the frame reader's own
    # chunk (never a buffer TLS keeps), and a send has encrypted every byte of the views it was given
    # (SSLObject.write takes them whole into its memory BIO) before it returns, which is before the
    # pump receives into that chunk again.
    can_stream = True

    def __init__(self, stream: trio.SSLStream, raw: socket.socket | None = None) -> None:
        self.stream = stream
        self.raw = raw
        # Plaintext decrypted but not yet asked for: a receive always takes a whole record, so the
        # TLS layer never holds half of one that readable_now could not see.
        self._left: memoryview | None = None
        self._full_record = False   # the last record was full size: a bulk transfer, more likely follows

    def readable_now(self) -> bool:
        """True when a receive would likely return at once: plaintext is left over, the last record
        was full size (a peer's write that ends exactly on a 16 KiB record reads as busy until the
        next receive), or bytes wait on the socket. Records trio has read from the socket but not
        decrypted read as False; that only gives a buffer back early, the next receive is immediate."""
        if self._left is not None or self._full_record or self.raw is None:
            return True
        return socket_readable(self.raw)

    async def recv_into(self, buf: memoryview) -> int:
        left = self._left
        if left is not None:
            n = min(len(buf), len(left))
            buf[:n] = left[:n]
            self._left = left[n:] if n < len(left) else None
            return n
        data = await self.stream.receive_some(min(max(len(buf), _TLS_RECORD), _TLS_READ))
        n = min(len(data), len(buf))
        buf[:n] = memoryview(data)[:n]
        if n < len(data):
            self._left = memoryview(data)[n:]
        self._full_record = len(data) >= _TLS_RECORD
        return n

    async def send(self, buffers: list) -> None:
        # Slices of at most _SLICE, each joined (small buffers) or sent as a view (a big one) and
        # encrypted in one go: a multi-megabyte answer is never copied and encrypted whole in one turn.
        stream = self.stream
        parts: list = []
        size = 0
        for b in buffers:
            view = memoryview(b).cast("B") if not isinstance(b, bytes | bytearray) else memoryview(b)
            while view:
                part = view[: _SLICE - size]
                view = view[len(part):]
                parts.append(part)
                size += len(part)
                if size >= _SLICE:
                    await stream.send_all(parts[0] if len(parts) == 1 else b"".join(parts))
                    parts, size = [], 0
        if parts:
            await stream.send_all(parts[0] if len(parts) == 1 else b"".join(parts))

    def close(self) -> None:
        # The TCP socket closes at once; a TLS close_notify is skipped on purpose (no await here).
        self.stream.transport_stream.socket.close()


def tune(sock: Any) -> None:
    # Kafka frames are latency-sensitive request/response pairs: no Nagle delay.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


class _NamedSSLObject(ssl.SSLObject):
    """A server-side TLS object that remembers the SNI name its client asked for (and kproxy
    accepted) as its public ``server_hostname``, which the stdlib leaves None on the server side and
    trio's SSLStream forwards. The record lives and dies with the connection: no table to fill."""

    asked_name: str | None = None

    @property
    def server_hostname(self) -> str | None:
        return self.asked_name if self.asked_name is not None else super().server_hostname


# The SNI name a handshake was refused for, set in the handshaking task's own context by the name
# callback (which runs inside that task), so the handshake's failure is logged with the name.
REFUSED_SNI_NAME: ContextVar[str | None] = ContextVar("kproxy_refused_sni_name", default=None)


class SniNames:
    """Which SNI names a handshake may ask for, and which one it asked.

    Only the names kproxy serves pass: ``broker-<int>.<domain>``, ``controller-<int>.<domain>`` and
    the bootstrap name. Any other name under the domain ends the handshake at the ClientHello, before
    a certificate is sent (OpenSSL makes an ``unrecognized_name`` alert, which trio does not flush
    before the socket closes), and leaves nothing behind; a name outside the domain (or none) is the
    bootstrap, as before SNI routing. One loaded context serves
    every name: the callback only records the name on the connection's own TLS object.
    """

    def __init__(self, domain: str | None, bootstrap_name: str = "bootstrap", listener: str = "") -> None:
        self.suffix = f".{domain.lower().rstrip('.')}" if domain else None
        self.bootstrap_name = bootstrap_name.lower()
        self.listener = listener    # the address the names are served on, for log lines
        self.refused = 0        # handshakes ended for a name kproxy does not serve

    def install(self, ctx: ssl.SSLContext) -> None:
        ctx.sslobject_class = _NamedSSLObject
        ctx.sni_callback = self._on_name

    def patterns(self) -> list[str]:
        """The names served, as a person reads them (for the log line of a name that matched none)."""
        domain = self.suffix or ""
        return [f"{self.bootstrap_name}{domain}", f"broker-<id>{domain}", f"controller-<id>{domain}"]

    def serves(self, name: str) -> bool:
        """Whether ``name`` (lower case, no final dot) is one of the names served."""
        return self.suffix is not None and name.endswith(self.suffix) and self.accepts(name)

    def accepts(self, name: str) -> bool:
        """Whether ``name`` (lower case, under the domain) is one kproxy serves."""
        assert self.suffix is not None
        label = name[: -len(self.suffix)]
        if label == self.bootstrap_name:
            return True
        role, dash, node = label.partition("-")
        # Node ids are non-negative int32s; "broker-007" is not how kproxy writes one.
        return (dash == "-" and role in ("broker", "controller") and node.isascii() and node.isdigit()
                and len(node) <= 10 and str(int(node)) == node and int(node) <= 0x7FFFFFFF)

    def _on_name(self, sslobj: Any, name: str | None, _ctx: ssl.SSLContext) -> int | None:
        if name is None or self.suffix is None:
            return None
        name = name.lower().rstrip(".")
        if not name.endswith(self.suffix):
            return None
        if not self.accepts(name):
            self.refused += 1
            REFUSED_SNI_NAME.set(name)
            return ssl.ALERT_DESCRIPTION_UNRECOGNIZED_NAME
        if isinstance(sslobj, _NamedSSLObject):
            sslobj.asked_name = name
        return None

    @staticmethod
    def name_of(stream: Any) -> str | None:
        """The name a finished server-side handshake asked for and kproxy serves, else None."""
        name = stream.server_hostname
        return name if isinstance(name, str) else None


def server_context(cfg: TlsServerSide, names: SniNames | None = None) -> ssl.SSLContext:
    """TLS for client connections, loaded from the files as they are now; with ``names``, SNI names
    are checked and recorded on each connection."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    assert cfg.cert_file is not None
    ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
    if cfg.ca_file:
        ctx.load_verify_locations(cfg.ca_file)
        ctx.verify_mode = ssl.CERT_REQUIRED if cfg.require_client_cert else ssl.CERT_OPTIONAL
    if names is not None:
        names.install(ctx)
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
            return TlsTransport(stream, raw)
        raise last or OSError(f"no address for {host}:{port}")

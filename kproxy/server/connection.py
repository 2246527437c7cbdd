"""The tasks of one proxied connection: the client -> broker and broker -> client pumps and the
watchdog, and the connection's life from accept to close.

The connection's nursery runs them; when the client side ends, the cancel scope ends the others and
both sockets close in ``finally``. Every task hands the session's actions to the one executor
(``executor.py``), which keeps the two orders (``ordering.py``): answers reach the client in the order
the session made them, and writes to the broker go one at a time. A broker connection that is lost
is not fatal to the client: the session answers what was waiting with retriable errors and the next
request reconnects. Every request the session read completes exactly once, also when the client
goes away (``client_gone``). A connection needs no server: it gets a frozen settings snapshot, a
router (where to connect, which ports to open) and a completion callback.
"""

from __future__ import annotations

import fcntl
import logging
import socket
import struct
import termios
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import attrs
import trio

from kproxy.logs import safe
from kproxy.protocol.entities import hold_ms
from kproxy.protocol.errors import FrameError
from kproxy.protocol.framing import STREAM_NONE, STREAMS, FrameReader, frame_taker
from kproxy.protocol.messages import api_name
from kproxy.protocol.records import V2_HEADER_SIZE
from kproxy.proxy.actions import ToClient, ToUpstream
from kproxy.proxy.addresses import Route
from kproxy.proxy.inflight import CLIENT_GONE, CLOSED, InFlight
from kproxy.proxy.session import Session
from kproxy.server.budget import BufferBudget
from kproxy.server.executor import Executor
from kproxy.server.ordering import ClientGone, ClientWriter, ConnectionClosed, run_clock
from kproxy.server.splice import Pipe
from kproxy.server.splice import available as splice_available
from kproxy.server.stats import ProxyStats
from kproxy.server.transport import PEEK_NOW, PlainTransport, Transport
from kproxy.server.upstream import UpstreamSettings
from kproxy.server.watchdog import watch

log = logging.getLogger("kproxy.server")

_I32 = struct.Struct(">i")
# After a drain's last answer, how long kproxy waits for the client to close (reading and dropping
# what it still sends) before closing itself: closing a socket with unread bytes sends a reset,
# which makes the client's kernel drop answers it had not read yet.
LINGER_S = 1.0
# And how long the answer has to be read before the end of the stream follows it: kafka-python
# 3.0 drops the bytes of a read that also meets the end of the stream (transport._sock_recv), so an
# answer and the close must not arrive together.
CLOSE_GRACE_S = 0.25
# The largest frame a client may send before it has logged in to kproxy: a SaslAuthenticate with a
# 128 KiB token fits; a stranger cannot make kproxy hold more than this.
PRE_LOGIN_FRAME_CAP = 256 * 1024
# ``FrameReader.next_frame`` as a function, its common cases compiled where the accelerator is.
_next_frame = frame_taker()


@attrs.frozen(slots=True)
class ConnectionSettings:
    """What a connection needs to know, fixed when it opens (a reload affects new connections)."""

    frame_cap: int
    max_in_flight: int
    bootstrap_servers: tuple[tuple[str, int], ...]
    # How each broker connection is opened (TLS, and kproxy's own login when upstream.sasl is set).
    upstream: UpstreamSettings
    request_timeout_s: float
    unauthenticated_timeout_s: float = 0.0
    idle_timeout_s: float = 0.0
    frame_timeout_s: float = 0.0
    frame_cap_setting: str | None = None     # the setting that sets frame_cap, named in errors
    # Streamed record batch bodies go broker -> client by splice(2) where the platform allows.
    splice: bool = False
    # The process's key service (``kproxy.kms.service.KeyService``) when a KMS is configured: it
    # answers the sessions' ``Keys`` actions.
    keys: Any = None

    @property
    def watchdog_period(self) -> float | None:
        """How often the watchdog looks; None when no timeout is set."""
        timeouts = [t for t in (self.unauthenticated_timeout_s, self.idle_timeout_s, self.frame_timeout_s,
                                self.request_timeout_s) if t > 0]
        return min(min(timeouts) / 4, 5.0) if timeouts else None


class Router(Protocol):
    """Where connections go, and the ports they need open (the server implements it)."""

    def route_for(self, port: int | None, name: str | None) -> Route | None: ...

    def open_ports(self, ports: tuple[int, ...]) -> str | None:
        """Listen on ``ports`` now; None when all are listening, else why one cannot be."""


Completion = Callable[[InFlight], None]


class ClientConnection(Executor):
    """One client connection and the broker connection behind it."""

    __slots__ = ("_close_reason", "_drain_reason", "_held", "_linger", "_lose_pending", "_now", "_nursery",
                 "_partial_frame", "_partial_since", "_pipe", "_pre_login", "_quiet_since", "_readers", "_room",
                 "_seen_requests", "_splice_ok", "budget", "bytes_in", "bytes_out", "cancel_scope", "client",
                 "client_gone", "client_reader", "closing", "cluster", "draining", "on_complete", "opened_at",
                 "prepare", "requests_done", "route_key", "router", "session", "settings", "stats", "unrouted",
                 "writer")

    def __init__(self, settings: ConnectionSettings, router: Router, client: Transport, session: Session,
                 *, on_complete: Completion | None = None, budget: BufferBudget | None = None,
                 route_key: tuple[int | None, str | None] = (None, None), stats: ProxyStats | None = None,
                 prepare: Callable[[memoryview], Awaitable[None]] | None = None, cluster: str = "default") -> None:
        super().__init__()
        self.settings = settings
        self.cluster = cluster                      # the upstream cluster it uses for its life
        self.router = router
        self.client = client
        self.session = session
        self.on_complete = on_complete
        self.budget = budget if budget is not None else BufferBudget(None)
        self.stats = stats                          # decode errors and connect failures, for metrics
        self.route_key = route_key                  # (exposed port, SNI name) the client connected to
        self.unrouted: tuple[int | None, str | None] | None = None   # (port, SNI name) not yet placed
        self._now = run_clock()
        self.opened_at = self._now()
        self.requests_done = 0
        self.bytes_in = 0                           # request bytes from the client
        self.bytes_out = 0                          # response bytes to the client
        self._close_reason: str | None = None       # why another task closed the connection
        self.writer = ClientWriter(client, self._complete)
        self.client_gone = False                    # the client went away (not kproxy closing it)
        self._room = trio.Event()                   # set when in-flight drops below the limit
        self._nursery: trio.Nursery | None = None
        self.cancel_scope: trio.CancelScope | None = None
        self.draining = False
        self._drain_reason = "kproxy is shutting down"
        self._linger = False                        # a drain ended it: close gracefully (LINGER_S)
        self.closing = False                        # it owes the client nothing more; closing
        self.client_reader = FrameReader(settings.frame_cap, trust_claims=False,
                                         limit_name=settings.frame_cap_setting)
        self._readers: list[FrameReader] = [self.client_reader]
        # The watchdog's view (``check``): since when the client has been quiet and how many requests
        # it had sent then; the frame being received (by the count of frames before it) and since when.
        self._quiet_since = self._partial_since = self.opened_at
        self._seen_requests = session.requests
        self._partial_frame: int | None = None
        self._lose_pending = False                  # a broker connection is being dropped as overdue
        self._held = 0                              # bytes this connection counts in the budget
        # The pipe streamed record bodies are spliced through (opened at the first splice), when
        # this platform, the settings and the client's transport allow it.
        self._splice_ok = settings.splice and isinstance(client, PlainTransport) and splice_available()
        self._pipe: Pipe | None = None
        # I/O a request needs before the session judges it (a JWKS refresh for a token's unknown kid).
        self.prepare = prepare
        front = session.front
        self._pre_login = front is not None and front.termination is not None
        if self._pre_login:
            self.client_reader.max_frame_size = min(settings.frame_cap, PRE_LOGIN_FRAME_CAP)
            self.client_reader.limit_name = "the frame limit before SASL login (256 KiB)"

    # -- completion

    def _complete(self, done: tuple[InFlight, ...] | list[InFlight], now: float) -> None:
        session = self.session
        for entry in done:
            entry.finished_at = now
            session.finish(entry)
            self.requests_done += 1
            self.bytes_in += entry.request_bytes
            self.bytes_out += entry.response_bytes
            if self.on_complete is not None:
                self.on_complete(entry)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("connection %d: %s v%d (correlation id %d) %s in %.2f ms, %d B in, %d B out",
                          self.session.ctx.connection_id, api_name(entry.api_key), entry.api_version,
                          entry.client_correlation_id, entry.outcome, (now - entry.started) * 1000,
                          entry.request_bytes, entry.response_bytes)
        if not self._room.is_set():
            self._room.set()
        if self.draining and not session.open:
            self._close_from_task(f"{self._drain_reason} (answered what was in flight)", linger=True)

    # -- the whole connection

    async def run(self) -> None:
        ctx = self.session.ctx
        reason = "client closed the connection"
        try:
            with trio.CancelScope() as scope:
                self.cancel_scope = scope
                try:
                    async with trio.open_nursery() as nursery:
                        self._nursery = nursery
                        period = self.settings.watchdog_period
                        unwatch = watch(self, period) if period is not None else None
                        try:
                            await self._client_pump()
                        except ClientGone as e:
                            reason = str(e)
                            self.client_gone = True
                        except ConnectionClosed as e:
                            reason = str(e)
                        except FrameError as e:
                            reason = f"bad frame from client: {e}"
                            if self.stats is not None:
                                self.stats.decode_errors["request"] += 1
                        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
                            reason = f"client connection error: {e!r}"
                            self.client_gone = True
                        finally:
                            if unwatch is not None:
                                unwatch()
                        nursery.cancel_scope.cancel()
                except Exception as e:
                    # A bug (in kproxy or a filter) ends this connection only, never the proxy.
                    # The traceback names code, not message contents, so no secret reaches the log.
                    log.error("connection %d: internal error", ctx.connection_id, exc_info=True)
                    reason = f"internal error: {type(_leaf(e)).__name__}"
            if self._close_reason is not None:
                reason = self._close_reason
            elif scope.cancelled_caught and reason == "client closed the connection":
                reason = "closed by kproxy (shutdown)"
            if self._linger and not self.client_gone:
                self.closing = True
                await self._lingering_close()
        finally:
            self.client.close()
            if self.upstream is not None:
                # A request cut off part-way is never completed: the broker connection holding it goes.
                self.upstream.close()
            if self._pipe is not None:
                self._pipe.close()
                self._pipe = None
            up = self.session.streaming_up
            if up is not None and up.entry is not None and up.lost is None:
                log.warning("connection %d: the client connection ended %d bytes into a %d-byte Produce "
                            "request streaming to the broker; closed the broker connection holding it",
                            ctx.connection_id, up.stream.sent - 4, up.stream.size)
            self.budget.release(self._held)
            self._held = 0
            # Requests still owed end here, each exactly once: the client went away, or kproxy
            # closed the connection (a bad frame, a drain timeout, a fault).
            left = self.session.abandon(CLIENT_GONE if self.client_gone else CLOSED)
            if left:
                self._complete(left, trio.current_time())
            self.session.close()
            log.info("connection %d from %s closed after %.1fs: %s (client id %s, %d requests, "
                     "%s in, %s out)", ctx.connection_id, _addr(ctx.client_address),
                     trio.current_time() - self.opened_at, safe(reason, 500), safe(ctx.client_id),
                     self.requests_done, _size(self.bytes_in), _size(self.bytes_out))

    def drain(self, reason: str = "kproxy is shutting down") -> None:
        """Shut down gently: answer what is in flight, take no new request, then close (a shutdown, or
        a switch to another upstream cluster: the client reconnects)."""
        self.draining = True
        self._drain_reason = reason
        if not self.session.open:
            self._close_from_task(f"{reason} (nothing in flight)", linger=True)

    def _account(self) -> None:
        held = 0
        for r in self._readers:
            held += r.held_bytes
        if self._pipe is not None:
            held += self._pipe.capacity
        up = self.session.streaming_up
        if up is not None:
            # A large request the filters wanted whole is kept by its walker until its end.
            held += up.stream.held_bytes
        if held != self._held:
            self.budget.adjust(held - self._held)
            self._held = held

    # -- client -> broker

    async def _client_pump(self) -> None:
        reader = self.client_reader
        session = self.session
        limit = self.settings.max_in_flight
        client = self.client
        budget = self.budget
        writer = self.writer
        counted = -1        # the reader's held bytes when last accounted for
        # A request streaming to the broker is read to its end whatever happens meanwhile (a drain, a
        # throttle): its first bytes are with the broker, which holds the write lock for the rest.
        while not self.draining or reader.streaming_left:
            muted = session.throttled_for(self._now()) if session.throttle_until else 0.0
            if muted > 0 and not reader.streaming_left:
                # Throttled: read nothing until the time is up, as a broker mutes the channel, and
                # hold no receive buffer meanwhile (the answer that said so is already on its way).
                if reader.release_idle():
                    self._account()
                await self._hold(muted)
                continue
            if budget.exhausted and reader.at_frame_boundary:
                # Backpressure across the whole process: no new request is read until buffers drain.
                # A frame already begun keeps arriving (its sender must send every byte it holds,
                # and the frame timeout bounds how long); pausing it too could wait forever. The
                # receive buffer goes back first: idle buffers alone could fill the budget, and then
                # nothing would ever free memory.
                if reader.release_idle():
                    self._account()
                await budget.wait_for_room()
            if reader.chunk_is_large and reader.idle_chunk_is_large and not client.readable_now():
                # Going idle: give a grown receive chunk back before waiting (a peek, not a copy).
                reader.release_idle()
                self._account()
            n = await client.recv_into(reader.recv_buffer())
            if self.draining and not reader.streaming_left:
                break
            if n == 0:
                self._account()
                self.client_gone = True
                return
            reader.received(n)
            min_bytes = session.stream_min_bytes
            stream_from = min_bytes if min_bytes is not None else STREAM_NONE
            while True:
                frame = _next_frame(reader, stream_from)
                if frame is STREAMS:
                    # A large Produce request starting (or going on) here may go out as it arrives
                    # (a frame too small to stream costs no coroutine).
                    await self._stream_request(reader)
                    if self.draining:
                        break
                    frame = _next_frame(reader, 0)
                if frame is None:
                    break
                if len(session.open) >= limit:
                    # Backpressure: stop reading the client until answers (written ones) make room.
                    self._room = trio.Event()
                    while len(session.open) >= limit:
                        await self._room.wait()
                        self._room = trio.Event()
                if self.prepare is not None:
                    await self.prepare(frame)
                actions = session.client_frame(frame)
                if len(actions) == 1 and type(actions[0]) is ToUpstream:
                    # A request forwarded (nearly always): to the broker without the executor's loop.
                    await self._to_upstream(actions[0])
                    if writer.pending:
                        await writer.flush()
                else:
                    await self._execute(actions)
                if self._pre_login and session.ctx.authenticated:
                    self._pre_login = False
                    reader.max_frame_size = self.settings.frame_cap
                    reader.limit_name = self.settings.frame_cap_setting
                if self.draining:
                    break
            if reader.held_bytes != counted or session.streaming_up is not None:
                # The other pump accounts for its own reader; a request streaming up holds bytes too.
                counted = reader.held_bytes
                self._account()
        # Draining: the requests already taken are answered; then the connection ends.
        while session.open:
            self._room = trio.Event()
            await self._room.wait()
        self._linger = True
        raise ConnectionClosed(f"{self._drain_reason} (answered what was in flight)")

    # -- cut-through: a large request streamed to the broker while it arrives

    async def _stream_request(self, reader: FrameReader) -> None:
        """The pieces of a large Produce request that have arrived go to the broker now, each written
        before the next receive (they are views of the receive chunk): a slow broker holds the client
        back and the request holds one chunk of memory. Frames behind it are left to ``next_frame``."""
        session = self.session
        while True:
            if reader.streaming_left:
                piece = reader.take_piece()
                if piece is None:
                    return
                try:
                    await self._execute(session.request_piece(piece))
                finally:
                    if not reader.streaming_left:
                        self._stream_up_over()
                continue
            # A request that arrived whole streams too: stored, it would be decoded whole and its
            # chunk lent, and the next large request would need a fresh one.
            starting = reader.frame_starting(whole=True)
            if starting is None or len(starting[1]) < 8 or self._pre_login or self.draining:
                return
            size, head = starting
            if size > reader.max_frame_size or head[0:2] != b"\x00\x00":
                return          # next_frame refuses an oversized frame; only Produce (api key 0) streams
            limit = self.settings.max_in_flight
            if len(session.open) >= limit:
                # Backpressure, as for a frame read whole: room first, then the request is taken.
                self._room = trio.Event()
                while len(session.open) >= limit:
                    await self._room.wait()
                    self._room = trio.Event()
            # A broker connection not open yet will be one of kproxy's transports, which all stream.
            transport = self.client.can_stream and (self.upstream is None or self.upstream.can_stream)
            if not session.request_stream_start(size, head, transport):
                return
            reader.stream_current()

    # -- broker -> client

    async def _upstream_pump(self, upstream: Transport, generation: int) -> None:
        reader = FrameReader(self.settings.frame_cap, trust_claims=True,
                             limit_name=self.settings.frame_cap_setting)
        self._readers.append(reader)
        self._answer_task = trio.lowlevel.current_task()
        session = self.session
        writer = self.writer
        counted = -1        # the reader's held bytes when last accounted for
        try:
            while True:
                if reader.chunk_is_large and reader.idle_chunk_is_large and not upstream.readable_now():
                    reader.release_idle()
                    self._account()
                n = await upstream.recv_into(reader.recv_buffer())
                if n == 0:
                    raise ConnectionError("broker closed the connection")
                reader.received(n)
                min_bytes = session.stream_min_bytes
                stream_from = min_bytes if min_bytes is not None else STREAM_NONE
                while True:
                    frame = _next_frame(reader, stream_from)
                    if frame is STREAMS:
                        # A large answer starting (or going on) here may go out as it arrives (one
                        # too small to stream costs no coroutine).
                        await self._stream_pieces(reader, upstream)
                        frame = _next_frame(reader, 0)
                    if frame is None:
                        break
                    if self._login_answers is not None and _I32.unpack_from(frame, 0)[0] in self._login_ids:
                        # An answer to kproxy's own re-authentication: never the client's business.
                        self._login_answers.send_nowait(bytes(frame))
                        continue
                    # Answers queue up across the frames of one read and go out in one write.
                    actions = session.upstream_frame(frame)
                    if len(actions) == 1 and type(actions[0]) is ToClient and actions[0].buffers:
                        # An answer (nearly always): queued as the executor would, without its loop.
                        writer.put(actions[0].buffers, actions[0].done)
                    else:
                        await self._execute(actions, flush=False)
                    if self._settle is not None:
                        self._settled()
                    if self.unrouted is not None and not session.in_flight:
                        await self.writer.flush()    # what is owed goes out before a reconnect
                        self._check_route()
                if writer.pending:
                    await writer.flush()
                if reader.held_bytes != counted or self._pipe is not None:
                    counted = reader.held_bytes
                    self._account()
        except (OSError, FrameError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
            if isinstance(e, FrameError) and self.stats is not None:
                self.stats.decode_errors["response"] += 1
            if generation == self._upstream_generation and self.upstream is upstream:
                try:
                    await self._upstream_lost(str(e) or repr(e))
                except ConnectionClosed as closed:
                    self._closed(closed)
        except ConnectionClosed as e:
            self._closed(e)
        finally:
            self._readers.remove(reader)
            self._account()

    async def _stream_pieces(self, reader: FrameReader, upstream: Transport) -> None:
        """Cut-through: the pieces of a large answer that have arrived go to the client now, each
        written before the next receive (they are views of the receive chunk), so a client that
        reads slowly holds the broker connection back and the answer holds one chunk of memory.
        Frames behind it are left to ``next_frame``."""
        session = self.session
        splices = self._splice_ok and isinstance(upstream, PlainTransport)
        while True:
            if reader.streaming_left:
                piece = reader.take_piece()
                if piece is None:
                    if splices:
                        assert isinstance(upstream, PlainTransport)
                        if await self._splice_batches(reader, upstream):
                            continue
                        # Receive only up to the next batch header: its body can then be spliced.
                        reader.recv_cap = session.stream_recv_hint()
                    return
                reader.recv_cap = None
                await self._execute(session.stream_piece(piece))
                continue
            reader.recv_cap = None
            starting = reader.frame_starting(whole=True)
            if starting is None or len(starting[1]) < 4:
                return
            if not session.stream_start(starting[0], starting[1], upstream.can_stream and self.client.can_stream):
                return
            # Answers owed before it go out first (the session streams only the next one owed).
            if self.writer.pending:
                await self.writer.flush()
            reader.stream_current()

    async def _splice_batches(self, reader: FrameReader, upstream: PlainTransport) -> bool:
        """Splice record batches of the streamed answer for as long as the next bytes on the broker's
        socket are batches: each batch header is peeked at (and counted), then the whole batch moves
        without a copy. False when the walker must see the next bytes (they are received and fed)."""
        session = self.session
        raw = upstream.raw
        spliced = False
        while reader.streaming_left:
            room = session.stream_splice_room()
            if not room:
                try:
                    head = raw.recv(V2_HEADER_SIZE, PEEK_NOW)
                except (BlockingIOError, InterruptedError):
                    await trio.lowlevel.wait_readable(raw)
                    continue
                if not head:
                    raise ConnectionError("broker closed the connection")
                room = session.stream_take_unseen(head)
                if not room:
                    return spliced
            await self._splice(reader, upstream, room)
            spliced = True
        return spliced

    async def _splice(self, reader: FrameReader, upstream: PlainTransport, n: int) -> None:
        """``n`` bytes of record batches whose headers the walker has counted, straight from the
        broker's socket to the client's (zero-copy); the walker and the reader are told they passed. The pipe is emptied
        before this returns, so the client holding back holds the broker back."""
        pipe = self._pipe
        if pipe is None:
            pipe = self._pipe = Pipe()
            self._account()
        try:
            await self.writer.splice(pipe, upstream.raw, n)
        except BaseException:
            # What reached the client counts (the log of a broken answer says how much was sent).
            if pipe.delivered and self.session.streaming is not None:
                reader.skip_streamed(pipe.delivered)
                self.session.stream_skip(pipe.delivered)
            raise
        reader.skip_streamed(n)
        await self._execute(self.session.stream_skip(n))

    def _check_route(self) -> None:
        assert self.unrouted is not None
        route = self.router.route_for(*self.unrouted)
        if route is None:
            return
        self.unrouted = None
        if route.upstream != self.connected_to:
            # Served by the wrong broker so far: close between requests; the client reconnects
            # to the same address and now reaches the right one.
            raise ConnectionClosed(f"learned that this address is node {route.node_id}; "
                                   "closing so the client reconnects to it")

    def _closed(self, e: ConnectionClosed) -> None:
        """Another task than the client pump ended the connection with ``e``."""
        if isinstance(e, ClientGone):
            self.client_gone = True
        self._close_from_task(str(e))

    def _close_from_task(self, reason: str, *, linger: bool = False) -> None:
        """End the connection from any task; ``linger``: every answer owed is written, so the
        client's socket is closed gracefully (``_lingering_close``) rather than at once."""
        self._close_reason = reason
        self.closing = True
        if linger:
            self._linger = True
        else:
            self.client.close()
        if self.cancel_scope is not None:
            self.cancel_scope.cancel()

    async def _lingering_close(self) -> None:
        """Once the client's kernel has every answer and the client a moment to read it, shut the
        sending side (the client reads the end of the stream after the answers) and drop what the
        client still sends until it closes, for up to LINGER_S: a close with unread bytes would send
        a reset, and the client's kernel would drop answers it had not read yet."""
        raw = getattr(self.client, "raw", None)
        if raw is None:
            return
        with trio.move_on_after(LINGER_S):
            while _unacknowledged(raw) > 0:
                await trio.sleep(0.01)
        await trio.sleep(CLOSE_GRACE_S)
        try:
            raw.shutdown(socket.SHUT_WR)
        except OSError:
            return
        with trio.move_on_after(LINGER_S):
            while True:
                try:
                    if not raw.recv(65536):
                        return
                except (BlockingIOError, InterruptedError):
                    await trio.lowlevel.wait_readable(raw)
                except OSError:
                    return

    # -- timeouts

    def _overdue(self, now: float) -> str | None:
        streaming = self.session.streaming
        for entry in self.session.in_flight:
            if streaming is not None and entry is streaming[0]:
                return None  # its answer is arriving; a slow client, not the broker, sets the pace
            # Timed from when it was written to the broker: a request kproxy itself holds (a
            # throttle, a delay) is not the broker being slow.
            sent = entry.forwarded_at
            if entry.reply is None and entry.upstream_correlation_id is not None and sent is not None:
                # (The timeout alone first: a relayed request's hold is read by decoding it.)
                timeout = self.settings.request_timeout_s
                if now - sent > timeout and now - sent > allowed_seconds(entry, timeout):
                    return api_name(entry.api_key)
                return None  # answers come in order: only the oldest sent can be the first overdue
        return None

    # -- the watchdog (kproxy.server.watchdog calls ``check`` every period while the connection runs)

    def check(self, now: float) -> None:
        """Look at this connection's timeouts: a broker that stopped answering, a login not finished,
        a frame arriving too slowly, a client idle too long."""
        if self._lose_pending or (self.cancel_scope is not None and self.cancel_scope.cancel_called):
            return
        s = self.settings
        session = self.session
        reader = self.client_reader
        if s.request_timeout_s > 0 and self.upstream is not None and self._nursery is not None:
            late = self._overdue(now)
            if late is not None:
                # A broker that stopped answering without closing (a partition, a hung host): drop
                # that connection so waiting clients get retriable errors, not silence.
                self._lose_pending = True
                self._nursery.start_soon(self._lose_overdue, late)
                return
        unauth = s.unauthenticated_timeout_s
        if (unauth > 0 and session.sasl_in_progress and not session.ctx.authenticated
                and now - session.sasl_started_at > unauth):
            self._close_from_task(f"SASL authentication not completed within {unauth:g}s "
                                  "(limits.unauthenticated_idle_timeout_s)")
            return
        if self._holding or self._up_sending:
            # kproxy's own wait, or a slow broker holding back a streamed request's pieces.
            self._partial_since = self._quiet_since = now
        if s.frame_timeout_s > 0:
            if reader.at_frame_boundary:
                self._partial_frame = None
            elif self._partial_frame != reader.frames:
                self._partial_frame, self._partial_since = reader.frames, now
            elif now - self._partial_since > s.frame_timeout_s:
                # One byte every few seconds must not keep a connection (and its buffer) forever.
                self._close_from_task(f"a request frame did not arrive whole within "
                                      f"{s.frame_timeout_s:g}s (limits.frame_timeout_s)")
                return
        if session.requests != self._seen_requests or session.open:
            self._seen_requests, self._quiet_since = session.requests, now
        elif s.idle_timeout_s > 0 and now - self._quiet_since > s.idle_timeout_s:
            self._close_from_task(f"no request for {s.idle_timeout_s:g}s (limits.idle_timeout_s)")

    def close_from_watchdog(self, reason: str) -> None:
        self._close_from_task(reason)

    async def _lose_overdue(self, late: str) -> None:
        try:
            await self._upstream_lost(f"no {late} response within the request timeout")
        except ConnectionClosed as e:
            self._closed(e)
        finally:
            self._lose_pending = False


def _unacknowledged(raw: socket.socket) -> int:
    """Bytes sent on ``raw`` the peer has not acknowledged yet (Linux SIOCOUTQ); 0 where unknown."""
    try:
        return int(struct.unpack("i", fcntl.ioctl(raw.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0])
    except (OSError, ValueError):
        return 0


def allowed_seconds(entry: InFlight, request_timeout: float) -> float:
    """How long ``entry`` may wait for its response: the timeout plus any wait it asked for (the
    schema's ``hold=ms`` fields: a Fetch's max_wait_ms, a JoinGroup's rebalance timeout, ...)."""
    req = entry.decoded_request()
    if req is None:
        return request_timeout
    return request_timeout + hold_ms(req.body, req.api_key, req.api_version) / 1000.0


def _leaf(e: BaseException) -> BaseException:
    """The one exception inside nested single-member exception groups (trio's nurseries wrap)."""
    while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
        e = e.exceptions[0]
    return e


def _addr(a: tuple[str, int] | None) -> str:
    return f"{a[0]}:{a[1]}" if a else "?"


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)

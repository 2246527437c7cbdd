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
from typing import TYPE_CHECKING, Any, Protocol

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
from kproxy.server.clients import ClientRecord
from kproxy.server.executor import Executor
from kproxy.server.handover import lane_api, lane_table
from kproxy.server.ordering import ClientGone, ClientWriter, ConnectionClosed, run_clock
from kproxy.server.splice import Pipe
from kproxy.server.splice import available as splice_available
from kproxy.server.stats import ProxyStats
from kproxy.server.transport import PEEK_NOW, PlainTransport, Transport
from kproxy.server.upstream import UpstreamSettings
from kproxy.server.watchdog import watch

if TYPE_CHECKING:                   # the lane is optional (a build without a compiler has none)
    from kproxy.server.lane import Given, Lane, LaneApi, LaneHandle

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
# A connection goes to the lane (``_lane_turn``) after this many requests in a row that the lane
# would relay: a client that mixes in requests the lane gives back (Metadata between heartbeats)
# stays on the Python path rather than bouncing (bench/heartbeats.py, docs/architecture.md).
LANE_AFTER = 3
# The lane's reasons for giving a connection back that end it, and how (the log reasons the
# watchdog and the pumps give for the same events).
_UNSEEN: Any = object()
_LANE_ENDS = {"idle": "no request for {idle:g}s (limits.idle_timeout_s)",
              "frame_timeout": "a request frame did not arrive whole within {frame:g}s (limits.frame_timeout_s)"}


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

    __slots__ = (
        "_close_reason",
        "_drain_reason",
        "_held",
        "_lane",
        "_lane_apis",
        "_lane_fed",
        "_lane_handle",
        "_lane_max",
        "_lane_parked",
        "_lane_resume",
        "_lane_streak",
        "_lane_waiter",
        "_linger",
        "_lose_pending",
        "_now",
        "_nursery",
        "_partial_frame",
        "_partial_since",
        "_pipe",
        "_pre_login",
        "_quiet_since",
        "_readers",
        "_room",
        "_seen_requests",
        "_splice_ok",
        "_up_park",
        "budget",
        "bytes_in",
        "bytes_out",
        "cancel_scope",
        "client",
        "client_gone",
        "client_reader",
        "closing",
        "cluster",
        "draining",
        "on_complete",
        "opened_at",
        "prepare",
        "record",
        "requests_done",
        "route_key",
        "router",
        "session",
        "settings",
        "stats",
        "unrouted",
        "writer",
    )

    def __init__(self, settings: ConnectionSettings, router: Router, client: Transport, session: Session,
                 *, on_complete: Completion | None = None, budget: BufferBudget | None = None,
                 route_key: tuple[int | None, str | None] = (None, None), stats: ProxyStats | None = None,
                 prepare: Callable[[memoryview], Awaitable[None]] | None = None, cluster: str = "default",
                 lane: Lane | None = None, record: ClientRecord | None = None) -> None:
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
        # The process's lane (kproxy.server.lane), when it may ever take this connection: plain TCP
        # to the client, none of kproxy's own SASL (the rest is asked at each hand-over, ``_lane_ready``).
        self._lane = lane if lane is not None and type(client) is PlainTransport and front is None else None
        self._lane_max = self._lane.max_frame if self._lane is not None else 0     # the largest frame it takes
        self._lane_apis: dict[tuple[int, int], LaneApi | None] = {}  # what the lane may relay, as met
        self.record = record            # its /clients row: told when the lane holds it and what it relayed
        self._lane_streak = 0                       # requests in a row the lane would have relayed
        self._lane_handle: LaneHandle | None = None   # the lane holds both sockets now
        self._lane_waiter: trio.CancelScope | None = None   # the client pump waits to hand over
        self._lane_parked: trio.Event | None = None   # set once the upstream pump has let go of the broker
        # Wakes the parked upstream pump, which then reads ``_lane_fed`` first (None: it ends).
        self._lane_resume: trio.Event | None = None
        self._lane_fed: bytes | None = None
        self._up_park: trio.CancelScope | None = None   # the upstream pump's scope, cancelled to park it

    # -- completion

    def _complete(self, done: tuple[InFlight, ...] | list[InFlight], now: float) -> None:
        session = self.session
        lane = self._lane
        for entry in done:
            entry.finished_at = now
            session.finish(entry)
            self.requests_done += 1
            self.bytes_in += entry.request_bytes
            self.bytes_out += entry.response_bytes
            if lane is not None and entry.response_bytes > lane.max_frame:
                # An answer the lane would give back (a consumer's large Fetch): the streak starts
                # again, so a connection whose answers are large is not offered to the lane each time.
                self._lane_streak = 0
            if self.on_complete is not None:
                self.on_complete(entry)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("connection %d: %s v%d (correlation id %d) %s in %.2f ms, %d B in, %d B out",
                          self.session.ctx.connection_id, api_name(entry.api_key), entry.api_version,
                          entry.client_correlation_id, entry.outcome, (now - entry.started) * 1000,
                          entry.request_bytes, entry.response_bytes)
        if not self._room.is_set():
            self._room.set()
        if self._lane_waiter is not None and not session.open:
            self._lane_waiter.cancel()      # idle now: the client pump may hand the connection over
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
            # The lane lets go of both sockets before they close (and what it held comes back).
            self._lane_detach()
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
        if self._lane_handle is not None:
            # The lane answers what it has in flight and gives the connection back; the client pump
            # then drains it as any other.
            self._lane_handle.recall()
            return
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
            if self._lane_streak >= LANE_AFTER:
                # Steady: the lane may take the connection once it is idle; when it gives it back,
                # the bytes it had read from the client are in the reader.
                turn = await self._lane_turn(reader)
                if turn is None:
                    self._account()
                    self.client_gone = True
                    return
            else:
                turn = False
            if not turn:
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
            elif self.draining and not reader.streaming_left:
                break
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
                if self._lane is not None:
                    self._lane_count(frame)
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

    # -- the lane (kproxy.server.lane): a steady connection relayed without the event loop

    @property
    def laned(self) -> bool:
        """Whether the lane holds the connection now (for the lane's gauge)."""
        return self._lane_handle is not None

    def lane_recall(self) -> None:
        """Have the lane give the connection back before it relays another request (a rules reload:
        what the lane relays was worked out under the old rules)."""
        self._lane_apis.clear()
        if self._lane_handle is not None:
            self._lane_handle.recall()

    def _lane_count(self, frame: memoryview) -> None:
        """Count a request the lane would have relayed (its api version is in the lane's table, and it
        is no larger than the lane takes: a client sending large requests would only be given back)."""
        if len(frame) < 8 or len(frame) > self._lane_max:
            self._lane_streak = 0
            return
        pair = (frame[0] << 8 | frame[1], frame[2] << 8 | frame[3])
        apis = self._lane_apis
        api = apis.get(pair, _UNSEEN)
        if api is _UNSEEN:
            got = self.session.lane_programs(*pair)
            api = apis[pair] = lane_api(got) if got is not None else None
        self._lane_streak = self._lane_streak + 1 if api is not None else 0

    def _lane_ready(self) -> bool:
        """Whether nothing but the lane's own work would happen to the connection's frames now, in
        flight requests aside (``_lane_turn`` waits for those)."""
        session = self.session
        upstream = self.upstream
        return (type(upstream) is PlainTransport and upstream.login is None and self._up_park is not None
                and not self.draining and not self.closing and not self._pre_login and self.unrouted is None
                and not self._holding and not self._lose_pending and self._login_answers is None
                and not self._up_locked and self._pipe is None and session.throttle_until == 0.0
                and session.asking is None and session.streaming is None and session.streaming_up is None
                and session.idle_for_lane and not self.client_reader.streaming_left)

    async def _lane_turn(self, reader: FrameReader) -> bool | None:
        """Hand the connection to the lane once it is idle, and take it back: True when it went and
        came back (the client's unread bytes are in ``reader``), False when it did not go (read the
        client as usual), None when the client closed it meanwhile. Ending reasons raise as the
        pumps and the watchdog would."""
        session = self.session
        writer = self.writer
        if not self._lane_ready():
            return False
        if session.open or writer.pending or writer.writing:
            # Wait for the answers owed, unless the client sends first (then it is read as usual).
            with trio.CancelScope() as waiter:
                self._lane_waiter = waiter
                try:
                    await trio.lowlevel.wait_readable(self.client.raw)      # type: ignore[attr-defined]
                finally:
                    self._lane_waiter = None
            if not waiter.cancelled_caught or not self._lane_ready():
                return False
            if session.open or writer.pending or writer.writing:
                return False
        park = self._up_park
        if park is None:
            return False
        # The upstream pump lets go of the broker's socket first (it waits for the give-back).
        parked = self._lane_parked = trio.Event()
        park.cancel()
        await parked.wait()
        if self._lane_resume is None:
            return False        # it ended instead (the broker connection was lost)
        client_bytes = reader.take_buffered()
        upstream = self.upstream
        assert self._lane is not None
        if (client_bytes is None or len(client_bytes) > self._lane.max_frame + 4 or upstream is None
                or not self._lane_ready() or session.open or writer.pending or writer.writing):
            if client_bytes:
                reader.feed(client_bytes)
            self._upstream_resume(b"")
            return False
        if reader.release_idle():
            self._account()
        s = self.settings
        client_id = session.ctx.client_id
        try:
            handle = self._lane.adopt(
                self.client.raw.fileno(), upstream.raw.fileno(),      # type: ignore[attr-defined]
                table=lane_table(self._lane_apis, session.lane_memo_class),
                next_correlation_id=session.next_correlation_id, client_bytes=client_bytes,
                client_id=client_id.encode("utf-8", "surrogateescape") if client_id is not None else None,
                max_in_flight=s.max_in_flight, request_timeout_s=s.request_timeout_s,
                idle_timeout_s=s.idle_timeout_s, frame_timeout_s=s.frame_timeout_s)
        except BaseException:
            reader.feed(client_bytes)
            self._upstream_resume(b"")
            raise
        self._lane_handle = handle
        if self.record is not None:
            self.record.lane = handle       # /clients reads the lane's counts while it holds the connection
        try:
            await trio.lowlevel.wait_readable(handle.fd)
        except BaseException:
            # Cancelled (the connection ends): the lane lets go at once, and what it held comes back.
            self._lane_detach()
            raise
        if self._lane_handle is not handle:
            # Detached by another task, which is closing the connection: end here.
            await trio.lowlevel.checkpoint()
            return False
        self._lane_handle = None
        given = handle.take()
        self._lane_restore(given)
        return await self._lane_back(given)

    def _lane_restore(self, given: Given) -> None:
        """What the lane did and holds, back in the session, the connection and its readers."""
        session = self.session
        now = self._now()
        client_id = given.client_id
        session.lane_returned(given.in_flight, given.next_correlation_id, given.requests,
                              client_id.decode("utf-8", "surrogateescape") if client_id is not None else None,
                              now, self.connected_to)
        self.requests_done += given.requests
        self.bytes_in += given.bytes_in
        self.bytes_out += given.bytes_out
        if self.record is not None:
            self.record.lane = None
            if given.requests:
                self.record.add(given.requests, given.bytes_in, given.bytes_out)
        self._quiet_since = now - given.quiet_s
        self._seen_requests = session.requests
        self._partial_frame = None
        if given.client_bytes:
            self.client_reader.feed(given.client_bytes)
        self._lane_fed = given.broker_bytes
        self._lane_streak = 0       # back to the Python path for LANE_AFTER requests at least
        if self.stats is not None:
            self.stats.lane_given_back[given.reason] = self.stats.lane_given_back.get(given.reason, 0) + 1
        if log.isEnabledFor(logging.DEBUG):
            log.debug("connection %d: the lane gave the connection back (%s: %s) after %d requests, "
                      "%d in flight", session.ctx.connection_id, given.reason, safe(given.detail),
                      given.requests, len(given.in_flight))
        self._account()

    def _lane_detach(self) -> None:
        """The lane lets go of both sockets now (they are about to close); what it held comes back."""
        handle = self._lane_handle
        if handle is not None:
            self._lane_handle = None
            self._lane_restore(handle.detach())

    async def _lane_back(self, given: Given) -> bool | None:
        """Go on after the lane gave the connection back, by its reason (``_lane_turn``)."""
        reason = given.reason
        s = self.settings
        if reason == "client_closed":
            return None
        if reason == "client_error":
            raise OSError(given.detail)
        ends = _LANE_ENDS.get(reason)
        if ends is not None:
            raise ConnectionClosed(ends.format(idle=s.idle_timeout_s, frame=s.frame_timeout_s))
        if given.client_out:
            # Answers the lane had queued for the client go before any other.
            await self.client.send([given.client_out])
        if reason in ("broker_closed", "broker_error"):
            # As the upstream pump meets it: what was in flight gets retriable errors, the next
            # request reconnects.
            self._upstream_resume(None)
            await self._upstream_lost("broker closed the connection" if reason == "broker_closed"
                                      else given.detail)
            return True
        if given.broker_out and self.upstream is not None:
            # Requests the lane had queued for the broker (in flight already) go before any other.
            try:
                await self.upstream.send([given.broker_out])
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
                self._upstream_resume(None)
                await self._upstream_lost(f"send failed: {e!r}")
                return True
        fed, self._lane_fed = self._lane_fed, None
        self._upstream_resume(fed if fed is not None else b"")
        if reason == "recalled":
            self._lane_apis.clear()         # worked out again under the rules in force now
        elif reason == "request_timeout" and self._nursery is not None and not self._lose_pending:
            # The watchdog's handling of a broker that stopped answering.
            late = self._overdue(self._now())
            if late is not None:
                self._lose_pending = True
                self._nursery.start_soon(self._lose_overdue, late)
        return True

    async def _upstream_parked(self) -> bytes | None:
        """The upstream pump, parked while the lane holds the broker connection: the broker's bytes
        the lane left when it gives it back (read first), or None when the pump is to end."""
        self._lane_resume = resume = trio.Event()
        parked, self._lane_parked = self._lane_parked, None
        if parked is not None:
            parked.set()
        await resume.wait()
        fed, self._lane_fed = self._lane_fed, None
        return fed

    def _upstream_resume(self, fed: bytes | None) -> None:
        """Wake the parked upstream pump: ``fed`` (the broker's bytes to read first), or None to end it."""
        # Its scope is spent: until the pump runs again and opens another, ``_lane_ready`` says no, so
        # a hand-over cannot cancel the spent one and wait for ever for a park that has happened.
        self._up_park = None
        self._lane_fed = fed
        resume, self._lane_resume = self._lane_resume, None
        if resume is not None:
            resume.set()

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
        fed: bytes | None = None        # the broker's bytes the lane left, read before the socket
        park: trio.CancelScope | None = None
        try:
            while True:
                # A scope per hand-over to the lane, not per answer: cancelled, it parks this pump.
                with trio.CancelScope() as park:
                    self._up_park = park
                    while True:
                        if fed is not None:
                            reader.feed(fed)
                            fed = None
                        else:
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
                # Parked: the lane holds the broker connection until it gives it back.
                fed = await self._upstream_parked()
                if fed is None:
                    return      # the broker connection ended meanwhile
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
            if self._up_park is park:
                self._up_park = None
            if self._lane_parked is not None:
                self._lane_parked.set()     # the client pump waits for it to park: it ended instead
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
        self._lane_detach()
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
        if (self._lose_pending or self._lane_handle is not None
                or (self.cancel_scope is not None and self.cancel_scope.cancel_called)):
            return      # (the lane keeps the same timeouts while it holds the connection)
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

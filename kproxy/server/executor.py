"""The executor: how a client connection carries out the session's actions, whichever task (client
pump, upstream pump, watchdog) called the session, and the broker connection those actions need.

Answers are queued on the connection's ``ClientWriter`` the moment the session returns them; writes
to the broker (and connecting) go one at a time under the connection's FIFO lock. The broker
connection is opened through ``open_upstream`` when the first action needs it, kept logged in
(KIP-368: re-authenticated before its session ends, busy or idle), and when it is lost the session
answers what waited on it. ``ClientConnection`` (connection.py) is this class plus the tasks that
read the sockets.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from kproxy.protocol.messages import decode_response, encode_request_frame
from kproxy.proxy.actions import Ask, Close, Hold, Keys, Listen, StreamUp, ToClient, ToUpstream
from kproxy.proxy.inflight import NO_RESPONSE, InFlight
from kproxy.proxy.session import Session
from kproxy.server.ordering import ClientWriter, ConnectionClosed, FifoLock
from kproxy.server.origination import OriginationError
from kproxy.server.stats import ProxyStats
from kproxy.server.transport import Transport
from kproxy.server.upstream import login_failed, open_upstream

if TYPE_CHECKING:                   # connection.py builds on this module
    from kproxy.server.connection import ConnectionSettings, Router

log = logging.getLogger("kproxy.server")


class Executor:
    """Carries out a session's actions (``_execute``) and owns the broker connection behind it: the
    base of ``ClientConnection``, which sets the connection's shared state below."""

    # Slots, as ClientConnection has: the pumps read these on every frame, and a slot is read faster
    # than an instance dict past CPython's 30 shared keys.
    __slots__ = ("_answer_task", "_holding", "_login_answers", "_login_changed", "_login_ids", "_reauth_due",
                 "_settle", "_up_locked", "_up_sending", "_up_target", "_upstream_generation", "_upstream_lock",
                 "connected_to", "upstream")

    # Set by ClientConnection: what the connection is and what it reports to.
    settings: ConnectionSettings
    router: Router
    session: Session
    writer: ClientWriter
    stats: ProxyStats | None
    route_key: tuple[int | None, str | None]
    _nursery: trio.Nursery | None
    _now: Callable[[], float]

    if TYPE_CHECKING:               # the connection's own parts this one calls
        def _complete(self, done: tuple[InFlight, ...] | list[InFlight], now: float) -> None: ...

        async def _upstream_pump(self, upstream: Transport, generation: int) -> None: ...

        def _closed(self, e: ConnectionClosed) -> None: ...

    def __init__(self) -> None:
        self.upstream: Transport | None = None
        self.connected_to: tuple[str, int] | None = None
        # One task at a time connects and writes to the broker, in the order the session asked.
        self._upstream_lock = FifoLock()
        self._upstream_generation = 0
        self._settle: trio.Event | None = None      # set when a filter's question is settled
        self._holding = False                       # the client pump waits out a throttle or delay
        # kproxy's own login on the broker connection (upstream.sasl), kept alive by _keep_login.
        self._login_answers: trio.MemorySendChannel[bytes] | None = None   # re-authentication under way
        self._login_ids: set[int] = set()
        self._login_changed: trio.Event | None = None   # wakes _keep_login for a new broker connection
        # When the login falls due again (trio time; inf: never), read before each write, and the
        # upstream pump's task, which must never wait for a login (it carries the login's answers).
        self._reauth_due = math.inf
        self._answer_task: trio.lowlevel.Task | None = None
        # A request streaming to the broker (cut-through): the broker connection its first piece went
        # to, whether this pump holds the broker write lock for it, and whether a piece is being sent.
        self._up_target: Transport | None = None
        self._up_locked = False
        self._up_sending = False

    async def _execute(self, actions: list, *, flush: bool = True) -> None:
        """Carry out the session's actions in order; the same for every task. Answers are queued at
        once, in the session's order, before anything here can wait; ``flush=False`` leaves them
        queued for the caller to write together with more (one vectored send for several)."""
        writer = self.writer
        for a in actions:
            kind = type(a)
            if kind is ToClient:
                if a.buffers:
                    writer.put(a.buffers, a.done)
                elif a.done:
                    self._complete(a.done, trio.current_time())
                continue
            if kind is Listen:
                problem = self.router.open_ports(a.ports)
                if problem is not None:
                    raise ConnectionClosed(problem)
                continue
            if kind is ToUpstream:
                # Not waiting for answers still being written: the queue keeps their order anyway.
                await self._to_upstream(a)
                continue
            if kind is StreamUp:
                await self._stream_up(a)
                continue
            if writer.pending:
                # Earlier answers go out before kproxy waits on anything else.
                await writer.flush()
            if kind is Hold:
                await self._hold(a.seconds)
            elif kind is Close:
                if a.undecodable is not None and self.stats is not None:
                    self.stats.decode_errors[a.undecodable] += 1
                if a.done:
                    self._complete(a.done, trio.current_time())
                raise ConnectionClosed(a.reason)
            elif kind is Ask:
                await self._ask(a)
            elif kind is Keys:
                await self._keys(a)
            else:  # pragma: no cover - a new action type without an executor branch is a bug
                raise AssertionError(f"no executor for {a!r}")
        if flush and writer.pending:
            await writer.flush()

    async def _hold(self, seconds: float) -> None:
        # The watchdog does not count a wait kproxy imposes as the client being slow or idle.
        self._holding = True
        try:
            await trio.sleep(seconds)
        finally:
            self._holding = False

    async def _to_upstream(self, action: ToUpstream) -> None:
        # Several tasks write to the broker (the client pump; the upstream pump resuming a request
        # whose question it read the answer to; the watchdog through a lost connection): one at a
        # time, first come first served, which is the session's order. Uncontended (almost always)
        # the lock is taken without a trip through the scheduler.
        # One clock reading serves the login check and, when nothing waits in between, the send's stamp.
        now = self._now()
        stamp: float | None = now
        if now >= self._reauth_due:
            await self._renew_login_before_write()
            stamp = None
        lock = self._upstream_lock
        if not lock.take():
            await lock.acquire()
            stamp = None
        try:
            failed = await self._send_upstream(action, stamp)
        finally:
            lock.release()
        if failed is not None:
            # Handled with the lock free: the session may resume a request that must be sent now.
            # Nothing runs between the release and the session hearing of the loss (no await).
            reason, connecting = failed
            await self._upstream_lost(reason)
            entry = action.entry
            if connecting and entry is not None and entry.outcome == NO_RESPONSE:
                # acks=0 sends that cannot be made: close, as a broker does when such a produce fails.
                raise ConnectionClosed("could not forward an acks=0 Produce: no broker connection")

    async def _send_upstream(self, action: ToUpstream, now: float | None = None) -> tuple[str, bool] | None:
        """Send one action's bytes (connecting first if need be); (why, while connecting) on failure.
        ``now``: the time read just before, when nothing has waited since."""
        entry = action.entry
        if entry is not None and entry.reply is not None:
            # Already answered: the broker connection was lost while kproxy held this request (a
            # throttle, a delay) and the client was told to retry. Sending it now would run it twice.
            return None
        if self.upstream is None:
            try:
                await self._connect_upstream()
            except (OSError, trio.TooSlowError) as e:
                return f"cannot connect: {str(e) or 'timed out'}", True
            now = None
        assert self.upstream is not None
        if entry is not None:
            # Stamped before the send: while it waits for the socket, the other pump may already
            # read the answer, and the broker's time must never come out negative.
            entry.forwarded_at = now if now is not None else self._now()
            entry.broker = self.connected_to
        try:
            await self.upstream.send(action.buffers)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
            if entry is not None:
                entry.forwarded_at = entry.broker = None
            return f"send failed: {e!r}", False
        if entry is not None and entry.outcome == NO_RESPONSE:
            self._complete((entry,), trio.current_time())
        return None

    # -- a filter's question to the broker (Ask)

    async def _ask(self, action: Ask) -> None:
        """Send a filter's question and wait, not reading the client, until the session has settled
        it: the upstream pump hands the answer to the session (which then acts on the request), and
        a lost connection settles it too. Past the request timeout the filter decides without it."""
        session = self.session
        await self._to_upstream(ToUpstream(action.buffers))
        timeout = self.settings.request_timeout_s
        with trio.move_on_after(timeout if timeout > 0 else float("inf")):
            await self._question_settled()
        if session.asking is not None:
            await self._execute(session.question_unanswered(f"none within {timeout:g}s"))
            self._settled()

    async def _keys(self, action: Keys) -> None:
        """Ask the key service (record encryption) and hand its answer to the session, within the
        request timeout; the task that met the action reads nothing more meanwhile, so requests and
        answers keep their order. No answer in time is None: the filter answers with a retriable error."""
        service = self.settings.keys
        answer: Any = None
        if service is not None:
            timeout = self.settings.request_timeout_s
            self._holding = True
            try:
                with trio.move_on_after(timeout if timeout > 0 else float("inf")):
                    answer = await service.answer(action.question)
            finally:
                self._holding = False
        await self._execute(action.then(answer), flush=False)

    async def _question_settled(self) -> None:
        """Return once the session has no question to the broker pending."""
        while self.session.asking is not None:
            if self._settle is None:
                self._settle = trio.Event()
            await self._settle.wait()

    def _settled(self) -> None:
        """Called whenever the session may have settled its question (an answer, a lost connection)."""
        if self._settle is not None and self.session.asking is None:
            self._settle.set()
            self._settle = None

    # -- cut-through: a large request streamed to the broker while it arrives

    async def _stream_up(self, action: StreamUp) -> None:
        """Send one piece of a streamed request. The first takes the broker write lock (FIFO, like
        every write to the broker) and connects if need be; it is held until the last, so no other
        request's bytes come between the pieces. A failure drops the rest of the frame, never sends
        it elsewhere, and the session answers the request with a retriable error once it is in."""
        entry = action.entry
        if action.first:
            if self._now() >= self._reauth_due:
                await self._renew_login_before_write()
            lock = self._upstream_lock
            if lock.locked():
                await lock.acquire()
            else:
                lock.acquire_nowait()
            self._up_locked = True
            self._up_target = None
            if self.upstream is None:
                try:
                    await self._connect_upstream()
                except (OSError, trio.TooSlowError) as e:
                    await self._stream_up_failed(entry, f"cannot connect: {e or 'timed out'}", lost=True)
                    return
            self._up_target = self.upstream
            entry.broker = self.connected_to
        if not self._up_locked:
            return
        upstream = self.upstream
        if upstream is None or upstream is not self._up_target:
            # Lost by another task meanwhile (the session knows): the rest of the frame is dropped.
            self._stream_up_over()
            return
        if action.last:
            # Stamped before the last send: the answer may be read before the send returns.
            entry.forwarded_at = trio.current_time()
        self._up_sending = True
        try:
            await upstream.send(action.buffers)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
            await self._stream_up_failed(entry, f"send failed: {e!r}", lost=self.upstream is upstream)
            return
        finally:
            self._up_sending = False
        if action.last:
            self._stream_up_over()
            if entry.outcome == NO_RESPONSE:
                self._complete((entry,), trio.current_time())

    async def _stream_up_failed(self, entry: InFlight, reason: str, *, lost: bool) -> None:
        self._stream_up_over()
        entry.broken = "broker"
        log.warning("connection %d: a streamed Produce request could not reach the broker whole (%s); "
                    "the rest of it is read and dropped, and the client told to retry",
                    self.session.ctx.connection_id, reason)
        if lost:
            await self._upstream_lost(reason)

    def _stream_up_over(self) -> None:
        """The streamed request is done with the broker connection (sent, or given up)."""
        self._up_target = None
        if self._up_locked:
            self._up_locked = False
            self._upstream_lock.release()

    # -- the broker connection

    async def _connect_upstream(self) -> None:
        s = self.settings
        # Look the route up on every connect, not only at accept: a broker that moved (learned from
        # a later Metadata) is then reached through the same exposed port by connections already open.
        # No route (the bootstrap listener, or a broker not learned yet): the bootstrap servers in turn.
        route = self.router.route_for(*self.route_key)
        targets = [route.upstream] if route is not None else list(s.bootstrap_servers)
        last: Exception | None = None
        for host, port in targets:
            try:
                self.upstream = await open_upstream(host, port, s.upstream)
                self.connected_to = (host, port)
                break
            except (OSError, trio.TooSlowError) as e:
                if login_failed(e):
                    # Reached, but kproxy's own login failed: the next broker would refuse it too.
                    self.connected_to = (host, port)
                    raise
                last = e
                if self.stats is not None:
                    self.stats.upstream_failed(host, port)
        else:
            raise last or OSError("no upstream")
        self._upstream_generation += 1
        assert self._nursery is not None
        self._nursery.start_soon(self._upstream_pump, self.upstream, self._upstream_generation)
        login = self.upstream.login
        self._reauth_due = math.inf
        if login is not None and login.reauth_at is not None:
            self._reauth_due = login.reauth_at
            if self._login_changed is None:
                self._login_changed = trio.Event()
                self._nursery.start_soon(self._keep_login)
            else:
                self._login_changed.set()

    async def _upstream_lost(self, reason: str) -> None:
        """The broker connection ended: the session answers what waited on it."""
        if self.upstream is not None:
            self.upstream.close()
            self.upstream = None
        self._reauth_due = math.inf
        if self._login_answers is not None:
            # A re-authentication waiting for its answers fails now, not at its timeout.
            self._login_answers.close()
            self._login_answers = None
        where = f"{self.connected_to[0]}:{self.connected_to[1]}" if self.connected_to else "the broker"
        BROKER_LOST.warning(where, "connection %d: lost the connection to %s: %s",
                            self.session.ctx.connection_id, where, reason)
        try:
            await self._execute(self.session.upstream_lost(reason))
        finally:
            self._settled()

    # -- kproxy's own login on the broker connection (KIP-368)

    async def _keep_login(self) -> None:
        """Log kproxy in again on the broker connection before the session the broker gave its login
        ends, whether the client is sending or idle: KIP-368 re-authenticates a connection, it does
        not replace it. Runs from the first broker connection whose login has a lifetime until the
        client connection ends; a new broker connection wakes it (``_login_changed``)."""
        while True:
            upstream = self.upstream
            login = upstream.login if upstream is not None else None
            at = login.reauth_at if login is not None and login.reauth_at is not None else math.inf
            changed = self._login_changed = trio.Event()
            with trio.move_on_at(at) as timer:
                await changed.wait()
            if timer.cancelled_caught and upstream is not None and self.upstream is upstream:
                try:
                    await self._reauthenticate_upstream(upstream)
                except ConnectionClosed as e:
                    # A failed login ends the broker connection, and what waited on it may end the
                    # client's (as when another task loses it).
                    self._closed(e)
                    return

    async def _renew_login_before_write(self) -> None:
        """A write found kproxy's login due (KIP-368): log in again before the request goes out, as
        Kafka's client checks before each send, so that no request is sent on a broker session that
        may have ended because the timer (``_keep_login``) has not had its turn on a busy loop. Not
        from the upstream pump, which carries the login's answers, nor while a filter's question is
        pending, whose held request may need the write lock; the timer renews the login then."""
        upstream = self.upstream
        if (upstream is None or self.session.asking is not None
                or trio.lowlevel.current_task() is self._answer_task):
            return
        await self._reauthenticate_upstream(upstream)

    async def _reauthenticate_upstream(self, upstream: Transport) -> None:
        """Log in again on the live broker connection, holding the broker write lock so that no
        request goes out during the exchange (a broker reads only SASL while it re-authenticates);
        answers to requests sent before it still reach the client (the broker answers in order), and
        kproxy takes the answers to its own login from the upstream pump. The lock is taken only
        while no filter's question is pending: the upstream pump may need the lock to send the
        request that question held, and it must never wait for the lock while the login waits for it."""
        lock = self._upstream_lock
        while True:
            await self._question_settled()
            await lock.acquire()
            if self.session.asking is None:
                break
            lock.release()
        login = upstream.login
        failed: str | None = None
        try:
            if self.upstream is not upstream or login is None:
                return          # lost meanwhile: the next request reconnects and logs in anew
            if not login.due(trio.current_time()):
                return          # renewed meanwhile (the timer and a write both found it due)
            send, receive = trio.open_memory_channel[bytes](4)

            async def roundtrip(req: Any) -> Any:
                self._login_ids.add(req.correlation_id)
                await upstream.send(encode_request_frame(req))
                try:
                    frame = await receive.receive()
                except trio.EndOfChannel:
                    raise OriginationError("the broker connection was lost") from None
                self._login_ids.discard(req.correlation_id)
                return decode_response(frame, req.api_key, req.api_version)

            self._login_answers = send
            try:
                await login.log_in(roundtrip)
                self._reauth_due = login.reauth_at if login.reauth_at is not None else math.inf
            except (OSError, trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
                failed = f"re-authentication failed: {str(e) or 'timed out'}"
            finally:
                self._login_answers = None
                self._login_ids.clear()
        finally:
            lock.release()
        if failed is not None:
            if self.upstream is upstream:
                # With the lock free: the session may resume a request that must be sent at once.
                await self._upstream_lost(failed)
            return
        log.info("connection %d: re-authenticated kproxy to %s (KIP-368)", self.session.ctx.connection_id,
                 login.where)

class _RateLimited:
    """A warning that repeats per key (a broker down, every client retrying) is logged once per
    ``interval`` seconds per key, with the count of lines it held back."""

    def __init__(self, logger: logging.Logger, interval: float = 10.0) -> None:
        self.logger = logger
        self.interval = interval
        self._last: dict[str, tuple[float, int]] = {}

    def warning(self, key: str, msg: str, *args: object) -> None:
        now = trio.current_time()
        last, held = self._last.get(key, (float("-inf"), 0))
        if now - last < self.interval:
            self._last[key] = (last, held + 1)
            return
        if len(self._last) > 1000:
            self._last.clear()
        self._last[key] = (now, 0)
        if held:
            msg += f" ({held} similar lines held back in the last {self.interval:g}s)"
        self.logger.warning(msg, *args)


BROKER_LOST = _RateLimited(log)

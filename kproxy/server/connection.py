"""The two pumps of one proxied connection: client -> broker and broker -> client.

The connection's nursery runs both; when the client side ends, the cancel scope ends the other and
both sockets close in ``finally``. A broker connection that is lost is not fatal to the client: the
session answers what was waiting with retriable errors and the next request reconnects.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

from kproxy.protocol.errors import FrameError
from kproxy.protocol.framing import FrameReader
from kproxy.protocol.messages import api_name
from kproxy.proxy.session import Close, Hold, InFlight, Session, ToClient, ToUpstream
from kproxy.server.transport import Transport, connect

if TYPE_CHECKING:
    from kproxy.server.app import ProxyServer

log = logging.getLogger("kproxy.server")


class ConnectionClosed(Exception):
    """Ends a connection on purpose; the reason is logged once."""


class ClientConnection:
    """One client connection and the broker connection behind it."""

    def __init__(self, server: ProxyServer, client: Transport, session: Session,
                 route_key: tuple[int | None, str | None] = (None, None)) -> None:
        self.server = server
        self.client = client
        self.session = session
        self.route_key = route_key                  # (exposed port, SNI name) the client connected to
        self.upstream: Transport | None = None
        self.connected_to: tuple[str, int] | None = None
        self.unrouted: tuple[int | None, str | None] | None = None   # (port, SNI name) not yet placed
        self._close_reason: str | None = None     # why another task closed the connection
        self._client_lock = trio.StrictFIFOLock()
        self._room = trio.Event()                   # set when in-flight drops below the limit
        self._nursery: trio.Nursery | None = None
        self.cancel_scope: trio.CancelScope | None = None
        self.last_activity = 0        # changes with every receive from the client
        self._upstream_generation = 0
        session.completed = self._completed          # type: ignore[method-assign]

    def _completed(self, entry: InFlight) -> None:
        self.server.stats.record(entry, trio.current_time())
        if not self._room.is_set():
            self._room.set()

    async def run(self) -> None:
        ctx = self.session.ctx
        reason = "client closed the connection"
        try:
            with trio.CancelScope() as scope:
                self.cancel_scope = scope
                try:
                    async with trio.open_nursery() as nursery:
                        self._nursery = nursery
                        if self.server.watchdog_needed:
                            nursery.start_soon(self._watchdog)
                        try:
                            await self._client_pump()
                        except ConnectionClosed as e:
                            reason = str(e)
                        except FrameError as e:
                            reason = f"bad frame from client: {e}"
                        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
                            reason = f"client connection error: {e!r}"
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
        finally:
            self.client.close()
            if self.upstream is not None:
                self.upstream.close()
            self.session.close()
            log.info("connection %d from %s closed: %s", ctx.connection_id,
                     _addr(ctx.client_address), reason)

    # -- client -> broker

    async def _client_pump(self) -> None:
        reader = FrameReader(self.server.frame_cap)
        session = self.session
        limit = self.server.config.limits.max_in_flight_requests
        client = self.client
        while True:
            n = await client.recv_into(reader.recv_buffer())
            if n == 0:
                return
            reader.received(n)
            self.last_activity += 1   # a counter the watchdog compares: no clock read per receive
            while (frame := reader.next_frame()) is not None:
                if len(session.in_flight) >= limit:
                    # Backpressure: stop reading the client until answers make room.
                    self._room = trio.Event()
                    while len(session.in_flight) >= limit:
                        await self._room.wait()
                        self._room = trio.Event()
                await self._execute(session.client_frame(frame))

    async def _execute(self, actions: list) -> None:
        for a in actions:
            if type(a) is ToUpstream:
                await self._to_upstream(a.buffers)
            elif type(a) is ToClient:
                await self._to_client(a.buffers)
            elif type(a) is Hold:
                await trio.sleep(a.seconds)
            elif type(a) is Close:
                raise ConnectionClosed(a.reason)

    async def _to_client(self, buffers: list) -> None:
        # Both pumps write to the client; the lock keeps their frames whole. Uncontended (almost
        # always) it is taken without a trip through the scheduler.
        lock = self._client_lock
        if lock.locked():
            await lock.acquire()
        else:
            lock.acquire_nowait()
        try:
            await self.client.send(buffers)
        finally:
            lock.release()

    async def _to_upstream(self, buffers: list) -> None:
        if self.upstream is None:
            try:
                await self._connect_upstream()
            except (OSError, trio.TooSlowError) as e:
                await self._upstream_lost(f"cannot connect: {e or 'timed out'}")
                return
        assert self.upstream is not None
        try:
            await self.upstream.send(buffers)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
            await self._upstream_lost(f"send failed: {e!r}")

    async def _connect_upstream(self) -> None:
        cfg = self.server.config.upstream
        # Look the route up on every connect, not only at accept: a broker that moved (learned from
        # a later Metadata) is then reached through the same exposed port by connections already open.
        # No route (the bootstrap listener, or a broker not learned yet): the bootstrap servers in turn.
        route = self.server.route_for(*self.route_key)
        targets = ([route.upstream] if route is not None
                   else [(hp.host, hp.port) for hp in cfg.bootstrap_servers])
        last: Exception | None = None
        for host, port in targets:
            try:
                self.upstream = await connect(host, port, cfg.connect_timeout_s,
                                              self.server.upstream_tls, cfg.tls.server_hostname)
                self.connected_to = (host, port)
                break
            except (OSError, trio.TooSlowError) as e:
                last = e
        else:
            raise last or OSError("no upstream")
        self._upstream_generation += 1
        assert self._nursery is not None
        self._nursery.start_soon(self._upstream_pump, self.upstream, self._upstream_generation)

    async def _upstream_lost(self, reason: str) -> None:
        if self.upstream is not None:
            self.upstream.close()
            self.upstream = None
        log.warning("connection %d: broker connection lost: %s", self.session.ctx.connection_id, reason)
        await self._execute(self.session.upstream_lost(reason))

    # -- broker -> client

    async def _upstream_pump(self, upstream: Transport, generation: int) -> None:
        reader = FrameReader(self.server.frame_cap)
        session = self.session
        try:
            while True:
                n = await upstream.recv_into(reader.recv_buffer())
                if n == 0:
                    raise ConnectionError("broker closed the connection")
                reader.received(n)
                while (frame := reader.next_frame()) is not None:
                    actions = session.upstream_frame(frame)
                    for a in actions:
                        if type(a) is ToClient:
                            await self._to_client(a.buffers)
                        elif type(a) is Close:
                            raise ConnectionClosed(a.reason)
                    if self.unrouted is not None and not session.in_flight:
                        self._check_route()
        except (OSError, FrameError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
            if generation == self._upstream_generation and self.upstream is upstream:
                try:
                    await self._upstream_lost(str(e) or repr(e))
                except ConnectionClosed as closed:
                    self._close_from_task(str(closed))
                except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as e2:
                    self._close_from_task(f"client connection error: {e2!r}")
        except ConnectionClosed as e:
            self._close_from_task(str(e))

    def _check_route(self) -> None:
        assert self.unrouted is not None
        route = self.server.route_for(*self.unrouted)
        if route is None:
            return
        self.unrouted = None
        if route.upstream != self.connected_to:
            # Served by the wrong broker so far: close between requests; the client reconnects
            # to the same address and now reaches the right one.
            raise ConnectionClosed(f"learned that this address is node {route.node_id}; "
                                   "closing so the client reconnects to it")

    def _close_from_task(self, reason: str) -> None:
        self._close_reason = reason
        self.client.close()
        if self.cancel_scope is not None:
            self.cancel_scope.cancel()

    # -- timeouts

    def _overdue(self, now: float, request_timeout: float) -> str | None:
        for entry in self.session.in_flight:
            if entry.reply is None and entry.upstream_correlation_id is not None:
                if now - entry.started > allowed_seconds(entry, request_timeout):
                    return api_name(entry.api_key)
                return None  # answers come in order: only the oldest can be the first overdue
        return None

    async def _watchdog(self) -> None:
        limits = self.server.config.limits
        request_timeout = self.server.config.upstream.request_timeout_s
        started = quiet_since = trio.current_time()
        seen_activity = self.last_activity
        while True:
            await trio.sleep(self.server.watchdog_period)
            now = trio.current_time()
            if request_timeout > 0 and self.upstream is not None:
                late = self._overdue(now, request_timeout)
                if late is not None:
                    # A broker that stopped answering without closing (a partition, a hung host):
                    # drop that connection so waiting clients get retriable errors, not silence.
                    try:
                        await self._upstream_lost(f"no {late} response within the request timeout")
                    except ConnectionClosed as e:
                        self._close_from_task(str(e))
                        return
                    continue
            unauth = limits.unauthenticated_idle_timeout_s
            if unauth > 0 and now - started > unauth and not self.session.ctx.authenticated and (
                    self.session.sasl_in_progress or self.session.requests == 0):
                self._close_from_task(f"no request or completed authentication within {unauth:g}s")
                return
            idle = limits.idle_timeout_s
            if self.last_activity != seen_activity or self.session.in_flight:
                seen_activity, quiet_since = self.last_activity, now
            if idle > 0 and now - quiet_since > idle:
                self._close_from_task(f"idle for {idle:g}s")
                return


# Fields by which a request asks the broker to hold it: the broker may take that long on top.
_WAIT_FIELDS = ("max_wait_ms", "timeout_ms", "rebalance_timeout_ms", "session_timeout_ms")


def allowed_seconds(entry: InFlight, request_timeout: float) -> float:
    """How long ``entry`` may wait for its response: the timeout plus any wait it asked for."""
    extra = 0
    body = entry.request.body if entry.request is not None else None
    if body is not None:
        for name in _WAIT_FIELDS:
            v = getattr(body, name, None)
            if isinstance(v, int) and v > extra:
                extra = v
    return request_timeout + extra / 1000.0


def _leaf(e: BaseException) -> BaseException:
    """The one exception inside nested single-member exception groups (trio's nurseries wrap)."""
    while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
        e = e.exceptions[0]
    return e


def _addr(a: tuple[str, int] | None) -> str:
    return f"{a[0]}:{a[1]}" if a else "?"

"""The proxy process: listeners, one task tree per connection, broker discovery, drain on SIGTERM.

A listener nursery accepts connections and starts one ``ClientConnection`` each. Broker listeners
open on demand, synchronously, the moment a response reveals a new broker, so the port is bound
before the client reads the address. This is the only layer that knows about trio and sockets.
"""

from __future__ import annotations

import itertools
import logging
import signal
import socket
import ssl
from collections.abc import Sequence
from typing import Any

import attrs
import trio

from kproxy.config import ProxyConfig
from kproxy.protocol.errors import KProxyError
from kproxy.protocol.framing import FrameReader
from kproxy.protocol.messages import (
    Request,
    api_name,
    body_class,
    decode_response,
    encode_request_frame,
    supported_versions,
)
from kproxy.proxy.addresses import AddressMap, AddressRewriter, Route
from kproxy.proxy.filters import ConnectionContext, Filter, FilterChain
from kproxy.proxy.session import InFlight, Session
from kproxy.proxy.versions import ApiVersionsNarrower, narrow_api_keys
from kproxy.server.connection import ClientConnection
from kproxy.server.transport import (
    PlainTransport,
    TlsTransport,
    Transport,
    client_context,
    connect,
    format_subject,
    server_context,
    tune,
)

log = logging.getLogger("kproxy.server")


@attrs.define(slots=True)
class ApiStats:
    count: int = 0
    request_bytes: int = 0
    response_bytes: int = 0
    latency_sum: float = 0.0
    latencies: list[float] = attrs.field(factory=list)   # a bounded sample for percentiles


class ProxyStats:
    """Per-API counts, bytes and latency of answered requests, for the demo and the admin port."""

    SAMPLE = 10_000

    def __init__(self) -> None:
        self.apis: dict[str, ApiStats] = {}
        self.connections_total = 0
        self.connections_open = 0

    def record(self, entry: InFlight, now: float) -> None:
        name = api_name(entry.api_key)
        s = self.apis.get(name)
        if s is None:
            s = self.apis[name] = ApiStats()
        s.count += 1
        s.request_bytes += entry.request_bytes
        s.response_bytes += entry.response_bytes
        latency = now - entry.started
        s.latency_sum += latency
        if len(s.latencies) < self.SAMPLE:
            s.latencies.append(latency)


class ProxyServer:
    """kproxy in front of one Kafka cluster, as configured."""

    def __init__(self, config: ProxyConfig, filters: Sequence[Filter] = ()) -> None:
        self.config = config
        self.stats = ProxyStats()
        exposure = config.exposure
        self.sni = exposure.mode == "sni"
        self._sni_names: dict[int, str] = {}
        self.client_tls: ssl.SSLContext | None = (
            server_context(config.tls, self._sni_names if self.sni else None) if config.tls.enabled else None)
        self.upstream_tls: ssl.SSLContext | None = (
            client_context(config.upstream.tls) if config.upstream.tls.enabled else None)
        self.address_map = AddressMap(
            config.advertised_host, config.broker_port_start, exposure.broker_port_count,
            node_id_base=exposure.node_id_base,
            sni_domain=exposure.sni.domain if self.sni and exposure.sni else None,
            sni_port=config.listen.port if self.sni else None,
            on_new_port=self._open_broker_listener)
        self.rewriter = AddressRewriter(self.address_map)
        builtin: list[Filter] = [self.rewriter]
        if not config.passthrough_unknown_versions:
            builtin.insert(0, ApiVersionsNarrower())
        self.chain = FilterChain([*builtin, *filters])
        self._ids = itertools.count(1)
        self.connections: set[ClientConnection] = set()
        self._nursery: trio.Nursery | None = None
        self._listeners: dict[int, trio.socket.SocketType] = {}
        self._accept_scopes: list[trio.CancelScope] = []
        self._pending_ports: list[int] = []
        self.bootstrap_address: tuple[str, int] | None = None
        self._draining = False
        limits = config.limits
        # A frame is forwarded only once it is whole, so what one direction of a connection holds
        # is at most one frame: capping frames at the buffer limit bounds both.
        self.frame_cap = min(limits.max_frame_size, limits.max_buffered_bytes)
        timeouts = [t for t in (limits.unauthenticated_idle_timeout_s, limits.idle_timeout_s,
                                config.upstream.request_timeout_s) if t > 0]
        self.watchdog_needed = bool(timeouts)
        self.watchdog_period = min(timeouts) / 4 if timeouts else 1.0

    # -- listeners

    def _bind(self, host: str, port: int) -> trio.socket.SocketType:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        s = socket.socket(family, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        s.listen(1024)
        s.setblocking(False)
        return trio.socket.from_stdlib_socket(s)

    def _bind_host(self) -> str:
        return self.config.listen.host

    def _open_broker_listener(self, port: int) -> None:
        """Called by the address map when a broker gets a port: bind now, accept from a task."""
        if port in self._listeners:
            return
        sock = self._bind(self._bind_host(), port)
        self._listeners[port] = sock
        log.info("exposing %s on port %d", self.address_map.route_for_port(port) or "broker", port)
        if self._nursery is not None:
            self._nursery.start_soon(self._accept_loop, sock, port)
        else:
            self._pending_ports.append(port)

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Run until cancelled or drained; ``task_status.started(self)`` once the bootstrap port listens."""
        listen = self.config.listen
        boot = self._bind(listen.host, listen.port)
        self.bootstrap_address = boot.getsockname()[:2]
        self._listeners[listen.port] = boot
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._accept_loop, boot, None)
                exposure = self.config.exposure
                if exposure.node_id_base is not None and not self.sni:
                    # Deterministic ports: open the whole range now, so clients holding addresses
                    # from before a restart can connect even if discovery cannot reach a broker.
                    start = self.config.broker_port_start
                    for port in range(start, start + exposure.broker_port_count):
                        if port not in self._listeners:
                            self._listeners[port] = self._bind(self._bind_host(), port)
                            self._pending_ports.append(port)
                for port in self._pending_ports:
                    nursery.start_soon(self._accept_loop, self._listeners[port], port)
                self._pending_ports.clear()
                await self.discover()
                log.info("kproxy listening on %s:%d -> %s", listen.host, listen.port,
                         ", ".join(str(b) for b in self.config.upstream.bootstrap_servers))
                task_status.started(self)
        finally:
            for s in self._listeners.values():
                s.close()

    async def _accept_loop(self, sock: trio.socket.SocketType, port: int | None) -> None:
        with trio.CancelScope() as scope:
            self._accept_scopes.append(scope)
            if self._draining:
                return
            while True:
                try:
                    conn, addr = await sock.accept()
                except OSError as e:
                    log.warning("accept on port %s failed: %s", port, e)
                    await trio.sleep(0.1)
                    continue
                assert self._nursery is not None
                self._nursery.start_soon(self._handle, conn, addr, port)

    async def _handle(self, sock: trio.socket.SocketType, addr: Any, port: int | None) -> None:
        tune(sock)
        cid = next(self._ids)
        ctx = ConnectionContext(cid, client_address=(addr[0], addr[1]), clock=trio.current_time)
        transport: PlainTransport | TlsTransport
        route: Route | None = None
        name: str | None = None
        try:
            if self.client_tls is not None:
                stream = trio.SSLStream(trio.SocketStream(sock), self.client_tls, server_side=True)
                try:
                    with trio.fail_after(self.config.upstream.connect_timeout_s):
                        await stream.do_handshake()
                finally:
                    # The SNI callback keyed the server name by this SSLObject before the handshake
                    # could fail (a refused client certificate): take it out either way.
                    name = self._sni_names.pop(id(stream._ssl_object), None)
                transport = TlsTransport(stream)
                cert = stream.getpeercert()
                if cert:
                    ctx.tls_subject = format_subject(cert)
                if self.sni and name is not None:
                    route = self.address_map.route_for_name(name)
                    if route is None and not name.startswith(self._sni_bootstrap_prefix()):
                        route = await self._route_after_discovery(name=name)
            else:
                transport = PlainTransport(sock)
        except (OSError, ssl.SSLError, trio.BrokenResourceError, trio.TooSlowError) as e:
            sock.close()
            log.info("connection %d from %s: TLS handshake failed: %s", cid, addr[0], e)
            return
        if port is not None:
            route = self.address_map.route_for_port(port) or await self._route_after_discovery(port=port)
        if route is not None:
            ctx.listener = f"{route.role}-{route.node_id}"
        session = Session(ctx, self.chain,
                          passthrough_unknown_versions=self.config.passthrough_unknown_versions)
        conn = ClientConnection(self, transport, session, (port, name))
        if route is None and (port is not None or (self.sni and name is not None
                                                  and not name.startswith(self._sni_bootstrap_prefix()))):
            # A broker address kproxy cannot place yet (brokers that need SASL defeat discovery):
            # serve it through the bootstrap servers until a response teaches the route.
            conn.unrouted = (port, name)
        self.connections.add(conn)
        self.stats.connections_total += 1
        self.stats.connections_open += 1
        try:
            await conn.run()
        finally:
            self.connections.discard(conn)
            self.stats.connections_open -= 1

    def route_for(self, port: int | None, name: str | None) -> Route | None:
        if port is not None:
            return self.address_map.route_for_port(port)
        return self.address_map.route_for_name(name) if name is not None else None

    def _sni_bootstrap_prefix(self) -> str:
        sni = self.config.exposure.sni
        return f"{sni.bootstrap_name}." if sni else "bootstrap."

    async def _route_after_discovery(self, port: int | None = None, name: str | None = None) -> Route | None:
        # A client may hold addresses from before kproxy (re)started: learn the brokers, then look again.
        await self.discover()
        if port is not None:
            route = self.address_map.route_for_port(port)
        else:
            assert name is not None
            route = self.address_map.route_for_name(name)
        if route is None:
            log.warning("no broker known for %s; sending it to the bootstrap servers", port or name)
        return route

    # -- broker discovery

    async def discover(self) -> bool:
        """Ask a bootstrap server for the brokers (ApiVersions, then Metadata with no topics) so
        their ports are open before any client asks. Best effort: False if no broker answered."""
        cfg = self.config.upstream
        for hp in cfg.bootstrap_servers:
            try:
                t = await connect(hp.host, hp.port, cfg.connect_timeout_s, self.upstream_tls,
                                  cfg.tls.server_hostname)
            except (OSError, trio.TooSlowError) as e:
                log.warning("discovery: cannot reach %s: %s", hp, e or "timed out")
                continue
            try:
                with trio.fail_after(cfg.request_timeout_s):
                    await self._discover_on(t)
                return True
            except (OSError, trio.TooSlowError, KProxyError, trio.BrokenResourceError) as e:
                log.warning("discovery via %s failed: %s", hp, e or "timed out")
            finally:
                t.close()
        return False

    async def _discover_on(self, t: Transport) -> None:
        reader = FrameReader(self.config.limits.max_frame_size)

        async def roundtrip(req: Request) -> Any:
            await t.send(encode_request_frame(req))
            while (frame := reader.next_frame()) is None:
                n = await t.recv_into(reader.recv_buffer())
                if n == 0:
                    raise OSError("broker closed the connection")
                reader.received(n)
            return decode_response(frame, req.api_key, req.api_version)

        av = await roundtrip(Request.build(18, 0, 1, "kproxy", body_class(18, "request")()))
        ranges = {e.api_key: e for e in narrow_api_keys(av.body.api_keys, supported_versions())}
        meta = ranges.get(3)
        if meta is None:
            raise KProxyError("broker offers no Metadata version kproxy decodes")
        version = meta.max_version
        body = body_class(3, "request")(topics=[])
        req = Request.build(3, version, 2, "kproxy", body)
        resp = await roundtrip(req)
        self.rewriter.on_response(ConnectionContext(0, listener="discovery"), req, resp)

    # -- shutdown

    async def drain(self, timeout: float | None = None) -> None:
        """Stop accepting, let in-flight requests finish (up to ``timeout``), then close everything."""
        timeout = self.config.limits.drain_timeout_s if timeout is None else timeout
        self._draining = True
        for scope in self._accept_scopes:
            scope.cancel()
        for s in self._listeners.values():
            s.close()
        log.info("draining %d connections (up to %gs)", len(self.connections), timeout)
        with trio.move_on_after(timeout):
            while self.connections:
                for c in list(self.connections):
                    if not c.session.in_flight and c.cancel_scope is not None:
                        c.cancel_scope.cancel()
                await trio.sleep(0.02)
        for c in list(self.connections):
            if c.cancel_scope is not None:
                c.cancel_scope.cancel()
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()


async def serve_until_signal(server: ProxyServer) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("%s: draining", signal.Signals(signum).name)
                await server.drain()
                nursery.cancel_scope.cancel()
                break


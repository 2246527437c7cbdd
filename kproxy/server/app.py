"""The proxy process: listeners, one task tree per connection, broker discovery, drain on SIGTERM.

A listener nursery accepts connections and starts one ``ClientConnection`` each. Broker ports open
the moment a response reveals a new broker, before that response is written, so a client never
reads an address nobody listens on; a port that cannot be bound is never advertised. This is the only
layer that knows about trio and sockets.
"""

from __future__ import annotations

import errno
import functools
import itertools
import logging
import os
import signal
import socket
import ssl
from collections.abc import Sequence
from typing import Any

import trio

from kproxy.config import HostPort, ProxyConfig, TlsClientSide, TlsServerSide, effective_buffer_budget
from kproxy.identity.principal import PrincipalMapper
from kproxy.logs import safe
from kproxy.policy.filter import PolicyFilter
from kproxy.policy.loader import describe_rules
from kproxy.policy.store import RuleStore
from kproxy.protocol.errors import KProxyError
from kproxy.protocol.messages import (
    Request,
    body_class,
    supported_versions,
)
from kproxy.proxy.addresses import AddressMap, AddressRewriter, Route
from kproxy.proxy.filters import ConnectionContext, Filter, FilterChain
from kproxy.proxy.inflight import InFlight
from kproxy.proxy.memo import AnswerMemo
from kproxy.proxy.reencode import ReencodeCheck
from kproxy.proxy.session import Session
from kproxy.proxy.topics import TopicNames
from kproxy.proxy.versions import ApiVersionsNarrower, narrow_api_keys
from kproxy.quota.engine import QuotaFilter
from kproxy.server import admin
from kproxy.server.budget import BufferBudget
from kproxy.server.certificates import CERTIFICATES, CertificateExpiry
from kproxy.server.clients import ClientRecord, ClientTable
from kproxy.server.connection import ClientConnection, ConnectionSettings
from kproxy.server.coordination import Coordinator
from kproxy.server.identity import IdentityService
from kproxy.server.ordering import run_clock
from kproxy.server.origination import Roundtrip, direct_roundtrip
from kproxy.server.proxy_protocol import ProxyProtocolGate
from kproxy.server.reload import POLL_INTERVAL_S, watch_rules
from kproxy.server.stats import ProxyStats
from kproxy.server.tls_files import POLL_INTERVAL_S as TLS_POLL_INTERVAL_S
from kproxy.server.tls_files import ReloadingContext, watch_tls
from kproxy.server.transport import (
    PlainTransport,
    SniNames,
    TlsTransport,
    client_context,
    server_context,
    tune,
)
from kproxy.server.upstream import UpstreamSettings, login_failed, open_upstream
from kproxy.telemetry import metrics as metric_families
from kproxy.telemetry.metrics import Metrics
from kproxy.telemetry.outputs import Telemetry
from kproxy.telemetry.spans import SpanExporter

log = logging.getLogger("kproxy.server")

# accept() errors that mean "out of a resource for now": wait and try again. Anything else is a bug
# or a closed listener, and retrying it forever would only hide it.
_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
# Errors of the one pending connection that Linux reports from accept() itself (accept(2): "treat them
# like EAGAIN"): a client that reset before it was accepted, a firewall, a network that went away.
_PEER_ERRNOS = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.ENETDOWN, errno.ENOPROTOOPT,
                          errno.EHOSTDOWN, errno.ENONET, errno.EHOSTUNREACH, errno.EOPNOTSUPP,
                          errno.ENETUNREACH, errno.ECONNRESET})


# A discovery attempt that ended less than this long ago answers for a new one: a reconnect storm to
# ports kproxy has not mapped yet costs one attempt, not one per connection.
DISCOVERY_REUSE_S = 1.0


class ListenError(KProxyError):
    """A port kproxy must listen on cannot be bound (in use, no permission, no such address)."""


class ProxyServer:
    """kproxy in front of one Kafka cluster, as configured."""

    def __init__(self, config: ProxyConfig, filters: Sequence[Filter] = (), *,
                 span_exporter: SpanExporter | None = None, worker: tuple[int, int] | None = None,
                 admin_listen: HostPort | None = None, certificates: CertificateExpiry | None = None) -> None:
        """Raises RuleError (a ConfigError) when the configured rule files do not load."""
        self.config = config
        # (index, count) when this is one of several worker processes sharing the ports (SO_REUSEPORT);
        # budgets are then divided among the workers.
        self.worker = worker
        self.workers = worker[1] if worker is not None else 1
        self.admin_listen = admin_listen or config.admin.listen
        self.stats = ProxyStats()
        # SASL termination and origination (sasl, upstream.sasl); raises ConfigError for a bad users file.
        self.identity = IdentityService(config)
        # Live and recently closed connections, for /clients and `kproxy top`.
        self.clients = ClientTable()
        self.certificates = certificates if certificates is not None else CERTIFICATES
        # The one table of topic names by id, for the rules and telemetry alike (the broker's names).
        self.topic_names = TopicNames()
        self.telemetry = Telemetry(config, span_exporter=span_exporter, topic_names=self.topic_names)
        self.reencode = ReencodeCheck(config.verify_reencode) if config.verify_reencode > 0 else None
        # The policy rules in force (generation, loaded_at, rule_count, sources, reloads_ok,
        # reloads_failed, describe()); None when no rule files are configured. Read by /rules and /metrics.
        self.rule_store: RuleStore | None = RuleStore(config.rules, config.chaos) if config.rules else None
        self.rules_poll_interval_s = POLL_INTERVAL_S
        self.discovered = False              # a bootstrap server told the brokers (Metadata) at least once
        self.bootstrap_answered = False      # a bootstrap server answered a request at least once (ready)
        self.discovery_attempts = 0
        self._discovery: trio.Event | None = None      # set when the attempt in progress ends
        self._discovery_result = False
        self.discovery_ended_at: float | None = None
        self.admin: admin.AdminServer | None = None
        self.coordinator: Coordinator | None = None     # fleet quotas (quota.coordination)
        self._telemetry_failures: set[str] = set()
        exposure = config.exposure
        self.sni = exposure.mode == "sni"
        self.sni_names = SniNames(exposure.sni.domain if self.sni and exposure.sni else None,
                                  exposure.sni.bootstrap_name if exposure.sni else "bootstrap")
        # Both sides follow their certificate files (tls_poll_interval_s; see tls_files.py), and every
        # load, the first included, records the certificates' expiry in self.certificates.
        self.client_tls: ReloadingContext | None = (
            _reloading("tls", config.tls, lambda: server_context(config.tls, self.sni_names if self.sni else None),
                       server_side=True, expiry=self.certificates) if config.tls.enabled else None)
        self.upstream_tls: ReloadingContext | None = (
            _reloading("upstream.tls", config.upstream.tls, lambda: client_context(config.upstream.tls),
                       server_side=False, expiry=self.certificates) if config.upstream.tls.enabled else None)
        # How every broker connection is opened (discovery, client connections): kproxy.server.upstream.
        self.upstream = UpstreamSettings.from_config(config.upstream, self.upstream_tls, self.identity.originator)
        self.tls_poll_interval_s = TLS_POLL_INTERVAL_S
        principal = config.tls.principal
        self.principal_mapper = PrincipalMapper.from_config(principal.mapping_rules, principal.san_uri)
        self.proxy_protocol: ProxyProtocolGate | None = (
            ProxyProtocolGate(config.proxy_protocol) if config.proxy_protocol.mode != "off" else None)
        self.address_map = AddressMap(
            config.advertised_host, config.broker_port_start, exposure.broker_port_count,
            node_id_base=exposure.node_id_base,
            sni_domain=exposure.sni.domain if self.sni and exposure.sni else None,
            sni_port=config.listen.port if self.sni else None)
        self.rewriter = AddressRewriter(self.address_map)
        builtin: list[Filter] = [self.rewriter]
        if not config.passthrough_unknown_versions:
            builtin.insert(0, ApiVersionsNarrower())
        # Policy rules, when configured: judged after the built-in filters, before any given here.
        if self.rule_store is not None:
            builtin.append(PolicyFilter(self.rule_store, topic_ids=self.topic_names))
            # Quotas come from the same files; they count what the policy lets through.
            coordinated = config.quota.coordinated is not None
            quotas = QuotaFilter(self.rule_store, config.quota.samples, config.quota.window_s,
                                 config.quota_share(self.workers), coordinated=coordinated)
            builtin.append(quotas)
            if coordinated:
                # Its connections are opened, logged in and re-authenticated as every other one.
                self.coordinator = Coordinator(config, quotas, config.quota_share(self.workers),
                                               opener=lambda host, port: open_upstream(host, port, self.upstream))
        self.chain = FilterChain([*builtin, *filters])
        # Rewritten answers that repeat byte for byte (Metadata between cluster changes), by their bytes.
        self.answer_memo = AnswerMemo()
        self._ids = itertools.count(1)
        self.connections: set[ClientConnection] = set()
        self._nursery: trio.Nursery | None = None
        self._listeners: dict[int, trio.socket.SocketType] = {}
        self._raw_listeners: dict[int, socket.socket] = {}     # fileno -> the stdlib listening socket
        self._accept_scopes: list[trio.CancelScope] = []
        self._pending_ports: list[int] = []
        self.bootstrap_address: tuple[str, int] | None = None
        self.draining = False
        limits = config.limits
        self.budget = BufferBudget(_budget_limit(config) // self.workers)
        upstream = config.upstream
        self.settings = ConnectionSettings(
            # A frame is forwarded only once it is whole, so what one direction of a connection
            # holds is at most one frame: capping frames at the buffer limit bounds both.
            frame_cap=min(limits.max_frame_size, limits.max_buffered_bytes),
            max_in_flight=limits.max_in_flight_requests,
            bootstrap_servers=tuple((hp.host, hp.port) for hp in upstream.bootstrap_servers),
            upstream=self.upstream,
            request_timeout_s=upstream.request_timeout_s,
            unauthenticated_timeout_s=limits.unauthenticated_idle_timeout_s,
            idle_timeout_s=limits.idle_timeout_s,
            frame_timeout_s=limits.frame_timeout_s,
            splice=config.cut_through_splice,
            frame_cap_setting=("limits.max_frame_size" if limits.max_frame_size <= limits.max_buffered_bytes
                               else "limits.max_buffered_bytes"),
        )
        self.tls_handshake_timeout_s = limits.tls_handshake_timeout_s
        # How late the event loop runs a short timer (see _watch_loop_lag).
        self.loop_lag = metric_families.Histogram()
        self.loop_lag_max = 0.0
        if self.metrics is not None:
            self._add_metric_readers(self.metrics)

    # -- telemetry and the admin listener

    @property
    def metrics(self) -> Metrics | None:
        return self.telemetry.metrics

    def readiness(self) -> tuple[bool, str]:
        """(ready, why): listeners bound and one round trip to a bootstrap server done (its ApiVersions
        answer is enough: a broker that requires SASL answers it before authentication), and not
        draining. Learning the brokers is not required: client traffic teaches them too."""
        if self.draining:
            return False, "not ready: draining"
        if self.bootstrap_address is None:
            return False, "not ready: the listeners are not bound yet"
        if not self.bootstrap_answered:
            return False, "not ready: no bootstrap server has answered yet"
        return True, "ready"

    def _add_metric_readers(self, m: Metrics) -> None:
        stats = self.stats

        def connections() -> list:
            open_now: dict[str, int] = {}
            in_flight = 0
            for c in self.connections:
                listener = c.session.ctx.listener
                open_now[listener] = open_now.get(listener, 0) + 1
                in_flight += len(c.session.in_flight)
            return metric_families.connection_families(stats.opened_by_listener, open_now, stats.decode_errors,
                                                       stats.upstream_connect_failures, in_flight)

        m.add_reader(connections)
        m.add_reader(lambda: metric_families.discovery_families(self.discovery_attempts))
        m.add_reader(lambda: metric_families.memo_families(self.answer_memo))
        m.add_reader(lambda: metric_families.loop_lag_families(self.loop_lag, self.loop_lag_max))
        m.add_reader(lambda: metric_families.budget_families(self.budget))
        m.add_reader(lambda: metric_families.rule_families(self.rule_store))
        m.add_reader(lambda: metric_families.readiness_families(self.readiness()[0]))
        m.add_reader(self.certificates.families)
        m.add_reader(lambda: metric_families.identity_edge_families(
            [c for c in (self.client_tls, self.upstream_tls) if c is not None], self.proxy_protocol,
            self.sni_names if self.sni else None))
        if self.identity.active:
            m.add_reader(lambda: metric_families.identity_families(self.identity))
        if self.coordinator is not None:
            coordinator = self.coordinator
            m.add_reader(lambda: metric_families.coordination_families(coordinator.snapshot()))
        if self.reencode is not None:
            check = self.reencode
            m.add_reader(lambda: metric_families.reencode_families(check))

    async def _watch_loop_lag(self, period: float = 0.005) -> None:
        """A 5 ms timer whose lateness measures how long other work held the event loop (a big frame,
        a slow filter): every other connection waited that long. Costs 200 wake-ups a second."""
        while True:
            due = trio.current_time() + period
            await trio.sleep_until(due)
            lag = max(0.0, trio.current_time() - due)
            self.loop_lag.observe(lag)
            if lag > self.loop_lag_max:
                self.loop_lag_max = lag

    def _cut_through_min_bytes(self) -> int | None:
        """Answers this large stream to the client (None: none do). Spans that link the traces named
        in records' headers read every Fetch answer's records, which a streamed answer no longer has."""
        tracing = self.config.tracing
        if tracing.enabled and tracing.link_record_traces != "off":
            return None
        return self.config.cut_through_min_bytes

    def _completed_with_telemetry(self, ctx: ConnectionContext, record: ClientRecord, entry: InFlight) -> None:
        self.stats.record(entry)
        record.completed(entry.request_bytes, entry.response_bytes)
        try:
            self.telemetry.completed(entry, ctx)
        except Exception as e:
            # A bug in telemetry must not cost the client its connection; one line per kind of bug.
            key = f"{type(e).__name__}:{e}"[:200]
            if key not in self._telemetry_failures:
                self._telemetry_failures.add(key)
                log.error("telemetry failed on a completed request (logged once per kind)", exc_info=True)

    # -- listeners (the Router the connections use)

    def _bind(self, host: str, port: int) -> trio.socket.SocketType:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        s = socket.socket(family, socket.SOCK_STREAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if self.workers > 1:
                # Every worker listens on the same ports; the kernel spreads new connections.
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind((host, port))
            s.listen(1024)
        except OSError as e:
            s.close()
            raise ListenError(f"cannot listen on {_hostport(host, port)}: {e.strerror or e}") from e
        s.setblocking(False)
        self._raw_listeners[s.fileno()] = s
        return trio.socket.from_stdlib_socket(s)

    def open_ports(self, ports: tuple[int, ...]) -> str | None:
        """Bind broker ports now (synchronously, so before the response naming them is written)."""
        for port in ports:
            if port in self._listeners:
                self.address_map.confirm(port)
                continue
            try:
                sock = self._bind(self.config.listen.host, port)
            except ListenError as e:
                route = self.address_map.withdraw(port, str(e))
                what = f"{route.role} {route.node_id}" if route is not None else "a broker"
                log.error("%s; %s will not be advertised on it", e, what)
                return f"{e} (for {what}); closing so the client fetches metadata again"
            self._listeners[port] = sock
            self.address_map.confirm(port)
            route = self.address_map.route_for_port(port)
            if route is not None:
                log.info("exposing %s %d (%s) on port %d", route.role, route.node_id,
                         _hostport(*route.upstream), port)
            if self._nursery is not None:
                self._nursery.start_soon(self._accept_loop, sock, port)
            else:
                self._pending_ports.append(port)
        return None

    def route_for(self, port: int | None, name: str | None) -> Route | None:
        if port is not None:
            return self.address_map.route_for_port(port)
        return self.address_map.route_for_name(name) if name is not None else None

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Run until cancelled or drained; ``task_status.started(self)`` once the bootstrap port listens."""
        listen = self.config.listen
        admin_listener = None
        if self.admin_listen is not None:
            try:
                admin_listener = admin.bind(self.admin_listen)
            except admin.AdminListenError as e:
                raise ListenError(str(e)) from e
        try:
            boot = self._bind(listen.host, listen.port)
        except ListenError:
            if admin_listener is not None:
                admin_listener.socket.close()
            raise
        self.bootstrap_address = boot.getsockname()[:2]
        self._listeners[listen.port] = boot
        self.telemetry.start(trio.current_time())
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                if admin_listener is not None:
                    self.admin = admin.AdminServer(self, admin_listener)
                    nursery.start_soon(self.admin.serve)
                    log.info("admin listener on %s: /metrics /livez /readyz /config /rules /clients",
                             _hostport(*self.admin.address))
                await self.identity.run(nursery)
                nursery.start_soon(self._accept_loop, boot, None)
                if self.metrics is not None:
                    nursery.start_soon(self._watch_loop_lag)
                exposure = self.config.exposure
                if exposure.node_id_base is not None and not self.sni:
                    # Deterministic ports: open the whole range now, so clients holding addresses
                    # from before a restart can connect even if discovery cannot reach a broker.
                    start = self.config.broker_port_start
                    for port in range(start, start + exposure.broker_port_count):
                        if port not in self._listeners:
                            self._listeners[port] = self._bind(listen.host, port)
                            self._pending_ports.append(port)
                for port in self._pending_ports:
                    nursery.start_soon(self._accept_loop, self._listeners[port], port)
                self._pending_ports.clear()
                if not await self.discover():
                    nursery.start_soon(self._rediscover)
                log.info("kproxy listening on %s -> %s", _hostport(listen.host, listen.port),
                         ", ".join(str(b) for b in self.config.upstream.bootstrap_servers))
                tls_files = [c for c in (self.client_tls, self.upstream_tls) if c is not None]
                if tls_files:
                    nursery.start_soon(watch_tls, tls_files, self.tls_poll_interval_s)
                if self.rule_store is not None:
                    log.info("rules in force: %s (watching %s)", describe_rules(self.rule_store.rule_set),
                             ", ".join(self.rule_store.paths))
                    nursery.start_soon(watch_rules, self.rule_store, self.rules_poll_interval_s)
                if self.coordinator is not None:
                    # Background only: the data path reads each budget's share, never waits on this.
                    nursery.start_soon(self.coordinator.run)
                    nursery.start_soon(self.coordinator.watch)
                task_status.started(self)
        finally:
            for s in self._listeners.values():
                s.close()
            if admin_listener is not None:
                admin_listener.socket.close()
            self.telemetry.close()

    async def _rediscover(self) -> None:
        # Until a bootstrap server answers once (readiness waits for it), try again with a backoff.
        # Once one has answered, brokers still unknown are learned from client traffic, or by the
        # discovery a connection to an unmapped port asks for.
        delay = 1.0
        while not (self.discovered or self.bootstrap_answered) and not self.draining:
            await trio.sleep(delay)
            delay = min(delay * 2, 30.0)
            await self.discover()

    async def _accept_loop(self, sock: trio.socket.SocketType, port: int | None) -> None:
        listener = self._raw_listeners[sock.fileno()]
        with trio.CancelScope() as scope:
            self._accept_scopes.append(scope)
            if self.draining:
                return
            while True:
                try:
                    # Accepted as a stdlib socket, which kproxy then owns by a public name (the
                    # transport peeks at it to tell an idle connection from a busy one).
                    await trio.lowlevel.wait_readable(listener)
                    try:
                        raw, addr = listener.accept()
                    except BlockingIOError:
                        continue
                    raw.setblocking(False)
                    conn = trio.socket.from_stdlib_socket(raw)
                except OSError as e:
                    if e.errno in _CAPACITY_ERRNOS:
                        log.warning("accept on port %s failed: %s; retrying in 100 ms",
                                    port or self.config.listen.port, e.strerror or e)
                        await trio.sleep(0.1)
                        continue
                    if e.errno in _PEER_ERRNOS:
                        continue    # that one connection failed before it was accepted; not the listener
                    if self.draining:
                        return
                    raise
                assert self._nursery is not None
                self._nursery.start_soon(self._handle, conn, addr, port, raw)

    async def _handle(self, sock: trio.socket.SocketType, addr: Any, port: int | None,
                      raw: socket.socket) -> None:
        tune(sock)
        cid = next(self._ids)
        peer = (addr[0], addr[1])
        via = ""
        if self.proxy_protocol is not None:
            # Before TLS: a load balancer writes the header ahead of the client's ClientHello.
            admission = await self.proxy_protocol.admit(raw, peer)
            if admission.refused is not None:
                sock.close()
                # A balancer's TCP health check connects and closes without a byte: not worth a warning.
                log.log(logging.DEBUG if admission.kind == "closed" else logging.WARNING,
                        "connection %d from %s refused: %s", cid, _hostport(*peer), safe(admission.refused))
                return
            if admission.via is not None:
                via = f" via {_hostport(*admission.via)}"
            peer = admission.client
        ctx = self.new_context(cid, peer)
        transport: PlainTransport | TlsTransport
        route: Route | None = None
        name: str | None = None
        try:
            if self.client_tls is not None:
                stream = trio.SSLStream(trio.SocketStream(sock), self.client_tls, server_side=True)
                with trio.fail_after(self.tls_handshake_timeout_s):
                    await stream.do_handshake()
                name = self.sni_names.name_of(stream)
                transport = TlsTransport(stream, raw)
                cert = stream.getpeercert()
                if cert:
                    # Verified by the handshake (getpeercert is empty otherwise); only then a principal.
                    principal, why = self.principal_mapper.map(cert)
                    if principal is None:
                        transport.close()
                        log.warning("connection %d from %s%s refused: %s", cid, _hostport(*peer), via, safe(why))
                        return
                    ctx.tls_subject = principal
                if self.sni and name is not None:
                    route = self.address_map.route_for_name(name)
                    if route is None and not name.startswith(self._sni_bootstrap_prefix()):
                        route = await self._route_after_discovery(name=name)
            else:
                transport = PlainTransport(sock, raw)
        except (OSError, ssl.SSLError, trio.BrokenResourceError, trio.TooSlowError) as e:
            sock.close()
            log.info("connection %d from %s%s: TLS handshake failed: %s", cid, _hostport(*peer), via,
                     "timed out (limits.tls_handshake_timeout_s)" if isinstance(e, trio.TooSlowError)
                     else safe(str(e)))
            return
        if port is not None:
            route = self.address_map.route_for_port(port) or await self._route_after_discovery(port=port)
        if route is not None:
            ctx.listener = f"{route.role}-{route.node_id}"
        front = self.identity.front(ctx)
        session = Session(ctx, self.chain, passthrough_unknown_versions=self.config.passthrough_unknown_versions,
                          reencode=self.reencode, topic_names=self.topic_names, front=front,
                          stream_min_bytes=self._cut_through_min_bytes(), memo=self.answer_memo,
                          read_answers=self.telemetry.active)
        prepare = (functools.partial(self.identity.prepare, front, discover=self.discover)
                   if front is not None and front.termination is not None else None)
        record = self.clients.opened(ctx)
        complete = functools.partial(self._completed_with_telemetry if self.telemetry.active
                                     else self._completed, ctx, record)
        conn = ClientConnection(self.settings, self, transport, session, on_complete=complete,
                                budget=self.budget, route_key=(port, name), stats=self.stats, prepare=prepare)
        if route is None and (port is not None or (self.sni and name is not None
                                                  and not name.startswith(self._sni_bootstrap_prefix()))):
            # A broker address kproxy cannot place yet (brokers that need SASL defeat discovery):
            # serve it through the bootstrap servers until a response teaches the route.
            conn.unrouted = (port, name)
        log.info("connection %d from %s%s on %s", cid, _hostport(*peer), via, ctx.listener)
        self.connections.add(conn)
        self.stats.opened(ctx.listener)
        try:
            if self.draining:
                conn.drain()
            await conn.run()
        finally:
            self.connections.discard(conn)
            self.clients.closed(record)
            self.stats.connections_open -= 1

    def reload_rules(self, reason: str) -> bool:
        """Load the rule files again (SIGHUP); the old rules stay if the new ones do not load."""
        if self.rule_store is None:
            log.info("%s: nothing to reload (no rule files are configured)", reason)
            return False
        return self.rule_store.reload(reason)

    def reload_tls(self) -> None:
        """Look at the TLS files now (SIGHUP) instead of at the next poll; unchanged files stay loaded."""
        for ctx in (self.client_tls, self.upstream_tls):
            if ctx is not None:
                ctx.check()

    def new_context(self, connection_id: int, client_address: tuple[str, int]) -> ConnectionContext:
        """The context of a new client connection, with the settings filters read from it."""
        return ConnectionContext(connection_id, client_address=client_address, clock=run_clock(),
                                 max_decompressed_batch_bytes=self.config.limits.max_decompressed_batch_bytes)

    def _completed(self, ctx: ConnectionContext, record: ClientRecord, entry: InFlight) -> None:
        self.stats.record(entry)
        record.completed(entry.request_bytes, entry.response_bytes)

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
            log.warning("no broker known for %s; sending it to the bootstrap servers", port or safe(name))
        return route

    # -- broker discovery

    async def discover(self) -> bool:
        """Ask a bootstrap server for the brokers (ApiVersions, then Metadata with no topics) so
        their ports are open before any client asks. Best effort: False if no broker told them.

        One attempt at a time for the whole process: callers that arrive while one runs wait for it
        and share its answer, and an attempt that ended less than ``DISCOVERY_REUSE_S`` ago answers
        for a new one. The attempt runs in the server's nursery, so a caller that goes away (its
        connection closed) does not cancel it for the others."""
        running = self._discovery
        if running is None:
            ended = self.discovery_ended_at
            if ended is not None and trio.current_time() - ended < DISCOVERY_REUSE_S:
                return self._discovery_result
            running = self._discovery = trio.Event()
            if self._nursery is not None:
                self._nursery.start_soon(self._discovery_attempt, running)
            else:
                await self._discovery_attempt(running)
        await running.wait()
        return self._discovery_result

    async def _discovery_attempt(self, done: trio.Event) -> None:
        self.discovery_attempts += 1
        try:
            self._discovery_result = await self._discover_once()
        except Exception:
            # A bug here must not stop the server; the next attempt may fare better.
            log.exception("discovery failed")
            self._discovery_result = False
        finally:
            self.discovery_ended_at = trio.current_time()
            self._discovery = None
            done.set()

    async def _discover_once(self) -> bool:
        cfg = self.config.upstream
        for hp in cfg.bootstrap_servers:
            try:
                t = await open_upstream(hp.host, hp.port, self.upstream)
            except (OSError, trio.TooSlowError) as e:
                if login_failed(e):
                    self._discovery_failed(hp, e)
                else:
                    log.warning("discovery: cannot reach %s: %s", hp, str(e) or "timed out")
                continue
            try:
                roundtrip = direct_roundtrip(t, cfg.request_timeout_s, self.config.limits.max_frame_size)
                with trio.fail_after(cfg.request_timeout_s):
                    await self._discover_on(roundtrip)
                if not self.discovered:
                    self.discovered = True
                return True
            except (OSError, trio.TooSlowError, KProxyError, trio.BrokenResourceError) as e:
                self._discovery_failed(hp, e)
            finally:
                t.close()
        return False

    def _discovery_failed(self, hp: HostPort, e: BaseException) -> None:
        if self.bootstrap_answered and not self.discovered:
            # It answers ApiVersions but not Metadata: a broker that requires SASL, most likely.
            log.warning("discovery via %s: it answered ApiVersions but not Metadata (%s); a broker "
                        "that requires SASL refuses Metadata before authentication. Brokers are "
                        "learned from the clients' own Metadata instead", hp, str(e) or "timed out")
        else:
            log.warning("discovery via %s failed: %s", hp, str(e) or "timed out")

    async def _discover_on(self, roundtrip: Roundtrip) -> None:
        av = await roundtrip(Request.build(18, 0, 1, "kproxy", body_class(18, "request")()))
        if not self.bootstrap_answered:
            self.bootstrap_answered = True
            log.info("a bootstrap server answered: ready")
        # Kept for terminating connections, which answer ApiVersions themselves before any login.
        self.identity.broker_versions = [(e.api_key, e.min_version, e.max_version) for e in av.body.api_keys]
        ranges = {e.api_key: e for e in narrow_api_keys(av.body.api_keys, supported_versions())}
        meta = ranges.get(3)
        if meta is None:
            raise KProxyError("broker offers no Metadata version kproxy decodes")
        version = meta.max_version
        body = body_class(3, "request")(topics=[])
        req = Request.build(3, version, 2, "kproxy", body)
        resp = await roundtrip(req)
        ctx = ConnectionContext(0, listener="discovery")
        exchange = InFlight(req.correlation_id, req.api_key, req.api_version, 0.0, req)
        self.rewriter.on_response(ctx, exchange, resp)
        if exchange.ports:
            self.open_ports(tuple(exchange.ports))

    # -- shutdown

    async def drain(self, timeout: float | None = None) -> None:
        """Stop accepting, answer what is in flight (up to ``timeout``), close each connection as soon
        as it owes nothing, then stop."""
        timeout = self.config.limits.drain_timeout_s if timeout is None else timeout
        self.draining = True
        for scope in self._accept_scopes:
            scope.cancel()
        for s in self._listeners.values():
            s.close()
        busy = sum(1 for c in self.connections if c.session.open)
        log.info("draining: %d connections open, %d with requests in flight (up to %gs)",
                 len(self.connections), busy, timeout)
        for c in list(self.connections):
            c.drain()
        with trio.move_on_after(timeout):
            while self.connections:
                await trio.sleep(0.01)
        if self.connections:
            log.warning("drain timeout (limits.drain_timeout_s = %gs): closing %d connections with "
                        "requests still in flight", timeout, len(self.connections))
            for c in list(self.connections):
                c._close_from_task(f"drain timeout ({timeout:g}s) with requests in flight")
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()


async def serve_until_signal(server: ProxyServer) -> None:
    """Serve; SIGTERM or SIGINT drains, a second one stops at once; SIGHUP reloads the rule files
    and any changed TLS files."""
    # Signals are kproxy's before the first port is bound: /readyz says ready as soon as a bootstrap
    # server answers, while discovery may still wait for Metadata, and a SIGTERM then (a supervisor's,
    # a kubelet's) would otherwise end the process at once without a drain or a last log line. One
    # that arrives during start-up waits here until the server has started, then drains it.
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            if server.worker is not None:
                nursery.start_soon(_drain_when_orphaned, server, nursery.cancel_scope, os.getppid())
            log.info("signals: SIGTERM or SIGINT drains, SIGHUP reloads the rule files")
            async for signum in signals:
                name = signal.Signals(signum).name
                if signum == signal.SIGHUP:
                    server.reload_rules("SIGHUP")
                    server.reload_tls()
                    continue
                if server.draining:
                    log.info("%s again: stopping now", name)
                    break
                log.info("%s: draining (send it again to stop at once)", name)
                nursery.start_soon(_drain_then_stop, server, nursery.cancel_scope)
            nursery.cancel_scope.cancel()
    log.info("kproxy stopped")


async def _drain_when_orphaned(server: ProxyServer, scope: trio.CancelScope, parent: int) -> None:
    # A worker whose supervisor is gone (killed outright) would hold the ports forever: drain and stop.
    while os.getppid() == parent:
        await trio.sleep(1.0)
    if not server.draining:
        log.warning("the supervisor (pid %d) is gone: draining and stopping this worker", parent)
        await _drain_then_stop(server, scope)


async def _drain_then_stop(server: ProxyServer, scope: trio.CancelScope) -> None:
    await server.drain()
    scope.cancel()


def _reloading(setting: str, side: TlsServerSide | TlsClientSide, build: Any, server_side: bool,
               expiry: CertificateExpiry) -> ReloadingContext:
    files = [f for f in (side.cert_file, side.key_file, side.ca_file) if f]
    certificates = [f for f in (side.cert_file, side.ca_file) if f]

    def observe_expiry() -> None:
        # The expiry of what is in force now: read again after every load, never after a refused one.
        for path in certificates:
            expiry.observe(path)

    return ReloadingContext(setting, files, build, server_side=server_side, on_loaded=observe_expiry)


def _budget_limit(config: ProxyConfig) -> int:
    return effective_buffer_budget(config)


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen_error(e: BaseException) -> ListenError | None:
    """The ListenError that ended the server, through trio's nursery exception groups; else None."""
    while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
        e = e.exceptions[0]
    return e if isinstance(e, ListenError) else None

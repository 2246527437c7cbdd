"""One virtual cluster: its listeners, one task tree per connection, broker discovery, drain on SIGTERM.

A listener nursery accepts connections and starts one ``ClientConnection`` each. Broker ports open
the moment a response reveals a new broker, before that response is written, so a client never
reads an address nobody listens on; a port that cannot be bound is never advertised. A
``ProxyServer`` knows nothing of other virtual clusters: the ``ProxyProcess`` around it
(``kproxy.server.process``) holds what they share (the admin listener, metrics, the buffer budget,
signals) and the ports they share. This is the only layer that knows about trio and sockets.
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
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import trio

from kproxy.config import ConfigError, HostPort, ProxyConfig, TlsClientSide, TlsServerSide
from kproxy.identity.principal import PrincipalMapper
from kproxy.logs import VIRTUAL_CLUSTER, safe
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
from kproxy.proxy.cluster_view import ClusterIdentity, ReplicaNames
from kproxy.proxy.continuity import Continuity, ProducerCarrier, SwitchBook
from kproxy.proxy.filters import ConnectionContext, Filter, FilterChain
from kproxy.proxy.inflight import InFlight
from kproxy.proxy.memo import AnswerMemo
from kproxy.proxy.reencode import ReencodeCheck
from kproxy.proxy.session import Session
from kproxy.proxy.topics import TopicNames
from kproxy.proxy.versions import ApiVersionsNarrower, narrow_api_keys
from kproxy.quota.engine import QuotaFilter
from kproxy.server.certificates import CertificateExpiry
from kproxy.server.clients import ClientRecord, ClientTable
from kproxy.server.clusters import Cluster, UpstreamClusters
from kproxy.server.connection import ClientConnection, ConnectionSettings
from kproxy.server.coordination import Coordinator
from kproxy.server.encryption import encrypt_without_kms, kek_problems, open_key_service
from kproxy.server.handover import merge_counts, open_lane
from kproxy.server.identity import IdentityService
from kproxy.server.ordering import run_clock
from kproxy.server.origination import Originator, Roundtrip, direct_roundtrip
from kproxy.server.proxy_protocol import Admission, ProxyProtocolGate
from kproxy.server.reload import POLL_INTERVAL_S, watch_rules
from kproxy.server.stats import ProxyStats
from kproxy.server.tls_files import POLL_INTERVAL_S as TLS_POLL_INTERVAL_S
from kproxy.server.tls_files import ReloadingContext, watch_tls
from kproxy.server.transport import (
    REFUSED_SNI_NAME,
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

if TYPE_CHECKING:
    from kproxy.server.admin import AdminServer
    from kproxy.server.process import ProxyProcess

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
    """kproxy in front of one Kafka cluster, as configured: one virtual cluster."""

    def __init__(self, config: ProxyConfig, filters: Sequence[Filter] = (), *, process: ProxyProcess,
                 worker: tuple[int, int] | None = None) -> None:
        """Raises RuleError (a ConfigError) when the configured rule files do not load.

        ``process``: the ProxyProcess this virtual cluster is one of, which holds the admin listener,
        telemetry outputs, budget and certificates; ``ProxyProcess.from_config`` makes it and one
        ProxyServer per virtual cluster (``.cluster()`` is the only one of a single-cluster file)."""
        self.config = config
        self.name = config.name
        # (index, count) when this is one of several worker processes sharing the ports (SO_REUSEPORT);
        # budgets are then divided among the workers.
        self.worker = worker
        self.workers = worker[1] if worker is not None else 1
        self.process = process
        shared = process.shared
        self.stats = ProxyStats()
        # SASL termination and origination (sasl, upstream.sasl); raises ConfigError for a bad users file.
        self.identity = IdentityService(config)
        # Live and recently closed connections, for /clients and `kproxy top`.
        self.clients = ClientTable()
        self.certificates = shared.certificates
        # The one table of topic names by id, for the rules and telemetry alike (the broker's names).
        self.topic_names = TopicNames()
        self.telemetry = shared.telemetry.for_cluster(self.name, self.topic_names)
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
        self.coordinator: Coordinator | None = None     # fleet quotas (quota.coordination)
        self._telemetry_failures: set[str] = set()
        exposure = config.exposure
        self.sni = exposure.mode == "sni"
        self.sni_names = SniNames(exposure.sni.domain if self.sni and exposure.sni else None,
                                  exposure.sni.bootstrap_name if exposure.sni else "bootstrap",
                                  listener=_hostport(config.listen.host, config.listen.port))
        # Both sides follow their certificate files (tls_poll_interval_s; see tls_files.py), and every
        # load, the first included, records the certificates' expiry in self.certificates.
        self.client_tls: ReloadingContext | None = (
            _reloading("tls", config.tls, lambda: server_context(config.tls, self.sni_names if self.sni else None),
                       server_side=True, expiry=self.certificates) if config.tls.enabled else None)
        self.upstream_tls: ReloadingContext | None = (
            _reloading("upstream.tls", config.upstream.tls, lambda: client_context(config.upstream.tls),
                       server_side=False, expiry=self.certificates) if config.upstream.tls.enabled else None)
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
        # Record encryption: the key service (kms:) and the policy filter's view of its data keys.
        keys = open_key_service(config)
        self.keys = keys[0] if keys is not None else None
        self.record_crypto = keys[1] if keys is not None else None
        if self.rule_store is not None:
            missing_kms = encrypt_without_kms(config, self.rule_store.rule_set)
            if missing_kms is not None:
                raise missing_kms
        if self.rule_store is not None:
            builtin.append(PolicyFilter(self.rule_store, topic_ids=self.topic_names, crypto=self.record_crypto))
            # Quotas come from the same files; they count what the policy lets through.
            coordinated = config.quota.coordinated is not None
            quotas = QuotaFilter(self.rule_store, config.quota.samples, config.quota.window_s,
                                 config.quota_share(self.workers), coordinated=coordinated)
            builtin.append(quotas)
            if coordinated:
                # Its connections are opened, logged in and re-authenticated as every other one.
                self.coordinator = Coordinator(config, quotas, config.quota_share(self.workers),
                                               opener=lambda host, port: open_upstream(host, port, self.upstream))
        self._filters = (builtin, list(filters))
        # Rewritten answers that repeat byte for byte (Metadata between cluster changes), by their bytes;
        # this virtual cluster's own, as its address map is.
        self.answer_memo = AnswerMemo()
        # Connection ids are unique in the process, whichever virtual cluster a connection is of.
        self._ids: itertools.count[int] = shared.connection_ids
        self.connections: set[ClientConnection] = set()
        # The lane relaying this virtual cluster's steady plain connections without the event loop
        # (kproxy.server.lane); None with ``lane: off``, where it is not built, with fleet quotas
        # (their budgets are read per request) or per-client metrics (the lane counts by api only).
        self.lane = (open_lane(config.lane, min(config.limits.max_frame_size, config.limits.max_buffered_bytes),
                               self._cut_through_min_bytes())
                     if self.coordinator is None and not config.metrics.client_labels else None)
        if self.lane is not None and self.rule_store is not None:
            self.rule_store.installed.append(self._recall_lanes)
        if self.lane is not None:
            # The lane answers Metadata from its own memo of the rewrites made here (Session.lane_programs);
            # when the address map moves they are all stale, and laned connections carry the old class.
            self.answer_memo.lane = self.lane
            self.address_map.on_move.append(self.lane.memo_clear)
        self._nursery: trio.Nursery | None = None
        self._listeners: dict[int, trio.socket.SocketType] = {}
        self._raw_listeners: dict[int, socket.socket] = {}     # fileno -> the stdlib listening socket
        self._accept_scopes: list[trio.CancelScope] = []
        self._pending_ports: list[int] = []
        self.bootstrap_address: tuple[str, int] | None = None
        # The address of a port this virtual cluster shares with others (SNI): the process binds it and
        # hands over each connection whose ClientHello names this cluster (hand_over).
        self.shared_listener: tuple[str, int] | None = None
        self.draining = False
        limits = config.limits
        self.budget = shared.budget
        if self.lane is not None:
            # Laned connections' bytes count in the process's budget, and the lane pauses clients with it.
            self.budget.attach_lane(self.lane)
        upstream = config.upstream
        self.settings = ConnectionSettings(
            # A frame is forwarded only once it is whole, so what one direction of a connection
            # holds is at most one frame: capping frames at the buffer limit bounds both.
            frame_cap=min(limits.max_frame_size, limits.max_buffered_bytes),
            max_in_flight=limits.max_in_flight_requests,
            # Each upstream cluster's own bootstrap servers and upstream settings replace these.
            bootstrap_servers=(),
            upstream=UpstreamSettings(upstream.connect_timeout_s, request_timeout_s=upstream.request_timeout_s),
            request_timeout_s=upstream.request_timeout_s,
            unauthenticated_timeout_s=limits.unauthenticated_idle_timeout_s,
            idle_timeout_s=limits.idle_timeout_s,
            frame_timeout_s=limits.frame_timeout_s,
            splice=config.cut_through_splice,
            keys=self.keys,
            frame_cap_setting=("limits.max_frame_size" if limits.max_frame_size <= limits.max_buffered_bytes
                               else "limits.max_buffered_bytes"),
        )
        # Which upstream cluster is active, and switching it (kproxy.server.clusters); each cluster has
        # its own connection settings and filter chain. Connections ask when they open.
        self.switch_book = SwitchBook()
        self.upstreams = UpstreamClusters(
            self.name, config.upstream, self._build_clusters(*self._filters), self.switch_book, self,
            state_path=_state_path(config), max_frame=limits.max_frame_size)
        self.settings = self.upstreams.active.connection
        self.tls_handshake_timeout_s = limits.tls_handshake_timeout_s
        if self.metrics is not None:
            self._add_metric_readers(self.metrics)
        process.add(self)

    def _build_clusters(self, builtin: list[Filter], filters: list[Filter]) -> list[Cluster]:
        """One Cluster per upstream cluster: how its connections are opened (TLS following its files,
        kproxy's own login), its filter chain (the server's filters between its own: the virtual
        cluster's id, and a replica's topic prefix on last and off first) and connection settings.
        The single-cluster form is one cluster, "default", opened as before."""
        up = self.config.upstream
        cluster_id = self.config.presented_cluster_id
        out = []
        for name in up.names:
            cfg = up.cluster(name)
            if up.several:
                tls = (_reloading(f"upstream.clusters[{name}].tls", cfg.tls,
                                  functools.partial(client_context, cfg.tls), server_side=False,
                                  expiry=self.certificates) if cfg.tls.enabled else None)
                originator = Originator(cfg.sasl) if cfg.sasl is not None else None
            else:
                tls, originator = self.upstream_tls, self.identity.originator
            # How every broker connection is opened (discovery, client connections): kproxy.server.upstream.
            settings = UpstreamSettings.from_config(cfg, tls, originator)
            prefix = up.topic_prefix(name)
            first: list[Filter] = [ClusterIdentity(cluster_id)]
            last: list[Filter] = []
            carrying: list[Filter] = []
            if up.several:
                last.append(Continuity(name, self.switch_book))
                # Joins the chain only once the virtual cluster has switched: until then Produce
                # requests meet no filter of its own and go out as they were received.
                carrying.append(ProducerCarrier(name, self.switch_book))
            outgoing: list[Filter] = []
            if prefix:
                names = ReplicaNames(prefix)
                first.insert(0, names.incoming)
                outgoing.append(names.outgoing)
            alias = next((c.alias for c in up.clusters if c.name == name), name)
            out.append(Cluster(
                name, cfg, settings, prefix, alias, tls if up.several else None,
                FilterChain([*first, *builtin, *filters, *last, *outgoing]),
                attrs.evolve(self.settings, bootstrap_servers=tuple((hp.host, hp.port) for hp in cfg.bootstrap_servers),
                             upstream=settings),
                self.topic_names.without_prefix(prefix),
                carrying_chain=FilterChain([*first, *builtin, *filters, *last, *carrying, *outgoing])))
        return out

    def switchable(self) -> dict[str, UpstreamClusters]:
        """This server's virtual cluster and its upstream clusters, for the admin listener."""
        return {self.name: self.upstreams}

    @property
    def upstream(self) -> UpstreamSettings:
        """How the active upstream cluster's broker connections are opened."""
        return self.upstreams.active.settings

    @property
    def chain(self) -> FilterChain:
        """The filters of a connection opened now (the active upstream cluster's)."""
        return self.upstreams.active.chain_now(self.switch_book.switched)

    def _upstream_tls_contexts(self) -> list[ReloadingContext]:
        clusters = [c.tls for c in self.upstreams.clusters.values() if c.tls is not None]
        return [c for c in (self.client_tls, self.upstream_tls, *clusters) if c is not None]

    async def drain_upstream(self, cluster: str, timeout: float, reason: str) -> int:
        """For a switch: drain the connections on ``cluster`` as on SIGTERM, and close what is left
        after ``timeout``; how many there were."""
        moving = [c for c in self.connections if c.cluster == cluster]
        for c in moving:
            c.drain(reason)
        with trio.move_on_after(timeout):
            # Done once each has written every answer it owed (it then closes gracefully by itself).
            while any(c in self.connections and not c.closing for c in moving):
                await trio.sleep(0.005)
        left = [c for c in moving if c in self.connections and not c.closing]
        if left:
            log.warning("%s: closing %d connections with requests still in flight after %gs", reason, len(left),
                        timeout)
            for c in left:
                c._close_from_task(f"{reason} (requests still in flight after {timeout:g}s)")
        return len(moving)

    async def retarget(self) -> None:
        """For a switch: the old cluster's broker addresses are forgotten (a port leads nowhere until
        the new cluster's broker of that node id is learned), and the new cluster's brokers learned."""
        self.address_map.forget_upstreams()
        self.discovery_ended_at = None
        await self.discover()

    # -- telemetry and the admin listener

    @property
    def metrics(self) -> Metrics | None:
        """This virtual cluster's metrics (the process's /metrics adds its ``virtual_cluster`` label)."""
        return self.telemetry.metrics

    @property
    def admin(self) -> AdminServer | None:
        """The process's admin listener, once it serves."""
        return self.process.admin

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
        if self.lane is not None:
            m.add_refresher(self.merge_lane_counts)
            lane = self.lane
            m.add_reader(lambda: metric_families.lane_families(sum(1 for c in self.connections if c.laned),
                                                               stats.lane_given_back, lane.memo_counts()))
        m.add_reader(lambda: metric_families.discovery_families(self.discovery_attempts))
        m.add_reader(lambda: metric_families.memo_families(self.answer_memo))
        keys, crypto = self.keys, self.record_crypto
        if keys is not None and crypto is not None:
            m.add_reader(lambda: metric_families.kms_families(keys.snapshot()))
            m.add_reader(lambda: metric_families.record_crypto_families(crypto.snapshot()))
        m.add_reader(lambda: metric_families.rule_families(self.rule_store))
        m.add_reader(lambda: metric_families.readiness_families(self.readiness()[0]))
        m.add_reader(lambda: metric_families.identity_edge_families(
            self._upstream_tls_contexts(), self.proxy_protocol, self.sni_names if self.sni else None))
        m.add_reader(lambda: metric_families.upstream_families(self.upstreams.snapshot()))
        if self.identity.active:
            m.add_reader(lambda: metric_families.identity_families(self.identity))
        m.add_reader(lambda: metric_families.kerberos_families(self.identity.kerberos))
        if self.coordinator is not None:
            coordinator = self.coordinator
            m.add_reader(lambda: metric_families.coordination_families(coordinator.snapshot()))
        if self.reencode is not None:
            check = self.reencode
            m.add_reader(lambda: metric_families.reencode_families(check))

    def merge_lane_counts(self) -> None:
        """What the lane relayed since the last call, into ``stats`` and the metrics (each scrape)."""
        if self.lane is not None:
            merge_counts(self.lane.counts(), self.stats, self.metrics)

    def _recall_lanes(self) -> None:
        """The rules changed: every laned connection comes back before the lane relays another
        request of it, and works out again what the lane may relay."""
        for c in self.connections:
            c.lane_recall()

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
        s = bind_listener(host, port, reuse_port=self.workers > 1)
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
        """Run the process of this virtual cluster (its admin listener included) until cancelled or
        drained; ``task_status.started()`` once the bootstrap port listens."""
        await self.process.serve(task_status=task_status)

    async def serve_cluster(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """This virtual cluster's listeners, discovery and watchers, until cancelled or drained (the
        process runs one per virtual cluster); ``task_status.started(self)`` once its bootstrap port
        listens."""
        if self.process.names_logs:
            # Every task of this virtual cluster inherits it from here (its nursery's parent task).
            VIRTUAL_CLUSTER.set(self.name)
        listen = self.config.listen
        boot = None
        if self.shared_listener is None:
            boot = self._bind(listen.host, listen.port)
            self.bootstrap_address = boot.getsockname()[:2]
            self._listeners[listen.port] = boot
        else:
            self.bootstrap_address = self.shared_listener
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await self.identity.run(nursery)
                if self.keys is not None:
                    await nursery.start(self.keys.run)
                if boot is not None:
                    nursery.start_soon(self._accept_loop, boot, None)
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
                         ", ".join(str(b) for b in self.upstreams.active.config.bootstrap_servers))
                if self.config.upstream.several:
                    log.info("virtual cluster %s: on upstream cluster %s (%s)", self.name,
                             self.upstreams.active.name, self.upstreams.started_because)
                await nursery.start(self.upstreams.run)
                tls_files = self._upstream_tls_contexts()
                if tls_files:
                    nursery.start_soon(watch_tls, tls_files, self.tls_poll_interval_s)
                if self.rule_store is not None:
                    log.info("rules in force: %s (watching %s)", describe_rules(self.rule_store.rule_set),
                             ", ".join(self.rule_store.paths))
                    nursery.start_soon(watch_rules, self.rule_store, self.rules_poll_interval_s,
                                       self.reload_rules_checked)
                if self.coordinator is not None:
                    # Background only: the data path reads each budget's share, never waits on this.
                    nursery.start_soon(self.coordinator.run)
                    nursery.start_soon(self.coordinator.watch)
                task_status.started(self)
        finally:
            for s in self._listeners.values():
                s.close()
            if self.lane is not None:
                # Every connection has ended (and given the lane's sockets back): its thread stops.
                self.merge_lane_counts()
                self.lane.close()
                self.budget.detach_lane(self.lane)
            if self.keys is not None:
                with trio.CancelScope(shield=True):
                    await self.keys.kms.aclose()

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

            def handle(conn: trio.socket.SocketType, addr: Any, raw: socket.socket) -> None:
                assert self._nursery is not None
                self._nursery.start_soon(self._handle, conn, addr, port, raw)

            await accept_loop(listener, str(port or self.config.listen.port), handle, lambda: self.draining)

    def hand_over(self, sock: trio.socket.SocketType, addr: Any, raw: socket.socket, admitted: Admission) -> None:
        """Serve a connection the process accepted on a port this virtual cluster shares, whose
        ClientHello names it; ``admitted`` is what the PROXY header (if any) said."""
        if self._nursery is None or self.draining:
            sock.close()
            return
        self._nursery.start_soon(self._handle, sock, addr, None, raw, admitted)

    async def _handle(self, sock: trio.socket.SocketType, addr: Any, port: int | None,
                      raw: socket.socket, admitted: Admission | None = None) -> None:
        tune(sock)
        cid = next(self._ids)
        peer = (addr[0], addr[1])
        via = ""
        if admitted is not None:
            # Read by the process before it saw the ClientHello of a port several virtual clusters share.
            if admitted.via is not None:
                via = f" via {_hostport(*admitted.via)}"
            peer = admitted.client
        elif self.proxy_protocol is not None:
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
            refused = REFUSED_SNI_NAME.get()
            if refused is not None:
                # The one line that says why (the handshake's own error would only say "unrecognized name").
                log.warning("connection %d from %s%s on %s: no broker of this listener has the TLS host name "
                            "%r (it serves %s); closed", cid, _hostport(*peer), via, self.sni_names.listener,
                            safe(refused), ", ".join(self.sni_names.patterns()))
                return
            log.info("connection %d from %s%s: TLS handshake failed: %s", cid, _hostport(*peer), via,
                     "timed out (limits.tls_handshake_timeout_s)" if isinstance(e, trio.TooSlowError)
                     else safe(str(e)))
            return
        if port is not None:
            route = self.address_map.route_for_port(port) or await self._route_after_discovery(port=port)
        if route is not None:
            ctx.listener = f"{route.role}-{route.node_id}"
        # The upstream cluster it uses for its life; while a switch is under way this waits (new
        # requests are held), and nothing below waits before the connection is in self.connections.
        cluster = await self.upstreams.current()
        chain = cluster.chain_now(self.switch_book.switched)
        front = self.identity.front(ctx)
        # Telemetry reads every exchange decoded (None), those of a few apis (metrics alone), or none;
        # and, when the traffic log or spans sample, the exchanges their draw takes as each arrives.
        reads = self.telemetry.decoded_apis() if self.telemetry.active else frozenset()
        session = Session(ctx, chain, passthrough_unknown_versions=self.config.passthrough_unknown_versions,
                          reencode=self.reencode, topic_names=cluster.topic_names, front=front,
                          stream_min_bytes=self._cut_through_min_bytes(), memo=self.answer_memo,
                          read_answers=reads is None,
                          telemetry_reads=reads if reads or self.telemetry.metrics is not None else None,
                          sample=self.telemetry.sampler() if self.telemetry.active else None)
        prepare = (functools.partial(self.identity.prepare, front, discover=self.discover)
                   if front is not None and front.termination is not None else None)
        record = self.clients.opened(ctx)
        complete = functools.partial(self._completed_with_telemetry if self.telemetry.active
                                     else self._completed, ctx, record)
        conn = ClientConnection(cluster.connection, self, transport, session, on_complete=complete,
                                budget=self.budget, route_key=(port, name), stats=self.stats, prepare=prepare,
                                cluster=cluster.name, lane=self.lane, record=record)
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

    async def check_keks(self) -> None:
        """At start: every KEK the encrypt rules name must exist in the KMS (ConfigError if not);
        a KMS that cannot be reached now is a warning (records wait for it, retriably)."""
        assert self.keys is not None
        if self.rule_store is None:
            return
        errors, warnings = await kek_problems(self.keys, self.rule_store.rule_set)
        for w in warnings:
            log.warning("kms: %s", w)
        if errors:
            raise errors[0]

    async def reload_rules_checked(self, reason: str) -> bool:
        """Reload the rule files; with a KMS, the new set goes in force only if every KEK its
        encrypt rules name exists (a failed reload keeps the old set)."""
        store = self.rule_store
        if store is None or self.keys is None:
            return self.reload_rules(reason)
        rule_set = store.load(reason)
        if rule_set is None:
            return False
        errors, warnings = await kek_problems(self.keys, rule_set)
        for w in warnings:
            log.warning("kms: %s", w)
        if errors:
            store.refuse(reason, "\n".join(str(e) for e in errors))
            return False
        store.install(rule_set, reason)
        return True

    def reload_settings(self, reason: str) -> bool:
        """Read the config file again (SIGHUP): the process's (``ProxyProcess.reload_settings``)."""
        return self.process.reload_settings(reason)

    def reload_rules(self, reason: str) -> bool:
        """Load the rule files again (SIGHUP); the old rules stay if the new ones do not load."""
        if self.rule_store is None:
            log.info("%s: nothing to reload (no rule files are configured)", reason)
            return False
        return self.rule_store.reload(reason)

    async def reload_upstream(self) -> None:
        """Read the state file again (SIGHUP): follow a switch another process recorded."""
        if self.upstreams.state_file is not None:
            await self.upstreams.follow_state()

    def reload_tls(self) -> None:
        """Look at the TLS files now (SIGHUP) instead of at the next poll; unchanged files stay loaded."""
        for ctx in self._upstream_tls_contexts():
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
        cfg = self.upstreams.active.config
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

    async def drain(self, timeout: float | None = None, *, stop: bool = True) -> None:
        """Stop accepting, answer what is in flight (up to ``timeout``), close each connection as soon
        as it owes nothing, then stop the process (unless not ``stop``: the process drains all its
        virtual clusters this way, then stops)."""
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
        if stop:
            self.process.stop()


# The signals kproxy handles. A supervisor starts its workers with them blocked (Worker.start), and
# serve_until_signal unblocks them once it listens for them.
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# Set by the supervisor in each worker's environment: its own pid (``_supervisor_pid``).
SUPERVISOR_ENV = "KPROXY_SUPERVISOR"


class Serving(Protocol):
    """What ``serve_until_signal`` runs: a ProxyProcess (or one of its ProxyServers, which serves the whole process)."""

    worker: tuple[int, int] | None

    @property
    def draining(self) -> bool: ...

    async def serve(self, *, task_status: Any = ...) -> None: ...

    async def drain(self, timeout: float | None = None) -> None: ...

    def reload_settings(self, reason: str) -> bool: ...

    def reload_rules(self, reason: str) -> bool: ...

    async def reload_rules_checked(self, reason: str) -> bool: ...

    def reload_tls(self) -> None: ...

    async def reload_upstream(self) -> None: ...


async def serve_until_signal(server: Serving) -> None:
    """Serve; SIGTERM or SIGINT drains, a second one stops at once; SIGHUP reads the config file's
    sample ratios again, reloads the rule files and any changed TLS files, and follows a switch the
    state file records."""
    # Signals are kproxy's before the first port is bound: /readyz says ready as soon as a bootstrap
    # server answers, while discovery may still wait for Metadata, and a SIGTERM then (a supervisor's,
    # a kubelet's) would otherwise end the process at once without a drain or a last log line. One
    # that arrives during start-up waits here until the server has started, then drains it.
    with trio.open_signal_receiver(*SIGNALS) as signals:
        # A worker's signals were held (blocked) since its supervisor started it, so one passed on
        # while it was still importing and reading its settings waited: it is delivered from here.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            if server.worker is not None:
                nursery.start_soon(_drain_when_orphaned, server, nursery.cancel_scope, _supervisor_pid())
            log.info("signals: SIGTERM or SIGINT drains, SIGHUP reloads the rule files and sample ratios")
            async for signum in signals:
                name = signal.Signals(signum).name
                if signum == signal.SIGHUP:
                    server.reload_settings("SIGHUP")
                    await server.reload_rules_checked("SIGHUP")
                    server.reload_tls()
                    # A switch another process made since is followed now (the state file says so).
                    nursery.start_soon(server.reload_upstream)
                    continue
                if server.draining:
                    log.info("%s again: stopping now", name)
                    break
                log.info("%s: draining (send it again to stop at once)", name)
                nursery.start_soon(_drain_then_stop, server, nursery.cancel_scope)
            nursery.cancel_scope.cancel()
    log.info("kproxy stopped")


def _supervisor_pid() -> int:
    """The pid of the supervisor that started this worker, as it wrote it in the environment
    (``SUPERVISOR_ENV``); the parent now, from a supervisor that did not. Asking the parent alone
    would miss a supervisor killed while the worker was still starting: its parent is then already
    another process, and it would hold the ports for ever."""
    value = os.environ.get(SUPERVISOR_ENV, "")
    return int(value) if value.isdigit() else os.getppid()


async def _drain_when_orphaned(server: Serving, scope: trio.CancelScope, parent: int) -> None:
    # A worker whose supervisor is gone (killed outright) would hold the ports forever: drain and stop.
    while os.getppid() == parent:
        await trio.sleep(1.0)
    if not server.draining:
        log.warning("the supervisor (pid %d) is gone: draining and stopping this worker", parent)
        await _drain_then_stop(server, scope)


async def _drain_then_stop(server: Serving, scope: trio.CancelScope) -> None:
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


def _state_path(config: ProxyConfig) -> str:
    """upstream.state_file, else kproxy-state.json beside the configuration file (or in the cwd).
    Every virtual cluster of a file has its own entry in it."""
    given = config.upstream.state_file
    if given is not None:
        return given
    return os.path.join(os.path.dirname(config.source) if config.source else ".", "kproxy-state.json")


def bind_listener(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A non-blocking listening socket on ``host:port``; ``reuse_port`` when every worker process
    listens on the same ports (the kernel spreads new connections). ListenError names the address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind((host, port))
        s.listen(1024)
    except OSError as e:
        s.close()
        raise ListenError(f"cannot listen on {_hostport(host, port)}: {e.strerror or e}") from e
    s.setblocking(False)
    return s


async def accept_loop(listener: socket.socket, where: str,
                      handle: Callable[[trio.socket.SocketType, Any, socket.socket], None],
                      draining: Callable[[], bool]) -> None:
    """Accept connections on ``listener`` until cancelled, giving each to ``handle`` (which starts
    its task); ``where`` names the port in log lines. Out of descriptors or memory, it waits and
    tries again; a connection that failed before it was accepted is skipped."""
    while True:
        try:
            # Accepted as a stdlib socket, which kproxy then owns by a public name (the transport
            # peeks at it to tell an idle connection from a busy one).
            await trio.lowlevel.wait_readable(listener)
            try:
                raw, addr = listener.accept()
            except BlockingIOError:
                continue
            raw.setblocking(False)
            conn = trio.socket.from_stdlib_socket(raw)
        except OSError as e:
            if e.errno in _CAPACITY_ERRNOS:
                log.warning("accept on port %s failed: %s; retrying in 100 ms", where, e.strerror or e)
                await trio.sleep(0.1)
                continue
            if e.errno in _PEER_ERRNOS:
                continue    # that one connection failed before it was accepted; not the listener
            if draining():
                return
            raise
        handle(conn, addr, raw)


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen_error(e: BaseException) -> ListenError | ConfigError | None:
    """The ListenError (a port) or ConfigError (a KEK the KMS does not have) that ended the server
    at start, through trio's nursery exception groups; else None."""
    while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
        e = e.exceptions[0]
    return e if isinstance(e, (ListenError, ConfigError)) else None

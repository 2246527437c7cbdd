"""The kproxy process: one ``ProxyServer`` per virtual cluster, and what they share.

``ProxyProcess`` owns the admin listener (its view of every virtual cluster: /metrics with the
``virtual_cluster`` label, /readyz for each, /config, /rules, /clients), the ports several SNI
virtual clusters share (``SharedSniPort``: the ClientHello's host name picks the virtual cluster),
the drain of all of them, and ``SharedParts``: the telemetry outputs, the buffer budget, certificate
expiry, connection ids and the event loop's lag. A virtual cluster's server knows nothing of the
others: its address map, ports, node ids, SNI names, identity, rules, quotas, topic names and
remembered answers are its own.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import socket
from collections.abc import Callable, Sequence
from typing import Any

import trio

from kproxy.config import ConfigError, HostPort, ProxyConfig, effective_buffer_budget, load_config
from kproxy.config.changes import changed_settings
from kproxy.identity.client_hello import MAX_HELLO_BYTES, NeedMore, NotClientHello, Result, read_server_name
from kproxy.logs import safe
from kproxy.proxy.filters import Filter
from kproxy.server import admin
from kproxy.server.app import ListenError, ProxyServer, _hostport, accept_loop, bind_listener
from kproxy.server.budget import BufferBudget
from kproxy.server.certificates import CERTIFICATES, CertificateExpiry
from kproxy.server.clients import MAX_LISTED
from kproxy.server.proxy_protocol import Admission
from kproxy.server.transport import tune
from kproxy.telemetry import metrics as metric_families
from kproxy.telemetry.metrics import Histogram, ProcessMetrics
from kproxy.telemetry.outputs import TelemetryOutputs
from kproxy.telemetry.spans import SpanExporter

log = logging.getLogger("kproxy.server")

# The loop-lag timer (SharedParts.watch_loop_lag): every 5 ms while the loop is being held (a sample 5 ms
# late or more in the last second), every 100 ms otherwise. A hold longer than the period is always
# seen; a shorter one on a quiet loop is seen in proportion to its length, and the holds after it finely.
LAG_PERIOD_S = 0.005
LAG_QUIET_PERIOD_S = 0.1
LAG_HELD_S = 0.005
LAG_FINE_FOR_S = 1.0


class SharedParts:
    """What the virtual clusters of one process share: the telemetry outputs (metrics, traffic log,
    spans), the buffer budget (``limits.max_buffered_bytes_total``, divided among the workers),
    certificate expiry, connection ids, and the event loop's lag."""

    def __init__(self, config: ProxyConfig, *, span_exporter: SpanExporter | None = None, workers: int = 1,
                 certificates: CertificateExpiry | None = None) -> None:
        self.telemetry = TelemetryOutputs(config, span_exporter=span_exporter)
        self.budget = BufferBudget(effective_buffer_budget(config) // workers)
        self.certificates = certificates if certificates is not None else CERTIFICATES
        self.connection_ids = itertools.count(1)
        # How late the event loop runs a timer (see watch_loop_lag).
        self.loop_lag = Histogram()
        self.loop_lag_max = 0.0
        # Connections closed on a shared port before any virtual cluster took them: (listener, reason).
        self.refused: dict[tuple[str, str], int] = {}
        # Re-reads of the config file (SIGHUP) by outcome, and the changed settings that wait for a restart.
        self.settings_reloads = {"ok": 0, "failed": 0}
        self.settings_pending: list[str] = []
        m = self.telemetry.metrics
        if m is not None:
            m.add_reader(lambda: metric_families.loop_lag_families(self.loop_lag, self.loop_lag_max))
            m.add_reader(lambda: metric_families.budget_families(self.budget))
            m.add_reader(self.certificates.families)
            m.add_reader(lambda: metric_families.shared_port_families(self.refused))
            m.add_reader(lambda: metric_families.settings_families(self.settings_reloads, self.settings_pending))

    async def watch_loop_lag(self, period: float = LAG_PERIOD_S, quiet_period: float = LAG_QUIET_PERIOD_S) -> None:
        """A timer whose lateness measures how long other work held the event loop (a big frame, a
        slow filter): every other connection waited that long. It fires every ``period`` for a second
        after a sample late by ``LAG_HELD_S`` or more (the loop is being held: sample it finely), and
        every ``quiet_period`` otherwise, so that a quiet loop is woken 10 times a second, not 200 (each
        wake-up costs about a third of a small request's instructions)."""
        fine_until = 0.0
        while True:
            now = trio.current_time()
            due = now + (period if now < fine_until else quiet_period)
            await trio.sleep_until(due)
            now = trio.current_time()
            lag = max(0.0, now - due)
            self.loop_lag.observe(lag)
            if lag > self.loop_lag_max:
                self.loop_lag_max = lag
            if lag >= LAG_HELD_S:
                fine_until = now + LAG_FINE_FOR_S


class ProxyProcess:
    """kproxy in front of one or more Kafka clusters: a ProxyServer per virtual cluster, the admin
    listener over all of them (a switch is routed to the virtual cluster it names), and their drain. Build it with ``from_config``; the switch and any
    other per-cluster admin action find a virtual cluster with ``cluster(name)``."""

    def __init__(self, config: ProxyConfig, shared: SharedParts, *, worker: tuple[int, int] | None = None,
                 admin_listen: HostPort | None = None) -> None:
        self.config = config                        # the root: process-wide settings, every virtual cluster
        self.shared = shared
        self.worker = worker
        self.admin_listen = admin_listen or config.admin.listen
        self.servers: dict[str, ProxyServer] = {}   # by virtual cluster name, in the file's order
        self.admin: admin.AdminServer | None = None
        self.shared_ports: list[SharedSniPort] = []
        self._nursery: trio.Nursery | None = None
        self._draining = False
        # How a SIGHUP reads the settings again (``kproxy run`` sets it to read them as it did at
        # start, its command-line options included); None: the file the config came from.
        self.read_config: Callable[[], ProxyConfig] | None = None

    @classmethod
    def from_config(cls, config: ProxyConfig, filters: Sequence[Filter] = (), *,
                    span_exporter: SpanExporter | None = None, worker: tuple[int, int] | None = None,
                    admin_listen: HostPort | None = None,
                    certificates: CertificateExpiry | None = None) -> ProxyProcess:
        """The process for ``config``: one ProxyServer per virtual cluster (``config.clusters``), each
        with ``filters`` after its own. Raises ConfigError as ProxyServer does."""
        workers = worker[1] if worker is not None else 1
        shared = SharedParts(config, span_exporter=span_exporter, workers=workers, certificates=certificates)
        process = cls(config, shared, worker=worker, admin_listen=admin_listen)
        for vc in config.clusters:
            ProxyServer(vc, filters, worker=worker, process=process)
        by_address: dict[HostPort, list[ProxyServer]] = {}
        for server in process.servers.values():
            if server.sni:
                by_address.setdefault(server.config.listen, []).append(server)
        for address, servers in by_address.items():
            if len(servers) > 1:
                # The configuration allows only SNI virtual clusters with distinct domains here.
                process.shared_ports.append(SharedSniPort(address, servers, shared, reuse_port=workers > 1))
        return process

    def add(self, server: ProxyServer) -> None:
        """A virtual cluster of this process (ProxyServer registers itself)."""
        if server.name in self.servers:
            raise ValueError(f"two virtual clusters named {server.name!r}")
        self.servers[server.name] = server

    def cluster(self, name: str | None = None) -> ProxyServer:
        """The virtual cluster ``name``; None: the only one. LookupError says which names there are."""
        if name is None:
            if len(self.servers) == 1:
                return next(iter(self.servers.values()))
            raise LookupError(f"name a virtual cluster: this process serves {', '.join(self.servers)}")
        server = self.servers.get(name)
        if server is None:
            raise LookupError(f"no virtual cluster named {name!r}; this process serves {', '.join(self.servers)}")
        return server

    @property
    def names_logs(self) -> bool:
        """Whether log lines name their virtual cluster (only when there are several)."""
        return len(self.servers) > 1

    # -- what the admin listener reads (admin.AdminView)

    @property
    def metrics(self) -> ProcessMetrics | None:
        return self.shared.telemetry.metrics

    @property
    def draining(self) -> bool:
        return self._draining or all(s.draining for s in self.servers.values())

    def readiness(self) -> tuple[bool, str]:
        """(ready, why): ready when every virtual cluster is; with several, the reason names each."""
        states = [(name, *server.readiness()) for name, server in self.servers.items()]
        if len(states) == 1:
            return states[0][1], states[0][2]
        waiting = [f"{name} ({why.removeprefix('not ready: ')})" for name, ok, why in states if not ok]
        ready = [name for name, ok, _ in states if ok]
        if not waiting:
            return True, f"ready: {', '.join(ready)}"
        return False, f"not ready: {'; '.join(waiting)}" + (f"; ready: {', '.join(ready)}" if ready else "")

    def rules(self) -> dict[str, Any]:
        """/rules: the rules in force, per virtual cluster when there are several."""
        views = {name: admin.rules_view(server.rule_store) for name, server in self.servers.items()}
        if len(views) == 1:
            return next(iter(views.values()))
        return {"virtual_clusters": views}

    def clients_view(self, limit: int = MAX_LISTED) -> dict[str, Any]:
        """/clients: every virtual cluster's connections, each row naming its virtual cluster."""
        views = [(name, server.clients.view(limit)) for name, server in self.servers.items()]
        live: list[dict[str, Any]] = []
        recent: list[dict[str, Any]] = []
        omitted = 0
        for name, view in views:
            live += [{**row, "virtual_cluster": name} for row in view["connections"]]
            recent += [{**row, "virtual_cluster": name} for row in view["recent"]]
            omitted += view["omitted"]
        live.sort(key=lambda r: r["request_bytes"] + r["response_bytes"], reverse=True)
        recent.sort(key=lambda r: r["closed_at"] or 0, reverse=True)
        omitted += max(0, len(live) - limit) + max(0, len(recent) - limit)
        return {"time": max(v["time"] for _, v in views), "live": sum(v["live"] for _, v in views),
                "connections": live[:limit], "recent": recent[:limit], "omitted": omitted}

    # -- running

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Run every virtual cluster until cancelled or drained; ``task_status.started(self)`` once
        every bootstrap port listens. A port that cannot be bound is a ListenError, before any
        virtual cluster serves."""
        try:
            for server in self.servers.values():
                if server.keys is not None:
                    await server.check_keks()   # before anything binds: a KEK that does not exist is fatal
        except BaseException:
            # No virtual cluster serves, so none closes its KMS client (and its connections) itself.
            for server in self.servers.values():
                if server.keys is not None:
                    with trio.CancelScope(shield=True):
                        await server.keys.kms.aclose()
            raise
        admin_listener = None
        if self.admin_listen is not None:
            try:
                admin_listener = admin.bind(self.admin_listen)
            except admin.AdminListenError as e:
                raise ListenError(str(e)) from e
        telemetry = self.shared.telemetry
        try:
            for port in self.shared_ports:
                port.bind()
            telemetry.start(trio.current_time())
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                if admin_listener is not None:
                    self.admin = admin.AdminServer(self, admin_listener)
                    nursery.start_soon(self.admin.serve)
                    log.info("admin listener on %s: /metrics /livez /readyz /config /rules /clients /upstream, POST /switch",
                             _hostport(*self.admin.address))
                if self.metrics is not None:
                    nursery.start_soon(self.shared.watch_loop_lag)
                # A drained virtual cluster's tasks end by themselves; the process ends at stop() (the
                # drain's last step) or when cancelled, so the admin listener answers to the end.
                for server in self.servers.values():
                    await nursery.start(server.serve_cluster)
                for port in self.shared_ports:
                    nursery.start_soon(port.serve)
                task_status.started(self)
        finally:
            for port in self.shared_ports:
                port.close()
            if admin_listener is not None:
                admin_listener.socket.close()
            telemetry.close()

    async def drain(self, timeout: float | None = None) -> None:
        """Drain every virtual cluster at once (as on SIGTERM): stop accepting, answer what is in
        flight (up to ``timeout``), then stop."""
        self._draining = True
        for port in self.shared_ports:
            port.close()
        async with trio.open_nursery() as nursery:
            for server in self.servers.values():
                nursery.start_soon(functools.partial(server.drain, timeout, stop=False))
        self.stop()

    def stop(self) -> None:
        """End ``serve`` now: every virtual cluster, its listeners and connections, the admin listener."""
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    def reload_rules(self, reason: str) -> bool:
        """Load every virtual cluster's rule files again (SIGHUP); True when any loaded."""
        return any([server.reload_rules(reason) for server in self.servers.values()])

    async def reload_rules_checked(self, reason: str) -> bool:
        """Load every virtual cluster's rule files again (SIGHUP), each new set in force only if the
        KEKs its encrypt rules name exist in that virtual cluster's KMS; True when any went in force."""
        return any([await server.reload_rules_checked(reason) for server in self.servers.values()])

    def reload_settings(self, reason: str) -> bool:
        """Read the config file again (SIGHUP) and put its traffic log and tracing sample ratios in
        force; every other changed setting is named in a warning and waits for a restart. A file that
        does not load is refused with its file, line and reason, and the settings in force stay. True
        when it loaded."""
        shared = self.shared
        if self.read_config is None and self.config.source is None:
            log.info("%s: the settings came from the command line; there is no file to read again", reason)
            return False
        try:
            new = self.read_config() if self.read_config is not None else load_config(str(self.config.source))
        except ConfigError as e:
            shared.settings_reloads["failed"] += 1
            log.error("%s: settings reload refused; the settings in force stay: %s", reason, e)
            return False
        shared.settings_reloads["ok"] += 1
        changed = shared.telemetry.set_sampling(new)
        for change in changed:
            log.info("%s: %s (in force from the next request)", reason, change)
        pending = changed_settings(self.config, new)
        shared.settings_pending = pending
        if pending:
            log.warning("%s: the config file changes %s; %s take%s effect only at a restart (kproxy keeps "
                        "the values it started with)", reason, ", ".join(pending),
                        "these" if len(pending) > 1 else "it", "" if len(pending) > 1 else "s")
        elif not changed:
            log.info("%s: the config file's settings are the ones in force", reason)
        return True

    def reload_tls(self) -> None:
        for server in self.servers.values():
            server.reload_tls()

    async def reload_upstream(self) -> None:
        """Follow a switch another process recorded in the state file (SIGHUP), for every virtual
        cluster with upstream.clusters."""
        for server in self.servers.values():
            await server.reload_upstream()

    def switchable(self) -> dict[str, Any]:
        """/upstream and POST /switch: every virtual cluster's UpstreamClusters, by name."""
        return {name: server.upstreams for name, server in self.servers.items()}


class SharedSniPort:
    """A listen address several SNI virtual clusters share: the host name of each connection's
    ClientHello (peeked, never consumed) picks the one virtual cluster that serves it, which then does
    the TLS handshake with its own certificates as on a port of its own. A name no virtual cluster
    serves, a ClientHello without one, or bytes that are not TLS close the connection with one log
    line naming the host, the listener and the names that were tried."""

    def __init__(self, address: HostPort, servers: Sequence[ProxyServer], shared: SharedParts,
                 reuse_port: bool = False) -> None:
        self.address = address
        self.servers = list(servers)
        self.shared = shared
        self.reuse_port = reuse_port
        self.where = str(address)
        first = self.servers[0]
        # The configuration holds every virtual cluster on the port to the same proxy_protocol and
        # limits, so the first one's gate and handshake timeout serve for all.
        self.proxy_protocol = first.proxy_protocol
        self.timeout_s = first.tls_handshake_timeout_s
        self._raw: socket.socket | None = None
        self._scope: trio.CancelScope | None = None
        self._closing = False

    def bind(self) -> None:
        self._raw = bind_listener(self.address.host, self.address.port, reuse_port=self.reuse_port)
        bound = self._raw.getsockname()[:2]
        for server in self.servers:
            server.shared_listener = (bound[0], bound[1])

    def close(self) -> None:
        """Stop accepting (drain) and close the listening socket."""
        self._closing = True
        if self._scope is not None:
            self._scope.cancel()
        raw, self._raw = self._raw, None
        if raw is not None:
            trio.lowlevel.notify_closing(raw)
            raw.close()

    async def serve(self) -> None:
        raw = self._raw
        assert raw is not None
        log.info("port %s is shared by virtual clusters %s, chosen by the TLS host name (SNI)", self.where,
                 ", ".join(s.name for s in self.servers))
        async with trio.open_nursery() as nursery:

            def handle(conn: trio.socket.SocketType, addr: Any, raw: socket.socket) -> None:
                nursery.start_soon(self._route, conn, addr, raw)

            with trio.CancelScope() as self._scope:
                if not self._closing:
                    await accept_loop(raw, self.where, handle, lambda: self._closing)

    def server_for(self, name: str) -> ProxyServer | None:
        for server in self.servers:
            if server.sni_names.serves(name):
                return server
        return None

    def tried(self) -> str:
        return "; ".join(f"{s.name}: {', '.join(s.sni_names.patterns())}" for s in self.servers)

    async def _route(self, sock: trio.socket.SocketType, addr: Any, raw: socket.socket) -> None:
        tune(sock)
        peer = (addr[0], addr[1])
        admitted = Admission(peer)
        if self.proxy_protocol is not None:
            admitted = await self.proxy_protocol.admit(raw, peer)
            if admitted.refused is not None:
                sock.close()
                log.log(logging.DEBUG if admitted.kind == "closed" else logging.WARNING,
                        "connection from %s on %s refused: %s", _hostport(*peer), self.where, safe(admitted.refused))
                return
        client = _hostport(*admitted.client)
        verdict: Result | None = None
        with trio.move_on_after(self.timeout_s):
            verdict = await peek_client_hello(raw)
        if isinstance(verdict, NotClientHello) or verdict is None:
            reason = "timeout" if verdict is None else "not_tls"
            why = ("no whole ClientHello within limits.tls_handshake_timeout_s" if verdict is None
                   else f"not a TLS ClientHello ({verdict.reason})")
            self._refuse(sock, reason, f"connection from {client} on {self.where}: {why}; this port serves TLS "
                                       f"only, for virtual clusters {', '.join(s.name for s in self.servers)}")
            return
        assert not isinstance(verdict, NeedMore)
        if verdict.name is None:
            self._refuse(sock, "no_name", f"connection from {client} on {self.where}: the ClientHello names no host "
                                          f"(SNI), which picks the virtual cluster on this port (tried {self.tried()})")
            return
        server = self.server_for(verdict.name)
        if server is None:
            self._refuse(sock, "unknown_name", f"connection from {client} on {self.where}: no virtual cluster serves "
                                               f"the TLS host name {safe(verdict.name)!r} (tried {self.tried()})")
            return
        server.hand_over(sock, addr, raw, admitted)

    def _refuse(self, sock: trio.socket.SocketType, reason: str, line: str) -> None:
        sock.close()
        key = (self.where, reason)
        self.shared.refused[key] = self.shared.refused.get(key, 0) + 1
        log.warning("%s; closed", line)


async def peek_client_hello(raw: socket.socket) -> Result:
    """The verdict on the ClientHello at the start of ``raw``'s stream, read without taking a byte:
    the TLS handshake that follows reads the same bytes. Waits (SO_RCVLOWAT) until as many bytes as
    the parser asks for have arrived, so a ClientHello that arrives in pieces costs no busy loop."""
    want = 5
    try:
        while True:
            # Without it, readiness means one byte, and a short peek waits a little below.
            with contextlib.suppress(OSError):
                raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
            await trio.lowlevel.wait_readable(raw)
            try:
                data = raw.recv(want, socket.MSG_PEEK)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError as e:
                return NotClientHello(f"connection lost: {e.strerror or e}")
            if not data:
                return NotClientHello("closed before a ClientHello")
            verdict = read_server_name(data)
            if isinstance(verdict, NeedMore):
                if len(data) < want:
                    # The peer closed part-way, or the low-water mark was not honoured: look again soon.
                    await trio.sleep(0.01)
                want = min(verdict.up_to, MAX_HELLO_BYTES)
                continue
            return verdict
    finally:
        with contextlib.suppress(OSError):
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)


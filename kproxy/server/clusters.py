"""Which upstream cluster a virtual cluster runs on, and moving it to another (``upstream.clusters``).

``UpstreamClusters`` is the one owner of that state, per virtual cluster. A client connection asks it
which cluster to use when it opens (``current``: it waits while a switch is under way, which is how
new requests are held) and keeps that cluster for its life. A switch (``switch``: planned through the
admin listener, or failover when the active cluster stops answering) goes:

1. hold: new connections wait;
2. drain the old cluster's connections as on SIGTERM: what is in flight is answered, nothing new is
   read, then each closes (past ``switch.drain_s`` the rest are closed);
3. a planned switch waits, up to ``switch.catch_up_s``, until the replica holds every offset the
   old cluster acknowledged through this process (MM2's offset syncs map the offsets);
4. with ``offset_translation: mm2``, the groups' offsets are translated and committed on the new
   cluster (``kproxy.replication.mm2.plan_group``);
5. the new cluster becomes active, the state file is written (atomically), the old brokers'
   addresses are forgotten and the new cluster's learned; then the held connections go on.

Clients reconnect to the same kproxy addresses, refresh metadata and carry on; producers another
cluster issued are carried (``kproxy.proxy.continuity``). Worker processes share the state file:
each follows a switch another made (``epoch``), and each runs the same failover probes.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import attrs
import trio

from kproxy.config import UpstreamConfig
from kproxy.logs import safe
from kproxy.protocol.errors import KProxyError
from kproxy.protocol.messages import Request, body_class
from kproxy.proxy.continuity import SwitchBook
from kproxy.proxy.filters import FilterChain
from kproxy.proxy.topics import TopicNames
from kproxy.replication.mm2 import OffsetSyncs, checkpoints_topic, offset_syncs_topic, plan_group
from kproxy.replication.state import StateError, VirtualClusterState, choose_active, parse_state, render_state
from kproxy.server.origination import direct_roundtrip
from kproxy.server.replicas import ClusterClient, ReplicaError, decode_syncs, latest_checkpoints
from kproxy.server.tls_files import ReloadingContext
from kproxy.server.upstream import UpstreamSettings, login_failed, open_upstream

log = logging.getLogger("kproxy.switch")

STATE_POLL_S = 1.0            # how often a process looks at the state file for another's switch
TRANSLATE_BUDGET_S = 10.0     # the most a switch spends translating and committing group offsets
RETARGET_BUDGET_S = 5.0       # the most it spends learning the new cluster's brokers
SYNC_TAIL_WAIT_MS = 500       # a tail of MM2's offset syncs waits this long for new ones


class SwitchError(KProxyError):
    """A switch that cannot be made (an unknown cluster, a target that does not answer)."""


@attrs.define(eq=False)
class Cluster:
    """One upstream cluster of a virtual cluster, with what the server built for it."""

    name: str
    config: UpstreamConfig                  # its settings as a single-cluster upstream
    settings: UpstreamSettings              # how its broker connections are opened
    topic_prefix: str | None = None
    alias: str = ""                         # MirrorMaker 2's name for it
    tls: ReloadingContext | None = None
    chain: FilterChain | None = None        # the filters of its connections (the server's, plus its own)
    connection: Any = None                  # its ConnectionSettings
    topic_names: TopicNames | None = None   # the process's table, as this cluster teaches it
    reachable: bool | None = None           # the last probe's answer (None: not probed yet)
    unreachable_since: float | None = None  # since when no probe has had an answer
    probe_error: str | None = None
    # The chain once the virtual cluster has switched: with the filter that carries producers.
    carrying_chain: FilterChain | None = None

    def chain_now(self, switched: bool) -> FilterChain:
        """The filters of a connection opening now."""
        chain = self.carrying_chain if switched and self.carrying_chain is not None else self.chain
        assert chain is not None
        return chain

    @property
    def bootstrap(self) -> tuple[tuple[str, int], ...]:
        return tuple((hp.host, hp.port) for hp in self.config.bootstrap_servers)

    @property
    def prefix(self) -> str:
        return self.topic_prefix or ""


class SwitchTarget(Protocol):
    """What a switch asks of the server whose virtual cluster it moves."""

    async def drain_upstream(self, cluster: str, timeout: float, reason: str) -> int:
        """Drain the connections on ``cluster`` (answer what is in flight, then close), closing those
        left after ``timeout``; how many there were."""

    async def retarget(self) -> None:
        """Forget the old cluster's broker addresses and learn the active cluster's."""


@attrs.define
class SwitchReport:
    """What one switch did, for the admin answer, the log and the tests."""

    virtual_cluster: str
    from_cluster: str
    to_cluster: str
    reason: str
    epoch: int = 0
    took_s: float = 0.0
    drained: int = 0
    # Per partition the old cluster acknowledged: (replica end wanted, replica end seen).
    catch_up: dict[str, tuple[int, int | None]] = attrs.field(factory=dict)
    caught_up: bool | None = None
    # group -> "topic[partition]" -> (offset committed on the new cluster, what said so)
    offsets: dict[str, dict[str, tuple[int, str]]] = attrs.field(factory=dict)
    problems: list[str] = attrs.field(factory=list)
    changed: bool = True

    def to_json(self) -> dict[str, Any]:
        return {"virtual_cluster": self.virtual_cluster, "from": self.from_cluster, "to": self.to_cluster,
                "reason": self.reason, "epoch": self.epoch, "took_s": round(self.took_s, 3),
                "drained_connections": self.drained, "caught_up": self.caught_up,
                "catch_up": {k: {"wanted": w, "seen": s} for k, (w, s) in self.catch_up.items()},
                "offsets": {g: {k: {"offset": o, "source": src} for k, (o, src) in parts.items()}
                            for g, parts in self.offsets.items()},
                "problems": self.problems, "changed": self.changed}


class StateFile:
    """The state file at one path, shared by every virtual cluster of the process: read whole,
    changed for one virtual cluster, written whole again through a temporary file and a rename, so a
    reader never sees half of it."""

    _open: dict[str, StateFile] = {}

    @classmethod
    def at(cls, path: str) -> StateFile:
        got = cls._open.get(path)
        if got is None:
            got = cls._open[path] = cls(path)
        return got

    def __init__(self, path: str) -> None:
        self.path = path
        self.error: str | None = None       # why the last read or write failed
        self.writes = 0

    def read(self) -> dict[str, VirtualClusterState]:
        try:
            with open(self.path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            return {}
        except OSError as e:
            self.error = f"cannot read {self.path}: {e.strerror or e}"
            return {}
        try:
            return parse_state(text)
        except StateError as e:
            self.error = f"{self.path}: {e}"
            return {}

    def mtime(self) -> float | None:
        try:
            return os.stat(self.path).st_mtime_ns / 1e9
        except OSError:
            return None

    def write(self, virtual_cluster: str, state: VirtualClusterState) -> bool:
        """Change this virtual cluster's entry, keeping every other one as it is in the file now."""
        directory = os.path.dirname(os.path.abspath(self.path))
        try:
            with _locked(directory):
                return self._write(directory, virtual_cluster, state)
        except OSError as e:
            self.error = f"cannot write {self.path}: {e.strerror or e}"
            log.error("state file: %s; the switch holds in this process but will not survive a restart",
                      self.error)
            return False

    def _write(self, directory: str, virtual_cluster: str, state: VirtualClusterState) -> bool:
        # Read again under the lock: another worker (or another virtual cluster's switch in one)
        # may have written its own entry since, and that entry must survive this write.
        states = self.read()
        states[virtual_cluster] = state
        fd, tmp = tempfile.mkstemp(prefix=".kproxy-state-", dir=directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(render_state(states))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self.error = None
        self.writes += 1
        return True


@contextlib.contextmanager
def _locked(directory: str) -> Any:
    """An exclusive lock on the state file's directory for one read-change-write, between the worker
    processes (and processes of other virtual clusters) that share the file; held for microseconds."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)     # releases the lock


class UpstreamClusters:
    """The active upstream cluster of one virtual cluster, and switching it (module docstring)."""

    def __init__(self, virtual_cluster: str, config: UpstreamConfig, clusters: Iterable[Cluster],
                 book: SwitchBook, target: SwitchTarget, *, state_path: str | None,
                 wall: Callable[[], float] = time.time, max_frame: int = 100 * 1024 * 1024) -> None:
        self.virtual_cluster = virtual_cluster
        self.config = config
        self.clusters = {c.name: c for c in clusters}
        self.book = book
        self.target = target
        self.wall = wall
        self.max_frame = max_frame
        self.state_file = StateFile.at(state_path) if state_path is not None and config.several else None
        self.switches: collections.Counter[str] = collections.Counter()
        self.last: SwitchReport | None = None
        self.last_hold_s = 0.0
        self._idle = trio.Event()           # set while no switch is under way
        self._idle.set()
        self._lock = trio.Lock()
        self.epoch = 0
        self.abandoned: tuple[str, ...] = ()
        self.started_because = "upstream.active"
        # MM2's offset syncs from the active cluster to each other one, as they are read.
        self.syncs: dict[tuple[str, str], OffsetSyncs] = {}
        self._sync_offsets: dict[tuple[str, str], int] = {}
        self._state_seen: float | None = None
        self._no_candidate_logged = 0.0
        start = config.first_active
        if self.state_file is not None:
            self._state_seen = self.state_file.mtime()
            state = self.state_file.read().get(virtual_cluster)
            start, self.started_because = choose_active(config.first_active, self.clusters, state)
            if state is not None and start == state.active:
                self.epoch, self.abandoned = state.epoch, state.abandoned
        self.active = self.clusters[start]
        self.book.switched = self.epoch > 0

    # -- what connections ask

    @property
    def switching(self) -> bool:
        return not self._idle.is_set()

    async def current(self) -> Cluster:
        """The cluster a connection opening now uses; waits while a switch is under way."""
        while not self._idle.is_set():
            await self._idle.wait()
        return self.active

    # -- switching

    async def switch(self, to: str, reason: str = "planned", *, planned: bool | None = None,
                     persist: bool = True) -> SwitchReport:
        """Move the virtual cluster to cluster ``to`` (see the module docstring) and return once new
        connections go there. ``planned`` (default: the reason is "planned") drains fully and waits
        for the replica; a failover does neither, the old cluster being gone. SwitchError when ``to``
        is not a cluster, or a planned switch's target does not answer."""
        if to not in self.clusters:
            raise SwitchError(f"virtual cluster {self.virtual_cluster} has no cluster {to!r}; it has "
                              f"{', '.join(self.clusters)}")
        async with self._lock:
            old, new = self.active, self.clusters[to]
            report = SwitchReport(self.virtual_cluster, old.name, new.name, reason, self.epoch)
            if old is new:
                report.changed = False
                return report
            if planned is None:
                planned = reason == "planned"
            if reason == "planned":
                # Asked for here: refused rather than moving clients to a cluster that does not answer
                # (a process following another's switch, or a failover, has decided already).
                why = await self.probe(new)
                if why is not None:
                    raise SwitchError(f"cluster {to} does not answer ({why}); the virtual cluster stays on "
                                      f"{old.name}")
            started = trio.current_time()
            log.warning("virtual cluster %s: switching from cluster %s to %s (%s); new connections are held",
                        self.virtual_cluster, old.name, new.name, reason)
            self._idle = trio.Event()
            try:
                drain_s = self.config.switch.drain_s if planned else min(self.config.switch.drain_s, 1.0)
                report.drained = await self.target.drain_upstream(old.name, drain_s, f"switching to cluster {to}")
                acked, commits = self.book.left(old.name)
                if planned and self.config.switch.catch_up_s > 0 and acked:
                    await self._catch_up(old, new, acked, report)
                if self.config.offset_translation == "mm2":
                    with trio.move_on_after(TRANSLATE_BUDGET_S) as scope:
                        await self._translate(old, new, commits, report, source_alive=planned)
                    if scope.cancelled_caught:
                        report.problems.append(f"offset translation stopped after {TRANSLATE_BUDGET_S:g}s")
                self.active = new
                self.epoch += 1
                # Counted as it is made, so /metrics never shows the new cluster active and no switch.
                self.switches[reason] += 1
                self.book.switched = True
                self.abandoned = () if planned else tuple(dict.fromkeys((*self.abandoned, old.name)))
                if persist and self.state_file is not None:
                    state = VirtualClusterState(new.name, self.epoch, self.config.first_active, old.name, reason,
                                                self.wall(), self.abandoned)
                    if not self.state_file.write(self.virtual_cluster, state):
                        report.problems.append(self.state_file.error or "the state file was not written")
                    self._state_seen = self.state_file.mtime()
                with trio.move_on_after(RETARGET_BUDGET_S):
                    await self.target.retarget()
            finally:
                self.last_hold_s = trio.current_time() - started
                self._idle.set()
            report.epoch = self.epoch
            report.took_s = self.last_hold_s
            self.last = report
            log.warning("virtual cluster %s: switched from cluster %s to %s (%s, switch %d) in %.2fs: %d connections "
                        "drained%s%s", self.virtual_cluster, old.name, new.name, reason, self.epoch, report.took_s,
                        report.drained, "" if report.caught_up in (None, True) else
                        "; the replica had not caught up with everything the old cluster acknowledged",
                        "".join(f"; {p}" for p in report.problems))
            return report

    async def _catch_up(self, old: Cluster, new: Cluster, acked: dict[tuple[str, int], int],
                        report: SwitchReport) -> None:
        """Wait until the replica's end offsets cover what the old cluster acknowledged."""
        syncs = self.syncs.setdefault((old.name, new.name), OffsetSyncs())
        source = ClusterClient(old.name, old.bootstrap, old.settings, self.config.request_timeout_s, self.max_frame)
        target = ClusterClient(new.name, new.bootstrap, new.settings, self.config.request_timeout_s, self.max_frame)
        seen: dict[tuple[str, int], int | None] = {}
        deadline = trio.current_time() + self.config.switch.catch_up_s
        with trio.move_on_at(deadline):
            try:
                await self._read_syncs(source, old, new, syncs)
            except (OSError, trio.TooSlowError, KProxyError) as e:
                report.problems.append(f"offset syncs not read on {old.name}: {safe(str(e) or 'timed out')}")
        wanted = {(new.prefix + topic, partition): syncs.replica_end_for(old.prefix + topic, partition, end)
                  for (topic, partition), end in acked.items()}
        with trio.move_on_at(deadline):
            delay = 0.05
            while True:
                try:
                    seen = await target.end_offsets(wanted)
                except (OSError, trio.TooSlowError, KProxyError) as e:
                    report.problems.append(f"end offsets of {new.name}: {safe(str(e) or 'timed out')}")
                if all((seen.get(tp) or -1) >= end for tp, end in wanted.items()):
                    break
                await trio.sleep(delay)
                delay = min(delay * 2, 0.5)
        source.close()
        target.close()
        report.catch_up = {f"{t}[{p}]": (end, seen.get((t, p))) for (t, p), end in wanted.items()}
        report.caught_up = all((seen.get(tp) or -1) >= end for tp, end in wanted.items())

    async def _read_syncs(self, client: ClusterClient, source: Cluster, target: Cluster, into: OffsetSyncs) -> None:
        """Read MM2's offset syncs for ``source`` -> ``target`` on ``client``'s cluster to their end."""
        topic = offset_syncs_topic(target.alias)
        key = (client.name, topic)
        start = self._sync_offsets.get(key, 0)
        records, reached = await client.read(topic, 0, start)
        self._sync_offsets[key] = reached
        bad = decode_syncs(records, into)
        if bad:
            log.warning("virtual cluster %s: %d records of %s on cluster %s are not offset syncs", self.virtual_cluster,
                        bad, topic, client.name)

    async def _translate(self, old: Cluster, new: Cluster, commits: dict[str, dict[tuple[str, int], int]],
                         report: SwitchReport, *, source_alive: bool) -> None:
        """Commit, on ``new``, the offsets each group resumes from (``plan_group``): for groups kproxy
        saw commit on ``old``, their last commit through MM2's offset syncs; for every group, MM2's last
        checkpoint; whichever is further, and only where the new cluster holds less."""
        syncs = self.syncs.setdefault((old.name, new.name), OffsetSyncs())
        target = ClusterClient(new.name, new.bootstrap, new.settings, self.config.request_timeout_s, self.max_frame)
        try:
            if source_alive:
                source = ClusterClient(old.name, old.bootstrap, old.settings, self.config.request_timeout_s,
                                       self.max_frame)
                try:
                    await self._read_syncs(source, old, new, syncs)
                except (OSError, trio.TooSlowError, KProxyError) as e:
                    report.problems.append(f"offset syncs not read on {old.name}: {safe(str(e) or 'timed out')}")
                finally:
                    source.close()
            try:
                # offset-syncs.topic.location=target keeps them on the new cluster instead.
                await self._read_syncs(target, old, new, syncs)
                records, _ = await target.read(checkpoints_topic(old.alias), 0, 0)
                checkpoints = latest_checkpoints(records)
            except (OSError, trio.TooSlowError, KProxyError) as e:
                report.problems.append(f"MM2's topics not read on {new.name}: {safe(str(e) or 'timed out')}")
                checkpoints = {}
            for group in sorted({*commits, *checkpoints}):
                plan = plan_group(commits.get(group, {}), syncs, checkpoints.get(group, {}), old.prefix, new.prefix)
                log.debug("virtual cluster %s: group %s: commits seen %s, resumes at %s", self.virtual_cluster,
                          group, commits.get(group), plan)
                if not plan:
                    continue
                try:
                    current, done = await self._commit(target, group, {tp: t.offset for tp, t in plan.items()})
                except (OSError, trio.TooSlowError, KProxyError) as e:
                    report.problems.append(f"group {group}: {safe(str(e) or 'timed out')}")
                    continue
                # What the group resumes from: kproxy's commit, or what the new cluster held already
                # (MM2's own group offset sync, or the group's own commits there).
                report.offsets[group] = {
                    f"{t}[{p}]": ((plan[(t, p)].offset, plan[(t, p)].source) if (t, p) in done
                                  else (current.get((t, p), plan[(t, p)].offset), "target")) for (t, p) in plan}
        finally:
            target.close()

    async def _commit(self, target: ClusterClient, group: str, offsets: dict[tuple[str, int], int]
                      ) -> tuple[dict[tuple[str, int], int], list[tuple[str, int]]]:
        """Commit the offsets the target holds less of; read back and commit again (another worker
        may have committed its own, lower view at the same moment). (What the target held before,
        the partitions committed.)"""
        done: list[tuple[str, int]] = []
        held: dict[tuple[str, int], int] | None = None
        for _ in range(3):
            current = await target.committed(group)
            if held is None:
                held = current
            ahead = {tp: o for tp, o in offsets.items() if o > current.get(tp, -1)}
            if not ahead:
                break
            errors = await target.commit(group, ahead)
            refused = {tp: e for tp, e in errors.items() if e}
            if refused:
                # 25 UNKNOWN_MEMBER_ID / 22 ILLEGAL_GENERATION: the group has members there already.
                raise ReplicaError(f"commit refused on {target.name} (errors "
                                   f"{sorted(set(refused.values()))}); a group with members keeps its own offsets")
            done += [tp for tp in ahead if tp not in done]
        return held or {}, done

    # -- background: probes, failover, the state file, MM2's offset syncs

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Probe every cluster (and fail over), follow the state file, tail MM2's offset syncs."""
        async with trio.open_nursery() as nursery:
            if len(self.clusters) > 1:
                nursery.start_soon(self._probe_loop)
                if self.state_file is not None:
                    nursery.start_soon(self._follow_state)
                if self.config.offset_translation == "mm2":
                    nursery.start_soon(self._tail_syncs)
            task_status.started()

    async def probe(self, cluster: Cluster) -> str | None:
        """Whether ``cluster`` answers: None when a broker answered ApiVersions on a fresh connection
        (or refused kproxy's login: reachable, refusing), else why not."""
        timeout = max(1.0, min(self.config.connect_timeout_s, self._after_s() / 2))
        settings = attrs.evolve(cluster.settings, connect_timeout_s=timeout, originator=None)
        why = "no bootstrap server"
        for host, port in cluster.bootstrap:
            try:
                with trio.fail_after(timeout * 2):
                    t = await open_upstream(host, port, settings)
                    try:
                        roundtrip = direct_roundtrip(t, timeout)
                        await roundtrip(Request.build(18, 0, 1, "kproxy-probe", body_class(18, "request")()))
                    finally:
                        t.close()
                return None
            except (OSError, trio.TooSlowError, KProxyError, trio.BrokenResourceError) as e:
                if login_failed(e):
                    return None
                why = f"{host}:{port}: {str(e) or 'timed out'}"
        return why

    def _after_s(self) -> float:
        f = self.config.failing_over
        return f.after_s if f is not None else 10.0

    async def _probe_loop(self) -> None:
        failover = self.config.failing_over
        every = failover.probe_every if failover is not None else 5.0
        while True:
            due = trio.current_time() + every
            async with trio.open_nursery() as nursery:
                for c in self.clusters.values():
                    nursery.start_soon(self._probe_one, c)
            if failover is not None and not self.switching:
                await self._maybe_fail_over(failover.after_s)
            await trio.sleep_until(due)

    async def _probe_one(self, cluster: Cluster) -> None:
        why = await self.probe(cluster)
        now = trio.current_time()
        if why is None:
            if cluster.reachable is False:
                log.info("virtual cluster %s: cluster %s answers again", self.virtual_cluster, cluster.name)
            cluster.reachable, cluster.unreachable_since, cluster.probe_error = True, None, None
            return
        if cluster.reachable is not False:
            log.warning("virtual cluster %s: cluster %s does not answer: %s", self.virtual_cluster, cluster.name,
                        safe(why))
            cluster.unreachable_since = now
        cluster.reachable, cluster.probe_error = False, why

    async def _maybe_fail_over(self, after_s: float) -> None:
        active = self.active
        since = active.unreachable_since
        if since is None or trio.current_time() - since < after_s:
            return
        candidate = next((c for c in self.clusters.values() if c is not active and c.reachable
                          and c.name not in self.abandoned), None)
        if candidate is None:
            if trio.current_time() - self._no_candidate_logged > 30:
                self._no_candidate_logged = trio.current_time()
                log.error("virtual cluster %s: cluster %s has not answered for %.0fs and no other cluster it has not "
                          "left answers; staying on it", self.virtual_cluster, active.name,
                          trio.current_time() - since)
            return
        log.error("virtual cluster %s: cluster %s has not answered for %.1fs (failover.after_s %g): failing over "
                  "to %s", self.virtual_cluster, active.name, trio.current_time() - since, after_s, candidate.name)
        try:
            await self.switch(candidate.name, "failover")
        except SwitchError as e:
            log.error("virtual cluster %s: failover to %s failed: %s", self.virtual_cluster, candidate.name, e)

    async def _follow_state(self) -> None:
        while True:
            await trio.sleep(STATE_POLL_S)
            await self.follow_state()

    async def follow_state(self) -> None:
        """Switch as the state file says when another process switched since (a higher epoch)."""
        assert self.state_file is not None
        seen = self.state_file.mtime()
        if seen == self._state_seen or self.switching:
            return
        self._state_seen = seen
        state = self.state_file.read().get(self.virtual_cluster)
        if state is None or state.epoch <= self.epoch:
            return
        if state.active not in self.clusters:
            log.error("virtual cluster %s: the state file names cluster %r, which is not configured; staying on %s",
                      self.virtual_cluster, state.active, self.active.name)
            return
        if state.active == self.active.name:
            self.epoch, self.abandoned = state.epoch, state.abandoned
            return
        log.warning("virtual cluster %s: another process switched to cluster %s (switch %d, %s); following",
                    self.virtual_cluster, state.active, state.epoch, state.reason)
        await self.switch(state.active, "followed", planned=state.reason == "planned", persist=False)
        self.epoch, self.abandoned = state.epoch, state.abandoned

    async def _tail_syncs(self) -> None:
        """Keep reading MM2's offset syncs on the active cluster, so a failover (the active cluster
        gone) can still translate the groups' last commits."""
        delay = 1.0
        while True:
            source = self.active
            client = ClusterClient(source.name, source.bootstrap, source.settings, self.config.request_timeout_s,
                                   self.max_frame)
            try:
                while self.active is source:
                    for other in self.clusters.values():
                        if other is not source:
                            await self._read_syncs(client, source, other,
                                                   self.syncs.setdefault((source.name, other.name), OffsetSyncs()))
                    delay = 1.0
                    await trio.sleep(SYNC_TAIL_WAIT_MS / 1000)
            except (OSError, trio.TooSlowError, KProxyError, trio.BrokenResourceError) as e:
                log.debug("virtual cluster %s: reading offset syncs on %s: %s", self.virtual_cluster, source.name, e)
            finally:
                client.close()
            await trio.sleep(delay)
            delay = min(delay * 2, 30.0)

    # -- what the admin listener and /metrics show

    def view(self) -> dict[str, Any]:
        return {
            "virtual_cluster": self.virtual_cluster,
            "active": self.active.name,
            "epoch": self.epoch,
            "switching": self.switching,
            "started_on_because": self.started_because,
            "failover_after_s": self.config.failing_over.after_s if self.config.failing_over else None,
            "abandoned": list(self.abandoned),
            "state_file": self.state_file.path if self.state_file else None,
            "state_file_error": self.state_file.error if self.state_file else None,
            "clusters": [{"name": c.name, "bootstrap_servers": [f"{h}:{p}" for h, p in c.bootstrap],
                          "topic_prefix": c.topic_prefix, "reachable": c.reachable, "probe_error": c.probe_error}
                         for c in self.clusters.values()],
            "switches": dict(self.switches),
            "last_switch": self.last.to_json() if self.last else None,
            "carried_batches": self.book.carried_batches,
        }

    def snapshot(self) -> dict[str, Any]:
        """For kproxy.telemetry.metrics.upstream_families."""
        return {"virtual_cluster": self.virtual_cluster, "active": self.active.name,
                "clusters": {c.name: c.reachable for c in self.clusters.values()}, "probed": len(self.clusters) > 1,
                "switches": dict(self.switches), "last_hold_s": self.last_hold_s,
                "carried_batches": self.book.carried_batches}


def switch_answer(report: SwitchReport) -> bytes:
    return (json.dumps(report.to_json(), indent=2) + "\n").encode()

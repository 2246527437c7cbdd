"""Fleet-wide quotas: the share of one budget each kproxy of a fleet enforces, from what all of them report.

Every process reports, per active budget key, its measured rate and its demand (both as fractions of
the quota's whole limit); ``FleetShares`` keeps the latest report of every other process and turns
them into this process's share: ``own demand / total demand``, floored, capped at the whole limit and
smoothed between intervals, or the static share when coordination is down. A key new to this process
keeps room for the processes not yet heard from since it reported the key. The records' wire format
is here too. Pure: wall-clock times are passed in; nothing here reads a clock or a socket.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from urllib.parse import quote, unquote

import attrs

from kproxy.quota.budgets import BudgetKey

# A demand estimate counts the time a throttled budget's clients were told to wait; near always
# muted, rate / (1 - muted) explodes, so muted is held below this.
MAX_MUTED = 0.99
# Characters of a budget key, quota or instance name kept as they are in a record key; the rest
# (the '/' that separates the parts above all) are %-escaped, so a record key always splits in four.
_SAFE = "=:@.-_+,;!~*()[]{}<>#$&'"


@attrs.frozen(slots=True)
class Load:
    """One process's use of one budget over the quota window, as fractions of the quota's whole limit
    (the most used of its limits): ``rate`` is what it let through, ``demand`` what it would have let
    through unthrottled."""

    rate: float
    demand: float


def demand_of(rate: float, muted: float) -> float:
    """What a budget would have let through unthrottled, estimated from its ``rate`` and the seconds per
    second its clients were told to wait (``muted``): a client sending back to back at D, told to wait
    a fraction m of the time, is measured at D x (1 - m). Demand beyond the whole limit counts as the
    whole limit: it changes nothing about one limit's split, and an estimate from a client muted
    nearly always only grows with the share it already has, which would make shares drift."""
    estimate = rate / (1.0 - min(max(muted, 0.0), MAX_MUTED))
    return min(estimate, max(1.0, rate))


@attrs.frozen(slots=True)
class PeerRecord:
    """The latest report of one process on one budget; ``at`` is its wall-clock time in seconds."""

    instance: str
    rate: float
    demand: float
    at: float


@attrs.frozen(slots=True)
class Report:
    """One record of the coordination topic, decoded."""

    fleet: str
    quota: str
    key: str
    instance: str
    rate: float
    demand: float
    at: float           # the record's timestamp, seconds

    @property
    def budget(self) -> BudgetKey:
        return (self.quota, self.key)


def record_key(fleet: str, quota: str, key: str, instance: str) -> bytes:
    """``fleet/quota/budget key/instance``, each part %-escaped: compaction keeps the latest record of
    each instance for each budget."""
    return "/".join(quote(p, safe=_SAFE) for p in (fleet, quota, key, instance)).encode()


def record_value(load: Load) -> bytes:
    """The compact JSON value of a record: ``{"r": rate, "d": demand}`` (fractions of the limit)."""
    return b'{"r":%s,"d":%s}' % (_short(load.rate).encode(), _short(load.demand).encode())


def _short(x: float) -> str:
    return f"{x:.4g}"


def decode_record(key: bytes | memoryview | None, value: bytes | memoryview | None, at: float) -> Report | None:
    """The report a record holds, or None for a record that is not one (a tombstone, another format,
    garbage written by someone else): the topic is read, never trusted to be well formed."""
    if key is None or value is None or len(key) > 4096 or len(value) > 4096:
        return None
    try:
        parts = bytes(key).decode().split("/")
        if len(parts) != 4:
            return None
        doc = json.loads(bytes(value))
        rate, demand = float(doc["r"]), float(doc["d"])
    except (UnicodeDecodeError, ValueError, TypeError, KeyError):
        return None
    if not (math.isfinite(rate) and math.isfinite(demand)) or rate < 0 or demand < 0:
        return None
    fleet, quota, budget_key, instance = (unquote(p) for p in parts)
    return Report(fleet, quota, budget_key, instance, rate, demand, at)


class FleetShares:
    """This process's share of every budget it reports on, from the latest peer reports.

    ``up`` means coordination works end to end: a record this process wrote has been read back from
    the topic within ``stale_after_s``. While it is not, every share is ``static_share`` (today's
    ``limit / (quota_replicas x workers)``). Peer reports older than ``stale_after_s`` count for nothing.

    A key is *young* from this process's first report of it until ``stale_after_s`` after that report
    was written (by its own timestamp, read back). A peer's silence about a young key means it does not use the key only if the peer
    wrote after that report (records of one fleet are in one partition, read in order, so this needs
    no clock agreement). Until then the peer may be using the key on its static share, as a process
    new to a key or not coordinated does: each such peer, and each of the fleet's expected processes
    (``1 / static_share``) not heard from at all, keeps ``static_share`` of the limit out of this
    process's reach. So a fleet whose clients all start on a new key starts from the static shares,
    and a client alone on one process gets the whole limit once the others have written.
    """

    def __init__(self, fleet: str, instance: str, static_share: float, stale_after_s: float, *,
                 floor: float = 0.5, smoothing: float = 0.5, max_instances: int = 10_000) -> None:
        self.fleet = fleet
        self.instance = instance
        self.static_share = static_share
        self.stale_after_s = stale_after_s
        # At least this part of an equal split, so an instance whose demand has not been measured yet
        # (its rate is measured over the whole window) still gets room to show it.
        self.floor = floor
        self.smoothing = smoothing          # the part of the way to the new share taken each interval
        self._peers: dict[BudgetKey, dict[str, PeerRecord]] = {}
        self._shares: dict[BudgetKey, float] = {}
        self.own_seen_at: float | None = None     # the timestamp of the newest own record read back
        # Other processes the fleet is expected to have: the static share is one of 1 / static_share.
        self.expected_peers = max(0, round(1.0 / static_share) - 1) if static_share > 0 else 0
        self._read = 0                              # records of this fleet read so far
        self._since: dict[BudgetKey, tuple[int, float]] = {}    # key -> (read count, time) of own first report
        self._last_read: dict[str, int] = {}        # other instance -> read count of its newest record
        # Budgets this process uses (None: every one). Only their peer records are kept: what others
        # write about other budgets changes no share here, and the topic is not trusted to be small.
        self.interest: set[BudgetKey] | None = None
        self._instances: dict[str, float] = {}    # other instance -> its newest record's time
        self.max_instances = max_instances

    # -- what was read

    def observe(self, report: Report) -> None:
        """Take in one record read from the topic (any fleet, any instance, in any order)."""
        if report.fleet != self.fleet:
            return
        self._read += 1
        if report.instance == self.instance:
            if self.own_seen_at is None or report.at > self.own_seen_at:
                self.own_seen_at = report.at
            if report.key and report.budget not in self._since and (
                    self.interest is None or report.budget in self.interest):
                self._since[report.budget] = (self._read, report.at)
            return
        seen = self._instances.get(report.instance)
        if seen is None and len(self._instances) >= self.max_instances:
            return          # more writers than a fleet has: ignore the new names until old ones go stale
        if seen is None or report.at > seen:
            self._instances[report.instance] = report.at
        self._last_read[report.instance] = self._read
        if self.interest is not None and report.budget not in self.interest:
            return
        peers = self._peers.setdefault(report.budget, {})
        known = peers.get(report.instance)
        if known is None or report.at >= known.at:
            peers[report.instance] = PeerRecord(report.instance, report.rate, report.demand, report.at)

    def observe_all(self, reports: Iterable[Report]) -> None:
        for r in reports:
            self.observe(r)

    # -- state

    def up(self, now: float) -> bool:
        """Whether coordination works: an own record written within ``stale_after_s`` was read back."""
        return self.own_seen_at is not None and now - self.own_seen_at < self.stale_after_s

    def fresh_peers(self, key: BudgetKey, now: float) -> Iterator[PeerRecord]:
        for p in self._peers.get(key, {}).values():
            if now - p.at < self.stale_after_s:
                yield p

    def newest_peer_age(self, now: float) -> float | None:
        """Seconds since the newest peer record of any budget was written; None before the first."""
        newest = max(self._instances.values(), default=None)
        return None if newest is None else max(0.0, now - newest)

    def peer_count(self, now: float) -> int:
        """Other instances of the fleet with a fresh record (on any budget, or a heartbeat)."""
        return sum(1 for at in self._instances.values() if now - at < self.stale_after_s)

    # -- the sharing rule

    def unheard(self, key: BudgetKey, now: float) -> int:
        """How many processes of the fleet may be using young ``key`` without this one knowing: the
        fresh peers that have neither reported it nor written since this process first reported it,
        and the expected processes not heard from at all. 0 once the key is no longer young."""
        since = self._since.get(key)
        if since is not None and now - since[1] >= self.stale_after_s:
            return 0
        after = since[0] if since is not None else self._read
        known = {p.instance for p in self.fresh_peers(key, now)}
        known.update(name for name, at in self._instances.items()
                     if now - at < self.stale_after_s and self._last_read.get(name, 0) > after)
        return max(0, max(self.expected_peers, self.peer_count(now)) - len(known))

    def target(self, key: BudgetKey, own_demand: float, now: float) -> float:
        """The share the rule gives without smoothing: own demand over everyone's, of what the
        processes not heard from yet leave (``unheard``, each holding ``static_share``); at least
        ``floor`` of an equal split among the instances reporting or unheard, at most the whole limit."""
        peers = list(self.fresh_peers(key, now))
        unheard = self.unheard(key, now)
        room = max(0.0, 1.0 - unheard * self.static_share)
        total = own_demand + sum(p.demand for p in peers)
        share = room * own_demand / total if total > 0 else room / (1 + len(peers))
        return min(1.0, max(share, self.floor / (1 + len(peers) + unheard)))

    def share(self, key: BudgetKey, own_demand: float, now: float) -> float:
        """This interval's share of budget ``key`` (a fraction of the limit): the static share while
        coordination is down, else the previous share moved ``smoothing`` of the way to ``target``."""
        if not self.up(now):
            self._shares.pop(key, None)
            return self.static_share
        before = self._shares.get(key, self.static_share)
        now_share = before + self.smoothing * (self.target(key, own_demand, now) - before)
        self._shares[key] = now_share
        return now_share

    def forget(self, now: float, active: Iterable[BudgetKey] = ()) -> None:
        """Drop peer records past ``stale_after_s`` and the smoothing state of budgets no longer active."""
        for key in [k for k, peers in self._peers.items()
                    if not any(now - p.at < self.stale_after_s for p in peers.values())]:
            del self._peers[key]
        for peers in self._peers.values():
            for name in [n for n, p in peers.items() if now - p.at >= self.stale_after_s]:
                del peers[name]
        keep = set(active)
        for key in [k for k in self._shares if k not in keep]:
            del self._shares[key]
        for key in [k for k in self._since if k not in keep]:
            del self._since[key]
        for name in [n for n, at in self._instances.items() if now - at >= self.stale_after_s]:
            del self._instances[name]
            self._last_read.pop(name, None)

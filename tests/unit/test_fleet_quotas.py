"""Fleet quotas without a broker, on injected clocks: the sharing rule for 1, 2, 3 and 10 instances
with equal and unequal demand, its floor, cap and smoothing, stale and vanished peers, other fleets,
the fallback to the static share, the record format, the share and demand in the quota engine, and
the coordinator applying shares and logging each switch once."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import attrs
import pytest

from kproxy.config import ConfigError, CoordinationConfig, QuotaConfig, config_from_args
from kproxy.quota.fleet import FleetShares, Load, Report, decode_record, demand_of, record_key, record_value
from kproxy.server.coordination import Coordinator

from .rulebook import session
from .test_quota import ONE_K, at, produce_once, quota_filter

KEY = ("q", "client_id=app")
STATIC = 1 / 3
STALE = 5.0


def shares(instance: str = "me", fleet: str = "billing") -> FleetShares:
    return FleetShares(fleet, instance, STATIC, STALE)


def report(instance: str, demand: float, at: float, key: tuple[str, str] = KEY, fleet: str = "billing") -> Report:
    return Report(fleet, key[0], key[1], instance, rate=demand, demand=demand, at=at)


def known_for_a_while(fs: FleetShares, now: float) -> FleetShares:
    """This process first reported KEY ``stale_after_s`` before ``now``: no longer young then."""
    fs.observe(report("me", 0.5, now - STALE))
    return fs


def settle(fs: FleetShares, own_demand: float, peers: dict[str, float], now: float, rounds: int = 30) -> float:
    """Run ``rounds`` intervals of 0.5 s with these demands (every instance reporting each interval)."""
    share = 0.0
    for i in range(rounds):
        t = now + 0.5 * i
        fs.observe(report("me", own_demand, t))
        for name, d in peers.items():
            fs.observe(report(name, d, t))
        share = fs.share(KEY, own_demand, t)
    return share


@pytest.mark.parametrize("n", [1, 2, 3, 10])
def test_equal_demand_gives_each_of_n_instances_one_nth(n):
    fs = shares()
    assert settle(fs, 0.5, {f"p{i}": 0.5 for i in range(n - 1)}, 1000.0) == pytest.approx(1 / n, rel=1e-3)


@pytest.mark.parametrize("own, peers, expected", [
    (0.3, {"p1": 0.1}, 0.75),                            # 2 instances, 3:1
    (0.1, {"p1": 0.3}, 0.25),
    (0.6, {"p1": 0.3, "p2": 0.1}, 0.6),                  # 3 instances, 6:3:1
    (0.2, {"p1": 0.4, "p2": 0.4}, 0.2),
    (0.9, {f"p{i}": 0.1 for i in range(9)}, 0.5),        # 10 instances, one with half the demand
])
def test_unequal_demand_gives_shares_in_proportion(own, peers, expected):
    assert settle(shares(), own, peers, 1000.0) == pytest.approx(expected, rel=1e-3)


def test_shares_of_the_fleet_add_up_to_the_limit():
    demands = {"a": 0.9, "b": 0.5, "c": 0.2}
    got = {}
    for me, d in demands.items():
        got[me] = settle(shares(me), d, {k: v for k, v in demands.items() if k != me}, 1000.0)
    assert sum(got.values()) == pytest.approx(1.0, rel=1e-3)


def test_a_newly_active_instance_is_not_starved_by_the_floor():
    # Its own rate is still ramping up (measured over the whole window) while two peers are busy.
    fs = shares()
    share = settle(fs, 0.001, {"p1": 0.5, "p2": 0.5}, 1000.0)
    assert share == pytest.approx(0.5 / 3, rel=1e-3)         # half of an equal split, not 0.001 / 1.001


def test_the_cap_is_the_whole_limit_and_a_lone_instance_gets_nearly_all_of_it():
    fs = shares()
    assert settle(fs, 3.0, {}, 1000.0) == pytest.approx(1.0, rel=1e-3)
    assert fs.target(KEY, 3.0, 1015.0) == 1.0


def test_shares_move_smoothly_without_overshoot():
    fs = shares()
    fs.observe(report("me", 0.5, 1000.0))
    for peer in ("p1", "p2"):       # the other two of the fleet wrote since, not about this key
        fs.observe(report(peer, 0.0, 1000.2, key=("", "")))
    seen = [fs.share(KEY, 0.5, 1000.5 + 0.5 * i) for i in range(8)]     # alone: from 1/3 towards 1
    assert seen[0] == pytest.approx(STATIC + 0.5 * (1 - STATIC))
    assert all(a < b <= 1.0 for a, b in itertools.pairwise(seen))
    assert seen[3] > 0.9


# -- a key new to the fleet (issue 27: from a cold start, three processes each took the whole limit)


HEARTBEAT = ("", "")


class Fleet:
    """Processes of one fleet writing to one partition every 0.5 s, each a tenth of a second after
    the one before, reading it to the end, then taking their share (as ``Coordinator._session``)."""

    def __init__(self, names: tuple[str, ...], static: float = STATIC) -> None:
        self.processes = {n: FleetShares("billing", n, static, STALE) for n in names}
        self.log: list[Report] = []
        self.read = dict.fromkeys(names, 0)
        self.shares: dict[str, float] = {}

    def interval(self, now: float, demands: dict[str, float]) -> dict[str, float]:
        """One interval from ``now``: ``demands`` says who uses KEY and how much; the others write a
        heartbeat. The shares in force after each process's turn, the fleet's sum among them."""
        sums = []
        for i, (name, fs) in enumerate(self.processes.items()):
            t = now + 0.1 * i
            used = name in demands
            self.log.append(report(name, demands[name], t) if used else report(name, 0.0, t, key=HEARTBEAT))
            fs.observe_all(self.log[self.read[name]:])
            self.read[name] = len(self.log)
            if used:
                self.shares[name] = fs.share(KEY, demands[name], t)
            else:
                fs.forget(t, ())
                self.shares.pop(name, None)
            sums.append(sum(self.shares.values()))
        return {**self.shares, "most": max(sums)}


def test_a_key_new_to_every_process_starts_from_the_static_shares():
    fleet = Fleet(("a", "b", "c"))
    for i in range(4):              # coordinated for a while, no client yet
        fleet.interval(1000.0 + 0.5 * i, {})
    everyone = dict.fromkeys("abc", 1.0)
    seen = [fleet.interval(1002.0 + 0.5 * i, everyone) for i in range(20)]
    assert seen[0] == pytest.approx({"a": STATIC, "b": STATIC, "c": STATIC, "most": 1.0})
    # Never more than the whole limit among them on the way (before: each took 2/3 on its first turn).
    assert max(s["most"] for s in seen) <= 1.0 + 1e-9
    assert all(seen[-1][n] == pytest.approx(STATIC) for n in "abc")


def test_a_key_used_on_one_process_grows_to_the_whole_limit_once_the_others_have_written():
    fleet = Fleet(("a", "b", "c"))
    for i in range(4):
        fleet.interval(1000.0 + 0.5 * i, {})
    seen = [fleet.interval(1002.0 + 0.5 * i, {"a": 1.0})["a"] for i in range(8)]
    # Its first turn: b and c last wrote before a reported the key. Its second: they wrote since, not
    # about the key. Then half of the way to the whole limit each interval.
    assert seen[:3] == pytest.approx([STATIC, STATIC + (1 - STATIC) / 2, STATIC + 3 * (1 - STATIC) / 4])
    assert seen[4] > 0.95 and seen[-1] <= 1.0


def test_a_process_that_starts_before_the_rest_of_its_fleet_keeps_their_static_shares_free():
    fs = shares()               # expected: two more processes (the static share is a third)
    fs.observe(report("me", 1.0, 1000.0))
    assert fs.share(KEY, 1.0, 1000.0) == pytest.approx(STATIC)
    fs.observe(report("me", 1.0, 1000.5))
    fs.observe(report("p1", 1.0, 1000.6))        # one of them comes, using the key as much
    assert fs.target(KEY, 1.0, 1001.0) == pytest.approx(1 / 3)     # (1 - 1/3 for the one missing) / 2
    # The third never comes (it is down, or not coordinated): after stale_after_s, no room kept for it.
    for i in range(1, 9):
        fs.observe(report("me", 1.0, 1000.5 + 0.5 * i))
        fs.observe(report("p1", 1.0, 1000.6 + 0.5 * i))
    assert fs.unheard(KEY, 1005.0 - 0.01) == 1 and fs.unheard(KEY, 1005.0) == 0
    assert fs.target(KEY, 1.0, 1005.0) == pytest.approx(0.5)


def test_the_order_written_not_the_clocks_says_who_has_been_heard_since():
    fs = shares()
    fs.observe(report("p1", 0.0, 1003.0, key=HEARTBEAT))   # p1's clock is ahead: written before our report
    fs.observe(report("me", 1.0, 1000.0))
    fs.observe(report("p2", 0.0, 998.0, key=HEARTBEAT))    # p2's clock is behind: written after it
    assert fs.unheard(KEY, 1000.5) == 1                       # p1 may still be using the key
    fs.observe(report("p1", 0.0, 1003.5, key=HEARTBEAT))
    assert fs.unheard(KEY, 1000.5) == 0


def test_a_peer_already_using_the_key_counts_with_its_demand():
    fs = shares()
    fs.observe(report("p1", 0.6, 999.8))          # p1 was using it before we were
    fs.observe(report("me", 0.2, 1000.0))
    # p2, expected but not heard since, keeps a third; the rest is split 1:3 with p1.
    assert fs.target(KEY, 0.2, 1000.0) == pytest.approx((1 - STATIC) * 0.25)


def test_a_key_idle_long_enough_to_be_forgotten_is_new_again():
    fs = known_for_a_while(shares(), 1000.0)
    fs.observe(report("me", 0.5, 1000.0))
    assert fs.unheard(KEY, 1000.0) == 0
    fs.forget(1001.0, ())                         # the budget was dropped (idle past the quota's span)
    fs.observe(report("me", 0.5, 1030.0))
    assert fs.unheard(KEY, 1030.0) == 2


def test_with_a_static_share_of_the_whole_limit_an_unheard_peer_leaves_only_the_floor():
    # quota_replicas: 1 on every sidecar: a peer new to the key may take the whole limit itself.
    fs = FleetShares("billing", "me", 1.0, STALE)
    fs.observe(report("p1", 0.0, 999.0, key=HEARTBEAT))
    fs.observe(report("me", 1.0, 1000.0))
    assert fs.expected_peers == 0 and fs.unheard(KEY, 1000.0) == 1
    assert fs.target(KEY, 1.0, 1000.0) == pytest.approx(0.5 / 2)


def test_stale_peers_are_ignored():
    fs = known_for_a_while(shares(), 1010.0)
    fs.observe(report("me", 0.5, 1010.0))
    fs.observe(report("old", 0.5, 1010.0 - STALE))      # exactly stale_after_s old: ignored
    fs.observe(report("fresh", 0.5, 1009.0))
    assert fs.target(KEY, 0.5, 1010.0) == pytest.approx(0.5)
    assert [p.instance for p in fs.fresh_peers(KEY, 1010.0)] == ["fresh"]


def test_a_peer_that_disappears_stops_counting_after_stale_after_s():
    fs = shares()
    assert settle(fs, 0.5, {"p1": 0.5}, 1000.0, rounds=20) == pytest.approx(0.5, rel=1e-3)
    last_peer = 1000.0 + 0.5 * 19
    share = 0.0
    for i in range(1, 40):       # p1 is gone; this process goes on reporting
        t = last_peer + 0.5 * i
        fs.observe(report("me", 0.5, t))
        share = fs.share(KEY, 0.5, t)
        if t - last_peer < STALE:
            assert share == pytest.approx(0.5, rel=1e-3)
    assert share == pytest.approx(1.0, rel=1e-3)
    fs.forget(last_peer + 20, [KEY])
    assert fs.newest_peer_age(last_peer + 20) is None and fs.peer_count(last_peer + 20) == 0


def test_only_the_newest_record_of_a_peer_counts_whatever_the_order_read():
    fs = known_for_a_while(shares(), 1000.0)
    fs.observe(report("me", 0.5, 1000.0))
    fs.observe(report("p1", 0.9, 1000.0))
    fs.observe(report("p1", 0.1, 999.0))        # an older record read later (two partitions, a replay)
    assert fs.target(KEY, 0.3, 1000.0) == pytest.approx(0.25)


def test_other_fleets_do_not_count():
    fs = known_for_a_while(shares(), 1000.0)
    fs.observe(report("me", 0.5, 1000.0))
    fs.observe(report("p1", 0.5, 1000.0, fleet="other"))
    fs.observe(report("me", 0.5, 1000.0, fleet="other"))
    assert fs.target(KEY, 0.5, 1000.0) == 1.0
    assert fs.peer_count(1000.0) == 0


def test_fallback_is_the_static_share_until_an_own_record_is_read_back_fresh():
    fs = shares()
    fs.observe(report("p1", 0.1, 1000.0))
    assert not fs.up(1000.0) and fs.share(KEY, 0.9, 1000.0) == STATIC    # nothing of ours read back
    fs.observe(report("me", 0.9, 1000.0))
    assert fs.up(1000.0) and fs.share(KEY, 0.9, 1000.0) > STATIC
    # The topic stops answering: our last record read back ages past stale_after_s.
    assert fs.up(1000.0 + STALE - 0.01)
    assert not fs.up(1000.0 + STALE) and fs.share(KEY, 0.9, 1000.0 + STALE) == STATIC
    # Back: the share starts again from the static one, smoothly.
    fs.observe(report("me", 0.9, 1010.0))
    assert fs.share(KEY, 0.9, 1010.0) == pytest.approx(STATIC + 0.5 * (1.0 - STATIC))


# -- the records


def test_records_round_trip_and_budget_keys_with_slashes_stay_whole():
    key = record_key("billing", "per-client", "client_id=a/b%c", "host-1-ab")
    assert key == b"billing/per-client/client_id=a%2Fb%25c/host-1-ab"
    value = record_value(Load(0.123456, 2.5))
    assert value == b'{"r":0.1235,"d":2.5}'
    got = decode_record(key, value, 12.5)
    assert got == Report("billing", "per-client", "client_id=a/b%c", "host-1-ab", 0.1235, 2.5, 12.5)


@pytest.mark.parametrize("key, value", [
    (None, b'{"r":1,"d":1}'),                    # no key
    (b"a/b/c/d", None),                          # a tombstone
    (b"a/b/c", b'{"r":1,"d":1}'),                # three parts
    (b"a/b/c/d", b"not json"),
    (b"a/b/c/d", b'{"r":1}'),
    (b"a/b/c/d", b'{"r":-1,"d":1}'),
    (b"a/b/c/d", b'{"r":1,"d":NaN}'),
    (b"a/b/c/d", b'{"r":"x","d":1}'),
    (b"\xff/b/c/d", b'{"r":1,"d":1}'),
    (b"a/b/c/d", b"[" * 5000),                  # larger than any record kproxy writes
])
def test_anything_else_on_the_topic_is_ignored(key, value):
    assert decode_record(key, value, 1.0) is None


def test_demand_counts_the_time_clients_were_told_to_wait():
    assert demand_of(0.5, 0.0) == 0.5
    assert demand_of(0.2, 0.5) == pytest.approx(0.4)      # let through half the time: twice the demand
    # Beyond the whole limit it is the whole limit: two clients muted nearly always, one on a bigger
    # share than the other, want the same, and get the same from then on.
    assert demand_of(0.2, 0.95) == demand_of(0.4, 0.97) == 1.0
    assert demand_of(0.5, 5.0) == 1.0 and demand_of(1.2, 0.0) == 1.2


# -- the quota engine


def test_a_coordinated_budget_is_held_to_its_share_of_the_whole_limit(tmp_path):
    f = quota_filter(tmp_path, ONE_K % ("client_id", 1), share=0.5)
    f = type(f)(f.source, 11, 1.0, 0.5, coordinated=True)
    s = session(f)
    assert produce_once(s, 500)[0].body.throttle_time_ms == 0          # new budgets start at the static share
    budget = f.budgets.peek(("one-k", "client_id=app"))
    assert budget is not None and budget.share == 0.5
    budget.share = 0.25                                                  # the coordinator moved it
    at(s, 101.0)
    # 750 bytes in the window against 250/s over 1 s of burst: (750 - 250) / 250 s.
    assert produce_once(s, 250)[0].body.throttle_time_ms == 2000
    [(key, _, load)] = f.loads(101.0)
    assert key == ("one-k", "client_id=app")
    assert load.rate == pytest.approx(0.75)         # 750 bytes over the 1 s measured, of the whole 1000/s
    assert load.demand > load.rate                                      # the throttle counts as unmet demand


def test_an_uncoordinated_filter_reports_against_the_whole_limit_too(tmp_path):
    f = quota_filter(tmp_path, ONE_K % ("client_id", 1), share=0.5)
    s = session(f)
    produce_once(s, 400)
    [(_, budget, load)] = f.loads(100.0)
    assert budget.share == 1.0 and load.rate == pytest.approx(400 / 1.0 / 1000)


# -- the coordinator, with no broker: what it applies and logs


def coordinator(tmp_path: Path, clock: list[float]) -> tuple[Coordinator, object]:
    cfg = config_from_args("127.0.0.1:9092", "127.0.0.1:19092", quota_replicas=2)
    cfg = attrs.evolve(cfg, quota=QuotaConfig(coordination=CoordinationConfig(fleet="billing")))
    base = quota_filter(tmp_path, ONE_K % ("client_id", 1))
    f = type(base)(base.source, 11, 1.0, cfg.quota_share(), coordinated=True)
    c = Coordinator(cfg, f, cfg.quota_share(), instance="me", wall=lambda: clock[0], clock=lambda: clock[0])
    return c, f


def test_the_coordinator_sets_shares_and_logs_each_switch_once(tmp_path, caplog):
    clock = [100.0]
    c, f = coordinator(tmp_path, clock)
    s = session(f)
    produce_once(s, 300)
    budget = f.budgets.peek(("one-k", "client_id=app"))
    assert budget is not None and budget.share == 0.5
    caplog.set_level(logging.INFO, "kproxy.quota.coordination")
    c.apply()                                            # nothing read back yet: static
    assert budget.share == 0.5 and not c.up
    for i in range(6):
        clock[0] = 100.0 + 0.5 * i
        c.shares.observe(report("me", 0.3, clock[0], key=("one-k", "client_id=app")))
        c.shares.observe(report("peer", 0.9, clock[0], key=("one-k", "client_id=app")))
        c.apply()
    assert c.up and budget.share < 0.5                   # a busier peer: towards 1/4
    clock[0] += STALE                                    # nothing read back since
    c.apply()
    c.apply()
    assert not c.up and budget.share == 0.5
    lines = [r.getMessage() for r in caplog.records]
    assert sum("coordinated through topic __kproxy_quotas" in m for m in lines) == 1
    assert sum("falling back to the static share" in m for m in lines) == 1
    assert c.snapshot()["switches"] == 2


# -- settings


@pytest.mark.parametrize("settings, problem", [
    ({"fleet": ""}, "is not a fleet name"),
    ({"fleet": "a/b"}, "is not a fleet name"),
    ({"fleet": "f", "topic": "no spaces"}, "is not a Kafka topic name"),
    ({"fleet": "f", "publish_interval_ms": 10}, "at least 50"),
    ({"fleet": "f", "stale_after_s": 0.5}, "at least two publish intervals"),
    ({"fleet": "f", "replication_factor": 0}, "-1 (the broker's default) or at least 1"),
])
def test_coordination_settings_are_checked(settings, problem):
    with pytest.raises(ConfigError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        CoordinationConfig(**settings)


def test_the_contract_names_load_from_yaml_and_errors_name_file_and_line(tmp_path):
    from kproxy.config import load_config

    path = tmp_path / "kproxy.yaml"
    path.write_text("listen: 127.0.0.1:9092\nupstream: {bootstrap_servers: [127.0.0.1:9093]}\nquota:\n"
                    "  coordination:\n    topic: __kproxy_quotas\n    fleet: billing\n"
                    "    publish_interval_ms: 500\n    stale_after_s: 5\n")
    coord = load_config(path).quota.coordination
    assert coord == CoordinationConfig(fleet="billing", topic="__kproxy_quotas", publish_interval_ms=500,
                                       stale_after_s=5.0)
    path.write_text(path.read_text().replace("stale_after_s: 5", "stale_after_s: 0.2"))
    with pytest.raises(ConfigError, match=r"kproxy.yaml:8: quota.coordination.stale_after_s: must be at least"):
        load_config(path)


def test_per_connection_budgets_are_not_reported_to_the_fleet_and_keep_the_whole_limit(tmp_path):
    base = quota_filter(tmp_path, ONE_K % ("connection", 1))
    f = type(base)(base.source, 11, 1.0, 0.5, coordinated=True)
    s = session(f)
    produce_once(s, 300)
    assert len(f.budgets) == 1 and f.loads(100.0) == []
    # The coordinator, down, sets every budget to the static share (a half): a connection's is whole.
    cfg = config_from_args("127.0.0.1:9092", "127.0.0.1:19092", quota_replicas=2)
    cfg = attrs.evolve(cfg, quota=QuotaConfig(coordination=CoordinationConfig(fleet="billing")))
    c = Coordinator(cfg, f, cfg.quota_share(), instance="me", wall=lambda: 100.0, clock=lambda: 100.0)
    c.apply()
    assert not c.up
    assert produce_once(s, 700)[0].body.throttle_time_ms == 0       # 1000 of 1000/s, not of 500/s
    assert produce_once(s, 500)[0].body.throttle_time_ms == 500     # (1500 - 1000) / 1000 s


def test_only_peer_records_of_budgets_in_use_are_kept_and_writers_are_bounded():
    fs = known_for_a_while(FleetShares("billing", "me", STATIC, STALE, max_instances=3), 1000.0)
    fs.interest = {KEY}
    fs.observe(report("me", 0.5, 1000.0))
    for i in range(100):        # someone writes about budgets this process never uses
        fs.observe(report("p1", 0.5, 1000.0, key=("q", f"client_id=other-{i}")))
    assert fs.target(KEY, 0.5, 1000.0) == 1.0 and len(fs._peers) == 0
    assert fs.peer_count(1000.0) == 1                     # p1 is alive all the same
    for i in range(10):         # forged instance names: three are kept, the rest ignored
        fs.observe(report(f"forged-{i}", 5.0, 1000.0))
    assert fs.peer_count(1000.0) == 3
    assert [p.instance for p in fs.fresh_peers(KEY, 1000.0)] == ["forged-0", "forged-1"]
    assert fs.target(KEY, 0.5, 1000.0) == pytest.approx(0.5 / 3)      # the floor holds against them

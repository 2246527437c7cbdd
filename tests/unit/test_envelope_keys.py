"""DEK lifetimes, renewal ahead of need, the unwrap cache and KMS call bookkeeping (kproxy.envelope.keys),
with the time handed in."""

from __future__ import annotations

import itertools
import os

import pytest

from kproxy.envelope import Calls, DataKey, KeyPolicy, KeyRef, KeyRing, Kms, UnwrapCache

_serial = itertools.count()


def new_dek(kek: str = "k1", at: float = 0.0) -> DataKey:
    return DataKey(KeyRef(Kms.LOCAL_FILE, kek, b"wrapped-%d" % next(_serial)), os.urandom(32), at)


class FakeKms:
    """Answers every due KMS call at once: the ring's view of a healthy KMS."""

    def __init__(self, ring: KeyRing) -> None:
        self.ring = ring
        self.calls = 0
        self.now = 0.0

    def __call__(self, kek: str) -> None:
        if self.ring.start(kek, self.now):
            self.calls += 1
            self.ring.add(kek, new_dek(kek, self.now))


def ring_with(policy: KeyPolicy) -> tuple[KeyRing, list[str]]:
    asked: list[str] = []
    return KeyRing(policy, on_due=asked.append, jitter=lambda: 0.5), asked


def test_rotation_by_count_asks_for_the_next_dek_before_the_current_runs_out():
    ring, asked = ring_with(KeyPolicy(max_records=100, renew_at=0.8))
    assert ring.reserve("k1", 10, 0) is None and asked == ["k1"]
    assert ring.start("k1", 0)
    first = new_dek()
    ring.add("k1", first)
    asked.clear()
    for _ in range(7):
        assert ring.reserve("k1", 10, 1) == [(first, 10)]
    assert asked == []                        # 30 left: more than a fifth
    assert ring.reserve("k1", 10, 1) == [(first, 10)]
    assert asked == ["k1"]                    # 20 left: the next one is due now, not when it runs out
    assert ring.start("k1", 1)
    second = new_dek(at=1)
    ring.add("k1", second)
    # A batch larger than what is left of the first spans both; no DEK seals more than 100 records.
    assert ring.reserve("k1", 50, 2) == [(first, 20), (second, 30)]
    assert first.used == 100 and ring.ready("k1") == (second,)


def test_rotation_by_time():
    ring, asked = ring_with(KeyPolicy(max_records=1000, max_age_s=100, renew_at=0.8))
    ring.start("k1", 0)
    first = new_dek(at=0)
    ring.add("k1", first)
    assert ring.reserve("k1", 1, 79) == [(first, 1)] and asked == []
    assert ring.reserve("k1", 1, 80) == [(first, 1)] and asked == ["k1"]
    assert ring.due(80) == ["k1"]
    ring.start("k1", 80)
    second = new_dek(at=80)
    ring.add("k1", second)
    assert ring.due(81) == []
    assert ring.reserve("k1", 1, 99) == [(first, 1)]   # the older one first, while it lasts
    assert ring.reserve("k1", 1, 100) == [(second, 1)]  # expired at 100
    assert ring.ready("k1") == (second,)
    assert ring.reserve("k1", 1, 180) is None           # the second expired too: nothing left


def test_renewal_never_stalls_a_steady_producer():
    """Kroxylicious #757/#1526: at a low per-DEK limit and a steady rate, no batch ever finds the
    supply empty when the KMS answers within the renewal margin."""
    policy = KeyPolicy(max_records=500, max_age_s=5.0, renew_at=0.8)
    ring = KeyRing(policy, jitter=lambda: 0.5)
    kms = FakeKms(ring)
    ring.on_due = kms
    ring.start("k1", 0)
    ring.add("k1", new_dek(at=0))
    stalls = 0
    per_dek: dict[bytes, int] = {}
    for i in range(20_000):                   # 3,000 records/s for 2,000 s: every 2nd batch of ~37
        kms.now = now = i * 0.1
        grants = ring.reserve("k1", 300 if i % 2 else 7, now)
        if grants is None:
            stalls += 1
            continue
        for dek, count in grants:
            per_dek[dek.ref.wrapped] = per_dek.get(dek.ref.wrapped, 0) + count
    assert stalls == 0
    assert max(per_dek.values()) <= 500
    # One KMS call per DEK: as many calls as DEKs used, plus at most the one fetched ahead.
    assert len(per_dek) <= kms.calls + 1 <= len(per_dek) + 2


def test_a_batch_larger_than_a_dek_waits_for_enough_deks():
    ring, _asked = ring_with(KeyPolicy(max_records=1000))
    assert ring.reserve("k1", 2500, 0) is None
    for _ in range(3):
        assert ring.due(0) == ["k1"]
        ring.start("k1", 0)
        ring.add("k1", new_dek())
    grants = ring.reserve("k1", 2500, 0)
    assert grants is not None and [c for _, c in grants] == [1000, 1000, 500]


def test_one_call_per_kek_at_a_time():
    ring, asked = ring_with(KeyPolicy())
    for _ in range(100):
        assert ring.reserve("k1", 1, 0) is None
    assert asked == ["k1"] * 100 or asked[:1] == ["k1"]
    assert ring.start("k1", 0)
    asked.clear()
    for _ in range(100):                       # waiters while the call is in flight ask nothing more
        assert ring.reserve("k1", 1, 0) is None
    assert asked == [] and not ring.start("k1", 0) and ring.due(0) == []
    assert ring.start("k2", 0)                 # another KEK has its own call


def test_failures_back_off_exponentially_and_say_why():
    ring, asked = ring_with(KeyPolicy(backoff_initial_s=1.0, backoff_max_s=5.0))
    err = RuntimeError("kms down")
    at = 0.0
    delays = []
    for _ in range(5):
        assert ring.start("k1", at)
        retry = ring.failed("k1", at, err, retriable=True)
        delays.append(retry - at)
        assert ring.error("k1", at) is err and not ring.start("k1", at) and ring.due(at) == []
        asked.clear()
        assert ring.reserve("k1", 1, at) is None and asked == []   # no call while backing off
        at = retry
    assert delays == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert ring.error("k1", at) is None and ring.start("k1", at)
    ring.add("k1", new_dek(at=at))
    assert ring.calls.failures("k1") == 0 and ring.reserve("k1", 1, at) is not None


def test_jitter_spreads_retries():
    calls: Calls[str] = Calls(1.0, 60.0, jitter=iter([0.0, 0.999]).__next__)
    assert calls.failed("a", 0, RuntimeError()) == 0.75
    assert calls.failed("b", 0, RuntimeError()) == pytest.approx(1.25, abs=0.01)


def test_a_non_retriable_failure_stops_sealing_with_that_kek():
    """A KEK the KMS says is gone: records sealed with its DEKs might never open again."""
    ring, _ = ring_with(KeyPolicy())
    ring.start("k1", 0)
    ring.add("k1", new_dek())
    ring.start("k1", 1)
    ring.failed("k1", 1, RuntimeError("retriable"), retriable=True)
    assert ring.reserve("k1", 1, 1) is not None             # a passing outage keeps the DEK it has
    ring.calls.in_flight.add("k1")
    ring.failed("k1", 2, LookupError("unknown key"), retriable=False)
    assert ring.reserve("k1", 1, 2) is None and isinstance(ring.error("k1", 2), LookupError)


def test_idle_keks_are_not_renewed_and_are_forgotten():
    ring, _ = ring_with(KeyPolicy(max_age_s=100, idle_s=30))
    for kek in ("busy", "idle"):
        ring.start(kek, 0)
        ring.add(kek, new_dek(kek, at=0))
        ring.reserve(kek, 1, 0)
    ring.reserve("busy", 1, 80)
    assert ring.due(85) == ["busy"]            # "idle" last produced 85 s ago
    assert ring.forget_idle(85) == 0           # its DEK still lives
    assert ring.forget_idle(101) == 1 and ring.keks() == ["busy"]


def test_policy_limits():
    with pytest.raises(ValueError, match="2\\*\\*30"):
        KeyPolicy(max_records=1 << 31)
    with pytest.raises(ValueError, match="renew_at"):
        KeyPolicy(renew_at=1.0)
    with pytest.raises(ValueError, match="max_age_s"):
        KeyPolicy(max_age_s=0)
    assert KeyPolicy().max_records == 1 << 24


def test_calls_remember_a_bounded_number_of_failures():
    calls: Calls[int] = Calls(1.0, 2.0, max_keys=10)
    for key in range(50):
        calls.failed(key, 0, RuntimeError())
    assert calls.backing_off(0) == 10 and calls.failures(0) == 0 and calls.failures(49) == 1


def test_unwrap_cache_is_bounded_by_count():
    cache = UnwrapCache(max_entries=3, max_age_s=100)
    deks = [new_dek() for _ in range(4)]
    for d in deks[:3]:
        cache.put(d, 0)
    assert cache.get(deks[0].ref, 1) is deks[0]      # now the most recently used
    cache.put(deks[3], 1)
    assert len(cache) == 3 and cache.evicted == 1
    assert cache.get(deks[1].ref, 1) is None          # the least recently used went out
    found, missing = cache.lookup([d.ref for d in deks], 1)
    assert set(found) == {deks[0].ref, deks[2].ref, deks[3].ref} and missing == [deks[1].ref]


def test_unwrap_cache_is_bounded_by_time_from_the_unwrap():
    cache = UnwrapCache(max_entries=10, max_age_s=60)
    d = new_dek()
    cache.put(d, 0)
    for t in range(0, 60, 10):
        assert cache.get(d.ref, t) is d                # hits do not extend its life
    assert cache.get(d.ref, 60) is None and len(cache) == 0
    assert (cache.hits, cache.misses) == (6, 1)


def test_a_fast_producer_and_a_slow_kms_move_the_renewal_earlier():
    """At 1,000 records/s and a KMS that took 0.5 s, the next DEK is asked for while 1,000 records
    (twice what one call's time lets through) are left, not at the 20% margin of 200."""
    ring, asked = ring_with(KeyPolicy(max_records=1000, renew_at=0.8))
    assert ring.start("k1", 0)
    ring.add("k1", new_dek(at=0.5))
    left = []
    for i in range(10):
        ring.reserve("k1", 50, 0.5 + i * 0.05)
        if asked:
            left.append(1000 - ring.ready("k1")[0].used)
            break
    assert left and left[0] > 200

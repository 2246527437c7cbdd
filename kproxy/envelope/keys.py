"""How long a DEK serves and which DEKs are kept: the policy, the encryption side's ring of DEKs per
KEK, the decryption side's cache of unwrapped DEKs, and the single-flight and backoff table behind
every KMS call. Pure: the time is passed in (``now``), and the KMS calls themselves are the caller's
(``kproxy.kms.service``); these classes only say when one is due and keep what it brought.

A DEK seals at most ``max_records`` records and serves at most ``max_age_s`` from when kproxy got
it. The next one is asked for once the supply falls to ``1 - renew_at`` of a DEK's records (or to
the largest batch seen, or to twice what the recent rate seals during one KMS call, if more), or
the youngest DEK has lived ``renew_at`` of its time, so a produce does not wait for a renewal while the
KEK is in use (Kroxylicious #757, #1526). Every new DEK is wrapped with the KEK's latest version, so
new records use a rotated KEK at most ``max_age_s`` (plus one KMS call) after the rotation (#1339);
no KEK version is ever cached (#1767).
"""

from __future__ import annotations

import random
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable
from typing import Any, Final, Generic, TypeVar

import attrs

from kproxy.envelope.aead import DataKey
from kproxy.envelope.format import KeyRef

# NIST SP 800-38D 8.3: at most 2**32 invocations per key with random 96-bit nonces. The setting may
# not exceed a quarter of that; ``reserve`` never gives a DEK more records than the setting.
MAX_RECORDS_PER_DEK: Final = 1 << 30

RATE_WINDOW_S: Final = 0.2   # records sealed per KEK are counted over windows this long

K = TypeVar("K", bound=Hashable)


def _check_positive(_instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not value > 0:
        raise ValueError(f"{attribute.name} must be greater than 0, got {value!r}")


@attrs.frozen
class KeyPolicy:
    """How DEKs are renewed and cached, and how KMS failures back off."""

    # Records one DEK seals: 2**24 (16.8 million) is 256 times below NIST's bound for random nonces.
    max_records: int = attrs.field(default=1 << 24, validator=_check_positive)
    max_age_s: float = attrs.field(default=600.0, validator=_check_positive)
    # The next DEK is asked for when this share of the current one's records or time is spent.
    renew_at: float = 0.8
    # A KEK with no produce for this long is not renewed ahead (default: max_age_s).
    idle_s: float | None = None
    # Unwrapped DEKs kept for decryption: at most this many, each for at most cache_age_s from when it
    # was unwrapped (which also bounds how long a KEK revoked in the KMS still decrypts here).
    cache_entries: int = attrs.field(default=1024, validator=_check_positive)
    cache_age_s: float = attrs.field(default=600.0, validator=_check_positive)
    backoff_initial_s: float = attrs.field(default=0.25, validator=_check_positive)
    backoff_max_s: float = attrs.field(default=10.0, validator=_check_positive)

    def __attrs_post_init__(self) -> None:
        if self.max_records > MAX_RECORDS_PER_DEK:
            raise ValueError(f"max_records may be at most {MAX_RECORDS_PER_DEK} (2**30), got {self.max_records}")
        if not 0 < self.renew_at < 1:
            raise ValueError(f"renew_at must be between 0 and 1, got {self.renew_at}")
        if self.idle_s is not None and not self.idle_s > 0:
            raise ValueError(f"idle_s must be greater than 0, got {self.idle_s}")
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("backoff_max_s must be at least backoff_initial_s")

    @property
    def renew_margin(self) -> int:
        """Records left on a KEK's DEKs at which the next DEK is asked for."""
        return max(1, round(self.max_records * (1 - self.renew_at)))

    @property
    def idle_after_s(self) -> float:
        return self.max_age_s if self.idle_s is None else self.idle_s


@attrs.define(slots=True)
class _Failure:
    count: int
    retry_at: float
    error: Exception


class Calls(Generic[K]):
    """Single flight and backoff for calls by key: at most one call per key at a time, however many
    requests wait for it (Kroxylicious #1426), and after a failure none before its retry time
    (exponential, with jitter, up to ``max_s``). Failures are remembered for at most ``max_keys`` keys."""

    def __init__(self, initial_s: float, max_s: float, *, jitter: Callable[[], float] = random.random,
                 max_keys: int = 4096) -> None:
        self.initial_s = initial_s
        self.max_s = max_s
        self.jitter = jitter
        self.max_keys = max_keys
        self.in_flight: set[K] = set()
        self._failed: OrderedDict[K, _Failure] = OrderedDict()

    def may_start(self, key: K, now: float) -> bool:
        if key in self.in_flight:
            return False
        f = self._failed.get(key)
        return f is None or now >= f.retry_at

    def start(self, key: K, now: float) -> bool:
        """Claim the call for ``key``: False if one is in flight or the key is backing off."""
        if not self.may_start(key, now):
            return False
        self.in_flight.add(key)
        return True

    def succeeded(self, key: K) -> None:
        self.in_flight.discard(key)
        self._failed.pop(key, None)

    def failed(self, key: K, now: float, error: Exception) -> float:
        """Record a failed call; returns when the next may start."""
        self.in_flight.discard(key)
        f = self._failed.pop(key, None)
        count = 1 if f is None else f.count + 1
        delay = min(self.max_s, self.initial_s * 2 ** min(count - 1, 32))
        delay *= 0.75 + 0.5 * self.jitter()   # 75% to 125%, so a fleet's retries do not march together
        retry_at = now + min(delay, self.max_s)
        self._failed[key] = _Failure(count, retry_at, error)
        while len(self._failed) > self.max_keys:
            self._failed.popitem(last=False)
        return retry_at

    def error(self, key: K, now: float) -> Exception | None:
        """The last failure's error while ``key`` backs off, else None."""
        f = self._failed.get(key)
        return f.error if f is not None and now < f.retry_at else None

    def failures(self, key: K) -> int:
        f = self._failed.get(key)
        return 0 if f is None else f.count

    def backing_off(self, now: float) -> int:
        return sum(1 for f in self._failed.values() if now < f.retry_at)


@attrs.define(slots=True, eq=False)
class _Supply:
    ready: deque[DataKey] = attrs.field(factory=deque)   # oldest first; the front one seals first
    waiting: int = 0          # the largest batch that found too few records left
    largest: int = 0          # the largest batch reserved: the supply is refilled before it runs below
    last_used: float = float("-inf")
    # Records per second sealed lately, and how long the last KMS call took: the supply is refilled
    # while what is left lasts twice that long at that rate.
    rate: float = 0.0
    window_start: float = float("-inf")
    window_records: int = 0
    asked_at: float | None = None
    latency: float = 0.0

    def count(self, n: int, now: float) -> None:
        elapsed = now - self.window_start
        if elapsed >= RATE_WINDOW_S:
            # A burst raises the rate at once; a quiet spell halves it per window.
            self.rate = max(self.window_records / elapsed, self.rate / 2)
            self.window_start, self.window_records = now, 0
        self.window_records += n


class KeyRing:
    """The DEKs that seal new records, per KEK. ``reserve`` hands out records on them; when a KEK's
    supply should be refilled, ``on_due(kek)`` is called (and ``due`` lists them for a timer) so
    that the caller starts a KMS call, claimed with ``start`` and ended with ``add`` or ``failed``."""

    def __init__(self, policy: KeyPolicy, *, on_due: Callable[[str], object] | None = None,
                 jitter: Callable[[], float] = random.random) -> None:
        self.policy = policy
        self.on_due = on_due
        self.calls: Calls[str] = Calls(policy.backoff_initial_s, policy.backoff_max_s, jitter=jitter)
        self._supplies: dict[str, _Supply] = {}
        self.generated = 0
        self.retired = 0

    def reserve(self, kek: str, n: int, now: float) -> list[tuple[DataKey, int]] | None:
        """``n`` records on ``kek``'s DEKs, as ``[(dek, count), ...]`` (more than one only when the
        batch outgrows the current DEK), or None when the supply is short: a KMS call is then due."""
        s = self._supplies.get(kek)
        if s is None:
            s = self._supplies[kek] = _Supply()
        s.last_used = now
        if n <= 0:
            return []
        if n > s.largest:
            s.largest = min(n, self.policy.max_records)
        ready = s.ready
        self._prune(ready, now)
        limit = self.policy.max_records
        if sum(limit - d.used for d in ready) < n:
            s.waiting = max(s.waiting, n)
            self._check(kek, s, now)
            return None
        grants = []
        left = n
        for d in ready:
            take = min(limit - d.used, left)
            if take:
                d.used += take
                grants.append((d, take))
                left -= take
                if not left:
                    break
        if n >= s.waiting:
            s.waiting = 0
        s.count(n, now)
        self._prune(ready, now)
        self._check(kek, s, now)
        return grants

    def add(self, kek: str, dek: DataKey) -> None:
        """A DEK the KMS gave for ``kek`` (``dek.created_at`` is when it arrived)."""
        s = self._supplies.setdefault(kek, _Supply())
        s.ready.append(dek)
        if s.asked_at is not None:
            s.latency = max(0.0, dek.created_at - s.asked_at)
            s.asked_at = None
        self.calls.succeeded(kek)
        self.generated += 1

    def failed(self, kek: str, now: float, error: Exception, *, retriable: bool) -> float:
        """A KMS call for ``kek`` failed. A non-retriable failure (the KEK is unknown, access is
        denied) also drops its DEKs: records sealed now might never be opened again."""
        if not retriable:
            s = self._supplies.get(kek)
            if s is not None:
                self.retired += len(s.ready)
                s.ready.clear()
        return self.calls.failed(kek, now, error)

    def start(self, kek: str, now: float) -> bool:
        if not self.calls.start(kek, now):
            return False
        self._supplies.setdefault(kek, _Supply()).asked_at = now
        return True

    def error(self, kek: str, now: float) -> Exception | None:
        """Why ``kek`` has no DEK while its KMS calls back off."""
        return self.calls.error(kek, now)

    def due(self, now: float) -> list[str]:
        """KEKs in use whose supply should be refilled now and whose KMS call may start."""
        idle = now - self.policy.idle_after_s
        out = []
        for kek, s in self._supplies.items():
            self._prune(s.ready, now)
            if (s.waiting or s.last_used >= idle) and self._needs(s, now) and self.calls.may_start(kek, now):
                out.append(kek)
        return out

    def forget_idle(self, now: float) -> int:
        """Drop KEKs not used for ``idle_after_s`` whose DEKs have all expired; returns how many."""
        idle = now - self.policy.idle_after_s
        gone = []
        for kek, s in self._supplies.items():
            self._prune(s.ready, now)
            if not s.ready and not s.waiting and s.last_used < idle and kek not in self.calls.in_flight:
                gone.append(kek)
        for kek in gone:
            del self._supplies[kek]
        return len(gone)

    def ready(self, kek: str) -> tuple[DataKey, ...]:
        s = self._supplies.get(kek)
        return () if s is None else tuple(s.ready)

    def keks(self) -> list[str]:
        return list(self._supplies)

    def _prune(self, ready: deque[DataKey], now: float) -> None:
        p = self.policy
        while ready and (ready[0].used >= p.max_records or now - ready[0].created_at >= p.max_age_s):
            ready.popleft()
            self.retired += 1
        # A younger DEK can expire before an older one only if the clock went back; drop those too.
        if any(now - d.created_at >= p.max_age_s for d in ready):
            kept = [d for d in ready if now - d.created_at < p.max_age_s]
            self.retired += len(ready) - len(kept)
            ready.clear()
            ready.extend(kept)

    def _needs(self, s: _Supply, now: float) -> bool:
        p = self.policy
        ready = s.ready
        if not ready:
            return True
        left = sum(p.max_records - d.used for d in ready)
        # Ahead of need: when what is left is down to the renewal margin, to the largest batch seen, or
        # to twice what the last KMS call's time lets through at the recent rate (a low max_records
        # against large batches or a high rate, Kroxylicious #1526).
        if left - s.waiting <= max(p.renew_margin, s.largest, 2 * s.rate * s.latency):
            return True
        return now - ready[-1].created_at >= p.renew_at * p.max_age_s

    def _check(self, kek: str, s: _Supply, now: float) -> None:
        if self.on_due is not None and self._needs(s, now) and self.calls.may_start(kek, now):
            self.on_due(kek)


class UnwrapCache:
    """Unwrapped DEKs for opening records, by reference: at most ``max_entries`` (least recently used
    out first), each for at most ``max_age_s`` from when it was put (a hit does not extend it)."""

    def __init__(self, max_entries: int, max_age_s: float) -> None:
        self.max_entries = max_entries
        self.max_age_s = max_age_s
        self._entries: OrderedDict[KeyRef, tuple[DataKey, float]] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self.evicted = 0

    def get(self, ref: KeyRef, now: float) -> DataKey | None:
        e = self._entries.get(ref)
        if e is not None:
            if now < e[1]:
                self._entries.move_to_end(ref)
                self.hits += 1
                return e[0]
            del self._entries[ref]
        self.misses += 1
        return None

    def put(self, dek: DataKey, now: float) -> None:
        self._entries[dek.ref] = (dek, now + self.max_age_s)
        self._entries.move_to_end(dek.ref)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
            self.evicted += 1

    def lookup(self, refs: Iterable[KeyRef], now: float) -> tuple[dict[KeyRef, DataKey], list[KeyRef]]:
        """``(found, missing)`` for a batch's references."""
        found: dict[KeyRef, DataKey] = {}
        missing: list[KeyRef] = []
        for ref in refs:
            dek = self.get(ref, now)
            if dek is None:
                missing.append(ref)
            else:
                found[ref] = dek
        return found, missing

    def __len__(self) -> int:
        return len(self._entries)

"""Kafka's sampled rate and throttle time: the measure a broker's client quota manager acts on.

A rate is kept as a few samples of ``window_s`` seconds each (Kafka's ``quota.window.num`` and
``quota.window.size.seconds``, 11 and 1 by default); samples older than the whole span are forgotten,
so a burst after an idle minute is judged on its own. The throttle time is how long the client must
stay quiet for the measured rate to fall back to the quota, as in Kafka's ``QuotaUtils``. Pure:
callers pass the time in seconds; nothing here reads a clock.
"""

from __future__ import annotations

import math

import attrs


@attrs.frozen(slots=True)
class Windows:
    """How rates are sampled: ``samples`` samples of ``window_s`` seconds each; at least
    ``min_full_windows`` whole windows are assumed when the rate is measured (Kafka assumes
    ``samples - 1``; kproxy sets it from a quota's ``burst_s``)."""

    samples: int = 11
    window_s: float = 1.0
    min_full_windows: float = 10.0

    @classmethod
    def for_burst(cls, samples: int, window_s: float, burst_s: float) -> Windows:
        """The windows of a quota that lets ``burst_s`` seconds of its rate through at once.

        A rate measured right after an idle spell is the bytes over ``burst_s`` seconds (plus the part
        of the current window already gone), so ``burst_s * rate`` passes before any throttle. The
        samples then cover at least the burst and the window in progress, or the burst would outlive
        the usage it is measured against.
        """
        needed = math.ceil(burst_s / window_s - 1e-9) + 1
        return cls(max(samples, needed), window_s, burst_s / window_s)


class _Sample:
    __slots__ = ("last_event", "start", "value")

    def __init__(self, now: float) -> None:
        self.start = now
        self.last_event = now
        self.value = 0.0

    def reset(self, now: float) -> None:
        self.start = now
        self.last_event = now
        self.value = 0.0


class SampledRate:
    """A sum over sliding sample windows, measured as a rate per second (Kafka's ``Rate`` over a
    ``WindowedSum``): a sample is complete once ``window_s`` has passed since it started, and one
    extra sample is kept so the oldest still overlapping the span is never dropped early. The sum,
    the oldest start and the earliest time a sample can expire are kept as samples change, so a
    measurement costs a few operations, not a pass over the samples."""

    __slots__ = ("_current", "_expire", "_oldest", "_samples", "_stale_at", "_total")

    def __init__(self) -> None:
        self._samples: list[_Sample] = []
        self._current = 0
        self._total = 0.0
        self._oldest = 0.0       # the earliest start of a sample
        self._stale_at = 0.0     # no sample can be older than the span before this time
        self._expire = 0.0       # the span _stale_at was computed for

    def _first(self, now: float, windows: Windows) -> _Sample:
        sample = _Sample(now)
        self._samples.append(sample)
        self._current = 0
        self._oldest = now
        self._expire = windows.samples * windows.window_s
        self._stale_at = now + self._expire
        return sample

    def _reset(self, sample: _Sample, now: float) -> None:
        self._total -= sample.value
        was_oldest = sample.start == self._oldest
        sample.reset(now)
        if was_oldest:
            self._oldest = min(s.start for s in self._samples)

    def record(self, value: float, now: float, windows: Windows) -> None:
        samples = self._samples
        sample = samples[self._current] if samples else self._first(now, windows)
        if now - sample.start >= windows.window_s:
            self._current = (self._current + 1) % (windows.samples + 1)
            if self._current >= len(samples):
                sample = _Sample(now)
                samples.append(sample)
            else:
                sample = samples[self._current]
                self._reset(sample, now)
        sample.value += value
        sample.last_event = now
        self._total += value

    def _purge(self, now: float, windows: Windows) -> None:
        # A sample with no event within the whole span counts for nothing any more.
        expire = windows.samples * windows.window_s
        if now < self._stale_at and expire == self._expire:
            return
        for sample in self._samples:
            if now - sample.last_event >= expire:
                self._reset(sample, now)
        self._expire = expire
        self._stale_at = min(s.last_event for s in self._samples) + expire

    def measured(self, now: float, windows: Windows) -> tuple[float, float]:
        """(what was recorded within the span, the seconds it is measured over). The seconds run
        from the start of the oldest sample still in the span, but count at least
        ``min_full_windows`` whole windows more than have passed (Kafka's ``Rate.windowSize``)."""
        if not self._samples:
            self._first(now, windows)
        self._purge(now, windows)
        elapsed = now - self._oldest
        full = math.floor(elapsed / windows.window_s)
        if full < windows.min_full_windows:
            elapsed += (windows.min_full_windows - full) * windows.window_s
        return self._total, elapsed

    def total(self, now: float, windows: Windows) -> float:
        return self.measured(now, windows)[0]

    def window_size(self, now: float, windows: Windows) -> float:
        return self.measured(now, windows)[1]

    def measure(self, now: float, windows: Windows) -> float:
        """The rate per second."""
        total, window = self.measured(now, windows)
        return total / window

    def record_and_throttle(self, value: float, now: float, windows: Windows, bound: float) -> float:
        """Record ``value``, then the throttle time in seconds (0 within the quota) as Kafka computes it
        right after recording: the usage over the quota, spread back over the measured window."""
        self.record(value, now, windows)
        if self._total <= bound * windows.min_full_windows * windows.window_s:
            return 0.0      # within the quota over the shortest window a rate is measured over
        total, window = self.measured(now, windows)
        return throttle_seconds(total / window, bound, window)

    def allowance(self, now: float, windows: Windows, bound: float) -> float:
        """How much could be recorded now without a throttle (0 or less while over the quota)."""
        total, window = self.measured(now, windows)
        return bound * window - total

    def least_allowance(self, windows: Windows, bound: float) -> float:
        """A lower bound of ``allowance`` that needs no time: the room left were the rate measured
        over the shortest window, with nothing forgotten yet."""
        return bound * windows.min_full_windows * windows.window_s - self._total


def throttle_seconds(rate: float, bound: float, window_s: float) -> float:
    """Kafka's throttle time for a measured ``rate`` over a quota ``bound``, measured over ``window_s``
    seconds: the delay X that makes rate * W / (W + X) equal the bound, (rate - bound) / bound * W."""
    if rate <= bound:
        return 0.0
    return (rate - bound) / bound * window_s


def to_ms(seconds: float) -> int:
    """Whole milliseconds, rounded half up as Kafka's ``Math.round`` does."""
    return math.floor(seconds * 1000 + 0.5)

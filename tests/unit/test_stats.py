"""ProxyStats: a bounded latency sample that keeps following the traffic after warm-up."""

from __future__ import annotations

from kproxy.proxy.inflight import InFlight
from kproxy.server.stats import ProxyStats


def test_the_latency_sample_stays_bounded_and_follows_later_traffic():
    stats = ProxyStats(seed=1)
    n = 5 * ProxyStats.SAMPLE
    for i in range(n):
        # Latency grows with time: a sample frozen on the first requests would put p99 near 0.2 s.
        stats.record(InFlight(i, 3, 12, started=0.0, finished_at=i / 1000.0))
    s = stats.apis["metadata"]
    assert s.count == n and len(s.latencies) == ProxyStats.SAMPLE
    p99 = sorted(s.latencies)[int(0.99 * len(s.latencies))]
    true_p99 = 0.99 * n / 1000.0
    assert abs(p99 - true_p99) < 0.02 * true_p99

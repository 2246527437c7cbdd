"""Per-API counts, bytes and latency of completed requests, for the demo and the startup summary.

Latencies are a bounded uniform sample (reservoir sampling), so percentiles keep following the
traffic after warm-up instead of freezing on the first requests. The metrics endpoint replaces this
for operators; it stays small and dependency-free.
"""

from __future__ import annotations

import random

import attrs

from kproxy.protocol.messages import api_name
from kproxy.proxy.inflight import InFlight


@attrs.define(slots=True)
class ApiStats:
    count: int = 0
    request_bytes: int = 0
    response_bytes: int = 0
    latency_sum: float = 0.0
    latencies: list[float] = attrs.field(factory=list)   # a uniform sample of at most SAMPLE values


class ProxyStats:
    """Counters kept by the server: one ``record`` per completed request."""

    SAMPLE = 10_000

    def __init__(self, seed: int = 0) -> None:
        self.apis: dict[str, ApiStats] = {}
        self.connections_total = 0
        self.connections_open = 0
        # For the metrics endpoint, counted where they happen.
        self.opened_by_listener: dict[str, int] = {}
        self.decode_errors = {"request": 0, "response": 0}
        self.upstream_connect_failures: dict[str, int] = {}
        # Connections the lane gave back, by its reason (kproxy.server.lane).
        self.lane_given_back: dict[str, int] = {}
        self._random = random.Random(seed)
        self._by_key: dict[int, ApiStats] = {}      # the same ApiStats by api key, read per request

    def _api(self, api_key: int) -> ApiStats:
        """The statistics of one api, made at its first request and then found by key."""
        name = api_name(api_key)
        s = self.apis.get(name)
        if s is None:
            s = self.apis[name] = ApiStats()
        self._by_key[api_key] = s
        return s

    def record(self, entry: InFlight) -> None:
        s = self._by_key.get(entry.api_key)
        if s is None:
            s = self._api(entry.api_key)
        s.count += 1
        s.request_bytes += entry.request_bytes
        s.response_bytes += entry.response_bytes
        end = entry.finished_at if entry.finished_at is not None else entry.started
        latency = end - entry.started
        s.latency_sum += latency
        if len(s.latencies) < self.SAMPLE:
            s.latencies.append(latency)
        else:
            # Algorithm R: the n-th value replaces a random one with probability SAMPLE/n.
            j = self._random.randrange(s.count)
            if j < self.SAMPLE:
                s.latencies[j] = latency

    def add_relayed(self, api_key: int, count: int, request_bytes: int, response_bytes: int, latency_sum: float,
                    latencies: tuple[float, ...]) -> None:
        """Requests the lane relayed (``kproxy.server.handover.merge_counts``): counts and sums whole,
        latencies from the lane's own uniform sample, each value standing for count/len of them."""
        s = self._by_key.get(api_key)
        if s is None:
            s = self._api(api_key)
        s.request_bytes += request_bytes
        s.response_bytes += response_bytes
        s.latency_sum += latency_sum
        step = count // len(latencies) if latencies else count
        for latency in latencies:
            s.count += step
            if len(s.latencies) < self.SAMPLE:
                s.latencies.append(latency)
            else:
                j = self._random.randrange(s.count)
                if j < self.SAMPLE:
                    s.latencies[j] = latency
        s.count += count - step * len(latencies)

    def opened(self, listener: str) -> None:
        self.connections_total += 1
        self.connections_open += 1
        self.opened_by_listener[listener] = self.opened_by_listener.get(listener, 0) + 1

    def upstream_failed(self, host: str, port: int) -> None:
        key = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.upstream_connect_failures[key] = self.upstream_connect_failures.get(key, 0) + 1

"""Prometheus metrics: per-API counts, bytes and latency histograms of completed requests, kept in
plain integers on the event loop, and the families read at scrape time from the objects that hold
them (connections, buffer budget, rule store, traffic log, transparency check).

prometheus-client only renders the text format (``exposition``); the data path never takes a lock.
Labels are bounded: API names, listeners, outcomes, rule names. Per-client and per-topic series exist
only when opted in (``metrics.client_labels``, ``metrics.topic_labels``), capped at
``metrics.label_cap`` values each, the rest counted under ``other``.
"""

from __future__ import annotations

import bisect
import datetime
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kproxy.config import MetricsConfig
from kproxy.proxy.inflight import STORED, STREAMED, UPSTREAM_LOST
from kproxy.telemetry.exchange import FETCH, PRODUCE, Exchange, fetched_records, produced_records

# Seconds: from sub-millisecond metadata answers to long polls and rebalances.
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
OTHER = "other"
# Durations waiting to be counted into their buckets are folded in every 1,024 requests of an API (and
# at every read), so that no more than that many are held.
FOLD_EVERY_MASK = 1023

Reader = Callable[[], Iterable[Metric]]


class Histogram:
    """Counts by bucket, a count and a sum. ``observe`` counts a value at once; the request path
    appends to ``pending`` instead (one list append, no call of its own) and ``fold`` counts what is
    pending in one pass: sorted, each bucket's share is found by bisection rather than per value.
    Everything that reads the counts folds first."""

    __slots__ = ("_buckets", "_count", "_sum", "pending")

    def __init__(self) -> None:
        self._buckets = [0] * (len(BUCKETS) + 1)   # the last one is +Inf
        self._count = 0
        self._sum = 0.0
        self.pending: list[float] = []

    def observe(self, value: float) -> None:
        self._buckets[bisect.bisect_left(BUCKETS, value)] += 1
        self._count += 1
        self._sum += value

    def fold(self) -> None:
        pending = self.pending
        if not pending:
            return
        self.pending = []
        pending.sort()
        buckets = self._buckets
        below = 0
        for i, bound in enumerate(BUCKETS):
            # A value equal to a bound is counted in that bound's bucket (le), as observe counts it.
            upto = bisect.bisect_right(pending, bound, below)
            buckets[i] += upto - below
            below = upto
        buckets[-1] += len(pending) - below
        self._count += len(pending)
        self._sum += math.fsum(pending)

    @property
    def buckets(self) -> list[int]:
        self.fold()
        return self._buckets

    @property
    def count(self) -> int:
        self.fold()
        return self._count

    @property
    def sum(self) -> float:
        self.fold()
        return self._sum

    def add_sampled(self, values: Sequence[float], count: int, total: float) -> None:
        """``count`` values of sum ``total`` known by a uniform sample of them (the lane's): the count
        and sum exact, the buckets each sampled value's share of the count."""
        if not values:
            self._buckets[-1] += count
            self._count += count
            self._sum += total
            return
        base, extra = divmod(count, len(values))
        buckets = self._buckets
        for i, value in enumerate(values):
            buckets[bisect.bisect_left(BUCKETS, value)] += base + (i < extra)
        self._count += count
        self._sum += total

    def cumulative(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        total = 0
        for bound, n in zip((*BUCKETS, float("inf")), self.buckets, strict=True):
            total += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), total))
        return out


class ApiCounters:
    __slots__ = ("added", "broker", "duration", "outcomes", "paths", "request_bytes", "request_paths", "requests",
                 "response_bytes", "stored_why")

    def __init__(self) -> None:
        self.requests = 0
        self.request_bytes = 0
        self.response_bytes = 0
        self.duration = Histogram()
        self.broker = Histogram()
        self.added = Histogram()
        self.outcomes: dict[str, int] = {}
        self.paths: dict[str, int] = {}        # broker answers by path (stored, streamed)
        self.request_paths: dict[str, int] = {}   # requests to the broker that may stream, by path
        self.stored_why: dict[str, int] = {}   # requests large enough to stream that were stored, by reason

    def fold(self) -> None:
        self.duration.fold()
        self.broker.fold()
        self.added.fold()


class Capped:
    """Counters by a label value the clients choose, at most ``cap`` values; the rest are OTHER."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.values: dict[tuple[str, ...], float] = {}
        self._keys: set[str] = set()

    def add(self, key: str, rest: tuple[str, ...], amount: float) -> None:
        if key not in self._keys:
            if len(self._keys) >= self.cap:
                key = OTHER
            else:
                self._keys.add(key)
        k = (key, *rest)
        self.values[k] = self.values.get(k, 0) + amount


def _counter(name: str, doc: str, labels: list[str], values: Mapping[Any, float]) -> Metric:
    m = CounterMetricFamily(name, doc, labels=labels)
    for key, value in sorted(values.items()):
        m.add_metric(list(key), value)
    return m


def _gauge(name: str, doc: str, labels: list[str], values: Mapping[Any, float]) -> Metric:
    m = GaugeMetricFamily(name, doc, labels=labels)
    for key, value in sorted(values.items()):
        m.add_metric(list(key), value)
    return m


class Metrics(Collector):
    """The proxy's metrics; ``record`` per completed request, ``exposition`` per scrape."""

    def __init__(self, cfg: MetricsConfig | None = None) -> None:
        self.cfg = cfg or MetricsConfig()
        self.apis: dict[str, ApiCounters] = {}
        self.records = {"produced": 0, "fetched": 0}
        self.streams_broken = 0
        self.spliced_bytes = 0
        self.requests_broken: dict[str, int] = {}   # streamed requests cut off part-way, by the side that failed
        self.answers_stored: dict[tuple[str, str], int] = {}   # large answers stored, by (api, reason)
        self.throttle_seconds: dict[str, float] = {}
        self.denied: dict[str, int] = {}
        self.records_refused: dict[str, int] = {}
        self.clients = Capped(self.cfg.label_cap) if self.cfg.client_labels else None
        self.topics = Capped(self.cfg.label_cap) if self.cfg.topic_labels else None
        self._readers: list[Reader] = []
        self._refreshers: list[Callable[[], None]] = []
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def add_reader(self, reader: Reader) -> None:
        """Families read at scrape time from another object."""
        self._readers.append(reader)

    def add_refresher(self, refresh: Callable[[], None]) -> None:
        """Called at the start of every scrape, to bring the counts up to date (the lane's)."""
        self._refreshers.append(refresh)

    def add_relayed(self, api: str, count: int, request_bytes: int, response_bytes: int, duration_sum: float,
                    durations: Sequence[float], throttle_ms: int) -> None:
        """Requests the lane relayed, in bulk (``kproxy.server.handover.merge_counts``): forwarded,
        their answers stored whole; their durations from the lane's sample (no broker or added
        duration: the lane does not time the two apart)."""
        c = self.apis.get(api)
        if c is None:
            c = self.apis[api] = ApiCounters()
        c.requests += count
        c.request_bytes += request_bytes
        c.response_bytes += response_bytes
        c.duration.fold()
        c.duration.add_sampled(durations, count, duration_sum)
        c.outcomes["forwarded"] = c.outcomes.get("forwarded", 0) + count
        c.paths[STORED] = c.paths.get(STORED, 0) + count
        if throttle_ms > 0:
            self.throttle_seconds["broker"] = self.throttle_seconds.get("broker", 0.0) + throttle_ms / 1000

    # -- per request (the event loop)

    def record(self, x: Exchange) -> None:
        e = x.entry
        c = self.apis.get(x.api)
        if c is None:
            c = self.apis[x.api] = ApiCounters()
        c.requests += 1
        c.request_bytes += e.request_bytes
        c.response_bytes += e.response_bytes
        end = e.finished_at if e.finished_at is not None else e.started
        # Durations are counted into their buckets in batches (Histogram.fold), not one call each.
        c.duration.pending.append(end - e.started)
        if e.forwarded_at is not None and e.answered_at is not None:
            broker = e.answered_at - e.forwarded_at
            c.broker.pending.append(broker)
            # What the proxy itself cost this request (queueing, decoding, filters, writing): the
            # figure an alert on kproxy's latency wants, apart from the broker's long polls.
            c.added.pending.append(max(0.0, end - e.started - broker))
        if not c.requests & FOLD_EVERY_MASK:
            c.fold()
        c.outcomes[e.outcome] = c.outcomes.get(e.outcome, 0) + 1
        if e.answered_at is not None or e.path == STREAMED:
            # The broker's answer passed through kproxy: stored whole first, or streamed.
            c.paths[e.path] = c.paths.get(e.path, 0) + 1
            if e.path == STREAMED and e.outcome == UPSTREAM_LOST:
                self.streams_broken += 1
            elif e.response_why_stored is not None and e.path == STORED:
                key = (x.api, e.response_why_stored)
                self.answers_stored[key] = self.answers_stored.get(key, 0) + 1
            if e.spliced_bytes:
                self.spliced_bytes += e.spliced_bytes
        if e.api_key == PRODUCE:
            # Requests that may stream (cut-through): how those that went to the broker got there.
            if e.forwarded_at is not None or e.request_path == STREAMED:
                c.request_paths[e.request_path] = c.request_paths.get(e.request_path, 0) + 1
            if e.why_stored is not None:
                c.stored_why[e.why_stored] = c.stored_why.get(e.why_stored, 0) + 1
            if e.broken is not None and e.request_path == STREAMED:
                self.requests_broken[e.broken] = self.requests_broken.get(e.broken, 0) + 1
        if e.api_key in (PRODUCE, FETCH):
            self._records(x)
        notes = e.notes
        if notes:
            if notes.get("action") == "deny":
                rule = str(notes.get("rule") or "default")
                self.denied[rule] = self.denied.get(rule, 0) + 1
            for refusal in notes.get("records_refused") or ():
                rule = str(refusal.get("rule"))
                self.records_refused[rule] = self.records_refused.get(rule, 0) + 1
            quota = notes.get("quota")
            if isinstance(quota, dict) and quota.get("throttle_ms"):
                rule = str(quota.get("rule") or "quota")
                self.throttle_seconds[rule] = self.throttle_seconds.get(rule, 0.0) + quota["throttle_ms"] / 1000
            elif e.throttle_ms > 0:
                self.throttle_seconds["broker"] = self.throttle_seconds.get("broker", 0.0) + e.throttle_ms / 1000
        elif e.throttle_ms > 0:
            self.throttle_seconds["broker"] = self.throttle_seconds.get("broker", 0.0) + e.throttle_ms / 1000
        if self.clients is not None:
            client = x.ctx.client_id or "none"
            self.clients.add(client, (x.api, "requests"), 1)
            self.clients.add(client, (x.api, "request_bytes"), e.request_bytes)
            self.clients.add(client, (x.api, "response_bytes"), e.response_bytes)

    def _records(self, x: Exchange) -> None:
        e = x.entry
        direction = "produced" if e.api_key == PRODUCE else "fetched"
        if e.outcome not in ("forwarded", "no_response"):
            return
        topics = self.topics
        if topics is None:
            # Only the sum is wanted: read from batch headers' fixed offsets, no facts per partition
            # (a relayed Fetch's was read from its bytes, ``kproxy.proxy.fetch_bytes``).
            n = produced_records(e) if e.api_key == PRODUCE else fetched_records(e)
            if n is not None:
                self.records[direction] += n
                return
        n = 0
        for p in x.partitions:
            if p.error_code:
                continue
            n += p.records
            if topics is not None:
                topic = p.topic or "unknown"
                topics.add(topic, (direction, "records"), p.records)
                topics.add(topic, (direction, "bytes"), p.bytes)
        self.records[direction] += n

    # -- per scrape

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        for refresh in self._refreshers:
            refresh()
        apis = sorted(self.apis.items())
        yield _counter("kproxy_requests", "Requests completed, by API.", ["api"],
                       {(a,): c.requests for a, c in apis})
        outcomes = {(a, o): n for a, c in apis for o, n in c.outcomes.items()}
        yield _counter("kproxy_request_outcomes", "Requests completed, by API and outcome (forwarded, local, "
                       "no_response, upstream_lost, passthrough, client_gone, closed).", ["api", "outcome"],
                       outcomes)
        by_direction = {}
        for a, c in apis:
            by_direction[(a, "request")] = c.request_bytes
            by_direction[(a, "response")] = c.response_bytes
        frames = {(a, "response", p): n for a, c in apis for p, n in c.paths.items()}
        frames.update({(a, "request", p): n for a, c in apis for p, n in c.request_paths.items()})
        yield _counter("kproxy_frames", "Frames forwarded, by API, direction and path: stored whole first, or "
                       "streamed while they arrived (cut-through). Direction response: broker answers to "
                       "clients; request: Produce requests to brokers.", ["api", "direction", "path"], frames)
        stored = {(a, "request", r): n for a, c in apis for r, n in c.stored_why.items()}
        stored.update({(a, "response", r): n for (a, r), n in self.answers_stored.items()})
        yield _counter("kproxy_frames_stored_large", "Frames large enough to stream (cut_through_min_bytes) "
                       "that were stored whole, by API, direction and reason (transport, throttled, sasl, busy, "
                       "order, filter NAME).", ["api", "direction", "reason"], stored)
        yield _counter("kproxy_streamed_requests_broken", "Streamed requests cut off part-way, by the side that "
                       "failed: client (it went away mid-frame; the broker connection was closed) or broker "
                       "(lost mid-frame; the rest was dropped and the client told to retry).", ["side"],
                       {(k,): n for k, n in self.requests_broken.items()})
        yield _counter("kproxy_streamed_answers_broken", "Streamed answers whose broker connection was lost "
                       "part-way (the client connection was closed).", [], {(): self.streams_broken})
        yield _counter("kproxy_spliced_bytes", "Bytes of streamed answers moved from the broker's socket to the "
                       "client's by splice(2), never copied through kproxy (cut_through_splice).", [],
                       {(): self.spliced_bytes})
        yield _counter("kproxy_client_bytes", "Bytes of requests from and responses to clients, size prefix "
                       "included, by API and direction.", ["api", "direction"], by_direction)
        for name, doc, attr in (
            ("kproxy_request_duration_seconds", "Request read until answer written to the client.", "duration"),
            ("kproxy_broker_duration_seconds", "Request written to the broker until its response was read.",
             "broker"),
            ("kproxy_added_duration_seconds", "Time kproxy added to a request the broker answered: the "
             "request's duration minus the broker's.", "added"),
        ):
            h = HistogramMetricFamily(name, doc, labels=["api"])
            for a, c in apis:
                hist: Histogram = getattr(c, attr)
                if hist.count:
                    h.add_metric([a], hist.cumulative(), hist.sum)
            yield h
        yield _counter("kproxy_records", "Records produced (acknowledged or acks=0) and fetched, from batch "
                       "headers.", ["direction"], {(k,): v for k, v in self.records.items()})
        yield _counter("kproxy_throttle_seconds", "Throttle time told to clients, by the quota rule that "
                       "decided it (broker: the broker's own).", ["rule"],
                       {(k,): v for k, v in self.throttle_seconds.items()})
        yield _counter("kproxy_denied_requests", "Requests refused by a policy rule, by rule.", ["rule"],
                       {(k,): v for k, v in self.denied.items()})
        yield _counter("kproxy_records_refused", "Partition batches refused by a validate rule (INVALID_RECORD), "
                       "by rule.", ["rule"], {(k,): v for k, v in self.records_refused.items()})
        if self.clients is not None:
            for kind, doc in (("requests", "Requests"), ("request_bytes", "Request bytes"),
                              ("response_bytes", "Response bytes")):
                yield _counter(f"kproxy_by_client_{kind}", f"{doc} by client id (opt-in, capped; "
                               f"'{OTHER}' past metrics.label_cap).", ["client_id", "api"],
                               {k[:2]: v for k, v in self.clients.values.items() if k[2] == kind})
        if self.topics is not None:
            for kind in ("records", "bytes"):
                yield _counter(f"kproxy_topic_{kind}", f"Produced and fetched {kind} by topic (opt-in, capped; "
                               f"'{OTHER}' past metrics.label_cap).", ["topic", "direction"],
                               {k[:2]: v for k, v in self.topics.values.items() if k[2] == kind})
        for reader in self._readers:
            yield from reader()


# The label every family of a process's /metrics carries: the virtual cluster a sample is about.
VIRTUAL_CLUSTER = "virtual_cluster"


class ProcessMetrics(Collector):
    """The /metrics of one process: each virtual cluster's families (its ``Metrics``, which knows
    nothing of the others) with ``virtual_cluster="<name>"`` added to every sample, and the families
    of what the process shares (the event loop, the buffer budget, certificate files, the traffic
    log, the span exporter) with ``virtual_cluster=""``, which Prometheus reads as no virtual
    cluster. Families of one name from several virtual clusters become one family."""

    def __init__(self, cfg: MetricsConfig | None = None) -> None:
        self.cfg = cfg or MetricsConfig()
        self.clusters: list[tuple[str, Metrics]] = []
        self._readers: list[Reader] = []
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def cluster(self, name: str) -> Metrics:
        """The metrics of one more virtual cluster, shown under ``name``."""
        metrics = Metrics(self.cfg)
        self.clusters.append((name, metrics))
        return metrics

    def add_reader(self, reader: Reader) -> None:
        """Families of the process as a whole, read at scrape time."""
        self._readers.append(reader)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}

        def add(family: Metric, virtual_cluster: str) -> None:
            out = merged.get(family.name)
            if out is None:
                out = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples.extend(s._replace(labels={**s.labels, VIRTUAL_CLUSTER: virtual_cluster})
                               for s in family.samples)

        for name, metrics in self.clusters:
            for family in metrics.collect():
                add(family, name)
        for reader in self._readers:
            for family in reader():
                add(family, "")
        yield from merged.values()


# ---------------------------------------------------------------------------------------------
# Families read from other objects at scrape time


def connection_families(opened: Mapping[str, int], open_now: Mapping[str, int],
                        decode_errors: Mapping[str, int], upstream_failures: Mapping[str, int],
                        in_flight: int = 0) -> list[Metric]:
    return [
        _gauge("kproxy_connections_open", "Client connections open, by listener.", ["listener"],
               {(k,): open_now.get(k, 0) for k in {*opened, *open_now}}),
        GaugeMetricFamily("kproxy_requests_in_flight", "Requests read from clients and not yet answered, "
                          "all connections.", value=in_flight),
        _counter("kproxy_connections_opened", "Client connections accepted, by listener.", ["listener"],
                 {(k,): v for k, v in opened.items()}),
        _counter("kproxy_decode_errors", "Frames kproxy could not decode (the connection closed), by direction "
                 "(request: from a client, response: from a broker).", ["direction"],
                 {(d,): decode_errors.get(d, 0) for d in ("request", "response")}),
        _counter("kproxy_upstream_connect_failures", "Failed connection attempts to brokers, by broker.",
                 ["broker"], {(k,): v for k, v in upstream_failures.items()}),
    ]


def lane_families(laned: int, given_back: Mapping[str, int], memo: Any) -> list[Metric]:
    """The lane's connections and give-backs, and its memo of rewritten answers (``Lane.memo_counts``)."""
    return [
        GaugeMetricFamily("kproxy_lane_connections", "Client connections the lane holds now (relayed without "
                          "the event loop).", value=laned),
        _counter("kproxy_lane_given_back", "Connections the lane gave back to the event loop, by reason (frame, "
                 "recalled, bad_answer, endpoints, answer_unknown, request_timeout, client_closed, broker_closed, idle, "
                 "...).", ["reason"], {(k,): v for k, v in given_back.items()}),
        _counter("kproxy_lane_remembered_answers", "Answers the lane serves only from memory (Metadata, "
                 "FindCoordinator) looked up among the rewrites the event loop made, by result (a miss gives the "
                 "connection back).", ["result"], {("hit",): memo.hits, ("miss",): memo.misses}),
        GaugeMetricFamily("kproxy_lane_remembered_answer_bytes", "Bytes held by the lane's remembered "
                          "rewritten answers.", value=memo.bytes),
    ]


def memo_families(memo: Any) -> list[Metric]:
    """Rewritten answers sent again from memory (kproxy.proxy.memo), and what the memory holds."""
    return [
        _counter("kproxy_remembered_answers", "Broker answers looked up by their bytes among rewritten "
                 "answers already sent (only for apis whose response filters are all pure), by result.",
                 ["result"], {("hit",): memo.hits, ("miss",): memo.misses}),
        GaugeMetricFamily("kproxy_remembered_answer_bytes", "Bytes held by remembered rewritten answers.",
                          value=memo.bytes),
    ]


def discovery_families(attempts: int) -> list[Metric]:
    return [CounterMetricFamily("kproxy_discovery_attempts", "Broker discovery attempts (one at a time, "
                                "shared by every connection that needs one).", value=attempts)]


def kerberos_families(kerberos: Any) -> list[Metric]:
    """Kerberos failures; the family is declared (without series) when Kerberos is not configured, so
    the dashboard's panel and the alert find it on every kproxy."""
    return [_counter("kproxy_kerberos_failures", "Kerberos (GSSAPI) failures, by side (accept: clients' "
                     "tickets checked with kproxy's keytab; initiate: kproxy's own tickets) and kind "
                     "(keytab, clock_skew, unknown_principal, expired, other).", ["side", "kind"],
                     dict(kerberos.failures) if kerberos is not None else {})]


def identity_families(identity: Any) -> list[Metric]:
    """SASL logins kproxy judged (termination) and made (origination)."""
    out = [_counter("kproxy_sasl_logins", "Client SASL logins kproxy judged, by mechanism and outcome (ok, "
                    "reauthenticated, failed, refused, rate_limited, reauth_too_soon, reauth_disabled, "
                    "authenticate_after_login).", ["mechanism", "outcome"],
                    dict(identity.logins))]
    originator = identity.originator
    if originator is not None:
        out.append(_counter("kproxy_upstream_sasl_logins", "Logins kproxy made to brokers as itself, by outcome.",
                            ["outcome"], {("ok",): originator.logins, ("failed",): originator.failures}))
    jwks = identity.jwks
    if jwks is not None:
        out.append(_counter("kproxy_jwks_fetches", "JWKS fetches, by outcome.", ["outcome"],
                            {("ok",): jwks.fetches_ok, ("failed",): jwks.fetches_failed}))
        out.append(GaugeMetricFamily("kproxy_jwks_keys", "Signing keys held from the JWKS.", value=len(jwks.keys)))
    return out


def budget_families(budget: Any) -> list[Metric]:
    out = [
        GaugeMetricFamily("kproxy_buffered_bytes", "Bytes held in frame buffers, all connections "
                          "(laned ones too).", value=budget.total()),
        CounterMetricFamily("kproxy_buffer_budget_pauses", "Times a client read waited for the process "
                            "buffer budget (limits.max_buffered_bytes_total).", value=budget.pauses),
    ]
    if budget.limit is not None:
        out.append(GaugeMetricFamily("kproxy_buffer_budget_bytes", "The process buffer budget.",
                                     value=budget.limit))
    return out


def rule_families(store: Any) -> list[Metric]:
    """From the rule store the server holds (None: no rules configured)."""
    ok = getattr(store, "reloads_ok", 0) if store is not None else 0
    failed = getattr(store, "reloads_failed", 0) if store is not None else 0
    out: list[Metric] = [_counter("kproxy_rule_reloads", "Rule reloads, by outcome.", ["outcome"],
                                  {("ok",): ok, ("failed",): failed})]
    if store is not None:
        out.append(GaugeMetricFamily("kproxy_rules", "Rules in force.", value=getattr(store, "rule_count", 0)))
        out.append(GaugeMetricFamily("kproxy_rules_generation", "Generation of the rule sets in force "
                                     "(one more per successful load).", value=getattr(store, "generation", 0)))
        out.append(GaugeMetricFamily("kproxy_rules_reload_failing", "1 while the last rule reload was "
                                     "refused (the rules loaded before stay in force), else 0.",
                                     value=1 if getattr(store, "last_error", None) else 0))
        loaded = epoch_seconds(getattr(store, "loaded_at", None))
        if loaded is not None:
            out.append(GaugeMetricFamily("kproxy_rules_loaded_timestamp_seconds", "When the rules in force "
                                         "were loaded (seconds since the epoch).", value=loaded))
    return out


def epoch_seconds(value: Any) -> float | None:
    if isinstance(value, datetime.datetime):
        return value.timestamp()
    if isinstance(value, int | float):
        return float(value)
    return None


def traffic_log_families(writer: Any) -> list[Metric]:
    return [
        CounterMetricFamily("kproxy_traffic_log_lines_written", "Traffic log lines written.",
                            value=writer.written),
        CounterMetricFamily("kproxy_traffic_log_lines_dropped", "Traffic log lines dropped (queue full or "
                            "write errors).", value=writer.dropped),
        CounterMetricFamily("kproxy_traffic_log_files", "Traffic log files finished (rotated).",
                            value=writer.files),
    ]


def reencode_families(check: Any) -> list[Metric]:
    return [
        CounterMetricFamily("kproxy_reencode_checks", "Frames whose re-encoding was compared with the bytes "
                            "received (verify_reencode).", value=check.checked),
        CounterMetricFamily("kproxy_reencode_mismatches", "Frames that re-encoded differently; the bytes "
                            "received were forwarded.", value=check.mismatches),
    ]


def tracing_families(tracing: Any) -> list[Metric]:
    return [CounterMetricFamily("kproxy_spans", "Request spans handed to the exporter.", value=tracing.spans)]


def readiness_families(ready: bool) -> list[Metric]:
    """/readyz as a number, for alerts: 1 when ready, 0 when not (draining, or no broker answered)."""
    return [GaugeMetricFamily("kproxy_ready", "1 when /readyz answers ready: listeners bound, the "
                              "cluster's brokers learned, not draining.", value=1 if ready else 0)]


def loop_lag_families(lag: Histogram, longest: float) -> list[Metric]:
    """How late the event loop ran a timer: what a frame or a filter that holds the loop costs every
    other connection."""
    h = HistogramMetricFamily("kproxy_event_loop_lag_seconds", "How late a timer on the event loop fired "
                              "(every 5 ms while the loop is being held, every 100 ms when it is not): time "
                              "the loop was held by other work.")
    h.add_metric([], lag.cumulative(), lag.sum)
    return [h, GaugeMetricFamily("kproxy_event_loop_lag_max_seconds", "The longest event loop lag seen.",
                                 value=longest)]


def coordination_families(snap: Mapping[str, Any]) -> list[Metric]:
    """Fleet quotas (``Coordinator.snapshot()``): whether shares follow the fleet or the static share."""
    out: list[Metric] = [
        GaugeMetricFamily("kproxy_quota_coordination_up", "1 while quota shares follow the fleet (an own record "
                          "was read back from the coordination topic within stale_after_s), 0 on the static "
                          "share.", value=1 if snap["up"] else 0),
        CounterMetricFamily("kproxy_quota_coordination_switches", "Switches between coordinated and static "
                            "quota shares.", value=snap["switches"]),
        _counter("kproxy_quota_coordination_records", "Coordination records written and read.", ["direction"],
                 {("out",): snap["published"], ("in",): snap["read"]}),
        _counter("kproxy_quota_coordination_bytes", "Bytes sent to and received from brokers for quota "
                 "coordination.", ["direction"], {("out",): snap["bytes_out"], ("in",): snap["bytes_in"]}),
        GaugeMetricFamily("kproxy_quota_coordination_budgets", "Budgets reported in the last interval.",
                          value=snap["active"]),
        GaugeMetricFamily("kproxy_quota_coordination_peers", "Other kproxy processes of the fleet with a fresh "
                          "record.", value=snap["peers"]),
    ]
    if snap["peer_age_s"] is not None:
        out.append(GaugeMetricFamily("kproxy_quota_coordination_peer_age_seconds", "Age of the newest record "
                                     "of another process of the fleet.", value=snap["peer_age_s"]))
    return out


def shared_port_families(refused: Mapping[tuple[str, str], int]) -> list[Metric]:
    """Connections to a port several virtual clusters share that none of them took."""
    return [_counter("kproxy_shared_port_refused", "Connections closed on a port several SNI virtual clusters "
                     "share before any took them, by listener and reason (unknown_name: no virtual cluster "
                     "serves the TLS host name; no_name: the ClientHello names none; not_tls; timeout).",
                     ["listener", "reason"], refused)]


def settings_families(reloads: Mapping[str, int], pending: Sequence[str]) -> list[Metric]:
    """Re-reads of the config file (SIGHUP) and the changed settings that wait for a restart."""
    return [_counter("kproxy_settings_reloads", "Re-reads of the config file on SIGHUP, by outcome (failed: "
                     "the file did not load and the settings in force stayed).", ["outcome"],
                     {(k,): v for k, v in reloads.items()}),
            GaugeMetricFamily("kproxy_settings_restart_pending", "Settings the config file changed at the "
                              "last SIGHUP that take effect only at a restart (0: the file is what runs; the "
                              "log's warning names them).", value=len(pending))]


def upstream_families(snap: Mapping[str, Any]) -> list[Metric]:
    """Which upstream cluster the virtual cluster is on, whether each answers, and the switches
    (``UpstreamClusters.snapshot()``). The process's /metrics adds the ``virtual_cluster`` label."""
    clusters: Mapping[str, bool | None] = snap["clusters"]
    out: list[Metric] = [
        _gauge("kproxy_upstream_active", "1 for the upstream cluster the virtual cluster is on, 0 for its others.",
               ["cluster"], {(c,): 1 if c == snap["active"] else 0 for c in clusters}),
        _counter("kproxy_upstream_switches", "Switches of the virtual cluster to another upstream cluster, by "
                 "reason (planned, failover, followed: another worker switched).", ["reason"],
                 {(r,): n for r, n in {"planned": 0, "failover": 0, "followed": 0, **snap["switches"]}.items()}),
        _gauge("kproxy_upstream_switch_hold_seconds", "How long the last switch held new connections (drain, "
               "catch-up, offset translation, learning the new brokers).", [], {(): snap["last_hold_s"]}),
        _counter("kproxy_upstream_carried_batches", "Record batches of producers another upstream cluster "
                 "issued, carried under a producer id kproxy got from the active one.", [],
                 {(): snap["carried_batches"]}),
    ]
    # Declared always; samples once clusters are probed (only with several of them).
    out.append(_gauge("kproxy_upstream_reachable", "1 when a broker of the upstream cluster answered the "
                      "last probe (a refused login counts as an answer), else 0.", ["cluster"],
                      {(c,): 1 if ok else 0 for c, ok in clusters.items() if ok is not None and snap["probed"]}))
    return out


def identity_edge_families(tls_contexts: Iterable[Any], proxy_protocol: Any, sni_names: Any) -> list[Metric]:
    """Certificate reloads (``ReloadingContext``), PROXY header refusals and refused SNI names."""
    reloads: dict[tuple[str, str], float] = {}
    loaded: dict[tuple[str], float] = {}
    for ctx in tls_contexts:
        reloads[(ctx.setting, "ok")] = ctx.reloads_ok
        reloads[(ctx.setting, "failed")] = ctx.reloads_failed
        when = epoch_seconds(ctx.loaded_at)
        if when is not None:
            loaded[(ctx.setting,)] = when
    out = [_counter("kproxy_tls_reloads", "Reloads of changed certificate, key and CA files, by side "
                    "(tls, upstream.tls) and outcome.", ["setting", "outcome"], reloads),
           _gauge("kproxy_tls_loaded_timestamp_seconds", "When the TLS files in force on each side were "
                  "loaded (seconds since the epoch).", ["setting"], loaded)]
    if proxy_protocol is not None:
        refused = {(kind,): float(n) for kind, n in proxy_protocol.refused.items()}
        out.append(_counter("kproxy_proxy_protocol_refused", "Connections closed at the PROXY header, by "
                            "reason (untrusted, missing, malformed, timeout, closed).", ["reason"], refused))
    if sni_names is not None and sni_names.suffix is not None:
        out.append(CounterMetricFamily("kproxy_sni_names_refused", "TLS handshakes ended for an SNI name "
                                       "kproxy does not serve.", value=sni_names.refused))
    return out


def kms_families(snap: Mapping[str, Any]) -> list[Metric]:
    """Record encryption's KMS calls and DEK cache (``kproxy.kms.service.KeyService.snapshot()``)."""
    backend = snap["backend"]
    h = HistogramMetricFamily("kproxy_kms_call_duration_seconds", "How long KMS calls took, by backend and "
                              "operation (generate, unwrap, check).", labels=["backend", "op"])
    for op, hist in sorted(snap["durations"].items()):
        h.add_metric([backend, op], hist.cumulative(), hist.sum)
    return [
        _counter("kproxy_kms_calls", "KMS calls by backend, operation and outcome (ok, or why it failed: "
                 "unreachable, timeout, server_error, throttled, token, unknown_kek, denied, refused, "
                 "bad_answer, wrong_kms).", ["backend", "op", "outcome"],
                 {(backend, op, outcome): n for (op, outcome), n in snap["calls"].items()}),
        h,
        _counter("kproxy_dek_cache_lookups", "Lookups of unwrapped DEKs for opening records, by result "
                 "(a miss costs a KMS call).", ["result"],
                 {("hit",): snap["cache_hits"], ("miss",): snap["cache_misses"]}),
        CounterMetricFamily("kproxy_dek_cache_evictions", "Unwrapped DEKs dropped from the full cache.",
                            value=snap["cache_evicted"]),
        GaugeMetricFamily("kproxy_dek_cache_entries", "Unwrapped DEKs held for opening records.",
                          value=snap["cache_entries"]),
        CounterMetricFamily("kproxy_deks_generated", "DEKs the KMS made for sealing records.",
                            value=snap["deks_generated"]),
        CounterMetricFamily("kproxy_deks_retired", "DEKs that stopped sealing: used up, expired, or their "
                            "KEK refused.", value=snap["deks_retired"]),
        GaugeMetricFamily("kproxy_kms_keys_backing_off", "KEKs and wrapped DEKs whose KMS calls wait after a "
                          "failure.", value=snap["backing_off"]),
    ]


def record_crypto_families(snap: Mapping[str, Any]) -> list[Metric]:
    """What encrypt and mask rules did to records (``kproxy.policy.crypto.RecordCrypto.snapshot()``)."""
    return [
        _counter("kproxy_records_encrypted", "Record values sealed by encrypt rules (batches: the batches "
                 "rebuilt).", ["unit"], {("records",): snap["records_encrypted"],
                                          ("batches",): snap["batches_encrypted"]}),
        _counter("kproxy_records_decrypted", "Sealed record values opened in Fetch answers (batches: the "
                 "batches rebuilt).", ["unit"], {("records",): snap["records_decrypted"],
                                                  ("batches",): snap["batches_decrypted"]}),
        _counter("kproxy_record_encryption_failures", "Partitions refused by record encryption, by reason "
                 "(unreachable, timeout, unknown_kek, denied, tampered, unknown_topic, unreadable, ...).",
                 ["reason"], {(k,): v for k, v in snap["failures"].items()}),
        _counter("kproxy_records_masked", "Fetched record values mask rules changed (not_json: values that "
                 "are not JSON, passed unchanged).", ["result"],
                 {("masked",): snap["records_masked"], ("not_json",): snap["mask_not_json"]}),
    ]

"""Client quotas with an injected clock: Kafka's sample windows and throttle time, budgets per key,
burst, several quotas, reloads that keep the usage, Fetch limits, request rate and request time,
acks=0, replica shares, notes and logs, the bounded budget table, and the example in rules/."""

from __future__ import annotations

import logging
import struct
from pathlib import Path
from typing import Any

import pytest

from kproxy.config import config_from_args
from kproxy.policy.engine import FixedRules
from kproxy.policy.store import RuleStore
from kproxy.protocol.messages import body_class
from kproxy.proxy.actions import Hold, ToClient, ToUpstream
from kproxy.proxy.filters import Filter
from kproxy.proxy.session import Session
from kproxy.quota.budgets import Budgets
from kproxy.quota.engine import QuotaFilter, fetch_record_bytes, produce_record_bytes, quotas_of, trim_fetch
from kproxy.quota.rate import SampledRate, Windows, throttle_seconds

from .rulebook import Clock, rule_set, session, write_rules
from .test_policy_filter import broker_answers, response_frame, send
from .test_session import answered, forwarded

PRODUCE, FETCH, METADATA = 0, 1, 3
RULES = Path(__file__).resolve().parents[2] / "rules"
KAFKA = Windows(11, 1.0, 10.0)      # a broker's defaults: 11 samples of 1 s, 10 whole windows assumed


def kafka_throttle_ms(total: float, window_s: float, bound: float) -> int:
    """Kafka's QuotaUtils.throttleTime for ``total`` measured over ``window_s``, written out here
    independently: (O - T) / T * W with O = total / W, rounded to whole milliseconds."""
    observed = total / window_s
    return round((observed - bound) / bound * window_s * 1000) if observed > bound else 0


# -- the rate on its own


def test_throttle_time_is_kafkas_formula_with_kafkas_windows():
    rate = SampledRate()
    assert rate.record_and_throttle(5000, 100.0, KAFKA, 1000) == 0.0    # 5000 over 10 s assumed
    t = rate.record_and_throttle(20000, 100.5, KAFKA, 1000)
    # 25000 bytes; 0.5 s into the first window, plus the 10 whole windows Kafka assumes.
    assert rate.window_size(100.5, KAFKA) == pytest.approx(10.5)
    assert round(t * 1000) == kafka_throttle_ms(25000, 10.5, 1000) == 14500
    # Three windows in: elapsed 3.2 s counts as 3.2 + 7 whole windows.
    t = rate.record_and_throttle(1000, 103.2, KAFKA, 1000)
    assert rate.window_size(103.2, KAFKA) == pytest.approx(10.2)
    assert round(t * 1000) == kafka_throttle_ms(26000, 10.2, 1000)
    assert throttle_seconds(500, 1000, 10) == 0.0 and throttle_seconds(1000, 1000, 10) == 0.0


def test_samples_slide_and_usage_past_the_span_is_forgotten():
    w = Windows.for_burst(11, 1.0, 1.0)
    assert (w.samples, w.min_full_windows) == (11, 1.0)
    rate = SampledRate()
    rate.record(5000, 100.0, w)
    for t in (101.2, 102.7, 105.0):
        rate.record(100, t, w)
    assert rate.total(110.99, w) == 5300
    assert rate.total(111.5, w) == 300          # the first sample had no event for 11 s
    assert rate.total(116.0, w) == 0
    # More samples than configured are kept when the burst needs them.
    assert Windows.for_burst(3, 1.0, 5.0).samples == 6
    assert Windows.for_burst(11, 0.5, 2.0).min_full_windows == 4.0


class NaiveRate:
    """Kafka's SampledStat + Rate, written out plainly (every measurement walks every sample), as the
    reference the kept-up-to-date SampledRate must agree with."""

    def __init__(self) -> None:
        self.samples: list[list[float]] = []      # [start, last event, value]
        self.current = 0

    def record(self, value: float, now: float, w: Windows) -> None:
        if not self.samples:
            self.samples.append([now, now, 0.0])
        s = self.samples[self.current]
        if now - s[0] >= w.window_s:
            self.current = (self.current + 1) % (w.samples + 1)
            if self.current >= len(self.samples):
                self.samples.append([now, now, 0.0])
            else:
                self.samples[self.current][:] = [now, now, 0.0]
            s = self.samples[self.current]
        s[2] += value
        s[1] = now

    def measured(self, now: float, w: Windows) -> tuple[float, float]:
        if not self.samples:
            self.samples.append([now, now, 0.0])
        for s in self.samples:
            if now - s[1] >= w.samples * w.window_s:
                s[:] = [now, now, 0.0]
        elapsed = now - min(s[0] for s in self.samples)
        full = int(elapsed // w.window_s)
        if full < w.min_full_windows:
            elapsed += (w.min_full_windows - full) * w.window_s
        return sum(s[2] for s in self.samples), elapsed


@pytest.mark.parametrize("seed", range(20))
def test_the_sampled_rate_agrees_with_a_plain_walk_over_its_samples(seed):
    import random

    rng = random.Random(seed)
    fast, plain = SampledRate(), NaiveRate()
    now = 1000.0
    w = Windows.for_burst(rng.choice((2, 3, 11)), rng.choice((0.5, 1.0)), rng.choice((0.5, 1.0, 4.0)))
    for _ in range(400):
        now += rng.choice((0.0, 0.001, 0.05, 0.3, 0.9, 2.5, 7.0, 30.0)) * rng.random()
        if rng.random() < 0.05:     # a reload with other windows
            w = Windows.for_burst(rng.choice((2, 3, 11)), w.window_s, rng.choice((0.5, 1.0, 4.0)))
        if rng.random() < 0.7:
            value = rng.choice((1.0, 100.0, 5000.0))
            fast.record(value, now, w)
            plain.record(value, now, w)
        total, window = fast.measured(now, w)
        expected_total, expected_window = plain.measured(now, w)
        assert total == pytest.approx(expected_total, abs=1e-6) and window == pytest.approx(expected_window)


def test_allowance_is_what_fits_before_a_throttle():
    w = Windows.for_burst(11, 1.0, 2.0)
    rate = SampledRate()
    assert rate.allowance(100.0, w, 1000) == pytest.approx(2000)
    rate.record(1500, 100.0, w)
    assert rate.allowance(100.0, w, 1000) == pytest.approx(500)
    assert rate.record_and_throttle(500, 100.0, w, 1000) == 0.0
    assert rate.record_and_throttle(1, 100.0, w, 1000) > 0


# -- through sessions

ONE_K = """\
quotas:
  - name: one-k
    match: {client_id: "app*"}
    per: %s
    produce_bytes_per_s: 1000
    burst_s: %s
"""


def quota_filter(tmp_path: Path, text: str, share: float = 1.0, budgets: Budgets | None = None) -> QuotaFilter:
    return QuotaFilter(FixedRules.of(rule_set(tmp_path, text)), 11, 1.0, share, budgets)


def produce_body(nbytes: int, acks: int = -1, partitions: int = 1) -> Any:
    cls = body_class(PRODUCE, "request")
    return cls(acks=acks, timeout_ms=1000, topic_data=[cls.TopicProduceData(name="t", partition_data=[
        cls.PartitionProduceData(index=p, records=b"r" * nbytes) for p in range(partitions)])])


def produce_once(s: Session, nbytes: int, client_id: str = "app", answer: Any = None) -> tuple[Any, Any]:
    """Produce ``nbytes`` of records and have the broker accept it: (the answer, its entry)."""
    up = forwarded(send(s, PRODUCE, 9, produce_body(nbytes), client_id)[-1])
    out = broker_answers(s, up, answer)
    assert isinstance(out[-1], ToClient)
    return answered(out[-1], PRODUCE, 9), out[-1].done[0]


def at(s: Session, now: float) -> Session:
    s.ctx.clock.now = now
    return s


def test_a_client_over_its_quota_is_told_the_throttle_and_muted(tmp_path):
    f = quota_filter(tmp_path, ONE_K % ("client_id", 1))
    s = session(f)
    resp, entry = produce_once(s, 3000)
    # 3000 bytes over a 1 s burst window at 1000/s: (3000 - 1000) / 1000 * 1 s.
    assert resp.body.throttle_time_ms == 2000 and entry.throttle_ms == 2000
    assert entry.notes["quota"] == {"rule": "one-k", "key": "client_id=app", "throttle_ms": 2000}
    assert s.throttled_for(100.0) == pytest.approx(2.0) and s.throttled_for(102.0) == 0.0


def test_within_the_quota_nothing_is_throttled_and_the_entry_says_which_quota_counted(tmp_path):
    s = session(quota_filter(tmp_path, ONE_K % ("client_id", 1)))
    resp, entry = produce_once(s, 1000)
    assert resp.body.throttle_time_ms == 0 and s.throttled_for(100.0) == 0.0
    assert entry.notes["quota"] == {"rule": "one-k", "key": "client_id=app", "throttle_ms": 0}
    # A client the quota does not match is not charged at all.
    _, other = produce_once(s, 50_000, client_id="other")
    assert other.notes is None


def test_telemetry_reads_the_quota_from_the_entry(tmp_path):
    import json

    import jsonschema

    from kproxy.telemetry.exchange import Exchange, Learned
    from kproxy.telemetry.metrics import Metrics
    from kproxy.telemetry.traffic_log import traffic_line

    s = session(quota_filter(tmp_path, ONE_K % ("client_id", 1)))
    _, entry = produce_once(s, 3000)
    schema = json.loads((Path(__file__).resolve().parents[2] / "kproxy/telemetry/traffic_log.schema.json").read_text())
    line = traffic_line(Exchange(entry, s.ctx, Learned()), 1_700_000_000.0)
    jsonschema.Draft202012Validator(schema).validate(line)
    assert line["quota"] == {"rule": "one-k", "key": "client_id=app", "throttle_ms": 2000}
    assert line["throttle_ms"] == 2000
    m = Metrics()
    m.record(Exchange(entry, s.ctx, Learned()))
    assert 'kproxy_throttle_seconds_total{rule="one-k"} 2.0' in m.exposition().decode().splitlines()


def test_the_brokers_own_larger_throttle_is_kept(tmp_path):
    s = session(quota_filter(tmp_path, ONE_K % ("client_id", 1)))
    cls = body_class(PRODUCE, "response")
    answer = cls(throttle_time_ms=9000, responses=[cls.TopicProduceResponse(name="t", partition_responses=[
        cls.PartitionProduceResponse(index=0, base_offset=1)])])
    resp, _ = produce_once(s, 3000, answer=answer)
    assert resp.body.throttle_time_ms == 9000
    assert s.throttled_for(100.0) == pytest.approx(2.0)   # kproxy mutes for its own throttle only


def test_burst_lets_that_many_seconds_of_the_rate_through_at_once(tmp_path):
    s = session(quota_filter(tmp_path, ONE_K % ("client_id", 3)))
    assert produce_once(s, 3000)[0].body.throttle_time_ms == 0
    assert produce_once(s, 1)[0].body.throttle_time_ms == 1       # (3001/3 - 1000)/1000 * 3 s
    s = session(quota_filter(tmp_path, ONE_K % ("client_id", 1)))
    assert produce_once(s, 3000)[0].body.throttle_time_ms == 2000


def test_a_burst_after_an_idle_minute_is_not_punished_for_the_minute(tmp_path):
    s = session(quota_filter(tmp_path, ONE_K % ("client_id", 1)))
    for i in range(10):
        produce_once(at(s, 100.0 + i), 1000)
    assert produce_once(at(s, 110.0), 5000)[0].body.throttle_time_ms > 0
    resp, _ = produce_once(at(s, 170.0), 1000)
    assert resp.body.throttle_time_ms == 0


def test_steady_use_is_throttled_back_to_the_rate(tmp_path):
    s = session(quota_filter(tmp_path, ONE_K % ("client_id", 1)))
    now, sent = 100.0, 0
    while now < 130.0:
        resp, _ = produce_once(at(s, now), 400)
        sent += 400
        # A client that honours throttle_time_ms (KIP-219) sends again when it is over.
        now += max(resp.body.throttle_time_ms / 1000, 0.01)
    assert sent / 30.0 == pytest.approx(1000, rel=0.1)


@pytest.mark.parametrize("per, first, second, shared", [
    ("client_id", dict(client_id="app-1"), dict(client_id="app-2"), False),
    ("client_id", dict(client_id="app-1"), dict(client_id="app-1", connection_id=2), True),
    ("rule", dict(client_id="app-1"), dict(client_id="app-2"), True),
    ("connection", dict(client_id="app-1"), dict(client_id="app-1", connection_id=2), False),
    ("source", dict(client_id="app-1"), dict(client_id="app-1", connection_id=2), True),
    ("source", dict(client_id="app-1"), dict(client_id="app-1", address="10.9.9.9"), False),
    ("principal", dict(tls_subject="CN=a"), dict(tls_subject="CN=a", connection_id=2), True),
    ("principal", dict(tls_subject="CN=a"), dict(tls_subject="CN=b"), False),
])
def test_per_says_who_shares_a_budget(tmp_path, per, first, second, shared):
    f = quota_filter(tmp_path, ONE_K % (per, 1))
    sessions = []
    for who in (first, second):
        s = session(f, connection_id=who.get("connection_id", 1), address=who.get("address", "10.1.2.3"),
                    tls_subject=who.get("tls_subject"))
        resp, entry = produce_once(s, 1000, client_id=who.get("client_id", "app"))
        sessions.append((resp, entry))
    assert sessions[0][0].body.throttle_time_ms == 0
    assert sessions[1][0].body.throttle_time_ms == (1000 if shared else 0)
    expected = {"client_id": "client_id=app-1", "rule": "all", "connection": "connection=1",
                "source": "source=10.1.2.3", "principal": "principal=User:CN=a"}[per]
    assert sessions[0][1].notes["quota"]["key"] == expected


def test_connection_budgets_end_with_their_connection(tmp_path):
    f = quota_filter(tmp_path, ONE_K % ("connection", 1))
    s = session(f)
    produce_once(s, 10)
    assert len(f.budgets) == 1
    s.close()
    assert len(f.budgets) == 0


SEVERAL = """\
quotas:
  - name: each
    match: {client_id: "app*"}
    produce_bytes_per_s: 1000
  - name: all-apps
    match: {client_id: "app*"}
    per: rule
    produce_bytes_per_s: 500
  - name: requests
    requests_per_s: 1000
"""


def test_every_matching_quota_applies_and_the_longest_throttle_wins(tmp_path):
    f = quota_filter(tmp_path, SEVERAL)
    resp, entry = produce_once(session(f), 1500)
    # each: (1500-1000)/1000 s; all-apps: (1500-500)/500 s; requests: 1 request of 1000/s.
    assert resp.body.throttle_time_ms == 2000
    assert entry.notes["quota"] == {"rule": "all-apps", "key": "all", "throttle_ms": 2000}
    assert {k[0] for k in f.budgets._budgets} == {"each", "all-apps", "requests"}


def test_a_reload_keeps_the_usage_and_applies_the_new_rate_from_the_next_request(tmp_path):
    path = write_rules(tmp_path, ONE_K % ("client_id", 1), "quotas.yaml")
    store = RuleStore([path])
    assert store.describe()["quotas"] == [{"name": "one-k", "per": "client_id", "produce_bytes_per_s": 1000.0,
                                           "burst_s": 1.0, "where": f"{path}:2:5"}]
    f = QuotaFilter(store)
    s = session(f)
    assert produce_once(s, 1000)[0].body.throttle_time_ms == 0
    Path(path).write_text((ONE_K % ("client_id", 1)).replace("1000", "500"))
    assert store.reload("test")
    # The 1000 bytes already measured count against the new 500/s: (1500 - 500) / 500 * 1 s.
    assert produce_once(s, 500)[0].body.throttle_time_ms == 2000
    # A renamed quota is a new budget.
    Path(path).write_text((ONE_K % ("client_id", 1)).replace("one-k", "renamed"))
    assert store.reload("test")
    assert produce_once(s, 1000)[0].body.throttle_time_ms == 0


def test_a_produce_over_the_budget_mutes_the_connection_when_it_arrives(tmp_path):
    """A broker reads a connection's next request only once the last was answered and its throttle
    served; kproxy forwards requests while earlier ones are answered, so it charges a Produce's
    records when the request comes: requests the client pipelined behind it wait out the throttle."""
    f = quota_filter(tmp_path, ONE_K % ("client_id", 1))
    s = session(f)
    first = send(s, PRODUCE, 9, produce_body(3000), correlation_id=1)
    assert isinstance(first[-1], ToUpstream)
    assert s.throttled_for(100.0) == pytest.approx(2.0)          # (3000 - 1000) / 1000 * 1 s, at once
    second = send(s, PRODUCE, 9, produce_body(3000), correlation_id=2)    # read with the first
    assert isinstance(second[0], Hold) and second[0].seconds == pytest.approx(2.0)
    assert isinstance(second[-1], ToUpstream)
    # (6000 bytes over 1 s against 1000/s: (6000 - 1000) / 1000 s for the second, from its arrival.)
    assert s.throttled_for(100.0) == pytest.approx(5.0)
    # The answers come 0.5 s later: each tells what is left of its own throttle, and the connection
    # stays muted until the longest ends; nothing is charged twice.
    at(s, 100.5)
    resp = answered(broker_answers(s, forwarded(first[-1]))[-1], PRODUCE, 9)
    assert resp.body.throttle_time_ms == 1500 and s.throttled_for(100.5) == pytest.approx(4.5)
    resp = answered(broker_answers(s, forwarded(second[-1]))[-1], PRODUCE, 9)
    assert resp.body.throttle_time_ms == 4500
    budget = f.budgets.peek(("one-k", "client_id=app"))
    assert budget is not None and budget.produce is not None and budget.produce.total(100.5, KAFKA) == 6000
    # The client was told to wait twice, when each request came (demand for fleet shares), not again.
    assert budget.muted is not None and budget.muted.total(100.5, KAFKA) == pytest.approx(2.0 + 5.0)


def test_a_quota_for_each_replica(tmp_path):
    s = session(quota_filter(tmp_path, ONE_K % ("client_id", 1), share=0.5))
    assert produce_once(s, 1000)[0].body.throttle_time_ms == 1000     # 1000 of 500/s
    cfg = config_from_args("127.0.0.1:9092", "127.0.0.1:19092", quota_replicas=4)
    assert cfg.quota_share() == 0.25 and cfg.quota_share(workers=2) == 0.125


def test_a_per_connection_quota_is_whole_on_every_replica_and_worker(tmp_path):
    """A connection lives on one process: a per-connection limit holds it there whole, however many
    replicas and workers the deployment has, while a per-client-id limit is divided among them."""
    both = (ONE_K % ("connection", 1)) + (ONE_K % ("client_id", 1)).replace("quotas:\n", "").replace(
        "name: one-k", "name: each-client").replace("1000", "8000")
    rules = rule_set(tmp_path, both)
    by_name = {q.rule.name: q for q in quotas_of(rules, share=0.25)}          # also what the dry run uses
    assert (by_name["one-k"].produce, by_name["each-client"].produce) == (1000, 2000)
    for coordinated in (False, True):
        f = QuotaFilter(FixedRules.of(rules), 11, 1.0, 0.25, coordinated=coordinated)
        resp, entry = produce_once(session(f), 1500)
        # one-k: (1500 - 1000) / 1000 s, not (1500 - 250) / 250 s; each-client: 1500 of its 2000/s.
        assert entry.notes["quota"] == {"rule": "one-k", "key": "connection=1", "throttle_ms": 500}, coordinated
        assert resp.body.throttle_time_ms == 500


METADATA_RATE = """\
quotas:
  - name: metadata
    match: {api: metadata}
    requests_per_s: 2
"""


def metadata_once(s: Session, client_id: str = "app") -> Any:
    cls = body_class(METADATA, "request")
    up = forwarded(send(s, METADATA, 12, cls(topics=None), client_id)[-1])
    return answered(broker_answers(s, up, body_class(METADATA, "response")())[-1], METADATA, 12)


def test_a_request_rate_quota_counts_only_the_apis_it_matches(tmp_path):
    s = session(quota_filter(tmp_path, METADATA_RATE))
    assert [metadata_once(s).body.throttle_time_ms for _ in range(3)] == [0, 0, 500]
    assert produce_once(s, 10)[1].notes is None


class Busy(Filter):
    """Takes ``seconds`` of the session's time on each request and response (the injected clock)."""

    request_api_keys = response_api_keys = frozenset({METADATA})

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_request(self, ctx, exchange):
        ctx.clock.now += self.seconds

    def on_response(self, ctx, exchange, response):
        ctx.clock.now += self.seconds
        return 0.0


def test_request_time_is_the_session_time_spent_on_the_request_capped_at_one_window(tmp_path):
    rules = "quotas: [{name: cpu, request_time_percent: %s}]\n"
    s = session(Busy(0.004), quota_filter(tmp_path, rules % 2))
    # 8 ms of 1 s = 0.8 percent-seconds, within 2 percent.
    resp = metadata_once(s)
    assert resp.body.throttle_time_ms == 0
    s = session(Busy(0.004), quota_filter(tmp_path, rules % 0.2))
    # (0.8 - 0.2) / 0.2 * 1 s = 3 s, but a request quota throttles by one window at most (Kafka).
    assert metadata_once(s).body.throttle_time_ms == 1000


def fetch_request(max_bytes: int, partition_max_bytes: int = 1 << 20, version: int = 12) -> Any:
    cls = body_class(FETCH, "request")
    body = cls(max_wait_ms=500, min_bytes=1, topics=[cls.FetchTopic(topic="t", partitions=[
        cls.FetchPartition(partition=p, fetch_offset=0, partition_max_bytes=partition_max_bytes)
        for p in (0, 1)])])
    if version >= 3:
        body.max_bytes = max_bytes
    return body


def batch_bytes(size: int) -> bytes:
    """Records holding one batch of ``size`` bytes (only its length field matters to quotas)."""
    return struct.pack(">qi", 0, size - 12) + b"\x00" * (size - 12)


def fetch_answer(*sizes: int) -> Any:
    cls = body_class(FETCH, "response")
    return cls(responses=[cls.FetchableTopicResponse(topic="t", partitions=[
        cls.PartitionData(partition_index=p, high_watermark=10, records=batch_bytes(n))
        for p, n in enumerate(sizes)])])


FETCH_10K = """\
quotas:
  - name: readers
    fetch_bytes_per_s: 10000
"""


def answer_size(*sizes: int, version: int = 12) -> int:
    """The size of ``fetch_answer(*sizes)`` as the broker sends it (header and body): what it is charged."""
    return len(response_frame(FETCH, version, 0, fetch_answer(*sizes)))


def fetch_once(s: Session, max_bytes: int, sizes: tuple[int, ...], version: int = 12) -> tuple[Any, Any]:
    """(the Fetch as the broker got it, the answer the client got)."""
    up = forwarded(send(s, FETCH, version, fetch_request(max_bytes, version=version))[-1])
    out = broker_answers(s, up, fetch_answer(*sizes))
    return up, answered(out[-1], FETCH, version)


def test_a_fetch_is_lowered_to_what_the_budget_allows_but_never_below_one_batch(tmp_path):
    s = session(quota_filter(tmp_path, FETCH_10K))
    up, resp = fetch_once(s, 50 << 20, (8000,))
    assert up.body.max_bytes == 10000 and {p.partition_max_bytes for p in up.body.topics[0].partitions} == {10000}
    assert resp.body.throttle_time_ms == 0
    # 2000 bytes left, but the largest batch seen is 8000; the 3000 beyond it are cut off.
    up, resp = fetch_once(s, 50 << 20, (6000, 3000))
    assert up.body.max_bytes == 8000
    # A Fetch is charged its answer's size, as a Kafka broker charges it: the batches, less what
    # was cut off, and the answer's own fields.
    charged = answer_size(8000) + answer_size(6000, 3000) - 3000
    assert 14000 < charged < 14200
    assert resp.body.throttle_time_ms == kafka_throttle_ms(charged, 1.0, 10000)
    # Over the budget: still one batch.
    up, _ = fetch_once(s, 50 << 20, (100,))
    assert up.body.max_bytes == 8000
    # A client asking for less than the budget allows is left alone.
    at(s, 200.0)
    up, _ = fetch_once(s, 4000, (100,))
    assert up.body.max_bytes == 4000 and {p.partition_max_bytes for p in up.body.topics[0].partitions} == {1 << 20}


def test_an_answer_larger_than_the_lowered_max_bytes_is_cut_to_whole_batches(tmp_path):
    s = session(quota_filter(tmp_path, FETCH_10K))
    cls = body_class(FETCH, "response")
    big = cls(responses=[cls.FetchableTopicResponse(topic="t", partitions=[
        cls.PartitionData(partition_index=0, high_watermark=10, records=batch_bytes(4000) * 3),
        cls.PartitionData(partition_index=1, high_watermark=10, records=batch_bytes(2500))])])
    up = forwarded(send(s, FETCH, 12, fetch_request(50 << 20))[-1])
    assert up.body.max_bytes == 10000
    resp = answered(broker_answers(s, up, big)[-1], FETCH, 12)
    # A broker that ignores max_bytes (tansu): two whole batches fit, the rest is fetched again later.
    assert [len(p.records) for p in resp.body.responses[0].partitions] == [8000, 0]
    assert [p.high_watermark for p in resp.body.responses[0].partitions] == [10, 10]


def test_cutting_keeps_the_first_batch_whatever_its_size():
    cls = body_class(FETCH, "response")

    def answer(*parts: bytes) -> Any:
        return cls(responses=[cls.FetchableTopicResponse(topic="t", partitions=[
            cls.PartitionData(partition_index=i, records=r) for i, r in enumerate(parts)])])

    body = answer(b"", batch_bytes(9000) + batch_bytes(100), batch_bytes(100))
    assert trim_fetch(body, 1000) == 9000
    assert [len(p.records) for p in body.responses[0].partitions] == [0, 9000, 0]
    body = answer(batch_bytes(300), batch_bytes(300) + batch_bytes(300)[:50])     # a cut-off last batch
    assert trim_fetch(body, 620) == 600
    assert [len(p.records) for p in body.responses[0].partitions] == [300, 300]
    body = answer(batch_bytes(300))
    assert trim_fetch(body, 300) == 300 and len(body.responses[0].partitions[0].records) == 300


def test_an_old_fetch_without_max_bytes_shares_the_budget_over_its_partitions(tmp_path):
    s = session(quota_filter(tmp_path, FETCH_10K))
    up, _ = fetch_once(s, 0, (300, 300), version=2)
    assert {p.partition_max_bytes for p in up.body.topics[0].partitions} == {1 << 20}   # no batch seen yet
    up, _ = fetch_once(s, 0, (300,), version=2)
    left = 10000 - answer_size(300, 300, version=2)
    assert {p.partition_max_bytes for p in up.body.topics[0].partitions} == {left // 2} and left < 10000 - 600


def test_an_acks0_produce_is_charged_when_sent_and_mutes_the_connection(tmp_path):
    s = session(quota_filter(tmp_path, ONE_K % ("client_id", 1)))
    out = send(s, PRODUCE, 9, produce_body(3000, acks=0))
    assert [type(a) for a in out] == [ToUpstream]
    assert out[0].entry.notes["quota"]["throttle_ms"] == 2000
    assert s.throttled_for(100.0) == pytest.approx(2.0)


def test_a_quota_may_select_produce_requests_by_acks(tmp_path):
    s = session(quota_filter(tmp_path, "quotas: [{name: fire-and-forget, match: {acks: 0}, produce_bytes_per_s: 1000,"
                                       " requests_per_s: 1}]\n"))
    _, entry = produce_once(s, 5000)
    assert entry.notes is None and s.throttled_for(100.0) == 0.0
    assert metadata_once(s).body.throttle_time_ms == 0 and metadata_once(s).body.throttle_time_ms == 0
    out = send(s, PRODUCE, 9, produce_body(3000, acks=0))
    assert out[0].entry.notes["quota"]["rule"] == "fire-and-forget" and s.throttled_for(100.0) == pytest.approx(2.0)


def test_large_arrays_nobody_decoded_are_counted_by_their_size_and_stay_undecoded(tmp_path):
    from kproxy.protocol import LazyArray

    f = quota_filter(tmp_path, ONE_K % ("client_id", 1) + "    fetch_bytes_per_s: 1.0e9\n")
    s = session(f)
    cls = body_class(PRODUCE, "request")
    body = cls(acks=-1, timeout_ms=1000, topic_data=[cls.TopicProduceData(name=f"t{i}", partition_data=[
        cls.PartitionProduceData(index=0, records=b"r" * 100)]) for i in range(10)])
    up = forwarded(send(s, PRODUCE, 9, body)[-1])
    rcls = body_class(PRODUCE, "response")
    out = broker_answers(s, up, rcls(responses=[rcls.TopicProduceResponse(name=f"t{i}", partition_responses=[
        rcls.PartitionProduceResponse(index=0)]) for i in range(10)]))
    entry = out[-1].done[0]
    topics = entry.request.body.topic_data
    assert type(topics) is LazyArray and not topics.decoded
    charged = f.budgets.peek(("one-k", "client_id=app")).produce.total(100.0, Windows.for_burst(11, 1.0, 1.0))
    # The records plus each topic's name and each partition's index, length and tags.
    assert charged == len(topics.raw) and 1000 < charged < 1000 + 10 * 12
    up = forwarded(send(s, FETCH, 12, fetch_request(50 << 20))[-1])
    fcls = body_class(FETCH, "response")
    answer = fcls(responses=[fcls.FetchableTopicResponse(topic=f"t{i}", partitions=[
        fcls.PartitionData(partition_index=0, records=batch_bytes(100))]) for i in range(10)])
    back = broker_answers(s, up, answer)[-1].done[0].response.body.responses
    assert type(back) is LazyArray and not back.decoded


def test_record_bytes_are_the_records_fields_sizes():
    assert produce_record_bytes(produce_body(700, partitions=3)) == 2100
    assert fetch_record_bytes(fetch_answer(5000, 200)) == (5200, 5000)
    cls = body_class(FETCH, "response")
    empty = cls(responses=[cls.FetchableTopicResponse(topic="t", partitions=[
        cls.PartitionData(partition_index=0, records=None), cls.PartitionData(partition_index=1, records=b"x")])])
    assert fetch_record_bytes(empty) == (1, 0)


def test_throttling_is_logged_at_debug_with_rule_key_and_time(tmp_path, caplog):
    s = session(quota_filter(tmp_path, ONE_K % ("client_id", 1)))
    with caplog.at_level(logging.DEBUG, logger="kproxy.quota"):
        produce_once(s, 1000)
        produce_once(s, 1500, client_id="app\nforged")
    lines = [r.getMessage() for r in caplog.records if r.name == "kproxy.quota"]
    assert len(lines) == 1
    assert "one-k" in lines[0] and "500 ms" in lines[0] and "\n" not in lines[0] and "app" in lines[0]


def test_the_budget_table_is_bounded_and_forgets_idle_budgets():
    budgets = Budgets(limit=50)
    for i in range(200):
        budgets.get(("q", f"client_id=c{i}"), 100.0, 11.0)
    assert len(budgets) <= 50 and budgets.evicted > 0
    keep = Budgets(limit=100_000)
    for i in range(1024):
        keep.get(("q", f"old{i}"), 100.0, 11.0)
    keep.get(("q", "new"), 200.0, 11.0)        # past the span of every old one: swept
    assert len(keep) == 1 and keep.evicted == 0


def test_budgets_in_use_survive_a_flood_of_new_keys():
    budgets = Budgets(limit=50)
    busy = budgets.get(("q", "client_id=busy"), 100.0, 11.0)     # the oldest key, but used all along
    for i in range(500):
        budgets.get(("q", f"client_id=c{i}"), 100.0, 11.0)
        assert budgets.get(("q", "client_id=busy"), 100.0, 11.0) is busy
    assert budgets.peek(("q", "client_id=busy")) is busy
    assert len(budgets) <= 50 and budgets.evicted > 0
    assert budgets.peek(("q", "client_id=c0")) is None         # the least recently used went first


def test_one_connection_rotating_client_ids_opens_few_budgets_and_stays_held(tmp_path):
    from kproxy.quota.engine import MAX_BUDGET_KEYS_PER_CONNECTION as CAP

    f = quota_filter(tmp_path, ONE_K % ("client_id", 1), budgets=Budgets(limit=2 * CAP))
    busy = session(f, connection_id=1)
    produce_once(busy, 500, client_id="app-busy")
    rotating = session(f, connection_id=2)
    throttles = [produce_once(rotating, 400, client_id=f"app-{i}")[0].body.throttle_time_ms for i in range(200)]
    # The first CAP ids each get a budget of their own; the rest share one, which fills and throttles.
    assert throttles[:CAP] == [0] * CAP and max(throttles[CAP:]) > 0
    assert len(f.budgets) == 1 + CAP + 1 and f.budgets.evicted == 0
    # The busy client's budget still holds its usage: 500 + 600 bytes is over 1000 in one second.
    assert produce_once(busy, 600, client_id="app-busy")[0].body.throttle_time_ms > 0
    _, entry = produce_once(rotating, 1, client_id="app-999")
    assert entry.notes["quota"]["key"] == f"client_id=<more than {CAP} on connection 2>"
    rotating.close()
    assert len(f.budgets) == 1 + CAP      # the overflow budget ends with its connection


def test_no_quotas_costs_no_budgets(tmp_path):
    f = quota_filter(tmp_path, "rules: []\n")
    s = session(f)
    _, entry = produce_once(s, 1 << 20)
    assert entry.notes is None and len(f.budgets) == 0


# -- the example in rules/


def test_the_quota_example(tmp_path):
    from kproxy.policy.loader import load_rules

    f = QuotaFilter(FixedRules.of(load_rules([str(RULES / "quotas.yaml")])))
    # Each team-a client has its own 5 MiB/s with 2 s of burst; the team shares 50 MiB/s.
    a1, a2 = session(f), session(f, connection_id=2)
    assert produce_once(a1, 10 << 20, client_id="team-a-orders")[0].body.throttle_time_ms == 0
    resp, entry = produce_once(a1, 5 << 20, client_id="team-a-orders")
    assert resp.body.throttle_time_ms == 1000 and entry.notes["quota"]["rule"] == "team-a-each-client"
    assert produce_once(a2, 10 << 20, client_id="team-a-billing")[0].body.throttle_time_ms == 0
    # The batch job's connections share one budget by principal.
    b1, b2 = session(f, tls_subject="batch-etl"), session(f, connection_id=4, tls_subject="batch-etl")
    assert produce_once(b1, 20 << 20)[0].body.throttle_time_ms == 0
    resp, entry = produce_once(b2, 10 << 20)
    assert resp.body.throttle_time_ms == 500 and entry.notes["quota"]["key"] == "principal=User:batch-etl"
    # The admin tool: ten metadata requests a second.
    tool = session(f)
    times = [metadata_once(tool, client_id="admin-tool-1").body.throttle_time_ms for _ in range(11)]
    assert times[:10] == [0] * 10 and times[10] == 100
    # Other clients are not limited at all.
    assert produce_once(session(f), 100 << 20, client_id="someone")[1].notes is None


# -- rule files


def check_problems(tmp_path: Path, text: str) -> list[str]:
    from kproxy.policy.loader import RuleError, load_rules

    with pytest.raises(RuleError) as e:
        load_rules([write_rules(tmp_path, text, "q.yaml")])
    return [str(p) for p in e.value.problems]


def test_quota_mistakes_are_named_with_file_line_and_column(tmp_path):
    problems = check_problems(tmp_path, """\
        quotas:
          - name: a
            per: clientid
            produce_bytes_per_second: 5
          - name: b
            requests_per_s: 0
            request_time_percent: 150
            burst_s: 120
          - name: c
            match: {topic: "orders-*", client_id: x}
            fetch_bytes_per_s: 10
          - name: a
            requests_per_s: 1
        """)
    q = str(tmp_path / "q.yaml")
    assert problems == [
        f"{q}:3:10: quota 'a': per: unknown budget key 'clientid' (did you mean 'client_id'?)",
        f"{q}:4:5: quota 'a': unknown key 'produce_bytes_per_second' (did you mean 'produce_bytes_per_s'?)",
        f"{q}:6:21: quota 'b': requests_per_s: must be more than 0, got 0",
        f"{q}:7:27: quota 'b': request_time_percent: must be at most 100, got 150",
        f"{q}:8:14: quota 'b': burst_s: must be at most 60, got 120",
        f"{q}:10:13: quota 'c': match.topic: a quota cannot select by topic: budgets count whole requests; "
        "select clients and APIs instead (client_id, principal, source, listener, client_software, api, "
        "api_version, acks)",
        f"{q}:12:11: quota 'a': name: the name 'a' is already used at {q}:2:5",
    ]


def test_quota_names_are_unique_across_files_but_may_repeat_a_rule_name(tmp_path):
    from kproxy.policy.loader import RuleError, load_rules

    a = write_rules(tmp_path, "rules: [{name: x, action: allow}]\nquotas: [{name: x, requests_per_s: 1}]\n", "a.yaml")
    b = write_rules(tmp_path, "quotas: [{name: x, requests_per_s: 2}]\n", "b.yaml")
    assert [q.name for q in load_rules([a]).quotas] == ["x"]
    with pytest.raises(RuleError, match=r"b\.yaml:1:17: quota 'x': name: the name 'x' is already used at .*a\.yaml:2:10"):
        load_rules([a, b])


def test_a_quota_without_limits_loads_with_a_warning_and_rates_may_be_written_1e6(tmp_path):
    from kproxy.policy.loader import load_rules

    rs = load_rules([write_rules(tmp_path, "quotas:\n  - name: idle\n  - name: big\n    produce_bytes_per_s: 1e6\n"
                                           "    burst_s: 2.5\n")])
    idle, big = rs.quotas
    assert idle.limits == {} and any("quota 'idle' sets no limit" in w for w in rs.warnings)
    assert big.limits == {"produce_bytes_per_s": 1e6} and big.burst_s == 2.5 and big.per == "client_id"


def test_kproxy_check_accepts_a_report_quota_file(tmp_path, capsys):
    """The shape ``kproxy report`` writes to recommended-quotas.yaml (yaml.safe_dump of its advice)."""
    import yaml

    from kproxy.cli import main

    doc = {"default": "allow", "rules": [], "quotas": [
        {"name": "client-app-1", "match": {"client_id": "app-1"}, "per": "client_id",
         "produce_bytes_per_s": 1048576, "fetch_bytes_per_s": 2097152, "requests_per_s": 100, "burst_s": 1},
        {"name": "principal-user-etl", "match": {"principal": "User:etl"}, "per": "principal",
         "requests_per_s": 3, "burst_s": 1},
    ]}
    path = tmp_path / "recommended-quotas.yaml"
    path.write_text("# Recommended quotas from kproxy report\n"
                    + yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=100))
    assert main(["check", "--rules", str(path)]) == 0
    assert "2 quotas" in capsys.readouterr().out


# -- kproxy.yaml


def test_quota_replicas_and_windows_in_kproxy_yaml(tmp_path):
    from kproxy.config import ConfigError, load_config, parse_config

    head = 'listen: "127.0.0.1:9092"\nupstream: {bootstrap_servers: "k:1"}\n'
    cfg = parse_config(head + "quota_replicas: ${KPROXY_REPLICAS:-1}\nquota: {samples: 5, window_s: 0.5}\n",
                       env={"KPROXY_REPLICAS": "3"})
    assert (cfg.quota_replicas, cfg.quota.samples, cfg.quota.window_s) == (3, 5, 0.5)
    assert cfg.quota_share() == pytest.approx(1 / 3)
    default = parse_config(head + "quota_replicas: ${KPROXY_REPLICAS:-1}\n", env={})
    assert (default.quota_replicas, default.quota.samples, default.quota.window_s, default.quota_share()) == (
        1, 11, 1.0, 1.0)
    for text, reason in (("quota_replicas: 0\n", "quota_replicas: must be at least 1, got 0"),
                         ("quota: {window_s: 0}\n", "quota.window_s: must be greater than 0"),
                         ("quota: {sampels: 3}\n", "did you mean 'samples'")):
        path = tmp_path / "kproxy.yaml"
        path.write_text(head + text)
        with pytest.raises(ConfigError, match=reason) as e:
            load_config(path)
        assert e.value.line == 3


def test_the_server_enforces_this_replicas_share(tmp_path):
    from kproxy.config import config_from_args
    from kproxy.server.process import ProxyProcess

    rules = write_rules(tmp_path, ONE_K % ("client_id", 1))
    server = ProxyProcess.from_config(config_from_args("127.0.0.1:9092", "127.0.0.1:19092", rules=[rules], quota_replicas=2,
                                          quota={"samples": 4, "window_s": 2.0})).cluster()
    (f,) = [f for f in server.chain.filters if isinstance(f, QuotaFilter)]
    assert (f.share, f.samples, f.window_s) == (0.5, 4, 2.0)
    ctx = server.new_context(1, ("127.0.0.1", 5555))
    ctx.clock = Clock()
    s = Session(ctx, server.chain)
    resp, _ = produce_once(s, 1000)
    # 1000 bytes of 500/s over a 1 s burst window: (1000 - 500) / 500 * 1 s.
    assert resp.body.throttle_time_ms == 1000
    # One of two worker processes of that replica enforces a quarter.
    worker = ProxyProcess.from_config(server.config, worker=(1, 2)).cluster()
    assert [f.share for f in worker.chain.filters if isinstance(f, QuotaFilter)] == [0.25]
    # A per-connection quota is whole on that worker: its connection is there alone.
    Path(rules).write_text(ONE_K % ("connection", 1))
    worker = ProxyProcess.from_config(server.config, worker=(1, 2)).cluster()
    ctx = worker.new_context(1, ("127.0.0.1", 5555))
    ctx.clock = Clock()
    resp, _ = produce_once(Session(ctx, worker.chain), 1000)
    assert resp.body.throttle_time_ms == 0

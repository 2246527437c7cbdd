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
from kproxy.proxy.filters import Filter
from kproxy.proxy.session import Session, ToClient, ToUpstream
from kproxy.quota.budgets import Budgets
from kproxy.quota.engine import QuotaFilter, fetch_record_bytes, produce_record_bytes
from kproxy.quota.rate import SampledRate, Windows, throttle_seconds

from .rulebook import rule_set, session, write_rules
from .test_policy_filter import broker_answers, send
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


def test_a_quota_for_each_replica(tmp_path):
    s = session(quota_filter(tmp_path, ONE_K % ("client_id", 1), share=0.5))
    assert produce_once(s, 1000)[0].body.throttle_time_ms == 1000     # 1000 of 500/s
    cfg = config_from_args("127.0.0.1:9092", "127.0.0.1:19092", quota_replicas=4)
    assert cfg.quota_share == 0.25


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

    def on_request(self, ctx, request):
        ctx.clock.now += self.seconds

    def on_response(self, ctx, request, response):
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
    # 2000 bytes left, but the largest batch seen is 8000.
    up, resp = fetch_once(s, 50 << 20, (6000, 3000))
    assert up.body.max_bytes == 8000
    assert resp.body.throttle_time_ms == kafka_throttle_ms(17000, 1.0, 10000) == 700
    # Over the budget: still one batch.
    up, _ = fetch_once(s, 50 << 20, (100,))
    assert up.body.max_bytes == 8000
    # A client asking for less than the budget allows is left alone.
    at(s, 200.0)
    up, _ = fetch_once(s, 4000, (100,))
    assert up.body.max_bytes == 4000 and {p.partition_max_bytes for p in up.body.topics[0].partitions} == {1 << 20}


def test_an_old_fetch_without_max_bytes_shares_the_budget_over_its_partitions(tmp_path):
    s = session(quota_filter(tmp_path, FETCH_10K))
    up, _ = fetch_once(s, 0, (300, 300), version=2)
    assert {p.partition_max_bytes for p in up.body.topics[0].partitions} == {1 << 20}   # no batch seen yet
    up, _ = fetch_once(s, 0, (300,), version=2)
    assert {p.partition_max_bytes for p in up.body.topics[0].partitions} == {(10000 - 600) // 2}


def test_an_acks0_produce_is_charged_when_sent_and_mutes_the_connection(tmp_path):
    s = session(quota_filter(tmp_path, ONE_K % ("client_id", 1)))
    out = send(s, PRODUCE, 9, produce_body(3000, acks=0))
    assert [type(a) for a in out] == [ToUpstream]
    assert out[0].entry.notes["quota"]["throttle_ms"] == 2000
    assert s.throttled_for(100.0) == pytest.approx(2.0)


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

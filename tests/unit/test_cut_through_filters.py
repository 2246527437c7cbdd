"""Cut-through with policy rules and quotas configured: a Fetch answer streams when, for that exchange,
no filter would change it, and then reaches the client, the budgets, the metrics, the traffic log and
the spans exactly as the stored answer does; a partial denial, a tenant prefix on a name-based
version or an answer a quota may have to cut is stored, with its reason."""

from __future__ import annotations

import logging
import random
import struct
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kproxy.policy.engine import FixedRules
from kproxy.policy.filter import PolicyFilter
from kproxy.protocol.messages import (
    Request,
    Response,
    body_class,
    decode_response,
    encode_request_frame,
    encode_response_frame,
)
from kproxy.protocol.records import build_batch
from kproxy.proxy.actions import Close, ToClient, ToUpstream
from kproxy.proxy.addresses import AddressMap, AddressRewriter
from kproxy.proxy.filters import ConnectionContext, Filter, FilterChain
from kproxy.proxy.inflight import STORED, STREAMED
from kproxy.proxy.session import Session
from kproxy.proxy.topics import TopicNames
from kproxy.proxy.versions import ApiVersionsNarrower
from kproxy.quota.engine import QuotaFilter
from kproxy.quota.rate import Windows
from kproxy.telemetry.exchange import Exchange, Learned
from kproxy.telemetry.metrics import Metrics
from kproxy.telemetry.spans import span_attributes
from kproxy.telemetry.traffic_log import traffic_line

from .rulebook import Clock, rule_set

FETCH = 1
TOPIC_ID = uuid.UUID("1b4e28ba-2fa1-11d2-883f-0016d3cca427")
SECRET_ID = uuid.UUID(int=0x5EC)
RULES = """\
rules:
  - name: no-secrets
    match: {topic: "secret-*"}
    action: deny
  - name: team-a
    match: {client_id: "team-a-*"}
    action: rewrite
    rewrite: {topic_prefix: "tenant-a."}
quotas:
  - name: readers
    match: {client_id: "app*"}
    fetch_bytes_per_s: 300000
    requests_per_s: 1000
"""


class Proxy:
    """One session with the built-in filters and the rules above, on its own budgets and clock."""

    def __init__(self, tmp_path: Path, min_bytes: int | None, text: str = RULES) -> None:
        rules = FixedRules.of(rule_set(tmp_path, text))
        names = TopicNames()
        names.learn([SimpleNamespace(topic_id=TOPIC_ID, name="t"), SimpleNamespace(topic_id=SECRET_ID,
                                                                                      name="secret-x"),
                     SimpleNamespace(topic_id=uuid.UUID(int=0xA), name="tenant-a.t")])
        self.quota = QuotaFilter(rules, 11, 1.0)
        rewriter = AddressRewriter(AddressMap("proxy.example", 19000, 16, node_id_base=0))
        self.clock = Clock(100.0)
        self.ctx = ConnectionContext(1, client_address=("10.1.2.3", 40000), clock=self.clock)
        chain = FilterChain([ApiVersionsNarrower(), rewriter, PolicyFilter(rules, random.Random(1), names),
                             self.quota])
        self.session = Session(self.ctx, chain, stream_min_bytes=min_bytes, topic_names=names)

    def fetch(self, topics: tuple[Any, ...] = (TOPIC_ID,), version: int = 16, client_id: str = "app",
              max_bytes: int = 50 << 20) -> int:
        """A Fetch of partition 0 of each topic (names or ids, by version); kproxy's correlation id."""
        rq: Any = body_class(FETCH, "request")
        body = rq(max_wait_ms=100, min_bytes=1, max_bytes=max_bytes, topics=[
            rq.FetchTopic(topic_id=t if version >= 13 else None, topic=t if version < 13 else "",
                          partitions=[rq.FetchPartition(partition=0, fetch_offset=500, partition_max_bytes=1 << 20)])
            for t in topics])
        frame = b"".join(bytes(b) for b in encode_request_frame(Request.build(FETCH, version, 7, client_id, body)))
        up = [a for a in self.session.client_frame(memoryview(frame)[4:]) if isinstance(a, ToUpstream)]
        assert len(up) == 1, "the Fetch was not forwarded"
        return struct.unpack_from(">i", b"".join(bytes(b) for b in up[0].buffers), 8)[0]

    def answer(self, upstream_id: int, frame: bytes, piece: int = 10_000) -> tuple[bytes, Any, bool]:
        """The broker's answer, fed as a reader would: (what the client got, the entry, streamed?)."""
        s = self.session
        actions: list = []
        streamed = s.stream_start(len(frame), memoryview(frame)[:16], True)
        if streamed:
            for i in range(0, len(frame), piece):
                actions += s.stream_piece(memoryview(bytearray(frame[i:i + piece])))
        else:
            actions = s.upstream_frame(memoryview(bytearray(frame)))
        assert not [a for a in actions if isinstance(a, Close)]
        done = [e for a in actions if isinstance(a, ToClient) for e in a.done]
        assert len(done) == 1
        entry = done[0]
        entry.finished_at = self.clock.now
        s.finish(entry)
        return b"".join(bytes(b) for a in actions if isinstance(a, ToClient) for b in a.buffers), entry, streamed


def answer_frame(upstream_id: int, topics: tuple[Any, ...] = (TOPIC_ID,), version: int = 16, batches: int = 1,
                 throttle_ms: int = 0, records: int = 100) -> bytes:
    cls: Any = body_class(FETCH, "response")
    batch = b"".join(build_batch([(None, b"v" * 1000)] * records, base_offset=500 + records * i)
                     for i in range(batches))
    body = cls(throttle_time_ms=throttle_ms, responses=[cls.FetchableTopicResponse(
        topic_id=t if version >= 13 else None, topic=t if version < 13 else "", partitions=[
            cls.PartitionData(partition_index=0, high_watermark=10_000, records=batch)]) for t in topics])
    return b"".join(bytes(b) for b in encode_response_frame(Response.build(FETCH, version, upstream_id, body)))[4:]


def telemetry(entry: Any, ctx: ConnectionContext) -> tuple[dict, dict, bytes]:
    """(traffic log line, span attributes, /metrics) of one completed request."""
    x = Exchange(entry, ctx, Learned())
    metrics = Metrics()
    metrics.record(x)
    exposition = b"\n".join(line for line in metrics.exposition().splitlines()
                            if not line.startswith(b"kproxy_frames_total"))
    return traffic_line(x, 0.0), span_attributes(x), exposition


def through_both(streamed: Proxy, stored: Proxy, now: float, version: int, batches: int, broker_throttle: int,
                 records: int, piece: int = 10_000) -> tuple[Any, bool]:
    """The same Fetch and answer through a proxy that streams and one that stores: everything the
    client, the quota and telemetry see must be equal. (The streamed proxy's entry, whether it streamed.)"""
    topic = TOPIC_ID if version >= 13 else "t"
    got = []
    for p in (streamed, stored):
        p.clock.now = now
        up = p.fetch((topic,), version)
        frame = answer_frame(up, (topic,), version, batches, broker_throttle, records)
        got.append((p.answer(up, frame, piece), len(frame)))
    ((s_bytes, s_entry, was_streamed), size), ((t_bytes, t_entry, was_stored), _) = got
    assert not was_stored and t_entry.path == STORED
    assert s_entry.path == (STREAMED if was_streamed else STORED)
    # The quota lowered max_bytes on the request alike.
    assert s_entry.request.body.max_bytes == t_entry.request.body.max_bytes
    # The same bytes: the throttle patched in place is the stored answer's re-encoded value.
    assert s_bytes == t_bytes and (len(s_bytes) == size + 4 or not was_streamed)
    assert s_entry.throttle_ms == t_entry.throttle_ms
    assert s_entry.notes == t_entry.notes and s_entry.notes["quota"]["rule"] == "readers"
    assert streamed.session.throttled_for(now) == stored.session.throttled_for(now)
    s_line, s_span, s_metrics = telemetry(s_entry, streamed.ctx)
    t_line, t_span, t_metrics = telemetry(t_entry, stored.ctx)
    if s_entry.response_why_stored is not None:
        # The one difference: /metrics says why the streaming proxy stored it.
        assert b'reason="filter quota"} 1.0' in s_metrics and b"reason=" not in t_metrics
        s_metrics, t_metrics = (b"\n".join(line for line in m.splitlines()
                                           if not line.startswith(b"kproxy_frames_stored_large"))
                                for m in (s_metrics, t_metrics))
    assert s_line == t_line and s_span == t_span and s_metrics == t_metrics
    assert s_line["partitions"][0]["records"] == sum(p["records"] for p in t_line["partitions"]) > 0
    w = Windows.for_burst(11, 1.0, 1.0)
    budgets = [p.quota.budgets.peek(("readers", "client_id=app")) for p in (streamed, stored)]
    assert budgets[0].fetch.total(now, w) == budgets[1].fetch.total(now, w) > 0
    # The largest batch seen, which bounds how far a later Fetch's max_bytes is lowered, is the same too.
    assert streamed.ctx.peek_state(streamed.quota).largest_batch == stored.ctx.peek_state(stored.quota).largest_batch
    return s_entry, was_streamed


@pytest.mark.parametrize("version", [12, 16])
def test_a_throttling_quota_gives_the_streamed_answer_what_it_gives_the_stored_one(tmp_path, version):
    streamed, stored = Proxy(tmp_path, 64 * 1024), Proxy(tmp_path, None)
    throttles = []
    # The first answer's batch is the largest: the quota lowers max_bytes no further than that.
    for i, (now, batches, broker_throttle, records) in enumerate(
            [(100.0, 1, 0, 120), (100.1, 2, 0, 60), (100.2, 1, 5000, 100), (100.3, 1, 0, 100), (100.4, 1, 0, 100),
             (115.0, 1, 0, 100)]):
        entry, was_streamed = through_both(streamed, stored, now, version, batches, broker_throttle, records)
        assert was_streamed, f"answer {i}: {entry.response_why_stored}"
        throttles.append(entry.throttle_ms)
    assert throttles[2] == 5000       # the broker's own, larger throttle stays
    # The quota did throttle (and then forgot the usage): the comparison is not of zeros.
    assert throttles[3] > 0 and throttles[4] > throttles[3] and throttles[5] == 0, throttles


@pytest.mark.parametrize("seed", range(12))
def test_random_fetches_through_a_quota_are_the_same_streamed_or_stored(tmp_path, seed):
    rng = random.Random(seed)
    limit = rng.choice((150_000, 300_000, 600_000))
    streamed = Proxy(tmp_path, 64 * 1024, RULES.replace("300000", str(limit)))
    stored = Proxy(tmp_path, None, RULES.replace("300000", str(limit)))
    now, paths, throttled = 100.0, set(), 0     # throttled: streamed answers that carried a throttle
    for _ in range(8):
        now += rng.choice((0.0, 0.05, 0.2, 0.7, 3.0))
        entry, was_streamed = through_both(
            streamed, stored, now, rng.choice((4, 7, 11, 12, 13, 16)), rng.randint(1, 3),
            rng.choice((0, 0, 0, rng.randint(1, 3000))), rng.randint(70, 130), rng.randint(1, 40_000))
        paths.add(was_streamed)
        throttled += was_streamed and entry.throttle_ms > 0
    assert True in paths and throttled


def test_policy_rules_that_change_nothing_let_the_answer_stream(tmp_path):
    p = Proxy(tmp_path, 64 * 1024)
    for version, topic in ((16, TOPIC_ID), (12, "t")):
        up = p.fetch((topic,), version)
        _, entry, streamed = p.answer(up, answer_frame(up, (topic,), version))
        assert streamed and entry.path == STREAMED and entry.response_why_stored is None
    # A tenant's answer by topic id carries no names: nothing to take a prefix off, so it streams.
    up = p.fetch((uuid.UUID(int=0xA),), 16, client_id="team-a-1")
    _, entry, streamed = p.answer(up, answer_frame(up, (uuid.UUID(int=0xA),), 16))
    assert streamed and entry.path == STREAMED


def test_a_partial_denial_stores_the_answer_and_says_why(tmp_path, caplog):
    p = Proxy(tmp_path, 64 * 1024)
    up = p.fetch((TOPIC_ID, SECRET_ID), 16)
    with caplog.at_level(logging.DEBUG, logger="kproxy.session"):
        sent, entry, streamed = p.answer(up, answer_frame(up, (TOPIC_ID,), 16, batches=2))
    assert not streamed and entry.path == STORED and entry.response_why_stored == "filter policy"
    assert "stored whole, not streamed: filter policy" in caplog.text
    # kproxy's refusal is merged into the broker's answer: what streaming could not have done.
    back = decode_response(memoryview(sent)[4:], FETCH, 16)
    assert sorted(t.topic_id for t in back.body.responses) == sorted([TOPIC_ID, SECRET_ID])
    metrics = Metrics()
    metrics.record(Exchange(entry, p.ctx, Learned()))
    assert (b'kproxy_frames_stored_large_total{api="fetch",direction="response",reason="filter policy"} 1.0'
            in metrics.exposition())


def test_a_tenant_prefix_on_a_name_based_version_stores_the_answer(tmp_path):
    p = Proxy(tmp_path, 64 * 1024)
    up = p.fetch(("t",), 12, client_id="team-a-1")
    _, entry, streamed = p.answer(up, answer_frame(up, ("tenant-a.t",), 12))
    assert not streamed and entry.response_why_stored == "filter policy"
    assert [t.topic for t in entry.response.body.responses] == ["t"]


def test_an_answer_a_fetch_quota_may_have_to_cut_is_stored(tmp_path):
    p = Proxy(tmp_path, 64 * 1024)
    up = p.fetch((TOPIC_ID,), 16, max_bytes=150_000)
    _, entry, streamed = p.answer(up, answer_frame(up, (TOPIC_ID,), 16, batches=2))
    assert not streamed and entry.response_why_stored == "filter quota"
    assert sum(len(pd.records) for t in entry.response.body.responses for pd in t.partitions) < 150_000
    # Within max_bytes it streams (once the budget has room again, or max_bytes would be lowered).
    p.clock.now = 130.0
    up = p.fetch((TOPIC_ID,), 16, max_bytes=250_000)
    _, entry, streamed = p.answer(up, answer_frame(up, (TOPIC_ID,), 16, batches=2))
    assert streamed


class Refuses(Filter):
    """A filter that must see Fetch answers whole and never consents: the default."""

    name = "refuses"
    response_api_keys = frozenset({FETCH})


def test_a_filter_that_does_not_consent_keeps_the_answer_stored(tmp_path):
    p = Proxy(tmp_path, 64 * 1024)
    p.session.chain = FilterChain([*p.session.chain.filters, Refuses()])
    up = p.fetch()
    _, entry, streamed = p.answer(up, answer_frame(up))
    assert not streamed and entry.response_why_stored == "filter refuses"


def test_a_filter_failing_on_the_head_closes_the_connection_before_anything_is_sent(tmp_path):
    class Fails(Filter):
        name = "fails"
        response_api_keys = frozenset({FETCH})

        def may_stream_response(self, ctx: Any, exchange: Any) -> bool:
            return True

        def on_response_head(self, ctx: Any, exchange: Any, head: Any) -> float:
            raise RuntimeError("boom")

    p = Proxy(tmp_path, 64 * 1024)
    p.session.chain = FilterChain([*p.session.chain.filters, Fails()])
    up = p.fetch()
    frame = answer_frame(up)
    assert p.session.stream_start(len(frame), memoryview(frame)[:16], True)
    actions = p.session.stream_piece(memoryview(frame)[:5000])
    assert not [a for a in actions if isinstance(a, ToClient)]
    assert [a.reason for a in actions if isinstance(a, Close)] == ["internal error in filter 'fails' "
                                                                   "(on_response_head on fetch)"]

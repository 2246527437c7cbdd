"""Which Produce requests the policy and quota filters let stream to the broker (``may_stream_request``),
and that the ones they keep whole are stored and judged exactly as before. Pure: sessions only."""

from __future__ import annotations

from typing import Any

import pytest

from kproxy.protocol.messages import Request, body_class, encode_request_frame
from kproxy.protocol.records import build_batch
from kproxy.proxy.actions import Close, StreamUp, ToClient, ToUpstream
from kproxy.proxy.inflight import STORED, STREAMED
from kproxy.quota.engine import QuotaFilter

from .rulebook import FixedRules, policy_filter, rule_set, session
from .test_session import answered, response_frame

PRODUCE = 0
BATCH = build_batch([(None, b"v" * 1000)] * 20)     # about 20 KiB


def frame(topics: tuple[str, ...] = ("a", "secret-b"), acks: int = -1, txn: str | None = None, version: int = 9,
          client_id: str = "app") -> bytes:
    rq: Any = body_class(PRODUCE, "request")
    body = rq(transactional_id=txn, acks=acks, timeout_ms=1000, topic_data=[
        rq.TopicProduceData(name=t, partition_data=[rq.PartitionProduceData(index=i, records=BATCH) for i in (0, 1)])
        for t in topics])
    return b"".join(bytes(b) for b in encode_request_frame(Request.build(PRODUCE, version, 7, client_id, body)))[4:]


def feed(s, data: bytes, piece: int = 5000) -> list:
    """Offer ``data`` to the session's streaming path as the connection does; every action."""
    s.stream_min_bytes = 1
    if not s.request_stream_start(len(data), memoryview(data)[:8], True):
        return s.client_frame(memoryview(data))
    out: list = []
    for i in range(0, len(data), piece):
        out += s.request_piece(memoryview(bytearray(data[i:i + piece])))
    return out


def path_of(actions: list) -> str:
    if any(isinstance(a, StreamUp) for a in actions):
        return STREAMED
    assert not any(isinstance(a, Close) for a in actions), actions
    return STORED


STREAMING = {
    "no rules": "rules: []\n",
    "allow by client": "rules: [{name: ok, match: {client_id: 'app*'}, action: allow}]\n",
    "deny another api": "rules: [{name: no-fetch, match: {api: fetch}, action: deny}]\n",
    "deny another client": "rules: [{name: no-x, match: {client_id: 'x-*'}, action: deny}]\n",
    "acks required and kept": "rules: [{name: acks, match: {api: produce}, action: require, require: {acks: all}}]\n",
    "log": "rules: [{name: watch, action: log}]\n",
    "transactional id allowed": "rules: [{name: no-txn, match: {transactional_id: 'bad-*'}, action: deny}]\n",
}
STORING = {
    "topic deny": "rules: [{name: no-secrets, match: {topic: 'secret-*'}, action: deny}]\n",
    "topic allow": "rules: [{name: only-a, match: {topic: 'a'}, action: allow}]\n",
    "default deny": "default: deny\nrules: [{name: ok, match: {client_id: 'app*'}, action: allow}]\n",
    "tenant prefix": "rules: [{name: t, match: {client_id: 'app*'}, action: rewrite, rewrite: {topic_prefix: 'x.'}}]\n",
    "validate": "rules: [{name: v, match: {api: produce}, action: validate, validate: {value: json}}]\n",
    "headers": "rules: [{name: h, action: headers, headers: {set: {x-a: b}}}]\n",
    "compression selector": "rules: [{name: z, match: {compression: [gzip]}, action: deny}]\n",
    "batch requirement": "rules: [{name: z, action: require, require: {max_batch_bytes: 100000}}]\n",
    "cap timeout": "rules: [{name: c, action: cap, cap: {timeout_ms: 10}}]\n",
    "acks required and broken": "rules: [{name: acks, match: {api: produce}, action: require, require: {acks: 1}}]\n",
    "transactional id refused": "rules: [{name: no-txn, match: {transactional_id: 't-*'}, action: deny}]\n",
}


@pytest.mark.parametrize("name", list(STREAMING))
def test_rules_that_can_only_let_a_produce_through_unchanged_let_it_stream(tmp_path, name):
    s = session(policy_filter(tmp_path, STREAMING[name]))
    actions = feed(s, frame(txn="t-1"))
    assert path_of(actions) == STREAMED
    (entry,) = s.open
    assert entry.request_path == STREAMED and entry.why_stored is None


@pytest.mark.parametrize("name", list(STORING))
def test_rules_that_could_refuse_or_change_part_of_a_produce_keep_it_whole(tmp_path, name):
    data = frame(txn="t-1")
    s = session(policy_filter(tmp_path, STORING[name]))
    actions = feed(s, data)
    assert path_of(actions) == STORED
    (entry,) = s.open
    assert entry.request_path == STORED and entry.why_stored == "filter policy"
    # Judged whole, exactly as a request read whole is.
    plain = session(policy_filter(tmp_path, STORING[name]))
    want = plain.client_frame(memoryview(data))
    assert [type(a) for a in actions] == [type(a) for a in want]
    for got, expected in zip(actions, want, strict=True):
        if isinstance(got, ToUpstream | ToClient):
            assert b"".join(bytes(b) for b in got.buffers) == b"".join(bytes(b) for b in expected.buffers)


def test_a_partial_denial_of_a_later_topic_is_still_merged_into_the_answer(tmp_path):
    """The topic refused comes after the first topic's records: the request is stored, so the refused
    topic never reaches the broker and its error is merged into the broker's answer."""
    s = session(policy_filter(tmp_path, STORING["topic deny"]))
    actions = feed(s, frame(("a", "secret-b")))
    (up,) = [a for a in actions if isinstance(a, ToUpstream)]
    data = b"".join(bytes(b) for b in up.buffers)
    assert b"secret-b" not in data and b"a" in data


QUOTA = """\
quotas:
  - name: slow
    match: {client_id: "app*"}
    per: client_id
    produce_bytes_per_s: 1000
"""


@pytest.mark.parametrize("acks", [-1, 0])
def test_quotas_let_a_produce_stream_and_charge_what_its_records_held(tmp_path, acks):
    throttles = []
    for streamed in (True, False):
        quota = QuotaFilter(FixedRules.of(rule_set(tmp_path, QUOTA)))
        s = session(quota)
        data = frame(acks=acks)
        actions = feed(s, data) if streamed else s.client_frame(memoryview(data))
        assert path_of(actions) == (STREAMED if streamed else STORED)
        if acks == 0:
            # Charged at once (no answer will come to carry the throttle): the connection is muted.
            throttles.append(round(s.throttled_for(s.ctx.clock()), 6))
            continue
        (entry,) = s.in_flight
        rs: Any = body_class(PRODUCE, "response")
        body = rs(responses=[rs.TopicProduceResponse(name=t, partition_responses=[
            rs.PartitionProduceResponse(index=i, base_offset=0) for i in (0, 1)]) for t in ("a", "secret-b")])
        back = s.upstream_frame(memoryview(response_frame(PRODUCE, 9, entry.upstream_correlation_id, body)))
        throttles.append(answered(back[-1], PRODUCE, 9).body.throttle_time_ms)
    # The same throttle either way: the quota saw the same record bytes (4 batches of about 20 KiB).
    assert throttles[0] == throttles[1] and throttles[0] > 0


def test_both_filters_must_agree(tmp_path):
    quota = QuotaFilter(FixedRules.of(rule_set(tmp_path, QUOTA)))
    s = session(policy_filter(tmp_path, STORING["topic deny"]), quota)
    assert path_of(feed(s, frame())) == STORED
    s = session(policy_filter(tmp_path, STREAMING["log"]), quota)
    assert path_of(feed(s, frame())) == STREAMED

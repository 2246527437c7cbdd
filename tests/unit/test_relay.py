"""The session's relay path: a request that nothing reads (no filter sees its api, no telemetry, no
transparency check) goes to the broker undecoded, checked whole by the accelerator, with kproxy's
correlation id; everything that needs the request decoded still gets it (``InFlight.decoded_request``),
and a request a filter or a rule sees always takes the full path."""

from __future__ import annotations

import struct

import pytest

from kproxy.protocol.compiler import native_skip
from kproxy.protocol.messages import body_class, decode_request
from kproxy.proxy.actions import Close, ToClient, ToUpstream
from kproxy.proxy.filters import ConnectionContext, Filter, FilterChain
from kproxy.proxy.session import Session
from kproxy.server.connection import allowed_seconds

from .rulebook import policy_filter
from .test_session import (
    API_VERSIONS,
    HEARTBEAT,
    OFFSET_COMMIT,
    PRODUCE,
    Clock,
    answered,
    heartbeat_request,
    kinds,
    produce_request,
    request_frame,
    response_frame,
    wire,
)

JOIN_GROUP = 11
pytestmark = pytest.mark.skipif(native_skip() is None, reason="the relay path needs the native accelerator")


def relaying(*filters: Filter, read_answers: bool = False) -> Session:
    """A session as the server makes one without telemetry (``read_answers=False``)."""
    return Session(ConnectionContext(1, clock=Clock()), FilterChain(filters), read_answers=read_answers)


def heartbeat_answer(correlation_id: int, error_code: int = 0) -> bytes:
    return response_frame(HEARTBEAT, 4, correlation_id, body_class(HEARTBEAT, "response")(error_code=error_code))


def test_a_request_nobody_reads_goes_to_the_broker_undecoded():
    s = relaying()
    frame = request_frame(HEARTBEAT, 4, 41, heartbeat_request(), client_id="consumer-7")
    (up,) = s.client_frame(frame)
    assert isinstance(up, ToUpstream)
    entry = up.entry
    # The path counter: relayed, never decoded.
    assert entry.request is None and entry.relayed is not None
    sent = wire(up)
    # The client's bytes, byte for byte, but for kproxy's correlation id.
    assert sent[:4] == bytes(frame[:4]) and sent[8:] == bytes(frame[8:])
    (upstream_id,) = struct.unpack_from(">i", sent, 4)
    assert upstream_id == entry.upstream_correlation_id
    assert s.ctx.client_id == "consumer-7"
    out = s.upstream_frame(memoryview(heartbeat_answer(upstream_id, error_code=27)))
    assert kinds(out) == [ToClient]
    back = answered(out[0], HEARTBEAT, 4)
    assert (back.correlation_id, back.body.error_code) == (41, 27)
    assert out[0].done == (entry,) and entry.request is None


@pytest.mark.parametrize("version", range(0, 14))
@pytest.mark.parametrize("acks", [0, 1, -1])
def test_a_relayed_produce_request_reads_acks_from_its_bytes(version, acks):
    s = relaying()
    body = produce_request(acks=acks)
    if version >= 3:
        body.transactional_id = "a-transaction"
    frame = request_frame(PRODUCE, version, 5, body)
    (up,) = s.client_frame(frame)
    entry = up.entry
    assert entry.request is None and entry.relayed is not None
    assert wire(up)[8:] == bytes(frame[8:])
    # acks=0: no answer is owed, nothing waits for one.
    assert (entry.outcome == "no_response") is (acks == 0)
    assert s.awaiting_upstream == (0 if acks == 0 else 1)


@pytest.mark.parametrize(("api_key", "version", "body"), [
    (API_VERSIONS, 3, body_class(API_VERSIONS, "request")(client_software_name="x", client_software_version="1")),
])
def test_requests_the_session_reads_itself_are_decoded(api_key, version, body):
    s = relaying()
    (up,) = s.client_frame(request_frame(api_key, version, 5, body))
    assert up.entry.request is not None and up.entry.relayed is None


def test_a_relayed_request_is_decoded_when_a_filter_reads_its_answer_and_not_when_memory_serves():
    # Metadata: the address rewriter reads every answer, but not the request; a remembered answer
    # runs no filter at all.
    from .test_answer_memo import Client, confirm_all, metadata_answer, rewriter_setup

    m, chain, memo = rewriter_setup()
    c = Client(chain, memo, read_answers=False)
    body = metadata_answer([(1, "b1.internal", 9092), (2, "b2.internal", 9092)])
    _, resp, entry = c.ask(body)
    assert entry.request is not None and entry.relayed is None        # decoded with its answer
    assert [(b.host, b.port) for b in resp.body.brokers] == [("proxy.example", 19000), ("proxy.example", 19001)]
    confirm_all(m)
    c.ask(body)
    _, resp, entry = c.ask(body)
    assert memo.hits == 1 and entry.request is None and entry.relayed is not None
    assert [(b.host, b.port) for b in resp.body.brokers] == [("proxy.example", 19000), ("proxy.example", 19001)]


def test_with_telemetry_every_request_is_decoded():
    s = relaying(read_answers=True)
    (up,) = s.client_frame(request_frame(HEARTBEAT, 4, 5, heartbeat_request()))
    assert up.entry.request is not None and up.entry.relayed is None


class SeesHeartbeats(Filter):
    name = "sees-heartbeats"
    request_api_keys = frozenset({HEARTBEAT})

    def __init__(self) -> None:
        self.seen: list[str] = []

    def on_request(self, ctx, exchange):
        self.seen.append(exchange.request.body.group_id)


def test_a_request_a_filter_sees_takes_the_full_path():
    f = SeesHeartbeats()
    s = relaying(f)
    (up,) = s.client_frame(request_frame(HEARTBEAT, 4, 5, heartbeat_request()))
    assert f.seen == ["g"] and up.entry.request is not None


def test_a_request_a_rule_matches_takes_the_full_path(tmp_path):
    rules = policy_filter(tmp_path, "rules: [{name: no-heartbeats, match: {api: heartbeat}, action: deny}]\n")
    s = relaying(rules)
    out = s.client_frame(request_frame(HEARTBEAT, 4, 5, heartbeat_request()))
    # Refused by the rule, answered by kproxy: relayed, it would have gone to the broker.
    assert kinds(out) == [ToClient]
    assert answered(out[0], HEARTBEAT, 4).body.error_code != 0


def test_a_malformed_request_is_refused_as_before():
    s = relaying()
    frame = bytes(request_frame(HEARTBEAT, 4, 5, heartbeat_request()))
    out = s.client_frame(memoryview(frame[:-3]))
    assert kinds(out) == [Close]
    assert out[0].reason.startswith("malformed heartbeat v4 request: string member_id")


def test_a_lost_broker_connection_answers_a_relayed_request_as_a_decoded_one():
    s = relaying()
    s.client_frame(request_frame(HEARTBEAT, 4, 11, heartbeat_request()))
    oc = body_class(OFFSET_COMMIT, "request")
    (up,) = s.client_frame(request_frame(OFFSET_COMMIT, 8, 12, oc(group_id="g", member_id="m", topics=[
        oc.OffsetCommitRequestTopic(name="a", partitions=[
            oc.OffsetCommitRequestPartition(partition_index=0, committed_offset=5)])])))
    assert up.entry.relayed is not None
    out = s.upstream_lost("connection reset")
    assert kinds(out) == [ToClient, ToClient]
    heartbeat = answered(out[0], HEARTBEAT, 4)
    assert (heartbeat.correlation_id, heartbeat.body.error_code) == (11, 15)
    commit = answered(out[1], OFFSET_COMMIT, 8)
    assert commit.correlation_id == 12 and [p.error_code for p in commit.body.topics[0].partitions] == [15]


def test_the_watchdog_reads_a_relayed_requests_hold_from_its_bytes():
    s = relaying()
    jg = body_class(JOIN_GROUP, "request")(group_id="g", session_timeout_ms=10_000, rebalance_timeout_ms=60_000,
                                           member_id="", protocol_type="consumer", protocols=[])
    (up,) = s.client_frame(request_frame(JOIN_GROUP, 9, 3, jg))
    entry = up.entry
    assert entry.request is None
    # A JoinGroup may be held for its rebalance timeout: the watchdog must allow that much.
    assert allowed_seconds(entry, 30.0) == 90.0
    req = entry.decoded_request()
    assert req is not None and req.correlation_id == entry.upstream_correlation_id
    assert req.body.group_id == "g" and entry.relayed is None
    assert decode_request(wire(up)).body == req.body


# -- metrics without a decode: the same figures from the frames' headers and sizes

METADATA, OFFSET_DELETE = 3, 47


def _metrics_traffic(s: Session) -> tuple[list, bytes]:
    """A few exchanges through ``s``, each completed entry recorded in fresh metrics: (what each entry
    says, the metrics' exposition)."""
    from kproxy.telemetry.exchange import Exchange, Learned
    from kproxy.telemetry.metrics import Metrics

    hb = body_class(HEARTBEAT, "response")
    od = body_class(OFFSET_DELETE, "response")
    exchanges = [
        (HEARTBEAT, 4, heartbeat_request(), hb(throttle_time_ms=120, error_code=27)),
        (HEARTBEAT, 0, heartbeat_request(), hb(error_code=0)),          # no throttle time in v0
        (METADATA, 12, body_class(METADATA, "request")(topics=[]), body_class(METADATA, "response")(
            throttle_time_ms=7)),
        (PRODUCE, 9, produce_request(), body_class(PRODUCE, "response")(throttle_time_ms=5)),
        # Its throttle time is not its first field: decoded, so that metrics read the same.
        (OFFSET_DELETE, 0, body_class(OFFSET_DELETE, "request")(group_id="g", topics=[]),
         od(error_code=0, throttle_time_ms=33)),
    ]
    metrics, learned, seen = Metrics(), Learned(), []
    for i, (key, version, body, answer) in enumerate(exchanges):
        (up,) = s.client_frame(request_frame(key, version, 100 + i, body, client_id=f"client-{i}"))
        (out,) = s.upstream_frame(memoryview(response_frame(key, version, up.entry.upstream_correlation_id,
                                                            answer)))
        (entry,) = out.done
        s.finish(entry)
        metrics.record(Exchange(entry, s.ctx, learned))
        seen.append((entry.api_key, entry.request_bytes, entry.response_bytes, entry.throttle_ms, entry.outcome,
                     s.ctx.client_id, entry.request is None, entry.response is None))
    return seen, metrics.exposition()


def test_metrics_read_the_same_figures_from_relayed_exchanges_as_from_decoded_ones():
    relayed, relayed_metrics = _metrics_traffic(Session(
        ConnectionContext(1, clock=Clock()), FilterChain([]), read_answers=False,
        telemetry_reads=frozenset({PRODUCE, 1})))
    decoded, decoded_metrics = _metrics_traffic(relaying(read_answers=True))
    # The path counter: Heartbeat and Metadata went both ways undecoded; Produce (records are
    # counted) and OffsetDelete (throttle time not first; relayed, decoded with its answer) were read.
    assert [r[-2:] for r in relayed] == [(True, True), (True, True), (True, True), (False, False), (False, False)]
    assert all(r[-2:] == (False, False) for r in decoded)
    assert [r[:-2] for r in relayed] == [r[:-2] for r in decoded]
    assert [r[3] for r in relayed] == [120, 0, 7, 5, 33]
    assert relayed_metrics == decoded_metrics
    assert b'kproxy_throttle_seconds_total{rule="broker"} 0.165' in relayed_metrics


def test_a_throttle_time_behind_header_tagged_fields_is_read_as_the_decoder_reads_it():
    from kproxy.protocol.messages import decode_response

    s = Session(ConnectionContext(1, clock=Clock()), FilterChain([]), read_answers=False,
                telemetry_reads=frozenset({PRODUCE}))
    (up,) = s.client_frame(request_frame(HEARTBEAT, 4, 9, heartbeat_request()))
    cid = up.entry.upstream_correlation_id
    # Header v1 with one tagged field (tag 3, two bytes), then throttle_time_ms, error_code, no tags.
    frame = struct.pack(">i", cid) + b"\x01\x03\x02ab" + struct.pack(">ih", 250, 0) + b"\x00"
    assert decode_response(frame, HEARTBEAT, 4).body.throttle_time_ms == 250
    (out,) = s.upstream_frame(memoryview(frame))
    assert out.done[0].response is None and out.done[0].throttle_ms == 250


# -- rules-aware relay: apis no rule can address go by the policy filter undecoded


class _Reloading:
    """A RuleSource whose rules a test replaces, as ``RuleStore.install`` does on a reload."""

    def __init__(self, policy) -> None:
        self.policy = policy


def _rules(tmp_path, text: str):
    from kproxy.policy.engine import Policy

    from .rulebook import rule_set
    return Policy(rule_set(tmp_path, text))


def _policy_session(source) -> Session:
    import random

    from kproxy.policy.filter import PolicyFilter
    return relaying(PolicyFilter(source, random.Random(1)))


PRODUCE_FETCH_ONLY = """
    default: allow
    rules:
      - {name: audited-writes, match: {api: produce, topic: "audited-*"}, action: log}
      - {name: no-secrets, match: {api: fetch, topic: "secret-*"}, action: deny}
"""


def test_a_rule_added_on_reload_reaches_the_next_heartbeat_of_an_open_connection(tmp_path):
    source = _Reloading(_rules(tmp_path, PRODUCE_FETCH_ONLY))
    s = _policy_session(source)
    (up,) = s.client_frame(request_frame(HEARTBEAT, 4, 1, heartbeat_request()))
    # No rule addresses Heartbeat: relayed both ways, never decoded.
    assert up.entry.request is None and up.entry.relayed is not None
    (out,) = s.upstream_frame(memoryview(heartbeat_answer(up.entry.upstream_correlation_id)))
    assert out.done[0].request is None and out.done[0].response is None
    source.policy = _rules(tmp_path, PRODUCE_FETCH_ONLY + "      - {name: no-heartbeats, match: {api: heartbeat}, "
                                                          "action: deny}\n")
    out = s.client_frame(request_frame(HEARTBEAT, 4, 2, heartbeat_request()))
    # The same connection's next Heartbeat meets the new rule: refused by kproxy, never sent upstream.
    assert kinds(out) == [ToClient]
    refused = answered(out[0], HEARTBEAT, 4)
    assert refused.correlation_id == 2 and refused.body.error_code != 0
    assert out[0].done[0].notes["rule"] == "no-heartbeats"
    source.policy = _rules(tmp_path, PRODUCE_FETCH_ONLY)
    (up,) = s.client_frame(request_frame(HEARTBEAT, 4, 3, heartbeat_request()))
    assert up.entry.request is None and up.entry.relayed is not None


@pytest.mark.parametrize(("text", "relayed"), [
    (PRODUCE_FETCH_ONLY, True),
    # A rule without an api selector may apply to any api, whatever its other selectors say.
    ("rules: [{name: one-client, match: {client_id: nobody-here}, action: deny}]", False),
    ("rules: [{name: groups, match: {api: [heartbeat, join_group]}, action: log}]", False),
    ("rules: [{name: groups, match: {api: join_group}, action: log}]", True),
    ("default: deny\nrules: [{name: writes, match: {api: produce}, action: allow}]", False),
])
def test_only_apis_no_rule_can_address_are_relayed(tmp_path, text, relayed):
    s = _policy_session(_Reloading(_rules(tmp_path, text)))
    (out,) = s.client_frame(request_frame(HEARTBEAT, 4, 1, heartbeat_request(), client_id="someone"))
    entry = out.entry if isinstance(out, ToUpstream) else out.done[0]
    assert (entry.relayed is not None) is relayed


def test_a_request_a_rule_addresses_has_its_answer_read_while_others_pass_unread(tmp_path):
    # The rule logs Produce requests to audited topics: a Produce is decoded and judged, and its
    # answer read; the Heartbeat beside it is not.
    s = _policy_session(_Reloading(_rules(tmp_path, PRODUCE_FETCH_ONLY)))
    (up,) = s.client_frame(request_frame(PRODUCE, 9, 1, produce_request(topics=(("audited-x", (0,)),))))
    assert up.entry.request is not None
    (out,) = s.upstream_frame(memoryview(response_frame(PRODUCE, 9, up.entry.upstream_correlation_id,
                                                        body_class(PRODUCE, "response")(responses=[]))))
    assert out.done[0].response is not None


@pytest.mark.parametrize(("extra", "remembered"), [
    ("", True),
    # A rule that addresses Metadata: the policy filter reads every answer, none is remembered.
    ("      - {name: look, match: {api: metadata}, action: log}\n", False),
])
def test_answers_the_policy_filter_lets_by_are_remembered(tmp_path, extra, remembered):
    import random

    from kproxy.policy.filter import PolicyFilter

    from .test_answer_memo import Client, confirm_all, metadata_answer
    from .test_answer_memo import rewriter_setup as setup

    m, chain, memo = setup()
    rules = PolicyFilter(_Reloading(_rules(tmp_path, PRODUCE_FETCH_ONLY + extra)), random.Random(1))
    c = Client(FilterChain([rules, *chain.filters]), memo, read_answers=False)
    body = metadata_answer([(1, "b1.internal", 9092)])
    c.ask(body)
    confirm_all(m)
    c.ask(body)
    _, resp, _ = c.ask(body)
    assert (memo.hits == 1) is remembered
    assert [(b.host, b.port) for b in resp.body.brokers] == [("proxy.example", 19000)]


def test_with_rules_and_no_quota_the_quota_filter_lets_heartbeats_by_and_a_quota_stops_that(tmp_path):
    import random

    from kproxy.policy.filter import PolicyFilter
    from kproxy.quota.engine import QuotaFilter

    source = _Reloading(_rules(tmp_path, PRODUCE_FETCH_ONLY))
    s = relaying(PolicyFilter(source, random.Random(1)), QuotaFilter(source))
    (up,) = s.client_frame(request_frame(HEARTBEAT, 4, 1, heartbeat_request()))
    assert up.entry.relayed is not None
    (out,) = s.upstream_frame(memoryview(heartbeat_answer(up.entry.upstream_correlation_id)))
    assert out.done[0].response is None
    source.policy = _rules(tmp_path, PRODUCE_FETCH_ONLY + "    quotas:\n"
                                                          "      - {name: calls, per: client_id, requests_per_s: 100}\n")
    (up,) = s.client_frame(request_frame(HEARTBEAT, 4, 2, heartbeat_request()))
    # A request-rate quota counts every api's answers (its requests are not the quota filter's): the
    # answer is read, and the request decoded with it.
    (out,) = s.upstream_frame(memoryview(heartbeat_answer(up.entry.upstream_correlation_id)))
    assert out.done[0].response is not None and out.done[0].request is not None
    assert out.done[0].notes["quota"]["rule"] == "calls"

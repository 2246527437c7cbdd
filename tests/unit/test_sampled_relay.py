"""The traffic log's and spans' samples, drawn as a request arrives: an exchange that neither samples
goes by the relay path (undecoded, as with metrics alone) and is counted as metrics alone count it; one
that is sampled is read whole and logged as before; the per-API sample map is honoured; and a sampled
Fetch v13+ still names its topic after a Metadata answer that was not sampled."""

from __future__ import annotations

import random
import uuid
from pathlib import Path
from typing import Any

import pytest

from kproxy.config import config_from_args
from kproxy.protocol.compiler import native_skip
from kproxy.protocol.messages import body_class
from kproxy.proxy.addresses import AddressMap, AddressRewriter
from kproxy.proxy.filters import ConnectionContext, FilterChain
from kproxy.proxy.inflight import InFlight
from kproxy.proxy.memo import AnswerMemo
from kproxy.proxy.session import Session
from kproxy.telemetry.exchange import GROUP_MEMBER_APIS, Learned, _group_first, group_in_frame
from kproxy.telemetry.outputs import LOGGED, SPANNED, TelemetryOutputs

from .test_relay import JOIN_GROUP, _metrics_traffic
from .test_session import (
    FETCH,
    HEARTBEAT,
    METADATA,
    Clock,
    heartbeat_request,
    request_frame,
    response_frame,
)

pytestmark = pytest.mark.skipif(native_skip() is None, reason="the relay path needs the native accelerator")


def outputs(tmp_path: Path, sample: dict[str, float] | None, metrics: bool = False) -> TelemetryOutputs:
    """The process's outputs with the traffic log on (``sample`` its traffic_log.sample), and metrics."""
    log: dict[str, Any] = {"dir": str(tmp_path / "traffic")}
    if sample is not None:
        log["sample"] = sample
    cfg = config_from_args("127.0.0.1:9092", "127.0.0.1:19092", traffic_log=log,
                           admin={"listen": "127.0.0.1:19999"} if metrics else None)
    out = TelemetryOutputs(cfg)
    out.random = random.Random(7).random
    return out


class Logged:
    """One virtual cluster's telemetry and a session made as the server makes one for it; the lines
    the traffic log was offered."""

    def __init__(self, out: TelemetryOutputs, *filters: Any, memo: AnswerMemo | None = None) -> None:
        self.tel = out.for_cluster("")
        self.lines: list[dict[str, Any]] = []
        self.relayed_up: set[InFlight] = set()     # entries whose request went to the broker undecoded
        if out.traffic_log is not None:
            out.traffic_log.offer = self.lines.append      # type: ignore[method-assign,assignment]
        reads = self.tel.decoded_apis()
        self.session = Session(ConnectionContext(1, clock=Clock()), FilterChain(list(filters)),
                               topic_names=self.tel.learned.topic_names, read_answers=reads is None,
                               telemetry_reads=reads if reads or self.tel.metrics is not None else None,
                               sample=self.tel.sampler(), memo=memo)

    def exchange(self, api_key: int, version: int, body: Any, answer: Any, cid: int = 5) -> InFlight:
        s = self.session
        (up,) = s.client_frame(request_frame(api_key, version, cid, body, client_id="sampled-client"))
        if up.entry.request is None:
            self.relayed_up.add(up.entry)
        out = s.upstream_frame(memoryview(response_frame(api_key, version, up.entry.upstream_correlation_id,
                                                         answer)))
        (entry,) = out[-1].done
        s.finish(entry)
        self.tel.completed(entry, s.ctx)
        return entry


def heartbeat_answer() -> Any:
    return body_class(HEARTBEAT, "response")(error_code=0)


def join_group() -> tuple[Any, Any]:
    rq, rs = body_class(JOIN_GROUP, "request"), body_class(JOIN_GROUP, "response")
    return (rq(group_id="g", session_timeout_ms=6000, member_id="", protocol_type="consumer", protocols=[]),
            rs(error_code=0, generation_id=1, member_id="m", leader="m", members=[]))


def decoded(t: Logged, entry: InFlight) -> bool:
    """The path counter: whether the exchange was read whole (the request decoded before it went to
    the broker, the answer decoded)."""
    return entry not in t.relayed_up and entry.request is not None and entry.response is not None


def test_an_api_sampled_at_0_is_never_decoded_and_one_at_1_always(tmp_path):
    t = Logged(outputs(tmp_path, {"default": 1.0, "heartbeat": 0.0}))
    join_body, join_answer = join_group()
    for i in range(30):
        hb = t.exchange(HEARTBEAT, 4, heartbeat_request(), heartbeat_answer(), cid=2 * i)
        assert hb.request is None and hb.relayed is not None and hb.response is None and hb.sampled == 0
        jg = t.exchange(JOIN_GROUP, 7, join_body, join_answer, cid=2 * i + 1)
        assert decoded(t, jg) and jg.sampled == LOGGED
    assert [line["api"] for line in t.lines] == ["join_group"] * 30

    # The map the other way round: the same two apis swap paths.
    t = Logged(outputs(tmp_path, {"default": 0.0, "heartbeat": 1.0}))
    for i in range(30):
        assert decoded(t, t.exchange(HEARTBEAT, 4, heartbeat_request(), heartbeat_answer(), cid=2 * i))
        jg = t.exchange(JOIN_GROUP, 7, join_body, join_answer, cid=2 * i + 1)
        assert jg.request is None and jg.response is None
    assert [line["api"] for line in t.lines] == ["heartbeat"] * 30


def test_exactly_the_sampled_exchanges_are_decoded_and_logged(tmp_path):
    t = Logged(outputs(tmp_path, {"default": 0.3}))
    entries = [t.exchange(HEARTBEAT, 4, heartbeat_request(), heartbeat_answer(), cid=i) for i in range(200)]
    logged = {line["correlation_id"] for line in t.lines}
    assert 30 < len(logged) < 90       # one draw per request, at 0.3
    assert {e.client_correlation_id for e in entries if decoded(t, e)} == logged
    assert all(e.request is None and e.response is None for e in entries if e.client_correlation_id not in logged)


def test_sample_1_lines_are_those_of_the_full_path(tmp_path):
    # The same exchanges, logged with every exchange read (no sampling, as before) and with the
    # sampler on for other apis only (Heartbeat and JoinGroup at 1.0): the same lines.
    everything = Logged(outputs(tmp_path, None))
    assert everything.tel.sampler() is None and everything.tel.decoded_apis() is None
    mixed = Logged(outputs(tmp_path, {"default": 0.0, "heartbeat": 1.0, "join_group": 1.0}))
    assert mixed.tel.sampler() is not None
    join_body, join_answer = join_group()
    for t in (everything, mixed):
        t.exchange(JOIN_GROUP, 7, join_body, join_answer, cid=1)
        t.exchange(HEARTBEAT, 4, heartbeat_request(), heartbeat_answer(), cid=2)
    assert len(everything.lines) == 2 and everything.lines == mixed.lines
    assert mixed.lines[1]["group"] == "g"


def test_unsampled_exchanges_are_counted_as_with_metrics_alone(tmp_path):
    out = outputs(tmp_path, {"default": 0.0}, metrics=True)
    tel = out.for_cluster("")
    reads = tel.decoded_apis()
    assert reads == frozenset()     # Produce's and Fetch's counts come from their bytes (no topic labels)
    # As the server builds it: metrics on, so an empty set, not None (which says nothing counts).
    unsampled = Session(ConnectionContext(1, clock=Clock()), FilterChain([]), read_answers=reads is None,
                        telemetry_reads=reads, sample=tel.sampler())
    metrics_alone = Session(ConnectionContext(1, clock=Clock()), FilterChain([]), read_answers=False,
                            telemetry_reads=frozenset())
    seen, exposition = _metrics_traffic(unsampled)
    seen_alone, exposition_alone = _metrics_traffic(metrics_alone)
    assert seen == seen_alone and exposition == exposition_alone
    # The path counter: Heartbeat and Metadata went by undecoded, as with metrics alone.
    assert [r[-2:] for r in seen][:3] == [(True, True)] * 3


def test_a_relayed_group_request_still_teaches_the_group(tmp_path):
    t = Logged(outputs(tmp_path, {"default": 0.0}))
    hb = t.exchange(HEARTBEAT, 4, heartbeat_request(), heartbeat_answer())
    assert hb.request is None and hb.relayed is not None
    assert t.tel.learned.group_of(t.session.ctx) == "g"
    # Metrics alone learn nothing from it (no line names a group), as before.
    learned = Learned(learn_groups=False)
    learned.observe(hb, t.session.ctx)
    assert learned.group_of(t.session.ctx) is None


@pytest.mark.parametrize("fetch_version", [13, 16])
def test_a_sampled_fetch_names_its_topic_after_an_unsampled_metadata(tmp_path, fetch_version):
    t = Logged(outputs(tmp_path, {"default": 0.0, "fetch": 1.0}))
    tid = uuid.UUID(int=0x5EED)
    md_rq, md_rs = body_class(METADATA, "request"), body_class(METADATA, "response")
    md = t.exchange(METADATA, 12, md_rq(topics=None), md_rs(brokers=[], topics=[
        md_rs.MetadataResponseTopic(name="orders", topic_id=tid, partitions=[])]), cid=1)
    assert md.sampled == 0 and t.lines == []
    rq, rs = body_class(FETCH, "request"), body_class(FETCH, "response")
    fetch = t.exchange(FETCH, fetch_version, rq(max_wait_ms=0, min_bytes=1, topics=[
        rq.FetchTopic(topic_id=tid, partitions=[rq.FetchPartition(partition=0, fetch_offset=0)])]),
        rs(responses=[rs.FetchableTopicResponse(topic_id=tid, partitions=[
            rs.PartitionData(partition_index=0, high_watermark=0)])]), cid=2)
    assert decoded(t, fetch)
    (line,) = t.lines
    assert line["api"] == "fetch" and line["topics"] == ["orders"]
    assert [p["topic"] for p in line["partitions"]] == ["orders"]


def test_a_sampled_fetch_names_its_topic_after_a_metadata_answer_served_from_memory(tmp_path):
    # Two processes' telemetry (each its own table of names) sharing one answer memo: the second
    # learns the topic's name only from the answer memory serves it, and its logged Fetch (by id)
    # names the topic. Metadata is never sampled; its request goes to the broker undecoded.
    tid = uuid.UUID(int=0x5EED)
    md_rq, md_rs = body_class(METADATA, "request"), body_class(METADATA, "response")
    answer = md_rs(brokers=[md_rs.MetadataResponseBroker(node_id=1, host="b1.internal", port=9092)], topics=[
        md_rs.MetadataResponseTopic(name="orders", topic_id=tid, partitions=[])])
    addresses, memo = AddressMap("proxy.example", 19000, 16), AnswerMemo()
    first = Logged(outputs(tmp_path, {"default": 0.0, "fetch": 1.0}), AddressRewriter(addresses), memo=memo)
    first.exchange(METADATA, 12, md_rq(topics=None), answer, cid=1)
    for port in addresses.pending_ports():
        addresses.confirm(port)
    first.exchange(METADATA, 12, md_rq(topics=None), answer, cid=2)
    assert memo.stored == 1 and first.tel.learned.topic(tid) == "orders"
    t = Logged(outputs(tmp_path, {"default": 0.0, "fetch": 1.0}), AddressRewriter(addresses), memo=memo)
    md = t.exchange(METADATA, 12, md_rq(topics=None), answer, cid=3)
    assert memo.hits == 1 and md.sampled == 0 and md in t.relayed_up and md.request is None
    rq, rs = body_class(FETCH, "request"), body_class(FETCH, "response")
    t.exchange(FETCH, 13, rq(max_wait_ms=0, min_bytes=1, topics=[
        rq.FetchTopic(topic_id=tid, partitions=[rq.FetchPartition(partition=0, fetch_offset=0)])]),
        rs(responses=[rs.FetchableTopicResponse(topic_id=tid, partitions=[
            rs.PartitionData(partition_index=0, high_watermark=0)])]), cid=4)
    (line,) = t.lines
    assert line["api"] == "fetch" and line["topics"] == ["orders"]


def test_the_draw_is_made_once_as_the_request_arrives(tmp_path):
    out = outputs(tmp_path, {"default": 0.5})
    draws = []

    def counted() -> float:
        draws.append(1)
        return 0.0          # always under the ratio: sampled

    out.random = counted
    t = Logged(out)
    entry = t.exchange(HEARTBEAT, 4, heartbeat_request(), heartbeat_answer())
    assert len(draws) == 1 and entry.sampled == LOGGED and len(t.lines) == 1
    # At 1.0 no draw at all.
    t = Logged(outputs(tmp_path, {"default": 0.0, "heartbeat": 1.0}))
    t.tel.outputs.random = counted
    t.exchange(HEARTBEAT, 4, heartbeat_request(), heartbeat_answer())
    assert len(draws) == 1


def test_spans_sampled_below_1_are_drawn_as_the_request_arrives_and_the_others_relayed(tmp_path):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    spans = InMemorySpanExporter()
    cfg = config_from_args("127.0.0.1:9092", "127.0.0.1:19092", tracing={"enabled": True, "sample_ratio": 0.3})
    out = TelemetryOutputs(cfg, span_exporter=spans, env={})
    assert out.tracing is not None
    out.tracing._random = random.Random(3).random
    try:
        t = Logged(out)
        assert t.tel.sampler() is not None
        entries = [t.exchange(HEARTBEAT, 4, heartbeat_request(), heartbeat_answer(), cid=i) for i in range(100)]
        out.tracing.provider.force_flush()
        spanned = [e for e in entries if e.sampled]
        assert 10 < len(spanned) < 60 and all(e.sampled == SPANNED for e in spanned)
        assert all(decoded(t, e) for e in spanned)
        assert all(e in t.relayed_up and e.response is None for e in entries if not e.sampled)
        # A span per sampled exchange (no client span: no I/O layer stamped forwarded_at), none for the others.
        assert len(spans.get_finished_spans()) == len(spanned)
    finally:
        out.close()


@pytest.mark.parametrize("api_key", sorted(GROUP_MEMBER_APIS))
@pytest.mark.parametrize("group", ["g", "", "grüppe-" + "x" * 300])
@pytest.mark.parametrize("client_id", ["app", None])
def test_a_group_read_from_the_bytes_is_the_group_decoding_finds(api_key, group, client_id):
    from kproxy.protocol.messages import Request, encode_request_frame, supported_versions

    lo, hi = supported_versions()[api_key]
    for version in range(lo, hi + 1):
        body = body_class(api_key, "request")()
        if hasattr(body, "group_id"):
            body.group_id = group
        frame = memoryview(b"".join(encode_request_frame(Request.build(api_key, version, 9, client_id, body)))[4:])
        ctx = ConnectionContext(1, client_address=("10.0.0.1", 5000))
        ctx.client_id = client_id
        relayed = Learned(learn_groups=True)
        relayed.observe(InFlight(9, api_key, version, 1.0, relayed=frame), ctx)
        decoded_req = Learned()
        decoded_req.observe(InFlight(9, api_key, version, 1.0, request=Request.build(api_key, version, 9, client_id,
                                                                                      body)), ctx)
        assert relayed.group_of(ctx) == decoded_req.group_of(ctx), (api_key, version)
        if _group_first(api_key, version):
            assert group_in_frame(frame) == group


def test_a_reloaded_tracing_ratio_is_drawn_by_from_the_next_request_unless_the_environment_samples() -> None:
    def config(ratio: float) -> Any:
        return config_from_args("127.0.0.1:9092", "127.0.0.1:19092",
                                tracing={"enabled": True, "sample_ratio": ratio, "exporter": "none"})

    out = TelemetryOutputs(config(1.0), env={})
    try:
        assert out.sampler() is None and all(out.sample(HEARTBEAT) & SPANNED for _ in range(20))
        assert out.set_sampling(config(1.0)) == []
        assert out.set_sampling(config(0.0)) == ["tracing.sample_ratio: 1 -> 0"]
        assert out.sampler() is not None                       # new connections relay what is not drawn
        assert not any(out.sample(HEARTBEAT) & SPANNED for _ in range(20))
        assert out.set_sampling(config(1.0)) == ["tracing.sample_ratio: 0 -> 1"]
        assert out.sampler() is None and out.sample(HEARTBEAT) & SPANNED
    finally:
        out.close()
    env_sampled = TelemetryOutputs(config(1.0), env={"OTEL_TRACES_SAMPLER": "always_off"})
    try:
        (said,) = env_sampled.set_sampling(config(0.0))
        assert said.endswith("(not in force: OTEL_TRACES_SAMPLER samples instead)")
        assert env_sampled.sample(HEARTBEAT) & SPANNED          # the SDK's sampler decides, not kproxy
    finally:
        env_sampled.close()

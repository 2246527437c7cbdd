"""Fetch under metrics alone (no per-topic labels, nothing else reading it): the request and a small
answer go by undecoded, and what metrics count comes from the bytes (``kproxy.proxy.fetch_bytes``):
the records of each error-free partition from its batch headers, from the partition's fetch offset
in the request, and the broker's throttle time. The counts equal the decoder's (``fetch_partitions``)
on every Fetch version, generated requests and answers included (unknown tagged fields, aborted
transactions, null records, several batches, a partial last batch, errors, node_endpoints)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kproxy.protocol.compiler import native_function, native_skip
from kproxy.protocol.messages import api_by_key, body_class, decode_request, decode_response
from kproxy.proxy.addresses import AddressMap, AddressRewriter
from kproxy.proxy.fetch_bytes import WALKED_UP_TO, py_fetch_counts
from kproxy.proxy.filters import ConnectionContext, FilterChain
from kproxy.proxy.inflight import InFlight
from kproxy.proxy.session import Session
from kproxy.telemetry.exchange import Exchange, Learned, fetch_partitions
from kproxy.telemetry.metrics import Metrics
from tests.budget import examples
from tests.protocol.strategies import message_strategy

from .test_session import FETCH, Clock, request_frame, response_frame
from .test_telemetry import _legacy_message, batch

REQUEST, RESPONSE = api_by_key(FETCH).request, api_by_key(FETCH).response
VERSIONS = range(REQUEST.versions.lo, REQUEST.versions.hi + 1)
# The walks: the Python reference, and the accelerator's compiled twin when it is loaded.
WALKS = [pytest.param(py_fetch_counts, id="python")]
if native_function("fetch_counts") is not None:
    WALKS.append(pytest.param(native_function("fetch_counts"), id="native"))


def test_the_walk_knows_every_fetch_version_of_the_schema() -> None:
    # A new Fetch version in the schema is decoded (not walked) until the walk learns its layout.
    assert REQUEST.versions.hi == RESPONSE.versions.hi == WALKED_UP_TO
    assert REQUEST.versions.lo == RESPONSE.versions.lo == 0


def _decoded_count(req: Any, resp: Any, version: int) -> int:
    """What metrics count decoded: the records of the partitions without an error."""
    entry = InFlight(3, FETCH, version, 0.0, req)
    entry.response = resp
    return sum(p.records for p in fetch_partitions(entry, Learned(learn_topics=False)) if not p.error_code)


def _records(base: int) -> st.SearchStrategy[tuple[bytes | None, bool]]:
    """A partition's records field from offset ``base`` and whether the walk must read it: null,
    empty, one to three v2 batches (the last one maybe cut short, as at max_bytes), or a legacy
    message set (the decoded path reads those)."""
    def batches(ns: list[int], cut: int) -> tuple[bytes, bool]:
        out, at = b"", base
        for n in ns:
            out += batch(n, base_offset=at)
            at += max(n, 1)
        tail = batch(2, base_offset=at)
        return out + tail[:cut], True

    return st.one_of(
        st.just((None, True)), st.just((b"", True)),
        st.builds(batches, st.lists(st.integers(1, 4), min_size=1, max_size=3), st.integers(0, 70)),
        st.just((_legacy_message(b"old"), False)))


def _unknown_tags() -> st.SearchStrategy[list | None]:
    return st.none() | st.lists(st.tuples(st.integers(5, 300), st.binary(max_size=6)), min_size=1, max_size=2)


def _decorate(obj: Any, data: st.DataObject, version: int) -> None:
    """Unknown tagged fields on the message and each of its structs (flexible versions)."""
    if version >= 12:
        obj._unknown = data.draw(_unknown_tags())
        for attr in ("topics", "partitions", "responses", "aborted_transactions"):
            for item in getattr(obj, attr, None) or ():
                if not isinstance(item, int):
                    _decorate(item, data, version)


def _frames(req_body: Any, resp_body: Any, version: int, data: st.DataObject) -> tuple[memoryview, memoryview, bool]:
    """The two frames with records and offsets drawn so that the fetch offsets matter: the answer
    names the request's partitions (or what Hypothesis made), batches from around the fetch offset.
    Also whether the walk must read them (no legacy message set in an error-free partition)."""
    readable = True
    if data.draw(st.booleans()):
        cls = body_class(FETCH, "response")
        topics = []
        for t in req_body.topics:
            parts = []
            for fp in t.partitions:
                fp.fetch_offset = data.draw(st.integers(-2, 12))
                records, walked = data.draw(_records(data.draw(st.integers(0, 8))))
                error = data.draw(st.sampled_from([0, 0, 0, 1, 6]))
                readable = readable and (walked or bool(error))
                parts.append(cls.PartitionData(partition_index=fp.partition, error_code=error,
                                               high_watermark=20, records=records))
            topics.append(cls.FetchableTopicResponse(topic=t.topic if version < 13 else "",
                                                     topic_id=getattr(t, "topic_id", None), partitions=parts))
        resp_body.responses = topics
    else:
        for t in resp_body.responses:
            for p in t.partitions:
                p.records, walked = data.draw(_records(data.draw(st.integers(0, 8))))
                readable = readable and (walked or bool(p.error_code))
    _decorate(req_body, data, version)
    _decorate(resp_body, data, version)
    return (request_frame(FETCH, version, 3, req_body), memoryview(response_frame(FETCH, version, 3, resp_body)),
            readable)


@pytest.mark.parametrize("walk", WALKS)
@pytest.mark.parametrize("version", VERSIONS)
def test_counts_from_bytes_equal_the_decoders_on_generated_exchanges(version: int, walk: Any) -> None:
    @settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(message_strategy(REQUEST, version), message_strategy(RESPONSE, version), st.data())
    def check(req_body: Any, resp_body: Any, data: st.DataObject) -> None:
        frame, answer, readable = _frames(req_body, resp_body, version, data)
        req = decode_request(frame)
        resp = decode_response(answer, FETCH, version)
        read = walk(frame, answer, version)
        if not readable:
            assert read is None         # a legacy message set: the decoded path reads it
            return
        endpoints = version >= 16 and bool(resp.body.node_endpoints)
        assert read == (_decoded_count(req, resp, version), resp.body.throttle_time_ms if version >= 1 else 0,
                        endpoints)

    check()


@pytest.mark.parametrize("walk", WALKS)
def test_an_empty_long_poll_is_counted_without_reading_the_request(walk: Any) -> None:
    cls = body_class(FETCH, "response")
    for version in VERSIONS:
        body = cls(throttle_time_ms=7, responses=[cls.FetchableTopicResponse(
            topic="t", topic_id=uuid.UUID(int=1), partitions=[cls.PartitionData(partition_index=0, high_watermark=4)])])
        # The request is not read: any bytes will do when the answer holds no records.
        assert walk(b"", memoryview(response_frame(FETCH, version, 1, body)), version) == (
            0, 7 if version >= 1 else 0, False)


@pytest.mark.parametrize("walk", WALKS)
def test_a_truncated_answer_is_not_read(walk: Any) -> None:
    rq, rs = body_class(FETCH, "request"), body_class(FETCH, "response")
    req_body = rq(max_wait_ms=0, min_bytes=1, topics=[rq.FetchTopic(topic="t", topic_id=uuid.UUID(int=1), partitions=[
        rq.FetchPartition(partition=0, fetch_offset=2)])])
    body = rs(throttle_time_ms=9, responses=[rs.FetchableTopicResponse(topic="t", topic_id=uuid.UUID(int=1), partitions=[
        rs.PartitionData(partition_index=0, high_watermark=9, records=batch(2) + batch(3, base_offset=2))])])
    for version in VERSIONS:
        frame = request_frame(FETCH, version, 1, req_body)
        answer = response_frame(FETCH, version, 1, body)
        assert walk(frame, memoryview(answer), version) == (3, 9 if version >= 1 else 0, False)
        # Without the request (the address rewriter's question): the same walk, no records counted.
        assert walk(None, memoryview(answer), version) == (0, 9 if version >= 1 else 0, False)
        # The first batch (offsets 0-1) ends before the fetch offset: left out, as decoded.
        for cut in range(4, len(answer) - (1 if version >= 12 else 0)):
            assert walk(frame, memoryview(answer[:cut]), version) is None, (version, cut)
        # The request is read as far as its topics: after them, forgotten_topics_data (v7+), rack_id
        # (v11+) and the tagged fields (v12+), none read.
        after = 3 if version >= 12 else 6 if version >= 11 else 4 if version >= 7 else 0
        for cut in range(0, len(frame) - after):
            assert walk(frame[:cut], memoryview(answer), version) is None, (version, cut)


def test_the_session_uses_the_compiled_walk_when_the_accelerator_is_loaded() -> None:
    from kproxy.proxy import fetch_bytes

    native = native_function("fetch_counts")
    assert fetch_bytes.fetch_counts is (native if native is not None else py_fetch_counts)


@pytest.mark.skipif(len(WALKS) < 2, reason="no accelerator: only the Python walk")
@pytest.mark.parametrize("version", VERSIONS)
def test_the_compiled_walk_agrees_with_the_python_one_on_changed_bytes(version: int) -> None:
    native = WALKS[1].values[0]

    @settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(message_strategy(REQUEST, version), message_strategy(RESPONSE, version), st.data())
    def check(req_body: Any, resp_body: Any, data: st.DataObject) -> None:
        frame, answer, _ = _frames(req_body, resp_body, version, data)
        request, changed = bytearray(frame), bytearray(answer)
        cut = data.draw(st.integers(0, len(changed)))
        assert native(bytes(request), bytes(changed[:cut]), version) == py_fetch_counts(
            memoryview(bytes(request)), memoryview(bytes(changed[:cut])), version)
        for buf in (request, changed):
            if len(buf) > 4:
                buf[data.draw(st.integers(4, len(buf) - 1))] = data.draw(st.integers(0, 255))
        assert native(bytes(request), bytes(changed), version) == py_fetch_counts(
            memoryview(bytes(request)), memoryview(bytes(changed)), version)
        cut = data.draw(st.integers(0, len(request)))
        assert native(bytes(request[:cut]), bytes(answer), version) == py_fetch_counts(
            memoryview(bytes(request[:cut])), answer, version)

    check()


# -- through the session: the path counter and the metrics

_ids = {"orders": uuid.UUID(int=1), "audit": uuid.UUID(int=2)}
# (topic, partition): fetch offset, the answer's records, its error code
PARTITIONS = {("orders", 0): (4, batch(3) + batch(2, base_offset=3) + batch(3, base_offset=5)[:40], 0),
              ("orders", 1): (0, batch(4), 0), ("audit", 0): (9, None, 0), ("audit", 1): (0, batch(5), 6)}
FETCHED = 2 + 4     # orders-0 from offset 4: the second batch (3-4), the third cut short; audit-1 failed


def _fetch_request(version: int) -> Any:
    cls = body_class(FETCH, "request")
    topics: dict[str, list] = {}
    for (t, p), (offset, _, _) in PARTITIONS.items():
        topics.setdefault(t, []).append(cls.FetchPartition(partition=p, fetch_offset=offset))
    return cls(max_wait_ms=500, min_bytes=1, topics=[
        cls.FetchTopic(topic=t, topic_id=_ids[t], partitions=ps) for t, ps in topics.items()])


def _fetch_answer(version: int, endpoints: bool = False) -> Any:
    cls = body_class(FETCH, "response")
    topics: dict[str, list] = {}
    for (t, p), (_, records, error) in PARTITIONS.items():
        topics.setdefault(t, []).append(cls.PartitionData(partition_index=p, error_code=error, high_watermark=9,
                                                          records=records))
    return cls(throttle_time_ms=40, responses=[
        cls.FetchableTopicResponse(topic=t if version < 13 else "", topic_id=_ids[t], partitions=ps)
        for t, ps in topics.items()],
        node_endpoints=[cls.NodeEndpoint(node_id=1, host="kafka-1.internal", port=9092)] if endpoints else [])


def _through(s: Session, version: int, endpoints: bool = False) -> tuple[InFlight, bytes]:
    (up,) = s.client_frame(request_frame(FETCH, version, 11, _fetch_request(version)))
    entry = up.entry
    actions = s.upstream_frame(memoryview(response_frame(
        FETCH, version, entry.upstream_correlation_id, _fetch_answer(version, endpoints))))
    out = actions[-1]
    (entry,) = out.done
    s.finish(entry)
    return entry, b"".join(bytes(b) for b in out.buffers)


def _metrics_alone(*filters: Any) -> Session:
    # As the server builds it with an admin listener and no topic labels: telemetry reads no api
    # decoded (an empty set, not None).
    return Session(ConnectionContext(1, clock=Clock()), FilterChain(list(filters)), read_answers=False,
                   telemetry_reads=frozenset())


def _rewriter() -> AddressRewriter:
    return AddressRewriter(AddressMap("proxy.example", 19000, 16))


needs_accelerator = pytest.mark.skipif(native_skip() is None, reason="the relay path needs the native accelerator")


def _recorded(entry: InFlight) -> Metrics:
    m = Metrics()
    m.record(Exchange(entry, ConnectionContext(1, clock=Clock()), Learned()))
    return m


@needs_accelerator
@pytest.mark.parametrize("version", VERSIONS)
def test_fetch_under_metrics_alone_is_relayed_and_counted_as_decoded(version: int) -> None:
    # The address rewriter is always there; it reads Fetch answers only for node_endpoints (v16+).
    relayed, sent = _through(_metrics_alone(_rewriter()), version)
    # The path counter: neither the request nor its answer was decoded.
    assert relayed.request is None and relayed.relayed is not None and relayed.response is None
    assert relayed.fetched == FETCHED
    # The full path (telemetry reads everything) decodes both; the client gets the same bytes.
    decoded, sent_decoded = _through(Session(ConnectionContext(1, clock=Clock()), FilterChain([_rewriter()])), version)
    assert decoded.request is not None and decoded.response is not None
    assert sent == sent_decoded
    assert relayed.throttle_ms == decoded.throttle_ms == (40 if version >= 1 else 0)
    for entry in (relayed, decoded):
        m = _recorded(entry)
        assert m.records["fetched"] == FETCHED
        assert m.throttle_seconds.get("broker", 0) == (0.04 if version >= 1 else 0)


def _no_telemetry(*filters: Any) -> Session:
    # As the server builds it with no telemetry on: nothing counts (None), answers nobody reads pass.
    return Session(ConnectionContext(1, clock=Clock()), FilterChain(list(filters)), read_answers=False)


@needs_accelerator
@pytest.mark.parametrize("session", [_metrics_alone, _no_telemetry])
@pytest.mark.parametrize("version", [16, 17, 18])
def test_an_answer_with_node_endpoints_is_decoded_and_rewritten(version: int, session: Any) -> None:
    entry, sent = _through(session(_rewriter()), version, endpoints=True)
    assert entry.response is not None and entry.request is not None      # decoded, with its request
    assert b"kafka-1.internal" not in sent and b"proxy.example" in sent
    assert _recorded(entry).records["fetched"] == FETCHED
    # Without endpoints the same session relays the answer, the rewriter left out by the walk.
    relayed, sent = _through(session(_rewriter()), version)
    assert relayed.response is None and relayed.request is None
    assert b"proxy.example" not in sent


@needs_accelerator
def test_with_no_telemetry_an_answer_nobody_reads_is_not_walked() -> None:
    # Below v16 nothing reads a Fetch answer: passed on without the walk (nothing counts it).
    relayed, _ = _through(_no_telemetry(_rewriter()), 15)
    assert relayed.response is None and relayed.request is None and relayed.fetched is None


@needs_accelerator
@pytest.mark.parametrize("version", [16, 17, 18])
def test_an_answer_with_an_empty_node_endpoints_tag_is_relayed(version: int) -> None:
    # tansu sends node_endpoints as an empty array in every v16+ answer: nothing for the rewriter.
    s = _metrics_alone(_rewriter())
    (up,) = s.client_frame(request_frame(FETCH, version, 11, _fetch_request(version)))
    answer = response_frame(FETCH, version, up.entry.upstream_correlation_id, _fetch_answer(version))
    assert answer[-1:] == b"\x00"          # no tagged fields: now one, tag 0 of one byte, an empty array
    answer = answer[:-1] + b"\x01\x00\x01\x01"
    assert decode_response(answer, FETCH, version).body.node_endpoints == []
    (out,) = s.upstream_frame(memoryview(answer))
    (entry,) = out.done
    assert entry.response is None and entry.request is None and entry.fetched == FETCHED
    assert b"".join(bytes(b) for b in out.buffers)[8:] == answer[4:]
    # One endpoint in it: decoded and rewritten.
    assert py_fetch_counts(request_frame(FETCH, version, 1, _fetch_request(version)),
                           memoryview(response_frame(FETCH, version, 1, _fetch_answer(version, True))), version)[2]


@needs_accelerator
def test_per_topic_metrics_or_a_legacy_message_set_take_the_decoded_path() -> None:
    # Per-topic metrics need names and bytes: telemetry reads Fetch decoded.
    s = Session(ConnectionContext(1, clock=Clock()), FilterChain([]), read_answers=False,
                telemetry_reads=frozenset({0, FETCH}))
    entry, _ = _through(s, 12)
    assert entry.request is not None and entry.response is not None
    # A legacy message set in an error-free partition: the answer is decoded (its request with it).
    saved = PARTITIONS[("orders", 1)]
    PARTITIONS[("orders", 1)] = (0, _legacy_message(b"v1") + _legacy_message(b"v2"), 0)
    try:
        legacy, _ = _through(_metrics_alone(), 12)
    finally:
        PARTITIONS[("orders", 1)] = saved
    assert legacy.request is not None and legacy.response is not None and legacy.fetched is None
    assert _recorded(legacy).records["fetched"] == 2 + 2


@needs_accelerator
def test_a_malformed_answer_is_reported_as_decoded() -> None:
    s = _metrics_alone()
    (up,) = s.client_frame(request_frame(FETCH, 12, 11, _fetch_request(12)))
    answer = response_frame(FETCH, 12, up.entry.upstream_correlation_id, _fetch_answer(12))
    (close,) = s.upstream_frame(memoryview(answer[:-20]))
    assert "malformed fetch v12 response" in close.reason

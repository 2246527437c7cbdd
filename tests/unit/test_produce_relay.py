"""Produce under metrics alone (no per-topic labels, nothing else reading it): the request and its
answer go by undecoded, and what metrics count comes from the bytes (``kproxy.proxy.produce_bytes``):
the records of each partition from the batch headers, the partitions the answer reports an error for,
and the broker's throttle time. The counts equal the decoder's (``produced_records``) on every Produce
version, generated requests and answers included (unknown tagged fields, null records, several
batches, partition errors, acks=0)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kproxy.config import MetricsConfig
from kproxy.protocol.compiler import native_function, native_skip
from kproxy.protocol.messages import api_by_key, body_class, decode_request, decode_response, request_codecs
from kproxy.proxy.filters import ConnectionContext, Filter, FilterChain
from kproxy.proxy.inflight import InFlight
from kproxy.proxy.produce_bytes import WALKED_UP_TO, produced, py_answer_failures, py_request_counts
from kproxy.proxy.session import Session
from kproxy.telemetry.exchange import Exchange, Learned, produced_records, records_in
from kproxy.telemetry.metrics import Metrics
from tests.budget import examples
from tests.protocol.strategies import message_strategy

from .test_session import FETCH, PRODUCE, Clock, request_frame, response_frame
from .test_telemetry import _legacy_message, batch

REQUEST, RESPONSE = api_by_key(PRODUCE).request, api_by_key(PRODUCE).response
VERSIONS = range(REQUEST.versions.lo, REQUEST.versions.hi + 1)
# The walks: the Python reference, and the accelerator's compiled twins when it is loaded.
WALKS = [pytest.param((py_request_counts, py_answer_failures), id="python")]
if native_function("produce_counts") is not None:
    WALKS.append(pytest.param((native_function("produce_counts"), native_function("produce_answer")), id="native"))


def test_the_walks_know_every_produce_version_of_the_schema() -> None:
    # A new Produce version in the schema is decoded (not walked) until the walks learn its layout.
    assert REQUEST.versions.hi == RESPONSE.versions.hi == WALKED_UP_TO
    assert REQUEST.versions.lo == RESPONSE.versions.lo == 0


def _key(t: Any, version: int) -> bytes:
    return t.topic_id.bytes if version >= 13 else t.name.encode("utf-8", "surrogateescape")


def _body_at(frame: memoryview, version: int) -> int:
    header, _ = request_codecs(PRODUCE, version)
    return header.decode_checked(frame, 0, len(frame))[1]


def _records() -> st.SearchStrategy[bytes | None]:
    """A partition's records field: null, empty, one to three v2 batches, or a legacy message set."""
    batches = st.lists(st.integers(0, 4), min_size=1, max_size=3).map(
        lambda ns: b"".join(batch(n, base_offset=i) for i, n in enumerate(ns)))
    return st.one_of(st.none(), st.just(b""), batches, st.just(_legacy_message(b"old")))


def _unknown_tags() -> st.SearchStrategy[list | None]:
    return st.none() | st.lists(st.tuples(st.integers(5, 300), st.binary(max_size=6)), min_size=1, max_size=2)


def _decorate(obj: Any, data: st.DataObject, version: int) -> None:
    """Unknown tagged fields on the message and each of its structs (flexible versions)."""
    if version >= 9:
        obj._unknown = data.draw(_unknown_tags())
        for attr in ("topic_data", "partition_data", "responses", "partition_responses"):
            for item in getattr(obj, attr, None) or ():
                _decorate(item, data, version)


@pytest.mark.parametrize("walks", WALKS)
@pytest.mark.parametrize("version", VERSIONS)
def test_counts_from_bytes_equal_the_decoders_on_generated_exchanges(version: int, walks: Any) -> None:
    request_counts, answer_failures = walks

    @settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(message_strategy(REQUEST, version), message_strategy(RESPONSE, version), st.data())
    def check(req_body: Any, resp_body: Any, data: st.DataObject) -> None:
        for t in req_body.topic_data:
            for pd in t.partition_data:
                pd.records = data.draw(_records())
        # Some answers name the request's partitions (errors on a few), others what Hypothesis made.
        if data.draw(st.booleans()):
            cls = body_class(PRODUCE, "response")
            resp_body.responses = [cls.TopicProduceResponse(
                name=t.name if version < 13 else "", topic_id=getattr(t, "topic_id", None),
                partition_responses=[cls.PartitionProduceResponse(
                    index=pd.index, error_code=data.draw(st.sampled_from([0, 0, 6, 10])), base_offset=7)
                    for pd in t.partition_data]) for t in req_body.topic_data]
        _decorate(req_body, data, version)
        _decorate(resp_body, data, version)
        frame = request_frame(PRODUCE, version, 3, req_body)
        answer = memoryview(response_frame(PRODUCE, version, 3, resp_body))
        req = decode_request(frame)
        resp = decode_response(answer, PRODUCE, version)

        counted = request_counts(frame, _body_at(frame, version), version)
        expected = [(_key(t, version), pd.index, records_in(pd.records))
                    for t in req.body.topic_data for pd in t.partition_data]
        if any(n is None for _, _, n in expected):
            assert counted is None      # a legacy message set: the decoded path reads it
            return
        assert counted == (req.body.acks, sum(n for _, _, n in expected), expected)

        read = answer_failures(answer, version)
        failed = {(_key(t, version), p.index) for t in resp.body.responses
                  for p in t.partition_responses if p.error_code}
        assert read == (failed or None, resp.body.throttle_time_ms if version >= 1 else 0)

        entry = InFlight(3, PRODUCE, version, 0.0, req)
        entry.response = resp
        assert produced(counted[1], counted[2], read[0]) == produced_records(entry)

    check()


@pytest.mark.parametrize("walks", WALKS)
def test_a_truncated_answer_is_not_read(walks: Any) -> None:
    answer_failures = walks[1]
    cls = body_class(PRODUCE, "response")
    body = cls(responses=[cls.TopicProduceResponse(name="t", partition_responses=[
        cls.PartitionProduceResponse(index=0, base_offset=1)])], throttle_time_ms=9)
    for version in VERSIONS:
        answer = response_frame(PRODUCE, version, 1, body)
        assert answer_failures(memoryview(answer), version) is not None
        for cut in range(4, len(answer) - (1 if version >= 9 else 0)):
            assert answer_failures(memoryview(answer[:cut]), version) is None, (version, cut)


# -- through the session: the path counter and the metrics


def _request(version: int, acks: int, records: dict[tuple[str, int], bytes | None]) -> Any:
    cls = body_class(PRODUCE, "request")
    topics: dict[str, list] = {}
    for (t, p), recs in records.items():
        topics.setdefault(t, []).append(cls.PartitionProduceData(index=p, records=recs))
    return cls(acks=acks, timeout_ms=1000, transactional_id="tx" if version >= 3 else None, topic_data=[
        cls.TopicProduceData(name=t, topic_id=_ids[t], partition_data=ps) for t, ps in topics.items()])


def _answer(version: int, records: dict[tuple[str, int], Any], errors: dict[tuple[str, int], int]) -> Any:
    cls = body_class(PRODUCE, "response")
    topics: dict[str, list] = {}
    for t, p in records:
        topics.setdefault(t, []).append(cls.PartitionProduceResponse(
            index=p, error_code=errors.get((t, p), 0), base_offset=5))
    return cls(throttle_time_ms=40, responses=[
        cls.TopicProduceResponse(name=t if version < 13 else "", topic_id=_ids[t], partition_responses=ps)
        for t, ps in topics.items()])


_ids = {"orders": __import__("uuid").UUID(int=1), "audit": __import__("uuid").UUID(int=2)}
RECORDS = {("orders", 0): batch(3) + batch(2, base_offset=3), ("orders", 1): batch(4), ("audit", 0): None,
           ("audit", 1): batch(1)}


def _through(s: Session, version: int, acks: int, records: dict, errors: dict) -> InFlight:
    (up,) = s.client_frame(request_frame(PRODUCE, version, 11, _request(version, acks, records)))
    entry = up.entry
    if acks:
        (out,) = s.upstream_frame(memoryview(response_frame(
            PRODUCE, version, entry.upstream_correlation_id, _answer(version, records, errors))))
        (entry,) = out.done
    s.finish(entry)
    return entry


def _metrics_alone() -> Session:
    return Session(ConnectionContext(1, clock=Clock()), FilterChain([]), read_answers=False,
                   telemetry_reads=frozenset({FETCH}))


needs_accelerator = pytest.mark.skipif(native_skip() is None, reason="the relay path needs the native accelerator")


@needs_accelerator
@pytest.mark.parametrize("version", range(3, 14))
@pytest.mark.parametrize(("acks", "errors"), [(1, {}), (-1, {("orders", 1): 6}), (0, {})])
def test_produce_under_metrics_alone_is_relayed_and_counted_as_decoded(version, acks, errors) -> None:
    relayed = _through(_metrics_alone(), version, acks, RECORDS, errors)
    # The path counter: neither the request nor its answer was decoded.
    assert relayed.request is None and relayed.relayed is not None and relayed.response is None
    # The full path (telemetry reads everything) decodes both.
    decoded = _through(Session(ConnectionContext(1, clock=Clock()), FilterChain([])), version, acks,
                       RECORDS, errors)
    assert decoded.request is not None
    assert (decoded.response is not None) is bool(acks)
    assert produced_records(relayed) == produced_records(decoded) == (6 if errors else 10)
    assert relayed.throttle_ms == decoded.throttle_ms == (40 if acks else 0)
    for m_entry in (relayed, decoded):
        m = Metrics()
        m.record(Exchange(m_entry, ConnectionContext(1, clock=Clock()), Learned()))
        assert m.records["produced"] == (6 if errors else 10)
        assert m.throttle_seconds.get("broker", 0) == (0.04 if acks else 0)


@needs_accelerator
def test_a_legacy_message_set_or_per_topic_metrics_take_the_decoded_path() -> None:
    legacy = _through(_metrics_alone(), 9, 1, {("orders", 0): _legacy_message(b"v")}, {})
    assert legacy.request is not None and legacy.response is not None
    assert produced_records(legacy) is None        # read in full by the partition facts
    m = Metrics()
    m.record(Exchange(legacy, ConnectionContext(1, clock=Clock()), Learned()))
    assert m.records["produced"] == 1
    # Per-topic metrics need names and bytes: Produce is read decoded (TelemetryOutputs.decoded_apis).
    from kproxy.config import config_from_args
    from kproxy.telemetry.outputs import TelemetryOutputs

    def reads(topic_labels: bool) -> frozenset[int] | None:
        cfg = config_from_args("127.0.0.1:9092", "127.0.0.1:19092", admin={"listen": "127.0.0.1:19999"},
                               metrics=MetricsConfig(topic_labels=topic_labels))
        return TelemetryOutputs(cfg).decoded_apis()

    assert reads(False) == frozenset() and reads(True) == {PRODUCE, FETCH}


def test_the_session_uses_the_compiled_walks_when_the_accelerator_is_loaded() -> None:
    from kproxy.proxy import produce_bytes

    native = native_function("produce_counts")
    assert (produce_bytes.request_counts is native) if native is not None else (
        produce_bytes.request_counts is py_request_counts)
    assert (produce_bytes.answer_failures is native_function("produce_answer")) if native is not None else (
        produce_bytes.answer_failures is py_answer_failures)


@pytest.mark.skipif(len(WALKS) < 2, reason="no accelerator: only the Python walks")
@pytest.mark.parametrize("version", VERSIONS)
def test_the_compiled_walks_agree_with_the_python_ones_on_changed_bytes(version: int) -> None:
    native_answer, py_answer = WALKS[1].values[0][1], WALKS[0].values[0][1]

    @settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(message_strategy(RESPONSE, version), st.data())
    def check(resp_body: Any, data: st.DataObject) -> None:
        _decorate(resp_body, data, version)
        answer = bytearray(response_frame(PRODUCE, version, 3, resp_body))
        cut = data.draw(st.integers(0, len(answer)))
        assert native_answer(bytes(answer[:cut]), version) == py_answer(memoryview(bytes(answer[:cut])), version)
        if len(answer) > 4:
            answer[data.draw(st.integers(4, len(answer) - 1))] = data.draw(st.integers(0, 255))
            assert native_answer(bytes(answer), version) == py_answer(memoryview(bytes(answer)), version)

    check()


class ReadsProduceAnswers(Filter):
    """A response filter on Produce (as the address rewriter is from v10): the answer is decoded."""

    name = "reads-produce-answers"
    response_api_keys = frozenset({PRODUCE})

    def on_response(self, ctx: Any, exchange: Any, response: Any) -> float:
        return 0.0


@needs_accelerator
def test_a_relayed_produce_whose_answer_a_filter_reads_is_counted_from_the_decoded_pair() -> None:
    s = Session(ConnectionContext(1, clock=Clock()), FilterChain([ReadsProduceAnswers()]), read_answers=False,
                telemetry_reads=frozenset({FETCH}))
    entry = _through(s, 9, -1, RECORDS, {("orders", 1): 6})
    assert entry.request is not None and entry.response is not None      # decoded with its answer
    assert produced_records(entry) == 6

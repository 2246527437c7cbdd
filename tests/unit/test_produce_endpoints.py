"""Produce v10+ answers and KIP-951's node_endpoints: the address rewriter reads an answer only when
its bytes carry them (``AddressRewriter.reads_answer``, ``produce_bytes.answer_endpoints``). A wrong
"none" would hand a broker's real address to the client, so the check is held to the decoder on
generated answers (unknown tagged fields at every level, ``current_leader`` set or not, several topics
and partitions, node_endpoints absent, present and empty, or present) and on changed and cut bytes;
and through the session, with and without metrics."""

from __future__ import annotations

import struct
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kproxy.protocol.compiler import native_function
from kproxy.protocol.errors import DecodeError
from kproxy.protocol.messages import api_by_key, body_class, decode_response
from kproxy.proxy import produce_bytes
from kproxy.proxy.actions import Close, ToClient
from kproxy.proxy.addresses import AddressMap, AddressRewriter
from kproxy.proxy.filters import ConnectionContext, FilterChain
from kproxy.proxy.produce_bytes import py_answer_endpoints
from kproxy.proxy.session import Session
from kproxy.telemetry.exchange import produced_records
from tests.budget import examples
from tests.protocol.strategies import message_strategy

from .test_produce_relay import RECORDS, _answer, _request, needs_accelerator
from .test_session import FETCH, PRODUCE, Clock, request_frame, response_frame

RESPONSE = api_by_key(PRODUCE).response
ENDPOINT_VERSIONS = range(10, RESPONSE.versions.hi + 1)
CHECKS = [pytest.param(py_answer_endpoints, id="python")]
if native_function("produce_endpoints") is not None:
    CHECKS.append(pytest.param(native_function("produce_endpoints"), id="native"))

UPSTREAM = "kafka-1.internal"


def _tags(low: int) -> st.SearchStrategy[list | None]:
    return st.none() | st.lists(st.tuples(st.integers(low, 300), st.binary(max_size=6)), min_size=1, max_size=2)


def _decorate(obj: Any, data: st.DataObject) -> None:
    """Unknown tagged fields on every struct of an answer: the root's may sit right beside tag 0."""
    obj._unknown = data.draw(_tags(1 if hasattr(obj, "node_endpoints") else 5))
    for attr in ("responses", "partition_responses", "record_errors", "node_endpoints"):
        for item in getattr(obj, attr, None) or ():
            _decorate(item, data)
    leader = getattr(obj, "current_leader", None)
    if leader is not None:
        leader._unknown = data.draw(_tags(1))


def _has_endpoints(body: Any) -> bool:
    """What the decoder found: node_endpoints with something in them, or tag 0 sent empty."""
    return bool(body.node_endpoints) or 0 in (body._explicit or ())


def _endpoint(cls: Any, node_id: int = 1, host: str = UPSTREAM, port: int = 9092) -> Any:
    return cls.NodeEndpoint(node_id=node_id, host=host, port=port)


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("version", ENDPOINT_VERSIONS)
def test_the_check_says_endpoints_exactly_when_the_decoder_finds_them(version: int, check: Any) -> None:
    cls = body_class(PRODUCE, "response")

    @settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(message_strategy(RESPONSE, version), st.data())
    def run(body: Any, data: st.DataObject) -> None:
        how = data.draw(st.sampled_from(["generated", "absent", "empty", "one", "several"]))
        if how == "absent":
            body.node_endpoints = []
        elif how == "empty":
            body.node_endpoints, body._explicit = [], frozenset({0})     # tag 0 sent, holding no endpoint
        elif how != "generated":
            body.node_endpoints = [_endpoint(cls, i) for i in range(1 if how == "one" else 3)]
        for t in body.responses:
            for p in t.partition_responses:
                if data.draw(st.booleans()):    # KIP-951's leader hint: an id and an epoch, tag 0 too
                    p.current_leader = cls.LeaderIdAndEpoch(leader_id=2, leader_epoch=7)
        _decorate(body, data)
        frame = memoryview(response_frame(PRODUCE, version, 3, body))
        decoded = decode_response(frame, PRODUCE, version, keep_trailing=True).body
        assert check(frame, version) is _has_endpoints(decoded)
        if how in ("one", "several", "empty"):
            assert check(frame, version) is True

    run()


@pytest.mark.parametrize("check", CHECKS)
def test_answers_before_v10_have_no_endpoints_and_a_cut_answer_is_not_read(check: Any) -> None:
    cls = body_class(PRODUCE, "response")
    body = cls(responses=[cls.TopicProduceResponse(name="t", topic_id=__import__("uuid").UUID(int=5), partition_responses=[
        cls.PartitionProduceResponse(index=0, base_offset=1)])], throttle_time_ms=9)
    for version in range(RESPONSE.versions.lo, RESPONSE.versions.hi + 1):
        answer = response_frame(PRODUCE, version, 1, body)
        assert check(memoryview(answer), version) is False
        for cut in range(4, len(answer)):
            assert check(memoryview(answer[:cut]), version) is None, (version, cut)
    body.node_endpoints = [_endpoint(cls)]
    for version in ENDPOINT_VERSIONS:
        answer = response_frame(PRODUCE, version, 1, body)
        assert check(memoryview(answer), version) is True
        for cut in range(4, len(answer)):
            assert check(memoryview(answer[:cut]), version) is None, (version, cut)


@pytest.mark.parametrize("version", ENDPOINT_VERSIONS)
def test_changed_bytes_never_hide_endpoints_the_decoder_would_find(version: int) -> None:
    # Any byte changed, bytes cut or added: where the check says "none", the decoder finds none (or
    # cannot read the answer); the compiled check and the Python one agree on every such answer.
    cls = body_class(PRODUCE, "response")
    checks = [c.values[0] for c in CHECKS]

    @settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(message_strategy(RESPONSE, version), st.data())
    def run(body: Any, data: st.DataObject) -> None:
        if data.draw(st.booleans()):
            body.node_endpoints = [_endpoint(cls)]
        _decorate(body, data)
        answer = bytearray(response_frame(PRODUCE, version, 3, body))
        for _ in range(data.draw(st.integers(1, 3))):
            what = data.draw(st.sampled_from(["byte", "cut", "add"]))
            if what == "byte" and len(answer) > 4:
                answer[data.draw(st.integers(4, len(answer) - 1))] = data.draw(st.integers(0, 255))
            elif what == "cut":
                del answer[data.draw(st.integers(4, len(answer))):]
            else:
                answer += data.draw(st.binary(min_size=1, max_size=4))
        frame = memoryview(bytes(answer))
        said = {c(frame, version) for c in checks}
        assert len(said) == 1, said
        try:
            found = _has_endpoints(decode_response(frame, PRODUCE, version, keep_trailing=True).body)
        except DecodeError:
            return
        if found:
            assert said == {True}

    run()


def test_the_rewriter_uses_the_compiled_check_when_the_accelerator_is_loaded() -> None:
    native = native_function("produce_endpoints")
    assert produce_bytes.answer_endpoints is (native if native is not None else py_answer_endpoints)


# -- through the session: the path counter, the client's bytes, and metrics


def _session(metrics: bool) -> Session:
    rewriter = AddressRewriter(AddressMap("proxy.example", 19000, 16))
    return Session(ConnectionContext(1, clock=Clock()), FilterChain([rewriter]), read_answers=False,
                   telemetry_reads=frozenset({FETCH}) if metrics else None)


def _exchange(s: Session, version: int, answer: Any) -> tuple[Any, list]:
    """A Produce through ``s`` answered with ``answer`` (a body, or a frame's bytes after its
    correlation id): the finished entry and the session's actions."""
    (up,) = s.client_frame(request_frame(PRODUCE, version, 11, _request(version, -1, RECORDS)))
    entry = up.entry
    upstream_id = struct.pack(">i", entry.upstream_correlation_id)
    tail = answer if isinstance(answer, bytes) else response_frame(PRODUCE, version, 0, answer)[4:]
    out = s.upstream_frame(memoryview(upstream_id + tail))
    if out and isinstance(out[-1], ToClient):
        s.finish(entry)
    return entry, out


def _client_bytes(out: list) -> bytes:
    sent = out[-1]
    assert isinstance(sent, ToClient) and sent.done
    return b"".join(bytes(b) for b in sent.buffers)[4:]


def _moved(version: int) -> Any:
    """An answer whose partition's leader moved: its current_leader and the new leader's endpoint."""
    body = _answer(version, RECORDS, {("orders", 1): 6})
    cls = type(body)
    body.responses[0].partition_responses[1].current_leader = (
        cls.LeaderIdAndEpoch(leader_id=1, leader_epoch=4))
    body.node_endpoints = [_endpoint(cls)]
    return body


@needs_accelerator
@pytest.mark.parametrize("metrics", [False, True], ids=["no-options", "metrics"])
@pytest.mark.parametrize("version", ENDPOINT_VERSIONS)
def test_an_answer_without_endpoints_is_relayed_and_one_with_them_rewritten(version: int, metrics: bool) -> None:
    s = _session(metrics)
    body = _answer(version, RECORDS, {("orders", 1): 6})
    body._unknown = [(1, b"future")]       # an unknown tag beside where node_endpoints would be
    body.responses[0].partition_responses[0].current_leader = (
        type(body).LeaderIdAndEpoch(leader_id=1, leader_epoch=3))
    tail = response_frame(PRODUCE, version, 0, body)[4:]
    relayed, out = _exchange(s, version, tail)
    # The path counter: neither the request nor its answer was decoded; the client gets the broker's
    # bytes with its own correlation id.
    assert relayed.request is None and relayed.response is None
    assert _client_bytes(out) == struct.pack(">i", 11) + tail
    moved, out = _exchange(s, version, _moved(version))
    got = _client_bytes(out)
    assert moved.request is not None and moved.response is not None      # decoded, and rewritten
    assert UPSTREAM.encode() not in got
    (endpoint,) = decode_response(memoryview(got), PRODUCE, version).body.node_endpoints
    assert (endpoint.host, endpoint.port) == ("proxy.example", 19000)
    if metrics:
        # Counted from the bytes as the decoded path counts: the partition in error left out.
        assert produced_records(relayed) == produced_records(moved) == 6
        assert relayed.throttle_ms == moved.throttle_ms == 40


@needs_accelerator
@pytest.mark.parametrize("metrics", [False, True], ids=["no-options", "metrics"])
def test_an_answer_the_check_cannot_walk_is_decoded_and_refused(metrics: bool) -> None:
    # node_endpoints announced with more bytes than the answer holds: not "no endpoints", but the
    # decoded path, which says what is wrong and closes the connection.
    cls = body_class(PRODUCE, "response")
    tail = response_frame(PRODUCE, 12, 0, cls(throttle_time_ms=0))[4:]
    assert tail.endswith(b"\x00")
    _, out = _exchange(_session(metrics), 12, tail[:-1] + b"\x01\x00\x20" + UPSTREAM.encode())
    assert isinstance(out[-1], Close) and "malformed" in out[-1].reason
    assert not any(isinstance(a, ToClient) for a in out)


@needs_accelerator
def test_endpoints_after_unknown_tags_are_found() -> None:
    # Tags in order: node_endpoints (0) comes first; behind a header tag, partition tags and a
    # current_leader, it is still found, and rewritten.
    s = _session(False)
    body = _moved(11)
    body._unknown = [(7, b"x" * 200)]       # a two-byte size
    for t in body.responses:
        t._unknown = [(0, b"\x00")]
    entry, out = _exchange(s, 11, body)
    assert entry.response is not None and UPSTREAM.encode() not in _client_bytes(out)

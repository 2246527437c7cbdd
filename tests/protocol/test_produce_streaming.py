"""Produce requests streamed to the broker while they arrive, through the session, against the same
requests stored and forwarded: for random requests of every Produce version (several topics and
partitions, v2 batches and legacy message sets, unknown tagged fields) cut into random pieces, the
bytes the broker receives are the stored path's bytes, and the batch headers noted on the way say
what ``records.summarize`` says of the stored frame's records."""

from __future__ import annotations

import itertools
from typing import Any

import hypothesis.strategies as st
from hypothesis import HealthCheck, given, settings

from kproxy.protocol.messages import Request, api_by_key, decode_request, encode_request_frame
from kproxy.protocol.records import build_batch, build_legacy, summarize
from kproxy.proxy.actions import StreamUp, ToUpstream
from kproxy.proxy.filters import ConnectionContext, FilterChain
from kproxy.proxy.inflight import STREAMED
from kproxy.proxy.session import Session
from kproxy.telemetry.exchange import produce_partitions

from .strategies import message_strategy

PRODUCE = 0
SPEC = api_by_key(PRODUCE).request
assert SPEC is not None
CHECKS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                         HealthCheck.data_too_large])


def joined(buffers: list) -> bytes:
    return b"".join(bytes(b) for b in buffers)


@st.composite
def records_for(draw: st.DrawFn, version: int) -> bytes | None:
    kind = draw(st.sampled_from(["batches", "batches", "empty", "null"]))
    if kind == "null":
        return None
    if kind == "empty":
        return b""
    out = bytearray()
    for _ in range(draw(st.integers(1, 3))):
        values = [(None, v) for v in draw(st.lists(st.binary(max_size=400), min_size=1, max_size=4))]
        # Produce v0-2 carry legacy message sets (magic 0 and 1), v3 on record batches.
        out += build_batch(values) if version >= 3 else build_legacy(values, magic=draw(st.integers(0, 1)))
    return bytes(out)


@st.composite
def produce_requests(draw: st.DrawFn) -> bytes:
    v = draw(st.integers(0, 13))
    body = draw(message_strategy(SPEC, v))
    body.acks = draw(st.sampled_from([-1, 1]))
    for topic in body.topic_data:
        for p in topic.partition_data:
            p.records = draw(records_for(v))
    if v >= 9 and draw(st.booleans()):
        # Unknown tags at the root and inside the first topic: they pass byte for byte.
        body._unknown = sorted(draw(st.dictionaries(st.integers(1, 300), st.binary(max_size=20), max_size=2)).items()) or None
        if body.topic_data:
            body.topic_data[0]._unknown = [(77, b"later")]
    req = Request.build(PRODUCE, v, draw(st.integers(0, 1 << 30)), draw(st.none() | st.text(max_size=10)), body)
    return joined(encode_request_frame(req))[4:]


def session(min_bytes: int | None) -> Session:
    return Session(ConnectionContext(1, clock=lambda: 5.0), FilterChain([]), stream_min_bytes=min_bytes)


def pieces(frame: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(frame) + 1) for c in cuts} | {0, len(frame)})
    return [frame[a:b] for a, b in itertools.pairwise(points)]


@given(frame=produce_requests(), cuts=st.lists(st.integers(0, 1 << 20), max_size=12), head=st.integers(8, 200))
@CHECKS
def test_streamed_produce_requests_reach_the_broker_as_stored_ones_do(frame: bytes, cuts: list[int], head: int):
    stored = session(None)
    (up,) = [a for a in stored.client_frame(memoryview(frame)) if isinstance(a, ToUpstream)]
    want = joined(up.buffers)

    streamed = session(1)
    # The connection starts streaming with what has arrived of the frame: at least its first 8 bytes.
    assert streamed.request_stream_start(len(frame), memoryview(frame)[:head], True)
    sent = bytearray()
    actions: list[Any] = []
    for piece in pieces(frame, cuts):
        # Copied out at once: the buffers may be views of a receive chunk that is then refilled.
        got = streamed.request_piece(memoryview(bytearray(piece)))
        for a in got:
            if isinstance(a, StreamUp):
                sent += joined(a.buffers)
        actions += got
    assert bytes(sent) == want
    ups = [a for a in actions if isinstance(a, StreamUp)]
    assert ups[0].first and ups[-1].last and not any(a.first for a in ups[1:]) and not any(a.last for a in ups[:-1])
    entry = ups[0].entry
    assert entry.request_path == STREAMED and entry.request_bytes == len(frame) + 4
    assert streamed.streaming_up is None and streamed.in_flight[0] is entry

    # What the batch headers said as they passed is what summarize says of the stored records.
    whole = decode_request(memoryview(frame), keep_trailing=True)
    fields = [p.records for t in whole.body.topic_data for p in t.partition_data]
    assert entry.records_facts is not None and len(entry.records_facts) == len(fields)
    for facts, records in zip(entry.records_facts, fields, strict=True):
        if records is None:
            assert facts.size == -1
            continue
        s = summarize(records)
        assert (facts.batches, facts.records, facts.whole_bytes, facts.compressed, facts.size) == (
            s.batch_count, s.record_count, s.total_bytes, s.compressed, len(records))
    # Telemetry, the traffic log and quotas read the same per-partition facts from either path.
    (stored_entry,) = stored.in_flight
    assert ([p.as_dict() for p in produce_partitions(entry, _NoNames())]  # type: ignore[arg-type]
            == [p.as_dict() for p in produce_partitions(stored_entry, _NoNames())])  # type: ignore[arg-type]


class _NoNames:
    def topic(self, topic_id: Any) -> str | None:
        return None

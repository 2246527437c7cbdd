"""Cut-through streaming (``kproxy.proxy.streaming``) against store-and-forward.

For random Fetch answers of every version (records that are real batches, cut batches or arbitrary
bytes; node endpoints or none; unknown tags), split into random chunks, the bytes a client would get
from the stream equal what decoding, patching and re-encoding the whole frame gives, or differ only
by the documented padding field; the batch facts equal ``summarize`` on the whole records; and
every streamed answer decodes in kio, the independent oracle (after its padding field is removed:
kio refuses unknown tags, which a Kafka parser must skip, KIP-482). Produce requests likewise.
"""

from __future__ import annotations

import io
import itertools
import uuid
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, assume, given, settings
from kio.serial import entity_reader, entity_writer

from kproxy.protocol.framing import STREAM_CHUNK_SIZE, FrameReader
from kproxy.protocol.messages import (
    Request,
    Response,
    api_by_key,
    body_class,
    decode_request,
    decode_response,
    encode_request_frame,
    encode_response_frame,
)
from kproxy.protocol.records import build_batch, summarize
from kproxy.proxy.addresses import AddressMap, AddressRewriter
from kproxy.proxy.filters import ConnectionContext, Filter, FilterChain
from kproxy.proxy.inflight import InFlight
from kproxy.proxy.streaming import (
    PAD_TAG,
    STREAM_MIN_BYTES,
    FrameStream,
    RecordsFacts,
    StreamError,
    _BatchCounter,
    encode_tags,
    fit_tags,
    node_endpoints_rewrite,
    parse_tags,
    why_stored,
)
from kproxy.proxy.versions import ApiVersionsNarrower
from kproxy.telemetry.exchange import PartitionFacts, _read_batches, read_streamed

from .kio_bridge import kio_class
from .strategies import message_strategy

FETCH, PRODUCE = 1, 0
FETCH_SPEC = api_by_key(FETCH).response
PRODUCE_SPEC = api_by_key(PRODUCE).request
assert FETCH_SPEC is not None and PRODUCE_SPEC is not None
CHECKS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                         HealthCheck.data_too_large])


def joined(buffers: list) -> bytes:
    return b"".join(bytes(b) for b in buffers)


@st.composite
def record_payloads(draw: st.DrawFn) -> bytes | None:
    """What a broker puts in a records field: whole batches, the last one perhaps cut at max_bytes,
    nothing, null, or (a broker bug, or kproxy's own fuzzing) bytes that are not batches at all."""
    kind = draw(st.sampled_from(["batches", "batches", "cut", "empty", "null", "junk"]))
    if kind == "null":
        return None
    if kind == "empty":
        return b""
    if kind == "junk":
        return draw(st.binary(min_size=1, max_size=80))
    out = bytearray()
    offset = draw(st.integers(0, 1 << 40))
    for _ in range(draw(st.integers(1, 4))):
        values = draw(st.lists(st.binary(max_size=300), min_size=1, max_size=5))
        out += build_batch([(None, v) for v in values], base_offset=offset)
        offset += len(values)
    if kind == "cut":
        out = out[: draw(st.integers(1, len(out) - 1))]
    return bytes(out)


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


def stream_all(stream: FrameStream, body: bytes, cuts: list[int]) -> bytes:
    out = []
    for piece in chunked(body, cuts):
        # The stream may hand back views of the chunk: copy it out before the chunk is "reused".
        out.append(joined(stream.feed(memoryview(bytearray(piece)))))
    assert stream.done
    return b"".join(out)


def endpoint_rewrite(new_host: str, new_port: int):
    def rewrite(endpoints: list) -> bool:
        for e in endpoints:
            e.host, e.port = new_host, new_port
        return bool(endpoints)
    return rewrite


@st.composite
def fetch_answers(draw: st.DrawFn) -> tuple[int, Any]:
    v = draw(st.integers(0, 18))
    body = draw(message_strategy(FETCH_SPEC, v))
    codes = st.sampled_from([0, 1, 3, 6, 74, 100])   # kio reads error codes as its enum: real ones
    body.error_code = draw(codes)
    for topic in body.responses:
        for p in topic.partitions:
            p.records = draw(record_payloads())
            p.error_code = draw(codes)
    if v >= 12 and draw(st.booleans()):
        # Unknown tags at the root: kept byte for byte, and around them the rewrite must still fit.
        tags = draw(st.dictionaries(st.integers(1, 300).filter(lambda t: t != PAD_TAG), st.binary(max_size=20),
                                    max_size=3))
        body._unknown = sorted(tags.items()) or None
    return v, body


@given(answer=fetch_answers(), cuts=st.lists(st.integers(0, 1 << 20), max_size=12),
       host=st.sampled_from(["h", "kproxy.example.com", "a-much-longer-advertised-hostname.example.net"]),
       port=st.integers(1, 65535))
@CHECKS
def test_fetch_streams_what_store_and_forward_sends(answer, cuts, host, port):
    v, body = answer
    frame = joined(encode_response_frame(Response.build(FETCH, v, 11, body)))
    size = len(frame) - 4
    decided: list = []

    def decide(head):
        decided.append(head)
        return {"correlation_id": 42, "throttle_time_ms": 1234}

    stream = FrameStream(FETCH, v, "response", size, decide=decide,
                         rewrite_tail=node_endpoints_rewrite(v, endpoint_rewrite(host, port)) if v >= 12 else None)
    sent = stream_all(stream, frame[4:], cuts)
    assert len(decided) == 1 and decided[0].values["correlation_id"] == 11

    # Store-and-forward: decode the whole frame, patch, rewrite, encode.
    expected = decode_response(memoryview(frame)[4:], FETCH, v, keep_trailing=True)
    expected.correlation_id = 42
    if v >= 1:
        expected.body.throttle_time_ms = 1234
    if v >= 16:
        endpoint_rewrite(host, port)(expected.body.node_endpoints)
    want = joined(encode_response_frame(expected))
    assert len(sent) == len(frame)
    if stream.padded == 0 and not stream.dropped_hint:
        assert sent == want
    else:
        # Only the closing tags differ: the padding field, and the hint when it was dropped.
        got = decode_response(memoryview(sent)[4:], FETCH, v)
        unknown = dict(got.body._unknown or ())
        # A pad field, or (for one or two bytes of room) none: the field count's varint written longer.
        unknown.pop(PAD_TAG, None)
        got.body._unknown = sorted(unknown.items()) or None
        if stream.dropped_hint:
            expected.body.node_endpoints = []
        assert joined(encode_response_frame(got)) == joined(encode_response_frame(expected))

    # The skeleton is what was sent without the records: it decodes, and re-encodes to itself.
    skeleton = decode_response(memoryview(stream.skeleton), FETCH, v, keep_trailing=True)
    assert joined(encode_response_frame(skeleton))[4:] == stream.skeleton
    if stream.padded == 0 and not stream.dropped_hint:
        for t in expected.body.responses:
            for p in t.partitions:
                if p.records:
                    p.records = b""
        assert stream.skeleton == joined(encode_response_frame(expected))[4:]
        expected = decode_response(memoryview(frame)[4:], FETCH, v, keep_trailing=True)

    # The batch facts, partition by partition, as summarize reads the stored records.
    records = [p.records for t in expected.body.responses for p in t.partitions]
    assert len(stream.facts) == len(records)
    for facts, rec in zip(stream.facts, records, strict=True):
        assert facts.size == (-1 if rec is None else len(rec))
        if rec is None or facts.malformed:
            continue
        s = summarize(rec)
        assert (facts.batches, facts.records, facts.whole_bytes, facts.compressed) == tuple(s)

    # The independent oracle reads the streamed answer (without the padding field kio refuses).
    if v < 4:
        return   # kio knows Fetch v4 and later (Kafka 4.x)
    sent_body = decode_response(memoryview(sent)[4:], FETCH, v).body
    if sent_body._unknown:
        return   # kio raises on unknown tags (the generated ones, or the padding)
    cls = kio_class("fetch", v, "response")
    entity, used = entity_reader(cls)(memoryview(sent)[8 + (1 if v >= 12 else 0):].tobytes(), 0)
    assert used == len(sent) - 8 - (1 if v >= 12 else 0)
    buf = io.BytesIO()
    entity_writer(cls)(buf, entity)
    # The oracle writes what it read as kproxy's codec does: the bytes sent, with a count varint
    # stretched into one or two spare bytes written minimally.
    minimal = joined(encode_response_frame(decode_response(memoryview(sent)[4:], FETCH, v, keep_trailing=True)))
    assert buf.getvalue() == minimal[8 + (1 if v >= 12 else 0):]
    assert minimal == sent or (stream.padded and len(minimal) < len(sent))


@given(answer=fetch_answers(), cuts=st.lists(st.integers(0, 1 << 20), max_size=8))
@CHECKS
def test_a_frame_the_session_stores_is_returned_whole_and_unchanged(answer, cuts):
    v, body = answer
    frame = joined(encode_response_frame(Response.build(FETCH, v, 7, body)))
    stream = FrameStream(FETCH, v, "response", len(frame) - 4, decide=lambda head: None,
                         rewrite_tail=node_endpoints_rewrite(v, endpoint_rewrite("x", 1)) if v >= 12 else None)
    pieces = chunked(frame[4:], cuts)
    outs = [stream.feed(p) for p in pieces]
    assert all(o == [] for o in outs[:-1])
    assert stream.stored and joined(outs[-1]) == frame


def test_records_pass_through_as_views_of_what_arrived():
    """The records are not copied: what the stream returns for them is the memory it was fed."""
    batch = build_batch([(None, bytes(1000))] * 100)
    cls: Any = body_class(FETCH, "response")
    body = cls(responses=[cls.FetchableTopicResponse(topic="t", partitions=[
        cls.PartitionData(partition_index=0, high_watermark=100, records=batch)])])
    frame = joined(encode_response_frame(Response.build(FETCH, 11, 5, body)))
    stream = FrameStream(FETCH, 11, "response", len(frame) - 4, decide=lambda head: {})
    chunk = memoryview(bytearray(frame[4:]))
    out = stream.feed(chunk)
    views = [b for b in out if isinstance(b, memoryview) and b.obj is chunk.obj]
    assert sum(len(b) for b in views) == len(batch)
    assert stream.facts[0].records == 100 and stream.facts[0].path == ("t", 0)


def test_nothing_is_sent_before_the_decision_and_patches_apply_to_what_was_held():
    batch = build_batch([(None, b"x" * 100)] * 10)
    cls: Any = body_class(FETCH, "response")
    body = cls(throttle_time_ms=5, responses=[cls.FetchableTopicResponse(topic="t", partitions=[
        cls.PartitionData(partition_index=3, records=batch)])])
    frame = joined(encode_response_frame(Response.build(FETCH, 4, 9, body)))
    stream = FrameStream(FETCH, 4, "response", len(frame) - 4,
                         decide=lambda head: {"correlation_id": 1, "throttle_time_ms": lambda t: t + 100})
    first = stream.feed(frame[4:20])
    assert joined(first) == b""                    # the head is not whole yet: nothing goes out
    rest = stream.feed(frame[20:])
    got = decode_response(memoryview(joined(rest))[4:], FETCH, 4)
    assert got.correlation_id == 1 and got.body.throttle_time_ms == 105


def test_a_frame_shorter_than_its_schema_is_an_error():
    cls: Any = body_class(FETCH, "response")
    body = cls(responses=[cls.FetchableTopicResponse(topic="t", partitions=[cls.PartitionData()])])
    frame = joined(encode_response_frame(Response.build(FETCH, 4, 9, body)))
    stream = FrameStream(FETCH, 4, "response", len(frame) - 4 + 1, decide=lambda head: {})
    stream.feed(frame[4:])
    with pytest.raises(StreamError):
        stream.feed(b"\x00\x00")   # past the end


@given(data=st.data(), cuts=st.lists(st.integers(0, 1 << 20), max_size=10))
@CHECKS
def test_produce_requests_stream_with_the_correlation_id_patched(data, cuts):
    v = data.draw(st.integers(3, 13))
    body = data.draw(message_strategy(PRODUCE_SPEC, v))
    for topic in body.topic_data:
        for p in topic.partition_data:
            p.records = data.draw(record_payloads())
    req = Request.build(PRODUCE, v, 3, data.draw(st.none() | st.text(max_size=10)), body)
    frame = joined(encode_request_frame(req))
    stream = FrameStream(PRODUCE, v, "request", len(frame) - 4, decide=lambda head: {"correlation_id": 99})
    sent = stream_all(stream, frame[4:], cuts)
    want = decode_request(memoryview(frame)[4:], keep_trailing=True)
    want.correlation_id = 99
    assert sent == joined(encode_request_frame(want))
    assert stream.values["acks"] == body.acks


def test_a_field_cut_across_many_pieces_is_held_until_whole_not_walked_again_per_piece(monkeypatch):
    """A 200 KB tagged field in a request header, fed 1 KB at a time: the walk waits until the field
    is all there (its length is known from its first bytes) rather than trying again per piece, so a
    large field costs one copy, not one per piece (which would be quadratic in its size)."""
    body: Any = body_class(PRODUCE, "request")(acks=-1, timeout_ms=1000, topic_data=[])
    frame = joined(encode_request_frame(Request.build(PRODUCE, 9, 3, "app", body)))
    at = 4 + 2 + 2 + 4 + 2 + 3          # size, api key, version, correlation id, client id "app"
    assert frame[at] == 0                # the header's tagged fields: none
    blob = bytes(range(256)) * 800
    tags = encode_tags({5: blob})
    assert tags is not None
    data = frame[4:at] + tags + frame[at + 1:]
    runs = 0
    real = FrameStream._run

    def counted(self: FrameStream, buf: Any, p: int, end: int) -> int:
        nonlocal runs
        runs += 1
        return real(self, buf, p, end)

    monkeypatch.setattr(FrameStream, "_run", counted)
    stream = FrameStream(PRODUCE, 9, "request", len(data), decide=lambda head: {"correlation_id": 99})
    sent = stream_all(stream, data, list(range(1000, len(data), 1000)))
    assert sent[8:12] == (99).to_bytes(4, "big") and sent[12:] == data[8:]
    assert len(data) // 1000 > 200 and runs < 10


# -- keeping the tail's length


@given(tags=st.dictionaries(st.integers(0, 400).filter(lambda t: t != PAD_TAG), st.binary(max_size=300), max_size=4),
       new=st.binary(max_size=400))
def test_rewritten_tags_keep_their_length_or_drop_the_hint(tags, new):
    original = encode_tags(tags)
    assert original is not None
    wanted = {**tags, 0: new} if 0 in tags else dict(tags)
    fitted, padded, dropped = fit_tags(wanted, len(original))
    assert len(fitted) == len(original)
    parsed = parse_tags(fitted)
    assert parsed is not None and parsed[1] == len(fitted)
    got = parsed[0]
    assert (PAD_TAG in got) == (padded > 2)   # 1 or 2 bytes go into the count's varint
    got.pop(PAD_TAG, None)
    assert got == ({t: d for t, d in wanted.items() if t != 0} if dropped else wanted)
    if not dropped:
        plain = encode_tags(wanted)
        assert plain is not None and len(plain) + padded == len(original)


# -- which frames stream, and the address rewriter on a streamed answer


def test_frames_stream_only_when_large_on_a_streaming_transport_and_no_filter_sees_them_whole():
    rewriter = AddressRewriter(AddressMap("proxy.example", 19000, 16))
    chain = FilterChain([ApiVersionsNarrower(), rewriter])
    big = STREAM_MIN_BYTES
    assert why_stored(chain, FETCH, "response", big, transport_streams=True) is None
    assert why_stored(chain, FETCH, "response", big - 1, transport_streams=True) == "small"
    assert why_stored(chain, FETCH, "response", big, transport_streams=False) == "transport"
    assert why_stored(chain, 3, "response", big, transport_streams=True) == "api"
    assert why_stored(chain, PRODUCE, "request", big, transport_streams=True) is None

    class Records(Filter):
        name = "record-rules"
        response_api_keys = frozenset({FETCH})

    # A filter that has not said otherwise sees the frames of its api keys whole.
    assert why_stored(FilterChain([rewriter, Records()]), FETCH, "response", big,
                      transport_streams=True) == "filter record-rules"


@pytest.mark.parametrize(("host", "fits"), [("p", True), ("proxy.example", True),
                                           ("a-very-long-advertised-name.proxy.example", False)])
def test_a_streamed_answer_gets_the_node_endpoints_store_and_forward_would_give(host, fits):
    cls: Any = body_class(FETCH, "response")
    body = cls(responses=[cls.FetchableTopicResponse(topic_id=uuid.uuid4(), partitions=[
        cls.PartitionData(partition_index=0, current_leader=cls.LeaderIdAndEpoch(leader_id=2, leader_epoch=5),
                          records=build_batch([(None, b"v" * 500)] * 200))])],
        node_endpoints=[cls.NodeEndpoint(node_id=2, host="broker-2.internal.example", port=9092, rack="r1")])
    frame = joined(encode_response_frame(Response.build(FETCH, 16, 3, body)))

    def rewriter_and_exchange():
        rw = AddressRewriter(AddressMap(host, 19000, 16, node_id_base=0))
        return rw, InFlight(3, FETCH, 16, 0.0)

    rw, exchange = rewriter_and_exchange()
    stream = FrameStream(FETCH, 16, "response", len(frame) - 4, decide=lambda head: {},
                         rewrite_tail=node_endpoints_rewrite(16, lambda eps: rw.rewrite_node_endpoints(exchange, eps)))
    sent = stream_all(stream, frame[4:], [1000, 5000, 50000])
    assert exchange.ports == [19002]

    rw2, exchange2 = rewriter_and_exchange()
    stored = decode_response(memoryview(frame)[4:], FETCH, 16)
    rw2.on_response(ConnectionContext(1), exchange2, stored)
    got = decode_response(memoryview(sent)[4:], FETCH, 16)
    assert [(e.node_id, e.host, e.port, e.rack) for e in stored.body.node_endpoints] == [(2, host, 19002, "r1")]
    # A rewritten hint longer than the broker's (the size prefix is already out) is dropped whole:
    # the client then asks for metadata, as before KIP-951.
    assert stream.dropped_hint == (not fits)
    assert [(e.node_id, e.host, e.port, e.rack) for e in got.body.node_endpoints] == \
        ([(2, host, 19002, "r1")] if fits else [])
    unknown = dict(got.body._unknown or ())
    assert (PAD_TAG in unknown) == (stream.padded > 2)
    assert len(sent) == len(frame)


@given(records=record_payloads(), from_offset=st.integers(-1, 1 << 41), cuts=st.lists(st.integers(0, 5000), max_size=6))
@CHECKS
def test_telemetry_reads_the_same_facts_from_a_streamed_records_field(records, from_offset, cuts):
    """The traffic log and spans stay exact: what telemetry reads from the batch headers the stream
    noted equals what it reads from the stored records."""
    facts = RecordsFacts(("t", 0), -1 if records is None else len(records))
    if records:
        counter = _BatchCounter(facts)
        for piece in chunked(records, cuts):
            counter.feed(memoryview(piece))
    stored, streamed = PartitionFacts("t", None, 0), PartitionFacts("t", None, 0)
    offsets = _read_batches(stored, records, from_offset)
    if facts.malformed:
        return   # bytes that are not batches: each counts what it understood, neither fails
    assert read_streamed(streamed, facts, from_offset) == offsets
    assert streamed.as_dict() == stored.as_dict()


# -- the frame reader's cut-through mode


@given(sizes=st.lists(st.integers(0, 3_000_000), min_size=1, max_size=5),
       recv=st.lists(st.integers(1, 700_000), min_size=1, max_size=20), threshold=st.integers(1, 2_000_000))
@settings(max_examples=60, deadline=None)
def test_the_frame_reader_hands_large_frames_out_in_pieces_and_holds_one_chunk(sizes, recv, threshold):
    # A frame taken whole must fit the reader's limit (above it the reader rightly refuses it).
    assume(all(n >= threshold or n <= 1 << 20 for n in sizes))
    frames = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
    wire = b"".join(len(f).to_bytes(4, "big") + f for f in frames)
    reader = FrameReader(max_frame_size=1 << 20, chunk_size=64 * 1024)
    got: list[bytes] = []
    streamed = bytearray()
    pos = k = 0
    most_held = 0
    # Tiny reads split headers and pieces anywhere, but drawn for a wire of several MB they made one
    # example take up to 30 s (millions of reads): at most about 4,000 reads per example, so a 3 MB
    # frame is read at least 750 bytes at a time, and a wire under 4 KB still a byte at a time.
    least = len(wire) // 4000
    while pos < len(wire) or reader.streaming_left or not reader.at_frame_boundary:
        buf = reader.recv_buffer()
        n = min(len(buf), max(recv[k % len(recv)], least), len(wire) - pos)
        k += 1
        if n == 0:
            break
        buf[:n] = wire[pos:pos + n]
        pos += n
        reader.received(n)
        while True:
            if reader.streaming_left:
                piece = reader.take_piece()
                if piece is None:
                    break
                streamed += piece
                if not reader.streaming_left:
                    got.append(bytes(streamed))
                    streamed.clear()
                continue
            starting = reader.frame_starting()
            if starting is not None and starting[0] >= threshold:
                reader.stream_current()
                continue
            frame = reader.next_frame()
            if frame is None:
                break
            got.append(bytes(frame))
        most_held = max(most_held, reader.held_bytes)
    assert got == frames
    if all(len(f) >= threshold for f in frames):
        # Only streamed frames: never more than the streaming chunk held, whatever the frame sizes.
        assert most_held <= STREAM_CHUNK_SIZE + 64 * 1024

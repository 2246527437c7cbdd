"""FrameReader: frames out of any chunking of the stream, size checks before allocation."""

from __future__ import annotations

import struct

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from kproxy.protocol import FrameError
from kproxy.protocol.framing import FIRST_CHUNK_SIZE, GROWTH_FLOOR, FrameReader


def _frames(payloads):
    return b"".join(struct.pack(">i", len(p)) + p for p in payloads)


def _drain(r):
    # Frames are kept as views until the end: they must stay valid while more data arrives.
    out = []
    while (f := r.next_frame()) is not None:
        out.append(f)
    return out


@settings(max_examples=200, deadline=None)
@given(
    payloads=st.lists(st.binary(max_size=300) | st.binary(min_size=600, max_size=2000), max_size=12),
    cuts=st.lists(st.integers(1, 700), max_size=40),
    chunk=st.sampled_from([64, 512, 1024, 4096]),
    trust=st.booleans(),
)
def test_any_chunking_yields_the_same_frames(payloads, cuts, chunk, trust):
    stream = _frames(payloads)
    r = FrameReader(max_frame_size=10_000, chunk_size=chunk, trust_claims=trust)
    got, pos = [], 0
    for c in [*cuts, len(stream)]:
        piece = stream[pos : pos + c]
        pos += len(piece)
        # receive the way the server does: into the buffer the reader hands out
        mv = memoryview(piece)
        while mv:
            dst = r.recv_buffer()
            assert len(dst) > 0
            k = min(len(dst), len(mv))
            dst[:k] = mv[:k]
            r.received(k)
            mv = mv[k:]
            assert r.held_bytes == _allocated(r)
            got += _drain(r)
            assert r.held_bytes == _allocated(r)
    assert [bytes(f) for f in got] == payloads
    assert r.at_frame_boundary
    r.release_idle()
    assert r.held_bytes == _allocated(r) == 0


def _allocated(r) -> int:
    # What the reader holds, counted from its buffers: ``held_bytes`` is kept current as they change.
    return sum(len(b) for b in (r._buf, r._ready, r._big) if b is not None)


def test_frames_stay_valid_after_more_data_arrives():
    r = FrameReader(chunk_size=64)
    r.feed(_frames([b"a" * 20]))
    first = r.next_frame()
    r.feed(_frames([b"b" * 30, b"c" * 40]))
    rest = _drain(r)
    assert bytes(first) == b"a" * 20
    assert [bytes(f) for f in rest] == [b"b" * 30, b"c" * 40]


def test_large_frame_gets_its_own_exact_buffer():
    r = FrameReader(chunk_size=1024)
    payload = bytes(range(256)) * 40  # 10 KiB, larger than the chunk
    r.feed(_frames([payload]))
    f = r.next_frame()
    assert isinstance(f.obj, bytearray) and len(f.obj) == len(payload)
    assert bytes(f) == payload


@pytest.mark.parametrize("size", [-1, -(2**31), 1025, 2**31 - 1])
def test_bad_sizes_fail_before_allocation(size):
    r = FrameReader(max_frame_size=1024, chunk_size=64)
    r.feed(struct.pack(">i", size) + b"xx")
    with pytest.raises(FrameError) as e:
        r.next_frame()
    assert e.value.offset == 0
    assert r._big is None  # nothing sized from the bad prefix


def test_partial_prefix_waits():
    r = FrameReader()
    r.feed(b"\x00\x00")
    assert r.next_frame() is None
    r.feed(b"\x00\x01z")
    assert bytes(r.next_frame()) == b"z"


def test_nothing_is_allocated_before_the_first_receive_and_the_first_chunk_is_small():
    r = FrameReader()
    assert r.held_bytes == 0
    r.recv_buffer()
    assert r.held_bytes == FIRST_CHUNK_SIZE


def test_an_untrusted_size_claim_buys_only_twice_what_arrived():
    # Four bytes claiming 60 MiB, then 1,000 bytes: the buffer follows the bytes, not the claim.
    r = FrameReader(max_frame_size=64 * 2**20, trust_claims=False)
    r.feed(struct.pack(">i", 60 * 2**20) + b"x" * 1000)
    assert r.next_frame() is None
    assert r.held_bytes <= 2 * 1000 + GROWTH_FLOOR
    r.feed(b"y" * 300_000)
    assert r.next_frame() is None
    assert r.held_bytes <= 2 * 301_000 + GROWTH_FLOOR


def test_a_trusted_claim_gets_one_buffer_of_the_frame_size():
    r = FrameReader(max_frame_size=64 * 2**20, chunk_size=1024, trust_claims=True)
    r.feed(struct.pack(">i", 2**20) + b"x" * 2000)
    r.next_frame()
    assert r.held_bytes >= 2**20


def test_an_untrusted_large_frame_arrives_whole_through_its_growing_buffer():
    payload = bytes(range(256)) * 4000      # 1 MB
    r = FrameReader(max_frame_size=2 * 2**20, trust_claims=False)
    stream = _frames([payload, b"after"])
    for i in range(0, len(stream), 70_001):
        r.feed(stream[i:i + 70_001])
    assert [bytes(f) for f in _drain(r)] == [payload, b"after"]


def test_a_complete_large_frame_is_kept_while_more_is_fed_ahead():
    r = FrameReader(chunk_size=1024)
    big = b"z" * 5000
    r.feed(_frames([big, b"next"]))         # fed in one go, nothing taken in between
    assert [bytes(f) for f in _drain(r)] == [big, b"next"]


def test_release_idle_gives_the_chunk_back_and_frames_stay_valid():
    r = FrameReader(chunk_size=64 * 1024)
    r.feed(_frames([b"a" * 3000]) * 3)      # grows past the first chunk
    frames = _drain(r)
    assert r.idle_chunk_is_large or r.held_bytes <= FIRST_CHUNK_SIZE
    held = r.held_bytes
    assert r.release_idle() == held and r.held_bytes == 0
    assert [bytes(f) for f in frames] == [b"a" * 3000] * 3
    r.feed(_frames([b"b"]))
    assert bytes(r.next_frame()) == b"b"


def test_release_idle_keeps_a_partial_frame():
    r = FrameReader()
    r.feed(struct.pack(">i", 10) + b"abc")
    assert r.release_idle() == 0
    r.feed(b"defghij")
    assert bytes(r.next_frame()) == b"abcdefghij"


def _stream_one(r: FrameReader, payload: bytes) -> bytes:
    """``payload`` as one frame, taken piece by piece as cut-through does; what the pieces held."""
    r.feed(_frames([payload])[:100])
    starting = r.frame_starting()
    assert starting is not None and starting[0] == len(payload)
    r.stream_current()
    got = bytearray()
    rest = memoryview(_frames([payload]))[100:]
    while True:
        while (piece := r.take_piece()) is not None:
            got += piece
        if not rest:
            break
        dst = r.recv_buffer()
        k = min(len(dst), len(rest))
        dst[:k] = rest[:k]
        r.received(k)
        rest = rest[k:]
    assert not r.streaming_left
    return bytes(got)


def test_a_streamed_frames_chunk_is_refilled_by_the_next_answer_after_idling(monkeypatch):
    from kproxy.protocol import framing

    monkeypatch.setattr(framing, "_SPARE", [])
    r = FrameReader()
    big = bytes(range(256)) * 1024
    assert _stream_one(r, big) == big
    chunk = r.recv_buffer().obj
    assert len(chunk) == framing.STREAM_CHUNK_SIZE
    # Idle: the chunk goes back (the budget sees nothing held) to the spare list, and the next
    # receive after a streamed frame gets it whole, not a small first chunk.
    assert r.idle_chunk_is_large and r.release_idle() == len(chunk) and r.held_bytes == 0
    assert len(framing._SPARE) == 1 and framing._SPARE[0] is chunk
    assert r.recv_buffer().obj is chunk and framing._SPARE == []
    assert _stream_one(r, big[::-1]) == big[::-1]


def test_a_whole_frame_behind_a_streamed_one_is_a_copy_so_its_chunk_is_still_a_spare(monkeypatch):
    from kproxy.protocol import framing

    monkeypatch.setattr(framing, "_SPARE", [])
    r = FrameReader()
    big = b"x" * 300_000
    _stream_one(r, big)
    r.feed(_frames([b"small answer"]))
    frame = r.next_frame()
    assert frame is not None and bytes(frame) == b"small answer"
    r.release_idle()
    assert len(framing._SPARE) == 1
    # Another connection's streamed frame refills that chunk; the frame taken before is untouched.
    other = FrameReader()
    assert _stream_one(other, b"y" * 300_000) == b"y" * 300_000 and framing._SPARE == []
    assert bytes(frame) == b"small answer"


def test_a_chunk_a_frame_was_lent_from_is_never_a_spare(monkeypatch):
    from kproxy.protocol import framing

    monkeypatch.setattr(framing, "_SPARE", [])
    r = FrameReader()
    r.feed(_frames([b"a view of the chunk"]))
    frame = r.next_frame()
    assert frame is not None and isinstance(frame.obj, bytearray)    # a view of the receive chunk
    _stream_one(r, b"x" * 300_000)      # a later streamed frame gets a chunk of its own...
    r.release_idle()
    assert len(framing._SPARE) == 1 and framing._SPARE[0] is not frame.obj   # ...which is the spare
    assert bytes(frame) == b"a view of the chunk"

"""FrameReader: frames out of any chunking of the stream, size checks before allocation."""

from __future__ import annotations

import struct

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from kproxy.protocol import FrameError
from kproxy.protocol.framing import FrameReader


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
)
def test_any_chunking_yields_the_same_frames(payloads, cuts, chunk):
    stream = _frames(payloads)
    r = FrameReader(max_frame_size=10_000, chunk_size=chunk)
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
            got += _drain(r)
    assert [bytes(f) for f in got] == payloads
    assert r.at_frame_boundary


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

"""The accelerator's ``next_frame`` (``framing.frame_taker``) against ``FrameReader.next_frame``, the
reference: the same frames, the same errors and the same reader state, however the bytes arrive."""

from __future__ import annotations

import itertools
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kproxy.protocol.compiler import native_function
from kproxy.protocol.errors import FrameError
from kproxy.protocol.framing import STREAMS, FrameReader, frame_taker

pytestmark = pytest.mark.skipif(native_function("next_frame") is None, reason="the accelerator's next_frame")
take = frame_taker()
counted = native_function("frame_counts")

_STATE = [s for s in FrameReader.__slots__ if s not in ("_buf", "_big", "_ready")]


def state(r: FrameReader) -> tuple:
    def raw(b: object) -> bytes | None:
        return None if b is None else bytes(b)  # type: ignore[call-overload]
    return (tuple(getattr(r, s) for s in _STATE), raw(r._buf), raw(r._big), raw(r._ready))


def outcome(call, reader: FrameReader, stream_from: int) -> object:
    try:
        got = call(reader, stream_from)
    except FrameError as e:
        return ("FrameError", str(e))
    if got is STREAMS:
        return "STREAMS"
    return None if got is None else bytes(got)


# Frame bodies by size and a fill (few bytes of Hypothesis' data, however large the frame): small ones,
# several to a receive, and ones larger than half the first chunk.
frames = st.builds(lambda n, fill: struct.pack(">i", n) + bytes([fill]) * n,
                   st.one_of(st.integers(0, 300), st.integers(2000, 9000)), st.integers(0, 255))
bad = st.sampled_from([b"\xff\xff\xff\xf0", struct.pack(">i", 1 << 21), b"GET / HTTP/1.1\r\n"])


# The receive sizes, stream_from values and release_idle choices are drawn as lists up front and
# taken in turn: drawn one by one with st.data() (hundreds of interactive draws an example, most of
# the time spent in Hypothesis), the test took 14-25 s for its 150 examples.
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=st.lists(frames, min_size=1, max_size=20), tail=st.one_of(st.none(), bad),
       receives=st.lists(st.integers(1, 12000), min_size=1, max_size=40),
       stream_froms=st.lists(st.sampled_from([0, 0, 1 << 62, 4000]), min_size=1, max_size=40),
       releases=st.lists(st.booleans(), min_size=1, max_size=40))
def test_the_compiled_next_frame_is_the_methods(stream, tail, receives, stream_froms, releases):
    draws = {"receive": itertools.cycle(receives), "stream_from": itertools.cycle(stream_froms),
             "release": itertools.cycle(releases)}
    whole = b"".join(stream) + (tail or b"")
    least = len(whole) // 2000        # at most about 2,000 receives: a wire of 180 KB in 90-byte ones at least
    a = FrameReader(1 << 20, trust_claims=False, limit_name="frame_cap")
    b = FrameReader(1 << 20, trust_claims=False, limit_name="frame_cap")
    pos = 0
    while pos < len(whole):
        # One receive of up to what the buffer takes, as a pump's recv_into; then frames until None.
        room_a, room_b = a.recv_buffer(), b.recv_buffer()
        assert len(room_a) == len(room_b)
        n = min(len(room_a), len(whole) - pos, max(next(draws["receive"]), least))
        room_a[:n] = room_b[:n] = whole[pos:pos + n]
        a.received(n)
        b.received(n)
        pos += n
        while True:
            stream_from = next(draws["stream_from"])
            got_a = outcome(FrameReader.next_frame, a, stream_from)
            got_b = outcome(take, b, stream_from)
            assert got_a == got_b
            assert state(a) == state(b)
            if got_a is None or got_a == "STREAMS" or isinstance(got_a, tuple):
                break
        if isinstance(got_a, tuple):
            return
        if next(draws["release"]):
            assert a.release_idle() == b.release_idle()


def test_a_frame_wholly_received_is_taken_in_c():
    r = FrameReader()
    r.feed(struct.pack(">i", 3) + b"abc" + struct.pack(">i", 2) + b"de")
    before = counted()
    assert bytes(take(r, 0)) == b"abc" and bytes(take(r, 0)) == b"de" and take(r, 0) is None
    assert counted() - before == 2

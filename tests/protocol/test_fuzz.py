"""Fuzz the frame and message decoders: mutated valid frames of every API family may only ever
raise DecodeError (no IndexError, no MemoryError, no hang), and the lazy decoders (pure Python and
native) accept and reject exactly what the eager one does, so a lazy array never fails later."""

from __future__ import annotations

import contextlib
import struct

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from kproxy.protocol import DecodeError, decode_request, decode_response, encode_request
from kproxy.protocol.compiler import encode_to, get_codec, join_parts
from kproxy.protocol.messages import Request, request_codecs
from tests.budget import examples

from .strategies import all_messages, message_strategy
from .variants import lazy_variants, outcome

MESSAGES = all_messages()


@st.composite
def mutated(draw, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "truncate", "insert", "delete", "big"]))
        if not b:
            break
        i = draw(st.integers(0, len(b) - 1))
        if op == "flip":
            b[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            b[i] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xFF]))
        elif op == "truncate":
            del b[i:]
        elif op == "insert":
            b[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del b[i : i + draw(st.integers(1, 8))]
        else:
            # A huge length or count where one may stand: must fail before allocating.
            b[i : i + 4] = draw(st.sampled_from([b"\x7f\xff\xff\xff", b"\xff\xff\xff\xfe", b"\xff\xff\xff\x7f"]))
    return bytes(b)


def _encoded(msg, v):
    codec = get_codec(msg, v)

    def enc(obj):
        out, ins = bytearray(), []
        encode_to(codec, obj, out, ins)
        return codec, bytes(join_parts(out, ins))

    return message_strategy(msg, v).map(enc)


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: f"{m.api_name}-{m.kind}")
def test_mutated_bodies_raise_only_decode_error(msg):
    versions = list(range(msg.versions.lo, msg.versions.hi + 1))

    @settings(max_examples=examples(20), deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.sampled_from(versions).flatmap(lambda v: _encoded(msg, v)).flatmap(
        lambda cd: st.tuples(st.just(cd[0]), mutated(cd[1]))))
    def check(case):
        codec, data = case
        expected = outcome(codec, data)
        for lazy in lazy_variants(codec):
            assert outcome(lazy, data) == expected, f"lazy, native={lazy.native}"

    check()


@pytest.mark.parametrize("api_key", sorted({m.api_key for m in MESSAGES}))
def test_mutated_frames_raise_only_decode_error(api_key):
    msg = next(m for m in MESSAGES if m.api_key == api_key and m.kind == "request")
    versions = list(range(msg.versions.lo, msg.versions.hi + 1))

    def frame(v):
        return message_strategy(msg, v).map(
            lambda body: bytes(join_parts(*_parts(Request.build(api_key, v, 7, "fuzz", body)))))

    @settings(max_examples=examples(14), deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.sampled_from(versions).flatmap(frame).flatmap(mutated))
    def check(data):
        with contextlib.suppress(DecodeError):
            decode_request(data)
        # Responses are decoded knowing the request: feed the same bytes as a response too.
        with contextlib.suppress(DecodeError):
            decode_response(data, api_key, versions[-1])

    check()


def _parts(req):
    out = encode_request(req)
    if isinstance(out, list):
        return bytearray(b"".join(out)), []
    return out, []


def test_unknown_api_key_and_version_are_decode_errors():
    with pytest.raises(DecodeError, match="unknown api key 999"):
        decode_request(struct.pack(">hhih", 999, 0, 1, -1))
    with pytest.raises(DecodeError, match="v99"):
        decode_request(struct.pack(">hhih", 3, 99, 1, -1))
    _, bc = request_codecs(3, 0)
    with pytest.raises(DecodeError, match="trailing"):
        decode_request(struct.pack(">hhih", 3, 0, 1, -1) + struct.pack(">i", 0) + b"x")
    assert bc is not None


def test_a_nan_float64_means_the_same_after_a_round_trip():
    """Found by the fuzz above: AlterClientQuotas v1 with value NaN (0x7fffffff00000000)."""
    data = bytes.fromhex("02020b30303030c280f0908080000002017fffffff000000000000000000")
    msg = next(m for m in MESSAGES if m.api_name == "alter_client_quotas" and m.kind == "request")
    codec = get_codec(msg, 1)
    expected = outcome(codec, data)
    assert expected[0] == "ok"
    for lazy in lazy_variants(codec):
        assert outcome(lazy, data) == expected

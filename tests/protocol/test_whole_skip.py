"""The accelerator's check of a whole message (``compiler.whole_skip``), which the session's relay
path runs instead of decoding a request, accepts and rejects exactly what the decoder does: on every
request message and version, for encoded messages (Hypothesis), each of their truncations, and bytes
changed at random."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kproxy.protocol import compiler
from kproxy.protocol.compiler import NO_LAZY, get_codec, join_parts, native_skip, whole_skip
from kproxy.protocol.errors import DecodeError
from kproxy.protocol.messages import apis
from tests.budget import examples

from .strategies import message_strategy

SKIP = native_skip()
pytestmark = pytest.mark.skipif(SKIP is None, reason="no native accelerator (KPROXY_CODEC=python)")

CASES = [
    pytest.param(api.request, v, id=f"{api.request.api_name}-v{v}")
    for _, api in sorted(apis().items())
    for v in range(api.request.versions.lo, api.request.versions.hi + 1)
]


def _encode(codec, obj) -> bytes:
    out, ins = bytearray(), []
    compiler.encode_to(codec, obj, out, ins)
    return bytes(join_parts(out, ins))


def _decodes(codec, data: bytes) -> int | None:
    try:
        return codec.decode_checked(memoryview(data), 0, len(data))[1]
    except DecodeError:
        return None


def _skips(program, data: bytes) -> int | None:
    try:
        return SKIP(program, 0, memoryview(data), 0, len(data), 1, None, NO_LAZY)
    except ValueError:
        return None


@pytest.mark.parametrize(("msg", "v"), CASES)
def test_whole_skip_agrees_with_the_decoder(msg, v):
    codec = get_codec(msg, v)
    program = whole_skip(codec)
    assert program is not None

    @settings(max_examples=examples(2), deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(message_strategy(msg, v), st.data())
    def check(obj, data):
        encoded = _encode(codec, obj)
        assert _skips(program, encoded) == len(encoded)
        cut = data.draw(st.integers(0, len(encoded)))
        assert _skips(program, encoded[:cut]) == _decodes(codec, encoded[:cut])
        if encoded:
            i = data.draw(st.integers(0, len(encoded) - 1))
            changed = bytearray(encoded)
            changed[i] = data.draw(st.integers(0, 255))
            assert _skips(program, bytes(changed)) == _decodes(codec, bytes(changed))

    check()


def test_the_request_header_versions_too():
    from kproxy.protocol.messages import request_header_codec

    for version in (0, 1, 2):
        codec = request_header_codec(version)
        head = b"\x00\x0c\x00\x04\x00\x00\x00\x07" + (b"\x00\x03abc" if version else b"") + (b"\x00" if version == 2 else b"")
        assert _skips(whole_skip(codec), head) == len(head) == _decodes(codec, head)
        assert _skips(whole_skip(codec), head[:-1]) is None

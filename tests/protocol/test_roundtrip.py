"""Every message at every version survives encode -> decode -> encode unchanged (Hypothesis), with
the codec the proxy runs and with every array of structs lazy, in pure Python and native."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from kproxy.protocol import compiler
from kproxy.protocol.compiler import get_codec, join_parts
from tests.budget import examples

from .strategies import all_messages, message_strategy
from .variants import lazy_variants

MESSAGES = all_messages()


def _encode(codec, obj) -> bytes:
    out, ins = bytearray(), []
    compiler.encode_to(codec, obj, out, ins)
    return bytes(join_parts(out, ins))


CASES = [
    pytest.param(m, v, id=f"{m.api_name}-{m.kind}-v{v}")
    for m in MESSAGES
    for v in range(m.versions.lo, m.versions.hi + 1)
]


@pytest.mark.parametrize(("msg", "v"), CASES)
def test_round_trip(msg, v):
    codec = get_codec(msg, v)
    variants = [codec, *lazy_variants(codec)]

    @settings(max_examples=examples(7), deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(message_strategy(msg, v))
    def check(obj):
        data = _encode(codec, obj)
        for c in variants:
            back, pos = c.decode_checked(memoryview(data), 0, len(data))
            assert pos == len(data)
            assert _encode(c, back) == data  # untouched: lazy arrays are written as received
            assert back.to_dict(v) == obj.to_dict(v)
            assert _encode(c, back) == data  # every array decoded now: written from the objects

    check()

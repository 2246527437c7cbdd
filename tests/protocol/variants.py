"""The codec variants the codec tests compare: the one the proxy runs, and pure Python and native
with every array of structs lazy (so Hypothesis's short arrays take the lazy path too)."""

from __future__ import annotations

import pytest

from kproxy.protocol import compiler
from kproxy.protocol.compiler import DECODE_FAILURES, Codec, encode_to, join_parts
from kproxy.protocol.errors import DecodeError

LAZY = {"python-lazy": False, "native-lazy": True}


def require_accelerator() -> None:
    if not compiler.accelerator_available():
        pytest.fail("the native codec accelerator is not built (a C compiler and the Python headers are "
                    "needed; then `pip install -e .`): its tests cannot run")


def lazy_variants(codec: Codec) -> list[Codec]:
    """``codec`` as pure Python and as native, both lazy from 0 elements."""
    require_accelerator()
    return [codec.variant(native=native, lazy_min_items=0) for native in LAZY.values()]


def outcome(codec: Codec, data: bytes) -> tuple:
    """What decoding ``data`` gives: the error, or the value and its encoding once everything is
    decoded. Only DecodeError may escape the decoder."""
    fast_ok = True
    try:
        codec.decode(memoryview(data), 0, len(data))
    except DECODE_FAILURES:
        fast_ok = False
    try:
        obj, pos = codec.decode_checked(memoryview(data), 0, len(data))
    except DecodeError as e:
        assert not fast_ok, "the fast decoder accepted what the traced one rejects"
        assert e.path and e.path.startswith(codec.name)
        assert e.offset is not None and 0 <= e.offset <= len(data)
        return ("error", str(e))
    assert fast_ok, "the fast decoder rejected what the traced one accepts"
    untouched = encoded(codec, obj)
    plain = obj.to_dict()
    # Written before any lazy array was decoded, the output keeps the sender's own spelling inside
    # them (a bool sent as 2, a varint longer than needed, unknown tagged fields in the order they
    # came, where the encoder sorts them), so it is compared by what it means.
    back, _ = codec.decode_checked(memoryview(untouched), 0, len(untouched))
    assert meaning(back.to_dict()) == meaning(plain)
    return ("ok", pos, meaning(plain), encoded(codec, obj))


def meaning(value):
    """``to_dict()`` output with unknown tagged fields in tag order, as the encoder writes them."""
    if isinstance(value, list):
        return [meaning(v) for v in value]
    if isinstance(value, dict):
        out = {k: meaning(v) for k, v in value.items()}
        if "_unknown_tagged_fields" in out:
            out["_unknown_tagged_fields"] = sorted(out["_unknown_tagged_fields"], key=lambda t: t["tag"])
        return out
    if isinstance(value, float) and value != value:
        # A float64 NaN (AlterClientQuotas' value) is never equal to itself; its meaning is.
        return "NaN"
    return value


def encoded(codec: Codec, obj) -> bytes:
    out, ins = bytearray(), []
    encode_to(codec, obj, out, ins)
    return bytes(join_parts(out, ins))

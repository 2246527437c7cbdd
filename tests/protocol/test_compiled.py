"""The compiled decoder (``_accel.Decoder``, driven by ``codegen/decode_program.py``) against the
generated Python decoder it stands in front of, for every message and version in
``compiler.COMPILED``: the same values (unknown tagged fields included) and the same bytes when
re-encoded, on Hypothesis's messages; the same outcome, value or error, on mutated bytes; and a path
counter showing the compiled decoder, not the fallback, decoded what the proxy decodes."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from kproxy.protocol import compiler, decode_request, decode_response
from kproxy.protocol.codegen.layout import Layout
from kproxy.protocol.compiler import DECODE_FAILURES, Struct, encode_to, join_parts
from kproxy.protocol.lazy import LazyArray
from kproxy.protocol.messages import (
    Request,
    Response,
    api_by_name,
    encode_request,
    encode_response,
    request_codecs,
    response_codecs,
    standalone_message,
)
from kproxy.protocol.records import build_batch
from tests.budget import examples

from .strategies import all_messages, message_strategy
from .test_fuzz import mutated
from .variants import require_accelerator


def _covered():
    produce = api_by_name("produce")
    msgs = [produce.request, produce.response, standalone_message("RequestHeader"),
            standalone_message("ResponseHeader")]
    assert {m.name for m in msgs} == compiler.COMPILED, "a compiled message this test does not cover"
    return [pytest.param(m, v, id=f"{m.name}-v{v}") for m in msgs
            for v in range(m.versions.lo, m.versions.hi + 1)]


CASES = _covered()


def _pair(msg, v, lazy_min_items=compiler.DEFAULT_LAZY_MIN_ITEMS):
    """The compiled codec (native) and the pure-Python one, arrays of structs lazy from
    ``lazy_min_items`` elements."""
    require_accelerator()
    native = compiler._get(msg, v, True, lazy_min_items)
    python = native.variant(native=False)
    assert hasattr(native.decode, "hits"), f"{native.name} is not decoded by the compiled decoder"
    return native, python


def _encode(codec, obj) -> bytes:
    out, ins = bytearray(), []
    encode_to(codec, obj, out, ins)
    return bytes(join_parts(out, ins))


def _with_unknown_tags(draw, obj, msg, v):
    """Give ``obj`` and the structs inside it unknown tagged fields (flexible versions only)."""
    vf = Layout(msg, v)
    if not vf.flex:
        return obj

    def walk(o):
        if isinstance(o, list):
            for e in o:
                walk(e)
            return
        if not isinstance(o, Struct):
            return
        _, tagged = vf.fields(o._spec)
        known = {f.tag for f in tagged}
        tags = draw(st.lists(st.integers(0, 300).filter(lambda t: t not in known), max_size=2, unique=True))
        o._unknown = [(t, draw(st.binary(max_size=6))) for t in sorted(tags)] or None
        for name in o._fields:
            walk(getattr(o, name))

    walk(obj)
    return obj


def _same(a, b):
    """Equal values, and the same types and explicit-default tags all the way down."""
    assert type(a) is type(b)
    if isinstance(a, LazyArray):
        assert (a._start, a._pos, a._end, len(a)) == (b._start, b._pos, b._end, len(b))
        assert a.decoded or a._dec.__name__ == b._dec.__name__
        _same(list(a), list(b))  # decodes both
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    elif isinstance(a, Struct):
        assert a == b
        assert a._explicit == b._explicit
        for name in a._fields:
            _same(getattr(a, name), getattr(b, name))
        assert [(t, bytes(d)) for t, d in a._unknown or ()] == [(t, bytes(d)) for t, d in b._unknown or ()]
    elif isinstance(a, memoryview):
        assert a.obj is b.obj and bytes(a) == bytes(b)  # zero copy: a view of the same input
    else:
        assert a == b or (a != a and b != b)


@pytest.mark.parametrize("lazy_min_items", [compiler.DEFAULT_LAZY_MIN_ITEMS, 0], ids=["eager", "lazy"])
@pytest.mark.parametrize(("msg", "v"), CASES)
def test_compiled_matches_python(msg, v, lazy_min_items):
    """Hypothesis's arrays are short: the proxy's threshold decodes them all, 0 leaves them all lazy
    (LazyArray made by the compiled decoder after the native validating skip)."""
    native, python = _pair(msg, v, lazy_min_items)
    before = native.decode.hits

    @settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(message_strategy(msg, v), st.data())
    def check(obj, data):
        obj = _with_unknown_tags(data.draw, obj, msg, v)
        wire = _encode(python, obj)
        buf = memoryview(wire)
        a, pa = native.decode(buf, 0, len(wire))
        b, pb = python.decode(buf, 0, len(wire))
        assert pa == pb == len(wire)
        assert _encode(native, a) == _encode(python, b) == wire  # before lazy arrays are decoded
        _same(a, b)
        assert _encode(native, a) == _encode(python, b) == wire

    check()
    # Known tagged fields go to the Python decoder; every other message was decoded compiled.
    assert native.decode.hits > before


@pytest.mark.parametrize(("msg", "v"), CASES)
def test_compiled_rejects_what_python_rejects(msg, v):
    native, python = _pair(msg, v)

    @settings(max_examples=examples(15), deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.data())
    def check(data):
        wire = _encode(python, data.draw(message_strategy(msg, v)))
        bad = data.draw(mutated(wire))
        buf = memoryview(bad)
        got = []
        for c in (native, python):
            try:
                obj, pos = c.decode(buf, 0, len(bad))
                got.append((obj, pos))
            except DECODE_FAILURES as e:
                got.append(e)
        if isinstance(got[1], tuple):
            assert isinstance(got[0], tuple), "the compiled decoder rejected what Python accepts"
            _same(got[0][0], got[1][0])
            assert got[0][1] == got[1][1]
        else:
            # (Which exception differs where the skip of a lazy array runs in C; DecodeError is the same.)
            assert not isinstance(got[0], tuple), "the compiled decoder accepted what Python rejects"

    check()


def _frame(parts) -> bytes:
    return b"".join(bytes(p) for p in parts) if isinstance(parts, list) else bytes(parts)


def test_the_proxy_decodes_produce_compiled():
    """A path counter, not a timing: the proxy's decode of a one-record Produce v9 and its answer goes
    through the compiled decoders (body and headers), not their Python fallbacks."""
    require_accelerator()
    before = compiler.codec_settings()
    compiler.set_codec(native=True, lazy_min_items=compiler.DEFAULT_LAZY_MIN_ITEMS)
    try:
        cls = compiler.message_class(api_by_name("produce").request)
        part = cls.PartitionProduceData(index=0, records=build_batch([(b"k", b"v" * 100)]))
        body = cls(acks=1, timeout_ms=1000, topic_data=[cls.TopicProduceData(name="t", partition_data=[part])])
        frame = _frame(encode_request(Request.build(0, 9, 7, "client", body)))
        hc, bc = request_codecs(0, 9)
        counts = (hc.decode.hits, bc.decode.hits, hc.decode.fallbacks, bc.decode.fallbacks)
        got = decode_request(frame)
        assert (hc.decode.hits, bc.decode.hits) == (counts[0] + 1, counts[1] + 1)
        assert (hc.decode.fallbacks, bc.decode.fallbacks) == counts[2:]
        assert got.body.topic_data[0].partition_data[0].records is not None

        rcls = compiler.message_class(api_by_name("produce").response)
        part = rcls.PartitionProduceResponse(index=0, error_code=0, base_offset=5)
        resp = Response.build(0, 9, 7, rcls(responses=[rcls.TopicProduceResponse(name="t",
                                                                                  partition_responses=[part])]))
        rframe = _frame(encode_response(resp))
        rh, rb = response_codecs(0, 9)
        counts = (rh.decode.hits, rb.decode.hits)
        back = decode_response(rframe, 0, 9)
        assert (rh.decode.hits, rb.decode.hits) == (counts[0] + 1, counts[1] + 1)
        assert back.body.responses[0].partition_responses[0].base_offset == 5
    finally:
        compiler.set_codec(native=before[0], lazy_min_items=before[1])


def test_python_choice_uses_no_compiled_decoder():
    """KPROXY_CODEC=python (set_codec(native=False)) hands out the generated Python decoders only."""
    before = compiler.codec_settings()
    compiler.set_codec(native=False)
    try:
        for m in (api_by_name("produce").request, standalone_message("RequestHeader")):
            c = compiler.get_codec(m, m.versions.hi)
            assert not hasattr(c.decode, "hits")
            assert c.decode.__name__ == "d_" + m.root.name
    finally:
        compiler.set_codec(native=before[0], lazy_min_items=before[1])


ALL = [pytest.param(m, v, id=f"{m.api_name}-{m.kind}-v{v}") for m in all_messages()
       for v in range(m.versions.lo, m.versions.hi + 1)]


# Slow (about 820 cases, some 40 s of the 2 cores): the messages it adds run pure Python in the
# proxy until they join COMPILED, whose own tests above then cover them in the default run.
@pytest.mark.slow
@pytest.mark.parametrize(("msg", "v"), ALL)
def test_the_decode_program_fits_every_message(msg, v):
    """The interpreter, not only the messages it runs for now: every message and version decoded
    compiled equals the Python decode (fewer examples; eager and lazy arrays by turns), so adding a
    message to COMPILED needs no new C, only its coverage above."""
    require_accelerator()
    native = compiler._get(msg, v, True, (0, compiler.DEFAULT_LAZY_MIN_ITEMS)[v % 2])
    python = native.variant(native=False)
    decode = compiler.compiled_decoder(native)

    @settings(max_examples=examples(3), deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(message_strategy(msg, v), st.data())
    def check(obj, data):
        wire = _encode(python, _with_unknown_tags(data.draw, obj, msg, v))
        a, pa = decode(memoryview(wire), 0, len(wire))
        b, pb = python.decode(memoryview(wire), 0, len(wire))
        assert pa == pb == len(wire)
        _same(a, b)

    check()


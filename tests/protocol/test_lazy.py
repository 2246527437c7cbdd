"""Lazy arrays of structs: a large Metadata response stays bytes until a filter looks, behaves like
a list when it does, re-encodes untouched parts as views of the frame, and still reports every
malformed byte at decode time with its field path. Runs on the pure-Python and the native path."""

from __future__ import annotations

import linecache
import os
import struct
import subprocess
import sys
import uuid
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from kproxy.protocol import LazyArray, compiler
from kproxy.protocol.dissect import codec_text
from kproxy.protocol.errors import DecodeError
from kproxy.protocol.messages import Response, body_class, decode_response, encode_response, response_codecs
from kproxy.proxy.addresses import AddressMap, AddressRewriter
from kproxy.proxy.filters import ConnectionContext
from kproxy.proxy.inflight import InFlight

from .test_fuzz import mutated
from .variants import LAZY, outcome, require_accelerator

METADATA = 3
EAGER = 1 << 30  # a lazy threshold no array reaches


@pytest.fixture(params=["python", "native"])
def impl(request: pytest.FixtureRequest):
    """The proxy's codec with its own lazy threshold, in pure Python or native."""
    before = compiler.codec_settings()
    if request.param == "native":
        require_accelerator()
    compiler.set_codec(native=request.param == "native", lazy_min_items=compiler.DEFAULT_LAZY_MIN_ITEMS)
    try:
        yield request.param
    finally:
        compiler.set_codec(native=before[0], lazy_min_items=before[1])


def metadata_body(topics: int = 20, partitions: int = 10, brokers: int = 10, version: int = 12) -> Any:
    """A Metadata response: topic 0 has only 3 partitions (below the lazy threshold), and the
    partition topics[3].partitions[7] has the replicas 7777, 8888, 9999 so a test can find it."""
    C: Any = body_class(METADATA, "response")
    out = C(throttle_time_ms=0, cluster_id="cluster-1", controller_id=1, _version=version)
    out.brokers = [C.MetadataResponseBroker(node_id=i, host=f"b{i}.internal", port=9092, rack=f"r{i % 3}")
                   for i in range(1, brokers + 1)]
    out.topics = []
    for t in range(topics):
        parts = []
        for p in range(3 if t == 0 else partitions):
            reps = [7777, 8888, 9999] if (t, p) == (3, 7) else [1 + (t + p + k) % brokers for k in range(3)]
            parts.append(C.MetadataResponsePartition(partition_index=p, leader_id=reps[0], leader_epoch=t,
                                                     replica_nodes=reps, isr_nodes=reps[:2]))
        out.topics.append(C.MetadataResponseTopic(name=f"topic-{t:02d}", topic_id=uuid.UUID(int=t + 1),
                                                  partitions=parts))
    return out


def frame_of(body: Any, version: int = 12) -> bytearray:
    """The response frame (header and body, no size prefix) in a buffer of its own."""
    out = encode_response(Response.build(METADATA, version, 42, body))
    return bytearray(b"".join(out) if isinstance(out, list) else out)


def joined(parts: Any) -> bytes:
    return b"".join(bytes(p) for p in parts) if isinstance(parts, list) else bytes(parts)


def eager(frame: Any, version: int = 12) -> Any:
    """The body decoded with no lazy array at all, as the reference."""
    hc, bc = response_codecs(METADATA, version)
    _, pos = hc.decode_checked(memoryview(frame), 0, len(frame))
    body, _ = bc.variant(lazy_min_items=EAGER).decode_checked(memoryview(frame), pos, len(frame))
    return body


FRAME = frame_of(metadata_body())


def test_large_arrays_stay_bytes_until_read(impl):
    body = decode_response(FRAME, METADATA, 12).body
    assert type(body.topics) is LazyArray and type(body.brokers) is LazyArray
    assert len(body.topics) == 20 and len(body.brokers) == 10
    assert not body.topics.decoded and not body.brokers.decoded  # len() needs no decoding
    topic = body.topics[5]
    assert body.topics.decoded and not body.brokers.decoded
    assert topic.name == "topic-05"
    assert type(topic.partitions) is LazyArray and not topic.partitions.decoded
    # Below the threshold an array is a plain list at once.
    assert type(body.topics[0].partitions) is list and len(body.topics[0].partitions) == 3
    assert body.to_dict() == eager(FRAME).to_dict()


def test_a_lazy_array_behaves_like_a_list(impl):
    def fresh() -> tuple[LazyArray, list]:
        lazy = decode_response(FRAME, METADATA, 12).body.topics
        assert isinstance(lazy, LazyArray)
        return lazy, list(eager(FRAME).topics)

    readers = [
        len, bool, list, repr, lambda a: a[3], lambda a: a[-1], lambda a: a[2:9:3], lambda a: list(reversed(a)),
        lambda a: a.index(a[4]), lambda a: a.count(a[4]), lambda a: a[4] in a, lambda a: a + [1],  # noqa: RUF005
        lambda a: [0, *a][:2], lambda a: a == list(a), lambda a: a != [], lambda a: a.copy(),
        lambda a: [t.name for t in a],
    ]
    for read in readers:
        lazy, plain = fresh()
        assert read(lazy) == read(plain)
    writers = [
        lambda a: a.__setitem__(2, a[0]), lambda a: a.__delitem__(3), lambda a: a.__delitem__(slice(1, 15, 2)),
        lambda a: a.append(a[0]), lambda a: a.insert(1, a[7]), lambda a: a.extend(a[:2]), lambda a: a.pop(),
        lambda a: a.pop(0), lambda a: a.remove(a[6]), lambda a: a.reverse(), lambda a: a.clear(),
        lambda a: a.sort(key=lambda t: t.name, reverse=True), lambda a: a.__iadd__(a[:1]),
        lambda a: a.__setitem__(slice(0, 2), []),
    ]
    for write in writers:
        lazy, plain = fresh()
        write(lazy)
        write(plain)
        assert lazy == plain and len(lazy) == len(plain)
        assert [t.to_dict(12) for t in lazy] == [t.to_dict(12) for t in plain]


def test_changes_are_encoded_and_untouched_parts_are_not(impl):
    resp = decode_response(FRAME, METADATA, 12)
    want = eager(FRAME)
    for body in (resp.body, want):
        # What a policy hiding topics and a filter rewriting one partition would do.
        del body.topics[1::2]
        body.topics[2].name = "renamed"
        body.topics[3].partitions[4].leader_id = 99
        body.topics.append(body.topics[0])
    out = joined(encode_response(resp))
    back = decode_response(out, METADATA, 12).body
    assert back.to_dict() == want.to_dict()
    assert [t.name for t in back.topics] == [f"topic-{t:02d}" for t in range(0, 20, 2)][:2] + ["renamed"] + [
        f"topic-{t:02d}" for t in range(6, 20, 2)] + ["topic-00"]


def test_untouched_subtrees_are_written_as_views_of_the_frame(impl):
    frame = bytearray(FRAME)
    resp = decode_response(memoryview(frame), METADATA, 12)
    for b in resp.body.brokers:  # what the address rewriter does
        b.host, b.port = "kproxy.local", 30000 + b.node_id
    parts = encode_response(resp)
    assert isinstance(parts, list)
    views = [p for p in parts if isinstance(p, memoryview) and p.obj is frame]
    assert len(views) == 1  # the whole topics array, count prefix included
    (topics,) = views
    start = FRAME.index(b"\x15" + struct.pack(">h", 0) + b"\x09topic-00")  # 20 topics: count 21
    assert bytes(topics) == FRAME[start:start + len(topics)]
    assert start + len(topics) == len(FRAME) - 1  # then only the body's tagged-field count
    want = eager(FRAME)
    for b in want.brokers:
        b.host, b.port = "kproxy.local", 30000 + b.node_id
    assert decode_response(joined(parts), METADATA, 12).body.to_dict() == want.to_dict()
    assert not resp.body.topics.decoded


def test_reading_every_topic_name_leaves_the_partitions_as_bytes(impl):
    resp = decode_response(FRAME, METADATA, 12)
    assert [t.name for t in resp.body.topics] == [f"topic-{t:02d}" for t in range(20)]
    lazy = [t.partitions for t in resp.body.topics[1:]]
    assert all(isinstance(p, LazyArray) and not p.decoded for p in lazy)
    assert joined(encode_response(resp)) == FRAME
    assert all(not p.decoded for p in lazy)


def test_the_address_rewriter_does_not_decode_the_topics(impl):
    resp = decode_response(FRAME, METADATA, 12)
    AddressRewriter(AddressMap("kproxy.local", 30000, 64, node_id_base=0)).on_response(
        ConnectionContext(1), InFlight(1, METADATA, 12, 0.0), resp)
    assert [(b.host, b.port) for b in resp.body.brokers] == [("kproxy.local", 30000 + i) for i in range(1, 11)]
    assert isinstance(resp.body.topics, LazyArray) and not resp.body.topics.decoded


@pytest.mark.parametrize("lazy_min", [0, 8])
def test_a_bad_byte_deep_inside_is_reported_at_decode_time_with_its_path(impl, lazy_min):
    compiler.set_codec(lazy_min_items=lazy_min)
    frame = bytearray(FRAME)
    at = frame.index(b"\x04" + struct.pack(">iii", 7777, 8888, 9999))
    frame[at] = 0  # a null array, where replica_nodes may not be null
    with pytest.raises(DecodeError) as e:
        decode_response(frame, METADATA, 12)
    assert e.value.path == "metadata.v12.topics[3].partitions[7].replica_nodes"
    assert e.value.offset == at + 1  # where the decoder stands: just past the count
    frame = bytearray(FRAME)
    frame[at] = 0x7F  # 126 replicas: runs past the partition into its neighbours' bytes
    with pytest.raises(DecodeError, match=r"metadata\.v12\.topics"):
        decode_response(frame, METADATA, 12)
    cut = FRAME.index(b"topic-15")
    with pytest.raises(DecodeError) as e:
        decode_response(FRAME[:cut + 300], METADATA, 12)
    assert e.value.path.startswith("metadata.v12.topics[15].partitions[")


def test_unknown_tagged_fields_inside_lazy_elements_survive(impl):
    body = metadata_body()
    for t in body.topics:
        t._unknown = [(90, b"topic extra")]
        for p in t.partitions:
            p._unknown = [(91, b"\x01\x02")]
    frame = frame_of(body)
    resp = decode_response(frame, METADATA, 12)
    assert joined(encode_response(resp)) == frame
    assert resp.body.topics[7].partitions[3]._unknown == [(91, b"\x01\x02")]
    resp.body.to_dict()  # everything decoded
    assert joined(encode_response(resp)) == frame


def test_a_lazy_array_moved_to_another_version_is_written_from_its_elements(impl):
    v12 = decode_response(FRAME, METADATA, 12).body
    body = metadata_body(version=11)
    body.topics = v12.topics  # v11 has no nullable topic names: the v12 bytes cannot be reused
    out = joined(encode_response(Response.build(METADATA, 11, 42, body)))
    assert out == bytes(frame_of(metadata_body(version=11), 11))


def test_equal_bytes_compare_equal_without_decoding(impl):
    a = decode_response(FRAME, METADATA, 12).body.topics
    b = decode_response(bytes(FRAME), METADATA, 12).body.topics
    assert a == b and not a.decoded and not b.decoded
    assert a == list(eager(FRAME).topics)
    assert b != eager(FRAME).topics[:3]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_large_metadata_only_ever_raises_decode_error(data):
    require_accelerator()
    hc, bc = response_codecs(METADATA, 12)
    body = bytes(FRAME[hc.decode_checked(memoryview(FRAME), 0, len(FRAME))[1]:])
    b = data.draw(mutated(body))
    expected = outcome(bc.variant(lazy_min_items=EAGER), b)
    for native in LAZY.values():
        for lazy_min in (0, 8):
            assert outcome(bc.variant(native=native, lazy_min_items=lazy_min), b) == expected


# -- choosing the implementation


def test_kproxy_codec_python_forces_the_pure_python_codec():
    require_accelerator()
    probe = ("from kproxy.protocol import compiler; from kproxy.protocol.messages import response_codecs; "
             "print(response_codecs(3, 12)[1].native, compiler.codec_implementation())")
    env = {k: v for k, v in os.environ.items() if k != "KPROXY_CODEC"}
    ran = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert ran.stdout.strip() == "True generated Python with the native accelerator"
    ran = subprocess.run([sys.executable, "-c", probe], env={**env, "KPROXY_CODEC": "python"},
                         capture_output=True, text=True, check=True)
    assert ran.stdout.strip() == "False generated Python (KPROXY_CODEC=python)"


def test_without_the_accelerator_only_pure_python_is_offered(monkeypatch):
    monkeypatch.setattr(compiler, "_accel", None)
    monkeypatch.setattr(compiler, "_accel_status", "not built (no compiler)")
    monkeypatch.setattr(compiler, "_native", False)
    assert not compiler.accelerator_available()
    assert compiler.codec_implementation() == "generated Python (accelerator not built (no compiler))"
    with pytest.raises(RuntimeError, match="not built"):
        compiler.set_codec(native=True)
    _, bc = response_codecs(METADATA, 12)
    with pytest.raises(RuntimeError, match="not built"):
        bc.variant(native=True, lazy_min_items=3)
    with pytest.raises(ValueError, match=">= 0"):
        compiler.set_codec(lazy_min_items=-1)


@pytest.mark.parametrize(("native", "shown"), [(False, "def s_a_MetadataResponsePartition("),
                                               (True, "_SKIP = _NProgram((")])
def test_the_generated_skip_is_shown_and_in_tracebacks(native, shown):
    if native:
        require_accelerator()
    before = compiler.codec_settings()
    compiler.set_codec(native=native)
    try:
        text = codec_text("metadata", 12, "response")
        _, bc = response_codecs(METADATA, 12)
    finally:
        compiler.set_codec(native=before[0], lazy_min_items=before[1])
    assert shown in text and "_Lazy(buf, _st, pos, _e, n, da_MetadataResponseTopic, sp)" in text
    # Where a message decodes compiled, its Python decoder is the fallback behind it.
    code = getattr(bc.decode, "fallback", bc.decode).__code__
    assert linecache.getline(code.co_filename, code.co_firstlineno).startswith("def d_MetadataResponse(")


def test_the_native_program_is_checked_before_it_runs():
    require_accelerator()
    accel: Any = compiler._accel
    for bad in [((99,),), ((1,),), ((6, 1, 0, 5, 1, 1),), ((6, 1, 0, 0, 0, 1),), ((9, 2, 1, 0),), ((3, 3, 0),)]:
        with pytest.raises(ValueError, match="malformed skip program"):
            accel.Program(bad)
    prog = accel.Program(((1, 4),))  # a struct of one int32
    assert accel.skip(prog, 0, b"\x00" * 8, 0, 8, 2, None, 0) == 8
    with pytest.raises(ValueError, match="invalid encoding"):
        accel.skip(prog, 0, b"\x00" * 8, 0, 7, 2, None, 0)
    with pytest.raises(ValueError, match="invalid encoding"):
        accel.skip(prog, 0, b"\x00" * 8, 0, 9, 1, None, 0)  # end beyond the buffer
    with pytest.raises(ValueError, match="no such struct"):
        accel.skip(prog, 1, b"", 0, 0, 1, None, 0)
    with pytest.raises(TypeError):
        accel.skip("not a program", 0, b"", 0, 0, 1, None, 0)


def test_a_missing_accelerator_is_a_warning_that_says_what_and_what_it_costs(monkeypatch):
    monkeypatch.setattr(compiler, "_native", False)
    if compiler.accelerator_available():
        assert compiler.accelerator_warning() is None
    monkeypatch.setattr(compiler, "_accel", None)
    monkeypatch.setattr(compiler, "_accel_status", "not built")
    said = compiler.accelerator_warning()
    assert said is not None and "circular" not in said
    assert "no kproxy.protocol._accel extension" in said and "without a C compiler" in said
    assert "100,000-partition Metadata" in said and "apt-get install gcc python3-dev" in said
    monkeypatch.setattr(compiler, "_accel_status", "not loaded (undefined symbol: x)")
    assert "is not loaded (undefined symbol: x)" in (compiler.accelerator_warning() or "")

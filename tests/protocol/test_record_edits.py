"""Rebuilding record batches with headers added (kproxy.protocol.records.edit_headers), checked with
kafka-python's record parser as the independent oracle: every codec, magic 2, batch header fields
kept, CRC32C computed again; batches with nothing to change are left alone; the output is bounded.
"""

from __future__ import annotations

import contextlib

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from kproxy.protocol.errors import RecordsError
from kproxy.protocol.records import (
    Compression,
    HeaderEdit,
    RecordBatch,
    build_batch,
    edit_headers,
    iter_batches,
)

from .test_records import ROWS, _kafka_python_build, _kafka_python_view, kafka_codecs  # noqa: F401

TP = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
OWN = b"00-11111111111111111111111111111111-2222222222222222-01"
EDIT = HeaderEdit(((b"x-producer", b"billing"), (b"trace", b"set")), TP)
_FIELDS = ("base_offset", "partition_leader_epoch", "attributes", "last_offset_delta", "base_timestamp",
           "max_timestamp", "producer_id", "producer_epoch", "base_sequence", "record_count")


def expected_headers(headers: list[tuple[str, bytes | None]], edit: HeaderEdit) -> list[tuple[str, bytes | None]]:
    names = {k.decode() for k, _ in edit.set}
    kept = [(k, v) for k, v in headers if k not in names]
    out = kept + [(k.decode(), v) for k, v in edit.set]
    if edit.traceparent is not None and not any(k == "traceparent" for k, _ in kept):
        out.append(("traceparent", edit.traceparent))
    return out


def only(data: bytes):
    (batch,) = iter_batches(data, verify_crc=True)
    return batch


@pytest.mark.parametrize("codec", list(Compression))
def test_kafka_python_batch_stamped_and_read_back_by_kafka_python(kafka_codecs, codec):  # noqa: F811
    data = _kafka_python_build(2, codec, ROWS, offset=5, producer=(77, 3, 1000))
    before = only(data)
    new = edit_headers(before, EDIT)
    assert new is not None
    after = only(new)
    assert {f: getattr(after, f) for f in _FIELDS} == {f: getattr(before, f) for f in _FIELDS}
    assert after.compression is codec
    (magic, got_codec, rows), = _kafka_python_view(new)
    (_, _, old_rows), = _kafka_python_view(data)
    assert (magic, got_codec) == (2, int(codec))
    assert rows == [(o, ts, k, v, expected_headers(h, EDIT)) for o, ts, k, v, h in old_rows]


def test_a_producers_own_traceparent_is_kept():
    data = build_batch([(b"k", b"v", [("traceparent", OWN)]), (b"k", b"v", [])])
    new = edit_headers(only(data), HeaderEdit((), TP))
    assert new is not None
    assert [[(h.key, bytes(h.value)) for h in r.headers] for r in only(new).records()] == [
        [("traceparent", OWN)], [("traceparent", TP)]]


@pytest.mark.parametrize("codec", list(Compression))
def test_nothing_to_change_leaves_the_batch_alone(codec):
    traced = only(build_batch([(b"k", b"v", [("traceparent", OWN)])] * 3, compression=codec))
    assert edit_headers(traced, HeaderEdit((), TP)) is None
    assert edit_headers(traced, HeaderEdit()) is None
    for flags in ({"is_transactional": True}, {"is_control": True}):
        assert edit_headers(only(build_batch([(b"k", b"v")], compression=codec, **flags)), EDIT) is None


def test_the_rewritten_size_is_bounded():
    data = build_batch([(None, b"")] * 1000)
    big = HeaderEdit(((b"pad", b"x" * 100),))
    with pytest.raises(RecordsError, match="exceed"):
        edit_headers(only(data), big, max_decompressed_bytes=50_000)
    assert edit_headers(only(data), big, max_decompressed_bytes=200_000) is not None


def test_malformed_records_raise_records_error():
    data = bytearray(build_batch([(b"k", b"value", [("h", b"x")])] * 3))
    for cut in range(62, len(data) - 1, 3):
        broken = bytes(data[:cut]) + bytes(len(data) - cut)      # zeros where records were
        with contextlib.suppress(RecordsError):
            edit_headers(RecordBatch(broken), EDIT)


# Large values cross lz4's 64 KiB and xerial snappy's 32 KiB blocks; drawn as a size, not as bytes.
_large = st.integers(3000, 70_000).map(lambda n: bytes([n % 251]) * n)
_keys = st.none() | st.binary(max_size=40) | _large
_headers = st.lists(st.tuples(st.sampled_from(["traceparent", "x-producer", "a", "\u00e9"]),
                              st.none() | st.binary(max_size=16)), max_size=3)
_rows = st.lists(st.tuples(_keys, _keys, _headers), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=_rows, codec=st.sampled_from(list(Compression)), inject=st.booleans(),
       producer=st.tuples(st.integers(-1, 2**40), st.integers(-1, 2**15 - 1), st.integers(-1, 2**31 - 1)))
def test_property_edit_matches_the_oracle(kafka_codecs, rows, codec, inject, producer):  # noqa: F811
    data = build_batch(rows, compression=codec, base_offset=9, producer_id=producer[0], producer_epoch=producer[1],
                       base_sequence=producer[2], base_timestamp=1_700_000_000_000)
    edit = HeaderEdit(((b"x-producer", b"p"),), TP if inject else None)
    new = edit_headers(only(data), edit)
    assert new is not None
    before, after = only(data), only(new)
    assert {f: getattr(after, f) for f in _FIELDS} == {f: getattr(before, f) for f in _FIELDS}
    (_, _, got), = _kafka_python_view(new)
    assert [(k, v, h) for _, _, k, v, h in got] == [(k, v, expected_headers(list(h), edit)) for k, v, h in rows]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=_rows, ts=st.lists(st.integers(0, 2**41), min_size=6, max_size=6))
def test_record_size_is_the_encoded_size(rows, ts):
    from kproxy.policy.record_rules import record_size

    rows = [(k, v, h, 1_700_000_000_000 + t) for (k, v, h), t in zip(rows, ts, strict=False)]
    batch = only(build_batch(rows))
    sizes = [record_size(r.key, r.value, r.headers, r.timestamp_delta, r.offset_delta) for r in batch.records()]
    assert sum(sizes) == len(batch.raw) - 61

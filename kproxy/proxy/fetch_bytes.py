"""What metrics count of a Fetch exchange, read from its bytes on the relay path (no decoding).

With metrics the only reader of Fetch (no per-topic labels, no traffic log or span sampling the
exchange, no filter that reads it), a Fetch request goes to the broker undecoded and a small answer
comes back undecoded (a large one streams, and notes its batch headers as it goes). Metrics still
need the records fetched and the broker's throttle time. ``fetch_counts`` reads both from the two
frames by the layout of ``schema/fetch.kschema`` (v0..v18, flexible from v12, topic ids from v13),
exactly as ``kproxy.telemetry.exchange.fetch_partitions`` counts them decoded: the records of the v2
batches of each partition the answer reports no error for, leaving out the batches that end before
the partition's fetch offset in the request, a partial last batch not counted. The request is read
only when some error-free partition holds records (an empty long poll never reads it).

It returns None where it cannot say (a legacy message set, a malformed batch or frame, an offset
past int64): the caller then takes the decoded path, which reports a malformed answer as before. It
also says whether the answer carries KIP-951's node_endpoints (tag 0 of the body's closing tagged
fields, v16+; an empty array does not count), which the address rewriter must rewrite: such an
answer is decoded.

``fetch_counts`` is the accelerator's compiled twin (``_accel.fetch_counts``) when it is loaded; the
Python walk here is the reference and the fallback (``KPROXY_CODEC=python``) and gives the same
results. A walk written from the schema's layout by hand is a departure from the generated codecs:
``WALKED_UP_TO`` bounds it, and tests/unit/test_fetch_relay.py fails when the schema moves past it.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from kproxy.protocol.compiler import native_function
from kproxy.protocol.primitives import ShortBuffer, read_uvarint

_I16 = struct.Struct(">h").unpack_from
_I32 = struct.Struct(">i").unpack_from
_I64 = struct.Struct(">q").unpack_from

FLEXIBLE_SINCE = 12
TOPIC_IDS_SINCE = 13
ENDPOINTS_SINCE = 16        # KIP-951's node_endpoints, tag 0 of the answer's closing tagged fields
# The last version whose layout this walk knows: a newer one in the schema is decoded until it learns
# it (tests/unit/test_fetch_relay.py fails when the schema moves past it).
WALKED_UP_TO = 18
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


class _Unreadable(Exception):
    """The bytes do not read as the walk expects: the decoded path takes the exchange."""


def _count(buf: Any, pos: int, end: int, flexible: bool) -> tuple[int, int]:
    """An array's count (compact: unsigned varint - 1; else int32)."""
    if flexible:
        n, pos = read_uvarint(buf, pos)
        if pos > end:
            raise _Unreadable
        return n - 1, pos
    if end - pos < 4:
        raise _Unreadable
    return _I32(buf, pos)[0], pos + 4


def _not_null(n: int) -> int:
    """An array that may not be null: its count."""
    if n < 0:
        raise _Unreadable
    return n


def _skip(pos: int, end: int, n: int) -> int:
    if n > end - pos:
        raise _Unreadable
    return pos + n


def _tags(buf: Any, pos: int, end: int) -> tuple[int, bool]:
    """Past a tagged-field section; whether it holds tag 0 with anything but an empty compact array
    (one byte, 1: brokers such as tansu send node_endpoints so when no leader moved)."""
    n, pos = read_uvarint(buf, pos)
    zero = False
    for _ in range(n):
        tag, pos = read_uvarint(buf, pos)
        size, pos = read_uvarint(buf, pos)
        at, pos = pos, _skip(pos, end, size)
        zero = zero or (tag == 0 and not (size == 1 and buf[at] == 1))
    if pos > end:
        raise _Unreadable
    return pos, zero


def _key(buf: Any, pos: int, end: int, flexible: bool, by_id: bool) -> tuple[bytes, int]:
    """A topic's key: the bytes of its id (v13+) or of its name (a string that may not be null)."""
    if by_id:
        n = 16
    elif flexible:
        n, pos = read_uvarint(buf, pos)
        n -= 1
    else:
        if end - pos < 2:
            raise _Unreadable
        (n,) = _I16(buf, pos)
        pos += 2
    if n < 0 or n > end - pos:
        raise _Unreadable
    return bytes(buf[pos:pos + n]), pos + n


def fetch_offsets(frame: Any, version: int) -> dict[tuple[bytes, int], int]:
    """Each (topic key, partition) of a Fetch request frame (no size prefix) and its fetch offset,
    the last one when a partition is named twice (as the decoded path keeps them)."""
    end = len(frame)
    flexible = version >= FLEXIBLE_SINCE
    if end < 10:
        raise _Unreadable
    (n,) = _I16(frame, 8)                               # the header's client id
    pos = _skip(10, end, max(n, 0))
    if flexible:
        pos = _tags(frame, pos, end)[0]
    # replica_id (v0-14), max_wait_ms, min_bytes, max_bytes (v3+), isolation_level (v4+), session_id
    # and session_epoch (v7+)
    pos = _skip(pos, end, (4 if version <= 14 else 0) + 8 + (4 if version >= 3 else 0)
                + (1 if version >= 4 else 0) + (8 if version >= 7 else 0))
    # current_leader_epoch (v9+) before fetch_offset; after it last_fetched_epoch (v12+),
    # log_start_offset (v5+), partition_max_bytes
    before = 4 + (4 if version >= 9 else 0)
    after = (4 if version >= 12 else 0) + (8 if version >= 5 else 0) + 4
    offsets: dict[tuple[bytes, int], int] = {}
    topics, pos = _count(frame, pos, end, flexible)
    by_id = version >= TOPIC_IDS_SINCE
    for _ in range(_not_null(topics)):
        key, pos = _key(frame, pos, end, flexible, by_id)
        partitions, pos = _count(frame, pos, end, flexible)
        for _ in range(_not_null(partitions)):
            if end - pos < before + 8 + after:
                raise _Unreadable
            (partition,) = _I32(frame, pos)
            (offsets[(key, partition)],) = _I64(frame, pos + before)
            pos += before + 8 + after
            if flexible:
                pos = _tags(frame, pos, end)[0]
        if flexible:
            pos = _tags(frame, pos, end)[0]
    return offsets


def batch_records(buf: Any, pos: int, end: int, from_offset: int) -> int:
    """The records of the v2 batches in ``buf[pos:end]`` that end at or after ``from_offset``, as
    ``exchange._read_batches`` counts them; a partial last batch ends the walk (a Fetch answer may
    be cut at max_bytes). Anything else (a legacy message, a malformed batch) is not read here."""
    total = 0
    while end - pos >= 12:
        (length,) = _I32(buf, pos + 8)
        if length < 14:
            raise _Unreadable
        if length > end - pos - 12:
            break                           # a partial batch: the answer was cut there
        if buf[pos + 16] != 2 or length < 49:
            raise _Unreadable
        (count,) = _I32(buf, pos + 57)
        if count < 0:
            raise _Unreadable
        last = _I64(buf, pos)[0] + _I32(buf, pos + 23)[0]
        if not _INT64_MIN <= last <= _INT64_MAX:
            raise _Unreadable
        if last >= from_offset:
            total += count
        pos += 12 + length
    return total


def py_fetch_counts(request: Any, answer: Any, version: int) -> tuple[int, int, bool] | None:
    """Of a Fetch exchange, its request frame and its answer frame (both without their size prefix):
    (the records metrics count, the broker's throttle time, whether the answer carries
    node_endpoints); None when the bytes cannot be read so. With ``request`` None the records are
    not counted (0): the address rewriter asks only about node_endpoints."""
    try:
        end = len(answer)
        flexible = version >= FLEXIBLE_SINCE
        pos = _tags(answer, 4, end)[0] if flexible else _skip(4, end, 0)     # header v1: tagged fields
        throttle = 0
        if version >= 1:
            if end - pos < 4:
                raise _Unreadable
            (throttle,) = _I32(answer, pos)
            pos += 4
        if version >= 7:
            pos = _skip(pos, end, 6)        # error_code, session_id
        # high_watermark, then last_stable_offset (v4+) and log_start_offset (v5+)
        fixed = 6 + 8 + (8 if version >= 4 else 0) + (8 if version >= 5 else 0)
        offsets: dict[tuple[bytes, int], int] | None = None
        records = 0
        topics, pos = _count(answer, pos, end, flexible)
        by_id = version >= TOPIC_IDS_SINCE
        for _ in range(_not_null(topics)):
            key, pos = _key(answer, pos, end, flexible, by_id)
            partitions, pos = _count(answer, pos, end, flexible)
            for _ in range(_not_null(partitions)):
                if end - pos < fixed:
                    raise _Unreadable
                (partition,) = _I32(answer, pos)
                (error,) = _I16(answer, pos + 4)
                pos += fixed
                if version >= 4:            # aborted_transactions, nullable
                    aborted, pos = _count(answer, pos, end, flexible)
                    if aborted < -1:
                        raise _Unreadable
                    for _ in range(aborted):
                        pos = _skip(pos, end, 16)
                        if flexible:
                            pos = _tags(answer, pos, end)[0]
                if version >= 11:
                    pos = _skip(pos, end, 4)    # preferred_read_replica
                size, pos = _count(answer, pos, end, flexible)
                if size < -1:
                    raise _Unreadable
                at, pos = pos, _skip(pos, end, max(size, 0))
                if size > 0 and not error and request is not None:
                    if offsets is None:
                        offsets = fetch_offsets(request, version)
                    records += batch_records(answer, at, pos, offsets.get((key, partition), -1))
                if flexible:
                    pos = _tags(answer, pos, end)[0]
            if flexible:
                pos = _tags(answer, pos, end)[0]
        endpoints = False
        if flexible:
            pos, endpoints = _tags(answer, pos, end)
        return records, throttle, endpoints and version >= ENDPOINTS_SINCE
    except (_Unreadable, struct.error, IndexError, ShortBuffer):
        return None


fetch_counts: Callable[[Any, Any, int], tuple[int, int, bool] | None] = (
    native_function("fetch_counts") or py_fetch_counts)

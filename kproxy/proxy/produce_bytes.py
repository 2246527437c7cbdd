"""What metrics count of a Produce exchange, read from its bytes on the relay path (no decoding).

With metrics the only reader of Produce (no per-topic labels, no traffic log or span sampling the
exchange, no filter that sees it), a Produce request goes to the broker undecoded and its answer comes
back undecoded. Metrics still need two facts: the records of each partition (summed from the v2
batch headers' fixed offsets, as ``kproxy.telemetry.exchange.records_in`` does for a decoded
request) and which partitions the answer reports an error for, with the broker's throttle time
(Produce's is its last fixed field, not its first). ``request_counts`` and ``answer_failures`` walk
the two frames by the layout of ``schema/produce.kschema`` (v0..v13, flexible from v9, topic ids
from v13) and give exactly what the decoded path counts; either returns None where it cannot say
(a legacy message set, a partial batch, a malformed frame): the caller then takes the decoded path.

``answer_endpoints`` says whether an answer carries KIP-951's node_endpoints (v10+), the one part of
it the address rewriter reads: an answer without them may go on undecoded (``AddressRewriter.reads_answer``).

``request_counts``, ``answer_failures`` and ``answer_endpoints`` are the accelerator's compiled twins
(``_accel.produce_counts``/``produce_answer``/``produce_endpoints``) when it is loaded; the Python
walks here are the reference and the fallback (``KPROXY_CODEC=python``), and give the same results.

A partition's key is the bytes of its topic's name (v0..v12) or id (v13) and its index, the same
pairing the decoded path matches answers to requests by.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from kproxy.protocol.compiler import native_function
from kproxy.protocol.primitives import ShortBuffer, read_uvarint

_I32 = struct.Struct(">i").unpack_from
_I16 = struct.Struct(">h").unpack_from
_IH = struct.Struct(">ih").unpack_from

# A v2 record batch: its length after the first 12 bytes at 8, magic at 16, record count at 57; the
# header is 61 bytes.
_LENGTH_AT, _MAGIC_AT, _COUNT_AT, _V2_HEADER = 8, 16, 57, 61

FLEXIBLE_SINCE = 9
TOPIC_IDS_SINCE = 13
ENDPOINTS_SINCE = 10        # KIP-951's node_endpoints, tag 0 of the answer body
# The last version whose layout these walks know: a newer one in the schema is decoded until they
# learn it (tests/unit/test_produce_relay.py fails when the schema moves past it).
WALKED_UP_TO = 13


def batch_records(buf: Any, pos: int, end: int) -> int | None:
    """The records of the v2 batches in ``buf[pos:end]``, from each header's count; None when the
    span holds anything else (a legacy message set, a partial or malformed batch)."""
    total = 0
    while pos < end:
        if end - pos < _V2_HEADER or buf[pos + _MAGIC_AT] != 2:
            return None
        (length,) = _I32(buf, pos + _LENGTH_AT)
        (count,) = _I32(buf, pos + _COUNT_AT)
        pos += 12 + length
        if length < _V2_HEADER - 12 or pos > end or count < 0:
            return None
        total += count
    return total


def _skip_tags(buf: Any, pos: int) -> int:
    count, pos = read_uvarint(buf, pos)
    for _ in range(count):
        _, pos = read_uvarint(buf, pos)
        size, pos = read_uvarint(buf, pos)
        pos += size
    return pos


def py_request_counts(frame: Any, pos: int, version: int) -> tuple[int, int, list] | None:
    """Of a Produce request whose body starts at ``pos`` (checked whole already, ``compiler.whole_skip``):
    (acks, its records in all, and each partition's ``(topic key, index, records)``); None when a
    records field is not v2 batches."""
    try:
        flexible = version >= FLEXIBLE_SINCE
        if version >= 3:        # transactional_id, nullable
            if flexible:
                length = frame[pos]
                if length < 0x80:
                    pos += 1
                else:
                    length, pos = read_uvarint(frame, pos)
                pos += length - 1 if length else 0
            else:
                (length,) = _I16(frame, pos)
                pos += 2 + (length if length > 0 else 0)
        (acks,) = _I16(frame, pos)
        pos += 6                # acks, timeout_ms
        if flexible:
            topics = frame[pos]
            if topics < 0x80:
                pos += 1
            else:
                topics, pos = read_uvarint(frame, pos)
            topics -= 1
        else:
            (topics,) = _I32(frame, pos)
            pos += 4
        counts: list = []
        total = 0
        by_id = version >= TOPIC_IDS_SINCE
        for _ in range(topics):
            if by_id:
                key = bytes(frame[pos:pos + 16])
                pos += 16
            elif flexible:
                length = frame[pos]
                if length < 0x80:
                    pos += 1
                else:
                    length, pos = read_uvarint(frame, pos)
                key = bytes(frame[pos:pos + length - 1])
                pos += length - 1
            else:
                (length,) = _I16(frame, pos)
                key = bytes(frame[pos + 2:pos + 2 + length])
                pos += 2 + length
            if flexible:
                partitions = frame[pos]
                if partitions < 0x80:
                    pos += 1
                else:
                    partitions, pos = read_uvarint(frame, pos)
                partitions -= 1
            else:
                (partitions,) = _I32(frame, pos)
                pos += 4
            for _ in range(partitions):
                (index,) = _I32(frame, pos)
                pos += 4
                if flexible:
                    size = frame[pos]
                    if size < 0x80:
                        pos += 1
                    else:
                        size, pos = read_uvarint(frame, pos)
                    size -= 1
                else:
                    (size,) = _I32(frame, pos)
                    pos += 4
                if size > 0:
                    n = batch_records(frame, pos, pos + size)
                    if n is None:
                        return None
                    pos += size
                else:
                    n = 0       # null or empty
                counts.append((key, index, n))
                total += n
                if flexible:
                    pos = pos + 1 if frame[pos] == 0 else _skip_tags(frame, pos)
            if flexible:
                pos = pos + 1 if frame[pos] == 0 else _skip_tags(frame, pos)
        return acks, total, counts
    except (struct.error, IndexError, ValueError, ShortBuffer):
        return None


def py_answer_failures(frame: Any, version: int) -> tuple[set | None, int] | None:
    """Of a Produce answer (its frame from the correlation id on): the keys of the partitions it
    reports an error for (None: none) and its throttle time; None when it cannot be read."""
    try:
        failed, throttle, pos = _walk_answer(frame, version, True)
    except (struct.error, IndexError, ValueError, ShortBuffer):
        return None
    if pos > len(frame):
        return None
    return failed, throttle


def py_answer_endpoints(frame: Any, version: int) -> bool | None:
    """Whether a Produce answer (its frame from the correlation id on) carries KIP-951's
    node_endpoints: tag 0 among the body's closing tagged fields (v10+), where the only broker
    addresses of the answer are (a partition's ``current_leader``, its own tag 0, is an id and an
    epoch). None when the answer cannot be walked to the end of those tagged fields."""
    try:
        _, _, pos = _walk_answer(frame, version, False)
        found = False
        if version >= FLEXIBLE_SINCE:
            count, pos = read_uvarint(frame, pos)
            for _ in range(count):
                tag, pos = read_uvarint(frame, pos)
                size, pos = read_uvarint(frame, pos)
                pos += size
                if tag == 0 and version >= ENDPOINTS_SINCE:
                    found = True
    except (struct.error, IndexError, ValueError, ShortBuffer):
        return None
    if pos > len(frame):
        return None
    return found


def _walk_answer(frame: Any, version: int, collect: bool) -> tuple[set | None, int, int]:
    """A Produce answer's partitions with an error (when ``collect``), its throttle time, and where
    its body's closing tagged fields start; raises when the bytes run out."""
    flexible = version >= FLEXIBLE_SINCE
    pos = _skip_tags(frame, 4) if flexible else 4     # header v1 has tagged fields
    if flexible:
        topics = frame[pos]
        if topics < 0x80:
            pos += 1
        else:
            topics, pos = read_uvarint(frame, pos)
        topics -= 1
    else:
        (topics,) = _I32(frame, pos)
        pos += 4
    by_id = version >= TOPIC_IDS_SINCE
    # index, error_code, base_offset, then log_append_time_ms (v2+) and log_start_offset (v5+)
    fixed = 14 + (8 if version >= 2 else 0) + (8 if version >= 5 else 0)
    failed: set | None = None
    for _ in range(topics):
        if by_id:
            key = frame[pos:pos + 16]
            pos += 16
        elif flexible:
            length = frame[pos]
            if length < 0x80:
                pos += 1
            else:
                length, pos = read_uvarint(frame, pos)
            if length < 1:
                raise ValueError("a null topic name")   # not an answer the decoder would read
            key = frame[pos:pos + length - 1]
            pos += length - 1
        else:
            (length,) = _I16(frame, pos)
            if length < 0:
                raise ValueError("a null topic name")
            key = frame[pos + 2:pos + 2 + length]
            pos += 2 + length
        if flexible:
            partitions = frame[pos]
            if partitions < 0x80:
                pos += 1
            else:
                partitions, pos = read_uvarint(frame, pos)
            partitions -= 1
        else:
            (partitions,) = _I32(frame, pos)
            pos += 4
        for _ in range(partitions):
            index, error = _IH(frame, pos)
            pos += fixed
            if error and collect:
                if failed is None:
                    failed = set()
                failed.add((bytes(key), index))
            if version >= 8:
                pos = _skip_errors(frame, pos, flexible)
            if flexible:
                pos = pos + 1 if frame[pos] == 0 else _skip_tags(frame, pos)
        if flexible:
            pos = pos + 1 if frame[pos] == 0 else _skip_tags(frame, pos)
    throttle = 0
    if version >= 1:
        (throttle,) = _I32(frame, pos)
        pos += 4
    return failed, throttle, pos


def _skip_errors(frame: Any, pos: int, flexible: bool) -> int:
    """Past record_errors and error_message (v8+)."""
    if flexible:
        n = frame[pos]
        if n < 0x80:
            pos += 1
        else:
            n, pos = read_uvarint(frame, pos)
        n -= 1
    else:
        (n,) = _I32(frame, pos)
        pos += 4
    for _ in range(n):
        pos += 4                                    # batch_index
        pos = _skip_nullable_string(frame, pos, flexible)
        if flexible:
            pos = pos + 1 if frame[pos] == 0 else _skip_tags(frame, pos)
    return _skip_nullable_string(frame, pos, flexible)


def _skip_nullable_string(frame: Any, pos: int, flexible: bool) -> int:
    if flexible:
        length, pos = read_uvarint(frame, pos)
        return pos + (length - 1 if length else 0)
    (length,) = _I16(frame, pos)
    return pos + 2 + (length if length > 0 else 0)


request_counts: Callable[[Any, int, int], tuple[int, int, list] | None] = (
    native_function("produce_counts") or py_request_counts)
answer_failures: Callable[[Any, int], tuple[set | None, int] | None] = (
    native_function("produce_answer") or py_answer_failures)
answer_endpoints: Callable[[Any, int], bool | None] = native_function("produce_endpoints") or py_answer_endpoints


def produced(total: int, counts: list | None, failed: set | None) -> int:
    """The records of the partitions the answer reports no error for."""
    if failed is None or counts is None:
        return total
    return sum(n for key, index, n in counts if (key, index) not in failed)

"""Encoding batches from values: RecordBatch v2 and legacy v0/v1 message sets, compressed with any
codec, for the records kproxy writes itself (fleet quota coordination), tests, benchmarks and the
broker stand-ins. A batch a client sent is rebuilt, not built (``rewrite``).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable
from typing import Any

import crc32c

from kproxy.protocol.primitives import INT32, write_varint
from kproxy.protocol.records.compression import Compression, compress
from kproxy.protocol.records.view import (
    CONTROL_MASK,
    LOG_OVERHEAD,
    TIMESTAMP_TYPE_MASK,
    TRANSACTIONAL_MASK,
    V2_ATTRIBUTES_OFFSET,
    V2_CRC_OFFSET,
    V2_HEADER,
    V2_HEADER_SIZE,
    TimestampType,
)

# --------------------------------------------------------------------------------------------------
# Building


def _unpack_input(item: Any, index: int) -> tuple[Any, Any, Iterable[Any], int | None, int]:
    """(key, value, headers, timestamp, offset_delta) from a tuple or a Record-like object."""
    if isinstance(item, tuple | list):
        if len(item) == 2:
            return item[0], item[1], (), None, index
        if len(item) == 3:
            return item[0], item[1], item[2] or (), None, index
        if len(item) == 4:
            return item[0], item[1], item[2] or (), item[3], index
        raise ValueError(f"record {index}: expected (key, value[, headers[, timestamp]])")
    headers = getattr(item, "headers", None) or ()
    timestamp = getattr(item, "timestamp", None)
    offset_delta = getattr(item, "offset_delta", index)
    return item.key, item.value, headers, timestamp, offset_delta


def write_bytes(out: bytearray, value: Any) -> None:
    if value is None:
        out += b"\x01"  # zig-zag -1: null
    else:
        out += write_varint(len(value))
        out += value


def build_batch(
    records: Iterable[Any],
    *,
    compression: Compression = Compression.NONE,
    base_offset: int = 0,
    base_timestamp: int | None = None,
    max_timestamp: int | None = None,
    producer_id: int = -1,
    producer_epoch: int = -1,
    base_sequence: int = -1,
    is_transactional: bool = False,
    is_control: bool = False,
    timestamp_type: TimestampType = TimestampType.CREATE_TIME,
    partition_leader_epoch: int = -1,
    last_offset_delta: int | None = None,
    magic: int = 2,
) -> bytes:
    """Encode one batch. ``records`` holds ``(key, value[, headers[, timestamp]])`` tuples or objects
    with ``key``, ``value``, ``headers`` and optionally ``timestamp`` and ``offset_delta`` (a Record).

    Records without a timestamp get ``base_timestamp``, which defaults to the first timestamp given,
    else -1 (Kafka's NO_TIMESTAMP). ``magic`` 0 or 1 builds a legacy message set via ``build_legacy``.
    """
    compression = Compression(compression)
    if magic in (0, 1):
        return build_legacy(
            records,
            magic=magic,
            compression=compression,
            base_offset=base_offset,
            timestamp_type=timestamp_type,
        )
    if magic != 2:
        raise ValueError(f"cannot build magic {magic}")
    items = [_unpack_input(item, i) for i, item in enumerate(records)]
    if base_timestamp is None:
        base_timestamp = next((ts for _, _, _, ts, _ in items if ts is not None), -1)
    body = bytearray()
    max_ts = None
    last_delta = 0
    for key, value, headers, ts, offset_delta in items:
        if ts is None:
            ts = base_timestamp
        max_ts = ts if max_ts is None else max(max_ts, ts)
        last_delta = offset_delta
        rec = bytearray(b"\x00")  # record attributes: unused since magic 2
        rec += write_varint(ts - base_timestamp)
        rec += write_varint(offset_delta)
        write_bytes(rec, key)
        write_bytes(rec, value)
        headers = list(headers)
        rec += write_varint(len(headers))
        for hkey, hvalue in headers:
            if isinstance(hkey, str):
                hkey = hkey.encode("utf-8", "surrogateescape")
            write_bytes(rec, hkey)
            write_bytes(rec, hvalue)
        body += write_varint(len(rec))
        body += rec
    if compression is not Compression.NONE:
        body = bytearray(compress(compression, bytes(body), 2))
    attributes = int(compression)
    if timestamp_type == TimestampType.LOG_APPEND_TIME:
        attributes |= TIMESTAMP_TYPE_MASK
    if is_transactional:
        attributes |= TRANSACTIONAL_MASK
    if is_control:
        attributes |= CONTROL_MASK
    if max_timestamp is None:
        max_timestamp = base_timestamp if max_ts is None else max_ts
    header = V2_HEADER.pack(
        base_offset,
        V2_HEADER_SIZE - LOG_OVERHEAD + len(body),
        partition_leader_epoch,
        2,
        0,
        attributes,
        last_delta if last_offset_delta is None else last_offset_delta,
        base_timestamp,
        max_timestamp,
        producer_id,
        producer_epoch,
        base_sequence,
        len(items),
    )
    out = bytearray(header)
    out += body
    struct.pack_into(">I", out, V2_CRC_OFFSET, crc32c.crc32c(memoryview(out)[V2_ATTRIBUTES_OFFSET:]))
    return bytes(out)


def _legacy_message(offset: int, magic: int, attributes: int, timestamp: int, key: Any, value: Any) -> bytes:
    body = bytearray(struct.pack(">bb", magic, attributes))
    if magic == 1:
        body += struct.pack(">q", timestamp)
    for part in (key, value):
        if part is None:
            body += INT32.pack(-1)
        else:
            body += INT32.pack(len(part))
            body += part
    return struct.pack(">qiI", offset, 4 + len(body), zlib.crc32(body)) + bytes(body)


def build_legacy(
    messages: Iterable[Any],
    *,
    magic: int = 1,
    compression: Compression = Compression.NONE,
    base_offset: int = 0,
    timestamp_type: TimestampType = TimestampType.CREATE_TIME,
    wrapper_timestamp: int | None = None,
) -> bytes:
    """Encode a magic 0 or 1 message set from the same inputs as ``build_batch`` (headers must be empty).

    Compressed sets are one wrapper message whose offset is the last inner offset; inner offsets are
    relative for magic 1 (KIP-31) and absolute for magic 0, and magic 0 lz4 uses the broken header
    checksum of Kafka 0.8 (KIP-57).
    """
    if magic not in (0, 1):
        raise ValueError(f"legacy message sets are magic 0 or 1, not {magic}")
    compression = Compression(compression)
    items = [_unpack_input(item, i) for i, item in enumerate(messages)]
    ts_bit = TIMESTAMP_TYPE_MASK if magic == 1 and timestamp_type == TimestampType.LOG_APPEND_TIME else 0
    parts = []
    max_ts = -1
    for i, (key, value, headers, ts, _) in enumerate(items):
        if list(headers):
            raise ValueError("messages before magic 2 cannot carry headers")
        ts = -1 if ts is None else ts
        max_ts = max(max_ts, ts)
        inner_offset = i if compression is not Compression.NONE and magic == 1 else base_offset + i
        parts.append(
            _legacy_message(
                inner_offset, magic, ts_bit if compression is Compression.NONE else 0, ts, key, value
            )
        )
    if compression is Compression.NONE or not items:
        return b"".join(parts)
    payload = compress(compression, b"".join(parts), magic)
    wrapper_ts = max_ts if wrapper_timestamp is None else wrapper_timestamp
    return _legacy_message(
        base_offset + len(items) - 1, magic, compression | ts_bit, wrapper_ts, None, payload
    )

"""Rewriting a received RecordBatch for record rules: the same codec and header fields (base offset,
leader epoch, attributes, timestamps, the producer's id, epoch and sequence), a new records
section, length and CRC32C. ``edit_headers`` puts headers on every record; transactional and
control batches are never changed.
"""

from __future__ import annotations

import struct

import crc32c

from kproxy.protocol.errors import RecordsError
from kproxy.protocol.primitives import ShortBuffer, read_varint, read_varlong, write_varint
from kproxy.protocol.records.build import write_bytes
from kproxy.protocol.records.compression import Compression, compress
from kproxy.protocol.records.view import (
    DEFAULT_MAX_DECOMPRESSED_BYTES,
    LOG_OVERHEAD,
    MIN_RECORD_SIZE,
    V2_ATTRIBUTES_OFFSET,
    V2_CRC_OFFSET,
    V2_HEADER,
    V2_HEADER_SIZE,
    RecordBatch,
    records_error,
)

# --------------------------------------------------------------------------------------------------
# Rewriting a batch (record rules): same codec, same header fields, new records section and CRC


def rebuild_batch(batch: RecordBatch, payload: bytes | bytearray | memoryview, record_count: int | None = None) -> bytes:
    """``batch`` with its records section replaced by ``payload`` (uncompressed records), compressed
    with the batch's own codec. Base offset, leader epoch, attributes, offset delta, timestamps and
    the producer's id, epoch and sequence are kept; the length and the CRC32C are computed again."""
    codec = batch.compression
    body = bytes(payload) if codec is Compression.NONE else compress(codec, bytes(payload), 2)
    out = bytearray(V2_HEADER_SIZE + len(body))
    V2_HEADER.pack_into(
        out, 0,
        batch.base_offset,
        V2_HEADER_SIZE - LOG_OVERHEAD + len(body),
        batch.partition_leader_epoch,
        2,
        0,
        batch.attributes,
        batch.last_offset_delta,
        batch.base_timestamp,
        batch.max_timestamp,
        batch.producer_id,
        batch.producer_epoch,
        batch.base_sequence,
        batch.record_count if record_count is None else record_count,
    )
    out[V2_HEADER_SIZE:] = body
    struct.pack_into(">I", out, V2_CRC_OFFSET, crc32c.crc32c(memoryview(out)[V2_ATTRIBUTES_OFFSET:]))
    return bytes(out)


_PRODUCER = struct.Struct(">qhi")     # producer id, producer epoch, base sequence
_V2_PRODUCER_OFFSET = 43


def with_producer(batch: RecordBatch, producer_id: int, producer_epoch: int, base_sequence: int) -> bytes:
    """``batch`` as another producer's, or at another sequence: the producer id, epoch and base
    sequence replaced and the CRC32C computed again (they are inside what it covers); the records
    are copied as they are, compressed or not."""
    out = bytearray(batch.raw)
    _PRODUCER.pack_into(out, _V2_PRODUCER_OFFSET, producer_id, producer_epoch, base_sequence)
    struct.pack_into(">I", out, V2_CRC_OFFSET, crc32c.crc32c(memoryview(out)[V2_ATTRIBUTES_OFFSET:]))
    return bytes(out)


def _header_bytes(key: bytes, value: bytes | None) -> bytes:
    out = bytearray(write_varint(len(key)))
    out += key
    write_bytes(out, value)
    return bytes(out)


TRACEPARENT = b"traceparent"


class HeaderEdit:
    """Headers to put on every record of a batch: ``set`` replaces any header of the same name (all
    of them) and is added; ``traceparent`` is added only to records that carry none."""

    __slots__ = ("keys", "set", "traceparent")

    def __init__(self, set: tuple[tuple[bytes, bytes], ...] = (), traceparent: bytes | None = None) -> None:
        self.set = tuple(set)
        self.traceparent = traceparent
        self.keys = frozenset(k for k, _ in self.set)


def edit_headers(batch: RecordBatch, edit: HeaderEdit,
                 max_decompressed_bytes: int = DEFAULT_MAX_DECOMPRESSED_BYTES) -> bytes | None:
    """``batch`` rebuilt with ``edit`` applied to every record, or None when nothing changes
    (transactional and control batches are never changed, nor a batch every record of which
    already has what the edit would add). The rebuilt batch is at most ``max_decompressed_bytes``
    uncompressed, else RecordsError; so is anything decompressed on the way."""
    if batch.is_transactional or batch.is_control or (not edit.set and edit.traceparent is None):
        return None
    compressed = batch.compression is not Compression.NONE
    buf = batch.payload(max_decompressed_bytes)
    base = batch._at + V2_HEADER_SIZE
    count = batch.record_count
    end = len(buf)
    if count > end // MIN_RECORD_SIZE:
        raise records_error(f"record count {count} cannot fit in {end} bytes", 0, base, compressed)
    keys = edit.keys
    set_bytes = b"".join(_header_bytes(k, v) for k, v in edit.set)
    tp_bytes = _header_bytes(TRACEPARENT, edit.traceparent) if edit.traceparent is not None else b""
    # The common case, a record without headers, gets the same bytes every time.
    plain_added = set_bytes + tp_bytes
    plain_count = len(edit.set) + (1 if tp_bytes else 0)
    out = bytearray()
    cap = max_decompressed_bytes
    changed = False
    pos = 0
    start = 0
    # Varints are read inline when they fit one byte (nearly always, but for value lengths), which
    # is most of the cost of a record here; the records' own bytes are copied, never decoded.
    encoded_counts = [write_varint(i) for i in range(64)]
    out_append = out.__iadd__
    try:
        for _ in range(count):
            start = pos
            b = buf[pos]
            if b < 0x80:
                length, p = (b >> 1) ^ -(b & 1), pos + 1
            else:
                length, p = read_varint(buf, pos)
            if length < MIN_RECORD_SIZE - 1 or length > end - p:
                raise records_error(f"record length {length} outside 6..{end - p}", start, base, compressed)
            stop = p + length
            q = p + 1                              # attributes
            if buf[q] < 0x80:                      # timestamp delta
                q += 1
            else:
                _, q = read_varlong(buf, q)
            if buf[q] < 0x80:                      # offset delta
                q += 1
            else:
                _, q = read_varint(buf, q)
            for _ in range(2):                     # key, value
                b = buf[q]
                if b < 0x80:
                    n, q = (b >> 1) ^ -(b & 1), q + 1
                else:
                    n, q = read_varint(buf, q)
                if n > 0:
                    q += n
            if q >= stop:
                raise records_error("key or value overruns its record", start, base, compressed)
            head_end = q
            b = buf[q]
            if b == 0:
                header_count, q = 0, q + 1
            else:
                header_count, q = read_varint(buf, q)
            if header_count < 0 or header_count > (stop - q) // 2:
                raise records_error(f"header count {header_count} invalid", q, base, compressed)
            if header_count == 0:
                if q != stop:
                    raise records_error(f"record body is {q - stop + length} bytes, its length says {length}",
                                        start, base, compressed)
                if plain_count:
                    changed = True
                    count_bytes = encoded_counts[plain_count] if plain_count < 64 else write_varint(plain_count)
                    new_length = length + len(plain_added) + len(count_bytes) - 1
                    out_append(write_varint(new_length))
                    out_append(buf[p:head_end])
                    out_append(count_bytes)
                    out_append(plain_added)
                else:
                    out_append(buf[start:stop])
                if len(out) > cap:
                    raise RecordsError(f"the rewritten records exceed {cap} bytes", base)
                pos = stop
                continue
            kept: list[memoryview] = []
            has_tp = False
            for _ in range(header_count):
                h = q
                n, q = read_varint(buf, q)
                if n < 0 or n > stop - q:
                    raise records_error(f"header key length {n} invalid", q, base, compressed)
                hkey = bytes(buf[q : q + n])
                q += n
                n, q = read_varint(buf, q)
                if n > 0:
                    q += n
                if q > stop:
                    raise records_error("header value overruns its record", h, base, compressed)
                if hkey in keys:
                    continue
                if hkey == TRACEPARENT:
                    has_tp = True
                kept.append(buf[h:q])
            if tp_bytes and not has_tp:
                added, new_count = plain_added, len(kept) + plain_count
            else:
                added, new_count = set_bytes, len(kept) + len(edit.set)
            if q != stop:
                raise records_error(f"record body is {q - stop + length} bytes, its length says {length}",
                                    start, base, compressed)
            if added or new_count != header_count:
                changed = True
            count_bytes = write_varint(new_count)
            new_length = (head_end - p) + len(count_bytes) + sum(len(k) for k in kept) + len(added)
            out_append(write_varint(new_length))
            out_append(buf[p:head_end])
            out_append(count_bytes)
            for k in kept:
                out_append(k)
            out_append(added)
            if len(out) > cap:
                raise RecordsError(f"the rewritten records exceed {cap} bytes", base)
            pos = stop
    except IndexError:
        raise records_error("record runs past the end of the batch", start, base, compressed) from None
    except ShortBuffer as exc:
        raise records_error(str(exc), start, base, compressed) from None
    if pos != end:
        raise records_error(f"{end - pos} bytes remain after the last of {count} records", pos, base, compressed)
    if not changed:
        return None
    return rebuild_batch(batch, out)

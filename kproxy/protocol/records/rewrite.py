"""Rewriting a received RecordBatch for record rules: the same codec and header fields (base offset,
leader epoch, attributes, timestamps, the producer's id, epoch and sequence), a new records
section, length and CRC32C. ``edit_headers`` puts headers on every record; transactional and
control batches are never changed.
"""

from __future__ import annotations

import importlib
import struct
from typing import Any

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
    out[V2_HEADER_SIZE:] = body
    _seal_header(batch, out, batch.record_count if record_count is None else record_count)
    return bytes(out)


def _seal_header(batch: RecordBatch, out: bytearray | memoryview, record_count: int) -> None:
    """Writes ``batch``'s header (its length from ``out``'s, ``record_count``) into the first
    ``V2_HEADER_SIZE`` bytes of ``out``, then the CRC of everything after the attributes."""
    V2_HEADER.pack_into(
        out, 0,
        batch.base_offset,
        len(out) - LOG_OVERHEAD,
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
        record_count,
    )
    struct.pack_into(">I", out, V2_CRC_OFFSET, crc32c.crc32c(memoryview(out)[V2_ATTRIBUTES_OFFSET:]))


def rebuild_reserved(batch: RecordBatch, out: bytearray | memoryview,
                     max_decompressed_bytes: int = DEFAULT_MAX_DECOMPRESSED_BYTES) -> bytearray | memoryview | bytes:
    """``rebuild_batch`` for records written after ``V2_HEADER_SIZE`` reserved bytes of ``out`` (a
    bytearray, or a writable view of a larger buffer): an uncompressed batch gets its header written
    in place (no copy of the records), a compressed one is compressed from there. RecordsError when
    the records exceed ``max_decompressed_bytes``."""
    size = len(out) - V2_HEADER_SIZE
    if size > max_decompressed_bytes:
        raise RecordsError(f"the rewritten records exceed {max_decompressed_bytes} bytes", batch._at)
    if batch.compression is not Compression.NONE:
        return rebuild_batch(batch, memoryview(out)[V2_HEADER_SIZE:])
    _seal_header(batch, out, batch.record_count)
    return out


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


# --------------------------------------------------------------------------------------------------
# Replacing keys and values (record encryption and masking)


def split_records(batch: RecordBatch, max_decompressed_bytes: int = DEFAULT_MAX_DECOMPRESSED_BYTES
                  ) -> tuple[list[memoryview], list[memoryview | None], list[memoryview | None], list[memoryview]]:
    """A v2 batch's records as four lists: each record's head (attributes, timestamp and offset
    deltas, as received), key, value (None for null) and tail (its headers, as received). Views into
    the batch or its decompressed payload; ``join_records`` puts them back together. RecordsError
    when a record does not fit its batch. The C accelerator does it where it was built."""
    compressed = batch.compression is not Compression.NONE
    buf = batch.payload(max_decompressed_bytes)
    base = batch._at + V2_HEADER_SIZE
    count = batch.record_count
    end = len(buf)
    if count > end // MIN_RECORD_SIZE:
        raise records_error(f"record count {count} cannot fit in {end} bytes", 0, base, compressed)
    return split_payload(buf, count, base, compressed)


def split_payload(buf: memoryview, count: int, base: int = 0, compressed: bool = False
                  ) -> tuple[list[memoryview], list[memoryview | None], list[memoryview | None], list[memoryview]]:
    """``split_records`` of an uncompressed records section; errors located at ``base`` as a batch's."""
    if _native_split is not None:
        try:
            return _native_split(buf, count)
        except ValueError as e:
            reason, pos = e.args
            raise records_error(reason, pos, base, compressed) from None
    return _split_records(buf, count, base, compressed)


def _split_records(buf: memoryview, count: int, base: int, compressed: bool
                   ) -> tuple[list[memoryview], list[memoryview | None], list[memoryview | None], list[memoryview]]:
    end = len(buf)
    heads: list[memoryview] = []
    keys: list[memoryview | None] = []
    values: list[memoryview | None] = []
    tails: list[memoryview] = []
    add_head, add_key, add_value, add_tail = heads.append, keys.append, values.append, tails.append
    pos = 0
    start = 0
    # Varints of one and two bytes (a 1 KiB record's length and value size) are read inline: this
    # loop is most of what opening or sealing a batch costs in Python.
    try:
        for _ in range(count):
            start = pos
            b = buf[pos]
            if b < 0x80:
                length, p = (b >> 1) ^ -(b & 1), pos + 1
            elif buf[pos + 1] < 0x80:
                z = (b & 0x7F) | (buf[pos + 1] << 7)
                length, p = (z >> 1) ^ -(z & 1), pos + 2
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
            elif buf[q + 1] < 0x80:
                q += 2
            else:
                _, q = read_varint(buf, q)
            add_head(buf[p:q])
            b = buf[q]                             # key
            if b < 0x80:
                n, q = (b >> 1) ^ -(b & 1), q + 1
            else:
                n, q = read_varint(buf, q)
            if n < 0:
                add_key(None)
            elif n > stop - q:
                raise records_error("key overruns its record", start, base, compressed)
            else:
                add_key(buf[q:q + n])
                q += n
            b = buf[q]                             # value
            if b < 0x80:
                n, q = (b >> 1) ^ -(b & 1), q + 1
            elif buf[q + 1] < 0x80:
                z = (b & 0x7F) | (buf[q + 1] << 7)
                n, q = (z >> 1) ^ -(z & 1), q + 2
            else:
                n, q = read_varint(buf, q)
            if n < 0:
                add_value(None)
            elif n > stop - q:
                raise records_error("value overruns its record", start, base, compressed)
            else:
                add_value(buf[q:q + n])
                q += n
            if q >= stop:
                raise records_error("key or value overruns its record", start, base, compressed)
            add_tail(buf[q:stop])
            pos = stop
    except IndexError:
        raise records_error("record runs past the end of the batch", start, base, compressed) from None
    except ShortBuffer as exc:
        raise records_error(str(exc), start, base, compressed) from None
    if pos != end:
        raise records_error(f"{end - pos} bytes remain after the last of {count} records", pos, base, compressed)
    return heads, keys, values, tails


class _Varints(dict[int, bytes]):
    """Zig-zag varints by value, made once: a batch's records mostly share a few lengths."""

    def __missing__(self, n: int) -> bytes:
        got = write_varint(n)
        if len(self) < 4096:
            self[n] = got
        return got


_VARINTS = _Varints()


def join_records(batch: RecordBatch, heads: list, keys: list, values: list, tails: list,
                 max_decompressed_bytes: int = DEFAULT_MAX_DECOMPRESSED_BYTES) -> bytes:
    """``batch`` rebuilt (``rebuild_batch``: same codec and producer fields) from records' heads,
    keys, values and tails, as ``split_records`` gives them with keys or values replaced."""
    payload = join_records_payload(heads, keys, values, tails)
    if len(payload) > max_decompressed_bytes:
        raise RecordsError(f"the rewritten records exceed {max_decompressed_bytes} bytes", batch._at)
    return rebuild_batch(batch, payload)


def join_records_payload(heads: list, keys: list, values: list, tails: list) -> bytes:
    """The uncompressed records section ``join_records`` puts in its batch."""
    if _native_join is not None:
        return _native_join(heads, keys, values, tails)
    return _join_records(heads, keys, values, tails)


def _join_records(heads: list, keys: list, values: list, tails: list) -> bytes:
    parts: list = []
    append = parts.append
    varint = _VARINTS
    null = b"\x01"       # zig-zag -1
    for head, key, value, tail in zip(heads, keys, values, tails, strict=True):
        if key is None:
            kl, ks = 0, null
        else:
            kl = len(key)
            ks = varint[kl]
        if value is None:
            vl, vs = 0, null
        else:
            vl = len(value)
            vs = varint[vl]
        length = len(head) + len(ks) + kl + len(vs) + vl + len(tail)
        append(varint[length])
        append(head)
        append(ks)
        if key is not None:
            append(key)
        append(vs)
        if value is not None:
            append(value)
        append(tail)
    return b"".join(parts)


def _native() -> tuple[Any, Any]:
    """The C accelerator's split and join (kproxy/protocol/_accel.c), or (None, None) where it was
    not built or is older than they are: the Python functions above then do the work."""
    try:
        accel = importlib.import_module("kproxy.protocol._accel")
    except ImportError:
        return None, None
    return getattr(accel, "split_records", None), getattr(accel, "join_records", None)


_native_split, _native_join = _native()

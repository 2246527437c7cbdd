"""Read and build the ``records`` field of Produce requests and Fetch responses: RecordBatch v2 and the
legacy v0/v1 message sets, with their checksums and compression codecs. Parsing is lazy and zero-copy
over the received buffer; nothing here may allocate more than the bytes it was given or, once
decompressed, the caller's cap.
"""

from __future__ import annotations

import enum
import gzip
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import cramjam
import crc32c

from kproxy.protocol.errors import RecordsError
from kproxy.protocol.primitives import (
    INT32,
    ShortBuffer,
    read_uvarint,
    read_varint,
    read_varlong,
    write_varint,
)

__all__ = [
    "DEFAULT_MAX_DECOMPRESSED_BYTES",
    "BatchIterator",
    "Compression",
    "Header",
    "HeaderEdit",
    "LegacyMessage",
    "Record",
    "RecordBatch",
    "RecordsSummary",
    "TimestampType",
    "build_batch",
    "build_legacy",
    "edit_headers",
    "iter_batches",
    "rebuild_batch",
    "summarize",
]

DEFAULT_MAX_DECOMPRESSED_BYTES = 64 * 1024 * 1024

# Every format starts with baseOffset/offset (int64) and a length (int32) counting the bytes after it,
# and keeps its magic byte at offset 16, so one peek tells the formats apart (Kafka's LOG_OVERHEAD).
LOG_OVERHEAD = 12
MAGIC_OFFSET = 16

# RecordBatch v2 header: baseOffset, batchLength, partitionLeaderEpoch, magic, crc, attributes,
# lastOffsetDelta, baseTimestamp, maxTimestamp, producerId, producerEpoch, baseSequence, recordCount.
_V2_HEADER = struct.Struct(">qiibIhiqqqhii")
V2_HEADER_SIZE = _V2_HEADER.size  # 61
_V2_CRC_OFFSET = 17
_V2_ATTRIBUTES_OFFSET = 21  # the CRC32C covers attributes..end (KIP-98)
_V2_COUNT_OFFSET = 57
_V2_MIN_LENGTH = V2_HEADER_SIZE - LOG_OVERHEAD

# Legacy message: offset, messageSize, crc (CRC32 over magic..end), magic, attributes[, timestamp].
_V0_HEADER = struct.Struct(">qiIbb")
_V1_HEADER = struct.Struct(">qiIbbq")
# Smallest messageSize: crc + magic + attributes (+ timestamp) + key length + value length.
_LEGACY_MIN_LENGTH = (14, 22)

# A v2 record is at least a length varint plus six one-byte fields (attributes, timestamp delta,
# offset delta, key length, value length, header count), so a record count can be checked up front.
_MIN_RECORD_SIZE = 7

_COMPRESSION_MASK = 0x07
_TIMESTAMP_TYPE_MASK = 0x08
_TRANSACTIONAL_MASK = 0x10
_CONTROL_MASK = 0x20

_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1

_INT16 = struct.Struct(">h")
_UINT32_LE = struct.Struct("<I")
_LENGTH_PREFIX = struct.Struct(">i")


class Compression(enum.IntEnum):
    """The codec id in bits 0-2 of a batch's or message's attributes."""

    NONE = 0
    GZIP = 1
    SNAPPY = 2
    LZ4 = 3
    ZSTD = 4


class TimestampType(enum.IntEnum):
    NO_TIMESTAMP_TYPE = -1  # magic 0 messages carry no timestamp
    CREATE_TIME = 0
    LOG_APPEND_TIME = 1


class Header(NamedTuple):
    key: str
    value: memoryview | None


@dataclass(slots=True)
class Record:
    """One record with absolute offset and timestamp; key, value and header values are memoryviews."""

    offset: int
    timestamp: int
    key: memoryview | None
    value: memoryview | None
    headers: list[Header] = field(default_factory=list)
    attributes: int = 0
    offset_delta: int = 0
    timestamp_delta: int = 0


class RecordsSummary(NamedTuple):
    batch_count: int
    record_count: int
    total_bytes: int
    compressed: bool


def _compression_of(attributes: int, at: int | None) -> Compression:
    try:
        return Compression(attributes & _COMPRESSION_MASK)
    except ValueError:
        raise RecordsError(f"unknown compression codec id {attributes & _COMPRESSION_MASK}", at) from None


# --------------------------------------------------------------------------------------------------
# RecordBatch v2


class RecordBatch:
    """A view of one RecordBatch (magic 2). ``raw`` is the whole batch, shared with the input buffer."""

    __slots__ = (
        "_at",
        "attributes",
        "base_offset",
        "base_sequence",
        "base_timestamp",
        "batch_length",
        "crc",
        "last_offset_delta",
        "magic",
        "max_timestamp",
        "partition_leader_epoch",
        "producer_epoch",
        "producer_id",
        "raw",
        "record_count",
    )

    def __init__(self, raw: bytes | bytearray | memoryview, at: int = 0) -> None:
        """``raw`` must hold exactly one batch; ``at`` is its byte offset in the records field, for errors."""
        raw = _as_view(raw)
        if len(raw) < V2_HEADER_SIZE:
            raise RecordsError(f"record batch of {len(raw)} bytes is shorter than its header", at)
        (
            self.base_offset,
            self.batch_length,
            self.partition_leader_epoch,
            self.magic,
            self.crc,
            self.attributes,
            self.last_offset_delta,
            self.base_timestamp,
            self.max_timestamp,
            self.producer_id,
            self.producer_epoch,
            self.base_sequence,
            self.record_count,
        ) = _V2_HEADER.unpack_from(raw, 0)
        if self.magic != 2:
            raise RecordsError(f"record batch magic {self.magic} is not 2", at + MAGIC_OFFSET)
        if self.batch_length != len(raw) - LOG_OVERHEAD:
            raise RecordsError(f"batch length {self.batch_length} does not match {len(raw)} bytes", at + 8)
        if self.record_count < 0:
            raise RecordsError(f"negative record count {self.record_count}", at + _V2_COUNT_OFFSET)
        self.raw = raw
        self._at = at

    @property
    def compression(self) -> Compression:
        return _compression_of(self.attributes, self._at + _V2_ATTRIBUTES_OFFSET)

    @property
    def timestamp_type(self) -> TimestampType:
        if self.attributes & _TIMESTAMP_TYPE_MASK:
            return TimestampType.LOG_APPEND_TIME
        return TimestampType.CREATE_TIME

    @property
    def is_transactional(self) -> bool:
        return bool(self.attributes & _TRANSACTIONAL_MASK)

    @property
    def is_control(self) -> bool:
        return bool(self.attributes & _CONTROL_MASK)

    @property
    def last_offset(self) -> int:
        return self.base_offset + self.last_offset_delta

    def verify_crc(self) -> bool:
        return crc32c.crc32c(self.raw[_V2_ATTRIBUTES_OFFSET:]) == self.crc

    def payload(self, max_decompressed_bytes: int = DEFAULT_MAX_DECOMPRESSED_BYTES) -> memoryview:
        """The records section: a view of ``raw`` when uncompressed, else a capped decompressed copy."""
        body = self.raw[V2_HEADER_SIZE:]
        codec = self.compression
        if codec is Compression.NONE:
            return body
        if self.record_count > max_decompressed_bytes // _MIN_RECORD_SIZE:
            raise RecordsError(
                f"record count {self.record_count} cannot fit in {max_decompressed_bytes} decompressed bytes",
                self._at + _V2_COUNT_OFFSET,
            )
        return _decompress(codec, body, max_decompressed_bytes, 2, self._at + V2_HEADER_SIZE)

    def records(self, max_decompressed_bytes: int = DEFAULT_MAX_DECOMPRESSED_BYTES) -> list[Record]:
        compressed = self.compression is not Compression.NONE
        buf = self.payload(max_decompressed_bytes)
        # Offsets in errors point into the records field; inside a decompressed payload they can only
        # point at the payload's start, and the reason says where in the decompressed bytes.
        base = self._at + V2_HEADER_SIZE
        return _read_records(self, buf, base, compressed)

    def __repr__(self) -> str:
        return (
            f"RecordBatch(base_offset={self.base_offset}, record_count={self.record_count}, "
            f"attributes={self.attributes:#x}, bytes={len(self.raw)})"
        )


def _records_error(reason: str, pos: int, base: int, compressed: bool) -> RecordsError:
    if compressed:
        return RecordsError(f"{reason} at byte {pos} of the decompressed records", base)
    return RecordsError(reason, base + pos)


def _read_records(batch: RecordBatch, buf: memoryview, base: int, compressed: bool) -> list[Record]:
    end = len(buf)
    count = batch.record_count
    if count > end // _MIN_RECORD_SIZE:
        raise _records_error(f"record count {count} cannot fit in {end} bytes", 0, base, compressed)
    base_offset = batch.base_offset
    base_timestamp = batch.base_timestamp
    # With LogAppendTime the broker stamps the batch once; every record reads as maxTimestamp (KIP-32).
    append_time = batch.max_timestamp if batch.attributes & _TIMESTAMP_TYPE_MASK else None
    out: list[Record] = []
    pos = 0
    start = 0
    try:
        for _ in range(count):
            start = pos
            length, pos = read_varint(buf, pos)
            if length < _MIN_RECORD_SIZE - 1 or length > end - pos:
                raise _records_error(
                    f"record length {length} outside 6..{end - pos}", start, base, compressed
                )
            stop = pos + length
            attributes = buf[pos]
            ts_delta, pos = read_varlong(buf, pos + 1)
            off_delta, pos = read_varint(buf, pos)
            if not _INT32_MIN <= off_delta <= _INT32_MAX or not _INT64_MIN <= ts_delta <= _INT64_MAX:
                raise _records_error("offset or timestamp delta out of range", start, base, compressed)
            n, pos = read_varint(buf, pos)
            # Any negative length means null, as Kafka's DefaultRecord reads it.
            if n < 0:
                key = None
            elif n > stop - pos:
                raise _records_error(f"key length {n} overruns its record", pos, base, compressed)
            else:
                key = buf[pos : pos + n]
                pos += n
            n, pos = read_varint(buf, pos)
            if n < 0:
                value = None
            elif n > stop - pos:
                raise _records_error(f"value length {n} overruns its record", pos, base, compressed)
            else:
                value = buf[pos : pos + n]
                pos += n
            header_count, pos = read_varint(buf, pos)
            # A header is at least two bytes (key length, value length).
            if header_count < 0 or header_count > (stop - pos) // 2:
                raise _records_error(f"header count {header_count} invalid", pos, base, compressed)
            headers = []
            for _ in range(header_count):
                n, pos = read_varint(buf, pos)
                if n < 0 or n > stop - pos:
                    raise _records_error(f"header key length {n} invalid", pos, base, compressed)
                # Brokers never validate header keys as UTF-8; surrogateescape keeps any bytes and
                # encodes back to the same bytes, so a rewrite cannot alter them.
                hkey = str(buf[pos : pos + n], "utf-8", "surrogateescape")
                pos += n
                n, pos = read_varint(buf, pos)
                if n < 0:
                    hvalue = None
                elif n > stop - pos:
                    raise _records_error(
                        f"header value length {n} overruns its record", pos, base, compressed
                    )
                else:
                    hvalue = buf[pos : pos + n]
                    pos += n
                headers.append(Header(hkey, hvalue))
            if pos != stop:
                raise _records_error(
                    f"record body is {pos - stop + length} bytes, its length says {length}",
                    start,
                    base,
                    compressed,
                )
            out.append(
                Record(
                    base_offset + off_delta,
                    append_time if append_time is not None else base_timestamp + ts_delta,
                    key,
                    value,
                    headers,
                    attributes,
                    off_delta,
                    ts_delta,
                )
            )
    except IndexError:
        raise _records_error("record runs past the end of the batch", start, base, compressed) from None
    except ShortBuffer as exc:
        raise _records_error(str(exc), start, base, compressed) from None
    if pos != end:
        raise _records_error(
            f"{end - pos} bytes remain after the last of {count} records", pos, base, compressed
        )
    return out


# --------------------------------------------------------------------------------------------------
# Legacy message sets (magic 0 and 1)


class LegacyMessage:
    """One message of a v0/v1 message set. A compressed one is a wrapper; ``records()`` expands it."""

    __slots__ = (
        "_at",
        "attributes",
        "crc",
        "key",
        "magic",
        "offset",
        "raw",
        "timestamp",
        "timestamp_type",
        "value",
    )

    def __init__(self, raw: bytes | bytearray | memoryview, at: int = 0) -> None:
        """``raw`` must hold exactly one message; ``at`` is its byte offset, for errors."""
        raw = _as_view(raw)
        size = len(raw)
        if size < LOG_OVERHEAD + _LEGACY_MIN_LENGTH[0]:
            raise RecordsError(f"message of {size} bytes is shorter than its header", at)
        magic = raw[MAGIC_OFFSET]
        if magic == 0:
            self.offset, length, self.crc, _, self.attributes = _V0_HEADER.unpack_from(raw, 0)
            self.timestamp = None
            self.timestamp_type = TimestampType.NO_TIMESTAMP_TYPE
            pos = _V0_HEADER.size
        elif magic == 1:
            if size < LOG_OVERHEAD + _LEGACY_MIN_LENGTH[1]:
                raise RecordsError(f"v1 message of {size} bytes is shorter than its header", at)
            self.offset, length, self.crc, _, self.attributes, self.timestamp = _V1_HEADER.unpack_from(raw, 0)
            self.timestamp_type = (
                TimestampType.LOG_APPEND_TIME
                if self.attributes & _TIMESTAMP_TYPE_MASK
                else TimestampType.CREATE_TIME
            )
            pos = _V1_HEADER.size
        else:
            raise RecordsError(f"message magic {magic} is not 0 or 1", at + MAGIC_OFFSET)
        if length != size - LOG_OVERHEAD:
            raise RecordsError(f"message size {length} does not match {size} bytes", at + 8)
        self.magic = magic
        self.key, pos = _read_legacy_bytes(raw, pos, at, "key")
        self.value, pos = _read_legacy_bytes(raw, pos, at, "value")
        if pos != size:
            raise RecordsError(f"{size - pos} bytes follow the message value", at + pos)
        self.raw = raw
        self._at = at

    @property
    def compression(self) -> Compression:
        return _compression_of(self.attributes, self._at + MAGIC_OFFSET + 1)

    @property
    def headers(self) -> list[Header]:
        """Always empty: headers arrived with magic 2. Present so records of any magic read alike."""
        return []

    def verify_crc(self) -> bool:
        return zlib.crc32(self.raw[MAGIC_OFFSET:]) == self.crc

    def records(
        self, max_decompressed_bytes: int = DEFAULT_MAX_DECOMPRESSED_BYTES, *, verify_crc: bool = False
    ) -> list[LegacyMessage]:
        """``[self]`` when uncompressed; the inner messages, with absolute offsets, for a wrapper."""
        codec = self.compression
        if codec is Compression.NONE:
            return [self]
        at = self._at
        if codec is Compression.ZSTD:
            raise RecordsError("zstd is not allowed before magic 2 (KIP-110)", at + MAGIC_OFFSET + 1)
        if self.value is None:
            raise RecordsError("compressed message has a null value", at)
        value_at = at + len(self.raw) - len(self.value)
        inner_buf = _decompress(codec, self.value, max_decompressed_bytes, self.magic, value_at)
        inner: list[LegacyMessage] = []
        pos = 0
        end = len(inner_buf)
        while pos < end:
            if end - pos < LOG_OVERHEAD:
                raise RecordsError(f"partial message at byte {pos} of the decompressed set", value_at)
            (size,) = INT32.unpack_from(inner_buf, pos + 8)
            if size < _LEGACY_MIN_LENGTH[0] or size > end - pos - LOG_OVERHEAD:
                raise RecordsError(
                    f"inner message size {size} invalid at byte {pos} of the decompressed set", value_at
                )
            try:
                msg = LegacyMessage(inner_buf[pos : pos + LOG_OVERHEAD + size], 0)
                msg_codec = msg.compression
            except RecordsError as exc:
                raise RecordsError(f"{exc.reason} at byte {pos} of the decompressed set", value_at) from None
            if msg_codec is not Compression.NONE:
                raise RecordsError("compressed message nested inside a compressed message", value_at)
            if verify_crc and not msg.verify_crc():
                raise RecordsError(f"CRC32 mismatch at byte {pos} of the decompressed set", value_at)
            msg._at = value_at
            inner.append(msg)
            pos += LOG_OVERHEAD + size
        if self.magic == 1 and inner:
            # Magic 1 inner offsets are relative and the wrapper holds the absolute offset of the last
            # one (KIP-31). A producer's wrapper may say 0, giving a negative base: keep them relative.
            absolute_base = self.offset - inner[-1].offset
            if absolute_base >= 0:
                for msg in inner:
                    msg.offset += absolute_base
            if self.timestamp_type is TimestampType.LOG_APPEND_TIME:
                for msg in inner:
                    msg.timestamp = self.timestamp
                    msg.timestamp_type = TimestampType.LOG_APPEND_TIME
        return inner

    def __repr__(self) -> str:
        return f"LegacyMessage(offset={self.offset}, magic={self.magic}, attributes={self.attributes}, bytes={len(self.raw)})"


def _read_legacy_bytes(raw: memoryview, pos: int, at: int, what: str) -> tuple[memoryview | None, int]:
    if len(raw) - pos < 4:
        raise RecordsError(f"message {what} length runs past the message", at + pos)
    (n,) = _LENGTH_PREFIX.unpack_from(raw, pos)
    pos += 4
    if n < 0:
        return None, pos
    if n > len(raw) - pos:
        raise RecordsError(f"message {what} length {n} overruns the message", at + pos - 4)
    return raw[pos : pos + n], pos + n


# --------------------------------------------------------------------------------------------------
# Iteration over a records field


class BatchIterator:
    """Iterates the batches of a records field. After iteration, ``truncated`` tells whether a partial
    trailing batch was left (brokers cut the last batch of a Fetch at max_bytes), ``valid_bytes`` how many
    leading bytes were whole batches, and ``truncated_at`` where the partial one starts."""

    __slots__ = ("_allow_truncated", "_buf", "_verify_crc", "truncated", "truncated_at", "valid_bytes")

    def __init__(self, buf: memoryview, verify_crc: bool, allow_truncated: bool) -> None:
        self._buf = buf
        self._verify_crc = verify_crc
        self._allow_truncated = allow_truncated
        self.valid_bytes = 0
        self.truncated = False
        self.truncated_at: int | None = None

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> RecordBatch | LegacyMessage:
        buf = self._buf
        pos = self.valid_bytes
        remaining = len(buf) - pos
        if remaining == 0 or self.truncated:
            raise StopIteration
        if remaining >= LOG_OVERHEAD:
            (length,) = INT32.unpack_from(buf, pos + 8)
            # Kafka rejects anything shorter than the smallest v0 message before looking at the magic.
            if length < _LEGACY_MIN_LENGTH[0]:
                raise RecordsError(f"batch length {length} is below the minimum of 14", pos + 8)
            end = pos + LOG_OVERHEAD + length
            if end <= len(buf):
                magic = buf[pos + MAGIC_OFFSET]
                raw = buf[pos:end]
                if magic == 2:
                    if length < _V2_MIN_LENGTH:
                        raise RecordsError(f"batch length {length} is below the v2 minimum of 49", pos + 8)
                    batch: RecordBatch | LegacyMessage = RecordBatch(raw, pos)
                elif magic <= 1:
                    batch = LegacyMessage(raw, pos)
                else:
                    raise RecordsError(f"unknown magic {magic}", pos + MAGIC_OFFSET)
                if self._verify_crc and not batch.verify_crc():
                    raise RecordsError("CRC mismatch", pos + (_V2_CRC_OFFSET if magic == 2 else LOG_OVERHEAD))
                self.valid_bytes = end
                return batch
        self.truncated = True
        self.truncated_at = pos
        if not self._allow_truncated:
            raise RecordsError(f"partial batch of {remaining} bytes at the end of the records", pos)
        raise StopIteration


def _as_view(data: bytes | bytearray | memoryview) -> memoryview:
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def iter_batches(
    data: bytes | bytearray | memoryview, *, verify_crc: bool = False, allow_truncated: bool = True
) -> BatchIterator:
    """Iterate a whole records field: RecordBatch for magic 2, LegacyMessage for magic 0 and 1.

    A partial trailing batch ends iteration and sets ``truncated`` on the returned iterator; with
    ``allow_truncated=False`` (Produce requests, which are never cut) it raises RecordsError instead.
    """
    return BatchIterator(_as_view(data), verify_crc, allow_truncated)


def summarize(data: bytes | bytearray | memoryview) -> RecordsSummary:
    """Count batches and records from headers alone, for telemetry on the hot path.

    ``record_count`` counts a compressed legacy wrapper as one record (its inner count needs
    decompression); ``total_bytes`` covers whole batches only, not a truncated tail.
    """
    n = len(data)
    pos = 0
    batches = records = 0
    codecs = 0
    unpack_int = INT32.unpack_from
    unpack_short = _INT16.unpack_from
    while n - pos >= LOG_OVERHEAD:
        length = unpack_int(data, pos + 8)[0]
        if length < _LEGACY_MIN_LENGTH[0]:
            raise RecordsError(f"batch length {length} is below the minimum of 14", pos + 8)
        end = pos + LOG_OVERHEAD + length
        if end > n:
            break
        magic = data[pos + MAGIC_OFFSET]
        if magic == 2:
            if length < _V2_MIN_LENGTH:
                raise RecordsError(f"batch length {length} is below the v2 minimum of 49", pos + 8)
            codecs |= unpack_short(data, pos + _V2_ATTRIBUTES_OFFSET)[0]
            count = unpack_int(data, pos + _V2_COUNT_OFFSET)[0]
            if count < 0:
                raise RecordsError(f"negative record count {count}", pos + _V2_COUNT_OFFSET)
            records += count
        elif magic <= 1:
            codecs |= data[pos + MAGIC_OFFSET + 1]
            records += 1
        else:
            raise RecordsError(f"unknown magic {magic}", pos + MAGIC_OFFSET)
        batches += 1
        pos = end
    return RecordsSummary(batches, records, pos, bool(codecs & _COMPRESSION_MASK))


# --------------------------------------------------------------------------------------------------
# Compression codecs


def _decompress(codec: Compression, payload: memoryview, cap: int, magic: int, at: int) -> memoryview:
    try:
        if codec is Compression.GZIP:
            return _gunzip(payload, cap, at)
        if codec is Compression.SNAPPY:
            return _unsnappy(payload, cap, at)
        if codec is Compression.LZ4:
            return _unlz4(payload, cap, magic, at)
        if codec is Compression.ZSTD:
            hint = _zstd_content_size(payload)
            if hint is not None and hint > cap:
                raise RecordsError(f"zstd frame declares {hint} bytes, over the cap of {cap}", at)
            return _decompress_growing(cramjam.zstd.decompress_into, payload, hint, cap, "zstd", at)
    except (cramjam.DecompressionError, zlib.error, ShortBuffer, IndexError, struct.error) as exc:
        raise RecordsError(f"{codec.name.lower()} payload is corrupt: {exc}", at) from None
    raise RecordsError(f"unsupported codec {codec!r}", at)  # pragma: no cover - enum is closed


_GZIP_INPUT_CHUNK = 64 * 1024
_GZIP_OUTPUT_CHUNK = 64 * 1024
_GZIP_MAGIC = b"\x1f\x8b"


def _gunzip(payload: memoryview, cap: int, at: int) -> memoryview:
    # Small input and output chunks: the output never passes cap + 1 bytes, no chunk sits beside a
    # full buffer, and zlib's unconsumed_tail never copies more than one input chunk. ISIZE, the last
    # member's size mod 2**32 in its final four bytes, sizes the buffer once in the usual one-member
    # case; it is only a hint, so a wrong one costs a resize, never more than the cap.
    hint = _UINT32_LE.unpack_from(payload, len(payload) - 4)[0] if len(payload) >= 4 else 0
    out = bytearray(min(hint, cap))
    used = 0
    ipos = 0
    while True:  # one pass per gzip member; Java's GZIPInputStream reads concatenated members too
        d = zlib.decompressobj(wbits=31)
        pending: bytes | memoryview = b""
        while not d.eof:
            if pending:
                src = pending
            else:
                src = payload[ipos : ipos + _GZIP_INPUT_CHUNK]
                ipos += len(src)
            # With all input fed, zlib may still hold output that max_length held back.
            chunk = d.decompress(src, min(_GZIP_OUTPUT_CHUNK, cap + 1 - used))
            if not chunk and not src:
                raise RecordsError("gzip payload ends before its stream does", at)
            out[used : used + len(chunk)] = chunk
            used += len(chunk)
            if used > cap:
                raise RecordsError(f"gzip payload decompresses to more than {cap} bytes", at)
            pending = d.unconsumed_tail
        ipos -= len(d.unused_data)
        # Like GZIPInputStream, bytes after a member that do not start another member are ignored.
        if payload[ipos : ipos + 2] != _GZIP_MAGIC:
            del out[used:]
            return memoryview(out)


_XERIAL_MAGIC = b"\x82SNAPPY\x00"
_XERIAL_HEADER_SIZE = 16
_XERIAL_BLOCK_SIZE = 32 * 1024  # the xerial SnappyOutputStream default that Kafka's Java client uses


def _snappy_raw_length(block: memoryview, cap: int, at: int) -> int:
    # Raw snappy starts with the uncompressed length as an unsigned varint (at most 32 bits).
    length, _ = read_uvarint(block, 0)
    if length > cap:
        raise RecordsError(f"snappy block declares {length} bytes, over the cap of {cap}", at)
    return length


def _unsnappy(payload: memoryview, cap: int, at: int) -> memoryview:
    # Kafka's Java client writes xerial's framing (16-byte header, then int32-length-prefixed raw
    # blocks); librdkafka writes one raw block. The version fields are not checked: some producers
    # write them little-endian (kafka-python issue 2414), and Java's reader only looks at the magic.
    n = len(payload)
    if n >= _XERIAL_HEADER_SIZE and payload[:8] == _XERIAL_MAGIC:
        blocks = []
        total = 0
        pos = _XERIAL_HEADER_SIZE
        while pos < n:
            if n - pos < 4:
                raise RecordsError("xerial snappy block length runs past the payload", at + pos)
            (blen,) = _LENGTH_PREFIX.unpack_from(payload, pos)
            pos += 4
            if blen <= 0 or blen > n - pos:
                raise RecordsError(f"xerial snappy block length {blen} invalid", at + pos - 4)
            block = payload[pos : pos + blen]
            ulen = _snappy_raw_length(block, cap, at + pos)
            total += ulen
            if total > cap:
                raise RecordsError(f"snappy payload decompresses to more than {cap} bytes", at)
            blocks.append((block, ulen))
            pos += blen
        out = bytearray(total)
        view = memoryview(out)
        opos = 0
        for block, ulen in blocks:
            written = cramjam.snappy.decompress_raw_into(block, view[opos : opos + ulen])
            if written != ulen:
                raise RecordsError("snappy block is shorter than it declares", at)
            opos += ulen
        return view
    ulen = _snappy_raw_length(payload, cap, at)
    out = bytearray(ulen)
    if cramjam.snappy.decompress_raw_into(payload, out) != ulen:
        raise RecordsError("snappy payload is shorter than it declares", at)
    return memoryview(out)


_LZ4_MAGIC = b"\x04\x22\x4d\x18"
_LZ4_FLG_CONTENT_SIZE = 0x08
_LZ4_BLOCK_SIZE = 64 * 1024
_LZ4_UNCOMPRESSED = 0x80000000


def _unlz4(payload: memoryview, cap: int, magic: int, at: int) -> memoryview:
    if len(payload) < 7 or payload[:4] != _LZ4_MAGIC:
        raise RecordsError("lz4 payload does not start with a frame header", at)
    flg = payload[4]
    descriptor_end = 6 + (8 if flg & _LZ4_FLG_CONTENT_SIZE else 0)
    if len(payload) <= descriptor_end:
        raise RecordsError("lz4 frame header runs past the payload", at)
    hint = None
    if flg & _LZ4_FLG_CONTENT_SIZE:
        hint = struct.unpack_from("<Q", payload, 6)[0]
        if hint > cap:
            raise RecordsError(f"lz4 frame declares {hint} bytes, over the cap of {cap}", at)
    source: memoryview | bytes = payload
    if magic == 0:
        # Kafka 0.8/0.9 hashed the magic number into the header checksum (KIP-57); Java ignores that
        # byte for magic 0. The decoder checks it, so put the correct one in its place.
        hc = (_xxh32(bytes(payload[4:descriptor_end])) >> 8) & 0xFF
        source = b"".join((payload[:descriptor_end], bytes((hc,)), payload[descriptor_end + 1 :]))
    return _decompress_growing(cramjam.lz4.decompress_into, source, hint, cap, "lz4", at)


_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _zstd_content_size(payload: memoryview) -> int | None:
    """The first frame's Frame_Content_Size when its header carries one (RFC 8878, 3.1.1.1)."""
    if len(payload) < 6 or payload[:4] != _ZSTD_MAGIC:
        return None
    fhd = payload[4]
    fcs_flag = fhd >> 6
    single_segment = (fhd >> 5) & 1
    pos = 5 + (0 if single_segment else 1) + (0, 1, 2, 4)[fhd & 3]
    size = (1 if single_segment else 0, 2, 4, 8)[fcs_flag]
    if size == 0 or len(payload) < pos + size:
        return None
    value = int.from_bytes(payload[pos : pos + size], "little")
    return value + 256 if size == 2 else value


# The first guess for output whose size no header states: most Kafka batches compress 2-8x.
_MIN_GUESS = 64 * 1024
_GUESS_RATIO = 8
_GROWTH = 4
# cramjam reports output that did not fit with these words; anything else is corrupt input.
_OUTPUT_FULL = ("whole buffer", "smaller than required")


def _decompress_growing(
    decompress_into, payload, hint: int | None, cap: int, name: str, at: int
) -> memoryview:
    # cramjam's one-shot decoders stop with an error as soon as the output buffer is full, so the
    # output is bounded by the buffer we hand them. Without a declared size we start from a guess and
    # retry larger, never past the cap, at the cost of decoding again (at most log4(cap/64K) times).
    size = hint if hint is not None else max(_MIN_GUESS, _GUESS_RATIO * len(payload))
    size = min(size, cap)
    while True:
        # Success means the stream ended within the buffer, so an exact fit needs no spare byte.
        out = bytearray(size)
        try:
            written = decompress_into(payload, out)
        except cramjam.DecompressionError as exc:
            if not any(word in str(exc) for word in _OUTPUT_FULL):
                raise RecordsError(f"{name} payload is corrupt: {exc}", at) from None
            if size >= cap:
                raise RecordsError(f"{name} payload decompresses to more than {cap} bytes", at) from None
            del out
            size = min(max(size * _GROWTH, _MIN_GUESS), cap)
            continue
        return memoryview(out)[:written]


# xxHash32 (https://github.com/Cyan4973/xxHash/blob/dev/doc/xxhash_spec.md). Only the few bytes of an
# lz4 frame descriptor are ever hashed here, so pure Python costs nothing that matters.
_P1, _P2, _P3, _P4, _P5 = 2654435761, 2246822519, 3266489917, 668265263, 374761393
_M32 = 0xFFFFFFFF


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & _M32


def _xxh32(data: bytes, seed: int = 0) -> int:
    n = len(data)
    pos = 0
    if n >= 16:
        acc = [(seed + _P1 + _P2) & _M32, (seed + _P2) & _M32, seed & _M32, (seed - _P1) & _M32]
        while pos + 16 <= n:
            lanes = struct.unpack_from("<4I", data, pos)
            for i in range(4):
                acc[i] = (_rotl((acc[i] + lanes[i] * _P2) & _M32, 13) * _P1) & _M32
            pos += 16
        h = (_rotl(acc[0], 1) + _rotl(acc[1], 7) + _rotl(acc[2], 12) + _rotl(acc[3], 18)) & _M32
    else:
        h = (seed + _P5) & _M32
    h = (h + n) & _M32
    while pos + 4 <= n:
        h = (_rotl((h + _UINT32_LE.unpack_from(data, pos)[0] * _P3) & _M32, 17) * _P4) & _M32
        pos += 4
    while pos < n:
        h = (_rotl((h + data[pos] * _P5) & _M32, 11) * _P1) & _M32
        pos += 1
    h ^= h >> 15
    h = (h * _P2) & _M32
    h ^= h >> 13
    h = (h * _P3) & _M32
    return h ^ (h >> 16)


def _compress(codec: Compression, data: bytes, magic: int) -> bytes:
    if codec is Compression.GZIP:
        return gzip.compress(data, mtime=0)
    if codec is Compression.SNAPPY:
        if not data:
            # A bare xerial header is 16 bytes, and kafka-python only detects xerial framing in longer
            # payloads; a raw empty block reads as empty everywhere, xerial's own reader included.
            return bytes(cramjam.snappy.compress_raw(b""))
        parts = [_XERIAL_MAGIC, struct.pack(">ii", 1, 1)]
        for i in range(0, len(data), _XERIAL_BLOCK_SIZE):
            block = bytes(cramjam.snappy.compress_raw(data[i : i + _XERIAL_BLOCK_SIZE]))
            parts += (_LENGTH_PREFIX.pack(len(block)), block)
        return b"".join(parts)
    if codec is Compression.LZ4:
        return _lz4_frame(data, broken_checksum=magic == 0)
    if codec is Compression.ZSTD:
        if magic < 2:
            raise ValueError("zstd needs magic 2 (KIP-110)")
        return bytes(cramjam.zstd.compress(data, level=3))
    raise ValueError(f"cannot compress with {codec!r}")


def _lz4_frame(data: bytes, broken_checksum: bool) -> bytes:
    # The frame Kafka's Java client writes: version 1, independent blocks (its reader decodes each block
    # alone), 64 KiB maximum block size, no checksums beyond the header's.
    descriptor = b"\x60\x40"
    hashed = _LZ4_MAGIC + descriptor if broken_checksum else descriptor
    parts = [_LZ4_MAGIC, descriptor, bytes(((_xxh32(hashed) >> 8) & 0xFF,))]
    for i in range(0, len(data), _LZ4_BLOCK_SIZE):
        chunk = data[i : i + _LZ4_BLOCK_SIZE]
        block = bytes(cramjam.lz4.compress_block(chunk, store_size=False))
        if len(block) < len(chunk):
            parts += (_UINT32_LE.pack(len(block)), block)
        else:
            parts += (_UINT32_LE.pack(len(chunk) | _LZ4_UNCOMPRESSED), chunk)
    parts.append(b"\x00\x00\x00\x00")
    return b"".join(parts)


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


def _write_bytes(out: bytearray, value: Any) -> None:
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
        _write_bytes(rec, key)
        _write_bytes(rec, value)
        headers = list(headers)
        rec += write_varint(len(headers))
        for hkey, hvalue in headers:
            if isinstance(hkey, str):
                hkey = hkey.encode("utf-8", "surrogateescape")
            _write_bytes(rec, hkey)
            _write_bytes(rec, hvalue)
        body += write_varint(len(rec))
        body += rec
    if compression is not Compression.NONE:
        body = bytearray(_compress(compression, bytes(body), 2))
    attributes = int(compression)
    if timestamp_type == TimestampType.LOG_APPEND_TIME:
        attributes |= _TIMESTAMP_TYPE_MASK
    if is_transactional:
        attributes |= _TRANSACTIONAL_MASK
    if is_control:
        attributes |= _CONTROL_MASK
    if max_timestamp is None:
        max_timestamp = base_timestamp if max_ts is None else max_ts
    header = _V2_HEADER.pack(
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
    struct.pack_into(">I", out, _V2_CRC_OFFSET, crc32c.crc32c(memoryview(out)[_V2_ATTRIBUTES_OFFSET:]))
    return bytes(out)


def _legacy_message(offset: int, magic: int, attributes: int, timestamp: int, key: Any, value: Any) -> bytes:
    body = bytearray(struct.pack(">bb", magic, attributes))
    if magic == 1:
        body += struct.pack(">q", timestamp)
    for part in (key, value):
        if part is None:
            body += _LENGTH_PREFIX.pack(-1)
        else:
            body += _LENGTH_PREFIX.pack(len(part))
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
    ts_bit = _TIMESTAMP_TYPE_MASK if magic == 1 and timestamp_type == TimestampType.LOG_APPEND_TIME else 0
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
    payload = _compress(compression, b"".join(parts), magic)
    wrapper_ts = max_ts if wrapper_timestamp is None else wrapper_timestamp
    return _legacy_message(
        base_offset + len(items) - 1, magic, compression | ts_bit, wrapper_ts, None, payload
    )


# --------------------------------------------------------------------------------------------------
# Rewriting a batch (record rules): same codec, same header fields, new records section and CRC


def rebuild_batch(batch: RecordBatch, payload: bytes | bytearray | memoryview, record_count: int | None = None) -> bytes:
    """``batch`` with its records section replaced by ``payload`` (uncompressed records), compressed
    with the batch's own codec. Base offset, leader epoch, attributes, offset delta, timestamps and
    the producer's id, epoch and sequence are kept; the length and the CRC32C are computed again."""
    codec = batch.compression
    body = bytes(payload) if codec is Compression.NONE else _compress(codec, bytes(payload), 2)
    out = bytearray(V2_HEADER_SIZE + len(body))
    _V2_HEADER.pack_into(
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
    struct.pack_into(">I", out, _V2_CRC_OFFSET, crc32c.crc32c(memoryview(out)[_V2_ATTRIBUTES_OFFSET:]))
    return bytes(out)


_PRODUCER = struct.Struct(">qhi")     # producer id, producer epoch, base sequence
_V2_PRODUCER_OFFSET = 43


def with_producer(batch: RecordBatch, producer_id: int, producer_epoch: int, base_sequence: int) -> bytes:
    """``batch`` as another producer's, or at another sequence: the producer id, epoch and base
    sequence replaced and the CRC32C computed again (they are inside what it covers); the records
    are copied as they are, compressed or not."""
    out = bytearray(batch.raw)
    _PRODUCER.pack_into(out, _V2_PRODUCER_OFFSET, producer_id, producer_epoch, base_sequence)
    struct.pack_into(">I", out, _V2_CRC_OFFSET, crc32c.crc32c(memoryview(out)[_V2_ATTRIBUTES_OFFSET:]))
    return bytes(out)


def _header_bytes(key: bytes, value: bytes | None) -> bytes:
    out = bytearray(write_varint(len(key)))
    out += key
    _write_bytes(out, value)
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
    if count > end // _MIN_RECORD_SIZE:
        raise _records_error(f"record count {count} cannot fit in {end} bytes", 0, base, compressed)
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
            if length < _MIN_RECORD_SIZE - 1 or length > end - p:
                raise _records_error(f"record length {length} outside 6..{end - p}", start, base, compressed)
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
                raise _records_error("key or value overruns its record", start, base, compressed)
            head_end = q
            b = buf[q]
            if b == 0:
                header_count, q = 0, q + 1
            else:
                header_count, q = read_varint(buf, q)
            if header_count < 0 or header_count > (stop - q) // 2:
                raise _records_error(f"header count {header_count} invalid", q, base, compressed)
            if header_count == 0:
                if q != stop:
                    raise _records_error(f"record body is {q - stop + length} bytes, its length says {length}",
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
                    raise _records_error(f"header key length {n} invalid", q, base, compressed)
                hkey = bytes(buf[q : q + n])
                q += n
                n, q = read_varint(buf, q)
                if n > 0:
                    q += n
                if q > stop:
                    raise _records_error("header value overruns its record", h, base, compressed)
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
                raise _records_error(f"record body is {q - stop + length} bytes, its length says {length}",
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
        raise _records_error("record runs past the end of the batch", start, base, compressed) from None
    except ShortBuffer as exc:
        raise _records_error(str(exc), start, base, compressed) from None
    if pos != end:
        raise _records_error(f"{end - pos} bytes remain after the last of {count} records", pos, base, compressed)
    if not changed:
        return None
    return rebuild_batch(batch, out)

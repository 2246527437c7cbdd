"""Reading a ``records`` field, lazily and without copying: RecordBatch v2 and the legacy v0/v1
message sets, their records and headers, iteration over a field (a truncated tail allowed where
brokers cut it) and a count from the headers alone. The formats' constants live here; the codecs
are in ``compression``. Nothing here allocates more than the bytes it was given or, once
decompressed, the caller's cap.
"""

from __future__ import annotations

import enum
import struct
import zlib
from dataclasses import dataclass, field
from typing import NamedTuple

import crc32c

from kproxy.protocol.errors import RecordsError
from kproxy.protocol.primitives import INT32, ShortBuffer, read_varint, read_varlong
from kproxy.protocol.records.compression import Compression, decompress

DEFAULT_MAX_DECOMPRESSED_BYTES = 64 * 1024 * 1024

# Every format starts with baseOffset/offset (int64) and a length (int32) counting the bytes after it,
# and keeps its magic byte at offset 16, so one peek tells the formats apart (Kafka's LOG_OVERHEAD).
LOG_OVERHEAD = 12
MAGIC_OFFSET = 16

# RecordBatch v2 header: baseOffset, batchLength, partitionLeaderEpoch, magic, crc, attributes,
# lastOffsetDelta, baseTimestamp, maxTimestamp, producerId, producerEpoch, baseSequence, recordCount.
V2_HEADER = struct.Struct(">qiibIhiqqqhii")
V2_HEADER_SIZE = V2_HEADER.size  # 61
V2_CRC_OFFSET = 17
V2_ATTRIBUTES_OFFSET = 21  # the CRC32C covers attributes..end (KIP-98)
_V2_COUNT_OFFSET = 57
_V2_MIN_LENGTH = V2_HEADER_SIZE - LOG_OVERHEAD

# Legacy message: offset, messageSize, crc (CRC32 over magic..end), magic, attributes[, timestamp].
_V0_HEADER = struct.Struct(">qiIbb")
_V1_HEADER = struct.Struct(">qiIbbq")
# Smallest messageSize: crc + magic + attributes (+ timestamp) + key length + value length.
_LEGACY_MIN_LENGTH = (14, 22)

# A v2 record is at least a length varint plus six one-byte fields (attributes, timestamp delta,
# offset delta, key length, value length, header count), so a record count can be checked up front.
MIN_RECORD_SIZE = 7

_COMPRESSION_MASK = 0x07
TIMESTAMP_TYPE_MASK = 0x08
TRANSACTIONAL_MASK = 0x10
CONTROL_MASK = 0x20

_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1

_INT16 = struct.Struct(">h")


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
        ) = V2_HEADER.unpack_from(raw, 0)
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
        return _compression_of(self.attributes, self._at + V2_ATTRIBUTES_OFFSET)

    @property
    def timestamp_type(self) -> TimestampType:
        if self.attributes & TIMESTAMP_TYPE_MASK:
            return TimestampType.LOG_APPEND_TIME
        return TimestampType.CREATE_TIME

    @property
    def is_transactional(self) -> bool:
        return bool(self.attributes & TRANSACTIONAL_MASK)

    @property
    def is_control(self) -> bool:
        return bool(self.attributes & CONTROL_MASK)

    @property
    def last_offset(self) -> int:
        return self.base_offset + self.last_offset_delta

    def verify_crc(self) -> bool:
        return crc32c.crc32c(self.raw[V2_ATTRIBUTES_OFFSET:]) == self.crc

    def payload(self, max_decompressed_bytes: int = DEFAULT_MAX_DECOMPRESSED_BYTES) -> memoryview:
        """The records section: a view of ``raw`` when uncompressed, else a capped decompressed copy."""
        body = self.raw[V2_HEADER_SIZE:]
        codec = self.compression
        if codec is Compression.NONE:
            return body
        if self.record_count > max_decompressed_bytes // MIN_RECORD_SIZE:
            raise RecordsError(
                f"record count {self.record_count} cannot fit in {max_decompressed_bytes} decompressed bytes",
                self._at + _V2_COUNT_OFFSET,
            )
        return decompress(codec, body, max_decompressed_bytes, 2, self._at + V2_HEADER_SIZE)

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


def records_error(reason: str, pos: int, base: int, compressed: bool) -> RecordsError:
    if compressed:
        return RecordsError(f"{reason} at byte {pos} of the decompressed records", base)
    return RecordsError(reason, base + pos)


def _read_records(batch: RecordBatch, buf: memoryview, base: int, compressed: bool) -> list[Record]:
    end = len(buf)
    count = batch.record_count
    if count > end // MIN_RECORD_SIZE:
        raise records_error(f"record count {count} cannot fit in {end} bytes", 0, base, compressed)
    base_offset = batch.base_offset
    base_timestamp = batch.base_timestamp
    # With LogAppendTime the broker stamps the batch once; every record reads as maxTimestamp (KIP-32).
    append_time = batch.max_timestamp if batch.attributes & TIMESTAMP_TYPE_MASK else None
    out: list[Record] = []
    pos = 0
    start = 0
    try:
        for _ in range(count):
            start = pos
            length, pos = read_varint(buf, pos)
            if length < MIN_RECORD_SIZE - 1 or length > end - pos:
                raise records_error(
                    f"record length {length} outside 6..{end - pos}", start, base, compressed
                )
            stop = pos + length
            attributes = buf[pos]
            ts_delta, pos = read_varlong(buf, pos + 1)
            off_delta, pos = read_varint(buf, pos)
            if not _INT32_MIN <= off_delta <= _INT32_MAX or not _INT64_MIN <= ts_delta <= _INT64_MAX:
                raise records_error("offset or timestamp delta out of range", start, base, compressed)
            n, pos = read_varint(buf, pos)
            # Any negative length means null, as Kafka's DefaultRecord reads it.
            if n < 0:
                key = None
            elif n > stop - pos:
                raise records_error(f"key length {n} overruns its record", pos, base, compressed)
            else:
                key = buf[pos : pos + n]
                pos += n
            n, pos = read_varint(buf, pos)
            if n < 0:
                value = None
            elif n > stop - pos:
                raise records_error(f"value length {n} overruns its record", pos, base, compressed)
            else:
                value = buf[pos : pos + n]
                pos += n
            header_count, pos = read_varint(buf, pos)
            # A header is at least two bytes (key length, value length).
            if header_count < 0 or header_count > (stop - pos) // 2:
                raise records_error(f"header count {header_count} invalid", pos, base, compressed)
            headers = []
            for _ in range(header_count):
                n, pos = read_varint(buf, pos)
                if n < 0 or n > stop - pos:
                    raise records_error(f"header key length {n} invalid", pos, base, compressed)
                # Brokers never validate header keys as UTF-8; surrogateescape keeps any bytes and
                # encodes back to the same bytes, so a rewrite cannot alter them.
                hkey = str(buf[pos : pos + n], "utf-8", "surrogateescape")
                pos += n
                n, pos = read_varint(buf, pos)
                if n < 0:
                    hvalue = None
                elif n > stop - pos:
                    raise records_error(
                        f"header value length {n} overruns its record", pos, base, compressed
                    )
                else:
                    hvalue = buf[pos : pos + n]
                    pos += n
                headers.append(Header(hkey, hvalue))
            if pos != stop:
                raise records_error(
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
        raise records_error("record runs past the end of the batch", start, base, compressed) from None
    except ShortBuffer as exc:
        raise records_error(str(exc), start, base, compressed) from None
    if pos != end:
        raise records_error(
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
                if self.attributes & TIMESTAMP_TYPE_MASK
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
        inner_buf = decompress(codec, self.value, max_decompressed_bytes, self.magic, value_at)
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
    (n,) = INT32.unpack_from(raw, pos)
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
                    raise RecordsError("CRC mismatch", pos + (V2_CRC_OFFSET if magic == 2 else LOG_OVERHEAD))
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
            codecs |= unpack_short(data, pos + V2_ATTRIBUTES_OFFSET)[0]
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

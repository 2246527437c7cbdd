"""The compression codecs of record batches and legacy message sets: gzip, snappy (xerial-framed
or raw), lz4 (Kafka's frame, with the broken header checksum of magic 0) and zstd. Decompression
never produces more than the caller's cap, whatever a payload declares or holds; compression
writes what Kafka's Java client writes.
"""

from __future__ import annotations

import enum
import gzip
import struct
import zlib

import cramjam

from kproxy.protocol.errors import RecordsError
from kproxy.protocol.primitives import INT32, ShortBuffer, read_uvarint

_UINT32_LE = struct.Struct("<I")


class Compression(enum.IntEnum):
    """The codec id in bits 0-2 of a batch's or message's attributes."""

    NONE = 0
    GZIP = 1
    SNAPPY = 2
    LZ4 = 3
    ZSTD = 4


# --------------------------------------------------------------------------------------------------
# Compression codecs


def decompress(codec: Compression, payload: memoryview, cap: int, magic: int, at: int) -> memoryview:
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
    out = bytearray(min(hint, cap + 1))
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
            del chunk      # not alive beside the next one (zlib builds each from blocks: twice its size)
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
            (blen,) = INT32.unpack_from(payload, pos)
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


def compress(codec: Compression, data: bytes, magic: int) -> bytes:
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
            parts += (INT32.pack(len(block)), block)
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

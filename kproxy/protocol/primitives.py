"""Readers and writers for Kafka's primitive wire types.

Fixed-width integers are handled by ``struct.Struct`` objects that generated codecs call directly;
this module holds the variable-length pieces (unsigned varints, zig-zag varints, UUIDs) and the
small tables that keep the hot path allocation-free. Everything here is pure: bytes in, values out.
"""

from __future__ import annotations

import struct
import uuid

INT8 = struct.Struct(">b")
INT16 = struct.Struct(">h")
INT32 = struct.Struct(">i")
INT64 = struct.Struct(">q")
UINT16 = struct.Struct(">H")
UINT32 = struct.Struct(">I")
FLOAT64 = struct.Struct(">d")
UUID_PAIR = struct.Struct(">QQ")

# Single-byte encodings of 0..127, so the common case of a small varint costs one lookup.
UVARINT_1 = tuple(bytes((i,)) for i in range(128))

ZERO_UUID = uuid.UUID(int=0)


class ShortBuffer(Exception):
    """Raised inside generated decoders; the caller turns it into a DecodeError with a path."""


def read_uvarint(buf, pos: int) -> tuple[int, int]:
    """Read an unsigned varint (at most 5 bytes, as Kafka's 32-bit unsigned varint)."""
    b = buf[pos]
    if b < 0x80:
        return b, pos + 1
    value = b & 0x7F
    shift = 7
    pos += 1
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
        if shift > 28:
            raise ShortBuffer("unsigned varint longer than 5 bytes")


def write_uvarint(value: int) -> bytes:
    if value < 0x80:
        if value < 0:
            raise ValueError(f"unsigned varint cannot hold {value}")
        return UVARINT_1[value]
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def read_varint(buf, pos: int, max_bytes: int = 5) -> tuple[int, int]:
    """Read a zig-zag signed varint (5 bytes for int32 fields, 10 for int64 ones)."""
    value = 0
    shift = 0
    for _ in range(max_bytes):
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return (value >> 1) ^ -(value & 1), pos
        shift += 7
    raise ShortBuffer(f"varint longer than {max_bytes} bytes")


def read_varlong(buf, pos: int) -> tuple[int, int]:
    return read_varint(buf, pos, 10)


def write_varint(value: int) -> bytes:
    """Zig-zag encode a signed 64-bit value as a varint."""
    z = (value << 1) ^ (value >> 63)
    if 0 <= z < 0x80:
        return UVARINT_1[z]
    out = bytearray()
    while z >= 0x80:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


def varint_size(value: int) -> int:
    z = (value << 1) ^ (value >> 63)
    n = 1
    while z >= 0x80:
        z >>= 7
        n += 1
    return n


_uuid_new = uuid.UUID.__new__
_set = object.__setattr__
_SAFE = uuid.SafeUUID.unknown


def make_uuid(hi: int, lo: int) -> uuid.UUID:
    """Build a UUID from its two 64-bit halves without the argument parsing of ``uuid.UUID()``."""
    u = _uuid_new(uuid.UUID)
    _set(u, "int", (hi << 64) | lo)
    _set(u, "is_safe", _SAFE)
    return u


def uuid_halves(u: uuid.UUID) -> tuple[int, int]:
    i = u.int
    return i >> 64, i & 0xFFFFFFFFFFFFFFFF

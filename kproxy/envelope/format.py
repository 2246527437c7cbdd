"""The byte layout of a sealed record value or key (envelope version 1), what its associated data
binds, and the errors of a record that cannot be opened. Pure: bytes in, values out; no keys here.

    0        4     5      6       7                                              end-28     end-16   end
    +--------+-----+------+-------+----+----------+----+-------------+----------+----------+--------+
    | FF 6B  | ver | kms  | flags | n  | KEK name | w  | wrapped DEK | nonce    | cipher-  | tag    |
    | 70 65  | 01  |      |       |    | n bytes  |    | w bytes     | 12 bytes | text     | 16 B   |
    +--------+-----+------+-------+----+----------+----+-------------+----------+----------+--------+
    magic "\\xffkpe"         n, w: 1 or 2 byte unsigned varints

Everything before the nonce is the envelope's *header*; it is the same for every record a DEK seals
with the same flags, so a batch's records share it and a parser checks it once per batch. The
associated data of AES-GCM is ``header || part || len(topic) || topic`` and, when the header's
KEY_BOUND flag is set, ``|| 00`` (a null key) or ``|| 01 || key`` (the record's plaintext key): moving
a record to another topic, swapping a value with a key, or a value under another key fails the tag.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from typing import Any, Final, NamedTuple

from kproxy.protocol.errors import KProxyError

MAGIC: Final = b"\xffkpe"      # 0xFF is never the first byte of UTF-8 text, JSON or Confluent's framing
VERSION: Final = 1
NONCE_SIZE: Final = 12         # 96-bit random nonces (NIST SP 800-38D, 8.2.2)
TAG_SIZE: Final = 16
KEY_SIZE: Final = 32           # AES-256
MAX_NAME_BYTES: Final = 1024   # a KEK name longer than this is refused on both sides
MAX_WRAPPED_BYTES: Final = 4096

FLAG_KEY_BOUND: Final = 0x01   # the value's associated data ends with the record's key
_KNOWN_FLAGS: Final = FLAG_KEY_BOUND
_MIN_HEADER: Final = len(MAGIC) + 3 + 1 + 1


class Kms(enum.IntEnum):
    """Which kind of KMS wrapped a record's DEK: the byte after the version."""

    VAULT_TRANSIT = 1
    AWS_KMS = 2
    LOCAL_FILE = 3
    PKCS11 = 4


class Part(enum.IntEnum):
    """Which part of a record an envelope seals; bound in the associated data."""

    VALUE = 0x76   # "v"
    KEY = 0x6B     # "k"


class KeyRef(NamedTuple):
    """What a sealed record carries to find its DEK again: the KMS kind, the KEK's name, and the DEK
    as that KMS wrapped it (its own compact form, which names the KEK's version)."""

    kms: int
    kek: str
    wrapped: bytes

    def __repr__(self) -> str:
        return f"KeyRef({_kms_name(self.kms)}, kek={self.kek!r}, wrapped={len(self.wrapped)} bytes)"


# ------------------------------------------------------------------------------------------------
# Errors
#
#   KProxyError
#   └── EnvelopeError              a sealed record that cannot be opened
#       ├── TamperedRecord         it fails authentication or its envelope is malformed
#       │   └── UnknownEnvelope    the magic matches but the version (or a flag) is not one kproxy knows
#       └── MissingDataKey         the caller did not supply the DEK a record names (look refs up first)


class EnvelopeError(KProxyError):
    """A sealed record value or key that cannot be opened."""


class TamperedRecord(EnvelopeError):
    """Record ``index`` of the batch fails authentication or has a malformed envelope. It must never be
    delivered, not even as an empty value (on a compacted topic that deletes its key)."""

    def __init__(self, index: int, reason: str) -> None:
        self.index = index
        self.reason = reason
        super().__init__(f"record {index}: {reason}")


class UnknownEnvelope(TamperedRecord):
    """An envelope whose version or flags this kproxy does not know (tampered, or from a newer kproxy)."""


class MissingDataKey(EnvelopeError):
    """``open_values`` needs a DEK the caller did not supply: call ``key_refs`` and fetch them first."""

    def __init__(self, ref: KeyRef) -> None:
        self.ref = ref
        super().__init__(f"no data key supplied for {ref!r}")


# ------------------------------------------------------------------------------------------------
# Header


def _kms_name(kms: int) -> str:
    try:
        return Kms(kms).name.lower()
    except ValueError:
        return f"kms#{kms}"


def _length(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))
    if n < 0x4000:
        return bytes(((n & 0x7F) | 0x80, n >> 7))
    raise ValueError(f"{n} bytes is too long for an envelope field")


def _read_length(buf: Any, pos: int, index: int) -> tuple[int, int]:
    b = buf[pos]
    if b < 0x80:
        return b, pos + 1
    b2 = buf[pos + 1]
    if b2 >= 0x80 or b2 == 0:
        raise TamperedRecord(index, "malformed length in the envelope header")
    return (b & 0x7F) | (b2 << 7), pos + 2


def header(ref: KeyRef, flags: int = 0) -> bytes:
    """The header every record sealed by ``ref``'s DEK with ``flags`` starts with."""
    name = ref.kek.encode()
    if not 0 < len(name) <= MAX_NAME_BYTES:
        raise ValueError(f"a KEK name is 1 to {MAX_NAME_BYTES} bytes of UTF-8, got {len(name)}")
    if not 0 < len(ref.wrapped) <= MAX_WRAPPED_BYTES:
        raise ValueError(f"a wrapped DEK is 1 to {MAX_WRAPPED_BYTES} bytes, got {len(ref.wrapped)}")
    return b"".join((MAGIC, bytes((VERSION, ref.kms, flags)), _length(len(name)), name,
                     _length(len(ref.wrapped)), ref.wrapped))


def is_sealed(value: Any) -> bool:
    """Whether a record value or key is an envelope (starts with the magic). Null is not."""
    return value is not None and value[:4] == MAGIC


def parse_header(value: Any, index: int = 0) -> tuple[KeyRef, int, int]:
    """``(ref, flags, header_size)`` of a sealed value; TamperedRecord if it is malformed. Lengths are
    checked against the bytes that are there before anything is copied."""
    size = len(value)
    try:
        if size < _MIN_HEADER or value[:4] != MAGIC:
            raise TamperedRecord(index, "not an envelope")
        version, kms, flags = value[4], value[5], value[6]
        if version != VERSION:
            raise UnknownEnvelope(index, f"envelope version {version} (this kproxy reads version {VERSION})")
        if flags & ~_KNOWN_FLAGS:
            raise UnknownEnvelope(index, f"unknown envelope flags {flags:#04x}")
        n, pos = _read_length(value, 7, index)
        if n == 0 or n > MAX_NAME_BYTES or pos + n > size:
            raise TamperedRecord(index, "the KEK name overruns the envelope")
        name = bytes(value[pos:pos + n]).decode()
        pos += n
        w, pos = _read_length(value, pos, index)
        if w == 0 or w > MAX_WRAPPED_BYTES or pos + w > size:
            raise TamperedRecord(index, "the wrapped DEK overruns the envelope")
        wrapped = bytes(value[pos:pos + w])
        pos += w
    except IndexError:
        raise TamperedRecord(index, "truncated envelope header") from None
    except UnicodeDecodeError:
        raise TamperedRecord(index, "the KEK name is not UTF-8") from None
    if pos + NONCE_SIZE + TAG_SIZE > size:
        raise TamperedRecord(index, "too short for a nonce and a tag")
    return KeyRef(kms, name, wrapped), flags, pos


def key_refs(values: Iterable[Any]) -> list[KeyRef]:
    """The distinct DEK references of a batch's sealed values (plain and null values have none), in
    order of first appearance. A batch sealed by one DEK parses one header."""
    refs: list[KeyRef] = []
    last = b""
    for i, v in enumerate(values):
        if v is None or v[:4] != MAGIC:
            continue
        if last and v[:len(last)] == last:
            continue
        ref, _flags, size = parse_header(v, i)
        last = bytes(v[:size])
        if ref not in refs:
            refs.append(ref)
    return refs


def bound_topic(topic: str, replica_prefixes: Sequence[str] = ()) -> str:
    """The topic name the associated data binds: ``topic`` less the first of ``replica_prefixes`` it
    starts with (MirrorMaker 2 names a copy of ``orders`` ``primary.orders``), so a replica that is
    configured as one still opens, while a record moved to any other topic does not."""
    for prefix in replica_prefixes:
        if prefix and topic.startswith(prefix) and len(topic) > len(prefix):
            return topic[len(prefix):]
    return topic


class Binding:
    """The associated data a batch's records share after the header: the part and the topic."""

    __slots__ = ("part", "suffix", "topic")

    def __init__(self, topic: str, part: Part = Part.VALUE) -> None:
        self.topic = topic
        self.part = part
        name = topic.encode()
        self.suffix = bytes((part,)) + _length(len(name)) + name

    def __repr__(self) -> str:
        return f"Binding({self.topic!r}, {self.part.name.lower()})"


def describe(value: Any) -> dict[str, Any]:
    """An envelope's fields for people (``kproxy decode``), without opening it; raises TamperedRecord
    if it is malformed."""
    ref, flags, size = parse_header(value)
    return {
        "version": value[4],
        "kms": _kms_name(ref.kms),
        "kek": ref.kek,
        "key_bound": bool(flags & FLAG_KEY_BOUND),
        "wrapped_dek_bytes": len(ref.wrapped),
        "nonce": bytes(value[size:size + NONCE_SIZE]).hex(),
        "ciphertext_bytes": len(value) - size - NONCE_SIZE - TAG_SIZE,
        "overhead_bytes": size + NONCE_SIZE + TAG_SIZE,
    }

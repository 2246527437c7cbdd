"""Sealing and opening a batch's record values (or keys) with AES-256-GCM from ``cryptography``.

The functions take a whole batch's values at once, so that the per-record Python work is a nonce
slice, one cipher call and one join: at 1 KiB records that, not the cipher, sets the speed
(``bench/envelope.py``). Nonces are random (one ``os.urandom`` call per batch); a DEK's record limit
(``KeyPolicy.max_records``) keeps their number far below NIST's 2**32 for random nonces.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kproxy.envelope.format import (
    FLAG_KEY_BOUND,
    KEY_SIZE,
    MAGIC,
    NONCE_SIZE,
    TAG_SIZE,
    Binding,
    KeyRef,
    MissingDataKey,
    TamperedRecord,
    header,
    parse_header,
)


class DataKey:
    """One DEK: the reference sealed records carry, its AES-GCM cipher (the key bytes live only in
    there), when kproxy got it, and how many records ``KeyRing.reserve`` has given out on it."""

    __slots__ = ("_aead", "_headers", "created_at", "ref", "used")

    def __init__(self, ref: KeyRef, key: bytes, created_at: float = 0.0) -> None:
        if len(key) != KEY_SIZE:
            raise ValueError(f"a data key is {KEY_SIZE} bytes (AES-256), got {len(key)}")
        self._aead = AESGCM(key)
        self._headers = (header(ref, 0), header(ref, FLAG_KEY_BOUND))
        self.ref = ref
        self.created_at = created_at
        self.used = 0

    def __repr__(self) -> str:
        # Never the key: the reference names the KEK and the wrapped form only.
        return f"DataKey({self.ref!r}, used={self.used})"


def seal(dek: DataKey, values: Sequence[Any], binding: Binding, keys: Sequence[Any] | None = None,
         nonces: bytes | None = None) -> list[Any]:
    """Each value sealed in an envelope; a null value stays null (a tombstone must stay one). With
    ``keys`` (the records' plaintext keys, one per value), each value is bound to its key. The caller
    has reserved ``len(values)`` records on ``dek`` (``KeyRing.reserve``). ``nonces`` (12 bytes per
    non-null value, in order) are random ones unless given."""
    if nonces is None:
        nonces = os.urandom(NONCE_SIZE * len(values))
    encrypt = dek._aead.encrypt
    join = b"".join
    out: list[Any] = []
    append = out.append
    pos = 0
    if keys is None:
        head = dek._headers[0]
        aad = head + binding.suffix
        for v in values:
            if v is None:
                append(None)
                continue
            nonce = nonces[pos:pos + NONCE_SIZE]
            pos += NONCE_SIZE
            append(join((head, nonce, encrypt(nonce, v, aad))))
        return out
    head = dek._headers[1]
    base = head + binding.suffix
    for v, k in zip(values, keys, strict=True):
        if v is None:
            append(None)
            continue
        nonce = nonces[pos:pos + NONCE_SIZE]
        pos += NONCE_SIZE
        aad = base + b"\x00" if k is None else base + b"\x01" + k
        append(join((head, nonce, encrypt(nonce, v, aad))))
    return out


def open_values(values: Sequence[Any], binding: Binding, deks: Mapping[KeyRef, DataKey],
                keys: Sequence[Any] | None = None) -> tuple[list[Any], int]:
    """``(opened, plain)``: each sealed value opened, each plain or null value as it was, and how many
    were plain (written before encryption, or past kproxy). ``keys`` are the records' plaintext
    keys, needed when values were sealed bound to them. Raises TamperedRecord (with the record's
    index) for the first record that fails, and MissingDataKey when ``deks`` lacks a record's DEK:
    a batch is opened whole or not at all."""
    out: list[Any] = []
    append = out.append
    plain = 0
    last = b""
    size = 0
    aad = b""
    bound = False
    decrypt: Any = None
    for i, v in enumerate(values):
        if v is None:
            append(None)
            continue
        if v[:4] != MAGIC:
            append(v)
            plain += 1
            continue
        if not (last and v[:size] == last):
            ref, flags, size = parse_header(v, i)
            dek = deks.get(ref)
            if dek is None:
                raise MissingDataKey(ref)
            last = bytes(v[:size])
            aad = last + binding.suffix
            bound = bool(flags & FLAG_KEY_BOUND)
            if bound and keys is None:
                raise ValueError("these values are bound to their record keys: pass keys")
            decrypt = dek._aead.decrypt
        body = size + NONCE_SIZE
        if len(v) < body + TAG_SIZE:
            raise TamperedRecord(i, "too short for a nonce and a tag")
        try:
            if bound:
                assert keys is not None
                k = keys[i]
                append(decrypt(v[size:body], v[body:], aad + b"\x00" if k is None else aad + b"\x01" + k))
            else:
                append(decrypt(v[size:body], v[body:], aad))
        except InvalidTag:
            raise TamperedRecord(i, "authentication failed (the record, its envelope, topic or key was "
                                    "changed)") from None
    return out, plain

"""Sealing and opening a whole records section (a batch's records, uncompressed) in one pass: every
record's value (and key) through its envelope, the records written again around them. This is the
data path's unit of work; ``seal``/``open_values`` (``aead``) are the same envelope for lists of
values. Pure, like the rest of the package: DEKs and bytes in, bytes out.

The C accelerator (``kproxy/protocol/_accel.c``) does the per-record work where it was built: it
parses the records, places headers and nonces, and calls the DEK's ``cryptography`` AESGCM
``encrypt_into``/``decrypt_into`` straight into the output, so no per-record Python runs. The Python
functions here are the reference and the fallback; a test holds the two equal byte for byte, and
``PATHS`` counts the batches each one handled.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from cryptography.exceptions import InvalidTag

from kproxy.envelope.aead import DataKey, open_values, seal
from kproxy.envelope.format import (
    FLAG_KEY_BOUND,
    MAGIC,
    NONCE_SIZE,
    TAG_SIZE,
    Binding,
    KeyRef,
    MissingDataKey,
    TamperedRecord,
    parse_header,
)

AUTH_FAILED = "authentication failed (the record, its envelope, topic or key was changed)"

# Batches sealed or opened by each path since start: tests read it to know the accelerator ran
# ("into": of those, batches the accelerator opened straight into a partition's buffer).
PATHS = {"native": 0, "python": 0, "into": 0}


class RecordsBroken(Exception):
    """A records section whose records do not fit it: ``reason`` and ``position`` (in the section)."""

    def __init__(self, reason: str, position: int) -> None:
        self.reason = reason
        self.position = position
        super().__init__(f"{reason} at {position}")


def seal_records(records: Any, count: int, runs: Sequence[tuple[int, DataKey]], seal_keys: bool,
                 value_binding: Binding, key_binding: Binding, reserve: int = 0,
                 native: bool | None = None) -> tuple[bytearray, int]:
    """``(records, values sealed)``: the ``count`` records of ``records`` with every non-null value sealed (and key, with
    ``seal_keys``), after ``reserve`` zero bytes (room for the batch header). ``runs`` gives each DEK
    the next records in order, ``(record count, DEK)``; a value is bound to its record's plaintext
    key. RecordsBroken when a record does not fit, before anything is sealed."""
    nonces = os.urandom(NONCE_SIZE * count * (2 if seal_keys else 1))
    use_native = _native_seal is not None if native is None else native
    if use_native:
        assert _native_seal is not None
        c_runs = [(n, dek._aead.encrypt_into, dek._headers[1], dek._headers[0] if seal_keys else None)
                  for n, dek in runs]
        try:
            got: tuple[bytearray, int] = _native_seal(records, count, c_runs, nonces, value_binding.suffix,
                                          key_binding.suffix, reserve)
        except ValueError as e:
            raise _as_broken(e) from None
        PATHS["native"] += 1
        return got
    PATHS["python"] += 1
    return _seal_records(records, count, runs, seal_keys, nonces, value_binding, key_binding, reserve)


def _as_broken(e: ValueError) -> Exception:
    """The accelerator's ValueError(reason, offset) for a record that does not fit, as RecordsBroken;
    any other ValueError as it is."""
    if len(e.args) == 2 and isinstance(e.args[0], str):
        return RecordsBroken(*e.args)
    return e

def open_records(records: Any, count: int, deks: Mapping[KeyRef, DataKey] | Any, value_binding: Binding,
                 key_binding: Binding, reserve: int = 0, native: bool | None = None
                 ) -> tuple[bytearray, int, int, bool]:
    """``(records, values opened, plain values, keys opened)``: the ``count`` records of ``records``
    with sealed values opened, and sealed keys when the batch's first non-null key is sealed (kproxy
    seals all of a batch's keys or none), after ``reserve`` zero bytes; plain and null parts as they
    were. TamperedRecord (with the record's index) for the first record that fails, MissingDataKey
    when ``deks`` (anything with ``get``) lacks a record's DEK, RecordsBroken when a record does not
    fit: a batch is opened whole or not at all."""
    got, opened, plain, keys_opened = _open(records, count, deks, value_binding, key_binding, reserve, native)
    assert isinstance(got, bytearray)
    return got, opened, plain, keys_opened


def open_records_into(into: bytearray, at: int, records: Any, count: int, deks: Mapping[KeyRef, DataKey] | Any,
                      value_binding: Binding, key_binding: Binding, reserve: int = 0, native: bool | None = None
                      ) -> tuple[int, int, int, bool]:
    """``open_records`` writing into ``into`` from ``at`` instead of a new bytearray: ``(offset after
    what was written, values opened, plain values, keys opened)``. ``into`` must hold ``reserve +
    len(records)`` bytes from ``at`` (an opened record is never longer than the sealed one), so a
    partition's batches open one after another into one buffer, with no copy to join them. On an
    error, what lies from ``at`` is undefined."""
    if len(into) - at < reserve + len(records) or at < 0:
        raise ValueError("no room for the records in `into` from `at`")
    if (_native_open is not None if native is None else native) and not _OPEN_INTO:
        # An accelerator built before it could write into a buffer: its own, copied once.
        new, opened, plain, keys_opened = open_records(records, count, deks, value_binding, key_binding, reserve,
                                                       native)
        into[at:at + len(new)] = new
        return at + len(new), opened, plain, keys_opened
    got, opened, plain, keys_opened = _open(records, count, deks, value_binding, key_binding, reserve, native,
                                            into, at)
    assert isinstance(got, int)
    return got, opened, plain, keys_opened


def _open(records: Any, count: int, deks: Mapping[KeyRef, DataKey] | Any, value_binding: Binding,
          key_binding: Binding, reserve: int, native: bool | None, into: bytearray | None = None, at: int = 0
          ) -> tuple[bytearray | int, int, int, bool]:
    use_native = _native_open is not None if native is None else native
    if use_native:
        assert _native_open is not None

        def lookup(part: memoryview, index: int) -> tuple[int, int, Callable[..., Any]]:
            ref, flags, size = parse_header(part, index)
            dek = deks.get(ref)
            if dek is None:
                raise MissingDataKey(ref)
            return size, flags, dek._aead.decrypt_into

        where = () if into is None else (into, at)
        try:
            got: tuple[bytearray | int, int, int, bool] = _native_open(
                records, count, lookup, value_binding.suffix, key_binding.suffix, TamperedRecord, InvalidTag,
                reserve, *where)
        except ValueError as e:
            raise _as_broken(e) from None
        PATHS["native"] += 1
        if into is not None:
            PATHS["into"] += 1
        return got
    PATHS["python"] += 1
    new, opened, plain, keys_opened = _open_records(records, count, deks, value_binding, key_binding, reserve)
    if into is None:
        return new, opened, plain, keys_opened
    into[at:at + len(new)] = new
    return at + len(new), opened, plain, keys_opened


# --------------------------------------------------------------------------------------------------
# The reference: the same work through split and join, record by record in the same order (a
# record's key, then its value; nonces taken in that order).


def _split(records: Any, count: int) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
    from kproxy.protocol.errors import RecordsError
    from kproxy.protocol.records.rewrite import _split_records
    buf = memoryview(records)
    if count < 0 or count > len(buf):
        raise RecordsBroken(f"record count {count} cannot fit in {len(buf)} bytes", 0)
    try:
        return _split_records(buf, count, 0, False)
    except RecordsError as e:
        raise RecordsBroken(e.reason, e.offset or 0) from None


def _join(heads: list[Any], keys: list[Any], values: list[Any], tails: list[Any], reserve: int) -> bytearray:
    from kproxy.protocol.records.rewrite import _join_records
    out = bytearray(reserve)
    out += _join_records(heads, keys, values, tails)
    return out


def _seal_records(records: Any, count: int, runs: Sequence[tuple[int, DataKey]], seal_keys: bool, nonces: bytes,
                  value_binding: Binding, key_binding: Binding, reserve: int) -> tuple[bytearray, int]:
    heads, keys, values, tails = _split(records, count)
    if sum(n for n, _ in runs) != count:
        raise ValueError(f"the runs cover {sum(n for n, _ in runs)} records, the batch holds {count}")
    new_keys: list[Any] = [] if seal_keys else keys
    new_values: list[Any] = []
    at = 0
    pos = 0
    for n, dek in runs:
        run_keys, run_values = keys[at:at + n], values[at:at + n]
        if seal_keys:
            # Nonces go to a record's key, then its value: hand each list its own, in that order.
            key_nonces, value_nonces = bytearray(), bytearray()
            for k, v in zip(run_keys, run_values, strict=True):
                if k is not None:
                    key_nonces += nonces[pos:pos + NONCE_SIZE]
                    pos += NONCE_SIZE
                if v is not None:
                    value_nonces += nonces[pos:pos + NONCE_SIZE]
                    pos += NONCE_SIZE
            new_keys += seal(dek, run_keys, key_binding, nonces=bytes(key_nonces))
            new_values += seal(dek, run_values, value_binding, run_keys, nonces=bytes(value_nonces))
        else:
            used = NONCE_SIZE * (n - run_values.count(None))
            new_values += seal(dek, run_values, value_binding, run_keys, nonces=nonces[pos:pos + used])
            pos += used
        at += n
    return _join(heads, new_keys, new_values, tails, reserve), count - values.count(None)


def _open_records(records: Any, count: int, deks: Mapping[KeyRef, DataKey] | Any, value_binding: Binding,
                  key_binding: Binding, reserve: int) -> tuple[bytearray, int, int, bool]:
    heads, keys, values, tails = _split(records, count)
    first = next((k for k in keys if k is not None), None)
    open_keys = first is not None and first[:4] == MAGIC
    try:
        # A batch's keys, then its values, in bulk; a failure is found again record by record, so
        # that the error is the accelerator's: the first record that fails, key before value.
        if open_keys:
            keys, _ = open_values(keys, key_binding, deks)
        values, plain = open_values(values, value_binding, deks, keys)
    except (TamperedRecord, MissingDataKey, ValueError):
        _first_failure(keys if not open_keys else _split(records, count)[1], values, deks, value_binding,
                       key_binding, open_keys)
        raise
    opened = count - plain - values.count(None)
    return _join(heads, keys, values, tails, reserve), opened, plain, open_keys


def _first_failure(keys: list[Any], values: list[Any], deks: Mapping[KeyRef, DataKey] | Any, value_binding: Binding,
                   key_binding: Binding, open_keys: bool) -> None:
    """Raises the error of the first record whose key or value cannot be opened."""
    last: dict[Binding, tuple[bytes, int, bool, Any, bytes]] = {}

    def head(part: Any, binding: Binding, index: int) -> tuple[int, bool, Any, bytes]:
        got = last.get(binding)
        if got is not None and part[:len(got[0])] == got[0]:
            return got[1:]
        ref, flags, size = parse_header(part, index)
        dek = deks.get(ref)
        if dek is None:
            raise MissingDataKey(ref)
        hdr = bytes(part[:size])
        entry = (hdr, size, bool(flags & FLAG_KEY_BOUND), dek._aead.decrypt, hdr + binding.suffix)
        last[binding] = entry
        return entry[1:]

    def check(part: Any, binding: Binding, index: int, is_key: bool) -> tuple[int, bool, Any, bytes]:
        size, bound, decrypt, aad = head(part, binding, index)
        if is_key and bound:
            raise TamperedRecord(index, "a sealed key is bound to a key")
        if len(part) < size + NONCE_SIZE + TAG_SIZE:
            raise TamperedRecord(index, "too short for a nonce and a tag")
        return size, bound, decrypt, aad

    def open_part(part: Any, index: int, key: Any, found: tuple[int, bool, Any, bytes]) -> bytes:
        size, bound, decrypt, aad = found
        if bound:
            aad = aad + b"\x00" if key is None else aad + b"\x01" + bytes(key)
        body = size + NONCE_SIZE
        try:
            return decrypt(bytes(part[size:body]), bytes(part[body:]), aad)
        except InvalidTag:
            raise TamperedRecord(index, AUTH_FAILED) from None

    # A record's headers are looked up and checked (key, then value) before either is decrypted,
    # as the accelerator does: it sizes the record before it writes it.
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        key_found = value_found = None
        if open_keys and k is not None and k[:4] == MAGIC:
            key_found = check(k, key_binding, i, True)
        if v is not None and v[:4] == MAGIC:
            value_found = check(v, value_binding, i, False)
        if key_found is not None:
            k = open_part(k, i, None, key_found)
        if value_found is not None:
            open_part(v, i, k, value_found)


def _native() -> tuple[Any, Any, bool]:
    """The accelerator's seal_records and open_records, or (None, None) where it was not built or is
    older than they are; and whether its open_records can write into a given buffer."""
    try:
        accel = importlib.import_module("kproxy.protocol._accel")
    except ImportError:
        return None, None, False
    return (getattr(accel, "seal_records", None), getattr(accel, "open_records", None),
            bool(getattr(accel, "OPEN_INTO", 0)))


_native_seal, _native_open, _OPEN_INTO = _native()

"""Record rules on the bytes of records: sealing a produced partition's records (``encrypt``),
opening a fetched partition's sealed records, and masking JSON fields of fetched values (``mask``).
Pure: the data keys come in (``KeyRing`` grants, DEKs by reference), the batches go out rebuilt
with their own codec and producer fields (``protocol/records/rewrite.py``). The policy filter
decides which partitions these apply to and asks the key service for keys it does not hold.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from kproxy.envelope import Binding, DataKey, KeyRef, Part, is_sealed
from kproxy.envelope.format import MissingDataKey, TamperedRecord
from kproxy.envelope.keys import KeyRing, UnwrapCache
from kproxy.envelope.records import RecordsBroken, open_records, open_records_into, seal_records
from kproxy.policy.model import Mask
from kproxy.protocol.errors import RecordsError
from kproxy.protocol.records import (
    V2_HEADER_SIZE,
    Compression,
    RecordBatch,
    iter_batches,
    rebuild_reserved,
    split_records,
)
from kproxy.protocol.records.rewrite import join_records_payload, split_payload
from kproxy.protocol.records.view import MIN_RECORD_SIZE, records_error

log = logging.getLogger("kproxy.crypto")


class SealKeys(NamedTuple):
    """A question for the key service: records to seal, per KEK (``KeyService.data_keys``)."""

    needs: tuple[tuple[str, int], ...]


class OpenKeys(NamedTuple):
    """A question for the key service: the DEKs these references name (``KeyService.unwrap_all``)."""

    refs: tuple[KeyRef, ...]


class RecordCrypto:
    """The process's data keys as the connections see them (the key service's ring and cache,
    read and reserved without I/O) and the counters of what record rules did with them."""

    def __init__(self, ring: KeyRing, cache: UnwrapCache, clock: Callable[[], float]) -> None:
        self.ring = ring
        self.cache = cache
        self.clock = clock
        self.records_encrypted = 0
        self.records_decrypted = 0
        self.batches_encrypted = 0
        self.batches_decrypted = 0
        self.records_masked = 0
        self.mask_not_json = 0
        # Partitions refused, by reason: unreachable, timeout, unknown_kek, denied, tampered, ...
        self.failures: dict[str, int] = {}
        self._logged: dict[tuple[Any, ...], float] = {}

    def failed(self, reason: str) -> None:
        self.failures[reason] = self.failures.get(reason, 0) + 1

    def worth_logging(self, what: tuple[Any, ...], every_s: float = 60.0) -> bool:
        """Whether a refusal is logged now: a client asks again and again for a partition kproxy
        refuses, and each distinct one is logged once a minute (the metric counts them all)."""
        now = self.clock()
        last = self._logged.get(what)
        if last is not None and now - last < every_s:
            return False
        if len(self._logged) >= 1024:
            self._logged.clear()
        self._logged[what] = now
        return True

    def snapshot(self) -> dict[str, Any]:
        return {
            "records_encrypted": self.records_encrypted,
            "records_decrypted": self.records_decrypted,
            "batches_encrypted": self.batches_encrypted,
            "batches_decrypted": self.batches_decrypted,
            "records_masked": self.records_masked,
            "mask_not_json": self.mask_not_json,
            "failures": dict(self.failures),
        }


# --------------------------------------------------------------------------------------------------
# Sealing


class Unsealable(Exception):
    """A produced partition that cannot be sealed (kproxy cannot read it, or it is in a format
    before record batches v2); it is refused, never forwarded in plaintext."""


def sealable_batches(records: Any) -> list[Any]:
    """The batches of a produced partition, each a RecordBatch; Unsealable if one is not."""
    try:
        batches = list(iter_batches(records, allow_truncated=False))
    except RecordsError as e:
        raise Unsealable(f"the records cannot be read: {e}") from None
    for b in batches:
        if not isinstance(b, RecordBatch):
            raise Unsealable("message format v0/v1 (before Kafka 0.11) cannot be encrypted; upgrade the producer")
    return batches


def units(batches: Sequence[Any], keys: bool) -> int:
    """Records reserved on a DEK for these batches: one per record, two when keys are sealed too."""
    n = sum(b.record_count for b in batches if not b.is_control)
    return 2 * n if keys else n


class Grants:
    """Records granted on a KEK's DEKs (``KeyRing.reserve``), handed out in order."""

    __slots__ = ("_counts", "_deks")

    def __init__(self, grants: Iterable[tuple[DataKey, int]]) -> None:
        kept = [(dek, n) for dek, n in grants if n > 0]
        self._deks = [dek for dek, _ in kept]
        self._counts = [n for _, n in kept]

    def take(self, n: int) -> list[tuple[DataKey, int]]:
        out = []
        while n > 0 and self._deks:
            k = min(n, self._counts[0])
            out.append((self._deks[0], k))
            self._counts[0] -= k
            n -= k
            if not self._counts[0]:
                self._deks.pop(0)
                self._counts.pop(0)
        if n > 0:
            raise ValueError("fewer records granted than the batches hold")
        return out


def seal_partition(batches: Sequence[RecordBatch], topic: str, grants: Grants, seal_keys: bool,
                   cap: int) -> tuple[bytes, int, int]:
    """``(records, batches sealed, values sealed)``: each data batch rebuilt with its values (and keys)
    sealed; control batches as they were. A value's associated data binds the topic and its record's
    key, so neither a record moved to another topic nor a value under another key opens."""
    value_binding = Binding(topic, Part.VALUE)
    key_binding = Binding(topic, Part.KEY)
    per = 2 if seal_keys else 1
    out: list[Any] = []
    sealed_batches = 0
    sealed_values = 0
    for batch in batches:
        if batch.is_control:
            out.append(batch.raw)
            continue
        buf, count = _payload(batch, cap)
        runs: list[tuple[int, DataKey]] = []
        unit = 0
        for dek, n in grants.take(batch.record_count * per):
            # The records whose first unit falls in this grant are sealed by its DEK (a key and its
            # value always under one DEK).
            records = -(-(unit + n) // per) - -(-unit // per)
            unit += n
            if records > 0:
                runs.append((records, dek))
        try:
            new, values = seal_records(buf, count, runs, seal_keys, value_binding, key_binding, V2_HEADER_SIZE)
        except RecordsBroken as e:
            raise _records_error(batch, e) from None
        sealed_values += values
        out.append(rebuild_reserved(batch, new, cap))
        sealed_batches += 1
    return b"".join(out), sealed_batches, sealed_values


def _payload(batch: RecordBatch, cap: int) -> tuple[memoryview, int]:
    """A data batch's uncompressed records section and record count, checked as ``split_records`` does."""
    buf = batch.payload(cap)
    count = batch.record_count
    if count > len(buf) // MIN_RECORD_SIZE:
        raise records_error(f"record count {count} cannot fit in {len(buf)} bytes", 0, batch._at + V2_HEADER_SIZE,
                            batch.compression is not Compression.NONE)
    return buf, count


def _records_error(batch: RecordBatch, e: RecordsBroken) -> RecordsError:
    return records_error(e.reason, e.position, batch._at + V2_HEADER_SIZE, batch.compression is not Compression.NONE)


# --------------------------------------------------------------------------------------------------
# Opening and masking


class Tampered(Exception):
    """A fetched record that fails authentication: ``offset`` is where it is."""

    def __init__(self, offset: int, reason: str) -> None:
        self.offset = offset
        self.reason = reason
        super().__init__(f"offset {offset}: {reason}")


class FetchedBatch(NamedTuple):
    """A fetched data batch (v2, not control) that record rules may open or mask."""

    batch: RecordBatch


def read_fetched(records: Any, cap: int) -> list[FetchedBatch | Any]:
    """A fetched partition's batches: FetchedBatch for data batches v2, the raw bytes of the others.
    A partial trailing batch (a Fetch cut at its size limit) is left out: the client would drop it,
    and asks again from there. Records are read when they are opened or masked."""
    out: list[FetchedBatch | Any] = []
    for b in iter_batches(records, allow_truncated=True):
        if not isinstance(b, RecordBatch) or b.is_control:
            out.append(b.raw)
            continue
        out.append(FetchedBatch(b))
    return out


def holds_sealed(batches: Sequence[FetchedBatch | Any], cap: int) -> bool:
    """Whether any record of these batches has a sealed key or value (False for records that cannot
    be read: the client cannot read them either)."""
    for fb in batches:
        if not isinstance(fb, FetchedBatch):
            continue
        try:
            _, keys, values, _ = split_records(fb.batch, cap)
        except RecordsError:
            continue
        if any(map(is_sealed, (*values, *keys))):
            return True
    return False


class CachedKeys:
    """The unwrap cache as the mapping ``open_values`` reads DEKs from, at one moment."""

    __slots__ = ("cache", "now")

    def __init__(self, cache: UnwrapCache, now: float) -> None:
        self.cache = cache
        self.now = now

    def get(self, ref: KeyRef) -> DataKey | None:
        return self.cache.get(ref, self.now)


def open_partition(batches: Sequence[FetchedBatch | Any], topic: str, deks: Mapping[KeyRef, DataKey] | CachedKeys,
                   masks: Sequence[Mask], crypto: RecordCrypto | None, cap: int, opening: bool = True
                   ) -> bytearray | None:
    """The partition's records with sealed keys and values opened (when ``opening``: the topic is
    encrypted) and ``masks`` applied, or None when nothing changed (or the first batch cannot be
    read: the client cannot read it either, and the broker's answer stands). A batch that cannot be
    read or opened
    ends the records there: the batches before it are delivered, and the client's next Fetch starts
    at it. When it is the first, Tampered (a record fails authentication: it is never delivered, not
    even empty) or MissingDataKey (a DEK not in ``deks``) refuses the partition.

    The records are written into one buffer the size of those received: an uncompressed batch is
    opened in place there (an opened record is never longer than the sealed one) with its header
    written around it, so a partition of many batches costs one allocation and no copy to join them."""
    value_binding = Binding(topic, Part.VALUE)
    key_binding = Binding(topic, Part.KEY)
    out = bytearray(sum(len(fb.batch.raw) if isinstance(fb, FetchedBatch) else len(fb) for fb in batches))
    at = 0
    changed = False
    for fb in batches:
        if not isinstance(fb, FetchedBatch):
            at = _put(out, at, fb)
            continue
        batch = fb.batch
        new: Any = None
        try:
            if opening:
                buf, count = _payload(batch, cap)
                in_place = batch.compression is Compression.NONE
                try:
                    if in_place:
                        need = V2_HEADER_SIZE + len(buf)
                        if len(out) - at < need:
                            # Batches before it grew (masked): room for this one, bounded by its size.
                            out.extend(bytes(need - (len(out) - at)))
                        end, sealed, _plain, keys_opened = open_records_into(
                            out, at, buf, count, deks, value_binding, key_binding, V2_HEADER_SIZE)
                    else:
                        opened_records, sealed, _plain, keys_opened = open_records(
                            buf, count, deks, value_binding, key_binding, V2_HEADER_SIZE)
                except RecordsBroken as e:
                    raise _records_error(batch, e) from None
                except (TamperedRecord, MissingDataKey) as e:
                    if at:
                        # The batches before this one go to the client; its next Fetch starts here.
                        return _cut(out, at)
                    if isinstance(e, MissingDataKey):
                        raise
                    raise Tampered(batch.base_offset + e.index, e.reason) from None
                if sealed or keys_opened:
                    new = bytearray(out[at:end]) if in_place and masks else (
                        _OPENED_HERE if in_place else opened_records)
                    if crypto is not None:
                        crypto.records_decrypted += sealed
                        crypto.batches_decrypted += 1
            if masks:
                if new is not None:
                    parts = _split_section(memoryview(new)[V2_HEADER_SIZE:], count, batch)
                else:
                    parts = split_records(batch, cap)
                heads, keys, values, tails = parts
                values, masked = mask_values(values, masks, crypto)
                if masked:
                    new = bytearray(V2_HEADER_SIZE)
                    new += join_records_payload(heads, keys, values, tails)
                del parts, heads, keys, values, tails     # views of `new`, let go before it is rebuilt
            if new is _OPENED_HERE:
                with memoryview(out) as whole:
                    rebuild_reserved(batch, whole[at:end], cap)     # the header, in place
                at = end
                changed = True
            elif new is not None:
                at = _put(out, at, rebuild_reserved(batch, new, cap))
                changed = True
            else:
                at = _put(out, at, batch.raw)
        except RecordsError:
            # The client cannot read this batch either: the batches before it go (opened), and
            # alone it is the broker's answer as it is (the client fails on it first).
            return _cut(out, at) if at else None
    if not changed:
        return None
    return _cut(out, at)


# open_partition's mark for a batch opened where it belongs in the partition's buffer.
_OPENED_HERE = object()


def _put(out: bytearray, at: int, data: Any) -> int:
    """``data`` written into ``out`` from ``at`` (``out`` grows when it runs past the end); the offset after it."""
    end = at + len(data)
    out[at:end] = data
    return end


def _cut(out: bytearray, at: int) -> bytearray:
    del out[at:]
    return out


def _split_section(buf: memoryview, count: int, batch: RecordBatch) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
    """An opened records section split for masking, as ``split_records`` splits a batch's."""
    return split_payload(buf, count, batch._at + V2_HEADER_SIZE, batch.compression is not Compression.NONE)


def mask_values(values: Sequence[Any], masks: Sequence[Mask], crypto: RecordCrypto | None) -> tuple[list[Any], bool]:
    """Values with the masks' fields replaced where they are JSON objects that hold them; other
    values as they were (values that are not JSON are counted)."""
    out: list[Any] = []
    changed = False
    for v in values:
        if v is None:
            out.append(v)
            continue
        try:
            doc = json.loads(bytes(v))
        except (ValueError, UnicodeDecodeError):
            if crypto is not None:
                crypto.mask_not_json += 1
            out.append(v)
            continue
        hit = False
        for m in masks:
            for path in m.fields:
                hit = _replace(doc, path, m.with_) or hit
        if hit:
            out.append(json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode())
            changed = True
            if crypto is not None:
                crypto.records_masked += 1
        else:
            out.append(v)
    return out, changed


def _replace(doc: Any, path: tuple[str, ...], with_: Any) -> bool:
    for name in path[:-1]:
        if not isinstance(doc, dict) or name not in doc:
            return False
        doc = doc[name]
    if isinstance(doc, dict) and path[-1] in doc:
        doc[path[-1]] = with_
        return True
    return False

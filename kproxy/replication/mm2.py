"""MirrorMaker 2's records, as it writes them, and offset translation with them.

Facts from Apache Kafka's connect/mirror (``OffsetSync``, ``Checkpoint``, ``OffsetSyncStore``):

- An **offset sync** says that the record at ``upstream`` offset of a source partition was written at
  ``downstream`` offset of its replica. Key: topic (STRING: int16 length, UTF-8), partition (INT32).
  Value: upstreamOffset (INT64), offset (INT64). MM2 writes them to partition 0 of
  ``mm2-offset-syncs.<target alias>.internal``, on the source cluster by default, at once when the
  replica's offset has moved ``offset.lag.max`` (100) past the last sync or the source skipped an
  offset, else at its next offset flush.
- A **checkpoint** says a group's committed offset on the source (``upstream``) and its translation
  on the target (``offset``). Key: group, topic (the replica's name, ``primary.orders``), partition.
  Value: version (INT16, 0), upstreamOffset, offset (INT64), metadata (STRING). MM2 writes them to
  partition 0 of ``<source alias>.checkpoints.internal`` on the target, every
  ``emit.checkpoints.interval.seconds``.
- **Translation** of a source offset uses the latest sync at or before it: exactly its downstream
  offset when they are equal, else one past it (later records may or may not be replicated, so the
  translation never skips one; the records in between are read again).

Pure; decoding is bounded by the bytes given and raises ``MM2RecordError`` on anything else.
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Iterable

import attrs

from kproxy.protocol.errors import KProxyError

_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")
_I64 = struct.Struct(">q")
CHECKPOINT_VERSION = 0


class MM2RecordError(KProxyError):
    """A record of MM2's internal topics that does not parse."""


def offset_syncs_topic(target_alias: str) -> str:
    return f"mm2-offset-syncs.{target_alias}.internal"


def checkpoints_topic(source_alias: str) -> str:
    return f"{source_alias}.checkpoints.internal"


def _string(value: str) -> bytes:
    raw = value.encode()
    return _I16.pack(len(raw)) + raw


class _Reader:
    __slots__ = ("data", "pos")

    def __init__(self, data: bytes | memoryview) -> None:
        self.data = memoryview(data)
        self.pos = 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise MM2RecordError(f"needs {n} bytes at offset {self.pos}, has {len(self.data) - self.pos}")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def i16(self) -> int:
        return int(_I16.unpack(self.take(2))[0])

    def i32(self) -> int:
        return int(_I32.unpack(self.take(4))[0])

    def i64(self) -> int:
        return int(_I64.unpack(self.take(8))[0])

    def string(self) -> str:
        n = self.i16()
        if n < 0:
            raise MM2RecordError("a null string where MM2 writes none")
        try:
            return bytes(self.take(n)).decode()
        except UnicodeDecodeError as e:
            raise MM2RecordError(f"a string that is not UTF-8: {e}") from None


@attrs.frozen(slots=True)
class OffsetSync:
    topic: str
    partition: int
    upstream: int
    downstream: int

    def key(self) -> bytes:
        return _string(self.topic) + _I32.pack(self.partition)

    def value(self) -> bytes:
        return _I64.pack(self.upstream) + _I64.pack(self.downstream)

    @classmethod
    def decode(cls, key: bytes | memoryview | None, value: bytes | memoryview | None) -> OffsetSync:
        if key is None or value is None:
            raise MM2RecordError("an offset sync needs a key and a value")
        k, v = _Reader(key), _Reader(value)
        return cls(k.string(), k.i32(), v.i64(), v.i64())


@attrs.frozen(slots=True)
class Checkpoint:
    group: str
    topic: str              # the replica's name for it (MM2 renames: primary.orders)
    partition: int
    upstream: int
    downstream: int
    metadata: str = ""

    def key(self) -> bytes:
        return _string(self.group) + _string(self.topic) + _I32.pack(self.partition)

    def value(self) -> bytes:
        return (_I16.pack(CHECKPOINT_VERSION) + _I64.pack(self.upstream) + _I64.pack(self.downstream)
                + _string(self.metadata))

    @classmethod
    def decode(cls, key: bytes | memoryview | None, value: bytes | memoryview | None) -> Checkpoint:
        if key is None or value is None:
            raise MM2RecordError("a checkpoint needs a key and a value")
        k, v = _Reader(key), _Reader(value)
        group, topic, partition = k.string(), k.string(), k.i32()
        version = v.i16()
        if version != CHECKPOINT_VERSION:
            raise MM2RecordError(f"checkpoint version {version} (kproxy reads version {CHECKPOINT_VERSION})")
        return cls(group, topic, partition, v.i64(), v.i64(), v.string())


class OffsetSyncs:
    """The offset syncs of many partitions, for translation: per partition the newest syncs, and
    older ones ever more thinly (each halving of the kept history keeps every other sync), at most
    ``per_partition`` of them. A sync below the newest means the source was truncated or recreated:
    what was kept is dropped, as MM2 does."""

    def __init__(self, per_partition: int = 64, partitions: int = 100_000) -> None:
        self.per_partition = max(per_partition, 8)
        self.partitions = partitions
        self._syncs: dict[tuple[str, int], tuple[list[int], list[int]]] = {}
        self.read = 0           # syncs taken in

    def __len__(self) -> int:
        return len(self._syncs)

    def add(self, sync: OffsetSync) -> None:
        self.read += 1
        key = (sync.topic, sync.partition)
        got = self._syncs.get(key)
        if got is None:
            if len(self._syncs) >= self.partitions:
                return
            got = self._syncs[key] = ([], [])
        ups, downs = got
        if ups and sync.upstream < ups[-1]:
            ups.clear()
            downs.clear()
        if ups and sync.upstream == ups[-1]:
            downs[-1] = sync.downstream
            return
        ups.append(sync.upstream)
        downs.append(sync.downstream)
        if len(ups) > self.per_partition:
            # Keep the newest half as it is; of the older half, every other one.
            half = len(ups) // 2
            ups[:half] = ups[:half:2]
            downs[:half] = downs[:half:2]

    def extend(self, syncs: Iterable[OffsetSync]) -> None:
        for s in syncs:
            self.add(s)

    def latest(self, topic: str, partition: int) -> tuple[int, int] | None:
        """The newest sync of a partition: (upstream, downstream)."""
        got = self._syncs.get((topic, partition))
        if not got or not got[0]:
            return None
        return got[0][-1], got[1][-1]

    def translate(self, topic: str, partition: int, upstream: int) -> int | None:
        """The replica's offset for source offset ``upstream`` (a group's committed position), as
        MM2 translates it; None when no sync is at or before it."""
        got = self._syncs.get((topic, partition))
        if not got:
            return None
        ups, downs = got
        i = bisect.bisect_right(ups, upstream) - 1
        if i < 0:
            return None
        return downs[i] + (0 if ups[i] == upstream else 1)

    def replica_end_for(self, topic: str, partition: int, source_end: int) -> int:
        """The replica's end offset once it holds everything before ``source_end`` on the source:
        offsets run one to one after the newest sync (MM2 writes a new sync where they do not);
        without a sync, the same offset."""
        latest = self.latest(topic, partition)
        if latest is None:
            return source_end
        up, down = latest
        return down + (source_end - up) if source_end > up else down + 1


@attrs.frozen
class Translated:
    """Where a group resumes on the new cluster for one partition, and what said so."""

    offset: int
    source: str           # "kproxy" (its own view of the commit, through offset syncs), "checkpoint"
    upstream: int | None  # the group's committed offset on the old cluster, when known


def plan_group(commits: dict[tuple[str, int], int], syncs: OffsetSyncs, checkpoints: dict[tuple[str, int], Checkpoint],
               source_prefix: str, target_prefix: str) -> dict[tuple[str, int], Translated]:
    """Where one group resumes on the target, per (target topic, partition): the better of kproxy's
    own translation of the group's last commit on the source (``commits``, by the clients' names)
    and MM2's last checkpoint (``checkpoints``, by the target's names). Both never skip a record, so
    the higher one re-reads less."""
    out: dict[tuple[str, int], Translated] = {}
    for (topic, partition), cp in checkpoints.items():
        out[(topic, partition)] = Translated(cp.downstream, "checkpoint", cp.upstream)
    for (topic, partition), committed in commits.items():
        own = syncs.translate(source_prefix + topic, partition, committed)
        if own is None:
            continue
        key = (target_prefix + topic, partition)
        before = out.get(key)
        if before is None or own >= before.offset:
            out[key] = Translated(own, "kproxy", committed)
    return out

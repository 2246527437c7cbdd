"""kproxy's own Kafka client for a switch: reading MirrorMaker 2's topics, the end offsets of
partitions, and a group's committed offsets; committing translated offsets on the new cluster.

Out of the data path: a switch or a background tail uses it, never a client's request. Each request
goes on a connection opened like every other (``open_upstream``: TLS and kproxy's SASL login), one
at a time, answered within the timeout; failures are OSError, trio.TooSlowError or KProxyError for
the caller to report. Versions are the broker's highest within what this module fills in.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import trio

from kproxy.protocol.errors import KProxyError
from kproxy.protocol.messages import Request, body_class
from kproxy.protocol.records import RecordBatch, iter_batches
from kproxy.replication.mm2 import Checkpoint, MM2RecordError, OffsetSync, OffsetSyncs
from kproxy.server.origination import direct_roundtrip
from kproxy.server.transport import Transport
from kproxy.server.upstream import UpstreamSettings, open_upstream

log = logging.getLogger("kproxy.replicas")

API_VERSIONS, METADATA, FETCH, LIST_OFFSETS, FIND_COORDINATOR, OFFSET_FETCH, OFFSET_COMMIT = 18, 3, 1, 2, 10, 9, 8
# The versions this module fills in: all take topic names and one group per request.
_WANTED = {METADATA: (1, 9), FETCH: (4, 11), LIST_OFFSETS: (1, 5), FIND_COORDINATOR: (1, 3),
           OFFSET_FETCH: (2, 9), OFFSET_COMMIT: (2, 8)}
EARLIEST = -2
_FETCH_BYTES = 4 * 1024 * 1024
_NOT_COORDINATOR = frozenset({14, 15, 16})     # loading, not available, not coordinator


class ReplicaError(KProxyError):
    """A cluster answered a switch's request with an error."""


class _Link:
    """One connection to one broker; requests one at a time."""

    def __init__(self, transport: Transport, address: tuple[str, int], timeout: float, max_frame: int) -> None:
        self.transport = transport
        self.address = address
        self.timeout = timeout
        self._roundtrip = direct_roundtrip(transport, timeout, max_frame)
        self._ids = 0
        self.versions: dict[int, int] = {}

    async def call(self, api_key: int, **fields: Any) -> Any:
        self._ids = (self._ids + 1) & 0x7FFFFFFF
        version = self.versions.get(api_key, 0)
        body = body_class(api_key, "request")(**fields)
        resp = await self._roundtrip(Request.build(api_key, version, self._ids, "kproxy-switch", body))
        return resp.body

    async def negotiate(self) -> None:
        av = await self.call(API_VERSIONS)
        theirs = {e.api_key: (e.min_version, e.max_version) for e in av.api_keys}
        for api, (lo, hi) in _WANTED.items():
            if api in theirs and theirs[api][1] >= lo and theirs[api][0] <= hi:
                self.versions[api] = min(hi, theirs[api][1])

    def version(self, api_key: int) -> int:
        got = self.versions.get(api_key)
        if got is None:
            raise ReplicaError(f"broker {self.address[0]}:{self.address[1]} offers no version of API {api_key} "
                               f"kproxy uses ({_WANTED[api_key][0]}-{_WANTED[api_key][1]})")
        return got

    def close(self) -> None:
        self.transport.close()


class ClusterClient:
    """Requests to one cluster, its broker connections kept until ``close``."""

    def __init__(self, name: str, bootstrap: Iterable[tuple[str, int]], settings: UpstreamSettings,
                 timeout: float, max_frame: int = 100 * 1024 * 1024) -> None:
        self.name = name
        self.bootstrap = tuple(bootstrap)
        self.settings = settings
        self.timeout = timeout
        self.max_frame = max_frame
        self._links: dict[tuple[str, int], _Link] = {}
        self._brokers: dict[int, tuple[str, int]] = {}

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()

    async def _link(self, address: tuple[str, int]) -> _Link:
        link = self._links.get(address)
        if link is None:
            transport = await open_upstream(address[0], address[1], self.settings)
            link = _Link(transport, address, self.timeout, self.max_frame)
            try:
                await link.negotiate()
            except BaseException:
                link.close()
                raise
            self._links[address] = link
        return link

    async def _call(self, address: tuple[str, int], api_key: int, **fields: Any) -> Any:
        link = await self._link(address)
        link.version(api_key)       # ReplicaError when the broker offers no version kproxy fills in
        try:
            return await link.call(api_key, **fields)
        except (OSError, trio.TooSlowError, trio.BrokenResourceError, KProxyError):
            # The connection is in an unknown state: the next request opens a new one.
            self._links.pop(address, None)
            link.close()
            raise

    async def any_broker(self) -> tuple[str, int]:
        """The address of a bootstrap server (or known broker) that answers."""
        last: BaseException | None = None
        for address in (*self._links, *self.bootstrap):
            try:
                await self._link(address)
                return address
            except (OSError, trio.TooSlowError, KProxyError) as e:
                last = e
        raise OSError(f"no broker of cluster {self.name} answers ({last or 'none configured'})")

    async def metadata(self, topics: Iterable[str]) -> Any:
        address = await self.any_broker()
        mt: Any = body_class(METADATA, "request")
        body = await self._call(address, METADATA, topics=[mt.MetadataRequestTopic(name=t) for t in topics],
                                allow_auto_topic_creation=False)
        self._brokers = {b.node_id: (b.host, b.port) for b in body.brokers}
        return body

    async def leaders(self, partitions: Iterable[tuple[str, int]]) -> dict[tuple[str, int], tuple[str, int] | None]:
        """Each partition's leader's address; None for a partition the cluster does not have."""
        wanted = list(dict.fromkeys(partitions))
        md = await self.metadata({t for t, _ in wanted})
        leaders: dict[tuple[str, int], tuple[str, int]] = {}
        for t in md.topics:
            if t.error_code:
                continue
            for p in t.partitions:
                address = self._brokers.get(p.leader_id)
                if address is not None and not p.error_code:
                    leaders[(t.name, p.partition_index)] = address
        return {tp: leaders.get(tp) for tp in wanted}

    async def list_offsets(self, partitions: Iterable[tuple[str, int]], timestamp: int = EARLIEST
                           ) -> dict[tuple[str, int], int | None]:
        """Each partition's offset for ``timestamp`` (ListOffsets; EARLIEST: where its log starts);
        None where it is not known."""
        out: dict[tuple[str, int], int | None] = {}
        lo: Any = body_class(LIST_OFFSETS, "request")
        for address, tps in (await self._by_leader(partitions, out)).items():
            topics: dict[str, list[int]] = {}
            for t, p in tps:
                topics.setdefault(t, []).append(p)
            body = await self._call(address, LIST_OFFSETS, replica_id=-1, isolation_level=0, topics=[
                lo.ListOffsetsTopic(name=t, partitions=[lo.ListOffsetsPartition(partition_index=p, timestamp=timestamp)
                                                        for p in ps]) for t, ps in topics.items()])
            for t in body.topics:
                for p in t.partitions:
                    out[(t.name, p.partition_index)] = p.offset if not p.error_code and p.offset >= 0 else None
        return out

    async def end_offsets(self, partitions: Iterable[tuple[str, int]]) -> dict[tuple[str, int], int | None]:
        """Each partition's end (its high watermark); None where it is not known. Read from a Fetch
        at the log's start, not from ListOffsets LATEST: tansu 0.6 answers that with one past the
        first offset of the last batch, not past its last record."""
        out: dict[tuple[str, int], int | None] = {}
        starts = await self.list_offsets(partitions, EARLIEST)
        fe: Any = body_class(FETCH, "request")
        wanted = [tp for tp, start in starts.items() if start is not None]
        for address, tps in (await self._by_leader(wanted, out)).items():
            topics: dict[str, list[int]] = {}
            for t, p in tps:
                topics.setdefault(t, []).append(p)
            body = await self._call(address, FETCH, replica_id=-1, max_wait_ms=1, min_bytes=0, max_bytes=1,
                                    isolation_level=0, session_id=0, session_epoch=-1, topics=[
                                        fe.FetchTopic(topic=t, partitions=[fe.FetchPartition(
                                            partition=p, fetch_offset=starts[(t, p)] or 0, partition_max_bytes=1)
                                            for p in ps]) for t, ps in topics.items()],
                                    forgotten_topics_data=[], rack_id="")
            for t in body.responses:
                for p in t.partitions:
                    out[(t.topic, p.partition_index)] = p.high_watermark if not p.error_code else None
        for tp, start in starts.items():
            out.setdefault(tp, None if start is None else out.get(tp))
        return out

    async def _by_leader(self, partitions: Iterable[tuple[str, int]], unknown: dict[tuple[str, int], int | None]
                         ) -> dict[tuple[str, int], list[tuple[str, int]]]:
        """The partitions by their leader's address; those without one go into ``unknown`` as None."""
        by_leader: dict[tuple[str, int], list[tuple[str, int]]] = {}
        for tp, address in (await self.leaders(partitions)).items():
            if address is None:
                unknown[tp] = None
            else:
                by_leader.setdefault(address, []).append(tp)
        return by_leader

    async def read(self, topic: str, partition: int, start: int, limit: int = 1_000_000,
                   wait_ms: int = 50) -> tuple[list[tuple[int, bytes | None, bytes | None]], int]:
        """The records of a partition from ``start`` up to its high watermark (at most ``limit``), and
        the offset reading reached: [(offset, key, value)]. A partition the cluster does not have is
        ([], start)."""
        address = (await self.leaders([(topic, partition)]))[(topic, partition)]
        if address is None:
            return [], start
        fe: Any = body_class(FETCH, "request")
        out: list[tuple[int, bytes | None, bytes | None]] = []
        offset = start
        while len(out) < limit:
            # Not max_wait_ms=0: tansu answers that with no partitions at all, even with records there.
            body = await self._call(address, FETCH, replica_id=-1, max_wait_ms=wait_ms, min_bytes=1,
                                    max_bytes=_FETCH_BYTES, isolation_level=0, session_id=0, session_epoch=-1,
                                    topics=[fe.FetchTopic(topic=topic, partitions=[fe.FetchPartition(
                                        partition=partition, fetch_offset=offset,
                                        partition_max_bytes=_FETCH_BYTES)])],
                                    forgotten_topics_data=[], rack_id="")
            part = next((p for t in body.responses if t.topic == topic for p in t.partitions
                         if p.partition_index == partition), None)
            if part is None:
                break
            if part.error_code == 1:        # OFFSET_OUT_OF_RANGE: the log starts later now
                begins = (await self.list_offsets([(topic, partition)])).get((topic, partition))
                if begins is None or begins <= offset:
                    break
                offset = begins
                continue
            if part.error_code:
                raise ReplicaError(f"Fetch of {topic}[{partition}] on cluster {self.name}: error {part.error_code}")
            before = offset
            for batch in iter_batches(part.records or b""):
                if not isinstance(batch, RecordBatch):
                    continue        # a legacy message set: nothing MM2 writes
                if not batch.is_control:
                    for r in batch.records():
                        if r.offset >= offset:
                            out.append((r.offset, _bytes(r.key), _bytes(r.value)))
                offset = max(offset, batch.last_offset + 1)
            if offset >= part.high_watermark or offset == before:
                break
        return out, offset

    async def _coordinator(self, group: str) -> tuple[str, int]:
        address = await self.any_broker()
        for attempt in range(10):
            body = await self._call(address, FIND_COORDINATOR, key=group, key_type=0)
            if body.error_code == 0:
                return body.host, body.port
            if body.error_code not in _NOT_COORDINATOR:
                raise ReplicaError(f"FindCoordinator for group {group} on cluster {self.name}: error "
                                   f"{body.error_code}")
            await trio.sleep(min(0.05 * (attempt + 1), 0.5))
        raise ReplicaError(f"cluster {self.name} has no coordinator for group {group} yet")

    async def committed(self, group: str) -> dict[tuple[str, int], int]:
        """The group's committed offsets on this cluster (every topic it committed)."""
        address = await self._coordinator(group)
        link = await self._link(address)
        if link.version(OFFSET_FETCH) >= 8:
            of: Any = body_class(OFFSET_FETCH, "request")
            body = await self._call(address, OFFSET_FETCH, require_stable=False,
                                    groups=[of.OffsetFetchRequestGroup(group_id=group, topics=None)])
            (answer,) = [g for g in body.groups if g.group_id == group] or [None]
            code, topics = (answer.error_code, answer.topics) if answer is not None else (0, [])
        else:
            body = await self._call(address, OFFSET_FETCH, group_id=group, topics=None, require_stable=False)
            code, topics = body.error_code, body.topics
        if code:
            raise ReplicaError(f"OffsetFetch for group {group} on cluster {self.name}: error {code}")
        return {(t.name, p.partition_index): p.committed_offset for t in topics for p in t.partitions
                if not p.error_code and p.committed_offset >= 0}

    async def commit(self, group: str, offsets: dict[tuple[str, int], int]) -> dict[tuple[str, int], int]:
        """Commit ``offsets`` for ``group`` as an admin does (no generation: the group must have no
        members); each partition's error code (0: committed)."""
        address = await self._coordinator(group)
        oc: Any = body_class(OFFSET_COMMIT, "request")
        topics: dict[str, list[Any]] = {}
        for (t, p), offset in offsets.items():
            topics.setdefault(t, []).append(oc.OffsetCommitRequestPartition(partition_index=p, committed_offset=offset,
                                                                            committed_metadata=""))
        body = await self._call(address, OFFSET_COMMIT, group_id=group, generation_id_or_member_epoch=-1,
                                member_id="", topics=[oc.OffsetCommitRequestTopic(name=t, partitions=ps)
                                                      for t, ps in topics.items()])
        return {(t.name, p.partition_index): p.error_code for t in body.topics for p in t.partitions}


def _bytes(view: Any) -> bytes | None:
    return None if view is None else bytes(view)


def decode_syncs(records: Iterable[tuple[int, bytes | None, bytes | None]], into: OffsetSyncs) -> int:
    """Offset syncs from a partition of MM2's offset-syncs topic into ``into``; how many did not parse."""
    bad = 0
    for _, key, value in records:
        try:
            into.add(OffsetSync.decode(key, value))
        except MM2RecordError:
            bad += 1
    return bad


def latest_checkpoints(records: Iterable[tuple[int, bytes | None, bytes | None]]
                       ) -> dict[str, dict[tuple[str, int], Checkpoint]]:
    """The newest checkpoint per group and partition (the topic is compacted by that key)."""
    out: dict[str, dict[tuple[str, int], Checkpoint]] = {}
    for _, key, value in records:
        try:
            cp = Checkpoint.decode(key, value)
        except MM2RecordError:
            continue
        out.setdefault(cp.group, {})[(cp.topic, cp.partition)] = cp
    return out

"""What the telemetry outputs read from one completed request: topics, per-partition record facts,
errors, group, and the latency split, computed once and shared by metrics, the traffic log and spans.

Record facts come from batch headers only (counts, offsets, timestamps, codec), never from record
keys or values. Pure: no I/O and no clock; topic-id names and the groups clients joined are learned
from the traffic itself into small bounded maps.
"""

from __future__ import annotations

import functools
import struct
from collections import OrderedDict
from typing import Any

from kproxy.config import DEFAULT_NAME
from kproxy.protocol.entities import collect
from kproxy.protocol.errors import DecodeError, error_name
from kproxy.protocol.messages import api_by_key, api_name, decode_request, request_header_version
from kproxy.protocol.primitives import ShortBuffer, read_uvarint
from kproxy.protocol.records import LegacyMessage, iter_batches
from kproxy.protocol.schema import StructSpec
from kproxy.proxy.filters import ConnectionContext
from kproxy.proxy.inflight import InFlight
from kproxy.proxy.produce_bytes import batch_records
from kproxy.proxy.streaming import RecordsFacts
from kproxy.proxy.topics import TopicNames

PRODUCE, FETCH = 0, 1
# Requests that name the group a client belongs to (JoinGroup, SyncGroup, Heartbeat, OffsetCommit,
# OffsetFetch, ConsumerGroupHeartbeat, ShareGroupHeartbeat): a later Fetch by the same client on any
# connection is attributed to that group.
GROUP_MEMBER_APIS = frozenset({8, 9, 11, 12, 14, 68, 76})
_CODECS = ("none", "gzip", "snappy", "lz4", "zstd")
_H = struct.Struct(">h").unpack_from
_HH = struct.Struct(">hh").unpack_from


class BoundedMap:
    """A dict that forgets its oldest entries beyond ``cap`` (names learned from traffic)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._d: OrderedDict[Any, Any] = OrderedDict()

    def get(self, key: Any) -> Any:
        return self._d.get(key)

    def put(self, key: Any, value: Any) -> None:
        d = self._d
        if d.get(key) == value:
            return
        d[key] = value
        d.move_to_end(key)
        if len(d) > self.cap:
            d.popitem(last=False)

    def __len__(self) -> int:
        return len(self._d)


class Learned:
    """Names learned from traffic, shared by every connection: topic ids (the process's one
    ``TopicNames`` table, which the sessions fill with the broker's names) and the group each client
    joined (by client address and client id)."""

    def __init__(self, cap: int = 100_000, learn_topics: bool = True,
                 topic_names: TopicNames | None = None, learn_groups: bool = False) -> None:
        self.topic_names = topic_names if topic_names is not None else TopicNames()
        self.groups = BoundedMap(cap)
        self.learn_topics = learn_topics
        # Whether a group request relayed undecoded (one the traffic log and spans did not sample)
        # gives its group all the same (read from its bytes, ``group_in_frame``, or decoded): the
        # Fetch lines and spans they do sample name it.
        self.learn_groups = learn_groups
        if learn_topics:
            self.topic_names.want(lambda: True)

    def topic(self, topic_id: Any) -> str | None:
        return self.topic_names.get(topic_id)

    def observe(self, entry: InFlight, ctx: ConnectionContext) -> None:
        key = entry.api_key
        if key not in GROUP_MEMBER_APIS:
            return
        req = entry.request
        if req is None and self.learn_groups and entry.relayed is not None:
            if _group_first(key, entry.api_version):
                group = group_in_frame(entry.relayed)
                if group is not None:
                    self.groups.put(_client_key(ctx), group)
                return
            try:    # not kept on the entry: metrics read it as they read any relayed exchange
                req = decode_request(entry.relayed, keep_trailing=True)
            except DecodeError:
                return
        if req is not None:
            groups = collect(req.body, key, entry.api_version, "request", "group")
            if groups:
                self.groups.put(_client_key(ctx), groups[0])

    def group_of(self, ctx: ConnectionContext) -> str | None:
        return self.groups.get(_client_key(ctx))


@functools.cache
def _group_first(api_key: int, version: int) -> bool:
    """Whether requests of this api version hold their group id as the body's first field (every
    group request but OffsetFetch from v8, which names its groups in an array)."""
    try:
        fields = [f for f in api_by_key(api_key).request.root.fields if version in f.versions]  # type: ignore[union-attr]
    except (KeyError, AttributeError):
        return False
    return bool(fields) and fields[0].name == "group_id" and fields[0].type == "string"


def group_in_frame(frame: Any) -> str | None:
    """The group id of a request frame (no size prefix) whose body starts with it (``_group_first``),
    read from the bytes: the header (v1, or v2 with its tagged fields), then the string, compact
    from header v2 (flexible versions) on. None when the bytes are too short to say."""
    api_key, version = _HH(frame, 0)
    try:
        (n,) = _H(frame, 8)                          # client id (int16 length; -1 is null)
        pos = 10 + max(n, 0)
        if request_header_version(api_key, version) >= 2:
            count, pos = read_uvarint(frame, pos)    # header tagged fields, skipped
            for _ in range(count):
                _, pos = read_uvarint(frame, pos)
                size, pos = read_uvarint(frame, pos)
                pos += size
            length, pos = read_uvarint(frame, pos)
            length -= 1
        else:
            (length,) = _H(frame, pos)
            pos += 2
        if length < 0 or pos + length > len(frame):
            return None
        return str(frame[pos:pos + length], "utf-8", "surrogateescape")
    except (struct.error, IndexError, ValueError, ShortBuffer):
        return None


def _client_key(ctx: ConnectionContext) -> tuple[str | None, str | None]:
    host = ctx.client_address[0] if ctx.client_address else None
    return host, ctx.client_id


class PartitionFacts:
    """One topic partition of a Produce request or Fetch response, from batch headers."""

    __slots__ = ("bytes", "compression", "error_code", "first_offset", "first_timestamp", "last_offset",
                 "max_timestamp", "partition", "records", "topic", "topic_id")

    def __init__(self, topic: str | None, topic_id: Any, partition: int) -> None:
        self.topic = topic
        self.topic_id = topic_id
        self.partition = partition
        self.records = 0
        self.bytes = 0
        self.first_offset: int | None = None
        self.last_offset: int | None = None
        self.first_timestamp: int | None = None
        self.max_timestamp: int | None = None
        self.compression: str | None = None
        self.error_code = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "topic_id": str(self.topic_id) if self.topic_id is not None else None,
            "partition": self.partition,
            "records": self.records,
            "bytes": self.bytes,
            "first_offset": self.first_offset,
            "last_offset": self.last_offset,
            "first_timestamp": self.first_timestamp,
            "max_timestamp": self.max_timestamp,
            "compression": self.compression,
            "error_code": self.error_code,
        }


def _read_batches(p: PartitionFacts, records: Any, from_offset: int = -1) -> tuple[int | None, int | None]:
    """Fill counts, bytes, timestamps and codec from the batch headers of a records field; returns
    (first offset, last offset) of the batches that reach ``from_offset``. A malformed field counts
    what came before the fault: telemetry never fails a request."""
    if records is None:
        return None, None
    p.bytes = len(records)
    headers = []
    try:
        for b in iter_batches(records):
            if isinstance(b, LegacyMessage):
                ts = b.timestamp if b.magic >= 1 else None
                headers.append((b.offset, b.offset, 1, ts, ts, b.attributes))
            else:
                headers.append((b.base_offset, b.last_offset, b.record_count, b.base_timestamp,
                                b.max_timestamp, b.attributes))
    except DecodeError:
        pass
    return _fold(p, headers, from_offset)


def read_streamed(p: PartitionFacts, facts: RecordsFacts, from_offset: int = -1) -> tuple[int | None, int | None]:
    """``_read_batches`` for a records field that was streamed: the same figures, from the batch
    headers the stream noted as the bytes passed."""
    if facts.size < 0:
        return None, None
    p.bytes = facts.size
    return _fold(p, facts.batch_headers, from_offset)


def _fold(p: PartitionFacts, headers: Any, from_offset: int) -> tuple[int | None, int | None]:
    first = last = None
    for base, end, count, ts, max_ts, attributes in headers:
        if end < from_offset:
            continue  # a batch the broker sent whole although the client asked past it
        if first is None:
            first = max(base, from_offset)
            p.compression = _CODECS[attributes & 0x07] if (attributes & 0x07) < 5 else None
        last = end
        p.records += count
        if ts is not None and ts >= 0 and (p.first_timestamp is None or ts < p.first_timestamp):
            p.first_timestamp = ts
        if max_ts is not None and (p.max_timestamp is None or max_ts > p.max_timestamp):
            p.max_timestamp = max_ts
    return first, last


def _topic(t: Any, v: int, name_field: str, learned: Learned) -> tuple[str | None, Any, Any]:
    """(name, topic id, matching key) of a Produce or Fetch topic element: by id from v13 on."""
    if v >= 13:
        return learned.topic(t.topic_id), t.topic_id, t.topic_id
    name = getattr(t, name_field)
    return name, None, name


_I32 = struct.Struct(">i")


def records_in(records: Any) -> int | None:
    """The records of a Produce request's records field, summed from each v2 batch header's count at
    its fixed offset (no batch object built); None when the field holds anything else (a legacy
    message set, a partial or malformed batch), which ``produce_partitions`` reads in full."""
    if records is None:
        return 0
    return batch_records(records, 0, len(records))


def produced_records(entry: InFlight) -> int | None:
    """The records of a Produce request in the partitions its answer reports no error for: what
    metrics count, as ``produce_partitions`` would give it, from batch headers' fixed offsets; None
    when a records field (or a streamed request) needs ``produce_partitions``."""
    if entry.produced is not None and entry.response is None:
        return entry.produced       # relayed: read from its bytes (``kproxy.proxy.produce_bytes``)
    req = entry.request
    if req is None or entry.records_facts is not None:
        return None
    by_id = entry.api_version >= 13
    failed: set[tuple[Any, int]] = set()
    resp = entry.response
    if resp is not None and resp.api_key == PRODUCE:
        for t in resp.body.responses:
            for pr in t.partition_responses:
                if pr.error_code:
                    failed.add((t.topic_id if by_id else t.name, pr.index))
    total = 0
    for t in req.body.topic_data:
        for pd in t.partition_data:
            n = records_in(pd.records)
            if n is None:
                return None
            if not failed or ((t.topic_id if by_id else t.name), pd.index) not in failed:
                total += n
    return total


def fetched_records(entry: InFlight) -> int | None:
    """The records of a Fetch exchange relayed both ways, read from its bytes (``kproxy.proxy.fetch_bytes``:
    what ``fetch_partitions`` counts); None for one that was decoded."""
    return entry.fetched if entry.response is None else None


def produce_partitions(entry: InFlight, learned: Learned) -> list[PartitionFacts]:
    req = entry.request
    assert req is not None
    v = entry.api_version
    answers: dict[tuple[Any, int], Any] = {}
    resp = entry.response
    if resp is not None and resp.api_key == PRODUCE:
        for t in resp.body.responses:
            key = _topic(t, v, "name", learned)[2]
            for pr in t.partition_responses:
                answers[(key, pr.index)] = pr
    out = []
    # A streamed request's records went to the broker as they came: their batch headers were noted
    # on the way, one RecordsFacts per records field, in the request's order.
    streamed = iter(entry.records_facts) if entry.records_facts is not None else None
    for t in req.body.topic_data:
        name, tid, key = _topic(t, v, "name", learned)
        for pd in t.partition_data:
            p = PartitionFacts(name, tid, pd.index)
            if streamed is not None:
                read_streamed(p, next(streamed))
            else:
                _read_batches(p, pd.records)
            pr = answers.get((key, pd.index))
            if pr is not None:
                p.error_code = pr.error_code
                if pr.error_code == 0 and pr.base_offset >= 0 and p.records:
                    p.first_offset = pr.base_offset
                    p.last_offset = pr.base_offset + p.records - 1
            out.append(p)
    return out


def fetch_partitions(entry: InFlight, learned: Learned) -> list[PartitionFacts]:
    req, resp = entry.request, entry.response
    assert req is not None
    if resp is None or resp.api_key != FETCH:
        return []
    v = entry.api_version
    asked: dict[tuple[Any, int], int] = {}
    for t in req.body.topics:
        key = _topic(t, v, "topic", learned)[2]
        for fp in t.partitions:
            asked[(key, fp.partition)] = fp.fetch_offset
    out = []
    # A streamed answer's records went to the client as they came: their batch headers were noted
    # on the way, one RecordsFacts per records field, in the answer's order.
    streamed = iter(entry.records_facts) if entry.records_facts is not None else None
    for t in resp.body.responses:
        name, tid, key = _topic(t, v, "topic", learned)
        for pd in t.partitions:
            p = PartitionFacts(name, tid, pd.partition_index)
            p.error_code = pd.error_code
            from_offset = asked.get((key, pd.partition_index), -1)
            if streamed is not None:
                p.first_offset, p.last_offset = read_streamed(p, next(streamed), from_offset)
            else:
                p.first_offset, p.last_offset = _read_batches(p, pd.records, from_offset)
            out.append(p)
    return out


# ---------------------------------------------------------------------------------------------
# Error codes anywhere in a response, found from the schema (fields named error_code)

_ERROR_PLANS: dict[tuple[int, int], tuple[bool, tuple]] = {}


def _plan(struct: StructSpec, version: int) -> tuple:
    """((field, is_array, subplan), ...) leading to nested error_code fields; ``()`` when none."""
    out = []
    for f in struct.fields:
        if f.struct is not None and version in f.versions:
            sub = _plan(f.struct, version)
            has_own = any(g.name == "error_code" and version in g.versions for g in f.struct.fields)
            if sub or has_own:
                out.append((f.name, f.array, has_own, sub))
    return tuple(out)


def _error_plan(api_key: int, version: int) -> tuple[bool, tuple]:
    plan = _ERROR_PLANS.get((api_key, version))
    if plan is None:
        msg = api_by_key(api_key).response
        assert msg is not None
        top = any(f.name == "error_code" and version in f.versions for f in msg.root.fields)
        plan = _ERROR_PLANS[(api_key, version)] = (top, _plan(msg.root, version))
    return plan


def _walk_errors(obj: Any, plan: tuple, counts: dict[int, int]) -> None:
    for name, is_array, has_own, sub in plan:
        value = getattr(obj, name)
        if value is None:
            continue
        for item in (value if is_array else (value,)):
            if has_own:
                code = item.error_code
                if code:
                    counts[code] = counts.get(code, 0) + 1
            if sub:
                _walk_errors(item, sub, counts)


def response_errors(entry: InFlight) -> tuple[int, dict[int, int]]:
    """(top-level error code, {nested error code: how many elements carried it}) of the response."""
    resp = entry.response
    if resp is None:
        return 0, {}
    try:
        top, plan = _error_plan(resp.api_key, resp.api_version)
    except (KeyError, ValueError):
        return 0, {}
    counts: dict[int, int] = {}
    _walk_errors(resp.body, plan, counts)
    return (resp.body.error_code if top else 0), counts


# ---------------------------------------------------------------------------------------------


class Exchange:
    """One completed request as telemetry sees it; the parts are computed on first use."""

    __slots__ = ("_errors", "_partitions", "_topics", "api", "ctx", "entry", "learned", "virtual_cluster")

    def __init__(self, entry: InFlight, ctx: ConnectionContext, learned: Learned,
                 virtual_cluster: str = DEFAULT_NAME) -> None:
        self.entry = entry
        self.ctx = ctx
        self.learned = learned
        self.virtual_cluster = virtual_cluster       # whose listener the request came in on
        self.api = api_name(entry.api_key)
        self._topics: list[str] | None = None
        self._partitions: list[PartitionFacts] | None = None
        self._errors: tuple[int, dict[int, int]] | None = None

    @property
    def topics(self) -> list[str]:
        if self._topics is None:
            self._topics = self._find_topics()
        return self._topics

    def _find_topics(self) -> list[str]:
        entry = self.entry
        req = entry.request
        if req is None:
            return []
        try:
            names = collect(req.body, entry.api_key, entry.api_version, "request", "topic")
            ids = collect(req.body, entry.api_key, entry.api_version, "request", "topic_id")
        except ValueError:
            return []
        for tid in ids:
            name = self.learned.topic(tid)
            if name is not None:
                names.append(name)
        return list(dict.fromkeys(names))

    @property
    def partitions(self) -> list[PartitionFacts]:
        if self._partitions is None:
            entry = self.entry
            if entry.request is None:
                self._partitions = []
            elif entry.api_key == PRODUCE:
                self._partitions = produce_partitions(entry, self.learned)
            elif entry.api_key == FETCH:
                self._partitions = fetch_partitions(entry, self.learned)
            else:
                self._partitions = []
        return self._partitions

    @property
    def errors(self) -> tuple[int, dict[int, int]]:
        if self._errors is None:
            self._errors = response_errors(self.entry)
        return self._errors

    @property
    def error(self) -> str | None:
        """Kafka's name of the first non-zero error, top level or nested; None when all is well."""
        top, nested = self.errors
        if top:
            return error_name(top)
        for code in nested:
            return error_name(code)
        return None

    @property
    def group(self) -> str | None:
        entry = self.entry
        req = entry.request
        if req is not None:
            try:
                groups = collect(req.body, entry.api_key, entry.api_version, "request", "group")
            except ValueError:
                groups = []
            if groups:
                return str(groups[0])
        return self.learned.group_of(self.ctx)

    @property
    def transactional_id(self) -> str | None:
        entry = self.entry
        req = entry.request
        if req is None:
            return None
        try:
            txns = collect(req.body, entry.api_key, entry.api_version, "request", "txn")
        except ValueError:
            return None
        return str(txns[0]) if txns else None

    @property
    def acks(self) -> int | None:
        req = self.entry.request
        return req.body.acks if req is not None and self.entry.api_key == PRODUCE else None

    @property
    def max_wait_ms(self) -> int | None:
        req = self.entry.request
        return req.body.max_wait_ms if req is not None and self.entry.api_key == FETCH else None

    def split_ms(self) -> tuple[float, float | None, float | None, float | None]:
        """(duration, queued, broker, return) in milliseconds; None where a step did not happen."""
        e = self.entry
        end = e.finished_at if e.finished_at is not None else e.started
        queued = broker = ret = None
        if e.forwarded_at is not None:
            queued = (e.forwarded_at - e.started) * 1000
            if e.answered_at is not None:
                broker = (e.answered_at - e.forwarded_at) * 1000
        if e.answered_at is not None and e.finished_at is not None:
            ret = (e.finished_at - e.answered_at) * 1000
        return (end - e.started) * 1000, queued, broker, ret

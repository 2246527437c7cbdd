"""Fleet quotas over the Kafka cluster: publishes this process's budget use to the coordination topic,
reads the other processes' reports back and sets each budget's share (``kproxy.quota.fleet``).

It runs as one background task with connections of its own (kproxy's own codec over the upstream
settings), out of the data path: a request never waits on it, and every failure (broker down, leader
moved, topic deleted, ACLs missing) ends in the static share, logged once per switch, and a retry.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from kproxy.config import CoordinationConfig, ProxyConfig
from kproxy.protocol.errors import KProxyError
from kproxy.protocol.framing import FrameReader
from kproxy.protocol.messages import Request, body_class, decode_response, encode_request_frame
from kproxy.protocol.records import Compression, RecordBatch, build_batch, iter_batches
from kproxy.quota.budgets import Budget, BudgetKey
from kproxy.quota.engine import QuotaFilter
from kproxy.quota.fleet import FleetShares, Load, decode_record, record_key, record_value
from kproxy.server.transport import Transport
from kproxy.server.upstream import UpstreamSettings, open_upstream, renew_login

log = logging.getLogger("kproxy.quota.coordination")

API_VERSIONS, METADATA, PRODUCE, FETCH, LIST_OFFSETS, CREATE_TOPICS = 18, 3, 0, 1, 2, 19
# The versions used (at most these, at least the minimum; the broker's range decides): all take topic
# names (no topic ids) and v2 record batches, and their fields are the same across each range.
_WANTED = {METADATA: (1, 9), PRODUCE: (3, 8), FETCH: (4, 11), LIST_OFFSETS: (1, 5), CREATE_TOPICS: (2, 5)}
_LATEST = -1
# Errors after which the leader is looked up again (the partition moved, the broker restarted).
_RELOCATE = {3: "UNKNOWN_TOPIC_OR_PARTITION", 5: "LEADER_NOT_AVAILABLE", 6: "NOT_LEADER_OR_FOLLOWER",
             7: "REQUEST_TIMED_OUT", 15: "COORDINATOR_NOT_AVAILABLE", 19: "NOT_ENOUGH_REPLICAS",
             74: "FENCED_LEADER_EPOCH", 75: "UNKNOWN_LEADER_EPOCH", 13: "NETWORK_EXCEPTION"}
_DENIED = {29: "TOPIC_AUTHORIZATION_FAILED", 31: "CLUSTER_AUTHORIZATION_FAILED"}
_TOPIC_EXISTS = 36
_RECORDS_PER_BATCH = 2000       # a batch of these stays far below a broker's default 1 MB message limit
_FETCH_BYTES = 4 * 1024 * 1024
_FETCH_WAIT_MS = 50


class CoordinationError(KProxyError):
    """The coordination topic cannot be used as configured (refused, missing, unsupported)."""


def acls_needed(topic: str) -> str:
    return (f"the kproxy principal needs Describe, Read and Write on topic {topic} (and Create on it, or on "
            f"the cluster, for kproxy to create it), e.g. kafka-acls --add --allow-principal User:<kproxy> "
            f"--operation Describe --operation Read --operation Write --operation Create --topic {topic}")


def instance_id() -> str:
    """This process's name in its records: host, pid and a random tag (pids repeat across pods)."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"


class _Link:
    """One connection to one broker, sequential request and response."""

    def __init__(self, transport: Transport, address: tuple[str, int], max_frame: int,
                 renew_ahead: float = 0.0) -> None:
        self.transport = transport
        self.renew_ahead = renew_ahead      # the longest between two calls: the login is renewed that early
        self.address = address
        self.reader = FrameReader(max_frame)
        self.versions: dict[int, int] = {}
        self._correlation = 0
        self.sent = self.received = 0

    async def call(self, api_key: int, body: Any, timeout: float) -> Any:
        # kproxy's login on this connection is renewed before its session ends (KIP-368), as on every other.
        await renew_login(self.transport, self.renew_ahead)
        self._correlation = (self._correlation + 1) & 0x7FFFFFFF
        version = self.versions.get(api_key, 0)
        req = Request.build(api_key, version, self._correlation, "kproxy-coordination", body)
        with trio.fail_after(timeout):
            frame = encode_request_frame(req)
            self.sent += sum(len(b) for b in frame)
            await self.transport.send(frame)
            while (got := self.reader.next_frame()) is None:
                n = await self.transport.recv_into(self.reader.recv_buffer())
                if n == 0:
                    raise OSError(f"broker {self.address[0]}:{self.address[1]} closed the connection")
                self.reader.received(n)
        self.received += len(got) + 4
        resp = decode_response(got, api_key, version)
        if resp.correlation_id != self._correlation:
            raise OSError("broker answered out of order")
        return resp.body

    async def negotiate(self, timeout: float) -> None:
        av = await self.call(API_VERSIONS, body_class(API_VERSIONS, "request")(), timeout)
        if av.error_code:
            raise CoordinationError(f"ApiVersions refused (error {av.error_code})")
        theirs = {e.api_key: (e.min_version, e.max_version) for e in av.api_keys}
        for api, (lo, hi) in _WANTED.items():
            if api not in theirs or theirs[api][1] < lo or theirs[api][0] > hi:
                raise CoordinationError(f"the broker offers no version of API {api} that fleet quotas use "
                                        f"({lo}-{hi}); it offers {theirs.get(api)}")
            self.versions[api] = min(hi, theirs[api][1])

    def close(self) -> None:
        self.transport.close()


class Coordinator:
    """Publishes and reads the coordination topic every ``publish_interval_ms`` and sets the share of
    every active budget of ``quotas`` (see the module docstring). ``wall`` and ``clock`` are the
    record timestamps' clock and the quota engine's."""

    def __init__(self, config: ProxyConfig, quotas: QuotaFilter, static_share: float, *,
                 instance: str | None = None, wall: Callable[[], float] = time.time,
                 clock: Callable[[], float] = trio.current_time,
                 opener: Callable[[str, int], Awaitable[Transport]] | None = None) -> None:
        coord = config.quota.coordinated
        assert coord is not None
        self.settings: CoordinationConfig = coord
        self.config = config
        self.quotas = quotas
        self.instance = instance or instance_id()
        self.shares = FleetShares(coord.fleet, self.instance, static_share, coord.stale_after_s)
        self.static_share = static_share
        self.wall = wall
        self.clock = clock
        self.interval = coord.publish_interval_ms / 1000.0
        upstream = config.upstream
        # How a broker connection is opened: the server passes its own (the same TLS, and SASL when it
        # exists, as every other upstream connection); alone, open_upstream with the upstream settings
        # (SASL included).
        if opener is None:
            settings = UpstreamSettings.from_config(upstream)
            self.opener: Callable[[str, int], Awaitable[Transport]] = (
                lambda host, port: open_upstream(host, port, settings))
        else:
            self.opener = opener
        self.timeout = min(upstream.request_timeout_s, max(coord.stale_after_s / 2, self.interval))
        self.up = False                     # as last logged and exported
        self.switches = 0
        self.published = self.read = 0      # records
        self.bytes_out = self.bytes_in = 0
        self.active = 0                     # budgets reported in the last interval
        self.last_error: str | None = None
        self._partition = 0
        self._offset: int | None = None     # the next offset to read; None: not reading yet
        self._gone_at: float | None = None  # when the topic was found deleted
        self._link: _Link | None = None

    # -- the share in force

    def _set_up(self, up: bool, why: str) -> None:
        if up == self.up:
            return
        self.up = up
        self.switches += 1
        c = self.settings
        if up:
            log.info("fleet quotas: coordinated through topic %s (fleet %r, instance %s); shares follow demand",
                     c.topic, c.fleet, self.instance)
        else:
            log.warning("fleet quotas: falling back to the static share (%.3g of each limit): %s",
                        self.static_share, why)

    def apply(self, loads: list[tuple[BudgetKey, Budget, Load]] | None = None) -> None:
        """Set the share of every active budget (``loads``, measured now if not given) from what was
        read; the static share while down."""
        now_wall = self.wall()
        up = self.shares.up(now_wall)
        if not up:
            for _, budget in list(self.quotas.budgets.items()):
                budget.share = self.static_share
            self._set_up(False, self.last_error or f"no own record read back for {self.settings.stale_after_s:g}s")
            return
        if loads is None:
            loads = self.quotas.loads(self.clock())
        for key, budget, load in loads:
            budget.share = self.shares.share(key, load.demand, now_wall)
        self.shares.forget(now_wall, (k for k, _, _ in loads))
        self._set_up(True, "")

    def newest_peer_age(self) -> float | None:
        return self.shares.newest_peer_age(self.wall())

    # -- the loop

    async def run(self) -> None:
        """Run until cancelled: connect, make sure of the topic, then publish, read and apply every
        interval; on any failure fall back, wait and start again."""
        backoff = self.interval
        while True:
            try:
                await self._session()
            except (OSError, trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError,
                    KProxyError) as e:
                why = str(e) or type(e).__name__
                if isinstance(e, trio.TooSlowError):
                    why = f"no answer within {self.timeout:g}s"
                if why != self.last_error:
                    (log.error if isinstance(e, CoordinationError) else log.info)(
                        "fleet quotas: coordination topic %s: %s", self.settings.topic, why)
                self.last_error = why
            except Exception as e:
                # A bug here must cost the fleet share, never the proxy: fall back and try again.
                why = f"{type(e).__name__}: {e}"
                if why != self.last_error:
                    log.exception("fleet quotas: coordination failed unexpectedly")
                self.last_error = why
            finally:
                self._close()
            self.apply()
            await trio.sleep(backoff)
            backoff = min(backoff * 2, max(self.settings.stale_after_s, self.interval))
            if self.shares.up(self.wall()):
                backoff = self.interval

    async def watch(self) -> None:
        """Fall back on time even while the loop waits on a silent broker: every interval, apply."""
        while True:
            await trio.sleep(self.interval)
            if self.up and not self.shares.up(self.wall()):
                self.apply()

    def _close(self) -> None:
        if self._link is not None:
            self.bytes_out += self._link.sent
            self.bytes_in += self._link.received
            self._link.close()
            self._link = None

    async def _session(self) -> None:
        self._link = await self._leader()
        if self._offset is None:
            self._offset = await self._start_offset()
        self.last_error = None
        while True:
            due = trio.current_time() + self.interval
            await self._still_there()
            loads = self.quotas.loads(self.clock())
            self.shares.interest = {key for key, _, _ in loads}
            await self._publish(loads)
            await self._read()
            self.apply(loads)
            await trio.sleep_until(due)

    async def _open(self, host: str, port: int) -> _Link:
        t = await self.opener(host, port)
        link = _Link(t, (host, port), self.config.limits.max_frame_size, renew_ahead=self.interval)
        try:
            await link.negotiate(self.timeout)
        except BaseException:
            link.close()
            raise
        return link

    async def _bootstrap(self) -> _Link:
        last: Exception | None = None
        for hp in self.config.upstream.bootstrap_servers:
            try:
                return await self._open(hp.host, hp.port)
            except (OSError, trio.TooSlowError) as e:
                last = e
        raise OSError(f"no bootstrap server answered ({last or 'none configured'})")

    async def _metadata(self, link: _Link) -> Any:
        meta: Any = body_class(METADATA, "request")
        body = meta(topics=[meta.MetadataRequestTopic(name=self.settings.topic)], allow_auto_topic_creation=False)
        return await link.call(METADATA, body, self.timeout)

    async def _leader(self) -> _Link:
        """A link to the leader of this fleet's partition, creating the topic first if it is missing."""
        link: _Link | None = await self._bootstrap()
        assert link is not None
        try:
            for attempt in range(10):
                md = await self._metadata(link)
                (topic,) = [t for t in md.topics if t.name == self.settings.topic] or [None]
                code = topic.error_code if topic is not None else 3
                if code in _DENIED:
                    raise CoordinationError(f"{_DENIED[code]}: {acls_needed(self.settings.topic)}")
                if code == 3:
                    await self._topic_missing(link)
                    continue
                if code or not topic.partitions:
                    await trio.sleep(min(0.1 * (attempt + 1), 1.0))
                    continue
                count = len(topic.partitions)
                self._partition = zlib.crc32(self.settings.fleet.encode()) % count
                part = next(p for p in topic.partitions if p.partition_index == self._partition)
                if part.error_code or part.leader_id < 0:
                    await trio.sleep(min(0.1 * (attempt + 1), 1.0))
                    continue
                brokers = {b.node_id: (b.host, b.port) for b in md.brokers}
                address = brokers.get(part.leader_id)
                if address is None:
                    raise OSError(f"leader {part.leader_id} of {self.settings.topic} is not among the brokers")
                if address == link.address:
                    leader, link = link, None
                    return leader
                return await self._open(*address)
            raise OSError(f"topic {self.settings.topic} has no leader yet")
        finally:
            if link is not None:
                self.bytes_out += link.sent
                self.bytes_in += link.received
                link.close()

    async def _still_there(self) -> None:
        """Ask the leader about the topic each interval: a deleted topic or a moved leader ends the
        session at once (tansu even keeps accepting records for a topic it has deleted)."""
        assert self._link is not None
        md = await self._metadata(self._link)
        topic = next((t for t in md.topics if t.name == self.settings.topic), None)
        code = topic.error_code if topic is not None else 3
        if code == 3 or topic is None:
            await self._topic_missing(self._link)
            raise OSError(f"topic {self.settings.topic} is gone")
        self._check(code, "Metadata")
        part = next((p for p in topic.partitions if p.partition_index == self._partition), None)
        brokers = {b.node_id: (b.host, b.port) for b in md.brokers}
        if part is None or brokers.get(part.leader_id) != self._link.address:
            raise OSError(f"the leader of {self.settings.topic} moved")

    async def _topic_missing(self, link: _Link) -> None:
        """Create the topic; but one that was in use and went away (deleted) is created again only
        ``stale_after_s`` later, so every process of the fleet sees it gone and falls back alike
        instead of the quickest one recreating it under the others."""
        if self._offset is not None:
            self._offset = None
            self._gone_at = self.wall()
            self.shares.own_seen_at = None      # fall back now: what was read belongs to the old topic
            self.apply()
        if self._gone_at is not None:
            wait = self._gone_at + self.settings.stale_after_s - self.wall()
            if wait > 0:
                raise OSError(f"topic {self.settings.topic} is gone (deleted?); kproxy creates it again "
                              f"{self.settings.stale_after_s:g}s after it went")
        await self._create(link)
        self._gone_at = None

    async def _create(self, link: _Link) -> None:
        c = self.settings
        ct: Any = body_class(CREATE_TOPICS, "request")
        configs = [ct.CreatableTopicConfig(name="cleanup.policy", value="compact"),
                   ct.CreatableTopicConfig(name="retention.ms", value=str(c.retention_ms)),
                   ct.CreatableTopicConfig(name="segment.ms", value=str(c.retention_ms))]
        body = ct(topics=[ct.CreatableTopic(name=c.topic, num_partitions=c.partitions,
                                            replication_factor=c.replication_factor, assignments=[],
                                            configs=configs)], timeout_ms=int(self.timeout * 1000))
        resp = await link.call(CREATE_TOPICS, body, self.timeout)
        result = resp.topics[0]
        if result.error_code in _DENIED:
            raise CoordinationError(f"cannot create topic {c.topic} ({_DENIED[result.error_code]}); create it "
                                    f"(1 partition, cleanup.policy=compact) or grant the ACLs: {acls_needed(c.topic)}")
        if result.error_code not in (0, _TOPIC_EXISTS):
            raise CoordinationError(f"cannot create topic {c.topic}: error {result.error_code} "
                                    f"{getattr(result, 'error_message', None) or ''}".rstrip())
        if result.error_code == 0:
            log.info("fleet quotas: created topic %s (%d partition(s), compacted, retention %d ms)",
                     c.topic, c.partitions, c.retention_ms)

    async def _list_offset(self, timestamp: int) -> int:
        assert self._link is not None
        lo: Any = body_class(LIST_OFFSETS, "request")
        body = lo(replica_id=-1, isolation_level=0, topics=[lo.ListOffsetsTopic(
            name=self.settings.topic, partitions=[lo.ListOffsetsPartition(partition_index=self._partition,
                                                                          timestamp=timestamp)])])
        resp = await self._link.call(LIST_OFFSETS, body, self.timeout)
        part = _partition_of(resp.topics, "name", "partition_index", self.settings.topic, self._partition)
        if part is None:
            raise OSError("ListOffsets answer names no partition")
        self._check(part.error_code, "ListOffsets")
        return int(part.offset)

    async def _start_offset(self) -> int:
        """Where reading starts: the first record younger than ``stale_after_s`` (older ones are stale
        anyway), else the end."""
        since = int((self.wall() - self.settings.stale_after_s) * 1000)
        offset = await self._list_offset(since)
        return offset if offset >= 0 else await self._list_offset(_LATEST)

    def _check(self, code: int, what: str) -> None:
        if not code:
            return
        if code in _DENIED:
            raise CoordinationError(f"{what} refused ({_DENIED[code]}): {acls_needed(self.settings.topic)}")
        name = _RELOCATE.get(code, f"error {code}")
        raise OSError(f"{what} on {self.settings.topic}: {name}")

    async def _publish(self, loads: list[tuple[BudgetKey, Budget, Load]]) -> None:
        assert self._link is not None
        c = self.settings
        ts = int(self.wall() * 1000)
        records = [(record_key(c.fleet, key[0], key[1], self.instance), record_value(load), (), ts)
                   for key, _, load in loads if load.demand > 0]
        self.active = len(records)
        if not records:
            # Nothing to report: a heartbeat keeps "read back" (coordination up) true.
            records = [(record_key(c.fleet, "", "", self.instance), b'{"r":0,"d":0}', (), ts)]
        pr: Any = body_class(PRODUCE, "request")
        batches = b"".join(build_batch(records[i:i + _RECORDS_PER_BATCH], compression=Compression.GZIP)
                           for i in range(0, len(records), _RECORDS_PER_BATCH))
        body = pr(transactional_id=None, acks=1, timeout_ms=int(self.timeout * 1000), topic_data=[
            pr.TopicProduceData(name=c.topic, partition_data=[pr.PartitionProduceData(
                index=self._partition, records=batches)])])
        resp = await self._link.call(PRODUCE, body, self.timeout)
        part = _partition_of(resp.responses, "name", "index", c.topic, self._partition, "partition_responses")
        if part is None:
            raise OSError("Produce answer names no partition")
        self._check(part.error_code, "Produce")
        self.published += len(records)

    async def _read(self) -> None:
        """Read from the offset reached to the end (a few fetches at most per interval)."""
        assert self._link is not None and self._offset is not None
        fe: Any = body_class(FETCH, "request")
        for _ in range(8):
            # Not max_wait_ms=0: tansu answers that with no partitions at all, even with records there.
            body = fe(replica_id=-1, max_wait_ms=_FETCH_WAIT_MS, min_bytes=1, max_bytes=_FETCH_BYTES, isolation_level=0,
                      session_id=0, session_epoch=-1, topics=[fe.FetchTopic(topic=self.settings.topic, partitions=[
                          fe.FetchPartition(partition=self._partition, fetch_offset=self._offset,
                                            partition_max_bytes=_FETCH_BYTES)])],
                      forgotten_topics_data=[], rack_id="")
            resp = await self._link.call(FETCH, body, self.timeout)
            self._check(getattr(resp, "error_code", 0), "Fetch")
            part = _partition_of(resp.responses, "topic", "partition_index", self.settings.topic, self._partition)
            if part is None:
                return          # nothing for this partition this time (tansu answers an empty list)
            if part.error_code == 1:        # OFFSET_OUT_OF_RANGE: the log was truncated or recreated
                self._offset = await self._list_offset(_LATEST)
                return
            self._check(part.error_code, "Fetch")
            before = self._offset
            self._take(part.records)
            if self._offset >= part.high_watermark or self._offset == before:
                return

    def _take(self, records: Any) -> None:
        if not records:
            return
        for batch in iter_batches(records):
            if not isinstance(batch, RecordBatch):
                continue        # a legacy message set: nothing kproxy wrote
            if batch.is_control:
                self._offset = max(self._offset or 0, batch.last_offset + 1)
                continue
            for r in batch.records():
                if r.offset < (self._offset or 0):
                    continue
                report = decode_record(r.key, r.value, r.timestamp / 1000.0)
                if report is not None:
                    self.shares.observe(report)
                    self.read += 1
            self._offset = max(self._offset or 0, batch.last_offset + 1)

    # -- what /metrics shows

    def snapshot(self) -> dict[str, Any]:
        link = self._link
        out, into = (link.sent, link.received) if link is not None else (0, 0)
        return {"up": self.up, "peer_age_s": self.newest_peer_age(), "switches": self.switches,
                "published": self.published, "read": self.read, "bytes_out": self.bytes_out + out,
                "bytes_in": self.bytes_in + into, "active": self.active,
                "peers": self.shares.peer_count(self.wall())}



def _partition_of(topics: Any, name_field: str, index_field: str, topic: str, index: int,
                  parts_field: str = "partitions") -> Any:
    """The answer for one partition in a response's topics array, or None if it is not there."""
    for t in topics or ():
        if getattr(t, name_field) != topic:
            continue
        for p in getattr(t, parts_field) or ():
            if getattr(p, index_field) == index:
                return p
    return None

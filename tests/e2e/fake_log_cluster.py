"""A fake Kafka cluster that also keeps a log: the multi-broker ``FakeCluster`` plus one topic whose
partition leader can be moved, with Produce, Fetch, ListOffsets and CreateTopics served from memory,
and topic ACLs that can be switched to refuse.

It stands in for what tansu cannot show: a partition leader moving to another broker (tansu is a
single node), and a broker refusing a principal by ACL (tansu has none). Everything it answers is
what Apache Kafka answers in those cases: NOT_LEADER_OR_FOLLOWER from a broker that is not the
leader, TOPIC_AUTHORIZATION_FAILED on Metadata and Produce for a refused topic.
"""

from __future__ import annotations

import struct
import threading
from typing import Any

from kproxy.protocol.messages import body_class, decode_request
from kproxy.protocol.records import RecordBatch, iter_batches
from tests.e2e.fake_cluster import (
    API_RANGES,
    API_VERSIONS,
    HOST,
    METADATA,
    NOT_LEADER_OR_FOLLOWER,
    PRODUCE,
    UNKNOWN_TOPIC_OR_PARTITION,
    FakeBroker,
    FakeCluster,
    Received,
)

FETCH, LIST_OFFSETS, CREATE_TOPICS = 1, 2, 19
TOPIC_AUTHORIZATION_FAILED, TOPIC_ALREADY_EXISTS = 29, 36
LOG_RANGES = {**API_RANGES, FETCH: (4, 11), LIST_OFFSETS: (1, 5), CREATE_TOPICS: (2, 5)}
_BASE_OFFSET = struct.Struct(">q")


class LogBroker(FakeBroker):
    cluster: LogCluster

    def _api_versions(self, error_code: int) -> Any:
        cls: Any = body_class(API_VERSIONS, "response")
        return cls(error_code=error_code, api_keys=[
            cls.ApiVersion(api_key=k, min_version=lo, max_version=hi) for k, (lo, hi) in sorted(LOG_RANGES.items())])

    def _answer(self, frame: bytes) -> bytes | None:
        req = decode_request(frame)
        c = self.cluster
        if req.api_key == METADATA and any(t.name == c.topic for t in req.body.topics or ()):
            self._record(Received(req.api_key, req.api_version, req.client_id, req.correlation_id))
            return self._encode(METADATA, req.api_version, req.correlation_id, self._log_metadata(req.body))
        if req.api_key == PRODUCE and req.body.topic_data and req.body.topic_data[0].name == c.topic:
            produced = tuple((t.name, p.index, bytes(p.records or b""))
                             for t in req.body.topic_data for p in t.partition_data)
            self._record(Received(req.api_key, req.api_version, req.client_id, req.correlation_id, produced))
            return self._encode(PRODUCE, req.api_version, req.correlation_id, self._log_produce(req.body))
        handler = {FETCH: self._fetch, LIST_OFFSETS: self._list_offsets, CREATE_TOPICS: self._create}.get(req.api_key)
        if handler is None:
            return super()._answer(frame)
        self._record(Received(req.api_key, req.api_version, req.client_id, req.correlation_id))
        return self._encode(req.api_key, req.api_version, req.correlation_id, handler(req.body))

    def _code(self) -> int:
        c = self.cluster
        if c.denied:
            return TOPIC_AUTHORIZATION_FAILED
        if not c.exists:
            return UNKNOWN_TOPIC_OR_PARTITION
        return 0 if c.leader == self.node_id else NOT_LEADER_OR_FOLLOWER

    def _log_metadata(self, body: Any) -> Any:
        cls: Any = body_class(METADATA, "response")
        c = self.cluster
        code = TOPIC_AUTHORIZATION_FAILED if c.denied else 0 if c.exists else UNKNOWN_TOPIC_OR_PARTITION
        partitions = [cls.MetadataResponsePartition(error_code=0, partition_index=0, leader_id=c.leader,
                                                    leader_epoch=c.epoch, replica_nodes=[c.leader],
                                                    isr_nodes=[c.leader], offline_replicas=[])] if code == 0 else []
        brokers = [cls.MetadataResponseBroker(node_id=n, host=HOST, port=b.port) for n, b in c.brokers.items()]
        return cls(brokers=brokers, cluster_id="fake-cluster", controller_id=c.controller_id,
                   topics=[cls.MetadataResponseTopic(error_code=code, name=c.topic, partitions=partitions)])

    def _log_produce(self, body: Any) -> Any:
        cls: Any = body_class(PRODUCE, "response")
        code, offset = self._code(), -1
        p = body.topic_data[0].partition_data[0]
        if code == 0:
            offset = self.cluster.append(bytes(p.records))
        return cls(responses=[cls.TopicProduceResponse(name=self.cluster.topic, partition_responses=[
            cls.PartitionProduceResponse(index=p.index, error_code=code, base_offset=offset, log_append_time_ms=-1,
                                         log_start_offset=0, record_errors=[], error_message=None)])],
            throttle_time_ms=0)

    def _fetch(self, body: Any) -> Any:
        cls: Any = body_class(FETCH, "response")
        c = self.cluster
        p = body.topics[0].partitions[0]
        code = self._code()
        records, hw = (c.read_from(p.fetch_offset), c.end) if code == 0 else (b"", -1)
        return cls(throttle_time_ms=0, error_code=0, session_id=0, responses=[cls.FetchableTopicResponse(
            topic=c.topic, partitions=[cls.PartitionData(partition_index=0, error_code=code, high_watermark=hw,
                                                         last_stable_offset=hw, log_start_offset=0,
                                                         aborted_transactions=None, records=records)])])

    def _list_offsets(self, body: Any) -> Any:
        cls: Any = body_class(LIST_OFFSETS, "response")
        c = self.cluster
        p = body.topics[0].partitions[0]
        code = self._code()
        offset = c.offset_for(p.timestamp) if code == 0 else -1
        return cls(throttle_time_ms=0, topics=[cls.ListOffsetsTopicResponse(name=c.topic, partitions=[
            cls.ListOffsetsPartitionResponse(partition_index=0, error_code=code, timestamp=-1, offset=offset,
                                             leader_epoch=c.epoch)])])

    def _create(self, body: Any) -> Any:
        cls: Any = body_class(CREATE_TOPICS, "response")
        c = self.cluster
        t = body.topics[0]
        code = TOPIC_AUTHORIZATION_FAILED if c.denied else TOPIC_ALREADY_EXISTS if c.exists else 0
        if code == 0:
            c.exists = True
            c.created_with = {cfg.name: cfg.value for cfg in t.configs}
        return cls(throttle_time_ms=0, topics=[cls.CreatableTopicResult(name=t.name, error_code=code,
                                                                        error_message=None)])


class LogCluster(FakeCluster):
    """``FakeCluster`` whose brokers also serve ``topic`` (one partition, led by ``leader``), created on
    request; ``denied`` refuses it by ACL."""

    def __init__(self, topic: str, node_ids: tuple[int, ...] = (1, 2)) -> None:
        self.topic = topic
        self.exists = False
        self.denied = False
        self.leader = node_ids[0]
        self.epoch = 0
        self.created_with: dict[str, str | None] = {}
        self._log: list[tuple[int, int, int, bytes]] = []       # (base offset, last offset, max timestamp, batch)
        self._log_lock = threading.Lock()
        # FakeCluster.__init__ starts plain FakeBrokers; replace them before anything connects.
        super().__init__(node_ids, coordinator_id=node_ids[0])
        self.stop()
        self.brokers = {n: LogBroker(self, n) for n in node_ids}
        self.start()

    @property
    def end(self) -> int:
        with self._log_lock:
            return self._log[-1][1] + 1 if self._log else 0

    def move_leader(self, node_id: int) -> None:
        self.leader = node_id
        self.epoch += 1

    def append(self, records: bytes) -> int:
        out = bytearray()
        with self._log_lock:
            base = self._log[-1][1] + 1 if self._log else 0
            first = base
            for batch in iter_batches(records):
                assert isinstance(batch, RecordBatch)
                raw = bytearray(batch.raw)
                _BASE_OFFSET.pack_into(raw, 0, base)
                last = base + batch.last_offset_delta
                self._log.append((base, last, batch.max_timestamp, bytes(raw)))
                out += raw
                base = last + 1
        return first

    def read_from(self, offset: int) -> bytes:
        with self._log_lock:
            return b"".join(raw for _, last, _, raw in self._log if last >= offset)

    def offset_for(self, timestamp: int) -> int:
        with self._log_lock:
            end = self._log[-1][1] + 1 if self._log else 0
            if timestamp == -1:
                return end
            if timestamp == -2:
                return 0
            return next((base for base, _, ts, _ in self._log if ts >= timestamp), -1)

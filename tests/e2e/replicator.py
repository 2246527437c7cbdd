"""A stand-in for MirrorMaker 2 between two test brokers (Apache Kafka, and with it MM2, cannot be
installed here). It does what MM2 does that kproxy's switchover relies on, in MM2's formats and
under MM2's default names, with a real client (confluent-kafka):

- copies the records of the listed topics from the source to the target, renamed as MM2's
  DefaultReplicationPolicy renames them (``orders`` -> ``<source alias>.orders``), keys, values,
  headers and timestamps as they were;
- writes offset syncs to ``mm2-offset-syncs.<target alias>.internal`` on the source (MM2's default
  ``offset-syncs.topic.location``), at once when the replica moved ``offset_lag_max`` past the last
  sync or the source skipped an offset, else at the next offset flush (MirrorSourceTask);
- every ``checkpoint_interval_s`` writes checkpoints of every group's committed offsets on the source,
  translated as MM2 translates them, to ``<source alias>.checkpoints.internal`` on the target
  (MirrorCheckpointTask);
- every ``sync_interval_s`` commits those translated offsets on the target for groups that have no
  members there and hold less (``sync.group.offsets.enabled``).

It is not MM2: one thread, no Connect, no exactly-once, no config or ACL sync, no heartbeats. The
offsets it writes and the lag of its group offset sync (about one checkpoint plus one sync interval)
are what the tests compare kproxy's translation with.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from typing import Any

from confluent_kafka import Consumer as KafkaConsumer
from confluent_kafka import ConsumerGroupTopicPartitions, KafkaException, TopicPartition
from confluent_kafka import Producer as KafkaProducer
from confluent_kafka.admin import AdminClient, NewTopic

log = logging.getLogger("tests.replicator")


def _string(value: str) -> bytes:
    raw = value.encode()
    return struct.pack(">h", len(raw)) + raw


def sync_record(topic: str, partition: int, upstream: int, downstream: int) -> tuple[bytes, bytes]:
    """An OffsetSync's key and value as MM2 writes them (its own encoding, not kproxy's)."""
    return _string(topic) + struct.pack(">i", partition), struct.pack(">qq", upstream, downstream)


def checkpoint_record(group: str, topic: str, partition: int, upstream: int, downstream: int,
                      metadata: str = "") -> tuple[bytes, bytes]:
    key = _string(group) + _string(topic) + struct.pack(">i", partition)
    return key, struct.pack(">hqq", 0, upstream, downstream) + _string(metadata)


class Replicator:
    """Runs in a thread from ``start()`` to ``stop()``; ``copied`` counts records copied."""

    def __init__(self, source: str, target: str, topics: list[str], *, source_alias: str = "primary",
                 target_alias: str = "secondary", partitions: int = 1, offset_lag_max: int = 100,
                 flush_interval_s: float = 1.0, checkpoint_interval_s: float = 1.0, sync_interval_s: float = 1.0,
                 poll_s: float = 0.05) -> None:
        self.source, self.target = source, target
        self.topics = topics
        self.source_alias, self.target_alias = source_alias, target_alias
        self.partitions = partitions
        self.offset_lag_max = offset_lag_max
        self.flush_interval_s = flush_interval_s
        self.checkpoint_interval_s = checkpoint_interval_s
        self.sync_interval_s = sync_interval_s
        self.poll_s = poll_s
        self.syncs_topic = f"mm2-offset-syncs.{target_alias}.internal"
        self.checkpoints_topic = f"{source_alias}.checkpoints.internal"
        self.copied = 0
        self.checkpoints_written = 0
        self.group_commits = 0
        self.errors: list[str] = []
        # Per source partition: MM2's PartitionState, and the syncs written (what the topic holds).
        self._state: dict[tuple[str, int], dict[str, int]] = {}
        self._delayed: dict[tuple[str, int], tuple[int, int]] = {}
        self._written: dict[tuple[str, int], list[tuple[int, int]]] = {}
        self._checkpoints: dict[tuple[str, str, int], tuple[int, int]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.paused = threading.Event()       # set: copy nothing (a replica falling behind)

    def remote(self, topic: str) -> str:
        return f"{self.source_alias}.{topic}"

    def create_topics(self) -> None:
        """The replicas and MM2's internal topics (MM2 creates them itself)."""
        for bootstrap, names in ((self.target, [self.remote(t) for t in self.topics] + [self.checkpoints_topic]),
                                 (self.source, [*self.topics, self.syncs_topic])):
            admin = AdminClient({"bootstrap.servers": bootstrap})
            wanted = [NewTopic(n, 1 if n in (self.syncs_topic, self.checkpoints_topic) else self.partitions, 1)
                      for n in names]
            for name, future in admin.create_topics(wanted).items():
                try:
                    future.result(10)
                except KafkaException as e:
                    if "already exists" not in str(e).lower() and "TOPIC_ALREADY_EXISTS" not in str(e):
                        raise
                del name

    def start(self) -> Replicator:
        self.create_topics()
        self._thread = threading.Thread(target=self._run, name="replicator", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    # -- the loop

    def _run(self) -> None:
        consumer = KafkaConsumer({"bootstrap.servers": self.source, "group.id": "mm2-stand-in",
                                  "enable.auto.commit": False, "auto.offset.reset": "earliest",
                                  "topic.metadata.refresh.interval.ms": 1000, "reconnect.backoff.max.ms": 500})
        consumer.assign([TopicPartition(t, p, 0) for t in self.topics for p in range(self.partitions)])
        target = KafkaProducer({"bootstrap.servers": self.target, "enable.idempotence": True, "linger.ms": 5})
        source = KafkaProducer({"bootstrap.servers": self.source, "linger.ms": 0, "message.timeout.ms": 5000})
        source_admin = AdminClient({"bootstrap.servers": self.source})
        target_admin = AdminClient({"bootstrap.servers": self.target})
        next_flush = next_checkpoint = next_sync = time.monotonic()
        try:
            while not self._stop.is_set():
                if not self.paused.is_set():
                    self._copy(consumer, target, source)
                else:
                    time.sleep(self.poll_s)
                now = time.monotonic()
                if now >= next_flush:
                    next_flush = now + self.flush_interval_s
                    self._promote(source)
                if now >= next_checkpoint:
                    next_checkpoint = now + self.checkpoint_interval_s
                    self._guarded(self._checkpoint, source_admin, target)
                if now >= next_sync:
                    next_sync = now + self.sync_interval_s
                    self._guarded(self._sync_groups, target_admin)
        finally:
            consumer.close()
            target.flush(5)
            source.flush(5)

    def _guarded(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as e:  # the source may be gone (a failover test kills it): keep going
            self.errors.append(f"{fn.__name__}: {e}")

    def _copy(self, consumer: Any, target: Any, source: Any) -> None:
        messages = consumer.consume(500, self.poll_s)
        batch = [m for m in messages if m.error() is None]
        if not batch:
            return
        results: list[Any] = [None] * len(batch)

        def delivered(i: int) -> Any:
            def done(err: Any, msg: Any) -> None:
                results[i] = err if err is not None else msg.offset()
            return done

        for i, m in enumerate(batch):
            _, ts = m.timestamp()
            target.produce(self.remote(m.topic()), m.value(), m.key(), partition=m.partition(),
                           headers=m.headers(), timestamp=ts if ts > 0 else 0, on_delivery=delivered(i))
        target.flush(30)
        for m, downstream in zip(batch, results, strict=True):
            if not isinstance(downstream, int):
                self.errors.append(f"copy of {m.topic()}[{m.partition()}]@{m.offset()}: {downstream}")
                continue
            self.copied += 1
            self._maybe_sync(source, m.topic(), m.partition(), m.offset(), downstream)
        source.poll(0)

    def _maybe_sync(self, source: Any, topic: str, partition: int, upstream: int, downstream: int) -> None:
        """MM2's PartitionState.update: sync now, or keep it for the next flush."""
        st = self._state.setdefault((topic, partition), {"prev_up": -1, "prev_down": -1, "last_down": -1})
        now = (st["last_down"] == -1 or downstream - (st["last_down"] + 1) >= self.offset_lag_max
               or upstream - st["prev_up"] != 1 or downstream < st["prev_down"])
        st["prev_up"], st["prev_down"] = upstream, downstream
        if now:
            st["last_down"] = downstream
            self._delayed.pop((topic, partition), None)
            self._emit_sync(source, topic, partition, upstream, downstream)
        else:
            self._delayed[(topic, partition)] = (upstream, downstream)

    def _promote(self, source: Any) -> None:
        delayed, self._delayed = self._delayed, {}
        for (topic, partition), (upstream, downstream) in delayed.items():
            self._emit_sync(source, topic, partition, upstream, downstream)
        source.poll(0)

    def _emit_sync(self, source: Any, topic: str, partition: int, upstream: int, downstream: int) -> None:
        key, value = sync_record(topic, partition, upstream, downstream)
        try:
            source.produce(self.syncs_topic, value, key, partition=0)
        except (KafkaException, BufferError) as e:
            self.errors.append(f"offset sync: {e}")
            return
        self._written.setdefault((topic, partition), []).append((upstream, downstream))

    def translate(self, topic: str, partition: int, upstream: int) -> int | None:
        """MM2's OffsetSyncStore.translateDownstream over the syncs written: the newest at or before."""
        best = None
        for up, down in self._written.get((topic, partition), ()):
            if up <= upstream and (best is None or up >= best[0]):
                best = (up, down)
        if best is None:
            return None
        return best[1] + (0 if best[0] == upstream else 1)

    def _checkpoint(self, source_admin: Any, target: Any) -> None:
        groups = [g.group_id for g in source_admin.list_consumer_groups().result(5).valid
                  if g.group_id != "mm2-stand-in"]
        for group in groups:
            offsets = source_admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)])
            for tp in offsets[group].result(5).topic_partitions:
                if tp.topic not in self.topics or tp.offset < 0:
                    continue
                downstream = self.translate(tp.topic, tp.partition, tp.offset)
                if downstream is None:
                    continue
                key = (group, self.remote(tp.topic), tp.partition)
                last = self._checkpoints.get(key)
                if last is not None and not (tp.offset < last[0] or downstream > last[1]):
                    continue
                self._checkpoints[key] = (tp.offset, downstream)
                k, v = checkpoint_record(group, self.remote(tp.topic), tp.partition, tp.offset, downstream)
                target.produce(self.checkpoints_topic, v, k, partition=0)
                self.checkpoints_written += 1
        target.flush(10)

    def _sync_groups(self, target_admin: Any) -> None:
        by_group: dict[str, list[tuple[str, int, int]]] = {}
        for (group, topic, partition), (_, downstream) in self._checkpoints.items():
            by_group.setdefault(group, []).append((topic, partition, downstream))
        if not by_group:
            return
        states = target_admin.describe_consumer_groups(list(by_group))
        for group, wanted in by_group.items():
            desc = states[group].result(5)
            if desc.members:        # active on the target: its own offsets rule (MM2 skips it too)
                continue
            current = {(tp.topic, tp.partition): tp.offset for tp in target_admin.list_consumer_group_offsets(
                [ConsumerGroupTopicPartitions(group)])[group].result(5).topic_partitions}
            ahead = [TopicPartition(t, p, o) for t, p, o in wanted if o > current.get((t, p), -1)]
            if ahead:
                target_admin.alter_consumer_group_offsets([ConsumerGroupTopicPartitions(group, ahead)])[group].result(5)
                self.group_commits += 1

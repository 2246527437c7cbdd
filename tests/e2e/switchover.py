"""What the switchover tests share: two tansu brokers with the MirrorMaker 2 stand-in between them,
kproxy in front of both, and a steady idempotent producer plus a consumer group through it.

The brokers are fresh for each test (a failover test kills one). The producer writes the numbers
0, 1, 2, ... round robin over the partitions, so a partition's values rise in produce order and
each value is one record; the consumer group records what it was given.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

from tests.e2e.proxied import free_port_block
from tests.e2e.replicator import Replicator
from tests.e2e.tansu import TansuBroker, free_port, unique_name

PARTITIONS = 2


@attrs.define
class Pair:
    primary: TansuBroker
    secondary: TansuBroker
    replicator: Replicator
    topic: str


@pytest.fixture
def pair(tansu_binary: str, tmp_path: Path) -> Iterator[Pair]:
    primary, secondary = TansuBroker(tansu_binary), TansuBroker(tansu_binary)
    primary.log_path, secondary.log_path = tmp_path / "primary.log", tmp_path / "secondary.log"
    primary.start()
    secondary.start()
    topic = unique_name("orders")
    replicator = Replicator(primary.bootstrap, secondary.bootstrap, [topic], partitions=PARTITIONS)
    try:
        replicator.start()
        yield Pair(primary, secondary, replicator, topic)
    finally:
        replicator.stop()
        primary.stop()
        secondary.stop()


def config_text(pair: Pair, tmp_path: Path, *, translation: str = "mm2", failover: float | None = None,
                prefix: bool = True, extra: str = "") -> tuple[str, int, int]:
    """kproxy's configuration for ``pair``: (YAML, listen port, admin port). The secondary is a replica
    named by MM2's default policy (``primary.<topic>``) unless ``prefix`` is false."""
    port, admin = free_port_block(8), free_port()
    failover_line = f"  failover: {{after_s: {failover}, probe_interval_s: 0.5}}\n" if failover else ""
    prefix_line = ', topic_prefix: "primary."' if prefix else ""
    text = (f'listen: "127.0.0.1:{port}"\n'
            f"exposure: {{advertised_host: 127.0.0.1, broker_port_count: 6}}\n"
            f'admin: {{listen: "127.0.0.1:{admin}"}}\n'
            f"upstream:\n"
            f"  clusters:\n"
            f'    - {{name: primary, bootstrap_servers: ["{pair.primary.bootstrap}"]}}\n'
            f'    - {{name: secondary, bootstrap_servers: ["{pair.secondary.bootstrap}"]{prefix_line}}}\n'
            f"  offset_translation: {translation}\n"
            f"  state_file: {tmp_path / 'kproxy-state.json'}\n"
            f"{failover_line}{extra}")
    return text, port, admin


class Load:
    """A steady idempotent producer (acks=all) and a consumer group, through ``bootstrap``."""

    def __init__(self, bootstrap: str, topic: str, group: str | None = None, *, interval_s: float = 0.003,
                 producer: str = "confluent") -> None:
        self.bootstrap, self.topic = bootstrap, topic
        self.group = group or unique_name("group")
        self.interval_s = interval_s
        self.producer_kind = producer
        self.acked: list[tuple[int, int, float]] = []      # (partition, value, when acknowledged)
        self.errors: list[Any] = []                        # delivery errors (KafkaError or exceptions)
        self.reader: Reader | None = None                  # the consumer group's one member
        self.sent = 0
        self.sent_at: dict[int, float] = {}                # value -> when it was handed to the producer
        self._stop_producing = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def start(self, consume: bool = True) -> Load:
        target = self._produce_confluent if self.producer_kind == "confluent" else self._produce_kafka_python
        self._threads = [threading.Thread(target=target, daemon=True)]
        self._threads[0].start()
        if consume:
            self.reader = Reader(self.bootstrap, self.topic, self.group)
        return self

    @property
    def seen(self) -> list[tuple[int, int]]:
        """(partition, value) as the group got them."""
        return self.reader.seen if self.reader is not None else []

    def _ack(self, partition: int, value: int) -> None:
        with self._lock:
            self.acked.append((partition, value, time.monotonic()))

    def _produce_confluent(self) -> None:
        p = Producer({"bootstrap.servers": self.bootstrap, "enable.idempotence": True, "acks": "all",
                      "linger.ms": 5, "message.timeout.ms": 120000})

        def delivered(err: Any, msg: Any) -> None:
            if err is not None:
                self.errors.append(err)
            else:
                self._ack(msg.partition(), int(msg.value()))

        while not self._stop_producing.is_set():
            self.sent_at[self.sent] = time.monotonic()
            p.produce(self.topic, str(self.sent).encode(), partition=self.sent % PARTITIONS, on_delivery=delivered)
            self.sent += 1
            p.poll(0)
            time.sleep(self.interval_s)
        assert p.flush(120) == 0

    def _produce_kafka_python(self) -> None:
        from kafka import KafkaProducer

        p = KafkaProducer(bootstrap_servers=self.bootstrap, enable_idempotence=True, acks="all", linger_ms=5,
                          delivery_timeout_ms=120000, request_timeout_ms=30000)
        while not self._stop_producing.is_set():
            value, partition = self.sent, self.sent % PARTITIONS
            future = p.send(self.topic, str(value).encode(), partition=partition)
            future.add_callback(lambda md, v=value: self._ack(md.partition, v))
            future.add_errback(self.errors.append)
            self.sent += 1
            time.sleep(self.interval_s)
        p.flush(120)
        p.close(10)

    def stop(self, consumed_within: float = 60.0, may_lose: tuple[float, float] | None = None) -> None:
        """Stop producing (everything sent is acknowledged or failed), let the group read what was
        acknowledged, then stop it. ``may_lose``: (from, to), monotonic times; records acknowledged
        then may never come (a failover's loss), so the group is not waited for on their account."""
        self._stop_producing.set()
        self._threads[0].join(180)
        with self._lock:
            lossy = {(p, v) for p, v, at in self.acked if may_lose is not None and may_lose[0] <= at <= may_lose[1]}
        deadline = time.monotonic() + consumed_within
        while self.reader is not None and self.missing() - lossy and time.monotonic() < deadline:
            time.sleep(0.2)
        if self.reader is not None:
            self.reader.close()

    def missing(self) -> set[tuple[int, int]]:
        with self._lock:
            acked = {(p, v) for p, v, _ in self.acked}
        return acked - set(self.seen)

    def rereads(self) -> int:
        seen = list(self.seen)
        return len(seen) - len(set(seen))

    def acked_count(self) -> int:
        with self._lock:
            return len(self.acked)

    def stalls(self) -> tuple[float, float]:
        """(the longest time a record waited for its acknowledgement, the longest time between two
        acknowledgements), in seconds."""
        with self._lock:
            acked = sorted(self.acked, key=lambda a: a[2])
        waits = [at - self.sent_at[v] for _, v, at in acked if v in self.sent_at]
        gaps = [b[2] - a[2] for a, b in itertools.pairwise(acked)]
        return max(waits, default=0.0), max(gaps, default=0.0)

    def rate(self) -> float:
        """Records acknowledged per second over the run."""
        with self._lock:
            if len(self.acked) < 2:
                return 0.0
            return len(self.acked) / max(self.acked[-1][2] - self.acked[0][2], 1e-3)


def only_retriable(errors: list[Any]) -> list[str]:
    """The errors that are not retriable (an empty list is the goal)."""
    bad = []
    for e in errors:
        if isinstance(e, KafkaError):
            if not e.retriable():
                bad.append(str(e))
        elif not getattr(e, "retriable", False):
            bad.append(repr(e))
    return bad


def read_log(bootstrap: str, topic: str, partitions: int = PARTITIONS) -> dict[int, list[int]]:
    """Every value in each partition of ``topic``, in log order, read directly from a broker."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": unique_name("reader"), "enable.auto.commit": False,
                  "enable.partition.eof": True})
    c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    out: dict[int, list[int]] = {p: [] for p in range(partitions)}
    ended: set[int] = set()
    deadline = time.monotonic() + 60
    try:
        while len(ended) < partitions and time.monotonic() < deadline:
            m = c.poll(0.5)
            if m is None:
                continue
            if m.error() is not None:
                if m.error().code() == KafkaError._PARTITION_EOF:
                    ended.add(m.partition())
                continue
            out[m.partition()].append(int(m.value()))
    finally:
        c.close()
    assert len(ended) == partitions, f"could not read {topic} to its end on {bootstrap}"
    return out


class Reader:
    """One consumer of a group, in its own thread, until ``close()`` (which commits where it is)."""

    def __init__(self, bootstrap: str, topic: str, group: str) -> None:
        self.seen: list[tuple[int, int]] = []
        self.errors: list[Any] = []
        self._stop = threading.Event()
        self._config = {"bootstrap.servers": bootstrap, "group.id": group, "auto.offset.reset": "earliest",
                        "enable.auto.commit": True, "auto.commit.interval.ms": 200, "session.timeout.ms": 6000,
                        "max.poll.interval.ms": 6000, "heartbeat.interval.ms": 500}
        self.topic = topic
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        c = Consumer(self._config)
        c.subscribe([self.topic])
        try:
            while not self._stop.is_set():
                m = c.poll(0.2)
                if m is None:
                    continue
                if m.error() is not None:
                    self.errors.append(m.error())
                    continue
                self.seen.append((m.partition(), int(m.value())))
        finally:
            c.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(30)

"""A fake page-cache broker for benchmarks: a single Kafka node that answers Fetch from memory.

It stands in for Apache Kafka serving a cached partition, which tansu cannot (tansu caps Fetch
answers near 6 MB, ignores ``max_bytes`` and slows as it fills). Produce is acknowledged and only
counted: each partition's log is the number of records produced to it (or preloaded), and Fetch
serves real RecordBatch v2 batches of that many records, built once from a template (the first
record produced, or ``--preload``'s size) and sent with one vectored write per answer, base offsets
patched per batch (they lie outside a batch's CRC). Fetch honours ``max_bytes`` and
``partition_max_bytes`` as Apache Kafka does: whole batches from the one holding the fetch offset,
the last one cut at the limit, and the first batch of the answer always whole (KIP-74).

Every listener advertises the address it is given, so a relay in front of a second listener keeps
its clients after bootstrap::

    .venv/bin/python bench/fake_broker.py --listen 127.0.0.1:9092 \\
        --listen 127.0.0.1:9093=127.0.0.1:19093   # bind 9093, advertise 19093 (a relay's port)
    .venv/bin/python bench/fake_broker.py --selftest     # its own Fetch speed on loopback, no client

APIs: ApiVersions, Metadata (auto-creates topics), CreateTopics, DeleteTopics, FindCoordinator,
ListOffsets, Produce, Fetch (sessionless, every version kproxy decodes), InitProducerId; any other
request gets an error answer of its own shape. Plain sockets and one thread per connection: sends
release the GIL, so loopback sets the pace, not Python.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import struct
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from kproxy.protocol.compiler import ZERO_COPY_MIN
from kproxy.protocol.messages import (
    Response,
    body_class,
    decode_request,
    encode_response_frame,
    supported_versions,
)
from kproxy.protocol.records import build_batch, iter_batches
from kproxy.proxy.replies import error_response

HOST = "127.0.0.1"
NODE_ID = 0
CLUSTER_ID = "fake-page-cache"
PRODUCE, FETCH, LIST_OFFSETS, METADATA, FIND_COORDINATOR = 0, 1, 2, 3, 10
API_VERSIONS, CREATE_TOPICS, DELETE_TOPICS, INIT_PRODUCER_ID = 18, 19, 20, 22
UNKNOWN_TOPIC_OR_PARTITION, UNSUPPORTED_VERSION, TOPIC_ALREADY_EXISTS = 3, 35, 36
# Versions answered in full; capped where a later version needs state this broker does not keep
# (Produce v13 names topics by id, Fetch v7+ sessions are answered sessionless, which is allowed).
ANSWERED = {PRODUCE: 12, FETCH: 16, LIST_OFFSETS: 8, METADATA: 12, FIND_COORDINATOR: 4,
            API_VERSIONS: 3, CREATE_TOPICS: 7, DELETE_TOPICS: 6, INIT_PRODUCER_ID: 4}
RECORDS_PER_BATCH = 64            # 64 x 1 KiB: 16 batches make a 1 MiB answer, as librdkafka asks
_SIZE = struct.Struct(">i")
_OFFSET = struct.Struct(">q")


@dataclass
class Partition:
    records: int = 0                          # the log end offset (= high watermark)
    value_size: int | None = None             # of the records served (set by the first produce)


@dataclass
class Topic:
    name: str
    topic_id: uuid.UUID
    partitions: list[Partition]


@dataclass
class Templates:
    """Prebuilt batches of ``RECORDS_PER_BATCH`` records (and shorter tails) per value size; each
    without its 8-byte base offset, which is sent per batch."""

    full: dict[int, memoryview] = field(default_factory=dict)
    tails: dict[tuple[int, int], memoryview] = field(default_factory=dict)

    def batch(self, value_size: int, count: int) -> memoryview:
        key = (value_size, count)
        cache = self.full if count == RECORDS_PER_BATCH else self.tails
        got = cache.get(value_size if count == RECORDS_PER_BATCH else key)  # type: ignore[call-overload]
        if got is None:
            value = bytes((i * 7 + 3) & 0xFF for i in range(value_size))
            now = int(time.time() * 1000)
            raw = build_batch([(None, value)] * count, base_timestamp=now)
            got = memoryview(raw)[8:]
            if count == RECORDS_PER_BATCH:
                self.full[value_size] = got
            else:
                self.tails[key] = got
        return got


class FakeBroker:
    """One node, several listeners, each advertising its own (host, port)."""

    def __init__(self, listeners: list[tuple[tuple[str, int], tuple[str, int]]]) -> None:
        self.listeners = listeners            # (bind, advertised)
        self.topics: dict[str, Topic] = {}
        self.by_id: dict[uuid.UUID, Topic] = {}
        self.lock = threading.Condition()
        self.templates = Templates()
        self.sockets: list[socket.socket] = []
        self.bound: list[tuple[str, int]] = []
        self.stopped = False
        self.errors: list[str] = []
        self.fetch_bytes = 0
        self.produced_records = 0

    # -- lifecycle

    def start(self) -> FakeBroker:
        for bind, advertised in self.listeners:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(bind)
            s.listen(512)
            host, port = s.getsockname()[:2]
            adv = (advertised[0], advertised[1] or port)
            self.sockets.append(s)
            self.bound.append((host, port))
            threading.Thread(target=self._accept, args=(s, adv), daemon=True).start()
        return self

    def stop(self) -> None:
        self.stopped = True
        for s in self.sockets:
            with contextlib.suppress(OSError):
                s.close()

    def preload(self, name: str, partitions: int, records: int, value_size: int) -> None:
        t = self._create(name, partitions)
        for p in t.partitions:
            p.records, p.value_size = records, value_size

    def _accept(self, listener: socket.socket, advertised: tuple[str, int]) -> None:
        while not self.stopped:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn, advertised), daemon=True).start()

    def _serve(self, conn: socket.socket, advertised: tuple[str, int]) -> None:
        head = bytearray(4)
        try:
            with conn:
                while True:
                    if not _recv_exactly(conn, memoryview(head)):
                        return
                    (size,) = _SIZE.unpack(head)
                    frame = bytearray(size)
                    if not _recv_exactly(conn, memoryview(frame)):
                        return
                    answer = self.answer(memoryview(frame), advertised)
                    if answer:
                        _send_all(conn, answer)
        except OSError:
            return
        except Exception as e:   # a bug here must show in the bench, not vanish with a thread
            self.errors.append(f"{type(e).__name__}: {e}")
            raise

    # -- answers

    def answer(self, frame: memoryview, advertised: tuple[str, int]) -> list | None:
        req = decode_request(frame)
        key, version = req.api_key, req.api_version
        if key == PRODUCE and req.body.acks == 0:
            self._produce(req.body, version)
            return None
        if key not in ANSWERED or version > ANSWERED[key]:
            resp = error_response(req, UNSUPPORTED_VERSION)
            return encode_response_frame(resp) if resp is not None else None
        if key == FETCH:
            return self._fetch(req.body, version, req.correlation_id)
        body: Any
        if key == API_VERSIONS:
            body = self._api_versions()
        elif key == METADATA:
            body = self._metadata(req.body, version, advertised)
        elif key == FIND_COORDINATOR:
            body = self._find_coordinator(req.body, version, advertised)
        elif key == PRODUCE:
            body = self._produce(req.body, version)
        elif key == CREATE_TOPICS:
            for t in req.body.topics:
                if t.name not in self.topics:
                    self._create(t.name, max(1, t.num_partitions))
            return encode_response_frame(error_response(req, 0))  # type: ignore[arg-type]
        elif key == DELETE_TOPICS:
            for name in getattr(req.body, "topic_names", None) or [t.name for t in req.body.topics]:
                with self.lock:
                    t = self.topics.pop(name, None)
                    if t is not None:
                        self.by_id.pop(t.topic_id, None)
            return encode_response_frame(error_response(req, 0))  # type: ignore[arg-type]
        elif key == LIST_OFFSETS:
            body = self._list_offsets(req.body)
        else:   # InitProducerId
            cls: Any = body_class(INIT_PRODUCER_ID, "response")
            body = cls(producer_id=1000 + len(self.topics), producer_epoch=0)
        return encode_response_frame(Response.build(key, version, req.correlation_id, body))

    def _create(self, name: str, partitions: int) -> Topic:
        with self.lock:
            t = self.topics.get(name)
            if t is None:
                t = self.topics[name] = Topic(name, uuid.uuid4(), [Partition() for _ in range(partitions)])
                self.by_id[t.topic_id] = t
            return t

    def _api_versions(self) -> Any:
        cls: Any = body_class(API_VERSIONS, "response")
        have = supported_versions()
        return cls(error_code=0, api_keys=[cls.ApiVersion(api_key=k, min_version=have[k][0],
                                                           max_version=min(hi, have[k][1]))
                                           for k, hi in sorted(ANSWERED.items())])

    def _metadata(self, body: Any, version: int, advertised: tuple[str, int]) -> Any:
        cls: Any = body_class(METADATA, "response")
        if body.topics is None or (version == 0 and not body.topics):
            wanted = list(self.topics.values())
        else:
            wanted = []
            for t in body.topics:
                topic = self.topics.get(t.name) if t.name else self.by_id.get(t.topic_id)
                if topic is None and t.name and getattr(body, "allow_auto_topic_creation", True):
                    topic = self._create(t.name, 1)
                wanted.append(topic if topic is not None else t)
        topics = []
        for t in wanted:
            if not isinstance(t, Topic):
                topics.append(cls.MetadataResponseTopic(error_code=UNKNOWN_TOPIC_OR_PARTITION, name=t.name,
                                                        topic_id=getattr(t, "topic_id", None) or uuid.UUID(int=0)))
                continue
            parts = [cls.MetadataResponsePartition(error_code=0, partition_index=i, leader_id=NODE_ID,
                                                   leader_epoch=0, replica_nodes=[NODE_ID], isr_nodes=[NODE_ID],
                                                   offline_replicas=[])
                     for i in range(len(t.partitions))]
            topics.append(cls.MetadataResponseTopic(error_code=0, name=t.name, topic_id=t.topic_id,
                                                    partitions=parts))
        return cls(brokers=[cls.MetadataResponseBroker(node_id=NODE_ID, host=advertised[0], port=advertised[1])],
                   cluster_id=CLUSTER_ID, controller_id=NODE_ID, topics=topics)

    def _find_coordinator(self, body: Any, version: int, advertised: tuple[str, int]) -> Any:
        cls: Any = body_class(FIND_COORDINATOR, "response")
        host, port = advertised
        if version < 4:
            return cls(error_code=0, error_message=None, node_id=NODE_ID, host=host, port=port)
        return cls(coordinators=[cls.Coordinator(key=k, node_id=NODE_ID, host=host, port=port, error_code=0,
                                                 error_message=None) for k in body.coordinator_keys])

    def _partition(self, name: str | None, topic_id: uuid.UUID | None, index: int) -> Partition | None:
        t = self.topics.get(name) if name else self.by_id.get(topic_id)  # type: ignore[arg-type]
        if t is None or not 0 <= index < len(t.partitions):
            return None
        return t.partitions[index]

    def _produce(self, body: Any, version: int) -> Any:
        cls: Any = body_class(PRODUCE, "response")
        responses = []
        for topic in body.topic_data:
            parts = []
            for pd in topic.partition_data:
                p = self._partition(topic.name, getattr(topic, "topic_id", None), pd.index)
                if p is None:
                    parts.append(cls.PartitionProduceResponse(index=pd.index, error_code=UNKNOWN_TOPIC_OR_PARTITION,
                                                              base_offset=-1))
                    continue
                count = 0
                if pd.records is not None:
                    for batch in iter_batches(pd.records):
                        count += getattr(batch, "record_count", 1)
                        if p.value_size is None:
                            first = batch.records()[0]
                            p.value_size = len(first.value or b"")
                with self.lock:
                    base = p.records
                    p.records += count
                    self.produced_records += count
                    self.lock.notify_all()
                parts.append(cls.PartitionProduceResponse(index=pd.index, error_code=0, base_offset=base,
                                                          log_append_time_ms=-1, log_start_offset=0))
            responses.append(cls.TopicProduceResponse(name=topic.name, topic_id=getattr(topic, "topic_id", None),
                                                      partition_responses=parts))
        return cls(responses=responses, throttle_time_ms=0)

    def _list_offsets(self, body: Any) -> Any:
        cls: Any = body_class(LIST_OFFSETS, "response")
        topics = []
        for t in body.topics:
            parts = []
            for q in t.partitions:
                p = self._partition(t.name, None, q.partition_index)
                if p is None:
                    parts.append(cls.ListOffsetsPartitionResponse(partition_index=q.partition_index,
                                                                  error_code=UNKNOWN_TOPIC_OR_PARTITION))
                    continue
                # -2 is the earliest offset, anything else (latest, a time) the end of the log.
                offset = 0 if q.timestamp == -2 else p.records
                parts.append(cls.ListOffsetsPartitionResponse(partition_index=q.partition_index, error_code=0,
                                                              timestamp=-1, offset=offset, old_style_offsets=[offset]))
            topics.append(cls.ListOffsetsTopicResponse(name=t.name, partitions=parts))
        return cls(topics=topics)

    def _fetch(self, body: Any, version: int, correlation_id: int) -> list:
        cls: Any = body_class(FETCH, "response")
        deadline = time.monotonic() + body.max_wait_ms / 1000.0
        while True:
            available = 0
            for t in body.topics:
                for q in t.partitions:
                    p = self._partition(getattr(t, "topic", None), getattr(t, "topic_id", None), q.partition)
                    if p is not None and p.records > q.fetch_offset and p.value_size is not None:
                        available += 1
            if available or body.min_bytes <= 0:
                break
            with self.lock:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.lock.wait(min(left, 0.05))
        budget = body.max_bytes if version >= 3 else 0x7FFFFFFF
        first = True
        iovecs: dict[int, list] = {}     # id(placeholder view) -> the iovecs that replace it
        responses = []
        for t in body.topics:
            parts = []
            for q in t.partitions:
                p = self._partition(getattr(t, "topic", None), getattr(t, "topic_id", None), q.partition)
                if p is None:
                    parts.append(cls.PartitionData(partition_index=q.partition, error_code=UNKNOWN_TOPIC_OR_PARTITION,
                                                   high_watermark=-1, records=None))
                    continue
                limit = min(q.partition_max_bytes, budget)
                vecs, size = self._slice(p, q.fetch_offset, limit, first)
                if size:
                    first = False
                    budget -= size
                    records: Any
                    if size >= ZERO_COPY_MIN:
                        # A placeholder of the right length that the encoder passes through by
                        # reference; it is swapped for the batches' buffers after encoding.
                        records = memoryview(_ZEROS)[:size]
                        iovecs[id(records)] = vecs
                    else:
                        records = b"".join(vecs)
                else:
                    records = b""
                parts.append(cls.PartitionData(partition_index=q.partition, error_code=0, high_watermark=p.records,
                                               last_stable_offset=p.records, log_start_offset=0,
                                               aborted_transactions=None, records=records))
            responses.append(cls.FetchableTopicResponse(topic=getattr(t, "topic", None),
                                                        topic_id=getattr(t, "topic_id", None), partitions=parts))
        resp = Response.build(FETCH, version, correlation_id, cls(throttle_time_ms=0, error_code=0, session_id=0,
                                                                   responses=responses))
        out: list = []
        for b in encode_response_frame(resp):
            vecs = iovecs.get(id(b))
            if vecs is not None and isinstance(b, memoryview):
                out += vecs
            else:
                out.append(b)
        self.fetch_bytes += sum(len(b) for b in out)
        return out

    def _slice(self, p: Partition, offset: int, limit: int, whole_first: bool) -> tuple[list, int]:
        """Batches from the one holding ``offset``, cut at ``limit`` bytes (the first kept whole when
        ``whole_first``): as Apache Kafka reads a slice of its log segment."""
        if p.value_size is None or offset >= p.records or offset < 0:
            return [], 0
        vecs: list = []
        size = 0
        base = offset - offset % RECORDS_PER_BATCH
        while base < p.records:
            count = min(RECORDS_PER_BATCH, p.records - base)
            rest = self.templates.batch(p.value_size, count)
            n = 8 + len(rest)
            if size + n > limit:
                if size == 0 and whole_first:
                    pass                      # KIP-74: the first batch goes whole, whatever the limits
                else:
                    room = limit - size
                    if room > 8:
                        vecs += [_OFFSET.pack(base), rest[: room - 8]]
                        size += room
                    break
            vecs += [_OFFSET.pack(base), rest]
            size += n
            base += count
        return vecs, size


_ZEROS = bytes(256 << 20)   # calloc'd: placeholders share untouched zero pages


def _recv_exactly(conn: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


def _send_all(conn: socket.socket, buffers: list) -> None:
    # sendmsg takes at most IOV_MAX buffers; a 64 MiB answer has a few thousand.
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    while views:
        sent = conn.sendmsg(views[:1024])
        while sent and views:
            if sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


# ---------------------------------------------------------------------------------------------
# Command line


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or HOST, int(port)


def parse_listener(text: str) -> tuple[tuple[str, int], tuple[str, int]]:
    """``BIND[=ADVERTISED]``, each HOST:PORT (port 0 binds any free port and advertises it)."""
    bind, _, adv = text.partition("=")
    b = _address(bind)
    return b, _address(adv) if adv else b


def selftest(seconds: float, answer_bytes: int) -> None:
    """Fetch answers of ``answer_bytes`` read back by one raw client: the broker's own speed."""
    from kproxy.protocol.messages import Request, encode_request_frame

    broker = FakeBroker([((HOST, 0), (HOST, 0))]).start()
    broker.preload("selftest", 1, 1 << 30, 1024)
    topic_id = broker.topics["selftest"].topic_id
    rq: Any = body_class(FETCH, "request")
    body = rq(max_wait_ms=500, min_bytes=1, max_bytes=answer_bytes, topics=[
        rq.FetchTopic(topic_id=topic_id, partitions=[rq.FetchPartition(partition=0, fetch_offset=0,
                                                                       partition_max_bytes=answer_bytes)])])
    frame = b"".join(bytes(b) for b in encode_request_frame(Request.build(FETCH, 13, 1, "selftest", body)))
    sock = socket.create_connection(broker.bound[0])
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(answer_bytes + (1 << 20))
    moved = answers = 0
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    while time.perf_counter() - t0 < seconds:
        sock.sendall(frame)
        _recv_exactly(sock, memoryview(buf)[:4])
        (size,) = _SIZE.unpack_from(buf)
        _recv_exactly(sock, memoryview(buf)[:size])
        moved += size + 4
        answers += 1
    dt = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    sock.close()
    broker.stop()
    print(f"{answers} Fetch answers of {moved / answers / 2**20:.2f} MiB in {dt:.2f}s: "
          f"{moved / dt / 1e9:.2f} GB/s, broker + reader CPU {cpu / dt * 100:.0f}% of a core")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--listen", action="append", type=parse_listener, default=[],
                    help="BIND[=ADVERTISED] (HOST:PORT each); repeat for more listeners")
    ap.add_argument("--preload", action="append", default=[], metavar="TOPIC:PARTITIONS:RECORDS:SIZE",
                    help="a topic whose partitions already hold RECORDS records of SIZE bytes")
    ap.add_argument("--selftest", action="store_true", help="measure the broker alone and exit")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--answer-bytes", type=int, default=1 << 20)
    args = ap.parse_args(argv)
    if args.selftest:
        selftest(args.seconds, args.answer_bytes)
        return 0
    broker = FakeBroker(args.listen or [((HOST, 9092), (HOST, 9092))]).start()
    for spec in args.preload:
        name, parts, records, size = spec.rsplit(":", 3)
        broker.preload(name, int(parts), int(records), int(size))
    print("listening: " + ", ".join(f"{h}:{p}" for h, p in broker.bound), flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        broker.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

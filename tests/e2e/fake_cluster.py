"""An in-process fake Kafka cluster: several brokers on loopback ports, for multi-broker routing tests.

The real test broker (tansu) is a single node, so kproxy's port-per-broker routing needs a stand-in
with several. Each fake broker decodes requests with kproxy's own codec and answers a handful of
APIs from fixed cluster metadata (ApiVersions, Metadata, FindCoordinator, DescribeCluster, Produce);
it keeps no log and replicates nothing. Every broker records what reached it, so a test can tell
which node a connection through kproxy really landed on. Threads and plain sockets only.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading
import traceback
import uuid
from collections.abc import Iterable
from typing import Any

import attrs

from kproxy.protocol.messages import (
    Response,
    body_class,
    decode_request,
    encode_response_frame,
)

HOST = "127.0.0.1"
TOPIC = "t"
TOPIC_ID = uuid.UUID("5f0c2b5e-6d1a-4e55-9d5a-1c0ffee0c0de")
CLUSTER_ID = "fake-cluster"

PRODUCE, METADATA, FIND_COORDINATOR, API_VERSIONS, DESCRIBE_CLUSTER = 0, 3, 10, 18, 60
UNKNOWN_TOPIC_OR_PARTITION, NOT_LEADER_OR_FOLLOWER, UNSUPPORTED_VERSION = 3, 6, 35

# What every fake broker advertises: {api key: (min, max)}. Each range is one the fake answers in full.
API_RANGES: dict[int, tuple[int, int]] = {
    PRODUCE: (3, 9),
    METADATA: (0, 12),
    FIND_COORDINATOR: (0, 4),
    API_VERSIONS: (0, 3),
    DESCRIBE_CLUSTER: (0, 1),
}

_SIZE = struct.Struct(">i")


@attrs.frozen
class Received:
    """One request as a fake broker decoded it. ``produced`` holds (topic, partition, records bytes)
    of a Produce request, in request order; it is empty for every other API."""

    api_key: int
    api_version: int
    client_id: str | None
    correlation_id: int
    produced: tuple[tuple[str, int, bytes], ...] = ()


class FakeBroker:
    """One node of a ``FakeCluster``: a listener and the connections it accepted, served by one thread."""

    def __init__(self, cluster: FakeCluster, node_id: int, port: int = 0) -> None:
        self.cluster = cluster
        self.node_id = node_id
        self.port = port
        self.connections_accepted = 0
        self._received: list[Received] = []
        self._lock = threading.Lock()
        self._offsets: dict[tuple[str, int], int] = {}
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        # A broker slow to answer Metadata: while this is an Event not yet set, Metadata requests
        # wait for it (up to 30 s) before they are answered; every connection of this broker waits.
        self.metadata_gate: threading.Event | None = None

    @property
    def address(self) -> tuple[str, int]:
        return HOST, self.port

    @property
    def running(self) -> bool:
        return self._thread is not None

    def received(self, api_key: int | None = None) -> list[Received]:
        with self._lock:
            return [r for r in self._received if api_key is None or r.api_key == api_key]

    def produced(self) -> list[tuple[str, int, bytes]]:
        """Every (topic, partition, records) this broker was sent in a Produce, in arrival order."""
        return [p for r in self.received(PRODUCE) for p in r.produced]

    def clear(self) -> None:
        with self._lock:
            self._received.clear()

    def start(self, port: int | None = None) -> None:
        """Listen on ``port`` (default: the last one, or a free one the first time) and serve."""
        if self._thread is not None:
            raise RuntimeError(f"fake broker {self.node_id} is already running")
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((HOST, self.port if port is None else port))
            listener.listen(64)
        except OSError:
            listener.close()
            raise
        listener.setblocking(False)
        self.port = listener.getsockname()[1]
        self._stopping.clear()
        self._thread = threading.Thread(target=self._serve, args=(listener,),
                                        name=f"fake-broker-{self.node_id}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Close the listener and every connection; later connections to the port are refused."""
        if self._thread is None:
            return
        self._stopping.set()
        self._thread.join(10)
        self._thread = None

    # -- serving

    def _serve(self, listener: socket.socket) -> None:
        sel = selectors.DefaultSelector()
        sel.register(listener, selectors.EVENT_READ, None)
        try:
            while not self._stopping.is_set():
                for key, _ in sel.select(0.05):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    if key.data is None:
                        with contextlib.suppress(BlockingIOError):
                            conn, _ = listener.accept()
                            conn.settimeout(5)
                            self.connections_accepted += 1
                            sel.register(conn, selectors.EVENT_READ, bytearray())
                    elif not self._pump(sock, key.data):
                        sel.unregister(sock)
                        sock.close()
        finally:
            for key in list(sel.get_map().values()):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if key.data is not None:
                    # RST rather than FIN: the connection is gone at once, as when a broker dies.
                    with contextlib.suppress(OSError):
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.close()
            sel.close()

    def _pump(self, conn: socket.socket, buf: bytearray) -> bool:
        """Read what is there and answer every whole frame; False when the connection is done."""
        try:
            chunk = conn.recv(65536)
        except OSError:
            return False
        if not chunk:
            return False
        buf += chunk
        while len(buf) >= 4:
            (size,) = _SIZE.unpack_from(buf, 0)
            if len(buf) < 4 + size:
                break
            frame = bytes(buf[4:4 + size])
            del buf[:4 + size]
            try:
                reply = self._answer(frame)
            except Exception:
                self.cluster.errors.append(f"node {self.node_id}: {traceback.format_exc()}")
                return False
            if reply is not None:
                try:
                    conn.sendall(reply)
                except OSError:
                    return False
        return True

    def _answer(self, frame: bytes) -> bytes | None:
        req = decode_request(frame, keep_trailing=True)
        api_key, api_version, correlation_id = req.api_key, req.api_version, req.correlation_id
        body = req.body
        produced: tuple[tuple[str, int, bytes], ...] = ()
        if api_key == PRODUCE:
            produced = tuple((t.name, p.index, bytes(p.records or b""))
                             for t in body.topic_data for p in t.partition_data)
        self._record(Received(api_key, api_version, req.client_id, correlation_id, produced))
        lo, hi = self.cluster.api_ranges.get(api_key, (0, -1))
        if api_key == API_VERSIONS and api_version > hi:
            # A broker that does not know the requested ApiVersions version answers in v0 (KIP-511).
            return self._encode(API_VERSIONS, 0, correlation_id, self._api_versions(UNSUPPORTED_VERSION))
        if not lo <= api_version <= hi:
            raise ValueError(f"api {api_key} v{api_version} is not one this fake broker advertises")
        if api_key == API_VERSIONS:
            answer = self._api_versions(0)
        elif api_key == METADATA:
            if self.metadata_gate is not None:
                self.metadata_gate.wait(30)
            answer = self._metadata(body, api_version)
        elif api_key == FIND_COORDINATOR:
            answer = self._find_coordinator(body, api_version)
        elif api_key == DESCRIBE_CLUSTER:
            answer = self._describe_cluster(body, api_version)
        else:
            if body.acks == 0:
                return None  # acks=0: the client expects no response at all
            answer = self._produce(body, api_version)
        return self._encode(api_key, api_version, correlation_id, answer)

    def _record(self, r: Received) -> None:
        with self._lock:
            self._received.append(r)

    @staticmethod
    def _encode(api_key: int, api_version: int, correlation_id: int, body: Any) -> bytes:
        resp = Response.build(api_key, api_version, correlation_id, body)
        return b"".join(bytes(b) for b in encode_response_frame(resp))

    # -- answers

    def _api_versions(self, error_code: int) -> Any:
        cls: Any = body_class(API_VERSIONS, "response")
        return cls(error_code=error_code, api_keys=[
            cls.ApiVersion(api_key=k, min_version=lo, max_version=hi)
            for k, (lo, hi) in sorted(self.cluster.api_ranges.items())])

    def _metadata(self, body: Any, version: int) -> Any:
        cls: Any = body_class(METADATA, "response")
        cluster = self.cluster
        requested = body.topics
        if requested is None or (version == 0 and not requested):
            wanted: list[tuple[str | None, uuid.UUID | None]] = [(TOPIC, TOPIC_ID)]
        else:
            wanted = [(t.name, getattr(t, "topic_id", None)) for t in requested]
        topics = []
        for name, topic_id in wanted:
            if name == TOPIC or (name is None and topic_id == TOPIC_ID):
                partitions = [
                    cls.MetadataResponsePartition(
                        error_code=0, partition_index=p, leader_id=leader, leader_epoch=0,
                        replica_nodes=[leader], isr_nodes=[leader], offline_replicas=[])
                    for p, leader in enumerate(cluster.partition_leaders)]
                topics.append(cls.MetadataResponseTopic(error_code=0, name=TOPIC, topic_id=TOPIC_ID,
                                                        partitions=partitions))
            else:
                topics.append(cls.MetadataResponseTopic(error_code=UNKNOWN_TOPIC_OR_PARTITION, name=name,
                                                        topic_id=topic_id or uuid.UUID(int=0)))
        brokers = [cls.MetadataResponseBroker(node_id=n, host=HOST, port=b.port)
                   for n, b in cluster.brokers.items()]
        return cls(brokers=brokers, cluster_id=CLUSTER_ID, controller_id=cluster.controller_id,
                   topics=topics)

    def _find_coordinator(self, body: Any, version: int) -> Any:
        cls: Any = body_class(FIND_COORDINATOR, "response")
        node = self.cluster.coordinator_id
        port = self.cluster.brokers[node].port
        if version < 4:
            return cls(error_code=0, error_message=None, node_id=node, host=HOST, port=port)
        return cls(coordinators=[
            cls.Coordinator(key=k, node_id=node, host=HOST, port=port, error_code=0, error_message=None)
            for k in body.coordinator_keys])

    def _describe_cluster(self, body: Any, version: int) -> Any:
        cls: Any = body_class(DESCRIBE_CLUSTER, "response")
        brokers = [cls.DescribeClusterBroker(broker_id=n, host=HOST, port=b.port)
                   for n, b in self.cluster.brokers.items()]
        return cls(error_code=0, error_message=None, endpoint_type=body.endpoint_type if version else 1,
                   cluster_id=CLUSTER_ID, controller_id=self.cluster.controller_id, brokers=brokers)

    def _produce(self, body: Any, version: int) -> Any:
        cls: Any = body_class(PRODUCE, "response")
        responses = []
        moved: set[int] = set()
        for topic in body.topic_data:
            parts = []
            for p in topic.partition_data:
                leader = self.cluster.leader_of(topic.name, p.index)
                if leader is None:
                    code, offset = UNKNOWN_TOPIC_OR_PARTITION, -1
                elif leader != self.node_id:
                    # The client reached the wrong broker: what a real follower (or stranger) says.
                    code, offset = NOT_LEADER_OR_FOLLOWER, -1
                else:
                    key = (topic.name, p.index)
                    with self._lock:
                        code, offset = 0, self._offsets.get(key, 0)
                        self._offsets[key] = offset + 1
                part = cls.PartitionProduceResponse(
                    index=p.index, error_code=code, base_offset=offset, log_append_time_ms=-1,
                    log_start_offset=0 if code == 0 else -1, record_errors=[], error_message=None)
                if code == NOT_LEADER_OR_FOLLOWER and version >= 10:
                    # KIP-951, as Kafka answers: the leader, and its endpoint (this cluster's own address).
                    assert leader is not None
                    part.current_leader = cls.LeaderIdAndEpoch(leader_id=leader, leader_epoch=0)
                    moved.add(leader)
                parts.append(part)
            responses.append(cls.TopicProduceResponse(name=topic.name, partition_responses=parts))
        return cls(responses=responses, throttle_time_ms=0, node_endpoints=[
            cls.NodeEndpoint(node_id=n, host=HOST, port=self.cluster.brokers[n].port) for n in sorted(moved)])


class FakeCluster:
    """Fake brokers ``node_ids``, each on its own loopback port, serving from the moment it is built.

    Topic ``t`` has one partition per node; partition ``i`` is led by ``node_ids[i]``. The group
    coordinator is ``coordinator_id`` and the controller ``controller_id`` (default: the first node).
    ``errors`` collects every exception a broker hit while answering (the broker then drops that
    connection); a test should assert it stays empty. ``produce_max`` is the newest Produce version
    advertised (at most 12: the fake names topics); from v10 a NOT_LEADER_OR_FOLLOWER answer carries
    KIP-951's current_leader and node_endpoints, the leader's real address.
    """

    def __init__(self, node_ids: Iterable[int] = (1, 2, 3), *, coordinator_id: int = 2,
                 controller_id: int | None = None, produce_max: int = 9) -> None:
        ids = list(node_ids)
        self.api_ranges = {**API_RANGES, PRODUCE: (API_RANGES[PRODUCE][0], produce_max)}
        if coordinator_id not in ids:
            raise ValueError(f"coordinator {coordinator_id} is not one of the nodes {ids}")
        self.brokers: dict[int, FakeBroker] = {n: FakeBroker(self, n) for n in ids}
        self.partition_leaders: list[int] = list(ids)
        self.coordinator_id = coordinator_id
        self.controller_id = ids[0] if controller_id is None else controller_id
        self.errors: list[str] = []
        self.start()

    @property
    def bootstrap(self) -> str:
        """Every broker's address, comma-separated, as a client's bootstrap.servers would list them."""
        return ",".join(f"{HOST}:{b.port}" for b in self.brokers.values())

    @property
    def ports(self) -> dict[int, int]:
        return {n: b.port for n, b in self.brokers.items()}

    def leader_of(self, topic: str, partition: int) -> int | None:
        if topic != TOPIC or not 0 <= partition < len(self.partition_leaders):
            return None
        return self.partition_leaders[partition]

    def start(self) -> FakeCluster:
        """Start every broker that is not running, on its last port (a free one the first time)."""
        for b in self.brokers.values():
            if not b.running:
                b.start()
        return self

    def stop(self) -> None:
        for b in self.brokers.values():
            b.stop()

    def move(self, node_id: int, new_port: int | None = None) -> int:
        """Restart one broker on another port (a free one by default): its old connections are cut,
        its old port refuses, and later Metadata names the new one. Returns the new port."""
        broker = self.brokers[node_id]
        old = broker.port
        broker.stop()
        broker.start(0 if new_port is None else new_port)
        if broker.port == old:
            raise RuntimeError(f"node {node_id} was meant to move but got its old port {old} back")
        return broker.port

    def clear(self) -> None:
        """Forget what every broker received so far."""
        for b in self.brokers.values():
            b.clear()

    def __enter__(self) -> FakeCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

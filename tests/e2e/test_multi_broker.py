"""kproxy's port-per-broker routing in front of a three-node cluster, end to end over real sockets.

The test broker (tansu) is one node, so these tests use ``FakeCluster``: three in-process brokers
that answer Metadata, FindCoordinator, DescribeCluster and Produce, and record what reached them.
A Produce for a partition reaches its leader only through the kproxy port that Metadata gave that
leader; any other port lands on another broker, which answers NOT_LEADER_OR_FOLLOWER.
"""

from __future__ import annotations

import socket
import struct
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import trio

from kproxy.config import config_from_args
from kproxy.protocol.messages import Response, body_class, decode_response
from kproxy.protocol.records import build_batch, iter_batches
from kproxy.server.app import DISCOVERY_REUSE_S
from kproxy.server.embedded import ProxyThread
from tests.e2e.fake_cluster import (
    FIND_COORDINATOR,
    HOST,
    METADATA,
    NOT_LEADER_OR_FOLLOWER,
    PRODUCE,
    TOPIC,
    FakeCluster,
)
from tests.e2e.proxied import free_port_block, start_proxy
from tests.e2e.wire import Wire

pytestmark = pytest.mark.e2e

ADVERTISED = "localhost"
DESCRIBE_CLUSTER = 60


@pytest.fixture
def cluster() -> Iterator[FakeCluster]:
    c = FakeCluster((1, 2, 3))
    try:
        yield c
    finally:
        c.stop()
    assert c.errors == [], "a fake broker failed to answer:\n" + "\n".join(c.errors)


@pytest.fixture
def proxy(cluster: FakeCluster) -> Iterator[ProxyThread]:
    p = start_proxy(cluster.bootstrap, advertised_host=ADVERTISED)
    try:
        yield p
    finally:
        p.stop()


# -- raw requests through kproxy


def at(port: int) -> str:
    return f"{ADVERTISED}:{port}"


def request(address: str, api_key: int, version: int, body: Any) -> Response:
    w = Wire(address, timeout=5)
    try:
        w.send(api_key, version, 7, body)
        return w.receive(api_key, version)
    finally:
        w.close()


def metadata(address: str, version: int = 12) -> Response:
    req: Any = body_class(METADATA, "request")
    return request(address, METADATA, version, req(topics=[req.MetadataRequestTopic(name=TOPIC)]))


def broker_ports(resp: Response) -> dict[int, int]:
    """{node id: port} of the brokers in a Metadata response, checking each sits at kproxy's host."""
    assert {b.host for b in resp.body.brokers} == {ADVERTISED}
    return {b.node_id: b.port for b in resp.body.brokers}


def leaders(resp: Response) -> dict[int, int]:
    """{partition: leader node id} of topic ``t``."""
    (topic,) = resp.body.topics
    assert topic.name == TOPIC and topic.error_code == 0
    return {p.partition_index: p.leader_id for p in topic.partitions}


def produce_body(partition: int, value: bytes) -> Any:
    req: Any = body_class(PRODUCE, "request")
    return req(acks=1, timeout_ms=5000, topic_data=[req.TopicProduceData(name=TOPIC, partition_data=[
        req.PartitionProduceData(index=partition, records=build_batch([(None, value)]))])])


def produce_on(w: Wire, partition: int, value: bytes, correlation_id: int = 1) -> int:
    """Produce v9 of one record over an open connection; the partition's error code."""
    w.send(PRODUCE, 9, correlation_id, produce_body(partition, value))
    (topic,) = w.receive(PRODUCE, 9).body.responses
    (part,) = topic.partition_responses
    assert part.index == partition
    return int(part.error_code)


def produce(address: str, partition: int, value: bytes) -> int:
    w = Wire(address, timeout=5)
    try:
        return produce_on(w, partition, value)
    finally:
        w.close()


def values(cluster: FakeCluster, node_id: int, partition: int) -> list[bytes]:
    """Record values that broker ``node_id`` was sent for partition ``partition`` of ``t``."""
    out = []
    for topic, p, records in cluster.brokers[node_id].produced():
        if topic == TOPIC and p == partition:
            out += [bytes(r.value or b"") for b in iter_batches(records) for r in b.records()]
    return out


def assert_only_leader_got(cluster: FakeCluster, partition: int, expected: list[bytes]) -> None:
    leader = cluster.leader_of(TOPIC, partition)
    for node_id in cluster.brokers:
        got = values(cluster, node_id, partition)
        assert got == (expected if node_id == leader else []), f"node {node_id}, partition {partition}"


def listening(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=2):
            return True
    except OSError:
        return False


# -- tests


def test_each_exposed_port_reaches_its_own_broker(cluster: FakeCluster, proxy: ProxyThread) -> None:
    resp = metadata(proxy.bootstrap)
    ports = broker_ports(resp)
    assert sorted(ports) == [1, 2, 3]
    assert len(set(ports.values())) == 3
    assert not set(ports.values()) & set(cluster.ports.values())
    assert set(ports.values()) <= set(proxy.call(proxy.server.address_map.exposed_ports))
    assert resp.body.controller_id == 1
    led = leaders(resp)
    assert led == {0: 1, 1: 2, 2: 3}

    cluster.clear()
    for partition, leader in led.items():
        assert produce(at(ports[leader]), partition, b"p%d" % partition) == 0
    for partition in led:
        assert_only_leader_got(cluster, partition, [b"p%d" % partition])
    # kproxy keeps the client's id; only the correlation id is its own.
    assert {r.client_id for b in cluster.brokers.values() for r in b.received(PRODUCE)} == {"wire"}

    # The port of node 3 for partition 0 (led by node 1): node 3 gets it and refuses it.
    cluster.clear()
    assert produce(at(ports[3]), 0, b"wrong") == NOT_LEADER_OR_FOLLOWER
    assert cluster.brokers[3].produced() and values(cluster, 3, 0) == [b"wrong"]
    assert not cluster.brokers[1].produced() and not cluster.brokers[2].produced()


def test_coordinator_and_cluster_endpoints_use_the_metadata_ports(
        cluster: FakeCluster, proxy: ProxyThread) -> None:
    ports = broker_ports(metadata(proxy.bootstrap))

    fc: Any = body_class(FIND_COORDINATOR, "request")
    v3 = request(proxy.bootstrap, FIND_COORDINATOR, 3, fc(key="g", key_type=0)).body
    assert (v3.error_code, v3.node_id, v3.host, v3.port) == (0, 2, ADVERTISED, ports[2])
    v4 = request(proxy.bootstrap, FIND_COORDINATOR, 4, fc(key_type=0, coordinator_keys=["g1", "g2"])).body
    assert [(c.key, c.node_id, c.host, c.port) for c in v4.coordinators] == [
        ("g1", 2, ADVERTISED, ports[2]), ("g2", 2, ADVERTISED, ports[2])]

    dc: Any = body_class(DESCRIBE_CLUSTER, "request")
    for version in (0, 1):
        body = request(proxy.bootstrap, DESCRIBE_CLUSTER, version, dc(endpoint_type=1)).body
        assert {b.broker_id: (b.host, b.port) for b in body.brokers} == {
            n: (ADVERTISED, p) for n, p in ports.items()}

    # The coordinator's address is node 2's: a request there reaches fake node 2.
    cluster.clear()
    metadata(at(v3.port))
    assert [r.client_id for r in cluster.brokers[2].received(METADATA)] == ["wire"]
    assert not cluster.brokers[1].received() and not cluster.brokers[3].received()


def test_node_id_base_gives_fixed_ports_listening_from_start(cluster: FakeCluster) -> None:
    proxy = start_proxy(cluster.bootstrap, advertised_host=ADVERTISED, exposure={"node_id_base": 1})
    try:
        start = proxy.server.config.broker_port_start
        count = proxy.server.config.exposure.broker_port_count
        # Discovery at start-up placed every node; the whole range listens, even ports of nodes
        # 4-6 that do not exist, before any client asked for Metadata.
        assert proxy.call(proxy.server.address_map.exposed_ports) == [start, start + 1, start + 2]
        assert all(listening(p) for p in range(start, start + count))

        resp = metadata(proxy.bootstrap)
        assert broker_ports(resp) == {1: start, 2: start + 1, 3: start + 2}
        for partition, leader in leaders(resp).items():
            assert produce(at(start + leader - 1), partition, b"d%d" % partition) == 0
            assert_only_leader_got(cluster, partition, [b"d%d" % partition])
    finally:
        proxy.stop()


def test_node_id_base_ports_route_when_the_cluster_comes_up_after_kproxy(cluster: FakeCluster) -> None:
    # Ports chosen while the fake brokers still hold theirs, so the two cannot collide.
    listen = free_port_block()
    cfg = config_from_args(cluster.bootstrap, f"{HOST}:{listen}",
                           exposure={"advertised_host": ADVERTISED, "broker_port_count": 6, "node_id_base": 1})
    start = cfg.broker_port_start
    cluster.stop()
    with ProxyThread(cfg) as proxy:
        # Discovery found no broker, yet the deterministic ports listen already.
        assert proxy.call(proxy.server.address_map.exposed_ports) == []
        assert all(listening(p) for p in range(start, start + 6))
        cluster.start()
        # A failed discovery answers for new connections for DISCOVERY_REUSE_S (a reconnect storm
        # against a cluster that is down costs one attempt): wait until that has passed.
        server = proxy.server
        deadline = time.monotonic() + 30
        while proxy.call(lambda: trio.current_time() - (server.discovery_ended_at or 0.0)) < DISCOVERY_REUSE_S:
            assert time.monotonic() < deadline, "discovery never ended"
            time.sleep(0.05)
        # A client that kept node 3's address from before (no Metadata through kproxy first).
        assert produce(at(start + 2), 2, b"early") == 0
        assert_only_leader_got(cluster, 2, [b"early"])


def test_a_moved_broker_is_reached_at_the_same_kproxy_port(cluster: FakeCluster, proxy: ProxyThread) -> None:
    before = broker_ports(metadata(proxy.bootstrap))
    exposed = proxy.call(proxy.server.address_map.exposed_ports)
    held = Wire(at(before[2]), timeout=5)   # a client connection to node 2 that outlives the move
    try:
        assert produce_on(held, 1, b"before", 1) == 0

        old = cluster.brokers[2].port
        new = cluster.move(2)
        # Until kproxy hears of the move, node 2 is unreachable: a retriable error, not a hang.
        assert produce_on(held, 1, b"lost", 2) == NOT_LEADER_OR_FOLLOWER
        cluster.clear()
        after = metadata(proxy.bootstrap)
        assert broker_ports(after) == before
        assert proxy.call(proxy.server.address_map.exposed_ports) == exposed
        route = proxy.call(lambda: proxy.server.address_map.route_for_port(before[2]))
        assert route is not None and route.upstream == (HOST, new) != (HOST, old)

        assert produce(at(before[2]), 1, b"new connection") == 0
        # The held connection reconnects upstream to where node 2 is now, not where it was.
        assert produce_on(held, 1, b"held connection", 3) == 0
    finally:
        held.close()
    assert_only_leader_got(cluster, 1, [b"new connection", b"held connection"])
    assert cluster.brokers[2].port == new


def test_kafka_python_producer_reaches_each_leader(cluster: FakeCluster, proxy: ProxyThread) -> None:
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=proxy.bootstrap, client_id="multi-broker", acks=1,
                             enable_idempotence=False, linger_ms=0, request_timeout_ms=5000,
                             max_block_ms=5000)
    try:
        for partition in range(3):
            sent = producer.send(TOPIC, value=b"kp%d" % partition, partition=partition).get(timeout=10)
            assert (sent.topic, sent.partition) == (TOPIC, partition)
    finally:
        producer.close(timeout=5)
    for partition in range(3):
        assert_only_leader_got(cluster, partition, [b"kp%d" % partition])
    produces = [r for b in cluster.brokers.values() for r in b.received(PRODUCE)]
    assert {r.client_id for r in produces} == {"multi-broker"}


def _produced_records(admin: str) -> float:
    """kproxy_records_total for produced records, summed over its labels, from kproxy's /metrics."""
    with urllib.request.urlopen(f"http://{admin}/metrics", timeout=10) as r:
        return sum(float(line.rpartition(" ")[2]) for line in r.read().decode().splitlines()
                   if line.startswith("kproxy_records_total{") and 'direction="produced"' in line)


@pytest.mark.parametrize("metrics", [False, True], ids=["no-options", "metrics"])
def test_produce_v10_leader_hints_never_name_a_broker_behind_kproxy(
        metrics: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # KIP-951: a Produce v10+ answer refusing a partition (NOT_LEADER_OR_FOLLOWER) names the leader's
    # address in node_endpoints. kproxy lets an answer without them by undecoded (the path counter:
    # what the rewriter's check said of each answer) and rewrites one with them.
    from kproxy.proxy import addresses

    said: list[bool | None] = []
    check = addresses.answer_endpoints

    def counted(frame: Any, version: int) -> bool | None:
        said.append(check(frame, version))
        return said[-1]

    monkeypatch.setattr(addresses, "answer_endpoints", counted)
    cluster = FakeCluster((1, 2, 3), produce_max=12)
    admin = f"127.0.0.1:{free_port_block(1)}"
    proxy = start_proxy(cluster.bootstrap, advertised_host=ADVERTISED, **({"admin": {"listen": admin}} if metrics else {}))
    try:
        ports = broker_ports(metadata(proxy.bootstrap))
        assert leaders(metadata(proxy.bootstrap)) == {0: 1, 1: 2, 2: 3}
        w = Wire(at(ports[1]), timeout=5)
        try:
            for version, correlation_id in ((11, 1), (12, 2)):
                # Partition 0 is node 1's: acknowledged, no hint, relayed.
                w.send(PRODUCE, version, correlation_id, produce_body(0, b"mine"))
                frame = w.read_frame()
                assert frame is not None
                ok = decode_response(frame, PRODUCE, version)
                assert ok.correlation_id == correlation_id and ok.body.node_endpoints == []
                assert ok.body.responses[0].partition_responses[0].error_code == 0
                # Partition 1 is node 2's: refused, with node 2's endpoint, which kproxy rewrites.
                w.send(PRODUCE, version, correlation_id + 10, produce_body(1, b"not yours"))
                frame = w.read_frame()
                assert frame is not None
                moved = decode_response(frame, PRODUCE, version)
                (part,) = moved.body.responses[0].partition_responses
                assert part.error_code == NOT_LEADER_OR_FOLLOWER and part.current_leader.leader_id == 2
                assert [(e.node_id, e.host, e.port) for e in moved.body.node_endpoints] == [(2, ADVERTISED, ports[2])]
                assert HOST.encode() not in frame and struct.pack(">i", cluster.ports[2]) not in frame
        finally:
            w.close()
        # Each acknowledged answer was checked once and let by; each refusal was found to carry
        # endpoints (asked again on the decoded path's way in, so once or twice).
        assert said.count(False) == 2 and said.count(None) == 0 and said.count(True) in (2, 4)
        if metrics:
            # Counted alike on both paths: the acknowledged records, not the refused ones.
            deadline = time.monotonic() + 5
            while _produced_records(admin) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _produced_records(admin) == 2
        assert values(cluster, 1, 0) == [b"mine", b"mine"]
    finally:
        proxy.stop()
        cluster.stop()
    assert cluster.errors == []

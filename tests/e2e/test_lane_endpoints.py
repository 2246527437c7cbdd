"""Produce v10+ and Fetch v16+ relayed in the lane, end to end. KIP-951's node_endpoints (a broker's own
address in a NOT_LEADER answer) are never relayed raw: the lane gives the connection back with that
answer unread and kproxy rewrites it. tansu never sends a leader hint (its node_endpoints are always an
empty array), so the hint comes from ``FakeCluster``, which answers NOT_LEADER_OR_FOLLOWER as Kafka
does; confluent-kafka (librdkafka 2.16: Produce v10 and Fetch v16 on tansu) shows real clients laned."""

from __future__ import annotations

import struct
import time
import uuid

import confluent_kafka
import confluent_kafka.admin
import pytest

from kproxy.protocol.messages import body_class, decode_response
from kproxy.server import lane
from kproxy.server.connection import LANE_AFTER
from tests.e2e.fake_cluster import HOST, METADATA, NOT_LEADER_OR_FOLLOWER, PRODUCE, FakeCluster
from tests.e2e.proxied import start_proxy
from tests.e2e.tansu import TansuBroker, unique_name
from tests.e2e.test_lane import TIMEOUT, counts, moved
from tests.e2e.test_multi_broker import ADVERTISED, at, broker_ports, metadata, produce_body
from tests.e2e.wire import Wire

FETCH = 1

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(not lane.AVAILABLE, reason="the lane is not built in this installation")]


def test_a_laned_produce_answer_naming_the_leader_is_given_back_and_rewritten() -> None:
    cluster = FakeCluster((1, 2, 3), produce_max=12)
    proxy = start_proxy(cluster.bootstrap, advertised_host=ADVERTISED)
    try:
        ports = broker_ports(metadata(proxy.bootstrap))
        for version in (11, 12):
            w = Wire(at(ports[1]), timeout=5)
            before = counts()
            try:
                # Partition 0 is node 1's: acknowledged, no hint. Enough in a row for the lane to take
                # the connection, and the last ones relayed by it.
                for cid in range(LANE_AFTER + 3):
                    w.send(PRODUCE, version, cid, produce_body(0, b"mine"))
                    ok = w.receive(PRODUCE, version)
                    assert ok.correlation_id == cid and ok.body.node_endpoints == []
                    assert ok.body.responses[0].partition_responses[0].error_code == 0
                laned = moved(before)
                assert laned["adopted"] == 1 and laned["requests"] >= 2 and laned["given_back"] == 0
                # Partition 1 is node 2's: refused with node 2's real address, which the lane must not
                # relay: it gives the connection back, and kproxy rewrites the answer.
                w.send(PRODUCE, version, 100, produce_body(1, b"not yours"))
                frame = w.read_frame()
                assert frame is not None
                refused = decode_response(frame, PRODUCE, version)
                (part,) = refused.body.responses[0].partition_responses
                assert refused.correlation_id == 100 and part.error_code == NOT_LEADER_OR_FOLLOWER
                assert [(e.node_id, e.host, e.port) for e in refused.body.node_endpoints] == [
                    (2, ADVERTISED, ports[2])]
                assert HOST.encode() not in frame and struct.pack(">i", cluster.ports[2]) not in frame
                back = moved(before)
                assert back["given_back"] == 1 and back["answers"] == laned["answers"]
                # The connection goes on, on the Python path.
                w.send(PRODUCE, version, 101, produce_body(0, b"again"))
                assert w.receive(PRODUCE, version).body.responses[0].partition_responses[0].error_code == 0
            finally:
                w.close()
        assert proxy.call(lambda: dict(proxy.server.stats.lane_given_back)).get("endpoints") == 2
    finally:
        proxy.stop()
        cluster.stop()
    assert cluster.errors == []


def test_confluent_kafka_produce_and_fetch_are_laned_on_tansu(broker: TansuBroker) -> None:
    topic = unique_name("lane-v10")
    admin = confluent_kafka.admin.AdminClient({"bootstrap.servers": broker.bootstrap})
    admin.create_topics([confluent_kafka.admin.NewTopic(topic, 1, 1)])[topic].result(TIMEOUT)
    with start_proxy(broker.bootstrap, advertised_host="127.0.0.1") as p:
        before = counts()
        acked: list[bytes] = []
        producer = confluent_kafka.Producer({"bootstrap.servers": p.bootstrap, "linger.ms": 0, "acks": "all"})
        for i in range(12):
            producer.produce(topic, value=b"v%02d" % i,
                             on_delivery=lambda err, msg: acked.append(msg.value()) if err is None else None)
            producer.flush(TIMEOUT)
        produced = moved(before)
        consumer = confluent_kafka.Consumer({"bootstrap.servers": p.bootstrap, "group.id": unique_name("g"),
                                             "enable.auto.commit": False, "fetch.wait.max.ms": 50})
        consumer.assign([confluent_kafka.TopicPartition(topic, 0, 0)])
        read: list[bytes] = []
        deadline = time.monotonic() + TIMEOUT
        # Read everything, then long polls of an empty partition for a while.
        idle_until = None
        while (idle_until is None or time.monotonic() < idle_until) and time.monotonic() < deadline:
            m = consumer.poll(0.1)
            if m is not None and m.error() is None:
                read.append(m.value())
            if idle_until is None and len(read) == 12:
                idle_until = time.monotonic() + 1.0
        consumer.close()
        fetched = {k: v - produced[k] for k, v in moved(before).items()}
        given_back = p.call(lambda: dict(p.server.stats.lane_given_back))
    assert sorted(acked) == sorted(read) == [b"v%02d" % i for i in range(12)]
    # The producer's connection was laned and relayed its Produce v10 requests (librdkafka sends
    # nothing else on it once it knows the partition's leader), then the consumer's its Fetch v16.
    assert produced["adopted"] >= 1 and produced["requests"] >= 12 - LANE_AFTER - 1
    assert fetched["adopted"] >= 1 and fetched["requests"] >= 5
    # tansu's node_endpoints are always empty: no answer was given back for them.
    assert "endpoints" not in given_back


def _fetch_v16(w: Wire, correlation_id: int, topic_id: uuid.UUID, wait_ms: int) -> None:
    cls = body_class(FETCH, "request")
    w.send(FETCH, 16, correlation_id, cls(max_wait_ms=wait_ms, min_bytes=1, max_bytes=1 << 20, topics=[
        cls.FetchTopic(topic_id=topic_id, partitions=[cls.FetchPartition(
            partition=0, fetch_offset=0, partition_max_bytes=1 << 20)])]))


def test_a_laned_fetch_v16_long_poll_outlasting_the_request_timeout_is_answered(broker: TansuBroker) -> None:
    # The lane times a request by request_timeout_s alone and gives the connection back; the
    # watchdog's rule (the timeout plus the Fetch's max_wait_ms) then decides: not overdue, so the
    # long poll is answered when the broker answers (a dropped broker connection would have answered
    # it with a retriable error at once).
    topic = unique_name("lane-poll")
    admin = confluent_kafka.admin.AdminClient({"bootstrap.servers": broker.bootstrap})
    admin.create_topics([confluent_kafka.admin.NewTopic(topic, 1, 1)])[topic].result(TIMEOUT)
    with start_proxy(broker.bootstrap, advertised_host="127.0.0.1",
                     upstream_settings={"request_timeout_s": 0.5}) as p:
        w = Wire(p.bootstrap)
        meta = body_class(METADATA, "request")
        w.send(METADATA, 12, 1, meta(topics=[meta.MetadataRequestTopic(name=topic)]))
        (described,) = w.receive(METADATA, 12).body.topics
        before = counts()
        for cid in range(LANE_AFTER + 2):
            _fetch_v16(w, 10 + cid, described.topic_id, 0)
            assert w.receive(FETCH, 16).correlation_id == 10 + cid
        assert moved(before)["adopted"] == 1
        started = time.monotonic()
        _fetch_v16(w, 50, described.topic_id, 1500)
        answer = w.receive(FETCH, 16)
        waited = time.monotonic() - started
        assert answer.correlation_id == 50 and answer.body.error_code == 0
        assert answer.body.responses[0].partitions[0].error_code == 0
        assert waited > 0.5
        given_back = p.call(lambda: dict(p.server.stats.lane_given_back))
        assert given_back == {"request_timeout": 1}
        # The connection goes on.
        _fetch_v16(w, 60, described.topic_id, 0)
        after = w.receive(FETCH, 16)
        assert (after.correlation_id, after.body.error_code) == (60, 0)
        w.close()

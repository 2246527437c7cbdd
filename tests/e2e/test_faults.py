"""Faults through kproxy: bad frames, pipelining, disconnects with requests in flight, a broker that
goes away and comes back, and a SIGTERM drain. Each asserts what the client sees, not just survival."""

from __future__ import annotations

import contextlib
import logging
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator

import confluent_kafka
import pytest

from kproxy.protocol.messages import Request, body_class, encode_request_frame
from kproxy.proxy.filters import ConnectionContext, Filter
from kproxy.server.embedded import ProxyThread
from tests.e2e.proxied import free_port_block, in_flight, start_proxy
from tests.e2e.relay import Relay
from tests.e2e.sasl_gate import SaslGate, confluent_roundtrip, expected_pairs
from tests.e2e.scenarios import confluent_create_topic, confluent_produce_consume, expected_records
from tests.e2e.tansu import Tansu, TansuBroker, free_port, unique_name
from tests.e2e.wire import Wire

pytestmark = pytest.mark.e2e


@pytest.fixture
def proxy(broker: TansuBroker) -> Iterator[ProxyThread]:
    p = start_proxy(broker.bootstrap, advertised_host="127.0.0.1")
    try:
        yield p
    finally:
        p.stop()


def test_malformed_frame_closes_only_that_connection(proxy: ProxyThread, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kproxy")
    good = Wire(proxy.bootstrap)
    assert good.metadata(1).correlation_id == 1
    bad = Wire(proxy.bootstrap)
    # A Metadata v12 request whose topics array claims 2^30 entries in a 20-byte frame.
    header = struct.pack(">hhih", 3, 12, 9, 4) + b"evil" + b"\x00"
    bad.send_raw(struct.pack(">i", len(header) + 5) + header + b"\xff\xff\xff\xff\x04")
    assert bad.closed_by_peer()
    bad.close()
    # The other connection is untouched, and the reason was logged with the field path.
    assert good.metadata(2).correlation_id == 2
    deadline = time.monotonic() + 5
    while not any("metadata.v12.topics" in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert any("malformed metadata v12 request" in r.getMessage() and "metadata.v12.topics" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    good.close()


def test_oversized_frame_is_refused_before_reading_it(broker: TansuBroker,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kproxy")
    # 64 KiB, not less: the follow-up Metadata answer must fit, and on a broker that earlier test files
    # filled with topics it outgrows a 1 KiB limit (it lists every topic).
    p = start_proxy(broker.bootstrap, limits={"max_frame_size": 65536})
    try:
        w = Wire(p.bootstrap)
        w.send_raw(struct.pack(">i", 50_000_000) + b"\x00" * 16)
        assert w.closed_by_peer()
        w.close()
        deadline = time.monotonic() + 5   # the reason is logged as the connection winds down
        while not any("exceeds the 65536-byte limit (limits.max_frame_size)" in r.getMessage()
                      for r in caplog.records):
            assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
            time.sleep(0.02)
        w = Wire(p.bootstrap)
        assert w.metadata(3).correlation_id == 3
        w.close()
    finally:
        p.stop()


def test_pipelined_requests_are_answered_in_order(proxy: ProxyThread) -> None:
    w = Wire(proxy.bootstrap)
    # 60 requests of three APIs, sent before reading anything, with correlation ids out of order.
    ids = [(i * 7919) % 1000 + 1 for i in range(60)]
    kinds = []
    for n, cid in enumerate(ids):
        if n % 3 == 0:
            w.send(3, 12, cid, body_class(3, "request")(topics=[]))
            kinds.append((3, 12))
        elif n % 3 == 1:
            w.send(18, 3, cid, body_class(18, "request")(client_software_name="wire",
                                                          client_software_version="1"))
            kinds.append((18, 3))
        else:
            w.send(60, 0, cid, body_class(60, "request")())
            kinds.append((60, 0))
    got = [w.receive(k, v).correlation_id for k, v in kinds]
    assert got == ids
    w.close()


def test_client_gone_with_requests_in_flight_leaks_nothing(proxy: ProxyThread, broker: TansuBroker) -> None:
    topic = unique_name("leak")
    confluent_create_topic(broker.bootstrap, topic)
    fetch = body_class(1, "request")
    wires = []
    for i in range(20):
        w = Wire(proxy.bootstrap)
        # A long poll the broker holds for up to 5 s: still in flight when the client vanishes.
        w.send(1, 12, i, fetch(max_wait_ms=5000, min_bytes=1_000_000, max_bytes=1_000_000, topics=[
            fetch.FetchTopic(topic=topic, partitions=[fetch.FetchPartition(
                partition=0, fetch_offset=0, partition_max_bytes=1_000_000)])]))
        w.send(3, 12, 100 + i, body_class(3, "request")(topics=[]))
        wires.append(w)

    def ours() -> list:
        return [c for c in proxy.server.connections if c.session.ctx.client_id == "wire"]

    deadline = time.monotonic() + 15
    while not proxy.call(lambda: len(ours()) == 20 and all(c.upstream is not None and c.session.in_flight
                                                           for c in ours())):
        assert time.monotonic() < deadline, "the long polls never reached the broker"
        time.sleep(0.02)
    # kproxy's own sockets for these connections, both sides: what must be closed afterwards. (Not
    # the test process's descriptor count: the broker, clients and threads of other tests move it.)
    sockets = proxy.call(lambda: [t.raw for c in ours() for t in (c.client, c.upstream) if t is not None])
    assert len(sockets) == 40
    for w in wires:
        w.sock.setsockopt(1, 13, struct.pack("ii", 1, 0))  # SO_LINGER 0: reset, like a crashed client
        w.close()
    deadline = time.monotonic() + 15
    while proxy.call(lambda: len(ours())) or any(s.fileno() != -1 for s in sockets):
        assert time.monotonic() < deadline, "connections or sockets left open"
        time.sleep(0.05)
    assert proxy.call(lambda: proxy.server.stats.connections_open) == 0


# -- a broker that goes away and comes back


@contextlib.contextmanager
def relayed_tansu(binary: str) -> Iterator[Relay]:
    """A tansu broker behind a relay that can be cut, hung and restored; it advertises the relay,
    so every connection kproxy makes to the broker passes through it."""
    relay_port = free_port()
    tansu = Tansu(binary, advertised=("127.0.0.1", relay_port))
    relay = Relay(("127.0.0.1", tansu.port), relay_port)
    relay.start()
    try:
        with tansu:
            yield relay
    finally:
        relay.stop()


def test_broker_outage_with_idempotent_producer_loses_no_acknowledged_record(tansu_binary: str) -> None:
    with relayed_tansu(tansu_binary) as relay, \
            start_proxy(relay.bootstrap, advertised_host="127.0.0.1") as p:
        topic = f"outage-{relay.address[1]}"
        confluent_create_topic(p.bootstrap, topic)
        acked: list[bytes] = []
        failed: list[str] = []

        def on_delivery(err: object, msg: confluent_kafka.Message) -> None:
            if err is None:
                acked.append(msg.value())
            else:
                failed.append(str(err))

        producer = confluent_kafka.Producer({
            "bootstrap.servers": p.bootstrap, "enable.idempotence": True, "acks": "all",
            "message.timeout.ms": 60000, "retry.backoff.ms": 100, "reconnect.backoff.ms": 100,
            "reconnect.backoff.max.ms": 500, "linger.ms": 5})
        n = 600
        for i in range(n):
            producer.produce(topic, value=b"r%05d" % i, key=b"k%d" % (i % 7), on_delivery=on_delivery)
            producer.poll(0)
            if i == 200:
                producer.flush(10)
                relay.stop()                     # the broker "goes away" mid-run
            if i == 300:
                time.sleep(1.5)
                relay.start()                    # ... and comes back
            time.sleep(0.002)
        assert producer.flush(60) == 0
        assert failed == []
        assert sorted(acked) == [b"r%05d" % i for i in range(n)]
        # Every acknowledged record is there afterwards, once (idempotence: no duplicates).
        consumer = confluent_kafka.Consumer({"bootstrap.servers": p.bootstrap, "group.id": f"g-{topic}",
                                             "auto.offset.reset": "earliest", "enable.auto.commit": False})
        parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([confluent_kafka.TopicPartition(topic, q, 0) for q in parts])
        seen: list[bytes] = []
        deadline = time.monotonic() + 30
        while len(seen) < n and time.monotonic() < deadline:
            m = consumer.poll(0.5)
            if m is not None and m.error() is None:
                seen.append(m.value())
        consumer.close()
        assert sorted(seen) == sorted(acked)


def test_hung_broker_gives_retriable_errors_not_a_hung_socket(tansu_binary: str) -> None:
    with relayed_tansu(tansu_binary) as relay, start_proxy(
            relay.bootstrap, advertised_host="127.0.0.1", upstream_settings={"request_timeout_s": 1.0}) as p:
        w = Wire(p.bootstrap)
        assert w.metadata(1).correlation_id == 1
        relay.hung.set()       # the broker stops answering but keeps the connection open
        lo = body_class(2, "request")
        started = time.monotonic()
        w.send(2, 7, 5, lo(replica_id=-1, topics=[lo.ListOffsetsTopic(name="t", partitions=[
            lo.ListOffsetsPartition(partition_index=0, timestamp=-1)])]))
        resp = w.receive(2, 7)
        assert resp.correlation_id == 5
        assert resp.body.topics[0].partitions[0].error_code == 6   # NOT_LEADER_OR_FOLLOWER: retriable
        assert 0.9 < time.monotonic() - started < 5
        relay.hung.clear()
        assert w.metadata(6).correlation_id == 6       # next request reconnects
        w.close()


def test_real_broker_restart_clients_recover(tansu_binary: str) -> None:
    # A real tansu restart (memory storage: it comes back empty): the client is not hung, gets
    # retriable errors while the broker is down, and works again once it is back.
    b = TansuBroker(tansu_binary)
    b.start()
    p = None
    try:
        p = start_proxy(b.bootstrap, advertised_host="127.0.0.1")
        topic = f"restart-{b.port}"
        assert confluent_produce_consume(p.bootstrap, topic, n=20) == expected_records(20)
        w = Wire(p.bootstrap)
        assert w.metadata(1).correlation_id == 1
        b.stop()
        # While the broker is down, a request on the open connection is answered or the
        # connection closes: never a hang (Wire's socket timeout would fail the test).
        w.send(3, 12, 2, body_class(3, "request")(topics=[]))
        assert w.read_frame() is None
        w.close()
        b.start()
        assert confluent_produce_consume(p.bootstrap, f"{topic}-after", n=20) == expected_records(20)
    finally:
        if p is not None:
            p.stop()
        b.stop()


def test_sigterm_drains_in_flight_requests(broker: TansuBroker) -> None:
    port = free_port_block()
    admin = f"127.0.0.1:{free_port()}"
    # A session of its own, as a service manager would start it: in pytest's session the kernel's
    # autogroup scheduler shares one session's CPU among everything in it, and under load kproxy
    # alone then took 10-14 s to start.
    proc = subprocess.Popen([sys.executable, "-m", "kproxy", "run", "--upstream", broker.bootstrap,
                             "--listen", f"127.0.0.1:{port}", "--admin", admin],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                w = Wire(f"127.0.0.1:{port}")
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "kproxy did not start"
                time.sleep(0.1)
        topic = unique_name("drain")
        confluent_create_topic(broker.bootstrap, topic)
        fetch = body_class(1, "request")
        started = time.monotonic()
        w.send(1, 12, 42, fetch(max_wait_ms=1500, min_bytes=1_000_000, max_bytes=1_000_000, topics=[
            fetch.FetchTopic(topic=topic, partitions=[fetch.FetchPartition(
                partition=0, fetch_offset=0, partition_max_bytes=1_000_000)])]))
        # Signalled once kproxy holds the long poll (before, it would rightly close the connection
        # as one that owes nothing).
        deadline = time.monotonic() + 15
        while in_flight(admin) < 1:
            assert time.monotonic() < deadline, "the long poll never reached kproxy"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        # The long poll still in flight is answered, then the connection closes and kproxy exits.
        resp = w.receive(1, 12)
        assert resp.correlation_id == 42 and resp.body.error_code == 0
        assert w.closed_by_peer()
        w.close()
        assert proc.wait(10) == 0
        assert time.monotonic() - started < 8
        # No new connections once draining.
        with pytest.raises(OSError):
            Wire(f"127.0.0.1:{port}", timeout=2).metadata()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_in_flight_limit_applies_backpressure_and_keeps_order(broker: TansuBroker) -> None:
    p = start_proxy(broker.bootstrap, advertised_host="127.0.0.1", limits={"max_in_flight_requests": 2})
    try:
        w = Wire(p.bootstrap)
        ids = list(range(500, 440, -1))
        for cid in ids:
            w.send(3, 12, cid, body_class(3, "request")(topics=[]))
        peak = p.call(lambda: max((len(c.session.in_flight) for c in p.server.connections), default=0))
        assert peak <= 2
        assert [w.receive(3, 12).correlation_id for _ in ids] == ids
        w.close()
    finally:
        p.stop()


def test_acks_zero_produce_gets_no_response_and_lands(proxy: ProxyThread, broker: TansuBroker) -> None:
    topic = unique_name("acks0")
    confluent_create_topic(broker.bootstrap, topic)
    producer = confluent_kafka.Producer({"bootstrap.servers": proxy.bootstrap, "acks": "0",
                                         "enable.idempotence": False, "linger.ms": 0})
    for i in range(100):
        producer.produce(topic, value=b"z%03d" % i, partition=i % 3)
    assert producer.flush(10) == 0
    consumer = confluent_kafka.Consumer({"bootstrap.servers": proxy.bootstrap, "group.id": f"g-{topic}",
                                         "enable.auto.commit": False})
    consumer.assign([confluent_kafka.TopicPartition(topic, q, 0) for q in range(3)])
    seen: set[bytes] = set()
    deadline = time.monotonic() + 15
    while len(seen) < 100 and time.monotonic() < deadline:
        m = consumer.poll(0.5)
        if m is not None and m.error() is None:
            seen.add(m.value())
    consumer.close()
    assert seen == {b"z%03d" % i for i in range(100)}
    # acks=0 Produce requests were forwarded but never waited on: none is left in flight.
    assert produce_in_flight(proxy) == 0


def produce_in_flight(p: ProxyThread) -> int:
    return int(p.call(lambda: sum(1 for c in p.server.connections for e in c.session.in_flight
                                  if e.api_key == 0)))


def test_frames_over_the_buffer_limit_are_refused(broker: TansuBroker) -> None:
    p = start_proxy(broker.bootstrap, advertised_host="127.0.0.1", limits={"max_buffered_bytes": 4096})
    try:
        w = Wire(p.bootstrap)
        w.send_raw(struct.pack(">i", 5000) + b"\x00" * 5000)
        assert w.closed_by_peer()
        w.close()
    finally:
        p.stop()


def test_unknown_broker_port_is_served_then_rerouted(tansu_binary: str) -> None:
    # Brokers that demand SASL defeat kproxy's discovery (it has no credentials), so after a kproxy
    # restart a client holding cached addresses connects straight to a broker port kproxy cannot
    # place. kproxy serves it through the bootstrap servers, learns the node's address from the
    # first response, then closes between requests; the client's reconnect reaches the node itself.
    boot = SaslGate(None, {"alice": "pw"})           # the bootstrap address
    node = SaslGate(None, {"alice": "pw"})           # the address tansu advertises for node 111
    with Tansu(tansu_binary, advertised=node.address) as tansu:
        boot.upstream = node.upstream = (tansu.host, tansu.port)
        with boot, node:
            p = start_proxy(f"127.0.0.1:{boot.port}", advertised_host="127.0.0.1",
                            exposure={"node_id_base": 111, "broker_port_count": 4})
            try:
                broker_addr = f"127.0.0.1:{p.server.config.broker_port_start}"   # node 111's port
                settings = {"bootstrap.servers": broker_addr, "security.protocol": "SASL_PLAINTEXT",
                            "sasl.mechanism": "PLAIN", "sasl.username": "alice", "sasl.password": "pw"}
                assert confluent_roundtrip(settings, f"reroute-{boot.port}", n=20) == expected_pairs(20)
                # The first connection went through the bootstrap gate; requests after the reroute
                # reached the node's own address.
                assert {a.user for a in boot.authentications} == {"alice"}
                assert any(api == 0 for _, api, _ in node.forwarded)   # Produce went to the node
                assert not any(api == 0 for _, api, _ in boot.forwarded)
            finally:
                p.stop()


class _Broken(Filter):
    """A filter with a bug: raises on every Metadata request from client id "crash"."""

    name = "broken"
    request_api_keys = frozenset({3})

    def on_request(self, ctx: ConnectionContext, exchange) -> None:
        request = exchange.request
        if request.client_id == "crash":
            raise RuntimeError("filter bug")
        return None


def test_a_failing_filter_ends_only_its_connection(broker: TansuBroker,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kproxy")
    p = start_proxy(broker.bootstrap, advertised_host="127.0.0.1", filters=[_Broken()])
    try:
        good = Wire(p.bootstrap)
        assert good.metadata(1).correlation_id == 1
        bad = Wire(p.bootstrap)
        bad.sock.sendall(b"".join(bytes(b) for b in encode_request_frame(
            Request.build(3, 12, 5, "crash", body_class(3, "request")(topics=[])))))
        assert bad.closed_by_peer()
        bad.close()
        assert good.metadata(2).correlation_id == 2       # the proxy and other clients carry on
        deadline = time.monotonic() + 5
        while not any("internal error in filter 'broken'" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        # The traceback is logged (code, not message contents).
        assert any(r.exc_info and "filter bug" in str(r.exc_info[1]) for r in caplog.records)
        good.close()
    finally:
        p.stop()

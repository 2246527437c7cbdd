"""Connections handed to the lane and taken back (kproxy.server.lane), with real clients on tansu:
the lane's path counters show it adopted connections and relayed their requests, and what clients
get, what metrics count, a lost broker, a drain, a rules reload and a frame the lane does not take
are what the Python path gives. Skipped as a whole only where the lane is not built."""

from __future__ import annotations

import contextlib
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import confluent_kafka
import confluent_kafka.admin
import kafka
import pytest
import trio

from kproxy.protocol.messages import body_class
from kproxy.server import lane
from kproxy.server.connection import LANE_AFTER
from tests.e2e.fake_cluster import FakeCluster
from tests.e2e.proxied import free_port_block, start_proxy
from tests.e2e.relay import Relay
from tests.e2e.tansu import Tansu, TansuBroker, free_port, unique_name
from tests.e2e.wire import Wire

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(not lane.AVAILABLE, reason="the lane is not built in this installation")]

TIMEOUT = 30.0
REPO = Path(__file__).resolve().parents[2]
PRODUCE, FETCH, LIST_OFFSETS, METADATA, API_VERSIONS = 0, 1, 2, 3, 18
NOT_LEADER_OR_FOLLOWER = 6


def list_offsets(w: Wire, correlation_id: int, topic: str = "t") -> Any:
    lo = body_class(LIST_OFFSETS, "request")
    w.send(LIST_OFFSETS, 7, correlation_id, lo(replica_id=-1, topics=[lo.ListOffsetsTopic(name=topic, partitions=[
        lo.ListOffsetsPartition(partition_index=0, timestamp=-1)])]))
    return w.receive(LIST_OFFSETS, 7)


def counts() -> dict[str, int]:
    adopted, given_back, requests, answers = lane.path_counts()
    return {"adopted": adopted, "given_back": given_back, "requests": requests, "answers": answers}


def moved(before: dict[str, int]) -> dict[str, int]:
    now = counts()
    return {k: now[k] - before[k] for k in now}


def scrape(admin: str) -> dict[str, float]:
    """Every sample of a kproxy's /metrics, by its line's name and labels (the virtual_cluster label left out)."""
    out: dict[str, float] = {}
    with urllib.request.urlopen(f"http://{admin}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name.replace('virtual_cluster="default",', "").replace(',virtual_cluster="default"', "")
                    .replace('{virtual_cluster="default"}', "")] = float(value)
    return out


def wait_for(predicate: Any, what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout:g}s")
        time.sleep(0.02)


# -- the lane takes a steady connection, and metrics count what it relayed


def test_metrics_count_every_request_the_lane_relayed(broker: TansuBroker) -> None:
    admin = f"127.0.0.1:{free_port()}"
    with start_proxy(broker.bootstrap, advertised_host="127.0.0.1", admin={"listen": admin}) as p:
        w = Wire(p.bootstrap)
        before = counts()
        n = 40
        for i in range(n):
            assert list_offsets(w, 10 + i).correlation_id == 10 + i
        lane_moved = moved(before)
        metrics = scrape(admin)
        # /clients is current while the lane holds the connection, not as of its last give-back.
        live = p.call(lambda: p.server.clients.view())["connections"]
        w.close()
        # /clients counts them too, once the lane gives the closed connection back.
        wait_for(lambda: p.server.clients.recent, "the connection closed")
        row = p.server.clients.recent[-1].row()
    assert (row["requests"], row["request_bytes"] > 0) == (n, True)
    assert [(c["requests"], c["request_bytes"], c["response_bytes"]) for c in live] == \
        [(row["requests"], row["request_bytes"], row["response_bytes"])]
    assert lane_moved["adopted"] == 1
    # All but the first LANE_AFTER went through the lane (the last answer may still be on its way).
    assert lane_moved["requests"] == n - LANE_AFTER
    assert metrics['kproxy_requests_total{api="list_offsets"}'] == n
    assert metrics['kproxy_request_duration_seconds_count{api="list_offsets"}'] == n
    assert metrics['kproxy_lane_connections'] == 1


def test_the_buffer_budget_counts_laned_connections_and_pauses_them(broker: TansuBroker) -> None:
    """A laned connection's buffers are in kproxy_buffered_bytes, and while the process's budget is
    exhausted (another client's half-sent large frame) the lane reads none of its requests; the
    request is relayed by the lane once the budget has room."""
    admin = f"127.0.0.1:{free_port()}"
    with start_proxy(broker.bootstrap, advertised_host="127.0.0.1", admin={"listen": admin},
                     limits={"max_buffered_bytes_total": 512 * 1024}) as p:
        w, hog = Wire(p.bootstrap, timeout=20), Wire(p.bootstrap)
        try:
            before = counts()
            for i in range(LANE_AFTER + 2):
                assert list_offsets(w, 10 + i).correlation_id == 10 + i
            assert moved(before)["adopted"] == 1
            # Its four 4 KiB buffers, which the Python path does not hold (the process's gauge: no cluster).
            gauge = scrape(admin)['kproxy_buffered_bytes{virtual_cluster=""}']
            assert gauge >= 4 * 4096 + p.call(lambda: p.server.budget.used)
            hog.send_raw(struct.pack(">i", 4 * 1024 * 1024) + b"\x00" * 600_000)   # an incomplete big frame
            wait_for(lambda: p.call(lambda: p.server.budget.exhausted), "the budget exhausted")
            relayed = moved(before)["requests"]
            result: list[float] = []

            def ask() -> None:
                list_offsets(w, 99)
                result.append(time.monotonic())       # when the answer came

            t = threading.Thread(target=ask)
            t.start()
            time.sleep(0.5)
            assert not result and moved(before)["requests"] == relayed      # not read while exhausted
            freed_at = time.monotonic()
            hog.close()                                                     # its buffer goes back
            t.join(10)
            assert result and result[0] >= freed_at                         # answered only once there was room
            assert moved(before)["requests"] == relayed + 1                 # by the lane, still laned
            assert moved(before)["given_back"] == 0
        finally:
            hog.close()
            w.close()


def test_lane_off_takes_nothing(broker: TansuBroker) -> None:
    with start_proxy(broker.bootstrap, advertised_host="127.0.0.1", lane="off") as p:
        assert p.server.lane is None
        w = Wire(p.bootstrap)
        before = counts()
        for i in range(10):
            assert list_offsets(w, i).correlation_id == i
        w.close()
    assert moved(before) == {"adopted": 0, "given_back": 0, "requests": 0, "answers": 0}


def produce_and_group(bootstrap: str, topic: str, n: int) -> tuple[list[bytes], list[bytes]]:
    """A confluent-kafka producer with linger.ms=0 writes ``n`` records one by one while a
    kafka-python consumer group member reads them and heartbeats while idle; (acknowledged, read)."""
    acked: list[bytes] = []
    producer = confluent_kafka.Producer({"bootstrap.servers": bootstrap, "linger.ms": 0, "acks": "all",
                                         "topic.metadata.refresh.interval.ms": 1000})
    consumer = kafka.KafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=unique_name("lane-g"),
                                   auto_offset_reset="earliest", session_timeout_ms=6000,
                                   heartbeat_interval_ms=200, max_poll_interval_ms=6000,
                                   fetch_max_wait_ms=100)
    read: list[bytes] = []
    try:
        for i in range(n):
            producer.produce(topic, value=b"v%04d" % i,
                             on_delivery=lambda err, msg: acked.append(msg.value()) if err is None else None)
            producer.flush(TIMEOUT)
        deadline = time.monotonic() + TIMEOUT
        while len(read) < n and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=200).values():
                read.extend(r.value for r in records)
        # Idle for a while: only heartbeats (and empty fetches) go by.
        idle_until = time.monotonic() + 2.0
        while time.monotonic() < idle_until:
            consumer.poll(timeout_ms=200)
    finally:
        consumer.close()
    return sorted(acked), sorted(read)


def test_real_clients_get_the_same_with_the_lane_as_without(broker: TansuBroker) -> None:
    results = {}
    for setting in ("off", "auto"):
        topic = unique_name(f"lane-{setting}")
        with start_proxy(broker.bootstrap, advertised_host="127.0.0.1", lane=setting) as p:
            before = counts()
            results[setting] = produce_and_group(p.bootstrap, topic, 60)
            results[setting + " moved"] = moved(before)       # type: ignore[assignment]
    expected = sorted(b"v%04d" % i for i in range(60))
    assert results["off"] == results["auto"] == (expected, expected)
    assert results["off moved"]["adopted"] == 0
    on = results["auto moved"]
    # The producer's and the group member's connections were adopted, and the lane relayed requests
    # (Produce with linger.ms=0, heartbeats while idle) and their answers.
    assert on["adopted"] >= 2 and on["requests"] >= 20 and on["answers"] >= 20


# -- the lane gives the connection back


def test_a_broker_lost_while_laned_gives_retriable_errors_and_the_client_recovers(tansu_binary: str) -> None:
    relay_port = free_port()
    with Tansu(tansu_binary, advertised=("127.0.0.1", relay_port)) as tansu:
        relay = Relay(("127.0.0.1", tansu.port), relay_port)
        relay.start()
        try:
            with start_proxy(relay.bootstrap, advertised_host="127.0.0.1") as p:
                w = Wire(p.bootstrap)
                before = counts()
                for i in range(LANE_AFTER + 2):
                    assert list_offsets(w, i).correlation_id == i
                assert moved(before)["adopted"] == 1
                # A request in flight in the lane when the broker goes away.
                relay.hung.set()
                lo = body_class(LIST_OFFSETS, "request")
                w.send(LIST_OFFSETS, 7, 100, lo(replica_id=-1, topics=[lo.ListOffsetsTopic(name="t", partitions=[
                    lo.ListOffsetsPartition(partition_index=0, timestamp=-1)])]))
                wait_for(lambda: moved(before)["requests"] >= 3, "request relayed by the lane")
                relay.stop()
                answer = w.receive(LIST_OFFSETS, 7)
                assert answer.correlation_id == 100
                assert answer.body.topics[0].partitions[0].error_code == NOT_LEADER_OR_FOLLOWER
                assert moved(before)["given_back"] == 1
                relay.hung.clear()
                _restart(relay)
                # The next request reconnects, on the same client connection.
                assert list_offsets(w, 101).body.topics[0].partitions[0].error_code != NOT_LEADER_OR_FOLLOWER
                w.close()
        finally:
            relay.stop()


def fetch(w: Wire, correlation_id: int, topic: str, wait_ms: int) -> None:
    """Send a Fetch v12 of partition 0 from offset 0 that the broker may hold for ``wait_ms``."""
    cls = body_class(FETCH, "request")
    w.send(FETCH, 12, correlation_id, cls(replica_id=-1, max_wait_ms=wait_ms, min_bytes=1, max_bytes=1 << 20,
                                          topics=[cls.FetchTopic(topic=topic, partitions=[cls.FetchPartition(
                                              partition=0, fetch_offset=0, partition_max_bytes=1 << 20)])]))


def test_drain_answers_what_the_lane_has_in_flight_then_closes(broker: TansuBroker) -> None:
    topic = unique_name("lane-drain")
    admin = confluent_kafka.admin.AdminClient({"bootstrap.servers": broker.bootstrap})
    admin.create_topics([confluent_kafka.admin.NewTopic(topic, 1, 1)])[topic].result(TIMEOUT)
    p = start_proxy(broker.bootstrap, advertised_host="127.0.0.1")
    try:
        w = Wire(p.bootstrap)
        before = counts()
        for i in range(LANE_AFTER + 1):
            fetch(w, i, topic, 0)
            assert w.receive(FETCH, 12).correlation_id == i
        assert moved(before)["adopted"] == 1
        # An empty topic: the broker holds this one for its max wait, in flight in the lane.
        fetch(w, 50, topic, 1500)
        wait_for(lambda: moved(before)["requests"] >= 2, "request relayed by the lane")
        started = time.monotonic()
        errors: list[BaseException] = []

        def drain() -> None:
            try:
                p.drain(20.0)
            except BaseException as e:     # reported below, with the test's own assertions
                # (The drain ends the embedded proxy's run, which cancels the call that asked for it.)
                if not (isinstance(e, BaseExceptionGroup) and e.split(trio.Cancelled)[1] is None):
                    errors.append(e)

        drained = threading.Thread(target=drain)
        drained.start()
        answer = w.receive(FETCH, 12)
        assert answer.correlation_id == 50 and answer.body.error_code == 0
        assert w.read_frame() is None       # then the connection closed
        drained.join(TIMEOUT)
        assert not drained.is_alive()
        assert [repr(e) for e in errors] == []
        # Recalled from the lane once answered, and closed gracefully, not at the drain timeout.
        assert time.monotonic() - started < 10
        assert moved(before)["given_back"] == 1
        w.close()
    finally:
        p.stop()


def test_a_rules_reload_reaches_a_laned_connection_before_its_next_request(broker: TansuBroker,
                                                                         tmp_path: Path) -> None:
    topic = unique_name("lane-rules")
    rules = tmp_path / "rules.yaml"
    rules.write_text("default: allow\n")
    with start_proxy(broker.bootstrap, advertised_host="127.0.0.1", rules=[str(rules)]) as p:
        p.server.rules_poll_interval_s = 3600.0     # reloaded below, by hand
        w = Wire(p.bootstrap)
        before = counts()
        for i in range(LANE_AFTER + 3):
            assert list_offsets(w, i, topic).correlation_id == i
        assert moved(before)["adopted"] == 1
        rules.write_text(f"rules: [{{name: no-{topic}, match: {{topic: {topic}}}, action: deny}}]\n")
        assert p.call(lambda: p.server.reload_rules("test"))
        after = counts()
        for i in range(100, 100 + LANE_AFTER + 3):
            answer = list_offsets(w, i, topic)
            assert answer.correlation_id == i
            assert answer.body.topics[0].partitions[0].error_code == 29      # TOPIC_AUTHORIZATION_FAILED
        # A rule addresses ListOffsets now: the lane takes the connection no more.
        assert moved(after)["adopted"] == 0
        w.close()


def test_a_frame_the_lane_does_not_take_in_a_laned_produce_loop(broker: TansuBroker) -> None:
    admin = f"127.0.0.1:{free_port()}"
    topic = unique_name("lane-mix")
    with start_proxy(broker.bootstrap, advertised_host="127.0.0.1", admin={"listen": admin}) as p:
        w = Wire(p.bootstrap)
        before = counts()
        for i in range(30):
            # ApiVersions (which the lane gives back: the session reads it) every 10 requests.
            if i % 10 == 9:
                av = body_class(API_VERSIONS, "request")
                w.send(API_VERSIONS, 3, 1000 + i, av(client_software_name="t", client_software_version="1"))
                assert w.receive(API_VERSIONS, 3).correlation_id == 1000 + i
            else:
                assert list_offsets(w, i, topic).correlation_id == i
        lane_moved = moved(before)
        metrics = scrape(admin)
        w.close()
    assert lane_moved["adopted"] == 3 and lane_moved["given_back"] == 3
    assert metrics['kproxy_lane_given_back_total{reason="frame"}'] == 3
    assert metrics['kproxy_requests_total{api="list_offsets"}'] == 27
    assert metrics['kproxy_requests_total{api="api_versions"}'] == 3


# -- Metadata answered from the lane's memory of the rewrites the Python path made


def test_a_metadata_loop_is_answered_by_the_lane_with_only_kproxys_addresses(broker: TansuBroker) -> None:
    admin = f"127.0.0.1:{free_port()}"
    with start_proxy(broker.bootstrap, advertised_host="127.0.0.1", admin={"listen": admin}) as p:
        assert p.server.lane is not None
        client = confluent_kafka.admin.AdminClient({"bootstrap.servers": p.bootstrap})
        client.list_topics(timeout=TIMEOUT)
        before, memo_before = counts(), p.server.lane.memo_counts()
        n = 40
        addresses = set()
        for _ in range(n):
            addresses |= {(b.host, b.port) for b in client.list_topics(timeout=TIMEOUT).brokers.values()}
        w = Wire(p.bootstrap)
        for i in range(n):
            answer = w.metadata(i)
            assert answer.correlation_id == i
            addresses |= {(b.host, b.port) for b in answer.body.brokers}
        lane_moved, memo = moved(before), p.server.lane.memo_counts()
        exposed = p.call(p.server.address_map.exposed_ports)
        metrics = scrape(admin)
        w.close()
    # Every broker address either client saw is one of kproxy's, never tansu's own.
    assert addresses == {("127.0.0.1", port) for port in exposed} and broker.port not in exposed
    # Both clients' connections were laned (librdkafka's at its first list_topics), and the lane
    # answered their Metadata from its memory, the first LANE_AFTER of the new connection aside.
    assert metrics['kproxy_lane_connections'] == 2 and lane_moved["adopted"] >= 1
    assert lane_moved["answers"] >= 2 * n - 2 * LANE_AFTER
    assert memo.hits - memo_before.hits >= 2 * n - 2 * LANE_AFTER
    assert metrics.get('kproxy_lane_given_back_total{reason="answer_unknown"}', 0) <= 1
    assert metrics['kproxy_lane_remembered_answers_total{result="hit"}'] >= memo.hits
    assert 0 < metrics['kproxy_lane_remembered_answer_bytes'] < 1 << 20
    assert metrics['kproxy_requests_total{api="metadata"}'] >= 2 * n


def test_a_laned_metadata_loop_sees_brokers_come_and_move_at_kproxys_addresses() -> None:
    """The cluster changes under a laned Metadata loop (``FakeCluster``, as tansu is one node that
    does not move): a new node, then a node on another port. The lane gives each first changed
    answer back unread; the client gets it rewritten, and kproxy's address for the new node."""
    from tests.e2e.fake_cluster import FakeBroker

    cluster = FakeCluster((1, 2, 3))
    try:
        with start_proxy(cluster.bootstrap, advertised_host="127.0.0.1") as p:
            w = Wire(p.bootstrap)
            before = counts()

            def loop(first: int, n: int = LANE_AFTER + 4) -> dict[int, tuple[str, int]]:
                seen: dict[int, tuple[str, int]] = {}
                for i in range(first, first + n):
                    answer = w.metadata(i)
                    assert answer.correlation_id == i
                    brokers = {b.node_id: (b.host, b.port) for b in answer.body.brokers}
                    assert seen in ({}, brokers)        # the same in every answer of one loop
                    seen = brokers
                return seen

            start = loop(0)
            assert moved(before)["adopted"] == 1 and moved(before)["answers"] >= 3
            cluster.brokers[4] = FakeBroker(cluster, 4)
            cluster.brokers[4].start()
            grown = loop(100)
            new_port = cluster.move(2)
            after_move = loop(200)
            lane_moved = moved(before)
            exposed = p.call(p.server.address_map.exposed_ports)
            route = p.call(lambda: p.server.address_map.route_for_port(after_move[2][1]))
            memo = p.server.lane.memo_counts()
            w.close()
    finally:
        cluster.stop()
    broker_ports = {b.port for b in cluster.brokers.values()}
    assert set(grown) == {1, 2, 3, 4} and set(start) == {1, 2, 3}
    for seen in (start, grown, after_move):
        assert all(host == "127.0.0.1" and port in exposed and port not in broker_ports
                   for host, port in seen.values())
    # The new node got a kproxy port of its own; the moved one kept its kproxy port, which leads to
    # where it is now.
    assert grown[4] not in start.values() and after_move == grown
    assert route is not None and route.upstream == ("127.0.0.1", new_port)
    # Laned again after each change (each changed answer given back unread, and answered by Python).
    assert lane_moved["adopted"] == 3 and lane_moved["given_back"] >= 2
    # Each move of the address map cleared the lane's memo: only the answer since the last is there.
    assert memo.entries == 1
    assert cluster.errors == []


def _restart(relay: Relay) -> None:
    """Listen again: the address is free once the relay's old accept thread, blocked in accept() on
    the closed listener, has let go of it (a connection wakes it)."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        with contextlib.suppress(OSError):
            socket.create_connection(relay.address, timeout=1).close()
        probe = socket.socket()
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(relay.address)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
        finally:
            probe.close()
    relay.start()


def test_a_consumer_whose_answers_are_larger_than_the_lane_takes_is_left_on_the_python_path(
        broker: TansuBroker) -> None:
    """A consumer reading large batches gets every Fetch answer larger than the lane relays: handing
    it over between fetches would only have it given back (or cost the client pump a wait and the
    broker's pump a park each time), so such a connection stays off the lane, whatever its streak."""
    topic = unique_name("lane-large")
    admin = confluent_kafka.admin.AdminClient({"bootstrap.servers": broker.bootstrap})
    admin.create_topics([confluent_kafka.admin.NewTopic(topic, 1, 1)])[topic].result(TIMEOUT)
    producer = confluent_kafka.Producer({"bootstrap.servers": broker.bootstrap})
    producer.produce(topic, b"x" * (3 * 65536), partition=0)
    assert producer.flush(TIMEOUT) == 0
    with start_proxy(broker.bootstrap, advertised_host="127.0.0.1") as p:
        w = Wire(p.bootstrap)
        before = counts()
        try:
            for i in range(4 * LANE_AFTER):
                fetch(w, i, topic, 500)
                answer = w.receive(FETCH, 12)
                assert answer.correlation_id == i
                assert len(answer.body.responses[0].partitions[0].records) > 3 * 65536
        finally:
            w.close()
        print("MOVED", moved(before))
        assert moved(before)["adopted"] == 0



def test_a_producer_of_batches_stored_whole_is_read_to_the_end(tmp_path: Path) -> None:
    """confluent-kafka producing 1 MB batches (its default batch size), several in flight, through
    kproxy storing frames whole (``cut_through_min_bytes: null``): every record is acknowledged.

    A request whose first bytes were read into a buffer of its own used to have the connection
    offered to the lane on each read of it. An offer refused woke the broker's pump without letting it
    run, and the next offer cancelled that pump's spent scope and waited for ever for it to park: the
    client was read no more, and the request timed out after ``limits.frame_timeout_s``. It takes a
    broker that acknowledges at once (tansu is slower than the second offer) and a kproxy process of
    its own, so ``bench/fake_broker.py`` and ``kproxy run``, with no admin listener (metrics keep
    Produce off the lane). The log (DEBUG) says what the lane did."""
    broker, port = free_port(), free_port_block(2)
    config = tmp_path / "kproxy.yaml"
    config.write_text(f'listen: "127.0.0.1:{port}"\nupstream: {{bootstrap_servers: "127.0.0.1:{broker}"}}\n'
                      "cut_through_min_bytes: null\nlimits: {frame_timeout_s: 5}\nlog_level: DEBUG\n")
    log = tmp_path / "kproxy.log"
    with open(log, "wb") as out:
        fake = subprocess.Popen([sys.executable, str(REPO / "bench" / "fake_broker.py"), "--listen",
                                 f"127.0.0.1:{broker}"], stdout=subprocess.DEVNULL, stderr=out)
        proxy = subprocess.Popen([sys.executable, "-m", "kproxy", "run", "--config", str(config)],
                                 stdout=subprocess.DEVNULL, stderr=out)
    try:
        wait_for(lambda: b"kproxy listening" in log.read_bytes(), "kproxy listening")
        producer = confluent_kafka.Producer({"bootstrap.servers": f"127.0.0.1:{port}", "acks": 1,
                                             "queue.buffering.max.messages": 100_000})
        for _ in range(30_000):
            producer.produce("stored-batches", b"x" * 1024, partition=0)
        left = producer.flush(TIMEOUT)
    finally:
        for proc in (proxy, fake):
            proc.terminate()
            proc.wait(10)
    text = log.read_text()
    assert left == 0, text[-2000:]
    assert "did not arrive whole" not in text
    # Requests larger than the lane takes keep the connection off it: it is never handed over only to
    # be given back at the next request.
    assert "the lane gave the connection back (frame" not in text

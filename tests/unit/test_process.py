"""The process of several virtual clusters, without a broker: metrics labelled per virtual cluster,
readiness that names each one, finding a virtual cluster by name, which names a shared SNI port gives
to whom, and reading a ClientHello's host name off a socket without taking a byte."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from kproxy.config import parse_config
from kproxy.identity.client_hello import NotClientHello, ServerName
from kproxy.server.process import LAG_HELD_S, ProxyProcess, peek_client_hello
from kproxy.telemetry.exchange import Exchange, Learned
from kproxy.telemetry.metrics import BUCKETS, ProcessMetrics
from tests.unit.test_client_hello import client_hello
from tests.unit.test_telemetry import ctx as telemetry_ctx
from tests.unit.test_telemetry import produce_entry

TWO = """\
virtual_clusters:
  - name: team-a
    listen: "127.0.0.1:19092"
    upstream: {bootstrap_servers: ["a:9092"]}
  - name: team-b
    listen: "127.0.0.1:19192"
    upstream: {bootstrap_servers: ["b:9092"]}
admin: {listen: "127.0.0.1:19644"}
"""


def test_every_sample_says_its_virtual_cluster_and_families_merge() -> None:
    m = ProcessMetrics()
    a, b = m.cluster("team-a"), m.cluster("team-b")
    for metrics, n in ((a, 1), (b, 2)):
        for _ in range(n):
            metrics.record(Exchange(produce_entry({("t", 0): b""}, {("t", 0): 0}), telemetry_ctx(), Learned()))
    from prometheus_client.core import GaugeMetricFamily

    m.add_reader(lambda: [GaugeMetricFamily("kproxy_buffered_bytes", "Bytes held.", value=7)])
    text = m.exposition().decode()
    assert text.count("# TYPE kproxy_requests_total counter") == 1
    assert 'kproxy_requests_total{api="produce",virtual_cluster="team-a"} 1.0' in text
    assert 'kproxy_requests_total{api="produce",virtual_cluster="team-b"} 2.0' in text
    assert 'kproxy_buffered_bytes{virtual_cluster=""} 7.0' in text
    for family in text_string_to_metric_families(text):
        assert all("virtual_cluster" in s.labels for s in family.samples), family.name


async def test_a_blocked_event_loop_is_reported_as_lag_and_a_quiet_one_is_woken_seldom() -> None:
    shared = ProxyProcess.from_config(parse_config(TWO)).shared
    lag = shared.loop_lag

    def later_than(seconds: float) -> int:
        return sum(n for bound, n in zip((*BUCKETS, float("inf")), lag.buckets, strict=True) if bound > seconds)

    async def next_sample() -> None:
        # The timer's task runs: on a starved machine this task's own short sleep can expire in the
        # same turn as the timer's and run first, so wait for the sample rather than for a time.
        count = lag.count
        with trio.fail_after(10):
            while lag.count == count:
                await trio.sleep(0.001)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(shared.watch_loop_lag)
        # A quiet loop: the timer fires every 100 ms, not every 5 ms (unless the machine itself held
        # the loop 5 ms: then it samples finely, rightly).
        await trio.sleep(0.35)
        if shared.loop_lag_max < LAG_HELD_S:
            assert 2 <= lag.count <= 4
        # A task that holds the loop (a blocking call, as a huge frame's work would) longer than the
        # quiet period: every connection waited, and the timer says so, late by the hold less at most
        # one quiet period.
        time.sleep(0.25)
        await next_sample()
        assert shared.loop_lag_max >= 0.15
        # Held once, the loop is sampled every 5 ms for a second (a 100 ms timer fires 3 or 4 times in
        # 0.3 s), so a short hold now shows nearly whole.
        count = lag.count
        await trio.sleep(0.3)
        assert lag.count - count >= 8
        before = later_than(0.025)
        time.sleep(0.04)
        await next_sample()
        assert later_than(0.025) > before
        nursery.cancel_scope.cancel()


def test_the_process_finds_its_virtual_clusters_by_name() -> None:
    process = ProxyProcess.from_config(parse_config(TWO))
    assert list(process.servers) == ["team-a", "team-b"]
    assert process.cluster("team-b").config.upstream.bootstrap_servers[0].host == "b"
    with pytest.raises(LookupError, match="name a virtual cluster: this process serves team-a, team-b"):
        process.cluster()
    with pytest.raises(LookupError, match="no virtual cluster named 'team-c'; this process serves team-a, team-b"):
        process.cluster("team-c")
    alone = ProxyProcess.from_config(parse_config('listen: "127.0.0.1:19092"\nupstream: {bootstrap_servers: ["k:1"]}\n'))
    assert alone.cluster() is alone.cluster("default")
    # Each virtual cluster's own parts; the process's shared ones.
    a, b = process.servers.values()
    assert a.address_map is not b.address_map and a.answer_memo is not b.answer_memo
    assert a.topic_names is not b.topic_names and a.identity is not b.identity
    assert a.budget is b.budget is process.shared.budget


def test_readiness_names_each_virtual_cluster_that_is_not_ready() -> None:
    process = ProxyProcess.from_config(parse_config(TWO))
    a, b = process.servers.values()
    assert process.readiness() == (False, "not ready: team-a (the listeners are not bound yet); team-b (the "
                                          "listeners are not bound yet)")
    for server in (a, b):
        server.bootstrap_address = ("127.0.0.1", server.config.listen.port)
    a.bootstrap_answered = True
    assert process.readiness() == (False, "not ready: team-b (no bootstrap server has answered yet); ready: team-a")
    b.bootstrap_answered = True
    assert process.readiness() == (True, "ready: team-a, team-b")


def test_a_shared_sni_port_gives_each_name_to_the_one_cluster_that_serves_it(tmp_path: Path) -> None:
    import trustme

    ca = trustme.CA()
    leaf = ca.issue_cert("*.a.test", "*.b.test", "*.c.test")
    leaf.private_key_pem.write_to_path(str(tmp_path / "c.key"))
    leaf.cert_chain_pems[0].write_to_path(str(tmp_path / "c.pem"))

    def sni(name: str, port: int, domain: str) -> str:
        return (f"  - name: {name}\n    listen: \"127.0.0.1:{port}\"\n    upstream: {{bootstrap_servers: [\"k:1\"]}}\n"
                f"    tls: {{enabled: true, cert_file: {tmp_path / 'c.pem'}, key_file: {tmp_path / 'c.key'}}}\n"
                f"    exposure: {{mode: sni, sni: {{domain: {domain}}}}}\n")

    cfg = parse_config("virtual_clusters:\n" + sni("a", 19443, "a.test") + sni("b", 19443, "B.Test.")
                       + sni("c", 19444, "c.test"))
    process = ProxyProcess.from_config(cfg)
    (port,) = process.shared_ports          # c has its port alone
    assert str(port.address) == "127.0.0.1:19443" and [s.name for s in port.servers] == ["a", "b"]
    for name, cluster in (("bootstrap.a.test", "a"), ("broker-7.b.test", "b"), ("controller-1.b.test", "b"),
                          ("broker-7.c.test", None), ("x.bootstrap.a.test", None), ("a.test", None),
                          ("broker-07.a.test", None), ("bootstrap.b.test.evil", None)):
        server = port.server_for(name)
        assert (server.name if server else None) == cluster, name
    assert port.tried() == ("a: bootstrap.a.test, broker-<id>.a.test, controller-<id>.a.test; "
                            "b: bootstrap.b.test, broker-<id>.b.test, controller-<id>.b.test")


async def test_the_client_hello_is_read_without_taking_a_byte() -> None:
    hello = client_hello("Broker-3.B.Test")
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    with a, b:
        async with trio.open_nursery() as nursery:
            got: list[object] = []

            async def peek() -> None:
                got.append(await peek_client_hello(a))

            nursery.start_soon(peek)
            # In three pieces, some time apart: the peek waits for as much as the parser asks for.
            for piece in (hello[:3], hello[3:200], hello[200:]):
                await trio.sleep(0.05)
                b.send(piece)
        assert got == [ServerName("broker-3.b.test", len(hello))]
        # Nothing was taken: the TLS handshake reads the same bytes, and readiness is one byte again.
        assert a.recv(len(hello) + 10) == hello
        assert a.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1


async def test_bytes_that_are_not_tls_are_told_at_once() -> None:
    a, b = socket.socketpair()
    a.setblocking(False)
    with a, b:
        b.send(b"\x00\x00\x00\x0a\x00\x12\x00\x03\x00\x00\x00\x01\x00\x00")
        assert await peek_client_hello(a) == NotClientHello("not a TLS handshake")
        b.close()
        assert a.recv(100) != b""

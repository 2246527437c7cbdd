"""The fleet quota coordinator against a fake cluster with a log (``fake_log_cluster``): the topic
created compacted, records written and read back, the partition leader moving to another broker, the
leader broker restarting, and a broker refusing by ACL. tansu covers the real-broker path in
``test_fleet_quotas.py``; it has one node and no ACLs, which is what this fake stands in for."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import attrs
import pytest
import trio

from kproxy.config import CoordinationConfig, QuotaConfig, config_from_args
from kproxy.policy.engine import FixedRules
from kproxy.policy.loader import load_rules
from kproxy.protocol.records import iter_batches
from kproxy.quota.engine import QuotaFilter
from kproxy.quota.fleet import decode_record
from kproxy.server.coordination import Coordinator
from tests.e2e.fake_log_cluster import LogCluster

TOPIC = "__kproxy_quotas_fake"
STATIC = 0.5
BUDGET = ("per-client", "client_id=app-1")


@pytest.fixture
async def cluster() -> AsyncIterator[LogCluster]:
    c = LogCluster(TOPIC)
    try:
        yield c
    finally:
        c.stop()
        assert not c.errors, c.errors


def coordinator(cluster: LogCluster, tmp_path: Path) -> Coordinator:
    rules = tmp_path / "rules.yaml"
    rules.write_text("quotas:\n  - name: per-client\n    match: {client_id: 'app-*'}\n    produce_bytes_per_s: 1000\n")
    f = QuotaFilter(FixedRules.of(load_rules([str(rules)])), share=STATIC, coordinated=True)
    cfg = config_from_args(cluster.bootstrap.split(",")[0], "127.0.0.1:1")
    cfg = attrs.evolve(cfg, quota=QuotaConfig(coordination=CoordinationConfig(
        fleet="f", topic=TOPIC, publish_interval_ms=100, stale_after_s=1.0)))
    return Coordinator(cfg, f, STATIC, instance="me-1-ab")


def charge(c: Coordinator) -> None:
    now = trio.current_time()
    (q,) = c.quotas._compile(c.quotas.source.policy.rule_set).quotas
    budget = c.quotas.budgets.get(BUDGET, now, q.span_s)
    (budget.produce or budget.new("produce")).record(500, now, q.windows)


async def wait_until(check: Callable[[], bool], c: Coordinator, seconds: float = 10.0) -> None:
    with trio.fail_after(seconds):
        while not check():
            charge(c)
            await trio.sleep(0.05)


def reports(cluster: LogCluster) -> list:
    out = []
    for batch in iter_batches(cluster.read_from(0)):
        for r in batch.records():
            rep = decode_record(r.key, r.value, r.timestamp / 1000)
            if rep is not None:
                out.append(rep)
    return out


async def test_the_topic_is_created_compacted_and_records_come_back(cluster, tmp_path):
    c = coordinator(cluster, tmp_path)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(c.run)
        await wait_until(lambda: c.up, c)
        # Alone in its fleet: once the other process a half implies has not written for stale_after_s,
        # towards the whole limit.
        await wait_until(lambda: c.quotas.budgets.peek(BUDGET).share > STATIC, c)
        nursery.cancel_scope.cancel()
    assert cluster.created_with["cleanup.policy"] == "compact"
    assert int(cluster.created_with["retention.ms"]) == 300000
    mine = [r for r in reports(cluster) if r.budget == BUDGET]
    assert mine and {(r.fleet, r.instance) for r in mine} == {("f", "me-1-ab")}


async def test_a_moved_leader_is_followed(cluster, tmp_path):
    c = coordinator(cluster, tmp_path)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(c.run)
        await wait_until(lambda: c.up, c)
        produced_before = len(cluster.brokers[2].received(0))
        cluster.move_leader(2)
        # Node 1 now answers NOT_LEADER_OR_FOLLOWER and Metadata names node 2.
        await wait_until(lambda: len(cluster.brokers[2].received(0)) > produced_before + 3, c)
        await wait_until(lambda: c.up, c)
        nursery.cancel_scope.cancel()


async def test_the_leader_restarting_means_fallback_then_coordination_again(cluster, tmp_path, caplog):
    caplog.set_level(logging.INFO, "kproxy.quota.coordination")
    c = coordinator(cluster, tmp_path)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(c.run)
        nursery.start_soon(c.watch)
        await wait_until(lambda: c.up, c)
        cluster.brokers[1].stop()
        await wait_until(lambda: not c.up, c, seconds=3.0)     # within stale_after_s (1 s) and a little
        assert c.quotas.budgets.peek(BUDGET).share == STATIC
        cluster.brokers[1].start()
        await wait_until(lambda: c.up, c)
        nursery.cancel_scope.cancel()
    lines = [r.getMessage() for r in caplog.records]
    assert sum("falling back to the static share" in m for m in lines) == 1
    assert sum("coordinated through topic" in m for m in lines) == 2


async def test_a_refusal_names_the_acls_and_the_static_share_holds(cluster, tmp_path, caplog):
    caplog.set_level(logging.INFO, "kproxy.quota.coordination")
    cluster.denied = True
    c = coordinator(cluster, tmp_path)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(c.run)
        await wait_until(lambda: any("TOPIC_AUTHORIZATION_FAILED" in r.getMessage() for r in caplog.records), c)
        nursery.cancel_scope.cancel()
    (line,) = [r for r in caplog.records if "TOPIC_AUTHORIZATION_FAILED" in r.getMessage()]   # logged once
    assert line.levelno == logging.ERROR
    assert f"Describe, Read and Write on topic {TOPIC}" in line.getMessage()
    assert not c.up and c.quotas.budgets.peek(BUDGET).share == STATIC

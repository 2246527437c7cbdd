"""Switching a virtual cluster between two upstream clusters with real clients under load: a planned
switch, failover when the primary dies, the virtual cluster's own cluster id, the state file across a
restart, and ``kproxy switch``.

Two tansu brokers stand for the clusters and tests/e2e/replicator.py for MirrorMaker 2 (it copies the
records under MM2's names, writes offset syncs and checkpoints in MM2's formats and syncs group
offsets to the secondary every second). Apache Kafka and MM2 cannot be installed here.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient

from kproxy.config import derived_cluster_id, parse_config
from kproxy.server.embedded import ProxyThread
from tests.e2e.switchover import (
    PARTITIONS,
    Load,
    Pair,
    Reader,
    config_text,
    only_retriable,
    pair,
    read_log,
)
from tests.e2e.tansu import TansuBroker
from tests.polling import wait_until

pytestmark = pytest.mark.e2e
__all__ = ["pair"]     # the fixture: two brokers and the MM2 stand-in
# The stand-in syncs a group's offsets about one checkpoint interval plus one sync interval behind
# its commits; the consumer commits every 200 ms; a second more of slack for a loaded machine.
GROUP_SYNC_LAG_S = 1.0 + 1.0 + 0.2 + 1.0


def http(url: str, method: str = "GET", timeout: float = 60) -> tuple[int, str]:
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:        # not listening yet, or gone
        return 0, str(e)


def upstream(admin: int) -> dict:
    return json.loads(http(f"http://127.0.0.1:{admin}/upstream")[1])["default"]


def metric(admin: int, name: str, **labels: str) -> float | None:
    text = http(f"http://127.0.0.1:{admin}/metrics")[1]
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def cluster_id(bootstrap: str) -> str:
    admin = AdminClient({"bootstrap.servers": bootstrap})    # held: the future needs its handle
    return str(admin.describe_cluster().result(30).cluster_id)


def check_log(pair: Pair, load: Load) -> None:
    """Every acknowledged record is in the secondary's replica once, in produce order per partition."""
    log = read_log(pair.secondary.bootstrap, f"primary.{pair.topic}")
    acked: dict[int, set[int]] = {p: set() for p in range(PARTITIONS)}
    for p, v, _ in load.acked:
        acked[p].add(v)
    for p in range(PARTITIONS):
        values = log[p]
        twice = sorted({v for v in values if values.count(v) > 1})[:5]
        assert not twice, (f"partition {p} holds records twice: {twice} at "
                           f"{[i for i, v in enumerate(values) if v in twice]} of {len(values)}")
        assert values == sorted(values), f"partition {p} is out of produce order"
        assert acked[p] <= set(values), f"partition {p} lacks {len(acked[p] - set(values))} acknowledged records"


# confluent-kafka switches under load in the failover and virtual-cluster tests too; its planned
# switch here runs with `make test-slow` (the default run stays within its time).
@pytest.mark.parametrize("producer", [pytest.param("confluent", marks=pytest.mark.slow), "kafka-python"])
def test_a_planned_switch_under_load_loses_nothing_and_clients_see_one_cluster(pair: Pair, tmp_path: Path,
                                                                                 producer: str) -> None:
    text, port, admin = config_text(pair, tmp_path)
    with ProxyThread(parse_config(text, str(tmp_path / "kproxy.yaml"))) as proxy:
        bootstrap = proxy.bootstrap
        before_id = cluster_id(bootstrap)
        assert before_id == derived_cluster_id("default") != pair.primary.cluster_id
        load = Load(bootstrap, pair.topic, producer=producer).start()
        wait_until(lambda: len(load.seen) > 1500, "the group reads through kproxy")

        status, body = http(f"http://127.0.0.1:{admin}/switch?cluster=secondary", "POST")
        assert status == 200, body
        report = json.loads(body)
        assert (report["from"], report["to"], report["reason"]) == ("primary", "secondary", "planned")
        # The replica held everything the primary acknowledged before new requests went on.
        assert report["caught_up"] is True, report
        switched_at = load.acked_count()
        wait_until(lambda: load.acked_count() > switched_at + 1500, "the producer goes on through the secondary")
        load.stop()

        assert only_retriable(load.errors) == []
        assert not load.missing(), f"{len(load.missing())} acknowledged records never reached the group"
        check_log(pair, load)
        # Re-reads stay within what the group's offset sync lags behind its commits.
        assert load.rereads() <= load.rate() * GROUP_SYNC_LAG_S + 100, (load.rereads(), load.rate())

        # One cluster throughout: the same id, and only kproxy's addresses.
        assert cluster_id(bootstrap) == before_id
        admin_client = AdminClient({"bootstrap.servers": bootstrap})
        brokers = admin_client.list_topics(pair.topic, timeout=30).brokers
        assert {(b.host, b.port) for b in brokers.values()} <= {("127.0.0.1", p) for p in range(port, port + 8)}
        view = upstream(admin)
        assert view["active"] == "secondary" and view["epoch"] == 1
        assert metric(admin, "kproxy_upstream_active", cluster="secondary") == 1.0
        assert metric(admin, "kproxy_upstream_active", cluster="primary") == 0.0
        assert metric(admin, "kproxy_upstream_switches_total", reason="planned") == 1.0
        # The producer the primary issued was carried on the secondary under kproxy's own id.
        assert view["carried_batches"] > 0
    state = json.loads((tmp_path / "kproxy-state.json").read_text())
    assert state["virtual_clusters"]["default"]["active"] == "secondary"


# Without kproxy's translation the group resumes from the stand-in's own offset sync: measured by
# bench/switchover.py, and run here with `make test-slow`.
@pytest.mark.parametrize("translation", ["mm2", pytest.param("off", marks=pytest.mark.slow)])
def test_a_group_that_moves_resumes_near_its_last_commit(pair: Pair, tmp_path: Path, translation: str) -> None:
    """The group's consumer stops on the primary (committing where it is) and a new one starts on the
    secondary right after the switch: it re-reads what lies between the group's last commit and where
    the secondary says the group is. With MM2's own group offset sync (off) that is up to a
    checkpoint plus a sync interval of records; kproxy's translation of the commit it saw (mm2)
    leaves at most what lies between the commit and MM2's last offset sync before it."""
    text, _, admin = config_text(pair, tmp_path, translation=translation)
    with ProxyThread(parse_config(text, str(tmp_path / "kproxy.yaml"))) as proxy:
        load = Load(proxy.bootstrap, pair.topic).start(consume=False)
        first = Reader(proxy.bootstrap, pair.topic, load.group)
        wait_until(lambda: len(first.seen) > 2000, "the group reads through kproxy")
        first.close()
        status, body = http(f"http://127.0.0.1:{admin}/switch?cluster=secondary", "POST")
        assert status == 200, body
        report = json.loads(body)
        second = Reader(proxy.bootstrap, pair.topic, load.group)
        wait_until(lambda: len(second.seen) > 500, "the group reads on through the secondary")
        load.stop()
        wait_until(lambda: {(p, v) for p, v, _ in load.acked} <= {*first.seen, *second.seen},
                   "the group reads everything acknowledged")
        second.close()
        reread = len(set(first.seen) & set(second.seen))
        if translation == "mm2":
            # The commit kproxy saw, translated (unless MM2's sync had already put as much there): at
            # most offset.lag.max (100) records per partition back.
            resumed = report["offsets"][load.group]
            assert set(resumed) == {f"primary.{pair.topic}[{p}]" for p in range(PARTITIONS)}, report
            assert {v["source"] for v in resumed.values()} <= {"kproxy", "target"}, report
            assert reread <= PARTITIONS * 100 + 20, reread
        else:
            assert report["offsets"] == {}
            assert reread <= load.rate() * GROUP_SYNC_LAG_S + 100, (reread, load.rate())
        assert not (first.errors or second.errors)


def test_failover_when_the_primary_dies(pair: Pair, tmp_path: Path) -> None:
    text, _, admin = config_text(pair, tmp_path, failover=2.0)
    with ProxyThread(parse_config(text, str(tmp_path / "kproxy.yaml"))) as proxy:
        load = Load(proxy.bootstrap, pair.topic).start()
        wait_until(lambda: len(load.seen) > 1500, "the group reads through kproxy")
        assert metric(admin, "kproxy_upstream_reachable", cluster="primary") == 1.0
        pair.primary.stop()
        killed_at = time.monotonic()
        wait_until(lambda: upstream(admin)["active"] == "secondary", "kproxy fails over by itself", 30)
        took = time.monotonic() - killed_at
        after = load.acked_count()
        wait_until(lambda: load.acked_count() > after + 1500, "the producer goes on through the secondary")
        # Acknowledgements the dead primary sent may arrive a moment after it was killed; the secondary
        # gives none before the failover (at least 2 s later).
        load.stop(may_lose=(killed_at - 1.0, killed_at + 1.0))

        assert 2.0 <= took < 10, took
        assert only_retriable(load.errors) == []
        # What the primary acknowledged in its last moments and the stand-in had not copied is the
        # one loss a failover has; everything acknowledged since is there once, in order.
        lost = load.missing()
        acked_late = {(p, v) for p, v, at in load.acked if killed_at - 1.0 <= at <= killed_at + 1.0}
        assert lost <= acked_late, "only records acknowledged just before the primary died may be lost"
        log = read_log(pair.secondary.bootstrap, f"primary.{pair.topic}")
        for p in range(PARTITIONS):
            after_failover = [v for v in log[p] if v > max((v for q, v in lost if q == p), default=-1)]
            assert after_failover == sorted(after_failover) and len(after_failover) == len(set(after_failover))
        assert metric(admin, "kproxy_upstream_switches_total", reason="failover") == 1.0
        assert metric(admin, "kproxy_upstream_reachable", cluster="primary") == 0.0
        view = upstream(admin)
        assert view["abandoned"] == ["primary"]

        # The primary comes back: kproxy never switches back by itself.
        pair.primary.start()
        wait_until(lambda: metric(admin, "kproxy_upstream_reachable", cluster="primary") == 1.0, "a probe sees it")
        assert upstream(admin)["active"] == "secondary"


def test_a_restart_comes_back_on_the_cluster_it_switched_to(pair: Pair, tmp_path: Path) -> None:
    text, _, admin = config_text(pair, tmp_path, translation="off")
    config = tmp_path / "kproxy.yaml"
    config.write_text(text)
    with ProxyThread(parse_config(text, str(config))):
        assert upstream(admin)["active"] == "primary"
        assert http(f"http://127.0.0.1:{admin}/switch?cluster=secondary", "POST")[0] == 200
    with ProxyThread(parse_config(text, str(config))) as proxy:
        view = upstream(admin)
        assert view["active"] == "secondary" and view["epoch"] == 1
        assert "state file" in view["started_on_because"]
        # Clients reach the secondary's replica under the primary's names.
        load = Load(proxy.bootstrap, pair.topic).start()
        wait_until(lambda: load.acked_count() > 200, "records go through")
        load.stop()
        assert only_retriable(load.errors) == [] and not load.missing()
        assert read_log(pair.secondary.bootstrap, f"primary.{pair.topic}")[0]
    # The configuration's upstream.active changed since: the newer decision wins over the file.
    changed = text.replace("  offset_translation: off\n", "  offset_translation: off\n  active: secondary\n")
    with ProxyThread(parse_config(changed, str(config))):
        assert upstream(admin)["active"] == "secondary"


def test_a_process_follows_a_switch_another_recorded(pair: Pair, tmp_path: Path) -> None:
    """Workers share the state file: one that did not hear the admin call follows the file."""
    text, _, admin = config_text(pair, tmp_path, translation="off")
    state = tmp_path / "kproxy-state.json"
    with ProxyThread(parse_config(text, str(tmp_path / "kproxy.yaml"))):
        assert upstream(admin)["active"] == "primary"
        state.write_text(json.dumps({"version": 1, "virtual_clusters": {"default": {
            "active": "secondary", "epoch": 1, "configured_active": "primary", "from": "primary",
            "reason": "planned", "switched_at": time.time(), "abandoned": []}}}))
        wait_until(lambda: upstream(admin)["active"] == "secondary", "the process follows the state file", 15)
        assert metric(admin, "kproxy_upstream_switches_total", reason="followed") == 1.0


def test_kproxy_switch_command(pair: Pair, tmp_path: Path) -> None:
    text, _, admin = config_text(pair, tmp_path, translation="off")

    def switch(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "kproxy", "switch", *args, "--admin", f"127.0.0.1:{admin}"],
                              capture_output=True, text=True, timeout=120)

    with ProxyThread(parse_config(text, str(tmp_path / "kproxy.yaml"))):
        done = switch("secondary")
        assert done.returncode == 0, done.stderr
        assert re.search(r"virtual cluster default: switched from primary to secondary \(planned, switch 1\)",
                         done.stdout), done.stdout
        assert switch("secondary", "--virtual-cluster", "default").stdout.strip() == \
            "virtual cluster default is already on cluster secondary"
        unknown = switch("tertiary")
        assert unknown.returncode == 1 and "has no cluster 'tertiary'" in unknown.stderr
        assert switch("primary", "--virtual-cluster", "nope").returncode == 1
        # A planned switch to a cluster that does not answer is refused; nothing moves.
        pair.primary.stop()
        refused = switch("primary")
        assert refused.returncode == 1 and "does not answer" in refused.stderr
        assert upstream(admin)["active"] == "secondary"


def test_every_worker_switches(pair: Pair, tmp_path: Path) -> None:
    """``workers: 2``: POST /switch on the supervisor switches both workers (each drains its own
    connections); then a failover back is decided by each worker's probes alike."""
    text, port, admin = config_text(pair, tmp_path, translation="off", prefix=False, failover=2.0)
    config = tmp_path / "kproxy.yaml"
    config.write_text(text.replace("exposure: {advertised_host: 127.0.0.1, broker_port_count: 6}",
                                   f"exposure: {{advertised_host: 127.0.0.1, broker_port_count: 6, "
                                   f"node_id_base: {pair.primary.node_id}}}") + "workers: 2\n")
    log = tmp_path / "kproxy.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kproxy", "run", "--config", str(config)],
                                stdout=subprocess.DEVNULL, stderr=out)
    try:
        wait_until(lambda: http(f"http://127.0.0.1:{admin}/readyz")[0] == 200, log.read_text)
        status, body = http(f"http://127.0.0.1:{admin}/switch?cluster=secondary", "POST")
        assert status == 200, body
        answers = json.loads(body)["workers"]
        assert sorted(answers) == ["0", "1"] and {a["to"] for a in answers.values()} == {"secondary"}
        # Merged over the workers, "primary" is 0 only when no worker is on it any more.
        assert metric(admin, "kproxy_upstream_active", cluster="primary") == 0.0
        assert metric(admin, "kproxy_upstream_active", cluster="secondary") == 1.0
        load = Load(f"127.0.0.1:{port}", pair.topic).start(consume=False)
        wait_until(lambda: load.acked_count() > 300, "records go through both workers")
        load.stop()
        assert only_retriable(load.errors) == []
        assert sum(len(v) for v in read_log(pair.secondary.bootstrap, pair.topic).values()) >= load.acked_count()

        # The secondary dies: every worker fails over to the primary by itself.
        pair.secondary.stop()
        wait_until(lambda: metric(admin, "kproxy_upstream_active", cluster="secondary") == 0.0,
                   "both workers fail over", 30)
        assert metric(admin, "kproxy_upstream_switches_total", reason="planned") == 2.0
        state = json.loads((tmp_path / "kproxy-state.json").read_text())["virtual_clusters"]["default"]
        assert (state["active"], state["reason"], state["abandoned"]) == ("primary", "failover", ["secondary"])
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_producer_id_one_cluster_issued_is_unknown_to_the_other(pair: Pair) -> None:
    """Why kproxy carries producers: tansu refuses a producer id it did not issue, at any sequence,
    and numbers its own from the same start, so another cluster's id may be someone else's."""
    import trio

    from kproxy.protocol.messages import Request, body_class
    from kproxy.protocol.records import build_batch
    from kproxy.server.origination import direct_roundtrip
    from kproxy.server.transport import connect

    async def ask(broker: TansuBroker, api_key: int, version: int, **fields: object) -> object:
        t = await connect(broker.host, broker.port, 10, None)
        try:
            roundtrip = direct_roundtrip(t, 10)
            return (await roundtrip(Request.build(api_key, version, 1, "t",
                                                  body_class(api_key, "request")(**fields)))).body
        finally:
            t.close()

    async def main() -> None:
        issued = await ask(pair.primary, 22, 4, transactional_id=None, transaction_timeout_ms=60000)
        other = await ask(pair.secondary, 22, 4, transactional_id=None, transaction_timeout_ms=60000)
        # Both number from the same start: the first ids of one are the first ids of the other.
        assert 0 <= issued.producer_id < 10 and 0 <= other.producer_id < 10
        pr = body_class(0, "request")
        topic = f"primary.{pair.topic}"
        for sequence in (0, 7):
            records = build_batch([(b"k", b"v")], producer_id=issued.producer_id + 100,
                                  producer_epoch=0, base_sequence=sequence)
            answer = await ask(pair.secondary, 0, 9, transactional_id=None, acks=-1, timeout_ms=5000, topic_data=[
                pr.TopicProduceData(name=topic, partition_data=[pr.PartitionProduceData(index=0, records=records)])])
            assert answer.responses[0].partition_responses[0].error_code == 59     # UNKNOWN_PRODUCER_ID
        bump = await ask(pair.secondary, 22, 4, transactional_id=None, transaction_timeout_ms=60000,
                         producer_id=issued.producer_id + 100, producer_epoch=0)
        assert bump.error_code != 0         # KIP-360's epoch bump of an id it did not issue: refused

    trio.run(main)

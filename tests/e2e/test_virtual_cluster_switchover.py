"""Two virtual clusters in one process, one of them on two upstream clusters: switching it moves its
clients alone. The other keeps its connections, its producer sees no error, and each virtual cluster
keeps its own cluster id throughout. ``kproxy switch`` finds the one virtual cluster that can switch
without --virtual-cluster, /metrics says which cluster each is on, and the state file holds the one
that switched.

The brokers and the MirrorMaker 2 stand-in are tests/e2e/switchover.py's ``pair``; team-a runs on the
pair's primary too, on a topic of its own that nothing replicates.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from kproxy.config import derived_cluster_id, parse_config
from kproxy.server.embedded import ProxyThread
from tests.e2e.proxied import free_port_block
from tests.e2e.switchover import PARTITIONS, Load, Pair, only_retriable, pair, read_log
from tests.e2e.tansu import free_port, unique_name
from tests.e2e.test_switchover import cluster_id, http, metric
from tests.polling import wait_until

pytestmark = pytest.mark.e2e
__all__ = ["pair"]     # the fixture: two brokers and the MM2 stand-in


def config_text(pair: Pair, tmp_path: Path) -> tuple[str, int]:
    """team-a on the primary alone; dr-app on the primary and its replica (MM2's ``primary.`` names)."""
    admin = free_port()

    def listen() -> str:
        return (f'    listen: "127.0.0.1:{free_port_block(8)}"\n'
                "    exposure: {advertised_host: 127.0.0.1, broker_port_count: 6}\n")

    text = ("virtual_clusters:\n"
            "  - name: team-a\n" + listen() +
            f'    upstream: {{bootstrap_servers: ["{pair.primary.bootstrap}"]}}\n'
            "  - name: dr-app\n" + listen() +
            "    upstream:\n"
            "      clusters:\n"
            f'        - {{name: primary, bootstrap_servers: ["{pair.primary.bootstrap}"]}}\n'
            f'        - {{name: secondary, bootstrap_servers: ["{pair.secondary.bootstrap}"], '
            'topic_prefix: "primary."}\n'
            f"      state_file: {tmp_path / 'kproxy-state.json'}\n"
            f'admin: {{listen: "127.0.0.1:{admin}"}}\n')
    return text, admin


def opened(admin: int, virtual_cluster: str) -> float:
    """Client connections the virtual cluster has accepted, over all its listeners."""
    text = http(f"http://127.0.0.1:{admin}/metrics")[1]
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kproxy_connections_opened_total{") and f'virtual_cluster="{virtual_cluster}"' in line)


def test_switching_one_virtual_cluster_leaves_the_other_alone(pair: Pair, tmp_path: Path) -> None:
    text, admin = config_text(pair, tmp_path)

    def switch(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "kproxy", "switch", *args, "--admin", f"127.0.0.1:{admin}"],
                              capture_output=True, text=True, timeout=120)

    with ProxyThread(parse_config(text, str(tmp_path / "kproxy.yaml"))) as proxy:
        team_a, dr_app = (proxy.bootstrap_of(proxy.cluster(name)) for name in ("team-a", "dr-app"))
        topic_a = unique_name("team-a")
        creator = AdminClient({"bootstrap.servers": team_a})     # held: the future needs its handle
        creator.create_topics([NewTopic(topic_a, PARTITIONS, 1)])[topic_a].result(30)
        ids = {team_a: cluster_id(team_a), dr_app: cluster_id(dr_app)}
        assert ids == {team_a: derived_cluster_id("team-a"), dr_app: derived_cluster_id("dr-app")}

        steady_a = Load(team_a, topic_a).start(consume=False)
        steady_dr = Load(dr_app, pair.topic).start(consume=False)
        wait_until(lambda: steady_a.acked_count() > 300 and steady_dr.acked_count() > 300, "both produce through kproxy")
        opened_a = opened(admin, "team-a")

        # No --virtual-cluster: dr-app is the only one with upstream clusters to switch between.
        done = switch("secondary")
        assert done.returncode == 0, done.stderr
        assert "virtual cluster dr-app: switched from primary to secondary (planned, switch 1)" in done.stdout
        assert switch("secondary", "--virtual-cluster", "dr-app").stdout.strip() == \
            "virtual cluster dr-app is already on cluster secondary"
        refused = switch("secondary", "--virtual-cluster", "team-a")
        assert refused.returncode == 1 and "has no cluster 'secondary'" in refused.stderr

        at_switch = (steady_a.acked_count(), steady_dr.acked_count())
        wait_until(lambda: steady_a.acked_count() > at_switch[0] + 300 and steady_dr.acked_count() > at_switch[1] + 300,
                   "both go on producing, dr-app through the secondary")
        steady_a.stop()
        steady_dr.stop()

        # team-a was not touched: no error at all, not one new connection, its id unchanged.
        assert steady_a.errors == []
        assert opened(admin, "team-a") == opened_a
        assert only_retriable(steady_dr.errors) == []
        assert {team_a: cluster_id(team_a), dr_app: cluster_id(dr_app)} == ids
        assert metric(admin, "kproxy_upstream_active", virtual_cluster="dr-app", cluster="secondary") == 1.0
        assert metric(admin, "kproxy_upstream_active", virtual_cluster="dr-app", cluster="primary") == 0.0
        assert metric(admin, "kproxy_upstream_active", virtual_cluster="team-a", cluster="default") == 1.0
        view = json.loads(http(f"http://127.0.0.1:{admin}/upstream")[1])
        assert (view["team-a"]["active"], view["dr-app"]["active"]) == ("default", "secondary")

    # Every record each producer had acknowledged is where it belongs, once.
    for load, bootstrap, topic in ((steady_a, pair.primary.bootstrap, topic_a),
                                   (steady_dr, pair.secondary.bootstrap, f"primary.{pair.topic}")):
        log = read_log(bootstrap, topic)
        for p in range(PARTITIONS):
            acked = {v for q, v, _ in load.acked if q == p}
            assert len(log[p]) == len(set(log[p])) and acked <= set(log[p]), (topic, p)
    state = json.loads((tmp_path / "kproxy-state.json").read_text())["virtual_clusters"]
    assert set(state) == {"dr-app"} and state["dr-app"]["active"] == "secondary"

"""Virtual clusters with upstream.clusters, without brokers: the issue's contract loads, each virtual
cluster has its own cluster id (two that would show one are refused with file:line), the admin
listener routes /switch to the virtual cluster it names (or the only one that can switch), a switch
moves that virtual cluster alone, /metrics says which cluster each is on, and the state file keeps
each virtual cluster's active cluster apart, across a restart of the process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kproxy.config import ConfigError, derived_cluster_id, load_config, parse_config
from kproxy.server import admin
from kproxy.server.clusters import Cluster
from kproxy.server.process import ProxyProcess

# The issue's contract, word for word.
CONTRACT = """\
virtual_clusters:
  - name: team-a
    listen: "127.0.0.1:9092"
    exposure: {broker_port_start: 9093}
    upstream: {bootstrap_servers: ["a:9092"]}
  - name: dr-app
    listen: "127.0.0.1:9192"
    exposure: {broker_port_start: 9193}
    upstream:
      clusters:
        - {name: primary, bootstrap_servers: ["p:9092"]}
        - {name: secondary, bootstrap_servers: ["s:9092"]}
      active: primary
      failover: {after_s: 10}
admin: {listen: "127.0.0.1:9644"}
"""


def two_switchable(state: Path) -> str:
    """Two virtual clusters, each on two upstream clusters (nothing listens there), one state file."""
    def vc(name: str, port: int) -> str:
        return (f"  - name: {name}\n    listen: \"127.0.0.1:{port}\"\n    upstream:\n"
                f"      clusters:\n"
                f"        - {{name: primary, bootstrap_servers: [\"127.0.0.1:1\"]}}\n"
                f"        - {{name: secondary, bootstrap_servers: [\"127.0.0.1:2\"]}}\n"
                f"      switch: {{catch_up_s: 0, drain_s: 0.1}}\n"
                f"      state_file: {state}\n")
    return "virtual_clusters:\n" + vc("orders", 19092) + vc("billing", 19192) + 'admin: {listen: "127.0.0.1:19644"}\n'


def answering(process: ProxyProcess) -> None:
    """Every upstream cluster answers the probe a planned switch makes (nothing really listens)."""
    async def answers(cluster: Cluster) -> str | None:
        return None
    for server in process.servers.values():
        server.upstreams.probe = answers  # type: ignore[method-assign]


def active_series(process: ProxyProcess) -> dict[tuple[str, str], float]:
    metrics = process.metrics
    assert metrics is not None
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        if family.name == "kproxy_upstream_active":
            return {(s.labels["virtual_cluster"], s.labels["cluster"]): s.value for s in family.samples}
    raise AssertionError("no kproxy_upstream_active")


# -- configuration --------------------------------------------------------------------------------------


def test_the_contract_loads_with_each_virtual_clusters_upstream_and_cluster_id() -> None:
    cfg = parse_config(CONTRACT, "kproxy.yaml")
    team_a, dr_app = cfg.clusters
    assert not team_a.upstream.several and team_a.upstream.names == ("default",)
    assert dr_app.upstream.names == ("primary", "secondary") and dr_app.upstream.first_active == "primary"
    assert dr_app.upstream.failing_over is not None and dr_app.upstream.failing_over.after_s == 10.0
    # Each virtual cluster is its own cluster to tools: ids derived from the names, or set per cluster.
    assert team_a.presented_cluster_id == derived_cluster_id("team-a")
    assert dr_app.presented_cluster_id == derived_cluster_id("dr-app") != team_a.presented_cluster_id
    own = parse_config(CONTRACT.replace("  - name: dr-app\n", "  - name: dr-app\n    cluster_id: dr-app-1\n"))
    assert own.clusters[1].presented_cluster_id == "dr-app-1"


def error(tmp_path: Path, text: str) -> ConfigError:
    path = tmp_path / "kproxy.yaml"
    path.write_text(textwrap.dedent(text))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    err = info.value
    assert err.file == str(path) and str(err).startswith(f"{path}:{err.line}: ")
    return err


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        # One cluster id for two virtual clusters (Kroxylicious #379): the written one is blamed.
        (CONTRACT.replace("  - name: team-a\n", "  - name: team-a\n    cluster_id: shared\n")
                 .replace("  - name: dr-app\n", "  - name: dr-app\n    cluster_id: shared\n"), 8,
         "virtual_clusters[1].cluster_id: 'shared' is also the cluster id of virtual cluster 'team-a'"),
        (CONTRACT.replace("  - name: team-a\n", f"  - name: team-a\n    cluster_id: {derived_cluster_id('dr-app')}\n"),
         3, f"virtual_clusters[0].cluster_id: '{derived_cluster_id('dr-app')}' is also the cluster id of virtual "
            "cluster 'dr-app'"),
        # A cluster setting at the top level of a file with virtual_clusters.
        ("cluster_id: x\n" + CONTRACT, 1, "cluster_id: belongs to a virtual cluster"),
        # Mistakes inside one virtual cluster's upstream.clusters name the whole path and their line.
        (CONTRACT.replace("{name: secondary,", "{name: primary,"), 12,
         "virtual_clusters[1].upstream.clusters[1].name: 'primary' is already the name of clusters[0]"),
        (CONTRACT.replace("active: primary", "active: tertiary"), 13,
         "virtual_clusters[1].upstream.active: names no cluster; one of primary, secondary"),
        (CONTRACT.replace("failover: {after_s: 10}", "failover: {after_s: 0}"), 14,
         "virtual_clusters[1].upstream.failover.after_s: must be greater than 0, got 0.0"),
        (CONTRACT.replace('upstream: {bootstrap_servers: ["a:9092"]}', 'upstream: {bootstrap_servers: ["a:9092"], '
                                                                       "active: x}"), 5,
         "virtual_clusters[0].upstream.active: needs several clusters under upstream.clusters"),
        # Ports still collide across virtual clusters with several upstream clusters.
        (CONTRACT.replace("9193}", "9100}"), 8, "virtual_clusters[1].exposure.broker_port_start: broker ports "
                                                 "9100..9163 on 127.0.0.1: port 9100 is already taken"),
    ],
)
def test_mistakes_name_file_line_and_the_virtual_cluster(tmp_path: Path, text: str, line: int, message: str) -> None:
    err = error(tmp_path, text)
    assert message in str(err) and err.line == line, str(err)


def test_the_default_state_file_of_every_virtual_cluster_is_beside_the_configuration(tmp_path: Path) -> None:
    path = tmp_path / "conf" / "kproxy.yaml"
    path.parent.mkdir()
    path.write_text(CONTRACT)
    process = ProxyProcess.from_config(load_config(path))
    state = process.cluster("dr-app").upstreams.state_file
    assert state is not None and state.path == str(tmp_path / "conf" / "kproxy-state.json")
    assert process.cluster("team-a").upstreams.state_file is None       # one cluster: nothing to keep


# -- the admin listener of a process with several virtual clusters --------------------------------------


async def test_a_switch_is_routed_to_the_only_virtual_cluster_that_can_switch(tmp_path: Path) -> None:
    text = CONTRACT.replace('["p:9092"]', '["127.0.0.1:1"]').replace('["s:9092"]', '["127.0.0.1:2"]')
    text = text.replace("      failover: {after_s: 10}\n",
                        f"      switch: {{catch_up_s: 0, drain_s: 0.1}}\n      state_file: {tmp_path / 'state.json'}\n")
    process = ProxyProcess.from_config(parse_config(text))
    answering(process)
    server = admin.AdminServer(process, None)  # type: ignore[arg-type]
    upstream = json.loads((await server.answer("GET", "/upstream"))[2])
    assert {name: view["active"] for name, view in upstream.items()} == {"team-a": "default", "dr-app": "primary"}
    assert active_series(process) == {("team-a", "default"): 1, ("dr-app", "primary"): 1, ("dr-app", "secondary"): 0}
    # No --virtual-cluster: team-a has one upstream cluster, so dr-app is meant.
    status, _, body = await server.answer("POST", "/switch?cluster=secondary")
    assert status == 200, body
    report = json.loads(body)
    assert (report["virtual_cluster"], report["from"], report["to"]) == ("dr-app", "primary", "secondary")
    assert process.cluster("dr-app").upstreams.active.name == "secondary"
    assert process.cluster("team-a").upstreams.active.name == "default"
    assert active_series(process) == {("team-a", "default"): 1, ("dr-app", "primary"): 0, ("dr-app", "secondary"): 1}
    # team-a cannot switch, and says so.
    status, _, body = await server.answer("POST", "/switch?cluster=secondary&virtual_cluster=team-a")
    assert status == 409 and b"has no cluster 'secondary'" in body
    status, _, body = await server.answer("POST", "/switch?cluster=secondary&virtual_cluster=team-b")
    assert status == 404 and b"dr-app, team-a" in body
    # Only dr-app has an entry in the state file: team-a has nothing to remember.
    assert set(json.loads((tmp_path / "state.json").read_text())["virtual_clusters"]) == {"dr-app"}


async def test_the_state_file_keeps_each_virtual_clusters_active_cluster_apart(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    cfg = parse_config(two_switchable(state))
    process = ProxyProcess.from_config(cfg)
    answering(process)
    server = admin.AdminServer(process, None)  # type: ignore[arg-type]
    # Two virtual clusters that can switch: the switch must name one.
    status, _, body = await server.answer("POST", "/switch?cluster=secondary")
    assert status == 400 and b"name the virtual cluster (virtual_cluster=...): one of billing, orders" in body
    status, _, body = await server.answer("POST", "/switch?cluster=secondary&virtual_cluster=billing")
    assert status == 200, body
    orders, billing = process.cluster("orders").upstreams, process.cluster("billing").upstreams
    assert (orders.active.name, billing.active.name) == ("primary", "secondary")
    assert (orders.epoch, billing.epoch) == (0, 1)
    entries = json.loads(state.read_text())["virtual_clusters"]
    assert set(entries) == {"billing"} and entries["billing"]["active"] == "secondary"
    # The other virtual cluster's switch keeps billing's entry as it was.
    status, _, body = await server.answer("POST", "/switch?cluster=secondary&virtual_cluster=orders")
    assert status == 200, body
    status, _, body = await server.answer("POST", "/switch?cluster=primary&virtual_cluster=orders")
    assert status == 200, body
    entries = json.loads(state.read_text())["virtual_clusters"]
    assert {name: (e["active"], e["epoch"]) for name, e in entries.items()} == {
        "orders": ("primary", 2), "billing": ("secondary", 1)}
    # billing's own follower sees nothing new in orders' writes.
    await billing.follow_state()
    assert billing.switches["followed"] == 0 and billing.active.name == "secondary"
    # A restart (a new process on the same file) comes back on each virtual cluster's own cluster.
    again = ProxyProcess.from_config(cfg)
    assert again.cluster("orders").upstreams.active.name == "primary"
    assert again.cluster("billing").upstreams.active.name == "secondary"
    assert again.cluster("billing").upstreams.epoch == 1 and again.cluster("orders").upstreams.epoch == 2
    assert active_series(again) == {("orders", "primary"): 1, ("orders", "secondary"): 0,
                                    ("billing", "primary"): 0, ("billing", "secondary"): 1}


# Each writer checks, after every write, that its own entry is what it just wrote: a writer that read
# the file before that write and replaced it after would have put an older entry back.
_WRITER = """
import json, sys
from kproxy.replication.state import VirtualClusterState
from kproxy.server.clusters import StateFile

path, vc = sys.argv[1], sys.argv[2]
f = StateFile(path)
for epoch in range(1, 41):
    assert f.write(vc, VirtualClusterState("secondary", epoch, "primary", "primary", "planned")), f.error
    with open(path) as r:
        seen = json.load(r)["virtual_clusters"][vc]["epoch"]
    if seen != epoch:
        sys.exit(f"{vc}: wrote switch {epoch}, the file says {seen}")
"""


def test_processes_writing_their_own_entries_at_once_lose_none(tmp_path: Path) -> None:
    path = str(tmp_path / "state.json")
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, path, vc], stderr=subprocess.PIPE, text=True)
               for vc in ("orders", "billing", "payments")]
    problems = [w.communicate(timeout=120)[1].strip() for w in writers]
    assert [w.returncode for w in writers] == [0, 0, 0], problems
    entries = json.loads(Path(path).read_text())["virtual_clusters"]
    assert {vc: e["epoch"] for vc, e in entries.items()} == {"orders": 40, "billing": 40, "payments": 40}

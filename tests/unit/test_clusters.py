"""UpstreamClusters without brokers: which cluster a virtual cluster starts on, the hold a switch puts
on new connections, the state file it writes, following another process's switch, the admin
endpoint, and the address map forgetting the old cluster's brokers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio

from kproxy.config import parse_config
from kproxy.ops.switch import describe
from kproxy.proxy.addresses import AddressMap
from kproxy.proxy.continuity import SwitchBook
from kproxy.server import admin
from kproxy.server.clusters import Cluster, StateFile, SwitchError, UpstreamClusters
from kproxy.server.upstream import UpstreamSettings
from kproxy.telemetry.metrics import upstream_families

CONFIG = """listen: "127.0.0.1:9192"
upstream:
  clusters:
    - {name: primary, bootstrap_servers: ["127.0.0.1:1"]}
    - {name: secondary, bootstrap_servers: ["127.0.0.1:2"]}
  switch: {catch_up_s: 0}
"""


class Target:
    """The server side of a switch, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.release = trio.Event()
        self.release.set()

    async def drain_upstream(self, cluster: str, timeout: float, reason: str) -> int:
        self.calls.append(("drain", cluster))
        await self.release.wait()
        return 3

    async def retarget(self) -> None:
        self.calls.append(("retarget", None))


def clusters(tmp_path: Path, text: str = CONFIG, *, state: str | None = None,
             target: Target | None = None, answering: bool = True) -> UpstreamClusters:
    """The clusters of CONFIG (nothing listens on their addresses); ``answering``: probes say they answer."""
    cfg = parse_config(text).upstream
    path = tmp_path / "state.json"
    if state is not None:
        path.write_text(state)
    built = [Cluster(n, cfg.cluster(n), UpstreamSettings(1.0)) for n in cfg.names]
    up = UpstreamClusters("dr-app", cfg, built, SwitchBook(), target or Target(), state_path=str(path),
                          wall=lambda: 1767225600.0)
    if answering:
        async def answers(cluster: Cluster) -> str | None:
            return None
        up.probe = answers  # type: ignore[method-assign]
    return up


def state_of(active: str, epoch: int, configured: str = "primary", reason: str = "planned") -> str:
    return json.dumps({"version": 1, "virtual_clusters": {"dr-app": {
        "active": active, "epoch": epoch, "configured_active": configured, "reason": reason, "from": "primary"}}})


def test_it_starts_on_the_configured_cluster_or_the_one_the_state_file_names(tmp_path: Path) -> None:
    assert clusters(tmp_path).active.name == "primary"
    after = clusters(tmp_path, state=state_of("secondary", 2))
    assert after.active.name == "secondary" and after.epoch == 2 and after.book.switched
    assert "state file" in after.started_because
    # Changed in the configuration since that switch: the configuration wins.
    changed = clusters(tmp_path, CONFIG + "  active: primary\n", state=state_of("secondary", 2, configured="secondary"))
    assert changed.active.name == "primary"
    broken = clusters(tmp_path, state="{not json")
    assert broken.active.name == "primary" and broken.state_file is not None and broken.state_file.error


async def test_a_switch_holds_new_connections_and_records_itself(tmp_path: Path) -> None:
    target = Target()
    target.release = trio.Event()
    up = clusters(tmp_path, target=target)
    got: list[str] = []

    async def open_connection() -> None:
        got.append((await up.current()).name)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(up.switch, "secondary")
        await trio.testing.wait_all_tasks_blocked()
        assert up.switching
        nursery.start_soon(open_connection)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []                # held while the old cluster drains
        target.release.set()
    assert got == ["secondary"]
    assert target.calls == [("drain", "primary"), ("retarget", None)]
    assert up.last is not None and up.last.drained == 3 and up.epoch == 1
    written = json.loads((tmp_path / "state.json").read_text())["virtual_clusters"]["dr-app"]
    assert written == {"active": "secondary", "epoch": 1, "configured_active": "primary", "from": "primary",
                       "reason": "planned", "switched_at": 1767225600.0, "abandoned": []}
    assert not list(tmp_path.glob(".kproxy-state-*"))      # the temporary file was renamed away
    families = {f.name: f for f in upstream_families(up.snapshot())}
    active = {s.labels["cluster"]: s.value for s in families["kproxy_upstream_active"].samples}
    assert active == {"primary": 0, "secondary": 1}
    assert {s.labels["reason"]: s.value for s in families["kproxy_upstream_switches"].samples
            if s.name.endswith("_total")}["planned"] == 1
    # Switching to where it is already changes nothing.
    again = await up.switch("secondary")
    assert not again.changed and up.epoch == 1


async def test_a_failover_leaves_the_old_cluster_abandoned_and_a_planned_switch_clears_it(tmp_path: Path) -> None:
    up = clusters(tmp_path)
    await up.switch("secondary", "failover")
    assert up.abandoned == ("primary",)
    assert up.book.switched


async def test_an_unknown_cluster_is_refused(tmp_path: Path) -> None:
    up = clusters(tmp_path)
    with pytest.raises(SwitchError, match="has no cluster 'tertiary'"):
        await up.switch("tertiary")


async def test_a_planned_switch_to_a_cluster_that_does_not_answer_is_refused(tmp_path: Path) -> None:
    up = clusters(tmp_path, answering=False)
    with pytest.raises(SwitchError, match="does not answer"):
        await up.switch("secondary")        # nothing listens on 127.0.0.1:2
    assert up.active.name == "primary" and not up.switching


async def test_it_follows_a_switch_another_process_recorded(tmp_path: Path) -> None:
    target = Target()
    up = clusters(tmp_path, target=target)
    StateFile.at(str(tmp_path / "state.json")).write("dr-app", parse_state_entry("secondary", 4))
    await up.follow_state()
    assert up.active.name == "secondary" and up.epoch == 4 and up.switches["followed"] == 1
    await up.follow_state()         # nothing new: nothing done
    assert up.switches["followed"] == 1


def parse_state_entry(active: str, epoch: int) -> Any:
    from kproxy.replication.state import VirtualClusterState

    return VirtualClusterState(active, epoch, "primary", "primary", "planned")


class View:
    def __init__(self, groups: dict[str, Any]) -> None:
        self.groups = groups

    def switchable(self) -> dict[str, Any]:
        return self.groups


async def test_the_admin_endpoint_names_what_it_needs(tmp_path: Path) -> None:
    up = clusters(tmp_path)
    server = admin.AdminServer(View({"dr-app": up, "team-a": clusters(tmp_path)}), None)  # type: ignore[arg-type]
    assert (await server.answer("GET", "/switch?cluster=secondary"))[0] == 405
    assert (await server.answer("POST", "/switch"))[0] == 400
    status, _, body = await server.answer("POST", "/switch?cluster=secondary")
    assert status == 400 and b"name the virtual cluster" in body
    status, _, body = await server.answer("POST", "/switch?cluster=secondary&virtual_cluster=nope")
    assert status == 404
    status, _, body = await server.answer("POST", "/switch?cluster=tertiary&virtual_cluster=dr-app")
    assert status == 409 and b"has no cluster" in body
    status, _, body = await server.answer("GET", "/upstream")
    assert status == 200 and json.loads(body)["dr-app"]["active"] == "primary"


def test_the_switch_command_says_what_happened() -> None:
    text = describe({"virtual_cluster": "dr-app", "from": "primary", "to": "secondary", "reason": "planned",
                     "epoch": 1, "took_s": 0.3, "drained_connections": 2, "caught_up": False,
                     "catch_up": {"primary.orders[0]": {"wanted": 10, "seen": 8}},
                     "offsets": {"billing": {"primary.orders[0]": {"offset": 7, "source": "kproxy"}}},
                     "problems": ["x"], "changed": True})
    assert "switched from primary to secondary (planned, switch 1)" in text
    assert "not caught up on 1 partitions: primary.orders[0] at 8 of 10" in text
    assert "group billing resumes at primary.orders[0]=7 (kproxy)" in text and "problem: x" in text


def test_the_address_map_forgets_the_old_clusters_brokers_but_keeps_their_ports() -> None:
    m = AddressMap("kproxy", 9100, 8)
    assert m.expose("broker", 1, "old-a", 9092) == ("kproxy", 9100)
    m.confirm(9100)
    generation = m.generation
    m.forget_upstreams()
    assert m.route_for_port(9100) is None and m.route_for_node(1) is None
    assert m.generation > generation
    # The new cluster's node 1 gets the same port, which leads to it now.
    assert m.expose("broker", 1, "new-a", 9092) == ("kproxy", 9100)
    route = m.route_for_port(9100)
    assert route is not None and route.upstream == ("new-a", 9092)

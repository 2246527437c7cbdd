"""deploy/monitoring/grafana/kproxy.json: what ``python -m kproxy.ops.dashboard`` builds (a stale file
fails here), valid for grafana-foundation-sdk's own dashboard model, with the rows and variables the
issue asks for, every query valid PromQL for Prometheus (promtool) and filtered by the variables."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models.dashboard import Dashboard

from kproxy.ops import dashboard
from tests.monitoring.conftest import CHART_FILES, DASHBOARD, as_promql, dashboard_expressions, promtool


def test_the_checked_in_dashboard_is_what_the_generator_builds() -> None:
    built = dashboard.render()
    assert DASHBOARD.read_text() == built, "stale: run `make monitoring`"
    assert (CHART_FILES / "kproxy-dashboard.json").read_text() == built, "stale chart copy: run `make monitoring`"


def test_the_generator_writes_where_it_is_told(tmp_path: Path) -> None:
    out = tmp_path / "d" / "kproxy.json"
    assert dashboard.main(["--out", str(out)]) == 0
    assert out.read_text() == DASHBOARD.read_text()


def test_the_dashboard_reads_back_through_the_librarys_model() -> None:
    register_default_plugins()
    data = json.loads(DASHBOARD.read_text())
    model = Dashboard.from_json(data)
    # Everything the file says is something the model knows: nothing is lost or invented on the way back.
    assert json.loads(json.dumps(model, cls=JSONEncoder)) == data
    assert model.uid == "kproxy-overview" and model.panels


def test_rows_and_variables() -> None:
    data = json.loads(DASHBOARD.read_text())
    rows = [p["title"] for p in data["panels"] if p["type"] == "row"]
    assert rows == ["Traffic", "Latency", "Errors, denials and throttles", "Connections and buffers",
                    "Upstream clusters", "Event loop, traffic log and rules"]
    variables = {v["name"]: v for v in data["templating"]["list"]}
    assert {"namespace", "pod", "api"} <= set(variables)
    titles = " | ".join(p["title"] for p in data["panels"])
    for needle in ("Requests per second by API", "Bytes per second", "Records per second", "Top clients",
                   "Top topics", "p50 and p99", "Broker time", "Denials per rule", "Throttle time per quota",
                   "Open connections", "Buffer budget", "Event loop lag", "Traffic log", "Rule reloads",
                   "Active upstream cluster", "Upstream clusters answering", "Switches"):
        assert needle in titles
    ids = [p["id"] for p in data["panels"]]
    assert len(ids) == len(set(ids))


def test_every_query_is_filtered_by_namespace_and_pod() -> None:
    for title, expr in dashboard_expressions():
        if title == "variable namespace":
            continue
        assert 'namespace=~"$namespace"' in expr, (title, expr)
        if not title.startswith("variable"):
            assert 'pod=~"$pod"' in expr, (title, expr)


def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    # promtool parses recording rules with Prometheus's own parser.
    rules = [{"record": f"dashboard:query{i}", "expr": as_promql(expr)}
             for i, (_, expr) in enumerate(dashboard_expressions())]
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    checked = promtool("check", "rules", str(path))
    assert checked.returncode == 0, checked.stdout + checked.stderr

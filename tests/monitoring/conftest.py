"""Shared paths and helpers of the monitoring tests (alert rules, dashboard, metric names)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "monitoring" / "prometheus-rules.yaml"
RULES_TESTS = Path(__file__).parent / "rules-test.yaml"
DASHBOARD = REPO / "deploy" / "monitoring" / "grafana" / "kproxy.json"
CHART_FILES = REPO / "helm" / "kproxy" / "files"
OPERATIONS_DOC = REPO / "docs" / "operations.md"


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    path = shutil.which("promtool")
    assert path, "promtool is not installed: `make test` installs it (Debian package prometheus)"
    return subprocess.run([path, *args], capture_output=True, text=True, timeout=60, cwd=cwd)


def alert_rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]


def dashboard_expressions(dashboard: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    """(panel title, expression) of every query of the dashboard, variables' queries included."""
    d = dashboard if dashboard is not None else json.loads(DASHBOARD.read_text())
    out = []
    for panel in d["panels"]:
        for target in panel.get("targets") or []:
            out.append((panel["title"], target["expr"]))
    for var in d["templating"]["list"]:
        if var["type"] == "query":
            out.append((f"variable {var['name']}", var["query"]))
    return out


def as_promql(expr: str) -> str:
    """A dashboard query as Prometheus itself would get it: Grafana's variables substituted, and
    label_values(m, l) (a Grafana function) as the series it reads."""
    expr = expr.replace("$__rate_interval", "5m").replace("$__range", "1h")
    for name in ("namespace", "pod", "api"):
        expr = expr.replace(f"${name}", ".*")
    if expr.startswith("label_values("):
        selector = expr[len("label_values("):].rsplit(",", 1)[0]
        expr = f"count({selector})"
    return expr

"""``kproxy switch NAME --admin HOST:PORT [--virtual-cluster VC]``: move a virtual cluster to another
of its upstream clusters through a running kproxy's admin listener (POST /switch), and say what the
switch did. It returns once new connections go to the new cluster."""

from __future__ import annotations

import json
import sys
import urllib.parse
from typing import Any

from kproxy.ops.top import AdminError, fetch


def run(cluster: str, admin: str, virtual_cluster: str | None, timeout: float) -> int:
    """0 once switched (or already there), 1 when kproxy refused or failed, 2 when it cannot be asked."""
    query = {"cluster": cluster}
    if virtual_cluster:
        query["virtual_cluster"] = virtual_cluster
    try:
        status, body = fetch(admin, f"/switch?{urllib.parse.urlencode(query)}", timeout, method="POST")
    except AdminError as e:
        print(f"kproxy switch: {e}", file=sys.stderr)
        return 2
    text = body.decode(errors="replace").strip()
    if status != 200:
        print(f"kproxy switch: {status}: {text}", file=sys.stderr)
        return 1
    try:
        answer = json.loads(text)
    except ValueError:
        print(text)
        return 0
    # One report, or one per worker behind a supervisor.
    reports = list(answer["workers"].values()) if "workers" in answer else [answer]
    for report in reports:
        print(describe(report))
    return 0


def describe(report: Any) -> str:
    if not isinstance(report, dict):
        return str(report)
    vc, to = report.get("virtual_cluster"), report.get("to")
    if not report.get("changed", True):
        return f"virtual cluster {vc} is already on cluster {to}"
    lines = [f"virtual cluster {vc}: switched from {report.get('from')} to {to} ({report.get('reason')}, switch "
             f"{report.get('epoch')}) in {report.get('took_s')}s; {report.get('drained_connections')} connections "
             "drained"]
    caught = report.get("caught_up")
    if caught is not None:
        behind = {k: v for k, v in report.get("catch_up", {}).items() if (v["seen"] or -1) < v["wanted"]}
        lines.append("  the replica held everything the old cluster acknowledged" if caught else
                     f"  the replica had not caught up on {len(behind)} partitions: " +
                     ", ".join(f"{k} at {v['seen']} of {v['wanted']}" for k, v in sorted(behind.items())[:5]))
    for group, parts in sorted(report.get("offsets", {}).items()):
        lines.append(f"  group {group} resumes at " + ", ".join(
            f"{k}={v['offset']} ({v['source']})" for k, v in sorted(parts.items())))
    lines += [f"  problem: {p}" for p in report.get("problems", [])]
    return "\n".join(lines)

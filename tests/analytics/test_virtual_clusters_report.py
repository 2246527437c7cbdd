"""``kproxy report`` on the traffic of two virtual clusters whose clients and topics have the same
names: every table keeps them apart (a row per virtual cluster), the end-to-end join never meets one
cluster's produce with the other's fetch, each virtual cluster gets a quota file of its own, a line
from before virtual clusters counts as ``default``, and ``--virtual-cluster`` keeps only one."""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import json
from pathlib import Path
from typing import Any

import pytest

from kproxy.analytics.synthetic import base_line, epoch_ms, write_log

pytestmark = pytest.mark.spark

START = dt.datetime(2024, 5, 1, 10, 0, tzinfo=dt.UTC)


def produce(ts: dt.datetime, cluster: str | None, nbytes: int) -> dict[str, Any]:
    line = base_line(ts, "app", "produce", 9, acks=-1, topics=["orders"], partitions=[
        {"topic": "orders", "partition": 0, "records": 10, "bytes": nbytes, "first_offset": 100, "last_offset": 109,
         "first_timestamp": epoch_ms(ts), "max_timestamp": epoch_ms(ts), "compression": "none", "error_code": 0}])
    if cluster is not None:
        line["virtual_cluster"] = cluster
    return line


def fetch(ts: dt.datetime, cluster: str) -> dict[str, Any]:
    return {**base_line(ts, "reader", "fetch", 13, group="g", topics=["orders"], partitions=[
        {"topic": "orders", "partition": 0, "records": 10, "bytes": 1000, "first_offset": 100, "last_offset": 109,
         "first_timestamp": None, "max_timestamp": None, "compression": "none", "error_code": 0}]),
        "virtual_cluster": cluster}


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("two-clusters")
    lines = []
    for i in range(20):
        ts = START + dt.timedelta(seconds=i)
        lines.append(produce(ts, "team-a", 1000))
        lines.append(produce(ts + dt.timedelta(milliseconds=500), "team-b", 3000))
    # Only team-b's consumer fetched "orders" offsets 100..109; team-a's batch at offset 100 was never
    # delivered, however alike the names.
    lines.append(fetch(START + dt.timedelta(seconds=30), "team-b"))
    lines.append(produce(START + dt.timedelta(seconds=40), None, 500))      # before virtual clusters
    write_log(root, sorted(lines, key=lambda line: line["ts"]))
    return root


def run(logs: Path, out: Path, *extra: str) -> dict[str, Any]:
    from kproxy.cli import main

    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["report", str(logs), "--out", str(out), *extra]) == 0
    return json.loads((out / "summary.json").read_text())


def table(spark: Any, out: Path, name: str) -> list[dict[str, Any]]:
    return [r.asDict(recursive=True) for r in spark.read.parquet(str(out / "tables" / name)).collect()]


def test_every_table_is_per_virtual_cluster(spark: Any, logs: Path, tmp_path: Path) -> None:
    s = run(logs, tmp_path)
    assert s["virtual_clusters"] == 3 and s["requests"] == 42
    by_client = {(r["virtual_cluster"], r["client_id"]): r for r in table(spark, tmp_path, "traffic_by_client")}
    assert by_client[("team-a", "app")]["produce_bytes"] == 20 * 1000
    assert by_client[("team-b", "app")]["produce_bytes"] == 20 * 3000
    assert by_client[("default", "app")]["produce_bytes"] == 500
    topics = {(r["virtual_cluster"], r["topic"]) for r in table(spark, tmp_path, "traffic_by_topic")}
    assert topics == {("team-a", "orders"), ("team-b", "orders"), ("default", "orders")}
    for name in ("requests", "partitions", "requests_per_minute", "records_per_minute", "latency_by_api",
                 "latency_by_client", "incidents_per_minute", "fleet", "api_versions", "quota_advice",
                 "e2e_latency", "traffic_by_principal"):
        rows = table(spark, tmp_path, name)
        assert rows and all(r["virtual_cluster"] in ("team-a", "team-b", "default") for r in rows), name
    # The end-to-end join meets team-b's batch with team-b's fetch, and never team-a's.
    (e2e,) = table(spark, tmp_path, "e2e_latency")
    assert (e2e["virtual_cluster"], e2e["topic"], e2e["batches"]) == ("team-b", "orders", 20)
    # A quota file for each virtual cluster: quotas belong in each one's rule files.
    assert set(s["quota_files"]) == {"team-a", "team-b", "default"}
    team_b = (tmp_path / "recommended-quotas-team-b.yaml").read_text()
    assert "virtual cluster team-b" in team_b and "client_id: app" in team_b
    html = (tmp_path / "report.html").read_text()
    # The report's tables with rows say their virtual cluster first.
    assert "<th>virtual cluster</th><th>client id</th>" in html and html.count("<th>virtual cluster</th>") >= 6


# A second whole report (24 s in a warm Spark session at load average 4 on 2 cores, 84 s at 19): the
# filter it checks is one `where` on the requests table (kproxy/analytics/job.py), so it runs with -m slow.
@pytest.mark.slow
def test_one_virtual_cluster_alone(spark: Any, logs: Path, tmp_path: Path) -> None:
    s = run(logs, tmp_path, "--virtual-cluster", "team-a")
    assert s["virtual_clusters"] == 1 and s["requests"] == 20 and s["produce_bytes"] == 20 * 1000
    assert {r["virtual_cluster"] for r in table(spark, tmp_path, "requests")} == {"team-a"}
    assert (tmp_path / "recommended-quotas.yaml").is_file()
    assert table(spark, tmp_path, "e2e_latency") == []

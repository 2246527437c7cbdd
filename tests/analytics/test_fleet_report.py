"""The quota dry run for fleets: one producer split over three kproxy instances, judged per instance
(with and without the static share) and as fleet quotas judge it (both instances' traffic on one
budget); and a dump of the coordination topic summed per budget key."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest

from kproxy.analytics.synthetic import base_line, epoch_ms, write_log
from kproxy.quota.fleet import Load, record_key, record_value

pytestmark = pytest.mark.spark

START = dt.datetime(2024, 5, 1, 10, 0, tzinfo=dt.UTC)
RULES = """\
quotas:
  - name: split
    match: {client_id: split-producer}
    produce_bytes_per_s: 102400
"""


def produce(ts: dt.datetime, proxy: str, conn: int, nbytes: int) -> dict[str, Any]:
    return base_line(ts, "split-producer", "produce", 9, acks=-1, proxy=proxy, conn=conn, topics=["t"], partitions=[
        {"topic": "t", "partition": 0, "records": 10, "bytes": nbytes, "first_offset": 0, "last_offset": 9,
         "first_timestamp": epoch_ms(ts), "max_timestamp": epoch_ms(ts), "compression": "none", "error_code": 0}])


@pytest.fixture(scope="module")
def requests(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    # 40 KiB a second through each of three instances for 60 s: 40% of the limit each (80% at most
    # as Kafka measures the first two seconds), 120% together.
    root = tmp_path_factory.mktemp("split")
    lines = [produce(START + dt.timedelta(seconds=i, milliseconds=100 + 300 * n), f"kproxy-{n}:1", n + 1, 40960)
             for i in range(60) for n in (0, 1, 2)]
    write_log(root, lines)
    from kproxy.analytics.source import read_lines
    from kproxy.analytics.tables import requests_table
    return requests_table(read_lines(spark, [str(root)]))


def throttled(spark: Any, requests: Any, tmp_path: Path, **kwargs: Any) -> dict[str, dict[str, Any]]:
    from kproxy.analytics.dry_run import dry_run
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    table = dry_run(requests, rules, **kwargs)["dry_run_throttled"]
    return {r["instance"]: r.asDict() for r in table.collect()}


def test_each_instance_alone_is_within_the_limit_but_the_fleet_is_not(spark, requests, tmp_path):
    alone = throttled(spark, requests, tmp_path)
    assert set(alone) == {"kproxy-0:1", "kproxy-1:1", "kproxy-2:1"}
    assert all(r["requests"] == 60 and r["throttled"] == 0 for r in alone.values()), alone
    fleet = throttled(spark, requests, tmp_path, fleet=True)
    assert set(fleet) == {"*"} and fleet["*"]["requests"] == 180
    assert fleet["*"]["throttled"] > 90          # 120% of the limit: soon every request is over
    # Kept per instance with the static share (quota_replicas: 3), each third is over its 33%.
    thirds = throttled(spark, requests, tmp_path, replicas=3)
    assert set(thirds) == set(alone) and all(r["throttled"] > 30 for r in thirds.values()), thirds


def test_a_coordination_dump_is_summed_per_budget_key(spark, tmp_path):
    from kproxy.analytics.dry_run import coordination_tables
    from kproxy.analytics.source import ReportError
    at = int(START.timestamp() * 1000)
    lines = []
    for i in range(10):
        for instance, rate, demand in (("host-a-1-ab", 0.3, 0.6), ("host-b-2-cd", 0.2, 0.2)):
            key = record_key("billing", "split", "client_id=split-producer", instance).decode()
            value = record_value(Load(rate, demand)).decode()
            lines.append(f"{key}\t{value}\t{at + 500 * i}")
    heartbeat = record_key("billing", "", "", "host-a-1-ab").decode()
    lines += [f"{heartbeat}\t{{\"r\":0,\"d\":0}}\t{at}", "garbage line", "a/b/c/d\tnot json\t1"]
    dump = tmp_path / "dump.tsv"
    dump.write_text("\n".join(lines) + "\n")
    (row,) = [r.asDict() for r in coordination_tables(spark, dump)["coordination_budgets"].collect()]
    assert (row["fleet"], row["quota"], row["key"]) == ("billing", "split", "client_id=split-producer")
    assert row["instances"] == 2 and row["records"] == 20
    assert row["peak_rate"] == pytest.approx(0.5) and row["peak_demand"] == pytest.approx(0.8)
    with pytest.raises(ReportError, match="no such file"):
        coordination_tables(spark, tmp_path / "absent.tsv")

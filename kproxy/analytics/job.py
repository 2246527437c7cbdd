"""``kproxy report``: runs the pipeline stage by stage and writes the report directory.

Stages read the Parquet tables the earlier stages wrote, so the JSON is parsed once. Only the small
final results (top rows, per-bucket totals, the quota advice) come back to the driver, for the HTML
page, the quota file, summary.json and the terminal summary.
"""

from __future__ import annotations

import argparse
import datetime as dt
import html
import json
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from pyspark.sql import DataFrame, Observation, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from kproxy.analytics import render as R
from kproxy.analytics import tables as TB
from kproxy.analytics.dry_run import coordination_tables, dry_run
from kproxy.analytics.quota_file import write_quota_file
from kproxy.analytics.removed_versions import REMOVED_IN
from kproxy.analytics.session import apply_runtime_settings, build_session
from kproxy.analytics.source import CORRUPT, ReportError, parse_time, read_lines

UTC = dt.UTC
TOP = 20


@dataclass
class ReportOptions:
    logs: list[str]
    out: Path
    since: dt.datetime | None = None
    until: dt.datetime | None = None
    master: str | None = None
    rules: Path | None = None
    quota_per: str = "client_id"
    tables_uri: str | None = None
    fleet_quotas: bool = False          # the quota dry run sums each budget key over the instances
    quota_replicas: int = 1             # otherwise each instance is judged with 1/this of each limit
    coordination_dump: Path | None = None
    virtual_cluster: str | None = None   # only this virtual cluster's lines (None: all, each table per cluster)

    @property
    def tables(self) -> str:
        return (self.tables_uri or str(self.out / "tables")).rstrip("/")


class Progress:
    """One status line per stage on a terminal (stderr), and the time each stage took."""

    def __init__(self, total: int, stream: IO[str] | None = None, enabled: bool | None = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.total, self.done = total, 0
        self.timings: list[tuple[str, float]] = []

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        self.done += 1
        if self.enabled:
            print(f"[{self.done}/{self.total}] {name} …", file=self.stream, flush=True)
        start = time.perf_counter()
        yield
        seconds = time.perf_counter() - start
        self.timings.append((name, seconds))
        if self.enabled:
            print(f"[{self.done}/{self.total}] {name}: {seconds:.1f} s", file=self.stream, flush=True)


class Tables:
    """Writes each table as Parquet under one root and reads it back for the next stages."""

    def __init__(self, spark: SparkSession, root: str) -> None:
        self.spark, self.root = spark, root
        self.written: dict[str, str] = {}
        self.rows: dict[str, int] = {}

    def write(self, name: str, df: DataFrame, small: bool = False) -> DataFrame:
        uri = f"{self.root}/{name}"
        # The row count comes with the write (an Observation), not from another job.
        counted = Observation(name)
        df = df.observe(counted, F.count(F.lit(1)).alias("rows"))
        # A result of a few thousand rows is one file, not one per shuffle partition. repartition,
        # not coalesce: coalesce(1) would also run the aggregation before it in a single task.
        (df.repartition(1) if small else df).write.mode("overwrite").parquet(uri)
        self.written[name] = uri
        self.rows[name] = int(counted.get["rows"])
        return self.spark.read.parquet(uri)


STAGES = ("read the logs into the requests table", "partitions table", "traffic per minute",
          "traffic by client, principal and topic", "latency", "errors, denials and throttles",
          "fleet and upgrade risk", "quota advice", "end-to-end latency", "report files")


def run_report(opts: ReportOptions, spark: SparkSession | None = None,
               progress: Progress | None = None) -> dict[str, Any]:
    """Runs the whole report; returns what summary.json holds."""
    if opts.since and opts.until and opts.since >= opts.until:
        raise ReportError(f"--since {opts.since.isoformat()} is not before --until {opts.until.isoformat()}")
    if opts.rules is not None and not opts.rules.is_file():
        raise ReportError(f"--rules {opts.rules}: no such file")
    if opts.quota_replicas < 1:
        raise ReportError(f"--quota-replicas {opts.quota_replicas}: must be at least 1")
    opts.out.mkdir(parents=True, exist_ok=True)
    progress = progress or Progress(len(STAGES) + (1 if opts.rules or opts.coordination_dump else 0))
    if spark is None:
        spark = build_session(opts.master)
    else:
        apply_runtime_settings(spark)
    t = Tables(spark, opts.tables)
    got: dict[str, DataFrame] = {}

    with progress.stage(STAGES[0]):
        lines = read_lines(spark, opts.logs, opts.since, opts.until)
        seen = Observation("input")
        bad = ~TB.valid_lines(lines)
        lines = lines.observe(
            seen, F.count(F.lit(1)).alias("lines"), F.count(F.when(bad, 1)).alias("malformed"),
            F.first(F.when(bad, F.substring(F.coalesce(F.col(CORRUPT), F.lit("(missing ts, api or duration_ms)")),
                                            1, 200)), ignorenulls=True).alias("sample"),
            F.first(F.when(bad, F.input_file_name()), ignorenulls=True).alias("sample_file"))
        requests_of = TB.requests_table(lines)
        if opts.virtual_cluster is not None:
            requests_of = requests_of.where(F.col(TB.VC) == opts.virtual_cluster)
        got["requests"] = t.write("requests", requests_of)
        input_stats = seen.get
        if not input_stats.get("lines"):
            raise ReportError(f"no traffic log lines (*.jsonl, *.jsonl.gz) in {', '.join(opts.logs)}"
                              f"{_window_text(opts)}")
    requests = got["requests"]
    dry_tables = (dry_run(requests, opts.rules, opts.fleet_quotas, opts.quota_replicas)
                  if opts.rules is not None else {})
    if opts.coordination_dump is not None:
        dry_tables.update(coordination_tables(spark, opts.coordination_dump))

    with progress.stage(STAGES[1]):
        partitions = t.write("partitions", TB.partitions_table(requests))
    with progress.stage(STAGES[2]):
        rpm = t.write("requests_per_minute", TB.requests_per_minute(requests))
        recpm = t.write("records_per_minute", TB.records_per_minute(partitions))
    with progress.stage(STAGES[3]):
        for key, name in (("client_id", "traffic_by_client"), ("principal", "traffic_by_principal"),
                          ("topic", "traffic_by_topic")):
            got[name] = t.write(name, TB.traffic_by(requests, partitions, key), small=True)
    with progress.stage(STAGES[4]):
        got["latency_by_api"] = t.write("latency_by_api", TB.latency_by(requests, ["api"]), small=True)
        got["latency_by_client"] = t.write("latency_by_client", TB.latency_by(requests, ["client_id", "api"]),
                                           small=True)
    with progress.stage(STAGES[5]):
        got["errors"] = t.write("errors", TB.errors_table(requests), small=True)
        got["partition_errors"] = t.write("partition_errors", TB.partition_errors_table(requests), small=True)
        got["denials"] = t.write("denials", TB.denials_table(requests), small=True)
        got["record_refusals"] = t.write("record_refusals", TB.record_refusals_table(requests), small=True)
        got["throttles"] = t.write("throttles", TB.throttles_table(requests), small=True)
        got["incidents_per_minute"] = t.write("incidents_per_minute", TB.incidents_per_minute(rpm), small=True)
    with progress.stage(STAGES[6]):
        got["fleet"] = t.write("fleet", TB.fleet_table(requests), small=True)
        versions = t.write("api_versions", TB.api_versions_table(requests), small=True)
        got["upgrade_risk"] = t.write(
            "upgrade_risk", TB.upgrade_risk_table(versions, TB.removed_versions_frame(spark)), small=True)
    with progress.stage(STAGES[7]):
        got["quota_advice"] = t.write(
            "quota_advice", TB.quota_advice_table(got["traffic_by_client"], got["traffic_by_principal"]), small=True)
        advice = [r.asDict() for r in got["quota_advice"].where(F.col("dimension") == opts.quota_per).collect()]
    with progress.stage(STAGES[8]):
        got["e2e_latency"] = t.write("e2e_latency", TB.e2e_latency_table(TB.e2e_batches(partitions)), small=True)
    if dry_tables:
        with progress.stage("policy dry-run"):
            for name, df in dry_tables.items():
                got[name] = t.write(name, df, small=True)

    with progress.stage(STAGES[9]):
        summary = _summary(opts, got, input_stats)
        # Rules are a virtual cluster's own: one quota file for each.
        quota_paths = quota_files(opts.out, sorted({str(r[TB.VC]) for r in advice}))
        summary["quotas"] = sum(
            write_quota_file(path, [r for r in advice if cluster is None or r[TB.VC] == cluster], opts.quota_per,
                             _quota_header(opts, summary, cluster))
            for cluster, path in quota_paths.items())
        summary["quota_files"] = {cluster or "": str(path) for cluster, path in quota_paths.items()}
        summary["tables"] = dict(t.written)
        page = _html(opts, summary, got, t.rows, recpm, quota_paths, len(advice))
        (opts.out / "report.html").write_text(page, encoding="utf-8")
    summary["stages"] = [{"name": n, "seconds": round(s, 3)} for n, s in progress.timings]
    (opts.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n", encoding="utf-8")
    return summary


def quota_files(out: Path, clusters: list[str]) -> dict[str | None, Path]:
    """Where the recommended quotas go: recommended-quotas.yaml when the traffic is one virtual
    cluster's (None: every row), else recommended-quotas-<name>.yaml for each."""
    if len(clusters) <= 1:
        return {None: out / "recommended-quotas.yaml"}
    return {c: out / f"recommended-quotas-{re.sub(r'[^A-Za-z0-9-]+', '_', c)}.yaml" for c in clusters}


def _window_text(opts: ReportOptions) -> str:
    parts = []
    if opts.since:
        parts.append(f" since {opts.since.isoformat()}")
    if opts.until:
        parts.append(f" until {opts.until.isoformat()}")
    return "".join(parts)


# ---- collecting the small results ---------------------------------------------------------------

def rows(df: DataFrame, limit: int | None = None) -> list[dict[str, Any]]:
    """Rows as dicts, timestamps as UTC text (PySpark would turn them into local-zone datetimes)."""
    cols = [F.date_format(f.name, "yyyy-MM-dd HH:mm:ss").alias(f.name)
            if isinstance(f.dataType, T.TimestampType) else F.col(f.name) for f in df.schema.fields]
    out = df.select(*cols)
    if limit is not None:
        out = out.limit(limit)
    return [r.asDict(recursive=True) for r in out.collect()]


def _summary(opts: ReportOptions, got: dict[str, DataFrame], input_stats: dict[str, Any]) -> dict[str, Any]:
    c = got["traffic_by_client"].agg(
        F.sum("requests").alias("requests"), F.sum("produce_bytes").alias("produce_bytes"),
        F.sum("fetch_bytes").alias("fetch_bytes"), F.sum("produced_records").alias("produced_records"),
        F.sum("fetched_records").alias("fetched_records"), F.count("client_id").alias("clients"),
        F.countDistinct(TB.VC).alias("virtual_clusters"),
        F.date_format(F.min("first_seen"), "yyyy-MM-dd'T'HH:mm:ss.SSSSSS'Z'").alias("first_ts"),
        F.date_format(F.max("last_seen"), "yyyy-MM-dd'T'HH:mm:ss.SSSSSS'Z'").alias("last_ts")).first()
    assert c is not None
    topics = got["traffic_by_topic"].where(F.col("topic").isNotNull()).count()
    principals = got["traffic_by_principal"].where(F.col("principal").isNotNull()).count()
    risk = sorted(r["client_id"] or "(none)" for r in got["upgrade_risk"].select("client_id").distinct().collect())
    return {
        "requests": int(c["requests"] or 0),
        "produce_bytes": int(c["produce_bytes"] or 0),
        "fetch_bytes": int(c["fetch_bytes"] or 0),
        "produced_records": int(c["produced_records"] or 0),
        "fetched_records": int(c["fetched_records"] or 0),
        "clients": int(c["clients"] or 0),
        "virtual_clusters": int(c["virtual_clusters"] or 0),
        "topics": topics,
        "principals": principals,
        "first_ts": c["first_ts"],
        "last_ts": c["last_ts"],
        "malformed_lines": int(input_stats.get("malformed") or 0),
        "malformed_sample": input_stats.get("sample"),
        "malformed_sample_file": input_stats.get("sample_file"),
        "inputs": list(opts.logs),
        "since": opts.since.isoformat() if opts.since else None,
        "until": opts.until.isoformat() if opts.until else None,
        "upgrade_risk_clients": risk,
        "percentile_accuracy": TB.PERCENTILE_ACCURACY,
    }


def _quota_header(opts: ReportOptions, summary: dict[str, Any], cluster: str | None = None) -> str:
    which = f" of virtual cluster {cluster} (its rules: put them in its rule files)" if cluster else ""
    return (f"Recommended quotas{which} from kproxy report, traffic {summary['first_ts']} .. {summary['last_ts']} "
            "(UTC).\n"
            f"Each limit is the observed p99 per-second rate (over the seconds the {opts.quota_per} was active)\n"
            f"times {TB.HEADROOM:g}, rounded up to two significant digits, at least "
            f"{TB.FLOOR_BYTES_PER_S} B/s and {TB.FLOOR_REQUESTS_PER_S} requests/s.\n"
            "A direction a client never used gets no limit. Review before use: kproxy check --rules FILE")


def _bucket_seconds(first: str | None, last: str | None) -> int:
    """The chart resolution: the finest that keeps a series under ~1,500 points."""
    if not first or not last:
        return 60
    span = (dt.datetime.fromisoformat(last) - dt.datetime.fromisoformat(first)).total_seconds()
    for b in (60, 300, 900, 3600, 6 * 3600, 86400):
        if span / b <= 1500:
            return b
    return 7 * 86400


def _series(df: DataFrame, bucket: int, values: dict[str, Any]) -> tuple[list[dt.datetime], dict[str, list[float]]]:
    start = (F.floor(F.unix_seconds("minute") / bucket) * bucket).alias("t")
    got = df.groupBy(start).agg(*[v.alias(k) for k, v in values.items()]).orderBy("t").collect()
    times = [dt.datetime.fromtimestamp(r["t"], UTC) for r in got]
    return times, {k: [float(r[k] or 0) for r in got] for k in values}


# ---- the HTML page -------------------------------------------------------------------------------

DRY_RUN_NOTES = {
    "dry_run_record_rules": "The traffic log holds record counts and batch sizes, never record keys, values or "
                            "headers, so value and key checks (json, json_schema, avro_schema_registry, key: "
                            "required, allow_null, headers) cannot be dry-run: this table shows what each validate "
                            "rule would have judged, and refuses only where the log proves it (max_record_bytes, "
                            "for uncompressed batches whose average record is already too large).",
}


def _html(opts: ReportOptions, s: dict[str, Any], got: dict[str, DataFrame], counts: dict[str, int],
          recpm: DataFrame, quota_paths: dict[str | None, Path], quotas_shown: int) -> str:
    bucket = _bucket_seconds(s["first_ts"], s["last_ts"])
    per = f"per {bucket // 60} min" if bucket < 3600 else f"per {bucket // 3600} h"
    sections = [_traffic(got, counts, recpm, bucket, per), _latency(got, counts),
                _incidents(got, counts, bucket, per), _fleet(got, counts),
                _quotas(got, quota_paths, opts.quota_per, quotas_shown), _e2e(got, counts)]
    for name in got:
        if name.startswith(("dry_run_", "coordination_")):
            intro = DRY_RUN_NOTES.get(name, "")
            title = ("Dry run: " if name.startswith("dry_run_") else "Fleet quotas: ") + name
            sections.append(R.Section(title, name, intro, parts=[
                R.table(rows(got[name], 200), [(c, c, R.fmt_text) for c in got[name].columns],
                        counts[name], f"tables/{name}")]))
    window = f"{s['first_ts'] or R.DASH} to {s['last_ts'] or R.DASH} UTC"
    meta = (f"Traffic {html.escape(window)} · from {html.escape(', '.join(opts.logs))}"
            f"{html.escape(_window_text(opts))} · generated {dt.datetime.now(UTC):%Y-%m-%d %H:%M} UTC")
    summary_cards = R.cards([
        ("requests", R.fmt_int(s["requests"])), ("produced", R.fmt_bytes(s["produce_bytes"])),
        ("fetched", R.fmt_bytes(s["fetch_bytes"])), ("records produced", R.fmt_int(s["produced_records"])),
        ("records fetched", R.fmt_int(s["fetched_records"])), ("clients", R.fmt_int(s["clients"])),
        ("virtual clusters", R.fmt_int(s["virtual_clusters"])),
        ("topics", R.fmt_int(s["topics"])), ("upgrade-risk clients", R.fmt_int(len(s["upgrade_risk_clients"]))),
    ])
    if s["malformed_lines"]:
        summary_cards += (f'<p class="warn">{s["malformed_lines"]:,} lines could not be read and are left out, '
                          f'e.g. in {html.escape(str(s["malformed_sample_file"]))}: '
                          f'<code>{html.escape(str(s["malformed_sample"]))}</code></p>')
    footer = ("<p>Every table is Parquet, one directory each, for notebooks and other tools:</p><ul>"
              + "".join(f"<li><code>{html.escape(uri)}</code></li>" for uri in s["tables"].values()) + "</ul>")
    return R.page("kproxy traffic report", meta, summary_cards, sections, footer)


def _traffic(got: dict[str, DataFrame], counts: dict[str, int], recpm: DataFrame, bucket: int,
             per: str) -> R.Section:
    sec = R.Section("Traffic", "traffic", "Bytes are record batch bytes as sent (the records fields of Produce "
                    "and Fetch). Peaks are the busiest single second; p99 is over the seconds a client was active.")
    times, series = _series(recpm, bucket, {
        "produce": F.sum(F.when(F.col("direction") == "produce", F.col("bytes"))) / bucket,
        "fetch": F.sum(F.when(F.col("direction") == "fetch", F.col("bytes"))) / bucket})
    if times:
        scale = 1024 * 1024
        sec.parts.append(R.img(R.time_chart(f"Record bytes per second ({per} averages)", times,
                                            {k: [v / scale for v in vs] for k, vs in series.items()}, "MiB/s"),
                               "record bytes over time"))
    by_client = got["traffic_by_client"]
    top = rows(by_client.orderBy(F.desc("total_bytes"), F.desc("requests")), TOP)
    if top:
        sec.parts.append(R.img(R.bar_chart(
            "Top talkers by record bytes", [R.fmt_text(r["client_id"]) for r in top[:12]],
            {"produce": [r["produce_bytes"] / 2**20 for r in top[:12]],
             "fetch": [r["fetch_bytes"] / 2**20 for r in top[:12]]}, "MiB", stacked=True), "top talkers"))
    cols: list[R.Column] = [
        ("requests", "requests", R.fmt_int), ("produce_bytes", "produced", R.fmt_bytes),
        ("fetch_bytes", "fetched", R.fmt_bytes), ("produced_records", "records in", R.fmt_int),
        ("fetched_records", "records out", R.fmt_int), ("peak_produce_bytes_per_s", "peak produce", R.fmt_rate),
        ("peak_fetch_bytes_per_s", "peak fetch", R.fmt_rate), ("peak_requests_per_s", "peak req/s", R.fmt_int),
        ("last_seen", "last seen", R.fmt_text)]
    sec.parts.append("<h3>Clients</h3>" + R.table(top, [VC_COL, ("client_id", "client id", R.fmt_text), *cols],
                                                     counts["traffic_by_client"], "tables/traffic_by_client"))
    for name, key, label in (("traffic_by_principal", "principal", "Principals"), ("traffic_by_topic", "topic", "Topics")):
        df = got[name]
        sec.parts.append(f"<h3>{label}</h3>" + R.table(
            rows(df.orderBy(F.desc("total_bytes"), F.desc("requests")), TOP), [VC_COL, (key, key, R.fmt_text), *cols],
            counts[name], f"tables/{name}"))
    return sec


def _latency(got: dict[str, DataFrame], counts: dict[str, int]) -> R.Section:
    sec = R.Section("Latency", "latency", f"Approximate percentiles (Spark percentile_approx, accuracy "
                    f"{TB.PERCENTILE_ACCURACY:,}: each value's rank is within {100 / TB.PERCENTILE_ACCURACY:g}% "
                    "of the rows of the one asked for). Total = request read to response written; broker = "
                    "written to the broker until its response was complete; kproxy = total minus broker. Wait adds "
                    "the throttle time clients were told to honour; throttle share is that time's part of all "
                    "waiting. Fetch times include the long-poll wait (max_wait_ms) the consumers asked for.")
    by_api = rows(got["latency_by_api"].orderBy(F.desc("requests")))
    if by_api:
        shown = by_api[:12]
        sec.parts.append(R.img(R.bar_chart(
            "Total time per API (p50 / p95 / p99, log scale)", [r["api"] for r in shown],
            {q: [r[f"total_ms_{q}"] or 0 for r in shown] for q in R_QUANTILES}, "ms", log=True), "latency per API"))
        sec.parts.append(R.img(R.bar_chart(
            "Where the time goes at p99: broker vs kproxy", [r["api"] for r in shown],
            {"broker p99": [r["broker_ms_p99"] or 0 for r in shown],
             "kproxy p99": [r["kproxy_ms_p99"] or 0 for r in shown]}, "ms", log=True), "broker vs kproxy"))
    cols: list[R.Column] = [("requests", "requests", R.fmt_int)]
    for prefix, label in (("total_ms", "total"), ("broker_ms", "broker"), ("kproxy_ms", "kproxy")):
        cols += [(f"{prefix}_{q}", f"{label} {q}", R.fmt_ms) for q in R_QUANTILES]
    cols += [("wait_ms_p99", "wait p99", R.fmt_ms), ("throttled_requests", "throttled", R.fmt_int),
             ("throttle_share", "throttle share", R.fmt_share)]
    sec.parts.append("<h3>Per API</h3>" + R.table(by_api, [VC_COL, ("api", "api", R.fmt_text), *cols]))
    df = got["latency_by_client"]
    sec.parts.append("<h3>Per client and API (busiest first)</h3>" + R.table(
        rows(df.orderBy(F.desc("requests")), TOP),
        [VC_COL, ("client_id", "client id", R.fmt_text), ("api", "api", R.fmt_text), *cols],
        counts["latency_by_client"],
        "tables/latency_by_client"))
    return sec


R_QUANTILES = TB.QUANTILE_NAMES
# The first column of every table: which virtual cluster a row is about.
VC_COL: R.Column = (TB.VC, "virtual cluster", R.fmt_text)


def _incidents(got: dict[str, DataFrame], counts: dict[str, int], bucket: int, per: str) -> R.Section:
    sec = R.Section("Errors, denials and throttles", "incidents",
                    "Errors are responses with a non-zero error code (top level or any partition); denials are "
                    "requests a kproxy rule answered with deny; throttles are responses that told the client "
                    "to wait, by kproxy's quota or by the broker.")
    times, series = _series(got["incidents_per_minute"], bucket, {
        "errors": F.sum("errors"), "denials": F.sum("denials"), "throttled": F.sum("throttled"),
        "broker lost": F.sum("upstream_lost")})
    if times and R.nonzero(v for vs in series.values() for v in vs):
        sec.parts.append(R.img(R.time_chart(f"Requests {per}", times, series, "requests"), "incidents over time"))
    for name, title, cols in (
        ("errors", "Errors", [("error", "error", R.fmt_text), ("error_code", "top-level code", R.fmt_code),
                              ("api", "api", R.fmt_text), ("client_id", "client id", R.fmt_text),
                              ("requests", "requests", R.fmt_int), ("last_seen", "last seen", R.fmt_text)]),
        ("partition_errors", "Partition errors", [("error", "error", R.fmt_text), ("api", "api", R.fmt_text),
                                                  ("client_id", "client id", R.fmt_text),
                                                  ("partitions", "partitions", R.fmt_int)]),
        ("denials", "Denials", [("rule", "rule", R.fmt_text), ("api", "api", R.fmt_text),
                                ("client_id", "client id", R.fmt_text), ("principal", "principal", R.fmt_text),
                                ("requests", "requests", R.fmt_int), ("last_seen", "last seen", R.fmt_text)]),
        ("record_refusals", "Records refused by validate rules", [
            ("rule", "rule", R.fmt_text), ("client_id", "client id", R.fmt_text), ("topic", "topic", R.fmt_text),
            ("batches", "batches", R.fmt_int), ("records", "bad records", R.fmt_int),
            ("last_seen", "last seen", R.fmt_text)]),
        ("throttles", "Throttles", [("source", "by", R.fmt_text), ("quota_rule", "quota", R.fmt_text),
                                    ("quota_key", "key", R.fmt_text), ("client_id", "client id", R.fmt_text),
                                    ("api", "api", R.fmt_text), ("requests", "requests", R.fmt_int),
                                    ("throttle_ms_total", "throttle total", R.fmt_ms),
                                    ("throttle_ms_max", "max", R.fmt_ms)]),
    ):
        df = got[name]
        order = {"partition_errors": "partitions", "record_refusals": "batches"}.get(name, "requests")
        sec.parts.append(f"<h3>{title}</h3>" + R.table(rows(df.orderBy(F.desc(order)), TOP), [VC_COL, *cols], counts[name],
                                                       f"tables/{name}"))
    return sec


def _fleet(got: dict[str, DataFrame], counts: dict[str, int]) -> R.Section:
    sec = R.Section("Fleet and upgrade risk", "fleet",
                    f"Clients that used API versions removed in {REMOVED_IN}: they break when the cluster "
                    "moves to it. Software name and version come from ApiVersions v3+; older clients do not send "
                    "them. Metadata v0-3 are not on the list: Kafka 4.0 kept them (KAFKA-18648).")
    risk = got["upgrade_risk"]
    per_client = rows(risk.groupBy(TB.VC, "client_id", "client_software_name", "client_software_version").agg(
        F.array_sort(F.collect_set(F.concat("api", F.lit(" v"), F.col("api_version").cast("string")))).alias("uses"),
        F.sum("requests").alias("requests"), F.max("last_seen").alias("last_seen")).orderBy(F.desc("last_seen")), 200)
    if per_client:
        sec.parts.append(f'<p class="warn">{len(per_client)} client(s) would break on {REMOVED_IN}.</p>')
    sec.parts.append("<h3>Who breaks</h3>" + R.table(per_client, [
        VC_COL, ("client_id", "client id", R.fmt_text), ("client_software_name", "software", R.fmt_text),
        ("client_software_version", "version", R.fmt_text), ("uses", "removed versions used", R.fmt_text),
        ("requests", "requests", R.fmt_int), ("last_seen", "last seen", R.fmt_text)]))
    fleet = got["fleet"]
    sec.parts.append("<h3>Client inventory</h3>" + R.table(rows(fleet.orderBy(F.desc("requests")), 50), [
        VC_COL, ("client_id", "client id", R.fmt_text), ("client_software_name", "software", R.fmt_text),
        ("client_software_version", "version", R.fmt_text), ("principals", "principals", R.fmt_text),
        ("connections", "connections", R.fmt_int), ("requests", "requests", R.fmt_int),
        ("first_seen", "first seen", R.fmt_text), ("last_seen", "last seen", R.fmt_text)],
        counts["fleet"], "tables/fleet"))
    return sec


def _quotas(got: dict[str, DataFrame], quota_paths: dict[str | None, Path], per: str, shown_total: int) -> R.Section:
    names = ", ".join(path.name for path in quota_paths.values())
    sec = R.Section("Quota advice", "quotas",
                    f"Per {per}: the observed p99 per-second rate times {TB.HEADROOM:g}, rounded up, written to "
                    f"{names} in kproxy's quota syntax (one file per virtual cluster when there are several: "
                    f"quotas go in each one's rule files). Principals are in tables/quota_advice too.")
    df = got["quota_advice"].where(F.col("dimension") == per)
    top = rows(df.orderBy(F.desc("peak_produce_bytes_per_s"), F.desc("peak_fetch_bytes_per_s")), TOP)
    if top:
        shown = top[:12]
        sec.parts.append(R.img(R.bar_chart(
            "Produce: observed p99 and peak vs recommended", [R.fmt_text(r["key"]) for r in shown],
            {"p99": [(r["p99_produce_bytes_per_s"] or 0) / 1024 for r in shown],
             "peak": [(r["peak_produce_bytes_per_s"] or 0) / 1024 for r in shown],
             "recommended": [(r["recommended_produce_bytes_per_s"] or 0) / 1024 for r in shown]}, "KiB/s"),
            "quota advice"))
    sec.parts.append(R.table(top, [
        VC_COL, ("key", per, R.fmt_text), ("p99_produce_bytes_per_s", "produce p99", R.fmt_rate),
        ("peak_produce_bytes_per_s", "produce peak", R.fmt_rate),
        ("recommended_produce_bytes_per_s", "produce quota", R.fmt_rate),
        ("p99_fetch_bytes_per_s", "fetch p99", R.fmt_rate), ("peak_fetch_bytes_per_s", "fetch peak", R.fmt_rate),
        ("recommended_fetch_bytes_per_s", "fetch quota", R.fmt_rate),
        ("p99_requests_per_s", "req/s p99", R.fmt_int), ("recommended_requests_per_s", "req/s quota", R.fmt_int)],
        shown_total, "tables/quota_advice"))
    for quota_path in quota_paths.values():
        text = quota_path.read_text(encoding="utf-8").splitlines()
        preview = "\n".join(text[:60]) + ("\n…" if len(text) > 60 else "")
        sec.parts.append(f'<h3><a href="{quota_path.name}">{quota_path.name}</a></h3><pre>{html.escape(preview)}</pre>')
    return sec


def _e2e(got: dict[str, DataFrame], counts: dict[str, int]) -> R.Section:
    sec = R.Section("End-to-end latency", "e2e",
                    "Per produced batch: from kproxy passing the produce acknowledgement back to kproxy delivering "
                    "the batch's first record to each consumer group (both times on kproxy's clocks), joined on "
                    "topic, partition and offsets. CreateTime to delivery starts at the producer's record "
                    "timestamp instead, so it includes the producer's batching and depends on the producer's clock. "
                    "Approximate percentiles, per batch. Consumers with no known group are shown as client:<id>.")
    df = got["e2e_latency"]
    top = rows(df.orderBy(F.desc("batches")), TOP)
    if top:
        shown = top[:12]
        sec.parts.append(R.img(R.bar_chart(
            "Acknowledgement to delivery (p50 / p95 / p99)", [f"{r['topic']} → {r['group']}" for r in shown],
            {q: [r[f"ack_to_delivery_ms_{q}"] or 0 for r in shown] for q in R_QUANTILES}, "ms"), "end-to-end latency"))
    cols: list[R.Column] = [VC_COL, ("topic", "topic", R.fmt_text), ("group", "group", R.fmt_text),
                            ("batches", "batches", R.fmt_int), ("records", "records", R.fmt_int)]
    cols += [(f"ack_to_delivery_ms_{q}", f"ack→delivery {q}", R.fmt_ms) for q in R_QUANTILES]
    cols += [(f"create_to_delivery_ms_{q}", f"CreateTime→delivery {q}", R.fmt_ms) for q in R_QUANTILES]
    sec.parts.append(R.table(top, cols, counts["e2e_latency"], "tables/e2e_latency"))
    return sec


# ---- the command ---------------------------------------------------------------------------------

def print_summary(s: dict[str, Any], out: Path, stream: IO[str]) -> None:
    lines = [
        f"kproxy report: {s['requests']:,} requests, {s['clients']:,} clients, {s['topics']:,} topics "
        f"({s['first_ts']} .. {s['last_ts']} UTC)",
        f"  produced {R.fmt_bytes(s['produce_bytes'])} in {s['produced_records']:,} records; "
        f"fetched {R.fmt_bytes(s['fetch_bytes'])} in {s['fetched_records']:,} records",
    ]
    if s["upgrade_risk_clients"]:
        names = ", ".join(s["upgrade_risk_clients"][:8]) + (" …" if len(s["upgrade_risk_clients"]) > 8 else "")
        lines.append(f"  {len(s['upgrade_risk_clients'])} client(s) use versions {REMOVED_IN} removed: {names}")
    if s["malformed_lines"]:
        lines.append(f"  {s['malformed_lines']:,} lines could not be read (e.g. {s['malformed_sample_file']})")
    files = ", ".join(s.get("quota_files", {}).values()) or str(out / "recommended-quotas.yaml")
    lines += [f"  report:  {out / 'report.html'}", f"  quotas:  {files} ({s['quotas']})",
              f"  summary: {out / 'summary.json'}", f"  tables:  {len(s['tables'])} Parquet tables"]
    print("\n".join(lines), file=stream)


def run_from_args(args: argparse.Namespace) -> int:
    try:
        opts = ReportOptions(
            logs=list(args.logs), out=Path(args.out),
            since=parse_time(args.since) if args.since else None,
            until=parse_time(args.until) if args.until else None,
            master=args.master, rules=Path(args.rules) if args.rules else None,
            quota_per=args.quota_per, tables_uri=args.tables, fleet_quotas=args.fleet_quotas,
            quota_replicas=args.quota_replicas,
            coordination_dump=Path(args.coordination_dump) if args.coordination_dump else None,
            virtual_cluster=getattr(args, "virtual_cluster", None))
        summary = run_report(opts)
    except ReportError as e:
        print(f"kproxy report: {e}", file=sys.stderr)
        return 2
    print_summary(summary, opts.out, sys.stdout)
    return 0

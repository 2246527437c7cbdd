"""``kproxy report`` throughput: rows per second on local[1] and local[2], and where the time goes.

Run from the repository root:  ``.venv/bin/python bench/report.py [--lines N] [--hours H] [--data DIR]``

A synthetic traffic log (default 10 million lines: producers, consumer groups, admin tools and legacy
clients over 24 topics, gzip files in dt=/hour= partitions, two kproxy instances) is generated once
into --data and reused while its line count matches. Each master then runs the whole report in its
own process (a fresh JVM, so neither inherits the other's warm-up; session start-up is timed apart),
and the report's totals are checked against what the generator wrote. Figures: lines per second over the whole report, and each stage's
seconds and share.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kproxy.analytics.synthetic import LogWriter, Truth, generate

START = dt.datetime(2024, 5, 1, 0, 0, tzinfo=dt.UTC)


def make_log(root: Path, lines: int, hours: float) -> dict[str, int]:
    marker = root / "truth.json"
    if marker.exists():
        truth = json.loads(marker.read_text())
        if truth["requests"] == lines:
            print(f"reusing {lines:,} lines in {root}", flush=True)
            return truth
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    t0 = time.perf_counter()
    truth_obj = Truth()
    logs = root / "logs"
    writers = {p: LogWriter(logs, name=f"part-{p.replace(':', '-')}", gz=True) for p in ("kproxy-a:101", "kproxy-b:202")}
    for line in generate(lines, START, hours=hours, seed=11, clients=400):
        truth_obj.count(line)
        writers[line["proxy"]].write(line)
    for w in writers.values():
        w.close()
    truth = {"requests": truth_obj.requests, "produce_bytes": truth_obj.produce_bytes,
             "fetch_bytes": truth_obj.fetch_bytes, "produced_records": truth_obj.produced_records,
             "fetched_records": truth_obj.fetched_records, "clients": len(truth_obj.clients),
             "topics": len(truth_obj.topics)}
    marker.write_text(json.dumps(truth))
    size = sum(f.stat().st_size for f in logs.rglob("*.gz"))
    files = len(list(logs.rglob("*.gz")))
    print(f"generated {lines:,} lines in {time.perf_counter() - t0:.0f} s: {files} gzip files, "
          f"{size / 2**20:,.0f} MiB", flush=True)
    return truth


def run_one(master: str, logs: Path, truth: dict[str, int]) -> dict[str, Any]:
    from kproxy.analytics.job import Progress, ReportOptions, run_report
    from kproxy.analytics.session import build_session

    t0 = time.perf_counter()
    spark = build_session(master, progress_bar=False)
    startup = time.perf_counter() - t0
    out = Path(tempfile.mkdtemp(prefix="kproxy-bench-report-"))
    try:
        progress = Progress(10, enabled=True)
        t1 = time.perf_counter()
        summary = run_report(ReportOptions(logs=[str(logs)], out=out), spark=spark, progress=progress)
        total = time.perf_counter() - t1
    finally:
        spark.stop()
        shutil.rmtree(out, ignore_errors=True)
    for key, value in truth.items():
        if summary[key] != value:
            raise SystemExit(f"{master}: report says {key}={summary[key]}, the generator wrote {value}")
    return {"master": master, "startup": startup, "total": total, "rows_per_s": truth["requests"] / total,
            "stages": progress.timings}


def run_in_process(master: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--one", master, "--lines", str(args.lines), "--data", args.data]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=10_000_000, help="traffic log lines (default 10 million)")
    ap.add_argument("--hours", type=float, default=12.0, help="hours of traffic they span (default 12)")
    ap.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "kproxy-bench-report"),
                    help="where the generated log is kept between runs")
    ap.add_argument("--masters", default="local[1],local[2]", help="comma-separated Spark masters")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one master, print JSON
    args = ap.parse_args()
    root = Path(args.data)
    truth = make_log(root, args.lines, args.hours)
    if args.one:
        print(json.dumps(run_one(args.one, root / "logs", truth)))
        return 0
    results = []
    for master in args.masters.split(","):
        print(f"--- {master}", flush=True)
        results.append(run_in_process(master, args))
    print(f"\nkproxy report over {truth['requests']:,} lines (os.cpu_count()={os.cpu_count()})")
    for r in results:
        print(f"{r['master']:>10}: {r['rows_per_s']:>9,.0f} lines/s  ({r['total']:.1f} s; session start "
              f"{r['startup']:.1f} s, not counted)")
    names = [name for name, _ in results[0]["stages"]]
    print("\nwhere the time goes (seconds, share of the report):")
    print(f"{'stage':<42}" + "".join(f"{r['master']:>20}" for r in results))
    for i, name in enumerate(names):
        cells = []
        for r in results:
            seconds = r["stages"][i][1]
            cells.append(f"{seconds:>11.1f} s {100 * seconds / r['total']:>4.0f}%")
        print(f"{name:<42}" + "".join(f"{c:>20}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())

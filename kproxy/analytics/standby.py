"""``kproxy report`` on standby: the Spark session first, the traffic log to read later.

``kproxy demo`` starts this process before its first step, so the JVM's start-up (10-25 s on two
cores) overlaps the steps that write the traffic log; when the log is complete, the demo writes one
line of JSON to this process's stdin, ``{"logs": [...], "out": "..."}``, and it runs the report on
the session it already has. If stdin closes with no line (the demo failed or was interrupted), it
stops its session and exits; so does its JVM, whose own stdin is this process's pipe.

    python -m kproxy.analytics.standby [--master local[2]]

Exit status: 0 report written (or stood down), 2 the report refused its input, 3 Spark did not start,
4 the request line was not understood.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

SPARK_FAILED = 3
BAD_REQUEST = 4


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kproxy.analytics.standby")
    parser.add_argument("--master", default="local[2]", help="Spark master URL (default local[2])")
    args = parser.parse_args(argv)

    try:
        from kproxy.analytics.job import STAGES, Progress, ReportOptions, print_summary, run_report
        from kproxy.analytics.session import build_session
        from kproxy.analytics.source import ReportError

        spark = build_session(args.master, progress_bar=False, small_input=True)
    except Exception as e:     # ImportError without PySpark; pyspark's own errors when its JVM cannot start
        print(f"kproxy report: Spark did not start: {type(e).__name__}: {e}", file=sys.stderr)
        return SPARK_FAILED
    try:
        line = sys.stdin.readline()
        if not line.strip():
            return 0           # stood down: no log to read
        try:
            request: dict[str, Any] = json.loads(line)
            logs, out = [str(p) for p in request["logs"]], Path(request["out"])
        except (ValueError, KeyError, TypeError) as e:
            print(f"kproxy report: not a request line ({e}): {line[:200]!r}", file=sys.stderr)
            return BAD_REQUEST
        opts = ReportOptions(logs=logs, out=out)
        try:
            summary = run_report(opts, spark=spark, progress=Progress(len(STAGES), enabled=False))
        except ReportError as e:
            print(f"kproxy report: {e}", file=sys.stderr)
            return 2
        print_summary(summary, opts.out, sys.stdout)
        return 0
    finally:
        spark.stop()


if __name__ == "__main__":
    sys.exit(main())

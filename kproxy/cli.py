"""kproxy's command line: ``kproxy run | check | demo | decode | report``, parsed in this one place.

Each sub-command's work lives in the module that owns it; this file only parses arguments and
imports that module lazily, so ``kproxy decode`` never pays for trio or the server.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kproxy", description="A transparent Kafka wire-protocol proxy.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run the proxy")
    run.add_argument("--config", "-c", help="YAML configuration file")
    run.add_argument("--upstream", help="HOST:PORT[,HOST:PORT...] bootstrap servers (no config file)")
    run.add_argument("--listen", help="HOST:PORT of the bootstrap listener (no config file)")
    run.add_argument("--advertised-host", help="host clients are told to connect to (default: the "
                     "listen host; needed when listening on 0.0.0.0)")
    run.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (default INFO)")

    check = sub.add_parser("check", help="validate a configuration file and exit")
    check.add_argument("config", help="YAML configuration file")

    demo = sub.add_parser("demo", help="embedded broker + kproxy + a real client, then a summary")
    demo.add_argument("--records", type=int, default=1000, help="records to produce and consume")

    dec = sub.add_parser("decode", help="decode a Kafka frame given as hex or raw bytes")
    dec.add_argument("file", nargs="?", default="-", help="file with hex or raw bytes; - for stdin")
    dec.add_argument("--response", action="store_true", help="the frame is a response")
    dec.add_argument("--api-key", type=int, help="api key (responses only)")
    dec.add_argument("--api-version", type=int, help="api version (responses only)")
    dec.add_argument("--raw", action="store_true", help="the input is raw bytes, not hex")
    dec.add_argument("--show-codec", nargs=2, metavar=("API", "VERSION"),
                     help="print the generated codec source of an API (name or key) at a version")
    dec.add_argument("--kind", choices=("request", "response"), default="request",
                     help="with --show-codec: which message")
    rep = sub.add_parser("report", help="fleet report from traffic logs (PySpark; needs the analytics extra)")
    rep.add_argument("logs", nargs="+", metavar="LOGS", help="traffic log directories, files, globs or Spark URIs "
                     "(s3a://, hdfs://, gs://)")
    rep.add_argument("--out", required=True, help="directory for report.html, recommended-quotas.yaml, "
                     "summary.json and tables/")
    rep.add_argument("--since", help="first time to include: 2024-05-01, 2024-05-01T10:00:00Z or an age (36h, 7d)")
    rep.add_argument("--until", help="time to stop before, same forms as --since")
    rep.add_argument("--master", help="Spark master URL (default local[*], or what spark-submit set)")
    rep.add_argument("--rules", help="candidate rules file to dry-run against the recorded traffic")
    rep.add_argument("--quota-per", choices=("client_id", "principal"), default="client_id",
                     help="what recommended-quotas.yaml limits (default client_id)")
    rep.add_argument("--tables", help="where the Parquet tables go (default OUT/tables); on a cluster, a URI "
                     "every executor can write")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command == "decode":
        from kproxy.protocol.dissect import run_decode

        return run_decode(args)
    if args.command == "run":
        from kproxy.server.app import run_from_args

        return run_from_args(args)
    if args.command == "check":
        from kproxy.config import check_config_file

        return check_config_file(args.config)
    if args.command == "demo":
        from kproxy.server.demo import run_demo

        return run_demo(args)
    if args.command == "report":
        try:
            from kproxy.analytics.job import run_from_args as run_report
        except ImportError as e:
            print(f"kproxy report needs the analytics extra (pip install 'kproxy[analytics]') and Java 17+: {e}",
                  file=sys.stderr)
            return 2
        return run_report(args)
    raise AssertionError(args.command)  # argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())

"""kproxy's command line: ``kproxy run | check | demo | decode | report | top | switch``, parsed in this one place.

Each sub-command's work lives in the module that owns it; this file only parses arguments and
imports that module lazily, so ``kproxy decode`` never pays for trio or the server.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kproxy import __version__

if TYPE_CHECKING:
    from kproxy.config import ProxyConfig


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kproxy", description="A transparent Kafka wire-protocol proxy.")
    p.add_argument("--version", action="version", version=f"kproxy {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run the proxy")
    run.add_argument("--config", "-c", help="YAML configuration file")
    run.add_argument("--upstream", help="HOST:PORT[,HOST:PORT...] bootstrap servers (no config file)")
    run.add_argument("--listen", help="HOST:PORT of the bootstrap listener (no config file)")
    run.add_argument("--advertised-host", help="host clients are told to connect to (default: the "
                     "listen host; needed when listening on 0.0.0.0)")
    run.add_argument("--rules", action="append", metavar="PATH", help="a policy rule file or directory "
                     "(repeatable; no config file)")
    run.add_argument("--chaos", action="store_true", help="let chaos rules inject faults (no config file)")
    run.add_argument("--admin", metavar="HOST:PORT", help="serve /metrics, /livez, /readyz, /config and "
                     "/rules here (no config file)")
    run.add_argument("--traffic-log", metavar="DIR", help="write one JSON line per request under DIR "
                     "(no config file)")
    run.add_argument("--tracing", action="store_true", help="emit OpenTelemetry spans; OTEL_* variables "
                     "say where (no config file)")
    run.add_argument("--log-level", help="DEBUG, INFO, WARNING, ERROR or CRITICAL (default: the file's "
                     "log_level, else INFO)")
    run.add_argument("--log-format", help="text or json, one object per line (default: the file's "
                     "log_format, else text)")

    check = sub.add_parser("check", help="validate a configuration file, or rule files, and exit")
    check.add_argument("config", nargs="?", help="YAML configuration file (its rule files are checked too)")
    check.add_argument("--rules", action="append", metavar="PATH",
                       help="check policy rule files (or directories) on their own; repeatable")
    check.add_argument("--chaos", action="store_true", help="with --rules: check as if chaos were enabled")

    users = sub.add_parser("users", help="manage the users file kproxy authenticates clients against")
    users_sub = users.add_subparsers(dest="users_command", required=True, metavar="ACTION")
    add = users_sub.add_parser("add", help="add a user (or replace its password) as SCRAM keys; the password "
                               "comes from --password-file, a prompt, or the first line of stdin")
    add.add_argument("name", help="the user name (the principal is User:NAME)")
    add.add_argument("--users-file", required=True, help="the users file (sasl.users_file); created if missing")
    add.add_argument("--mechanism", help="SCRAM-SHA-256 or SCRAM-SHA-512 (default: both)")
    add.add_argument("--password-file", help="read the password from the first line of this file")
    add.add_argument("--iterations", type=int, default=4096, help="PBKDF2 iterations (default 4096, the minimum)")

    demo = sub.add_parser("demo", help="the product tour on an embedded broker: a tenant, a refused topic, a "
                          "quota, metrics, the traffic log and the fleet report")
    demo.add_argument("--plain", action="store_true", help="only records through kproxy and back, and a table "
                      "of the APIs kproxy saw")
    demo.add_argument("--records", type=int, default=1000, help="records to produce and consume (--plain)")
    demo.add_argument("--no-report", action="store_true", help="leave out kproxy report (which needs Java 17+ "
                      "and the analytics extra)")
    demo.add_argument("--out", help="directory for the rule file, traffic log and report (default: a new "
                      "temporary directory)")

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
    rep.add_argument("--fleet-quotas", action="store_true",
                     help="quota dry run as fleet quotas enforce it: each budget key summed over every instance's "
                     "traffic before the whole limit applies (default: each instance on its own)")
    rep.add_argument("--quota-replicas", type=int, default=1, metavar="N",
                     help="without --fleet-quotas: each instance is judged with 1/N of each limit (default 1)")
    rep.add_argument("--coordination-dump", metavar="FILE",
                     help="a dump of the fleet quota coordination topic, one record a line: key, value and timestamp "
                     "(ms), tab-separated, as kcat -C -e -t TOPIC -f with %%k, %%s and %%T writes it; gives per "
                     "budget key the instances that reported it and their peak rate and demand summed")
    rep.add_argument("--virtual-cluster", metavar="NAME", help="only this virtual cluster's traffic (default: "
                     "all, every table per virtual cluster)")
    rep.add_argument("--quota-per", choices=("client_id", "principal"), default="client_id",
                     help="what recommended-quotas.yaml limits (default client_id)")
    rep.add_argument("--tables", help="where the Parquet tables go (default OUT/tables); on a cluster, a URI "
                     "every executor can write")
    top = sub.add_parser("top", help="live view of a running kproxy's traffic, from its admin listener")
    top.add_argument("--admin", required=True, metavar="HOST:PORT", help="the admin listener (admin.listen)")
    top.add_argument("--once", action="store_true", help="print one plain-text snapshot (rates from two "
                     "scrapes a second apart) and exit")
    sw = sub.add_parser("switch", help="move a virtual cluster to another of its upstream clusters (upstream.clusters) "
                        "through a running kproxy's admin listener")
    sw.add_argument("cluster", metavar="NAME", help="the upstream cluster to switch to")
    sw.add_argument("--admin", required=True, metavar="HOST:PORT", help="the admin listener (admin.listen)")
    sw.add_argument("--virtual-cluster", metavar="VC", help="which virtual cluster (virtual_clusters[].name); may be "
                    "left out when only one has several upstream clusters")
    sw.add_argument("--timeout", type=float, default=120.0, metavar="S",
                    help="seconds to wait for the switch (default 120)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    # The arguments as given: `kproxy run` with several workers starts each with the same ones.
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    if args.command == "decode":
        return _run_decode(args)
    if args.command == "run":
        from kproxy.server.main import run_from_args

        return run_from_args(args)
    if args.command == "check":
        if args.config is None and not args.rules:
            print("kproxy check: give a configuration file, or --rules PATH", file=sys.stderr)
            return 2
        status = 0
        if args.config is not None:
            status = check_config_file(args.config)
        if args.rules:
            from kproxy.policy.loader import check_rules_files

            status = max(status, check_rules_files(args.rules, args.chaos))
        return status
    if args.command == "users":
        from kproxy.userfile import run_users_add

        return run_users_add(args.name, args.users_file, args.mechanism, args.password_file, args.iterations)
    if args.command == "demo":
        from kproxy.demo import run_demo

        return run_demo(args)
    if args.command == "report":
        try:
            from kproxy.analytics.job import run_from_args as run_report
        except ImportError as e:
            print(f"kproxy report needs the analytics extra (pip install 'kproxy-kafka[analytics]') and Java 17+: {e}",
                  file=sys.stderr)
            return 2
        return run_report(args)
    if args.command == "top":
        from kproxy.ops.top import run as run_top

        return run_top(args.admin, args.once)
    if args.command == "switch":
        from kproxy.ops.switch import run as run_switch

        return run_switch(args.cluster, args.admin, args.virtual_cluster, args.timeout)
    raise AssertionError(args.command)  # argparse rejects unknown commands


def _run_decode(args: argparse.Namespace) -> int:
    """``kproxy decode``: print one frame as JSON, or a codec's source. 0 on success, 2 on bad input.

    The dissector itself is pure (``kproxy.protocol.dissect``); reading the input and printing live here.
    """
    import json

    from kproxy.protocol.dissect import codec_text, dissect, parse_hex
    from kproxy.protocol.errors import DecodeError

    def fail(message: str) -> int:
        print(f"kproxy decode: {' '.join(message.split())}", file=sys.stderr)
        return 2

    try:
        if args.show_codec:
            api_text, version_text = args.show_codec
            try:
                version = int(version_text)
            except ValueError:
                return fail(f"version {version_text!r} is not a number")
            print(codec_text(api_text, version, args.kind), end="")
            return 0
        if args.response and (args.api_key is None or args.api_version is None):
            return fail("--response needs --api-key and --api-version (a response does not carry them)")
        try:
            raw = _read_input(args.file)
        except OSError as e:
            return fail(f"cannot read {args.file}: {e.strerror or e}")
        data = raw if args.raw else parse_hex(raw.decode("utf-8", "replace"))
        result = dissect(data, response=args.response, api_key=args.api_key, api_version=args.api_version)
    except DecodeError as e:
        where = [f"offset {e.offset}"] if e.offset is not None else []
        if e.path:
            where.append(e.path if e.path.startswith("input") else f"field {e.path}")
        return fail(f"{e.reason} ({', '.join(where)})" if where else e.reason)
    print(json.dumps(result, indent=2, ensure_ascii=False))
    if result.get("trailing_bytes"):
        print(f"kproxy decode: note: {result['trailing_bytes']} more bytes follow the frame its size prefix "
              "describes (only the first frame was decoded; more than one frame pasted?)", file=sys.stderr)
    return 0


def _read_input(name: str) -> bytes:
    if name == "-":
        stream = getattr(sys.stdin, "buffer", None)
        return stream.read() if stream is not None else sys.stdin.read().encode("utf-8", "surrogateescape")
    with open(name, "rb") as fh:
        return fh.read()


if __name__ == "__main__":
    sys.exit(main())


def _check_keytabs(cfg: ProxyConfig, path: str, prefix: tuple[str | int, ...] = ()) -> None:
    """Each configured keytab holds the principal the configuration names (it is read, no KDC asked);
    a ConfigError at the setting's line when not."""
    from kproxy.config import ConfigError
    from kproxy.config.checks import dotted
    from kproxy.config.loader import setting_line

    wanted: list[tuple[tuple[str, ...], str, str]] = []
    up = cfg.upstream.sasl
    if up is not None and up.mechanism == "GSSAPI" and up.principal and up.keytab:
        wanted.append((("upstream", "sasl", "keytab"), up.principal, up.keytab))
    if cfg.sasl is not None and cfg.sasl.gssapi is not None and "GSSAPI" in cfg.sasl.mechanisms:
        wanted.append((("sasl", "gssapi", "keytab"), cfg.sasl.gssapi.principal, cfg.sasl.gssapi.keytab))
    if not wanted:
        return
    from kproxy.server.kerberos import keytab_problem

    for setting, principal, keytab in wanted:
        problem = keytab_problem(principal, keytab)
        if problem is not None:
            where = (*prefix, *setting)
            raise ConfigError(f"{dotted(where)}: {problem}", file=path, line=setting_line(path, where))


def check_config_file(path: str) -> int:
    """``kproxy check FILE``: print an ``ok:`` summary and return 0, or print the error to stderr and
    return 2. Here rather than in kproxy.config because the summary names the codec in use, and
    configuration sits above the protocol layer and must not import its compiler."""
    from kproxy.config import ConfigError, describe_cluster, describe_config, load_config
    from kproxy.protocol.compiler import codec_implementation

    try:
        cfg = load_config(path)
        prefixes: list[tuple[str | int, ...]] = [("virtual_clusters", i) for i in range(len(cfg.virtual_clusters))]
        rules = {vc.name: _check_cluster_files(vc, path, prefix)
                 for vc, prefix in zip(cfg.clusters, prefixes or [()], strict=True)}
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    print(f"ok: {path}: {describe_config(cfg, codec_implementation())}{rules[cfg.name] if not cfg.virtual_clusters else ''}")
    for vc in cfg.virtual_clusters:
        print(f"  virtual cluster {vc.name}: {describe_cluster(vc)}{rules[vc.name]}")
    return 0


def _check_cluster_files(cfg: ProxyConfig, path: str, prefix: tuple[str | int, ...]) -> str:
    """Load one virtual cluster's users file, keytabs and rule files as ``kproxy run`` would; the
    rules' summary (``; rules: ...``), or ConfigError. ``prefix`` is where the cluster is written."""
    if cfg.sasl is not None and cfg.sasl.users_file is not None:
        from kproxy.userfile import load_users_file

        load_users_file(cfg.sasl.users_file)
    _check_keytabs(cfg, path, prefix)
    if not cfg.rules:
        return ""
    from kproxy.policy.loader import describe_rules, load_rules

    rule_set = load_rules(cfg.rules, cfg.chaos)
    for warning in rule_set.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return f"; rules: {describe_rules(rule_set)}"

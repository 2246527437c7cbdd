"""``kproxy run``: settings from a file or the command line, then logging, then the proxy until SIGTERM.

The glue between ``kproxy.cli`` and ``ProxyProcess`` (one ``ProxyServer`` per virtual cluster): every setting it takes from the command line
goes through ``kproxy.config``'s checks, and a mistake is one line on stderr and exit status 2
before anything starts. It holds no proxy logic.
"""

import functools
import gc
import logging
import os
import sys
from typing import Any, Final

import trio

from kproxy import __version__
from kproxy.config import (
    ConfigError,
    HostPort,
    ProxyConfig,
    apply_overrides,
    config_from_args,
    describe_cluster,
    describe_config,
    effective_workers,
    load_config,
)
from kproxy.logs import configure_logging
from kproxy.policy.loader import load_rules
from kproxy.protocol.compiler import accelerator_warning, codec_implementation
from kproxy.server.app import ListenError, listen_error, serve_until_signal
from kproxy.server.process import ProxyProcess
from kproxy.server.workers import WORKER_ADMIN_ENV, Supervisor, worker_identity

log = logging.getLogger("kproxy.server")

# Quick-mode options and the settings a config file has for them instead.
_QUICK_OPTIONS = (
    ("upstream", "--upstream", "upstream.bootstrap_servers"),
    ("listen", "--listen", "listen"),
    ("advertised_host", "--advertised-host", "exposure.advertised_host"),
    ("rules", "--rules", "rules"),
    ("chaos", "--chaos", "chaos"),
    ("admin", "--admin", "admin.listen"),
    ("traffic_log", "--traffic-log", "traffic_log.dir"),
    ("tracing", "--tracing", "tracing.enabled"),
)


def _log_start(cfg: ProxyConfig) -> None:
    log.info("kproxy %s: %s", __version__, describe_config(cfg, codec_implementation()))
    for vc in cfg.virtual_clusters:
        log.info("virtual cluster %s: %s", vc.name, describe_cluster(vc))
    missing = accelerator_warning()
    if missing:
        log.warning("%s", missing)


def run_from_args(args: Any) -> int:
    """Run the proxy as ``args`` (from ``kproxy run``) say; 2 on a settings mistake, 0 after a drain."""
    try:
        cfg = config_for_run(args)
    except ConfigError as e:
        print(f"kproxy run: {e}", file=sys.stderr)
        return 2
    worker = worker_identity()
    configure_logging(cfg.log_level, cfg.log_format, process=f"worker {worker[0]}" if worker else None)
    if worker is None and effective_workers(cfg) > 1:
        _log_start(cfg)
        # Checked once here, so rule files that do not load stop the start instead of every worker
        # failing and being restarted.
        try:
            for vc in cfg.clusters:
                if vc.rules:
                    load_rules(vc.rules, vc.chaos)
        except ConfigError as e:
            print(f"kproxy run: {e}", file=sys.stderr)
            return 2
        argv = getattr(args, "argv", None) or sys.argv[1:]
        return trio.run(Supervisor(cfg, argv).run)
    if worker is None or worker[0] == 0:
        _log_start(cfg)
    private_admin = os.environ.get(WORKER_ADMIN_ENV) if worker else None
    try:
        process = ProxyProcess.from_config(cfg, worker=worker,
                                           admin_listen=HostPort.parse(private_admin) if private_admin else None)
    except ConfigError as e:
        # Rule files that do not load (the message `kproxy check` prints), or OTEL_* variables
        # kproxy cannot follow (read here, when the exporter is made).
        print(f"kproxy run: {e}", file=sys.stderr)
        return 2
    # Start-up objects (schema, settings, compiled codecs) never die: keep the collector off them, and
    # let young objects pile up longer between collections (a large Metadata answer makes hundreds of
    # thousands of short-lived objects; the default threshold of 700 walks them again and again).
    if args.config:
        process.read_config = functools.partial(config_for_run, args)
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
    keep_freed_memory()
    try:
        trio.run(serve_until_signal, process)
    except (ListenError, BaseExceptionGroup) as e:
        # A port in use, or a KEK the KMS does not have, is one line, not a traceback through trio's nurseries.
        leaf = listen_error(e)
        if leaf is None:
            raise
        log.error("%s", leaf)
        print(f"kproxy run: {leaf}", file=sys.stderr)
        return 1
    return 0


# glibc's mallopt parameters, and the values kproxy sets (``keep_freed_memory``).
_M_TRIM_THRESHOLD: Final = -1
_M_MMAP_THRESHOLD: Final = -3
MMAP_THRESHOLD: Final = 16 << 20
TRIM_THRESHOLD: Final = 64 << 20


def keep_freed_memory() -> bool:
    """Let glibc keep memory kproxy frees for the next answer of the same size instead of returning
    it to the system: buffers under 16 MiB come from the heap, and up to 64 MiB of free heap is kept.
    An encrypted Fetch answer is opened into a buffer of its size; with glibc's adaptive defaults,
    answers of a few MB were given fresh pages about half the time (500,000 page faults per GB of
    records) and encrypted consume ran 0.53-0.68x of plain; with these, no faults and 0.59-0.65x
    (docs/performance.md). Left alone when the operator set either through glibc's own
    MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_, and where the C library is not glibc.
    True when set."""
    if sys.platform != "linux" or any(os.environ.get(v) for v in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        if not hasattr(libc, "gnu_get_libc_version"):
            return False                  # musl (Alpine) and others: their allocators differ
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # mmap's threshold first: setting either turns glibc's adaptive thresholds off.
    done = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    log.debug("allocator: buffers under %d MiB from the heap, up to %d MiB of free heap kept (%s)",
              MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20, "set" if done else "mallopt refused")
    return done


def config_for_run(args: Any) -> ProxyConfig:
    """The checked settings for ``kproxy run``: ``--config FILE`` or quick mode, plus the log options.

    Quick-mode options next to ``--config`` are refused rather than quietly dropped or half applied.
    """
    quick = [(option, setting) for attr, option, setting in _QUICK_OPTIONS if getattr(args, attr, None)]
    logs = {"log_level": args.log_level, "log_format": args.log_format}
    if args.config:
        if quick:
            options = " and ".join(option for option, _ in quick)
            settings = " and ".join(setting for _, setting in quick)
            raise ConfigError(f"{options} cannot be combined with --config; set {settings} in {args.config}")
        return apply_overrides(load_config(args.config), **logs)
    if args.upstream and args.listen:
        exposure = {"advertised_host": args.advertised_host} if args.advertised_host else None
        telemetry = {
            "admin": {"listen": args.admin} if getattr(args, "admin", None) else None,
            "traffic_log": {"dir": args.traffic_log} if getattr(args, "traffic_log", None) else None,
            "tracing": {"enabled": True} if getattr(args, "tracing", False) else None,
        }
        return config_from_args(args.upstream, args.listen, exposure=exposure, rules=getattr(args, "rules", None),
                                chaos=getattr(args, "chaos", False) or None, **telemetry, **logs)
    raise ConfigError("give --config FILE, or --upstream HOST:PORT and --listen HOST:PORT")

"""What one small request costs kproxy, counted rather than timed, so that two versions can be
compared on a machine whose load moves every timing: instructions (valgrind's callgrind) and system
calls (perf's syscall tracepoints) per request, for this tree and, side by side, another
(``--baseline DIR``).

Run from the repository root:  ``.venv/bin/python bench/per_request.py [--baseline DIR] [--n 2000]``
(``--no-callgrind`` or ``--no-syscalls`` leaves a part out; ``--kinds metadata,produce,heartbeat,produce-v11``; ``--metrics``
runs kproxy with an admin listener, so that every request is also recorded in its metrics; ``--traffic-log``
also writes the traffic log, every request, or with ``--traffic-log-sample R`` that share of them (kproxy then
runs from a configuration file holding the same settings); ``--rules FILE`` loads a rule file, as production does).

One tansu broker (memory storage); kproxy (``python -m kproxy run``, log level WARNING) in front.

- **Instructions** (user space, the whole kproxy process): kproxy runs under ``valgrind
  --tool=callgrind`` with collection off; after a warm-up, collection is switched on
  (``callgrind_control``) for exactly ``--n`` requests sent one after another on one connection, each
  waiting for its answer, then the counters are dumped. Instructions/request is the dump's total over
  ``--n``. The same requests in the same order give the same count within a fraction of a percent,
  whatever else the machine runs; the kernel's share (the system calls themselves) is not in it.
- **System calls** under concurrency: kproxy runs normally; ``--clients`` connections each keep one
  request in flight (bench/small_requests.py) while ``perf stat`` counts kproxy's system calls by
  kind. Per request, they say how many receives, sends and event-loop waits each request costs;
  they depend a little on how requests bunch up, so the figure is the median of ``--rounds``.

The loops are those of bench/small_requests.py: Metadata v12 with no topics, Heartbeat v4, Produce v9 with
acks=1 and one 100-byte record, Fetch v12 answered with one batch of one 100-byte record (and the same in
v16, by topic id), and an empty Fetch v12 long poll (max_wait_ms 0, from past the end).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from small_requests import KINDS, request_for, run_load  # noqa: E402

from kproxy.tansu import Tansu, broker_answers, free_port  # noqa: E402

HOST = "127.0.0.1"
_I32 = struct.Struct(">i")
# System calls counted, by the tracepoint's name; the rest are summed as "other".
SYSCALLS = ("recvfrom", "sendto", "sendmsg", "epoll_wait", "epoll_ctl")


# kproxy's own options for every run (``--metrics`` adds an admin listener: metrics are recorded per
# request only when one is configured).
EXTRA_ARGS: list[str] = []
# ``--traffic-log-sample``: kproxy's traffic_log section, written with the other settings into a
# configuration file for each run (the quick options have no sample); empty: quick options only.
TRAFFIC_LOG: dict[str, object] = {}
# ``--no-loop-lag``: kproxy started with the loop-lag probe (a timer while an admin listener is on: 10
# wake-ups a second, 200 while the loop is held or in trees before) asleep, so that only per-request
# work is counted; a bench-only patch, the same for
# both trees.
NO_LOOP_LAG: list[bool] = [False]
# The admin port each started kproxy was given, by the name it was started under.
ADMIN_PORTS: dict[str, int] = {}
_WITHOUT_LOOP_LAG = (
    "import sys, trio\n"
    "from kproxy.server import process\n"
    "async def _asleep(self, period=0.005):\n"
    "    await trio.sleep_forever()\n"
    "process.SharedParts.watch_loop_lag = _asleep\n"
    "from kproxy.cli import main\n"
    "sys.exit(main())\n")


def start_kproxy(bp: int, tree: Path | None, wrap: list[str], workdir: Path, name: str,
                 timeout: float) -> tuple[subprocess.Popen[bytes], int]:
    kp = free_port()
    admin = free_port()
    while kp <= admin <= kp + 64:   # the broker ports follow the listener's (and nothing holds them yet)
        admin = free_port()
    env = dict(os.environ)
    if tree is not None:
        # As bench/proxy.py's kproxy-base: the other tree first on the path, the working directory off it.
        env.update(PYTHONPATH=str(tree), PYTHONSAFEPATH="1")
    ADMIN_PORTS[name] = admin
    entry = ["-c", _WITHOUT_LOOP_LAG] if NO_LOOP_LAG[0] else ["-m", "kproxy"]
    extra = [a.replace("{admin_port}", str(admin)) for a in EXTRA_ARGS]
    if TRAFFIC_LOG:
        settings = config_settings(f"{HOST}:{bp}", f"{HOST}:{kp}", extra)
        config = workdir / f"{name}.yaml"
        config.write_text(json.dumps(settings))        # JSON is YAML
        options = ["--config", str(config)]
    else:
        options = ["--upstream", f"{HOST}:{bp}", "--listen", f"{HOST}:{kp}", *extra]
    argv = [*wrap, sys.executable, *entry, "run", *options, "--log-level", "WARNING"]
    with open(workdir / f"{name}.log", "wb") as log:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while not broker_answers(HOST, kp, timeout=5.0):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{name} did not start: see {workdir / f'{name}.log'}\n"
                               + (workdir / f"{name}.log").read_text(errors="replace")[-3000:])
        time.sleep(0.2)
    return proc, kp


def config_settings(upstream: str, listen: str, options: list[str]) -> dict[str, object]:
    """The configuration file's settings for the quick ``options`` (``--admin``, ``--rules``), with
    ``TRAFFIC_LOG`` as its traffic_log section."""
    settings: dict[str, object] = {"listen": listen, "upstream": {"bootstrap_servers": upstream},
                                   "traffic_log": TRAFFIC_LOG}
    flags = dict(zip(options[::2], options[1::2], strict=True))
    if "--admin" in flags:
        settings["admin"] = {"listen": flags.pop("--admin")}
    if "--rules" in flags:
        settings["rules"] = [flags.pop("--rules")]
    flags.pop("--traffic-log", None)
    assert not flags, f"no configuration setting for {sorted(flags)}"
    return settings


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def sequential(port: int, request: bytes, n: int) -> None:
    """``n`` round trips on one connection, one request at a time."""
    with socket.create_connection((HOST, port), timeout=60) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray()
        for _ in range(n):
            s.sendall(request)
            while True:
                if len(buf) >= 4:
                    size = _I32.unpack_from(buf, 0)[0]
                    if len(buf) >= 4 + size:
                        del buf[: 4 + size]
                        break
                chunk = s.recv(65536)
                if not chunk:
                    raise ConnectionError("kproxy closed the connection")
                buf += chunk


def callgrind_per_request(bp: int, tree: Path | None, name: str, kind: str, topic: str | None, n: int,
                          workdir: Path, idle: float = 0.0) -> tuple[float, float | None]:
    """(instructions per request; the same less what kproxy spends by the clock, not by the request,
    when ``idle`` seconds of an idle process were counted too, else None)."""
    out = workdir / f"callgrind.{name}.{kind}.out"
    wrap = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]
    proc, kp = start_kproxy(bp, tree, wrap, workdir, f"{name}-callgrind-{kind}", timeout=300)
    try:
        request = request_for(kind, topic)
        sequential(kp, request, 200)           # warm-up: codecs built, the answer memo filled
        pid = proc.pid                         # valgrind runs the program in its own process
        subprocess.run(["callgrind_control", "-i", "on", str(pid)], check=True, capture_output=True)
        began = time.monotonic()
        sequential(kp, request, n)
        busy = time.monotonic() - began
        subprocess.run(["callgrind_control", "-d", str(pid)], check=True, capture_output=True)
        if idle > 0:
            # Timers (the loop-lag probe's wake-ups with metrics on, the rule files' poll) run by
            # the clock; under callgrind's slowdown they land on every request.
            began = time.monotonic()
            time.sleep(idle)
            subprocess.run(["callgrind_control", "-d", str(pid)], check=True, capture_output=True)
            idle_s = time.monotonic() - began
    finally:
        stop(proc)
    # The dump asked for (-d) is OUT.1 and holds the n requests (and the idle loop's few instructions
    # until the dump); OUT, written at exit, holds the shutdown.
    counts = [int(line.split()[1]) for line in Path(f"{out}.1").read_text(errors="replace").splitlines()
              if line.startswith("summary:")]
    if not counts:
        raise RuntimeError(f"no callgrind summary in {out}.1")
    if idle <= 0:
        return sum(counts) / n, None
    quiet = [int(line.split()[1]) for line in Path(f"{out}.2").read_text(errors="replace").splitlines()
             if line.startswith("summary:")]
    per_second = sum(quiet) / idle_s
    return sum(counts) / n, max(0.0, sum(counts) - per_second * busy) / n


def syscalls_per_request(bp: int, tree: Path | None, name: str, kind: str, topic: str | None, clients: int,
                         seconds: float, workdir: Path) -> dict[str, float]:
    proc, kp = start_kproxy(bp, tree, [], workdir, f"{name}-syscalls-{kind}", timeout=60)
    try:
        run_load(f"{HOST}:{kp}", clients, 1.0, warmup=0.5, kind=kind, topic=topic)
        events = ",".join(["raw_syscalls:sys_enter", *(f"syscalls:sys_enter_{c}" for c in SYSCALLS)])
        out = workdir / f"perf.{name}.{kind}.txt"
        perf = subprocess.Popen(["perf", "stat", "-x", ",", "-e", events, "-p", str(proc.pid), "-o", str(out)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.2)
        res = run_load(f"{HOST}:{kp}", clients, seconds, warmup=0.0, kind=kind, topic=topic)
        perf.send_signal(signal.SIGINT)
        perf.wait(30)
    finally:
        stop(proc)
    got: dict[str, float] = {}
    for line in out.read_text().splitlines():
        parts = line.split(",")
        if len(parts) > 2 and parts[0].strip().isdigit():
            event = parts[2]
            key = "all" if event.startswith("raw_syscalls") else event.rsplit("sys_enter_", 1)[1]
            got[key] = int(parts[0]) / res.answers_total
    got["other"] = got.get("all", 0.0) - sum(got.get(c, 0.0) for c in SYSCALLS)
    got["req/s"] = res.requests_per_s
    return got



def ir_table(ir: dict, kinds: Iterable[str], trees: Collection[str], width: int = 16) -> None:
    """Instructions per request by loop and tree, and kproxy's over the baseline's when both ran."""
    hdr = f"{'loop':<12}" + "".join(f"{name:>{width}}" for name in trees) + (f"{'kproxy/base':>14}" if len(trees) > 1 else "")
    print(hdr)
    print("-" * len(hdr))
    for kind in kinds:
        row = f"{kind:<12}" + "".join(f"{ir[(kind, name)]:>{width},.0f}" for name in trees)
        if len(trees) > 1:
            row += f"{ir[(kind, 'kproxy')] / ir[(kind, 'kproxy-base')]:>13.3f}x"
        print(row)

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path, metavar="DIR",
                    help="also measure the kproxy in DIR/kproxy (git archive COMMIT kproxy | tar -x -C DIR, "
                         "plus the built kproxy/protocol/_accel*.so)")
    ap.add_argument("--kinds", default="metadata,produce,heartbeat",
                    help=f"any of {', '.join(KINDS)}, comma-separated (default: metadata,produce,heartbeat)")
    ap.add_argument("--n", type=int, default=2000, help="requests counted under callgrind (default 2000)")
    ap.add_argument("--clients", type=int, default=100, help="connections for the system-call count (default 100)")
    ap.add_argument("--seconds", type=float, default=4.0, help="seconds per system-call count (default 4)")
    ap.add_argument("--rounds", type=int, default=3, help="system-call counts per tree and loop (default 3)")
    ap.add_argument("--metrics", action="store_true",
                    help="run kproxy with an admin listener, so that each request is recorded in its metrics")
    ap.add_argument("--traffic-log", action="store_true",
                    help="also write the traffic log (every request) into a temporary directory")
    ap.add_argument("--traffic-log-sample", type=float, metavar="R",
                    help="with --traffic-log: the share of requests logged (traffic_log.sample's default)")
    ap.add_argument("--rules", type=Path, metavar="FILE", help="run kproxy with this rule file (e.g. "
                    "bench/rules_produce_fetch.yaml: rules that address only Produce and Fetch)")
    ap.add_argument("--idle", type=float, default=0.0, metavar="S",
                    help="also count S seconds of the idle process under callgrind, and print the figures less "
                         "what kproxy spends by the clock rather than by the request (timers)")
    ap.add_argument("--no-loop-lag", action="store_true",
                    help="keep kproxy's loop-lag probe asleep (with --metrics it wakes 10 times a second on a quiet "
                         "loop, and 200 while the loop is held or, in trees before, always; callgrind's slowdown "
                         "puts those wake-ups on the requests)")
    ap.add_argument("--no-callgrind", action="store_true")
    ap.add_argument("--no-syscalls", action="store_true")
    args = ap.parse_args(argv)
    kinds = tuple(args.kinds.split(","))
    if args.metrics:
        EXTRA_ARGS[:] = ["--admin", HOST + ":{admin_port}"]
    if args.rules is not None:
        EXTRA_ARGS.extend(["--rules", str(args.rules.resolve())])
    NO_LOOP_LAG[0] = args.no_loop_lag
    if args.traffic_log_sample is not None and not (args.traffic_log and 0 <= args.traffic_log_sample <= 1):
        ap.error("--traffic-log-sample: a share from 0 to 1, with --traffic-log")
    if set(kinds) - set(KINDS):
        ap.error(f"--kinds: one or more of {', '.join(KINDS)}")
    trees: dict[str, Path | None] = {"kproxy": None}
    if args.baseline is not None:
        if not (args.baseline / "kproxy" / "__init__.py").is_file():
            ap.error(f"--baseline {args.baseline}: no kproxy package there")
        trees["kproxy-base"] = args.baseline.resolve()
    if not args.no_callgrind and shutil.which("valgrind") is None:
        ap.error("valgrind is not installed (Debian: apt-get install valgrind), or pass --no-callgrind")
    if not args.no_syscalls and shutil.which("perf") is None:
        ap.error("perf is not installed (Debian: apt-get install linux-perf), or pass --no-syscalls")
    load_before = "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    ir: dict[tuple[str, str], float] = {}
    ir_less: dict[tuple[str, str], float] = {}
    sc: dict[tuple[str, str], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="kproxy-per-request-") as tmp, Tansu(port=free_port()) as broker:
        workdir = Path(tmp)
        if args.traffic_log:
            EXTRA_ARGS.extend(["--traffic-log", str(workdir / "traffic")])
            if args.traffic_log_sample is not None:
                TRAFFIC_LOG.update(dir=str(workdir / "traffic"), sample={"default": args.traffic_log_sample})
        # The produce loops' topic, and the fetch loops' (one batch of one record at offset 0 of
        # partition 0, written first; the produce loops write elsewhere, so the answer stays small).
        topics = {kind: "per-request-fetch" if kind.startswith("fetch") else "per-request"
                  for kind in kinds if kind in ("produce", "produce-v11", "fetch", "fetch-empty", "fetch-v16")}
        if topics:
            from confluent_kafka.admin import AdminClient, NewTopic

            admin = AdminClient({"bootstrap.servers": f"{HOST}:{broker.port}"})
            for name in set(topics.values()):
                admin.create_topics([NewTopic(name, num_partitions=1, replication_factor=1)])[name].result(30)
            del admin               # its broker connection would log the broker's shutdown
            if "per-request-fetch" in topics.values():
                sequential(broker.port, request_for("produce", "per-request-fetch"), 1)
            if "fetch-v16" in topics:       # it names the topic by id
                from big_fetch import topic_id_of

                with socket.create_connection((HOST, broker.port), timeout=30) as s:
                    topics["fetch-v16"] = str(topic_id_of(s, "per-request-fetch"))
        for kind in kinds:
            topic = topics.get(kind)
            if not args.no_callgrind:
                for name, tree in trees.items():
                    ir[(kind, name)], less = callgrind_per_request(broker.port, tree, name, kind, topic, args.n,
                                                                   workdir, args.idle)
                    if less is not None:
                        ir_less[(kind, name)] = less
                    print(f"  {kind:<12}{name:<13}{ir[(kind, name)]:>12,.0f} instructions/request"
                          + (f" ({less:,.0f} less the timers)" if less is not None else ""),
                          file=sys.stderr, flush=True)
            if not args.no_syscalls:
                for r in range(args.rounds):
                    for name, tree in (list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]):
                        got = syscalls_per_request(broker.port, tree, name, kind, topic, args.clients,
                                                   args.seconds, workdir)
                        sc.setdefault((kind, name), []).append(got)
                        print(f"  {kind:<9}{name:<13} round {r + 1}: {got['all']:.2f} system calls/request "
                              f"({got['req/s']:,.0f} req/s)", file=sys.stderr, flush=True)
    print(f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}; {load_before} before, "
          "load average {:.2f} {:.2f} {:.2f} after".format(*os.getloadavg())
          + ("; kproxy with an admin listener (metrics)" if args.metrics else "")
          + ("; with the traffic log" if args.traffic_log else "")
          + (f" sampled at {args.traffic_log_sample:g}" if args.traffic_log and args.traffic_log_sample is not None
             else "")
          + ("; the loop-lag probe asleep" if args.no_loop_lag else "")
          + (f"; rules {args.rules}" if args.rules is not None else ""))
    if ir:
        print()
        print(f"Instructions per request in kproxy's process (callgrind, user space), {args.n:,} requests one "
              "after another on one connection")
        ir_table(ir, kinds, trees)
    if ir_less:
        print()
        print(f"The same, less what the idle process spends per second ({args.idle:g} s counted) times the "
              "loop's duration")
        ir_table(ir_less, kinds, trees)
    if sc:
        print()
        print(f"System calls per request in kproxy's process (perf), {args.clients} connections each keeping one "
              f"request in flight, medians of {args.rounds} round(s)")
        cols = ("all", *SYSCALLS, "other")
        hdr = f"{'loop':<10}{'tree':<14}" + "".join(f"{c:>12}" for c in cols)
        print(hdr)
        print("-" * len(hdr))
        for kind in kinds:
            for name in trees:
                runs = sc[(kind, name)]
                print(f"{kind:<10}{name:<14}" + "".join(f"{statistics.median(r[c] for r in runs):>12.2f}" for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())

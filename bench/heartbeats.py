"""Idle consumer groups: what kproxy's CPU is when many connections each send only a Heartbeat every
few seconds (a consumer between polls), the load a gateway carries for every idle group member.

``--connections`` connections (default 1,000) each send Heartbeat v4 for a group of their own every
``--period`` seconds (default 3), spread evenly over the period, and wait for the answer (tansu knows
no such group and says so; it is still a full round trip through kproxy). After the connections open
and ``--warmup-periods`` periods of heartbeats (default 3: kproxy hands a connection to its lane after
three requests in a row it would relay, ``LANE_AFTER``, so a consumer that has heartbeated three
times is in the steady state it keeps for the rest of its life), kproxy's own CPU time (user + system, from /proc) is read over
``--seconds`` (default 30). The same connections sending nothing give the floor (timers, the
watchdog); the difference over the heartbeats answered is the CPU per heartbeat. With ``--metrics``,
the table also says how often kproxy's loop-lag timer fired (from its /metrics) in either phase: 10
times a second on a quiet loop, 200 while the loop is being held (a loaded machine holds it too).

With ``--instructions``, instructions are counted instead: kproxy runs under valgrind's callgrind,
every connection heartbeats once (so each has its broker connection, as a consumer's has), then the
instructions kproxy executes over ``--seconds`` with every connection quiet are counted, and then
over ``--seconds`` more with the connections heartbeating every ``--instructions-period`` seconds
(default 60: callgrind slows kproxy some 50 times, and at 3 s it could not keep up, so heartbeats
would arrive together and share wake-ups; at 60 s each still arrives alone, as at 3 s without
callgrind). The beating phase less the quiet one, over the heartbeats answered, is the instructions
per heartbeat at a low rate (compare ``bench/per_request.py --kinds heartbeat``, the same request back
to back on one connection). Timers fire by the wall clock, so the count per second does not move
with the machine's load.

With ``--syscalls``, ``perf stat`` also counts kproxy's system calls, by kind, over the heartbeating
phase: per heartbeat, they say how many receives, sends and event-loop waits and re-arms each costs.

Run from the repository root:  ``.venv/bin/python bench/heartbeats.py [--connections 1000]
[--period 3] [--seconds 30] [--baseline DIR] [--instructions [--instructions-period 60]] [--syscalls]`` (``--baseline DIR``: also the kproxy in
DIR/kproxy, as bench/per_request.py takes it).
"""

from __future__ import annotations

import argparse
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import per_request  # noqa: E402
from big_fetch import proc_kib  # noqa: E402
from per_request import HOST, start_kproxy, stop  # noqa: E402
from small_requests import heartbeat_v4_request  # noqa: E402

from kproxy.tansu import Tansu, free_port  # noqa: E402

_I32 = struct.Struct(">i")
_TICK = os.sysconf("SC_CLK_TCK")


def heartbeat_request(correlation_id: int, group: str) -> bytes:
    return heartbeat_v4_request(correlation_id, group)


def cpu_times(pid: int) -> tuple[float, float]:
    """The process's user and system CPU seconds so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / _TICK, int(fields[12]) / _TICK       # utime, stime


def cpu_seconds(pid: int) -> float:
    return sum(cpu_times(pid))


class Group:
    """Connections that each heartbeat every ``period`` seconds (``send`` False: only held open)."""

    def __init__(self, port: int, n: int, period: float) -> None:
        self.sel = selectors.DefaultSelector()
        self.period = period
        self.socks: list[socket.socket] = []
        self.requests = []
        for i in range(n):
            s = socket.create_connection((HOST, port), timeout=30)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.setblocking(False)
            self.socks.append(s)
            self.requests.append(heartbeat_request(1, f"idle-group-{i}"))
            self.sel.register(s, selectors.EVENT_READ, i)
        self.bufs = [bytearray() for _ in range(n)]
        self.answers = 0

    def run(self, seconds: float, send: bool) -> int:
        """Heartbeat (or only read) for ``seconds``; the heartbeats answered meanwhile."""
        n = len(self.socks)
        start = time.monotonic()
        due = [start + self.period * i / n for i in range(n)]
        waiting = [False] * n
        answered = 0
        end = start + seconds
        nxt = 0
        while True:
            now = time.monotonic()
            if now >= end:
                self.answers += answered
                return answered
            if send:
                # Connections in order of their slot: the next due is always the oldest.
                for _ in range(n):
                    i = nxt
                    if due[i] > now:
                        break
                    if not waiting[i]:
                        self.socks[i].sendall(self.requests[i])
                        waiting[i] = True
                    due[i] += self.period
                    nxt = (nxt + 1) % n
            timeout = max(0.0, min(end, due[nxt] if send else end) - time.monotonic())
            for key, _ in self.sel.select(timeout):
                i = key.data
                chunk = self.socks[i].recv(65536)
                if not chunk:
                    raise ConnectionError("kproxy closed a connection")
                buf = self.bufs[i]
                buf += chunk
                while len(buf) >= 4 and len(buf) >= 4 + _I32.unpack_from(buf, 0)[0]:
                    del buf[: 4 + _I32.unpack_from(buf, 0)[0]]
                    waiting[i] = False
                    answered += 1

    def close(self) -> None:
        for s in self.socks:
            s.close()
        self.sel.close()


def measure(bp: int, tree: Path | None, name: str, args: argparse.Namespace, workdir: Path) -> dict[str, float]:
    proc, kp = start_kproxy(bp, tree, [], workdir, name, timeout=60)
    try:
        group = Group(kp, args.connections, args.period)
        try:
            group.run(args.period * args.warmup_periods, send=True)     # warm-up: each connection N times
            lag0 = lag_samples(name) if args.metrics else 0
            c0 = cpu_seconds(proc.pid)
            t0 = time.monotonic()
            group.run(args.seconds, send=False)
            idle = (cpu_seconds(proc.pid) - c0) / (time.monotonic() - t0)
            # Memory with every connection laned and quiet: resident, and allocated (VmData counts
            # heap a connection reserved but never touched, which VmRSS does not).
            rss_kib, data_kib = proc_kib(proc.pid, "VmRSS"), proc_kib(proc.pid, "VmData")
            lag1 = lag_samples(name) if args.metrics else 0
            lag_quiet = (lag1 - lag0) / (time.monotonic() - t0)
            perf = syscalls_start(proc.pid, workdir / f"perf.{name}.txt") if args.syscalls else None
            u0, s0 = cpu_times(proc.pid)
            t0 = time.monotonic()
            answered = group.run(args.seconds, send=True)
            elapsed = time.monotonic() - t0
            u1, s1 = cpu_times(proc.pid)
            calls = syscalls_read(perf, workdir / f"perf.{name}.txt") if perf is not None else {}
            lag_beating = ((lag_samples(name) if args.metrics else 0) - lag1) / elapsed
            busy = (u1 + s1 - u0 - s0) / elapsed
            system = (s1 - s0) / elapsed
        finally:
            group.close()
    finally:
        stop(proc)
    rate = answered / elapsed
    got = {"rss_kib": rss_kib, "data_kib": data_kib, "idle": idle, "busy": busy, "system": system, "rate": rate, "lag_quiet": lag_quiet, "lag_beating": lag_beating,
           "per_request": (busy - idle) / rate if rate else float("nan")}
    # perf counts a little longer than the phase (its start and stop): per heartbeat, a slight overstatement.
    got.update({f"calls_{k}": v / answered for k, v in calls.items()} if answered else {})
    return got


def lag_samples(name: str) -> int:
    """How many times kproxy's loop-lag timer has fired (its histogram's count, from /metrics)."""
    with urllib.request.urlopen(f"http://{HOST}:{per_request.ADMIN_PORTS[name]}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("kproxy_event_loop_lag_seconds_count"):
                return int(float(line.rsplit(" ", 1)[1]))
    raise RuntimeError("no kproxy_event_loop_lag_seconds_count in /metrics")


def counted_instructions(bp: int, tree: Path | None, name: str, args: argparse.Namespace,
                         workdir: Path) -> dict[str, float]:
    """kproxy's instructions per second holding ``--connections`` quiet connections, and per second and
    per heartbeat with them heartbeating every ``--instructions-period`` seconds (callgrind)."""
    out = workdir / f"callgrind.{name}.out"
    wrap = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]
    proc, kp = start_kproxy(bp, tree, wrap, workdir, f"{name}-callgrind", timeout=300)
    try:
        group = Group(kp, args.connections, args.period)
        try:
            # Every connection once (spread over a period), and every answer in, before counting:
            # under callgrind kproxy takes a while to catch up, and none of that may be counted. A
            # little over the period, so that the last connection's turn (due just before its end)
            # is not missed when a wait overshoots.
            group.run(args.period * 1.2, send=True)
            deadline = time.monotonic() + 600
            while group.answers < args.connections and time.monotonic() < deadline:
                group.run(1.0, send=False)
            if group.answers < args.connections:
                raise RuntimeError(f"{name}: {group.answers} of {args.connections} heartbeats answered")
            group.run(5.0, send=False)
            subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], check=True, capture_output=True)
            t0 = time.monotonic()
            group.run(args.seconds, send=False)
            subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True)
            quiet_s = time.monotonic() - t0
            # Each dump holds what ran since the one before: OUT.1 the quiet phase, OUT.2 the beating.
            group.period = args.instructions_period
            t0 = time.monotonic()
            answered = group.run(args.seconds, send=True)
            subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True)
            beating_s = time.monotonic() - t0
        finally:
            group.close()
    finally:
        stop(proc)

    def total(path: Path) -> int:
        return sum(int(line.split()[1]) for line in path.read_text(errors="replace").splitlines()
                   if line.startswith("summary:"))

    quiet = total(Path(f"{out}.1")) / quiet_s
    beating = total(Path(f"{out}.2")) / beating_s
    rate = answered / beating_s
    return {"quiet": quiet, "beating": beating, "rate": rate,
            "per_heartbeat": (beating - quiet) / rate if rate else float("nan")}


def syscalls_start(pid: int, out: Path) -> subprocess.Popen[bytes]:
    """``perf stat`` counting ``pid``'s system calls, all and by kind, until it is sent SIGINT."""
    events = ",".join(["raw_syscalls:sys_enter", *(f"syscalls:sys_enter_{c}" for c in per_request.SYSCALLS)])
    perf = subprocess.Popen(["perf", "stat", "-x", ",", "-e", events, "-p", str(pid), "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.2)
    return perf


def syscalls_read(perf: subprocess.Popen[bytes], out: Path) -> dict[str, int]:
    perf.send_signal(signal.SIGINT)
    perf.wait(30)
    got: dict[str, int] = {}
    for line in out.read_text().splitlines():
        parts = line.split(",")
        if len(parts) > 2 and parts[0].strip().isdigit():
            event = parts[2]
            got["all" if event.startswith("raw_syscalls") else event.rsplit("sys_enter_", 1)[1]] = int(parts[0])
    got["other"] = got.get("all", 0) - sum(got.get(c, 0) for c in per_request.SYSCALLS)
    return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connections", type=int, default=1000)
    ap.add_argument("--period", type=float, default=3.0, help="seconds between one connection's heartbeats")
    ap.add_argument("--seconds", type=float, default=30.0, help="seconds measured, idle and heartbeating")
    ap.add_argument("--warmup-periods", type=int, default=3, metavar="N",
                    help="heartbeats each connection sends before anything is measured (default 3: the "
                         "lane takes a connection after three)")
    ap.add_argument("--baseline", type=Path, metavar="DIR", help="also measure the kproxy in DIR/kproxy")
    ap.add_argument("--instructions", action="store_true",
                    help="count kproxy's instructions (callgrind): per second quiet, and per heartbeat")
    ap.add_argument("--instructions-period", type=float, default=60.0, metavar="S",
                    help="with --instructions: seconds between one connection's heartbeats under callgrind "
                         "(default 60)")
    ap.add_argument("--keep", type=Path, metavar="DIR",
                    help="with --instructions: keep callgrind's files in DIR (OUT.1 quiet, OUT.2 heartbeating; "
                         "read them with callgrind_annotate)")
    ap.add_argument("--syscalls", action="store_true",
                    help="count kproxy's system calls per heartbeat while heartbeating (perf stat)")
    ap.add_argument("--metrics", action="store_true", help="kproxy with an admin listener (metrics on)")
    ap.add_argument("--rules", type=Path, metavar="FILE", help="kproxy with this rule file")
    args = ap.parse_args(argv)
    if args.metrics:
        per_request.EXTRA_ARGS.extend(["--admin", HOST + ":{admin_port}"])
    if args.rules is not None:
        per_request.EXTRA_ARGS.extend(["--rules", str(args.rules.resolve())])
    trees: dict[str, Path | None] = {"kproxy": None}
    if args.baseline is not None:
        trees["kproxy-base"] = args.baseline.resolve()
    load_before = "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    if args.instructions:
        counted = {}
        with tempfile.TemporaryDirectory(prefix="kproxy-heartbeats-") as tmp, Tansu(port=free_port()) as broker:
            for name, tree in trees.items():
                counted[name] = counted_instructions(broker.port, tree, name, args, args.keep or Path(tmp))
                print(f"  {name}: {counted[name]}", file=sys.stderr, flush=True)
        print(f"{args.connections:,} connections (each heartbeated once), {args.seconds:g} s counted quiet, then "
              f"{args.seconds:g} s with one Heartbeat each every {args.instructions_period:g} s: kproxy's "
              "instructions (callgrind, user space)")
        hdr = f"{'tree':<14}{'quiet /s':>16}{'beating /s':>16}{'heartbeats/s':>14}{'per heartbeat':>16}"
        print(hdr)
        print("-" * len(hdr))
        for name, c in counted.items():
            print(f"{name:<14}{c['quiet']:>16,.0f}{c['beating']:>16,.0f}{c['rate']:>14,.1f}{c['per_heartbeat']:>16,.0f}")
        if len(counted) > 1:
            print(f"per heartbeat, kproxy/base: {counted['kproxy']['per_heartbeat'] / counted['kproxy-base']['per_heartbeat']:.3f}x")
        return 0
    got = {}
    with tempfile.TemporaryDirectory(prefix="kproxy-heartbeats-") as tmp, Tansu(port=free_port()) as broker:
        for name, tree in trees.items():
            got[name] = measure(broker.port, tree, name, args, Path(tmp))
            print(f"  {name}: {got[name]}", file=sys.stderr, flush=True)
    print(f"{os.cpu_count()} CPUs; {load_before} before, load average "
          "{:.2f} {:.2f} {:.2f} after".format(*os.getloadavg()))
    print(f"{args.connections:,} connections, one Heartbeat each every {args.period:g} s, {args.seconds:g} s measured")
    hdr = (f"{'tree':<14}{'heartbeats/s':>14}{'CPU idle':>12}{'CPU beating':>14}{'of it system':>14}"
           f"{'per heartbeat':>16}" + (f"{'lag timer/s quiet':>19}{'beating':>9}" if args.metrics else ""))
    print(hdr)
    print("-" * len(hdr))
    for name, g in got.items():
        print(f"{name:<14}{g['rate']:>14,.0f}{g['idle'] * 100:>11.2f}%{g['busy'] * 100:>13.2f}%"
              f"{g['system'] * 100:>13.2f}%"
              f"{g['per_request'] * 1e6:>13.0f} us"
              + (f"{g['lag_quiet']:>19.1f}{g['lag_beating']:>9.1f}" if args.metrics else ""))
    print("(CPU: kproxy's user + system time as a share of one core)")
    print(f"{'tree':<14}{'RSS quiet':>14}{'VmData quiet':>14}   (every connection laned and silent)")
    for name, g in got.items():
        print(f"{name:<14}{g['rss_kib'] / 1024:>10.1f} MiB{g['data_kib'] / 1024:>10.1f} MiB")
    if args.syscalls:
        kinds = ("all", *per_request.SYSCALLS, "other")
        print("System calls per heartbeat while heartbeating (perf stat)")
        hdr = f"{'tree':<14}" + "".join(f"{k:>12}" for k in kinds)
        print(hdr)
        print("-" * len(hdr))
        for name, g in got.items():
            print(f"{name:<14}" + "".join(f"{g.get('calls_' + k, float('nan')):>12.2f}" for k in kinds))
    return 0


if __name__ == "__main__":
    sys.exit(main())

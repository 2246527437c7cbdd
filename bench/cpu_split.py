"""Where the CPU of a small-request loop goes, per target: the broker's, the relay's, the load
generator's, and the cores left idle, each per answer, with context switches per answer.

bench/proxy.py reports requests per second and the relay's own CPU per request. On a machine whose
cores the broker, the relay and the load generator share, requests per second is close to the cores
divided by the sum of all three, so a relay can lose requests per second while spending no more CPU
than another: the broker or the load generator spent more behind it. This splits the sum. Targets
and brokers are bench/proxy.py's (a tansu of its own behind each relay target), the loops are
bench/small_requests.py's; each Produce run writes to a fresh topic.

Run from the repository root:
``.venv/bin/python bench/cpu_split.py --targets direct,kproxy,haproxy --kind metadata --rounds 3``
(``--kafka-proxy-bin PATH`` with ``kafka-proxy`` in the targets; ``--baseline DIR`` with
``kproxy-base``).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import proxy as bench_proxy  # bench/ is not a package: its directory is on the path
from small_requests import KINDS, run_load

FIGURES = ("requests_per_s", "p50_ms", "broker_us", "relay_us", "load_us", "total_us", "idle_cores",
           "broker_csw", "relay_csw", "load_csw")


def idle_seconds() -> float:
    """Idle and iowait time of the whole machine so far (/proc/stat's first line)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return (int(fields[4]) + int(fields[5])) / os.sysconf("SC_CLK_TCK")


def switches(pid: int) -> int:
    """Voluntary and involuntary context switches of every thread of ``pid``."""
    n = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/status") as f:
                for line in f:
                    if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                        n += int(line.split()[1])
        except OSError:
            pass        # a thread that ended meanwhile
    return n


def children() -> tuple[float, int]:
    """CPU seconds and context switches of this process's reaped children (the load generator's)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime, r.ru_nvcsw + r.ru_nivcsw


def one_run(b: bench_proxy.Bench, target: str, kind: str, clients: int, seconds: float) -> dict[str, float]:
    brokers = {c.name: c for c in b.children if c.name.startswith("tansu broker")}
    broker = brokers.get(f"tansu broker ({target})", brokers["tansu broker"])
    relay = b.proxies.get(target)
    admin = b.admins.get(target, b.admin)
    topic = f"split-{kind}-{uuid.uuid4().hex[:8]}" if kind.startswith("produce") else None
    if topic:
        bench_proxy.create_topic(admin, topic)

    def sample() -> tuple[float, ...]:
        load_cpu, load_csw = children()
        return (broker.tree_cpu_seconds(), relay.tree_cpu_seconds() if relay else 0.0, load_cpu,
                switches(broker.proc.pid), switches(relay.proc.pid) if relay else 0, load_csw,
                idle_seconds(), time.monotonic())

    before = sample()
    res = run_load(f"{bench_proxy.HOST}:{b.ports[target]}", clients, seconds, warmup=1.0, kind=kind, topic=topic)
    after = sample()
    if topic:
        bench_proxy.delete_topic(admin, topic)
    d = [a - s for a, s in zip(after, before, strict=True)]
    n = res.answers_total
    row = {"requests_per_s": res.requests_per_s, "p50_ms": res.p50_ms,
           "broker_us": d[0] / n * 1e6, "relay_us": d[1] / n * 1e6, "load_us": d[2] / n * 1e6,
           "idle_cores": d[6] / d[7], "broker_csw": d[3] / n, "relay_csw": d[4] / n, "load_csw": d[5] / n}
    row["total_us"] = row["broker_us"] + row["relay_us"] + row["load_us"]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", default="direct,kproxy,haproxy",
                    help="comma-separated: direct, kproxy, haproxy, kafka-proxy, kproxy-base, ...")
    ap.add_argument("--kind", choices=KINDS, default="metadata")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--seconds", type=float, default=5.0, help="seconds per run")
    ap.add_argument("--baseline", type=Path, help="the tree behind kproxy-base (see bench/proxy.py)")
    ap.add_argument("--kafka-proxy-bin", type=Path, default=os.environ.get("KAFKA_PROXY_BIN"))
    a = ap.parse_args()
    targets = tuple(a.targets.split(","))
    if bench_proxy.BASELINE in targets and a.baseline is None:
        ap.error("kproxy-base needs --baseline DIR")
    if bench_proxy.KAFKA_PROXY in targets and a.kafka_proxy_bin is None:
        ap.error("kafka-proxy needs --kafka-proxy-bin PATH")
    args = argparse.Namespace(broker="tansu", targets=targets, profile_kproxy=None, shared_broker=False,
                              baseline=a.baseline.resolve() if a.baseline else None,
                              kafka_proxy_bin=a.kafka_proxy_bin.resolve() if a.kafka_proxy_bin else None)
    with tempfile.TemporaryDirectory(prefix="kproxy-split-") as tmp:
        b = bench_proxy.Bench(args, Path(tmp))
        rows: dict[str, list[dict[str, float]]] = {}
        load_before = bench_proxy._load()
        try:
            b.start()
            for r in range(a.rounds):
                for t in targets[r % len(targets):] + targets[: r % len(targets)]:
                    b.check_alive()
                    row = one_run(b, t, a.kind, a.clients, a.seconds)
                    rows.setdefault(t, []).append(row)
                    print(f"  round {r + 1}/{a.rounds}  {t:<12} " + "  ".join(f"{k} {row[k]:.1f}" for k in FIGURES),
                          file=sys.stderr, flush=True)
        finally:
            b.stop()
    print(f"{a.kind} loop, {a.clients} connections, {a.rounds} interleaved rounds of {a.seconds:g} s, medians; "
          f"{os.cpu_count()} CPUs; {load_before} before, {bench_proxy._load()} after")
    print("per answer: broker, relay and load generator CPU (us), context switches; idle cores over the run")
    print(f"{'target':<12}{'req/s':>9}{'p50 ms':>8}{'broker':>8}{'relay':>7}{'load':>7}{'sum':>7}{'idle':>6}"
          f"{'brk csw':>9}{'rly csw':>9}{'load csw':>9}")
    for t, rs in rows.items():
        m = {k: statistics.median(r[k] for r in rs) for k in FIGURES}
        print(f"{t:<12}{m['requests_per_s']:>9,.0f}{m['p50_ms']:>8.2f}{m['broker_us']:>8.1f}{m['relay_us']:>7.1f}"
              f"{m['load_us']:>7.1f}{m['total_us']:>7.1f}{m['idle_cores']:>6.2f}{m['broker_csw']:>9.2f}"
              f"{m['relay_csw']:>9.2f}{m['load_csw']:>9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

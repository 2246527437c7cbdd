"""Aggregate throughput with more than one kproxy worker process: 8 concurrent producers through
``workers: 1`` and ``workers: 2``, and direct, side by side.

Run from the repository root:  ``.venv/bin/python bench/workers.py [--rounds 3] [--records 40000]
[--producers 8] [--size 1024]``

``--small``: the small-request loops instead (bench/small_requests.py: Metadata v12 with no topics,
and Produce v9 acks=1 with one 100-byte record), ``--clients`` connections (default 100) each keeping
one request in flight for ``--seconds`` (default 5) per round, through kproxy with ``--workers``
(default 1,2,4) worker processes, all running at once; the rounds interleave the worker counts (the
order rotating). Requests per second and kproxy's CPU per request (supervisor and workers summed,
over the warm-up and the measured seconds, divided by every answer) per worker count, medians and
min-max. ``.venv/bin/python bench/workers.py --small [--workers 1,2,4] [--rounds 5] [--clients 100]``

One tansu broker; for each round, each target in turn (order rotating): ``--producers`` processes,
each a confluent-kafka producer (acks=all) sending ``--records`` records of ``--size`` bytes to its own
partition; the figure is all records / the time until the last producer's last acknowledgement.
kproxy runs as ``kproxy run --config`` with ``exposure.node_id_base`` (which several workers need) and
its CPU time is summed over the supervisor and the workers.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from confluent_kafka import Producer  # noqa: E402
from confluent_kafka.admin import AdminClient, NewTopic  # noqa: E402

from kproxy.tansu import Tansu, broker_answers  # noqa: E402

sys.path.insert(0, str(REPO / "bench"))
from small_requests import run_load  # noqa: E402

from tests.e2e.proxied import free_port_block  # noqa: E402

HOST = "127.0.0.1"
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _produce(bootstrap: str, topic: str, partition: int, n: int, size: int, start: object, out: object) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "queue.buffering.max.messages": n + 1,
                  "queue.buffering.max.kbytes": 2_097_151})
    p.produce(topic, b"warm-up", partition=partition)
    p.flush(30)
    value = os.urandom(size)
    start.wait()  # type: ignore[attr-defined]
    for i in range(n):
        p.produce(topic, value, partition=partition)
        if i & 0x3FF == 0:
            p.poll(0)
    left = p.flush(120)
    out.send((left, time.perf_counter()))  # type: ignore[attr-defined]


def run(bootstrap: str, admin: AdminClient, producers: int, n: int, size: int,
        cpu: Any = None) -> tuple[float, float | None]:
    """Records per second of all producers together, and ``cpu()``'s growth per second meanwhile."""
    topic = f"workers-{uuid.uuid4().hex[:8]}"
    admin.create_topics([NewTopic(topic, num_partitions=producers, replication_factor=1)])[topic].result(30)
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Event()
    pipes = [ctx.Pipe(duplex=False) for _ in range(producers)]
    procs = [ctx.Process(target=_produce, args=(bootstrap, topic, i, n, size, start, send))
             for i, (_, send) in enumerate(pipes)]
    for p in procs:
        p.start()
    time.sleep(3.0)  # each producer's warm-up record (connections, metadata) before the clock starts
    c0 = cpu() if cpu is not None else 0.0
    t0 = time.perf_counter()
    start.set()
    ends = []
    for receive, _ in pipes:
        left, end = receive.recv()
        if left:
            raise RuntimeError(f"{left} records not acknowledged via {bootstrap}")
        ends.append(end)
    used = (cpu() - c0) / (max(ends) - t0) if cpu is not None else None
    for p in procs:
        p.join()
    with contextlib.suppress(Exception):  # best effort: it only frees the broker's memory
        admin.delete_topics([topic])[topic].result(30)
    return producers * n / (max(ends) - t0), used


def cpu_seconds(pid: int) -> float:
    """CPU time of ``pid`` and its children that are still running (the workers)."""
    total = 0.0
    for p in [pid, *_children(pid)]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / _CLK_TCK
    return total


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def start_kproxy(upstream: str, node_id: int, workers: int, workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port_block(4)
    cfg = workdir / f"kproxy-{workers}.yaml"
    cfg.write_text(f'listen: "{HOST}:{port}"\nupstream: {{bootstrap_servers: "{upstream}"}}\n'
                   f"exposure: {{advertised_host: {HOST}, node_id_base: {node_id}, broker_port_count: 2}}\n"
                   f"log_level: WARNING\nworkers: {workers}\n")
    proc = subprocess.Popen([sys.executable, "-m", "kproxy", "run", "--config", str(cfg)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=open(workdir / f"kproxy-{workers}.log", "wb"))  # noqa: SIM115
    deadline = time.monotonic() + 30
    while not broker_answers(HOST, port):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"kproxy (workers {workers}) did not start")
        time.sleep(0.1)
    time.sleep(1.0)  # every worker up
    return proc, f"{HOST}:{port}"


def small(args: argparse.Namespace) -> int:
    """The small-request loops through kproxy with each worker count (see the module's text)."""
    counts = [int(w) for w in args.workers.split(",")]
    load = ["load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())]
    got: dict[tuple[str, int], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="kproxy-workers-") as tmp, Tansu() as broker:
        admin = AdminClient({"bootstrap.servers": broker.bootstrap})
        node_id = next(iter(admin.list_topics(timeout=10).brokers))
        topic = f"workers-small-{uuid.uuid4().hex[:8]}"
        admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])[topic].result(30)
        del admin               # its broker connection would log the broker's shutdown
        proxies = {w: start_kproxy(broker.bootstrap, node_id, w, Path(tmp)) for w in counts}
        try:
            for r in range(args.rounds):
                for kind in ("metadata", "produce"):
                    for w in counts[r % len(counts):] + counts[: r % len(counts)]:
                        proc, address = proxies[w]
                        if proc.poll() is not None:
                            raise SystemExit(f"kproxy (workers {w}) exited: see its log")
                        c0 = cpu_seconds(proc.pid)
                        res = run_load(address, args.clients, args.seconds, warmup=1.0, kind=kind, topic=topic)
                        per = (cpu_seconds(proc.pid) - c0) / res.answers_total
                        got.setdefault((kind, w), []).append((res.requests_per_s, per))
                        print(f"  round {r + 1}/{args.rounds}  {kind:<9} workers {w}  {res.requests_per_s:>8,.0f} "
                              f"req/s  {per * 1e6:.0f} us CPU/request  (load average {os.getloadavg()[0]:.1f})",
                              file=sys.stderr, flush=True)
        finally:
            for proc, _ in proxies.values():
                proc.terminate()
                proc.wait(30)
    load.append("load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    print(f"{os.cpu_count()} CPUs shared with tansu and the load generator (2 processes); {load[0]} before, "
          f"{load[1]} after")
    print(f"{args.clients} connections each keeping one small request in flight, {args.seconds:g} s a round, "
          f"{args.rounds} interleaved rounds, medians (min-max)")
    hdr = (f"{'loop':<10}{'workers':>8}{'requests/s':>12}{'min-max':>18}{'/ 1 worker':>12}"
           f"{'CPU/request':>13}{'min-max':>12}")
    print(hdr)
    print("-" * len(hdr))
    for kind in ("metadata", "produce"):
        one = statistics.median(x for x, _ in got[(kind, counts[0])])
        for w in counts:
            rates = [x for x, _ in got[(kind, w)]]
            cpus = [c * 1e6 for _, c in got[(kind, w)]]
            print(f"{kind:<10}{w:>8}{statistics.median(rates):>12,.0f}{f'{min(rates):,.0f}-{max(rates):,.0f}':>18}"
                  f"{statistics.median(rates) / one:>11.2f}x{statistics.median(cpus):>10.0f} us"
                  f"{f'{min(cpus):.0f}-{max(cpus):.0f}':>12}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--records", type=int, default=40_000, help="records per producer")
    ap.add_argument("--producers", type=int, default=8)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--small", action="store_true", help="the small-request loops (Metadata, one-record Produce)")
    ap.add_argument("--workers", default="1,2,4", help="with --small: the worker counts, comma-separated")
    ap.add_argument("--clients", type=int, default=100, help="with --small: connections")
    ap.add_argument("--seconds", type=float, default=5.0, help="with --small: seconds measured per round")
    args = ap.parse_args()
    if args.small:
        return small(args)
    with tempfile.TemporaryDirectory(prefix="kproxy-workers-") as tmp, Tansu() as broker:
        admin = AdminClient({"bootstrap.servers": broker.bootstrap})
        md = admin.list_topics(timeout=10)
        node_id = next(iter(md.brokers))
        proxies = {w: start_kproxy(broker.bootstrap, node_id, w, Path(tmp)) for w in (1, 2)}
        targets = {"direct": broker.bootstrap, "workers 1": proxies[1][1], "workers 2": proxies[2][1]}
        pids = {"workers 1": proxies[1][0].pid, "workers 2": proxies[2][0].pid}
        rates: dict[str, list[float]] = {t: [] for t in targets}
        cpus: dict[str, list[float]] = {t: [] for t in pids}
        try:
            names = list(targets)
            for r in range(args.rounds):
                for name in names[r % 3:] + names[: r % 3]:
                    pid = pids.get(name)
                    rate, used = run(targets[name], admin, args.producers, args.records, args.size,
                                     (lambda p=pid: cpu_seconds(p)) if pid is not None else None)
                    if used is not None:
                        cpus[name].append(used)
                    rates[name].append(rate)
                    print(f"  round {r + 1}: {name:<10} {rate:>10,.0f} records/s", file=sys.stderr, flush=True)
        finally:
            for proc, _ in proxies.values():
                proc.terminate()
                proc.wait(30)
    med = {t: statistics.median(v) for t, v in rates.items()}
    print(f"{args.producers} producers x {args.records:,} records of {args.size} B, acks=all; "
          f"{args.rounds} rounds, medians; {os.cpu_count()} CPUs shared with the broker and the clients")
    for t in targets:
        cpu = f"  kproxy CPU {statistics.median(cpus[t]) * 100:.0f}% of a core" if t in cpus else ""
        print(f"  {t:<10} {med[t]:>10,.0f} records/s ({med[t] * args.size / 1e6:.0f} MB/s)  "
              f"{med[t] / med['direct']:.2f}x direct{cpu}")
    print(f"  workers 2 / workers 1: {med['workers 2'] / med['workers 1']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One consumer's large-frame reads through several kproxy trees and HAProxy, side by side: each
relay's CPU per MB and the rate, per interleaved round, from one fake broker.

`bench/proxy.py` starts each target once for a produce and a consume phase; this bench produces once
(direct) and then times only consumes, so a change to the consume path is compared round by round
on the same records, and each relay's CPU is read from ``/proc`` around each consume alone. Usage:

    .venv/bin/python bench/consume_ab.py --trees BASEDIR,. --records 1000000 --rounds 5
    .venv/bin/python bench/consume_ab.py --trees ".,.@cut_through_splice: true"

Each tree is a directory holding a ``kproxy`` package (``git archive COMMIT kproxy | tar -x -C
DIR`` plus the built ``_accel`` and ``_lane`` extensions); ``.`` is this checkout. ``DIR@LINE`` runs
that tree with a configuration file holding ``LINE`` (a top-level setting) besides the listener and
the broker, so two settings of one tree can be compared the same way. ``--partitions N`` reads N
partitions at once (the fake broker holds them preloaded, ``--records`` spread over them), so each
Fetch answer carries about N MiB: with N of 3 or more they are over ``cut_through_min_bytes``'s 2 MiB
default and stream, where one partition's 1 MiB answers are stored."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import IO

sys.path.insert(0, str(Path(__file__).resolve().parent))

from confluent_kafka import Consumer, KafkaException, TopicPartition
from proxy import HOST, consume, free_port, produce

REPO = Path(__file__).resolve().parent.parent
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> tuple[float, float]:
    """User and system CPU of one process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / _CLK_TCK, int(fields[12]) / _CLK_TCK


def consume_partitions(bootstrap: str, topic: str, partitions: int, n: int) -> float:
    """Seconds to read n records from the start of partitions 0..partitions-1 at once (assign, no group)."""
    c = Consumer({"bootstrap.servers": bootstrap, "client.id": "kproxy-bench", "group.id": uuid.uuid4().hex,
                  "enable.auto.commit": False, "enable.partition.eof": False,
                  "queued.min.messages": 2 * n, "queued.max.messages.kbytes": 2_097_151})
    try:
        c.list_topics(topic, timeout=30)
        got = 0
        deadline = time.monotonic() + 120
        t0 = time.perf_counter()
        c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        while got < n:
            msgs = c.consume(min(10_000, n - got), 0.5)
            for m in msgs:
                if m.error():
                    raise KafkaException(m.error())
            got += len(msgs)
            if not msgs and time.monotonic() > deadline:
                raise RuntimeError(f"consume via {bootstrap}: read {got} of {n} records")
        return time.perf_counter() - t0
    finally:
        c.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", required=True,
                    help="comma-separated directories holding a kproxy package, each DIR or DIR@SETTING")
    ap.add_argument("--records", type=int, default=1_000_000, help="1 KiB records (default 1,000,000)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-haproxy", action="store_true", help="leave HAProxy out")
    ap.add_argument("--partitions", type=int, default=1,
                    help="partitions read at once (default 1: 1 MiB answers; N: about N MiB each)")
    args = ap.parse_args()
    trees: list[tuple[Path, str | None]] = []
    for spec in args.trees.split(","):
        tree, _, setting = spec.partition("@")
        trees.append((Path(tree).resolve(), setting or None))
    for t, _ in trees:
        if not (t / "kproxy" / "__init__.py").exists():
            ap.error(f"{t}: no kproxy package in it")
    work = Path(tempfile.mkdtemp(prefix="kproxy-consume-ab-"))
    with (work / "children.log").open("wb") as log:
        results = run(args, trees, work, log)
    report(args, results)


def run(args: argparse.Namespace, trees: list[tuple[Path, str | None]], work: Path, log: IO[bytes]) -> dict[str, list[tuple[float, float]]]:
    """Produce once, then consume through every relay per round; (MB/s, CPU ms per MB) per round."""
    python = sys.executable
    broker, hap_port, hap_broker = free_port(), free_port(), free_port()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    ports: dict[str, int] = {}
    # The fake broker's second listener advertises HAProxy's port, so the consumer stays behind it.
    topic = f"consume-ab-{uuid.uuid4().hex[:8]}"
    preload = ["--preload", f"{topic}:{args.partitions}:{args.records // args.partitions}:1024"] if args.partitions > 1 else []
    fake = subprocess.Popen([python, str(REPO / "bench" / "fake_broker.py"), "--listen", f"{HOST}:{broker}",
                             "--listen", f"{HOST}:{hap_broker}={HOST}:{hap_port}", *preload], stdout=log, stderr=log)
    try:
        for i, (tree, setting) in enumerate(trees):
            name = f"{i}:{tree.name or tree}" + (f" {setting}" if setting else "")
            ports[name] = free_port()
            argv = [python, "-m", "kproxy", "run", "--upstream", f"{HOST}:{broker}", "--listen",
                    f"{HOST}:{ports[name]}", "--log-level", "WARNING"]
            if setting:
                config = work / f"kproxy-{i}.yaml"
                config.write_text(f'listen: "{HOST}:{ports[name]}"\n'
                                  f'upstream: {{bootstrap_servers: "{HOST}:{broker}"}}\n'
                                  f"log_level: WARNING\n{setting}\n")
                argv = [python, "-m", "kproxy", "run", "--config", str(config)]
            procs[name] = subprocess.Popen(argv, cwd=tree, stdout=log, stderr=log)
        if not args.no_haproxy:
            cfg = work / "haproxy.cfg"
            cfg.write_text("\n".join([
                "global", "    maxconn 1000", "defaults", "    mode tcp", "    option splice-auto",
                "    timeout connect 5s", "    timeout client 60s", "    timeout server 60s",
                "listen relay", f"    bind {HOST}:{hap_port}", f"    server broker {HOST}:{hap_broker}", ""]))
            procs["haproxy"] = subprocess.Popen(["haproxy", "-f", str(cfg), "-db"], stdout=log, stderr=log)
            ports["haproxy"] = hap_port
        time.sleep(3)
        if args.partitions == 1:
            produce(f"{HOST}:{broker}", topic, args.records, b"x" * 1024)
        records = args.records // args.partitions * args.partitions
        load_before = os.getloadavg()
        mb = records * 1024 / 1e6
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in ports}
        for r in range(args.rounds):
            order = list(ports) if r % 2 == 0 else list(reversed(ports))
            for name in order:
                user0, sys0 = cpu_seconds(procs[name].pid)
                seconds = (consume(f"{HOST}:{ports[name]}", topic, args.records, 1024) if args.partitions == 1
                           else consume_partitions(f"{HOST}:{ports[name]}", topic, args.partitions, records))
                user1, sys1 = cpu_seconds(procs[name].pid)
                cpu_ms_per_mb = (user1 - user0 + sys1 - sys0) * 1e3 / mb
                results[name].append((mb / seconds, cpu_ms_per_mb))
                print(f"round {r + 1}/{args.rounds}  {name:28s} {mb / seconds:7.1f} MB/s  "
                      f"{cpu_ms_per_mb:5.2f} ms CPU/MB ({(sys1 - sys0) * 1e3 / mb:.2f} of it in the kernel)",
                      flush=True)
    finally:
        for p in [*procs.values(), fake]:
            p.terminate()
        for p in [*procs.values(), fake]:
            p.wait(10)
    args.load = (load_before[0], os.getloadavg()[0])
    return results


def report(args: argparse.Namespace, results: dict[str, list[tuple[float, float]]]) -> None:
    print(f"\n{args.records:,} records of 1 KiB in {args.partitions} partition(s), {args.rounds} interleaved rounds; load average "
          f"{args.load[0]:.2f} before, {args.load[1]:.2f} after")
    print(f"{'relay':28s} {'MB/s median (min-max)':>26s} {'CPU ms/MB median (min-max)':>30s}")
    for name, rows in results.items():
        rates, cpus = [x for x, _ in rows], [y for _, y in rows]
        print(f"{name:28s} {statistics.median(rates):9.1f} ({min(rates):.0f}-{max(rates):.0f})"
              f"{statistics.median(cpus):16.2f} ({min(cpus):.2f}-{max(cpus):.2f})")
    first = next(iter(results))
    for name in results:
        if name != first:
            paired = [b[1] / a[1] for a, b in zip(results[first], results[name], strict=True)]
            print(f"CPU per MB, {name} / {first}, paired per round: median {statistics.median(paired):.2f} "
                  f"({min(paired):.2f}-{max(paired):.2f})")


if __name__ == "__main__":
    main()

"""Fetch answers of 1 MiB in a loop through kproxy variants, with a raw client: throughput and CPU.

Run from the repository root:  ``.venv/bin/python bench/fetch_loop.py [--answers 300] [--rounds 5]
[--baseline DIR] [--splice]``

The fake page-cache broker (bench/fake_broker.py) holds a partition of 1 KiB records. One raw client
connection per target asks for a 1 MiB answer, reads it whole, and asks again (what librdkafka does
with one partition, without librdkafka's own CPU in the figure). Targets: ``direct``, ``kproxy``
(this tree), HAProxy in TCP splice mode, and with ``--baseline DIR`` kproxy from another source tree
(``kproxy-base``, as in proxy.py), with ``--splice`` kproxy with ``cut_through_splice: true``.
Rounds interleave the targets in rotating order; the figures are medians of GB/s and of the proxy's
CPU seconds per GB moved (user + system, from /proc).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from big_fetch import fetch_frame, read_answer, topic_id_of
from proxy import HOST, Child, free_port, free_port_pair, haproxy_binary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--answers", type=int, default=300, help="answers per target and round (default 300)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--baseline", metavar="DIR", type=Path, help="add kproxy-base, run from DIR/kproxy")
    ap.add_argument("--splice", action="store_true", help="add kp-splice (cut_through_splice: true)")
    args = ap.parse_args(argv)
    size = (1 << 20) - 1024
    with tempfile.TemporaryDirectory(prefix="kproxy-fetch-loop-") as tmp:
        work = Path(tmp)
        bp = free_port()
        children = [Child("fake broker", [sys.executable, "bench/fake_broker.py", "--listen", f"{HOST}:{bp}",
                                          "--preload", f"big:1:{size // 1024 + 1024}:1024"], work / "broker.log")]
        children[0].start([bp])
        # Each target: (the proxy process or None, the port a client asks on).
        targets: dict[str, tuple[Child | None, int]] = {"direct": (None, bp)}
        kproxies: dict[str, tuple[str, dict[str, str] | None]] = {"kproxy": ("", None)}
        if args.baseline is not None:
            kproxies["kproxy-base"] = ("", {**os.environ, "PYTHONPATH": str(args.baseline.resolve()),
                                            "PYTHONSAFEPATH": "1"})
        if args.splice:
            kproxies["kp-splice"] = ("cut_through_splice: true\n", None)
        try:
            for name, (settings, env) in kproxies.items():
                kp = free_port_pair()
                cfg = work / f"{name}.yaml"
                cfg.write_text(f'listen: "{HOST}:{kp}"\nupstream: {{bootstrap_servers: "{HOST}:{bp}"}}\n'
                               f"log_level: WARNING\n{settings}")
                child = Child(name, [sys.executable, "-m", "kproxy", "run", "--config", str(cfg)],
                              work / f"{name}.log", env=env)
                children.append(child)
                child.start([kp, kp + 1])
                # kp + 1 is the port kproxy exposes for node 0, the partition's leader.
                targets[name] = (child, kp + 1)
            hp = free_port()
            (work / "haproxy.cfg").write_text("\n".join([
                "global", "    maxconn 4000", "defaults", "    mode tcp", "    option splice-auto",
                "    timeout connect 5s", "    timeout client 1h", "    timeout server 1h",
                "frontend kafka", f"    bind {HOST}:{hp}", "    default_backend broker",
                "backend broker", f"    server broker {HOST}:{bp}", ""]))
            haproxy = Child("haproxy", [haproxy_binary(), "-db", "-f", str(work / "haproxy.cfg")], work / "haproxy.log")
            children.append(haproxy)
            haproxy.start([hp])
            targets["haproxy"] = (haproxy, hp)
            results: dict[str, list[tuple[float, float]]] = {}
            order = list(targets)
            for r in range(args.rounds):
                for name in order[r % len(order):] + order[:r % len(order)]:
                    proc, port = targets[name]
                    results.setdefault(name, []).append(run(proc, port, size, args.answers))
        finally:
            for child in reversed(children):
                child.stop()
    print(f"{args.answers} answers of 1 MiB per target and round, {args.rounds} rounds; "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for name, rows in results.items():
        gbs = statistics.median(x for x, _ in rows)
        cpu = statistics.median(c for _, c in rows)
        print(f"  {name:<12} {gbs:5.2f} GB/s  CPU {cpu:4.2f} s/GB   rounds: {' '.join(f'{x:.2f}' for x, _ in rows)}")
    return 0


def run(child: Child | None, port: int, size: int, answers: int) -> tuple[float, float]:
    """(GB/s, the proxy's CPU seconds per GB) for ``answers`` answers on one connection."""
    with socket.create_connection((HOST, port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        topic_id = topic_id_of(sock, "big")
        for i in range(5):    # warm-up: connections, codecs, buffers
            sock.sendall(fetch_frame(1000 + i, topic_id, size))
            read_answer(sock)
        cpu0 = child.cpu_seconds() if child else 0.0
        t0 = time.perf_counter()
        total = 0
        for i in range(answers):
            sock.sendall(fetch_frame(2000 + i, topic_id, size))
            total += read_answer(sock)
        dt = time.perf_counter() - t0
        cpu = child.cpu_seconds() - cpu0 if child else 0.0
    return total / dt / 1e9, cpu / (total / 1e9)


if __name__ == "__main__":
    sys.exit(main())

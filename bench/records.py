"""What record rules cost: validating JSON values, stamping headers into batches, and nothing for the
topics they do not select.

Run from the repository root:  ``.venv/bin/python bench/records.py [--rounds N] [--quick]``

- **validate**: a partition's records field of 1 KiB JSON values (1 MiB, uncompressed) through a
  ``validate: {value: json}`` rule, and through a ``json_schema`` rule (a schema with five typed
  properties): MB of record batches per CPU second (goal: json at least 100 MB/s per core).
- **stamp**: the same 1 KiB records (plain values), a ``headers`` rule with one ``set`` header and
  ``traceparent: inject``, batches uncompressed (goal at least 200 MB/s per core), lz4 and zstd
  (decompressed, rewritten and compressed again): MB of uncompressed batch per CPU second, so the
  codecs compare on the same records.
- **untouched**: a Produce v9 to 10 topics (orders-NN) through a session whose policy holds 100 rules
  (bench/rules.py's) against the same policy with record rules added for topics the request does not
  name: their throughput ratio (goal at least 0.98).

Figures are CPU time of this process (``time.process_time``), medians over rounds; the machine's
other load does not count, but its noise does: compare ratios taken in one run.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kproxy.policy.engine import FixedRules, Policy
from kproxy.policy.filter import PolicyFilter
from kproxy.policy.loader import load_rules
from kproxy.policy.record_rules import header_edit, rewrite_records, traceparent, validate_records
from kproxy.protocol.records import Compression, build_batch
from rules import PRODUCE, Runner, hundred_rules, paired_us, produce_pair

CAP = 64 << 20
RECORDS = 1024            # per batch: 1 MiB of 1 KiB values
SCHEMA = """{"type": "object", "required": ["id", "customer", "amount", "currency", "note"],
 "properties": {"id": {"type": "integer"}, "customer": {"type": "string"}, "amount": {"type": "number"},
                "currency": {"type": "string"}, "note": {"type": "string"}}}"""
RECORD_RULES = """\
  - name: checkout-json
    match: {topic: "checkout-*", api: produce}
    action: validate
    validate: {value: {json_schema: schema.json}, key: required}
  - name: stamp
    match: {topic: ["checkout-*", "payments-*"], api: produce}
    action: headers
    headers: {set: {x-producer: "${client_id}"}, traceparent: inject}
"""


def json_value(i: int) -> bytes:
    head = b'{"id": %d, "customer": "c-%05d", "amount": %d.25, "currency": "EUR", "note": "' % (i, i % 977, i)
    return head + b"n" * (1021 - len(head)) + b'"}'


def throughput(fn: Callable[[], object], size: int, seconds: float) -> float:
    """MB per CPU second of ``fn`` over ``size`` bytes, repeated for about ``seconds``."""
    n, spent = 0, 0.0
    t0 = time.process_time()
    while spent < seconds or n < 3:
        fn()
        n += 1
        spent = time.process_time() - t0
    return size * n / spent / 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 round, short measurements")
    args = ap.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    seconds = 0.2 if args.quick else 1.0

    with tempfile.TemporaryDirectory() as d:
        Path(d, "schema.json").write_text(SCHEMA)
        Path(d, "checks.yaml").write_text(
            "rules:\n"
            "  - {name: json, action: validate, validate: {value: json}}\n"
            "  - {name: schema, action: validate, validate: {value: {json_schema: schema.json}}}\n")
        checks = {r.name: r for r in load_rules([str(Path(d, "checks.yaml"))]).rules}
        Path(d, "hundred.yaml").write_text(hundred_rules())
        Path(d, "records.yaml").write_text(hundred_rules().replace("rules:\n", "rules:\n" + RECORD_RULES, 1))
        plain_policy = Policy(load_rules([str(Path(d, "hundred.yaml"))]))
        record_policy = Policy(load_rules([str(Path(d, "records.yaml"))]))
        stamp_rules = tuple(r for r in record_policy.rule_set.rules if r.name == "stamp")

    json_batch = build_batch([(b"k%d" % i, json_value(i)) for i in range(RECORDS)])
    for rule in checks.values():
        assert validate_records(rule, json_batch, CAP) is None
    edit = header_edit(stamp_rules, "billing-7", None, traceparent(random.getrandbits(128), random.getrandbits(64)))
    # Text of 64 symbols: compresses about 1.3x, as log lines and JSON of ids do (not 100x as repeats).
    rng = random.Random(0)
    alphabet = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ,"
    plain = [(b"k%d" % i, bytes(rng.choices(alphabet, k=1024))) for i in range(RECORDS)]
    size = len(build_batch(plain))
    stamp_batches = {c: build_batch(plain, compression=c) for c in (Compression.NONE, Compression.LZ4,
                                                                    Compression.ZSTD)}
    for batch in stamp_batches.values():
        assert rewrite_records(batch, edit, CAP)[1] == 1

    cases: dict[str, Callable[[], float]] = {
        "validate json, 1 KiB values": lambda: throughput(
            lambda: validate_records(checks["json"], json_batch, CAP), len(json_batch), seconds),
        "validate json_schema, 1 KiB values": lambda: throughput(
            lambda: validate_records(checks["schema"], json_batch, CAP), len(json_batch), seconds),
    }
    for codec, batch in stamp_batches.items():
        cases[f"stamp headers, {codec.name.lower()}, 1 KiB"] = (
            lambda b=batch: throughput(lambda: rewrite_records(b, edit, CAP), size, seconds))

    frame, answer = produce_pair("")
    without = Runner([PolicyFilter(FixedRules(plain_policy), random.Random(1))], frame, PRODUCE, 9, answer)
    with_rules = Runner([PolicyFilter(FixedRules(record_policy), random.Random(1))], frame, PRODUCE, 9, answer)
    pairs, n = (5, 50) if args.quick else (15, 200)

    results: dict[str, list[float]] = {k: [] for k in cases}
    untouched: list[tuple[float, float, float]] = []
    for r in range(rounds):
        order = list(cases.items())
        random.Random(r).shuffle(order)
        for name, run in order:
            results[name].append(run())
        untouched.append(paired_us(without.once, with_rules.once, pairs, n))

    print(f"bench/records.py: {rounds} rounds; MB of uncompressed record batches per CPU second (medians)")
    for name, figures in results.items():
        print(f"  {name:40} {statistics.median(figures):8.1f} MB/s")
    a, b, _ = (statistics.median(f[i] for f in untouched) for i in range(3))
    print(f"untouched topics (Produce v9, 10 topics, 100 rules): without record rules {a:.1f} us, "
          f"with record rules for other topics {b:.1f} us per request: {a / b:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

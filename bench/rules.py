"""What policy rules add to a request: a session with the policy filter against one without.

Run from the repository root:  ``.venv/bin/python bench/rules.py [--rounds N] [--quick]``

Each case sends one request frame into a sans-I/O ``Session`` and its broker answer back (decode,
filters, encode both ways), with and without ``PolicyFilter``; the difference is what the rules
cost. Requests: a Produce v9 to 10 topics (one partition, a 100-byte batch each) and a Fetch v12 of
10 topics (one partition each, answered with a 100-byte batch each). Rule sets: 100 rules mixing
client id globs and regular expressions, principals, source CIDRs, topic globs and regexes, API and
acks selectors and requirements, none of which refuses the benchmark's own requests (so every rule
is judged, and each request goes through whole); and ``rules/multi-tenant.yaml``, where the client is
a tenant and every name is prefixed and unprefixed. "cold" clears the per-topic outcome cache before
every request (a client that never repeats a set of topics). Figures are CPU microseconds per
request, measured in alternating batches with and without rules (see ``paired_us``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kproxy.policy.engine import FixedRules, Policy
from kproxy.policy.filter import PolicyFilter
from kproxy.policy.loader import load_rules
from kproxy.protocol.messages import (
    Request,
    Response,
    body_class,
    encode_request_frame,
    encode_response_frame,
)
from kproxy.protocol.records import build_batch
from kproxy.proxy.actions import ToClient, ToUpstream
from kproxy.proxy.filters import ConnectionContext, Filter, FilterChain
from kproxy.proxy.session import Session

REPO = Path(__file__).resolve().parent.parent
PRODUCE, FETCH = 0, 1
TOPICS = [f"orders-{t:02d}" for t in range(10)]
CLIENT_ID = "billing-7"


def hundred_rules() -> str:
    """100 rules of every selector kind that look at each request but never refuse the benchmark's."""
    rules = []
    for n in range(20):
        rules.append(f"- {{name: other-team-{n}, match: {{client_id: 'team-{n:02d}-*'}}, action: deny}}")
    for n in range(10):
        rules.append(f"- {{name: other-app-{n}, match: {{client_id: 're:app-{n}-[a-z]+'}}, action: deny}}")
    for n in range(10):
        rules.append(f"- {{name: net-{n}, match: {{source: ['10.{n}.0.0/16', '2001:db8:{n}::/48']}}, "
                     "action: deny}")
    for n in range(10):
        rules.append(f"- {{name: person-{n}, match: {{principal: 'User:person-{n}'}}, action: deny}}")
    for n in range(20):
        rules.append(f"- {{name: secret-{n}, match: {{topic: 'secret-{n}-*'}}, action: deny}}")
    for n in range(10):
        rules.append(f"- {{name: private-{n}, match: {{topic: 're:private-{n}-[0-9]+'}}, action: deny}}")
    for n in range(5):
        rules.append(f"- {{name: acks-{n}, match: {{api: produce, acks: 0, topic: 'audit-{n}-*'}}, action: deny}}")
    for n in range(5):
        rules.append(f"- {{name: group-{n}, match: {{group: 'legacy-{n}-*'}}, action: deny}}")
    rules.append("- {name: produce-acks, match: {api: produce}, action: require, require: {acks: all}}")
    for n in range(8):
        rules.append(f"- {{name: admin-{n}, match: {{api: admin, principal: {{not: 'User:ops-{n}'}}, "
                     f"listener: 'broker-{n}'}}, action: deny}}")
    rules.append("- {name: everything-else, action: allow}")
    assert len(rules) == 100, len(rules)
    return "rules:\n" + "\n".join(f"  {r}" for r in rules) + "\n"


def produce_pair(prefix: str) -> tuple[bytes, Any]:
    cls = body_class(PRODUCE, "request")
    batch = bytes(build_batch([(None, b"v" * 100)]))
    body = cls(acks=-1, timeout_ms=30000, topic_data=[
        cls.TopicProduceData(name=t, partition_data=[cls.PartitionProduceData(index=0, records=batch)])
        for t in TOPICS])
    rcls = body_class(PRODUCE, "response")
    answer = rcls(responses=[rcls.TopicProduceResponse(name=prefix + t, partition_responses=[
        rcls.PartitionProduceResponse(index=0, base_offset=1)]) for t in TOPICS])
    return _frame(PRODUCE, 9, body), answer


def fetch_pair(prefix: str) -> tuple[bytes, Any]:
    cls = body_class(FETCH, "request")
    body = cls(max_wait_ms=500, min_bytes=1, max_bytes=50 << 20, topics=[
        cls.FetchTopic(topic=t, partitions=[cls.FetchPartition(partition=0, fetch_offset=5, partition_max_bytes=1 << 20)])
        for t in TOPICS])
    batch = bytes(build_batch([(None, b"v" * 100)]))
    rcls = body_class(FETCH, "response")
    answer = rcls(responses=[rcls.FetchableTopicResponse(topic=prefix + t, partitions=[
        rcls.PartitionData(partition_index=0, high_watermark=6, records=batch)]) for t in TOPICS])
    return _frame(FETCH, 12, body), answer


def _frame(api_key: int, version: int, body: Any) -> bytes:
    return b"".join(bytes(b) for b in encode_request_frame(Request.build(api_key, version, 1, CLIENT_ID, body)))[4:]


class Runner:
    """One session per case; ``once()`` sends the request and feeds back the answer."""

    def __init__(self, filters: list[Filter], frame: bytes, api_key: int, version: int, answer: Any,
                 client_id: str = CLIENT_ID) -> None:
        ctx = ConnectionContext(1, client_address=("192.168.7.7", 40000), listener="broker-1")
        self.session = Session(ctx, FilterChain(filters))
        self.request = memoryview(_frame_with_client(frame, client_id))
        response = b"".join(bytes(b) for b in encode_response_frame(Response.build(api_key, version, 0, answer)))[4:]
        self.response = bytearray(response)

    def once(self) -> None:
        (up,) = self.session.client_frame(self.request)
        assert type(up) is ToUpstream
        upstream_id = self.session._next_correlation_id - 1
        struct.pack_into(">i", self.response, 0, upstream_id)
        (out,) = self.session.upstream_frame(memoryview(self.response))
        assert type(out) is ToClient


def _frame_with_client(frame: bytes, client_id: str) -> bytes:
    # Request header v1/v2: api key, version, correlation id, then the int16-length client id.
    (n,) = struct.unpack_from(">h", frame, 8)
    return frame[:8] + struct.pack(">h", len(client_id)) + client_id.encode() + frame[10 + n:]


def paired_us(without: Callable[[], object], with_rules: Callable[[], object], pairs: int,
              n: int) -> tuple[float, float, float]:
    """(without, with, added) in microseconds per request: ``pairs`` short batches of ``n`` calls
    each, alternating the two sides, in CPU time of this process (other processes on a loaded machine
    do not count); medians of the per-batch figures, so drift in the machine's speed cancels out."""
    a, b, d = [], [], []
    for _ in range(pairs):
        t0 = time.process_time()
        for _ in range(n):
            without()
        t1 = time.process_time()
        for _ in range(n):
            with_rules()
        t2 = time.process_time()
        a.append((t1 - t0) / n * 1e6)
        b.append((t2 - t1) / n * 1e6)
        d.append(b[-1] - a[-1])
    return statistics.median(a), statistics.median(b), statistics.median(d)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--pairs", type=int, default=15, help="alternating batches per case and round")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 round, short measurements")
    args = ap.parse_args(argv)
    rounds = 1 if args.quick else args.rounds

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "hundred.yaml"
        path.write_text(hundred_rules())
        hundred = Policy(load_rules([str(path)]))
    tenants = Policy(load_rules([str(REPO / "rules" / "multi-tenant.yaml")]))
    assert len(hundred.rule_set.rules) == 100

    cases: dict[str, tuple[Runner, Runner, Policy | None]] = {}
    for name, pair, api, version in (("produce", produce_pair, PRODUCE, 9), ("fetch", fetch_pair, FETCH, 12)):
        frame, plain_answer = pair("")
        _, tenant_answer = pair("tenant-a.")
        cases[f"{name}, 100 rules"] = (Runner([], frame, api, version, plain_answer), Runner(
            [PolicyFilter(FixedRules(hundred), random.Random(1))], frame, api, version, plain_answer), None)
        cases[f"{name}, 100 rules, cold"] = (Runner([], frame, api, version, plain_answer), Runner(
            [PolicyFilter(FixedRules(hundred), random.Random(1))], frame, api, version, plain_answer), hundred)
        cases[f"{name}, multi-tenant"] = (Runner([], frame, api, version, tenant_answer, "team-a-bench"), Runner(
            [PolicyFilter(FixedRules(tenants), random.Random(1))], frame, api, version, tenant_answer,
            "team-a-bench"), None)

    def cold(runner: Runner, policy: Policy) -> Callable[[], None]:
        def run() -> None:
            for view in policy._views.values():
                for plan in view._plans.values():
                    plan._outcomes.clear()
            runner.once()
        return run

    pairs, n = (5, 50) if args.quick else (args.pairs, 200)
    results: dict[str, list[tuple[float, float, float]]] = {k: [] for k in cases}
    for r in range(rounds):
        order = list(cases.items())
        random.Random(r).shuffle(order)
        for name, (base, ruled, flush) in order:
            results[name].append(paired_us(base.once, cold(ruled, flush) if flush is not None else ruled.once,
                                           pairs, n))

    print(f"bench/rules.py: {rounds} rounds x {pairs} pairs of {n} requests; CPU us per request "
          "(request in + answer out, sans-I/O), medians")
    print(f"{'case':34} {'without':>9} {'with':>9} {'added':>9}")
    for name, figures in results.items():
        without, with_rules, added = (statistics.median(f[i] for f in figures) for i in range(3))
        print(f"{name:34} {without:9.1f} {with_rules:9.1f} {added:9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

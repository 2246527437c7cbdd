"""Cost of finding and rewriting entities (topics, groups, node ids) in decoded bodies.

Run from the repository root:  ``.venv/bin/python bench/entities.py [--rounds N] [--quick]``

Two bodies are built once: a Produce v9 request to 10 topics (one partition each) and a Metadata v12
response of 3 brokers and 100 topics x 12 partitions (1,200 partitions, 3 replicas each). Timed:
``entities.collect``, ``rewrite`` (prefix every name, then undo it) and ``filter_elements`` (keeping
everything, so each round sees the same body), beside a plain reflective walk over
``entity_paths`` (what a per-call walk of the schema would cost) and the body's decode, for scale.
Each figure is the median over interleaved rounds of microseconds per call.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from kproxy.protocol import entities
from kproxy.protocol.compiler import encode_to, join_parts
from kproxy.protocol.messages import request_codecs, response_codecs


def produce_request() -> tuple[Any, bytes]:
    _, codec = request_codecs(0, 9)
    cls = codec.cls
    body = cls(transactional_id=None, acks=-1, timeout_ms=30000, topic_data=[
        cls.TopicProduceData(name=f"topic-{t:03d}", partition_data=[
            cls.PartitionProduceData(index=0, records=b"x" * 100)])
        for t in range(10)])
    return body, _encoded(codec, body)


def metadata_response() -> tuple[Any, bytes]:
    _, codec = response_codecs(3, 12)
    cls = codec.cls
    body = cls(brokers=[cls.MetadataResponseBroker(node_id=n, host=f"broker-{n}", port=9092) for n in range(3)],
               cluster_id="bench", controller_id=0, topics=[
        cls.MetadataResponseTopic(name=f"topic-{t:03d}", topic_id=uuid.UUID(int=t + 1), partitions=[
            cls.MetadataResponsePartition(partition_index=p, leader_id=p % 3, leader_epoch=0,
                                          replica_nodes=[p % 3, (p + 1) % 3, (p + 2) % 3],
                                          isr_nodes=[p % 3, (p + 1) % 3, (p + 2) % 3])
            for p in range(12)])
        for t in range(100)])
    return body, _encoded(codec, body)


def _encoded(codec: Any, body: Any) -> bytes:
    out, ins = bytearray(), []
    encode_to(codec, body, out, ins)
    return bytes(join_parts(out, ins))


def reflective_collect(body: Any, api_key: int, version: int, kind: str, entity: str) -> list:
    """A walk that follows ``entity_paths`` with getattr on every call (no generated code)."""
    out: list = []

    def walk(obj: Any, path: entities.Path, i: int) -> None:
        name, array = path[i]
        value = getattr(obj, name)
        if value is None:
            return
        if i == len(path) - 1:
            out.extend(value) if array else out.append(value)
            return
        for item in value if array else (value,):
            walk(item, path, i + 1)

    for path in entities.entity_paths(api_key, version, kind).get(entity, ()):
        walk(body, path, 0)
    return out


def per_call_us(fn: Callable[[], object], budget: float) -> float:
    n = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        dt = time.perf_counter() - t0
        if dt >= budget or n >= 1 << 22:
            return dt / n * 1e6
        n = max(n * 2, int(n * budget / max(dt, 1e-9)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="one short round, for a smoke test")
    args = ap.parse_args()
    rounds, budget = (1, 0.01) if args.quick else (args.rounds, 0.2)

    produce, produce_bytes = produce_request()
    metadata, metadata_bytes = metadata_response()
    _, produce_codec = request_codecs(0, 9)
    _, metadata_codec = response_codecs(3, 12)
    prefix, strip = (lambda v: "t." + v), (lambda v: v[2:])

    def rewrite_and_undo(body: Any, key: int, v: int, kind: str) -> None:
        entities.rewrite(body, key, v, kind, "topic", prefix)
        entities.rewrite(body, key, v, kind, "topic", strip)

    cases: dict[str, Callable[[], object]] = {
        "produce v9 req, 10 topics: collect topic": lambda: entities.collect(produce, 0, 9, "request", "topic"),
        "  reflective walk": lambda: reflective_collect(produce, 0, 9, "request", "topic"),
        "  rewrite topic + undo": lambda: rewrite_and_undo(produce, 0, 9, "request"),
        "  collect txn (none there)": lambda: entities.collect(produce, 0, 9, "request", "txn"),
        "  decode (for scale)": lambda: produce_codec.decode(memoryview(produce_bytes), 0, len(produce_bytes)),
        "metadata v12 resp, 1,200 partitions: collect topic":
            lambda: entities.collect(metadata, 3, 12, "response", "topic"),
        "  reflective walk, topic": lambda: reflective_collect(metadata, 3, 12, "response", "topic"),
        "  rewrite topic + undo ": lambda: rewrite_and_undo(metadata, 3, 12, "response"),
        "  filter_elements topic (keep all)":
            lambda: entities.filter_elements(metadata, 3, 12, "response", "topic", bool),
        "  collect broker (7,200 ids)": lambda: entities.collect(metadata, 3, 12, "response", "broker"),
        "  reflective walk, broker": lambda: reflective_collect(metadata, 3, 12, "response", "broker"),
        "  decode (for scale) ":
            lambda: metadata_codec.decode(memoryview(metadata_bytes), 0, len(metadata_bytes)),
    }
    # Every case must find what the independent walk finds (which goes path by path, so in another
    # order) before it is timed.
    for body, key, v, kind, entity in ((produce, 0, 9, "request", "topic"), (metadata, 3, 12, "response", "topic"),
                                       (metadata, 3, 12, "response", "broker")):
        assert sorted(entities.collect(body, key, v, kind, entity)) == sorted(
            reflective_collect(body, key, v, kind, entity))
    rewrite_and_undo(metadata, 3, 12, "response")
    assert _encoded(metadata_codec, metadata) == metadata_bytes

    results: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            results[name].append(per_call_us(cases[name], budget))
    print(f"python {sys.version.split()[0]}, {rounds} round(s); microseconds per call, median")
    for name in names:
        print(f"{name:58s} {statistics.median(results[name]):10.2f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

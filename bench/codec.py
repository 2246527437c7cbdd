"""Codec throughput: kproxy's generated decoders and encoders against kio 0.6.5 on the same bytes.

Run from the repository root:  ``.venv/bin/python bench/codec.py [--rounds N] [--quick] [--profile CASE]``

Three message bodies are built once (a Metadata v12 response, a Produce v9 request, a Fetch v16
response with real RecordBatch v2 records) and kio must build the same bytes from its own entities.
The timed operation is decode + encode of the body (kproxy's body codec against kio's
``entity_reader`` + ``entity_writer``), then each half alone; every output is checked to equal the
input before timing. kproxy's output is its encoder's natural one (a bytearray and zero-copy record
buffers for one vectored send); "+join" also copies it into one ``bytes``, as kio's ``BytesIO`` is.
Runs interleave, the first runner rotates per round, and each figure is the median over rounds.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import importlib.metadata
import io
import pstats
import random
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kio.schema.errors import ErrorCode
from kio.schema.fetch.v16 import response as kio_fetch
from kio.schema.metadata.v12 import response as kio_metadata
from kio.schema.produce.v9 import request as kio_produce
from kio.serial import entity_reader, entity_writer
from kio.static.primitive import Records

from kproxy.protocol import compiler
from kproxy.protocol.compiler import Codec, encode_to, join_parts, split_parts
from kproxy.protocol.messages import request_codecs, response_codecs
from kproxy.protocol.records import RecordBatch, build_batch

KIB = 1024
MIB = 1024 * KIB
BASE_TS = 1_717_000_000_000  # a fixed wall-clock millisecond timestamp, so every run builds the same bytes


# ---------------------------------------------------------------------------------------------
# Building the bodies


def record_batch(rng: random.Random, size: int, *, base_offset: int = 0, value_size: int = 1000,
                 producer_id: int = -1, base_sequence: int = -1, leader_epoch: int = -1) -> bytes:
    """An uncompressed RecordBatch v2 of exactly ``size`` bytes: keyed records with random values."""
    per_record = value_size + 24  # key "key-NNNNN", varint lengths and deltas, header count
    n = max(1, (size - 61) // per_record)
    values = [rng.randbytes(value_size) for _ in range(n)]
    for _ in range(8):  # the last value absorbs the remainder; varint widths can move it a byte
        recs = [(b"key-%05d" % i, v, (), BASE_TS + i) for i, v in enumerate(values)]
        batch = build_batch(recs, base_offset=base_offset, producer_id=producer_id,
                            producer_epoch=0 if producer_id >= 0 else -1, base_sequence=base_sequence,
                            partition_leader_epoch=leader_epoch)
        if len(batch) == size:
            break
        values[-1] = values[-1] + rng.randbytes(size - len(batch)) if len(batch) < size \
            else values[-1][: size - len(batch)]
    assert len(batch) == size, (len(batch), size)
    b = RecordBatch(batch)
    assert b.verify_crc() and b.record_count == n
    return batch


@dataclass
class Case:
    name: str
    what: str
    codec: Codec
    kio_cls: type
    body: bytes


def codec_description() -> str:
    if not hasattr(compiler, "set_codec"):  # a kproxy from before lazy arrays, for before/after runs
        return "kproxy codec: generated Python, eager"
    return f"kproxy codec: {compiler.codec_implementation()}, lazy arrays from {compiler.LAZY_MIN_ITEMS} items"


def _kproxy_bytes(codec: Codec, obj: Any) -> bytes:
    out: bytearray = bytearray()
    ins: list[Any] = []
    encode_to(codec, obj, out, ins)
    return bytes(join_parts(out, ins))


def _kio_bytes(cls: type, entity: Any) -> bytes:
    buf = io.BytesIO()
    entity_writer(cls)(buf, entity)
    return buf.getvalue()


def metadata_body(n_topics: int, n_partitions: int, broker_ids: list[int], seed: int = 3) -> tuple[bytes, Any]:
    """A Metadata v12 response body and kio's entity for it: ``n_topics`` x ``n_partitions``, 3
    replicas spread over the brokers, topic ids, ISR (now and then shrunk), no offline replicas.
    Built by kproxy and by kio, and asserted to be the same bytes."""
    rng = random.Random(seed)
    _, codec = response_codecs(3, 12)
    C: Any = codec.cls
    mod: Any = kio_metadata  # kio types its ints as phantom types; plain values encode the same
    nb = len(broker_ids)
    brokers = [(i, f"b-{i}.kafka-prod.use1.internal.example.com", 9092, f"use1-az{(i - 1) % 3 + 1}")
               for i in broker_ids]
    topics = []
    for t in range(n_topics):
        tid = uuid.UUID(int=rng.getrandbits(128), version=4)
        parts = []
        for p in range(n_partitions):
            replicas = [broker_ids[(t + p + k) % nb] for k in range(3)]
            isr = replicas if (t * n_partitions + p) % 29 else replicas[:2]  # now and then a shrunk ISR
            parts.append((p, replicas[0], rng.randrange(0, 40), replicas, isr))
        topics.append((f"orders.events-{t:03d}", tid, parts))
    cluster_id = "MkU3OEVBNTcwNTJENDM2Qk"

    ours = C(
        throttle_time_ms=0,
        brokers=[C.MetadataResponseBroker(node_id=n, host=h, port=pt, rack=r) for n, h, pt, r in brokers],
        cluster_id=cluster_id,
        controller_id=2,
        topics=[
            C.MetadataResponseTopic(
                error_code=0, name=name, topic_id=tid, is_internal=False,
                partitions=[C.MetadataResponsePartition(
                    error_code=0, partition_index=p, leader_id=leader, leader_epoch=epoch,
                    replica_nodes=list(reps), isr_nodes=list(isr), offline_replicas=[])
                    for p, leader, epoch, reps, isr in parts])
            for name, tid, parts in topics
        ],
    )
    theirs = mod.MetadataResponse(
        throttle_time=datetime.timedelta(0),
        brokers=tuple(mod.MetadataResponseBroker(node_id=n, host=h, port=pt, rack=r) for n, h, pt, r in brokers),
        cluster_id=cluster_id,
        controller_id=2,
        topics=tuple(
            mod.MetadataResponseTopic(
                error_code=ErrorCode.none, name=name, topic_id=tid, is_internal=False,
                partitions=tuple(mod.MetadataResponsePartition(
                    error_code=ErrorCode.none, partition_index=p, leader_id=leader, leader_epoch=epoch,
                    replica_nodes=tuple(reps), isr_nodes=tuple(isr), offline_replicas=())
                    for p, leader, epoch, reps, isr in parts))
            for name, tid, parts in topics
        ),
    )
    body = _kproxy_bytes(codec, ours)
    assert body == _kio_bytes(mod.MetadataResponse, theirs), "kproxy and kio build different Metadata v12 bytes"
    return body, theirs


def metadata_case() -> Case:
    """Metadata v12 response: 3 brokers, 100 topics x 12 partitions x 3 replicas."""
    body, _ = metadata_body(100, 12, [1, 2, 3])
    _, codec = response_codecs(3, 12)
    return Case("metadata_v12_resp", "100 topics x 12 partitions x 3 replicas", codec,
                kio_metadata.MetadataResponse, body)


def produce_case() -> Case:
    """Produce v9 request: one topic, 10 partitions, each a 64 KiB RecordBatch v2 (idempotent)."""
    rng = random.Random(0)
    _, codec = request_codecs(0, 9)
    C: Any = codec.cls
    mod: Any = kio_produce  # kio types its ints as phantom types; plain values encode the same
    batches = [record_batch(rng, 64 * KIB, producer_id=4001, base_sequence=p * 1000) for p in range(10)]
    topic = "orders.events"
    ours = C(transactional_id=None, acks=-1, timeout_ms=30_000, topic_data=[
        C.TopicProduceData(name=topic, partition_data=[
            C.PartitionProduceData(index=p, records=b) for p, b in enumerate(batches)])])
    theirs = mod.ProduceRequest(transactional_id=None, acks=-1, timeout=datetime.timedelta(milliseconds=30_000), topic_data=(
        mod.TopicProduceData(name=topic, partition_data=tuple(
            mod.PartitionProduceData(index=p, records=Records(b)) for p, b in enumerate(batches))),))
    body = _kproxy_bytes(codec, ours)
    assert body == _kio_bytes(mod.ProduceRequest, theirs), "kproxy and kio build different Produce v9 bytes"
    return Case("produce_v9_req", "10 partitions x 64 KiB RecordBatch v2", codec, mod.ProduceRequest, body)


def fetch_case() -> Case:
    """Fetch v16 response: one topic, 10 partitions, each a 1 MiB RecordBatch v2."""
    rng = random.Random(1)
    _, codec = response_codecs(1, 16)
    C: Any = codec.cls
    mod: Any = kio_fetch  # kio types its ints as phantom types; plain values encode the same
    tid = uuid.UUID(int=rng.getrandbits(128), version=4)
    base = 1_000_000
    batches = [record_batch(rng, 1 * MIB, base_offset=base, leader_epoch=7) for _ in range(10)]
    hw = base + RecordBatch(batches[0]).record_count
    ours = C(throttle_time_ms=0, error_code=0, session_id=918_273, responses=[
        C.FetchableTopicResponse(topic_id=tid, partitions=[
            C.PartitionData(partition_index=p, error_code=0, high_watermark=hw, last_stable_offset=hw,
                            log_start_offset=0, aborted_transactions=None, preferred_read_replica=-1,
                            records=b)
            for p, b in enumerate(batches)])])
    theirs = mod.FetchResponse(throttle_time=datetime.timedelta(0), error_code=ErrorCode.none, session_id=918_273, responses=(
        mod.FetchableTopicResponse(topic_id=tid, partitions=tuple(
            mod.PartitionData(partition_index=p, error_code=ErrorCode.none, high_watermark=hw,
                              last_stable_offset=hw, log_start_offset=0, aborted_transactions=None,
                              preferred_read_replica=-1, records=Records(b))
            for p, b in enumerate(batches))),))
    body = _kproxy_bytes(codec, ours)
    assert body == _kio_bytes(mod.FetchResponse, theirs), "kproxy and kio build different Fetch v16 bytes"
    return Case("fetch_v16_resp", "10 partitions x 1 MiB RecordBatch v2", codec, mod.FetchResponse, body)


# ---------------------------------------------------------------------------------------------
# The timed operations


def decoder_and_encoder(codec: Codec, data: bytes) -> tuple[Callable[[], Any], Callable[..., list[Any]]]:
    """kproxy's decode of ``data``, and its encode (by default of ``data`` decoded once, untouched)
    to the list of buffers the proxy sends with one vectored write."""
    end = len(data)
    decoded, _ = codec.decode_checked(memoryview(data), 0, end)

    def dec() -> Any:
        obj, pos = codec.decode_checked(memoryview(data), 0, end)
        if pos != end:
            raise AssertionError(f"{end - pos} trailing bytes")
        return obj

    def enc(obj: Any = decoded) -> list[Any]:
        out: bytearray = bytearray()
        ins: list[Any] = []
        encode_to(codec, obj, out, ins)
        return split_parts(out, ins)

    return dec, enc


def kproxy_ops(case: Case) -> dict[str, Callable[[], Any]]:
    """Round trip (decode, then encode to the list of buffers the proxy sends with one vectored
    write), the same plus a copy of that list into one ``bytes`` (what kio's ``BytesIO`` holds),
    and each half alone."""
    dec, enc = decoder_and_encoder(case.codec, case.body)
    return {
        "kproxy": lambda: enc(dec()),
        "kproxy+join": lambda: b"".join(enc(dec())),
        "kproxy decode": dec,
        "kproxy encode": enc,
    }


def kio_ops(case: Case) -> dict[str, Callable[[], Any]]:
    read: Any = entity_reader(case.kio_cls)
    write: Any = entity_writer(case.kio_cls)
    data = case.body
    decoded, _ = read(data, 0)

    def dec() -> Any:
        entity, size = read(data, 0)
        if size != len(data):
            raise AssertionError(f"{len(data) - size} trailing bytes")
        return entity

    def enc(entity: Any = decoded) -> io.BytesIO:
        buf = io.BytesIO()
        write(buf, entity)
        return buf

    return {"kio": lambda: enc(dec()), "kio decode": dec, "kio encode": enc}


def all_ops(case: Case) -> dict[str, Callable[[], Any]]:
    return {**kproxy_ops(case), **kio_ops(case)}


def verify(case: Case) -> None:
    """Every output reproduces the input exactly; checked outside the timed loops."""
    ops = all_ops(case)
    assert b"".join(ops["kproxy"]()) == case.body, f"{case.name}: kproxy round trip differs from the input"
    assert ops["kproxy+join"]() == case.body, f"{case.name}: kproxy joined output differs from the input"
    assert b"".join(ops["kproxy encode"]()) == case.body, f"{case.name}: kproxy encode differs"
    assert ops["kio"]().getvalue() == case.body, f"{case.name}: kio round trip differs from the input"
    assert ops["kio encode"]().getvalue() == case.body, f"{case.name}: kio encode differs"


# ---------------------------------------------------------------------------------------------
# Timing


def calibrate(op: Callable[[], Any], target: float, max_iters: int | None) -> int:
    """Iterations that take about ``target`` seconds (after a warm-up call)."""
    op()
    n, elapsed = 1, 0.0
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            op()
        elapsed = time.perf_counter() - t0
        if elapsed >= target / 10 or (max_iters is not None and n >= max_iters):
            break
        n *= 4
    iters = max(1, round(n * target / elapsed)) if elapsed > 0 else n
    return min(iters, max_iters) if max_iters is not None else iters


def measure(op: Callable[[], Any], iters: int) -> float:
    """Operations per second over ``iters`` back-to-back calls."""
    gc.collect()
    t0 = time.perf_counter()
    for _ in range(iters):
        op()
    return iters / (time.perf_counter() - t0)


@dataclass
class Result:
    case: Case
    ops: dict[str, list[float]]

    def median(self, impl: str) -> float:
        return statistics.median(self.ops[impl])


ROUND_TRIP = ("kproxy", "kproxy+join", "kio")
PHASES = ("kproxy decode", "kio decode", "kproxy encode", "kio encode")


def run_ops(label: str, ops: dict[str, Callable[[], Any]], rounds: int, target: float,
            max_iters: int | None) -> dict[str, list[float]]:
    """Ops/s of each op per round; rounds interleave the ops and rotate which goes first."""
    names = tuple(ops)
    iters = {name: calibrate(op, target, max_iters) for name, op in ops.items()}
    res: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        k = r % len(names)  # rotate who goes first, so no side always runs on a warmer cache
        line = []
        for name in names[k:] + names[:k]:
            ops_s = measure(ops[name], iters[name])
            res[name].append(ops_s)
            line.append(f"{name} {ops_s:,.1f}")
        print(f"  {label} round {r + 1}/{rounds} (ops/s): {'; '.join(line)}", flush=True)
    return res


def run(cases: list[Case], names: tuple[str, ...], rounds: int, target: float,
        max_iters: int | None) -> list[Result]:
    results = []
    for case in cases:
        every = all_ops(case)
        ops = {name: every[name] for name in names}
        results.append(Result(case, run_ops(case.name, ops, rounds, target, max_iters)))
    return results


def _rate(ops: float, size: int) -> str:
    return f"{ops:>11,.1f} {ops * size / 1e6:>9,.0f}"


def table(results: list[Result]) -> str:
    """Round trips: kproxy, kproxy with its output joined, kio; ratios against kio."""
    head = (f"{'case':<18} {'body bytes':>11} | {'kproxy ops/s':>11} {'MB/s':>9} | {'+join ops/s':>11} "
            f"{'MB/s':>9} | {'kio ops/s':>11} {'MB/s':>9} | {'kproxy/kio':>10} {'+join/kio':>9}")
    lines = [head, "-" * len(head)]
    for res in results:
        size = len(res.case.body)
        kp, kj, ki = (res.median(name) for name in ROUND_TRIP)
        lines.append(f"{res.case.name:<18} {size:>11,} | {_rate(kp, size)} | {_rate(kj, size)} | "
                     f"{_rate(ki, size)} | {kp / ki:>9.2f}x {kj / ki:>8.2f}x")
    return "\n".join(lines)


def phase_table(results: list[Result]) -> str:
    """Each half alone: decode, and encode of an already decoded message."""
    head = (f"{'case':<18} | {'kproxy dec/s':>12} {'kio dec/s':>11} {'ratio':>7} | "
            f"{'kproxy enc/s':>12} {'kio enc/s':>11} {'ratio':>7}")
    lines = [head, "-" * len(head)]
    for res in results:
        kd, id_, ke, ie = (res.median(name) for name in PHASES)
        lines.append(f"{res.case.name:<18} | {kd:>12,.1f} {id_:>11,.1f} {kd / id_:>6.2f}x | "
                     f"{ke:>12,.1f} {ie:>11,.1f} {ke / ie:>6.2f}x")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Metadata of large clusters


SCALE_BROKERS = list(range(1, 51))
SCALE_SIZES = {  # name -> (topics, partitions per topic); 3 replicas over 50 brokers
    "metadata_10k": (500, 20),
    "metadata_100k": (5_000, 20),
}


@dataclass
class ScaleCase:
    name: str
    topics: int
    partitions: int  # in the whole response
    body: bytes


def scale_case(name: str) -> ScaleCase:
    n_topics, per_topic = SCALE_SIZES[name]
    body, _ = metadata_body(n_topics, per_topic, SCALE_BROKERS, seed=13)
    return ScaleCase(name, n_topics, n_topics * per_topic, body)


def _rewrite_brokers(body: Any) -> None:
    """What the address rewriter does to a Metadata response: every broker gets kproxy's endpoint."""
    for b in body.brokers:
        b.host, b.port = "kproxy.local", 30_000 + b.node_id


def scale_ops(case: ScaleCase) -> dict[str, Callable[[], Any]]:
    """decode; encode of a message decoded once; both; "proxy-like" (decode, rewrite every broker,
    read every topic name as a policy rule on topic names does, encode); "touch-all" (decode, read a
    field of every partition, encode: the cost when a filter walks everything); kio's native decode."""
    _, codec = response_codecs(3, 12)
    data, end = case.body, len(case.body)
    dec, enc = decoder_and_encoder(codec, data)
    read: Any = entity_reader(kio_metadata.MetadataResponse)

    def proxy_like() -> tuple[list[Any], list[str]]:
        obj = dec()
        _rewrite_brokers(obj)
        names = [t.name for t in obj.topics]
        return enc(obj), names

    def touch_all() -> list[Any]:
        obj = dec()
        leaders = 0
        for t in obj.topics:
            for p in t.partitions:
                leaders += p.leader_id
        return enc(obj)

    def kio_dec() -> Any:
        entity, size = read(data, 0)
        if size != end:
            raise AssertionError(f"{end - size} trailing bytes")
        return entity

    def kio_dec_no_gc() -> Any:
        # Most of a large decode's time can be CPython's cyclic GC walking the objects it creates;
        # without it kio is at its fastest: the strictest yardstick.
        gc.disable()
        try:
            return kio_dec()
        finally:
            gc.enable()

    return {"kproxy decode": dec, "kproxy encode": enc, "kproxy decode+encode": lambda: enc(dec()),
            "kproxy proxy-like": proxy_like, "kproxy touch-all": touch_all, "kio decode": kio_dec,
            "kio decode, gc off": kio_dec_no_gc}


def verify_scale(case: ScaleCase) -> None:
    """The round trips reproduce the input; proxy-like changes the brokers and nothing else."""
    ops = scale_ops(case)
    assert b"".join(ops["kproxy decode+encode"]()) == case.body, f"{case.name}: round trip differs"
    assert b"".join(ops["kproxy encode"]()) == case.body, f"{case.name}: encode differs"
    assert b"".join(ops["kproxy touch-all"]()) == case.body, f"{case.name}: touch-all differs"
    parts, names = ops["kproxy proxy-like"]()
    assert names == [f"orders.events-{t:03d}" for t in range(case.topics)]
    _, codec = response_codecs(3, 12)
    got, _ = codec.decode_checked(memoryview(b"".join(parts)), 0, len(b"".join(parts)))
    want, _ = codec.decode_checked(memoryview(case.body), 0, len(case.body))
    _rewrite_brokers(want)
    assert got.to_dict() == want.to_dict(), f"{case.name}: proxy-like changed more than the brokers"


def scale_table(cases: list[ScaleCase], results: list[dict[str, list[float]]]) -> str:
    """Median milliseconds per op, kio's native decode beside them (with and without the GC), and
    how kproxy's time compares with kio's decode."""
    ours = ("decode", "encode", "decode+encode", "proxy-like", "touch-all")
    head = (f"{'case':<14} {'partitions':>10} | " + " ".join(f"{c.replace('decode+encode', 'dec+enc'):>10}" for c in ours)
            + f" | {'kio dec':>8} {'gc off':>8} | "
            + " ".join(f"{c + '/kio':>14}" for c in ("dec+enc", "proxy-like", "touch-all"))
            + f" {'dec+enc/gc off':>14} | {'us/partition':>12}")
    lines = [head, "-" * len(head)]
    for case, res in zip(cases, results, strict=True):
        ms = {name: 1e3 / statistics.median(v) for name, v in res.items()}
        kio, kio_no_gc = ms["kio decode"], ms["kio decode, gc off"]
        vs = [kio / ms[f"kproxy {n}"] for n in ("decode+encode", "proxy-like", "touch-all")]
        lines.append(f"{case.name:<14} {case.partitions:>10,} | "
                     + " ".join(f"{ms[f'kproxy {n}']:>10.2f}" for n in ours)
                     + f" | {kio:>8.2f} {kio_no_gc:>8.2f} | " + " ".join(f"{v:>13.2f}x" for v in vs)
                     + f" {kio_no_gc / ms['kproxy decode+encode']:>13.2f}x"
                     + f" | {ms['kproxy decode+encode'] * 1e3 / case.partitions:>12.3f}")
    return "\n".join(lines)


def profile(ops: dict[str, Callable[[], Any]], name: str, impl: str, seconds: float = 1.0,
            top: int = 15) -> None:
    op = ops[impl]
    iters = calibrate(op, seconds, None)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        op()
    prof.disable()
    print(f"\n== cProfile: {impl} on {name}, {iters} calls, by own time")
    pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(top)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds per case (default 7)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 round, a few iterations")
    ap.add_argument("--codec", choices=("auto", "python", "native"), default="auto",
                    help="kproxy's codec: the native accelerator where built (auto), or force one")
    ap.add_argument("--lazy-min", type=int, metavar="N",
                    help="arrays of structs from N elements decode lazily (default: the codec's own)")
    ap.add_argument("--only", choices=("small", "scale"),
                    help="run only the three small cases, or only the Metadata-at-scale cases")
    ap.add_argument("--profile", metavar="CASE", action="append", default=[],
                    help="after the run, cProfile CASE on both sides ('all': every case)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    small_names = () if args.only == "scale" else ("metadata_v12_resp", "produce_v9_req", "fetch_v16_resp")
    scale_names = () if args.only == "small" else tuple(SCALE_SIZES)
    names = small_names + scale_names
    wanted = set(names) if "all" in args.profile else set(args.profile)
    if wanted - set(names):
        ap.error(f"unknown case(s) {sorted(wanted - set(names))}; choose from {list(names)} or 'all'")
    rounds = 1 if args.quick else args.rounds
    target, max_iters = (0.02, 3) if args.quick else (0.3, None)
    if hasattr(compiler, "set_codec"):
        compiler.set_codec(native=None if args.codec == "auto" else args.codec == "native",
                           lazy_min_items=args.lazy_min)
    elif args.codec != "auto" or args.lazy_min is not None:
        ap.error("this kproxy has one codec only: no --codec or --lazy-min")

    t0 = time.perf_counter()
    builders = {"metadata_v12_resp": metadata_case, "produce_v9_req": produce_case, "fetch_v16_resp": fetch_case}
    cases = [builders[n]() for n in small_names]
    for case in cases:
        verify(case)
    big = [scale_case(n) for n in scale_names]
    for sc in big:
        verify_scale(sc)
    print(f"python {sys.version.split()[0]}, kio {importlib.metadata.version('kio')} "
          f"({entity_reader.__module__} reader, Python writer); {codec_description()}; "
          f"bodies built and cross-checked in {time.perf_counter() - t0:.1f}s")
    for case in cases:
        print(f"  {case.name:<20} {len(case.body):>10,} bytes  {case.what}")
    for sc in big:
        print(f"  {sc.name:<20} {len(sc.body):>10,} bytes  Metadata v12: {sc.topics:,} topics x "
              f"{sc.partitions // sc.topics} partitions x 3 replicas, {len(SCALE_BROKERS)} brokers")
    print(f"{rounds} round(s), ~{target}s per measurement; medians over rounds\n")

    if cases:
        print("round trip: decode + encode")
        results = run(cases, ROUND_TRIP, rounds, target, max_iters)
        print("\nphases: decode alone, encode alone (of a message decoded once, before timing)")
        phases = run(cases, PHASES, rounds, target, max_iters)
    if big:
        print("\nMetadata at scale")
        every = [scale_ops(sc) for sc in big]
        scaled = [run_ops(sc.name, ops, rounds, target, max_iters) for sc, ops in zip(big, every, strict=True)]
    if cases:
        print(f"\n== round trip (decode + encode), median of {rounds} round(s)")
        print(table(results))
        print("MB/s = body bytes x ops/s / 1e6. kproxy's output is a list of buffers, its records fields are"
              "\nviews of the input (zero copy); +join copies that list into one bytes object, as kio's BytesIO"
              "\nholds one contiguous copy.")
        print(f"\n== phases, median of {rounds} round(s)")
        print(phase_table(phases))
        below = [f"{r.case.name} ({name})" for r in results + phases for name in r.ops
                 if name.startswith("kproxy") and r.median(name) < r.median(name.replace("kproxy+join", "kio")
                                                                            .replace("kproxy", "kio"))]
        print(f"\nkproxy below kio on: {', '.join(below)}" if below else "\nkproxy >= kio on every case")
    if big:
        print(f"\n== Metadata v12 at scale: median milliseconds of {rounds} round(s)")
        print(scale_table(big, scaled))
        print("proxy-like = decode, rewrite every broker's host and port, read every topic name, encode;"
              "\ntouch-all = decode, read a field of every partition, encode. kio dec = kio's native decode"
              "\nalone; gc off = the same with Python's cyclic GC disabled. X/kio = kio's decode time /"
              "\nkproxy's time for X (>= 1.00x: kproxy is at least as fast); us/partition = dec+enc per partition.")

    for case in cases:
        if case.name in wanted:
            for impl in ("kproxy", "kio"):
                profile(all_ops(case), case.name, impl, 0.3 if args.quick else 1.0)
                profile(all_ops(case), case.name, impl + " decode", 0.3 if args.quick else 1.0)
    for sc in big:
        if sc.name in wanted:
            for impl in ("kproxy decode+encode", "kproxy proxy-like", "kproxy touch-all", "kio decode"):
                profile(scale_ops(sc), sc.name, impl, 0.3 if args.quick else 1.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())

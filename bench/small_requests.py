"""Many clients, small requests: requests per second and latency of small round trips from many
concurrent connections, the load generator for bench/proxy.py's ``--small-clients`` case.

Seven loops (``kind``): ``metadata``, a Metadata v12 request with no topics; ``produce``, a Produce
v9 request with acks=1 carrying one record of 100 bytes to partition 0 of a topic that must exist;
``produce-v11``, the same as Produce v11 (whose answer may carry KIP-951's node_endpoints, the
newest version tansu speaks); ``heartbeat``, a Heartbeat v4 for a group the broker does not know (an
idle consumer's request); ``fetch``, a Fetch v12 from offset 0 of partition 0 of a topic that must
hold one small batch there (its answer is that batch); ``fetch-empty``, a Fetch v12 from far past the
end with max_wait_ms 0 (a consumer's long poll that finds nothing; tansu answers it with no
partitions); ``fetch-v16``, the ``fetch`` loop in Fetch v16, the version librdkafka speaks to tansu
(by topic id: ``topic`` is then the topic's id; the address rewriter reads v16+ answers for KIP-951's
node_endpoints).
Each load process drives its share of the connections with a selector loop over raw sockets (no
client library, so the generator itself stays cheap): every connection keeps exactly one request in
flight and sends the next as soon as the answer is whole. The first answer on each connection is
decoded and checked (a Produce answer must carry no error), the rest are only counted.

Run alone:  ``.venv/bin/python bench/small_requests.py HOST:PORT [--clients 200] [--seconds 5]
[--kind produce --topic NAME]``
"""

from __future__ import annotations

import argparse
import multiprocessing
import selectors
import socket
import statistics
import struct
import time
from dataclasses import dataclass

_I32 = struct.Struct(">i")
KINDS = ("metadata", "produce", "heartbeat", "produce-v11", "fetch", "fetch-empty", "fetch-v16")
# The Produce version of each produce loop.
PRODUCE_VERSIONS = {"produce": 9, "produce-v11": 11}
PRODUCE_VALUE_BYTES = 100


def metadata_v12_request(correlation_id: int) -> bytes:
    # Header v2: api key 3, version 12, correlation id, client id "bench", no tagged fields; body:
    # topics an empty compact array (1; 0 would be null, "all topics"), allow_auto_topic_creation
    # false, include_topic_authorized_operations false, no tagged fields.
    client_id = b"bench"
    header = struct.pack(">hhih", 3, 12, correlation_id, len(client_id)) + client_id + b"\x00"
    body = b"\x01" + b"\x00" + b"\x00" + b"\x00"
    frame = header + body
    return _I32.pack(len(frame)) + frame


def produce_v9_request(correlation_id: int, topic: str, version: int = 9) -> bytes:
    """Produce v9 (or ``version``, 9-12), acks=1, one RecordBatch v2 holding one record of
    ``PRODUCE_VALUE_BYTES`` bytes."""
    from kproxy.protocol.messages import Request, body_class, encode_request_frame
    from kproxy.protocol.records import build_batch

    cls = body_class(0, "request")
    batch = build_batch([(None, b"v" * PRODUCE_VALUE_BYTES)], base_timestamp=1_700_000_000_000)
    body = cls(transactional_id=None, acks=1, timeout_ms=30_000, topic_data=[
        cls.TopicProduceData(name=topic, partition_data=[cls.PartitionProduceData(index=0, records=batch)])])
    return b"".join(bytes(b) for b in encode_request_frame(Request.build(0, version, correlation_id, "bench", body)))


def heartbeat_v4_request(correlation_id: int, group: str = "bench-group") -> bytes:
    """Heartbeat v4 for a group the broker does not know (a consumer between polls: the answer is an
    error code, the round trip is whole)."""
    from kproxy.protocol.messages import Request, body_class, encode_request_frame

    body = body_class(12, "request")(group_id=group, generation_id=1, member_id="member-1")
    return b"".join(bytes(b) for b in encode_request_frame(Request.build(12, 4, correlation_id, "bench", body)))


def fetch_v12_request(correlation_id: int, topic: str, offset: int = 0, max_wait_ms: int = 100,
                      version: int = 12) -> bytes:
    """Fetch v12 (the last version naming topics) of partition 0 of ``topic`` from ``offset``, up to
    1 MiB, answered as soon as one byte is there; from v13 ``topic`` is the topic's id."""
    import uuid

    from kproxy.protocol.messages import Request, body_class, encode_request_frame

    cls = body_class(1, "request")
    named = {"topic": topic} if version < 13 else {"topic_id": uuid.UUID(topic)}
    body = cls(max_wait_ms=max_wait_ms, min_bytes=1, max_bytes=1 << 20, isolation_level=0, topics=[
        cls.FetchTopic(**named, partitions=[cls.FetchPartition(partition=0, fetch_offset=offset,
                                                               partition_max_bytes=1 << 20)])])
    return b"".join(bytes(b) for b in encode_request_frame(Request.build(1, version, correlation_id, "bench", body)))


def _topic(kind: str, topic: str | None) -> str:
    if not topic:
        raise ValueError(f"the {kind} loop needs a topic")
    return topic


def request_for(kind: str, topic: str | None) -> bytes:
    if kind == "metadata":
        return metadata_v12_request(1)
    if kind == "heartbeat":
        return heartbeat_v4_request(1)
    if kind == "fetch":
        return fetch_v12_request(1, _topic(kind, topic))
    if kind == "fetch-empty":
        return fetch_v12_request(1, _topic(kind, topic), offset=1 << 40, max_wait_ms=0)
    if kind == "fetch-v16":
        return fetch_v12_request(1, _topic(kind, topic), version=16)
    if kind in PRODUCE_VERSIONS:
        return produce_v9_request(1, _topic(kind, topic), PRODUCE_VERSIONS[kind])
    raise ValueError(f"unknown kind {kind!r}; one of {', '.join(KINDS)}")


def check_answer(kind: str, frame: bytes) -> None:
    """The first answer of a connection must be a good one: a Metadata naming brokers, a Produce
    acknowledged without error."""
    from kproxy.protocol.messages import decode_response

    if kind == "heartbeat":
        decode_response(memoryview(frame), 12, 4)       # any error code: the group is unknown
        return
    if kind in ("fetch", "fetch-empty", "fetch-v16"):
        resp = decode_response(memoryview(frame), 1, 16 if kind == "fetch-v16" else 12)
        got = [p for t in resp.body.responses for p in t.partitions]
        if kind != "fetch-empty" and (not got or got[0].error_code or not got[0].records):
            raise SystemExit(f"a Fetch answer without records: {resp!r}")
        return
    resp = decode_response(memoryview(frame), 3 if kind == "metadata" else 0,
                           12 if kind == "metadata" else PRODUCE_VERSIONS[kind])
    if kind == "metadata":
        if not resp.body.brokers:
            raise SystemExit(f"a Metadata answer without brokers: {resp!r}")
        return
    errors = [p.error_code for t in resp.body.responses for p in t.partition_responses if p.error_code]
    if errors or not resp.body.responses:
        raise SystemExit(f"a Produce answer with errors {errors}: {resp!r}")


@dataclass
class _Conn:
    sock: socket.socket
    buf: bytearray
    sent_at: float = 0.0
    checked: bool = False


def _worker(host: str, port: int, clients: int, seconds: float, warmup: float,
            out: multiprocessing.Queue, kind: str = "metadata", topic: str | None = None) -> None:  # type: ignore[type-arg]
    sel = selectors.DefaultSelector()
    request = request_for(kind, topic)
    conns = []
    for _ in range(clients):
        s = socket.create_connection((host, port), timeout=10)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.setblocking(False)
        c = _Conn(s, bytearray())
        conns.append(c)
        sel.register(s, selectors.EVENT_READ, c)
    start = time.perf_counter()
    measure_from = start + warmup
    end = measure_from + seconds
    for c in conns:
        c.sent_at = time.perf_counter()
        c.sock.send(request)
    done = 0
    answers = 0            # warm-up included: what the proxy's CPU time is divided by
    latencies: list[float] = []
    longest_gap = 0.0
    last_answer = measure_from
    while True:
        now = time.perf_counter()
        if now >= end:
            break
        for key, _ in sel.select(timeout=0.5):
            c = key.data
            chunk = c.sock.recv(65536)
            if not chunk:
                raise SystemExit("a connection was closed by the server")
            c.buf += chunk
            while len(c.buf) >= 4:
                (size,) = _I32.unpack_from(c.buf, 0)
                if len(c.buf) < 4 + size:
                    break
                if not c.checked:
                    check_answer(kind, bytes(c.buf[4 : 4 + size]))
                    c.checked = True
                del c.buf[: 4 + size]
                answers += 1
                t = time.perf_counter()
                if t >= measure_from:
                    done += 1
                    latencies.append(t - c.sent_at)
                    longest_gap = max(longest_gap, t - last_answer)
                    last_answer = t
                c.sent_at = t
                c.sock.send(request)
    for c in conns:
        c.sock.close()
    out.put((done, latencies, longest_gap, answers))


@dataclass
class LoadResult:
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    longest_gap_ms: float     # the longest time no answer at all arrived, over all connections
    answers_total: int = 0    # every answer, the warm-up's included


def run_load(address: str, clients: int = 200, seconds: float = 5.0, procs: int = 2,
             warmup: float = 1.0, kind: str = "metadata", topic: str | None = None) -> LoadResult:
    host, port = address.rsplit(":", 1)
    ctx = multiprocessing.get_context("fork")
    out: multiprocessing.Queue = ctx.Queue()  # type: ignore[type-arg]
    shares = [clients // procs + (1 if i < clients % procs else 0) for i in range(procs)]
    workers = [ctx.Process(target=_worker, args=(host, int(port), n, seconds, warmup, out, kind, topic))
               for n in shares if n]
    for w in workers:
        w.start()
    results = [out.get(timeout=seconds + warmup + 60) for _ in workers]
    for w in workers:
        w.join()
    done = sum(r[0] for r in results)
    lat = sorted(x for r in results for x in r[1])
    if not lat:
        raise RuntimeError(f"no answers from {address}")
    return LoadResult(done / seconds, statistics.median(lat) * 1000, lat[int(0.99 * (len(lat) - 1))] * 1000,
                      max(r[2] for r in results) * 1000, sum(r[3] for r in results))


def main() -> None:
    ap = argparse.ArgumentParser(description="Metadata v12 round trips from many connections.")
    ap.add_argument("address")
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--kind", choices=KINDS, default="metadata")
    ap.add_argument("--topic", help="the topic the produce loop writes to (it must exist), or the fetch loop reads")
    args = ap.parse_args()
    r = run_load(args.address, args.clients, args.seconds, args.procs, kind=args.kind, topic=args.topic)
    print(f"{args.clients} clients, {args.kind}: {r.requests_per_s:,.0f} requests/s, p50 {r.p50_ms:.2f} ms, "
          f"p99 {r.p99_ms:.2f} ms")


if __name__ == "__main__":
    main()

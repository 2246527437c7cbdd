"""``kproxy demo --plain``: an embedded tansu broker, kproxy in front of it, and kafka-python talking only to kproxy.

It creates a topic, produces keyed records with acks=all, reads them back with a consumer group, checks
every record, and prints what ran where and what kproxy saw per API. It is a tour and a smoke test, not
a benchmark; the broker child process never outlives it, Ctrl-C included.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kproxy.config import config_from_args
from kproxy.localports import PortError, free_port_run
from kproxy.server.embedded import ProxyThread
from kproxy.tansu import HOST, Tansu, TansuError

PARTITIONS = 3
# One broker needs one exposed port; a few spare ones keep the range honest without hunting for 64.
BROKER_PORT_COUNT = 4
# tansu holds a group's first JoinGroup for the rebalance timeout; 6 s makes a join take ~3 s (docs/testing.md).
SESSION_TIMEOUT_MS = 6000
MAX_POLL_INTERVAL_MS = 6000
HEARTBEAT_INTERVAL_MS = 1000
STEP_TIMEOUT_S = 15.0  # upper bound for producing, and for consuming, so a broken run ends on its own
CLIENT_TIMEOUT_MS = 10_000


class DemoError(Exception):
    """A step of the demo failed; the message says which and why, for the user to read."""


# --------------------------------------------------------------------------------------------------
# Ports for kproxy


def _free_port_run(count: int) -> int:
    """A port P such that P..P+count-1 are free: kproxy's listen and broker ports (kproxy.localports)."""
    try:
        return free_port_run(count, HOST)
    except PortError as e:
        raise DemoError(str(e)) from None


# --------------------------------------------------------------------------------------------------
# The client side (kafka-python, through kproxy only)


def _import_kafka() -> Any:
    with warnings.catch_warnings():
        # kafka-python 3.0 loads its schemas with importlib.resources calls deprecated in 3.11.
        warnings.simplefilter("ignore", DeprecationWarning)
        import kafka
        import kafka.admin
    return kafka


def demo_records(n: int) -> dict[bytes, tuple[bytes, tuple[tuple[str, bytes], ...]]]:
    """key -> (value, headers) for the n records produced; values vary in size (40..~400 bytes)."""
    out: dict[bytes, tuple[bytes, tuple[tuple[str, bytes], ...]]] = {}
    for i in range(n):
        key = b"key-%06d" % i
        value = (b"value-%06d|" % i) * (3 + i % 30)
        out[key] = (value, (("seq", str(i).encode()),))
    return out


@dataclass
class RunResult:
    topic: str
    cluster_brokers: list[tuple[int, str, int]]
    produced: int
    produce_s: float
    consumed: int
    join_s: float
    consume_s: float
    missing: int
    altered: int
    duplicates: int


def run_clients(kafka: Any, bootstrap: str, n: int) -> RunResult:
    topic = f"kproxy-demo-{uuid.uuid4().hex[:8]}"
    client_id = f"kproxy-demo-{uuid.uuid4().hex[:6]}"

    admin = kafka.KafkaAdminClient(bootstrap_servers=bootstrap, client_id=client_id,
                                   request_timeout_ms=CLIENT_TIMEOUT_MS)
    try:
        admin.create_topics([kafka.admin.NewTopic(topic, PARTITIONS, 1)])
        cluster = admin.describe_cluster()
    finally:
        admin.close()
    brokers = [(int(b["broker_id"]), str(b["host"]), int(b["port"])) for b in cluster["brokers"]]

    records = demo_records(n)
    producer = kafka.KafkaProducer(
        bootstrap_servers=bootstrap, client_id=client_id, acks="all", linger_ms=5,
        enable_idempotence=True,  # kafka-python 3.0's default, said aloud: InitProducerId goes through too
        max_block_ms=int(STEP_TIMEOUT_S * 1000), request_timeout_ms=CLIENT_TIMEOUT_MS,
        delivery_timeout_ms=int(STEP_TIMEOUT_S * 1000),
    )
    try:
        started = time.perf_counter()
        futures = [producer.send(topic, key=k, value=v, headers=list(h)) for k, (v, h) in records.items()]
        producer.flush(timeout=STEP_TIMEOUT_S)
        for future in futures:
            future.get(timeout=STEP_TIMEOUT_S)  # raises the delivery error, if any
        produce_s = time.perf_counter() - started
    except kafka.errors.KafkaError as e:
        raise DemoError(f"producing failed: {e!r}") from e
    finally:
        producer.close(timeout=5)

    consumer = kafka.KafkaConsumer(
        bootstrap_servers=bootstrap, client_id=client_id, group_id=f"{topic}-group",
        auto_offset_reset="earliest", enable_auto_commit=False,
        session_timeout_ms=SESSION_TIMEOUT_MS, max_poll_interval_ms=MAX_POLL_INTERVAL_MS,
        heartbeat_interval_ms=HEARTBEAT_INTERVAL_MS, request_timeout_ms=CLIENT_TIMEOUT_MS,
    )
    seen: dict[bytes, tuple[bytes, tuple[tuple[str, bytes], ...]]] = {}
    duplicates = 0
    joined: list[float] = []  # when the group first gave this member partitions

    class MarkJoin(kafka.ConsumerRebalanceListener):
        def on_partitions_revoked(self, revoked: Any) -> None:
            pass

        def on_partitions_assigned(self, assigned: Any) -> None:
            if assigned and not joined:
                joined.append(time.perf_counter())

    try:
        consumer.subscribe([topic], listener=MarkJoin())
        started = last = time.perf_counter()
        deadline = started + STEP_TIMEOUT_S
        while len(seen) < n and time.perf_counter() < deadline:
            for messages in consumer.poll(timeout_ms=200).values():
                for m in messages:
                    if m.key in seen:
                        duplicates += 1
                    seen[m.key] = (m.value, tuple((k, v) for k, v in m.headers or ()))
                last = time.perf_counter()
        if not joined:
            raise DemoError(f"the consumer group gave no partitions within {STEP_TIMEOUT_S:g}s")
        if seen:
            consumer.commit()  # OffsetCommit through kproxy too
    finally:
        consumer.close()

    missing = sum(1 for k in records if k not in seen)
    altered = sum(1 for k, v in seen.items() if k in records and records[k] != v)
    unexpected = sum(1 for k in seen if k not in records)
    join_s = joined[0] - started
    return RunResult(topic, brokers, len(futures), produce_s, len(seen), join_s,
                     max(0.0, last - joined[0]), missing, altered + unexpected, duplicates)


# --------------------------------------------------------------------------------------------------
# The summary


@dataclass(frozen=True)
class ApiRow:
    name: str
    count: int
    request_bytes: int
    response_bytes: int
    mean_ms: float
    p99_ms: float


def kafka_api_name(name: str) -> str:
    """Kafka's own spelling of an API name: ``api_versions`` -> ``ApiVersions``."""
    return "".join(word.capitalize() for word in name.split("_"))


def snapshot_stats(server: Any) -> tuple[list[ApiRow], int]:
    """Per-API rows (busiest first) and the connection count; run on the proxy's loop, so no races."""
    rows = []
    for name, s in server.stats.apis.items():
        lat = sorted(s.latencies)
        p99 = lat[max(0, math.ceil(0.99 * len(lat)) - 1)] if lat else 0.0  # nearest rank
        mean = s.latency_sum / s.count if s.count else 0.0
        rows.append(ApiRow(kafka_api_name(name), s.count, s.request_bytes, s.response_bytes, mean * 1000, p99 * 1000))
    rows.sort(key=lambda r: (-r.count, r.name))
    return rows, server.stats.connections_total


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024 or unit == "MiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def format_table(rows: list[ApiRow]) -> list[str]:
    head = ("API", "count", "bytes in", "bytes out", "mean ms", "p99 ms")
    body = [(r.name, str(r.count), _size(r.request_bytes), _size(r.response_bytes),
             f"{r.mean_ms:.2f}", f"{r.p99_ms:.2f}") for r in rows]
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]

    def line(cells: tuple[str, ...]) -> str:
        first = cells[0].ljust(widths[0])
        return "  " + "  ".join([first, *(c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))])

    return [line(head), "  " + "-" * (sum(widths) + 2 * (len(widths) - 1)), *(line(b) for b in body)]


def _rate(n: int, seconds: float) -> str:
    return f"{n / seconds:,.0f} records/s" if seconds > 0 else "n/a"


# --------------------------------------------------------------------------------------------------
# The command


@contextlib.contextmanager
def _quiet_logging() -> Iterator[None]:
    """Warnings only from kproxy, nothing but errors from kafka-python; levels restored afterwards."""
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    levels = {name: logging.getLogger(name).level for name in ("kproxy", "kafka")}
    logging.getLogger("kproxy").setLevel(logging.WARNING)
    # kafka-python logs reconnects and group churn at WARNING; a failure still surfaces as an exception.
    logging.getLogger("kafka").setLevel(logging.ERROR)
    try:
        yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def run_demo(args: Any) -> int:
    """``kproxy demo``: the product tour (``kproxy.tour``), or with ``--plain`` the round trip below."""
    n = int(args.records)
    if n < 1:
        print("kproxy demo: --records must be at least 1", file=sys.stderr)
        return 2
    with _quiet_logging():
        try:
            if not getattr(args, "plain", False):
                from kproxy.tour import run_tour

                return run_tour(getattr(args, "out", None), report=not getattr(args, "no_report", False))
            return _run(n)
        except DemoError as e:
            print(f"kproxy demo: FAILED: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("kproxy demo: interrupted; broker and proxy stopped", file=sys.stderr)
            return 130
        except Exception as e:
            print(f"kproxy demo: FAILED: {type(e).__name__}: {e}", file=sys.stderr)
            return 1


@contextlib.contextmanager
def _embedded_broker() -> Iterator[str]:
    """A tansu broker for the block, stopped on the way out (Ctrl-C included); its bootstrap address."""
    try:
        tansu = Tansu().start()
    except TansuError as e:
        raise DemoError(str(e)) from None
    try:
        yield tansu.bootstrap
    finally:
        tansu.stop()


def _run(n: int) -> int:
    wall = time.perf_counter()
    kafka = _import_kafka()
    print(f"kproxy demo: {n} records through kproxy to an embedded tansu broker\n", flush=True)
    with _embedded_broker() as broker:
        # Chosen after the broker binds, so kproxy's range cannot collide with it.
        listen = _free_port_run(1 + BROKER_PORT_COUNT)
        config = config_from_args(
            broker, f"{HOST}:{listen}", log_level="WARNING",
            exposure={"advertised_host": HOST, "broker_port_count": BROKER_PORT_COUNT},
        )
        with ProxyThread(config) as proxy:
            result = run_clients(kafka, proxy.bootstrap, n)
            exposed = proxy.call(proxy.server.address_map.exposed_ports)
            rows, connections = proxy.call(lambda: snapshot_stats(proxy.server))
            bootstrap = proxy.bootstrap
    wall = time.perf_counter() - wall

    seen_by_client = ", ".join(f"node {i} at {h}:{p}" for i, h, p in result.cluster_brokers) or "none"
    proxied = bool(result.cluster_brokers) and all(
        f"{h}:{p}" != broker and h == HOST and p in exposed for _, h, p in result.cluster_brokers)
    lines = [
        "What ran where",
        f"  tansu broker           {broker}  (embedded, memory storage)",
        f"  kproxy bootstrap       {bootstrap}",
        f"  kproxy broker ports    {', '.join(str(p) for p in exposed) or 'none'}",
        f"  client sees brokers    {seen_by_client}"
        + ("  (kproxy's, not the broker's)" if proxied else "  (NOT kproxy's!)"),
        "",
        "Workload (kafka-python, through kproxy only)",
        f"  topic                  {result.topic} ({PARTITIONS} partitions)",
        f"  produced               {result.produced} records, acks=all, in {result.produce_s:.2f} s"
        f"  ({_rate(result.produced, result.produce_s)})",
        f"  consumer group join    {result.join_s:.2f} s  (tansu holds the first JoinGroup; see docs/testing.md)",
        f"  consumed               {result.consumed} records in {result.consume_s:.2f} s after the join"
        f"  ({_rate(result.consumed, result.consume_s)})",
        "",
        f"What kproxy saw ({connections} client connections)",
        *format_table(rows),
        "  bytes in: requests from clients; bytes out: responses to them; latency: request in to",
        "  response out at kproxy (JoinGroup includes the broker's rebalance wait)",
        "",
    ]
    print("\n".join(lines))

    problems = []
    if result.missing:
        problems.append(f"{result.missing} of {n} records never came back")
    if result.altered:
        problems.append(f"{result.altered} records came back different from what was sent")
    if not proxied:
        problems.append(f"the client was given a broker address that is not kproxy's: {seen_by_client}")
    if problems:
        print(f"records check: FAILED: {'; '.join(problems)}")
        print(f"kproxy demo: FAILED: {'; '.join(problems)}", file=sys.stderr)
        return 1
    dup = f" ({result.duplicates} re-deliveries ignored)" if result.duplicates else ""
    print(f"records check: PASSED: all {n} records came back with the keys, values and headers sent{dup}")
    print(f"done in {wall:.1f} s")
    return 0

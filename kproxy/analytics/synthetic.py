"""Synthetic traffic logs that follow kproxy's traffic log schema, with the answers they should give.

The benchmark and the tests use it: a realistic mix of producers, consumer groups, admin tools and
a few legacy clients on versions Apache Kafka 4.0 removed, with offsets that line up between produce
and fetch. It is plain Python (no Spark), deterministic for a seed, and records the exact totals it
wrote in a ``Truth`` so a test can compare the report with them.
"""

from __future__ import annotations

import bisect
import datetime as dt
import gzip
import json
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from kproxy.analytics.removed_versions import KAFKA_4_0_MINIMUM_VERSIONS

UTC = dt.UTC
EPOCH = dt.datetime(1970, 1, 1, tzinfo=UTC)


def rfc3339(t: dt.datetime) -> str:
    """The traffic log's time format: RFC 3339, UTC, microseconds."""
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def epoch_ms(t: dt.datetime) -> int:
    return (t - EPOCH) // dt.timedelta(milliseconds=1)


def partition_dir(root: Path, t: dt.datetime) -> Path:
    return root / f"dt={t:%Y-%m-%d}" / f"hour={t:%H}"


class LogWriter:
    """Writes lines into ``dt=/hour=`` directories by the hour each line was written, which is when
    its request completed (ts + duration_ms), as kproxy's writer does."""

    def __init__(self, root: Path, name: str = "part-0", gz: bool = False) -> None:
        self.root, self.name, self.gz = Path(root), name, gz
        self.files: dict[tuple[str, str], IO[str]] = {}
        self.lines = 0

    def write(self, line: dict[str, Any]) -> None:
        ts = dt.datetime.fromisoformat(line["ts"])
        done = ts + dt.timedelta(milliseconds=line["duration_ms"])
        key = (f"{done:%Y-%m-%d}", f"{done:%H}")
        f = self.files.get(key)
        if f is None:
            d = partition_dir(self.root, done)
            d.mkdir(parents=True, exist_ok=True)
            path = d / f"{self.name}.jsonl{'.gz' if self.gz else ''}"
            # Kept open across writes (one per hour); close() closes them.
            f = (gzip.open(path, "at", compresslevel=1, encoding="utf-8") if self.gz  # noqa: SIM115
                 else path.open("a", encoding="utf-8"))
            self.files[key] = f
            if len(self.files) > 3:  # lines arrive in ts order; an hour two behind is finished
                oldest = min(self.files)
                self.files.pop(oldest).close()
        f.write(json.dumps(line, separators=(",", ":")))
        f.write("\n")
        self.lines += 1

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.files.clear()

    def __enter__(self) -> LogWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_log(root: Path, lines: Iterable[dict[str, Any]], name: str = "part-0", gz: bool = False) -> int:
    with LogWriter(root, name, gz) as w:
        for line in lines:
            w.write(line)
        return w.lines


@dataclass
class Truth:
    """What the generator wrote, counted as the report must count it."""

    requests: int = 0
    produce_bytes: int = 0
    fetch_bytes: int = 0
    produced_records: int = 0
    fetched_records: int = 0
    clients: set[str] = field(default_factory=set)
    topics: set[str] = field(default_factory=set)
    removed_version_users: set[str] = field(default_factory=set)
    requests_by_client: dict[str, int] = field(default_factory=dict)
    denials_by_rule: dict[str, int] = field(default_factory=dict)
    versions_used: dict[tuple[str, str, int], int] = field(default_factory=dict)
    first_ts: dt.datetime | None = None
    last_ts: dt.datetime | None = None

    def count(self, line: dict[str, Any]) -> None:
        self.requests += 1
        cid = line["client_id"]
        if cid is not None:
            self.clients.add(cid)
            self.requests_by_client[cid] = self.requests_by_client.get(cid, 0) + 1
            used = (cid, line["api"], line["api_version"])
            self.versions_used[used] = self.versions_used.get(used, 0) + 1
            if line["api_version"] < KAFKA_4_0_MINIMUM_VERSIONS.get(line["api"], 0):
                self.removed_version_users.add(cid)
        self.topics.update(line.get("topics") or ())
        for p in line.get("partitions") or ():
            if line["api"] == "produce":
                self.produce_bytes += p["bytes"]
                self.produced_records += p["records"]
            else:
                self.fetch_bytes += p["bytes"]
                self.fetched_records += p["records"]
        if line.get("action") == "deny":
            self.denials_by_rule[line["rule"]] = self.denials_by_rule.get(line["rule"], 0) + 1
        ts = dt.datetime.fromisoformat(line["ts"])
        self.first_ts = ts if self.first_ts is None else min(self.first_ts, ts)
        self.last_ts = ts if self.last_ts is None else max(self.last_ts, ts)


def base_line(ts: dt.datetime, client_id: str | None, api: str, api_version: int, **extra: Any) -> dict[str, Any]:
    """A forwarded request line with every required field; ``extra`` overrides or adds fields."""
    line: dict[str, Any] = {
        "ts": rfc3339(ts), "conn": 1, "proxy": "kproxy-test:1", "client_address": "10.0.0.1:50000",
        "client_id": client_id, "principal": None, "client_software_name": None,
        "client_software_version": None, "listener": "broker-1", "api": api, "api_version": api_version,
        "correlation_id": 0, "broker": "broker-1:9092", "outcome": "forwarded", "request_bytes": 100,
        "response_bytes": 100, "duration_ms": 1.0, "queued_ms": 0.1, "broker_ms": 0.8, "return_ms": 0.1,
        "throttle_ms": 0, "error_code": 0, "error": None, "topics": [],
    }
    line.update(extra)
    return line


# ---- the realistic mix -------------------------------------------------------------------------

_TOPIC_WORDS = ("orders", "payments", "clicks", "inventory", "shipments", "audit", "sessions", "metrics",
                "invoices", "users", "search", "alerts")
_MODERN = (("apache-kafka-java", "3.7.1"), ("apache-kafka-java", "3.9.0"), ("librdkafka", "2.3.0"),
           ("librdkafka", "2.6.1"), ("confluent-kafka-python", "2.5.0"), ("kafka-python", "2.2.3"))
# Legacy clients send no ApiVersions v3, so kproxy learns no software name for them.
_LEGACY = (("legacy-sarama", {"produce": 2, "fetch": 3, "metadata": 1, "offset_commit": 1}),
           ("legacy-kafka-python-1", {"produce": 2, "fetch": 3, "metadata": 0, "offset_fetch": 0}),
           ("legacy-admin", {"metadata": 1, "create_topics": 1, "describe_configs": 0}))
_MODERN_VERSIONS = {"produce": 9, "fetch": 13, "metadata": 12, "heartbeat": 4, "offset_commit": 8,
                    "offset_fetch": 8, "find_coordinator": 4, "join_group": 9, "sync_group": 5,
                    "list_offsets": 7, "api_versions": 3, "init_producer_id": 4, "describe_configs": 4,
                    "create_topics": 7, "delete_topics": 6, "list_groups": 4}
_ROLE_APIS = {
    "producer": (("produce", 85), ("metadata", 10), ("api_versions", 3), ("init_producer_id", 2)),
    "consumer": (("fetch", 72), ("heartbeat", 10), ("offset_commit", 9), ("metadata", 4),
                 ("find_coordinator", 2), ("list_offsets", 1), ("join_group", 1), ("sync_group", 1)),
    "admin": (("metadata", 50), ("describe_configs", 20), ("list_groups", 15), ("create_topics", 5),
              ("delete_topics", 10)),
}
_API_KEYS = {"produce": 0, "fetch": 1, "list_offsets": 2, "metadata": 3, "offset_commit": 8, "offset_fetch": 9,
             "find_coordinator": 10, "join_group": 11, "heartbeat": 12, "sync_group": 14, "list_groups": 16,
             "api_versions": 18, "create_topics": 19, "delete_topics": 20, "init_producer_id": 22,
             "describe_configs": 32}


@dataclass
class _Client:
    client_id: str
    role: str
    software: tuple[str, str] | None
    principal: str | None
    topics: list[str]
    group: str | None
    versions: dict[str, int]
    apis: list[str]
    weights: list[int]
    conn: int
    proxy: str
    correlation_id: int = 0


class _Partition:
    """Offsets of one topic partition: what producers appended and when it was acknowledged."""

    __slots__ = ("acked_at", "ends", "next_offset", "positions")

    def __init__(self) -> None:
        self.next_offset = 0
        self.ends: list[int] = []        # last offset + 1 of each appended batch
        self.acked_at: list[float] = []  # ack time (epoch s) of each batch, increasing
        self.positions: dict[str, int] = {}  # consumer group -> next offset to deliver

    def visible_end(self, now: float) -> int:
        i = bisect.bisect_right(self.acked_at, now)
        return self.ends[i - 1] if i else 0


def generate(lines: int, start: dt.datetime, hours: float = 2.0, seed: int = 1, clients: int = 60,
             topics: int = 24, partitions_per_topic: int = 6) -> Iterator[dict[str, Any]]:
    """Yields ``lines`` traffic log lines in ts order, spread over ``hours`` from ``start``."""
    rnd = random.Random(seed)
    topic_names = [f"{_TOPIC_WORDS[i % len(_TOPIC_WORDS)]}-{i // len(_TOPIC_WORDS)}" for i in range(topics)]
    record_size = {t: rnd.choice((120, 300, 800, 1500)) for t in topic_names}
    parts = {(t, p): _Partition() for t in topic_names for p in range(partitions_per_topic)}
    proxies = ("kproxy-a:101", "kproxy-b:202")
    roster: list[_Client] = []
    for i in range(clients):
        role = "producer" if i % 5 in (0, 1) else "consumer" if i % 5 in (2, 3) else "admin"
        if role == "admin" and i % 10 != 4:
            role = "consumer"
        mine = rnd.sample(topic_names, k=min(len(topic_names), rnd.randint(1, 3)))
        apis, weights = zip(*_ROLE_APIS[role], strict=True)
        roster.append(_Client(
            client_id=f"{role}-{i:03d}", role=role, software=rnd.choice(_MODERN),
            principal=f"User:team-{i % 7}" if i % 3 else None, topics=mine,
            group=f"group-{i % 6}" if role == "consumer" else None, versions=dict(_MODERN_VERSIONS),
            apis=list(apis), weights=list(weights), conn=i + 1, proxy=proxies[i % 2]))
    for j, (name, versions) in enumerate(_LEGACY):
        role = "admin" if "admin" in name else "producer" if j == 0 else "consumer"
        used = [a for a, _ in _ROLE_APIS[role] if a in versions] or list(versions)
        roster.append(_Client(
            client_id=name, role=role, software=None, principal=None, topics=topic_names[:2],
            group="legacy-group" if role == "consumer" else None, versions={**_MODERN_VERSIONS, **versions},
            apis=used, weights=[1] * len(used), conn=1000 + j, proxy=proxies[0]))
    # Producers and consumers of the same topics are what make end-to-end latency measurable.
    for c in roster:
        if c.role == "consumer" and c.client_id.startswith("consumer"):
            c.topics = list(dict.fromkeys([*c.topics, topic_names[int(str(c.group)[6:]) % len(topic_names)]]))
    activity = [rnd.choice((1, 2, 4, 8, 16)) for _ in roster]
    cum = []
    total = 0
    for a in activity:
        total += a
        cum.append(total)

    t0 = (start - EPOCH).total_seconds()
    span = hours * 3600.0
    step = span / max(lines, 1)
    now = t0
    for n in range(lines):
        now += rnd.expovariate(1.0 / step)
        if now >= t0 + span:
            now = t0 + span - 1e-6
        c = roster[bisect.bisect_right(cum, rnd.random() * total)]
        api = rnd.choices(c.apis, c.weights)[0]
        yield _line(rnd, c, api, now, parts, record_size, n)


def _line(rnd: random.Random, c: _Client, api: str, now: float, parts: dict[tuple[str, int], _Partition],
          record_size: dict[str, int], n: int) -> dict[str, Any]:
    c.correlation_id += 1
    version = c.versions.get(api, 0)
    queued = round(rnd.uniform(0.02, 0.3), 3)
    ret = round(rnd.uniform(0.01, 0.1), 3)
    broker = round(rnd.lognormvariate(0.0, 0.6), 3)
    line: dict[str, Any] = {
        "ts": "", "conn": c.conn, "proxy": c.proxy, "client_address": f"10.1.{c.conn // 250}.{c.conn % 250}:4{c.conn:04d}",
        "client_id": c.client_id, "principal": c.principal,
        "client_software_name": c.software[0] if c.software else None,
        "client_software_version": c.software[1] if c.software else None,
        "listener": "broker-1", "api": api, "api_key": _API_KEYS.get(api, 0), "api_version": version,
        "correlation_id": c.correlation_id, "broker": "broker-1:9092", "outcome": "forwarded",
        "request_bytes": rnd.randint(40, 200), "response_bytes": rnd.randint(30, 400), "duration_ms": 0.0,
        "queued_ms": queued, "broker_ms": broker, "return_ms": ret, "throttle_ms": 0, "error_code": 0,
        "error": None, "rule": None, "action": None, "quota": None, "group": c.group, "topics": [],
    }
    if api == "produce":
        _produce(rnd, c, line, now, parts, record_size, n)
    elif api == "fetch":
        _fetch(rnd, c, line, now, parts, record_size)
    elif api == "delete_topics":
        # The candidate policy denies topic deletion: kproxy answers locally.
        line.update(outcome="local", broker=None, broker_ms=None, rule="protect-topics", action="deny",
                    error_code=41, error="POLICY_VIOLATION", topics=[rnd.choice(c.topics)])
    elif api in ("metadata", "describe_configs", "create_topics"):
        line["topics"] = list(c.topics)
        line["response_bytes"] = rnd.randint(200, 4000)
    broker_ms = line["broker_ms"] or 0.0
    line["duration_ms"] = round(line["queued_ms"] + broker_ms + line["return_ms"], 3)
    # Heavy producers run into the tenant quota now and then; the broker throttles a few fetches.
    if api == "produce" and c.conn % 7 == 0 and rnd.random() < 0.05:
        ms = rnd.randint(50, 900)
        line.update(throttle_ms=ms, quota={"rule": "tenant-caps", "key": f"client_id={c.client_id}", "throttle_ms": ms})
    elif api == "fetch" and rnd.random() < 0.01:
        line["throttle_ms"] = rnd.randint(10, 200)
    line["ts"] = rfc3339(dt.datetime.fromtimestamp(now, UTC))
    return line


def _produce(rnd: random.Random, c: _Client, line: dict[str, Any], now: float,
             parts: dict[tuple[str, int], _Partition], record_size: dict[str, int], n: int) -> None:
    acks = 0 if c.conn % 11 == 0 else -1
    line["acks"] = acks
    line["broker_ms"] = round(line["broker_ms"] * 3 + 1, 3)
    done = now + (line["queued_ms"] + line["broker_ms"] + line["return_ms"]) / 1000.0
    entries: list[dict[str, Any]] = []
    topic = rnd.choice(c.topics)
    for p in rnd.sample(range(6), k=rnd.choice((1, 1, 2, 3))):
        part = parts[(topic, p)]
        records = rnd.randint(1, 400)
        size = records * record_size[topic] + 61
        entry: dict[str, Any] = {
            "topic": topic, "topic_id": None, "partition": p, "records": records, "bytes": size,
            "first_offset": None, "last_offset": None, "first_timestamp": int(now * 1000) - rnd.randint(0, 50),
            "max_timestamp": int(now * 1000), "compression": "none", "error_code": 0,
        }
        if acks == 0:
            pass  # no response: kproxy never learns the offsets
        elif n % 199 == 0:
            entry["error_code"] = 6
            line["error"] = "NOT_LEADER_OR_FOLLOWER"
            line["partition_errors"] = {"NOT_LEADER_OR_FOLLOWER": 1}
        else:
            entry["first_offset"] = part.next_offset
            entry["last_offset"] = part.next_offset + records - 1
            part.next_offset += records
            part.ends.append(part.next_offset)
            part.acked_at.append(max(done, part.acked_at[-1] if part.acked_at else done))
        entries.append(entry)
    line["topics"] = [topic]
    line["partitions"] = entries
    line["request_bytes"] = sum(e["bytes"] for e in entries) + 80
    if acks == 0:
        line.update(outcome="no_response", response_bytes=0, broker_ms=None, return_ms=0.0)


def _fetch(rnd: random.Random, c: _Client, line: dict[str, Any], now: float,
           parts: dict[tuple[str, int], _Partition], record_size: dict[str, int]) -> None:
    group = c.group or c.client_id
    line["max_wait_ms"] = 500
    entries: list[dict[str, Any]] = []
    for topic in c.topics:
        for p in range(6):
            part = parts[(topic, p)]
            pos = part.positions.get(group, part.visible_end(now - 5.0))
            end = min(part.visible_end(now), pos + 2000)
            if end <= pos:
                continue
            size = (end - pos) * record_size[topic] + 61
            entries.append({
                "topic": topic, "topic_id": None, "partition": p, "records": end - pos, "bytes": size,
                "first_offset": pos, "last_offset": end - 1, "first_timestamp": None, "max_timestamp": None,
                "compression": "none", "error_code": 0,
            })
            part.positions[group] = end
    if not entries:
        line["broker_ms"] = 500.0 + round(rnd.uniform(0, 2), 3)  # a long poll that found nothing
    line["topics"] = list(c.topics)
    line["partitions"] = entries
    line["response_bytes"] = sum(e["bytes"] for e in entries) + 100


def main(argv: list[str] | None = None) -> int:
    """``python -m kproxy.analytics.synthetic DIR``: a sample traffic log to try ``kproxy report`` on."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kproxy.analytics.synthetic",
                                 description="Write a synthetic kproxy traffic log (dt=/hour= partitions).")
    ap.add_argument("dir", help="directory to write into")
    ap.add_argument("--lines", type=int, default=100_000, help="number of lines (default 100,000)")
    ap.add_argument("--hours", type=float, default=2.0, help="hours of traffic they span (default 2)")
    ap.add_argument("--start", default="2024-05-01T00:00:00+00:00", help="time of the first line (UTC)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    start = dt.datetime.fromisoformat(args.start)
    start = start.replace(tzinfo=UTC) if start.tzinfo is None else start
    n = write_log(Path(args.dir), generate(args.lines, start, hours=args.hours, seed=args.seed), gz=True)
    print(f"wrote {n:,} lines under {args.dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

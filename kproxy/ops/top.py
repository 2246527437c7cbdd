"""``kproxy top``: a running kproxy's traffic, live in a terminal, from its admin listener alone.

Two scrapes of /metrics and /clients a second apart give the rates: requests and bytes per second by
API, the busiest clients and topics, denials and throttles in the interval, open connections and the
p99 latency. ``--once`` prints one such snapshot as plain text and exits; without it the view redraws
every second with ``rich`` (the ``top`` extra). A multi-worker supervisor's merged answers work the same.
"""

from __future__ import annotations

import http.client
import json
import math
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import attrs
from prometheus_client.parser import text_string_to_metric_families

Labels = frozenset[tuple[str, str]]
TOP_N = 10


class AdminError(Exception):
    """The admin listener could not be read."""


@attrs.define
class Scrape:
    at: float                                      # time.monotonic() when it was taken
    samples: dict[tuple[str, Labels], float]
    clients: dict[str, Any]

    def values(self, name: str) -> Iterable[tuple[dict[str, str], float]]:
        for (n, labels), v in self.samples.items():
            if n == name:
                yield dict(labels), v


def fetch(admin: str, path: str, timeout: float = 5.0, method: str = "GET") -> tuple[int, bytes]:
    host, _, port = admin.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    try:
        conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
        try:
            conn.request(method, path)
            response = conn.getresponse()
            # /metrics of a busy proxy with per-client labels is a few MB at most.
            return response.status, response.read(64 * 1024 * 1024)
        finally:
            conn.close()
    except (OSError, ValueError, http.client.HTTPException) as e:
        raise AdminError(f"cannot read http://{admin}{path}: {e}") from None


def scrape(admin: str) -> Scrape:
    at = time.monotonic()
    status, body = fetch(admin, "/metrics")
    if status == 404:
        raise AdminError(f"{admin} serves no metrics (they are off in its configuration)")
    if status != 200:
        raise AdminError(f"http://{admin}/metrics answered {status}: {body[:200].decode(errors='replace')}")
    samples: dict[tuple[str, Labels], float] = {}
    for family in text_string_to_metric_families(body.decode("utf-8", "replace")):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    status, body = fetch(admin, "/clients")
    try:
        clients = json.loads(body) if status == 200 else {}
    except ValueError:
        clients = {}
    return Scrape(at, samples, clients if isinstance(clients, dict) else {})


# -- what two scrapes say


@attrs.define
class ApiRow:
    api: str
    requests_per_s: float
    bytes_per_s: float
    in_per_s: float
    out_per_s: float
    p99_s: float | None


@attrs.define
class ClientRow:
    client_id: str
    connections: int
    requests_per_s: float
    bytes_per_s: float
    requests: int
    addresses: list[str]
    principals: list[str]


@attrs.define
class View:
    admin: str
    seconds: float
    apis: list[ApiRow]
    clients: list[ClientRow]
    topics: list[tuple[str, str, float, float]] | None      # (topic, direction, records/s, bytes/s); None: labels off
    denials: list[tuple[str, float, float]]                 # (rule, in the interval, total)
    throttles: list[tuple[str, float, float]]               # (rule, throttle seconds in the interval, total)
    connections: dict[str, float]
    p99_s: float | None
    workers: int | None


def _delta(before: Scrape, after: Scrape, name: str, key: Callable[[dict[str, str]], Any]) -> dict[Any, float]:
    """The increase of a counter between two scrapes, summed by ``key``; a counter that went down
    (a restarted worker) counts from zero."""
    old = {labels: v for (n, labels), v in before.samples.items() if n == name}
    out: dict[Any, float] = {}
    for (n, labels), v in after.samples.items():
        if n != name:
            continue
        prev = old.get(labels, 0.0)
        k = key(dict(labels))
        out[k] = out.get(k, 0.0) + (v - prev if v >= prev else v)
    return out


def quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus's histogram_quantile over cumulative bucket counts by upper bound."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    total = buckets[bounds[-1]]
    rank = q * total
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def view(admin: str, before: Scrape, after: Scrape) -> View:
    seconds = max(after.at - before.at, 1e-6)
    requests = _delta(before, after, "kproxy_requests_total", lambda lb: lb.get("api", "?"))
    io = _delta(before, after, "kproxy_client_bytes_total", lambda lb: (lb.get("api", "?"), lb.get("direction")))
    buckets = _delta(before, after, "kproxy_request_duration_seconds_bucket",
                     lambda lb: (lb.get("api", "?"), float(lb.get("le", "inf"))))
    apis = []
    all_buckets: dict[float, float] = {}
    for (_, le), n in buckets.items():
        all_buckets[le] = all_buckets.get(le, 0.0) + n
    for api in sorted({*requests, *(a for a, _ in io)}):
        incoming, outgoing = io.get((api, "request"), 0.0), io.get((api, "response"), 0.0)
        mine = {le: n for (a, le), n in buckets.items() if a == api}
        apis.append(ApiRow(api, requests.get(api, 0.0) / seconds, (incoming + outgoing) / seconds,
                           incoming / seconds, outgoing / seconds, quantile(0.99, mine)))
    apis.sort(key=lambda r: (-r.requests_per_s, -r.bytes_per_s, r.api))

    topics = None
    if any(n == "kproxy_topic_records_total" for n, _ in after.samples):
        records = _delta(before, after, "kproxy_topic_records_total", lambda lb: (lb["topic"], lb["direction"]))
        nbytes = _delta(before, after, "kproxy_topic_bytes_total", lambda lb: (lb["topic"], lb["direction"]))
        topics = sorted(((t, d, n / seconds, nbytes.get((t, d), 0.0) / seconds) for (t, d), n in records.items()),
                        key=lambda r: (-r[3], -r[2], r[0]))[:TOP_N]

    def per_rule(name: str) -> list[tuple[str, float, float]]:
        d = _delta(before, after, name, lambda lb: lb.get("rule", "?"))
        totals: dict[str, float] = {}
        for labels, v in after.values(name):
            totals[labels.get("rule", "?")] = totals.get(labels.get("rule", "?"), 0.0) + v
        return sorted(((r, d.get(r, 0.0), t) for r, t in totals.items()), key=lambda r: (-r[1], -r[2], r[0]))

    connections: dict[str, float] = {}
    for labels, v in after.values("kproxy_connections_open"):
        connections[labels.get("listener", "?")] = connections.get(labels.get("listener", "?"), 0.0) + v
    workers = next((int(v) for _, v in after.values("kproxy_workers")), None)
    return View(admin, seconds, apis, client_rows(before.clients, after.clients, seconds), topics,
                per_rule("kproxy_denied_requests_total"), per_rule("kproxy_throttle_seconds_total"),
                connections, quantile(0.99, all_buckets), workers)


def _rows(clients: dict[str, Any]) -> dict[tuple[Any, ...], dict[str, Any]]:
    out = {}
    for row in [*clients.get("connections", []), *clients.get("recent", [])]:
        if isinstance(row, dict):
            out[(row.get("worker"), row.get("connection"), row.get("opened_at"))] = row
    return out


def client_rows(before: dict[str, Any], after: dict[str, Any], seconds: float) -> list[ClientRow]:
    """Per client id: connections open now, requests and bytes per second over the interval (each
    connection's growth between the scrapes), its addresses and principals."""
    old = _rows(before)
    live_keys = {(r.get("worker"), r.get("connection"), r.get("opened_at")) for r in after.get("connections", [])}
    by_client: dict[str, ClientRow] = {}
    for key, row in _rows(after).items():
        prev = old.get(key, {})
        client = row.get("client_id")
        client = "(none)" if client is None else str(client)
        c = by_client.get(client)
        if c is None:
            c = by_client[client] = ClientRow(client, 0, 0.0, 0.0, 0, [], [])
        total = int(row.get("request_bytes", 0)) + int(row.get("response_bytes", 0))
        prev_total = int(prev.get("request_bytes", 0)) + int(prev.get("response_bytes", 0))
        c.requests_per_s += (int(row.get("requests", 0)) - int(prev.get("requests", 0))) / seconds
        c.bytes_per_s += (total - prev_total) / seconds
        c.requests += int(row.get("requests", 0))
        if key in live_keys:
            c.connections += 1
        for attr, value in (("addresses", row.get("address")), ("principals", row.get("principal"))):
            values = getattr(c, attr)
            if value and value not in values:
                values.append(str(value))
    return sorted(by_client.values(), key=lambda c: (-c.bytes_per_s, -c.requests_per_s, -c.requests, c.client_id))


# -- plain text (--once)


def _num(v: float) -> str:
    return f"{v:.1f}"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def render_text(v: View) -> str:
    lines = [f"kproxy top {v.admin}: rates over {v.seconds:.2f} s"
             + (f" ({v.workers} workers)" if v.workers else "")]
    lines.append(f"{'api':<28} {'requests/s':>12} {'bytes/s':>14} {'in_bytes/s':>14} {'out_bytes/s':>14} "
                 f"{'p99_ms':>9}")
    for a in v.apis:
        lines.append(f"{a.api:<28} {_num(a.requests_per_s):>12} {_num(a.bytes_per_s):>14} {_num(a.in_per_s):>14} "
                     f"{_num(a.out_per_s):>14} {_ms(a.p99_s):>9}")
    lines.append("")
    lines.append(f"clients: {len(v.clients)}")
    lines.append(f"{'client_id':<40} {'connections':>11} {'requests/s':>12} {'bytes/s':>14}  address / principal")
    for c in v.clients:
        where = ", ".join(c.addresses[:3]) + (f" +{len(c.addresses) - 3}" if len(c.addresses) > 3 else "")
        if c.principals:
            where += " / " + ", ".join(c.principals[:3])
        lines.append(f"{c.client_id:<40} {c.connections:>11} {_num(c.requests_per_s):>12} {_num(c.bytes_per_s):>14}"
                     f"  {where}")
    lines.append("")
    if v.topics is None:
        lines.append("topics: per-topic metrics are off (metrics.topic_labels)")
    else:
        lines.append("topics:")
        for topic, direction, records, nbytes in v.topics:
            lines.append(f"  {topic:<40} {direction:<9} {_num(records):>10} records/s {_num(nbytes):>14} bytes/s")
    lines.append("denials: " + (", ".join(f"{r} {d:g} (total {t:g})" for r, d, t in v.denials) or "none"))
    lines.append("throttles: " + (", ".join(f"{r} {d:.3f}s (total {t:.3f}s)" for r, d, t in v.throttles) or "none"))
    lines.append("connections: " + (", ".join(f"{k} {int(n)}" for k, n in sorted(v.connections.items())) or "none")
                 + f"; p99 latency {_ms(v.p99_s)} ms")
    return "\n".join(lines) + "\n"


# -- live (rich)


def render_rich(v: View) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    head = Text(f"kproxy top {v.admin}" + (f"  {v.workers} workers" if v.workers else "")
                + f"  connections {int(sum(v.connections.values()))}  p99 {_ms(v.p99_s)} ms", style="bold")
    apis = Table(title="APIs", expand=True)
    for col in ("api", "requests/s", "bytes/s", "in bytes/s", "out bytes/s", "p99 ms"):
        apis.add_column(col, justify="left" if col == "api" else "right")
    for a in v.apis:
        apis.add_row(a.api, _num(a.requests_per_s), _num(a.bytes_per_s), _num(a.in_per_s), _num(a.out_per_s),
                     _ms(a.p99_s))
    clients = Table(title="Top clients", expand=True)
    for col in ("client id", "connections", "requests/s", "bytes/s", "address / principal"):
        clients.add_column(col, justify="right" if col in ("connections", "requests/s", "bytes/s") else "left")
    for c in v.clients[:TOP_N]:
        # Text, not markup: a client id is the client's to choose.
        clients.add_row(Text(c.client_id), str(c.connections), _num(c.requests_per_s), _num(c.bytes_per_s),
                        Text(", ".join(c.addresses[:2]) + (" / " + ", ".join(c.principals[:2]) if c.principals else "")))
    topics = Table(title="Top topics", expand=True)
    for col in ("topic", "direction", "records/s", "bytes/s"):
        topics.add_column(col, justify="left" if col in ("topic", "direction") else "right")
    if v.topics is None:
        topics.add_row(Text("per-topic metrics are off (metrics.topic_labels)"), "", "", "")
    else:
        for topic, direction, records, nbytes in v.topics:
            topics.add_row(Text(topic), direction, _num(records), _num(nbytes))
    events = Table(title="Denials and throttles (this second; total)", expand=True)
    for col in ("kind", "rule", "now", "total"):
        events.add_column(col, justify="right" if col in ("now", "total") else "left")
    for rule, d, t in v.denials:
        events.add_row("denied", Text(rule), f"{d:g}", f"{t:g}")
    for rule, d, t in v.throttles:
        events.add_row("throttled", Text(rule), f"{d:.3f}s", f"{t:.3f}s")
    conns = Table(title="Connections by listener", expand=True)
    conns.add_column("listener")
    conns.add_column("open", justify="right")
    for listener, n in sorted(v.connections.items()):
        conns.add_row(Text(listener), str(int(n)))
    return Group(head, apis, clients, topics, events, conns)


def run(admin: str, once: bool, interval: float = 1.0) -> int:
    try:
        before = scrape(admin)
        if once:
            time.sleep(interval)
            sys.stdout.write(render_text(view(admin, before, scrape(admin))))
            return 0
        try:
            from rich.live import Live
        except ImportError:
            print("kproxy top: the live view needs rich: pip install 'kproxy-kafka[top]' (or use --once for plain "
                  "text)", file=sys.stderr)
            return 2
        with Live(render_rich(view(admin, before, before)), refresh_per_second=4, screen=False) as live:
            while True:
                time.sleep(interval)
                after = scrape(admin)
                live.update(render_rich(view(admin, before, after)))
                before = after
    except AdminError as e:
        print(f"kproxy top: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0

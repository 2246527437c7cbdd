"""The operations kit's pure parts: certificate expiry (files from trustme), the client table behind
/clients (escaping, verified principals only, bounds), its merge across workers, the metrics the alerts
need (kproxy_added_duration_seconds, kproxy_ready, kproxy_rules_reload_failing), and kproxy top's
arithmetic (rates, counter resets, histogram quantiles, per-client deltas)."""

from __future__ import annotations

import datetime
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import trustme
from cryptography import x509
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kproxy.config import parse_config
from kproxy.ops import top
from kproxy.proxy.filters import ConnectionContext
from kproxy.server import admin
from kproxy.server.certificates import METRIC, CertificateError, CertificateExpiry, expiry_of
from kproxy.server.clients import RECENT_CLOSED, ClientTable
from kproxy.server.workers import merge_clients
from kproxy.telemetry.exchange import Exchange, Learned
from kproxy.telemetry.metrics import Metrics, readiness_families, rule_families
from tests.unit.test_telemetry import ctx as telemetry_ctx
from tests.unit.test_telemetry import fetch_entry, produce_entry

# -- certificates


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    # A leaf that expires long before its CA, as real ones do.
    leaf = ca.issue_cert("127.0.0.1", not_after=datetime.datetime(2031, 5, 1, tzinfo=datetime.UTC))
    paths = {"ca": d / "ca.pem", "cert": d / "server.pem", "key": d / "server.key", "leaf": d / "leaf.pem"}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    leaf.private_key_pem.write_to_path(str(paths["key"]))
    leaf.cert_chain_pems[0].write_to_path(str(paths["leaf"]))
    with open(paths["cert"], "wb") as f:     # a chain file: the leaf, then its CA
        for blob in (*leaf.cert_chain_pems, ca.cert_pem):
            f.write(blob.bytes())
    return paths


def not_after(path: Path) -> list[float]:
    return [c.not_valid_after_utc.timestamp() for c in x509.load_pem_x509_certificates(path.read_bytes())]


def test_expiry_is_the_earliest_not_after_of_the_file(pki: dict[str, Path]) -> None:
    chain = not_after(pki["cert"])
    assert len(chain) == 2 and chain[0] != chain[1]
    assert expiry_of(pki["cert"]) == min(chain) == datetime.datetime(2031, 5, 1, tzinfo=datetime.UTC).timestamp()
    assert expiry_of(pki["ca"]) == not_after(pki["ca"])[0]


def test_expiry_of_what_is_not_a_certificate(tmp_path: Path, pki: dict[str, Path]) -> None:
    with pytest.raises(CertificateError, match="no PEM certificate"):
        expiry_of(pki["key"])
    (tmp_path / "empty.pem").write_text("")
    with pytest.raises(CertificateError):
        expiry_of(tmp_path / "empty.pem")
    with pytest.raises(OSError):
        expiry_of(tmp_path / "missing.pem")


def test_registry_observes_and_drops_a_file_that_went_bad(tmp_path: Path, pki: dict[str, Path],
                                                          caplog: pytest.LogCaptureFixture) -> None:
    reg = CertificateExpiry()
    path = tmp_path / "tls.crt"
    path.write_bytes(pki["leaf"].read_bytes())
    assert reg.observe(path) == expiry_of(pki["leaf"])
    registry = CollectorRegistry()
    registry.register(_Families(reg))
    (family,) = text_string_to_metric_families(generate_latest(registry).decode())
    assert [(s.name, s.labels, s.value) for s in family.samples] == [(METRIC, {"file": str(path)},
                                                                       expiry_of(pki["leaf"]))]
    # Replaced by something unreadable (a reload half done): the series goes and a warning says why.
    path.write_text("garbage")
    with caplog.at_level(logging.WARNING, logger="kproxy.certificates"):
        assert reg.observe(path) is None
    assert reg.snapshot() == {} and "cannot read the expiry" in caplog.text
    reg.observe(pki["ca"])
    reg.forget(pki["ca"])
    assert reg.snapshot() == {}


class _Families:
    def __init__(self, reg: CertificateExpiry) -> None:
        self.reg = reg

    def collect(self) -> Any:
        return self.reg.families()


def test_the_server_observes_every_certificate_file_it_loads(pki: dict[str, Path]) -> None:
    from kproxy.server.process import ProxyProcess

    config = parse_config(f"""\
listen: "127.0.0.1:19092"
upstream:
  bootstrap_servers: ["127.0.0.1:1"]
  tls: {{enabled: true, ca_file: "{pki['ca']}", cert_file: "{pki['leaf']}", key_file: "{pki['key']}"}}
tls: {{enabled: true, cert_file: "{pki['cert']}", key_file: "{pki['key']}", ca_file: "{pki['ca']}",
       require_client_cert: true}}
admin: {{listen: "127.0.0.1:19644"}}
""")
    reg = CertificateExpiry()
    server = ProxyProcess.from_config(config, certificates=reg).cluster()
    assert reg.snapshot() == {str(pki["cert"]): expiry_of(pki["cert"]), str(pki["ca"]): expiry_of(pki["ca"]),
                              str(pki["leaf"]): expiry_of(pki["leaf"])}
    assert server.process.metrics is not None
    text = server.process.metrics.exposition().decode()
    assert text.count(f"{METRIC}{{") == 3
    assert 'kproxy_ready{virtual_cluster="default"} 0.0' in text     # not bound, no broker learned


# -- metrics the alerts read


def test_added_duration_is_the_request_minus_the_broker() -> None:
    m = Metrics()
    m.record(Exchange(produce_entry({("t", 0): b""}, {("t", 0): 0}), telemetry_ctx(), Learned()))
    m.record(Exchange(fetch_entry({("t", 0): (0, b"")}), telemetry_ctx(), Learned()))
    families = {f.name: f for f in text_string_to_metric_families(m.exposition().decode())}
    added = {(s.labels["api"], s.name): s.value for s in families["kproxy_added_duration_seconds"].samples
             if s.name.endswith("_sum")}
    # produce: 4.5 ms in all, 3 ms at the broker; fetch: 501 ms, 499.8 ms at the broker (a long poll).
    assert added[("produce", "kproxy_added_duration_seconds_sum")] == pytest.approx(0.0015)
    assert added[("fetch", "kproxy_added_duration_seconds_sum")] == pytest.approx(0.0012)


def test_readiness_and_reload_failure_gauges() -> None:
    assert [s.value for f in readiness_families(True) for s in f.samples] == [1]
    assert [s.value for f in readiness_families(False) for s in f.samples] == [0]

    class Store:
        reloads_ok, reloads_failed, rule_count, generation, loaded_at = 1, 1, 3, 2, 1.0
        last_error: str | None = "rules.yaml:3: bad"

    def failing(store: Any) -> float:
        return next(s.value for f in rule_families(store) for s in f.samples if s.name == "kproxy_rules_reload_failing")

    assert failing(Store()) == 1
    store = Store()
    store.last_error = None
    assert failing(store) == 0


# -- /clients


def context(cid: int, client_id: str | None, **kw: Any) -> ConnectionContext:
    return ConnectionContext(cid, client_address=("10.1.2.3", 5000 + cid), listener="broker-1", client_id=client_id,
                             **kw)


def test_client_table_escapes_like_the_logs_and_shows_only_verified_principals() -> None:
    table = ClientTable()
    evil = table.opened(context(1, "app\x1b[31m\nFAKE LOG LINE", sasl_user="mallory"))   # claimed, not verified
    good = table.opened(context(2, "billing", sasl_user="svc", authenticated=True))
    for _ in range(3):
        good.completed(100, 20)
    evil.completed(10, 5)
    view = table.view()
    rows = {r["connection"]: r for r in view["connections"]}
    assert rows[1]["client_id"] == "app\\x1b[31m\\nFAKE LOG LINE" and rows[1]["principal"] is None
    assert rows[2] | {"opened_at": 0} == {
        "connection": 2, "client_id": "billing", "address": "10.1.2.3:5002", "principal": "User:svc",
        "listener": "broker-1", "software": None, "requests": 3, "request_bytes": 300, "response_bytes": 60,
        "opened_at": 0, "closed_at": None}
    assert [r["connection"] for r in view["connections"]] == [2, 1]     # the busiest first
    assert "\n" not in json.dumps(view)
    table.closed(good)
    view = table.view()
    assert [r["connection"] for r in view["connections"]] == [1]
    assert view["recent"][0]["client_id"] == "billing" and view["recent"][0]["closed_at"] is not None


def test_client_table_is_bounded() -> None:
    table = ClientTable()
    records = [table.opened(context(i, f"c{i}")) for i in range(RECENT_CLOSED + 50)]
    assert len(table.view(limit=10)["connections"]) == 10 and table.view(limit=10)["omitted"] == RECENT_CLOSED + 40
    for r in records:
        table.closed(r)
    view = table.view()
    assert view["live"] == 0 and len(view["recent"]) == RECENT_CLOSED
    assert view["recent"][0]["client_id"] == f"c{RECENT_CLOSED + 49}"    # the newest first


def test_admin_serves_clients() -> None:
    class View:
        config = parse_config('listen: "127.0.0.1:19092"\nupstream: {bootstrap_servers: ["k:9092"]}\n')
        metrics = None
        clients = ClientTable()

        def readiness(self) -> tuple[bool, str]:
            return True, "ready"

        def rules(self) -> dict[str, Any]:
            return admin.rules_view(None)

        def clients_view(self) -> dict[str, Any]:
            return self.clients.view()

    v = View()
    v.clients.opened(context(4, "x"))
    status, ctype, body = admin.AdminServer(v, None).respond("GET", "/clients")  # type: ignore[arg-type]
    assert (status, ctype) == (200, "application/json")
    assert json.loads(body)["connections"][0]["client_id"] == "x"


def test_merged_clients_say_their_worker_and_keep_the_bound() -> None:
    def row(cid: int, nbytes: int, closed: float | None = None) -> dict[str, Any]:
        return {"connection": cid, "client_id": f"c{cid}", "request_bytes": nbytes, "response_bytes": 0,
                "requests": 1, "closed_at": closed}

    w0 = {"time": 10.0, "live": 2, "connections": [row(1, 50), row(2, 10)], "recent": [row(3, 1, 5.0)], "omitted": 0}
    w1 = {"time": 11.0, "live": 1, "connections": [row(1, 30)], "recent": [row(9, 1, 7.0)], "omitted": 4}
    merged = merge_clients([(0, w0), (1, w1)], limit=2)
    assert [(r["worker"], r["connection"]) for r in merged["connections"]] == [(0, 1), (1, 1)]
    assert [(r["worker"], r["connection"]) for r in merged["recent"]] == [(1, 9), (0, 3)]
    assert (merged["live"], merged["time"], merged["omitted"]) == (3, 11.0, 5)


# -- kproxy top's arithmetic


def test_quantile_interpolates_like_prometheus() -> None:
    inf = float("inf")
    assert top.quantile(0.99, {0.1: 0, 0.25: 100, inf: 100}) == pytest.approx(0.1 + 0.15 * 0.99)
    assert top.quantile(0.5, {0.001: 50, 0.01: 100, inf: 100}) == pytest.approx(0.001)
    assert top.quantile(0.99, {0.5: 10, inf: 100}) == 0.5       # in the +Inf bucket: the highest bound
    assert top.quantile(0.99, {0.5: 0, inf: 0}) is None


def scrape(at: float, lines: str, clients: dict[str, Any] | None = None) -> top.Scrape:
    samples = {}
    for family in text_string_to_metric_families(lines):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return top.Scrape(at, samples, clients or {})


def exposition(produce: int, fetch: int, produce_bytes: int, slow: int, denied: int) -> str:
    return f"""\
# TYPE kproxy_requests counter
kproxy_requests_total{{api="produce"}} {produce}
kproxy_requests_total{{api="fetch"}} {fetch}
# TYPE kproxy_client_bytes counter
kproxy_client_bytes_total{{api="produce",direction="request"}} {produce_bytes}
kproxy_client_bytes_total{{api="produce",direction="response"}} {produce * 10}
# TYPE kproxy_request_duration_seconds histogram
kproxy_request_duration_seconds_bucket{{api="produce",le="0.01"}} {produce - slow}
kproxy_request_duration_seconds_bucket{{api="produce",le="1.0"}} {produce}
kproxy_request_duration_seconds_bucket{{api="produce",le="+Inf"}} {produce}
kproxy_request_duration_seconds_sum{{api="produce"}} 1
kproxy_request_duration_seconds_count{{api="produce"}} {produce}
# TYPE kproxy_denied_requests counter
kproxy_denied_requests_total{{rule="no-deletes"}} {denied}
# TYPE kproxy_connections_open gauge
kproxy_connections_open{{listener="bootstrap"}} 1
kproxy_connections_open{{listener="broker-1"}} 3
"""


def test_view_rates_from_two_scrapes() -> None:
    before = scrape(100.0, exposition(1000, 50, 1_000_000, 0, 2),
                    {"connections": [{"connection": 1, "opened_at": 1.0, "client_id": "app", "requests": 10,
                                      "request_bytes": 100, "response_bytes": 0}]})
    after = scrape(102.0, exposition(1200, 50, 1_400_000, 10, 3),
                   {"connections": [{"connection": 1, "opened_at": 1.0, "client_id": "app", "requests": 30,
                                     "request_bytes": 500, "response_bytes": 100, "address": "10.0.0.1:5"},
                                    {"connection": 2, "opened_at": 101.0, "client_id": "app", "requests": 4,
                                     "request_bytes": 40, "response_bytes": 0}],
                    "recent": [{"connection": 3, "opened_at": 100.5, "closed_at": 101.5, "client_id": None,
                                "requests": 2, "request_bytes": 2, "response_bytes": 2}]})
    v = top.view("h:1", before, after)
    produce = next(a for a in v.apis if a.api == "produce")
    assert (produce.requests_per_s, produce.in_per_s, produce.out_per_s) == (100.0, 200_000.0, 1000.0)
    assert produce.p99_s == pytest.approx(0.01 + 0.99 * (0.99 * 200 - 190) / 10)
    assert next(a for a in v.apis if a.api == "fetch").requests_per_s == 0
    assert v.apis[0].api == "produce"
    assert v.denials == [("no-deletes", 1.0, 3.0)] and v.connections == {"bootstrap": 1, "broker-1": 3}
    app = next(c for c in v.clients if c.client_id == "app")
    assert (app.connections, app.requests_per_s, app.bytes_per_s) == (2, (20 + 4) / 2, (500 + 40) / 2)
    assert next(c for c in v.clients if c.client_id == "(none)").connections == 0
    text = top.render_text(v)
    assert [line.split()[:3] for line in text.splitlines() if line.startswith("produce")] == \
        [["produce", "100.0", "201000.0"]]
    assert "app " in text and "denials: no-deletes 1 (total 3)" in text


def test_a_counter_that_restarted_counts_from_zero() -> None:
    before = scrape(0.0, exposition(1000, 0, 5000, 0, 0))
    after = scrape(1.0, exposition(30, 0, 300, 0, 0))
    assert next(a for a in top.view("h:1", before, after).apis if a.api == "produce").requests_per_s == 30


def test_rich_view_renders_client_strings_as_text() -> None:
    from rich.console import Console

    before = scrape(0.0, exposition(0, 0, 0, 0, 0))
    after = scrape(1.0, exposition(5, 0, 50, 0, 0),
                   {"connections": [{"connection": 1, "opened_at": 0.5, "client_id": "[bold]x[/bold]",
                                     "requests": 5, "request_bytes": 50, "response_bytes": 0}]})
    console = Console(width=160, record=True, color_system=None)
    console.print(top.render_rich(top.view("h:1", before, after)))
    out = console.export_text()
    assert "[bold]x[/bold]" in out and "produce" in out


def test_the_live_view_without_rich_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    monkeypatch.setattr(top, "scrape", lambda admin: scrape(0.0, exposition(0, 0, 0, 0, 0)))
    monkeypatch.setitem(sys.modules, "rich.live", None)     # as if the top extra were not installed
    assert top.run("h:1", once=False) == 2
    assert "pip install 'kproxy-kafka[top]'" in capsys.readouterr().err

"""``kproxy report`` on generated traffic logs whose answers are known: the synthetic mix counts what
it writes (``Truth``), and a few planted lines have hand-computed latencies, rates and percentiles.

The report runs once for the module (a Spark run costs seconds, an assertion nothing); each test
checks one of its outputs against the known answer.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import gzip
import io
import json
import zlib
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import yaml
from PIL import Image

from kproxy.analytics.removed_versions import KAFKA_4_0_MINIMUM_VERSIONS
from kproxy.analytics.synthetic import Truth, base_line, epoch_ms, generate, write_log

pytestmark = pytest.mark.spark

UTC = dt.UTC
START = dt.datetime(2024, 5, 1, 10, 0, tzinfo=UTC)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def planted_lines() -> list[dict[str, Any]]:
    """Lines whose answers are worked out by hand in the tests below."""
    lines = []
    # Latency: durations 0..1000 ms for one client and API, so p50/p95/p99 are 500/950/990.
    for i in range(1001):
        ts = START + dt.timedelta(seconds=1 + i * 7)
        lines.append(base_line(ts, "pctl-client", "list_offsets", 7, duration_ms=float(i), queued_ms=0.0,
                               broker_ms=float(i) / 2, return_ms=float(i) / 2, correlation_id=i))
    # A steady producer: exactly 100 KiB of records every second for 100 seconds.
    for i in range(100):
        ts = START + dt.timedelta(minutes=30, seconds=i, milliseconds=250)
        lines.append(base_line(ts, "steady-producer", "produce", 9, acks=-1, topics=["steady"], partitions=[
            {"topic": "steady", "partition": 0, "records": 100, "bytes": 102400, "first_offset": 100 * i,
             "last_offset": 100 * i + 99, "first_timestamp": epoch_ms(ts), "max_timestamp": epoch_ms(ts),
             "compression": "none", "error_code": 0}]))
    # End to end: a batch acknowledged at T+5 ms, first delivered to planted-group at T+1002 ms,
    # delivered again 4 s later (a rebalance); CreateTime is T-20 ms.
    t = START + dt.timedelta(minutes=45)
    lines.append(base_line(t, "planted-producer", "produce", 9, acks=-1, duration_ms=5.0, topics=["e2e-planted"],
                           partitions=[{"topic": "e2e-planted", "partition": 0, "records": 10, "bytes": 1000,
                                        "first_offset": 100, "last_offset": 109,
                                        "first_timestamp": epoch_ms(t) - 20, "max_timestamp": epoch_ms(t),
                                        "compression": "none", "error_code": 0}]))
    for delay, corr in ((1.0, 1), (5.0, 2)):
        lines.append(base_line(t + dt.timedelta(seconds=delay), "planted-consumer", "fetch", 13, duration_ms=2.0,
                               group="planted-group", correlation_id=corr, topics=["e2e-planted"],
                               partitions=[{"topic": "e2e-planted", "partition": 0, "records": 26, "bytes": 2600,
                                            "first_offset": 95, "last_offset": 120, "first_timestamp": None,
                                            "max_timestamp": None, "compression": "none", "error_code": 0}]))
    # A validate rule refused two batches of a producer writing bad JSON (3 bad records each).
    for i in range(2):
        ts = START + dt.timedelta(minutes=50, seconds=i)
        lines.append(base_line(ts, "bad-json-producer", "produce", 9, acks=-1, topics=["orders-planted"],
                               rule="orders-json", action="validate", error="INVALID_RECORD",
                               partition_errors={"INVALID_RECORD": 1},
                               records_refused=[{"rule": "orders-json", "topic": "orders-planted", "partition": 0,
                                                 "records": 3}],
                               partitions=[{"topic": "orders-planted", "partition": 0, "records": 5, "bytes": 400,
                                            "first_offset": None, "last_offset": None, "first_timestamp": None,
                                            "max_timestamp": None, "compression": "none", "error_code": 87}]))
    # An encrypt rule sealed three producers' batches on one topic; a consumer had them opened.
    for i in range(3):
        lines.append(base_line(START + dt.timedelta(minutes=52, seconds=i), f"pay-producer-{i % 2}", "produce", 9,
                               acks=-1, topics=["pay-planted"], record_rule="encrypt-pay", encrypted_batches=2))
    for i in range(2):
        lines.append(base_line(START + dt.timedelta(minutes=53, seconds=i), "pay-reader", "fetch", 13,
                               topics=["pay-planted"], decrypted_batches=3))
    return sorted(lines, key=lambda line: line["ts"])


# A candidate rule file for the dry run; its effect on the planted lines is known: the steady
# producer's 100 Produce requests all name only "steady", and pctl-client made 1001 ListOffsets.
CANDIDATE_RULES = """\
rules:
  - name: planted-small-records
    match: {topic: e2e-planted, api: produce}
    action: validate
    validate: {max_record_bytes: 50}
  - name: planted-json
    match: {topic: e2e-planted, api: produce}
    action: validate
    validate: {value: json}
  - name: no-steady-topic
    match: {topic: steady}
    action: deny
  - name: no-list-offsets-for-pctl
    match: {client_id: pctl-client, api: list_offsets}
    action: deny
quotas:
  - name: half-of-steady
    match: {client_id: steady-producer}
    per: client_id
    produce_bytes_per_s: 51200
  - name: roomy-requests
    match: {client_id: pctl-client}
    per: client_id
    requests_per_s: 1000
"""


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Truth]:
    root = tmp_path_factory.mktemp("traffic")
    truth = Truth()

    def counted(lines: Any) -> Any:
        for line in lines:
            truth.count(line)
            yield line

    write_log(root, counted(generate(4000, START, hours=1.0, seed=7, clients=30)), name="kproxy-a", gz=True)
    write_log(root, counted(planted_lines()), name="kproxy-b")
    # A torn last line, as a crash mid-write leaves: counted as malformed, never in any total.
    with (root / "dt=2024-05-01" / "hour=10" / "kproxy-b.jsonl").open("a") as f:
        f.write('{"ts":"2024-05-01T10:59:00.000000Z","conn":3,"api":"produce","request_by\n')
    return root, truth


@pytest.fixture(scope="module")
def run(spark: Any, logs: tuple[Path, Truth], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The report, run once through the command line (in this process, on the shared session)."""
    from kproxy.cli import main

    out = tmp_path_factory.mktemp("report")
    candidate = out.parent / "candidate-rules.yaml"
    candidate.write_text(CANDIDATE_RULES)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = main(["report", str(logs[0]), "--out", str(out), "--since", "2024-05-01T09:00:00Z",
                   "--until", "2024-05-02", "--rules", str(candidate)])
    assert rc == 0
    return out, printed.getvalue()


@pytest.fixture(scope="module")
def report(run: tuple[Path, str]) -> Path:
    return run[0]


def summary(report: Path) -> dict[str, Any]:
    return json.loads((report / "summary.json").read_text())


def table(spark: Any, report: Path, name: str) -> list[dict[str, Any]]:
    return [r.asDict(recursive=True) for r in spark.read.parquet(str(report / "tables" / name)).collect()]


def test_summary_totals_are_exact(report: Path, logs: tuple[Path, Truth]) -> None:
    truth = logs[1]
    s = summary(report)
    assert (s["requests"], s["produce_bytes"], s["fetch_bytes"], s["produced_records"], s["fetched_records"]) == (
        truth.requests, truth.produce_bytes, truth.fetch_bytes, truth.produced_records, truth.fetched_records)
    assert (s["clients"], s["topics"]) == (len(truth.clients), len(truth.topics))
    assert s["malformed_lines"] == 1
    assert "request_by" in s["malformed_sample"]
    assert s["percentile_accuracy"] == 10_000


def test_terminal_summary_and_stages(run: tuple[Path, str], logs: tuple[Path, Truth]) -> None:
    out, printed = run
    truth = logs[1]
    assert printed.startswith(f"kproxy report: {truth.requests:,} requests, {len(truth.clients)} clients, "
                              f"{len(truth.topics)} topics")
    assert "3 client(s) use versions Apache Kafka 4.0 (KIP-896) removed: legacy-admin" in printed
    assert "1 lines could not be read" in printed
    assert str(out / "report.html") in printed
    s = summary(out)
    assert (s["since"], s["until"]) == ("2024-05-01T09:00:00+00:00", "2024-05-02T00:00:00+00:00")
    # Imported here, not at the top: the job imports PySpark, which each xdist worker would otherwise
    # import while collecting, whether or not it runs a Spark test.
    from kproxy.analytics.job import STAGES
    assert [st["name"] for st in s["stages"]] == [*STAGES[:-1], "policy dry-run", STAGES[-1]]
    assert (out / "recommended-quotas.yaml").read_text().startswith("# Recommended quotas")


def test_requests_per_client_are_exact(spark: Any, report: Path, logs: tuple[Path, Truth]) -> None:
    got = {r["client_id"]: r["requests"] for r in table(spark, report, "traffic_by_client")}
    assert got == logs[1].requests_by_client


def test_percentiles_within_the_stated_error(spark: Any, report: Path) -> None:
    (row,) = [r for r in table(spark, report, "latency_by_client") if r["client_id"] == "pctl-client"]
    assert row["requests"] == 1001
    # percentile_approx's rank error is at most 1001 / 10000 rows, so one value either side.
    for q, exact in (("p50", 500), ("p95", 950), ("p99", 990)):
        assert abs(row[f"total_ms_{q}"] - exact) <= 1, (q, row[f"total_ms_{q}"])
        assert abs(row[f"broker_ms_{q}"] - exact / 2) <= 1
        assert abs(row[f"kproxy_ms_{q}"] - exact / 2) <= 1


def test_peak_rates_are_per_second_maxima(spark: Any, report: Path) -> None:
    (row,) = [r for r in table(spark, report, "traffic_by_client") if r["client_id"] == "steady-producer"]
    assert row["peak_produce_bytes_per_s"] == 102400
    assert row["p99_produce_bytes_per_s"] == 102400
    assert row["peak_requests_per_s"] == 1
    assert row["produce_bytes"] == 100 * 102400


def test_upgrade_risk_names_exactly_the_clients_that_used_removed_versions(
        spark: Any, report: Path, logs: tuple[Path, Truth]) -> None:
    truth = logs[1]
    expected = {k: n for k, n in truth.versions_used.items() if k[2] < KAFKA_4_0_MINIMUM_VERSIONS.get(k[1], 0)}
    rows = table(spark, report, "upgrade_risk")
    assert {(r["client_id"], r["api"], r["api_version"]): r["requests"] for r in rows} == expected
    assert summary(report)["upgrade_risk_clients"] == sorted(truth.removed_version_users)
    assert truth.removed_version_users == {"legacy-sarama", "legacy-kafka-python-1", "legacy-admin"}
    # Metadata v0/v1 were used, and Kafka 4.0 kept them: not a risk.
    assert not [r for r in rows if r["api"] == "metadata"]
    assert all(r["last_seen"] is not None and r["minimum_version"] > r["api_version"] for r in rows)


def test_end_to_end_latency_of_the_planted_pair(spark: Any, report: Path) -> None:
    rows = [r for r in table(spark, report, "e2e_latency") if r["topic"] == "e2e-planted"]
    assert len(rows) == 1
    row = rows[0]
    assert (row["group"], row["batches"], row["records"]) == ("planted-group", 1, 10)
    # Delivered at T+1000+2 ms, acknowledged at T+5 ms; the redelivery 4 s later does not count.
    for q in ("p50", "p95", "p99"):
        assert row[f"ack_to_delivery_ms_{q}"] == pytest.approx(997.0)
        assert row[f"create_to_delivery_ms_{q}"] == pytest.approx(1022.0)


def test_generated_end_to_end_latency_is_never_negative(spark: Any, report: Path) -> None:
    rows = [r for r in table(spark, report, "e2e_latency") if r["topic"] != "e2e-planted"]
    assert rows, "the synthetic producers and consumer groups share topics"
    assert all(r["ack_to_delivery_ms_p50"] > 0 for r in rows)


def test_denials_by_rule(spark: Any, report: Path, logs: tuple[Path, Truth]) -> None:
    got: dict[str, int] = {}
    for r in table(spark, report, "denials"):
        got[r["rule"]] = got.get(r["rule"], 0) + r["requests"]
    assert got == logs[1].denials_by_rule


def check_rules_file(path: Path) -> dict[str, Any]:
    """``kproxy check --rules FILE`` accepts the file, and it has the structure the report promises."""
    from kproxy.cli import main
    from kproxy.policy.loader import load_rules

    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["check", "--rules", str(path)]) == 0
    rule_set = load_rules([str(path)])
    assert not rule_set.warnings, rule_set.warnings
    doc = yaml.safe_load(path.read_text())
    assert [q.name for q in rule_set.quotas] == [q["name"] for q in doc["quotas"]]
    assert set(doc) == {"default", "rules", "quotas"}
    assert doc["default"] in ("allow", "deny")
    assert doc["rules"] == []
    names = [q["name"] for q in doc["quotas"]]
    assert len(names) == len(set(names))
    for q in doc["quotas"]:
        assert set(q) <= {"name", "match", "per", "produce_bytes_per_s", "fetch_bytes_per_s", "requests_per_s",
                          "burst_s"}
        assert q["per"] in ("client_id", "principal", "source", "connection", "rule")
        assert isinstance(q["match"], dict) and set(q["match"]) == {q["per"]}
        assert isinstance(q["match"][q["per"]], str)
        rates = [q[k] for k in ("produce_bytes_per_s", "fetch_bytes_per_s", "requests_per_s") if k in q]
        assert rates and all(isinstance(v, int) and v > 0 for v in rates)
        assert q["burst_s"] > 0
    return doc


def two_significant_digits(n: int) -> bool:
    digits = str(n).rstrip("0")
    return len(digits) <= 2


def test_recommended_quotas_file(spark: Any, report: Path, logs: tuple[Path, Truth]) -> None:
    doc = check_rules_file(report / "recommended-quotas.yaml")
    quotas = {q["match"]["client_id"]: q for q in doc["quotas"]}
    assert set(quotas) == logs[1].clients
    # p99 of 100 KiB/s, times two, rounded up to two significant digits.
    steady = quotas["steady-producer"]
    assert steady["produce_bytes_per_s"] == 210_000
    assert "fetch_bytes_per_s" not in steady
    assert steady["requests_per_s"] == 10  # the floor
    advice = {r["key"]: r for r in table(spark, report, "quota_advice") if r["dimension"] == "client_id"}
    for cid, q in quotas.items():
        for rate, p99 in (("produce_bytes_per_s", "p99_produce_bytes_per_s"),
                          ("fetch_bytes_per_s", "p99_fetch_bytes_per_s"), ("requests_per_s", "p99_requests_per_s")):
            if rate in q:
                assert q[rate] >= 2 * advice[cid][p99] and two_significant_digits(q[rate]), (cid, rate)


class _Images(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.sources: list[str] = []
        self.external: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "img":
            self.sources.append(a.get("src") or "")
        for key in ("src", "href"):
            value = a.get(key) or ""
            if value.startswith(("http:", "https:", "//")):
                self.external.append(value)


def test_html_report_embeds_real_charts(report: Path) -> None:
    page = (report / "report.html").read_text()
    parser = _Images()
    parser.feed(page)
    assert not parser.external, "the report must read offline"
    assert len(parser.sources) >= 6
    for src in parser.sources:
        prefix = "data:image/png;base64,"
        assert src.startswith(prefix)
        data = base64.b64decode(src[len(prefix):], validate=True)
        assert data[:8] == PNG_SIGNATURE
        # The IHDR chunk comes first: width and height, then the image data must inflate.
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        assert width >= 400 and height >= 150
        idat = b"".join(_chunks(data, b"IDAT"))
        assert len(zlib.decompress(idat)) > width * height
        image = Image.open(io.BytesIO(data))
        image.load()
        colors = image.convert("RGB").getcolors(maxcolors=1 << 20)
        assert colors is None or len(colors) > 20, "a chart is more than a blank canvas"
    for text in ("pctl-client", "legacy-sarama", "planted-group", "recommended-quotas.yaml", "approximate"):
        assert text in page.lower() or text in page


def _chunks(png: bytes, kind: bytes) -> list[bytes]:
    out, i = [], 8
    while i < len(png):
        length = int.from_bytes(png[i:i + 4], "big")
        if png[i + 4:i + 8] == kind:
            out.append(png[i + 8:i + 8 + length])
        i += 12 + length
    return out


def test_tables_are_parquet_directories(report: Path) -> None:
    s = summary(report)
    for name in ("requests", "partitions", "traffic_by_client", "traffic_by_topic", "latency_by_api",
                 "errors", "denials", "throttles", "fleet", "upgrade_risk", "quota_advice", "e2e_latency"):
        files = list((report / "tables" / name).glob("*.parquet"))
        assert files, name
        assert s["tables"][name].endswith(f"tables/{name}")


# ---- reading: since/until prune partitions --------------------------------------------------------

def test_since_until_prune_partitions(spark: Any, tmp_path: Path) -> None:
    from pyspark.sql import functions as F

    from kproxy.analytics.source import parse_time, read_lines
    from kproxy.analytics.tables import valid_lines

    lines = []
    for hour in range(8, 14):
        for minute in (0, 30):
            lines.append(base_line(START.replace(hour=hour, minute=minute), f"c{hour}", "metadata", 12))
    # Read at 11:59:59.9, completed after noon: written into hour=12, still inside --until 12:00.
    lines.append(base_line(START.replace(hour=11, minute=59, second=59, microsecond=900_000), "late", "fetch", 13,
                           duration_ms=500.0))
    write_log(tmp_path, sorted(lines, key=lambda x: x["ts"]))
    # Partitions outside the window hold files Spark cannot read: only pruning keeps them unread.
    for hour in ("08", "13"):
        (tmp_path / "dt=2024-05-01" / f"hour={hour}" / "broken.jsonl.gz").write_bytes(b"not gzip at all")
    since, until = parse_time("2024-05-01T10:00:00Z"), parse_time("2024-05-01T12:00:00Z")
    df = read_lines(spark, [str(tmp_path)], since, until)
    got = sorted(r["client_id"] for r in df.where(valid_lines(df)).select("client_id").collect())
    assert got == ["c10", "c10", "c11", "c11", "late"]
    read_hours = {r["hour"] for r in df.select("hour").distinct().collect()}
    assert read_hours == {"10", "11", "12"}
    with pytest.raises(Exception, match=r"(?i)gzip|corrupt|incorrect header"):
        everything = read_lines(spark, [str(tmp_path)])
        everything.agg(F.count(F.lit(1))).collect()


def test_a_glob_into_the_partitions_keeps_them(spark: Any, tmp_path: Path) -> None:
    from kproxy.analytics.source import read_lines

    write_log(tmp_path, [base_line(START.replace(hour=h), "g", "metadata", 12) for h in (10, 11, 12)])
    df = read_lines(spark, [str(tmp_path / "dt=2024-05-01" / "hour=1[01]")])
    assert sorted(r["hour"] for r in df.select("hour").collect()) == ["10", "11"]


def test_a_glob_over_several_log_roots(spark: Any, tmp_path: Path) -> None:
    from kproxy.analytics.source import ReportError, read_lines

    for name in ("east", "west"):
        write_log(tmp_path / name / "traffic", [base_line(START, name, "metadata", 12)])
    df = read_lines(spark, [str(tmp_path / "*" / "traffic")])
    assert sorted(r["client_id"] for r in df.select("client_id").collect()) == ["east", "west"]
    with pytest.raises(ReportError, match="no traffic log at"):
        read_lines(spark, [str(tmp_path / "nowhere-*")])


def test_parse_time_forms() -> None:
    from kproxy.analytics.source import ReportError, parse_time

    assert parse_time("2024-05-01") == dt.datetime(2024, 5, 1, tzinfo=UTC)
    assert parse_time("2024-05-01T12:30:00+02:00") == dt.datetime(2024, 5, 1, 10, 30, tzinfo=UTC)
    now = dt.datetime(2024, 5, 8, tzinfo=UTC)
    assert parse_time("7d", now) == dt.datetime(2024, 5, 1, tzinfo=UTC)
    assert parse_time("90m", now) == now - dt.timedelta(minutes=90)
    with pytest.raises(ReportError, match="cannot read time"):
        parse_time("last tuesday")


def test_gzip_and_plain_files_both_read(spark: Any, tmp_path: Path) -> None:
    from kproxy.analytics.source import read_lines

    write_log(tmp_path, [base_line(START, "plain", "metadata", 12)], name="a")
    write_log(tmp_path, [base_line(START, "zipped", "metadata", 12)], name="b", gz=True)
    (tmp_path / "dt=2024-05-01" / "hour=10" / "c.jsonl.tmp").write_text("in progress, not a log yet\n")
    assert gzip.decompress((tmp_path / "dt=2024-05-01" / "hour=10" / "b.jsonl.gz").read_bytes())
    got = sorted(r["client_id"] for r in read_lines(spark, [str(tmp_path)]).collect())
    assert got == ["plain", "zipped"]


def test_the_rule_dry_run_names_who_would_be_refused(spark: Any, report: Path) -> None:
    denied = {(r["rule"], r["client_id"], r["api"]): r for r in table(spark, report, "dry_run_denied")}
    steady = denied[("no-steady-topic", "steady-producer", "produce")]
    assert steady["requests"] == 100 and steady["example_topic"] == "steady"
    assert steady["error"] == "TOPIC_AUTHORIZATION_FAILED"
    pctl = denied[("no-list-offsets-for-pctl", "pctl-client", "list_offsets")]
    assert pctl["requests"] == 1001
    # Nobody else is touched by these two rules, and the default decided all the rest.
    assert {k[0] for k in denied} == {"no-steady-topic", "no-list-offsets-for-pctl"}
    decisions = {(r["rule"], r["action"]): r["requests"] for r in table(spark, report, "dry_run_decisions")}
    assert sum(decisions.values()) == summary(report)["requests"]
    assert "Dry run" in (report / "report.html").read_text()


def test_validation_refusals_per_client_topic_and_rule(spark: Any, report: Path) -> None:
    got = [(r["client_id"], r["topic"], r["rule"], r["batches"], r["records"])
           for r in table(spark, report, "record_refusals")]
    assert got == [("bad-json-producer", "orders-planted", "orders-json", 2, 6)]
    assert "Records refused by validate rules" in (report / "report.html").read_text()


def test_encrypted_topics_in_the_fleet_report(spark: Any, report: Path) -> None:
    (row,) = table(spark, report, "encrypted_topics")
    assert (row["topic"], row["rule"], row["produce_requests"], row["batches_sealed"], row["producers"],
            row["fetch_requests"], row["batches_opened"], row["consumers"]) == (
        "pay-planted", "encrypt-pay", 3, 6, 2, 2, 6, 1)
    assert "Encrypted topics" in (report / "report.html").read_text()


def test_the_record_rule_dry_run_refuses_only_what_the_log_proves(spark: Any, report: Path) -> None:
    got = {r["rule"]: r for r in table(spark, report, "dry_run_record_rules")}
    assert set(got) == {"planted-small-records", "planted-json"}
    small, json_rule = got["planted-small-records"], got["planted-json"]
    # 10 records in 1000 bytes: the average record (93.9 bytes) is over 50, so one certainly is.
    assert (small["client_id"], small["topic"], small["partitions"], small["records"]) == (
        "planted-producer", "e2e-planted", 1, 10)
    assert small["refused_partitions"] == 1 and small["cannot_judge"] is None
    assert json_rule["refused_partitions"] == 0
    assert json_rule["cannot_judge"] == "value json: keys, values and headers are not in the traffic log"
    assert "cannot be dry-run" in (report / "report.html").read_text()


def test_a_broken_candidate_rules_file_is_refused_with_its_line(spark: Any, tmp_path: Path,
                                                                logs: tuple[Path, Truth]) -> None:
    from kproxy.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("rules:\n  - name: x\n    match: {topik: a}\n    action: deny\n")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["report", str(logs[0]), "--out", str(tmp_path / "out"), "--rules", str(bad)])
    assert rc != 0
    assert f"{bad}:3" in err.getvalue() and "topic" in err.getvalue()


def test_the_quota_dry_run_says_who_would_be_throttled(spark: Any, report: Path) -> None:
    got = {r["quota"]: r for r in table(spark, report, "dry_run_throttled")}
    # 100 KiB a second against a 50 KiB/s quota: soon every request is over. Kafka's formula,
    # (rate - quota) / quota x the window measured over, is then 1 x 11 to 12 s (11 samples of 1 s,
    # the last one part-way through): a client twice over its quota waits as long as it sent.
    steady = got["half-of-steady"]
    assert steady["key"] == "client_id=steady-producer" and steady["requests"] == 100
    assert steady["throttled"] >= 90
    assert 10_000 <= steady["throttle_ms_p99"] <= 12_100
    roomy = got["roomy-requests"]       # one request every 7 s: never near 1,000 a second
    assert (roomy["requests"], roomy["throttled"], roomy["throttle_ms_total"]) == (1001, 0, 0)

"""``kproxy demo`` end to end: its own tansu broker, kproxy, kafka-python, and output that says what
happened. The product tour (a tenant, a refused topic, a throttled producer, /metrics, the traffic
log, then the fleet report), and the plain round trip behind ``--plain``.

The demo starts everything itself (no session broker fixture), so this also proves it works on a
machine with nothing running.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from kproxy.cli import main

pytestmark = pytest.mark.e2e


def _count(output: str, api: str) -> int:
    # A table row: the API name, then its count.
    match = re.search(rf"^\s+{api}\s+(\d+)\s", output, re.MULTILINE)
    assert match is not None, f"no {api} row in the summary:\n{output}"
    return int(match.group(1))


def test_demo_round_trips_records_through_kproxy(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["demo", "--plain", "--records", "200"])

    out, err = capsys.readouterr()
    assert code == 0, f"demo failed:\n{out}\n{err}"
    assert "records check: PASSED: all 200 records came back" in out
    assert _count(out, "Produce") > 0
    assert _count(out, "Fetch") > 0
    assert "(kproxy's, not the broker's)" in out
    assert "FAILED" not in out + err


def _tour(capsys: pytest.CaptureFixture[str], out_dir: Path, *extra: str) -> str:
    code = main(["demo", "--out", str(out_dir), *extra])
    out, err = capsys.readouterr()
    assert code == 0, f"demo failed:\n{out}\n{err}"
    assert "tour check: FAILED" not in out and "kproxy demo: FAILED" not in err
    return out


def test_the_tour_shows_a_tenant_a_refusal_a_quota_metrics_and_the_traffic_log(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = _tour(capsys, tmp_path, "--no-report")
    assert re.search(r"topics the client sees +orders\n", out), out
    assert re.search(r"topics the broker holds +(\S+, )*tenant-a\.orders(,|\n)", out), out
    assert "producing to 'secret-keys': TopicAuthorizationFailedError" in out
    throttle = re.search(r"kafka-python reports throttle-time-max (\d+) ms", out)
    assert throttle is not None and int(throttle.group(1)) > 0, out
    assert re.search(r'kproxy_throttle_seconds_total\{rule="bulk-loader",virtual_cluster="default"\} [0-9.]+', out), out
    assert 'kproxy_denied_requests_total{rule="no-secrets",virtual_cluster="default"} 1.0' in out
    refused = json.loads(out.split("the refused request: ", 1)[1].splitlines()[0])
    assert refused == {"client_id": "tenant-a-shop", "api": "metadata", "rule": "no-secrets", "action": "deny",
                       "error": "TOPIC_AUTHORIZATION_FAILED"}
    logged = [p for p in (tmp_path / "traffic").rglob("*.jsonl*") if not p.name.endswith(".part")]
    assert logged and f"traffic log: {tmp_path / 'traffic'}" in out
    assert "skipped: left out (--no-report)" in out
    assert "tour check: PASSED" in out
    _check_the_quota_step(out, tmp_path / "traffic")


def _check_the_quota_step(out: str, traffic: Path) -> None:
    """The quota step shows the burst, then a rate that converges to the quota: as the client printed
    it, and as kproxy's traffic log recorded the same requests."""
    from kproxy.tour import QUOTA_BYTES_PER_S, QUOTA_CLIENT, QUOTA_SECONDS, STEADY_FROM_S

    quota_kib, tolerance = QUOTA_BYTES_PER_S / 1024, 0.25
    rows = [(int(second), int(kib), int(average)) for second, kib, average in
            re.findall(r"^ +(\d+)-\d+ s +(\d+)  #* +(\d+) KiB/s", out, re.MULTILINE)]
    assert [second for second, _, _ in rows] == list(range(QUOTA_SECONDS)), out
    per_second = [kib for _, kib, _ in rows]
    assert per_second[0] > quota_kib * (1 + tolerance), out           # the burst, as the client saw it
    steady = per_second[STEADY_FROM_S:]
    steady_kib = sum(steady) / len(steady)
    assert abs(steady_kib - quota_kib) <= quota_kib * tolerance, out
    assert all(abs(kib - quota_kib) <= quota_kib * 0.5 for kib in steady), out   # no pause, no catch-up
    # The averages since the start add up from the seconds, and the last is near the quota: the
    # burst was an advance, not extra.
    for second, _, average in rows:
        assert abs(average - sum(per_second[: second + 1]) / (second + 1)) <= 1, out
    assert abs(rows[-1][2] - quota_kib) <= quota_kib * tolerance, out
    said = re.search(r"after the burst: (\d+) KiB/s", out)
    assert said is not None and abs(int(said.group(1)) - steady_kib) <= 1, out

    # kproxy's side: the record bytes of the same Produce requests in the traffic log, over the same
    # seconds counted from the first request after the warm-up record.
    lines = []
    for path in traffic.rglob("*.jsonl*"):
        with (gzip.open(path, "rt") if path.suffix == ".gz" else path.open()) as log:
            lines += [json.loads(line) for line in log if line.strip()]
    produced = sorted((datetime.fromisoformat(line["ts"]).timestamp(), sum(p["bytes"] for p in line["partitions"]))
                      for line in lines if line["client_id"] == QUOTA_CLIENT and line["api"] == "produce")
    started = produced[1][0]                       # produced[0] is the warm-up record that made the topic
    logged = sum(size for ts, size in produced if started + STEADY_FROM_S <= ts < started + QUOTA_SECONDS)
    logged_kib = logged / 1024 / (QUOTA_SECONDS - STEADY_FROM_S)
    assert abs(logged_kib - quota_kib) <= quota_kib * tolerance, (logged_kib, out)


@pytest.mark.slow
@pytest.mark.spark
def test_the_tour_ends_with_the_fleet_report(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = _tour(capsys, tmp_path)
    html = tmp_path / "report" / "report.html"
    assert f"report.html: {html}" in out and html.is_file()
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["produced_records"] >= 500   # the quota step's records, at least
    assert _left_behind(tmp_path, wait_s=10) == []


def _left_behind(work: Path, wait_s: float = 0.0) -> list[str]:
    """Command lines of the processes that still carry the demo's mark for ``work`` (the report's
    process and its JVM inherit it), after waiting up to ``wait_s`` for them to go."""
    from kproxy.tour import DEMO_DIR_ENV

    mark = f"{DEMO_DIR_ENV}={work}".encode()
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                if mark in (proc / "environ").read_bytes().split(b"\0"):
                    found.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                continue   # gone, or not ours to read
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.2)


def _terminal_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.spark
def test_ctrl_c_during_the_tour_leaves_no_report_process_or_jvm(tmp_path: Path) -> None:
    """The report's Spark session starts in its own process group (a terminal's Ctrl-C does not reach
    it), so the demo has to end it: interrupted once that JVM runs, nothing of the demo's is left."""
    # The demo gets Ctrl-C as from a terminal, however this test run was started: a shell without job
    # control starts a background job (`make test &`) with SIGINT ignored, its children inherit that,
    # and Python then installs no KeyboardInterrupt for it (the demo ran on to its end, exit 0).
    # PYTHONFAULTHANDLER: should the demo not end, SIGABRT makes it print where each thread is.
    demo = subprocess.Popen([sys.executable, "-m", "kproxy", "demo", "--out", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONFAULTHANDLER": "1"}, preexec_fn=_terminal_sigint)
    try:
        deadline = time.monotonic() + 120
        while not any("java" in line for line in _left_behind(tmp_path)):
            assert demo.poll() is None and time.monotonic() < deadline, "the report's JVM never started"
            time.sleep(0.2)
        demo.send_signal(signal.SIGINT)
        try:
            out, err = demo.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            demo.send_signal(signal.SIGABRT)
            out, err = demo.communicate(timeout=30)
            pytest.fail(f"the demo did not end within 60 s of a Ctrl-C; where it was:\n{out[-3000:]}\n{err[-6000:]}")
    finally:
        if demo.poll() is None:
            demo.kill()
        demo.communicate()       # reaps it and closes the pipes (left open, a later test's gc would warn)
    assert demo.returncode == 130, f"{out}\n{err}"
    assert "kproxy demo: interrupted" in err
    # Gone when the demo ends, not later: the demo waited for them (were it to leave them, they would
    # go on their own once Spark is up and they see their stdin closed, seconds later).
    assert _left_behind(tmp_path, wait_s=1) == []


@pytest.mark.spark
def test_a_report_process_whose_spark_cannot_start_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kproxy.tour import ReportProcess

    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "no-java-here"))   # spark-submit runs $JAVA_HOME/bin/java
    report = ReportProcess(tmp_path)
    try:
        ok, lines = report.run(tmp_path / "traffic", tmp_path / "report")
    finally:
        report.stop()
    assert not ok
    assert any(line.startswith("kproxy report: Spark did not start: ") for line in lines), lines
    assert not (tmp_path / "report" / "report.html").exists()
    assert _left_behind(tmp_path) == []


def test_the_getting_started_page_shows_the_tours_rule_file() -> None:
    import yaml

    from kproxy.tour import RULES

    page = (Path(__file__).resolve().parents[2] / "docs" / "getting-started.md").read_text()
    block = page.split("The rule file it uses, to copy from:\n\n```yaml\n", 1)[1].split("```", 1)[0]
    assert yaml.safe_load(block) == yaml.safe_load(RULES)

"""deploy/monitoring/prometheus-rules.yaml: promtool accepts it, its unit tests fire every alert and keep
each quiet on healthy series, every alert says what happened and links its runbook section, and the Helm
chart's copy is the same file."""

from __future__ import annotations

import re

import yaml

from tests.monitoring.conftest import (
    CHART_FILES,
    OPERATIONS_DOC,
    RULES,
    RULES_TESTS,
    alert_rules,
    promtool,
)


def test_promtool_checks_the_rules() -> None:
    checked = promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in checked.stdout


def test_promtool_unit_tests_pass() -> None:
    tested = promtool("test", "rules", RULES_TESTS.name, cwd=RULES_TESTS.parent)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_the_unit_tests_fire_every_alert_and_quiet_each_on_healthy_series() -> None:
    tests = yaml.safe_load(RULES_TESTS.read_text())["tests"]
    fired = {case["alertname"] for t in tests for case in t.get("alert_rule_test", []) if case["exp_alerts"]}
    healthy = next(t for t in tests if t["name"] == "healthy")
    quiet = {case["alertname"] for case in healthy["alert_rule_test"] if case["exp_alerts"] == []}
    names = {r["alert"] for r in alert_rules()}
    assert fired == names and quiet == names
    # The healthy series are kproxy's own names, so a renamed metric cannot keep an alert quiet by accident.
    series = " ".join(s["series"] for s in healthy["input_series"])
    for rule in alert_rules():
        for name in re.findall(r"\b(kproxy_[a-z_]+|up)\b(?=[{\[\s)])", rule["expr"]):
            assert name in series, (rule["alert"], name)


def test_the_issue_asks_for_these_alerts() -> None:
    assert {r["alert"] for r in alert_rules()} >= {
        "KproxyDown", "KproxyNotReady", "KproxyUpstreamUnreachable", "KproxyHighErrorRatio",
        "KproxyHighAddedLatency", "KproxySustainedThrottling", "KproxyTrafficLogDropping", "KproxyEventLoopLag",
        "KproxyRuleReloadRefused", "KproxyCertificateExpiringSoon", "KproxyKerberosFailing"}


def test_every_alert_has_a_summary_a_description_and_a_runbook_section() -> None:
    doc = OPERATIONS_DOC.read_text()
    headings = {m.lower() for m in re.findall(r"^#{2,4} (\w+)\s*$", doc, re.MULTILINE)}
    for rule in alert_rules():
        annotations = rule["annotations"]
        assert annotations["summary"].strip() and len(annotations["description"]) > 40, rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning", "info")
        anchor = rule["alert"].lower()
        assert annotations["runbook_url"] == f"docs/operations.md#{anchor}"
        assert anchor in headings, f"docs/operations.md has no section for {rule['alert']}"


def test_the_charts_copy_is_the_rules_file() -> None:
    assert (CHART_FILES / "prometheus-rules.yaml").read_text() == RULES.read_text(), "run `make monitoring`"

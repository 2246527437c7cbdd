"""``kproxy demo`` end to end: its own tansu broker, kproxy, kafka-python, and a summary that says so.

The demo starts everything itself (no session broker fixture), so this also proves it works on a
machine with nothing running.
"""

from __future__ import annotations

import re

import pytest

from kproxy.cli import main

pytestmark = pytest.mark.e2e


def _count(output: str, api: str) -> int:
    # A table row: the API name, then its count.
    match = re.search(rf"^\s+{api}\s+(\d+)\s", output, re.MULTILINE)
    assert match is not None, f"no {api} row in the summary:\n{output}"
    return int(match.group(1))


def test_demo_round_trips_records_through_kproxy(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["demo", "--records", "200"])

    out, err = capsys.readouterr()
    assert code == 0, f"demo failed:\n{out}\n{err}"
    assert "records check: PASSED: all 200 records came back" in out
    assert _count(out, "Produce") > 0
    assert _count(out, "Fetch") > 0
    assert "(kproxy's, not the broker's)" in out
    assert "FAILED" not in out + err

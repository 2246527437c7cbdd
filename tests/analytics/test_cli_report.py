"""The ``kproxy report`` command line: errors are one clear line, and nothing outside kproxy.analytics
imports PySpark. (A whole run through the command line is test_report's fixture.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kproxy.analytics.synthetic import generate, write_log
from kproxy.cli import main
from tests.analytics.test_report import START

PURE_MODULES = ("kproxy.cli", "kproxy.config", "kproxy.server.app", "kproxy.analytics",
                "kproxy.analytics.removed_versions", "kproxy.analytics.quota_file", "kproxy.analytics.synthetic")


def test_kproxy_imports_without_pyspark() -> None:
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('pyspark', 'py4j', 'matplotlib'):\n"
            "            raise ImportError('blocked ' + name)\n"
            "sys.meta_path.insert(0, Block())\n"
            f"for m in {PURE_MODULES!r}:\n"
            "    __import__(m)\n"
            "from kproxy.cli import main\n"
            "sys.exit(main(['report', '/nowhere', '--out', '/tmp/x']))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "needs the analytics extra" in r.stderr


@pytest.mark.spark
@pytest.mark.parametrize(("args", "message"), [
    (["--since", "yesterday-ish"], "cannot read time 'yesterday-ish'"),
    (["--since", "2024-05-02", "--until", "2024-05-01"], "is not before --until"),
    (["--rules", "/no/such/rules.yaml"], "--rules /no/such/rules.yaml: no such file"),
])
def test_bad_options_are_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                                        message: str) -> None:
    rc = main(["report", str(tmp_path), "--out", str(tmp_path / "out"), *args])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("kproxy report: ") and message in err and err.count("\n") == 1


@pytest.mark.spark
def test_missing_logs_and_empty_window(spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["report", str(tmp_path / "nothing-here"), "--out", str(tmp_path / "out")])
    assert rc == 2
    assert "no traffic log at" in capsys.readouterr().err
    write_log(tmp_path / "logs", list(generate(20, START, hours=0.1, seed=1, clients=5)))
    rc = main(["report", str(tmp_path / "logs"), "--out", str(tmp_path / "out"), "--since", "2030-01-01"])
    assert rc == 2
    assert "no traffic log lines (*.jsonl, *.jsonl.gz) in" in capsys.readouterr().err

"""``kproxy report --rules`` checks one executor before the dry run: an executor whose Python cannot
import kproxy ends the report with one line saying what to install, not a Py4J traceback. The
executor without kproxy is a real Python worker: a fresh virtual environment (no site packages)
that the local session's next job runs its tasks in, started from ``/`` as on a cluster node (a
local worker otherwise starts in the driver's directory, this checkout, and imports kproxy from it)."""

from __future__ import annotations

import sys
import venv
from pathlib import Path
from typing import Any

import pytest

import kproxy

pytestmark = pytest.mark.spark


def test_an_executor_with_kproxy_passes(spark: Any) -> None:
    from kproxy.analytics.dry_run import check_executors
    check_executors(spark)


def test_an_executor_without_kproxy_is_one_line_saying_what_to_install(spark: Any, tmp_path: Path) -> None:
    from kproxy.analytics.dry_run import check_executors
    from kproxy.analytics.source import ReportError
    bare = tmp_path / "bare"
    venv.create(bare, with_pip=False)
    node_python = tmp_path / "node-python"
    node_python.write_text(f'#!/bin/sh\ncd / && exec {bare / "bin" / "python"} "$@"\n')
    node_python.chmod(0o755)
    context = spark.sparkContext
    before = context.pythonExec
    context.pythonExec = str(node_python)   # the Python the next jobs' workers run
    try:
        with pytest.raises(ReportError) as refused:
            check_executors(spark)
    finally:
        context.pythonExec = before
    said = str(refused.value)
    assert "\n" not in said
    assert "cannot import kproxy (No module named 'kproxy')" in said
    assert f"pip install 'kproxy-kafka=={kproxy.__version__}'" in said
    assert sys.executable not in said

"""One local Spark session for the whole test run, on two cores and with the settings ``kproxy
report`` uses for a tiny log (SMALL_INPUT_SETTINGS: the demo's): the test logs are small, so each
Spark job's fixed cost is what dominates; generated code and the JVM's optimising compiler cost more
than they save on them. The test files import PySpark (and ``kproxy.analytics.dry_run`` or ``job``,
which import it) inside their tests, not at the top: both xdist workers collect every file, and PySpark
at collection cost each of them its import whether or not it ran a Spark test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def spark() -> Iterator[object]:
    from pyspark.sql import SparkSession

    from kproxy.analytics.session import SMALL_INPUT_SETTINGS, use_this_python

    use_this_python()                 # the rule dry-run's Python workers need kproxy
    builder = SparkSession.builder.master("local[2]").appName("kproxy-tests")
    for key, value in {**SMALL_INPUT_SETTINGS, "spark.ui.showConsoleProgress": "false",
                       "spark.sql.session.timeZone": "UTC",
                       "spark.sql.sources.partitionColumnTypeInference.enabled": "false"}.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()

"""One local Spark session for the whole test run: two cores, no UI, no console progress bar, two
shuffle partitions. The test logs are small, so each Spark job's fixed cost is what dominates; whole
stage code generation (compiling Java per query) costs more than it saves on them, so it is off."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def spark() -> Iterator[object]:
    from pyspark.sql import SparkSession

    from kproxy.analytics.session import use_this_python

    use_this_python()                 # the rule dry-run's Python workers need kproxy
    session = (SparkSession.builder.master("local[2]").appName("kproxy-tests")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", "2")
               .config("spark.default.parallelism", "2")
               .config("spark.sql.codegen.wholeStage", "false")
               .config("spark.sql.session.timeZone", "UTC")
               .config("spark.sql.sources.partitionColumnTypeInference.enabled", "false")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()

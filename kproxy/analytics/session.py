"""Builds the Spark session ``kproxy report`` runs on: ``local[*]`` unless told otherwise.

Settings the report depends on are set here and nowhere else (UTC times, partition values kept as
text); anything spark-submit or spark-defaults.conf already set is left as the user set it.
"""

from __future__ import annotations

import os
import sys

from pyspark import SparkConf
from pyspark.sql import SparkSession

DEFAULT_MASTER = "local[*]"


# For a log of a few thousand lines (the demo's), on a local master: each Spark job's fixed cost is
# what the report's time is made of. Two shuffle partitions; no adaptive re-planning; no generated
# code at all (compiling Java per query and per expression costs more than it saves on a few rows:
# factoryMode is an internal Spark setting, NO_CODEGEN interprets the expressions); no web UI; a
# small heap; and a JVM that compiles with C1 only and collects with the serial collector. Measured on
# the demo's log (2 cores, load 6-10): the report's CPU time 58 s -> 44 s for the SQL settings, and
# Spark's start-up and the report both about twice as fast for the JVM's.
SMALL_INPUT_SETTINGS = {
    "spark.sql.shuffle.partitions": "2",
    "spark.default.parallelism": "2",
    "spark.sql.adaptive.enabled": "false",
    "spark.sql.codegen.wholeStage": "false",
    "spark.sql.codegen.factoryMode": "NO_CODEGEN",
    "spark.ui.enabled": "false",
    "spark.driver.memory": "1g",
    "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
}


def report_settings(master: str, progress_bar: bool, small_input: bool = False) -> dict[str, str]:
    """The settings the report needs on any master (plus small-shuffle defaults on local ones, and
    SMALL_INPUT_SETTINGS there when the input is known to be tiny)."""
    settings = {
        "spark.app.name": "kproxy report",
        # Traffic log times are UTC; a session in the machine's zone would shift every minute bucket.
        "spark.sql.session.timeZone": "UTC",
        # dt=2024-05-01/hour=07 stay strings, so pruning compares them as written.
        "spark.sql.sources.partitionColumnTypeInference.enabled": "false",
        "spark.ui.showConsoleProgress": "true" if progress_bar else "false",
    }
    if master.startswith("local"):
        # A laptop's worth of cores does not need 200 shuffle partitions per aggregation.
        cores = os.cpu_count() or 2
        settings["spark.sql.shuffle.partitions"] = str(max(4, 4 * cores))
        # Locally the tasks run in the driver's JVM, whose 1 GiB default heap runs out in the
        # end-to-end join's aggregation on a few million batches: a quarter of RAM, 2 to 8 GiB.
        settings["spark.driver.memory"] = f"{local_heap_gib()}g"
        if small_input:
            settings.update(SMALL_INPUT_SETTINGS)
    return settings


def local_heap_gib() -> int:
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 2
    return max(2, min(8, ram // 4 // 2**30))


def build_session(master: str | None = None, progress_bar: bool | None = None,
                  small_input: bool = False) -> SparkSession:
    """The report's session; ``master`` None keeps what spark-submit chose, else ``local[*]``. In a
    process that already has a session (a notebook, the tests) that one is used as it is.
    ``small_input``: tuned for a log of a few thousand lines, as the demo's (SMALL_INPUT_SETTINGS)."""
    active = SparkSession.getActiveSession()
    if active is not None:
        apply_runtime_settings(active)
        return active
    conf = SparkConf()
    chosen = master or conf.get("spark.master", DEFAULT_MASTER) or DEFAULT_MASTER
    bar = sys.stderr.isatty() if progress_bar is None else progress_bar
    if chosen.startswith("local"):
        use_this_python()
    builder = SparkSession.builder.master(chosen)
    for key, value in report_settings(chosen, bar, small_input).items():
        if key in ("spark.sql.shuffle.partitions", "spark.driver.memory") and conf.contains(key):
            continue
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark


def use_this_python() -> None:
    """Python workers of a local session run this interpreter (the one kproxy is installed in, for the
    rule dry-run), not whatever ``python3`` comes first on the PATH; unless PYSPARK_PYTHON says else."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


def apply_runtime_settings(spark: SparkSession) -> None:
    """Sets the SQL settings the report relies on in a session someone else built (tests, notebooks)."""
    for key in ("spark.sql.session.timeZone", "spark.sql.sources.partitionColumnTypeInference.enabled"):
        spark.conf.set(key, report_settings("cluster", False)[key])

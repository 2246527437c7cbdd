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


def report_settings(master: str, progress_bar: bool) -> dict[str, str]:
    """The settings the report needs on any master (plus small-shuffle defaults on local ones)."""
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
    return settings


def local_heap_gib() -> int:
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 2
    return max(2, min(8, ram // 4 // 2**30))


def build_session(master: str | None = None, progress_bar: bool | None = None) -> SparkSession:
    """The report's session; ``master`` None keeps what spark-submit chose, else ``local[*]``. In a
    process that already has a session (a notebook, the tests) that one is used as it is."""
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
    for key, value in report_settings(chosen, bar).items():
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

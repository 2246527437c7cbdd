"""Reads traffic logs into Spark: explicit schema, ``dt=/hour=`` partition pruning, --since/--until.

It only selects lines; every derived column and table is built in ``tables``. Files are read from any
path, glob or URI Spark understands. A line that does not parse is counted and shown, never guessed.
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from kproxy.analytics.spark_schema import traffic_log_schema

UTC = dt.UTC
CORRUPT = "_corrupt_record"
# Only finished log files: the writer's in-progress or temporary files carry other suffixes.
LOG_FILES = "*.{jsonl,jsonl.gz}"
# A line lives in the hour it was written, when its request completed: at or after the hour of its
# ts. Requests do not outlive kproxy's request timeouts, so one hour after --until catches them all.
WRITE_SLACK = dt.timedelta(hours=1)

_GLOB = re.compile(r"[*?\[{]")
_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhdw])$")
_UNIT = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


class ReportError(Exception):
    """A problem with the report's input or options, told to the user in one line."""


def parse_time(text: str, now: dt.datetime | None = None) -> dt.datetime:
    """--since/--until: an RFC 3339 / ISO 8601 date or time (UTC when it names no zone), or an age
    such as ``90m``, ``36h``, ``7d`` meaning that long before now."""
    value = text.strip()
    m = _RELATIVE.match(value)
    if m:
        now = now or dt.datetime.now(UTC)
        return now - dt.timedelta(**{_UNIT[m.group(2)]: float(m.group(1))})
    try:
        t = dt.datetime.fromisoformat(value.replace("z", "Z"))
    except ValueError:
        raise ReportError(f"cannot read time {text!r}: give 2024-05-01, 2024-05-01T10:30:00Z or an age "
                          "such as 36h or 7d") from None
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)


def _hour_key(t: dt.datetime) -> tuple[str, str]:
    return f"{t:%Y-%m-%d}", f"{t:%H}"


def partition_filter(since: dt.datetime | None, until: dt.datetime | None) -> Column | None:
    """A condition on the dt/hour partition columns alone, so Spark lists and reads only the
    partitions that can hold lines with since <= ts < until."""
    cond: Column | None = None
    if since is not None:
        d, h = _hour_key(since)
        cond = (F.col("dt") > d) | ((F.col("dt") == d) & (F.col("hour") >= h))
    if until is not None:
        d, h = _hour_key(until - dt.timedelta(microseconds=1) + WRITE_SLACK)
        upper = (F.col("dt") < d) | ((F.col("dt") == d) & (F.col("hour") <= h))
        cond = upper if cond is None else cond & upper
    return cond


def base_path(path: str) -> str | None:
    """The directory above the first ``dt=`` component, so a glob into the partitions keeps them."""
    m = re.search(r"(^|/)dt=", path)
    if not m or m.start() == 0:
        return None
    return path[: m.start()] or "/"


def expand_roots(spark: SparkSession, path: str) -> list[str]:
    """A glob above the partitions (``logs/*/traffic``) as the log roots it matches, each read on
    its own: Spark refuses to discover partitions under several roots in one read."""
    if base_path(path) is not None or not _GLOB.search(path):
        return [path]
    jvm: Any = spark.sparkContext._jvm
    hadoop_path = jvm.org.apache.hadoop.fs.Path(path)
    fs = hadoop_path.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
    matches = fs.globStatus(hadoop_path) or []
    roots = sorted(str(m.getPath().toString()) for m in matches)
    if not roots:
        raise ReportError(f"no traffic log at {path}")
    return roots


def read_lines(spark: SparkSession, paths: list[str], since: dt.datetime | None = None,
               until: dt.datetime | None = None) -> DataFrame:
    """Every traffic log line under ``paths`` with since <= ts < until, in the schema's columns plus
    ``_corrupt_record`` (the text of a line that did not parse, else null)."""
    schema = traffic_log_schema().add(T.StructField(CORRUPT, T.StringType(), True))
    frames = []
    for path in [root for p in paths for root in expand_roots(spark, p)]:
        reader = (spark.read.schema(schema).option("mode", "PERMISSIVE")
                  .option("columnNameOfCorruptRecord", CORRUPT).option("pathGlobFilter", LOG_FILES))
        base = base_path(path)
        if base is not None:
            reader = reader.option("basePath", base)
        try:
            df = reader.json(path)
        except Exception as e:  # Spark raises AnalysisException for a path that does not exist
            if "PATH_NOT_FOUND" in str(e) or "Path does not exist" in str(e):
                raise ReportError(f"no traffic log at {path}") from None
            raise
        if "dt" in df.columns and "hour" in df.columns:
            cond = partition_filter(since, until)
            if cond is not None:
                df = df.where(cond)
        else:
            df = df.withColumn("dt", F.lit(None).cast("string")).withColumn("hour", F.lit(None).cast("string"))
        frames.append(df)
    out = frames[0]
    for df in frames[1:]:
        out = out.unionByName(df)
    if since is None and until is None:
        return out
    ts = F.col("ts")
    window = F.lit(True)
    if since is not None:
        window = window & (ts >= _timestamp(since))
    if until is not None:
        window = window & (ts < _timestamp(until))
    # A malformed line has no ts; it must reach the caller's count, not vanish in the time filter.
    return out.where(ts.isNull() | F.col(CORRUPT).isNotNull() | window)


def _timestamp(t: dt.datetime) -> Column:
    # Through text with its offset: a Python datetime literal would go through the local zone.
    return F.lit(t.astimezone(UTC).isoformat()).cast("timestamp")

"""Policy and quota dry-run: a candidate rules file applied to recorded traffic with kproxy's own engines.

The rules are loaded and checked once on the driver (a broken file stops the report with the same
file:line message ``kproxy check`` prints), then shipped to the executors, where
``kproxy.policy.decide`` judges every recorded request, and each quota's requests are charged, in
time order per budget key, with the accounting ``kproxy.quota`` uses, inside vectorised pandas
functions (``mapInPandas``, ``applyInPandas``): the one place the report runs Python per row. Spark
aggregates what comes out. Quotas are judged with Kafka's default 11 samples of 1 s, either per
kproxy instance (the lines' ``proxy``) with the static share ``1 / quota_replicas`` each, or, in fleet
mode, with every instance's traffic on a budget key summed before the whole limit applies, as fleet
quotas (``quota.coordination``) enforce it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from kproxy.analytics.source import ReportError

# What decide() is told about each recorded request (the requests table's columns).
_INPUT = ("ts", "virtual_cluster", "api", "api_key", "api_version", "client_id", "principal", "client_address", "listener",
          "client_software_name", "client_software_version", "topics", "group", "transactional_id", "acks",
          "partitions")

# Rows the pandas functions yield (Spark DDL; the comments say what each column holds).
_OUTPUT = ("ts timestamp, virtual_cluster string, rule string, action string, error string, client_id string, principal string, "
           "api string, refused_topics int, example_topic string")
# rule: "default" when no rule decided; action: allow, deny, rewrite, or "refuse topics" when partial.


def dry_run(requests: DataFrame, rules_path: Path, fleet: bool = False, replicas: int = 1) -> dict[str, DataFrame]:
    """Applies the rules file (or directory) at ``rules_path`` to ``requests`` (the report's table).

    Returns ``dry_run_decisions`` (per rule and action: how many requests it decided),
    ``dry_run_denied`` (who would have been refused, by which rule, with which error, how often, and
    when first and last), when the file has validate rules ``dry_run_record_rules`` (what each would
    have judged, and refused where the log can tell), and, when the file has quotas,
    ``dry_run_throttled`` (per quota and budget key: requests counted, how many would have been
    throttled, and by how much; per instance with a ``1 / replicas`` share of each limit, or with
    ``fleet`` summed over the instances, ``instance`` then ``*``).
    """
    from kproxy.policy.loader import RuleError, load_rules

    try:
        rules = load_rules([str(rules_path)])
    except RuleError as e:
        raise ReportError(f"--rules: {e}") from None
    check_executors(requests.sparkSession)
    tables = _policy(requests, rules)
    if any(r.action == "validate" for r in rules.rules):
        tables["dry_run_record_rules"] = _record_rules(requests, rules)
    if rules.quotas:
        tables["dry_run_throttled"] = _quotas(requests, rules, fleet, 1.0 / replicas)
    return tables


def check_executors(spark: SparkSession) -> None:
    """One task on one executor first: can its Python import the same kproxy as the driver's? Without
    this, an executor lacking kproxy fails the dry run deep inside a pandas function, in a long Py4J
    traceback. Raises ReportError with one line that says what to install where."""
    import sys

    from kproxy import __version__

    driver_python = f"{sys.version_info.major}.{sys.version_info.minor}"

    # Nested, so cloudpickle ships it by value: it must not need kproxy to be unpickled.
    def probe(_: Any) -> tuple[str, str, str, str]:
        import socket as _socket
        import sys as _sys

        python = f"{_sys.version_info.major}.{_sys.version_info.minor}"
        try:
            import kproxy as _kproxy
        except ImportError as e:
            return _socket.gethostname(), python, "", str(e)
        return _socket.gethostname(), python, _kproxy.__version__, ""

    install = (f"install kproxy {__version__} there (pip install 'kproxy-kafka=={__version__}') in the Python "
               "the executors run, or point them at an environment that has it (spark.pyspark.python)")
    try:
        host, python, version, error = spark.sparkContext.parallelize([0], 1).map(probe).collect()[0]
    except Exception as e:
        text = str(e)
        if "PYTHON_VERSION_MISMATCH" in text or "different version" in text:
            raise ReportError(f"--rules runs kproxy's rule engine on the Spark executors, and their Python is "
                              f"not the driver's {driver_python}: give the executors Python {driver_python} with "
                              f"kproxy {__version__} (spark.pyspark.python)") from None
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        first = next((line for line in lines if "Error" in line), lines[0] if lines else type(e).__name__)
        raise ReportError(f"--rules: a test task on an executor failed ({first[:300]}); "
                          f"the executors need Python {driver_python} and kproxy {__version__}") from None
    if error:
        raise ReportError(f"--rules runs kproxy's rule engine on the Spark executors, and executor {host} "
                          f"cannot import kproxy ({error}): {install}")
    if python != driver_python:
        raise ReportError(f"--rules: executor {host} runs Python {python}, the driver {driver_python}: give the "
                          f"executors Python {driver_python} (spark.pyspark.python)")
    if version != __version__:
        raise ReportError(f"--rules: executor {host} has kproxy {version}, the driver {__version__}: {install}")


def _policy(requests: DataFrame, rules: Any) -> dict[str, DataFrame]:
    judged = requests.select(*_INPUT).mapInPandas(_judge(rules), schema=_OUTPUT)
    decisions = judged.groupBy("virtual_cluster", "rule", "action").agg(F.count(F.lit(1)).alias("requests"))
    denied = (judged.where(F.col("action").isin("deny", "refuse topics"))
              .groupBy("virtual_cluster", "rule", "client_id", "principal", "api", "action", "error")
              .agg(F.count(F.lit(1)).alias("requests"), F.sum("refused_topics").alias("refused_topics"),
                   F.first("example_topic", ignorenulls=True).alias("example_topic"),
                   F.min("ts").alias("first_seen"), F.max("ts").alias("last_seen"))
              .orderBy(F.desc("requests")))
    return {"dry_run_decisions": decisions.orderBy(F.desc("requests")), "dry_run_denied": denied}


def _judge(rules: Any) -> Any:
    """The pandas function each executor runs: batches of requests in, one decision each out."""

    def judge(batches: Iterator[Any]) -> Iterator[Any]:
        import pandas as pd

        from kproxy.policy.engine import Facts, decide
        from kproxy.protocol.errors import error_name

        for batch in batches:
            out = []
            for row in batch.itertuples(index=False):
                facts = _facts(row, Facts)
                if facts is None:
                    continue
                d = decide(rules, facts)
                refused = d.refused
                action = d.action if d.action == "deny" or not refused else "refuse topics"
                if action == "deny":
                    error = error_name(d.error) if d.error is not None else None
                elif refused:
                    error = error_name(refused[0].error)
                else:
                    error = None
                rule = d.rule if not refused or d.action == "deny" else refused[0].rule
                out.append((row.ts, row.virtual_cluster, rule or "default", action, error, row.client_id,
                            row.principal, row.api,
                            len(refused), refused[0].topic if refused else None))
            yield pd.DataFrame(out, columns=_columns(_OUTPUT))

    return judge


def _facts(row: Any, facts_cls: Any) -> Any:
    """The engine's view of one recorded request, or None when the line lacks the API's key."""
    api_key, api_version = _scalar(row.api_key), _scalar(row.api_version)
    if api_key is None and _scalar(row.api) is not None:
        # ``api_key`` is optional in a line; the name says the same.
        api_key = _API_KEYS.get(row.api)
    if api_key is None or api_version is None:
        return None
    topics = [t for t in row.topics] if _scalar(row.topics, array=True) is not None else []
    compression, largest = [], 0
    if _scalar(row.partitions, array=True) is not None:
        for p in row.partitions:
            if p.get("topic") and p["topic"] not in topics:
                topics.append(p["topic"])
            if p.get("compression"):
                compression.append(p["compression"])
            largest = max(largest, int(_scalar(p.get("bytes")) or 0))
    address = _scalar(row.client_address)
    acks = _scalar(row.acks)
    group, txn = _scalar(row.group), _scalar(row.transactional_id)
    return facts_cls(
        api_key=int(api_key), api_version=int(api_version), client_id=_scalar(row.client_id),
        principal=_scalar(row.principal), source=address.rsplit(":", 1)[0].strip("[]") if address else None,
        listener=_scalar(row.listener) or "bootstrap", client_software_name=_scalar(row.client_software_name),
        client_software_version=_scalar(row.client_software_version), topics=tuple(topics),
        groups=(group,) if group else (), transactional_ids=(txn,) if txn else (),
        acks=None if acks is None else int(acks), compression=tuple(dict.fromkeys(compression)),
        max_batch_bytes=largest)


def _api_keys() -> dict[str, int]:
    from kproxy.protocol.messages import apis

    return {api.name: key for key, api in apis().items()}


_API_KEYS = _api_keys()


def _scalar(value: Any, array: bool = False) -> Any:
    """``value`` with pandas' and NumPy's missing-value markers (None, NaN, pd.NA) as None."""
    if value is None:
        return None
    if array:
        return value
    try:
        import pandas as pd

        return None if pd.isna(value) else value
    except (TypeError, ValueError):
        return value


# Per validate rule and produced partition it reaches: ``refused`` 1 when the log proves a record
# breaks the rule, ``cannot_judge`` the checks the log has nothing for (null when none).
_RECORDS = ("ts timestamp, virtual_cluster string, rule string, client_id string, topic string, records bigint, refused int, "
            "cannot_judge string")
# The traffic log holds batch sizes and record counts, never keys, values or headers.
NOT_LOGGED = "keys, values and headers are not in the traffic log"


def _record_rules(requests: DataFrame, rules: Any) -> DataFrame:
    """Per validate rule, client and topic: the partitions and records it would have judged, how many
    partitions it would certainly have refused, and which of its checks cannot be dry-run."""
    judged = requests.where(F.col("api") == "produce").select(*_INPUT).mapInPandas(
        _judge_records(rules), schema=_RECORDS)
    return (judged.groupBy("virtual_cluster", "rule", "client_id", "topic")
            .agg(F.count(F.lit(1)).alias("partitions"), F.sum("records").alias("records"),
                 F.sum("refused").alias("refused_partitions"),
                 F.first("cannot_judge", ignorenulls=True).alias("cannot_judge"),
                 F.min("ts").alias("first_seen"), F.max("ts").alias("last_seen"))
            .orderBy(F.desc("refused_partitions"), F.desc("partitions")))


def unjudgeable_checks(v: Any) -> list[str]:
    """The checks of a Validate that need record contents (all but max_record_bytes)."""
    out = []
    if v.value is not None:
        out.append(f"value {v.value.kind}")
    if not v.allow_null:
        out.append("allow_null: false")
    if v.key_required:
        out.append("key required")
    if v.key is not None:
        out.append(f"key {v.key.kind}")
    if v.required_headers:
        out.append("headers required")
    return out


def certainly_too_large(max_record_bytes: int | None, api_version: int, compression: Any, size: int,
                        records: int) -> bool:
    """Whether a produced partition must hold a record over ``max_record_bytes``: from v3 a Produce
    partition is one batch (61 header bytes, then its records), and when it is uncompressed its
    records' average size is a lower bound of the largest."""
    if max_record_bytes is None or api_version < 3 or compression not in ("none", None) or records <= 0:
        return False
    return (size - 61) / records > max_record_bytes


def _judge_records(rules: Any) -> Any:
    def judge(batches: Iterator[Any]) -> Iterator[Any]:
        import pandas as pd

        from kproxy.policy.engine import Facts, decide

        validators = {r.name: r.params for r in rules.rules if r.action == "validate"}
        for batch in batches:
            out = []
            for row in batch.itertuples(index=False):
                facts = _facts(row, Facts)
                if facts is None or _scalar(row.partitions, array=True) is None:
                    continue
                reach = {t: [n for n in names if n in validators] for t, names in decide(rules, facts).record_rules}
                for p in row.partitions:
                    topic = p.get("topic")
                    for name in reach.get(topic) or ():
                        v = validators[name]
                        records = int(_scalar(p.get("records")) or 0)
                        refused = certainly_too_large(v.max_record_bytes, facts.api_version, p.get("compression"),
                                                      int(_scalar(p.get("bytes")) or 0), records)
                        unknown = unjudgeable_checks(v)
                        if v.max_record_bytes is not None and not refused and p.get("compression") not in (
                                "none", None):
                            unknown.append("max_record_bytes of compressed batches")
                        out.append((row.ts, row.virtual_cluster, name, row.client_id, topic, records, int(refused),
                                    f"{', '.join(unknown)}: {NOT_LOGGED}" if unknown else None))
            yield pd.DataFrame(out, columns=_columns(_RECORDS))

    return judge


# t: when the response completed (seconds); spent: kproxy's own time on the request (seconds).
# instance: the kproxy that counted it, or "*" when the fleet's instances share one budget.
# Each virtual cluster has budgets of its own, as in kproxy.
_CHARGES = ("virtual_cluster string, quota string, key string, instance string, t double, produced bigint, fetched bigint, "
            "spent double, answered double")
# t: when the request is charged (a Produce with an answer as it arrived, as the live quota filter
# charges it; the rest when their answer was complete); answered: when a Produce's answer came, for
# its kproxy time (NaN for the others).

_THROTTLED = ("virtual_cluster string, quota string, key string, instance string, requests bigint, throttled bigint, "
              "throttle_ms_total bigint, throttle_ms_p99 bigint, throttle_ms_max bigint")


def _quotas(requests: DataFrame, rules: Any, fleet: bool, share: float) -> DataFrame:
    """Per quota and budget key (and instance, unless ``fleet``), what the quota would have done."""
    charges = requests.select(*_INPUT, "done_ts", "proxy", "conn", "kproxy_ms", "response_bytes").mapInPandas(
        _charges(rules, fleet), schema=_CHARGES)
    return (charges.groupBy("virtual_cluster", "quota", "key", "instance")
            .applyInPandas(_replay(rules, 1.0 if fleet else share), schema=_THROTTLED)
            .orderBy(F.desc("throttle_ms_total"), F.desc("requests")))


def _charges(rules: Any, fleet: bool) -> Any:
    """Each recorded request, once per quota that would have counted it, with what it is charged."""

    def charges(batches: Iterator[Any]) -> Iterator[Any]:
        import pandas as pd

        from kproxy.policy.engine import Facts
        from kproxy.quota.engine import key_of, quota_applies, quotas_of

        quotas = quotas_of(rules)
        for batch in batches:
            out = []
            for row in batch.itertuples(index=False):
                facts = _facts(row, Facts)
                if facts is None:
                    continue
                done = _scalar(row.done_ts)
                if done is None:
                    continue
                produced = fetched = 0
                if _scalar(row.partitions, array=True) is not None:
                    moved = sum(int(_scalar(p.get("bytes")) or 0) for p in row.partitions)
                    produced, fetched = (moved, 0) if row.api == "produce" else (0, moved) if row.api == "fetch" \
                        else (0, 0)
                if row.api == "fetch":
                    # Charged the size of its answer, as the live quota charges it (the broker's answer:
                    # what reached the client less its size prefix); its records' bytes without that.
                    answer = int(_scalar(row.response_bytes) or 0)
                    if answer > 4:
                        fetched = answer - 4
                done_s = pd.Timestamp(done).timestamp()
                t, answered = done_s, float("nan")
                if row.api == "produce" and _scalar(row.acks) != 0:
                    # Charged as it arrives, as the live quota filter charges a Produce (its throttle
                    # mutes the client at once); its kproxy time when its answer comes.
                    t, answered = pd.Timestamp(row.ts).timestamp(), done_s
                connection = f"{_scalar(row.proxy) or ''}/{_scalar(row.conn)}"
                instance = "*" if fleet else _scalar(row.proxy) or "?"
                for q in quotas:
                    if not (q.rule.match.holds_for_connection(
                            facts.client_id, facts.principal, facts.source, facts.listener,
                            facts.client_software_name, facts.client_software_version)
                            and quota_applies(q, facts.api_key, facts.api_version, facts.acks)):
                        continue
                    key = key_of(q.rule.per, facts.client_id, facts.principal, facts.source, connection)
                    spent = (_scalar(row.kproxy_ms) or 0.0) / 1000.0
                    out.append((row.virtual_cluster, q.rule.name, key, instance, t, produced, fetched, spent,
                                answered))
            yield pd.DataFrame(out, columns=_columns(_CHARGES))

    return charges


def _replay(rules: Any, share: float) -> Any:
    """One quota's budget key: its requests charged in time order; the throttles that come of it."""

    def replay(group: Any) -> Any:
        import pandas as pd

        from kproxy.quota.engine import quotas_of, replay_throttles

        cluster = group["virtual_cluster"].iloc[0]
        name, key, instance = group["quota"].iloc[0], group["key"].iloc[0], group["instance"].iloc[0]
        q = next(q for q in quotas_of(rules, share=share) if q.rule.name == name)
        group = group.sort_values("t", kind="stable")
        ms = replay_throttles(q, zip(group["t"], group["produced"], group["fetched"], group["spent"], group["answered"],
                                     strict=True))
        hit = sorted(m for m in ms if m > 0)
        p99 = hit[int(0.99 * (len(hit) - 1))] if hit else 0
        return pd.DataFrame([(cluster, name, key, instance, len(ms), len(hit), sum(hit), p99, max(hit, default=0))],
                            columns=_columns(_THROTTLED))

    return replay


def _columns(ddl: str) -> list[str]:
    """The column names of a DDL schema string, in order."""
    return [part.split()[0] for part in ddl.split(",")]


# ---- the coordination topic's history (fleet quotas)

# One record as a dump holds it: kcat -C -t TOPIC -f '%k\t%s\t%T\n' (key, value, timestamp in ms).
_DUMP_RECORDS = "fleet string, quota string, key string, instance string, rate double, demand double, at double"


def coordination_tables(spark: Any, dump: Path) -> dict[str, DataFrame]:
    """``coordination_budgets`` from a dump of the coordination topic: per fleet, quota and budget key,
    the instances that reported it, and the peak per second of the rates and demands they reported
    summed (fractions of the quota's whole limit: above 1, the fleet wanted more than the limit)."""
    if not dump.is_file():
        raise ReportError(f"--coordination-dump {dump}: no such file")
    lines = spark.read.text(str(dump))
    records = lines.mapInPandas(_decode_records, schema=_DUMP_RECORDS)
    per_second = (records.withColumn("second", F.floor("at"))
                  .groupBy("fleet", "quota", "key", "instance", "second")
                  .agg(F.max("rate").alias("rate"), F.max("demand").alias("demand")))
    summed = (per_second.groupBy("fleet", "quota", "key", "second")
              .agg(F.sum("rate").alias("rate"), F.sum("demand").alias("demand")))
    peaks = summed.groupBy("fleet", "quota", "key").agg(F.max("rate").alias("peak_rate"),
                                                        F.max("demand").alias("peak_demand"))
    seen = records.groupBy("fleet", "quota", "key").agg(
        F.countDistinct("instance").alias("instances"), F.count(F.lit(1)).alias("records"),
        F.min("at").cast("timestamp").alias("first_seen"), F.max("at").cast("timestamp").alias("last_seen"))
    table = (seen.join(peaks, ["fleet", "quota", "key"]).where(F.col("quota") != "")
             .orderBy(F.desc("peak_demand")))
    return {"coordination_budgets": table}


def _decode_records(batches: Iterator[Any]) -> Iterator[Any]:
    import pandas as pd

    from kproxy.quota.fleet import decode_record

    for batch in batches:
        out = []
        for line in batch["value"]:
            parts = line.split("\t")
            if len(parts) != 3:
                continue
            try:
                at = int(parts[2]) / 1000.0
            except ValueError:
                continue
            r = decode_record(parts[0].encode(), parts[1].encode(), at)
            if r is not None:
                out.append((r.fleet, r.quota, r.key, r.instance, r.rate, r.demand, r.at))
        yield pd.DataFrame(out, columns=_columns(_DUMP_RECORDS))

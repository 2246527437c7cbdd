"""The report's tables, each a DataFrame built from the traffic log lines with Spark expressions.

Nothing here collects rows or runs Python per row; ``job`` decides what is written and when. Times
are UTC; percentiles are approximate (``percentile_approx`` with ``PERCENTILE_ACCURACY``). Every table
is per virtual cluster (``virtual_cluster`` first): clients, topics and node ids of two virtual
clusters are never the same ones, even when their names are. Lines from before virtual clusters
count as ``default``, the name of a file without them.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from kproxy.analytics.removed_versions import REMOVED_IN, removed_versions
from kproxy.analytics.source import CORRUPT
from kproxy.config import DEFAULT_NAME

VC = "virtual_cluster"

# percentile_approx's accuracy: the rank of a returned value is within 1/ACCURACY of the rank
# asked for (0.01% of the rows at 10,000, Spark's default), whatever the number of rows.
PERCENTILE_ACCURACY = 10_000
PERCENTILES = (0.5, 0.95, 0.99)
QUANTILE_NAMES = ("p50", "p95", "p99")

PRODUCE_APIS = ("produce",)
FETCH_APIS = ("fetch", "share_fetch")

# Quota advice: the observed p99 per-second rate times HEADROOM, rounded up to two significant
# digits, and never below the floors (a quiet client still needs room to start up).
HEADROOM = 2.0
FLOOR_BYTES_PER_S = 64 * 1024
FLOOR_REQUESTS_PER_S = 10

# End-to-end join: offsets are bucketed so a produce batch meets only the fetches near it.
OFFSET_BUCKET = 4096


def _micros(c: Column) -> Column:
    return F.unix_micros(c)


def _ms_between(later: Column, earlier: Column) -> Column:
    return (_micros(later) - _micros(earlier)) / 1000.0


def valid_lines(lines: DataFrame) -> Column:
    """A line the report can use: parsed, with a time, an API and a duration."""
    return (F.col(CORRUPT).isNull() & F.col("ts").isNotNull() & F.col("api").isNotNull()
            & F.col("duration_ms").isNotNull())


def requests_table(lines: DataFrame) -> DataFrame:
    """One row per valid line, with the times and splits the other tables use."""
    done = F.timestamp_micros(_micros(F.col("ts")) + (F.col("duration_ms") * 1000).cast("long"))
    return lines.where(valid_lines(lines)).select(
        "ts",
        done.alias("done_ts"),
        F.date_trunc("minute", "ts").alias("minute"),
        F.coalesce(F.col(VC), F.lit(DEFAULT_NAME)).alias(VC),
        "proxy", "conn", "client_address", "client_id", "principal", "client_software_name",
        "client_software_version", "listener", "api", "api_key", "api_version", "correlation_id", "broker",
        "outcome", "request_bytes", "response_bytes", "duration_ms", "queued_ms", "broker_ms", "return_ms",
        # kproxy's share: everything that was not the broker (filters, holds, connect, writing back).
        (F.col("duration_ms") - F.coalesce("broker_ms", F.lit(0.0))).alias("kproxy_ms"),
        F.coalesce("throttle_ms", F.lit(0)).alias("throttle_ms"),
        "max_wait_ms", F.coalesce("error_code", F.lit(0)).alias("error_code"), "error", "partition_errors",
        "rule", "action", "records_refused",
        F.col("quota.rule").alias("quota_rule"), F.col("quota.key").alias("quota_key"),
        F.col("quota.throttle_ms").alias("quota_throttle_ms"),
        "group", "transactional_id", "acks", "topics", "partitions",
    )


def partitions_table(requests: DataFrame) -> DataFrame:
    """One row per topic partition of every Produce and Fetch: the records that moved."""
    direction = (F.when(F.col("api").isin(*PRODUCE_APIS), F.lit("produce"))
                 .when(F.col("api").isin(*FETCH_APIS), F.lit("fetch")))
    p = F.col("p")
    return (requests.where(direction.isNotNull() & (F.size("partitions") > 0))
            .select("ts", "done_ts", "minute", VC, "proxy", "conn", "client_id", "principal", "api",
                    direction.alias("direction"), "group", "acks", F.explode("partitions").alias("p"))
            .select("ts", "done_ts", "minute", VC, "proxy", "conn", "client_id", "principal", "api", "direction",
                    "group", "acks", p.topic.alias("topic"), p.partition.alias("partition"),
                    F.coalesce(p.records, F.lit(0)).alias("records"), F.coalesce(p.bytes, F.lit(0)).alias("bytes"),
                    p.first_offset.alias("first_offset"), p.last_offset.alias("last_offset"),
                    p.first_timestamp.alias("first_timestamp"), p.max_timestamp.alias("max_timestamp"),
                    p.compression.alias("compression"), F.coalesce(p.error_code, F.lit(0)).alias("error_code")))


def _sum_if(cond: Column, value: Column | str) -> Column:
    v = F.col(value) if isinstance(value, str) else value
    return F.coalesce(F.sum(F.when(cond, v)), F.lit(0)).cast("long")


def _quantiles(col: str, prefix: str) -> list[Column]:
    """``{prefix}_p50/p95/p99`` of ``col`` (approximate, see PERCENTILE_ACCURACY)."""
    arr = F.percentile_approx(col, list(PERCENTILES), PERCENTILE_ACCURACY)
    return [arr.alias(f"_{prefix}_q")]


def _expand_quantiles(df: DataFrame, prefixes: list[str]) -> DataFrame:
    cols = []
    for prefix in prefixes:
        cols += [F.col(f"_{prefix}_q")[i].alias(f"{prefix}_{name}") for i, name in enumerate(QUANTILE_NAMES)]
    return df.select(*[c for c in df.columns if not c.startswith("_")], *cols)


# ---- 1. traffic --------------------------------------------------------------------------------

def requests_per_minute(requests: DataFrame) -> DataFrame:
    errored = (F.col("error_code") != 0) | F.col("error").isNotNull()
    return requests.groupBy("minute", VC, "client_id", "principal", "api").agg(
        F.count(F.lit(1)).alias("requests"),
        F.sum("request_bytes").alias("request_bytes"),
        F.sum("response_bytes").alias("response_bytes"),
        _sum_if(errored, F.lit(1)).alias("errors"),
        _sum_if(F.col("action") == "deny", F.lit(1)).alias("denials"),
        _sum_if(F.col("throttle_ms") > 0, F.lit(1)).alias("throttled"),
        F.sum("throttle_ms").alias("throttle_ms"),
        _sum_if(F.col("outcome") == "upstream_lost", F.lit(1)).alias("upstream_lost"),
    )


def records_per_minute(partitions: DataFrame) -> DataFrame:
    return partitions.groupBy("minute", VC, "client_id", "principal", "topic", "direction").agg(
        F.sum("bytes").alias("bytes"), F.sum("records").alias("records"),
        F.count(F.lit(1)).alias("partition_entries"),
    )


def traffic_by(requests: DataFrame, partitions: DataFrame, key: str) -> DataFrame:
    """Totals, first/last seen and per-second peaks and p99s for one of client_id, principal, topic.

    Requests and record batches are summed per (key, second) in one aggregation, then per key: two
    shuffles, no joins. Per-second figures are over the seconds in which the key was active (a
    second with no traffic is not a sample), which is the rate a quota has to allow while it works."""
    zero = F.lit(0).cast("long")
    if key == "topic":
        req = requests.select(VC, F.explode(F.array_distinct("topics")).alias("topic"), "ts",
                              zero.alias("request_bytes"), zero.alias("response_bytes"))
    else:
        req = requests.select(VC, key, "ts", "request_bytes", "response_bytes")
    produce = F.col("direction") == "produce"
    events = req.select(VC, key, "ts", F.lit(1).alias("n"), "request_bytes", "response_bytes",
                        zero.alias("pb"), zero.alias("fb"), zero.alias("pr"), zero.alias("fr")).unionByName(
        partitions.select(VC, key, "ts", F.lit(0).alias("n"), zero.alias("request_bytes"), zero.alias("response_bytes"),
                          F.when(produce, F.col("bytes")).otherwise(0).alias("pb"),
                          F.when(~produce, F.col("bytes")).otherwise(0).alias("fb"),
                          F.when(produce, F.col("records")).otherwise(0).alias("pr"),
                          F.when(~produce, F.col("records")).otherwise(0).alias("fr")))
    sums = ("n", "request_bytes", "response_bytes", "pb", "fb", "pr", "fr")
    per_second = events.groupBy(VC, key, F.date_trunc("second", "ts").alias("second")).agg(
        F.min("ts").alias("first_seen"), F.max("ts").alias("last_seen"),
        *[F.coalesce(F.sum(c), zero).alias(c) for c in sums])

    def p99_of_active(c: str) -> Column:
        return F.percentile_approx(F.when(F.col(c) > 0, F.col(c)), 0.99, PERCENTILE_ACCURACY)

    out = per_second.groupBy(VC, key).agg(
        F.sum("n").alias("requests"), F.min("first_seen").alias("first_seen"), F.max("last_seen").alias("last_seen"),
        *([F.sum("request_bytes").alias("request_bytes"), F.sum("response_bytes").alias("response_bytes")]
          if key != "topic" else []),
        F.sum("pb").alias("produce_bytes"), F.sum("fb").alias("fetch_bytes"),
        F.sum("pr").alias("produced_records"), F.sum("fr").alias("fetched_records"),
        F.max("n").alias("peak_requests_per_s"), p99_of_active("n").alias("p99_requests_per_s"),
        F.max("pb").alias("peak_produce_bytes_per_s"), p99_of_active("pb").alias("p99_produce_bytes_per_s"),
        F.max("fb").alias("peak_fetch_bytes_per_s"), p99_of_active("fb").alias("p99_fetch_bytes_per_s"),
        F.max("pr").alias("peak_produced_records_per_s"), F.max("fr").alias("peak_fetched_records_per_s"),
    )
    return out.withColumn("total_bytes", F.col("produce_bytes") + F.col("fetch_bytes"))


# ---- 2. latency --------------------------------------------------------------------------------

def latency_by(requests: DataFrame, keys: list[str]) -> DataFrame:
    """p50/p95/p99 of total, broker and kproxy time, and what throttling added, per ``keys``."""
    df = requests.withColumn("wait_ms", F.col("duration_ms") + F.col("throttle_ms"))
    agg = df.groupBy(VC, *keys).agg(
        F.count(F.lit(1)).alias("requests"),
        *_quantiles("duration_ms", "total_ms"), *_quantiles("broker_ms", "broker_ms"),
        *_quantiles("kproxy_ms", "kproxy_ms"), *_quantiles("wait_ms", "wait_ms"),
        _sum_if(F.col("throttle_ms") > 0, F.lit(1)).alias("throttled_requests"),
        F.sum("throttle_ms").cast("long").alias("throttle_ms_total"),
        F.sum("duration_ms").alias("_duration_total"),
    )
    # The share of the clients' waiting that was throttling (throttle_time_ms they were told to
    # honour), against the time the requests themselves took.
    agg = agg.withColumn("throttle_share", F.col("throttle_ms_total")
                         / (F.col("throttle_ms_total") + F.col("_duration_total")))
    return _expand_quantiles(agg, ["total_ms", "broker_ms", "kproxy_ms", "wait_ms"])


# ---- 3. errors, denials, throttles ------------------------------------------------------------

def errors_table(requests: DataFrame) -> DataFrame:
    errored = requests.where((F.col("error_code") != 0) | F.col("error").isNotNull())
    name = F.coalesce(F.col("error"), F.concat(F.lit("error code "), F.col("error_code").cast("string")))
    return errored.groupBy(VC, "api", "client_id", name.alias("error"), "error_code").agg(
        F.count(F.lit(1)).alias("requests"), F.min("ts").alias("first_seen"), F.max("ts").alias("last_seen"))


def partition_errors_table(requests: DataFrame) -> DataFrame:
    exploded = requests.where(F.size("partition_errors") > 0).select(
        VC, "api", "client_id", F.explode("partition_errors").alias("error", "partitions"))
    return exploded.groupBy(VC, "api", "client_id", "error").agg(F.sum("partitions").alias("partitions"))


def denials_table(requests: DataFrame) -> DataFrame:
    return requests.where(F.col("action") == "deny").groupBy(VC, "rule", "api", "client_id", "principal").agg(
        F.count(F.lit(1)).alias("requests"), F.min("ts").alias("first_seen"), F.max("ts").alias("last_seen"))


def record_refusals_table(requests: DataFrame) -> DataFrame:
    """Per client, topic and validate rule: the partition batches refused with INVALID_RECORD and the
    records at fault in them."""
    refused = requests.where(F.size("records_refused") > 0).select(
        "ts", VC, "client_id", F.explode("records_refused").alias("r"))
    return refused.groupBy(VC, "client_id", F.col("r.topic").alias("topic"), F.col("r.rule").alias("rule")).agg(
        F.count(F.lit(1)).alias("batches"), F.sum("r.records").alias("records"),
        F.min("ts").alias("first_seen"), F.max("ts").alias("last_seen"))


def throttles_table(requests: DataFrame) -> DataFrame:
    source = F.when(F.col("quota_rule").isNotNull(), F.lit("kproxy")).otherwise(F.lit("broker"))
    return requests.where(F.col("throttle_ms") > 0).groupBy(
        VC, source.alias("source"), "quota_rule", "quota_key", "client_id", "api").agg(
        F.count(F.lit(1)).alias("requests"), F.sum("throttle_ms").alias("throttle_ms_total"),
        F.max("throttle_ms").alias("throttle_ms_max"))


def incidents_per_minute(per_minute: DataFrame) -> DataFrame:
    return per_minute.groupBy("minute", VC).agg(
        *[F.sum(c).alias(c) for c in ("requests", "errors", "denials", "throttled", "upstream_lost")])


# ---- 4. fleet and upgrade risk ----------------------------------------------------------------

SOFTWARE = ["client_id", "client_software_name", "client_software_version"]


def fleet_table(requests: DataFrame) -> DataFrame:
    return requests.groupBy(VC, *SOFTWARE).agg(
        F.count(F.lit(1)).alias("requests"),
        # countDistinct skips rows with a null column, and proxy may be null.
        F.countDistinct(F.concat_ws("/", F.coalesce("proxy", F.lit("")), F.col("conn"))).alias("connections"),
        F.array_sort(F.collect_set("principal")).alias("principals"),
        F.min("ts").alias("first_seen"), F.max("ts").alias("last_seen"))


def api_versions_table(requests: DataFrame) -> DataFrame:
    return requests.groupBy(VC, *SOFTWARE, "api", "api_version").agg(
        F.count(F.lit(1)).alias("requests"), F.min("ts").alias("first_seen"), F.max("ts").alias("last_seen"))


def removed_versions_frame(spark: SparkSession) -> DataFrame:
    schema = T.StructType([T.StructField("api", T.StringType()), T.StructField("api_key", T.LongType()),
                           T.StructField("api_version", T.LongType()),
                           T.StructField("minimum_version", T.LongType())])
    return spark.createDataFrame(removed_versions(), schema)


def upgrade_risk_table(api_versions: DataFrame, removed: DataFrame) -> DataFrame:
    """Every (client, API, version) the traffic used that the upgrade removes, with when last seen."""
    return (api_versions.join(F.broadcast(removed.drop("api_key")), ["api", "api_version"])
            .withColumn("removed_in", F.lit(REMOVED_IN))
            .select(VC, *SOFTWARE, "api", "api_version", "minimum_version", "removed_in", "requests",
                    "first_seen", "last_seen"))


# ---- 5. quota advice ----------------------------------------------------------------------------

def _nice_up(x: Column, floor: float) -> Column:
    """x rounded up to two significant digits, at least ``floor``."""
    v = F.greatest(x, F.lit(float(floor)))
    step = F.pow(F.lit(10.0), F.floor(F.log10(v)) - 1)
    return (F.ceil(v / step) * step).cast("long")


def quota_advice_table(by_client: DataFrame, by_principal: DataFrame) -> DataFrame:
    def advise(df: DataFrame, key: str) -> DataFrame:
        def rec(p99: str, peak: str, floor: float) -> Column:
            return F.when(F.col(peak) > 0, _nice_up(F.coalesce(F.col(p99), F.col(peak)) * HEADROOM, floor))
        return df.where(F.col(key).isNotNull()).select(
            VC, F.lit(key).alias("dimension"), F.col(key).alias("key"), "requests",
            "p99_produce_bytes_per_s", "peak_produce_bytes_per_s", "p99_fetch_bytes_per_s",
            "peak_fetch_bytes_per_s", "p99_requests_per_s", "peak_requests_per_s",
            rec("p99_produce_bytes_per_s", "peak_produce_bytes_per_s", FLOOR_BYTES_PER_S)
            .alias("recommended_produce_bytes_per_s"),
            rec("p99_fetch_bytes_per_s", "peak_fetch_bytes_per_s", FLOOR_BYTES_PER_S)
            .alias("recommended_fetch_bytes_per_s"),
            rec("p99_requests_per_s", "peak_requests_per_s", FLOOR_REQUESTS_PER_S)
            .alias("recommended_requests_per_s"))
    return advise(by_client, "client_id").unionByName(advise(by_principal, "principal"))


# ---- 7. end-to-end latency ----------------------------------------------------------------------

def e2e_batches(partitions: DataFrame) -> DataFrame:
    """Each acknowledged produce batch met with the first fetch per consumer group that delivered
    its first record: ack_to_delivery_ms is kproxy-to-kproxy, create_to_delivery_ms starts at the
    producer's CreateTime (the producer's clock)."""
    produced = partitions.where(
        (F.col("direction") == "produce") & (F.col("error_code") == 0) & F.col("first_offset").isNotNull()
        & (F.col("records") > 0)
    ).select(VC, "topic", "partition", F.col("first_offset").alias("p_first"), F.col("records").alias("p_records"),
             F.col("done_ts").alias("acked_at"), F.col("first_timestamp").alias("create_ms"),
             F.floor(F.col("first_offset") / OFFSET_BUCKET).alias("bucket"))
    consumer = F.coalesce(F.col("group"), F.concat(F.lit("client:"), F.coalesce("client_id", F.lit("?"))))
    fetched = partitions.where(
        (F.col("direction") == "fetch") & F.col("first_offset").isNotNull() & F.col("last_offset").isNotNull()
        & (F.col("last_offset") >= F.col("first_offset"))
    ).select(VC, "topic", "partition", F.col("first_offset").alias("f_first"), F.col("last_offset").alias("f_last"),
             F.col("done_ts").alias("delivered_at"), consumer.alias("consumer"),
             F.explode(F.sequence(F.floor(F.col("first_offset") / OFFSET_BUCKET),
                                  F.floor(F.col("last_offset") / OFFSET_BUCKET))).alias("bucket"))
    # A topic of one virtual cluster is never another's, whatever its name.
    met = produced.join(fetched, [VC, "topic", "partition", "bucket"]).where(
        (F.col("p_first") >= F.col("f_first")) & (F.col("p_first") <= F.col("f_last")))
    # A batch's ack time, CreateTime and size ride along in the key: they are one per batch.
    first = met.groupBy(VC, "topic", "partition", "p_first", "acked_at", "create_ms", "p_records", "consumer").agg(
        F.min("delivered_at").alias("delivered_at"))
    return first.select(
        VC, "topic", "partition", "consumer", F.col("p_records").alias("records"),
        _ms_between(F.col("delivered_at"), F.col("acked_at")).alias("ack_to_delivery_ms"),
        ((_micros(F.col("delivered_at")) / 1000.0) - F.col("create_ms")).alias("create_to_delivery_ms"))


def e2e_latency_table(batches: DataFrame) -> DataFrame:
    agg = batches.groupBy(VC, "topic", F.col("consumer").alias("group")).agg(
        F.count(F.lit(1)).alias("batches"), F.sum("records").alias("records"),
        *_quantiles("ack_to_delivery_ms", "ack_to_delivery_ms"),
        *_quantiles("create_to_delivery_ms", "create_to_delivery_ms"))
    return _expand_quantiles(agg, ["ack_to_delivery_ms", "create_to_delivery_ms"])

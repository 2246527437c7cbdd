"""The pieces of the report that need no Spark: the traffic log schema as Spark sees it, the KIP-896
table against kproxy's protocol schema, and the synthetic lines against the traffic log contract."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest

import kproxy
from kproxy.analytics.removed_versions import KAFKA_4_0_MINIMUM_VERSIONS, removed_versions
from kproxy.analytics.synthetic import generate
from kproxy.protocol.messages import api_by_name

CONTRACT = json.loads((Path(kproxy.__file__).parent / "telemetry" / "traffic_log.schema.json").read_text())


@pytest.mark.spark
def test_every_schema_field_has_a_spark_column() -> None:
    from kproxy.analytics.spark_schema import traffic_log_schema

    schema = traffic_log_schema()
    assert schema.fieldNames() == list(CONTRACT["properties"])
    types = {f.name: f.dataType.simpleString() for f in schema.fields}
    assert types["ts"] == "timestamp"
    assert types["duration_ms"] == "double"
    assert types["request_bytes"] == "bigint"
    assert types["partition_errors"] == "map<string,bigint>"
    assert types["quota"] == "struct<rule:string,key:string,throttle_ms:bigint>"
    assert types["partitions"].startswith("array<struct<topic:string,topic_id:string,partition:bigint")
    assert "first_offset:bigint,last_offset:bigint" in types["partitions"]


def test_removed_versions_come_from_the_protocol_schema() -> None:
    rows = removed_versions()
    for api, key, version, minimum in rows:
        spec = api_by_name(api)
        assert spec.key == key
        assert spec.request is not None and spec.request.versions.lo <= version < minimum
    produce = sorted(v for api, _, v, _ in rows if api == "produce")
    assert produce == [0, 1, 2]
    assert sorted(v for api, _, v, _ in rows if api == "fetch") == [0, 1, 2, 3]
    assert "metadata" not in KAFKA_4_0_MINIMUM_VERSIONS  # kept by Kafka 4.0 (KAFKA-18648)


def test_synthetic_lines_follow_the_contract() -> None:
    props = CONTRACT["properties"]
    outcomes = set(props["outcome"]["enum"])
    part_required = set(props["partitions"]["items"]["required"])
    for line in generate(500, dt.datetime(2024, 5, 1, tzinfo=dt.UTC), hours=0.2, seed=5, clients=20):
        assert set(CONTRACT["required"]) <= set(line)
        assert set(line) <= set(props), set(line) - set(props)
        assert line["outcome"] in outcomes
        assert line["ts"].endswith("Z") and len(line["ts"]) == len("2024-05-01T00:00:00.000000Z")
        for p in line.get("partitions") or ():
            assert part_required <= set(p)

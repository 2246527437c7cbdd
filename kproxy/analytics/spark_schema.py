"""The traffic log's JSON Schema turned into a Spark schema: the one place the two meet.

kproxy/telemetry/traffic_log.schema.json is the contract between the writer and this report; the
reader uses the StructType built here and never lets Spark infer one from the data.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from pyspark.sql import types as T

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "telemetry" / "traffic_log.schema.json"

# JSON Schema scalar types -> Spark types. Integers are all 64-bit: offsets and byte counts need it,
# and one width keeps the arithmetic free of casts.
_SCALARS: dict[str, T.DataType] = {
    "string": T.StringType(),
    "integer": T.LongType(),
    "number": T.DoubleType(),
    "boolean": T.BooleanType(),
}


@cache
def load_json_schema() -> dict[str, Any]:
    with SCHEMA_PATH.open(encoding="utf-8") as f:
        return json.load(f)


def _base_type(node: dict[str, Any]) -> str:
    types = node.get("type")
    if isinstance(types, str):
        return types
    non_null = [t for t in types or () if t != "null"]
    if len(non_null) != 1:
        raise ValueError(f"cannot map JSON Schema type {types!r} to one Spark type")
    return non_null[0]


def spark_type(node: dict[str, Any]) -> T.DataType:
    """The Spark type of one JSON Schema node."""
    kind = _base_type(node)
    if kind == "string" and node.get("format") == "date-time":
        return T.TimestampType()
    if kind in _SCALARS:
        return _SCALARS[kind]
    if kind == "array":
        return T.ArrayType(spark_type(node["items"]), containsNull=True)
    if kind == "object":
        if "properties" in node:
            return struct_type(node)
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            return T.MapType(T.StringType(), spark_type(extra), valueContainsNull=True)
    raise ValueError(f"cannot map JSON Schema node {node!r} to a Spark type")


def struct_type(node: dict[str, Any]) -> T.StructType:
    # Every field is nullable: the JSON reader yields null for a missing or malformed value, and a
    # line from an older writer may lack a field a newer schema added.
    return T.StructType([
        T.StructField(name, spark_type(sub), nullable=True,
                      metadata={"comment": sub["description"]} if "description" in sub else {})
        for name, sub in node["properties"].items()
    ])


def traffic_log_schema() -> T.StructType:
    """The Spark schema of one traffic log line."""
    return struct_type(load_json_schema())

"""The JSON Schema of policy rule files, built from kproxy's own tables of APIs and Kafka errors.

``rules/rules.schema.json`` is this schema written out (a test keeps the two identical), so editors
with the YAML language server complete and check rule files with the exact schema ``kproxy check``
applies. Pure: builds a dict.
"""

from __future__ import annotations

import json
from typing import Any

from kproxy.policy.model import (
    ACTIONS,
    ANY_API,
    API_GROUPS,
    COMPRESSIONS,
    MAX_LATENCY_S,
    QUOTA_PER,
    api_keys_by_name,
)
from kproxy.protocol.errors import ERROR_CODES_BY_NAME

SCHEMA_ID = "https://kproxy.dev/schemas/rules.schema.json"
# Kafka's legal characters for topic names; prefixes must keep the names legal.
NAME_CHARS = r"^[a-zA-Z0-9._-]+$"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _selector(item: dict[str, Any], what: str) -> dict[str, Any]:
    """One value, a list of them (any of), or ``{not: ...}`` of either."""
    plain = {"anyOf": [item, {"type": "array", "items": item, "minItems": 1}]}
    negated = {"type": "object", "properties": {"not": plain}, "required": ["not"],
               "additionalProperties": False}
    return {"description": f"{what}; a list means any of them, {{not: ...}} negates",
            "anyOf": [item, {"type": "array", "items": item, "minItems": 1}, negated]}


def _names(what: str) -> dict[str, Any]:
    return _selector({"type": "string",
                      "description": "exact, a glob (* ? [...]) or re:REGEX; the whole value must match "
                                     "(\"\" matches a null client id)"},
                     what)


def _enum(title: str, values: list[Any], description: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {"title": title, "enum": values}
    if description:
        out["description"] = description
    return out


def _error_name() -> dict[str, Any]:
    return _enum("Kafka error name", sorted(n for n in ERROR_CODES_BY_NAME if n != "NONE"),
                 "a Kafka error name, as in Kafka's Errors enum")


def _ints(description: str, minimum: int = 0) -> dict[str, Any]:
    return {"type": "integer", "minimum": minimum, "description": description}


def rules_schema() -> dict[str, Any]:
    """The schema of a rules file, as a JSON-ready dict."""
    api_item = {"anyOf": [
        _enum("API name or group", [*sorted(api_keys_by_name()), *sorted(API_GROUPS), ANY_API],
              "a Kafka API in snake_case (produce, delete_topics) or a group: read, write, admin, "
              "group, transaction, share, any"),
        {"type": "integer", "minimum": 0, "maximum": 32767, "description": "an api key"},
    ]}
    version_item = {"anyOf": [
        {"type": "integer", "minimum": 0, "maximum": 32767},
        {"type": "string", "pattern": r"^\d+(-\d+|\+)?$", "description": "N, N-M or N+"},
    ]}
    acks_item = _enum("acks value", ["all", -1, 0, 1])
    codec_item = _enum("compression type", list(COMPRESSIONS))
    software_item = {"anyOf": [
        {"type": "string", "minLength": 1, "description": "the client software name (exact, glob or re:)"},
        {"type": "object", "additionalProperties": False, "minProperties": 1, "properties": {
            "name": {"type": "string", "minLength": 1},
            "version": {"type": "string", "pattern": r"^\s*(>=|<=|==|!=|>|<)?\s*\d[\w.\-+]*"
                                                     r"(\s*,\s*(>=|<=|==|!=|>|<)?\s*\d[\w.\-+]*)*\s*$",
                        "description": "comma-separated bounds: >=3.5, <4"},
        }},
    ]}
    match = {
        "type": "object",
        "additionalProperties": False,
        "description": "selectors; every one given must hold (a rule without match matches everything)",
        "properties": {
            "client_id": _names("the client id"),
            "principal": _names("the SASL user or mTLS subject as User:NAME (User:ANONYMOUS when none)"),
            "source": _selector({"type": "string", "minLength": 1,
                                 "description": "an IP address or a CIDR (10.0.0.0/8)"}, "the client address"),
            "listener": _names("bootstrap, broker-<node id> or controller-<node id>"),
            "client_software": _selector(software_item, "name and version from ApiVersions v3+"),
            "api": _selector(api_item, "Kafka APIs"),
            "api_version": _selector(version_item, "the request's API version"),
            "topic": _names("a topic name (per topic: a request to several topics is judged topic by topic)"),
            "group": _names("a consumer or share group id"),
            "transactional_id": _names("a transactional id"),
            "acks": _selector(acks_item, "a Produce request's acks"),
            "compression": _selector(codec_item, "the compression of produced record batches"),
        },
    }
    most = int(MAX_LATENCY_S * 1000)
    latency = {"anyOf": [
        {"type": "number", "minimum": 0, "maximum": most, "description": "a fixed delay"},
        {"type": "object", "additionalProperties": False, "required": ["min", "max"],
         "properties": {"min": {"type": "number", "minimum": 0, "maximum": most},
                        "max": {"type": "number", "minimum": 0, "maximum": most}},
         "description": "uniform between min and max"},
        {"type": "object", "additionalProperties": False, "required": ["mean"],
         "properties": {"mean": {"type": "number", "exclusiveMinimum": 0, "maximum": most}},
         "description": f"exponential with this mean; a draw above {most} ms is cut to {most} ms"},
    ], "description": f"milliseconds, at most {most} (chaos latency is bounded)"}
    schema_file = {"type": "object", "additionalProperties": False, "required": ["json_schema"],
                   "properties": {"json_schema": {"type": "string", "minLength": 1,
                                                  "description": "a JSON Schema file, relative to this rule file"}}}
    registry = {"type": "object", "additionalProperties": False, "required": ["avro_schema_registry"],
                "properties": {"avro_schema_registry": {
                    "type": "object", "additionalProperties": False,
                    "properties": {"allowed_ids": {"type": "array", "minItems": 1,
                                                   "items": {"type": "integer", "minimum": 0},
                                                   "description": "the schema ids records may name"}}}}}
    value_check = {"anyOf": [
        _enum("value check", ["json", "avro_schema_registry"],
              "json: well-formed UTF-8 JSON; avro_schema_registry: Confluent's wire format (magic byte 0 "
              "and a 4-byte schema id)"),
        schema_file, registry]}
    key_check = {"anyOf": [
        _enum("key check", ["required", "json", "avro_schema_registry"],
              "required: not null; json, avro_schema_registry: as for values"),
        schema_file, registry]}
    params = {
        "deny": {"type": "object", "additionalProperties": False,
                 "properties": {"error": _error_name()},
                 "description": "default: the authorization error that fits the API"},
        "rewrite": {"type": "object", "additionalProperties": False, "minProperties": 1, "properties": {
            "topic_prefix": {"type": "string", "pattern": NAME_CHARS},
            "group_prefix": {"type": "string", "minLength": 1},
            "transactional_id_prefix": {"type": "string", "minLength": 1},
        }},
        "require": {"type": "object", "additionalProperties": False, "minProperties": 1, "properties": {
            "acks": acks_item,
            "max_batch_bytes": _ints("the largest record batch a producer may send", 1),
            "compression": {"anyOf": [codec_item, {"type": "array", "items": codec_item, "minItems": 1}],
                            "description": "the compression types produced batches may use"},
            "uncompressed_max_bytes": _ints("with compression: uncompressed batches up to this size pass "
                                            "anyway (librdkafka does not compress a batch when that would "
                                            "not make it smaller)"),
        }},
        "cap": {"type": "object", "additionalProperties": False, "minProperties": 1, "properties": {
            "max_bytes": _ints("Fetch max_bytes at most this"),
            "partition_max_bytes": _ints("Fetch partition_max_bytes at most this"),
            "max_wait_ms": _ints("Fetch max_wait_ms at most this"),
            "timeout_ms": _ints("Produce timeout_ms at most this"),
        }},
        "chaos": {"type": "object", "additionalProperties": False, "minProperties": 1, "properties": {
            "rate": {"type": "number", "minimum": 0, "maximum": 1,
                     "description": "the share of matching requests affected (default 1)"},
            "latency_ms": latency,
            "error": _error_name(),
        }},
        "validate": {"type": "object", "additionalProperties": False, "minProperties": 1,
                     "description": "checks every record of a produced batch must pass; a batch with a record "
                                    "that does not is refused whole with INVALID_RECORD",
                     "properties": {
            "value": value_check,
            "key": {"anyOf": [key_check, {"type": "array", "items": key_check, "minItems": 1}],
                    "description": "required (not null), and/or a check of non-null keys"},
            "max_record_bytes": _ints("the largest record, as its bytes in the uncompressed batch (key, value, "
                                      "headers and their framing)", 1),
            "headers": {"type": "object", "additionalProperties": False, "required": ["required"],
                        "properties": {"required": {"type": "array", "minItems": 1,
                                                    "items": {"type": "string", "minLength": 1},
                                                    "description": "header names every record must carry"}}},
            "allow_null": {"type": "boolean", "description": "null values (tombstones) pass the value check "
                                                            "(default true)"},
        }},
        "headers": {"type": "object", "additionalProperties": False, "minProperties": 1,
                    "description": "headers put on every produced record (the batch is re-encoded with its own "
                                   "compression)",
                    "properties": {
            "set": {"type": "object", "minProperties": 1,
                    "additionalProperties": {"type": "string",
                                             "description": "the value; ${client_id}, ${principal} and ${rule} "
                                                            "are filled in"},
                    "description": "header name -> value, added or replacing headers of that name"},
            "traceparent": _enum("traceparent", ["inject"], "inject: a W3C traceparent naming kproxy's produce "
                                                            "span on every record that has none"),
        }},
        "encrypt": {"type": "object", "additionalProperties": False, "required": ["kek"],
                    "description": "seal every produced record value (and key, with keys: true) with "
                                   "AES-256-GCM under a data key the KMS wraps with this KEK; Fetch answers "
                                   "are opened again for clients of kproxy (docs/encryption.md)",
                    "properties": {
            "kek": {"type": "string", "minLength": 1,
                    "description": "the KEK's name in the KMS; ${topic} is the record's topic"},
            "keys": {"type": "boolean", "description": "seal record keys too (default false; a sealed key "
                                                       "defeats compaction by key)"},
        }},
        "mask": {"type": "object", "additionalProperties": False, "required": ["fields"],
                 "description": "replace fields of JSON record values in Fetch answers (after decryption)",
                 "properties": {
            "fields": {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1},
                       "description": "dotted paths into JSON objects (card.number)"},
            "with": {"description": "the value put in their place (default \"****\")"},
        }},
        "log": {"type": "object", "additionalProperties": False, "properties": {
            "level": _enum("log level", list(LOG_LEVELS)),
            "sample": {"type": "number", "minimum": 0, "maximum": 1,
                       "description": "the share of matching requests logged (default 1)"},
        }},
    }
    rule = {
        "type": "object",
        "additionalProperties": False,
        "required": ["name", "action"],
        "properties": {
            "name": {"type": "string", "minLength": 1, "description": "unique; used in logs and metrics"},
            "match": {"$ref": "#/$defs/match"},
            "action": _enum("action", list(ACTIONS)),
            **params,
        },
    }
    rate = {"type": "number", "exclusiveMinimum": 0}
    quota = {
        "type": "object",
        "additionalProperties": False,
        "required": ["name"],
        "description": "budgets per second; every quota that matches a request applies, and the longest "
                       "throttle wins (a quota without limits does nothing)",
        "properties": {
            "name": {"type": "string", "minLength": 1, "description": "unique among quotas; used in logs and "
                                                                     "metrics, and budgets are kept by it"},
            "match": {"$ref": "#/$defs/match"},
            "per": _enum("budget key", list(QUOTA_PER), "who shares one budget: each client id, principal, "
                                                        "client address or connection, or everyone the "
                                                        "quota matches (rule); default client_id"),
            "produce_bytes_per_s": {**rate, "description": "record bytes produced per second"},
            "fetch_bytes_per_s": {**rate, "description": "record bytes fetched per second"},
            "requests_per_s": {**rate, "description": "requests per second"},
            "request_time_percent": {**rate, "maximum": 100,
                                     "description": "the share of one kproxy thread's time (percent) the "
                                                    "requests may take"},
            "burst_s": {**rate, "maximum": 60,
                        "description": "seconds of each limit that may be used at once (default 1)"},
        },
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        "title": "kproxy policy rules",
        "description": "An ordered list of rules (for each request the first rule that matches decides) and "
                       "a list of quotas (every quota that matches applies).",
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "default": _enum("default action", ["allow", "deny"], "what happens when no rule decides"),
            "rules": {"type": "array", "items": {"$ref": "#/$defs/rule"}},
            "quotas": {"type": "array", "items": {"$ref": "#/$defs/quota"}},
        },
        "$defs": {"rule": rule, "match": match, "quota": quota},
    }


def schema_text() -> str:
    """The schema as ``rules/rules.schema.json`` holds it."""
    return json.dumps(rules_schema(), indent=2) + "\n"


"""Record rules on Produce requests: ``validate`` checks every record of a partition's batches and
says which break the rule; ``headers`` rebuilds batches with headers added (and W3C trace context).

The engine decides which rules reach which topic; this module only looks at records. Messages say
where and why a record fails, never what it holds: JSON Schema failures name the place in the
schema, not in the record. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import orjson

from kproxy.policy.model import Headers, Rule, Validate, ValueCheck
from kproxy.protocol.errors import RecordsError
from kproxy.protocol.records import HeaderEdit, LegacyMessage, RecordBatch, edit_headers, iter_batches

# Per refused partition, at most this many record errors go back to the producer (the message
# still counts them all): a batch of 100,000 bad records must not make a huge answer.
MAX_RECORD_ERRORS = 100
_AVRO_MAGIC = 0
_AVRO_HEADER = 5     # magic byte and a big-endian int32 schema id (Confluent's wire format)


class RecordError(NamedTuple):
    """A record that breaks a rule: its index among the partition's records, and why."""

    batch_index: int
    message: str


class Verdict(NamedTuple):
    """A refused partition's errors (at most MAX_RECORD_ERRORS), how many records broke the rule
    in all, and the answer's ``error_message``."""

    errors: list[RecordError]
    broken: int
    message: str


def _schema_failure(check: ValueCheck, what: str, doc: Any) -> str | None:
    try:
        error = next(iter(check.validator.iter_errors(doc)), None)
    except RecursionError:
        # orjson accepts 1024 levels of nesting; the validator recurses once per level.
        return f"{what} is nested too deeply to check against the schema"
    if error is None:
        return None
    # The schema path names the schema's own words (properties/price/type), never the record's.
    where = "/".join(str(p) for p in error.absolute_schema_path) or "the top level"
    return f"{what} does not match the schema at {where}"


def check_bytes(check: ValueCheck, what: str, data: memoryview) -> str | None:
    """Why ``data`` (a non-null key or value) fails ``check``, or None when it passes."""
    kind = check.kind
    if kind == "avro_schema_registry":
        if len(data) < _AVRO_HEADER or data[0] != _AVRO_MAGIC:
            return f"{what} is not in the schema registry's wire format (magic byte 0, then a 4-byte schema id)"
        if check.allowed_ids is not None:
            schema_id = int.from_bytes(data[1:_AVRO_HEADER], "big")
            if schema_id not in check.allowed_ids:
                return f"{what} names schema id {schema_id}, which is not allowed"
        return None
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        return f"{what} is not JSON: {e}"
    if kind == "json_schema":
        return _schema_failure(check, what, doc)
    return None


def _varint_size(value: int) -> int:
    z = (value << 1) ^ (value >> 63)
    return 1 if z < 0x80 else (z.bit_length() + 6) // 7


def record_size(key: Any, value: Any, headers: Any, timestamp_delta: int = 0, offset_delta: int = 0) -> int:
    """The bytes a record takes in an uncompressed v2 batch, its length prefix included: what
    ``max_record_bytes`` limits (and what a traffic log's batch sizes bound from below)."""
    n = 1 + _varint_size(timestamp_delta) + _varint_size(offset_delta)
    for part in (key, value):
        n += 1 if part is None else _varint_size(len(part)) + len(part)
    n += _varint_size(len(headers))
    for h in headers:
        k = len(h.key.encode("utf-8", "surrogateescape"))
        n += _varint_size(k) + k + (1 if h.value is None else _varint_size(len(h.value)) + len(h.value))
    return _varint_size(n) + n


def _records(records: Any, cap: int) -> Iterator[tuple[Any, Any, Any, int, int]]:
    """(key, value, headers, timestamp delta, offset delta) of every record in a records field,
    legacy messages expanded."""
    for batch in iter_batches(records, allow_truncated=False):
        if isinstance(batch, LegacyMessage):
            for msg in batch.records(cap):
                yield msg.key, msg.value, (), 0, 0
        else:
            for rec in batch.records(cap):
                yield rec.key, rec.value, rec.headers, rec.timestamp_delta, rec.offset_delta


def check_record(v: Validate, key: Any, value: Any, headers: Any, timestamp_delta: int = 0,
                 offset_delta: int = 0) -> str | None:
    """Why one record breaks ``v``, or None."""
    if key is None:
        if v.key_required:
            return "key is null"
    elif v.key is not None:
        why = check_bytes(v.key, "key", key)
        if why is not None:
            return why
    if value is None:
        if not v.allow_null:
            return "value is null (a tombstone) and allow_null is false"
    elif v.value is not None:
        why = check_bytes(v.value, "value", value)
        if why is not None:
            return why
    if v.max_record_bytes is not None:
        size = record_size(key, value, headers, timestamp_delta, offset_delta)
        if size > v.max_record_bytes:
            return f"record is {size} bytes, more than max_record_bytes {v.max_record_bytes}"
    if v.required_headers:
        present = {h.key for h in headers}
        missing = [n for n in v.required_headers if n not in present]
        if missing:
            return f"header {missing[0]!r} is missing"
    return None


def validate_records(rule: Rule, records: Any, cap: int) -> Verdict | None:
    """The verdict on a partition's records field under a validate rule; None when all pass."""
    v = rule.params
    assert isinstance(v, Validate)
    errors: list[RecordError] = []
    broken = 0
    try:
        for i, (key, value, headers, ts_delta, off_delta) in enumerate(_records(records, cap)):
            why = check_record(v, key, value, headers, ts_delta, off_delta)
            if why is not None:
                broken += 1
                if len(errors) < MAX_RECORD_ERRORS:
                    errors.append(RecordError(i, why))
    except RecordsError as e:
        # A batch kproxy cannot read cannot be shown to keep the rule.
        return Verdict(errors, broken + 1, f"kproxy: rule {rule.name!r}: the records cannot be read ({e})")
    if not broken:
        return None
    first = errors[0]
    some = f"{broken} records break" if broken > 1 else "a record breaks"
    return Verdict(errors, broken, f"kproxy: {some} rule {rule.name!r} (record {first.batch_index}: "
                                   f"{first.message})")


def expand(template: str, client_id: str | None, principal: str | None, rule: str) -> str:
    """A headers rule's value with ``${client_id}``, ``${principal}`` and ``${rule}`` filled in
    (a null client id reads as "", no principal as User:ANONYMOUS)."""
    if "${" not in template:
        return template
    return (template.replace("${client_id}", client_id or "")
            .replace("${principal}", principal or "User:ANONYMOUS")
            .replace("${rule}", rule))


def header_edit(rules: tuple[Rule, ...], client_id: str | None, principal: str | None,
                traceparent: bytes | None) -> HeaderEdit:
    """One edit for the headers rules reaching a topic, in rule order (a later rule's value for the
    same name wins); ``traceparent`` when any of them injects it."""
    values: dict[bytes, bytes] = {}
    inject = False
    for rule in rules:
        h = rule.params
        assert isinstance(h, Headers)
        for name, template in h.set:
            key = name.encode("utf-8")
            values.pop(key, None)
            values[key] = expand(template, client_id, principal, rule.name).encode("utf-8")
        inject = inject or h.traceparent
    return HeaderEdit(tuple(values.items()), traceparent if inject else None)


def traceparent(trace_id: int, span_id: int) -> bytes:
    """A W3C trace context ``traceparent`` value (version 00, sampled)."""
    return b"00-%032x-%016x-01" % (trace_id, span_id)


def rewrite_records(records: Any, edit: HeaderEdit, cap: int) -> tuple[bytes | None, int]:
    """(the records field with ``edit`` applied to each v2 batch, batches rebuilt), or (None, 0)
    when no batch changed; batches left alone keep their bytes. RecordsError when one cannot be read."""
    parts: list[Any] = []
    rebuilt = 0
    for batch in iter_batches(records, allow_truncated=False):
        new = edit_headers(batch, edit, cap) if isinstance(batch, RecordBatch) else None
        if new is None:
            parts.append(batch.raw)
        else:
            parts.append(new)
            rebuilt += 1
    if not rebuilt:
        return None, 0
    return b"".join(parts), rebuilt

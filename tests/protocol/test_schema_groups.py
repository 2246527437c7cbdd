"""Wire checks for the consumer-group and offset APIs beyond the kio cross-check.

kio (Kafka 4.x) cross-checks every version it knows in ``test_kio_crosscheck.py``. It does not know
the versions Kafka 4.0 removed (KIP-896): ListOffsets v0, OffsetCommit v0-1, OffsetFetch v0 and
OffsetForLeaderEpoch v0-1. Here those, and every other version kafka-python's hand-written classes
describe, are checked against kafka-python; annotated golden vectors pin the shapes that matter most
(removed versions, nulls, the batched OffsetFetch, opaque group-protocol bytes, nullable structs).
"""

from __future__ import annotations

import dataclasses
import datetime
import types
import typing
import uuid
import warnings

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from kproxy.protocol.compiler import encode_to, join_parts
from kproxy.protocol.errors import DecodeError
from kproxy.protocol.messages import api_by_name, request_codecs, response_codecs
from kproxy.protocol.schema import NONE

from .kio_bridge import kio_class, kio_versions, kproxy_name
from .strategies import classes_of

with warnings.catch_warnings():
    # kafka-python 3.0 calls the deprecated importlib.resources.read_text while importing; the
    # warning is theirs and pyproject turns warnings into errors.
    warnings.simplefilter("ignore", DeprecationWarning)
    from kafka.protocol.old import admin as kp_admin
    from kafka.protocol.old import commit, group, list_offsets, offset_for_leader_epoch
    from kafka.protocol.old import types as kp

GROUP_APIS = {
    2: "list_offsets", 8: "offset_commit", 9: "offset_fetch", 11: "join_group", 12: "heartbeat",
    13: "leave_group", 14: "sync_group", 15: "describe_groups", 16: "list_groups",
    23: "offset_for_leader_epoch", 42: "delete_groups", 47: "offset_delete",
    68: "consumer_group_heartbeat", 69: "consumer_group_describe",
}


def _codec(name: str, kind: str, v: int):
    key = api_by_name(name).key
    return (request_codecs if kind == "request" else response_codecs)(key, v)[1]


def _encode(codec, obj) -> bytes:
    out, ins = bytearray(), []
    encode_to(codec, obj, out, ins)
    return bytes(join_parts(out, ins))


def _decode(codec, data: bytes):
    obj, pos = codec.decode_checked(memoryview(data), 0, len(data))
    assert pos == len(data)
    return obj


def _plain(x):
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_plain(v) for v in x]
    if isinstance(x, memoryview | bytearray):
        return bytes(x)
    return x


# ---------------------------------------------------------------------------------------------
# kafka-python's hand-written classes as an oracle


def _kp_classes() -> list:
    out = []
    for mod in (list_offsets, commit, offset_for_leader_epoch, group, kp_admin):
        for obj in vars(mod).values():
            if (isinstance(obj, type) and obj.__module__ == mod.__name__
                    and getattr(obj, "API_KEY", None) in GROUP_APIS and hasattr(obj, "SCHEMA")):
                out.append(obj)
    return sorted(out, key=lambda c: (c.API_KEY, c.__name__))


KP_CLASSES = _kp_classes()
# The versions kio cannot check; each must have a kafka-python class here.
REMOVED_IN_4_0 = {("list_offsets", 0), ("offset_commit", 0), ("offset_commit", 1),
                  ("offset_fetch", 0), ("offset_for_leader_epoch", 0), ("offset_for_leader_epoch", 1)}
_INT = {kp.Int8: 8, kp.Int16: 16, kp.Int32: 32, kp.Int64: 64}


def _kind(cls) -> str:
    return "request" if cls.__name__.split("_v")[0].endswith("Request") else "response"


def _kp_strategy(t, spec_field, v: int) -> st.SearchStrategy:
    """Values for a kafka-python type; nulls only where kproxy's field allows them (see golden
    vectors below for the nullability facts of the removed versions)."""
    nullable = spec_field is not None and v in spec_field.nullable
    if isinstance(t, kp.Schema):
        subs = {f.name: f for f in spec_field.struct.fields} if spec_field is not None else {}
        parts = [_kp_strategy(ft, subs.get(n), v) for n, ft in zip(t.names, t.fields, strict=True)
                 if ft is not kp.TaggedFields]
        s = st.tuples(*parts)
    elif isinstance(t, kp.Array):  # CompactArray too
        # The array's nullability is not its elements'.
        inner = (types.SimpleNamespace(struct=spec_field.struct, nullable=NONE)
                 if isinstance(t.array_of, kp.Schema) and spec_field is not None else None)
        s = st.lists(_kp_strategy(t.array_of, inner, v), max_size=3)
    elif t in _INT:
        bits = _INT[t]
        s = st.integers(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    elif t is kp.Boolean:
        s = st.booleans()
    elif isinstance(t, kp.String):  # CompactString too
        s = st.text(max_size=10)
    elif t in (kp.Bytes, kp.CompactBytes):
        s = st.binary(max_size=16)
    elif t is kp.BitField:
        # authorized_operations as a set of bit numbers; None is bit 31 alone (INT32_MIN, "omitted").
        s = st.none() | st.sets(st.integers(0, 30))
    else:
        raise AssertionError(f"no strategy for kafka-python type {t!r}")
    return st.none() | s if nullable else s


def _kp_plain(t, value):
    """kafka-python values as the nested dicts kproxy's ``to_dict`` gives (tags dropped)."""
    if t is kp.BitField:
        return -(2**31) if value is None else kp.BitField.to_32_bit_field(value)
    if value is None:
        return None
    if isinstance(t, kp.Schema):
        return {n: _kp_plain(ft, x) for n, ft, x in zip(t.names, t.fields, value, strict=False)
                if ft is not kp.TaggedFields}
    if isinstance(t, kp.Array):
        return [_kp_plain(t.array_of, x) for x in value]
    return value


@pytest.mark.parametrize("cls", KP_CLASSES, ids=lambda c: c.__name__)
def test_kafka_python_agrees(cls):
    name, v, kind = GROUP_APIS[cls.API_KEY], cls.API_VERSION, _kind(cls)
    codec = _codec(name, kind, v)
    msg = getattr(api_by_name(name), kind)
    root = types.SimpleNamespace(struct=msg.root, nullable=NONE)  # walk the root like a struct field

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(_kp_strategy(cls.SCHEMA, root, v))
    def check(values):
        data = cls(*values).encode()
        obj = _decode(codec, data)
        # Same names and values, so kproxy's field names and order match kafka-python's too.
        assert _plain(obj.to_dict(v)) == _kp_plain(cls.SCHEMA, values)
        ours = _encode(codec, obj)
        assert ours == data
        assert cls.decode(ours) == cls(*values)

    check()


def test_removed_versions_have_an_oracle():
    covered = {(GROUP_APIS[c.API_KEY], c.API_VERSION, _kind(c)) for c in KP_CLASSES}
    for name, v in REMOVED_IN_4_0:
        assert v not in kio_versions(name)
        assert (name, v, "request") in covered and (name, v, "response") in covered


# ---------------------------------------------------------------------------------------------
# Defaults: kio carries Kafka's explicit defaults; kproxy must use the same ones.


def _kio_default(f: dataclasses.Field):
    d = f.default
    if d is dataclasses.MISSING or dataclasses.is_dataclass(d):
        return dataclasses.MISSING
    if isinstance(d, datetime.timedelta):
        return round(d.total_seconds() * 1000)
    if isinstance(d, tuple):
        return list(d)
    return getattr(d, "value", d)


def _nested(tp) -> type | None:
    """The kio dataclass inside an annotation like ``tuple[X, ...] | None``, if any."""
    if dataclasses.is_dataclass(tp):
        return tp  # type: ignore[return-value]
    for arg in typing.get_args(tp):
        found = _nested(arg)
        if found is not None:
            return found
    return None


def _default_mismatches(kio_cls, our_cls, classes: dict[str, type], path: str) -> list[str]:
    out = []
    obj = our_cls()
    hints = typing.get_type_hints(kio_cls)
    for f in dataclasses.fields(kio_cls):
        ours = getattr(obj, kproxy_name(f))
        expected = _kio_default(f)
        if expected is not dataclasses.MISSING and ours != expected:
            out.append(f"{path}.{kproxy_name(f)}: kproxy {ours!r}, kio {expected!r}")
        sub = _nested(hints[f.name])
        if sub is not None:
            out += _default_mismatches(sub, classes[sub.__name__], classes, f"{path}.{kproxy_name(f)}")
    return out


@pytest.mark.parametrize("name", sorted(GROUP_APIS.values()))
def test_defaults_match_kio(name):
    mismatches: list[str] = []
    for kind in ("request", "response"):
        msg = getattr(api_by_name(name), kind)
        classes = classes_of(msg)
        for v in kio_versions(name):
            mismatches += _default_mismatches(kio_class(name, v, kind), classes[msg.root.name], classes,
                                              f"{name}.v{v}.{kind}")
    assert not mismatches, mismatches


# ---------------------------------------------------------------------------------------------
# Golden vectors (a comment per chunk)


def _build(name: str, kind: str, v: int, d: dict):
    """A kproxy message object from a plain dict, built without the decoder."""
    msg = getattr(api_by_name(name), kind)
    classes = classes_of(msg)

    def make(s, value):
        kw = {}
        for f in s.fields:
            if f.name not in value:
                continue
            x = value[f.name]
            if f.type == "struct" and x is not None:
                x = [make(f.struct, e) for e in x] if f.array else make(f.struct, x)
            kw[f.name] = x
        return classes[s.name](**kw)

    return make(msg.root, d)


def _golden(name: str, kind: str, v: int, data: bytes, expected: dict) -> None:
    codec = _codec(name, kind, v)
    assert _plain(_decode(codec, data).to_dict(v)) == expected
    assert _encode(codec, _build(name, kind, v, expected)) == data


def test_golden_list_offsets_v0():
    _golden("list_offsets", "request", 0, bytes.fromhex(
        "ffffffff"                  # int32 replica_id = -1 (a consumer)
        "00000001"                  # int32 topics count = 1
        "0001" "74"                 # string name = "t"
        "00000001"                  # int32 partitions count = 1
        "00000002"                  # int32 partition_index = 2
        "fffffffffffffffe"          # int64 timestamp = -2 (earliest)
        "00000003"                  # int32 max_num_offsets = 3 (v0 only)
    ), {"replica_id": -1, "topics": [{"name": "t", "partitions": [
        {"partition_index": 2, "timestamp": -2, "max_num_offsets": 3}]}]})
    _golden("list_offsets", "response", 0, bytes.fromhex(
        "00000001"                  # int32 topics count = 1
        "0001" "74"                 # string name = "t"
        "00000001"                  # int32 partitions count = 1
        "00000002"                  # int32 partition_index = 2
        "0000"                      # int16 error_code = 0
        "00000002"                  # int32 old_style_offsets count = 2 (v0 only)
        "0000000000000064"          # int64 offset = 100
        "0000000000000000"          # int64 offset = 0
    ), {"topics": [{"name": "t", "partitions": [
        {"partition_index": 2, "error_code": 0, "old_style_offsets": [100, 0]}]}]})


def test_golden_list_offsets_v1_drops_max_num_offsets():
    _golden("list_offsets", "response", 1, bytes.fromhex(
        "00000001" "0001" "74"      # topics count = 1, name = "t"
        "00000001" "00000002"       # partitions count = 1, partition_index = 2
        "0000"                      # int16 error_code = 0
        "ffffffffffffffff"          # int64 timestamp = -1 (v1+, replaces old_style_offsets)
        "0000000000000064"          # int64 offset = 100
    ), {"topics": [{"name": "t", "partitions": [
        {"partition_index": 2, "error_code": 0, "timestamp": -1, "offset": 100}]}]})


def test_golden_offset_commit_v0_v1():
    _golden("offset_commit", "request", 0, bytes.fromhex(
        "0001" "67"                 # string group_id = "g"
        "00000001" "0001" "74"      # topics count = 1, name = "t"
        "00000001"                  # partitions count = 1
        "00000000"                  # int32 partition_index = 0
        "000000000000002a"          # int64 committed_offset = 42
        "0002" "6d64"               # string committed_metadata = "md"
    ), {"group_id": "g", "topics": [{"name": "t", "partitions": [
        {"partition_index": 0, "committed_offset": 42, "committed_metadata": "md"}]}]})
    _golden("offset_commit", "request", 1, bytes.fromhex(
        "0001" "67"                 # string group_id = "g"
        "00000007"                  # int32 generation_id_or_member_epoch = 7 (v1+)
        "0001" "6d"                 # string member_id = "m" (v1+)
        "00000001" "0001" "74"      # topics count = 1, name = "t"
        "00000001"                  # partitions count = 1
        "00000000"                  # int32 partition_index = 0
        "000000000000002a"          # int64 committed_offset = 42
        "0000018000000000"          # int64 commit_timestamp (v1 only)
        "ffff"                      # string committed_metadata = null
    ), {"group_id": "g", "generation_id_or_member_epoch": 7, "member_id": "m", "topics": [
        {"name": "t", "partitions": [{"partition_index": 0, "committed_offset": 42,
                                      "commit_timestamp": 0x18000000000,
                                      "committed_metadata": None}]}]})
    _golden("offset_commit", "response", 1, bytes.fromhex(
        "00000001" "0001" "74"      # topics count = 1, name = "t"
        "00000001"                  # partitions count = 1
        "00000000" "0019"           # partition_index = 0, int16 error_code = 25 (UNKNOWN_MEMBER_ID)
    ), {"topics": [{"name": "t", "partitions": [{"partition_index": 0, "error_code": 25}]}]})


def test_golden_offset_fetch_null_topics_only_from_v2():
    v1_null = bytes.fromhex(
        "0001" "67"                 # string group_id = "g"
        "ffffffff"                  # int32 topics count = -1: null, which v0-1 do not allow
    )
    with pytest.raises(DecodeError):
        _decode(_codec("offset_fetch", "request", 1), v1_null)
    _golden("offset_fetch", "request", 2, v1_null, {"group_id": "g", "topics": None})
    _golden("offset_fetch", "response", 0, bytes.fromhex(
        "00000001" "0001" "74"      # topics count = 1, name = "t"
        "00000001"                  # partitions count = 1
        "00000003"                  # int32 partition_index = 3
        "ffffffffffffffff"          # int64 committed_offset = -1 (none committed)
        "ffff"                      # string metadata = null
        "0000"                      # int16 error_code = 0 (no top-level error_code before v2)
    ), {"topics": [{"name": "t", "partitions": [
        {"partition_index": 3, "committed_offset": -1, "metadata": None, "error_code": 0}]}]})


def test_golden_offset_fetch_batched_v9():
    _golden("offset_fetch", "request", 9, bytes.fromhex(
        "02"                        # uvarint groups count+1 = 2 (v8+ batched shape)
        "02" "67"                   # compact string group_id = "g"
        "00"                        # compact string member_id = null (v9+)
        "ffffffff"                  # int32 member_epoch = -1 (v9+)
        "00"                        # compact array topics = null: every topic
        "00"                        # group: no tagged fields
        "01"                        # bool require_stable = true
        "00"                        # no tagged fields
    ), {"groups": [{"group_id": "g", "member_id": None, "member_epoch": -1, "topics": None}],
        "require_stable": True})
    _golden("offset_fetch", "response", 9, bytes.fromhex(
        "00000000"                  # int32 throttle_time_ms = 0
        "02" "02" "67"              # groups count+1 = 2; group_id = "g"
        "02" "02" "74"              # topics count+1 = 2; name = "t"
        "02"                        # partitions count+1 = 2
        "00000000"                  # int32 partition_index = 0
        "0000000000000005"          # int64 committed_offset = 5
        "ffffffff"                  # int32 committed_leader_epoch = -1
        "01"                        # compact string metadata = ""
        "0000"                      # int16 error_code = 0
        "00" "00"                   # partition, topic: no tagged fields
        "000f"                      # int16 group error_code = 15 (COORDINATOR_NOT_AVAILABLE)
        "00" "00"                   # group, response: no tagged fields
    ), {"throttle_time_ms": 0, "groups": [{"group_id": "g", "topics": [{"name": "t", "partitions": [
        {"partition_index": 0, "committed_offset": 5, "committed_leader_epoch": -1,
         "metadata": "", "error_code": 0}]}], "error_code": 15}]})


def test_golden_offset_for_leader_epoch_v0_v1():
    _golden("offset_for_leader_epoch", "request", 0, bytes.fromhex(
        "00000001" "0001" "74"      # topics count = 1, topic = "t"
        "00000001"                  # partitions count = 1
        "00000004"                  # int32 partition = 4
        "00000009"                  # int32 leader_epoch = 9 (no current_leader_epoch before v2)
    ), {"topics": [{"topic": "t", "partitions": [{"partition": 4, "leader_epoch": 9}]}]})
    _golden("offset_for_leader_epoch", "response", 0, bytes.fromhex(
        "00000001" "0001" "74"      # topics count = 1, topic = "t"
        "00000001"                  # partitions count = 1
        "0000"                      # int16 error_code = 0
        "00000004"                  # int32 partition = 4
        "00000000000003e8"          # int64 end_offset = 1000 (no leader_epoch before v1)
    ), {"topics": [{"topic": "t", "partitions": [
        {"error_code": 0, "partition": 4, "end_offset": 1000}]}]})
    _golden("offset_for_leader_epoch", "response", 1, bytes.fromhex(
        "00000001" "0001" "74"      # topics count = 1, topic = "t"
        "00000001"                  # partitions count = 1
        "0000" "00000004"           # error_code = 0, partition = 4
        "00000008"                  # int32 leader_epoch = 8 (v1+)
        "00000000000003e8"          # int64 end_offset = 1000
    ), {"topics": [{"topic": "t", "partitions": [
        {"error_code": 0, "partition": 4, "leader_epoch": 8, "end_offset": 1000}]}]})


def test_golden_join_group_v6_keeps_protocol_bytes():
    _golden("join_group", "request", 6, bytes.fromhex(
        "02" "67"                   # compact string group_id = "g"
        "00002710"                  # int32 session_timeout_ms = 10000
        "000493e0"                  # int32 rebalance_timeout_ms = 300000
        "01"                        # compact string member_id = ""
        "00"                        # compact string group_instance_id = null
        "09" "636f6e73756d6572"     # compact string protocol_type = "consumer"
        "02"                        # protocols count+1 = 2
        "06" "72616e6765"           # compact string name = "range"
        "04" "000100"               # compact bytes metadata = 00 01 00 (opaque, kept as is)
        "00"                        # protocol: no tagged fields
        "00"                        # no tagged fields
    ), {"group_id": "g", "session_timeout_ms": 10000, "rebalance_timeout_ms": 300000,
        "member_id": "", "group_instance_id": None, "protocol_type": "consumer",
        "protocols": [{"name": "range", "metadata": b"\x00\x01\x00"}]})


def test_golden_consumer_group_heartbeat_nullable_assignment():
    tid = uuid.UUID("00000000-0000-0000-0000-000000000001")
    head = (
        "00000000"                  # int32 throttle_time_ms = 0
        "0000"                      # int16 error_code = 0
        "00"                        # compact string error_message = null
        "02" "6d"                   # compact string member_id = "m"
        "00000001"                  # int32 member_epoch = 1
        "00001388"                  # int32 heartbeat_interval_ms = 5000
    )
    base = {"throttle_time_ms": 0, "error_code": 0, "error_message": None, "member_id": "m",
            "member_epoch": 1, "heartbeat_interval_ms": 5000}
    _golden("consumer_group_heartbeat", "response", 0, bytes.fromhex(
        head + "ff"                 # int8 assignment = -1: null
        "00"                        # no tagged fields
    ), {**base, "assignment": None})
    _golden("consumer_group_heartbeat", "response", 1, bytes.fromhex(
        head + "01"                 # int8 assignment present
        "02"                        # topic_partitions count+1 = 2
        + tid.hex +                 # uuid topic_id
        "03" "00000000" "00000001"  # partitions count+1 = 3: [0, 1]
        "00"                        # topic partitions: no tagged fields
        "00"                        # assignment: no tagged fields
        "00"                        # no tagged fields
    ), {**base, "assignment": {"topic_partitions": [{"topic_id": tid, "partitions": [0, 1]}]}})

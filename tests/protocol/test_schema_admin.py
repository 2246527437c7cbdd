"""Wire checks for the admin APIs' versions that kio (Kafka 4.x) does not know.

Kafka 4.0 removed v0 of the ACL, DescribeConfigs, AlterReplicaLogDirs, DescribeLogDirs and
delegation-token APIs (KIP-896), but 3.9 brokers and clients still speak them. Oracles, strongest
first: kafka-python's hand-written classes; "version N is the same as version N-1" in Kafka's message
definitions, checked against the kio-verified neighbour; annotated golden byte vectors.
"""

from __future__ import annotations

import io
import struct
import warnings

import pytest
from hypothesis import HealthCheck, given, settings

from kproxy.protocol import compiler
from kproxy.protocol.compiler import join_parts
from kproxy.protocol.errors import DecodeError
from kproxy.protocol.messages import api_by_name, api_name, request_codecs, response_codecs

from .strategies import message_strategy

with warnings.catch_warnings():
    # kafka-python 3.0 calls the deprecated importlib.resources.read_text while importing; the
    # warning is theirs and pyproject turns warnings into errors.
    warnings.simplefilter("ignore", DeprecationWarning)
    from kafka.protocol.old import admin as kp
    from kafka.protocol.old.types import Array, Schema, TaggedFields


def _codec(key: int, kind: str, v: int):
    return (request_codecs if kind == "request" else response_codecs)(key, v)[1]


def _encode(codec, obj) -> bytes:
    out, ins = bytearray(), []
    compiler.encode_to(codec, obj, out, ins)
    return bytes(join_parts(out, ins))


def _decode(codec, data: bytes):
    obj, pos = codec.decode_checked(memoryview(data), 0, len(data))
    assert pos == len(data), f"{len(data) - pos} trailing bytes"
    return obj


def _spec(key: int, kind: str):
    return getattr(api_by_name(api_name(key)), kind)


# --- kafka-python's hand-written classes -----------------------------------------------------------


def _kp_plain(t, value):
    """A kafka-python decoded value as kproxy's to_dict shape (names from the kafka-python schema)."""
    if isinstance(t, Schema):
        return {n: _kp_plain(f, x) for n, f, x in zip(t.names, t.fields, value, strict=False)
                if f is not TaggedFields}
    if isinstance(t, Array):
        return None if value is None else [_kp_plain(t.array_of, x) for x in value]
    return value


# Every 3.9-only version kafka-python has a class for, plus its neighbours kio also checks (a
# second, independent opinion on the field order the v0 classes share with them).
KAFKA_PYTHON = [
    (29, "request", 0, kp.DescribeAclsRequest_v0), (29, "request", 1, kp.DescribeAclsRequest_v1),
    (29, "response", 0, kp.DescribeAclsResponse_v0), (29, "response", 1, kp.DescribeAclsResponse_v1),
    (30, "request", 0, kp.CreateAclsRequest_v0), (30, "request", 1, kp.CreateAclsRequest_v1),
    (30, "response", 0, kp.CreateAclsResponse_v0), (30, "response", 1, kp.CreateAclsResponse_v1),
    (31, "request", 0, kp.DeleteAclsRequest_v0), (31, "request", 1, kp.DeleteAclsRequest_v1),
    (31, "response", 0, kp.DeleteAclsResponse_v0), (31, "response", 1, kp.DeleteAclsResponse_v1),
    (32, "request", 0, kp.DescribeConfigsRequest_v0), (32, "request", 1, kp.DescribeConfigsRequest_v1),
    (32, "request", 2, kp.DescribeConfigsRequest_v2),
    (32, "response", 0, kp.DescribeConfigsResponse_v0), (32, "response", 1, kp.DescribeConfigsResponse_v1),
    (32, "response", 2, kp.DescribeConfigsResponse_v2),
    (33, "request", 0, kp.AlterConfigsRequest_v0), (33, "request", 1, kp.AlterConfigsRequest_v1),
    (33, "response", 0, kp.AlterConfigsResponse_v0), (33, "response", 1, kp.AlterConfigsResponse_v1),
    # kafka-python's DescribeLogDirsRequest_v0 declares partitions as one int32, not an array (a bug
    # in the oracle), so request v0 is covered by a golden vector below instead.
    (35, "response", 0, kp.DescribeLogDirsResponse_v0),
    (43, "request", 0, kp.ElectLeadersRequest_v0), (43, "request", 1, kp.ElectLeadersRequest_v1),
    (43, "response", 0, kp.ElectLeadersResponse_v0), (43, "response", 1, kp.ElectLeadersResponse_v1),
    (48, "request", 0, kp.DescribeClientQuotasRequest_v0),
    (48, "response", 0, kp.DescribeClientQuotasResponse_v0),
]


@pytest.mark.parametrize(("key", "kind", "v", "kp_cls"), [
    pytest.param(*c, id=f"{_spec(c[0], c[1]).api_name}-{c[1]}-v{c[2]}") for c in KAFKA_PYTHON])
def test_kafka_python_agrees(key, kind, v, kp_cls):
    codec = _codec(key, kind, v)

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(message_strategy(_spec(key, kind), v))
    def check(obj):
        data = _encode(codec, obj)
        buf = io.BytesIO(data)
        theirs = kp_cls.decode(buf)
        assert buf.tell() == len(data), "kafka-python left bytes unread"
        values = [getattr(theirs, n) for n in kp_cls.SCHEMA.names]
        assert _kp_plain(kp_cls.SCHEMA, values) == obj.to_dict(v)
        assert theirs.encode() == data
        assert _decode(codec, theirs.encode()).to_dict(v) == obj.to_dict(v)

    check()


# --- "version N is the same as version N-1" ---------------------------------------------------------

# Kafka's definitions say these versions differ only in broker behaviour (throttling, or fields the
# other direction gained); the newer one is checked against kio, so the older must share its layout.
SAME_LAYOUT = [
    (34, "request", 0, 1), (34, "response", 0, 1),
    (35, "request", 0, 1), (35, "response", 0, 1),
    (38, "request", 0, 1), (38, "response", 0, 1),
    (39, "request", 0, 1), (39, "response", 0, 1),
    (40, "request", 0, 1), (40, "response", 0, 1),
    (41, "request", 0, 1), (41, "response", 0, 1),
]


@pytest.mark.parametrize(("key", "kind", "old", "new"), [
    pytest.param(*c, id=f"{_spec(c[0], c[1]).api_name}-{c[1]}-v{c[2]}=v{c[3]}") for c in SAME_LAYOUT])
def test_same_layout_as_next_version(key, kind, old, new):
    old_codec, new_codec = _codec(key, kind, old), _codec(key, kind, new)
    assert [f.name for f in old_codec.cls._spec.fields if old in f.versions] == [
        f.name for f in new_codec.cls._spec.fields if new in f.versions]

    @settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(message_strategy(_spec(key, kind), old))
    def check(obj):
        data = _encode(old_codec, obj)
        again = _decode(new_codec, data)
        assert again.to_dict(new) == obj.to_dict(old)
        assert _encode(new_codec, again) == data

    check()


# --- golden vectors ------------------------------------------------------------------------------


def i8(n: int) -> bytes:
    return struct.pack(">b", n)


def i16(n: int) -> bytes:
    return struct.pack(">h", n)


def i32(n: int) -> bytes:
    return struct.pack(">i", n)


def i64(n: int) -> bytes:
    return struct.pack(">q", n)


def s(text: str | None) -> bytes:
    """Classic string: int16 length (-1 = null), then UTF-8."""
    if text is None:
        return i16(-1)
    raw = text.encode()
    return i16(len(raw)) + raw


def b(raw: bytes) -> bytes:
    """Classic bytes: int32 length, then the bytes."""
    return i32(len(raw)) + raw


GOLDEN = [
    pytest.param(35, "request", 0, [
        i32(1),                    # int32 topics count = 1
        s("logs"),                 #   string topic = "logs"
        i32(2),                    #   int32 partitions count = 2
        i32(0),                    #     int32 partition 0
        i32(3),                    #     int32 partition 3
    ], {"topics": [{"topic": "logs", "partitions": [0, 3]}]}, id="describe_log_dirs-request-v0"),
    pytest.param(35, "request", 0, [
        i32(-1),                   # int32 topics count = -1: null, every topic
    ], {"topics": None}, id="describe_log_dirs-request-v0-all"),
    pytest.param(34, "request", 0, [
        i32(1),                    # int32 dirs count = 1
        s("/d2"),                  #   string path = "/d2"
        i32(1),                    #   int32 topics count = 1
        s("t"),                    #     string name = "t"
        i32(1),                    #     int32 partitions count = 1
        i32(7),                    #       int32 partition 7
    ], {"dirs": [{"path": "/d2", "topics": [{"name": "t", "partitions": [7]}]}]},
        id="alter_replica_log_dirs-request-v0"),
    pytest.param(34, "response", 0, [
        i32(0),                    # int32 throttle_time_ms = 0
        i32(1),                    # int32 results count = 1
        s("t"),                    #   string topic_name = "t"
        i32(1),                    #   int32 partitions count = 1
        i32(7),                    #     int32 partition_index = 7
        i16(57),                   #     int16 error_code = 57 (LOG_DIR_NOT_FOUND)
    ], {"throttle_time_ms": 0, "results": [
        {"topic_name": "t", "partitions": [{"partition_index": 7, "error_code": 57}]}]},
        id="alter_replica_log_dirs-response-v0"),
    pytest.param(38, "request", 0, [
        i32(1),                    # int32 renewers count = 1
        s("User"),                 #   string principal_type = "User"
        s("bob"),                  #   string principal_name = "bob"
        i64(86_400_000),           # int64 max_lifetime_ms = one day
    ], {"renewers": [{"principal_type": "User", "principal_name": "bob"}],
        "max_lifetime_ms": 86_400_000}, id="create_delegation_token-request-v0"),
    pytest.param(38, "response", 0, [
        i16(0),                    # int16 error_code = 0
        s("User"),                 # string principal_type = "User"
        s("alice"),                # string principal_name = "alice"
        i64(1_700_000_000_000),    # int64 issue_timestamp_ms
        i64(1_700_086_400_000),    # int64 expiry_timestamp_ms
        i64(1_700_604_800_000),    # int64 max_timestamp_ms
        s("tok1"),                 # string token_id = "tok1"
        b(b"\xde\xad"),            # bytes hmac = de ad
        i32(5),                    # int32 throttle_time_ms = 5, last in this response
    ], {"error_code": 0, "principal_type": "User", "principal_name": "alice",
        "issue_timestamp_ms": 1_700_000_000_000, "expiry_timestamp_ms": 1_700_086_400_000,
        "max_timestamp_ms": 1_700_604_800_000, "token_id": "tok1", "hmac": b"\xde\xad",
        "throttle_time_ms": 5}, id="create_delegation_token-response-v0"),
    pytest.param(39, "request", 0, [
        b(b"\x01\x02\x03"),        # bytes hmac = 01 02 03
        i64(-1),                   # int64 renew_period_ms = -1 (broker default)
    ], {"hmac": b"\x01\x02\x03", "renew_period_ms": -1}, id="renew_delegation_token-request-v0"),
    pytest.param(39, "response", 0, [
        i16(65),                   # int16 error_code = 65 (DELEGATION_TOKEN_AUTH_DISABLED)
        i64(0),                    # int64 expiry_timestamp_ms = 0
        i32(0),                    # int32 throttle_time_ms = 0
    ], {"error_code": 65, "expiry_timestamp_ms": 0, "throttle_time_ms": 0},
        id="renew_delegation_token-response-v0"),
    pytest.param(40, "request", 0, [
        b(b"\xff"),                # bytes hmac = ff
        i64(0),                    # int64 expiry_time_period_ms = 0 (expire now)
    ], {"hmac": b"\xff", "expiry_time_period_ms": 0}, id="expire_delegation_token-request-v0"),
    pytest.param(40, "response", 0, [
        i16(0),                    # int16 error_code = 0
        i64(1_700_000_000_000),    # int64 expiry_timestamp_ms
        i32(100),                  # int32 throttle_time_ms = 100
    ], {"error_code": 0, "expiry_timestamp_ms": 1_700_000_000_000, "throttle_time_ms": 100},
        id="expire_delegation_token-response-v0"),
    pytest.param(41, "request", 0, [
        i32(-1),                   # int32 owners count = -1: null, every token
    ], {"owners": None}, id="describe_delegation_token-request-v0-all"),
    pytest.param(41, "request", 0, [
        i32(1),                    # int32 owners count = 1
        s("User"),                 #   string principal_type = "User"
        s("alice"),                #   string principal_name = "alice"
    ], {"owners": [{"principal_type": "User", "principal_name": "alice"}]},
        id="describe_delegation_token-request-v0"),
    pytest.param(41, "response", 0, [
        i16(0),                    # int16 error_code = 0
        i32(1),                    # int32 tokens count = 1
        s("User"),                 #   string principal_type = "User"
        s("alice"),                #   string principal_name = "alice"
        i64(10),                   #   int64 issue_timestamp = 10
        i64(20),                   #   int64 expiry_timestamp = 20
        i64(30),                   #   int64 max_timestamp = 30
        s("tok1"),                 #   string token_id = "tok1"
        b(b"\xab"),                #   bytes hmac = ab
        i32(1),                    #   int32 renewers count = 1
        s("User"),                 #     string principal_type = "User"
        s("bob"),                  #     string principal_name = "bob"
        i32(0),                    # int32 throttle_time_ms = 0, after the tokens
    ], {"error_code": 0, "tokens": [{
        "principal_type": "User", "principal_name": "alice", "issue_timestamp": 10,
        "expiry_timestamp": 20, "max_timestamp": 30, "token_id": "tok1", "hmac": b"\xab",
        "renewers": [{"principal_type": "User", "principal_name": "bob"}]}], "throttle_time_ms": 0},
        id="describe_delegation_token-response-v0"),
    pytest.param(29, "request", 0, [
        i8(2),                     # int8 resource_type_filter = 2 (TOPIC)
        s(None),                   # string resource_name_filter = null (any); no pattern type in v0
        s("User:alice"),           # string principal_filter = "User:alice"
        s(None),                   # string host_filter = null (any)
        i8(1),                     # int8 operation = 1 (ANY)
        i8(3),                     # int8 permission_type = 3 (ALLOW)
    ], {"resource_type_filter": 2, "resource_name_filter": None, "principal_filter": "User:alice",
        "host_filter": None, "operation": 1, "permission_type": 3}, id="describe_acls-request-v0"),
    pytest.param(32, "response", 0, [
        i32(0),                    # int32 throttle_time_ms = 0
        i32(1),                    # int32 results count = 1
        i16(0),                    #   int16 error_code = 0
        s(None),                   #   string error_message = null
        i8(2),                     #   int8 resource_type = 2 (TOPIC)
        s("t"),                    #   string resource_name = "t"
        i32(1),                    #   int32 configs count = 1
        s("retention.ms"),         #     string name = "retention.ms"
        s("-1"),                   #     string value = "-1"
        i8(0),                     #     bool read_only = false
        i8(1),                     #     bool is_default = true (v0 only; no config_source)
        i8(0),                     #     bool is_sensitive = false; no synonyms in v0
    ], {"throttle_time_ms": 0, "results": [{
        "error_code": 0, "error_message": None, "resource_type": 2, "resource_name": "t",
        "configs": [{"name": "retention.ms", "value": "-1", "read_only": False,
                     "is_default": True, "is_sensitive": False}]}]},
        id="describe_configs-response-v0"),
]


@pytest.mark.parametrize(("key", "kind", "v", "chunks", "expected"), GOLDEN)
def test_golden_vector(key, kind, v, chunks, expected):
    data = b"".join(chunks)
    codec = _codec(key, kind, v)
    obj = _decode(codec, data)
    assert obj.to_dict(v) == expected
    assert _encode(codec, obj) == data


def test_delegation_token_v0_rejects_truncated_hmac():
    """A bytes length running past the frame is a decode error, never a short read."""
    data = i32(3) + b"\x01\x02"   # int32 hmac length = 3, but only 2 bytes follow
    with pytest.raises(DecodeError):
        _decode(_codec(39, "request", 0), data)

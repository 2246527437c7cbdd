"""Schema checks for the "txn" group: topic admin, producer ids, transactions and SASL.

kio (test_kio_crosscheck) covers every Kafka 4.x version. Here: kafka-python's hand-written old
classes as a second oracle (the only executable one for CreateTopics v0-1 and DeleteTopics v0,
which Kafka 4.0 removed), annotated golden vectors for WriteTxnMarkers v0 (no oracle at all) and a
few flexible shapes, and Kafka's explicit field defaults.
"""

from __future__ import annotations

import io
import warnings

import pytest
from hypothesis import HealthCheck, given, settings

from kproxy.protocol.compiler import encode_to, join_parts
from kproxy.protocol.messages import api_by_name, apis, request_codecs, response_codecs

from .strategies import message_strategy

with warnings.catch_warnings():
    # kafka-python 3.0 calls the deprecated importlib.resources.read_text while importing; the
    # warning is theirs and pyproject turns warnings into errors.
    warnings.simplefilter("ignore", DeprecationWarning)
    from kafka.protocol.old import add_offsets_to_txn as kp_add_offsets
    from kafka.protocol.old import add_partitions_to_txn as kp_add_partitions
    from kafka.protocol.old import admin as kp_admin
    from kafka.protocol.old import end_txn as kp_end_txn
    from kafka.protocol.old import init_producer_id as kp_init_pid
    from kafka.protocol.old import sasl_authenticate as kp_sasl_auth
    from kafka.protocol.old import sasl_handshake as kp_sasl_handshake
    from kafka.protocol.old import txn_offset_commit as kp_txn_offset_commit
    from kafka.protocol.old.types import Array, Schema

_KP_MODULES = (kp_add_offsets, kp_add_partitions, kp_admin, kp_end_txn, kp_init_pid, kp_sasl_auth,
               kp_sasl_handshake, kp_txn_offset_commit)
_GROUP_KEYS = {17, 19, 20, 21, 22, 24, 25, 26, 27, 28, 36, 37, 61, 65, 66}


def _codec(key: int, kind: str, v: int):
    return (request_codecs if kind == "request" else response_codecs)(key, v)[1]


def _encode(codec, obj) -> bytes:
    out, ins = bytearray(), []
    encode_to(codec, obj, out, ins)
    return bytes(join_parts(out, ins))


def _decode(codec, data: bytes):
    obj, pos = codec.decode_checked(memoryview(data), 0, len(data))
    assert pos == len(data), f"decoded {pos} of {len(data)} bytes"
    return obj


# --- kafka-python's old classes -------------------------------------------------------------------

def _kp_classes():
    out = []
    for mod in _KP_MODULES:
        for name, cls in sorted(vars(mod).items()):
            if (isinstance(cls, type) and getattr(cls, "API_KEY", None) in _GROUP_KEYS
                    and isinstance(getattr(cls, "SCHEMA", None), Schema)):
                kind = "request" if "Request" in name else "response"
                out.append(pytest.param(cls, kind, id=f"{name}"))
    return out


KP_CLASSES = _kp_classes()


def test_kafka_python_oracle_covers_the_versions_kio_lacks():
    have = {(c.values[0].API_KEY, c.values[1], c.values[0].API_VERSION) for c in KP_CLASSES}
    for kind in ("request", "response"):
        assert {(19, kind, 0), (19, kind, 1), (20, kind, 0)} <= have


def _flat_kproxy(v) -> list:
    """Leaf values in wire order, with array lengths, of a kproxy ``to_dict`` value."""
    if isinstance(v, dict):
        return [x for item in v.values() for x in _flat_kproxy(item)]
    if isinstance(v, list):
        return [("len", len(v)), *(x for item in v for x in _flat_kproxy(item))]
    return [v]


def _flat_kp(v) -> list:
    """The same for a value kafka-python decoded (structs are tuples or Struct objects)."""
    if isinstance(v, tuple):
        return [x for item in v for x in _flat_kp(item)]
    if isinstance(v, list):
        return [("len", len(v)), *(x for item in v for x in _flat_kp(item))]
    return [v]


def _kp_names(schema: Schema) -> list:
    """kafka-python's field names, nested like kproxy's ``to_dict``; unnamed array elements skipped."""
    out = []
    for name, f in zip(schema.names, schema.fields, strict=True):
        if isinstance(f, Array) and isinstance(f.array_of, Schema):
            out.append((name, _kp_names(f.array_of)))
        elif isinstance(f, Schema):
            out.append((name, _kp_names(f)))
        else:
            out.append(name)
    return out


def _kproxy_names(codec, v: int) -> list:
    def walk(spec) -> list:
        out = []
        for f in spec.fields:
            if v in f.versions:
                out.append((f.name, walk(f.struct)) if f.struct is not None else f.name)
        return out
    return walk(codec.message.root)


# kafka-python nests CreatePartitions' count and assignments in a struct of its own ("new_partitions")
# and types assignments as [][]int32; the wire is the same, only the names differ.
_KP_OWN_NAMES = {37}


@pytest.mark.parametrize(("kp_cls", "kind"), KP_CLASSES)
def test_kafka_python_agrees(kp_cls, kind):
    key, v = kp_cls.API_KEY, kp_cls.API_VERSION
    codec = _codec(key, kind, v)
    if key not in _KP_OWN_NAMES:
        assert _kproxy_names(codec, v) == _kp_names(kp_cls.SCHEMA)

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(message_strategy(codec.message, v))
    def check(obj):
        ours = _encode(codec, obj)
        buf = io.BytesIO(ours)
        theirs = kp_cls.SCHEMA.decode(buf)
        assert buf.tell() == len(ours)
        assert _flat_kp(theirs) == _flat_kproxy(obj.to_dict(v))
        # kafka-python writes what it read byte for byte, and kproxy reads its bytes back equal.
        kp_bytes = kp_cls(*theirs).encode()
        assert kp_bytes == ours
        assert _decode(codec, kp_bytes).to_dict(v) == obj.to_dict(v)

    check()


def test_create_topics_v0_v1_from_kafka_python():
    topic = ("orders", 3, 2, [(0, [1, 2]), (1, [2, 3])], [("cleanup.policy", "compact"), ("x", None)])
    for v, cls, extra in ((0, kp_admin.CreateTopicsRequest_v0, ()),
                          (1, kp_admin.CreateTopicsRequest_v1, (True,))):
        data = cls(*([topic], 30000, *extra)).encode()
        obj = _decode(_codec(19, "request", v), data)
        expected = {
            "topics": [{
                "name": "orders", "num_partitions": 3, "replication_factor": 2,
                "assignments": [{"partition_index": 0, "broker_ids": [1, 2]},
                                {"partition_index": 1, "broker_ids": [2, 3]}],
                "configs": [{"name": "cleanup.policy", "value": "compact"}, {"name": "x", "value": None}],
            }],
            "timeout_ms": 30000,
        }
        if v == 1:
            expected["validate_only"] = True
        assert obj.to_dict(v) == expected
        assert _encode(_codec(19, "request", v), obj) == data

    data = kp_admin.CreateTopicsResponse_v0([("orders", 36)]).encode()
    obj = _decode(_codec(19, "response", 0), data)
    assert obj.to_dict(0) == {"topics": [{"name": "orders", "error_code": 36}]}
    data = kp_admin.CreateTopicsResponse_v1([("orders", 36, "exists"), ("b", 0, None)]).encode()
    obj = _decode(_codec(19, "response", 1), data)
    assert obj.to_dict(1) == {"topics": [{"name": "orders", "error_code": 36, "error_message": "exists"},
                                         {"name": "b", "error_code": 0, "error_message": None}]}
    assert _encode(_codec(19, "response", 1), obj) == data


def test_delete_topics_v0_from_kafka_python():
    data = kp_admin.DeleteTopicsRequest_v0(["a", "bb"], 5000).encode()
    obj = _decode(_codec(20, "request", 0), data)
    assert obj.to_dict(0) == {"topic_names": ["a", "bb"], "timeout_ms": 5000}
    data = kp_admin.DeleteTopicsResponse_v0([("a", 0), ("bb", 3)]).encode()
    obj = _decode(_codec(20, "response", 0), data)
    # v0 has no throttle_time_ms: it starts with the array.
    assert obj.to_dict(0) == {"responses": [{"name": "a", "error_code": 0}, {"name": "bb", "error_code": 3}]}
    assert _encode(_codec(20, "response", 0), obj) == data


# --- golden vectors ---------------------------------------------------------------------------------

def _check_golden(key: int, kind: str, v: int, data: bytes, expected: dict) -> None:
    codec = _codec(key, kind, v)
    obj = _decode(codec, data)
    assert obj.to_dict(v) == expected
    assert _encode(codec, obj) == data


# WriteTxnMarkers v0 (removed in Kafka 4.0; neither kio nor kafka-python has it): v1 without
# the flexible encodings.
WRITE_TXN_MARKERS_V0_REQUEST = b"".join([
    b"\x00\x00\x00\x01",                  # int32 markers count = 1
    b"\x00\x00\x00\x00\x00\x00\x00\x2a",  # int64 producer_id = 42
    b"\x00\x03",                          # int16 producer_epoch = 3
    b"\x01",                              # bool transaction_result = true (COMMIT)
    b"\x00\x00\x00\x01",                  # int32 topics count = 1
    b"\x00\x02t1",                        # string name = "t1" (int16 length)
    b"\x00\x00\x00\x02",                  # int32 partition_indexes count = 2
    b"\x00\x00\x00\x00",                  # int32 partition_indexes[0] = 0
    b"\x00\x00\x00\x05",                  # int32 partition_indexes[1] = 5
    b"\x00\x00\x00\x07",                  # int32 coordinator_epoch = 7
])
WRITE_TXN_MARKERS_REQUEST_DICT = {
    "markers": [{
        "producer_id": 42, "producer_epoch": 3, "transaction_result": True,
        "topics": [{"name": "t1", "partition_indexes": [0, 5]}],
        "coordinator_epoch": 7,
    }],
}

WRITE_TXN_MARKERS_V0_RESPONSE = b"".join([
    b"\x00\x00\x00\x01",                  # int32 markers count = 1
    b"\x00\x00\x00\x00\x00\x00\x00\x2a",  # int64 producer_id = 42
    b"\x00\x00\x00\x01",                  # int32 topics count = 1
    b"\x00\x02t1",                        # string name = "t1"
    b"\x00\x00\x00\x02",                  # int32 partitions count = 2
    b"\x00\x00\x00\x00",                  # int32 partition_index = 0
    b"\x00\x00",                          # int16 error_code = 0
    b"\x00\x00\x00\x05",                  # int32 partition_index = 5
    b"\x00\x2f",                          # int16 error_code = 47 (INVALID_PRODUCER_EPOCH)
])
WRITE_TXN_MARKERS_RESPONSE_DICT = {
    "markers": [{
        "producer_id": 42,
        "topics": [{"name": "t1", "partitions": [{"partition_index": 0, "error_code": 0},
                                                 {"partition_index": 5, "error_code": 47}]}],
    }],
}


def test_write_txn_markers_v0_golden():
    _check_golden(27, "request", 0, WRITE_TXN_MARKERS_V0_REQUEST, WRITE_TXN_MARKERS_REQUEST_DICT)
    _check_golden(27, "response", 0, WRITE_TXN_MARKERS_V0_RESPONSE, WRITE_TXN_MARKERS_RESPONSE_DICT)


def test_write_txn_markers_v0_is_not_flexible():
    # The same bytes are not a valid v1 message: v1 switched to compact arrays and tagged fields.
    assert _encode(_codec(27, "request", 1), _decode(_codec(27, "request", 0), WRITE_TXN_MARKERS_V0_REQUEST)) \
        != WRITE_TXN_MARKERS_V0_REQUEST


def test_write_txn_markers_v2_golden():
    data = b"".join([
        b"\x02",                              # uvarint markers count+1 = 1 marker
        b"\x00\x00\x00\x00\x00\x00\x00\x2a",  # int64 producer_id = 42
        b"\x00\x03",                          # int16 producer_epoch = 3
        b"\x00",                              # bool transaction_result = false (ABORT)
        b"\x02",                              # uvarint topics count+1 = 1 topic
        b"\x03t1",                            # compact string name = "t1" (uvarint length+1)
        b"\x02",                              # uvarint partition_indexes count+1 = 1
        b"\x00\x00\x00\x05",                  # int32 partition_indexes[0] = 5
        b"\x00",                              # topic: no tagged fields
        b"\x00\x00\x00\x07",                  # int32 coordinator_epoch = 7
        b"\x02",                              # int8 transaction_version = 2 (KIP-1228, v2+)
        b"\x00",                              # marker: no tagged fields
        b"\x00",                              # request: no tagged fields
    ])
    _check_golden(27, "request", 2, data, {
        "markers": [{
            "producer_id": 42, "producer_epoch": 3, "transaction_result": False,
            "topics": [{"name": "t1", "partition_indexes": [5]}],
            "coordinator_epoch": 7, "transaction_version": 2,
        }],
    })


def test_add_partitions_to_txn_v3_and_v4_shapes_golden():
    # v3: the client's single-transaction shape.
    v3 = b"".join([
        b"\x04txn",                           # compact string v3_and_below_transactional_id = "txn"
        b"\x00\x00\x00\x00\x00\x00\x00\x09",  # int64 v3_and_below_producer_id = 9
        b"\x00\x01",                          # int16 v3_and_below_producer_epoch = 1
        b"\x02",                              # uvarint v3_and_below_topics count+1 = 1
        b"\x02t",                             # compact string name = "t"
        b"\x02",                              # uvarint partitions count+1 = 1
        b"\x00\x00\x00\x04",                  # int32 partitions[0] = 4
        b"\x00",                              # topic: no tagged fields
        b"\x00",                              # request: no tagged fields
    ])
    _check_golden(24, "request", 3, v3, {
        "v3_and_below_transactional_id": "txn", "v3_and_below_producer_id": 9,
        "v3_and_below_producer_epoch": 1,
        "v3_and_below_topics": [{"name": "t", "partitions": [4]}],
    })
    # v4: the broker's batched shape; the v3-and-below fields are gone from the wire.
    v4 = b"".join([
        b"\x02",                              # uvarint transactions count+1 = 1
        b"\x04txn",                           # compact string transactional_id = "txn"
        b"\x00\x00\x00\x00\x00\x00\x00\x09",  # int64 producer_id = 9
        b"\x00\x01",                          # int16 producer_epoch = 1
        b"\x01",                              # bool verify_only = true
        b"\x02",                              # uvarint topics count+1 = 1
        b"\x02t",                             # compact string name = "t"
        b"\x02",                              # uvarint partitions count+1 = 1
        b"\x00\x00\x00\x04",                  # int32 partitions[0] = 4
        b"\x00",                              # topic: no tagged fields
        b"\x00",                              # transaction: no tagged fields
        b"\x00",                              # request: no tagged fields
    ])
    _check_golden(24, "request", 4, v4, {
        "transactions": [{
            "transactional_id": "txn", "producer_id": 9, "producer_epoch": 1, "verify_only": True,
            "topics": [{"name": "t", "partitions": [4]}],
        }],
    })
    v4_response = b"".join([
        b"\x00\x00\x00\x00",                  # int32 throttle_time_ms = 0
        b"\x00\x00",                          # int16 error_code = 0 (v4+)
        b"\x02",                              # uvarint results_by_transaction count+1 = 1
        b"\x04txn",                           # compact string transactional_id = "txn"
        b"\x02",                              # uvarint topic_results count+1 = 1
        b"\x02t",                             # compact string name = "t"
        b"\x02",                              # uvarint results_by_partition count+1 = 1
        b"\x00\x00\x00\x04",                  # int32 partition_index = 4
        b"\x00\x30",                          # int16 partition_error_code = 48 (INVALID_TXN_STATE)
        b"\x00",                              # partition result: no tagged fields
        b"\x00",                              # topic result: no tagged fields
        b"\x00",                              # transaction result: no tagged fields
        b"\x00",                              # response: no tagged fields
    ])
    _check_golden(24, "response", 4, v4_response, {
        "throttle_time_ms": 0, "error_code": 0,
        "results_by_transaction": [{
            "transactional_id": "txn",
            "topic_results": [{"name": "t", "results_by_partition": [
                {"partition_index": 4, "partition_error_code": 48}]}],
        }],
    })


def test_create_topics_v5_response_tagged_config_error_golden():
    data = b"".join([
        b"\x00\x00\x00\x00",                  # int32 throttle_time_ms = 0
        b"\x02",                              # uvarint topics count+1 = 1
        b"\x02t",                             # compact string name = "t"
        b"\x00\x00",                          # int16 error_code = 0
        b"\x00",                              # compact nullable string error_message = null
        b"\x00\x00\x00\x03",                  # int32 num_partitions = 3
        b"\x00\x01",                          # int16 replication_factor = 1
        b"\x00",                              # compact nullable array configs = null
        b"\x01",                              # topic: 1 tagged field
        b"\x00\x02\x00\x1d",                  # tag 0, size 2: int16 topic_config_error_code = 29
        b"\x00",                              # response: no tagged fields
    ])
    _check_golden(19, "response", 5, data, {
        "throttle_time_ms": 0,
        "topics": [{"name": "t", "error_code": 0, "error_message": None, "topic_config_error_code": 29,
                    "num_partitions": 3, "replication_factor": 1, "configs": None}],
    })


def test_delete_topics_v6_null_name_golden():
    data = b"".join([
        b"\x02",                              # uvarint topics count+1 = 1
        b"\x00",                              # compact nullable string name = null (deleting by id)
        bytes(range(1, 17)),                  # uuid topic_id = 01020304-...-10
        b"\x00",                              # topic: no tagged fields
        b"\x00\x00\x75\x30",                  # int32 timeout_ms = 30000
        b"\x00",                              # request: no tagged fields
    ])
    codec = _codec(20, "request", 6)
    obj = _decode(codec, data)
    assert obj.topics[0].name is None
    assert obj.topics[0].topic_id.bytes == bytes(range(1, 17))
    assert obj.timeout_ms == 30000
    assert "topic_names" not in obj.to_dict(6)
    assert _encode(codec, obj) == data


def test_sasl_authenticate_v1_golden():
    data = b"".join([
        b"\x00\x00",                          # int16 error_code = 0
        b"\xff\xff",                          # nullable string error_message = null (int16 -1)
        b"\x00\x00\x00\x03abc",               # bytes auth_bytes = b"abc" (int32 length)
        b"\x00\x00\x00\x00\x00\x36\xee\x80",  # int64 session_lifetime_ms = 3600000 (v1+)
    ])
    codec = _codec(36, "response", 1)
    obj = _decode(codec, data)
    assert obj.to_dict(1) == {"error_code": 0, "error_message": None, "auth_bytes": b"abc",
                              "session_lifetime_ms": 3600000}
    assert _encode(codec, obj) == data


# --- versions and defaults ------------------------------------------------------------------------

# The union of Kafka 3.9 and 4.x: CreateTopics v0-1, DeleteTopics v0 and WriteTxnMarkers v0 left
# in 4.0 (KIP-896) but older clients and brokers still speak them.
EXPECTED_RANGES = {
    "sasl_handshake": (0, 1, None), "create_topics": (0, 7, 5), "delete_topics": (0, 6, 4),
    "delete_records": (0, 2, 2), "init_producer_id": (0, 6, 2), "add_partitions_to_txn": (0, 5, 3),
    "add_offsets_to_txn": (0, 4, 3), "end_txn": (0, 5, 3), "write_txn_markers": (0, 2, 1),
    "txn_offset_commit": (0, 5, 3), "sasl_authenticate": (0, 2, 2), "create_partitions": (0, 3, 2),
    "describe_producers": (0, 0, 0), "describe_transactions": (0, 0, 0), "list_transactions": (0, 2, 0),
}


@pytest.mark.parametrize("name", sorted(EXPECTED_RANGES))
def test_version_ranges(name):
    lo, hi, flex = EXPECTED_RANGES[name]
    api = api_by_name(name)
    for msg in (api.request, api.response):
        assert (msg.versions.lo, msg.versions.hi) == (lo, hi)
        for v in range(lo, hi + 1):
            assert (v in msg.flexible) == (flex is not None and v >= flex), (name, v)


def test_explicit_kafka_defaults():
    def body(key, kind):
        # One class serves every version; the newest version has every field.
        return _codec(key, kind, getattr(apis()[key], kind).versions.hi).cls

    create = body(19, "request")()
    assert (create.timeout_ms, create.validate_only) == (60000, False)
    ct_result = body(19, "response").CreatableTopicResult()
    assert (ct_result.num_partitions, ct_result.replication_factor) == (-1, -1)
    assert body(19, "response").CreatableTopicConfigs().config_source == -1
    ipid = body(22, "request")()
    assert (ipid.producer_id, ipid.producer_epoch, ipid.enable2_pc, ipid.keep_prepared_txn) == (-1, -1, False, False)
    ipid_r = body(22, "response")()
    assert (ipid_r.producer_id, ipid_r.ongoing_txn_producer_id, ipid_r.ongoing_txn_producer_epoch) == (-1, -1, -1)
    end_r = body(26, "response")()
    assert (end_r.producer_id, end_r.producer_epoch) == (-1, -1)
    assert body(27, "request").WritableTxnMarker().transaction_version == 0
    toc = body(28, "request")()
    assert (toc.generation_id, toc.member_id, toc.group_instance_id) == (-1, "", None)
    assert body(28, "request").TxnOffsetCommitRequestPartition().committed_leader_epoch == -1
    assert body(36, "response")().session_lifetime_ms == 0
    assert body(37, "response").CreatePartitionsTopicResult().error_message is None
    ps = body(61, "response").ProducerState()
    assert (ps.last_sequence, ps.last_timestamp, ps.current_txn_start_offset) == (-1, -1, -1)
    assert body(61, "response").PartitionResponse().error_message is None
    lt = body(66, "request")()
    assert (lt.duration_filter, lt.transactional_id_pattern) == (-1, None)
    assert body(20, "request").DeleteTopicState().name is None
    assert body(20, "response").DeletableTopicResult().error_message is None


"""Share groups, streams groups and client telemetry: checks beyond the kio cross-check.

kio knows these APIs from Kafka 4.1 on. Kafka 4.0 shipped share groups as early access with v0 of
ShareGroupHeartbeat, ShareGroupDescribe, ShareFetch and ShareAcknowledge; 4.1 replaced them by v1.
No executable oracle speaks those v0s, so they are pinned here by hand-built byte vectors (one
comment per chunk). Where 4.1 only bumped the version number, kio's v1 bytes must also decode as
kproxy's v0, which checks the "same layout" claim against an independent implementation.
"""

from __future__ import annotations

import io
import uuid

import pytest
from hypothesis import HealthCheck, Phase, assume, given, settings
from kio.serial import entity_reader, entity_writer

from kproxy.protocol.compiler import encode_to, join_parts
from kproxy.protocol.errors import DecodeError
from kproxy.protocol.messages import api_by_name, request_codecs, response_codecs

from .kio_bridge import kio_class, kio_strategy, to_plain

TOPIC = uuid.UUID("00112233-4455-6677-8899-aabbccddeeff")
TOPIC_HEX = "00112233445566778899aabbccddeeff"


def _body_codec(kind: str, key: int, v: int):
    return (request_codecs if kind == "request" else response_codecs)(key, v)[1]


def _encode(codec, obj) -> bytes:
    out, ins = bytearray(), []
    encode_to(codec, obj, out, ins)
    return bytes(join_parts(out, ins))


def _build(root, cls, d: dict):
    """Build a kproxy object from a plain dict, to test the encoder on its own."""
    kw = {}
    for f in cls._spec.fields:
        if f.name not in d:
            continue
        value = d[f.name]
        if f.type == "struct" and value is not None:
            sub = getattr(root, f.struct.name)  # nested classes hang off the message class
            value = [_build(root, sub, e) for e in value] if f.array else _build(root, sub, value)
        kw[f.name] = value
    return cls(**kw)


def _hex(chunks: list[str]) -> bytes:
    return bytes.fromhex("".join(c.replace(" ", "") for c in chunks))


def _check_golden(kind: str, key: int, v: int, data: bytes, expected: dict) -> None:
    codec = _body_codec(kind, key, v)
    obj, pos = codec.decode_checked(memoryview(data), 0, len(data))
    assert pos == len(data)
    assert obj.to_dict(v) == expected
    assert _encode(codec, obj) == data
    assert _encode(codec, _build(codec.cls, codec.cls, expected)) == data


# --- version ranges -------------------------------------------------------------------------------

RANGES = {
    "get_telemetry_subscriptions": (0, 0), "push_telemetry": (0, 0),
    "share_group_heartbeat": (0, 1), "share_group_describe": (0, 1),
    "share_fetch": (0, 2), "share_acknowledge": (0, 2),
    "initialize_share_group_state": (0, 0), "read_share_group_state": (0, 0),
    "write_share_group_state": (0, 1), "delete_share_group_state": (0, 0),
    "read_share_group_state_summary": (0, 1),
    "streams_group_heartbeat": (0, 0), "streams_group_describe": (0, 0),
    "describe_share_group_offsets": (0, 1), "alter_share_group_offsets": (0, 0),
    "delete_share_group_offsets": (0, 0),
}


@pytest.mark.parametrize(("name", "lo_hi"), sorted(RANGES.items()))
def test_version_ranges(name, lo_hi):
    api = api_by_name(name)
    for msg in (api.request, api.response):
        assert (msg.versions.lo, msg.versions.hi) == lo_hi
        assert msg.flexible.lo == 0  # every one of these APIs is flexible from its first version


# --- ShareGroupHeartbeat v0 (Kafka 4.0 early access) ----------------------------------------------

def test_share_group_heartbeat_v0_request():
    data = _hex([
        "03 6731",               # compact string group_id = "g1"
        "02 6d",                 # compact string member_id = "m"
        "00000005",              # int32 member_epoch = 5
        "00",                    # compact nullable string rack_id = null
        "02 02 74",              # compact nullable array subscribed_topic_names = ["t"]
        "00",                    # no tagged fields
    ])
    _check_golden("request", 76, 0, data, {
        "group_id": "g1", "member_id": "m", "member_epoch": 5, "rack_id": None,
        "subscribed_topic_names": ["t"],
    })


def test_share_group_heartbeat_v0_response():
    data = _hex([
        "00000000",              # int32 throttle_time_ms = 0
        "0000",                  # int16 error_code = 0
        "00",                    # compact nullable string error_message = null
        "02 6d",                 # compact nullable string member_id = "m"
        "00000006",              # int32 member_epoch = 6
        "00001388",              # int32 heartbeat_interval_ms = 5000
        "01",                    # int8: nullable struct assignment is present
        "02",                    #   compact array topic_partitions: 1 entry
        TOPIC_HEX,               #     uuid topic_id
        "03 00000000 00000001",  #     compact array partitions = [0, 1]
        "00",                    #     TopicPartitions: no tagged fields
        "00",                    #   Assignment: no tagged fields
        "00",                    # no tagged fields
    ])
    _check_golden("response", 76, 0, data, {
        "throttle_time_ms": 0, "error_code": 0, "error_message": None, "member_id": "m",
        "member_epoch": 6, "heartbeat_interval_ms": 5000,
        "assignment": {"topic_partitions": [{"topic_id": TOPIC, "partitions": [0, 1]}]},
    })


def test_share_group_heartbeat_v0_response_without_assignment():
    data = _hex([
        "00000000 0000 00",      # throttle_time_ms = 0, error_code = 0, error_message = null
        "00",                    # compact nullable string member_id = null
        "00000000 00000000",     # member_epoch = 0, heartbeat_interval_ms = 0
        "ff",                    # int8 -1: assignment = null
        "00",                    # no tagged fields
    ])
    _check_golden("response", 76, 0, data, {
        "throttle_time_ms": 0, "error_code": 0, "error_message": None, "member_id": None,
        "member_epoch": 0, "heartbeat_interval_ms": 0, "assignment": None,
    })


# --- ShareGroupDescribe v0 -------------------------------------------------------------------------

def test_share_group_describe_v0_request():
    data = _hex([
        "02 03 6731",            # compact array group_ids = ["g1"]
        "01",                    # bool include_authorized_operations = true
        "00",                    # no tagged fields
    ])
    _check_golden("request", 77, 0, data, {"group_ids": ["g1"], "include_authorized_operations": True})


def test_share_group_describe_v0_response():
    data = _hex([
        "00000000",              # int32 throttle_time_ms = 0
        "02",                    # compact array groups: 1 entry
        "0000",                  #   int16 error_code = 0
        "00",                    #   compact nullable string error_message = null
        "03 6731",               #   compact string group_id = "g1"
        "07 537461626c65",       #   compact string group_state = "Stable"
        "00000003",              #   int32 group_epoch = 3
        "00000003",              #   int32 assignment_epoch = 3
        "07 73696d706c65",       #   compact string assignor_name = "simple"
        "02",                    #   compact array members: 1 entry
        "02 6d",                 #     compact string member_id = "m"
        "03 7231",               #     compact nullable string rack_id = "r1"
        "00000003",              #     int32 member_epoch = 3
        "02 63",                 #     compact string client_id = "c"
        "03 2f68",               #     compact string client_host = "/h"
        "02 02 74",              #     compact array subscribed_topic_names = ["t"]
        "02",                    #     struct assignment: compact array topic_partitions, 1 entry
        TOPIC_HEX,               #       uuid topic_id
        "02 74",                 #       compact string topic_name = "t"
        "02 00000000",           #       compact array partitions = [0]
        "00",                    #       TopicPartitions: no tagged fields
        "00",                    #     Assignment: no tagged fields
        "00",                    #     Member: no tagged fields
        "80000000",              #   int32 authorized_operations = -2147483648 (not requested)
        "00",                    #   DescribedGroup: no tagged fields
        "00",                    # no tagged fields
    ])
    _check_golden("response", 77, 0, data, {
        "throttle_time_ms": 0,
        "groups": [{
            "error_code": 0, "error_message": None, "group_id": "g1", "group_state": "Stable",
            "group_epoch": 3, "assignment_epoch": 3, "assignor_name": "simple",
            "members": [{
                "member_id": "m", "rack_id": "r1", "member_epoch": 3, "client_id": "c",
                "client_host": "/h", "subscribed_topic_names": ["t"],
                "assignment": {"topic_partitions": [
                    {"topic_id": TOPIC, "topic_name": "t", "partitions": [0]}]},
            }],
            "authorized_operations": -2147483648,
        }],
    })


# --- ShareFetch v0: the one early-access layout that differs from v1 ------------------------------

def test_share_fetch_v0_request():
    data = _hex([
        "03 6731",               # compact nullable string group_id = "g1"
        "02 6d",                 # compact nullable string member_id = "m"
        "00000000",              # int32 share_session_epoch = 0 (open a session)
        "000001f4",              # int32 max_wait_ms = 500
        "00000001",              # int32 min_bytes = 1
        "7fffffff",              # int32 max_bytes = 2147483647
        # v0 has no max_records / batch_size (added in v1)
        "02",                    # compact array topics: 1 entry
        TOPIC_HEX,               #   uuid topic_id
        "02",                    #   compact array partitions: 1 entry
        "00000000",              #     int32 partition_index = 0
        "00100000",              #     int32 partition_max_bytes = 1048576 (v0 only)
        "02",                    #     compact array acknowledgement_batches: 1 entry
        "000000000000000a",      #       int64 first_offset = 10
        "000000000000000c",      #       int64 last_offset = 12
        "02 01",                 #       compact array acknowledge_types = [1] (accept)
        "00",                    #       AcknowledgementBatch: no tagged fields
        "00",                    #     FetchPartition: no tagged fields
        "00",                    #   FetchTopic: no tagged fields
        "01",                    # compact array forgotten_topics_data: empty
        "00",                    # no tagged fields
    ])
    _check_golden("request", 78, 0, data, {
        "group_id": "g1", "member_id": "m", "share_session_epoch": 0, "max_wait_ms": 500,
        "min_bytes": 1, "max_bytes": 2147483647,
        "topics": [{"topic_id": TOPIC, "partitions": [{
            "partition_index": 0, "partition_max_bytes": 1048576,
            "acknowledgement_batches": [
                {"first_offset": 10, "last_offset": 12, "acknowledge_types": [1]}],
        }]}],
        "forgotten_topics_data": [],
    })


def test_share_fetch_v1_request_drops_partition_max_bytes():
    data = _hex([
        "00 00",                 # group_id = null, member_id = null
        "ffffffff",              # int32 share_session_epoch = -1 (close the session)
        "00000000 00000000",     # max_wait_ms = 0, min_bytes = 0
        "00000400",              # int32 max_bytes = 1024
        "000001f4",              # int32 max_records = 500 (v1+)
        "00000064",              # int32 batch_size = 100 (v1+)
        "02",                    # compact array topics: 1 entry
        TOPIC_HEX,               #   uuid topic_id
        "02",                    #   compact array partitions: 1 entry
        "00000003",              #     int32 partition_index = 3; no partition_max_bytes in v1
        "01",                    #     compact array acknowledgement_batches: empty
        "00 00",                 #     FetchPartition, FetchTopic: no tagged fields
        "01",                    # compact array forgotten_topics_data: empty
        "00",                    # no tagged fields
    ])
    _check_golden("request", 78, 1, data, {
        "group_id": None, "member_id": None, "share_session_epoch": -1, "max_wait_ms": 0,
        "min_bytes": 0, "max_bytes": 1024, "max_records": 500, "batch_size": 100,
        "topics": [{"topic_id": TOPIC, "partitions": [
            {"partition_index": 3, "acknowledgement_batches": []}]}],
        "forgotten_topics_data": [],
    })


def test_share_fetch_v0_response():
    data = _hex([
        "00000000",              # int32 throttle_time_ms = 0
        "0000",                  # int16 error_code = 0
        "00",                    # compact nullable string error_message = null
        # v0 has no acquisition_lock_timeout_ms (added in v1)
        "02",                    # compact array responses: 1 entry
        TOPIC_HEX,               #   uuid topic_id
        "03",                    #   compact array partitions: 2 entries
        "00000000",              #     int32 partition_index = 0
        "0006",                  #     int16 error_code = 6 (NOT_LEADER_OR_FOLLOWER)
        "00",                    #     compact nullable string error_message = null
        "0000",                  #     int16 acknowledge_error_code = 0
        "00",                    #     compact nullable string acknowledge_error_message = null
        "00000002 00000007 00",  #     current_leader: leader_id = 2, leader_epoch = 7, no tags
        "00",                    #     compact nullable records = null (nullable in v0 only)
        "01",                    #     compact array acquired_records: empty
        "00",                    #     PartitionData: no tagged fields
        "00000001",              #     int32 partition_index = 1
        "0000 00 0000 00",       #     error_code, error_message, acknowledge_error_code/_message
        "ffffffff ffffffff 00",  #     current_leader: leader_id = -1, leader_epoch = -1, no tags
        "05 61626364",           #     compact records: 4 bytes (opaque to the codec)
        "02",                    #     compact array acquired_records: 1 entry
        "0000000000000000",      #       int64 first_offset = 0
        "0000000000000003",      #       int64 last_offset = 3
        "0001",                  #       int16 delivery_count = 1
        "00",                    #       AcquiredRecords: no tagged fields
        "00",                    #     PartitionData: no tagged fields
        "00",                    #   ShareFetchableTopicResponse: no tagged fields
        "02",                    # compact array node_endpoints: 1 entry (kproxy rewrites these)
        "00000002",              #   int32 node_id = 2
        "03 6232",               #   compact string host = "b2"
        "00002384",              #   int32 port = 9092
        "00",                    #   compact nullable string rack = null
        "00",                    #   NodeEndpoint: no tagged fields
        "00",                    # no tagged fields
    ])
    no_error = {"error_code": 0, "error_message": None, "acknowledge_error_code": 0,
                "acknowledge_error_message": None}
    _check_golden("response", 78, 0, data, {
        "throttle_time_ms": 0, "error_code": 0, "error_message": None,
        "responses": [{"topic_id": TOPIC, "partitions": [
            {"partition_index": 0, **no_error, "error_code": 6,
             "current_leader": {"leader_id": 2, "leader_epoch": 7},
             "records": None, "acquired_records": []},
            {"partition_index": 1, **no_error,
             "current_leader": {"leader_id": -1, "leader_epoch": -1},
             "records": b"abcd",
             "acquired_records": [{"first_offset": 0, "last_offset": 3, "delivery_count": 1}]},
        ]}],
        "node_endpoints": [{"node_id": 2, "host": "b2", "port": 9092, "rack": None}],
    })


def test_share_fetch_records_are_not_nullable_after_v0():
    # The same partition with null records, framed as a v1 response (which adds the lock timeout).
    data = _hex([
        "00000000 0000 00",      # throttle_time_ms, error_code, error_message = null
        "00007530",              # int32 acquisition_lock_timeout_ms = 30000
        "02", TOPIC_HEX, "02",   # responses: 1 topic, 1 partition
        "00000000 0000 00 0000 00",  # partition 0, no errors
        "00000000 00000000 00",  # current_leader
        "00",                    # records = null: legal in v0, not in v1
        "01 00 00",              # acquired_records empty; PartitionData, topic tags
        "01 00",                 # node_endpoints empty; no tagged fields
    ])
    codec = _body_codec("response", 78, 1)
    with pytest.raises(DecodeError):
        codec.decode_checked(memoryview(data), 0, len(data))


# --- ShareAcknowledge v0 ---------------------------------------------------------------------------

def test_share_acknowledge_v0_request():
    data = _hex([
        "03 6731",               # compact nullable string group_id = "g1"
        "02 6d",                 # compact nullable string member_id = "m"
        "00000001",              # int32 share_session_epoch = 1
        "02",                    # compact array topics: 1 entry
        TOPIC_HEX,               #   uuid topic_id
        "02",                    #   compact array partitions: 1 entry
        "00000000",              #     int32 partition_index = 0
        "02",                    #     compact array acknowledgement_batches: 1 entry
        "000000000000000a",      #       int64 first_offset = 10
        "000000000000000b",      #       int64 last_offset = 11
        "03 02 03",              #       compact array acknowledge_types = [2, 3] (release, reject)
        "00 00 00",              #       AcknowledgementBatch, AcknowledgePartition, topic: no tags
        "00",                    # no tagged fields
    ])
    _check_golden("request", 79, 0, data, {
        "group_id": "g1", "member_id": "m", "share_session_epoch": 1,
        "topics": [{"topic_id": TOPIC, "partitions": [{
            "partition_index": 0,
            "acknowledgement_batches": [
                {"first_offset": 10, "last_offset": 11, "acknowledge_types": [2, 3]}],
        }]}],
    })


def test_share_acknowledge_v0_response():
    data = _hex([
        "00000000",              # int32 throttle_time_ms = 0
        "0000",                  # int16 error_code = 0
        "00",                    # compact nullable string error_message = null
        "02",                    # compact array responses: 1 entry
        TOPIC_HEX,               #   uuid topic_id
        "02",                    #   compact array partitions: 1 entry
        "00000000",              #     int32 partition_index = 0
        "0079",                  #     int16 error_code = 121 (INVALID_RECORD_STATE)
        "04 626164",             #     compact nullable string error_message = "bad"
        "00000002 00000007 00",  #     current_leader: leader_id = 2, leader_epoch = 7, no tags
        "00 00",                 #     PartitionData, topic: no tagged fields
        "01",                    # compact array node_endpoints: empty
        "00",                    # no tagged fields
    ])
    _check_golden("response", 79, 0, data, {
        "throttle_time_ms": 0, "error_code": 0, "error_message": None,
        "responses": [{"topic_id": TOPIC, "partitions": [{
            "partition_index": 0, "error_code": 121, "error_message": "bad",
            "current_leader": {"leader_id": 2, "leader_epoch": 7},
        }]}],
        "node_endpoints": [],
    })


# --- v0 == v1 where 4.1 only bumped the number: kio's v1 bytes must read as kproxy's v0 ------------

SAME_LAYOUT = [
    pytest.param(name, key, kind, id=f"{name}-{kind}")
    for name, key in (("share_group_heartbeat", 76), ("share_group_describe", 77),
                      ("share_acknowledge", 79))
    for kind in ("request", "response")
]


@pytest.mark.parametrize(("name", "key", "kind"), SAME_LAYOUT)
def test_early_access_v0_reads_kio_v1_bytes(name, key, kind):
    cls = kio_class(name, 1, kind)
    codec = _body_codec(kind, key, 0)

    @settings(max_examples=30, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(kio_strategy(cls))
    def check(entity):
        buf = io.BytesIO()
        try:
            entity_writer(cls)(buf, entity)
            data = buf.getvalue()
            again, _ = entity_reader(cls)(data, 0)
        except (ValueError, OverflowError, TypeError):
            assume(False)
        obj, pos = codec.decode_checked(memoryview(data), 0, len(data))
        assert pos == len(data)
        assert obj.to_dict(0) == to_plain(again)
        assert _encode(codec, obj) == data

    check()

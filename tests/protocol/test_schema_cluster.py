"""Wire checks for the cluster group: ZooKeeper-era inter-broker APIs and KRaft quorum/controller APIs.

The versions kio (Kafka 4.x) does not know -- LeaderAndIsr, StopReplica, UpdateMetadata and
ControlledShutdown (all removed in Kafka 4.0) and AlterPartition v0-1 -- have no executable oracle
here, so each layout is pinned by a golden byte vector built by hand from Kafka 3.9's message
definitions, one comment per chunk. Two kio cross-checks that the shared bridge cannot express
(kio's ``id_`` rename, null ``[]uuid`` arrays) are repeated here with the right normalisation,
and Kafka's explicit defaults are compared with kio's for every version kio knows.
"""

from __future__ import annotations

import dataclasses
import datetime
import io
import typing
import uuid

import pytest
from hypothesis import HealthCheck, Phase, assume, given, settings
from kio.serial import entity_reader, entity_writer

from kproxy.protocol.compiler import encode_to, join_parts
from kproxy.protocol.messages import (
    api_by_name,
    decode_request,
    encode_request,
    request_codecs,
    response_codecs,
)

from .kio_bridge import _inner, _plain, kio_class, kio_strategy, kio_versions, kproxy_name
from .strategies import classes_of

TOPIC_ID = uuid.UUID("00112233-4455-6677-8899-aabbccddeeff")
TOPIC_ID_BYTES = bytes.fromhex("00112233445566778899aabbccddeeff")


def _encode(codec, obj) -> bytes:
    out: bytearray = bytearray()
    ins: list = []
    encode_to(codec, obj, out, ins)
    return bytes(join_parts(out, ins))


def _joined(parts) -> bytes:
    return bytes(parts) if isinstance(parts, bytearray | bytes) else b"".join(bytes(p) for p in parts)


# ---------------------------------------------------------------------------------------------
# LeaderAndIsr (api 4), Kafka 3.9: v0-7, flexible v4+.
# Partition state used below: partition 0, controller epoch 5, leader 1, leader epoch 7,
# isr [1, 2], partition epoch 9, replicas [1, 2], adding [3], removing [2], is_new true,
# leader recovery state 1. Each chunk is the part of LeaderAndIsrPartitionState a version adds.
# ---------------------------------------------------------------------------------------------

_LAI_STATE_HEAD = (
    b"\x00\x00\x00\x00"  # int32 partition_index = 0
    b"\x00\x00\x00\x05"  # int32 controller_epoch = 5
    b"\x00\x00\x00\x01"  # int32 leader = 1
    b"\x00\x00\x00\x07"  # int32 leader_epoch = 7
)
_LAI_STATE_MID_CLASSIC = (
    b"\x00\x00\x00\x02\x00\x00\x00\x01\x00\x00\x00\x02"  # int32 count 2, isr = [1, 2]
    b"\x00\x00\x00\x09"  # int32 partition_epoch = 9
    b"\x00\x00\x00\x02\x00\x00\x00\x01\x00\x00\x00\x02"  # int32 count 2, replicas = [1, 2]
)
_LAI_STATE_MID_COMPACT = (
    b"\x03\x00\x00\x00\x01\x00\x00\x00\x02"  # uvarint count+1 = 3, isr = [1, 2]
    b"\x00\x00\x00\x09"  # int32 partition_epoch = 9
    b"\x03\x00\x00\x00\x01\x00\x00\x00\x02"  # uvarint count+1 = 3, replicas = [1, 2]
)
_LAI_ADDING_REMOVING_CLASSIC = (
    b"\x00\x00\x00\x01\x00\x00\x00\x03"  # int32 count 1, adding_replicas = [3]
    b"\x00\x00\x00\x01\x00\x00\x00\x02"  # int32 count 1, removing_replicas = [2]
)
_LAI_ADDING_REMOVING_COMPACT = (
    b"\x02\x00\x00\x00\x03"  # uvarint count+1 = 2, adding_replicas = [3]
    b"\x02\x00\x00\x00\x02"  # uvarint count+1 = 2, removing_replicas = [2]
)
_LIVE_LEADER_CLASSIC = (
    b"\x00\x00\x00\x01"  # int32 count 1, live_leaders
    b"\x00\x00\x00\x01"  # int32 broker_id = 1
    b"\x00\x01h"  # int16 length 1, host_name = "h"
    b"\x00\x00\x23\x84"  # int32 port = 9092
)
_LIVE_LEADER_COMPACT = (
    b"\x02"  # uvarint count+1 = 2, live_leaders
    b"\x00\x00\x00\x01"  # int32 broker_id = 1
    b"\x02h"  # uvarint length+1 = 2, host_name = "h"
    b"\x00\x00\x23\x84"  # int32 port = 9092
    b"\x00"  # tagged fields: none
)


def _lai_state(version: int, *, with_topic: bool) -> dict:
    d: dict = {}
    if with_topic:
        d["topic_name"] = "t"
    d.update(partition_index=0, controller_epoch=5, leader=1, leader_epoch=7, isr=[1, 2],
             partition_epoch=9, replicas=[1, 2])
    if version >= 3:
        d.update(adding_replicas=[3], removing_replicas=[2])
    if version >= 1:
        d["is_new"] = True
    if version >= 6:
        d["leader_recovery_state"] = 1
    return d


def _lai_request(version: int) -> dict:
    d: dict = {"controller_id": 1}
    if version >= 7:
        d["is_k_raft_controller"] = True
    d["controller_epoch"] = 5
    if version >= 2:
        d["broker_epoch"] = 100
    if version >= 5:
        d["type"] = 1
    if version <= 1:
        d["ungrouped_partition_states"] = [_lai_state(version, with_topic=True)]
    else:
        topic = {"topic_name": "t"}
        if version >= 5:
            topic["topic_id"] = TOPIC_ID
        topic["partition_states"] = [_lai_state(version, with_topic=False)]
        d["topic_states"] = [topic]
    d["live_leaders"] = [{"broker_id": 1, "host_name": "h", "port": 9092}]
    return d


LAI_REQ_V0 = (
    b"\x00\x00\x00\x01"  # int32 controller_id = 1
    b"\x00\x00\x00\x05"  # int32 controller_epoch = 5
    b"\x00\x00\x00\x01"  # int32 count 1, ungrouped_partition_states
    b"\x00\x01t"  # int16 length 1, topic_name = "t" (v0-1 only)
    + _LAI_STATE_HEAD + _LAI_STATE_MID_CLASSIC
    + _LIVE_LEADER_CLASSIC
)
LAI_REQ_V1 = (
    b"\x00\x00\x00\x01"  # int32 controller_id = 1
    b"\x00\x00\x00\x05"  # int32 controller_epoch = 5
    b"\x00\x00\x00\x01"  # int32 count 1, ungrouped_partition_states
    b"\x00\x01t"  # int16 length 1, topic_name = "t"
    + _LAI_STATE_HEAD + _LAI_STATE_MID_CLASSIC
    + b"\x01"  # bool is_new = true (v1+)
    + _LIVE_LEADER_CLASSIC
)
LAI_REQ_V2 = (
    b"\x00\x00\x00\x01"  # int32 controller_id = 1
    b"\x00\x00\x00\x05"  # int32 controller_epoch = 5
    b"\x00\x00\x00\x00\x00\x00\x00\x64"  # int64 broker_epoch = 100 (v2+)
    b"\x00\x00\x00\x01"  # int32 count 1, topic_states (v2+ group partitions by topic)
    b"\x00\x01t"  # int16 length 1, topic_name = "t"
    b"\x00\x00\x00\x01"  # int32 count 1, partition_states (no topic_name from v2)
    + _LAI_STATE_HEAD + _LAI_STATE_MID_CLASSIC
    + b"\x01"  # bool is_new = true
    + _LIVE_LEADER_CLASSIC
)
LAI_REQ_V3 = (
    b"\x00\x00\x00\x01"  # int32 controller_id = 1
    b"\x00\x00\x00\x05"  # int32 controller_epoch = 5
    b"\x00\x00\x00\x00\x00\x00\x00\x64"  # int64 broker_epoch = 100
    b"\x00\x00\x00\x01"  # int32 count 1, topic_states
    b"\x00\x01t"  # int16 length 1, topic_name = "t"
    b"\x00\x00\x00\x01"  # int32 count 1, partition_states
    + _LAI_STATE_HEAD + _LAI_STATE_MID_CLASSIC
    + _LAI_ADDING_REMOVING_CLASSIC  # v3+
    + b"\x01"  # bool is_new = true
    + _LIVE_LEADER_CLASSIC
)
LAI_REQ_V4 = (
    b"\x00\x00\x00\x01"  # int32 controller_id = 1
    b"\x00\x00\x00\x05"  # int32 controller_epoch = 5
    b"\x00\x00\x00\x00\x00\x00\x00\x64"  # int64 broker_epoch = 100
    b"\x02"  # uvarint count+1 = 2, topic_states (v4 is the first flexible version)
    b"\x02t"  # uvarint length+1 = 2, topic_name = "t"
    b"\x02"  # uvarint count+1 = 2, partition_states
    + _LAI_STATE_HEAD + _LAI_STATE_MID_COMPACT
    + _LAI_ADDING_REMOVING_COMPACT
    + b"\x01"  # bool is_new = true
    b"\x00"  # partition state tagged fields: none
    b"\x00"  # topic state tagged fields: none
    + _LIVE_LEADER_COMPACT
    + b"\x00"  # request tagged fields: none
)
LAI_REQ_V5 = (
    b"\x00\x00\x00\x01"  # int32 controller_id = 1
    b"\x00\x00\x00\x05"  # int32 controller_epoch = 5
    b"\x00\x00\x00\x00\x00\x00\x00\x64"  # int64 broker_epoch = 100
    b"\x01"  # int8 type = 1 (v5+)
    b"\x02"  # uvarint count+1 = 2, topic_states
    b"\x02t"  # uvarint length+1 = 2, topic_name = "t"
    + TOPIC_ID_BYTES  # uuid topic_id (v5+)
    + b"\x02"  # uvarint count+1 = 2, partition_states
    + _LAI_STATE_HEAD + _LAI_STATE_MID_COMPACT
    + _LAI_ADDING_REMOVING_COMPACT
    + b"\x01"  # bool is_new = true
    b"\x00"  # partition state tagged fields: none
    b"\x00"  # topic state tagged fields: none
    + _LIVE_LEADER_COMPACT
    + b"\x00"  # request tagged fields: none
)
LAI_REQ_V6 = (
    b"\x00\x00\x00\x01"  # int32 controller_id = 1
    b"\x00\x00\x00\x05"  # int32 controller_epoch = 5
    b"\x00\x00\x00\x00\x00\x00\x00\x64"  # int64 broker_epoch = 100
    b"\x01"  # int8 type = 1
    b"\x02"  # uvarint count+1 = 2, topic_states
    b"\x02t"  # uvarint length+1 = 2, topic_name = "t"
    + TOPIC_ID_BYTES  # uuid topic_id
    + b"\x02"  # uvarint count+1 = 2, partition_states
    + _LAI_STATE_HEAD + _LAI_STATE_MID_COMPACT
    + _LAI_ADDING_REMOVING_COMPACT
    + b"\x01"  # bool is_new = true
    b"\x01"  # int8 leader_recovery_state = 1 (v6+)
    b"\x00"  # partition state tagged fields: none
    b"\x00"  # topic state tagged fields: none
    + _LIVE_LEADER_COMPACT
    + b"\x00"  # request tagged fields: none
)
LAI_REQ_V7 = (
    b"\x00\x00\x00\x01"  # int32 controller_id = 1
    b"\x01"  # bool is_k_raft_controller = true (v7+, between controller id and epoch)
    b"\x00\x00\x00\x05"  # int32 controller_epoch = 5
    b"\x00\x00\x00\x00\x00\x00\x00\x64"  # int64 broker_epoch = 100
    b"\x01"  # int8 type = 1
    b"\x02"  # uvarint count+1 = 2, topic_states
    b"\x02t"  # uvarint length+1 = 2, topic_name = "t"
    + TOPIC_ID_BYTES  # uuid topic_id
    + b"\x02"  # uvarint count+1 = 2, partition_states
    + _LAI_STATE_HEAD + _LAI_STATE_MID_COMPACT
    + _LAI_ADDING_REMOVING_COMPACT
    + b"\x01"  # bool is_new = true
    b"\x01"  # int8 leader_recovery_state = 1
    b"\x00"  # partition state tagged fields: none
    b"\x00"  # topic state tagged fields: none
    + _LIVE_LEADER_COMPACT
    + b"\x00"  # request tagged fields: none
)

LAI_RESP_V0 = (
    b"\x00\x00"  # int16 error_code = 0
    b"\x00\x00\x00\x01"  # int32 count 1, partition_errors
    b"\x00\x01t"  # int16 length 1, topic_name = "t"
    b"\x00\x00\x00\x00"  # int32 partition_index = 0
    b"\x00\x06"  # int16 error_code = 6 (NOT_LEADER_OR_FOLLOWER)
)
LAI_RESP_V4 = (
    b"\x00\x00"  # int16 error_code = 0
    b"\x02"  # uvarint count+1 = 2, partition_errors
    b"\x02t"  # uvarint length+1 = 2, topic_name = "t"
    b"\x00\x00\x00\x00"  # int32 partition_index = 0
    b"\x00\x06"  # int16 error_code = 6
    b"\x00"  # partition error tagged fields: none
    b"\x00"  # response tagged fields: none
)
LAI_RESP_V5 = (
    b"\x00\x00"  # int16 error_code = 0
    b"\x02"  # uvarint count+1 = 2, topics (v5+: by topic id, no topic name)
    + TOPIC_ID_BYTES  # uuid topic_id
    + b"\x02"  # uvarint count+1 = 2, partition_errors
    b"\x00\x00\x00\x00"  # int32 partition_index = 0
    b"\x00\x06"  # int16 error_code = 6
    b"\x00"  # partition error tagged fields: none
    b"\x00"  # topic tagged fields: none
    b"\x00"  # response tagged fields: none
)
_LAI_RESP_OLD = {"error_code": 0,
                 "partition_errors": [{"topic_name": "t", "partition_index": 0, "error_code": 6}]}
_LAI_RESP_NEW = {"error_code": 0, "topics": [
    {"topic_id": TOPIC_ID, "partition_errors": [{"partition_index": 0, "error_code": 6}]}]}

# ---------------------------------------------------------------------------------------------
# StopReplica (api 5), Kafka 3.9: v0-4, flexible v2+.
# ---------------------------------------------------------------------------------------------

SR_REQ_V0 = (
    b"\x00\x00\x00\x01"  # int32 controller_id = 1
    b"\x00\x00\x00\x05"  # int32 controller_epoch = 5
    b"\x01"  # bool delete_partitions = true (v0-2)
    b"\x00\x00\x00\x01"  # int32 count 1, ungrouped_partitions (v0)
    b"\x00\x01t"  # int16 length 1, topic_name = "t"
    b"\x00\x00\x00\x00"  # int32 partition_index = 0
)
SR_REQ_V1 = (
    b"\x00\x00\x00\x01"  # int32 controller_id = 1
    b"\x00\x00\x00\x05"  # int32 controller_epoch = 5
    b"\x00\x00\x00\x00\x00\x00\x00\x64"  # int64 broker_epoch = 100 (v1+)
    b"\x01"  # bool delete_partitions = true
    b"\x00\x00\x00\x01"  # int32 count 1, topics (v1-2)
    b"\x00\x01t"  # int16 length 1, name = "t"
    b"\x00\x00\x00\x02\x00\x00\x00\x00\x00\x00\x00\x01"  # int32 count 2, partition_indexes = [0, 1]
)
SR_REQ_V2 = (
    b"\x00\x00\x00\x01"  # int32 controller_id = 1
    b"\x00\x00\x00\x05"  # int32 controller_epoch = 5
    b"\x00\x00\x00\x00\x00\x00\x00\x64"  # int64 broker_epoch = 100
    b"\x01"  # bool delete_partitions = true
    b"\x02"  # uvarint count+1 = 2, topics (v2 is the first flexible version)
    b"\x02t"  # uvarint length+1 = 2, name = "t"
    b"\x03\x00\x00\x00\x00\x00\x00\x00\x01"  # uvarint count+1 = 3, partition_indexes = [0, 1]
    b"\x00"  # topic tagged fields: none
    b"\x00"  # request tagged fields: none
)
SR_REQ_V3 = (
    b"\x00\x00\x00\x01"  # int32 controller_id = 1
    b"\x00\x00\x00\x05"  # int32 controller_epoch = 5
    b"\x00\x00\x00\x00\x00\x00\x00\x64"  # int64 broker_epoch = 100
    b"\x02"  # uvarint count+1 = 2, topic_states (v3+, replaces delete_partitions and topics)
    b"\x02t"  # uvarint length+1 = 2, topic_name = "t"
    b"\x02"  # uvarint count+1 = 2, partition_states
    b"\x00\x00\x00\x00"  # int32 partition_index = 0
    b"\x00\x00\x00\x07"  # int32 leader_epoch = 7
    b"\x01"  # bool delete_partition = true
    b"\x00"  # partition state tagged fields: none
    b"\x00"  # topic state tagged fields: none
    b"\x00"  # request tagged fields: none
)
SR_REQ_V4 = (
    b"\x00\x00\x00\x01"  # int32 controller_id = 1
    b"\x01"  # bool is_k_raft_controller = true (v4+)
    b"\x00\x00\x00\x05"  # int32 controller_epoch = 5
    b"\x00\x00\x00\x00\x00\x00\x00\x64"  # int64 broker_epoch = 100
    b"\x02"  # uvarint count+1 = 2, topic_states
    b"\x02t"  # uvarint length+1 = 2, topic_name = "t"
    b"\x02"  # uvarint count+1 = 2, partition_states
    b"\x00\x00\x00\x00"  # int32 partition_index = 0
    b"\x00\x00\x00\x07"  # int32 leader_epoch = 7
    b"\x01"  # bool delete_partition = true
    b"\x00"  # partition state tagged fields: none
    b"\x00"  # topic state tagged fields: none
    b"\x00"  # request tagged fields: none
)
_SR_STATES = [{"topic_name": "t", "partition_states": [
    {"partition_index": 0, "leader_epoch": 7, "delete_partition": True}]}]

SR_RESP_V0 = (
    b"\x00\x00"  # int16 error_code = 0
    b"\x00\x00\x00\x01"  # int32 count 1, partition_errors
    b"\x00\x01t"  # int16 length 1, topic_name = "t"
    b"\x00\x00\x00\x00"  # int32 partition_index = 0
    b"\x00\x03"  # int16 error_code = 3 (UNKNOWN_TOPIC_OR_PARTITION)
)
SR_RESP_V2 = (
    b"\x00\x00"  # int16 error_code = 0
    b"\x02"  # uvarint count+1 = 2, partition_errors
    b"\x02t"  # uvarint length+1 = 2, topic_name = "t"
    b"\x00\x00\x00\x00"  # int32 partition_index = 0
    b"\x00\x03"  # int16 error_code = 3
    b"\x00"  # partition error tagged fields: none
    b"\x00"  # response tagged fields: none
)
_SR_RESP = {"error_code": 0,
            "partition_errors": [{"topic_name": "t", "partition_index": 0, "error_code": 3}]}

# ---------------------------------------------------------------------------------------------
# UpdateMetadata (api 6), Kafka 3.9: v0-8, flexible v6+.
# Partition state: partition 0, controller epoch 5, leader 1, leader epoch 7, isr [1],
# zk version 9, replicas [1, 2], offline replicas [2] (v4+).
# ---------------------------------------------------------------------------------------------

_UM_STATE_CLASSIC = (
    b"\x00\x00\x00\x00"  # int32 partition_index = 0
    b"\x00\x00\x00\x05"  # int32 controller_epoch = 5
    b"\x00\x00\x00\x01"  # int32 leader = 1
    b"\x00\x00\x00\x07"  # int32 leader_epoch = 7
    b"\x00\x00\x00\x01\x00\x00\x00\x01"  # int32 count 1, isr = [1]
    b"\x00\x00\x00\x09"  # int32 zk_version = 9
    b"\x00\x00\x00\x02\x00\x00\x00\x01\x00\x00\x00\x02"  # int32 count 2, replicas = [1, 2]
)
_UM_OFFLINE_CLASSIC = b"\x00\x00\x00\x01\x00\x00\x00\x02"  # int32 count 1, offline_replicas = [2]
_UM_STATE_COMPACT = (
    b"\x00\x00\x00\x00"  # int32 partition_index = 0
    b"\x00\x00\x00\x05"  # int32 controller_epoch = 5
    b"\x00\x00\x00\x01"  # int32 leader = 1
    b"\x00\x00\x00\x07"  # int32 leader_epoch = 7
    b"\x02\x00\x00\x00\x01"  # uvarint count+1 = 2, isr = [1]
    b"\x00\x00\x00\x09"  # int32 zk_version = 9
    b"\x03\x00\x00\x00\x01\x00\x00\x00\x02"  # uvarint count+1 = 3, replicas = [1, 2]
    b"\x02\x00\x00\x00\x02"  # uvarint count+1 = 2, offline_replicas = [2]
    b"\x00"  # partition state tagged fields: none
)
_UM_UNGROUPED_HEAD = (
    b"\x00\x00\x00\x01"  # int32 count 1, ungrouped_partition_states (v0-4)
    b"\x00\x01t"  # int16 length 1, topic_name = "t"
)
_UM_BROKER_V1_HEAD = (
    b"\x00\x00\x00\x01"  # int32 count 1, live_brokers
    b"\x00\x00\x00\x01"  # int32 id = 1
    b"\x00\x00\x00\x01"  # int32 count 1, endpoints (v1+)
    b"\x00\x00\x23\x84"  # int32 port = 9092
    b"\x00\x01h"  # int16 length 1, host = "h"
)


def _um_state(version: int) -> dict:
    d: dict = {}
    if version <= 4:
        d["topic_name"] = "t"
    d.update(partition_index=0, controller_epoch=5, leader=1, leader_epoch=7, isr=[1],
             zk_version=9, replicas=[1, 2])
    if version >= 4:
        d["offline_replicas"] = [2]
    return d


def _um_request(version: int) -> dict:
    d: dict = {"controller_id": 1}
    if version >= 8:
        d.update(is_k_raft_controller=True, type=2)
    d["controller_epoch"] = 5
    if version >= 5:
        d["broker_epoch"] = 100
        topic: dict = {"topic_name": "t"}
        if version >= 7:
            topic["topic_id"] = TOPIC_ID
        topic["partition_states"] = [_um_state(version)]
        d["topic_states"] = [topic]
    else:
        d["ungrouped_partition_states"] = [_um_state(version)]
    broker: dict = {"id": 1}
    if version == 0:
        broker.update(v0_host="h", v0_port=9092)
    else:
        endpoint: dict = {"port": 9092, "host": "h"}
        if version >= 3:
            endpoint["listener"] = "L"
        endpoint["security_protocol"] = 0
        broker["endpoints"] = [endpoint]
    if version >= 2:
        broker["rack"] = "r" if version <= 5 else None
    d["live_brokers"] = [broker]
    return d


UM_REQ_V0 = (
    b"\x00\x00\x00\x01"  # int32 controller_id = 1
    b"\x00\x00\x00\x05"  # int32 controller_epoch = 5
    + _UM_UNGROUPED_HEAD + _UM_STATE_CLASSIC
    + b"\x00\x00\x00\x01"  # int32 count 1, live_brokers
    b"\x00\x00\x00\x01"  # int32 id = 1
    b"\x00\x01h"  # int16 length 1, v0_host = "h" (v0 only)
    b"\x00\x00\x23\x84"  # int32 v0_port = 9092 (v0 only)
)
UM_REQ_V1 = (
    b"\x00\x00\x00\x01"  # int32 controller_id = 1
    b"\x00\x00\x00\x05"  # int32 controller_epoch = 5
    + _UM_UNGROUPED_HEAD + _UM_STATE_CLASSIC
    + _UM_BROKER_V1_HEAD
    + b"\x00\x00"  # int16 security_protocol = 0 (PLAINTEXT)
)
UM_REQ_V2 = (
    b"\x00\x00\x00\x01"  # int32 controller_id = 1
    b"\x00\x00\x00\x05"  # int32 controller_epoch = 5
    + _UM_UNGROUPED_HEAD + _UM_STATE_CLASSIC
    + _UM_BROKER_V1_HEAD
    + b"\x00\x00"  # int16 security_protocol = 0
    b"\x00\x01r"  # int16 length 1, rack = "r" (v2+)
)
UM_REQ_V3 = (
    b"\x00\x00\x00\x01"  # int32 controller_id = 1
    b"\x00\x00\x00\x05"  # int32 controller_epoch = 5
    + _UM_UNGROUPED_HEAD + _UM_STATE_CLASSIC
    + _UM_BROKER_V1_HEAD
    + b"\x00\x01L"  # int16 length 1, listener = "L" (v3+)
    b"\x00\x00"  # int16 security_protocol = 0
    b"\x00\x01r"  # int16 length 1, rack = "r"
)
UM_REQ_V4 = (
    b"\x00\x00\x00\x01"  # int32 controller_id = 1
    b"\x00\x00\x00\x05"  # int32 controller_epoch = 5
    + _UM_UNGROUPED_HEAD + _UM_STATE_CLASSIC
    + _UM_OFFLINE_CLASSIC  # v4+
    + _UM_BROKER_V1_HEAD
    + b"\x00\x01L"  # int16 length 1, listener = "L"
    b"\x00\x00"  # int16 security_protocol = 0
    b"\x00\x01r"  # int16 length 1, rack = "r"
)
UM_REQ_V5 = (
    b"\x00\x00\x00\x01"  # int32 controller_id = 1
    b"\x00\x00\x00\x05"  # int32 controller_epoch = 5
    b"\x00\x00\x00\x00\x00\x00\x00\x64"  # int64 broker_epoch = 100 (v5+)
    b"\x00\x00\x00\x01"  # int32 count 1, topic_states (v5+ group partitions by topic)
    b"\x00\x01t"  # int16 length 1, topic_name = "t"
    b"\x00\x00\x00\x01"  # int32 count 1, partition_states (no topic_name from v5)
    + _UM_STATE_CLASSIC + _UM_OFFLINE_CLASSIC
    + _UM_BROKER_V1_HEAD
    + b"\x00\x01L"  # int16 length 1, listener = "L"
    b"\x00\x00"  # int16 security_protocol = 0
    b"\x00\x01r"  # int16 length 1, rack = "r"
)
UM_REQ_V6 = (
    b"\x00\x00\x00\x01"  # int32 controller_id = 1
    b"\x00\x00\x00\x05"  # int32 controller_epoch = 5
    b"\x00\x00\x00\x00\x00\x00\x00\x64"  # int64 broker_epoch = 100
    b"\x02"  # uvarint count+1 = 2, topic_states (v6 is the first flexible version)
    b"\x02t"  # uvarint length+1 = 2, topic_name = "t"
    b"\x02"  # uvarint count+1 = 2, partition_states
    + _UM_STATE_COMPACT
    + b"\x00"  # topic state tagged fields: none
    b"\x02"  # uvarint count+1 = 2, live_brokers
    b"\x00\x00\x00\x01"  # int32 id = 1
    b"\x02"  # uvarint count+1 = 2, endpoints
    b"\x00\x00\x23\x84"  # int32 port = 9092
    b"\x02h"  # uvarint length+1 = 2, host = "h"
    b"\x02L"  # uvarint length+1 = 2, listener = "L"
    b"\x00\x00"  # int16 security_protocol = 0
    b"\x00"  # endpoint tagged fields: none
    b"\x00"  # uvarint 0, rack = null
    b"\x00"  # broker tagged fields: none
    b"\x00"  # request tagged fields: none
)
UM_REQ_V7 = (
    b"\x00\x00\x00\x01"  # int32 controller_id = 1
    b"\x00\x00\x00\x05"  # int32 controller_epoch = 5
    b"\x00\x00\x00\x00\x00\x00\x00\x64"  # int64 broker_epoch = 100
    b"\x02"  # uvarint count+1 = 2, topic_states
    b"\x02t"  # uvarint length+1 = 2, topic_name = "t"
    + TOPIC_ID_BYTES  # uuid topic_id (v7+)
    + b"\x02"  # uvarint count+1 = 2, partition_states
    + _UM_STATE_COMPACT
    + b"\x00"  # topic state tagged fields: none
    b"\x02"  # uvarint count+1 = 2, live_brokers
    b"\x00\x00\x00\x01"  # int32 id = 1
    b"\x02"  # uvarint count+1 = 2, endpoints
    b"\x00\x00\x23\x84"  # int32 port = 9092
    b"\x02h"  # uvarint length+1 = 2, host = "h"
    b"\x02L"  # uvarint length+1 = 2, listener = "L"
    b"\x00\x00"  # int16 security_protocol = 0
    b"\x00"  # endpoint tagged fields: none
    b"\x00"  # uvarint 0, rack = null
    b"\x00"  # broker tagged fields: none
    b"\x00"  # request tagged fields: none
)
UM_REQ_V8 = (
    b"\x00\x00\x00\x01"  # int32 controller_id = 1
    b"\x01"  # bool is_k_raft_controller = true (v8+)
    b"\x00\x00\x00\x05"  # int32 controller_epoch = 5
    b"\x00\x00\x00\x00\x00\x00\x00\x64"  # int64 broker_epoch = 100
    b"\x02"  # uvarint count+1 = 2, topic_states
    b"\x02t"  # uvarint length+1 = 2, topic_name = "t"
    + TOPIC_ID_BYTES  # uuid topic_id
    + b"\x02"  # uvarint count+1 = 2, partition_states
    + _UM_STATE_COMPACT
    + b"\x00"  # topic state tagged fields: none
    b"\x02"  # uvarint count+1 = 2, live_brokers
    b"\x00\x00\x00\x01"  # int32 id = 1
    b"\x02"  # uvarint count+1 = 2, endpoints
    b"\x00\x00\x23\x84"  # int32 port = 9092
    b"\x02h"  # uvarint length+1 = 2, host = "h"
    b"\x02L"  # uvarint length+1 = 2, listener = "L"
    b"\x00\x00"  # int16 security_protocol = 0
    b"\x00"  # endpoint tagged fields: none
    b"\x00"  # uvarint 0, rack = null
    b"\x00"  # broker tagged fields: none
    b"\x01"  # request tagged fields: 1 field
    b"\x00\x01\x02"  # tag 0, size 1: int8 type = 2 (full snapshot, KIP-866)
)

UM_RESP_V0 = b"\x00\x00"  # int16 error_code = 0
UM_RESP_V6 = (
    b"\x00\x00"  # int16 error_code = 0
    b"\x00"  # response tagged fields: none
)

# ---------------------------------------------------------------------------------------------
# ControlledShutdown (api 7), Kafka 3.9: v0-3, flexible v3+. v0 requests use header v0.
# ---------------------------------------------------------------------------------------------

CS_FRAME_V0 = (
    b"\x00\x07"  # int16 request_api_key = 7
    b"\x00\x00"  # int16 request_api_version = 0
    b"\x00\x00\x00\x2a"  # int32 correlation_id = 42 (header v0: no client_id)
    b"\x00\x00\x00\x01"  # int32 broker_id = 1
)
CS_FRAME_V1 = (
    b"\x00\x07"  # int16 request_api_key = 7
    b"\x00\x01"  # int16 request_api_version = 1
    b"\x00\x00\x00\x2a"  # int32 correlation_id = 42
    b"\x00\x01c"  # int16 length 1, client_id = "c" (header v1)
    b"\x00\x00\x00\x01"  # int32 broker_id = 1
)
CS_FRAME_V3 = (
    b"\x00\x07"  # int16 request_api_key = 7
    b"\x00\x03"  # int16 request_api_version = 3
    b"\x00\x00\x00\x2a"  # int32 correlation_id = 42
    b"\x00\x01c"  # int16 length 1, client_id = "c" (header v2 keeps the classic string)
    b"\x00"  # header tagged fields: none
    b"\x00\x00\x00\x01"  # int32 broker_id = 1
    b"\x00\x00\x00\x00\x00\x00\x00\x64"  # int64 broker_epoch = 100
    b"\x00"  # request tagged fields: none
)
CS_REQ_V2 = (
    b"\x00\x00\x00\x01"  # int32 broker_id = 1
    b"\x00\x00\x00\x00\x00\x00\x00\x64"  # int64 broker_epoch = 100 (v2+)
)
CS_RESP_V0 = (
    b"\x00\x00"  # int16 error_code = 0
    b"\x00\x00\x00\x01"  # int32 count 1, remaining_partitions
    b"\x00\x01t"  # int16 length 1, topic_name = "t"
    b"\x00\x00\x00\x00"  # int32 partition_index = 0
)
CS_RESP_V3 = (
    b"\x00\x00"  # int16 error_code = 0
    b"\x02"  # uvarint count+1 = 2, remaining_partitions
    b"\x02t"  # uvarint length+1 = 2, topic_name = "t"
    b"\x00\x00\x00\x00"  # int32 partition_index = 0
    b"\x00"  # remaining partition tagged fields: none
    b"\x00"  # response tagged fields: none
)
_CS_RESP = {"error_code": 0, "remaining_partitions": [{"topic_name": "t", "partition_index": 0}]}

# ---------------------------------------------------------------------------------------------
# AlterPartition (api 56) v0-1: in Kafka 3.9, removed in 4.0 (KIP-896). Flexible from v0.
# ---------------------------------------------------------------------------------------------

AP_REQ_V0 = (
    b"\x00\x00\x00\x01"  # int32 broker_id = 1
    b"\x00\x00\x00\x00\x00\x00\x00\x64"  # int64 broker_epoch = 100
    b"\x02"  # uvarint count+1 = 2, topics
    b"\x02t"  # uvarint length+1 = 2, topic_name = "t" (v0-1; v2+ send topic_id)
    b"\x02"  # uvarint count+1 = 2, partitions
    b"\x00\x00\x00\x00"  # int32 partition_index = 0
    b"\x00\x00\x00\x07"  # int32 leader_epoch = 7
    b"\x03\x00\x00\x00\x01\x00\x00\x00\x02"  # uvarint count+1 = 3, new_isr = [1, 2]
    b"\x00\x00\x00\x09"  # int32 partition_epoch = 9
    b"\x00"  # partition tagged fields: none
    b"\x00"  # topic tagged fields: none
    b"\x00"  # request tagged fields: none
)
AP_REQ_V1 = (
    b"\x00\x00\x00\x01"  # int32 broker_id = 1
    b"\x00\x00\x00\x00\x00\x00\x00\x64"  # int64 broker_epoch = 100
    b"\x02"  # uvarint count+1 = 2, topics
    b"\x02t"  # uvarint length+1 = 2, topic_name = "t"
    b"\x02"  # uvarint count+1 = 2, partitions
    b"\x00\x00\x00\x00"  # int32 partition_index = 0
    b"\x00\x00\x00\x07"  # int32 leader_epoch = 7
    b"\x03\x00\x00\x00\x01\x00\x00\x00\x02"  # uvarint count+1 = 3, new_isr = [1, 2]
    b"\x01"  # int8 leader_recovery_state = 1 (v1+)
    b"\x00\x00\x00\x09"  # int32 partition_epoch = 9
    b"\x00"  # partition tagged fields: none
    b"\x00"  # topic tagged fields: none
    b"\x00"  # request tagged fields: none
)
AP_RESP_V0 = (
    b"\x00\x00\x00\x00"  # int32 throttle_time_ms = 0
    b"\x00\x00"  # int16 error_code = 0
    b"\x02"  # uvarint count+1 = 2, topics
    b"\x02t"  # uvarint length+1 = 2, topic_name = "t"
    b"\x02"  # uvarint count+1 = 2, partitions
    b"\x00\x00\x00\x00"  # int32 partition_index = 0
    b"\x00\x00"  # int16 error_code = 0
    b"\x00\x00\x00\x01"  # int32 leader_id = 1
    b"\x00\x00\x00\x07"  # int32 leader_epoch = 7
    b"\x03\x00\x00\x00\x01\x00\x00\x00\x02"  # uvarint count+1 = 3, isr = [1, 2]
    b"\x00\x00\x00\x0a"  # int32 partition_epoch = 10
    b"\x00"  # partition tagged fields: none
    b"\x00"  # topic tagged fields: none
    b"\x00"  # response tagged fields: none
)
AP_RESP_V1 = (
    b"\x00\x00\x00\x00"  # int32 throttle_time_ms = 0
    b"\x00\x00"  # int16 error_code = 0
    b"\x02"  # uvarint count+1 = 2, topics
    b"\x02t"  # uvarint length+1 = 2, topic_name = "t"
    b"\x02"  # uvarint count+1 = 2, partitions
    b"\x00\x00\x00\x00"  # int32 partition_index = 0
    b"\x00\x00"  # int16 error_code = 0
    b"\x00\x00\x00\x01"  # int32 leader_id = 1
    b"\x00\x00\x00\x07"  # int32 leader_epoch = 7
    b"\x03\x00\x00\x00\x01\x00\x00\x00\x02"  # uvarint count+1 = 3, isr = [1, 2]
    b"\x01"  # int8 leader_recovery_state = 1 (v1+)
    b"\x00\x00\x00\x0a"  # int32 partition_epoch = 10
    b"\x00"  # partition tagged fields: none
    b"\x00"  # topic tagged fields: none
    b"\x00"  # response tagged fields: none
)


def _ap_request(version: int) -> dict:
    part: dict = {"partition_index": 0, "leader_epoch": 7, "new_isr": [1, 2]}
    if version >= 1:
        part["leader_recovery_state"] = 1
    part["partition_epoch"] = 9
    return {"broker_id": 1, "broker_epoch": 100,
            "topics": [{"topic_name": "t", "partitions": [part]}]}


def _ap_response(version: int) -> dict:
    part: dict = {"partition_index": 0, "error_code": 0, "leader_id": 1, "leader_epoch": 7,
                  "isr": [1, 2]}
    if version >= 1:
        part["leader_recovery_state"] = 1
    part["partition_epoch"] = 10
    return {"throttle_time_ms": 0, "error_code": 0,
            "topics": [{"topic_name": "t", "partitions": [part]}]}


GOLDEN = [
    *(pytest.param(4, "request", v, data, _lai_request(v), id=f"leader_and_isr-request-v{v}")
      for v, data in enumerate([LAI_REQ_V0, LAI_REQ_V1, LAI_REQ_V2, LAI_REQ_V3,
                                LAI_REQ_V4, LAI_REQ_V5, LAI_REQ_V6, LAI_REQ_V7])),
    *(pytest.param(4, "response", v, LAI_RESP_V0, _LAI_RESP_OLD, id=f"leader_and_isr-response-v{v}")
      for v in (0, 1, 2, 3)),
    pytest.param(4, "response", 4, LAI_RESP_V4, _LAI_RESP_OLD, id="leader_and_isr-response-v4"),
    *(pytest.param(4, "response", v, LAI_RESP_V5, _LAI_RESP_NEW, id=f"leader_and_isr-response-v{v}")
      for v in (5, 6, 7)),
    pytest.param(5, "request", 0, SR_REQ_V0, {
        "controller_id": 1, "controller_epoch": 5, "delete_partitions": True,
        "ungrouped_partitions": [{"topic_name": "t", "partition_index": 0}]},
        id="stop_replica-request-v0"),
    *(pytest.param(5, "request", v, data, {
        "controller_id": 1, "controller_epoch": 5, "broker_epoch": 100, "delete_partitions": True,
        "topics": [{"name": "t", "partition_indexes": [0, 1]}]}, id=f"stop_replica-request-v{v}")
      for v, data in ((1, SR_REQ_V1), (2, SR_REQ_V2))),
    pytest.param(5, "request", 3, SR_REQ_V3, {
        "controller_id": 1, "controller_epoch": 5, "broker_epoch": 100, "topic_states": _SR_STATES},
        id="stop_replica-request-v3"),
    pytest.param(5, "request", 4, SR_REQ_V4, {
        "controller_id": 1, "is_k_raft_controller": True, "controller_epoch": 5, "broker_epoch": 100,
        "topic_states": _SR_STATES}, id="stop_replica-request-v4"),
    *(pytest.param(5, "response", v, SR_RESP_V0 if v < 2 else SR_RESP_V2, _SR_RESP,
                   id=f"stop_replica-response-v{v}") for v in range(5)),
    *(pytest.param(6, "request", v, data, _um_request(v), id=f"update_metadata-request-v{v}")
      for v, data in enumerate([UM_REQ_V0, UM_REQ_V1, UM_REQ_V2, UM_REQ_V3, UM_REQ_V4,
                                UM_REQ_V5, UM_REQ_V6, UM_REQ_V7, UM_REQ_V8])),
    *(pytest.param(6, "response", v, UM_RESP_V0 if v < 6 else UM_RESP_V6, {"error_code": 0},
                   id=f"update_metadata-response-v{v}") for v in range(9)),
    pytest.param(7, "request", 2, CS_REQ_V2, {"broker_id": 1, "broker_epoch": 100},
                 id="controlled_shutdown-request-v2"),
    *(pytest.param(7, "response", v, CS_RESP_V0 if v < 3 else CS_RESP_V3, _CS_RESP,
                   id=f"controlled_shutdown-response-v{v}") for v in range(4)),
    pytest.param(56, "request", 0, AP_REQ_V0, _ap_request(0), id="alter_partition-request-v0"),
    pytest.param(56, "request", 1, AP_REQ_V1, _ap_request(1), id="alter_partition-request-v1"),
    pytest.param(56, "response", 0, AP_RESP_V0, _ap_response(0), id="alter_partition-response-v0"),
    pytest.param(56, "response", 1, AP_RESP_V1, _ap_response(1), id="alter_partition-response-v1"),
]


@pytest.mark.parametrize(("key", "kind", "version", "data", "expected"), GOLDEN)
def test_golden_vector(key, kind, version, data, expected):
    _, codec = (request_codecs if kind == "request" else response_codecs)(key, version)
    obj, pos = codec.decode_checked(memoryview(data), 0, len(data))
    assert pos == len(data)
    assert obj.to_dict(version) == expected
    assert _encode(codec, obj) == data


@pytest.mark.parametrize(("frame", "version", "header_version", "client_id", "body"), [
    pytest.param(CS_FRAME_V0, 0, 0, None, {"broker_id": 1}, id="v0-header-v0"),
    pytest.param(CS_FRAME_V1, 1, 1, "c", {"broker_id": 1}, id="v1-header-v1"),
    pytest.param(CS_FRAME_V3, 3, 2, "c", {"broker_id": 1, "broker_epoch": 100}, id="v3-header-v2"),
])
def test_controlled_shutdown_frames(frame, version, header_version, client_id, body):
    req = decode_request(frame)
    header = {"request_api_key": 7, "request_api_version": version, "correlation_id": 42}
    if client_id is not None:
        header["client_id"] = client_id
    assert req.header.to_dict(header_version) == header
    assert req.body.to_dict(version) == body
    assert _joined(encode_request(req)) == frame


def test_version_ranges():
    """Kafka 3.9 or 4.x, whichever reaches further (4.0 dropped the ZooKeeper APIs and
    AlterPartition v0-1; kio has the 4.x ranges, these pin the rest)."""
    expected = {
        "leader_and_isr": (0, 7, 4), "stop_replica": (0, 4, 2), "update_metadata": (0, 8, 6),
        "controlled_shutdown": (0, 3, 3), "vote": (0, 2, 0), "begin_quorum_epoch": (0, 1, 1),
        "end_quorum_epoch": (0, 1, 1), "describe_quorum": (0, 2, 0), "alter_partition": (0, 3, 0),
        "envelope": (0, 0, 0), "fetch_snapshot": (0, 1, 0), "broker_registration": (0, 4, 0),
        "broker_heartbeat": (0, 2, 0), "unregister_broker": (0, 0, 0),
        "allocate_producer_ids": (0, 0, 0), "controller_registration": (0, 0, 0),
        "assign_replicas_to_dirs": (0, 0, 0), "add_raft_voter": (0, 1, 0),
        "remove_raft_voter": (0, 0, 0), "update_raft_voter": (0, 0, 0),
    }
    for name, (lo, hi, flex) in expected.items():
        api = api_by_name(name)
        for msg in (api.request, api.response):
            assert (msg.versions.lo, msg.versions.hi) == (lo, hi), name
            assert [v for v in range(lo, hi + 1) if v in msg.flexible] == list(range(flex, hi + 1)), name


# ---------------------------------------------------------------------------------------------
# kio cross-checks the shared bridge cannot express: kio renames Kafka's ``Id`` to ``id_``, and
# its bridge maps every None of a uuid-typed field to the zero UUID, which is wrong for a null
# ``[]uuid`` array (BrokerHeartbeat v2 cordoned_log_dirs).
# ---------------------------------------------------------------------------------------------


def _kio_plain(entity: object) -> dict:
    out = {}
    hints = typing.get_type_hints(type(entity))
    for f in dataclasses.fields(entity):  # type: ignore[arg-type]
        v = getattr(entity, f.name)
        _, array, _ = _inner(hints[f.name])
        if v is None and f.metadata.get("kafka_type") == "uuid" and not array:
            v = uuid.UUID(int=0)  # kio shows the zero UUID as None
        if dataclasses.is_dataclass(v):
            v = _kio_plain(v)
        elif isinstance(v, tuple):
            v = [_kio_plain(x) if dataclasses.is_dataclass(x) else _plain(x) for x in v]
        else:
            v = _plain(v)
        out[kproxy_name(f).removesuffix("_")] = v
    return out


@pytest.mark.parametrize(("name", "kind", "v"), [
    ("assign_replicas_to_dirs", "request", 0),
    ("assign_replicas_to_dirs", "response", 0),
    ("broker_heartbeat", "request", 2),
])
def test_kio_agrees_normalised(name, kind, v):
    cls = kio_class(name, v, kind)
    codec = (request_codecs if kind == "request" else response_codecs)(api_by_name(name).key, v)[1]

    @settings(max_examples=60, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
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
        assert obj.to_dict(v) == _kio_plain(again)
        ours = _encode(codec, obj)
        assert ours == data
        theirs, size = entity_reader(cls)(ours, 0)
        assert size == len(ours)
        assert theirs == again

    check()


@pytest.mark.parametrize(("dirs", "tagged"), [
    pytest.param(None, b"\x00", id="null"),  # tagged fields: none (null is the default)
    pytest.param([], b"\x01\x01\x01\x01", id="empty"),  # count 1; tag 1, size 1: count+1 = 1
    pytest.param([TOPIC_ID], b"\x01\x01\x11\x02" + TOPIC_ID_BYTES, id="one"),  # size 17: count+1 = 2
])
def test_broker_heartbeat_cordoned_log_dirs(dirs, tagged):
    """Null (not known yet) and empty (none cordoned) differ on the wire (KIP-1066)."""
    _, codec = request_codecs(63, 2)
    obj = codec.cls(broker_id=1, broker_epoch=7, current_metadata_offset=100, want_fence=False,
                    want_shut_down=False, offline_log_dirs=[], cordoned_log_dirs=dirs)
    data = _encode(codec, obj)
    assert data == (
        b"\x00\x00\x00\x01"  # int32 broker_id = 1
        b"\x00\x00\x00\x00\x00\x00\x00\x07"  # int64 broker_epoch = 7
        b"\x00\x00\x00\x00\x00\x00\x00\x64"  # int64 current_metadata_offset = 100
        b"\x00"  # bool want_fence = false
        b"\x00"  # bool want_shut_down = false
        + tagged  # offline_log_dirs is empty (its default), so only tag 1 can appear
    )
    back, _ = codec.decode_checked(memoryview(data), 0, len(data))
    assert back.to_dict(2)["cordoned_log_dirs"] == dirs


# ---------------------------------------------------------------------------------------------
# Defaults: kio carries Kafka's explicit defaults (for the versions it knows); kproxy must agree.
# ---------------------------------------------------------------------------------------------

KIO_APIS = ["vote", "begin_quorum_epoch", "end_quorum_epoch", "describe_quorum", "alter_partition",
            "envelope", "fetch_snapshot", "broker_registration", "broker_heartbeat",
            "unregister_broker", "allocate_producer_ids", "controller_registration",
            "assign_replicas_to_dirs", "add_raft_voter", "remove_raft_voter", "update_raft_voter"]


def _kio_default(f: dataclasses.Field, hint: object):
    d = f.default
    if d is dataclasses.MISSING or dataclasses.is_dataclass(d):
        return dataclasses.MISSING
    if isinstance(d, datetime.timedelta):
        return round(d.total_seconds() * 1000)
    if isinstance(d, tuple):
        return list(d)
    if d is None and f.metadata.get("kafka_type") == "uuid" and not _inner(hint)[1]:
        return uuid.UUID(int=0)  # kio shows the zero UUID as None
    return getattr(d, "value", d)


def _kio_struct(tp) -> type | None:
    if dataclasses.is_dataclass(tp):
        return tp  # type: ignore[return-value]
    for arg in typing.get_args(tp):
        found = _kio_struct(arg)
        if found is not None:
            return found
    return None


def _default_mismatches(kio_cls, our_cls, classes: dict[str, type], path: str) -> list[str]:
    out = []
    obj = our_cls()
    hints = typing.get_type_hints(kio_cls)
    for f in dataclasses.fields(kio_cls):
        name = kproxy_name(f).removesuffix("_")
        expected = _kio_default(f, hints[f.name])
        if expected is not dataclasses.MISSING and getattr(obj, name) != expected:
            out.append(f"{path}.{name}: kproxy {getattr(obj, name)!r}, kio {expected!r}")
        sub = _kio_struct(hints[f.name])
        if sub is not None:
            out += _default_mismatches(sub, classes[sub.__name__], classes, f"{path}.{name}")
    return out


@pytest.mark.parametrize("name", KIO_APIS)
def test_defaults_match_kio(name):
    mismatches: list[str] = []
    for kind in ("request", "response"):
        msg = getattr(api_by_name(name), kind)
        classes = classes_of(msg)
        for v in kio_versions(name):
            mismatches += _default_mismatches(kio_class(name, v, kind), classes[msg.root.name],
                                              classes, f"{name}.v{v}.{kind}")
    assert not mismatches, mismatches

"""Golden byte vectors, one comment per chunk (aiokafka's tests/test_protocol.py style).

Each vector is written from the protocol's facts, not from kproxy's encoder. Every test checks both
directions: decoding gives the expected fields, and encoding, from the decoded message and from one
built by hand, gives back exactly the same bytes. Each test runs with the proxy's codec and with
every array of structs lazy, in pure Python and native (``codec_setting``).
"""

from __future__ import annotations

import struct
import zlib

import pytest

from kproxy.protocol.messages import (
    Request,
    Response,
    body_class,
    decode_request,
    decode_response,
    encode_request,
    encode_request_frame,
    encode_response,
    request_header_version,
    response_header_version,
)
from kproxy.protocol.records import Compression, LegacyMessage, build_legacy, iter_batches

pytestmark = pytest.mark.usefixtures("codec_setting")


def joined(parts) -> bytes:
    """One bytes object from an encoder's bytearray or list of buffers."""
    if isinstance(parts, list):
        return b"".join(bytes(p) for p in parts)
    return bytes(parts)


# --------------------------------------------------------------------------------------------------
# (a) Produce v0 request: the classic protocol guide's example. Client "foo" sends "hello world" to
# partition 0 of topic "test" as a v0 message set of one message.

HELLO_WORLD_MESSAGE = b"".join([
    bytes.fromhex("73acf77c"),  # crc: CRC32 of everything after it (magic .. value)
    struct.pack(">b", 0),  # magic: 0
    struct.pack(">b", 0),  # attributes: no compression
    struct.pack(">i", -1),  # key: null
    struct.pack(">i", 11),  # value length
    b"hello world",  # value
])

HELLO_WORLD_MESSAGE_SET = b"".join([
    struct.pack(">q", 0),  # offset: a producer may put anything here
    struct.pack(">i", 25),  # message size
    HELLO_WORLD_MESSAGE,
])

PRODUCE_V0_REQUEST = b"".join([
    struct.pack(">i", 78),  # size: the 78 bytes that follow
    struct.pack(">h", 0),  # request_api_key: Produce
    struct.pack(">h", 0),  # request_api_version: 0 (request header v1)
    struct.pack(">i", 1),  # correlation_id
    struct.pack(">h", 3),  # client_id length
    b"foo",  # client_id
    struct.pack(">h", 1),  # acks: the leader's write
    struct.pack(">i", 1000),  # timeout_ms
    struct.pack(">i", 1),  # topic_data: 1 topic
    struct.pack(">h", 4),  # name length
    b"test",  # name
    struct.pack(">i", 1),  # partition_data: 1 partition
    struct.pack(">i", 0),  # index
    struct.pack(">i", 37),  # records: message set size
    HELLO_WORLD_MESSAGE_SET,  # records
])


def test_produce_v0_vector_is_self_consistent():
    assert len(PRODUCE_V0_REQUEST) == 4 + 78
    assert len(HELLO_WORLD_MESSAGE_SET) == 37
    assert zlib.crc32(HELLO_WORLD_MESSAGE[4:]) == 0x73ACF77C


def test_produce_v0_request_decodes():
    req = decode_request(PRODUCE_V0_REQUEST[4:])
    assert (req.api_key, req.api_version, req.correlation_id, req.client_id) == (0, 0, 1, "foo")
    assert request_header_version(0, 0) == 1
    assert req.body.to_dict(0) == {
        "acks": 1,
        "timeout_ms": 1000,
        "topic_data": [
            {"name": "test", "partition_data": [{"index": 0, "records": HELLO_WORLD_MESSAGE_SET}]}
        ],
    }
    # The records field is a view of the received frame, not a copy.
    assert isinstance(req.body.topic_data[0].partition_data[0].records, memoryview)
    (message,) = list(iter_batches(req.body.topic_data[0].partition_data[0].records, verify_crc=True))
    assert isinstance(message, LegacyMessage)
    assert (message.offset, message.magic, message.crc) == (0, 0, 0x73ACF77C)
    assert message.compression is Compression.NONE
    assert message.key is None
    assert bytes(message.value) == b"hello world"


def test_produce_v0_request_encodes_to_the_same_bytes():
    req = decode_request(PRODUCE_V0_REQUEST[4:])
    assert joined(encode_request(req)) == PRODUCE_V0_REQUEST[4:]
    assert joined(encode_request_frame(req)) == PRODUCE_V0_REQUEST


def test_produce_v0_request_built_by_hand_encodes_to_the_vector():
    Produce = body_class(0, "request")
    records = build_legacy([(None, b"hello world")], magic=0)
    assert records == HELLO_WORLD_MESSAGE_SET
    body = Produce(
        acks=1,
        timeout_ms=1000,
        topic_data=[Produce.TopicProduceData(
            name="test", partition_data=[Produce.PartitionProduceData(index=0, records=records)]
        )],
    )
    req = Request.build(0, 0, 1, "foo", body)
    assert joined(encode_request_frame(req)) == PRODUCE_V0_REQUEST


# --------------------------------------------------------------------------------------------------
# (b) Metadata v0: a request for topic "test" and its answer, one broker leading one partition.

METADATA_V0_REQUEST = b"".join([
    struct.pack(">h", 3),  # request_api_key: Metadata
    struct.pack(">h", 0),  # request_api_version: 0 (request header v1)
    struct.pack(">i", 2),  # correlation_id
    struct.pack(">h", 3),  # client_id length
    b"foo",  # client_id
    struct.pack(">i", 1),  # topics: 1 (v0 has no null; an empty array would mean all topics)
    struct.pack(">h", 4),  # name length
    b"test",  # name
])

METADATA_V0_RESPONSE = b"".join([
    struct.pack(">i", 2),  # correlation_id (response header v0)
    struct.pack(">i", 1),  # brokers: 1
    struct.pack(">i", 1),  # node_id
    struct.pack(">h", 9),  # host length
    b"localhost",  # host
    struct.pack(">i", 9092),  # port
    struct.pack(">i", 1),  # topics: 1
    struct.pack(">h", 0),  # error_code: NONE
    struct.pack(">h", 4),  # name length
    b"test",  # name
    struct.pack(">i", 1),  # partitions: 1
    struct.pack(">h", 0),  # error_code: NONE
    struct.pack(">i", 0),  # partition_index
    struct.pack(">i", 1),  # leader_id
    struct.pack(">i", 1),  # replica_nodes: 1
    struct.pack(">i", 1),  # replica_nodes[0]
    struct.pack(">i", 1),  # isr_nodes: 1
    struct.pack(">i", 1),  # isr_nodes[0]
])


def test_metadata_v0_request():
    req = decode_request(METADATA_V0_REQUEST)
    assert (req.api_key, req.api_version, req.correlation_id, req.client_id) == (3, 0, 2, "foo")
    assert req.body.to_dict(0) == {"topics": [{"name": "test"}]}
    assert joined(encode_request(req)) == METADATA_V0_REQUEST

    Metadata = body_class(3, "request")
    built = Request.build(3, 0, 2, "foo", Metadata(topics=[Metadata.MetadataRequestTopic(name="test")]))
    assert joined(encode_request(built)) == METADATA_V0_REQUEST


def test_metadata_v0_response():
    assert response_header_version(3, 0) == 0
    resp = decode_response(METADATA_V0_RESPONSE, 3, 0)
    assert resp.correlation_id == 2
    assert resp.body.to_dict(0) == {
        "brokers": [{"node_id": 1, "host": "localhost", "port": 9092}],
        "topics": [{
            "error_code": 0,
            "name": "test",
            "partitions": [{
                "error_code": 0, "partition_index": 0, "leader_id": 1,
                "replica_nodes": [1], "isr_nodes": [1],
            }],
        }],
    }
    assert joined(encode_response(resp)) == METADATA_V0_RESPONSE

    M = body_class(3, "response")
    body = M(
        brokers=[M.MetadataResponseBroker(node_id=1, host="localhost", port=9092)],
        topics=[M.MetadataResponseTopic(error_code=0, name="test", partitions=[
            M.MetadataResponsePartition(partition_index=0, leader_id=1, replica_nodes=[1], isr_nodes=[1])
        ])],
    )
    assert joined(encode_response(Response.build(3, 0, 2, body))) == METADATA_V0_RESPONSE


# --------------------------------------------------------------------------------------------------
# (c) ApiVersions v3 request: flexible, so request header v2 and compact strings (KIP-482, KIP-511).

API_VERSIONS_V3_REQUEST = b"".join([
    struct.pack(">h", 18),  # request_api_key: ApiVersions
    struct.pack(">h", 3),  # request_api_version: 3 (request header v2)
    struct.pack(">i", 7),  # correlation_id
    struct.pack(">h", 2),  # client_id length: still int16 in header v2, so any broker can read it
    b"c1",  # client_id
    b"\x00",  # header tagged fields: none
    b"\x12",  # client_software_name: compact string, uvarint length + 1 = 18
    b"apache-kafka-java",  # client_software_name
    b"\x06",  # client_software_version: compact string, length 5
    b"3.7.0",  # client_software_version
    b"\x00",  # body tagged fields: none
])


def test_api_versions_v3_request():
    assert request_header_version(18, 3) == 2
    req = decode_request(API_VERSIONS_V3_REQUEST)
    assert (req.api_key, req.api_version, req.correlation_id, req.client_id) == (18, 3, 7, "c1")
    assert req.body.to_dict(3) == {"client_software_name": "apache-kafka-java", "client_software_version": "3.7.0"}
    assert joined(encode_request(req)) == API_VERSIONS_V3_REQUEST

    ApiVersions = body_class(18, "request")
    built = Request.build(18, 3, 7, "c1", ApiVersions(
        client_software_name="apache-kafka-java", client_software_version="3.7.0"
    ))
    assert joined(encode_request(built)) == API_VERSIONS_V3_REQUEST


# --------------------------------------------------------------------------------------------------
# (d) ApiVersions v3 response with tagged fields: supported_features (tag 0) and
# finalized_features_epoch (tag 1) are known; tag 9 is not and must come back byte for byte.

UNKNOWN_TAG_9 = b"\xde\xad\xbe"

API_VERSIONS_V3_RESPONSE = b"".join([
    struct.pack(">i", 7),  # correlation_id: response header v0 although v3 is flexible (KIP-511)
    struct.pack(">h", 0),  # error_code: NONE
    b"\x03",  # api_keys: compact array, uvarint count + 1 = 2 entries
    struct.pack(">hhh", 0, 0, 9),  # api_key 0 (Produce), min_version 0, max_version 9
    b"\x00",  # its tagged fields: none
    struct.pack(">hhh", 18, 0, 3),  # api_key 18 (ApiVersions), min_version 0, max_version 3
    b"\x00",  # its tagged fields: none
    struct.pack(">i", 0),  # throttle_time_ms
    b"\x03",  # tagged fields: 3
    b"\x00",  # tag 0: supported_features
    b"\x17",  # size: 23 bytes
    b"\x02",  # compact array: 1 entry
    b"\x11",  # name: compact string, length 16
    b"metadata.version",  # name
    struct.pack(">hh", 1, 20),  # min_version 1, max_version 20
    b"\x00",  # the entry's tagged fields: none
    b"\x01",  # tag 1: finalized_features_epoch
    b"\x08",  # size: 8 bytes
    struct.pack(">q", 42),  # finalized_features_epoch
    b"\x09",  # tag 9: unknown to kproxy
    b"\x03",  # size: 3 bytes
    UNKNOWN_TAG_9,  # kept as raw bytes
])


def test_api_versions_v3_response_with_known_and_unknown_tags():
    assert response_header_version(18, 3) == 0
    resp = decode_response(API_VERSIONS_V3_RESPONSE, 18, 3)
    assert resp.correlation_id == 7
    assert resp.body.to_dict(3) == {
        "error_code": 0,
        "api_keys": [
            {"api_key": 0, "min_version": 0, "max_version": 9},
            {"api_key": 18, "min_version": 0, "max_version": 3},
        ],
        "throttle_time_ms": 0,
        "supported_features": [{"name": "metadata.version", "min_version": 1, "max_version": 20}],
        "finalized_features_epoch": 42,
        "finalized_features": [],
        "zk_migration_ready": False,
        "_unknown_tagged_fields": [{"tag": 9, "data": UNKNOWN_TAG_9}],
    }
    assert joined(encode_response(resp)) == API_VERSIONS_V3_RESPONSE

    R = body_class(18, "response")
    body = R(
        api_keys=[R.ApiVersion(api_key=0, max_version=9), R.ApiVersion(api_key=18, max_version=3)],
        supported_features=[R.SupportedFeatureKey(name="metadata.version", min_version=1, max_version=20)],
        finalized_features_epoch=42,
        _unknown=[(9, UNKNOWN_TAG_9)],
    )
    assert joined(encode_response(Response.build(18, 3, 7, body))) == API_VERSIONS_V3_RESPONSE


def test_api_versions_v3_response_without_the_unknown_tag_drops_only_it():
    # Guards against a vector that passes because unknown tags are ignored on both sides.
    resp = decode_response(API_VERSIONS_V3_RESPONSE, 18, 3)
    resp.body._unknown = None
    out = joined(encode_response(resp))
    expected = API_VERSIONS_V3_RESPONSE[: -len(b"\x09\x03" + UNKNOWN_TAG_9)]
    expected = expected.replace(struct.pack(">i", 0) + b"\x03\x00\x17", struct.pack(">i", 0) + b"\x02\x00\x17")
    assert out == expected


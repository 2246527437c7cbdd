"""Unknown tagged fields survive decode -> encode byte for byte, at the top level, in headers and in
nested structs, and are re-emitted in tag order among the known ones (KIP-482).

The frames are written here from the wire format, with a few small writers, so that the expected
bytes never come from kproxy's own encoder. Each test runs with the proxy's codec and with every
array of structs lazy, in pure Python and native (``codec_setting``).
"""

from __future__ import annotations

import struct
import uuid

import pytest

from kproxy.protocol.errors import DecodeError
from kproxy.protocol.messages import decode_request, decode_response, encode_request, encode_response
from kproxy.protocol.primitives import write_uvarint as uv
from kproxy.protocol.records import build_batch

pytestmark = pytest.mark.usefixtures("codec_setting")


def joined(parts) -> bytes:
    if isinstance(parts, list):
        return b"".join(bytes(p) for p in parts)
    return bytes(parts)


def i8(v: int) -> bytes:
    return struct.pack(">b", v)


def i16(v: int) -> bytes:
    return struct.pack(">h", v)


def i32(v: int) -> bytes:
    return struct.pack(">i", v)


def i64(v: int) -> bytes:
    return struct.pack(">q", v)


def cstr(s: str | None) -> bytes:
    """Compact (nullable) string: uvarint length + 1, 0 for null."""
    if s is None:
        return b"\x00"
    b = s.encode()
    return uv(len(b) + 1) + b


def carr(n: int) -> bytes:
    """Compact array count: uvarint count + 1."""
    return uv(n + 1)


def tags(*fields: tuple[int, bytes]) -> bytes:
    """A tagged-field section: uvarint count, then uvarint tag, uvarint size and the bytes of each."""
    return uv(len(fields)) + b"".join(uv(t) + uv(len(d)) + d for t, d in fields)


def unknown(obj) -> list[tuple[int, bytes]]:
    return [(t, bytes(d)) for t, d in obj._unknown or ()]


TOPIC_ID = uuid.UUID("6ba7b810-9dad-11d1-80b4-00c04fd430c8")
LONG = bytes(range(200))  # a value whose size needs a two-byte uvarint


# --------------------------------------------------------------------------------------------------
# Metadata v12 response: unknown tags in the response header, at the top, in brokers[], topics[]
# and topics[].partitions[], with tag numbers that need one, two and three uvarint bytes.

METADATA_V12_RESPONSE = b"".join([
    i32(11),  # correlation_id
    tags((4, b"hdr")),  # response header v1 tagged fields: unknown tag 4
    i32(0),  # throttle_time_ms
    carr(1),  # brokers: 1
    i32(1), cstr("broker-1"), i32(9092), cstr(None),  # node_id, host, port, rack
    tags((0, b"")),  # brokers[0]: unknown tag 0 with an empty value
    cstr("cluster-a"),  # cluster_id
    i32(1),  # controller_id
    carr(1),  # topics: 1
    i16(0), cstr("orders"), TOPIC_ID.bytes, i8(0),  # error_code, name, topic_id, is_internal
    carr(2),  # partitions: 2
    i16(0), i32(0), i32(1), i32(5),  # error_code, partition_index, leader_id, leader_epoch
    carr(1), i32(1), carr(1), i32(1), carr(0),  # replica_nodes, isr_nodes, offline_replicas
    tags((3, b"\x01\x02"), (300, b"abc"), (20000, LONG)),  # partitions[0]: three unknown tags
    i16(0), i32(1), i32(1), i32(5),  # partitions[1]
    carr(1), i32(1), carr(1), i32(1), carr(0),
    tags(),  # partitions[1]: none
    i32(-2147483648),  # topic_authorized_operations
    tags((7, b"\xff")),  # topics[0]: unknown tag 7
    tags((1, b"top"), (128, b"x")),  # top level: unknown tags 1 and 128
])


def test_metadata_v12_response_keeps_unknown_tags_everywhere():
    resp = decode_response(METADATA_V12_RESPONSE, 3, 12)
    body = resp.body
    assert unknown(resp.header) == [(4, b"hdr")]
    assert unknown(body) == [(1, b"top"), (128, b"x")]
    assert unknown(body.brokers[0]) == [(0, b"")]
    assert unknown(body.topics[0]) == [(7, b"\xff")]
    p0, p1 = body.topics[0].partitions
    assert unknown(p0) == [(3, b"\x01\x02"), (300, b"abc"), (20000, LONG)]
    assert unknown(p1) == []
    # Known fields around them decode normally.
    assert (body.cluster_id, body.topics[0].name, body.topics[0].topic_id) == ("cluster-a", "orders", TOPIC_ID)
    assert (p0.leader_id, p0.leader_epoch, p1.partition_index) == (1, 5, 1)
    assert joined(encode_response(resp)) == METADATA_V12_RESPONSE


def test_metadata_v12_unknown_tags_survive_edits_to_known_fields():
    resp = decode_response(METADATA_V12_RESPONSE, 3, 12)
    # What the proxy does to every Metadata response: rewrite the broker address.
    resp.body.brokers[0].host = "proxy-0"
    resp.body.brokers[0].port = 19092
    out = joined(encode_response(resp))
    expected = METADATA_V12_RESPONSE.replace(cstr("broker-1") + i32(9092), cstr("proxy-0") + i32(19092))
    assert out == expected


# --------------------------------------------------------------------------------------------------
# Fetch v16 response: the partition has known tags 0 (diverging_epoch) and 2 (snapshot_id) present,
# 1 (current_leader) absent, then unknown 4 and 130; the known tagged struct diverging_epoch holds an
# unknown tag of its own; the top level has known tag 0 (node_endpoints) then unknown 1 and 2.

RECORDS = build_batch([(b"k", b"v")], base_timestamp=1_700_000_000_000)

DIVERGING_EPOCH = i32(3) + i64(100) + tags((5, b"nested"))  # epoch, end_offset, unknown tag 5
SNAPSHOT_ID = i64(90) + i32(2) + tags()  # end_offset, epoch
NODE_ENDPOINTS = carr(1) + i32(1) + cstr("broker-1") + i32(9092) + cstr("rack-a") + tags()

FETCH_V16_RESPONSE = b"".join([
    i32(21),  # correlation_id
    tags(),  # response header v1 tagged fields: none
    i32(0), i16(0), i32(77),  # throttle_time_ms, error_code, session_id
    carr(1),  # responses: 1
    TOPIC_ID.bytes,  # topic_id
    carr(1),  # partitions: 1
    i32(0), i16(0), i64(10), i64(10), i64(0),  # index, error_code, high_watermark, lso, log_start
    carr(0),  # aborted_transactions: empty
    i32(-1),  # preferred_read_replica
    uv(len(RECORDS) + 1), RECORDS,  # records: compact bytes
    tags((0, DIVERGING_EPOCH), (2, SNAPSHOT_ID), (4, b"u4"), (130, b"u130")),
    tags((9, b"t")),  # responses[0]: unknown tag 9
    tags((0, NODE_ENDPOINTS), (1, b"one"), (2, b"two")),  # top level
])


def test_fetch_v16_response_interleaves_known_and_unknown_tags():
    resp = decode_response(FETCH_V16_RESPONSE, 1, 16)
    body = resp.body
    part = body.responses[0].partitions[0]
    assert (part.diverging_epoch.epoch, part.diverging_epoch.end_offset) == (3, 100)
    assert unknown(part.diverging_epoch) == [(5, b"nested")]
    assert (part.snapshot_id.end_offset, part.snapshot_id.epoch) == (90, 2)
    assert unknown(part) == [(4, b"u4"), (130, b"u130")]
    assert unknown(body.responses[0]) == [(9, b"t")]
    assert [e.host for e in body.node_endpoints] == ["broker-1"]
    assert unknown(body) == [(1, b"one"), (2, b"two")]
    assert bytes(part.records) == RECORDS
    assert joined(encode_response(resp)) == FETCH_V16_RESPONSE


def test_unknown_tags_are_re_emitted_in_tag_order_among_known_ones():
    resp = decode_response(FETCH_V16_RESPONSE, 1, 16)
    part = resp.body.responses[0].partitions[0]
    # Set the absent known tag 1 and give the unknown ones out of order: the encoder must sort.
    part.current_leader.leader_id = 2
    part.current_leader.leader_epoch = 8
    part._unknown = [(130, b"u130"), (4, b"u4")]
    current_leader = i32(2) + i32(8) + tags()
    expected = FETCH_V16_RESPONSE.replace(
        tags((0, DIVERGING_EPOCH), (2, SNAPSHOT_ID), (4, b"u4"), (130, b"u130")),
        tags((0, DIVERGING_EPOCH), (1, current_leader), (2, SNAPSHOT_ID), (4, b"u4"), (130, b"u130")),
    )
    assert expected != FETCH_V16_RESPONSE
    assert joined(encode_response(resp)) == expected


# --------------------------------------------------------------------------------------------------
# Fetch v17 request: tag 1 of a partition (high_watermark) is only known from v18, so at v17 it sits
# between known tag 0 (replica_directory_id) and unknown tag 5 and must keep its place.

DIRECTORY_ID = uuid.UUID("0c3f5a3e-0000-4000-8000-000000000001")


def fetch_request(version: int) -> bytes:
    return b"".join([
        i16(1), i16(version), i32(31), i16(2), b"c1",  # request header v2
        tags(),  # header tagged fields
        i32(500), i32(1), i32(1 << 20), i8(0), i32(0), i32(-1),  # max_wait .. session_epoch
        carr(1), TOPIC_ID.bytes,  # topics[0].topic_id
        carr(1),  # partitions: 1
        i32(0), i32(5), i64(100), i32(4), i64(0), i32(1 << 20),  # partition .. partition_max_bytes
        tags((0, DIRECTORY_ID.bytes), (1, i64(150)), (5, b"five")),
        tags(),  # topics[0]
        carr(0),  # forgotten_topics_data
        cstr(""),  # rack_id
        tags(),  # top level
    ])


def test_a_tag_known_only_in_later_versions_stays_in_place():
    v17 = decode_request(fetch_request(17))
    part = v17.body.topics[0].partitions[0]
    assert part.replica_directory_id == DIRECTORY_ID
    assert unknown(part) == [(1, i64(150)), (5, b"five")]
    assert joined(encode_request(v17)) == fetch_request(17)

    v18 = decode_request(fetch_request(18))
    part = v18.body.topics[0].partitions[0]
    assert part.high_watermark == 150
    assert unknown(part) == [(5, b"five")]
    assert joined(encode_request(v18)) == fetch_request(18)


# --------------------------------------------------------------------------------------------------
# CreateTopics v7 request: unknown tags in the request header and at every level of nesting.

CREATE_TOPICS_V7_REQUEST = b"".join([
    i16(19), i16(7), i32(41), i16(5), b"admin",  # request header v2
    tags((2, b"hdr")),  # header: unknown tag 2
    carr(1),  # topics: 1
    cstr("orders"), i32(-1), i16(-1),  # name, num_partitions, replication_factor
    carr(1),  # assignments: 1
    i32(0), carr(2), i32(1), i32(2),  # partition_index, broker_ids
    tags((0, b"a")),  # assignments[0]: unknown tag 0
    carr(2),  # configs: 2
    cstr("cleanup.policy"), cstr("compact"),
    tags((1, b""), (2, b"cfg")),  # configs[0]: unknown 1 (empty) and 2
    cstr("retention.ms"), cstr(None),
    tags(),  # configs[1]: none
    tags((9, b"topic")),  # topics[0]: unknown tag 9
    i32(30000), i8(1),  # timeout_ms, validate_only
    tags((200, LONG)),  # top level: a long unknown field
])


def test_create_topics_v7_request_keeps_unknown_tags_at_every_level():
    req = decode_request(CREATE_TOPICS_V7_REQUEST)
    topic = req.body.topics[0]
    assert unknown(req.header) == [(2, b"hdr")]
    assert unknown(topic.assignments[0]) == [(0, b"a")]
    assert unknown(topic.configs[0]) == [(1, b""), (2, b"cfg")]
    assert unknown(topic.configs[1]) == []
    assert unknown(topic) == [(9, b"topic")]
    assert unknown(req.body) == [(200, LONG)]
    assert topic.assignments[0].broker_ids == [1, 2]
    assert (topic.configs[1].name, topic.configs[1].value) == ("retention.ms", None)
    assert (req.body.timeout_ms, req.body.validate_only) == (30000, True)
    assert joined(encode_request(req)) == CREATE_TOPICS_V7_REQUEST


def test_unknown_tags_show_in_to_dict():
    req = decode_request(CREATE_TOPICS_V7_REQUEST)
    d = req.body.to_dict(7)
    assert d["_unknown_tagged_fields"] == [{"tag": 200, "data": LONG}]
    assert d["topics"][0]["configs"][0]["_unknown_tagged_fields"] == [
        {"tag": 1, "data": b""}, {"tag": 2, "data": b"cfg"}
    ]


@pytest.mark.parametrize(
    ("frame", "decode"),
    [
        (METADATA_V12_RESPONSE, lambda f: decode_response(f, 3, 12)),
        (FETCH_V16_RESPONSE, lambda f: decode_response(f, 1, 16)),
        (CREATE_TOPICS_V7_REQUEST, decode_request),
    ],
    ids=["metadata-v12", "fetch-v16", "create-topics-v7"],
)
def test_a_truncated_unknown_tag_is_a_decode_error(frame, decode):
    # Cutting the last byte leaves the final unknown tag claiming more bytes than remain.
    with pytest.raises(DecodeError) as info:
        decode(frame[:-1])
    assert info.value.offset is not None

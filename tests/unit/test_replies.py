"""Error responses kproxy builds itself mirror the request's topics and partitions, as a broker's would."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import HealthCheck, given, settings

from kproxy.protocol.messages import (
    Request,
    apis,
    body_class,
    decode_response,
    encode_response_frame,
)
from kproxy.protocol.schema import StructSpec
from kproxy.proxy.replies import error_response

from ..protocol.strategies import message_strategy

PRODUCE, FETCH, LIST_OFFSETS, METADATA, OFFSET_FETCH, FIND_COORDINATOR = 0, 1, 2, 3, 9, 10
HEARTBEAT, DELETE_TOPICS, FETCH_SNAPSHOT, SHARE_FETCH = 12, 20, 59, 78


def reply(api_key: int, version: int, body, code: int = 6, message: str | None = None, throttle: int = 0):
    """The error response, after a trip through the wire (so it must also be encodable)."""
    req = Request.build(api_key, version, 4242, "app", body)
    resp = error_response(req, code, message, throttle)
    assert resp is not None
    assert resp.correlation_id == 4242
    frame = b"".join(encode_response_frame(resp))[4:]
    return decode_response(frame, api_key, version).body


def produce(topics, topic_ids=False):
    cls = body_class(PRODUCE, "request")
    return cls(acks=-1, timeout_ms=100, topic_data=[
        cls.TopicProduceData(name=name, topic_id=uuid.UUID(int=i + 1) if topic_ids else uuid.UUID(int=0),
                             partition_data=[cls.PartitionProduceData(index=p, records=b"x") for p in parts])
        for i, (name, parts) in enumerate(topics)])


@pytest.mark.parametrize("version", [0, 2, 8, 9, 12])
def test_produce_errors_per_partition_by_name(version):
    body = reply(PRODUCE, version, produce([("a", [0, 3]), ("b", [1])]), code=29, message="denied", throttle=250)
    got = [(t.name, p.index, p.error_code, p.base_offset) for t in body.responses for p in t.partition_responses]
    assert got == [("a", 0, 29, -1), ("a", 3, 29, -1), ("b", 1, 29, -1)]
    if version >= 8:
        assert all(p.error_message == "denied" for t in body.responses for p in t.partition_responses)
    if version >= 1:
        assert body.throttle_time_ms == 250


def test_produce_v13_errors_per_partition_by_topic_id():
    body = reply(PRODUCE, 13, produce([("a", [0]), ("b", [5, 6])], topic_ids=True))
    assert [(t.topic_id, [(p.index, p.error_code) for p in t.partition_responses]) for t in body.responses] == [
        (uuid.UUID(int=1), [(0, 6)]), (uuid.UUID(int=2), [(5, 6), (6, 6)])]


def fetch(version_topics):
    cls = body_class(FETCH, "request")
    return cls(max_wait_ms=1, min_bytes=1, topics=[
        cls.FetchTopic(topic=name, topic_id=tid, partitions=[
            cls.FetchPartition(partition=p, fetch_offset=0, partition_max_bytes=1) for p in parts])
        for name, tid, parts in version_topics])


@pytest.mark.parametrize("version", [0, 6, 7, 12, 13, 16])
def test_fetch_errors_per_partition(version):
    tid = uuid.UUID(int=9)
    body = reply(FETCH, version, fetch([("logs", tid, [0, 1])]), code=29)
    topic = body.responses[0]
    assert (topic.topic_id if version >= 13 else topic.topic) == (tid if version >= 13 else "logs")
    assert [(p.partition_index, p.error_code, p.high_watermark) for p in topic.partitions] == [
        (0, 29, -1), (1, 29, -1)]
    # Empty, not null, as a broker sends them: librdkafka refuses a partition with null records.
    assert [p.records for p in topic.partitions] == [b"", b""]
    if version >= 7:
        # The top level is for fetch-session errors; consumers skip partition errors when it is set.
        assert body.error_code == 0


def test_list_offsets_errors_per_partition():
    cls = body_class(LIST_OFFSETS, "request")
    req = cls(replica_id=-1, topics=[cls.ListOffsetsTopic(name="t", partitions=[
        cls.ListOffsetsPartition(partition_index=4, timestamp=-1)])])
    body = reply(LIST_OFFSETS, 7, req)
    p = body.topics[0].partitions[0]
    assert (body.topics[0].name, p.partition_index, p.error_code, p.offset) == ("t", 4, 6, -1)


def test_heartbeat_error_is_top_level():
    req = body_class(HEARTBEAT, "request")(group_id="g", generation_id=1, member_id="m")
    body = reply(HEARTBEAT, 4, req, code=15, throttle=10)
    assert (body.error_code, body.throttle_time_ms) == (15, 10)


def test_find_coordinator_v3_error_is_top_level_with_message():
    req = body_class(FIND_COORDINATOR, "request")(key="g")
    body = reply(FIND_COORDINATOR, 3, req, code=15, message="lost")
    assert (body.error_code, body.error_message, body.host) == (15, "lost", "")


def test_find_coordinator_v4_error_per_key():
    req = body_class(FIND_COORDINATOR, "request")(coordinator_keys=["g1", "g2"])
    body = reply(FIND_COORDINATOR, 4, req, code=15)
    assert [(c.key, c.error_code, c.host) for c in body.coordinators] == [("g1", 15, ""), ("g2", 15, "")]


def test_offset_fetch_v8_errors_per_group():
    cls = body_class(OFFSET_FETCH, "request")
    req = cls(groups=[cls.OffsetFetchRequestGroup(group_id="g", topics=[
        cls.OffsetFetchRequestTopics(name="t", partition_indexes=[0, 2])])])
    body = reply(OFFSET_FETCH, 8, req, code=15)
    group = body.groups[0]
    assert (group.group_id, group.error_code) == ("g", 15)
    assert [(p.partition_index, p.error_code, p.committed_offset) for p in group.topics[0].partitions] == [
        (0, 15, -1), (2, 15, -1)]


def test_delete_topics_v6_mirrors_topic_ids():
    cls = body_class(DELETE_TOPICS, "request")
    req = cls(topics=[cls.DeleteTopicState(name=None, topic_id=uuid.UUID(int=3))], timeout_ms=1)
    body = reply(DELETE_TOPICS, 6, req, code=41)
    assert [(r.name, r.topic_id, r.error_code) for r in body.responses] == [(None, uuid.UUID(int=3), 41)]


def test_metadata_v10_null_topic_name_stays_encodable():
    # Requests may leave names null from v10, responses only from v12.
    cls = body_class(METADATA, "request")
    req = cls(topics=[cls.MetadataRequestTopic(name=None, topic_id=uuid.UUID(int=1))])
    body = reply(METADATA, 10, req, code=3)
    assert [(t.name, t.error_code) for t in body.topics] == [("", 3)]


@pytest.mark.parametrize(("api_key", "version"), [(SHARE_FETCH, 1), (SHARE_FETCH, 2), (FETCH_SNAPSHOT, 0)])
def test_non_nullable_records_are_empty_not_null(api_key, version):
    @settings(max_examples=5, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(message_strategy(apis()[api_key].request, version))
    def check(req):
        resp = error_response(Request.build(api_key, version, 1, "app", req), 6)
        if resp is not None:
            decode_response(b"".join(encode_response_frame(resp))[4:], api_key, version)

    check()


def test_nothing_to_carry_the_error_gives_none():
    assert error_response(Request.build(PRODUCE, 9, 1, "app", produce([])), 6) is None
    meta = body_class(METADATA, "request")(topics=[])
    assert error_response(Request.build(METADATA, 4, 1, "app", meta), 6) is None


# -- every API, every version


def error_codes(obj, spec: StructSpec, v: int, out: list[int]) -> list[int]:
    for f in spec.fields:
        if v not in f.versions:
            continue
        value = getattr(obj, f.name)
        if f.name == "error_code":
            out.append(value)
        if f.type == "struct" and value is not None:
            assert f.struct is not None
            for item in value if f.array else [value]:
                error_codes(item, f.struct, v, out)
    return out


CASES = [pytest.param(key, v, id=f"{api.name}-v{v}")
         for key, api in sorted(apis().items())
         for v in range(api.request.versions.lo, api.request.versions.hi + 1)]  # type: ignore[union-attr]


@pytest.mark.parametrize(("api_key", "version"), CASES)
def test_every_error_response_encodes_and_carries_the_error_everywhere(api_key, version):
    api = apis()[api_key]

    @settings(max_examples=4, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(message_strategy(api.request, version))
    def check(req):
        resp = error_response(Request.build(api_key, version, 1, "app", req), 87, "kproxy", 5)
        if resp is None:
            return
        back = decode_response(b"".join(encode_response_frame(resp))[4:], api_key, version)
        codes = error_codes(back.body, api.response.root, version, [])
        if api_key == FETCH and version >= 7 and any(t.partitions for t in back.body.responses):
            # Fetch keeps its top level (fetch-session errors) clear when partitions carry the error.
            assert codes[0] == 0
            codes = codes[1:]
        assert codes and set(codes) == {87}

    check()

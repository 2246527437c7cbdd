"""The virtual cluster's own cluster id, a replica's topic prefix, and producers carried across a
switch, on live sessions: pure, no sockets."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from kproxy.config import derived_cluster_id
from kproxy.protocol.messages import Request, body_class, decode_request
from kproxy.protocol.records import RecordBatch, build_batch, iter_batches
from kproxy.proxy.cluster_view import ClusterIdentity, ReplicaNames
from kproxy.proxy.continuity import Continuity, ProducerCarrier, SwitchBook
from kproxy.proxy.filters import ConnectionContext, FilterChain
from kproxy.proxy.session import Ask, Session, ToClient
from kproxy.proxy.topics import TopicNames

from .test_session import Clock, answered, forwarded, request_frame, response_frame

PRODUCE, FETCH, METADATA, OFFSET_COMMIT, INIT_PRODUCER_ID, DESCRIBE_CLUSTER = 0, 1, 3, 8, 22, 60
CONSUMER_GROUP_HEARTBEAT = 68


def session(*filters: Any, names: TopicNames | None = None, client: str = "10.0.0.5") -> Session:
    ctx = ConnectionContext(1, client_address=(client, 40000), clock=Clock())
    return Session(ctx, FilterChain(filters), topic_names=names)


def roundtrip(s: Session, api_key: int, version: int, body: Any, answer: Any, client_id: str = "app"
              ) -> tuple[Request, Any]:
    """(what reached the broker, what the client got back)."""
    up = forwarded(s.client_frame(request_frame(api_key, version, 7, body, client_id))[-1])
    back = s.upstream_frame(memoryview(response_frame(api_key, version, up.correlation_id, answer(up))))
    got = answered(back[-1], api_key, version)
    for entry in back[-1].done:
        s.finish(entry)     # as the I/O layer does once the answer is written: filters hear on_done
    return up, got


# -- the cluster id


def test_the_derived_id_is_stable_distinct_and_shaped_like_kafkas() -> None:
    a, b = derived_cluster_id("team-a"), derived_cluster_id("dr-app")
    assert a == derived_cluster_id("team-a") and a != b
    assert len(a) == 22 and all(c.isalnum() or c in "-_" for c in a)


@pytest.mark.parametrize("version", [2, 9, 12])
def test_metadata_carries_the_virtual_clusters_id(version: int) -> None:
    view = ClusterIdentity("vc-id")
    s = session(view)
    md = body_class(METADATA, "response")
    _, got = roundtrip(s, METADATA, version, body_class(METADATA, "request")(topics=[]),
                       lambda up: md(cluster_id="upstream-id", controller_id=1))
    assert got.body.cluster_id == "vc-id"
    assert view.upstream_id == "upstream-id"


@pytest.mark.parametrize("version", [0, 1])
def test_describe_cluster_carries_the_virtual_clusters_id(version: int) -> None:
    s = session(ClusterIdentity("vc-id"))
    dc = body_class(DESCRIBE_CLUSTER, "response")
    _, got = roundtrip(s, DESCRIBE_CLUSTER, version, body_class(DESCRIBE_CLUSTER, "request")(),
                       lambda up: dc(cluster_id="upstream-id", controller_id=1, brokers=[]))
    assert got.body.cluster_id == "vc-id"


def test_the_ids_are_asked_of_the_schema_and_cost_produce_and_fetch_nothing() -> None:
    view = ClusterIdentity("x")
    assert view.response_api_keys == {METADATA, DESCRIBE_CLUSTER}
    # No request filter: Produce and Fetch requests still go out as they were received.
    assert not view.request_api_keys
    assert FilterChain([view]).for_request(FETCH) == ()


# -- a replica's topic prefix


def test_the_prefix_goes_on_every_name_and_comes_off_the_answer() -> None:
    names = ReplicaNames("primary.")
    s = session(names.incoming, names.outgoing)
    md = body_class(METADATA, "response")
    tid = uuid.uuid4()

    def answer(up: Request) -> Any:
        assert [t.name for t in up.body.topics] == ["primary.orders"]
        return md(topics=[md.MetadataResponseTopic(name="primary.orders", topic_id=tid, partitions=[]),
                          md.MetadataResponseTopic(name="mm2-offset-syncs.secondary.internal", partitions=[]),
                          md.MetadataResponseTopic(name="heartbeats", partitions=[])])

    req = body_class(METADATA, "request")
    _, got = roundtrip(s, METADATA, 12, req(topics=[req.MetadataRequestTopic(name="orders")]), answer)
    # The replica's own topics are not the clients' to see.
    assert [t.name for t in got.body.topics] == ["orders"]


def test_produce_and_offset_commit_carry_the_prefix() -> None:
    names = ReplicaNames("primary.")
    s = session(names.incoming, names.outgoing)
    pr = body_class(PRODUCE, "request")
    up = forwarded(s.client_frame(request_frame(PRODUCE, 9, 7, pr(acks=-1, timeout_ms=1000, topic_data=[
        pr.TopicProduceData(name="orders", partition_data=[pr.PartitionProduceData(index=0, records=b"")])])))[-1])
    assert up.body.topic_data[0].name == "primary.orders"
    oc = body_class(OFFSET_COMMIT, "request")
    up = forwarded(s.client_frame(request_frame(OFFSET_COMMIT, 8, 8, oc(group_id="g", topics=[oc.OffsetCommitRequestTopic(
        name="orders", partitions=[oc.OffsetCommitRequestPartition(partition_index=0, committed_offset=5)])])))[-1])
    assert up.body.topics[0].name == "primary.orders" and up.body.group_id == "g"


def test_a_regex_subscription_cannot_follow_a_prefix() -> None:
    names = ReplicaNames("primary.")
    s = session(names.incoming, names.outgoing)
    hb = body_class(CONSUMER_GROUP_HEARTBEAT, "request")(group_id="g", member_id="m", member_epoch=0,
                                                        subscribed_topic_regex="ord.*")
    acts = s.client_frame(request_frame(CONSUMER_GROUP_HEARTBEAT, 1, 7, hb))
    got = answered(acts[-1], CONSUMER_GROUP_HEARTBEAT, 1)
    assert got.body.error_code == 128       # INVALID_REGULAR_EXPRESSION


def test_topic_names_learned_on_a_replica_are_the_clients() -> None:
    table = TopicNames()
    table.want(lambda: True)
    view = table.without_prefix("primary.")
    tid, other = uuid.uuid4(), uuid.uuid4()
    md = body_class(METADATA, "response")
    view.learn([md.MetadataResponseTopic(name="primary.orders", topic_id=tid),
                md.MetadataResponseTopic(name="heartbeats", topic_id=other)])
    assert table.get(tid) == "orders" and table.get(other) is None
    assert table.without_prefix(None) is table


# -- producers carried across a switch


def batch(producer_id: int, epoch: int, sequence: int, n: int = 3) -> bytes:
    return build_batch([(b"k", b"v%d" % i) for i in range(n)], producer_id=producer_id, producer_epoch=epoch,
                       base_sequence=sequence)


def produce(records: bytes) -> Any:
    pr = body_class(PRODUCE, "request")
    return pr(acks=-1, timeout_ms=1000, topic_data=[
        pr.TopicProduceData(name="orders", partition_data=[pr.PartitionProduceData(index=0, records=records)])])


def produce_answer(up: Request, base_offset: int = 10) -> Any:
    pr = body_class(PRODUCE, "response")
    return pr(responses=[pr.TopicProduceResponse(name="orders", partition_responses=[
        pr.PartitionProduceResponse(index=0, base_offset=base_offset)])])


def init_answer(producer_id: int, epoch: int = 0) -> Any:
    return body_class(INIT_PRODUCER_ID, "response")(producer_id=producer_id, producer_epoch=epoch)


def carrying(cluster: str, book: SwitchBook) -> tuple[Continuity, ProducerCarrier]:
    """The filters of a cluster's chain after a switch, as the server orders them."""
    return Continuity(cluster, book), ProducerCarrier(cluster, book)


def test_before_a_switch_produce_requests_meet_no_request_filter() -> None:
    chain = FilterChain([Continuity("primary", SwitchBook())])
    assert chain.for_request(PRODUCE) == () and chain.whole_frame_filter(PRODUCE, "request") is None


def test_a_producer_issued_by_the_cluster_passes_untouched_and_its_acks_are_counted() -> None:
    book = SwitchBook()
    s = session(*carrying("primary", book))
    ip = body_class(INIT_PRODUCER_ID, "request")(transactional_id=None, transaction_timeout_ms=60000)
    roundtrip(s, INIT_PRODUCER_ID, 4, ip, lambda up: init_answer(7))
    assert book.issued[(("10.0.0.5", "app"), 7, 0)] == "primary"
    book.switched = True        # even after a switch: the active cluster issued this one
    up, got = roundtrip(s, PRODUCE, 9, produce(batch(7, 0, 30)), produce_answer)
    first = next(iter(iter_batches(up.body.topic_data[0].partition_data[0].records)))
    assert (first.producer_id, first.base_sequence) == (7, 30)
    assert got.body.responses[0].partition_responses[0].error_code == 0
    assert book.acked["primary"] == {("orders", 0): 13}


def test_a_producer_from_another_cluster_is_carried_under_an_id_kproxy_asks_for() -> None:
    book = SwitchBook()
    book.issue("primary", ("10.0.0.5", "app"), 7, 0)
    s = session(*carrying("secondary", book))
    acts = s.client_frame(request_frame(PRODUCE, 9, 7, produce(batch(7, 0, 30))))
    assert [type(a) for a in acts] == [Ask]
    question = decode_request(b"".join(bytes(b) for b in acts[0].buffers)[4:])
    assert question.api_key == INIT_PRODUCER_ID and question.body.transactional_id is None
    acts = s.upstream_frame(memoryview(response_frame(INIT_PRODUCER_ID, question.api_version,
                                                      question.correlation_id, init_answer(1))))
    up = forwarded(acts[-1])
    (carried,) = list(iter_batches(up.body.topic_data[0].partition_data[0].records))
    assert isinstance(carried, RecordBatch) and carried.verify_crc()
    # kproxy's producer 1 starts its sequence at 0 where the client's batch said 30.
    assert (carried.producer_id, carried.producer_epoch, carried.base_sequence) == (1, 0, 0)
    assert [bytes(r.value) for r in carried.records()] == [b"v0", b"v1", b"v2"]
    s.upstream_frame(memoryview(response_frame(PRODUCE, 9, up.correlation_id, produce_answer(up))))
    # The next batch needs no question, and a retry keeps its sequence (the broker deduplicates it).
    for theirs, ours in ((33, 3), (33, 3), (36, 6)):
        up = forwarded(s.client_frame(request_frame(PRODUCE, 9, 8, produce(batch(7, 0, theirs))))[-1])
        b = next(iter(iter_batches(up.body.topic_data[0].partition_data[0].records)))
        assert (b.producer_id, b.base_sequence) == (1, ours) and b.verify_crc()
        s.upstream_frame(memoryview(response_frame(PRODUCE, 9, up.correlation_id, produce_answer(up))))
    assert book.carried_batches == 4


def test_after_a_switch_an_unknown_producer_is_carried_but_not_before() -> None:
    book = SwitchBook()
    s = session(*carrying("secondary", book))
    up = forwarded(s.client_frame(request_frame(PRODUCE, 9, 7, produce(batch(5, 0, 9))))[-1])
    assert next(iter(iter_batches(up.body.topic_data[0].partition_data[0].records))).producer_id == 5
    s.upstream_frame(memoryview(response_frame(PRODUCE, 9, up.correlation_id, produce_answer(up))))
    book.switched = True
    acts = s.client_frame(request_frame(PRODUCE, 9, 8, produce(batch(5, 0, 12))))
    assert [type(a) for a in acts] == [Ask]


def test_a_producer_that_cannot_be_carried_yet_retries() -> None:
    book = SwitchBook()
    book.switched = True
    s = session(*carrying("secondary", book))
    acts = s.client_frame(request_frame(PRODUCE, 9, 7, produce(batch(5, 0, 9))))
    question = decode_request(b"".join(bytes(b) for b in acts[0].buffers)[4:])
    failed = body_class(INIT_PRODUCER_ID, "response")(error_code=15, producer_id=-1, producer_epoch=-1)
    acts = s.upstream_frame(memoryview(response_frame(INIT_PRODUCER_ID, question.api_version,
                                                      question.correlation_id, failed)))
    got = answered(next(a for a in acts if isinstance(a, ToClient)), PRODUCE, 9)
    assert got.body.responses[0].partition_responses[0].error_code == 6     # NOT_LEADER_OR_FOLLOWER: retriable


def test_an_epoch_bump_for_an_id_this_cluster_did_not_issue_asks_for_a_new_one() -> None:
    book = SwitchBook()
    book.issue("primary", ("10.0.0.5", "app"), 7, 0)
    s = session(Continuity("secondary", book))
    ip = body_class(INIT_PRODUCER_ID, "request")(transactional_id=None, transaction_timeout_ms=60000,
                                                 producer_id=7, producer_epoch=0)
    up, _ = roundtrip(s, INIT_PRODUCER_ID, 4, ip, lambda up: init_answer(3))
    assert (up.body.producer_id, up.body.producer_epoch) == (-1, -1)
    assert book.issued[(("10.0.0.5", "app"), 3, 0)] == "secondary"


def test_offset_commits_that_succeeded_are_remembered_by_group() -> None:
    book = SwitchBook()
    s = session(Continuity("primary", book))
    oc = body_class(OFFSET_COMMIT, "request")
    body = oc(group_id="billing", topics=[oc.OffsetCommitRequestTopic(name="orders", partitions=[
        oc.OffsetCommitRequestPartition(partition_index=p, committed_offset=100 + p) for p in (0, 1)])])
    ans = body_class(OFFSET_COMMIT, "response")
    roundtrip(s, OFFSET_COMMIT, 8, body, lambda up: ans(topics=[ans.OffsetCommitResponseTopic(name="orders", partitions=[
        ans.OffsetCommitResponsePartition(partition_index=0, error_code=0),
        ans.OffsetCommitResponsePartition(partition_index=1, error_code=25)])]))
    assert book.commits["primary"] == {"billing": {("orders", 0): 100}}
    _, commits = book.left("primary")
    assert commits == {"billing": {("orders", 0): 100}} and "primary" not in book.commits

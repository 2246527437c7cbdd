"""PolicyFilter on live sessions: per-topic refusals split and merged, tenant prefixes in every API and
back, topic ids, chaos, caps, logs, notes, connection caching and reloads. Pure: no sockets."""

from __future__ import annotations

import logging
import random
import uuid
from typing import Any

import pytest

from kproxy.policy import model as M
from kproxy.policy.engine import FixedRules
from kproxy.policy.filter import PolicyFilter
from kproxy.policy.loader import RuleError, load_rules
from kproxy.policy.store import RuleStore
from kproxy.policy.tenants import pattern_fields
from kproxy.protocol import entities
from kproxy.protocol.compiler import message_class
from kproxy.protocol.errors import (
    CLUSTER_AUTHORIZATION_FAILED,
    INVALID_REQUIRED_ACKS,
    NOT_LEADER_OR_FOLLOWER,
    POLICY_VIOLATION,
    TOPIC_AUTHORIZATION_FAILED,
    UNKNOWN_TOPIC_ID,
)
from kproxy.protocol.messages import Response, apis, body_class, decode_request, supported_versions
from kproxy.protocol.records import build_batch
from kproxy.protocol.schema import RESOURCE_KINDS, StructSpec, resource_type_field
from kproxy.proxy.actions import Ask, Close, Hold, ToClient, ToUpstream
from kproxy.proxy.replies import error_response
from kproxy.proxy.topics import TopicNames

from .rulebook import policy_filter, session, write_rules
from .test_session import answered, forwarded, request_frame, response_frame

PRODUCE, FETCH, METADATA, OFFSET_COMMIT, CREATE_TOPICS, DELETE_TOPICS = 0, 1, 3, 8, 19, 20
FIND_COORDINATOR, CREATE_ACLS, CONSUMER_GROUP_HEARTBEAT, DESCRIBE_TOPIC_PARTITIONS = 10, 30, 68, 75
ID_A, ID_B, ID_C = (uuid.UUID(int=n) for n in (0xA, 0xB, 0xC))

DENY_SECRETS = "rules: [{name: no-secrets, match: {topic: 'secret-*'}, action: deny}]\n"
TENANTS = """\
rules:
  - name: no-secrets
    match: {topic: "secret-*"}
    action: deny
  - name: team-a
    match: {client_id: "team-a-*"}
    action: rewrite
    rewrite: {topic_prefix: "tenant-a.", group_prefix: "tenant-a.", transactional_id_prefix: "tenant-a."}
"""


def send(s, api_key: int, version: int, body: Any, client_id: str = "app", correlation_id: int = 7) -> list:
    return s.client_frame(request_frame(api_key, version, correlation_id, body, client_id))


def broker_answers(s, up, body: Any = None) -> list:
    """The broker's answer to forwarded request ``up``: ``body``, or success for everything it names."""
    if body is None:
        ok = error_response(up, 0)
        assert ok is not None
        body = ok.body
    return s.upstream_frame(memoryview(response_frame(up.api_key, up.api_version, up.correlation_id, body)))


def roundtrip(s, api_key: int, version: int, body: Any, client_id: str = "app", answer: Any = None,
              correlation_id: int = 7):
    """(what reached the broker, what the client got back)."""
    acts = send(s, api_key, version, body, client_id, correlation_id)
    up = forwarded(acts[-1])
    back = broker_answers(s, up, answer)
    return up, answered(back[-1], api_key, version)


def produce(topics, version: int = 9, acks: int = -1, records: Any = b"x"):
    cls = body_class(PRODUCE, "request")
    return cls(acks=acks, timeout_ms=1000, topic_data=[
        cls.TopicProduceData(name=t, partition_data=[cls.PartitionProduceData(index=p, records=records)
                                                    for p in (0, 1)]) for t in topics])


def produce_codes(resp) -> dict[str, list[int]]:
    return {t.name: [p.error_code for p in t.partition_responses] for t in resp.body.responses}


# -- per-topic refusals ------------------------------------------------------------------------------


def test_produce_writes_the_allowed_topic_and_fails_only_the_refused_one(tmp_path):
    s = session(policy_filter(tmp_path, DENY_SECRETS))
    up, resp = roundtrip(s, PRODUCE, 9, produce(["orders", "secret-x"]))
    assert [t.name for t in up.body.topic_data] == ["orders"]
    assert produce_codes(resp) == {"orders": [0, 0], "secret-x": [29, 29]}


def test_a_request_refused_entirely_never_reaches_the_broker(tmp_path):
    s = session(policy_filter(tmp_path, DENY_SECRETS))
    acts = send(s, PRODUCE, 9, produce(["secret-x", "secret-y"]))
    assert [type(a) for a in acts] == [ToClient]
    assert produce_codes(answered(acts[0], PRODUCE, 9)) == {"secret-x": [29, 29], "secret-y": [29, 29]}
    assert acts[0].done[0].notes == {"rule": "no-secrets", "action": "deny"}


def test_different_errors_for_different_topics_are_answered_together(tmp_path):
    rules = DENY_SECRETS + "  - {name: legacy, match: {topic: 'old-*'}, action: deny, deny: {error: POLICY_VIOLATION}}\n"
    rules = rules.replace("rules: [", "rules:\n  - ").replace("deny}]\n", "deny}\n", 1)
    s = session(policy_filter(tmp_path, rules))
    acts = send(s, PRODUCE, 9, produce(["secret-x", "old-y"]))
    assert produce_codes(answered(acts[0], PRODUCE, 9)) == {"secret-x": [29, 29], "old-y": [44, 44]}


def test_an_acks_0_produce_with_a_refused_topic_closes_like_a_broker(tmp_path):
    s = session(policy_filter(tmp_path, DENY_SECRETS))
    acts = send(s, PRODUCE, 9, produce(["orders", "secret-x"], acks=0))
    assert [type(a) for a in acts] == [Close]


@pytest.mark.parametrize("version", [12, 13])
def test_fetch_reads_the_allowed_topic_and_fails_only_the_refused_one(tmp_path, version):
    ids = TopicNames()
    ids.learn([body_class(METADATA, "response").MetadataResponseTopic(name=n, topic_id=i)
               for n, i in (("orders", ID_A), ("secret-x", ID_B))])
    s = session(policy_filter(tmp_path, DENY_SECRETS, topic_ids=ids))
    cls = body_class(FETCH, "request")
    key = "topic" if version < 13 else "topic_id"
    body = cls(max_wait_ms=500, topics=[
        cls.FetchTopic(**{key: t}, partitions=[cls.FetchPartition(partition=0, partition_max_bytes=1 << 20)])
        for t in (("orders", "secret-x") if version < 13 else (ID_A, ID_B))])
    up, resp = roundtrip(s, FETCH, version, body)
    assert [getattr(t, key) for t in up.body.topics] == (["orders"] if version < 13 else [ID_A])
    got = {getattr(t, key): [p.error_code for p in t.partitions] for t in resp.body.responses}
    assert got == ({"orders": [0], "secret-x": [29]} if version < 13 else {ID_A: [0], ID_B: [29]})
    assert resp.body.error_code == 0


def metadata(names):
    cls = body_class(METADATA, "request")
    return cls(topics=None if names is None else [cls.MetadataRequestTopic(name=n) for n in names])


def metadata_answer(names):
    cls = body_class(METADATA, "response")
    return cls(brokers=[cls.MetadataResponseBroker(node_id=1, host="kafka", port=9092)],
               topics=[cls.MetadataResponseTopic(name=n, topic_id=uuid.uuid5(uuid.NAMESPACE_DNS, n))
                       for n in names])


def test_metadata_naming_a_refused_topic_returns_it_with_the_error(tmp_path):
    s = session(policy_filter(tmp_path, DENY_SECRETS))
    up, resp = roundtrip(s, METADATA, 12, metadata(["orders", "secret-x"]), answer=metadata_answer(["orders"]))
    assert [t.name for t in up.body.topics] == ["orders"]
    assert {t.name: t.error_code for t in resp.body.topics} == {"orders": 0, "secret-x": 29}
    # Every topic refused: the broker is still asked (for the brokers), about no topic at all; a
    # broker that reads that as "every topic" (tansu) has its extra topics dropped.
    up, resp = roundtrip(s, METADATA, 12, metadata(["secret-x"]), answer=metadata_answer(["orders", "secret-x"]))
    assert up.body.topics == [] and len(resp.body.brokers) == 1
    assert [(t.name, t.error_code) for t in resp.body.topics] == [("secret-x", 29)]


def test_metadata_for_all_topics_hides_the_refused_ones(tmp_path):
    s = session(policy_filter(tmp_path, DENY_SECRETS))
    up, resp = roundtrip(s, METADATA, 12, metadata(None), answer=metadata_answer(["a", "secret-x", "b"]))
    assert up.body.topics is None
    assert [t.name for t in resp.body.topics] == ["a", "b"]


def test_metadata_v0_with_every_topic_refused_is_answered_locally(tmp_path):
    # v0 reads an empty topic list as "all topics", so nothing may be forwarded.
    s = session(policy_filter(tmp_path, DENY_SECRETS))
    acts = send(s, METADATA, 0, metadata(["secret-x"]))
    assert [type(a) for a in acts] == [ToClient]


def test_create_topics_creates_the_allowed_ones_only(tmp_path):
    s = session(policy_filter(tmp_path, DENY_SECRETS))
    cls = body_class(CREATE_TOPICS, "request")
    body = cls(topics=[cls.CreatableTopic(name=n, num_partitions=1, replication_factor=1)
                       for n in ("orders", "secret-x")], timeout_ms=1000)
    up, resp = roundtrip(s, CREATE_TOPICS, 7, body)
    assert [t.name for t in up.body.topics] == ["orders"]
    assert {t.name: t.error_code for t in resp.body.topics} == {"orders": 0, "secret-x": 29}


@pytest.mark.parametrize("version", [5, 6])
def test_delete_topics_deletes_the_allowed_ones_only(tmp_path, version):
    s = session(policy_filter(tmp_path, DENY_SECRETS))
    cls = body_class(DELETE_TOPICS, "request")
    if version < 6:
        body = cls(topic_names=["orders", "secret-x"], timeout_ms=1000)
    else:
        body = cls(topics=[cls.DeleteTopicState(name=n) for n in ("orders", "secret-x")], timeout_ms=1000)
    up, resp = roundtrip(s, DELETE_TOPICS, version, body)
    sent = up.body.topic_names if version < 6 else [t.name for t in up.body.topics]
    assert sent == ["orders"]
    assert {t.name: t.error_code for t in resp.body.responses} == {"orders": 0, "secret-x": 29}


def test_offset_commit_commits_the_allowed_topics_only(tmp_path):
    s = session(policy_filter(tmp_path, DENY_SECRETS))
    cls = body_class(OFFSET_COMMIT, "request")
    body = cls(group_id="g", generation_id_or_member_epoch=1, member_id="m", topics=[
        cls.OffsetCommitRequestTopic(name=n, partitions=[
            cls.OffsetCommitRequestPartition(partition_index=0, committed_offset=5)]) for n in ("orders", "secret-x")])
    up, resp = roundtrip(s, OFFSET_COMMIT, 8, body)
    assert [t.name for t in up.body.topics] == ["orders"] and up.body.group_id == "g"
    assert {t.name: [p.error_code for p in t.partitions] for t in resp.body.topics} == {
        "orders": [0], "secret-x": [29]}


# -- requirements, caps ------------------------------------------------------------------------------


def test_acks_1_is_refused_per_partition_and_acks_all_goes_through(tmp_path):
    s = session(policy_filter(tmp_path, "rules: [{name: acks, match: {api: produce}, action: require, "
                                        "require: {acks: all}}]\n"))
    acts = send(s, PRODUCE, 9, produce(["a", "b"], acks=1))
    assert produce_codes(answered(acts[0], PRODUCE, 9)) == {"a": [21, 21], "b": [21, 21]}
    assert INVALID_REQUIRED_ACKS == 21
    assert isinstance(send(s, PRODUCE, 9, produce(["a"], acks=-1), correlation_id=8)[0], ToUpstream)


def test_compression_and_batch_size_are_read_from_batch_headers(tmp_path):
    s = session(policy_filter(tmp_path, "rules: [{name: z, action: require, require: "
                                        "{compression: [zstd, lz4], max_batch_bytes: 4000, "
                                        "uncompressed_max_bytes: 100}}]\n"))
    small_lz4 = bytes(build_batch([(None, b"v" * 100)], compression=3))
    big_lz4 = bytes(build_batch([(None, random.Random(1).randbytes(5000))], compression=3))
    plain = bytes(build_batch([(None, b"v" * 100)]))
    tiny = bytes(build_batch([(None, b"v")]))
    assert len(tiny) <= 100 < len(plain)
    broker_answers(s, forwarded(send(s, PRODUCE, 9, produce(["a"], records=small_lz4))[0]))
    broker_answers(s, forwarded(send(s, PRODUCE, 9, produce(["a"], records=tiny), correlation_id=8)[0]))
    for records in (plain, big_lz4):
        acts = send(s, PRODUCE, 9, produce(["a"], records=records), correlation_id=9)
        assert produce_codes(answered(acts[0], PRODUCE, 9)) == {"a": [POLICY_VIOLATION] * 2}


def test_caps_lower_fetch_and_produce_limits(tmp_path):
    s = session(policy_filter(tmp_path, "rules: [{name: c, action: cap, cap: {max_bytes: 1000, "
                                        "partition_max_bytes: 100, max_wait_ms: 50, timeout_ms: 2000}}]\n"))
    cls = body_class(FETCH, "request")
    body = cls(max_wait_ms=500, max_bytes=1 << 20, topics=[cls.FetchTopic(topic="t", partitions=[
        cls.FetchPartition(partition=0, partition_max_bytes=1 << 20),
        cls.FetchPartition(partition=1, partition_max_bytes=10)])])
    up = forwarded(send(s, FETCH, 12, body)[0])
    assert (up.body.max_wait_ms, up.body.max_bytes) == (50, 1000)
    assert [p.partition_max_bytes for p in up.body.topics[0].partitions] == [100, 10]
    p = produce(["t"])
    p.timeout_ms = 30000
    assert forwarded(send(s, PRODUCE, 9, p, correlation_id=8)[0]).body.timeout_ms == 2000


# -- tenants -------------------------------------------------------------------------------------------


def test_a_tenant_writes_prefixed_names_and_reads_them_back_without(tmp_path):
    s = session(policy_filter(tmp_path, TENANTS))
    up, resp = roundtrip(s, PRODUCE, 9, produce(["orders", "secret-x"]), client_id="team-a-1")
    assert [t.name for t in up.body.topic_data] == ["tenant-a.orders"]
    assert produce_codes(resp) == {"orders": [0, 0], "secret-x": [29, 29]}
    assert resp is not None
    up, resp = roundtrip(s, METADATA, 12, metadata(None), client_id="team-a-1",
                         answer=metadata_answer(["tenant-a.orders", "tenant-b.orders", "plain", "tenant-a.x"]))
    assert [t.name for t in resp.body.topics] == ["orders", "x"]


def test_a_tenant_cannot_change_acls_or_subscribe_by_pattern(tmp_path):
    s = session(policy_filter(tmp_path, TENANTS))
    cls = body_class(CREATE_ACLS, "request")
    body = cls(creations=[cls.AclCreation(resource_type=2, resource_name="*", resource_pattern_type=3,
                                          principal="User:x", host="*", operation=2, permission_type=3)])
    acts = send(s, CREATE_ACLS, 3, body, client_id="team-a-1")
    assert answered(acts[0], CREATE_ACLS, 3).body.results[0].error_code == CLUSTER_AUTHORIZATION_FAILED
    assert pattern_fields(CONSUMER_GROUP_HEARTBEAT, 1) == ((("subscribed_topic_regex", False),),)
    hb = body_class(CONSUMER_GROUP_HEARTBEAT, "request")(group_id="g", member_id="m", member_epoch=0,
                                                         subscribed_topic_regex="orders.*")
    acts = send(s, CONSUMER_GROUP_HEARTBEAT, 1, hb, client_id="team-a-1", correlation_id=9)
    resp = answered(acts[0], CONSUMER_GROUP_HEARTBEAT, 1)
    assert resp.body.error_code == 128 and "tenant prefix" in resp.body.error_message


def test_a_lost_broker_connection_answers_a_tenant_in_its_own_names(tmp_path):
    s = session(policy_filter(tmp_path, TENANTS))
    acts = send(s, PRODUCE, 9, produce(["orders"]), client_id="team-a-1")
    assert forwarded(acts[0]).body.topic_data[0].name == "tenant-a.orders"
    (out,) = s.upstream_lost("test")
    resp = answered(out, PRODUCE, 9)
    assert produce_codes(resp) == {"orders": [NOT_LEADER_OR_FOLLOWER] * 2}


def test_find_coordinator_keys_follow_their_key_type(tmp_path):
    s = session(policy_filter(tmp_path, TENANTS))
    cls = body_class(FIND_COORDINATOR, "request")
    rcls = body_class(FIND_COORDINATOR, "response")
    for key_type in (0, 1):
        acts = send(s, FIND_COORDINATOR, 4, cls(key_type=key_type, coordinator_keys=["k"]), client_id="team-a-1")
        up = forwarded(acts[0])
        assert up.body.coordinator_keys == ["tenant-a.k"]
        back = broker_answers(s, up, rcls(coordinators=[rcls.Coordinator(key="tenant-a.k", node_id=1, host="h",
                                                                         port=1)]))
        assert answered(back[0], FIND_COORDINATOR, 4).body.coordinators[0].key == "k"


# Every API and version whose request or response carries a topic, group or transactional id, built
# with a value at every place the schema marks: the tenant's prefix must go on every one of them in
# the request and come off every one in the response. A new API with such a field is covered (and
# fails here if the filter misses it) without touching this test.

TYPE_CODE_FOR = {k: {e: c for c, e in codes.items()} for k, codes in entities.TYPE_CODES.items()}
PREFIX = {"topic": "tenant-a.", "group": "tenant-a.", "txn": "tenant-a."}


def full_body(api_key: int, version: int, kind: str, entity: str, value: str) -> Any:
    """A body with one element in every array and a value (``value`` + a number) at every name."""
    msg = getattr(apis()[api_key], kind)
    root = message_class(msg)
    counter = iter(range(10_000))

    def make(spec: StructSpec) -> Any:
        cls = root if spec is msg.root else getattr(root, spec.name)
        kw: dict[str, Any] = {}
        for f in spec.fields:
            if version not in f.versions:
                continue
            if f.struct is not None:
                one = make(f.struct)
                kw[f.name] = [one] if f.array else one
            elif f.type == "string" and f.entity is not None:
                names = [f"{value}{next(counter)}" for _ in range(2 if f.array else 1)]
                kw[f.name] = names if f.array else names[0]
            elif f.type in ("records", "bytes") and not f.array:
                kw[f.name] = b""
        for f in spec.fields:
            if version in f.versions and f.entity in RESOURCE_KINDS:
                code = TYPE_CODE_FOR[f.entity].get(entity)
                if code is not None:
                    kw[resource_type_field(f.name)] = code
        if spec is msg.root and kind == "request":
            if api_key == FIND_COORDINATOR and "key_type" in {f.name for f in spec.fields if version in f.versions}:
                kw["key_type"] = TYPE_CODE_FOR["coordinator_key"].get(entity, 0)
            if api_key == PRODUCE:
                kw["acks"] = -1
        return cls(**kw)

    return make(msg.root)


def _rewrite_cases():
    out = []
    for key, api in sorted(apis().items()):
        lo, hi = supported_versions()[key]
        for v in range(lo, hi + 1):
            for entity in ("topic", "group", "txn"):
                if any(entities.has_entity(key, v, kind, entity) for kind in ("request", "response")):
                    out.append(pytest.param(key, v, entity, id=f"{api.name}-v{v}-{entity}"))
    return out


@pytest.mark.parametrize(("api_key", "version", "entity"), _rewrite_cases())
def test_every_api_carrying_a_name_is_prefixed_and_unprefixed(tmp_path, api_key, version, entity):
    s = session(PolicyFilter(FixedRules(_TENANT_POLICY), random.Random(1)))
    # The client id comes with a first request (header v0 requests carry none of their own).
    av = forwarded(send(s, 18, 3, body_class(18, "request")(), client_id="team-a-1", correlation_id=1)[0])
    broker_answers(s, av, body_class(18, "response")())
    request = full_body(api_key, version, "request", entity, "n")
    sent = entities.collect(request, api_key, version, "request", entity)
    acts = send(s, api_key, version, request, client_id="team-a-1")
    if api_key == CREATE_ACLS or api_key == 31:
        assert [type(a) for a in acts] == [ToClient]       # tenants may not change ACLs
        return
    up = forwarded(acts[0])
    got = entities.collect(up.body, api_key, version, "request", entity)
    assert got == [PREFIX[entity] + v for v in sent]
    answer = full_body(api_key, version, "response", entity, PREFIX[entity] + "r")
    theirs = entities.collect(answer, api_key, version, "response", entity, up.body)
    if api_key == PRODUCE and up.body.acks == 0:
        return
    back = broker_answers(s, up, answer)
    resp = answered(back[-1], api_key, version)
    mine = entities.collect(resp.body, api_key, version, "response", entity, up.body)
    assert mine == [v[len(PREFIX[entity]):] for v in theirs]


_TENANT_POLICY: Any = None


@pytest.fixture(autouse=True, scope="module")
def _tenant_policy(tmp_path_factory):
    global _TENANT_POLICY
    from kproxy.policy.engine import Policy

    d = tmp_path_factory.mktemp("tenant")
    _TENANT_POLICY = Policy(load_rules([write_rules(d, TENANTS)]))


# -- topic ids -------------------------------------------------------------------------------------


def fetch_by_id(*ids):
    cls = body_class(FETCH, "request")
    return cls(max_wait_ms=0, topics=[cls.FetchTopic(topic_id=i, partitions=[cls.FetchPartition(partition=0)])
                                      for i in ids])


def metadata_by_id_answer(known: dict[uuid.UUID, str], asked):
    cls = body_class(METADATA, "response")
    return cls(brokers=[], topics=[
        cls.MetadataResponseTopic(name=known.get(t.topic_id), topic_id=t.topic_id,
                                  error_code=0 if t.topic_id in known else UNKNOWN_TOPIC_ID)
        for t in asked.body.topics])


def test_an_unknown_topic_id_is_asked_about_before_deciding(tmp_path):
    ids = TopicNames()
    ids.learn([body_class(METADATA, "response").MetadataResponseTopic(name="orders", topic_id=ID_A)])
    s = session(policy_filter(tmp_path, DENY_SECRETS, topic_ids=ids))
    acts = send(s, FETCH, 13, fetch_by_id(ID_A, ID_B, ID_C))
    assert [type(a) for a in acts] == [Ask] and s.asking is not None
    question = decode_request(b"".join(bytes(b) for b in acts[0].buffers)[4:])
    assert (question.api_key, question.api_version) == (METADATA, 12)
    assert [t.topic_id for t in question.body.topics] == [ID_B, ID_C]
    assert question.body.allow_auto_topic_creation is False
    # The broker knows B (a secret) but not C.
    acts = s.upstream_frame(memoryview(response_frame(METADATA, 12, question.correlation_id,
                                                      metadata_by_id_answer({ID_B: "secret-b"}, question))))
    assert s.asking is None and ids.get(ID_B) == "secret-b"
    up = forwarded(acts[0])
    assert [t.topic_id for t in up.body.topics] == [ID_A]
    back = broker_answers(s, up)
    got = {t.topic_id: t.partitions[0].error_code for t in answered(back[0], FETCH, 13).body.responses}
    assert got == {ID_A: 0, ID_B: TOPIC_AUTHORIZATION_FAILED, ID_C: UNKNOWN_TOPIC_ID}


def test_a_known_topic_id_needs_no_question(tmp_path):
    ids = TopicNames()
    s = session(policy_filter(tmp_path, DENY_SECRETS, topic_ids=ids))
    # Learned from a Metadata answer passing through.
    roundtrip(s, METADATA, 12, metadata(["orders"]), answer=metadata_answer(["orders"]))
    oid = uuid.uuid5(uuid.NAMESPACE_DNS, "orders")
    assert ids.get(oid) == "orders"
    broker_answers(s, forwarded(send(s, FETCH, 13, fetch_by_id(oid), correlation_id=9)[0]))
    # And from DescribeTopicPartitions answers.
    cls = body_class(DESCRIBE_TOPIC_PARTITIONS, "request")
    rcls = body_class(DESCRIBE_TOPIC_PARTITIONS, "response")
    roundtrip(s, DESCRIBE_TOPIC_PARTITIONS, 0, cls(topics=[cls.TopicRequest(name="logs")]), correlation_id=10,
              answer=rcls(topics=[rcls.DescribeTopicPartitionsResponseTopic(name="logs", topic_id=ID_C)]))
    assert ids.get(ID_C) == "logs"


@pytest.mark.parametrize("how", ["timeout", "lost"])
def test_an_unanswered_question_refuses_the_unknown_ids(tmp_path, how):
    s = session(policy_filter(tmp_path, DENY_SECRETS))
    acts = send(s, PRODUCE, 13, _produce_by_id(ID_B))
    assert [type(a) for a in acts] == [Ask]
    acts = s.question_unanswered("timed out") if how == "timeout" else s.upstream_lost("gone")
    assert s.asking is None
    resp = answered(acts[-1], PRODUCE, 13)
    assert [(t.topic_id, t.partition_responses[0].error_code) for t in resp.body.responses] == [
        (ID_B, UNKNOWN_TOPIC_ID)]
    # A late answer to the abandoned question is dropped.
    if how == "timeout":
        question_id = 0
        assert s.upstream_frame(memoryview(response_frame(METADATA, 12, question_id, metadata_answer([])))) == []


def _produce_by_id(*ids):
    cls = body_class(PRODUCE, "request")
    return cls(acks=-1, timeout_ms=1000, topic_data=[
        cls.TopicProduceData(topic_id=i, partition_data=[cls.PartitionProduceData(index=0, records=b"x")])
        for i in ids])


def test_a_tenant_cannot_reach_another_namespace_by_topic_id(tmp_path):
    ids = TopicNames()
    ids.learn([body_class(METADATA, "response").MetadataResponseTopic(name=n, topic_id=i)
               for n, i in (("tenant-a.mine", ID_A), ("tenant-b.theirs", ID_B))])
    s = session(policy_filter(tmp_path, TENANTS, topic_ids=ids))
    up, resp = roundtrip(s, FETCH, 13, fetch_by_id(ID_A, ID_B), client_id="team-a-1")
    assert [t.topic_id for t in up.body.topics] == [ID_A]
    assert {t.topic_id: t.partitions[0].error_code for t in resp.body.responses} == {ID_A: 0,
                                                                                    ID_B: UNKNOWN_TOPIC_ID}


def test_the_id_map_is_bounded():
    ids = TopicNames(limit=3)
    cls = body_class(METADATA, "response").MetadataResponseTopic
    ids.learn([cls(name=f"t{n}", topic_id=uuid.UUID(int=n + 1)) for n in range(5)])
    assert len(ids) == 3 and ids.get(uuid.UUID(int=1)) is None and ids.get(uuid.UUID(int=5)) == "t4"


# -- chaos and log -----------------------------------------------------------------------------------


def test_chaos_injects_errors_and_latency_only_when_enabled(tmp_path, caplog):
    rules = """\
        rules:
          - {name: boom, match: {api: produce}, action: chaos, chaos: {error: NOT_LEADER_OR_FOLLOWER}}
          - {name: slow, match: {api: fetch}, action: chaos, chaos: {latency_ms: 50}}
        """
    off = session(policy_filter(tmp_path, rules))
    assert isinstance(send(off, PRODUCE, 9, produce(["a"]))[0], ToUpstream)
    caplog.set_level(logging.INFO, "kproxy.policy")
    on = session(policy_filter(tmp_path, rules, chaos=True))
    acts = send(on, PRODUCE, 9, produce(["a"]))
    assert produce_codes(answered(acts[0], PRODUCE, 9)) == {"a": [NOT_LEADER_OR_FOLLOWER] * 2}
    assert acts[0].done[0].notes["action"] == "chaos"
    cls = body_class(FETCH, "request")
    acts = send(on, FETCH, 12, cls(topics=[cls.FetchTopic(topic="a")]), correlation_id=9)
    assert [type(a) for a in acts] == [Hold, ToUpstream] and acts[0].seconds == pytest.approx(0.05)
    lines = [r.getMessage() for r in caplog.records if r.name == "kproxy.policy"]
    assert lines == ["chaos: rule 'boom': connection 1's produce v9 failed with NOT_LEADER_OR_FOLLOWER",
                     "chaos: rule 'slow': connection 1's fetch v12 delayed by 50 ms"]


def test_chaos_latency_never_exceeds_the_bound(tmp_path):
    from kproxy.policy.model import MAX_LATENCY_S

    # An exponential with a mean at the bound draws above it about a third of the time; two rules on
    # one request add up. Neither holds a request longer than the bound.
    rules = """\
        rules:
          - {name: slow, match: {api: fetch}, action: chaos, chaos: {latency_ms: {mean: 60000}}}
          - {name: slower, match: {api: fetch}, action: chaos, chaos: {latency_ms: 50000}}
        """
    s = session(policy_filter(tmp_path, rules, chaos=True, seed=7))
    cls = body_class(FETCH, "request")
    holds = []
    for cid in range(50):
        acts = send(s, FETCH, 12, cls(topics=[cls.FetchTopic(topic="a")]), correlation_id=cid)
        assert isinstance(acts[0], Hold)
        holds.append(acts[0].seconds)
        broker_answers(s, forwarded(acts[-1]))
    assert max(holds) == MAX_LATENCY_S and min(holds) > 50.0


def test_chaos_rate_follows_the_seeded_generator(tmp_path):
    rules = "rules: [{name: some, action: chaos, chaos: {rate: 0.3, error: REQUEST_TIMED_OUT}}]\n"
    counts = []
    for _ in range(2):
        s = session(policy_filter(tmp_path, rules, chaos=True, seed=42))
        hit = 0
        for cid in range(200):
            acts = send(s, PRODUCE, 9, produce(["a"]), correlation_id=cid)
            if isinstance(acts[0], ToClient):
                hit += 1
            else:
                broker_answers(s, forwarded(acts[0]))
        counts.append(hit)
    assert counts[0] == counts[1] and 35 <= counts[0] <= 85


def test_log_rules_sample_and_never_log_record_contents(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, "kproxy.policy")
    s = session(policy_filter(tmp_path, "rules:\n  - {name: watch, action: log, log: {level: WARNING}}\n"
                                        "  - {name: quiet, action: log, log: {sample: 0}}\n"))
    send(s, PRODUCE, 9, produce(["new\nline"], records=b"SECRET-RECORD"))
    (line,) = [r for r in caplog.records if r.name == "kproxy.policy"]
    assert line.levelno == logging.WARNING
    assert line.getMessage() == ("rule 'watch': connection 1 (client id app, principal User:ANONYMOUS) "
                                 "produce v9 topics new\\nline")


def test_refusals_and_rewrites_are_logged_at_debug_with_the_rule_name(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, "kproxy.policy")
    s = session(policy_filter(tmp_path, TENANTS))
    send(s, PRODUCE, 9, produce(["secret-x"], records=b"SECRET-RECORD"))
    send(s, PRODUCE, 9, produce(["orders"]), client_id="team-a-1", correlation_id=8)
    lines = [r.getMessage() for r in caplog.records if r.name == "kproxy.policy"]
    assert lines == ["connection 1: rule 'no-secrets' refused produce v9 for topics secret-x "
                     "(TOPIC_AUTHORIZATION_FAILED)",
                     "connection 1: rule 'team-a' rewrote produce v9 (topic prefix tenant-a., group prefix "
                     "tenant-a., txn prefix tenant-a.)"]
    assert all(r.levelno == logging.DEBUG for r in caplog.records if r.name == "kproxy.policy")


def test_notes_name_the_deciding_rule(tmp_path):
    s = session(policy_filter(tmp_path, TENANTS + "  - {name: fetchers, match: {api: fetch}, action: allow}\n"))
    acts = send(s, PRODUCE, 9, produce(["o"]), client_id="team-a-1")
    out = broker_answers(s, forwarded(acts[0]))
    assert out[0].done[0].notes == {"rule": "team-a", "action": "rewrite"}
    cls = body_class(FETCH, "request")
    out = broker_answers(s, forwarded(send(s, FETCH, 12, cls(topics=[]), correlation_id=9)[0]))
    assert out[0].done[0].notes == {"rule": "fetchers", "action": "allow"}
    out = broker_answers(s, forwarded(send(s, METADATA, 12, metadata([]), correlation_id=10)[0]),
                         metadata_answer([]))
    assert out[0].done[0].notes is None        # the default decided: nothing to note


# -- connection selectors are judged once per connection ----------------------------------------------


def test_connection_selectors_are_judged_once_per_connection_and_rule_set(tmp_path, monkeypatch):
    calls = []
    real = M.Match.holds_for_connection

    def counting(self, *args):
        calls.append(args)
        return real(self, *args)

    monkeypatch.setattr(M.Match, "holds_for_connection", counting)
    f = policy_filter(tmp_path, TENANTS + "  - {name: ten, match: {source: 10.0.0.0/8}, action: allow}\n")
    s = session(f)
    for cid in range(20):
        broker_answers(s, forwarded(send(s, METADATA, 12, metadata(["a"]), correlation_id=cid)[0]))
    assert len(calls) == 3                 # three rules, judged once
    other = session(f, connection_id=2)    # same client, same address: the judgement is shared
    broker_answers(other, forwarded(send(other, METADATA, 12, metadata(["a"]))[0]))
    assert len(calls) == 3
    send(s, METADATA, 12, metadata(["a"]), client_id="team-a-9", correlation_id=99)
    assert len(calls) == 6                 # the client id changed


# -- reloads -------------------------------------------------------------------------------------------


def test_a_reload_replaces_the_rules_whole_for_the_next_request(tmp_path):
    path = write_rules(tmp_path, TENANTS, "live.yaml")
    clock = iter(range(1000, 2000))
    store = RuleStore([path], clock=lambda: float(next(clock)))
    s = session(PolicyFilter(store))
    assert (store.generation, store.rule_count, store.loaded_at) == (1, 2, 1000.0)
    # In flight under the old rules: its answer is still unprefixed after the reload.
    early = forwarded(send(s, PRODUCE, 9, produce(["o"]), client_id="team-a-1")[0])
    assert early.body.topic_data[0].name == "tenant-a.o"
    write_rules(tmp_path, "rules: [{name: nothing-for-a, match: {client_id: 'team-a-*'}, action: deny}]\n",
                "live.yaml")
    assert store.reload("test") is True
    assert (store.generation, store.rule_count, store.reloads_ok) == (2, 1, 1)
    acts = send(s, PRODUCE, 9, produce(["o"]), client_id="team-a-1", correlation_id=8)
    back = broker_answers(s, early, body_class(PRODUCE, "response")(responses=[
        body_class(PRODUCE, "response").TopicProduceResponse(name="tenant-a.o", partition_responses=[])]))
    assert answered(back[0], PRODUCE, 9).body.responses[0].name == "o"
    assert produce_codes(answered(back[1], PRODUCE, 9)) == {"o": [TOPIC_AUTHORIZATION_FAILED] * 2}
    assert acts == []     # its answer waited behind the earlier one


def test_an_invalid_edit_is_rejected_and_the_old_rules_stay(tmp_path, caplog):
    path = write_rules(tmp_path, DENY_SECRETS, "live.yaml")
    store = RuleStore([path])
    write_rules(tmp_path, "rules: [{name: broken, action: dney}]\n", "live.yaml")
    with pytest.raises(RuleError) as info:
        load_rules([path])
    assert store.reload("test") is False
    assert store.last_error == str(info.value) and store.reloads_failed == 1 and store.generation == 1
    assert str(info.value) in caplog.text and "generation 1 (1 rules) stays in force" in caplog.text
    s = session(PolicyFilter(store))
    acts = send(s, PRODUCE, 9, produce(["secret-x"]))
    assert produce_codes(answered(acts[0], PRODUCE, 9)) == {"secret-x": [TOPIC_AUTHORIZATION_FAILED] * 2}
    described = store.describe()
    assert described["generation"] == 1 and described["reloads_failed"] == 1
    assert described["rules"] == [{"name": "no-secrets", "action": "deny", "where": f"{path}:1:9"}]


def test_responses_without_pending_work_are_left_alone(tmp_path):
    s = session(policy_filter(tmp_path, DENY_SECRETS))
    body = metadata_answer(["a"])
    _, resp = roundtrip(s, METADATA, 12, metadata(["a"]), answer=body)
    assert resp.body == Response.build(METADATA, 12, 7, body).body


def test_telemetry_names_a_tenants_topic_the_same_by_name_and_by_id(tmp_path):
    """One table of topic names: the policy and telemetry both see the broker's name (with the tenant's
    prefix), whether the client named the topic (Produce v9) or gave its id (Produce v13)."""
    from kproxy.telemetry.exchange import Exchange, Learned

    ids = TopicNames()
    learned = Learned(topic_names=ids)
    s = session(policy_filter(tmp_path, TENANTS, topic_ids=ids))
    # A Metadata answer passing through teaches the id of tenant-a.orders (the broker's name) ...
    roundtrip(s, METADATA, 12, metadata(["orders"]), client_id="team-a-1",
              answer=metadata_answer(["tenant-a.orders"]), correlation_id=1)
    oid = uuid.uuid5(uuid.NAMESPACE_DNS, "tenant-a.orders")
    assert ids.get(oid) == "tenant-a.orders"
    names = []
    for version, body in ((9, produce(["orders"])), (13, _produce_by_id(oid))):
        acts = send(s, PRODUCE, version, body, client_id="team-a-1", correlation_id=version)
        done = broker_answers(s, forwarded(acts[-1]))[-1].done[0]
        names.append(Exchange(done, s.ctx, learned).topics)
    assert names == [["tenant-a.orders"], ["tenant-a.orders"]]


def test_an_answer_the_rules_and_quotas_leave_alone_is_the_brokers_bytes(tmp_path):
    from kproxy.quota.engine import QuotaFilter

    from .rulebook import rule_set
    from .test_session import _two_byte_tag_count

    text = ("rules:\n  - {name: audit, match: {topic: 'orders*'}, action: log}\n"
            "quotas:\n  - {name: roomy, match: {client_id: app}, produce_bytes_per_s: 1000000000}\n")
    store = FixedRules.of(rule_set(tmp_path, text))
    s = session(PolicyFilter(store, random.Random(1)), QuotaFilter(store))
    (up,) = [a for a in send(s, PRODUCE, 10, produce(["orders"], version=10)) if isinstance(a, ToUpstream)]
    rs = body_class(PRODUCE, "response")
    body = rs(responses=[rs.TopicProduceResponse(name="orders", partition_responses=[
        rs.PartitionProduceResponse(index=0, base_offset=5)])])
    reply = _two_byte_tag_count(response_frame(PRODUCE, 10, forwarded(up).correlation_id, body))
    (out,) = s.upstream_frame(memoryview(reply))
    assert isinstance(out, ToClient)
    sent = b"".join(bytes(b) for b in out.buffers)[4:]
    assert sent == (7).to_bytes(4, "big") + reply[4:]        # the broker's own bytes, correlation id patched


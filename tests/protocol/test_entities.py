"""kproxy.protocol.entities: collect, rewrite and filter the topics, groups, transactional ids, node
ids and producer ids of real message bodies, and the classifications read from the schema."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kproxy.protocol import compiler, entities
from kproxy.protocol.compiler import get_codec, join_parts, message_class
from kproxy.protocol.messages import apis, body_class
from kproxy.protocol.schema import MessageSpec

from .strategies import message_strategy

U1, U2, U3 = (uuid.UUID(int=n) for n in (0x11, 0x22, 0x33))


def build(api_key: int, kind: str, version: int, data: dict[str, Any]) -> Any:
    """A body of the API's request or response built from nested dicts and lists."""
    msg: MessageSpec = getattr(apis()[api_key], kind)
    root = message_class(msg)

    def make(cls: type, d: dict[str, Any]) -> Any:
        kw = {}
        for f in cls._spec.fields:  # type: ignore[attr-defined]
            if f.name not in d:
                continue
            value = d[f.name]
            if f.struct is not None and value is not None:
                sub = root if f.struct is msg.root else getattr(root, f.struct.name)
                value = [make(sub, x) for x in value] if f.array else make(sub, value)
            kw[f.name] = value
        return cls(**kw)

    body = make(root, data)
    body._version = version
    return body


def encode(api_key: int, kind: str, version: int, body: Any) -> bytes:
    codec = get_codec(getattr(apis()[api_key], kind), version)
    out, ins = bytearray(), []
    compiler.encode_to(codec, body, out, ins)
    return bytes(join_parts(out, ins))


def _add(v: str) -> str:
    return "t." + v


def _strip(v: str) -> str | None:
    assert v.startswith("t."), v
    return v[2:]


# (name, api key, kind, version, body, request body or None, {entity: values collect must find})
CASES: list[tuple[str, int, str, int, dict, dict | None, dict[str, list]]] = [
    ("produce request", 0, "request", 9,
     {"transactional_id": "tx-1", "acks": -1, "timeout_ms": 30000,
      "topic_data": [{"name": "orders", "partition_data": [{"index": 0, "records": None}]},
                     {"name": "payments", "partition_data": [{"index": 3, "records": b"abc"}]}]},
     None, {"topic": ["orders", "payments"], "txn": ["tx-1"], "group": [], "topic_id": []}),
    ("produce response", 0, "response", 9,
     {"responses": [{"name": "orders", "partition_responses": [{"index": 0, "base_offset": 7}]}]},
     None, {"topic": ["orders"], "broker": []}),
    ("produce v13 by topic id", 0, "request", 13,
     {"transactional_id": None, "topic_data": [{"topic_id": U1, "partition_data": [{"index": 0}]}]},
     None, {"topic": [], "topic_id": [U1], "txn": []}),
    ("produce v10 response leaders", 0, "response", 10,
     {"responses": [{"name": "orders", "partition_responses": [
         {"index": 0, "current_leader": {"leader_id": 2, "leader_epoch": 5}}]}],
      "node_endpoints": [{"node_id": 2, "host": "b2", "port": 9092}]},
     None, {"topic": ["orders"], "broker": [2, 2]}),
    ("fetch request", 1, "request", 12,
     {"replica_id": -1, "max_wait_ms": 500,
      "topics": [{"topic": "orders", "partitions": [{"partition": 0, "fetch_offset": 10}]}],
      "forgotten_topics_data": [{"topic": "old", "partitions": [1, 2]}], "rack_id": "r1"},
     None, {"topic": ["orders", "old"], "broker": [-1]}),
    ("fetch response", 1, "response", 12,
     {"responses": [{"topic": "orders", "partitions": [
         {"partition_index": 0, "preferred_read_replica": 2, "records": None,
          "aborted_transactions": [{"producer_id": 77, "first_offset": 3}]}]}]},
     None, {"topic": ["orders"], "broker": [-1, 2], "producer": [77]}),  # current_leader -1: none
    ("fetch v13 request by topic id", 1, "request", 13,
     {"topics": [{"topic_id": U1, "partitions": [{"partition": 0}]}],
      "forgotten_topics_data": [{"topic_id": U2, "partitions": [0]}]},
     None, {"topic": [], "topic_id": [U1, U2]}),
    ("metadata request", 3, "request", 12,
     {"topics": [{"name": "orders"}, {"name": None, "topic_id": U1}]},
     None, {"topic": ["orders"], "topic_id": [uuid.UUID(int=0), U1]}),
    ("metadata response", 3, "response", 12,
     {"brokers": [{"node_id": 1, "host": "b1", "port": 9092}, {"node_id": 2, "host": "b2", "port": 9092}],
      "cluster_id": "c", "controller_id": 1,
      "topics": [{"name": "orders", "topic_id": U1, "partitions": [
          {"partition_index": 0, "leader_id": 1, "replica_nodes": [1, 2], "isr_nodes": [1],
           "offline_replicas": [2]}]}]},
     None, {"topic": ["orders"], "topic_id": [U1], "broker": [1, 2, 1, 1, 1, 2, 1, 2]}),
    ("list offsets request", 2, "request", 7,
     {"replica_id": -1, "isolation_level": 1,
      "topics": [{"name": "orders", "partitions": [{"partition_index": 0, "timestamp": -1}]}]},
     None, {"topic": ["orders"], "broker": [-1]}),
    ("list offsets response", 2, "response", 7,
     {"topics": [{"name": "orders", "partitions": [{"partition_index": 0, "offset": 9}]}]},
     None, {"topic": ["orders"]}),
    ("offset commit request", 8, "request", 8,
     {"group_id": "g1", "generation_id_or_member_epoch": 3, "member_id": "m",
      "topics": [{"name": "orders", "partitions": [{"partition_index": 0, "committed_offset": 5}]}]},
     None, {"group": ["g1"], "topic": ["orders"]}),
    ("offset commit response", 8, "response", 8,
     {"topics": [{"name": "orders", "partitions": [{"partition_index": 0}]}]},
     None, {"topic": ["orders"], "group": []}),
    ("offset fetch v8 request", 9, "request", 8,
     {"groups": [{"group_id": "g1", "topics": [{"name": "orders", "partition_indexes": [0, 1]}]},
                 {"group_id": "g2", "topics": None}]},
     None, {"group": ["g1", "g2"], "topic": ["orders"]}),
    ("offset fetch v8 response", 9, "response", 8,
     {"groups": [{"group_id": "g1", "topics": [{"name": "orders", "partitions": [
         {"partition_index": 0, "committed_offset": 4, "metadata": None}]}]}]},
     None, {"group": ["g1"], "topic": ["orders"]}),
    ("offset fetch v3 request", 9, "request", 3,
     {"group_id": "g1", "topics": None},
     None, {"group": ["g1"], "topic": []}),
    ("create topics request", 19, "request", 5,
     {"topics": [{"name": "orders", "num_partitions": -1, "replication_factor": -1,
                  "assignments": [{"partition_index": 0, "broker_ids": [1, 2]}],
                  "configs": [{"name": "cleanup.policy", "value": "compact"}]}], "timeout_ms": 1000},
     None, {"topic": ["orders"], "broker": [1, 2]}),
    ("create topics response", 19, "response", 7,
     {"topics": [{"name": "orders", "topic_id": U1, "num_partitions": 3, "configs": None}]},
     None, {"topic": ["orders"], "topic_id": [U1]}),
    ("delete topics v4 request", 20, "request", 4,
     {"topic_names": ["a", "b"], "timeout_ms": 1000},
     None, {"topic": ["a", "b"]}),
    ("delete topics v6 request", 20, "request", 6,
     {"topics": [{"name": "a", "topic_id": uuid.UUID(int=0)}, {"name": None, "topic_id": U2}]},
     None, {"topic": ["a"], "topic_id": [uuid.UUID(int=0), U2]}),
    ("delete topics response", 20, "response", 6,
     {"responses": [{"name": "a", "topic_id": U1}, {"name": None, "topic_id": U2}]},
     None, {"topic": ["a"]}),
    ("describe configs request", 32, "request", 4,
     {"resources": [{"resource_type": 2, "resource_name": "orders", "configuration_keys": None},
                    {"resource_type": 4, "resource_name": "1", "configuration_keys": ["x"]},
                    {"resource_type": 32, "resource_name": "g1", "configuration_keys": None},
                    {"resource_type": 16, "resource_name": "metrics", "configuration_keys": None}]},
     None, {"topic": ["orders"], "broker": ["1"], "group": ["g1"], "txn": []}),
    ("describe configs response", 32, "response", 4,
     {"results": [{"resource_type": 2, "resource_name": "orders", "error_message": None, "configs": [
         {"name": "retention.ms", "value": "1", "documentation": None}]},
                  {"resource_type": 8, "resource_name": "2", "error_message": None, "configs": []}]},
     None, {"topic": ["orders"], "broker": ["2"]}),
    ("describe acls request", 29, "request", 3,
     {"resource_type_filter": 5, "resource_name_filter": "tx-1", "principal_filter": None,
      "host_filter": None},
     None, {"txn": ["tx-1"], "topic": [], "group": []}),
    ("describe acls response", 29, "response", 3,
     {"error_message": None, "resources": [
         {"resource_type": 2, "resource_name": "orders", "acls": []},
         {"resource_type": 3, "resource_name": "g1", "acls": []},
         {"resource_type": 4, "resource_name": "kafka-cluster", "acls": []}]},
     None, {"topic": ["orders"], "group": ["g1"], "txn": []}),
    ("join group request", 11, "request", 9,
     {"group_id": "g1", "session_timeout_ms": 10000, "rebalance_timeout_ms": 30000, "member_id": "",
      "group_instance_id": None, "protocol_type": "consumer",
      "protocols": [{"name": "range", "metadata": b"\x00\x01"}], "reason": None},
     None, {"group": ["g1"], "topic": []}),
    ("sync group request", 14, "request", 5,
     {"group_id": "g1", "generation_id": 1, "member_id": "m", "protocol_type": "consumer",
      "protocol_name": "range", "assignments": [{"member_id": "m", "assignment": b""}]},
     None, {"group": ["g1"]}),
    ("find coordinator v0 request", 10, "request", 0, {"key": "g1"}, None, {"group": ["g1"], "txn": []}),
    ("find coordinator v3 txn request", 10, "request", 3, {"key": "tx-1", "key_type": 1},
     None, {"group": [], "txn": ["tx-1"]}),
    ("find coordinator v4 request", 10, "request", 4,
     {"key_type": 0, "coordinator_keys": ["g1", "g2"]}, None, {"group": ["g1", "g2"], "txn": []}),
    ("find coordinator v4 response", 10, "response", 4,
     {"coordinators": [{"key": "tx-1", "node_id": 3, "host": "b3", "port": 9092, "error_message": None}]},
     {"key_type": 1, "coordinator_keys": ["tx-1"]}, {"txn": ["tx-1"], "group": [], "broker": [3]}),
    ("add partitions to txn v4 request", 24, "request", 4,
     {"transactions": [{"transactional_id": "tx-1", "producer_id": 5, "producer_epoch": 0,
                        "verify_only": False, "topics": [{"name": "orders", "partitions": [0, 1]}]}]},
     None, {"txn": ["tx-1"], "topic": ["orders"], "producer": [5]}),
    ("add partitions to txn v3 request", 24, "request", 3,
     {"v3_and_below_transactional_id": "tx-1", "v3_and_below_producer_id": 5,
      "v3_and_below_topics": [{"name": "orders", "partitions": [0]}]},
     None, {"txn": ["tx-1"], "topic": ["orders"], "producer": [5]}),
    ("add partitions to txn v4 response", 24, "response", 4,
     {"results_by_transaction": [{"transactional_id": "tx-1", "topic_results": [
         {"name": "orders", "results_by_partition": [{"partition_index": 0}]}]}]},
     None, {"txn": ["tx-1"], "topic": ["orders"]}),
    ("txn offset commit request", 28, "request", 3,
     {"transactional_id": "tx-1", "group_id": "g1", "producer_id": 5, "producer_epoch": 1,
      "generation_id": 2, "member_id": "m", "group_instance_id": None,
      "topics": [{"name": "orders", "partitions": [{"partition_index": 0, "committed_metadata": None}]}]},
     None, {"txn": ["tx-1"], "group": ["g1"], "topic": ["orders"], "producer": [5]}),
    ("describe topic partitions request", 75, "request", 0,
     {"topics": [{"name": "orders"}, {"name": "payments"}], "response_partition_limit": 10,
      "cursor": {"topic_name": "orders", "partition_index": 4}},
     None, {"topic": ["orders", "payments", "orders"]}),
    ("describe topic partitions response", 75, "response", 0,
     {"topics": [{"name": "orders", "topic_id": U1, "partitions": [
         {"partition_index": 0, "leader_id": 1, "replica_nodes": [1], "isr_nodes": [1],
          "eligible_leader_replicas": None, "last_known_elr": None, "offline_replicas": []}]}],
      "next_cursor": {"topic_name": "payments", "partition_index": 0}},
     None, {"topic": ["orders", "payments"], "topic_id": [U1], "broker": [1, 1, 1]}),
    ("share fetch request", 78, "request", 1,
     {"group_id": "sg", "member_id": "m", "share_session_epoch": 0, "max_wait_ms": 500,
      "topics": [{"topic_id": U1, "partitions": [{"partition_index": 0, "acknowledgement_batches": []}]}],
      "forgotten_topics_data": [{"topic_id": U2, "partitions": [1]}]},
     None, {"group": ["sg"], "topic_id": [U1, U2], "topic": []}),
    ("share fetch response", 78, "response", 1,
     {"error_message": None, "responses": [{"topic_id": U1, "partitions": [
         {"partition_index": 0, "error_message": None, "acknowledge_error_message": None,
          "current_leader": {"leader_id": 1, "leader_epoch": 2}, "records": b"",
          "acquired_records": []}]}],
      "node_endpoints": [{"node_id": 1, "host": "b1", "port": 9092, "rack": None}]},
     None, {"topic_id": [U1], "broker": [1, 1]}),
    ("consumer group heartbeat request", 68, "request", 0,
     {"group_id": "g1", "member_id": "m", "member_epoch": 0, "instance_id": None, "rack_id": None,
      "rebalance_timeout_ms": 30000, "subscribed_topic_names": ["orders", "payments"],
      "server_assignor": None, "topic_partitions": [{"topic_id": U1, "partitions": [0]}]},
     None, {"group": ["g1"], "topic": ["orders", "payments"], "topic_id": [U1]}),
    ("consumer group heartbeat response", 68, "response", 0,
     {"error_message": None, "member_id": "m", "member_epoch": 1, "heartbeat_interval_ms": 3000,
      "assignment": {"topic_partitions": [{"topic_id": U1, "partitions": [0, 1]}]}},
     None, {"topic_id": [U1], "group": []}),
    ("describe groups request", 15, "request", 5, {"groups": ["g1", "g2"]}, None, {"group": ["g1", "g2"]}),
    ("describe groups response", 15, "response", 5,
     {"groups": [{"group_id": "g1", "group_state": "Stable", "protocol_type": "consumer",
                  "protocol_data": "range", "members": []}]},
     None, {"group": ["g1"]}),
    ("delete groups request", 42, "request", 2, {"groups_names": ["g1", "g2"]}, None, {"group": ["g1", "g2"]}),
    ("delete groups response", 42, "response", 2, {"results": [{"group_id": "g1"}, {"group_id": "g2"}]},
     None, {"group": ["g1", "g2"]}),
    ("list groups response", 16, "response", 4,
     {"groups": [{"group_id": "g1", "protocol_type": "consumer", "group_state": "Empty"}]},
     None, {"group": ["g1"]}),
    ("init producer id request", 22, "request", 4,
     {"transactional_id": "tx-1", "transaction_timeout_ms": 60000, "producer_id": -1, "producer_epoch": -1},
     None, {"txn": ["tx-1"], "producer": [-1]}),
    ("init producer id idempotent request", 22, "request", 4,
     {"transactional_id": None, "transaction_timeout_ms": 60000}, None, {"txn": []}),
    ("init producer id response", 22, "response", 4, {"producer_id": 42, "producer_epoch": 0},
     None, {"producer": [42], "txn": []}),
]


def _request_body(api_key: int, version: int, data: dict | None) -> Any:
    return None if data is None else build(api_key, "request", version, data)


@pytest.mark.parametrize(("api_key", "kind", "version", "data", "req", "expected"),
                         [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_collect_finds_every_value(api_key, kind, version, data, req, expected):
    body = build(api_key, kind, version, data)
    r = _request_body(api_key, version, req)
    for entity, values in expected.items():
        assert entity in entities.ENTITIES
        assert entities.collect(body, api_key, version, kind, entity, r) == values, entity
        assert entities.has_entity(api_key, version, kind, entity) or not values


@pytest.mark.parametrize(("api_key", "kind", "version", "data", "req", "expected"),
                         [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_prefixing_names_and_undoing_it_restores_the_bytes(api_key, kind, version, data, req, expected):
    body = build(api_key, kind, version, data)
    r = _request_body(api_key, version, req)
    original = encode(api_key, kind, version, body)
    names = {e: entities.collect(body, api_key, version, kind, e, r) for e in ("topic", "group", "txn")}
    changed = 0
    for e in names:
        changed += entities.rewrite(body, api_key, version, kind, e, _add, r)
    for e, values in names.items():
        assert entities.collect(body, api_key, version, kind, e, r) == ["t." + v for v in values]
    assert changed == sum(len(v) for v in names.values())
    if changed:
        assert encode(api_key, kind, version, body) != original
    for e in names:
        entities.rewrite(body, api_key, version, kind, e, _strip, r)
    assert encode(api_key, kind, version, body) == original


def test_rewrite_leaves_values_fn_declines():
    body = build(0, "request", 9, CASES[0][4])
    n = entities.rewrite(body, 0, 9, "request", "topic", lambda v: "x" if v == "orders" else None)
    assert n == 1
    assert entities.collect(body, 0, 9, "request", "topic") == ["x", "payments"]


def test_typed_names_change_only_where_their_type_says_so():
    body = build(32, "request", 4, CASES[[c[0] for c in CASES].index("describe configs request")][4])
    entities.rewrite(body, 32, 4, "request", "topic", _add)
    assert [r.resource_name for r in body.resources] == ["t.orders", "1", "g1", "metrics"]
    entities.rewrite(body, 32, 4, "request", "group", _add)
    assert [r.resource_name for r in body.resources] == ["t.orders", "1", "t.g1", "metrics"]


def test_acl_filter_for_any_type_is_not_resolved():
    # ANY (1) matches every resource type at once, so no single entity kind owns the name.
    body = build(29, "request", 3, {"resource_type_filter": 1, "resource_name_filter": "orders",
                                    "principal_filter": None, "host_filter": None})
    assert all(entities.collect(body, 29, 3, "request", e) == [] for e in ("topic", "group", "txn"))


def test_coordinator_key_in_a_response_needs_the_request():
    body = build(10, "response", 4, {"coordinators": [{"key": "g1", "node_id": 1, "host": "h", "port": 1}]})
    with pytest.raises(ValueError, match="pass the request"):
        entities.collect(body, 10, 4, "response", "group")
    group_request = build(10, "request", 4, {"key_type": 0, "coordinator_keys": ["g1"]})
    assert entities.collect(body, 10, 4, "response", "group", group_request) == ["g1"]
    assert entities.collect(body, 10, 4, "response", "txn", group_request) == []
    # The broker ids in it need no request.
    assert entities.collect(body, 10, 4, "response", "broker") == [1]


def test_unknown_entity_api_and_version_are_refused():
    body = build(0, "request", 9, CASES[0][4])
    with pytest.raises(ValueError, match="unknown entity 'topics'"):
        entities.collect(body, 0, 9, "request", "topics")
    with pytest.raises(ValueError, match="unknown api key 9999"):
        entities.collect(body, 9999, 0, "request", "topic")
    with pytest.raises(ValueError, match="no request version 99"):
        entities.collect(body, 0, 99, "request", "topic")
    with pytest.raises(ValueError, match="kind must be"):
        entities.collect(body, 0, 9, "req", "topic")


# ---------------------------------------------------------------------------------------------
# filter_elements


def _metadata_response() -> Any:
    return build(3, "response", 12, {
        "brokers": [{"node_id": 1, "host": "b1", "port": 9092}, {"node_id": 2, "host": "b2", "port": 9092}],
        "controller_id": 1,
        "topics": [
            {"name": name, "topic_id": uuid.UUID(int=i + 1), "partitions": [
                {"partition_index": p, "leader_id": 1 + p % 2, "replica_nodes": [1, 2], "isr_nodes": [1, 2]}
                for p in range(3)]}
            for i, name in enumerate(["orders", "secret.keys", "payments", "secret.audit"])]})


def test_filter_hides_topics_from_a_metadata_response():
    body = _metadata_response()
    removed = entities.filter_elements(body, 3, 12, "response", "topic", lambda n: not n.startswith("secret."))
    assert removed == 2
    data = encode(3, "response", 12, body)
    codec = get_codec(apis()[3].response, 12)
    back, _ = codec.decode_checked(memoryview(data), 0, len(data))
    assert [t.name for t in back.topics] == ["orders", "payments"]
    assert [t.topic_id for t in back.topics] == [uuid.UUID(int=1), uuid.UUID(int=3)]
    assert [b.node_id for b in back.brokers] == [1, 2]
    assert all(len(t.partitions) == 3 for t in back.topics)


def test_filter_removes_the_innermost_array_element():
    body = _metadata_response()
    # Broker 2 hidden: brokers[] loses it, partitions it leads go, and it leaves every replica list.
    removed = entities.filter_elements(body, 3, 12, "response", "broker", lambda n: n != 2)
    assert [b.node_id for b in body.brokers] == [1]
    assert body.controller_id == 1
    assert all(p.leader_id == 1 and p.replica_nodes == [1] and p.isr_nodes == [1]
               for t in body.topics for p in t.partitions)
    assert all([p.partition_index for p in t.partitions] == [0, 2] for t in body.topics)
    assert removed == 1 + 4 * 1 + 4 * 2 * 2


def test_filter_leaves_single_values_outside_arrays():
    body = build(11, "request", 9, {"group_id": "g1", "protocols": [{"name": "range", "metadata": b""}]})
    assert entities.filter_elements(body, 11, 9, "request", "group", lambda g: False) == 0
    assert body.group_id == "g1"


def test_filter_removes_values_from_arrays_of_names():
    body = build(20, "request", 4, {"topic_names": ["a", "secret", "b"], "timeout_ms": 1})
    assert entities.filter_elements(body, 20, 4, "request", "topic", lambda n: n != "secret") == 1
    assert body.topic_names == ["a", "b"]


def test_filter_by_typed_name_keeps_other_types():
    body = build(32, "request", 4, {"resources": [
        {"resource_type": 2, "resource_name": "secret"}, {"resource_type": 4, "resource_name": "secret"}]})
    assert entities.filter_elements(body, 32, 4, "request", "topic", lambda n: n != "secret") == 1
    assert [r.resource_type for r in body.resources] == [4]


# ---------------------------------------------------------------------------------------------
# Every message, random bodies


def _string_entity_cases():
    out = []
    for key, api in sorted(apis().items()):
        for kind in ("request", "response"):
            msg = getattr(api, kind)
            for v in range(msg.versions.lo, msg.versions.hi + 1):
                if any(entities.has_entity(key, v, kind, e) for e in ("topic", "group", "txn")):
                    out.append(pytest.param(key, kind, v, id=f"{api.name}-{kind}-v{v}"))
    return out


def _array_free(body: Any, path: entities.Path) -> list:
    """Values at a path that crosses no array (a reflective walk, independent of the generated code)."""
    obj = body
    for name, _ in path:
        if obj is None:
            return []
        obj = getattr(obj, name)
    return [] if obj is None else [obj]


@pytest.mark.parametrize(("api_key", "kind", "version"), _string_entity_cases())
def test_random_bodies_round_trip_through_a_prefix(api_key, kind, version):
    msg = getattr(apis()[api_key], kind)
    request_cls = body_class(api_key, "request")

    @settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(message_strategy(msg, version), st.integers(0, 2))
    def check(body, key_type):
        r = request_cls(key_type=key_type) if api_key == 10 else None
        original = encode(api_key, kind, version, body)
        names = {e: entities.collect(body, api_key, version, kind, e, r) for e in ("topic", "group", "txn")}
        for e in names:
            entities.rewrite(body, api_key, version, kind, e, _add, r)
        for e, values in names.items():
            assert entities.collect(body, api_key, version, kind, e, r) == ["t." + v for v in values]
        for e in names:
            entities.rewrite(body, api_key, version, kind, e, _strip, r)
        assert encode(api_key, kind, version, body) == original
        # Hiding everything leaves only the values that sit outside every array.
        paths = entities.entity_paths(api_key, version, kind)
        for e in names:
            entities.filter_elements(body, api_key, version, kind, e, lambda v: False, r)
            left = len(entities.collect(body, api_key, version, kind, e, r))
            plain = sum(len(_array_free(body, p)) for p in paths.get(e, ()) if not any(a for _, a in p))
            typed = sum(len(_array_free(body, p)) for k in entities.TYPE_CODES for p in paths.get(k, ())
                        if not any(a for _, a in p))
            assert plain <= left <= plain + typed

    check()


# ---------------------------------------------------------------------------------------------
# Classifications


def test_partition_and_coordinator_apis():
    assert entities.partition_apis() == {0, 1, 2, 21, 23, 27, 61, 78, 79}
    coordinator = entities.coordinator_apis()
    assert {8, 9, 11, 12, 13, 14, 15, 22, 24, 25, 26, 28, 42, 47, 68, 69, 76, 77, 88, 89} <= coordinator
    assert not coordinator & {3, 10, 16, 18, 32, 60}     # metadata, find coordinator, list groups, ...
    assert entities.quorum_apis() == {52, 53, 54, 55, 59, 80, 81, 82}


def test_node_id_fields_come_from_the_schema():
    msg = apis()[3].response
    assert msg is not None
    structs = {s.name: s for s in msg.structs()}
    assert entities.node_id_fields(structs["MetadataResponseBroker"], 12) == ("node_id",)
    assert entities.node_id_fields(structs["MetadataResponsePartition"], 12) == ("leader_id",)
    assert entities.node_id_fields(msg.root, 0) == ()
    assert entities.node_id_fields(msg.root, 1) == ("controller_id",)
    fc = apis()[10].response
    assert fc is not None
    assert entities.node_id_fields(fc.root, 3) == ("node_id",)
    assert entities.node_id_fields(fc.root, 4) == ()


def test_hold_ms_is_the_longest_wait_a_request_asks_for():
    join = build(11, "request", 5, {"group_id": "g", "session_timeout_ms": 10000, "rebalance_timeout_ms": 45000})
    assert entities.hold_fields(11, 0) == ("session_timeout_ms",)
    assert entities.hold_ms(join, 11, 5) == 45000
    fetch = build(1, "request", 12, {"max_wait_ms": 500})
    assert entities.hold_ms(fetch, 1, 12) == 500
    assert entities.hold_fields(3, 12) == ()
    assert entities.hold_ms(build(3, "request", 12, {}), 3, 12) == 0
    produce = build(0, "request", 9, {"acks": 0, "timeout_ms": -1})
    assert entities.hold_ms(produce, 0, 9) == 0


def test_apis_with_an_entity():
    assert {0, 1, 3, 19, 20, 32} <= entities.apis_with("topic")
    assert 29 in entities.apis_with("txn")        # ACL filters name transactional ids by type code
    assert 10 in entities.apis_with("group", "response")
    assert 18 not in entities.apis_with("topic")  # ApiVersions names nothing


def test_entity_paths_lists_raw_kinds():
    paths = entities.entity_paths(10, 4, "request")
    assert paths == {"coordinator_key": ((("coordinator_keys", True),),)}
    assert entities.entity_paths(0, 9, "request") == {
        "txn": ((("transactional_id", False),),),
        "topic": ((("topic_data", True), ("name", False)),),
    }


def test_generated_source_is_shown_in_tracebacks():
    import linecache

    src = entities.entity_source(0, 9, "request", "topic")
    assert "def collect(b, r):" in src
    assert any(k.startswith("<kproxy-entities produce.request.v9 topic>") for k in linecache.cache)

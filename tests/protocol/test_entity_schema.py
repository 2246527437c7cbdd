"""The schema's entity=, hold=ms and to= marks: the parser's checks, coverage rules that catch an
unmarked field by its name, and a cross-check of every mark against Kafka's own entity types (as kio
carries them)."""

from __future__ import annotations

import dataclasses
import typing

import pytest
from kio.schema.types import BrokerId, GroupId, ProducerId, TopicName, TransactionalId

from kproxy.protocol.messages import apis
from kproxy.protocol.schema import (
    ENTITY_TYPES,
    FieldSpec,
    MessageSpec,
    SchemaError,
    StructSpec,
    parse_schema,
)

from .kio_bridge import _inner, kio_api_names, kio_class, kio_versions, kproxy_name

# ---------------------------------------------------------------------------------------------
# Parser


def _schema(request_fields: str, response_fields: str = "  throttle_time_ms  int32\n",
            api_line: str = "api 999 demo") -> str:
    return f"{api_line}\nrequest 0-3 flex 2+\n{request_fields}response 0-3 flex 2+\n{response_fields}"


def _error(text: str) -> SchemaError:
    with pytest.raises(SchemaError) as info:
        parse_schema(text, "demo.kschema")
    return info.value


def test_entity_and_hold_are_parsed():
    sf = parse_schema(_schema(
        "  timeout_ms  int32  hold=ms\n"
        "  topics  []Topic\n"
        "    name  string  v1+  entity=topic\n"
        "    replicas  []int32  entity=broker\n"
        "  group_id  string  nullable  default=null  entity=group\n",
    ), "demo.kschema")
    assert sf.api is not None and sf.api.request is not None
    root = sf.api.request.root
    fields = {f.name: f for f in root.fields}
    assert fields["timeout_ms"].hold and fields["timeout_ms"].entity is None
    assert fields["group_id"].entity == "group" and not fields["group_id"].hold
    assert fields["group_id"].default is None  # the mark does not disturb the other options
    topic = fields["topics"].struct
    assert topic is not None
    assert [(f.name, f.entity) for f in topic.fields] == [("name", "topic"), ("replicas", "broker")]
    assert sf.api.to is None


@pytest.mark.parametrize("dest", ["leader", "coordinator", "quorum"])
def test_destination_is_parsed(dest):
    sf = parse_schema(_schema("  group_id  string\n", api_line=f"api 999 demo to={dest}"), "x.kschema")
    assert sf.api is not None and sf.api.to == dest


@pytest.mark.parametrize(("text", "line", "reason"), [
    (_schema("  a  int32\n  topic  string  entity=topics\n"), 4, "unknown entity kind 'topics'"),
    (_schema("  leader_id  string  entity=broker\n"), 3, "entity=broker needs a int32 field, not string"),
    (_schema("  name  int32  entity=topic\n"), 3, "entity=topic needs a string field, not int32"),
    (_schema("  topic_id  string  entity=topic_id\n"), 3, "entity=topic_id needs a uuid field"),
    (_schema("  producer_id  int32  entity=producer\n"), 3, "entity=producer needs a int64 field"),
    (_schema("  topics  []Topic  entity=topic\n    name  string\n"), 3, "needs a string field, not []Topic"),
    (_schema("  resource_type  int8\n  resource_name  []string  entity=acl_resource\n"), 4,
     "applies to a single name"),
    (_schema("  resource_name  string  entity=config_resource\n"), 3,
     "needs an int8 sibling resource_type"),
    (_schema("  resource_type  int16\n  resource_name  string  entity=config_resource\n"), 4,
     "needs an int8 sibling resource_type"),
    (_schema("  key  string  entity=coordinator_key\n"), 3, "needs an int8 key_type"),
    (_schema("  a  int32\n", "  key  string  entity=coordinator_key\n"), 5, "needs an int8 key_type"),
    (_schema("  timeout_ms  int64  hold=ms\n"), 3, "hold=ms needs an int32 field"),
    (_schema("  timeout_ms  int32  hold=s\n"), 3, "unknown option 'hold=s'"),
    (_schema("  a  int32\n", api_line="api 999 demo to=everyone"), 1, "unknown destination to=everyone"),
    (_schema("  a  int32\n", api_line="api 999 demo leader"), 1, "expected one line: api KEY"),
])
def test_bad_marks_name_file_and_line(text, line, reason):
    e = _error(text)
    assert (e.file, e.line) == ("demo.kschema", line)
    assert reason in e.reason
    assert str(e).startswith(f"demo.kschema:{line}: ")


def test_a_resource_type_sibling_may_be_missing_in_some_versions():
    # ListConfigResources v0 has no resource_type: the sibling's default decides (FORMAT.md).
    sf = parse_schema(_schema("  resource_type  int8  v1+  default=16\n"
                              "  resource_name  string  entity=config_resource\n"), "demo.kschema")
    assert sf.api is not None and sf.api.request is not None
    assert sf.api.request.root.fields[1].entity == "config_resource"


def test_a_response_coordinator_key_uses_the_requests_key_type():
    sf = parse_schema(_schema("  key_type  int8  v1+\n", "  key  string  entity=coordinator_key\n"),
                      "demo.kschema")
    assert sf.api is not None and sf.api.response is not None
    assert sf.api.response.root.fields[0].entity == "coordinator_key"


# ---------------------------------------------------------------------------------------------
# Coverage: a field whose name says what it holds must carry the mark


def _every_field() -> list[tuple[str, MessageSpec, StructSpec, tuple[str, ...], FieldSpec]]:
    """(api name, message, holding struct, field names from the root, field) for every field."""
    out = []

    def walk(api: str, msg: MessageSpec, s: StructSpec, path: tuple[str, ...]) -> None:
        for f in s.fields:
            out.append((api, msg, s, (*path, f.name), f))
            if f.struct is not None:
                walk(api, msg, f.struct, (*path, f.name))

    for api in apis().values():
        for msg in (api.request, api.response):
            assert msg is not None
            walk(api.name, msg, msg.root, ())
    return out


FIELDS = _every_field()

# Fields whose names suggest an entity but which hold something else, as "name" or "name:type".
# Each needs its reason.
NOT_ENTITIES = {
    # JoinGroup's leader is the member id of the group's leader, not a node.
    "leader:string",
    # Regular expressions and patterns over names, not names (FORMAT.md, "Entities").
    "subscribed_topic_regex", "source_topic_regex", "transactional_id_pattern",
    # A group's state, type and protocol, and a static member's id: not the group id.
    "group_state", "group_type", "group_instance_id", "group_epoch",
    # Epochs and offsets that sit beside node ids.
    "leader_epoch", "current_leader_epoch", "committed_leader_epoch", "replica_epoch", "controller_epoch", "broker_epoch",
    "previous_broker_epoch", "producer_epoch", "producer_id_len", "partition_leader_epoch",
    # Log directory ids of replicas and voters: uuids, not topics or brokers.
    "replica_directory_id", "voter_directory_id", "candidate_directory_id",
    # Transaction state and timings, not the transactional id.
    "transaction_state", "transaction_timeout_ms", "transaction_start_time_ms",
    # Counts and permissions of topics.
    "topic_authorized_operations",
}

# Where a name pattern alone would pick the wrong kind.
KIND_BY_NAME = [
    # (field name test, type, array, the mark it must carry)
    (lambda n: n in ("topic", "topic_name", "topic_names", "topics") or n.endswith("_topics")
     or n.endswith("_topic_names"), "string", None, "topic"),
    (lambda n: n in ("topic_id", "topic_ids"), "uuid", None, "topic_id"),
    (lambda n: n in ("group_id", "group_ids", "groups", "groups_names"), "string", None, "group"),
    (lambda n: n in ("transactional_id", "transactional_ids") or n.endswith("_transactional_id"),
     "string", None, "txn"),
    (lambda n: n in ("node_id", "broker_id", "leader_id", "replica_id", "voter_id", "controller_id",
                     "candidate_id", "leader", "preferred_read_replica"), "int32", False, "broker"),
    (lambda n: n in ("replicas", "isr", "replica_nodes", "isr_nodes", "offline_replicas",
                     "adding_replicas", "removing_replicas", "broker_ids", "new_isr",
                     "preferred_successors", "eligible_leader_replicas", "last_known_elr"),
     "int32", True, "broker"),
    (lambda n: n == "producer_id" or n.endswith("_producer_id") or (n.startswith("producer_id_")
     and n != "producer_id_len"), "int64", None, "producer"),
    (lambda n: n in ("resource_name", "resource_name_filter"), "string", False, None),
]


def _explained(f: FieldSpec) -> bool:
    return f.name in NOT_ENTITIES or f"{f.name}:{f.type}" in NOT_ENTITIES


def _topic_struct(s: StructSpec, path: tuple[str, ...]) -> bool:
    """A struct that describes one topic: reached through a topics-like array, or named so."""
    parent = path[-2] if len(path) > 1 else ""
    by_field = parent in ("topics", "topic_data", "topic_states") or parent.endswith("_topics")
    by_name = "Topic" in s.name and "Config" not in s.name
    return by_field or by_name


def test_fields_named_for_an_entity_carry_its_mark():
    missing = []
    for api, msg, _s, path, f in FIELDS:
        if _explained(f):
            continue
        for test, ftype, array, kind in KIND_BY_NAME:
            if test(f.name) and f.type == ftype and (array is None or f.array == array):
                ok = f.entity in (("config_resource", "acl_resource") if kind is None else (kind,))
                if not ok:
                    missing.append(f"{api} {msg.kind} {'/'.join(path)}: {f.entity} (want {kind})")
    assert not missing, "\n".join(missing)


def test_topic_names_in_topic_structs_are_marked():
    missing = [f"{api} {msg.kind} {'/'.join(path)}"
               for api, msg, s, path, f in FIELDS
               if f.name == "name" and f.type == "string" and _topic_struct(s, path) and f.entity != "topic"]
    assert not missing, "\n".join(missing)


def test_names_that_mention_an_entity_are_marked_or_explained():
    """Any string, uuid, int32 or int64 field whose name mentions what an entity is must carry a
    mark or be listed in NOT_ENTITIES with its reason."""
    words = ("topic", "group", "transactional", "broker", "node", "leader", "replica", "voter",
             "controller", "candidate", "isr", "successor", "producer_id")
    unexplained = []
    for api, msg, _s, path, f in FIELDS:
        if f.type not in ("string", "uuid", "int32", "int64") or f.entity is not None or f.hold:
            continue
        if _explained(f):
            continue
        if any(w in f.name for w in words):
            unexplained.append(f"{api} {msg.kind} {'/'.join(path)} {f.type}")
    assert not unexplained, "\n".join(unexplained)


def test_every_mark_fits_its_type():
    wrong = [f"{api} {msg.kind} {'/'.join(path)}: {f.entity} on {f.type}"
             for api, msg, _s, path, f in FIELDS
             if f.entity is not None and ENTITY_TYPES[f.entity] != f.type]
    assert not wrong
    # Topic ids are the only uuids kproxy treats as entities; directory and incarnation ids are not.
    assert {f.name for *_, f in FIELDS if f.entity == "topic_id"} == {"topic_id"}


def test_hold_marks_only_top_level_request_timeouts():
    holds = sorted((api, msg.kind, "/".join(path)) for api, msg, _s, path, f in FIELDS if f.hold)
    assert all(kind == "request" and "/" not in p and p.endswith("_ms") for _, kind, p in holds)
    held = {api for api, *_ in holds}
    assert {"produce", "fetch", "share_fetch", "join_group", "create_topics", "delete_records"} <= held
    # Heartbeats answer at once; their rebalance timeout is not a wait on the request.
    assert not held & {"consumer_group_heartbeat", "streams_group_heartbeat", "heartbeat"}


# ---------------------------------------------------------------------------------------------
# Destinations agree with the marks


def _chains(msg: MessageSpec, v: int) -> list[tuple[FieldSpec, ...]]:
    out = []

    def walk(s: StructSpec, prefix: tuple[FieldSpec, ...]) -> None:
        for f in s.fields:
            if v in f.versions:
                out.append((*prefix, f))
                if f.struct is not None:
                    walk(f.struct, (*prefix, f))

    walk(msg.root, ())
    return out


def _partitions_under_topics(msg: MessageSpec, v: int) -> bool:
    """A topic name or id beside an array of partitions (structs or indexes)."""
    for chain in _chains(msg, v):
        f = chain[-1]
        if f.entity not in ("topic", "topic_id") or len(chain) < 2:
            continue
        holder = chain[-2].struct
        assert holder is not None
        for g in holder.fields:
            if v in g.versions and g.array and ((g.type == "int32" and "partition" in g.name)
                                                or (g.struct is not None and "artition" in g.struct.name)):
                return True
    return False


def _owner_ids(msg: MessageSpec, v: int) -> bool:
    """A group or transactional id outside any topic struct: whose coordinator the request needs."""
    return any(c[-1].entity in ("group", "txn") and not any(x.entity for x in c[:-1])
               and not any("topic" in x.name for x in c[:-1]) for c in _chains(msg, v))


def _versions(msg: MessageSpec) -> range:
    assert msg.versions.hi is not None
    return range(msg.versions.lo, msg.versions.hi + 1)


def test_leader_apis_name_partitions_of_topics():
    for api in apis().values():
        if api.to == "leader":
            assert api.request is not None
            for v in _versions(api.request):
                assert _partitions_under_topics(api.request, v), f"{api.name} v{v}"


def test_coordinator_apis_name_what_they_coordinate():
    for api in apis().values():
        if api.to == "coordinator":
            assert api.request is not None
            for v in _versions(api.request):
                assert _owner_ids(api.request, v), f"{api.name} v{v}"


# Leader APIs that also name a group or transaction: the partitions decide where they go.
OWNER_IDS_TO_LEADERS = {"produce", "share_fetch", "share_acknowledge"}


def test_no_api_that_names_a_group_or_transaction_forgets_its_destination():
    forgotten = []
    for api in apis().values():
        assert api.request is not None
        if api.to is None and any(_owner_ids(api.request, v) for v in _versions(api.request)):
            forgotten.append(api.name)
        if api.to == "leader" and any(_owner_ids(api.request, v) for v in _versions(api.request)):
            assert api.name in OWNER_IDS_TO_LEADERS
    assert not forgotten


# ---------------------------------------------------------------------------------------------
# Kafka's facts: every field Kafka types as an entity carries the same mark here

_KIO_KINDS = {BrokerId: "broker", GroupId: "group", ProducerId: "producer", TopicName: "topic",
              TransactionalId: "txn"}


def _kio_entities(cls: type, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], str]]:
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        tp, _array, _optional = _inner(hints[f.name])
        p = (*path, kproxy_name(f))
        if dataclasses.is_dataclass(tp):
            out += _kio_entities(tp, p)  # type: ignore[arg-type]
        elif tp in _KIO_KINDS:
            out.append((p, _KIO_KINDS[tp]))  # type: ignore[index]
    return out


def _field_at(msg: MessageSpec, v: int, path: tuple[str, ...]) -> FieldSpec:
    s = msg.root
    f = None
    for name in path:
        f = next(x for x in s.fields if x.name == name and v in x.versions)
        if f.struct is not None:
            s = f.struct
    assert f is not None
    return f


def _kio_cases():
    names = kio_api_names()
    return [pytest.param(key, name, id=name) for key, name in sorted(names.items()) if key in apis()]


@pytest.mark.parametrize(("key", "name"), _kio_cases())
def test_marks_agree_with_kafkas_entity_types(key, name):
    api = apis()[key]
    for kind in ("request", "response"):
        msg = getattr(api, kind)
        for v in kio_versions(name):
            for path, want in _kio_entities(kio_class(name, v, kind)):
                f = _field_at(msg, v, path)
                assert f.entity == want, f"{name} {kind} v{v} {'/'.join(path)}: {f.entity}, Kafka: {want}"

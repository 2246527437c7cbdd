"""Every example rule set in rules/ loaded and exercised: each does what its comment block says."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kproxy.policy.engine import Facts, FixedRules, decide
from kproxy.policy.filter import PolicyFilter
from kproxy.policy.loader import load_rules
from kproxy.protocol.errors import (
    CLUSTER_AUTHORIZATION_FAILED,
    INVALID_REQUIRED_ACKS,
    NOT_LEADER_OR_FOLLOWER,
    POLICY_VIOLATION,
    TOPIC_AUTHORIZATION_FAILED,
)
from kproxy.protocol.messages import body_class
from kproxy.proxy.actions import Hold, ToClient, ToUpstream

from .rulebook import session
from .test_policy_filter import broker_answers, produce, send
from .test_session import forwarded

RULES = Path(__file__).resolve().parents[2] / "rules"
PRODUCE, FETCH, METADATA, OFFSET_COMMIT, CREATE_TOPICS, API_VERSIONS, DELETE_RECORDS = 0, 1, 3, 8, 19, 18, 21


def example(name: str, chaos: bool = False):
    return load_rules([str(RULES / name)], chaos)


def test_every_example_is_exercised_here():
    exercised = {"allow-all.yaml", "multi-tenant.yaml", "read-only-consumers.yaml", "admin-lockdown.yaml",
                 "producer-standards.yaml", "chaos.yaml", "record-rules.yaml",
                 "quotas.yaml"}     # exercised in test_quota.py
    assert {p.name for p in RULES.glob("*.yaml")} == exercised


def test_allow_all():
    rules = example("allow-all.yaml")
    for key, version in ((PRODUCE, 9), (CREATE_TOPICS, 7), (57, 1)):
        assert decide(rules, Facts(key, version, topics=("t",))).action == "allow"


def test_multi_tenant():
    rules = example("multi-tenant.yaml")
    a = decide(rules, Facts(PRODUCE, 9, client_id="team-a-orders", topics=("orders",)))
    b = decide(rules, Facts(OFFSET_COMMIT, 8, client_id="team-b-1", topics=("orders",), groups=("g",)))
    assert (a.action, a.rule, a.rewrite.topic_prefix) == ("rewrite", "team-a", "tenant-a.")
    assert (b.action, b.rule, b.rewrite.group_prefix) == ("rewrite", "team-b", "tenant-b.")
    stranger = decide(rules, Facts(PRODUCE, 9, client_id="someone", topics=("orders",)))
    assert stranger.action == "deny" and stranger.error == TOPIC_AUTHORIZATION_FAILED
    assert decide(rules, Facts(API_VERSIONS, 3, client_id="someone")).action == "allow"
    # Through the filter: the broker sees the tenant's names, the client its own.
    s = session(PolicyFilter(FixedRules.of(rules)))
    acts = send(s, PRODUCE, 9, produce(["orders"]), client_id="team-b-x")
    assert isinstance(acts[0], ToUpstream)


def test_read_only_consumers():
    rules = example("read-only-consumers.yaml")
    reporting = Facts(PRODUCE, 9, client_id="reporting-daily", topics=("t",))
    assert decide(rules, reporting).action == "deny"
    for key, version in ((DELETE_RECORDS, 2), (CREATE_TOPICS, 7)):
        assert decide(rules, Facts(key, version, client_id="reporting-daily", topics=("t",))).action == "deny"
    for key, version in ((FETCH, 12), (METADATA, 12), (OFFSET_COMMIT, 8)):
        assert decide(rules, Facts(key, version, client_id="reporting-daily", topics=("t",))).action == "allow"
    assert decide(rules, Facts(PRODUCE, 9, client_id="orders-service", topics=("t",))).action == "allow"


@pytest.mark.parametrize(("principal", "allowed"), [
    ("User:ops", True), ("User:CN=ops,O=Acme", True), ("User:alice", False), (None, False)])
def test_admin_lockdown(principal, allowed):
    rules = example("admin-lockdown.yaml")
    d = decide(rules, Facts(CREATE_TOPICS, 7, principal=principal, topics=("t",)))
    assert (d.action == "allow") is allowed
    assert d.rule == ("operators-administer" if allowed else "admin-lockdown")
    assert decide(rules, Facts(57, 1, principal=principal)).error == (None if allowed else
                                                                     CLUSTER_AUTHORIZATION_FAILED)
    assert decide(rules, Facts(PRODUCE, 9, principal=principal, topics=("t",))).action == "allow"


def test_producer_standards():
    rules = example("producer-standards.yaml")
    good = Facts(PRODUCE, 9, topics=("t",), acks=-1, compression=("lz4",), max_batch_bytes=10_000)
    assert decide(rules, good).action == "allow"
    import attrs

    assert decide(rules, attrs.evolve(good, acks=1)).error == INVALID_REQUIRED_ACKS
    assert decide(rules, attrs.evolve(good, compression=("none",))).error == POLICY_VIOLATION
    small = attrs.evolve(good, compression=("none", "lz4"), max_uncompressed_batch_bytes=1024)
    assert decide(rules, small).action == "allow"
    assert decide(rules, attrs.evolve(small, max_uncompressed_batch_bytes=1025)).error == POLICY_VIOLATION
    assert decide(rules, attrs.evolve(good, max_batch_bytes=2 << 20)).error == POLICY_VIOLATION
    assert decide(rules, Facts(FETCH, 12, topics=("t",))).action == "allow"


def test_chaos_drills_touch_only_the_clients_under_test():
    off = example("chaos.yaml")
    assert len(off.warnings) == 3 and not off.chaos_enabled
    rules = example("chaos.yaml", chaos=True)
    assert decide(rules, Facts(FETCH, 12, client_id="drill-1", topics=("t",))).effects == ("slow-fetches",)
    assert decide(rules, Facts(FETCH, 12, client_id="app", topics=("t",))).effects == ()
    s = session(PolicyFilter(FixedRules.of(rules), random.Random(7)))
    errors = holds = 0
    for cid in range(400):
        acts = send(s, PRODUCE, 9, produce(["t"]), client_id="drill-7", correlation_id=cid)
        if isinstance(acts[0], ToClient):
            errors += 1
            assert acts[0].done[0].response.body.responses[0].partition_responses[0].error_code == \
                NOT_LEADER_OR_FOLLOWER
        else:
            broker_answers(s, forwarded(acts[0]))
    cls = body_class(FETCH, "request")
    for cid in range(200):
        acts = send(s, FETCH, 12, cls(topics=[cls.FetchTopic(topic="t")]), client_id="drill-7",
                    correlation_id=1000 + cid)
        holds += isinstance(acts[0], Hold)
        assert all(0.05 <= a.seconds <= 0.5 for a in acts if isinstance(a, Hold))
        broker_answers(s, forwarded(acts[-1]))
    # About 5% of produces fail and 20% of fetches are slowed (a seeded generator: stable counts).
    assert 5 <= errors <= 40 and 20 <= holds <= 70
    calm = session(PolicyFilter(FixedRules.of(off), random.Random(7)))
    for cid in range(50):
        assert isinstance(send(calm, PRODUCE, 9, produce(["t"]), client_id="drill-7", correlation_id=cid)[0],
                          ToUpstream)


def test_record_rules():
    from kproxy.protocol.errors import INVALID_RECORD
    from kproxy.protocol.records import build_batch, iter_batches

    from .test_session import answered

    rules = example("record-rules.yaml")
    s = session(PolicyFilter(FixedRules.of(rules)))
    order = b'{"order_id": "o-1", "amount": 12.5, "currency": "EUR"}'
    avro = b"\x00\x00\x00\x00\x2a" + b"avro"
    cases = {
        ("orders-eu", 0): ([(b"o-1", order), (b"o-2", None)], 0),                   # a delete passes
        ("orders-eu", 1): ([(b"o-1", b'{"order_id": "o-1", "amount": -1, "currency": "EUR"}')], INVALID_RECORD),
        ("orders-eu", 2): ([(None, order)], INVALID_RECORD),                         # no key
        ("orders-eu", 3): ([(b"o-1", b'{"order_id": "o-1", "amount": 1, "currency": "EUR", "pad": "'
                                     + b"x" * 70_000 + b'"}')], INVALID_RECORD),
        ("payments-x", 0): ([(None, avro)], 0),
        ("payments-x", 1): ([(None, b"\x00\x00\x00\x00\x07avro")], INVALID_RECORD),  # schema 7
        ("audit", 0): ([(None, b"anything")], 0),
    }
    cls = body_class(PRODUCE, "request")
    topics: dict[str, list] = {}
    for (t, p), (rows, _) in cases.items():
        topics.setdefault(t, []).append(cls.PartitionProduceData(index=p, records=build_batch(rows)))
    body = cls(acks=-1, timeout_ms=1000, topic_data=[cls.TopicProduceData(name=t, partition_data=ps)
                                                     for t, ps in topics.items()])
    acts = send(s, PRODUCE, 9, body, client_id="checkout")
    up = forwarded(acts[-1])
    sent = {(t.name, p.index): p.records for t in up.body.topic_data for p in t.partition_data}
    assert set(sent) == {k for k, (_, error) in cases.items() if error == 0}
    for (topic, _), records in sent.items():
        (batch,) = iter_batches(records, verify_crc=True)
        names = [[h.key for h in r.headers] for r in batch.records()]
        assert all(n == (["x-producer", "traceparent"] if topic != "audit" else []) for n in names)
    back = answered(broker_answers(s, up)[-1], PRODUCE, 9)
    got = {(t.name, p.index): p.error_code for t in back.body.responses for p in t.partition_responses}
    assert got == {k: error for k, (_, error) in cases.items()}

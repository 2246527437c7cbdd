"""decide(): every selector, first-match order, per-topic refusals, errors, requirements and effects,
on plain facts with no connection."""

from __future__ import annotations

import pytest

from kproxy.policy.engine import Decision, Facts, Refusal, decide
from kproxy.policy.model import Rewrite
from kproxy.protocol.errors import (
    CLUSTER_AUTHORIZATION_FAILED,
    GROUP_AUTHORIZATION_FAILED,
    INVALID_REQUIRED_ACKS,
    POLICY_VIOLATION,
    TOPIC_AUTHORIZATION_FAILED,
    TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
)

from .rulebook import rule_set

PRODUCE, FETCH, METADATA, OFFSET_COMMIT, CREATE_TOPICS, API_VERSIONS = 0, 1, 3, 8, 19, 18


def one_rule(tmp_path, match: str):
    return rule_set(tmp_path, f"rules: [{{name: hit, match: {match}, action: deny}}]\n")


# Each selector with a request it matches and one it does not (everything else equal).
BASE = Facts(PRODUCE, 9, client_id="app", principal="User:alice", source="10.1.2.3", listener="broker-1",
             client_software_name="librdkafka", client_software_version="2.16.0", topics=("orders",),
             groups=(), transactional_ids=(), acks=-1, compression=("lz4",), max_batch_bytes=1000)
SELECTORS = [
    ("{client_id: app}", {}, {"client_id": "other"}),
    ("{client_id: 'ap*'}", {}, {"client_id": "xapp"}),
    ("{client_id: 're:a.p'}", {}, {"client_id": "a-p-"}),
    ("{client_id: [x, app]}", {}, {"client_id": "y"}),
    ("{client_id: {not: app}}", {"client_id": "other"}, {}),
    ("{client_id: ''}", {"client_id": None}, {}),
    ("{principal: 'User:alice'}", {}, {"principal": "User:bob"}),
    ("{principal: 'User:ANONYMOUS'}", {"principal": None}, {}),
    ("{source: 10.0.0.0/8}", {}, {"source": "192.168.0.1"}),
    ("{source: {not: [10.0.0.0/8]}}", {"source": "192.168.0.1"}, {}),
    ("{listener: 'broker-*'}", {}, {"listener": "bootstrap"}),
    ("{client_software: librdkafka}", {}, {"client_software_name": "kafka-python"}),
    ("{client_software: {name: librdkafka, version: '>=2.10'}}", {}, {"client_software_version": "2.3.0"}),
    ("{api: produce}", {}, {"api_key": FETCH}),
    ("{api: 0}", {}, {"api_key": FETCH}),
    ("{api: write}", {}, {"api_key": FETCH}),
    ("{api: {not: read}}", {}, {"api_key": FETCH}),
    ("{api: any}", {"api_key": 57, "api_version": 1}, {"api_key": 9999, "api_version": 0}),
    ("{api_version: 3-9}", {}, {"api_version": 10}),
    ("{api_version: '10+'}", {"api_version": 11}, {}),
    ("{topic: 'ord*'}", {}, {"topics": ("payments",)}),
    ("{group: 'g-*'}", {"groups": ("g-1",)}, {"groups": ("h-1",)}),
    ("{group: {not: 'g-*'}}", {"groups": ("h-1",)}, {}),      # no group: a group selector never holds
    ("{transactional_id: tx}", {"transactional_ids": ("tx",)}, {"transactional_ids": ("ty",)}),
    ("{acks: all}", {}, {"acks": 1}),
    ("{acks: [0, 1]}", {"acks": 0}, {}),
    ("{compression: [lz4, zstd]}", {}, {"compression": ("none",)}),
    ("{compression: {not: none}}", {}, {"compression": ("none",)}),
]


@pytest.mark.parametrize(("match", "hits", "misses"), SELECTORS)
def test_every_selector(tmp_path, match, hits, misses):
    import attrs

    rules = one_rule(tmp_path, match)
    hit = decide(rules, attrs.evolve(BASE, **hits))
    miss = decide(rules, attrs.evolve(BASE, **misses))
    assert hit.action == "deny" and hit.rule == "hit", hit
    assert miss.action == "allow" and miss.rule is None and miss.refused == (), miss


def test_the_first_matching_rule_decides(tmp_path):
    rules = rule_set(tmp_path, """\
        rules:
          - {name: ops-may, match: {principal: "User:ops"}, action: allow}
          - {name: no-produce, match: {api: produce}, action: deny}
          - {name: everything, action: allow}
        """)
    assert decide(rules, Facts(PRODUCE, 9, principal="User:ops", topics=("t",))).rule == "ops-may"
    assert decide(rules, Facts(PRODUCE, 9, principal="User:x", topics=("t",))) == Decision(
        "deny", "no-produce", TOPIC_AUTHORIZATION_FAILED, (Refusal("t", "no-produce", TOPIC_AUTHORIZATION_FAILED),),
        None, ())
    assert decide(rules, Facts(FETCH, 12)).rule == "everything"


def test_default_deny_refuses_what_no_rule_allows(tmp_path):
    rules = rule_set(tmp_path, "default: deny\nrules: [{name: hello, match: {api: api_versions}, action: allow}]\n")
    assert decide(rules, Facts(API_VERSIONS, 3)).action == "allow"
    d = decide(rules, Facts(CREATE_TOPICS, 7, topics=("t",)))
    assert d.action == "deny" and d.rule is None and d.error == TOPIC_AUTHORIZATION_FAILED


def test_topics_are_judged_one_by_one(tmp_path):
    rules = rule_set(tmp_path, """\
        rules:
          - {name: public, match: {topic: "public-*"}, action: allow}
          - {name: secrets, match: {topic: "secret-*"}, action: deny}
          - {name: legacy, match: {topic: "legacy-*"}, action: deny, deny: {error: POLICY_VIOLATION}}
        """)
    d = decide(rules, Facts(PRODUCE, 9, topics=("public-a", "secret-b", "legacy-c", "other")))
    assert d.action == "allow" and d.error is None
    assert d.refused == (Refusal("secret-b", "secrets", TOPIC_AUTHORIZATION_FAILED),
                         Refusal("legacy-c", "legacy", POLICY_VIOLATION))
    whole = decide(rules, Facts(PRODUCE, 9, topics=("secret-b", "secret-c")))
    assert whole.action == "deny" and whole.error == TOPIC_AUTHORIZATION_FAILED and len(whole.refused) == 2


def test_a_topic_rule_never_matches_a_request_without_topics(tmp_path):
    rules = rule_set(tmp_path, "rules: [{name: t, match: {topic: '*'}, action: deny}]\n")
    assert decide(rules, Facts(API_VERSIONS, 3)).action == "allow"


def test_topic_rules_before_a_request_rule_take_their_topics_first(tmp_path):
    rules = rule_set(tmp_path, """\
        rules:
          - {name: keep-x, match: {topic: x}, action: allow}
          - {name: no-produce, match: {api: produce}, action: deny}
        """)
    d = decide(rules, Facts(PRODUCE, 9, topics=("x", "y")))
    assert d.refused == (Refusal("y", "no-produce", TOPIC_AUTHORIZATION_FAILED),) and d.action == "allow"


@pytest.mark.parametrize(("facts", "error"), [
    (Facts(PRODUCE, 9, topics=("t",), transactional_ids=("tx",)), TRANSACTIONAL_ID_AUTHORIZATION_FAILED),
    (Facts(OFFSET_COMMIT, 8, topics=("t",), groups=("g",)), GROUP_AUTHORIZATION_FAILED),
    (Facts(CREATE_TOPICS, 7, topics=("t",)), TOPIC_AUTHORIZATION_FAILED),
    (Facts(57, 1), CLUSTER_AUTHORIZATION_FAILED),
])
def test_the_default_error_fits_what_the_request_names(tmp_path, facts, error):
    rules = rule_set(tmp_path, "rules: [{name: nope, action: deny}]\n")
    assert decide(rules, facts).error == error


def test_the_default_error_fits_what_the_rule_selects(tmp_path):
    rules = rule_set(tmp_path, """\
        rules:
          - {name: g, match: {group: "g*"}, action: deny}
          - {name: tx, match: {transactional_id: "tx*"}, action: deny}
        """)
    assert decide(rules, Facts(OFFSET_COMMIT, 8, topics=("t",), groups=("g1",))).error == \
        GROUP_AUTHORIZATION_FAILED
    assert decide(rules, Facts(PRODUCE, 9, topics=("t",), transactional_ids=("tx1",))).error == \
        TRANSACTIONAL_ID_AUTHORIZATION_FAILED


def test_requirements_refuse_what_breaks_them_and_let_the_rest_go_on(tmp_path):
    rules = rule_set(tmp_path, """\
        rules:
          - {name: acks, match: {api: produce}, action: require, require: {acks: all}}
          - {name: codecs, action: require, require: {compression: [lz4, zstd], max_batch_bytes: 100}}
          - {name: then, match: {topic: "x*"}, action: deny}
        """)
    produce = Facts(PRODUCE, 9, topics=("a",), acks=-1, compression=("lz4",), max_batch_bytes=100)
    assert decide(rules, produce).action == "allow"
    assert decide(rules, Facts(PRODUCE, 9, topics=("a",), acks=1, compression=("lz4",))).error == \
        INVALID_REQUIRED_ACKS
    assert decide(rules, Facts(PRODUCE, 9, topics=("a",), acks=-1, compression=("none",))).error == \
        POLICY_VIOLATION
    assert decide(rules, Facts(PRODUCE, 9, topics=("a",), acks=-1, compression=("zstd",),
                               max_batch_bytes=101)).error == POLICY_VIOLATION
    # A kept requirement does not decide: the rules after it still apply.
    assert decide(rules, Facts(PRODUCE, 9, topics=("x1",), acks=-1, compression=("lz4",))).rule == "then"
    # Requirements about produced batches say nothing about other APIs.
    assert decide(rules, Facts(FETCH, 12, topics=("a",))).action == "allow"


def test_rewrite_decides_the_request_and_earlier_refusals_still_apply(tmp_path):
    rules = rule_set(tmp_path, """\
        rules:
          - {name: no-secrets, match: {topic: "secret-*"}, action: deny}
          - {name: team-a, match: {client_id: "team-a-*"}, action: rewrite, rewrite: {topic_prefix: a.}}
        """)
    d = decide(rules, Facts(PRODUCE, 9, client_id="team-a-1", topics=("orders", "secret-x")))
    assert d.action == "rewrite" and d.rule == "team-a" and d.rewrite == Rewrite("a.")
    assert d.refused == (Refusal("secret-x", "no-secrets", TOPIC_AUTHORIZATION_FAILED),)
    assert decide(rules, Facts(PRODUCE, 9, client_id="team-b-1", topics=("orders",))).action == "allow"


def test_effects_apply_until_the_deciding_rule(tmp_path):
    rules = rule_set(tmp_path, """\
        rules:
          - {name: log-all, action: log}
          - {name: slow, match: {topic: "slow-*"}, action: chaos, chaos: {latency_ms: 5}}
          - {name: allow-fetch, match: {api: fetch}, action: allow}
          - {name: cap-after, action: cap, cap: {max_wait_ms: 10}}
        """, chaos=True)
    assert decide(rules, Facts(FETCH, 12, topics=("slow-1",))).effects == ("log-all", "slow")
    assert decide(rules, Facts(FETCH, 12, topics=("fast",))).effects == ("log-all",)
    assert decide(rules, Facts(PRODUCE, 9, topics=("slow-1",))).effects == ("log-all", "slow", "cap-after")

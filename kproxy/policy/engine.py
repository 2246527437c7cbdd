"""Judging Kafka requests against a rule set, and the filter that carries the decisions out.

``decide(rules, facts)`` says what a rule set does with one request described by plain values (the
traffic-log dry run uses it). ``PolicyFilter`` judges decoded requests the same way and acts: it
refuses topics (forwarding the rest and merging its errors into the broker's answer), prefixes
tenant names and takes the prefix off every answer, lowers Fetch and Produce limits, injects chaos
and logs. Matchers are compiled once per rule set and connection selectors judged once per
connection and rule set. Pure: no I/O and no clocks; randomness comes from an injected generator.
"""

from __future__ import annotations

import functools
import logging
import random
import uuid
from collections.abc import Mapping
from typing import Any, Protocol

import attrs

from kproxy.logs import safe
from kproxy.policy.model import (
    ANONYMOUS,
    COMPRESSIONS,
    DECIDING,
    MAX_LATENCY_S,
    RECORD_ACTIONS,
    Cap,
    Chaos,
    Deny,
    Headers,
    Log,
    Require,
    Rewrite,
    Rule,
    RuleSet,
)
from kproxy.policy.record_rules import Verdict, header_edit, rewrite_records, traceparent, validate_records
from kproxy.protocol import entities
from kproxy.protocol.errors import (
    CLUSTER_AUTHORIZATION_FAILED,
    GROUP_AUTHORIZATION_FAILED,
    INVALID_RECORD,
    INVALID_REQUIRED_ACKS,
    POLICY_VIOLATION,
    TOPIC_AUTHORIZATION_FAILED,
    TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
    UNKNOWN_TOPIC_ID,
    RecordsError,
    error_name,
)
from kproxy.protocol.messages import (
    Request,
    Response,
    api_name,
    body_class,
    decode_request,
    encode_request,
)
from kproxy.protocol.primitives import ZERO_UUID
from kproxy.protocol.records import iter_batches
from kproxy.proxy.filters import ALL, AskBroker, ConnectionContext, Delay, Filter, RequestVerdict, Respond
from kproxy.proxy.names import NamePrefixes, prefixes_of, uses_patterns
from kproxy.proxy.names import pattern_fields as pattern_fields  # imported from here before it moved
from kproxy.proxy.replies import error_response, merge_response
from kproxy.proxy.topics import TopicNames

log = logging.getLogger("kproxy.policy")

PRODUCE, FETCH, METADATA, CREATE_ACLS, DELETE_ACLS, DESCRIBE_TOPIC_PARTITIONS = 0, 1, 3, 30, 31, 75
INVALID_REGULAR_EXPRESSION = 128
_REQUEST_SELECTORS = ("acks", "compression", "group", "transactional_id")
_EFFECTS = ("cap", "chaos", "log")
_CACHE_LIMIT = 4096     # entries per cache before it starts over (bounded memory, whatever clients send)


# --------------------------------------------------------------------------------------------------
# Plain facts and decisions (for decide(), and anything judging requests without a connection)


@attrs.frozen
class Facts:
    """One request as plain values: what every selector can look at.

    ``compression`` holds the codec names of the produced batches (none, gzip, snappy, lz4, zstd),
    ``max_batch_bytes`` the size of the largest and ``max_uncompressed_batch_bytes`` that of the
    largest uncompressed one (None: unknown, taken as ``max_batch_bytes``); they only matter for
    Produce.
    """

    api_key: int
    api_version: int
    client_id: str | None = None
    principal: str | None = None
    source: str | None = None
    listener: str | None = "bootstrap"
    client_software_name: str | None = None
    client_software_version: str | None = None
    topics: tuple[str, ...] = ()
    groups: tuple[str, ...] = ()
    transactional_ids: tuple[str, ...] = ()
    acks: int | None = None
    compression: tuple[str, ...] = ()
    max_batch_bytes: int = 0
    max_uncompressed_batch_bytes: int | None = None


@attrs.frozen
class Refusal:
    """A topic refused while the rest of the request goes on; ``rule`` None means the default."""

    topic: str
    rule: str | None
    error: int


@attrs.frozen
class Decision:
    """What a rule set does with one request.

    ``action`` is ``allow``, ``deny`` or ``rewrite`` for the request as a whole; ``rule`` names the
    rule that decided it (None: the default). A request refused as a whole has ``error``. Topics
    refused on their own, while the rest goes through, are in ``refused``. ``effects`` names the
    cap, chaos and log rules that apply (chaos and log may then still skip it, by their rate).
    ``record_rules`` names, per topic of a Produce, the validate and headers rules its records meet.
    """

    action: str
    rule: str | None
    error: int | None = None
    refused: tuple[Refusal, ...] = ()
    rewrite: Rewrite | None = None
    effects: tuple[str, ...] = ()
    record_rules: tuple[tuple[str, tuple[str, ...]], ...] = ()


# --------------------------------------------------------------------------------------------------
# The facts of one live request, read lazily from its body


class _Req:
    """Request facts, each computed the first time a rule asks (batches are never decompressed)."""

    __slots__ = ("_batches", "_groups", "_txn", "api_key", "body", "version")

    def __init__(self, api_key: int, version: int, body: Any) -> None:
        self.api_key = api_key
        self.version = version
        self.body = body
        self._groups: list[str] | None = None
        self._txn: list[str] | None = None
        self._batches: tuple[frozenset[int], int, int] | None = None

    def acks(self) -> int | None:
        return self.body.acks if self.api_key == PRODUCE else None

    def groups(self) -> list[str]:
        if self._groups is None:
            self._groups = [g for g in entities.collect(self.body, self.api_key, self.version, "request", "group")
                            if g]
        return self._groups

    def txn_ids(self) -> list[str]:
        if self._txn is None:
            self._txn = [t for t in entities.collect(self.body, self.api_key, self.version, "request", "txn") if t]
        return self._txn

    def batches(self) -> tuple[frozenset[int], int, int]:
        """(codec ids, size of the largest batch, size of the largest uncompressed batch) of a Produce
        request's record batches."""
        if self._batches is None:
            codecs: set[int] = set()
            biggest = plain = 0
            if self.api_key == PRODUCE:
                for topic in self.body.topic_data:
                    for part in topic.partition_data:
                        records = part.records
                        if not records:
                            continue
                        try:
                            for batch in iter_batches(records, allow_truncated=False):
                                codec = int(batch.compression)
                                codecs.add(codec)
                                biggest = max(biggest, len(batch.raw))
                                if codec == 0:
                                    plain = max(plain, len(batch.raw))
                        except RecordsError:
                            # Unreadable batches: judged by their size, and by a codec no rule allows.
                            codecs.add(-1)
                            biggest = max(biggest, len(records))
            self._batches = (frozenset(codecs), biggest, plain)
        return self._batches


class _FactsReq(_Req):
    """_Req over plain Facts."""

    __slots__ = ("facts",)

    def __init__(self, facts: Facts) -> None:
        super().__init__(facts.api_key, facts.api_version, None)
        self.facts = facts
        self._groups = [g for g in facts.groups if g]
        self._txn = [t for t in facts.transactional_ids if t]
        plain = facts.max_uncompressed_batch_bytes
        self._batches = (frozenset(COMPRESSIONS.index(c) for c in facts.compression), facts.max_batch_bytes,
                         facts.max_batch_bytes if plain is None else plain)

    def acks(self) -> int | None:
        return self.facts.acks


class _HeadReq(_Req):
    """_Req over a streamed Produce request's head: acks and the transactional id are known; its
    batches are not (``may_stream_request`` stores a request that any rule would judge by them)."""

    __slots__ = ("_acks",)

    def __init__(self, values: Mapping[str, Any]) -> None:
        super().__init__(PRODUCE, 0, None)
        self._acks = values.get("acks")
        txn = values.get("transactional_id")
        self._groups = []
        self._txn = [txn.decode("utf-8", "replace")] if txn else []

    def acks(self) -> int | None:
        return self._acks

    def batches(self) -> tuple[frozenset[int], int, int]:
        raise AssertionError("a streamed request's batches are not known when it is judged")


def _request_holds(rule: Rule, req: _Req) -> bool:
    m = rule.match
    if m.acks is not None:
        acks = req.acks()
        if acks is None or not m.acks(acks):
            return False
    if m.compression is not None and not m.compression(req.batches()[0]):
        return False
    if m.group is not None and not any(m.group(g) for g in req.groups()):
        return False
    return m.transactional_id is None or any(m.transactional_id(t) for t in req.txn_ids())


def _broken(require: Require, req: _Req) -> int | None:
    """The error for a request that breaks ``require``, or None when it keeps it."""
    if require.acks is not None:
        acks = req.acks()
        if acks is not None and acks != require.acks:
            return INVALID_REQUIRED_ACKS
    if require.uses_batches and req.api_key == PRODUCE:
        codecs, biggest, plain = req.batches()
        if require.max_batch_bytes is not None and biggest > require.max_batch_bytes:
            return POLICY_VIOLATION
        if require.compression is not None:
            wrong = codecs - require.compression
            small = require.uncompressed_max_bytes > 0 and plain <= require.uncompressed_max_bytes
            if wrong and not (wrong == {0} and small):
                return POLICY_VIOLATION
    return None


# --------------------------------------------------------------------------------------------------
# The compiled index: rules per connection, per api version, outcomes per request shape


@attrs.define(slots=True)
class _Outcome:
    """How a request goes down the rules: the rule deciding it as a whole (None: the default), the
    rule deciding each topic, the cap, chaos and log rules it reaches, and the topics whose deciding
    rule may refuse them (the others need no further look)."""

    request_rule: Rule | None
    topic_rules: dict[str, Rule | None]
    effects: tuple[Rule, ...]
    refusable: tuple[str, ...] = ()
    # Per topic, the validate and headers rules its produced records meet, in order.
    record_rules: dict[str, tuple[Rule, ...]] = attrs.field(factory=dict)


def _can_apply(rule: Rule, api_key: int, kinds: frozenset[str] | None) -> bool:
    """Whether ``rule`` can ever match a request of this API, whose requests carry ``kinds`` of
    names (None: not known, so anything can). Rules that cannot are left out of the plan."""
    m = rule.match
    if (m.acks is not None or m.compression is not None or rule.action == "require"
            or rule.action in RECORD_ACTIONS) and api_key != PRODUCE:
        return False        # acks and produced batches exist in Produce only
    if kinds is None:
        return True
    if m.group is not None and "group" not in kinds:
        return False
    if m.transactional_id is not None and "txn" not in kinds:
        return False
    return m.topic is None or "topic" in kinds or "topic_id" in kinds


class _Plan:
    """The rules that can apply to one api version on one kind of connection, in order."""

    __slots__ = ("_deciders", "_default_deny", "_effects", "_outcomes", "has_ids", "idle", "records",
                 "request_positions", "rules", "static", "topic_rules")

    def __init__(self, rules: tuple[Rule, ...], api_key: int, version: int, default_deny: bool = False) -> None:
        try:
            kinds: frozenset[str] | None = frozenset(
                e for e in ("topic", "topic_id", "group", "txn") if entities.has_entity(api_key, version, "request", e))
        except ValueError:      # a version kproxy does not know (decide() on recorded facts)
            kinds = None
        rules = tuple(r for r in rules if _can_apply(r, api_key, kinds))
        self.rules = rules
        self._default_deny = default_deny
        self.idle = not rules
        self.topic_rules = any(r.match.topic is not None for r in rules)
        self.request_positions = tuple(
            p for p, r in enumerate(rules)
            if r.action == "require" or any(getattr(r.match, s) is not None for s in _REQUEST_SELECTORS))
        self._deciders = tuple(p for p, r in enumerate(rules) if r.action in DECIDING or r.action == "require")
        self._effects = tuple(p for p, r in enumerate(rules) if r.action in _EFFECTS)
        self.records = tuple(p for p, r in enumerate(rules) if r.action in RECORD_ACTIONS)
        self._outcomes: dict[tuple[tuple[int, ...], tuple[str, ...]], _Outcome] = {}
        self.has_ids = kinds is not None and "topic_id" in kinds
        # Without topic or request selectors every request of this kind goes the same way.
        self.static = None if self.topic_rules or self.request_positions or self.records else self.outcome((), ())

    def inactive(self, req: _Req) -> tuple[int, ...]:
        """Positions of the rules that take no part for this request: a request selector does not
        hold, or a requirement is kept."""
        off = []
        rules = self.rules
        for p in self.request_positions:
            rule = rules[p]
            if not _request_holds(rule, req) or (isinstance(rule.params, Require) and _broken(rule.params, req) is None):
                off.append(p)
        return tuple(off)

    def request_rule(self, inactive: tuple[int, ...]) -> Rule | None:
        return self.outcome(inactive, ()).request_rule

    def outcome(self, inactive: tuple[int, ...], topics: tuple[str, ...]) -> _Outcome:
        key = (inactive, topics)
        got = self._outcomes.get(key)
        if got is None:
            if len(self._outcomes) >= _CACHE_LIMIT:
                self._outcomes.clear()
            got = self._outcomes[key] = self._evaluate(inactive, topics)
        return got

    def _evaluate(self, inactive: tuple[int, ...], topics: tuple[str, ...]) -> _Outcome:
        rules = self.rules
        n = len(rules)
        active = [p for p in self._deciders if p not in inactive]
        request_at = next((p for p in active if rules[p].match.topic is None), n)
        decided_at: dict[str, int] = {}
        for t in topics:
            at = n
            for p in active:
                selector = rules[p].match.topic
                if selector is None or selector(t):
                    at = p
                    break
            decided_at[t] = at
        effects = []
        for p in self._effects:
            if p in inactive:
                continue
            selector = rules[p].match.topic
            if selector is None:
                if p < request_at:
                    effects.append(rules[p])
            elif any(selector(t) and decided_at[t] > p for t in topics):
                effects.append(rules[p])
        deciding = {t: rules[at] if at < n else None for t, at in decided_at.items()}
        refusable = tuple(t for t, r in deciding.items()
                          if (r is None and self._default_deny) or (r is not None and r.action in ("deny", "require")))
        # Like cap, a record rule reaches a topic when it comes before the rule deciding that topic.
        record_rules = {}
        if self.records:
            for t in topics:
                reach = tuple(r for p in self.records
                              if p not in inactive and p < decided_at[t]
                              and ((sel := (r := rules[p]).match.topic) is None or sel(t)))
                if reach:
                    record_rules[t] = reach
        return _Outcome(rules[request_at] if request_at < n else None, deciding, tuple(effects), refusable,
                        record_rules)


ConnectionKey = tuple[str | None, str | None, str | None, str | None, str | None, str | None]


class _View:
    """The rules whose connection selectors hold for one kind of connection."""

    __slots__ = ("_default_deny", "_plans", "rules")

    def __init__(self, rules: tuple[Rule, ...], default_deny: bool) -> None:
        self.rules = rules
        self._default_deny = default_deny
        self._plans: dict[tuple[int, int], _Plan] = {}

    def plan(self, api_key: int, version: int) -> _Plan:
        plan = self._plans.get((api_key, version))
        if plan is None:
            chosen = tuple(r for r in self.rules
                           if (r.match.api is None or r.match.api(api_key))
                           and (r.match.api_version is None or r.match.api_version(version)))
            plan = self._plans[(api_key, version)] = _Plan(chosen, api_key, version, self._default_deny)
        return plan


class Policy:
    """A rule set compiled for judging, with its caches; build one per load and share it."""

    def __init__(self, rule_set: RuleSet) -> None:
        self.rule_set = rule_set
        self.default_deny = rule_set.default == "deny"
        self.chaos = rule_set.chaos_enabled
        self._views: dict[ConnectionKey, _View] = {}
        # Topic ids need names when a rule looks at topics or a tenant's namespace must be kept.
        self.uses_topic_names = any(
            r.match.topic is not None or (isinstance(r.params, Rewrite) and r.params.topic_prefix)
            or r.action in RECORD_ACTIONS for r in rule_set.rules) or self.default_deny

    def view(self, key: ConnectionKey) -> _View:
        """The rules for a connection (client id, principal, source address, listener, client
        software name and version)."""
        got = self._views.get(key)
        if got is None:
            if len(self._views) >= _CACHE_LIMIT:
                self._views.clear()
            chosen = tuple(r for r in self.rule_set.rules if r.match.holds_for_connection(*key))
            got = self._views[key] = _View(chosen, self.default_deny)
        return got


def default_error(rule: Rule | None, req: _Req, topics: bool) -> int:
    """The error a refusal gets: the rule's own, else the authorization error that fits what the
    rule selects, else what the request names (transactional id, group, topics, else the cluster)."""
    if rule is not None:
        if isinstance(rule.params, Deny) and rule.params.error is not None:
            return rule.params.error
        m = rule.match
        if m.transactional_id is not None:
            return TRANSACTIONAL_ID_AUTHORIZATION_FAILED
        if m.group is not None:
            return GROUP_AUTHORIZATION_FAILED
        if m.topic is not None:
            return TOPIC_AUTHORIZATION_FAILED
    if req.txn_ids():
        return TRANSACTIONAL_ID_AUTHORIZATION_FAILED
    if req.groups():
        return GROUP_AUTHORIZATION_FAILED
    return TOPIC_AUTHORIZATION_FAILED if topics else CLUSTER_AUTHORIZATION_FAILED


def _refusal(rule: Rule | None, req: _Req, policy: Policy, topics: bool) -> int | None:
    """The error if ``rule`` (None: the default) refuses, else None."""
    if rule is None:
        return default_error(None, req, topics) if policy.default_deny else None
    if rule.action == "deny":
        return default_error(rule, req, topics)
    if isinstance(rule.params, Require):
        return _broken(rule.params, req)
    return None


_POLICIES: dict[int, tuple[RuleSet, Policy]] = {}


def policy_for(rules: RuleSet | Policy) -> Policy:
    """The compiled Policy of a rule set (kept for the last few rule sets seen)."""
    if isinstance(rules, Policy):
        return rules
    got = _POLICIES.get(id(rules))
    if got is None or got[0] is not rules:
        if len(_POLICIES) >= 8:
            _POLICIES.clear()
        got = _POLICIES[id(rules)] = (rules, Policy(rules))
    return got[1]


def decide(rules: RuleSet | Policy, facts: Facts) -> Decision:
    """What ``rules`` do with the request ``facts`` describe; pure, no connection needed."""
    policy = policy_for(rules)
    plan = policy.view((facts.client_id, facts.principal, facts.source, facts.listener,
                        facts.client_software_name, facts.client_software_version)
                       ).plan(facts.api_key, facts.api_version)
    req = _FactsReq(facts)
    inactive = plan.inactive(req)
    topics = tuple(dict.fromkeys(facts.topics))
    outcome = plan.outcome(inactive, topics)
    effects = tuple(r.name for r in outcome.effects)
    records = tuple((t, tuple(r.name for r in rs)) for t, rs in outcome.record_rules.items())
    top = outcome.request_rule
    rewrite = top.params if top is not None and isinstance(top.params, Rewrite) else None
    refused = []
    for t in topics:
        rule = outcome.topic_rules[t]
        error = _refusal(rule, req, policy, True)
        if error is not None:
            refused.append(Refusal(t, rule.name if rule is not None else None, error))
    name = top.name if top is not None else None
    if topics and len(refused) == len(topics):
        first = refused[0]
        return Decision("deny", first.rule, first.error, tuple(refused), None, effects)
    if not topics:
        error = _refusal(top, req, policy, False)
        if error is not None:
            return Decision("deny", name, error, (), None, effects)
    action = "rewrite" if rewrite is not None else "allow"
    gone = {r.topic for r in refused}
    return Decision(action, name, None, tuple(refused), rewrite, effects,
                    tuple((t, names) for t, names in records if t not in gone))


# --------------------------------------------------------------------------------------------------
# Topic ids: one map per proxy, learned from the answers that pass


# --------------------------------------------------------------------------------------------------
# The filter


class RuleSource(Protocol):
    """Where the filter reads the rules in force (``RuleStore``); read on every request, so a
    reload takes effect on the next one."""

    @property
    def policy(self) -> Policy: ...


@attrs.frozen
class FixedRules:
    """A RuleSource that never changes (tests, benchmarks, embedding)."""

    policy: Policy

    @classmethod
    def of(cls, rule_set: RuleSet) -> FixedRules:
        return cls(Policy(rule_set))


@attrs.define(slots=True, eq=False)
class _Pending:
    """What on_response must do to the answer of one forwarded request."""

    prefixes: dict[str, str] = attrs.field(factory=dict)    # entity kind -> tenant prefix to take off
    parts: list[Any] = attrs.field(factory=list)            # kproxy's answers for refused topics
    hide: tuple[_Plan, tuple[int, ...], _Req] | None = None  # a listing: hide topics the rules refuse
    # After a split: the topic names and ids the broker was asked about; it answers for those only.
    asked: tuple[frozenset[str], frozenset[uuid.UUID]] | None = None


@attrs.define(slots=True, eq=False)
class _ConnState:
    policy: Policy | None = None
    key: Any = None
    view: _View | None = None


class PolicyFilter(Filter):
    """Applies the rules in force to every request (see the module docstring)."""

    name = "policy"
    request_api_keys = ALL
    response_api_keys = ALL
    reports_changes = True    # on_response marks every answer it may have changed

    def __init__(self, source: RuleSource, rng: random.Random | None = None,
                 topic_ids: TopicNames | None = None) -> None:
        self.source = source
        self.rng = rng if rng is not None else random.Random()
        # The process's table of topic names, which the session fills from the broker's answers
        # while rules name topics.
        self.topic_ids = topic_ids if topic_ids is not None else TopicNames()
        self.topic_ids.want(lambda: self.source.policy.uses_topic_names)

    # -- requests

    def _state(self, ctx: ConnectionContext) -> tuple[_ConnState, Policy]:
        policy = self.source.policy
        st: _ConnState = ctx.state_of(self, _ConnState)
        key = (ctx.client_id, ctx.principal, ctx.listener, ctx.client_software_name,
               ctx.client_software_version)
        if st.policy is not policy or st.key != key:
            # Connection selectors: judged again only when the rules or what they look at change.
            address = ctx.client_address[0] if ctx.client_address else None
            st.policy, st.key = policy, key
            st.view = policy.view((key[0], key[1], address, key[2], key[3], key[4]))
        return st, policy

    def on_request(self, ctx: ConnectionContext, exchange: Any) -> RequestVerdict:
        request: Request = exchange.request
        st, policy = self._state(ctx)
        assert st.view is not None
        plan = st.view.plan(request.api_key, request.api_version)
        if plan.idle and not policy.default_deny:
            return None
        return self._judge(ctx, exchange, st, policy, plan, request, asked=False)

    def may_stream_request(self, ctx: ConnectionContext, exchange: Any, head: Any) -> bool:
        """A Produce request streams when the rules that reach it on this connection can only let it
        through unchanged, judged from its head (acks, transactional id; the connection's
        selectors). Its later topics come after the first topic's records, so any rule that looks at
        topics or records, or could change the frame, means it is stored: a topic selector or
        ``default: deny`` (a partial denial), ``rewrite`` (a tenant prefix), ``validate`` and
        ``headers``, a ``compression`` selector or a ``require`` on batches (they read batch headers
        of every topic), ``cap`` (a changed ``timeout_ms``) and, with chaos enabled, ``chaos``. A
        request the remaining rules refuse as a whole is stored too, and refused as before."""
        if head.api_key != PRODUCE:
            return False
        st, policy = self._state(ctx)
        assert st.view is not None
        plan = st.view.plan(PRODUCE, head.api_version)
        if plan.idle and not policy.default_deny:
            return True
        if policy.default_deny or plan.topic_rules or plan.records:
            return False
        for rule in plan.rules:
            params = rule.params
            if (rule.action in ("rewrite", "cap") or (rule.action == "chaos" and policy.chaos)
                    or rule.match.compression is not None
                    or (isinstance(params, Require) and params.uses_batches)):
                return False
        rq = _HeadReq(head.values)
        top = plan.request_rule(plan.inactive(rq))
        if top is not None and top.action not in ("allow", "require"):
            return False
        return _refusal(top, rq, policy, True) is None

    def _judge(self, ctx: ConnectionContext, exchange: Any, st: _ConnState, policy: Policy, plan: _Plan,
               req: Request, asked: bool) -> RequestVerdict:
        body, key, version = req.body, req.api_key, req.api_version
        rq = _Req(key, version, body)
        inactive = () if plan.static is not None else plan.inactive(rq)
        top = plan.request_rule(inactive)
        rewrite = top.params if top is not None and isinstance(top.params, Rewrite) else None
        tenant = rewrite.topic_prefix if rewrite is not None else None

        # The topics the request names, by name and by id.
        # Names are needed when a rule looks at topics, or when the default refuses them all.
        defaulted = top is None and policy.default_deny
        names: list[str] = []
        if plan.topic_rules or defaulted or plan.records:
            names = list(dict.fromkeys(entities.collect(body, key, version, "request", "topic")))
        id_names: dict[uuid.UUID, str | None] = {}
        if plan.has_ids and (plan.topic_rules or tenant or defaulted or plan.records):
            ids = [i for i in dict.fromkeys(entities.collect(body, key, version, "request", "topic_id"))
                   if i != ZERO_UUID]
            unknown = [i for i in ids if self.topic_ids.get(i) is None]
            if unknown and not asked:
                return AskBroker(self.topic_ids.question(unknown),
                                 lambda answer: self._answered(ctx, exchange, req, answer))
            for i in ids:
                name = self.topic_ids.get(i)
                if name is not None and tenant:
                    # Outside the tenant's namespace is as unknown as a topic that does not exist.
                    name = name[len(tenant):] if name.startswith(tenant) else None
                id_names[i] = name
        judged = (tuple(dict.fromkeys([*names, *(n for n in id_names.values() if n is not None)])) if id_names
                  else tuple(names))
        outcome = plan.static if plan.static is not None and not judged else plan.outcome(inactive, judged)
        assert outcome is not None

        # Refusals, per topic name and per id.
        refused: dict[str, tuple[Rule | None, int]] = {}
        for t in outcome.refusable:
            rule = outcome.topic_rules[t]
            error = _refusal(rule, rq, policy, True)
            if error is not None:
                refused[t] = (rule, error)
        refused_ids: dict[uuid.UUID, tuple[Rule | None, int]] = {}
        for i, name in id_names.items():
            if name is None:
                refused_ids[i] = (None, UNKNOWN_TOPIC_ID)
            elif name in refused:
                refused_ids[i] = refused[name]
        named = bool(names or id_names)
        if not named:
            error = _refusal(top, rq, policy, False)
            if error is not None:
                if _names_topics(req):
                    error = _refusal(top, rq, policy, True) or error   # topics were not collected
                self._noted(ctx, exchange, top, "deny", req, error, ())
                return self._chaos_delay(ctx, policy, outcome, req, Respond(error_code=error))

        pending = _Pending()
        if refused or refused_ids:
            whole = named and refused.keys() >= set(names) and refused_ids.keys() >= id_names.keys()
            first_rule, first_error = next(iter(refused.values()), None) or next(iter(refused_ids.values()))
            self._noted(ctx, exchange, first_rule, "deny", req, first_error, [*refused, *map(str, refused_ids)])
            if key == PRODUCE and body.acks == 0:
                # No answer can carry per-topic errors; refused as a whole, the connection closes.
                return Respond(error_code=first_error)
            errors = {e for _, e in refused.values()} | {e for _, e in refused_ids.values()}
            if whole and len(errors) == 1 and not _forward_when_all_refused(req):
                return self._chaos_delay(ctx, policy, outcome, req, Respond(error_code=first_error))
            parts = _split(req, refused, refused_ids)
            if whole and not _forward_when_all_refused(req):
                merged = parts[0]
                for part in parts[1:]:
                    merge_response(key, version, merged, part)
                return self._chaos_delay(ctx, policy, outcome, req, Respond(body=merged))
            pending.parts = parts
            # By name, the answer names them (with their ids); by id, it may carry ids only.
            kept_ids = frozenset(id_names) - refused_ids.keys()
            pending.asked = (frozenset([*names, *(id_names[i] or "" for i in kept_ids)]) - refused.keys(),
                             frozenset() if names else kept_ids)
        else:
            self._noted(ctx, exchange, top, top.action if top is not None else None, req, None, ())

        # Chaos and log rules the request reaches; chaos answers before anything is changed.
        delay, chaos_error = self._roll(ctx, policy, outcome, req) if outcome.effects else (0.0, None)
        if chaos_error is not None:
            if exchange is not None:
                exchange.note("action", "chaos")
            return Delay(delay, Respond(error_code=chaos_error)) if delay else Respond(error_code=chaos_error)

        if outcome.record_rules:
            # Records are judged under the client's own names, before a tenant prefix goes on.
            answered = self._record_rules(ctx, exchange, req, outcome, id_names, pending)
            if answered is not None:
                return Delay(delay, answered) if delay else answered

        if rewrite is not None:
            refusal = _tenant_refusal(req)
            if refusal is not None:
                return refusal
            tenant_names = _tenant(rewrite)
            pending.prefixes = tenant_names.prefixes
            tenant_names.put_on(req)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("connection %d: rule %r rewrote %s v%d (%s)", ctx.connection_id, top.name if top else None,
                          api_name(key), version,
                          ", ".join(f"{e} prefix {safe(p)}" for e, p in pending.prefixes.items()))
        for rule in outcome.effects:
            if isinstance(rule.params, Cap):
                _cap(req, rule.params)
        if not named and plan.topic_rules:
            pending.hide = (plan, inactive, rq)
        if (pending.prefixes or pending.parts or pending.hide) and not (key == PRODUCE and body.acks == 0):
            # Read back when the answer comes; gone with the request if another filter answers it.
            exchange.keep(self, pending)
        return Delay(delay, None) if delay else None

    def _record_rules(self, ctx: ConnectionContext, exchange: Any, req: Request, outcome: _Outcome,
                      id_names: Mapping[uuid.UUID, str | None], pending: _Pending) -> Respond | None:
        """Validate and stamp the records of each topic its record rules reach. Partitions with a
        record that breaks a validate rule leave the request; kproxy answers for them with
        INVALID_RECORD (in ``pending.parts``, or at once when nothing is left to forward)."""
        body, version = req.body, req.api_version
        cap = ctx.max_decompressed_batch_bytes
        refused: list[tuple[Any, Any, Rule, Verdict]] = []
        edits: dict[tuple[Rule, ...], Any] = {}
        trace: tuple[int, int] | None = None
        rebuilt = 0
        for t in body.topic_data:
            name = t.name if version < 13 else id_names.get(t.topic_id)
            rules = outcome.record_rules.get(name) if name is not None else None
            if not rules:
                continue
            validators = [r for r in rules if r.action == "validate"]
            stampers = tuple(r for r in rules if r.action == "headers")
            kept = []
            for part in t.partition_data:
                records = part.records
                if not records:
                    kept.append(part)
                    continue
                bad = None
                for rule in validators:
                    verdict = validate_records(rule, records, cap)
                    if verdict is not None:
                        bad = (rule, verdict)
                        break
                if bad is not None:
                    refused.append((t, part, *bad))
                    continue
                kept.append(part)
                if not stampers:
                    continue
                edit = edits.get(stampers)
                if edit is None:
                    if trace is None and any(isinstance(r.params, Headers) and r.params.traceparent for r in stampers):
                        # The produce span's ids, chosen now so records can name it; telemetry
                        # creates the span with them once the request is complete.
                        trace = (self.rng.getrandbits(128) or 1, self.rng.getrandbits(64) or 1)
                    edit = edits[stampers] = header_edit(stampers, ctx.client_id, ctx.principal,
                                                         traceparent(*trace) if trace is not None else None)
                try:
                    new, n = rewrite_records(records, edit, cap)
                except RecordsError as e:
                    # The broker judges a batch kproxy cannot read (CORRUPT_MESSAGE); kproxy leaves it be.
                    log.debug("connection %d: rule %r left a batch of %s[%d] as it was: %s", ctx.connection_id,
                              stampers[0].name, safe(name), part.index, e)
                    continue
                if new is not None:
                    part.records = new
                    rebuilt += n
            if len(kept) != len(t.partition_data):
                t.partition_data = kept
        if exchange is not None and rebuilt:
            # Changed on purpose: the transparency check and telemetry must not take it for a fault.
            exchange.note("rewritten_batches", rebuilt)
            if trace is not None:
                exchange.note("trace_context", trace)
        if not refused:
            return None
        first_topic, first_part, first_rule, first_verdict = refused[0]
        if exchange is not None:
            exchange.note("records_refused", [
                {"rule": rule.name, "topic": t.name if version < 13 else id_names.get(t.topic_id),
                 "partition": part.index, "records": v.broken}
                for t, part, rule, v in refused])
            if not (exchange.notes or {}).get("rule"):
                exchange.note("rule", first_rule.name)
                exchange.note("action", "validate")
        if log.isEnabledFor(logging.DEBUG):
            log.debug("connection %d: rule %r refused the batch of %s[%d] (%s): %s", ctx.connection_id,
                      first_rule.name, safe(first_topic.name if version < 13 else str(first_topic.topic_id)),
                      first_part.index, error_name(INVALID_RECORD), first_verdict.message)
        if body.acks == 0:
            # No answer can carry per-partition errors; refused as a whole, the connection closes.
            return Respond(error_code=INVALID_RECORD)
        answer = _invalid_record_answer(version, refused)
        body.topic_data = [t for t in body.topic_data if t.partition_data]
        if not body.topic_data:
            for part in pending.parts:
                merge_response(PRODUCE, version, answer, part)
            pending.parts = []
            return Respond(body=answer)
        pending.parts.append(answer)
        return None

    def _answered(self, ctx: ConnectionContext, exchange: Any, req: Request, answer: Response | None
                  ) -> RequestVerdict:
        """The broker's answer to a question about topic ids: learn, then judge with what is known."""
        if answer is not None:
            self.topic_ids.learn(answer.body.topics)
        st: _ConnState = ctx.state_of(self, _ConnState)
        assert st.view is not None and st.policy is not None
        plan = st.view.plan(req.api_key, req.api_version)
        return self._judge(ctx, exchange, st, st.policy, plan, req, asked=True)

    def _noted(self, ctx: ConnectionContext, exchange: Any, rule: Rule | None, action: str | None, req: Request,
               error: int | None, topics: list[str] | tuple[str, ...]) -> None:
        """Record the decision on the completed-request entry, and log a refusal at DEBUG."""
        if action is None or (rule is None and action != "deny"):
            return
        if exchange is not None:
            exchange.note("rule", rule.name if rule is not None else "default")
            exchange.note("action", action)
        if action == "deny" and log.isEnabledFor(logging.DEBUG):
            what = f" for topics {safe(', '.join(topics))}" if topics else ""
            log.debug("connection %d: rule %r refused %s v%d%s (%s)", ctx.connection_id,
                      rule.name if rule is not None else "default", api_name(req.api_key), req.api_version,
                      what, error_name(error or 0))

    def _roll(self, ctx: ConnectionContext, policy: Policy, outcome: _Outcome, req: Request
              ) -> tuple[float, int | None]:
        """Chaos (only when enabled) and log rules: (seconds of injected latency, injected error)."""
        delay, error = 0.0, None
        for rule in outcome.effects:
            params = rule.params
            if isinstance(params, Log):
                if params.sample >= 1 or self.rng.random() < params.sample:
                    _log_request(ctx, rule, params, req)
            elif isinstance(params, Chaos) and policy.chaos:
                if params.rate < 1 and self.rng.random() >= params.rate:
                    continue
                latency = params.latency
                seconds = latency.draw(self.rng) if latency is not None else 0.0
                # Several chaos rules on one request add up, to the same bound as one.
                delay = min(delay + seconds, MAX_LATENCY_S)
                if params.error is not None and error is None:
                    error = params.error
                what = [f"delayed by {seconds * 1000:.0f} ms"] if latency else []
                if params.error is not None:
                    what.append(f"failed with {error_name(params.error)}")
                log.info("chaos: rule %r: connection %d's %s v%d %s", rule.name, ctx.connection_id,
                         api_name(req.api_key), req.api_version, " and ".join(what))
        return delay, error

    def _chaos_delay(self, ctx: ConnectionContext, policy: Policy, outcome: _Outcome, req: Request,
                     verdict: Respond) -> RequestVerdict:
        """A refusal still reaches the chaos and log rules before it (their latency applies)."""
        delay, _ = self._roll(ctx, policy, outcome, req)
        return Delay(delay, verdict) if delay else verdict

    # -- responses

    def may_stream_response(self, ctx: ConnectionContext, exchange: Any) -> bool:
        """A Fetch answer may stream when ``on_response`` would leave it as it is: no refused topic's
        answer to merge in, no topic to keep out of it, and no tenant prefix to take off names it
        carries (Fetch from v13 names topics by id only). Record rules judge produced records only:
        none reads a Fetch answer."""
        if exchange.api_key != FETCH:
            return False
        pending: _Pending | None = exchange.kept(self)
        if pending is None:
            return True
        if pending.parts or pending.asked is not None:
            return False
        version = exchange.api_version
        if pending.hide is not None and entities.has_entity(FETCH, version, "response", "topic"):
            return False
        return not (pending.prefixes and _tenant_of(pending.prefixes).undoing(FETCH, version))

    def on_response(self, ctx: ConnectionContext, exchange: Any, response: Response) -> float:
        pending: _Pending | None = exchange.kept(self)
        if pending is None:
            return 0.0
        if pending.prefixes or pending.asked is not None or pending.hide is not None or pending.parts:
            # Names taken off or hidden, topics the client did not ask about dropped, refusals merged in.
            exchange.response_changed = True
        request: Request = exchange.request
        key = response.api_key
        st: _ConnState = ctx.state_of(self, _ConnState)
        body, version = response.body, response.api_version
        if pending.prefixes:
            # Names outside the tenant's namespace are not the tenant's to see.
            _tenant_of(pending.prefixes).take_off(response, request.body)
        if pending.asked is not None:
            # A broker may say more than it was asked (tansu reads an empty Metadata topic list as
            # "all"): kproxy answers for the refused topics itself, and nothing else is the client's.
            names, ids = pending.asked
            if ids:
                entities.filter_elements(body, key, version, "response", "topic_id",
                                         functools.partial(_asked_id, ids), request.body)
            else:
                entities.filter_elements(body, key, version, "response", "topic", names.__contains__,
                                         request.body)
        if pending.hide is not None:
            plan, inactive, rq = pending.hide
            policy = st.policy
            assert policy is not None

            def visible(t: str) -> bool:
                rule = plan.outcome(inactive, (t,)).topic_rules[t]
                return _refusal(rule, rq, policy, True) is None

            entities.filter_elements(body, key, version, "response", "topic", visible, request.body)
        for part in pending.parts:
            merge_response(key, version, body, part)
        return 0.0


# --------------------------------------------------------------------------------------------------
# Carrying decisions out


# A tenant's names use the one prefix mechanism of kproxy.proxy.names (a replica's topic prefix is the other).
_TenantNames = NamePrefixes
_tenant_of = prefixes_of

_BY_REWRITE: dict[int, tuple[Rewrite, _TenantNames]] = {}


def _tenant(rewrite: Rewrite) -> _TenantNames:
    got = _BY_REWRITE.get(id(rewrite))
    if got is None or got[0] is not rewrite:
        if len(_BY_REWRITE) >= _CACHE_LIMIT:
            _BY_REWRITE.clear()
        got = _BY_REWRITE[id(rewrite)] = (rewrite, _tenant_of(rewrite.prefixes()))
    return got[1]


def _asked_id(ids: frozenset[uuid.UUID], topic_id: uuid.UUID) -> bool:
    return topic_id == ZERO_UUID or topic_id in ids


def _names_topics(req: Request) -> bool:
    key, version = req.api_key, req.api_version
    return bool(entities.collect(req.body, key, version, "request", "topic")) or any(
        i != ZERO_UUID for i in entities.collect(req.body, key, version, "request", "topic_id"))


def _forward_when_all_refused(req: Request) -> bool:
    """Whether a request with every topic refused still goes to the broker (without them): a
    Metadata request still needs the brokers, an incremental Fetch keeps its session."""
    if req.api_key == METADATA:
        return req.api_version >= 1     # v0 reads an empty topic list as "all topics"
    return req.api_key == FETCH and req.api_version >= 7 and req.body.session_epoch > 0


def _split(req: Request, refused: Mapping[str, tuple[Rule | None, int]],
           refused_ids: Mapping[uuid.UUID, tuple[Rule | None, int]]) -> list[Any]:
    """Take the refused topics out of ``req`` (in place); return kproxy's answers for them, one
    response body per error code, built like a broker's from a copy of the request holding only them."""
    key, version = req.api_key, req.api_version
    frame = encode_request(req)
    copy = bytes(frame) if isinstance(frame, bytearray) else b"".join(bytes(b) for b in frame)
    parts = []
    codes = {e for _, e in refused.values()} | {e for _, e in refused_ids.values()}
    for code in sorted(codes):
        names = {t for t, (_, e) in refused.items() if e == code}
        ids = {ZERO_UUID} | {i for i, (_, e) in refused_ids.items() if e == code}   # zero: named, not by id
        only = decode_request(copy, keep_trailing=True)
        entities.filter_elements(only.body, key, version, "request", "topic", names.__contains__)
        entities.filter_elements(only.body, key, version, "request", "topic_id", ids.__contains__)
        answer = error_response(only, code)
        if answer is not None:
            parts.append(answer.body)
    entities.filter_elements(req.body, key, version, "request", "topic", lambda t: t not in refused)
    entities.filter_elements(req.body, key, version, "request", "topic_id", lambda i: i not in refused_ids)
    return parts


def _invalid_record_answer(version: int, refused: list[tuple[Any, Any, Rule, Verdict]]) -> Any:
    """kproxy's Produce answer for partitions refused by validate rules: INVALID_RECORD with the
    records at fault (``record_errors`` and ``error_message`` exist from v8; older versions carry
    the error code alone, as a broker's answer would)."""
    cls: Any = body_class(PRODUCE, "response")
    topics: dict[int, Any] = {}
    for t, part, _, verdict in refused:
        entry = topics.get(id(t))
        if entry is None:
            entry = topics[id(t)] = (cls.TopicProduceResponse(name=t.name, partition_responses=[]) if version < 13
                                     else cls.TopicProduceResponse(topic_id=t.topic_id, partition_responses=[]))
        entry.partition_responses.append(cls.PartitionProduceResponse(
            index=part.index, error_code=INVALID_RECORD, base_offset=-1, log_append_time_ms=-1,
            log_start_offset=-1,
            record_errors=[cls.BatchIndexAndErrorMessage(batch_index=e.batch_index, batch_index_error_message=e.message)
                           for e in verdict.errors],
            error_message=verdict.message))
    return cls(responses=list(topics.values()))


def _cap(req: Request, cap: Cap) -> None:
    body = req.body
    if req.api_key == FETCH:
        if cap.max_wait_ms is not None and body.max_wait_ms > cap.max_wait_ms:
            body.max_wait_ms = cap.max_wait_ms
        if cap.max_bytes is not None and req.api_version >= 3 and body.max_bytes > cap.max_bytes:
            body.max_bytes = cap.max_bytes
        if cap.partition_max_bytes is not None:
            for topic in body.topics:
                for part in topic.partitions:
                    if part.partition_max_bytes > cap.partition_max_bytes:
                        part.partition_max_bytes = cap.partition_max_bytes
    elif req.api_key == PRODUCE and cap.timeout_ms is not None and body.timeout_ms > cap.timeout_ms:
        body.timeout_ms = cap.timeout_ms


def _log_request(ctx: ConnectionContext, rule: Rule, params: Log, req: Request) -> None:
    if not log.isEnabledFor(params.level):
        return
    topics = entities.collect(req.body, req.api_key, req.api_version, "request", "topic")
    shown = ", ".join(dict.fromkeys(topics))
    log.log(params.level, "rule %r: connection %d (client id %s, principal %s) %s v%d%s", rule.name,
            ctx.connection_id, safe(ctx.client_id), safe(ctx.principal or ANONYMOUS), api_name(req.api_key),
            req.api_version, f" topics {safe(shown)}" if shown else "")


def _tenant_refusal(req: Request) -> Respond | None:
    """The answer to a request a tenant prefix cannot keep inside the tenant's namespace, or None."""
    if req.api_key in (CREATE_ACLS, DELETE_ACLS):
        # Wildcards, null filters and the ANY type would reach other tenants' resources. One result
        # per creation or filter, as the broker gives.
        message = "kproxy: ACLs cannot be changed by a client with a tenant prefix"
        cls: Any = body_class(req.api_key, "response")
        if req.api_key == CREATE_ACLS:
            body = cls(results=[cls.AclCreationResult(error_code=CLUSTER_AUTHORIZATION_FAILED, error_message=message)
                                for _ in req.body.creations])
        else:
            body = cls(filter_results=[cls.DeleteAclsFilterResult(error_code=CLUSTER_AUTHORIZATION_FAILED,
                                                                  error_message=message)
                                       for _ in req.body.filters])
        return Respond(body=body)
    if uses_patterns(req):
        return Respond(error_code=INVALID_REGULAR_EXPRESSION,
                       error_message="kproxy: name patterns cannot be used with a tenant prefix; subscribe "
                                     "by topic names, or match them in the client")
    return None

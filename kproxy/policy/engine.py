"""Judging Kafka requests against a rule set: what the rules decide, never how it is carried out.

A ``Policy`` is a rule set compiled for judging: per kind of connection the rules whose connection
selectors hold (``View``), per api version the rules that can apply (``Plan``), per request shape
how it goes down them (``Outcome``: the deciding rule of the request and of each topic, the cap,
chaos, log and record rules it reaches). ``decide(rules, facts)`` says what a rule set does with one
request described by plain values (the traffic-log dry run uses it); ``PolicyFilter``
(``kproxy.policy.filter``) asks the same Policy about live requests and acts. Matchers are compiled
once per rule set and connection selectors judged once per connection and rule set. Pure: no I/O
and no clocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import attrs

from kproxy.policy.model import (
    COMPRESSIONS,
    DECIDING,
    FETCH_RECORD_ACTIONS,
    RECORD_ACTIONS,
    Deny,
    Encrypt,
    Require,
    Rewrite,
    Rule,
    RuleSet,
)
from kproxy.protocol import entities
from kproxy.protocol.errors import (
    CLUSTER_AUTHORIZATION_FAILED,
    GROUP_AUTHORIZATION_FAILED,
    INVALID_REQUIRED_ACKS,
    POLICY_VIOLATION,
    TOPIC_AUTHORIZATION_FAILED,
    TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
    RecordsError,
)
from kproxy.protocol.records import iter_batches

PRODUCE, FETCH, METADATA, CREATE_ACLS, DELETE_ACLS, DESCRIBE_TOPIC_PARTITIONS = 0, 1, 3, 30, 31, 75
_REQUEST_SELECTORS = ("acks", "compression", "group", "transactional_id")
_EFFECTS = ("cap", "chaos", "log")
CACHE_LIMIT = 4096     # entries per cache before it starts over (bounded memory, whatever clients send)


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


class RequestFacts:
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


class _FactsReq(RequestFacts):
    """RequestFacts over plain Facts."""

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


class HeadFacts(RequestFacts):
    """RequestFacts over a streamed Produce request's head: acks and the transactional id are known; its
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


def _request_holds(rule: Rule, req: RequestFacts) -> bool:
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


def _broken(require: Require, req: RequestFacts) -> int | None:
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
class Outcome:
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
    if rule.action in FETCH_RECORD_ACTIONS and api_key != FETCH:
        return False        # masks act on Fetch answers only
    if kinds is None:
        return True
    if m.group is not None and "group" not in kinds:
        return False
    if m.transactional_id is not None and "txn" not in kinds:
        return False
    return m.topic is None or "topic" in kinds or "topic_id" in kinds


class Plan:
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
        self._outcomes: dict[tuple[tuple[int, ...], tuple[str, ...]], Outcome] = {}
        self.has_ids = kinds is not None and "topic_id" in kinds
        # Without topic or request selectors every request of this kind goes the same way.
        self.static = None if self.topic_rules or self.request_positions or self.records else self.outcome((), ())

    def inactive(self, req: RequestFacts) -> tuple[int, ...]:
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

    def outcome(self, inactive: tuple[int, ...], topics: tuple[str, ...]) -> Outcome:
        key = (inactive, topics)
        got = self._outcomes.get(key)
        if got is None:
            if len(self._outcomes) >= CACHE_LIMIT:
                self._outcomes.clear()
            got = self._outcomes[key] = self._evaluate(inactive, topics)
        return got

    def _evaluate(self, inactive: tuple[int, ...], topics: tuple[str, ...]) -> Outcome:
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
        return Outcome(rules[request_at] if request_at < n else None, deciding, tuple(effects), refusable,
                       record_rules)


ConnectionKey = tuple[str | None, str | None, str | None, str | None, str | None, str | None]


class View:
    """The rules whose connection selectors hold for one kind of connection."""

    __slots__ = ("_default_deny", "_plans", "rules")

    def __init__(self, rules: tuple[Rule, ...], default_deny: bool) -> None:
        self.rules = rules
        self._default_deny = default_deny
        self._plans: dict[tuple[int, int], Plan] = {}

    def plan(self, api_key: int, version: int) -> Plan:
        plan = self._plans.get((api_key, version))
        if plan is None:
            chosen = tuple(r for r in self.rules
                           if (r.match.api is None or r.match.api(api_key))
                           and (r.match.api_version is None or r.match.api_version(version)))
            plan = self._plans[(api_key, version)] = Plan(chosen, api_key, version, self._default_deny)
        return plan


class Policy:
    """A rule set compiled for judging, with its caches; build one per load and share it."""

    def __init__(self, rule_set: RuleSet) -> None:
        self.rule_set = rule_set
        self.default_deny = rule_set.default == "deny"
        self.chaos = rule_set.chaos_enabled
        self._views: dict[ConnectionKey, View] = {}
        # Topic ids need names when a rule looks at topics or a tenant's namespace must be kept.
        self.uses_topic_names = any(
            r.match.topic is not None or (isinstance(r.params, Rewrite) and r.params.topic_prefix)
            or r.action in RECORD_ACTIONS or r.action in FETCH_RECORD_ACTIONS
            for r in rule_set.rules) or self.default_deny
        # Encrypt rules by topic: Fetch answers of the topics they name are opened, whoever reads.
        self.encrypting = tuple(r for r in rule_set.rules if r.action == "encrypt")
        self.masking = any(r.action == "mask" for r in rule_set.rules)
        self._encrypted: dict[str, bool] = {}
        # Every rule, whatever its connection selectors: what some connection's View could hold.
        self._anyone = View(rule_set.rules, self.default_deny)
        # addresses() by (api key << 16 | version), for callers that look up before they call.
        self.addressed: dict[int, bool] = {}

    def addresses(self, api_key: int, version: int) -> bool:
        """Whether a rule could apply to this api version on some connection, or the default denies:
        the rules' ``api`` and ``api_version`` selectors, and whether what a rule selects can be in
        such a request (``_can_apply``), as a connection's ``View`` chooses them, but ignoring every
        connection selector (a superset of any connection's plan). False means the policy lets
        every such request through untouched and unread, whoever sends it."""
        key = api_key << 16 | version
        got = self.addressed.get(key)
        if got is None:
            if len(self.addressed) >= CACHE_LIMIT:
                self.addressed.clear()
            got = self.addressed[key] = self.default_deny or not self._anyone.plan(api_key, version).idle
        return got

    def encrypts(self, topic: str) -> bool:
        """Whether an encrypt rule names ``topic`` (its Fetch answers may hold sealed records)."""
        got = self._encrypted.get(topic)
        if got is None:
            if len(self._encrypted) >= CACHE_LIMIT:
                self._encrypted.clear()
            got = self._encrypted[topic] = any(r.match.topic is None or r.match.topic(topic) for r in self.encrypting)
        return got

    def keks(self) -> list[str]:
        """The KEK names encrypt rules give whole (a ``${topic}`` template is known only per topic)."""
        out: list[str] = []
        for r in self.encrypting:
            assert isinstance(r.params, Encrypt)
            if "${" not in r.params.kek and r.params.kek not in out:
                out.append(r.params.kek)
        return out

    def view(self, key: ConnectionKey) -> View:
        """The rules for a connection (client id, principal, source address, listener, client
        software name and version)."""
        got = self._views.get(key)
        if got is None:
            if len(self._views) >= CACHE_LIMIT:
                self._views.clear()
            chosen = tuple(r for r in self.rule_set.rules if r.match.holds_for_connection(*key))
            got = self._views[key] = View(chosen, self.default_deny)
        return got


def default_error(rule: Rule | None, req: RequestFacts, topics: bool) -> int:
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


def refusal_error(rule: Rule | None, req: RequestFacts, policy: Policy, topics: bool) -> int | None:
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
        error = refusal_error(rule, req, policy, True)
        if error is not None:
            refused.append(Refusal(t, rule.name if rule is not None else None, error))
    name = top.name if top is not None else None
    if topics and len(refused) == len(topics):
        first = refused[0]
        return Decision("deny", first.rule, first.error, tuple(refused), None, effects)
    if not topics:
        error = refusal_error(top, req, policy, False)
        if error is not None:
            return Decision("deny", name, error, (), None, effects)
    action = "rewrite" if rewrite is not None else "allow"
    gone = {r.topic for r in refused}
    return Decision(action, name, None, tuple(refused), rewrite, effects,
                    tuple((t, names) for t, names in records if t not in gone))


# --------------------------------------------------------------------------------------------------
# Where filters read the rules in force (the policy filter, and the quota filter through its own protocol)


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

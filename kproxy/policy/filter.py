"""The policy filter: judges decoded requests with the rules in force (``kproxy.policy.engine``) and
acts. It refuses topics (forwarding the rest and merging its errors into the broker's answer),
prefixes tenant names and takes the prefix off every answer (``kproxy.policy.tenants``), applies
record rules to produced batches, lowers Fetch and Produce limits, injects chaos and logs. Pure: no
I/O and no clocks; randomness comes from an injected generator.
"""

from __future__ import annotations

import functools
import logging
import random
import uuid
from collections.abc import Mapping
from typing import Any

import attrs

from kproxy.envelope import DataKey, KeyRef, MissingDataKey
from kproxy.logs import safe
from kproxy.policy import crypto as C
from kproxy.policy.engine import (
    FETCH,
    METADATA,
    PRODUCE,
    HeadFacts,
    Outcome,
    Plan,
    Policy,
    RequestFacts,
    RuleSource,
    View,
    refusal_error,
)
from kproxy.policy.model import (
    ANONYMOUS,
    MAX_LATENCY_S,
    Cap,
    Chaos,
    Encrypt,
    Headers,
    Log,
    Mask,
    Require,
    Rewrite,
    Rule,
)
from kproxy.policy.record_rules import Verdict, header_edit, rewrite_records, traceparent, validate_records
from kproxy.policy.tenants import tenant_of, tenant_of_rewrite, tenant_refusal
from kproxy.protocol import entities
from kproxy.protocol.errors import (
    INVALID_RECORD,
    KAFKA_STORAGE_ERROR,
    POLICY_VIOLATION,
    UNKNOWN_TOPIC_ID,
    RecordsError,
    error_name,
)
from kproxy.protocol.messages import Request, Response, api_name, body_class, decode_request, encode_request
from kproxy.protocol.primitives import ZERO_UUID
from kproxy.proxy.filters import (
    ALL,
    AskBroker,
    AskKeys,
    ConnectionContext,
    Delay,
    Filter,
    RequestVerdict,
    Respond,
)
from kproxy.proxy.replies import error_response, merge_response
from kproxy.proxy.topics import TopicNames

log = logging.getLogger("kproxy.policy")

SHARE_FETCH = 78                 # share groups' Fetch (KIP-932): its answers carry records too
FETCH_MASK_VERSION = 13          # mask rules for a ShareFetch answer are those of Fetch v13 (topics by id)


@attrs.define(slots=True, eq=False)
class _Pending:
    """What on_response must do to the answer of one forwarded request."""

    prefixes: dict[str, str] = attrs.field(factory=dict)    # entity kind -> tenant prefix to take off
    parts: list[Any] = attrs.field(factory=list)            # kproxy's answers for refused topics
    hide: tuple[Plan, tuple[int, ...], RequestFacts] | None = None  # a listing: hide topics the rules refuse
    # After a split: the topic names and ids the broker was asked about; it answers for those only.
    asked: tuple[frozenset[str], frozenset[uuid.UUID]] | None = None
    # Produced partitions an encrypt rule reaches: (topic as the client names it, topic, partition, rule).
    seal: list[tuple[str, Any, Any, Rule]] = attrs.field(factory=list)
    # A Fetch answer's partitions that record rules open or mask (question_for_response).
    fetched: _Fetched | None = None


@attrs.define(slots=True, eq=False)
class _Fetched:
    """A Fetch answer's partitions that record rules change, opened and masked as far as the DEKs in
    the cache allow (``question_for_response``); those still waiting for a DEK, and what the key
    service answered for them."""

    # (topic, partition data, batches read, masks, whether the topic is encrypted)
    parts: list[tuple[str, Any, list[Any], tuple[Mask, ...], bool]] = attrs.field(factory=list)
    results: dict[int, bytes | bytearray | None] = attrs.field(factory=dict)  # index in parts -> records, or unchanged
    waiting: list[int] = attrs.field(factory=list)                   # indexes of parts that need a DEK
    missing: list[KeyRef] = attrs.field(factory=list)                # the DEKs they need
    deks: dict[KeyRef, DataKey] = attrs.field(factory=dict)
    errors: dict[KeyRef, Any] = attrs.field(factory=dict)
    # Partitions refused: (topic, partition data, offset or -1, reason, message, retriable).
    refused: list[tuple[str, Any, int, str, str, bool]] = attrs.field(factory=list)
    done: bool = False
    opened_batches: int = 0

    def answered(self, answer: Mapping[KeyRef, Any] | None) -> None:
        for ref in self.missing:
            got = answer.get(ref) if answer is not None else None
            if isinstance(got, DataKey):
                self.deks[ref] = got
            else:
                self.errors[ref] = got


@attrs.define(slots=True, eq=False)
class _ConnState:
    policy: Policy | None = None
    key: Any = None
    view: View | None = None


class PolicyFilter(Filter):
    """Applies the rules in force to every request (see the module docstring)."""

    name = "policy"
    request_api_keys = ALL
    response_api_keys = ALL
    reports_changes = True    # on_response marks every answer it may have changed

    asks_for_response = True   # a Fetch answer with sealed records may need DEKs first
    # Apis no rule addresses go by undecoded (``passes``); their answers then have nothing to read.
    may_pass = True

    def __init__(self, source: RuleSource, rng: random.Random | None = None,
                 topic_ids: TopicNames | None = None, crypto: C.RecordCrypto | None = None) -> None:
        self.source = source
        # The process's data keys (record encryption); None when no KMS is configured.
        self.crypto = crypto
        self.rng = rng if rng is not None else random.Random()
        # The process's table of topic names, which the session fills from the broker's answers
        # while rules name topics.
        self.topic_ids = topic_ids if topic_ids is not None else TopicNames()
        self.topic_ids.want(lambda: self.source.policy.uses_topic_names)

    def passes(self, api_key: int, api_version: int) -> bool:
        """No rule in force could apply to this api version on any connection, and the default
        allows: ``on_request`` would return at once (an idle plan) and keep nothing. Fetch and
        ShareFetch answers are read for record rules whatever their requests were, so never pass."""
        policy = self.source.policy
        addressed = policy.addressed.get(api_key << 16 | api_version)    # asked per request: no call when known
        if addressed is None:
            addressed = policy.addresses(api_key, api_version)
        return not addressed and api_key not in (FETCH, SHARE_FETCH)

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
        rq = HeadFacts(head.values)
        top = plan.request_rule(plan.inactive(rq))
        if top is not None and top.action not in ("allow", "require"):
            return False
        return refusal_error(top, rq, policy, True) is None

    def _judge(self, ctx: ConnectionContext, exchange: Any, st: _ConnState, policy: Policy, plan: Plan,
               req: Request, asked: bool) -> RequestVerdict:
        body, key, version = req.body, req.api_key, req.api_version
        rq = RequestFacts(key, version, body)
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
            error = refusal_error(rule, rq, policy, True)
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
            error = refusal_error(top, rq, policy, False)
            if error is not None:
                if _names_topics(req):
                    error = refusal_error(top, rq, policy, True) or error   # topics were not collected
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
            refusal = tenant_refusal(req)
            if refusal is not None:
                return refusal
            tenant_names = tenant_of_rewrite(rewrite)
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
        verdict = Delay(delay, None) if delay else None
        if pending.seal:
            return self._sealing(ctx, exchange, req, pending, verdict)
        return verdict

    def _record_rules(self, ctx: ConnectionContext, exchange: Any, req: Request, outcome: Outcome,
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
            encrypter = next((r for r in rules if r.action == "encrypt"), None)
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
            if encrypter is not None:
                # Sealed last, once validate and headers rules have seen the plaintext.
                assert name is not None
                pending.seal.extend((name, t, part, encrypter) for part in kept if part.records)
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

    def _roll(self, ctx: ConnectionContext, policy: Policy, outcome: Outcome, req: Request
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

    def _chaos_delay(self, ctx: ConnectionContext, policy: Policy, outcome: Outcome, req: Request,
                     verdict: Respond) -> RequestVerdict:
        """A refusal still reaches the chaos and log rules before it (their latency applies)."""
        delay, _ = self._roll(ctx, policy, outcome, req)
        return Delay(delay, verdict) if delay else verdict

    # -- record encryption (encrypt rules) on produced records

    def _sealing(self, ctx: ConnectionContext, exchange: Any, req: Request, pending: _Pending,
                 verdict: RequestVerdict) -> RequestVerdict:
        """Seal the partitions encrypt rules reach with DEKs the ring holds; when it is short, ask the
        key service (the client is not read meanwhile) and seal with its answer. A partition that
        cannot be sealed is refused, never forwarded in plaintext."""
        crypto = self.crypto
        version = req.api_version
        jobs: list[tuple[str, str, Any, Any, Rule, str, list[Any]]] = []
        refused: list[tuple[Any, Any, int, str, Rule, str]] = []
        for name, t, part, rule in pending.seal:
            params = rule.params
            assert isinstance(params, Encrypt)
            # The associated data binds the topic as the broker names it (a tenant's prefix included).
            bound = t.name if version < 13 else (self.topic_ids.get(t.topic_id) or name)
            if crypto is None:
                refused.append((t, part, POLICY_VIOLATION, "kproxy: an encrypt rule needs a kms: section in the "
                                                           "configuration", rule, "no_kms"))
                continue
            try:
                batches = C.sealable_batches(part.records)
            except C.Unsealable as e:
                refused.append((t, part, INVALID_RECORD, f"kproxy: {e}", rule, "unreadable"))
                continue
            jobs.append((name, bound, t, part, rule, params.kek_for(name), batches))
        pending.seal = []
        grants: dict[str, Any] = {}
        missing: list[tuple[str, int]] = []
        if crypto is not None and jobs:
            needs: dict[str, int] = {}
            for _, _, _, _, rule, kek, batches in jobs:
                assert isinstance(rule.params, Encrypt)
                needs[kek] = needs.get(kek, 0) + C.units(batches, rule.params.keys)
            now = crypto.clock()
            for kek, n in needs.items():
                got = crypto.ring.reserve(kek, n, now)
                if got is None:
                    missing.append((kek, n))
                else:
                    grants[kek] = got
        if missing:
            def then(answer: Any) -> RequestVerdict:
                errors: dict[str, Any] = {}
                for kek, _ in missing:
                    got = answer.get(kek) if answer is not None else None
                    if isinstance(got, list):
                        grants[kek] = got
                    else:
                        errors[kek] = got
                return self._sealed(ctx, exchange, req, pending, verdict, jobs, refused, grants, errors)

            return AskKeys(C.SealKeys(tuple(missing)), then)
        return self._sealed(ctx, exchange, req, pending, verdict, jobs, refused, grants, {})

    def _sealed(self, ctx: ConnectionContext, exchange: Any, req: Request, pending: _Pending,
                verdict: RequestVerdict, jobs: list[tuple[str, str, Any, Any, Rule, str, list[Any]]],
                refused: list[tuple[Any, Any, int, str, Rule, str]], grants: Mapping[str, Any],
                errors: Mapping[str, Any]) -> RequestVerdict:
        crypto = self.crypto
        cap = ctx.max_decompressed_batch_bytes
        by_kek = {kek: C.Grants(g) for kek, g in grants.items()}
        sealed_batches = sealed_records = 0
        first_rule: Rule | None = None
        for _name, bound, t, part, rule, kek, batches in jobs:
            params = rule.params
            assert isinstance(params, Encrypt)
            if kek in errors:
                e = errors[kek]
                retriable = e is None or e.retriable
                refused.append((t, part, KAFKA_STORAGE_ERROR if retriable else POLICY_VIOLATION,
                                f"kproxy: no data key for KEK {kek!r}: "
                                f"{e if e is not None else 'the KMS did not answer within the request timeout'}",
                                rule, e.reason if e is not None else "timeout"))
                continue
            try:
                new, nb, nr = C.seal_partition(batches, bound, by_kek[kek], params.keys, cap)
            except RecordsError as e:
                refused.append((t, part, INVALID_RECORD, f"kproxy: cannot read the records to encrypt them: {e}",
                                rule, "unreadable"))
                continue
            part.records = new
            sealed_batches += nb
            sealed_records += nr
            first_rule = first_rule or rule
        if crypto is not None:
            crypto.batches_encrypted += sealed_batches
            crypto.records_encrypted += sealed_records
        if exchange is not None and sealed_batches:
            notes = exchange.notes or {}
            exchange.note("rewritten_batches", notes.get("rewritten_batches", 0) + sealed_batches)
            exchange.note("encrypted_batches", sealed_batches)
            exchange.note("record_rule", first_rule.name if first_rule is not None else None)
        if not refused:
            return verdict
        body, version = req.body, req.api_version
        for t, part, code, message, rule, reason in refused:
            topic = t.name if version < 13 else str(t.topic_id)
            if crypto is not None:
                crypto.failed(reason)
            if crypto is None or crypto.worth_logging((topic, part.index, reason)):
                # Once a minute per partition and reason: clients retry a KMS outage many times a second.
                log.warning("rule %r: refused a Produce to %s[%d] from connection %d (%s): %s", rule.name,
                            safe(topic), part.index, ctx.connection_id, error_name(code), message)
        if exchange is not None:
            exchange.note("record_rule", refused[0][4].name)
        if body.acks == 0:
            # No answer can carry per-partition errors; refused as a whole, the connection closes.
            return Respond(error_code=refused[0][2])
        gone = {id(p) for _, p, *_ in refused}
        answer = _partition_errors_answer(version, [(t, p, code, message, []) for t, p, code, message, _, _ in refused])
        for t in body.topic_data:
            t.partition_data = [p for p in t.partition_data if id(p) not in gone]
        body.topic_data = [t for t in body.topic_data if t.partition_data]
        if not body.topic_data:
            for part in pending.parts:
                merge_response(PRODUCE, version, answer, part)
            pending.parts = []
            return Respond(body=answer)
        pending.parts.append(answer)
        exchange.keep(self, pending)
        return verdict

    # -- record encryption and masks on Fetch answers

    def _masks(self, ctx: ConnectionContext, version: int, topic: str) -> tuple[Mask, ...]:
        st, _ = self._state(ctx)
        assert st.view is not None
        return tuple(r.params for r in st.view.plan(FETCH, version).rules
                     if r.action == "mask" and isinstance(r.params, Mask)
                     and (r.match.topic is None or r.match.topic(topic)))

    def _fetch_touched(self, ctx: ConnectionContext, exchange: Any) -> bool:
        """Whether record rules may change this Fetch's answer (it must then be stored whole)."""
        policy = self.source.policy
        decrypting = self.crypto is not None and bool(policy.encrypting)
        if not decrypting and not policy.masking:
            return False
        req: Request = exchange.request
        version = req.api_version
        for t in req.body.topics:
            name = t.topic if version < 13 else self.topic_ids.get(t.topic_id)
            if name is None:
                return True
            if (decrypting and policy.encrypts(name)) or (policy.masking and self._masks(ctx, version, name)):
                return True
        return False

    def _fetched(self, ctx: ConnectionContext, response: Response) -> _Fetched | None:
        """The partitions of a Fetch (or ShareFetch) answer that record rules open or mask, opened and
        masked with the DEKs the cache holds; those that need another DEK wait in ``waiting``."""
        policy = self.source.policy
        crypto = self.crypto
        decrypting = crypto is not None and bool(policy.encrypting)
        if not decrypting and not policy.masking:
            return None
        version = response.api_version
        share = response.api_key == SHARE_FETCH    # KIP-932: topics by id, the same partition fields
        cap = ctx.max_decompressed_batch_bytes
        work = _Fetched()
        for t in response.body.responses:
            name = t.topic if not share and version < 13 else self.topic_ids.get(t.topic_id)
            opening = decrypting and (name is None or policy.encrypts(name))
            masks = (self._masks(ctx, FETCH_MASK_VERSION if share else version, name)
                     if name is not None and policy.masking else ())
            if not opening and not masks:
                continue
            for p in t.partitions:
                if p.error_code or not p.records:
                    continue
                try:
                    batches = C.read_fetched(p.records, cap)
                except RecordsError:
                    continue        # the client cannot read it either; it is the broker's to answer
                if name is None:
                    if C.holds_sealed(batches, cap):
                        work.refused.append((str(t.topic_id), p, -1, "unknown_topic", "the topic's name is not "
                                             "known yet (the associated data binds it)", True))
                    continue
                work.parts.append((name, p, batches, masks, opening))
        if not work.parts and not work.refused:
            return None
        keys: Any = C.CachedKeys(crypto.cache, crypto.clock()) if crypto is not None else {}
        self._open_parts(work, range(len(work.parts)), keys, crypto, cap)
        return work

    def _open_parts(self, work: _Fetched, indexes: Any, deks: Any, crypto: C.RecordCrypto | None, cap: int) -> None:
        before = crypto.batches_decrypted if crypto is not None else 0
        try:
            self._open_each(work, indexes, deks, crypto, cap)
        finally:
            if crypto is not None:
                work.opened_batches += crypto.batches_decrypted - before

    def _open_each(self, work: _Fetched, indexes: Any, deks: Any, crypto: C.RecordCrypto | None, cap: int) -> None:
        for i in indexes:
            name, p, batches, masks, opening = work.parts[i]
            try:
                work.results[i] = C.open_partition(batches, name, deks, masks, crypto, cap, opening)
            except MissingDataKey as e:
                if work.done:
                    err = work.errors.get(e.ref)
                    work.refused.append((name, p, -1, err.reason if err is not None else "timeout",
                                         str(err) if err is not None else "the KMS did not answer within the "
                                                                          "request timeout",
                                         err is None or err.retriable))
                else:
                    work.waiting.append(i)
                    if e.ref not in work.missing:
                        work.missing.append(e.ref)
            except C.Tampered as e:
                work.refused.append((name, p, e.offset, "tampered", e.reason, False))

    def question_for_response(self, ctx: ConnectionContext, exchange: Any, response: Response) -> AskKeys | None:
        """A Fetch answer with sealed records whose DEKs are not cached waits for the key service."""
        if response.api_key not in (FETCH, SHARE_FETCH):
            return None
        work = self._fetched(ctx, response)
        if work is None:
            return None
        pending: _Pending | None = exchange.kept(self)
        if pending is None:
            pending = _Pending()
            exchange.keep(self, pending)
        pending.fetched = work
        if not work.missing:
            return None
        return AskKeys(C.OpenKeys(tuple(work.missing)), work.answered)

    def _open_fetched(self, ctx: ConnectionContext, exchange: Any, work: _Fetched) -> None:
        """Put the opened and masked records in the answer; open the partitions that waited for a DEK
        with the key service's answer, and refuse those that still cannot be opened (a DEK the KMS
        could not give: retriable; an unknown KEK or a record that fails authentication:
        INVALID_RECORD). Other partitions are unaffected; nothing sealed is delivered as a value."""
        crypto = self.crypto
        waiting, work.waiting = work.waiting, []
        work.done = True
        if waiting:
            # Some DEKs came from the key service; a miss is refused this time (the client asks again).
            deks = dict(work.deks)
            if crypto is not None:
                now = crypto.clock()
                for ref in work.missing:
                    cached = crypto.cache.get(ref, now)
                    if cached is not None:
                        deks.setdefault(ref, cached)
            self._open_parts(work, waiting, deks, crypto, ctx.max_decompressed_batch_bytes)
        changed = False
        for i, new in work.results.items():
            if new is not None:
                work.parts[i][1].records = new
                changed = True
        for name, p, offset, reason, why, retriable in work.refused:
            code = KAFKA_STORAGE_ERROR if retriable else INVALID_RECORD
            if crypto is not None:
                crypto.failed(reason)
            at = f" at offset {offset}" if offset >= 0 else ""
            if crypto is None or crypto.worth_logging((name, p.partition_index, offset, reason)):
                log.warning("record encryption: refused %s[%d]%s to connection %d (%s, %s): %s", safe(name),
                            p.partition_index, at, ctx.connection_id, reason, error_name(code), why)
            p.error_code = code
            # ShareFetch's records are not nullable from v1: an empty records field says the same.
            p.records = b"" if exchange.api_key == SHARE_FETCH else None
            changed = True
        if changed:
            exchange.response_changed = True
            if work.opened_batches:
                exchange.note("decrypted_batches", work.opened_batches)
            if any(masks for _, _, _, masks, _ in work.parts):
                exchange.note("record_rule", "mask")

    # -- responses

    def may_stream_response(self, ctx: ConnectionContext, exchange: Any) -> bool:
        """A Fetch answer may stream when ``on_response`` would leave it as it is: no refused topic's
        answer to merge in, no topic to keep out of it, and no tenant prefix to take off names it
        carries (Fetch from v13 names topics by id only). Record rules judge produced records only:
        none reads a Fetch answer."""
        if exchange.api_key != FETCH:
            return False
        if self._fetch_touched(ctx, exchange):
            return False
        pending: _Pending | None = exchange.kept(self)
        if pending is None:
            return True
        if pending.parts or pending.asked is not None:
            return False
        version = exchange.api_version
        if pending.hide is not None and entities.has_entity(FETCH, version, "response", "topic"):
            return False
        return not (pending.prefixes and tenant_of(pending.prefixes).undoing(FETCH, version))

    def on_response(self, ctx: ConnectionContext, exchange: Any, response: Response) -> float:
        pending: _Pending | None = exchange.kept(self)
        if response.api_key in (FETCH, SHARE_FETCH):
            # Record rules see the broker's names, before a tenant's prefix comes off.
            work = pending.fetched if pending is not None else None
            if work is None and (self.crypto is not None or self.source.policy.masking):
                # Not asked before (an answer kproxy made up): what the cache holds, the rest retriable.
                work = self._fetched(ctx, response)
            if work is not None:
                self._open_fetched(ctx, exchange, work)
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
            tenant_of(pending.prefixes).take_off(response, request.body)
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
                return refusal_error(rule, rq, policy, True) is None

            entities.filter_elements(body, key, version, "response", "topic", visible, request.body)
        for part in pending.parts:
            merge_response(key, version, body, part)
        return 0.0


# --------------------------------------------------------------------------------------------------
# Carrying decisions out


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
    return _partition_errors_answer(version, [
        (t, part, INVALID_RECORD, verdict.message,
         [cls.BatchIndexAndErrorMessage(batch_index=e.batch_index, batch_index_error_message=e.message)
          for e in verdict.errors])
        for t, part, _, verdict in refused])


def _partition_errors_answer(version: int, refused: list[tuple[Any, Any, int, str, list[Any]]]) -> Any:
    """kproxy's Produce answer for partitions it refused, each with its error code, message
    (``error_message`` exists from v8) and the records at fault (``record_errors``)."""
    cls: Any = body_class(PRODUCE, "response")
    topics: dict[int, Any] = {}
    for t, part, code, message, record_errors in refused:
        entry = topics.get(id(t))
        if entry is None:
            entry = topics[id(t)] = (cls.TopicProduceResponse(name=t.name, partition_responses=[]) if version < 13
                                     else cls.TopicProduceResponse(topic_id=t.topic_id, partition_responses=[]))
        entry.partition_responses.append(cls.PartitionProduceResponse(
            index=part.index, error_code=code, base_offset=-1, log_append_time_ms=-1, log_start_offset=-1,
            record_errors=record_errors, error_message=message))
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

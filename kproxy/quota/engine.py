"""The quota filter: Kafka's client quotas on produce bytes, fetch bytes, requests and request time.

Every quota in the rule files (``quotas:``) that matches an answered request charges it to a budget
(``kproxy.quota.budgets``) and yields Kafka's throttle time; the session gets the longest, tells the
client in ``throttle_time_ms`` and reads nothing more from it meanwhile. A Fetch from a client near
or over a fetch budget has its ``max_bytes`` lowered to what the budget allows (never below one
batch), and an answer larger than that is cut to it. Accounting is per request, never per record
(only cutting an answer walks its batch headers): a Produce is charged its record bytes when it
arrives, and its throttle mutes the client at once; a Fetch is charged its answer's size, which a
streamed answer gives before any of it is sent (``on_response_head``). Pure: time comes from the
connection's clock.
"""

from __future__ import annotations

import heapq
import logging
import struct
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import attrs

from kproxy.logs import safe
from kproxy.policy.model import ANONYMOUS, QuotaRule, RuleSet
from kproxy.protocol.lazy import LazyArray
from kproxy.protocol.messages import Request, Response, api_name, body_class, encode_response_frame
from kproxy.protocol.primitives import write_uvarint
from kproxy.proxy.filters import ALL, ConnectionContext, Filter, RequestVerdict, Throttle
from kproxy.quota.budgets import Budget, BudgetKey, Budgets
from kproxy.quota.fleet import Load, demand_of
from kproxy.quota.rate import Windows, to_ms

log = logging.getLogger("kproxy.quota")

PRODUCE, FETCH = 0, 1
_LOG_OVERHEAD = struct.Struct(">qi")     # a record batch starts with its base offset and length
_CACHE_LIMIT = 4096
# Budget keys one connection may open from values it sends (client ids; a principal after
# re-authentication). A client rotating its id on one connection would otherwise create budgets without
# end and push out the busy ones; past this many, its further ids share one budget per quota with the
# connection's own key, so it is still held to the quota.
MAX_BUDGET_KEYS_PER_CONNECTION = 16
_CLIENT_CHOSEN = frozenset({"client_id", "principal"})


class RuleSource(Protocol):
    """Where the quotas in force are read (``RuleStore``, or ``FixedRules``); read on every request,
    so a reload applies from the next one."""

    @property
    def policy(self) -> Any: ...


@attrs.frozen(slots=True)
class _Quota:
    """A quota rule as this process enforces it: its limits times this process's share."""

    rule: QuotaRule
    windows: Windows
    produce: float | None
    fetch: float | None
    requests: float | None
    time: float | None          # percent of one thread, i.e. percent-seconds per second

    @property
    def span_s(self) -> float:
        return self.windows.samples * self.windows.window_s

    @property
    def divided(self) -> bool:
        """Whether the quota is divided among processes (replicas, workers, a fleet). A per-connection
        quota is not: a connection lives on one process, which holds it to the whole limit."""
        return self.rule.per != "connection"

    def concerns(self, api_key: int) -> bool:
        """Whether the quota has a limit that requests of this API count against."""
        return (self.requests is not None or self.time is not None or (self.produce is not None and api_key == PRODUCE)
                or (self.fetch is not None and api_key == FETCH))


def _scaled(value: float | None, share: float) -> float | None:
    return value * share if value is not None else None


class _Compiled:
    """The quotas of one rule set, and which of them hold for each kind of connection."""

    def __init__(self, rule_set: RuleSet, samples: int, window_s: float, share: float) -> None:
        self.rule_set = rule_set
        self.quotas = tuple(
            _Quota(q, Windows.for_burst(samples, window_s, q.burst_s), _scaled(q.produce_bytes_per_s, s),
                   _scaled(q.fetch_bytes_per_s, s), _scaled(q.requests_per_s, s), _scaled(q.request_time_percent, s))
            for q in rule_set.quotas if q.limits
            for s in (share if q.per != "connection" else 1.0,))
        self._views: dict[tuple[Any, ...], tuple[_Quota, ...]] = {}

    def for_connection(self, key: tuple[Any, ...]) -> tuple[_Quota, ...]:
        got = self._views.get(key)
        if got is None:
            if len(self._views) >= _CACHE_LIMIT:
                self._views.clear()
            got = self._views[key] = tuple(q for q in self.quotas if q.rule.match.holds_for_connection(*key))
        return got


def budget_key(per: str, ctx: ConnectionContext) -> str:
    """The key of the budget a request of this connection is charged to (``client_id=app-1``)."""
    source = ctx.client_address[0] if ctx.client_address else None
    return key_of(per, ctx.client_id, ctx.principal, source, str(ctx.connection_id))


class _Charged:
    """A Produce charged when it came (``QuotaFilter._charge_produce``): the quotas that applied, when,
    and the throttle each told. A plain class: one is made per Produce request."""

    __slots__ = ("applied", "at", "told")

    def __init__(self, applied: tuple[tuple[_Quota, BudgetKey], ...], at: float, told: list[float]) -> None:
        self.applied = applied
        self.at = at
        self.told = told


@attrs.define(slots=True, eq=False)
class _Conn:
    """One connection's view of the quotas: the ones whose connection selectors hold, their budget
    keys, and the ones that apply to each API version."""

    compiled: _Compiled
    key: tuple[Any, ...]
    quotas: tuple[tuple[_Quota, BudgetKey], ...]
    # (api key, version) -> (the quotas that apply, whether any of them selects by acks)
    by_api: dict[tuple[int, int], tuple[tuple[tuple[_Quota, BudgetKey], ...], bool]] = attrs.field(factory=dict)
    largest_batch: int = 0                      # the largest record batch fetched on this connection
    own_budgets: set[BudgetKey] = attrs.field(factory=set)    # per: connection, dropped on close
    # The client-chosen keys (client_id=..., principal=...) this connection has used, up to the cap.
    chosen_keys: set[str] = attrs.field(factory=set)

    def applied(self, request: Request) -> tuple[tuple[_Quota, BudgetKey], ...]:
        api_key, version = request.api_key, request.api_version
        found = self.by_api.get((api_key, version))
        if found is None:
            # An acks selector holds only for Produce requests, as in a policy rule.
            got = tuple((q, k) for q, k in self.quotas
                        if q.concerns(api_key) and (q.rule.match.api is None or q.rule.match.api(api_key))
                        and (q.rule.match.api_version is None or q.rule.match.api_version(version))
                        and (q.rule.match.acks is None or api_key == PRODUCE))
            found = self.by_api[(api_key, version)] = (
                got, api_key == PRODUCE and any(q.rule.match.acks is not None for q, _ in got))
        got, by_acks = found
        if by_acks:
            acks = request.body.acks
            return tuple((q, k) for q, k in got if q.rule.match.acks is None or q.rule.match.acks(acks))
        return got


class QuotaFilter(Filter):
    """Enforces the quotas in force (see the module docstring). ``share`` is the part of every quota
    this process enforces (``ProxyConfig.quota_share``: replicas and workers); ``samples`` and ``window_s`` are how rates
    are sampled (``ProxyConfig.quota``)."""

    name = "quota"
    request_api_keys = frozenset({PRODUCE, FETCH})
    response_api_keys = ALL
    reports_changes = True    # an answer changes only when cut to max_bytes (marked there)
    # A streamed Fetch answer's batches are known once it has passed: the largest first batch.
    done_api_keys = frozenset({FETCH})
    # With no quota in force, every api goes by it undecoded (``passes``).
    may_pass = True

    def passes(self, api_key: int, api_version: int) -> bool:
        """No quota is in force: nothing is charged, kept or throttled (``_conn`` is None). A quota
        added on reload counts from the next request; an answer to one that went by before it is
        not charged."""
        return not self.source.policy.rule_set.quotas

    def __init__(self, source: RuleSource, samples: int = 11, window_s: float = 1.0, share: float = 1.0,
                 budgets: Budgets | None = None, coordinated: bool = False) -> None:
        self.source = source
        self.samples = samples
        self.window_s = window_s
        self.share = share
        self.budgets = budgets if budgets is not None else Budgets()
        # Coordinated (fleet quotas): the limits are kept whole and each budget carries its own share,
        # which starts at the static one and is moved by the coordinator (kproxy.server.coordination).
        self.coordinated = coordinated
        if coordinated:
            self.budgets.initial_share = share
        self._compiled: _Compiled | None = None

    def _compile(self, rule_set: RuleSet) -> _Compiled:
        compiled = self._compiled
        if compiled is None or compiled.rule_set is not rule_set:
            compiled = self._compiled = _Compiled(rule_set, self.samples, self.window_s,
                                                  1.0 if self.coordinated else self.share)
        return compiled

    def loads(self, now: float) -> list[tuple[BudgetKey, Budget, Load]]:
        """Every budget used within its quota's window, with its rate and demand as fractions of the
        quota's whole limit (the most used of its limits): what a coordinated process reports. Walks
        the budget table; called between intervals, never per request."""
        rule_set = self.source.policy.rule_set
        if not rule_set.quotas:
            return []
        # A per-connection budget belongs to one connection of one process: nothing to share.
        by_name = {q.rule.name: q for q in self._compile(rule_set).quotas if q.rule.per != "connection"}
        out = []
        for key, budget in list(self.budgets.items()):
            q = by_name.get(key[0])
            if q is None or now - budget.last_used >= q.span_s:
                continue
            used = 0.0
            whole = 1.0 if self.coordinated else self.share     # the compiled limits are whole x this
            for kind in ("produce", "fetch", "requests", "time"):
                limit, rate = getattr(q, kind), getattr(budget, kind)
                if limit and rate is not None:
                    used = max(used, rate.measure(now, q.windows) * whole / limit)
            muted = budget.muted.measure(now, q.windows) if budget.muted is not None else 0.0
            out.append((key, budget, Load(used, demand_of(used, muted))))
        return out

    # -- which quotas apply

    def _conn(self, ctx: ConnectionContext) -> _Conn | None:
        rule_set = self.source.policy.rule_set
        if not rule_set.quotas:
            return None
        compiled = self._compile(rule_set)
        address = ctx.client_address[0] if ctx.client_address else None
        key = (ctx.client_id, ctx.principal, address, ctx.listener, ctx.client_software_name,
               ctx.client_software_version)
        st: _Conn | None = ctx.peek_state(self)
        if st is None or st.compiled is not compiled or st.key != key:
            # Judged again only when the quotas or what their selectors look at change.
            own = st.own_budgets if st is not None else set()
            chosen = st.chosen_keys if st is not None else set()
            quotas = tuple((q, _capped(q, budget_key(q.rule.per, ctx), ctx.connection_id, chosen, own))
                           for q in compiled.for_connection(key))
            st = _Conn(compiled, key, quotas, largest_batch=st.largest_batch if st else 0, own_budgets=own,
                       chosen_keys=chosen)
            ctx.set_state(self, st)
        return st

    # -- requests

    def on_request(self, ctx: ConnectionContext, exchange: Any) -> RequestVerdict:
        request: Request = exchange.request
        st = self._conn(ctx)
        if st is None:
            return None
        applied = st.applied(request)
        if not applied:
            return None
        if request.api_key == FETCH:
            self._lower_fetch(ctx, st, applied, request)
            return None
        now = ctx.clock()
        if request.body.acks == 0:
            # No response will come to carry a throttle: charge it now, and mute the connection.
            seconds = self._charge(ctx, exchange, st, applied, request, None, now, now - exchange.started)
        else:
            seconds = self._charge_produce(exchange, st, applied, request, now)
        return Throttle(seconds) if seconds > 0 else None

    def _charge_produce(self, exchange: Any, st: _Conn, applied: tuple[tuple[_Quota, BudgetKey], ...],
                        request: Request, now: float) -> float:
        """Charge a Produce request (its record bytes and its count) as it arrives; the longest
        throttle in seconds, which mutes the connection at once. A broker reads one request of a
        connection at a time and mutes a throttled one before it reads the next; kproxy forwards
        requests while earlier ones are answered, so a client with many requests in flight (librdkafka
        sends up to ten of up to 1 MB by default) would otherwise have them all through before the
        first answer told it to wait. Its time is charged on its answer (``_answer_charged``), which
        tells the client the throttle left then."""
        produced = _produced(exchange, request)
        told = []
        for q, key in applied:
            budget = self.budgets.get(key, now, q.span_s)
            if q.rule.per == "connection":
                st.own_budgets.add(key)
            told.append(_throttle(budget, q, now, produced, 0, None))
        exchange.keep(self, _Charged(applied, now, told))
        longest = max(told)
        return to_ms(longest) / 1000.0 if longest > 0 else 0.0

    def _lower_fetch(self, ctx: ConnectionContext, st: _Conn, applied: Iterable[tuple[_Quota, BudgetKey]],
                     request: Request) -> None:
        """Lower the Fetch's byte limits to what its fetch budgets allow now, but never below the
        largest record batch this connection has fetched (a broker returns at least one batch)."""
        now = ctx.clock()
        body = request.body
        wanted = body.max_bytes if request.api_version >= 3 else 1 << 62
        allowed: float | None = None
        for q, key in applied:
            if q.fetch is None:
                continue
            budget = self.budgets.peek(key)
            rate = budget.fetch if budget is not None else None
            bound = q.fetch * (_share(q, budget) if budget is not None
                               else self.budgets.initial_share if q.divided else 1.0)
            if rate is None:
                room = bound * q.windows.min_full_windows * q.windows.window_s
            else:
                room = rate.least_allowance(q.windows, bound)
                if room < wanted:
                    room = rate.allowance(now, q.windows, bound)
            allowed = room if allowed is None else min(allowed, room)
        if allowed is None:
            return
        limit = max(int(allowed), st.largest_batch, 1)
        if request.api_version >= 3:
            if limit >= body.max_bytes:
                return
            before = body.max_bytes
            body.max_bytes = limit
            parts = [p for t in body.topics for p in t.partitions]
        elif st.largest_batch:
            # No max_bytes before v3: the budget is shared out over the partitions.
            parts = [p for t in body.topics for p in t.partitions]
            if not parts:
                return
            limit = max(int(allowed) // len(parts), st.largest_batch)
            before = max(p.partition_max_bytes for p in parts)
            if limit >= before:
                return
        else:
            return
        for p in parts:
            if p.partition_max_bytes > limit:
                p.partition_max_bytes = limit
        if log.isEnabledFor(logging.DEBUG):
            log.debug("connection %d: fetch budget allows %d bytes; Fetch max_bytes lowered from %d to %d",
                      ctx.connection_id, max(int(allowed), 0), before, limit)

    # -- responses

    def on_response(self, ctx: ConnectionContext, exchange: Any, response: Response) -> float:
        return self._on_answer(ctx, exchange, response)

    def _on_answer(self, ctx: ConnectionContext, exchange: Any, response: Response | None) -> float:
        charged: _Charged | None = exchange.kept(self)
        if charged is not None:
            now = ctx.clock()
            return self._answer_charged(ctx, exchange, charged, now, _spent(exchange, now))
        st = self._conn(ctx)
        if st is None:
            return 0.0
        request: Request = exchange.request
        applied = st.applied(request)
        if not applied:
            return 0.0
        now = ctx.clock()
        return self._charge(ctx, exchange, st, applied, request, response, now, _spent(exchange, now))

    def _answer_charged(self, ctx: ConnectionContext, exchange: Any, charged: _Charged, now: float,
                        spent: float) -> float:
        """The answer to a Produce charged when it came: its time is charged now, and the client is
        told the longest throttle left (what it was told then, less the time since, or the time's)."""
        worst: tuple[int, _Quota, BudgetKey] | None = None
        for (q, key), told in zip(charged.applied, charged.told, strict=True):
            seconds = told - (now - charged.at)
            if q.time is not None:
                budget = self.budgets.get(key, now, q.span_s)
                took = _time_throttle(budget, q, now, spent)
                if took > 0:
                    (budget.muted or budget.new("muted")).record(took, now, q.windows)
                    seconds = max(seconds, took)
            ms = to_ms(seconds) if seconds > 0 else 0
            if worst is None or ms > worst[0]:
                worst = (ms, q, key)
        return self._noted(ctx, exchange, worst, PRODUCE)

    # -- streamed Fetch answers (cut-through): charged on their head, from their size

    def may_stream_response(self, ctx: ConnectionContext, exchange: Any) -> bool:
        """A Fetch answer streams unless it may have to be cut to ``max_bytes`` (which changes its
        size): only when a fetch quota applies and the answer is larger than the request allowed."""
        if exchange.api_key != FETCH:
            return False
        st = self._conn(ctx)
        if st is None:
            return True
        request: Request = exchange.request
        version = request.api_version
        if version < 3:
            return True
        # Cut only when its records exceed max_bytes: then it is at least that plus the fewest other bytes.
        limit = request.body.max_bytes
        return (exchange.upstream_bytes < limit + 1 + least_fetch_overhead(version, limit + 1)
                or not any(q.fetch is not None for q, _ in st.applied(request)))

    def on_response_head(self, ctx: ConnectionContext, exchange: Any, head: Any) -> float:
        """As ``on_response``, from the size alone: a Fetch is charged its answer's size either way,
        so the throttle, the notes and the budgets come out as for the stored answer."""
        return self._on_answer(ctx, exchange, None)

    def on_done(self, ctx: ConnectionContext, exchange: Any) -> None:
        facts = exchange.records_facts
        if facts is None or exchange.request is None:
            return
        st: _Conn | None = ctx.peek_state(self)
        if st is None:
            return
        # What fetch_record_bytes reads from a stored answer: each partition's first batch.
        largest = max((min(f.first_batch_bytes, f.size) for f in facts if f.size > 0), default=0)
        if largest > st.largest_batch:
            st.largest_batch = largest

    def _charge(self, ctx: ConnectionContext, exchange: Any, st: _Conn,
                applied: Iterable[tuple[_Quota, BudgetKey]], request: Request, response: Response | None,
                now: float, spent: float) -> float:
        """Charge the request to every budget that applies; the longest throttle in seconds. The
        entry notes the quota that throttled it the most (the first one when none did).

        A Fetch is charged the size of its answer as the broker sent it (``exchange.upstream_bytes``,
        header and body, as a Kafka broker charges a response), less what is cut off it; a streamed
        answer (``response`` None) is known by that size before any of it is sent."""
        api_key = request.api_key
        produced = fetched = 0
        if api_key == PRODUCE:
            produced = _produced(exchange, request)
        elif api_key == FETCH:
            fetched = exchange.upstream_bytes
            if response is not None:
                records, largest = fetch_record_bytes(response.body)
                if largest > st.largest_batch:
                    st.largest_batch = largest
                if (request.api_version >= 3 and records > request.body.max_bytes
                        and any(q.fetch is not None for q, _ in applied)):
                    # A broker that answers with more than max_bytes (tansu does) is held to it here.
                    fetched -= records - trim_fetch(response.body, request.body.max_bytes)
                    exchange.response_changed = True
        worst: tuple[int, _Quota, BudgetKey] | None = None
        for q, key in applied:
            budget = self.budgets.get(key, now, q.span_s)
            if q.rule.per == "connection":
                st.own_budgets.add(key)
            seconds = _throttle(budget, q, now, produced, fetched, spent)
            ms = to_ms(seconds) if seconds > 0 else 0
            if worst is None or ms > worst[0]:
                worst = (ms, q, key)
        return self._noted(ctx, exchange, worst, api_key)

    def _noted(self, ctx: ConnectionContext, exchange: Any, worst: tuple[int, _Quota, BudgetKey] | None,
               api_key: int) -> float:
        """Note the quota that throttled the request the most on its entry; its throttle in seconds."""
        if worst is None:
            return 0.0
        ms, q, key = worst
        exchange.note("quota", {"rule": q.rule.name, "key": key[1], "throttle_ms": ms})
        if ms > 0 and log.isEnabledFor(logging.DEBUG):
            log.debug("quota %r key %s: %s throttled for %d ms (connection %d)", q.rule.name, safe(key[1]),
                      api_name(api_key), ms, ctx.connection_id)
        return ms / 1000.0

    def may_stream_request(self, ctx: ConnectionContext, exchange: Any, head: Any) -> bool:
        # A Produce is charged by its records' size and the connection's selectors (principal,
        # client id, ...; acks from the head): nothing that needs the frame whole, nothing changed.
        return head.api_key == PRODUCE

    def on_close(self, ctx: ConnectionContext) -> None:
        st: _Conn | None = ctx.drop_state(self)
        if st is not None and st.own_budgets:
            self.budgets.drop(st.own_budgets)


def _capped(q: _Quota, key: str, connection_id: int, chosen: set[str], own: set[BudgetKey]) -> BudgetKey:
    """The budget ``q`` charges for ``key`` on this connection: its own, unless the connection has
    already used ``MAX_BUDGET_KEYS_PER_CONNECTION`` client-chosen keys; then one overflow budget of
    the connection's (dropped when it closes)."""
    if q.rule.per not in _CLIENT_CHOSEN or key in chosen:
        return (q.rule.name, key)
    if len(chosen) < MAX_BUDGET_KEYS_PER_CONNECTION:
        chosen.add(key)
        return (q.rule.name, key)
    overflow = (q.rule.name, f"{q.rule.per}=<more than {MAX_BUDGET_KEYS_PER_CONNECTION} on connection {connection_id}>")
    if overflow not in own:
        own.add(overflow)
        log.warning("connection %d: more than %d %s values on one connection; quota %r charges the rest "
                    "to one budget of the connection", connection_id, MAX_BUDGET_KEYS_PER_CONNECTION,
                    q.rule.per, q.rule.name)
    return overflow


def _produced(exchange: Any, request: Request) -> int:
    """A Produce request's record bytes. A streamed request's records are not in the decoded request:
    their sizes were noted."""
    facts = exchange.records_facts
    return sum(max(f.size, 0) for f in facts) if facts is not None else produce_record_bytes(request.body)


def _share(q: _Quota, budget: Budget) -> float:
    """The part of ``q``'s limits ``budget`` is held to: 1, or this process's fleet share (set between
    intervals); a per-connection budget always gets the whole limit."""
    return budget.share if q.divided else 1.0


def _spent(exchange: Any, now: float) -> float:
    """The seconds kproxy has spent on a request, now that its answer is here."""
    answered = exchange.answered_at
    return exchange.handling_s + (now - answered if answered is not None else 0.0)


def _time_throttle(budget: Budget, q: _Quota, now: float, spent: float) -> float:
    """Record ``spent`` seconds against ``q``'s request time limit; its throttle in seconds."""
    assert q.time is not None
    w = q.windows
    rate = budget.time or budget.new("time")
    # Kafka records thread time as percent-seconds and throttles a request quota by at most one
    # window (ClientRequestQuotaManager's maxThrottleTimeMs).
    return min(rate.record_and_throttle(spent * 100, now, w, q.time * _share(q, budget)), w.window_s)


def _throttle(budget: Budget, q: _Quota, now: float, produced: int, fetched: int, spent: float | None) -> float:
    """Record one request against each limit of ``q``, its time only when ``spent`` is given (a
    Produce's time is charged on its answer, the rest when it comes); the longest throttle in seconds."""
    w = q.windows
    share = _share(q, budget)
    longest = 0.0
    if q.produce is not None and produced:
        rate = budget.produce or budget.new("produce")
        longest = rate.record_and_throttle(produced, now, w, q.produce * share)
    if q.fetch is not None and fetched:
        rate = budget.fetch or budget.new("fetch")
        t = rate.record_and_throttle(fetched, now, w, q.fetch * share)
        if t > longest:
            longest = t
    if q.requests is not None:
        rate = budget.requests or budget.new("requests")
        t = rate.record_and_throttle(1, now, w, q.requests * share)
        if t > longest:
            longest = t
    if q.time is not None and spent is not None:
        t = _time_throttle(budget, q, now, spent)
        if t > longest:
            longest = t
    if longest > 0:
        # The wait a throttle imposes is demand the budget did not let through: fleet shares weigh it.
        (budget.muted or budget.new("muted")).record(longest, now, w)
    return longest


def _undecoded(array: Any) -> int | None:
    """The size of a large array of structs as received, while nothing has decoded it (else None)."""
    if type(array) is LazyArray and not array.decoded:
        return len(array.raw)
    return None


def _partitions(topics: Any, field: str) -> Iterator[Any]:
    """Each partition (the ``field`` array of each topic), or for a large array nothing has decoded,
    its size as received (an int): counting never decodes what kproxy forwards untouched."""
    raw = _undecoded(topics)
    if raw is not None:
        yield raw
        return
    for t in topics:
        parts = getattr(t, field)
        raw = _undecoded(parts)
        if raw is None:
            yield from parts
        else:
            yield raw


def produce_record_bytes(body: Any) -> int:
    """The record bytes of a Produce request: the sizes of its records fields (nothing parsed), or an
    undecoded large array's size (a few bytes a partition more)."""
    total = 0
    for p in _partitions(body.topic_data, "partition_data"):
        if type(p) is int:
            total += p
        elif p.records is not None:
            total += len(p.records)
    return total


def _fetched(body: Any) -> Iterator[Any]:
    """The partitions of a Fetch response that carry records (decoding them)."""
    for t in body.responses:
        for p in t.partitions:
            if p.records:
                yield p


def trim_fetch(body: Any, limit: int) -> int:
    """Cut a Fetch response's records down to ``limit`` bytes of whole batches, as a broker honours
    max_bytes: the first batch of the first partition with records stays whatever its size, and
    what is cut the client fetches again. Returns the record bytes kept."""
    kept = 0
    for p in _fetched(body):
        records = p.records
        n = len(records)
        if kept + n <= limit:
            kept += n
            continue
        cut = 0
        while cut + _LOG_OVERHEAD.size <= n:
            size = _LOG_OVERHEAD.unpack_from(records, cut)[1] + _LOG_OVERHEAD.size
            if size <= _LOG_OVERHEAD.size or cut + size > n or (kept + cut + size > limit and (kept or cut)):
                break
            cut += size
        p.records = records[:cut]
        kept += cut
    return kept


_LEAST_OVERHEAD: dict[int, int] = {}


def least_fetch_overhead(version: int, records: int) -> int:
    """The fewest bytes a Fetch answer of ``version`` carrying at least ``records`` bytes of records has
    besides them: its header and fields with one unnamed topic and one partition, and the records
    field's length."""
    got = _LEAST_OVERHEAD.get(version)
    if got is None:
        cls: Any = body_class(FETCH, "response")
        body = cls(responses=[cls.FetchableTopicResponse(topic="", partitions=[
            cls.PartitionData(partition_index=0, records=b"")])])
        size = sum(len(b) for b in encode_response_frame(Response.build(FETCH, version, 0, body))) - 4
        got = _LEAST_OVERHEAD[version] = size - (1 if version >= 12 else 4)   # less the empty field's length
    return got + (len(write_uvarint(records + 1)) if version >= 12 else 4)


def fetch_record_bytes(body: Any) -> tuple[int, int]:
    """(record bytes, size of the largest first batch of a partition) of a Fetch response; only the
    length field of each partition's first batch is read. An undecoded large array counts as its
    size as received (with each partition's header, about 40 bytes), and no batch in it is seen."""
    total = largest = 0
    for p in _partitions(body.responses, "partitions"):
        if type(p) is int:
            total += p
            continue
        records = p.records
        if not records:
            continue
        n = len(records)
        total += n
        if n >= _LOG_OVERHEAD.size:
            first = _LOG_OVERHEAD.unpack_from(records, 0)[1] + _LOG_OVERHEAD.size
            largest = max(largest, min(first, n))
    return total, largest


# -- the same accounting over recorded traffic (kproxy report --rules: the quota dry run)


def quotas_of(rule_set: RuleSet, samples: int = 11, window_s: float = 1.0, share: float = 1.0) -> tuple[_Quota, ...]:
    """The quotas of ``rule_set`` with limits, as a process with ``share`` of them enforces them."""
    return _Compiled(rule_set, samples, window_s, share).quotas


def quota_applies(q: _Quota, api_key: int, api_version: int, acks: int | None) -> bool:
    """Whether requests of this API (and acks, for Produce) count against ``q`` (connection selectors
    are judged separately, with ``Match.holds_for_connection``)."""
    m = q.rule.match
    return (q.concerns(api_key) and (m.api is None or m.api(api_key))
            and (m.api_version is None or m.api_version(api_version))
            and (m.acks is None or (api_key == PRODUCE and acks is not None and m.acks(acks))))


def key_of(per: str, client_id: str | None, principal: str | None, source: str | None,
           connection: str | None) -> str:
    """The budget key of a request from plain values, as ``budget_key`` makes it from a connection."""
    if per == "client_id":
        return f"client_id={client_id or ''}"
    if per == "principal":
        return f"principal={principal or ANONYMOUS}"
    if per == "source":
        return f"source={source or '?'}"
    if per == "connection":
        return f"connection={connection}"
    return "all"


def replay_throttles(q: _Quota, events: Iterable[tuple[float, int, int, float, float]]) -> list[int]:
    """Throttle milliseconds each request would have been told, charging ``events`` (time in seconds,
    produced bytes, fetched bytes, seconds of kproxy time, when its answer came) in time order to one
    fresh budget of ``q``, as the live filter charges them: a request whose answer time is given (a
    Produce with an answer) is charged its bytes and count at its time, as it arrived (its throttle
    mutes the client from then), and its kproxy time when its answer comes, and is throttled the
    longer of the two; the others (answer time NaN) are charged everything at their time. The
    recorded times are kept as they were: what a client would have waited is not replayed into them."""
    out: list[int] = []
    budget: Budget | None = None
    answers: list[tuple[float, int, float, float]] = []   # (answered at, index, spent, arrival's throttle)

    def answer(upto: float) -> None:
        while answers and answers[0][0] <= upto:
            at, i, spent, seconds = heapq.heappop(answers)
            assert budget is not None
            if q.time is not None:
                took = _time_throttle(budget, q, at, spent)
                if took > 0:
                    (budget.muted or budget.new("muted")).record(took, at, q.windows)
                    seconds = max(seconds, took)
            out[i] = to_ms(seconds) if seconds > 0 else 0

    for now, produced, fetched, spent, answered in events:
        if budget is None:
            budget = Budget(now, q.span_s)
        answer(now)
        if answered == answered:      # not NaN: charged on arrival, its time on its answer
            seconds = _throttle(budget, q, now, produced, fetched, None)
            out.append(0)
            heapq.heappush(answers, (max(answered, now), len(out) - 1, spent, seconds))
            continue
        seconds = _throttle(budget, q, now, produced, fetched, spent)
        out.append(to_ms(seconds) if seconds > 0 else 0)
    answer(float("inf"))
    return out

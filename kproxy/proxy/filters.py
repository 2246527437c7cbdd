"""The hook interface that address rewriting, policy, quotas and telemetry plug into.

A filter declares the api keys it wants to see; the session calls it only for those, with the request's
completed-request entry (the exchange, which carries the decoded request) and the decoded response,
which it may change in place. A request hook may also answer the request itself with a Kafka error,
or ask for it to be held back a while; ``on_done`` tells it once that a request is over, whatever
became of it. Filters are pure: no I/O, time comes from ``ConnectionContext.clock``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Any

import attrs

from kproxy.protocol.messages import Request, Response
from kproxy.protocol.records import DEFAULT_MAX_DECOMPRESSED_BYTES

ALL: frozenset[int] | None = None  # a filter's key set that means "every api key"


@attrs.define(slots=True, eq=False)
class ConnectionContext:
    """What kproxy knows about one client connection; shared by every filter on it.

    ``principal`` is the identity filters act on: the SASL user once the broker has accepted the
    authentication, else the name ``tls.principal`` maps the verified mTLS client certificate to
    (``tls_subject``: its subject by default, or its SPIFFE ID), else None. A user the client only
    claims (a token the broker has not accepted yet, or refused) is never a principal.
    ``client_address`` is the socket's peer, or the client a PROXY header from a trusted peer names.

    ``listener`` says where the client connected, one of:

    - ``bootstrap``: the bootstrap listener (or the SNI bootstrap name), and a broker port or name
      kproxy has not placed yet (it is served through the bootstrap servers until it is learned);
    - ``broker-<node id>``: a broker's port or SNI name;
    - ``controller-<node id>``: a KRaft controller's port or SNI name (KIP-919);
    - ``discovery``: kproxy's own start-up Metadata request, seen only by the address rewriter.

    A filter keeps what it needs per connection in ``state_of(filter, factory)`` (dropped when the
    connection closes) and what it needs per request on the exchange (``keep`` / ``kept``, dropped
    with the request); decisions for telemetry go on the exchange with ``note()``.
    """

    connection_id: int
    client_address: tuple[str, int] | None = None
    listener: str = "bootstrap"
    clock: Callable[[], float] = attrs.field(default=lambda: 0.0)
    tls_subject: str | None = None
    sasl_mechanism: str | None = None
    sasl_user: str | None = None
    authenticated: bool = False
    client_id: str | None = None
    client_software_name: str | None = None
    client_software_version: str | None = None
    # limits.max_decompressed_batch_bytes: the most a filter may decompress from one record batch
    # (pass it to RecordBatch.records / payload).
    max_decompressed_batch_bytes: int = DEFAULT_MAX_DECOMPRESSED_BYTES
    # Each filter's per-connection state, by filter (see state_of); cleared when the connection ends.
    _filter_state: dict[Filter, Any] = attrs.field(factory=dict, init=False, repr=False)

    def state_of(self, owner: Filter, factory: Callable[[], Any]) -> Any:
        """``owner``'s state for this connection, made with ``factory`` on first use."""
        got = self._filter_state.get(owner)
        if got is None:
            got = self._filter_state[owner] = factory()
        return got

    def peek_state(self, owner: Filter) -> Any:
        """``owner``'s state for this connection, or None."""
        return self._filter_state.get(owner)

    def set_state(self, owner: Filter, value: Any) -> None:
        self._filter_state[owner] = value

    def drop_state(self, owner: Filter) -> Any:
        """Forget ``owner``'s state for this connection; returns it (None if there was none)."""
        return self._filter_state.pop(owner, None)

    def clear_state(self) -> None:
        self._filter_state.clear()

    @property
    def principal(self) -> str | None:
        if self.authenticated and self.sasl_user is not None:
            return f"User:{self.sasl_user}"
        if self.tls_subject is not None:
            return f"User:{self.tls_subject}"
        return None


@attrs.frozen(slots=True)
class Respond:
    """Answer the request locally instead of forwarding it.

    Either a ready response ``body`` (of the request's api and version), or an ``error_code`` from
    which kproxy builds the error response Kafka would send (per topic and partition where the API has
    them). ``throttle_time_ms`` is copied into the response when the API has that field.
    """

    error_code: int = 0
    body: Any = None
    error_message: str | None = None
    throttle_time_ms: int = 0


@attrs.frozen(slots=True)
class Delay:
    """Hold the request back ``seconds`` before forwarding it (or answering it with ``then``).

    Requests behind it on the same connection wait too, which keeps Kafka's per-connection order
    and mirrors how a broker mutes a throttled channel.
    """

    seconds: float
    then: Respond | None = None


@attrs.frozen(slots=True)
class Throttle:
    """Forward the request, then read nothing more from this client for ``seconds``: the verdict of
    a quota on a request that gets no response to carry its throttle (an acks=0 Produce)."""

    seconds: float


@attrs.frozen(slots=True)
class AskBroker:
    """Ask the broker something before deciding (a rule that needs the name of a topic id).

    kproxy sends ``question``, a request the filter built, on this connection's broker connection,
    and reads nothing more from the client until it is answered; then it calls ``then`` with the
    broker's response, or with None when none came (the connection was lost or the request timed
    out), and takes what ``then`` returns as this filter's verdict. The client's request keeps its
    place: answers still go out in the order the client asked.
    """

    question: Request
    then: Callable[[Response | None], RequestVerdict]


@attrs.frozen(slots=True)
class AskKeys:
    """Ask the process's key service for data keys before deciding (record encryption: a DEK to seal
    with, or DEKs to open a Fetch answer's records). ``question`` is the filter's own description of
    what it needs (``kproxy.policy.crypto.SealKeys`` / ``OpenKeys``); the I/O layer answers it within
    the request timeout and calls ``then`` with the answer. The session never awaits a KMS itself.

    As a request verdict, the client is not read meanwhile and ``then`` returns the filter's verdict,
    as for ``AskBroker``. From ``question_for_response``, the answer waits (and the answers behind it,
    in order) and ``then`` returns nothing; ``on_response`` runs afterwards."""

    question: Any
    then: Callable[[Any], Any]


RequestVerdict = Respond | Delay | Throttle | AskBroker | AskKeys | None


class Filter:
    """Base class: override what you need. Hooks run in the connection's order of filters.

    ``exchange`` is the request's completed-request entry (``kproxy.proxy.inflight.InFlight``): the
    decoded request is ``exchange.request``; ``exchange.note()`` records a decision for telemetry,
    ``exchange.keep()``/``kept()`` carry a filter's own state from the request to its answer.
    """

    name: str = "filter"
    request_api_keys: frozenset[int] | None = frozenset()   # ALL (None) for every api key
    response_api_keys: frozenset[int] | None = frozenset()
    # Api keys whose requests this filter hears about in on_done (ALL for every one).
    done_api_keys: frozenset[int] | None = frozenset()
    # True when on_response sets ``exchange.response_changed`` whenever it changes an answer (its
    # body, or anything encoded from it). An answer that no response filter changed then reaches the
    # client as the broker's own bytes with the correlation id patched, without being encoded again.
    # A filter that leaves this False is taken to change every answer it sees.
    reports_changes: bool = False
    # True when the filter may let some apis go by unread although it sees every one (``passes``).
    may_pass: bool = False
    # Api keys whose answers this filter reads only when their bytes say so (``reads_answer``).
    reads_by_bytes: frozenset[int] = frozenset()

    def passes(self, api_key: int, api_version: int) -> bool:
        """On filters that set ``may_pass``: whether, with the configuration in force now, the filter
        would do nothing at all with a request of this api version (``on_request`` returns None and
        keeps nothing), and ``on_response`` does nothing with an answer to a request for which it
        kept nothing (such answers may then be remembered, ``memo_key``). Asked for every request
        the session could relay undecoded, so it must be cheap; the answer may change when the
        filter's configuration reloads (the next request sees the new one)."""
        return False

    def reads_answer(self, api_key: int, api_version: int, frame: Any) -> bool:
        """For the api keys of ``reads_by_bytes``: whether ``on_response`` has anything to do with
        this one answer of a version it ``reads_response``, told from the broker's bytes (``frame``,
        from the correlation id on). When it says no, the answer may go on undecoded. Asked of every
        such answer, so it must be cheap; and exact: True whenever it cannot tell (a truncated or
        malformed answer is decoded, and the decoder says what is wrong)."""
        return True

    def lane_walks(self, api_key: int, api_version: int) -> bool:
        """For the api keys of ``reads_by_bytes``: whether ``reads_answer`` at this api version is
        exactly the accelerator's node_endpoints walk (True when an answer carries node_endpoints or
        cannot be walked), so that the lane may run that walk in its place, without the GIL, and give
        such an answer back unread (``kproxy.server.lane.LaneApi.walk``). False keeps the api version
        out of the lane."""
        return False

    def on_request(self, ctx: ConnectionContext, exchange: Any) -> RequestVerdict:
        """See (and possibly change) ``exchange.request``. Return None to forward it.

        A filter that changes a request it forwards (a tenant prefix) can change the answer back in
        ``on_response``: it sees every answer to a forwarded request, including the errors kproxy
        makes up when the broker connection is lost.
        """
        return None

    def on_response(self, ctx: ConnectionContext, exchange: Any, response: Response) -> float:
        """See (and possibly change) a decoded response to ``exchange.request``.

        Returns seconds of throttle the client should observe from now on (0 for none). With the
        largest value any filter returns, the session sets the response's ``throttle_time_ms`` (the
        broker's own value stays when larger), sends it at once, and then reads nothing more from
        the client until that time has passed, as a broker mutes a throttled channel; answers to
        requests already forwarded still go out, in order.
        """
        return 0.0

    # True when question_for_response may ask something before on_response sees an answer.
    asks_for_response: bool = False

    def question_for_response(self, ctx: ConnectionContext, exchange: Any, response: Response) -> AskKeys | None:
        """Before ``on_response``, on filters that set ``asks_for_response``: what the filter must
        know first (``AskKeys``), or None. The answer, and those after it, wait for it."""
        return None

    def reads_response(self, api_key: int, api_version: int) -> bool:
        """Whether ``on_response`` has anything to do with answers of this api version (True, the
        default, for every version of ``response_api_keys``). When no filter reads an answer and
        nothing else does (telemetry, the transparency check), the session passes it on undecoded."""
        return True

    def on_done(self, ctx: ConnectionContext, exchange: Any) -> None:
        """The request is over, once and whatever its outcome (answered, refused, lost with the broker
        connection, or ``client_gone``); its times and outcome are final. Declare the api keys in
        ``done_api_keys``."""

    def on_close(self, ctx: ConnectionContext) -> None:
        """The connection ended (after every request on it was done); its state_of is dropped next."""

    def memo_key(self, ctx: ConnectionContext, api_key: int) -> Hashable | None:
        """Whether ``on_response`` is a pure function of an answer's bytes for ``api_key``: None (the
        default) when it is not; else a key to the filter's own state it reads (a generation that
        changes whenever the same bytes would be rewritten differently).

        Pure means it reads nothing of the request, the exchange or the connection but its
        ``listener``, keeps and notes nothing, and its only effects are on the answer (and ports it
        asks to open). When every response filter of an api says so, the session may remember the
        rewritten answer (``kproxy.proxy.memo``) and send it again for the same bytes without
        calling ``on_response``: answers that asked for a port or a throttle are never remembered.
        """
        return None

    def sees_whole(self, api_key: int, kind: str) -> bool:
        """Whether this filter must see a whole frame of ``api_key`` ("request" or "response")
        before any of it is sent. A frame that no filter must see whole may be streamed through as
        it arrives (cut-through, ``kproxy.proxy.streaming``); the others are stored and forwarded.

        Say True when the filter may change the frame's size (a topic prefix on a name-based
        version, a partial denial merged into the answer, a record rule) or reads its records. The
        default is True for every api key the filter registered for, so a filter that has not
        thought about streaming never sees a frame it cannot handle.
        """
        keys = self.request_api_keys if kind == "request" else self.response_api_keys
        return keys is None or api_key in keys

    def may_stream_response(self, ctx: ConnectionContext, exchange: Any) -> bool:
        """Whether, for this one exchange, the broker's answer may stream although ``sees_whole``
        says True for its api: the filter would change nothing in it that streaming cannot (its size,
        its records) and needs none of its records. Asked when a large answer starts to arrive;
        ``exchange.upstream_bytes`` is then its size. Default False: stored, as before.

        A filter that says True gets ``on_response_head`` instead of ``on_response`` for that
        answer."""
        return False

    def on_response_head(self, ctx: ConnectionContext, exchange: Any, head: Any) -> float:
        """The head of an answer streamed with this filter's consent (``may_stream_response``),
        before any of it is sent: ``head`` is a ``kproxy.proxy.streaming.StreamHead`` (api, version,
        size, and the root's scalar fields as the broker sent them). Returns seconds of throttle,
        as ``on_response`` does; the session patches ``throttle_time_ms`` in the head and mutes
        the client the same way. The records' counts are on ``exchange.records_facts`` in
        ``on_done``."""
        return 0.0

    def may_stream_request(self, ctx: ConnectionContext, exchange: Any, head: Any) -> bool:
        """Whether this one request may go to the broker while it arrives, although the filter
        ``sees_whole`` its api's requests. Asked once the head is decoded (``head``, a
        ``kproxy.proxy.streaming.StreamHead``: the frame as far as its first records, its root's
        scalar fields and ``client_id`` in ``head.values``) and before any byte leaves.

        Saying yes is a promise: the filter's ``on_request`` then runs once the whole frame has
        passed, on the request with its records left out (what they held is in
        ``exchange.records_facts``), and must neither change nor answer it (a ``Throttle`` is fine).
        A Produce request's later topics come after the first topic's records, so a filter that
        could refuse or rewrite a topic it has not seen yet must say no. The default is no.
        """
        return False


class FilterFailed(Exception):
    """A filter hook raised; the connection closes, the proxy carries on."""


class FilterChain:
    """The filters of one proxy, indexed by api key so each frame only meets the ones it concerns."""

    __slots__ = ("_askers", "_by_done_key", "_by_request_key", "_by_response_key", "_reads", "_reported", "_whole",
                 "_whole_all", "filters")

    def __init__(self, filters: Iterable[Filter]) -> None:
        self.filters = tuple(filters)
        self._by_request_key: dict[int, tuple[Filter, ...]] = {}
        self._by_response_key: dict[int, tuple[Filter, ...]] = {}
        self._whole: dict[tuple[int, str], str | None] = {}
        self._whole_all: dict[tuple[int, str, str], tuple[Filter, ...]] = {}
        self._by_done_key: dict[int, tuple[Filter, ...]] = {}
        self._reported: dict[int, bool] = {}
        self._askers: dict[int, tuple[Filter, ...]] = {}
        self._reads: dict[tuple[int, int], bool] = {}

    def for_request(self, api_key: int) -> tuple[Filter, ...]:
        got = self._by_request_key.get(api_key)
        if got is None:
            got = self._by_request_key[api_key] = self._select(api_key, "request_api_keys")
        return got

    def for_response(self, api_key: int) -> tuple[Filter, ...]:
        got = self._by_response_key.get(api_key)
        if got is None:
            got = self._by_response_key[api_key] = self._select(api_key, "response_api_keys")
        return got

    def askers_for_response(self, api_key: int) -> tuple[Filter, ...]:
        """The response filters of ``api_key`` that may ask something first (``asks_for_response``)."""
        got = self._askers.get(api_key)
        if got is None:
            got = self._askers[api_key] = tuple(f for f in self.for_response(api_key) if f.asks_for_response)
        return got

    def changes_reported(self, api_key: int) -> bool:
        """Whether every response filter of ``api_key`` says when it changes an answer
        (``Filter.reports_changes``; True when none sees the api's answers)."""
        got = self._reported.get(api_key)
        if got is None:
            got = self._reported[api_key] = all(f.reports_changes for f in self.for_response(api_key))
        return got

    def reads_answers(self, api_key: int, api_version: int) -> bool:
        """Whether a filter reads this api version's decoded answers: a response filter with something
        to do at that version (``Filter.reads_response``), or one told of the finished exchange. A
        filter that ``may_pass``, or reads the api's answers by their bytes, is left out: whether it
        reads one answer is asked of it each time (``answer_guards``)."""
        key = (api_key, api_version)
        got = self._reads.get(key)
        if got is None:
            got = self._reads[key] = bool(self.for_done(api_key)) or any(
                f.reads_response(api_key, api_version) for f in self.for_response(api_key)
                if not f.may_pass and api_key not in f.reads_by_bytes)
        return got

    def answer_guards(self, api_key: int, api_version: int) -> tuple[Filter, ...]:
        """The response filters of this api version that ``may_pass`` or read its answers by their
        bytes: one reads an answer unless it ``passes`` the api version now and kept nothing for the
        request, and its ``reads_answer`` (for ``reads_by_bytes``) says no."""
        return tuple(f for f in self.for_response(api_key)
                     if (f.may_pass or api_key in f.reads_by_bytes) and f.reads_response(api_key, api_version))

    def pass_guards(self, api_key: int) -> tuple[Filter, ...] | None:
        """The filters a request of ``api_key`` must pass (``Filter.passes``) to go by undecoded; None
        when one of its request filters never lets it by, or a filter hears of it when done."""
        filters = self.for_request(api_key)
        if self.for_done(api_key) or not all(f.may_pass for f in filters):
            return None
        return filters

    def for_done(self, api_key: int) -> tuple[Filter, ...]:
        got = self._by_done_key.get(api_key)
        if got is None:
            got = self._by_done_key[api_key] = self._select(api_key, "done_api_keys")
        return got

    def whole_frame_filter(self, api_key: int, kind: str) -> str | None:
        """The name of the first filter that must see whole frames of this api and kind (None when
        none must: such frames may be streamed)."""
        key = (api_key, kind)
        try:
            return self._whole[key]
        except KeyError:
            pass
        name = next((f.name for f in self.filters if f.sees_whole(api_key, kind)), None)
        self._whole[key] = name
        return name

    def whole_frame_filters(self, api_key: int, kind: str) -> tuple[Filter, ...]:
        """Every filter that ``sees_whole`` frames of this api and kind, in order (each may still let
        one exchange stream: ``may_stream_response``, ``may_stream_request``)."""
        key = (api_key, kind, "all")
        got = self._whole_all.get(key)
        if got is None:
            got = self._whole_all[key] = tuple(f for f in self.filters if f.sees_whole(api_key, kind))
        return got

    def _select(self, api_key: int, keys_attr: str) -> tuple[Filter, ...]:
        return tuple(f for f in self.filters
                     if (keys := getattr(f, keys_attr)) is None or api_key in keys)

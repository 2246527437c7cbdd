"""One client connection, sans-I/O: frames in, actions out.

The session decodes each request, runs the filters, gives it a correlation id of kproxy's own on the
upstream connection, and remembers it until the answer comes back; answers go to the client in the
order the client asked, whether they came from the broker or from a filter. Every request ends in
exactly one completed ``InFlight`` entry (``inflight.py``), handed to the I/O layer on the action
that finishes it (``actions.py``). No sockets, no clock: time comes from the context's injected clock.

This module holds the request and answer paths, filters' questions to the broker, answers kproxy
makes itself, and what a lost broker connection or a closing connection ends. Two parts live beside
it as the session's bases: following SASL so the principal is the one the broker accepted
(``sasl.py``, ``SessionSasl``), and cut-through, frames that go on while they arrive
(``cut_through.py``, ``SessionCutThrough``).
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import struct
from collections.abc import Callable
from typing import Any

import attrs

from kproxy.protocol.compiler import NO_LAZY, native_function, native_skip, whole_skip
from kproxy.protocol.errors import DecodeError, UnsupportedVersionError
from kproxy.protocol.messages import (
    Request,
    Response,
    api_by_key,
    api_name,
    body_class,
    decode_request,
    decode_response,
    encode_request_frame,
    encode_response_frame,
    request_codecs,
    request_header_version,
    response_codecs,
    response_header_version,
    supported_versions,
)
from kproxy.protocol.primitives import ShortBuffer, read_uvarint
from kproxy.proxy.actions import (
    Action,
    Ask,
    Close,
    Hold,
    Keys,
    Listen,
    ToClient,
    ToUpstream,
    size_prefixed,
)
from kproxy.proxy.cut_through import SessionCutThrough, _UpStream
from kproxy.proxy.fetch_bytes import WALKED_UP_TO as FETCH_WALKED_UP_TO
from kproxy.proxy.fetch_bytes import fetch_counts
from kproxy.proxy.filters import (
    AskBroker,
    AskKeys,
    ConnectionContext,
    Delay,
    Filter,
    FilterChain,
    FilterFailed,
    Respond,
    Throttle,
)
from kproxy.proxy.inflight import (
    FORWARDED,
    LOCAL,
    NO_RESPONSE,
    PASSTHROUGH,
    UPSTREAM_LOST,
    InFlight,
)
from kproxy.proxy.memo import AnswerMemo, Remembered
from kproxy.proxy.produce_bytes import WALKED_UP_TO, answer_failures, request_counts
from kproxy.proxy.produce_bytes import produced as produced_in
from kproxy.proxy.reencode import ReencodeCheck, joined
from kproxy.proxy.replies import error_response, lost_connection_error, raise_throttle
from kproxy.proxy.sasl import SaslFront, SessionSasl
from kproxy.proxy.streaming import STREAM_MIN_BYTES, FrameStream
from kproxy.proxy.topics import TopicNames

log = logging.getLogger("kproxy.session")

_I32 = struct.Struct(">i")
_HEAD = struct.Struct(">ihhi")          # size prefix, api key, api version, correlation id
_HHI = struct.Struct(">hhi").unpack_from
_HEAD_ID = struct.Struct(">ii")         # size prefix, correlation id
# Frames kproxy patches rather than encodes go out as one buffer below this size.
_JOIN_BELOW = 16 * 1024

PRODUCE, METADATA, SASL_HANDSHAKE, API_VERSIONS, SASL_AUTHENTICATE = 0, 3, 17, 18, 36
FETCH = 1
# Answers the session itself reads, whatever the filters do: the SASL exchange's outcome, and
# ApiVersions (a broker that answers in v0 when it does not know the version asked).
_READ_BY_SESSION = frozenset({SASL_HANDSHAKE, API_VERSIONS, SASL_AUTHENTICATE})
UNSUPPORTED_VERSION = 35

METADATA_TOPIC_IDS_SINCE = 10    # Metadata responses name topic ids from v10 (KIP-516)
DESCRIBE_TOPIC_PARTITIONS = 75
_NAMES_IN_ANSWERS = frozenset({METADATA, DESCRIBE_TOPIC_PARTITIONS})   # answers topic names are learned from
FIND_COORDINATOR = 10
# Answers the address rewriter reads that repeat byte for byte: the lane serves them from its memo of
# the rewrites the memo here made (``lane_programs``; kproxy/server/_lane.c's remembered_answer).
_LANE_REMEMBERS = frozenset({METADATA, FIND_COORDINATOR})
# Never relayed undecoded: requests the session reads itself. (A relayed Fetch is decoded when its
# hold is looked at, its answer streams or is decoded: ``InFlight.decoded_request``.)
_DECODED_ALWAYS = _READ_BY_SESSION
# In ``Session._unread_by``, the relay decision of an api version sits at this bit above its answer's,
# and the api keys telemetry reads decoded (``telemetry_reads``) at this key.
_RELAY = 1 << 32
_TELEMETRY = -1
_SAMPLE = -2    # and there, when the traffic log or spans sample, their draw as a request arrives (``sample``)
_ANSWER_GUARDS = 1 << 33    # and there, by api version, the filters asked about each answer (FilterChain.answer_guards)
_PASSED = "passed"      # a memo key's part for a filter that let the exchange by (Filter.passes)
_SKIP = native_skip()
_H = struct.Struct(">h").unpack_from
# ``_throttle_at`` for Produce and Fetch: metrics read their answers from the bytes (``_note_produce``,
# ``_note_fetch``).
_PRODUCE_ANSWER, _FETCH_ANSWER = -1, -2
_THROTTLE_OFFSETS = (4, 5)      # the others ``_throttle_at`` gives: no throttle time, or read with the rest


def _teaches_names(api_key: int, version: int) -> bool:
    """Whether answers of this api version name topic ids (``TopicNames.learn`` reads them)."""
    return (api_key == METADATA and version >= METADATA_TOPIC_IDS_SINCE) or api_key == DESCRIBE_TOPIC_PARTITIONS


@attrs.define(slots=True, eq=False)
class _Question:
    """A request waiting for the answer to a filter's question (``AskBroker``)."""

    entry: InFlight
    request: Request
    asker: Filter
    next_filter: int                 # where the filter chain resumes once the asker has decided
    then: Callable[[Response | None], Any]
    upstream_correlation_id: int
    api_key: int
    api_version: int
    # The received bytes and their re-encoding, when the transparency check found them different.
    original: tuple[memoryview, bytes] | None = None


_ASKED = object()   # _request_filters: the request waits for a question's answer
_KEYS = object()    # _request_filters: the request waits for the key service (AskKeys)


@attrs.define(slots=True, eq=False)
class _KeyWait:
    """A request waiting for the key service's answer to a filter's ``AskKeys``."""

    entry: InFlight
    request: Request
    asker: Filter
    next_filter: int
    then: Callable[[Any], Any]
    original: tuple[memoryview, bytes] | None = None


def future_produce_acks(frame: Any) -> int | None:
    """``acks`` of a Produce request newer than kproxy's schema, or None if it cannot be read.

    Every Produce version since 9 starts the same way (header v2, then a compact nullable
    transactional_id, then acks), so an acks=0 request still gets no in-flight entry when it is
    forwarded opaquely; otherwise every later answer would wait behind one that never comes.
    """
    try:
        pos = 8
        (n,) = struct.unpack_from(">h", frame, pos)      # client_id (int16 length; -1 is null)
        pos += 2 + max(n, 0)
        count, pos = read_uvarint(frame, pos)           # header tagged fields
        for _ in range(count):
            _, pos = read_uvarint(frame, pos)
            size, pos = read_uvarint(frame, pos)
            pos += size
        length, pos = read_uvarint(frame, pos)          # transactional_id: compact nullable
        pos += max(length - 1, 0)
        (acks,) = struct.unpack_from(">h", frame, pos)
        return int(acks)
    except (struct.error, IndexError, ValueError, ShortBuffer):
        # A frame too short to hold acks: it is forwarded as a request with an answer, and the
        # broker decides what it is.
        return None


def _read_order(entry: InFlight) -> int:
    return entry.seq


@functools.cache
def _throttle_at(api_key: int, version: int) -> bool | int:
    """Where an answer of this api version holds the broker's throttle time, for metrics that read it
    without decoding: 4, right behind the correlation id (header v0), or 5, behind the header's
    tagged fields (v1: usually none, one byte); True when the version has no throttle time (nothing
    to read); False when it is not the body's first field (a few apis: decoded); ``_PRODUCE_ANSWER``
    for Produce and ``_FETCH_ANSWER`` for Fetch, whose answers metrics read from their bytes
    (``_note_produce``, ``_note_fetch``)."""
    if api_key == PRODUCE:
        return _PRODUCE_ANSWER
    if api_key == FETCH:
        return _FETCH_ANSWER if version <= FETCH_WALKED_UP_TO else False
    try:
        fields = [f for f in api_by_key(api_key).response.root.fields if version in f.versions]  # type: ignore[union-attr]
    except (KeyError, AttributeError):
        return False
    if not any(f.name == "throttle_time_ms" for f in fields):
        return True
    if fields[0].name != "throttle_time_ms" or fields[0].type != "int32":
        return False
    return 5 if response_header_version(api_key, version) >= 1 else 4


def _guarded(entry: InFlight, guards: tuple[Filter, ...], version: int, frame: memoryview) -> bool:
    """Whether a filter that may pass reads this answer: it does not pass its api version now, or it
    kept something for the request; or a filter that reads the api's answers by their bytes says
    this one needs it (``Filter.reads_answer``: a Produce answer with node_endpoints)."""
    key = entry.api_key
    for f in guards:
        if f.may_pass and (not f.passes(key, version) or entry.kept(f) is not None):
            return True
        if key in f.reads_by_bytes and f.reads_answer(key, version, frame):
            return True
    return False


def _note_produce(entry: InFlight, frame: memoryview) -> bool:
    """A relayed Produce answer passed on undecoded: its throttle time, and the records metrics count
    (those of the partitions it reports no error for); False when it cannot be read so (decoded)."""
    read = answer_failures(frame, entry.api_version)
    if read is None or entry.produced is None:
        return False
    failed, entry.throttle_ms = read
    if failed is not None:
        entry.produced = produced_in(entry.produced, entry.produce_counts, failed)
    return True


def _note_fetch(entry: InFlight, frame: memoryview) -> bool:
    """A relayed Fetch answer passed on undecoded: its throttle time and the records metrics count,
    read from it and its request's bytes; False when they cannot be read so, or when the answer
    carries node_endpoints for the address rewriter (decoded, with its request)."""
    if entry.relayed is None:
        return False
    read = fetch_counts(entry.relayed, frame, entry.api_version)
    if read is None or read[2]:
        return False
    entry.fetched, entry.throttle_ms = read[0], read[1]
    return True


def _note_throttle(entry: InFlight, frame: memoryview, at: Any) -> None:
    """The broker's throttle time of an answer passed on undecoded, as decoding would give it."""
    try:
        if at == 5 and frame[4]:
            count, at = read_uvarint(frame, 4)      # tagged fields in the header: skipped
            for _ in range(count):
                _, at = read_uvarint(frame, at)
                size, at = read_uvarint(frame, at)
                at += size
        (ms,) = _I32.unpack_from(frame, at)
    except (struct.error, IndexError, ValueError, ShortBuffer):
        return          # too short to say: the client gets the broker's bytes as they are
    entry.throttle_ms = ms


class Session(SessionCutThrough, SessionSasl):
    """The per-connection state machine between one client and its upstream connection."""

    def __init__(self, ctx: ConnectionContext, chain: FilterChain, *,
                 passthrough_unknown_versions: bool = False, reencode: ReencodeCheck | None = None,
                 topic_names: TopicNames | None = None, front: SaslFront | None = None,
                 stream_min_bytes: int | None = STREAM_MIN_BYTES, memo: AnswerMemo | None = None,
                 read_answers: bool = True, telemetry_reads: frozenset[int] | None = None,
                 sample: Callable[[int], int] | None = None) -> None:
        self.ctx = ctx
        # None when something besides the filters reads every decoded answer (the traffic log, spans);
        # else, by (api key << 16 | version), whether no filter reads that version's answers
        # (``_unread``): those pass on undecoded; and at ``_RELAY | key``, whether that version's
        # requests may go out undecoded (``_relayable``: the accelerator's programs, or False). At
        # ``_TELEMETRY``, when metrics count every exchange, the api keys they read decoded (Produce
        # and Fetch records): the others' figures come from the frames' headers and byte counts, the
        # broker's throttle from its fixed offset (``_note_throttle``). (One attribute: past 30,
        # CPython 3.11 stops sharing the instance dict's keys and every attribute read of the session
        # gets slower.) At ``_SAMPLE``, when the traffic log or spans leave some exchanges out, what
        # decides as each request arrives which outputs take it (``TelemetryOutputs.sample``): an
        # exchange one of them samples is read whole, the others as if those outputs were off.
        self._unread_by: dict[int, Any] | None = None if read_answers else {}
        if self._unread_by is not None:
            if telemetry_reads is not None:
                self._unread_by[_TELEMETRY] = telemetry_reads
            if sample is not None:
                self._unread_by[_SAMPLE] = sample
        # Rewritten answers by their bytes, when every response filter of an api is pure; never
        # while the transparency check runs (it must compare what the filters would do each time).
        self.memo = memo if reencode is None else None
        # kproxy's own SASL handling (termination or origination); None: the client's SASL is relayed.
        self.front = front
        # Broker answers at least this large may be streamed to the client (None: never).
        self.stream_min_bytes = stream_min_bytes
        # The answer being streamed to the client: its entry and the walker (stream_start).
        self.streaming: tuple[InFlight, FrameStream] | None = None
        # The request being streamed to the broker (request_stream_start).
        self.streaming_up: _UpStream | None = None
        # Why the next large Produce request is stored (set when it was declined for streaming).
        self._why_next: str | None = None
        self.chain = chain
        self.topic_names = topic_names       # the process's topic id -> name table, learned here
        # Every request read and not yet done (``finish``): what ``abandon`` ends when the
        # connection does, so each request completes exactly once.
        self.open: set[InFlight] = set()
        self.passthrough = passthrough_unknown_versions
        self.reencode = reencode             # verify_reencode; None when off
        self.in_flight: collections.deque[InFlight] = collections.deque()
        self._by_upstream: dict[int, InFlight] = {}
        self._next_correlation_id = 0
        # Correlation ids of recent acks=0 Produce requests (bounded: only a misbehaving broker
        # answers them, and it answers promptly).
        self._no_response: collections.deque[int] = collections.deque(maxlen=1024)
        self.throttle_until = 0.0           # the client is muted until then (0: never throttled)
        self._raw_sasl = False               # after SaslHandshake v0: unframed SASL tokens follow
        self._sasl_claimed_user: str | None = None   # from the client's token; not trusted
        self._sasl_round_trips = 0
        self._sasl_handshake_ok = False
        self.sasl_in_progress = False
        self.sasl_started_at = 0.0           # when the current SASL exchange began (session clock)
        if front is not None and front.termination is not None:
            # Until the client logs in, the unauthenticated timeout runs from the connection's start.
            self.sasl_in_progress = True
            self.sasl_started_at = ctx.clock()
        self.requests = 0
        self.closed = False
        # A request whose filter asked the broker something; the client is not read meanwhile.
        self.asking: _Question | None = None
        # A request whose filter asked the key service (AskKeys); the client is not read meanwhile.
        self._key_wait: _KeyWait | None = None
        # The frame of the request being dispatched, when no request filter could change it.
        self._untouched: memoryview | None = None

    # -- client side

    @property
    def awaiting_upstream(self) -> int:
        return len(self._by_upstream)

    def client_frame(self, frame: memoryview) -> list[Action]:
        """A complete request frame (without its size prefix) from the client."""
        if _RELAY_REQUEST is not None:
            # The relay step of a request nothing reads, compiled (``_relay_step``); None: not such a one.
            relayed = _RELAY_REQUEST(self, frame)
            if relayed is not None:
                return relayed
        now = self.ctx.clock()
        actions: list[Action] = []
        if self.throttle_until > now:
            # Kafka mutes a throttled client's channel. The I/O layer stops reading while
            # ``throttled_for`` says so; a request read before the throttle began waits here.
            actions.append(Hold(self.throttle_until - now))
            self.throttle_until = 0.0
        front = self.front
        if front is not None and front.raw_expected:
            return actions + self._front_raw(front.raw_token(frame, now))
        if len(frame) < 8:
            if self._raw_sasl:
                return actions + self._raw_sasl_token(frame)
            return [Close(f"request of {len(frame)} bytes is shorter than a request header",
                          undecodable="request")]
        api_key, api_version, correlation_id = _HHI(frame, 0)
        unread_by = self._unread_by
        sampled: int | None = None
        if unread_by is not None and (sample := unread_by.get(_SAMPLE)) is not None:
            sampled = sample(api_key)
        if unread_by is not None and not sampled and front is None and not self._raw_sasl and not actions:
            programs: Any = unread_by.get(_RELAY | api_key << 16 | api_version)
            if programs is None:
                programs = self._relayable(unread_by, api_key, api_version)
            if programs:
                for f in programs[2]:
                    if not f.passes(api_key, api_version):
                        break       # a rule addresses it now (rules reload): the full path
                else:
                    relayed = self._relay(frame, programs, api_key, api_version, correlation_id, now, sampled)
                    if relayed is not None:
                        return relayed
        try:
            req = decode_request(frame, keep_trailing=True)
        except UnsupportedVersionError as e:
            if self._raw_sasl:
                return actions + self._raw_sasl_token(frame)
            return actions + self._unsupported(frame, api_key, api_version, correlation_id, e, now)
        except DecodeError as e:
            if self._raw_sasl:
                return actions + self._raw_sasl_token(frame)
            return [Close(f"malformed {api_name(api_key)} v{api_version} request: {e}", undecodable="request")]
        if self._raw_sasl:
            # A frame that decodes as a whole request ends the raw token exchange (SASL v0). It says
            # nothing about the broker's verdict: only the broker's answers to the tokens do.
            self._raw_sasl = False
        self.requests += 1
        entry = InFlight(correlation_id, api_key, api_version, now, req, request_bytes=len(frame) + 4,
                         seq=self.requests, sampled=sampled)
        if self._why_next is not None:
            entry.why_stored, self._why_next = self._why_next, None
        self.open.add(entry)
        if front is not None:
            answer = front.request(req, now)
            if answer is not None:
                if api_key == API_VERSIONS:
                    self._observe_request(req)
                if front.termination is not None and self.sasl_in_progress and self.ctx.authenticated:
                    self.sasl_in_progress = False
                return actions + self._front_answer(entry, req, answer)
        self._observe_request(req)
        # The received bytes and their re-encoding, when the transparency check found them different.
        original = self._recheck(req, frame) if self.reencode is not None else None
        try:
            verdict = self._request_filters(entry, req, actions)
        except FilterFailed as e:
            return [Close(str(e))]
        if len(frame) >= 8 and not self.chain.for_request(api_key):
            self._untouched = frame
        return self._dispatch(entry, req, verdict, actions, original, now)

    def _relayable(self, unread_by: dict[int, Any], api_key: int, version: int) -> tuple | bool:
        """Whether requests of this api version may go to the broker undecoded, worked out once: the
        accelerator's checks of the header and body when nothing reads the request as it goes (no
        request or done filter on its api, no telemetry, no transparency check, none of the
        session's own state), else False. When its answer is decoded (a filter reads it and no
        remembered answer serves), the request is decoded then, before the filters see the two.
        A filter that sees every api but ``may_pass`` (the policy filter: apis no rule addresses)
        is asked each time (the programs' third part), as its configuration may reload; a quota
        filter sees Produce and Fetch only."""
        chain = self.chain
        programs: tuple | bool = False
        guards = chain.pass_guards(api_key)
        if (_SKIP is not None and api_key not in _DECODED_ALWAYS and guards is not None
                and self.reencode is None and api_key not in unread_by.get(_TELEMETRY, ())):
            # An answer names are learned from is read all the same (``upstream_frame``), from memory
            # or decoded, and its request only when decoded (``InFlight.decoded_request``).
            try:
                header_codec, body_codec = request_codecs(api_key, version)
            except UnsupportedVersionError:
                pass
            else:
                if header_codec.version > 0:        # header v0 has no client id to learn
                    programs = (whole_skip(header_codec), whole_skip(body_codec), guards)
        unread_by[_RELAY | api_key << 16 | version] = programs
        return programs

    def _relay(self, frame: memoryview, programs: tuple, api_key: int, api_version: int, correlation_id: int,
               now: float, sampled: int | None) -> list[Action] | None:
        """A request nothing reads goes on as received, with kproxy's correlation id: checked whole by
        the accelerator as the decoder would (None when it fails: the caller's decode says why), its
        client id learned from the header, decoded only if something needs it later
        (``InFlight.decoded_request``)."""
        end = len(frame)
        skip = _SKIP
        assert skip is not None
        try:
            pos = skip(programs[0], 0, frame, 0, end, 1, None, NO_LAZY)
            skip(programs[1], 0, frame, pos, end, 1, None, NO_LAZY)
        except ValueError:
            return None
        no_response = False
        counted: tuple | None = None
        if api_key == PRODUCE:
            if self._why_next is not None:
                return None         # a large request declined for streaming: its entry says why
            if _TELEMETRY in self._unread_by:       # type: ignore[operator]
                # Metrics count its records: read from its batch headers as it goes (else decoded).
                counted = request_counts(frame, pos, api_version) if api_version <= WALKED_UP_TO else None
                if counted is None:
                    return None
                no_response = counted[0] == 0
            else:
                # acks follows the transactional id (from v3; compact from v9), right after the header.
                if api_version < 3:
                    at = pos
                elif api_version >= 9:
                    length, at = read_uvarint(frame, pos)
                    at += length - 1 if length else 0
                else:
                    (length,) = _H(frame, pos)
                    at = pos + 2 + (length if length > 0 else 0)
                no_response = _H(frame, at)[0] == 0
        (n,) = _H(frame, 8)         # the client id, in every header version past 0
        if n >= 0:
            self.ctx.client_id = str(frame[10:10 + n], "utf-8", "surrogateescape")
        self.requests += 1
        entry = InFlight(correlation_id, api_key, api_version, now, request_bytes=end + 4, seq=self.requests,
                         relayed=frame, sampled=sampled)
        if counted is not None:
            entry.produced, entry.produce_counts = counted[1], counted[2]
        self.open.add(entry)
        upstream_id = self._forwarding(entry, no_response)
        head = _HEAD.pack(end, api_key, api_version, upstream_id)
        return [ToUpstream([head + frame[8:]] if end < _JOIN_BELOW else [head, frame[8:]], entry)]

    # -- the lane (kproxy.server.lane): requests relayed outside the session, and given back

    @property
    def next_correlation_id(self) -> int:
        """The correlation id the next request to the broker gets."""
        return self._next_correlation_id

    @property
    def idle_for_lane(self) -> bool:
        """Nothing of the session's own under way that the lane could not carry on: no raw SASL
        tokens, no large request declined for streaming, no question to the key service."""
        return (not self._raw_sasl and self._why_next is None and self._key_wait is None and self.front is None
                and not self.closed)

    def lane_programs(self, api_key: int, version: int) -> tuple[Any, Any, int, bool, bool] | None:
        """How the lane may relay this api version both ways with the state in force now: (the
        accelerator's header and body programs, where its answer's throttle time sits or -1, whether
        each answer is walked for node_endpoints first), exactly when ``_relay`` would relay its
        requests undecoded (its pass guards passing now) and ``upstream_frame`` would pass its answers
        on unread (no answer guard that could read one, no names learned from it), or when the only
        guard that reads its answers by their bytes reads them by the walk the lane runs itself
        (``Filter.lane_walks``: the address rewriter's node_endpoints in Produce v10+ and Fetch v16+);
        None otherwise. When metrics count requests, Produce and Fetch, whose records metrics read
        from their bytes, are left out. A rules reload changes what the guards say: the server takes
        a laned connection back first (``ClientConnection.lane_recall``).

        The fifth part says whether the answer goes out only as remembered (``_LANE_REMEMBERS``,
        ``_lane_remembers``); then the lane needs ``lane_memo_class`` too."""
        unread_by = self._unread_by
        if (unread_by is None or _SAMPLE in unread_by or self.reencode is not None or self.front is not None
                or (api_key in _NAMES_IN_ANSWERS and api_key not in _LANE_REMEMBERS)
                or (_TELEMETRY in unread_by and api_key in (PRODUCE, FETCH))):
            return None
        programs: Any = unread_by.get(_RELAY | api_key << 16 | version)
        if programs is None:
            programs = self._relayable(unread_by, api_key, version)
        if not programs or not all(f.passes(api_key, version) for f in programs[2]):
            return None
        if api_key in _LANE_REMEMBERS:
            if not self._lane_remembers(unread_by, api_key, version):
                return None
            at = _throttle_at(api_key, version)
            return programs[0], programs[1], at if at in _THROTTLE_OFFSETS else -1, False, True
        unread = self._unread(unread_by, api_key, version)
        if not unread or unread in (_PRODUCE_ANSWER, _FETCH_ANSWER):
            return None
        walk = False
        for f in unread_by[_ANSWER_GUARDS | api_key << 16 | version]:
            if f.may_pass and not f.passes(api_key, version):
                return None
            if api_key in f.reads_by_bytes:
                if not f.lane_walks(api_key, version):
                    return None
                walk = True
            elif not f.may_pass:
                return None
        return programs[0], programs[1], unread if unread in _THROTTLE_OFFSETS else -1, walk, False

    def _lane_remembers(self, unread_by: dict[int, Any], api_key: int, version: int) -> bool:
        """Whether the lane may answer this api version from its memo, as ``_recall`` would from this
        one: the virtual cluster's memo feeds a lane, every response filter is pure, nothing reads the
        completed exchange decoded (no on_done filter, telemetry only counting it) and no SASL moves.

        Names (Metadata v10+ teaches topic ids' names, ``TopicNames``): a served answer must teach the
        process's table what decoding it would. The lane cannot (the table is Python's and forgets past
        its limit, so a name taught once may be gone later), so it serves such a version only while
        nothing learns names (``_learns_names``), when decoding it would teach nothing either. What
        wants names changes with the rules (a reload recalls laned connections first,
        ``ClientConnection.lane_recall``) or is fixed when the server starts (telemetry labelling
        topics): a laned connection never serves an answer while the table learns."""
        memo = self.memo
        return (memo is not None and memo.lane is not None and not self.sasl_in_progress
                and not self._learns_names(api_key, version) and not self.chain.for_done(api_key)
                and api_key not in unread_by.get(_TELEMETRY, ()) and self._filter_keys(api_key, version) is not None)

    def lane_memo_class(self, api_key: int, version: int) -> int | None:
        """The lane memo's class of this api version's answers on this connection now: what the memo
        key holds besides the answer's bytes (api, version, listener, the response filters' keys), as a
        number (``AnswerMemo.lane_class``); None when a filter is not pure. Worked out at each hand-over:
        a filter's key (the address map's generation) may have moved since."""
        memo = self.memo
        keys = self._filter_keys(api_key, version)
        if memo is None or keys is None:
            return None
        return memo.lane_class((api_key, version, self.ctx.listener, keys))

    def lane_returned(self, entries: Any, next_correlation_id: int, requests: int, client_id: str | None,
                      now: float, broker: tuple[str, int] | None) -> None:
        """The lane gave the connection back: ``requests`` it finished, the correlation id it would
        have used next, and ``entries`` (``LaneEntry``, oldest first) sent to the broker and not yet
        answered, which become relayed entries as ``_relay`` makes them, so that their answers, a
        lost broker connection or a timeout are handled here as for any other."""
        self._next_correlation_id = next_correlation_id
        self.requests += requests
        if client_id is not None:
            self.ctx.client_id = client_id
        for e in entries:
            uid = e.upstream_correlation_id
            if e.no_response:
                # Finished (and counted) when it was sent; an answer a broker sends anyway is dropped.
                self._no_response.append(uid)
                continue
            self.requests += 1
            started = now - e.age_s
            request = memoryview(e.request)
            entry = InFlight(e.client_correlation_id, e.api_key, e.api_version, started,
                             request_bytes=len(request) + 4, seq=self.requests, relayed=request)
            entry.forwarded_at, entry.broker = started, broker
            self.open.add(entry)
            entry.upstream_correlation_id = uid
            self.in_flight.append(entry)
            self._by_upstream[uid] = entry

    def _sample(self, api_key: int) -> int | None:
        """The traffic log's and spans' draw for a request arriving now (``InFlight.sampled``)."""
        sample = self._unread_by.get(_SAMPLE) if self._unread_by is not None else None
        return sample(api_key) if sample is not None else None

    def throttled_for(self, now: float) -> float:
        """Seconds the client must not be read from any more: a filter throttled it (0 for none)."""
        return self.throttle_until - now if self.throttle_until > now else 0.0

    def _mute(self, seconds: float) -> None:
        self.throttle_until = max(self.throttle_until, self.ctx.clock() + seconds)

    def _dispatch(self, entry: InFlight, req: Request, verdict: Any, actions: list[Action],
                  original: tuple[memoryview, bytes] | None = None, since: float | None = None) -> list[Action]:
        """Act on the filters' verdict: wait for a question's answer, answer locally, or forward."""
        frame, self._untouched = self._untouched, None
        if verdict is _ASKED:
            assert self.asking is not None
            self.asking.original = original
            return actions
        if verdict is _KEYS:
            assert self._key_wait is not None
            self._key_wait.original = original
            return actions
        if verdict is not None:
            return actions + self._answer_locally(entry, verdict)
        upstream_id = self._forwarding(entry, req.api_key == PRODUCE and req.body.acks == 0)
        if frame is not None and original is None:
            # No request filter could have changed it: the bytes received go on, only the
            # correlation id replaced (no re-encoding: what the client sent, byte for byte).
            req.correlation_id = upstream_id
            head = _HEAD.pack(len(frame), *_HHI(frame, 0)[:2], upstream_id)
            # A small request goes out as one buffer: a copy of a few hundred bytes costs less than
            # a vectored send.
            buffers: list = [head + frame[8:]] if len(frame) < _JOIN_BELOW else [head, frame[8:]]
        else:
            buffers = self._request_buffers(req, upstream_id, original)
        actions.append(ToUpstream(buffers, entry))
        if since is not None:
            entry.handling_s += self.ctx.clock() - since
        return actions

    def _recheck(self, req: Request, frame: memoryview) -> tuple[memoryview, bytes] | None:
        check = self.reencode
        assert check is not None
        if not check.due():
            return None
        encoded = encode_request_frame(req)
        if check.matches("request", req.api_key, req.api_version, frame, encoded, 4):
            return None
        return frame, joined(encoded)

    @staticmethod
    def _request_buffers(req: Request, upstream_id: int, original: tuple[memoryview, bytes] | None) -> list:
        """The request as it goes upstream: re-encoded, or the bytes received (with kproxy's
        correlation id) when they re-encode differently and no filter changed the request."""
        if original is not None and joined(encode_request_frame(req)) == original[1]:
            req.correlation_id = upstream_id
            patched = bytearray(original[0])
            _I32.pack_into(patched, 4, upstream_id)
            return size_prefixed(patched)
        req.correlation_id = upstream_id
        return encode_request_frame(req)

    def _request_filters(self, entry: InFlight, req: Request, actions: list[Action], start: int = 0,
                         resumed: tuple[Filter, Callable[[], Any]] | None = None) -> Any:
        """Run the request filters from ``start``: a Respond, None (forward) or _ASKED. ``resumed``
        is (filter, call) for the filter whose question was just answered; its call runs first."""
        ctx = self.ctx
        filters = self.chain.for_request(req.api_key)
        i = start
        while True:
            if resumed is not None:
                f, call = resumed
                resumed = None
            elif i < len(filters):
                f = filters[i]
                i += 1
                call = functools.partial(f.on_request, ctx, entry)
            else:
                return None
            try:
                verdict = call()
            except Exception as e:
                raise self._filter_failed(f, "on_request", req.api_key) from e
            if verdict is None:
                continue
            if isinstance(verdict, AskBroker):
                self._ask(entry, req, f, i, verdict, actions)
                return _ASKED
            if isinstance(verdict, AskKeys):
                wait = self._key_wait = _KeyWait(entry, req, f, i, verdict.then)
                actions.append(Keys(verdict.question, functools.partial(self._keys_answered, wait)))
                return _KEYS
            if isinstance(verdict, Delay):
                if verdict.seconds > 0:
                    actions.append(Hold(verdict.seconds))
                if verdict.then is None:
                    continue
                verdict = verdict.then
            elif isinstance(verdict, Throttle):
                if verdict.seconds > 0:
                    self._mute(verdict.seconds)
                continue
            return verdict

    # -- questions filters ask the broker (AskBroker)

    def _ask(self, entry: InFlight, req: Request, asker: Filter, next_filter: int, verdict: AskBroker,
             actions: list[Action]) -> None:
        question = verdict.question
        upstream_id = self._take_correlation_id()
        question.correlation_id = upstream_id
        self.asking = _Question(entry, req, asker, next_filter, verdict.then, upstream_id,
                                question.api_key, question.api_version)
        actions.append(Ask(encode_request_frame(question)))

    def _resume(self, answer: Response | None) -> list[Action]:
        """The asking filter decides with ``answer``; the request then goes on as it would have."""
        q = self.asking
        assert q is not None
        self.asking = None
        since = self.ctx.clock()
        actions: list[Action] = []
        try:
            verdict = self._request_filters(q.entry, q.request, actions, q.next_filter,
                                            (q.asker, functools.partial(q.then, answer)))
        except FilterFailed as e:
            return [Close(str(e))]
        return self._dispatch(q.entry, q.request, verdict, actions, q.original, since)

    def _keys_answered(self, wait: _KeyWait, answer: Any) -> list[Action]:
        """The key service answered a request filter's ``AskKeys``: the filter decides with it, and
        the request goes on as it would have."""
        if self._key_wait is wait:
            self._key_wait = None
        if wait.entry not in self.open:
            return []       # the connection ended meanwhile
        since = self.ctx.clock()
        actions: list[Action] = []
        try:
            verdict = self._request_filters(wait.entry, wait.request, actions, wait.next_filter,
                                            (wait.asker, functools.partial(wait.then, answer)))
        except FilterFailed as e:
            return [Close(str(e))]
        return self._dispatch(wait.entry, wait.request, verdict, actions, wait.original, since)

    def _question_answered(self, frame: memoryview) -> list[Action]:
        q = self.asking
        assert q is not None
        try:
            answer: Response | None = decode_response(frame, q.api_key, q.api_version, keep_trailing=True)
        except DecodeError as e:
            log.warning("connection %d: the broker's answer to kproxy's %s question does not decode: %s",
                        self.ctx.connection_id, api_name(q.api_key), e)
            answer = None
        return self._resume(answer)

    def question_unanswered(self, reason: str) -> list[Action]:
        """No answer to the pending question (the I/O layer's timeout): the filter decides without one."""
        q = self.asking
        if q is None:
            return []
        # A late answer is dropped, like the broker's answer to an acks=0 Produce.
        self._no_response.append(q.upstream_correlation_id)
        log.info("connection %d: no answer to kproxy's %s question (%s)", self.ctx.connection_id,
                 api_name(q.api_key), reason)
        return self._resume(None)

    def _filter_failed(self, f: Filter, hook: str, api_key: int) -> FilterFailed:
        # The traceback names code, not message contents, so no secret reaches the log.
        log.error("connection %d: filter %r failed in %s on %s", self.ctx.connection_id, f.name, hook,
                  api_name(api_key), exc_info=True)
        return FilterFailed(f"internal error in filter {f.name!r} ({hook} on {api_name(api_key)})")

    def _forwarding(self, entry: InFlight, no_response: bool) -> int:
        """``entry`` goes to the broker: its upstream correlation id, and the answer it is owed."""
        upstream_id = self._next_correlation_id
        self._next_correlation_id = (upstream_id + 1) & 0x7FFFFFFF
        if no_response:
            # acks=0: the broker sends no response, so nothing waits for one. Some brokers (tansu
            # 0.6) answer anyway; the id is remembered so such an answer is dropped, not forwarded.
            self._no_response.append(upstream_id)
            entry.outcome = NO_RESPONSE
        else:
            entry.upstream_correlation_id = upstream_id
            self.in_flight.append(entry)
            self._by_upstream[upstream_id] = entry
        return upstream_id

    def _take_correlation_id(self) -> int:
        cid = self._next_correlation_id
        self._next_correlation_id = (cid + 1) & 0x7FFFFFFF
        return cid

    def _observe_request(self, req: Request) -> None:
        ctx = self.ctx
        key = req.api_key
        # Header v0 (ControlledShutdown v0) has no client id: it does not clear the one the client gave.
        header = req.header
        if header.client_id is not None:
            # A decoded header knows its version; one built in code asks the registry.
            v = header._version
            if (v if v is not None else request_header_version(key, req.api_version)) > 0:
                ctx.client_id = header.client_id
        if key == API_VERSIONS and req.api_version >= 3:
            ctx.client_software_name = req.body.client_software_name
            ctx.client_software_version = req.body.client_software_version
        elif key in (SASL_HANDSHAKE, SASL_AUTHENTICATE):
            self._observe_sasl_request(req)

    def _unsupported(self, frame: memoryview, api_key: int, api_version: int, correlation_id: int,
                     err: Exception, now: float) -> list[Action]:
        if api_key == API_VERSIONS:
            # A client newer than kproxy: answer as a broker does, in v0 with UNSUPPORTED_VERSION
            # and kproxy's own ApiVersions range, so the client retries with a version we decode.
            lo, hi = supported_versions()[API_VERSIONS]
            cls: Any = body_class(API_VERSIONS, "response")
            body = cls(error_code=UNSUPPORTED_VERSION,
                       api_keys=[cls.ApiVersion(api_key=API_VERSIONS, min_version=lo, max_version=hi)])
            entry = InFlight(correlation_id, api_key, 0, now, None, request_bytes=len(frame) + 4,
                             outcome=LOCAL)
            self.requests += 1
            entry.seq = self.requests
            self.open.add(entry)
            resp = Response.build(API_VERSIONS, 0, correlation_id, body)
            entry.response = resp
            entry.reply = encode_response_frame(resp)
            self.in_flight.append(entry)
            return self._flush()
        if not self.passthrough:
            return [Close(f"cannot decode {err}; set passthrough_unknown_versions to forward such "
                          "frames opaquely")]
        front = self.front
        if front is not None and front.termination is not None and not self.ctx.authenticated:
            # Forwarded opaquely it would reach the broker before the client logged in.
            return [Close(f"cannot decode {err} before SASL authentication")]
        # Opaque passthrough: only the correlation id (bytes 4..8 of the header) is touched.
        upstream_id = self._take_correlation_id()
        patched = bytearray(frame)
        _I32.pack_into(patched, 4, upstream_id)
        entry = InFlight(correlation_id, api_key, api_version, now, None, upstream_id,
                         request_bytes=len(frame) + 4, outcome=PASSTHROUGH)
        self.requests += 1
        entry.seq = self.requests
        self.open.add(entry)
        if api_key == PRODUCE and future_produce_acks(frame) == 0:
            self._no_response.append(upstream_id)
            entry.upstream_correlation_id = None
            entry.outcome = NO_RESPONSE
            return [ToUpstream(size_prefixed(patched), entry)]
        self.in_flight.append(entry)
        self._by_upstream[upstream_id] = entry
        return [ToUpstream(size_prefixed(patched), entry)]

    def _answer_locally(self, entry: InFlight, verdict: Respond) -> list[Action]:
        req = entry.request
        assert req is not None
        entry.outcome = LOCAL
        if req.api_key == PRODUCE and req.body.acks == 0:
            # The client expects no answer, so a refusal cannot be told; a Kafka broker closes the
            # connection when an acks=0 produce fails, and the client notices and refreshes metadata.
            entry.reply = []
            entry.close_after = (f"an acks=0 Produce was refused (error {verdict.error_code}); closing "
                                 "as a broker does, so the client notices")
            self.in_flight.append(entry)
            return self._flush()
        if verdict.body is not None:
            resp = Response.build(req.api_key, req.api_version, entry.client_correlation_id, verdict.body)
        else:
            refused = error_response(req, verdict.error_code, verdict.error_message,
                                     verdict.throttle_time_ms)
            if refused is None:
                # Answers already owed to the client go out first; then the connection closes.
                entry.reply = []
                entry.close_after = (f"{api_name(req.api_key)} was refused (error {verdict.error_code}) "
                                     "and its response has no error code to say so")
                self.in_flight.append(entry)
                return self._flush()
            resp = refused
            resp.correlation_id = entry.client_correlation_id
        entry.response = resp
        entry.throttle_ms = verdict.throttle_time_ms
        entry.reply = encode_response_frame(resp)
        self.in_flight.append(entry)
        return self._flush()

    # -- upstream side

    def upstream_frame(self, frame: memoryview) -> list[Action]:
        """A complete response frame (without its size prefix) from the broker."""
        if _RELAY_ANSWER is not None:
            # The relay of an answer nobody reads, and the flush, compiled (``_relay_step``).
            relayed = _RELAY_ANSWER(self, frame)
            if relayed is not None:
                return relayed
        if self._raw_sasl and not self._by_upstream:
            # Unframed SASL tokens (handshake v0) have no Kafka header: relay them untouched.
            return self._raw_sasl_reply(frame)
        if len(frame) < 4:
            return [Close(f"broker sent a {len(frame)}-byte response, shorter than its header",
                          undecodable="response")]
        (upstream_id,) = _I32.unpack_from(frame, 0)
        if self.asking is not None and upstream_id == self.asking.upstream_correlation_id:
            return self._question_answered(frame)
        entry = self._by_upstream.pop(upstream_id, None)
        if entry is None:
            if upstream_id in self._no_response:
                self._no_response.remove(upstream_id)
                log.debug("connection %d: dropped the broker's answer to an acks=0 Produce",
                          self.ctx.connection_id)
                return []
            return [Close(f"broker answered correlation id {upstream_id}, which kproxy never sent")]
        entry.answered_at = answered = self.ctx.clock()
        entry.upstream_bytes = len(frame)
        version = entry.api_version
        unread_by = self._unread_by
        if entry.request is None and (entry.relayed is None or (
                unread_by is not None and (unread := unread_by.get(entry.api_key << 16 | version))
                and entry.api_key not in _NAMES_IN_ANSWERS
                and not ((guards := unread_by[_ANSWER_GUARDS | entry.api_key << 16 | version])
                         and _guarded(entry, guards, version, frame))
                and (unread != _PRODUCE_ANSWER or _note_produce(entry, frame))
                and (unread != _FETCH_ANSWER or _note_fetch(entry, frame)))):
            # Forwarded undecoded (an unknown version passed through, or relayed and nobody reads the
            # answer: ``_unread`` said so before, and no names are learned from it): so is the answer,
            # with the client's correlation id. A relayed request whose answer is read goes on below.
            head = _HEAD_ID.pack(len(frame), entry.client_correlation_id)
            entry.reply = [head + frame[4:]] if len(frame) < _JOIN_BELOW else [head, frame[4:]]
            if entry.relayed is not None and unread in _THROTTLE_OFFSETS:
                _note_throttle(entry, frame, unread)
            return self._flush()
        if unread_by is not None and not entry.sampled:
            unread = unread_by.get(entry.api_key << 16 | version)
            if unread is None or (unread and entry.api_key in _NAMES_IN_ANSWERS):
                unread = self._unread(unread_by, entry.api_key, version)
        else:
            unread = False      # the traffic log or spans sampled it: read whole
        if (unread
                and not ((guards := unread_by[_ANSWER_GUARDS | entry.api_key << 16 | version])  # type: ignore[index]
                         and _guarded(entry, guards, version, frame))
                # A Produce answer is read from its bytes when its request was (else decoded), a Fetch
                # answer when its request was relayed and it names no endpoints.
                and (unread != _PRODUCE_ANSWER or _note_produce(entry, frame))
                and (unread != _FETCH_ANSWER or _note_fetch(entry, frame))):
            # Nobody reads this answer decoded (no filter at this version, no transparency check,
            # telemetry only counts it): the broker's bytes go on with the client's correlation id.
            head = _HEAD_ID.pack(len(frame), entry.client_correlation_id)
            entry.reply = [head + frame[4:]] if len(frame) < _JOIN_BELOW else [head, frame[4:]]
            if unread in _THROTTLE_OFFSETS:
                _note_throttle(entry, frame, unread)
            entry.handling_s += self.ctx.clock() - answered
            return self._flush()
        if entry.api_key == API_VERSIONS and len(frame) >= 6 and frame[4:6] == b"\x00\x23":
            # A broker that does not know the requested ApiVersions version answers in v0 (KIP-511).
            version = 0
        seen: bytes | None = None
        if self.memo is not None:
            seen, remembered = self._recall(entry, version, frame)
            if remembered is not None:
                return self._send_remembered(entry, version, remembered, answered)
        try:
            resp = decode_response(frame, entry.api_key, version, keep_trailing=True)
        except DecodeError as e:
            return [Close(f"malformed {api_name(entry.api_key)} v{version} response from the broker: {e}",
                          undecodable="response")]
        if entry.relayed is not None:
            entry.decoded_request()         # the filters read the request with its answer
        original: tuple[memoryview, bytes] | None = None
        check = self.reencode
        if check is not None and check.due():
            encoded = encode_response_frame(resp)
            if not check.matches("response", entry.api_key, version, frame, encoded, 4):
                original = frame, joined(encoded)
        names = self.topic_names
        taught: tuple = ()
        if names is not None and _teaches_names(entry.api_key, version):
            # The broker's own names, before any filter changes them (a tenant prefix comes off); kept
            # with the answer if it is remembered, to be taught again when memory serves it.
            if seen is not None:
                taught = names.taught(resp.body.topics)
            if names.learning:
                names.learn(taught if seen is not None else resp.body.topics)
        for f in self.chain.askers_for_response(entry.api_key):
            try:
                ask = f.question_for_response(self.ctx, entry, resp)
            except Exception:
                return [Close(str(self._filter_failed(f, "question_for_response", entry.api_key)))]
            if ask is not None:
                # This answer (and the ones behind it, in order) waits for the key service.
                return [Keys(ask.question, functools.partial(self._response_keys, ask.then, entry, resp, frame,
                                                             version, original, seen, answered, taught))]
        return self._answer(entry, resp, frame, version, original, seen, answered, taught)

    def _response_keys(self, then: Callable[[Any], Any], entry: InFlight, resp: Response, frame: memoryview,
                       version: int, original: tuple[memoryview, bytes] | None, seen: bytes | None,
                       answered: float, taught: tuple, answer: Any) -> list[Action]:
        """The key service answered a response filter's question: the answer goes on."""
        if entry not in self.open:
            return []
        try:
            then(answer)
        except Exception:
            asker = self.chain.askers_for_response(entry.api_key)[0]
            return [Close(str(self._filter_failed(asker, "question_for_response", entry.api_key)))]
        return self._answer(entry, resp, frame, version, original, seen, answered, taught)

    def _answer(self, entry: InFlight, resp: Response, frame: memoryview, version: int,
                original: tuple[memoryview, bytes] | None, seen: bytes | None, answered: float,
                taught: tuple = ()) -> list[Action]:
        """The response filters, then the answer to the client (in order). ``taught``: the topic names
        the broker's answer teaches, remembered with it (``_remember``)."""
        try:
            throttle = self._response_filters(entry, resp)
        except FilterFailed as e:
            return [Close(str(e))]
        ctx = self.ctx
        actions: list[Action] = []
        if entry.ports:
            # The answer names broker ports that must be listening before the client reads them.
            actions.append(Listen(tuple(entry.ports)))
            entry.ports = None
            seen = None         # the next such answer must ask again, until the ports are open
        if throttle > 0:
            # Told in the answer, which goes out at once; the client is then not read meanwhile.
            self._mute(throttle)
            raise_throttle(resp, math.ceil(throttle * 1000))
        self._observe_response(entry, resp)
        entry.throttle_ms = getattr(resp.body, "throttle_time_ms", 0) or 0
        entry.response = resp
        if throttle <= 0 and not entry.response_changed and self.chain.changes_reported(entry.api_key):
            # No filter changed it (each says so, ``Filter.reports_changes``): the broker's own bytes
            # go on with the client's correlation id, not encoded again.
            resp.correlation_id = cid = entry.client_correlation_id
            head = _HEAD_ID.pack(len(frame), cid)
            entry.reply = [head + frame[4:]] if len(frame) < _JOIN_BELOW else [head, frame[4:]]
            if seen is not None:
                self._remember(entry, version, seen, taught)
        elif original is not None and joined(encode_response_frame(resp)) == original[1]:
            # No filter changed it: the client gets the broker's bytes, not kproxy's re-encoding.
            patched = bytearray(original[0])
            _I32.pack_into(patched, 0, entry.client_correlation_id)
            entry.reply = size_prefixed(patched)
            resp.correlation_id = entry.client_correlation_id
        else:
            resp.correlation_id = entry.client_correlation_id
            entry.reply = encode_response_frame(resp)
            if seen is not None and throttle <= 0:
                self._remember(entry, version, seen, taught)
        entry.handling_s += ctx.clock() - answered
        actions += self._flush()
        return actions

    def _unread(self, unread_by: dict[int, Any], api_key: int, version: int) -> bool | int:
        """Whether no one would read this answer decoded: no filter at this version, no transparency
        check, no telemetry reading its body, no state of the session's own kept from it (SASL, the
        versions a broker speaks, the names of topic ids). The fixed part is worked out once per api
        version: True, or, when metrics count it, where its throttle time sits (``_throttle_at``)."""
        unread = unread_by.get(api_key << 16 | version)
        if unread is None:
            unread_by[_ANSWER_GUARDS | api_key << 16 | version] = self.chain.answer_guards(api_key, version)
            counted = unread_by.get(_TELEMETRY)
            unread = unread_by[api_key << 16 | version] = (
                api_key not in _READ_BY_SESSION and self.reencode is None
                and not self.chain.reads_answers(api_key, version)
                and (counted is None or (api_key not in counted and _throttle_at(api_key, version))))
        if unread and api_key in _NAMES_IN_ANSWERS and self._learns_names(api_key, version):
            return False
        return unread

    # -- remembered answers (kproxy.proxy.memo)

    def _learns_names(self, api_key: int, version: int) -> bool:
        names = self.topic_names
        return names is not None and names.learning and _teaches_names(api_key, version)

    def _filter_keys(self, api_key: int, version: int, entry: InFlight | None = None) -> tuple | None:
        """Every response filter's memo key for the answer to ``entry`` (None: a request relayed
        undecoded, for which no filter kept anything); None when one is not pure (or none runs: then
        nothing is rewritten, and answers with nothing to rewrite rarely repeat). A filter that
        ``passes`` this api version and kept nothing for the request has nothing to do with its
        answer: it counts as pure."""
        filters = self.chain.for_response(api_key)
        if not filters:
            return None
        keys: list[Any] = []
        for f in filters:
            if f.may_pass and f.passes(api_key, version) and (entry is None or entry.kept(f) is None):
                keys.append(_PASSED)
                continue
            k = f.memo_key(self.ctx, api_key)
            if k is None:
                return None
            keys.append(k)
        return tuple(keys)

    def _recall(self, entry: InFlight, version: int, frame: memoryview) -> tuple[bytes | None, Remembered | None]:
        """(the answer's bytes after its correlation id, if it may be remembered; what was sent for
        them last time, if anything)."""
        memo = self.memo
        assert memo is not None
        api_key = entry.api_key
        if (len(frame) > memo.max_frame or api_key in (SASL_HANDSHAKE, SASL_AUTHENTICATE) or self.sasl_in_progress
                or ((entry.sampled or self._unread_by is None) and self._learns_names(api_key, version))):
            # SASL answers move the session's state. An answer that teaches names is served from memory
            # teaching them again (``Remembered.names``), unless the traffic log or spans sampled it
            # (or read every exchange: no sampler): that one is decoded, as before the memo served
            # such answers.
            return None, None
        keys = self._filter_keys(api_key, version, entry)
        if keys is None:
            return None, None
        seen = bytes(frame[4:])
        got = memo.get((api_key, version, self.ctx.listener, keys, seen))
        if got is not None and memo.lane is not None and api_key in _LANE_REMEMBERS:
            # The lane missed it (its memo let it go first, or this connection is not laned yet): it
            # learns it again, so that a laned connection does not come back for it each time.
            memo.to_lane((api_key, version, self.ctx.listener, keys), seen, got.tail)
        return seen, got

    def _send_remembered(self, entry: InFlight, version: int, got: Remembered, answered: float) -> list[Action]:
        cid = entry.client_correlation_id
        tail = got.tail
        head = _HEAD_ID.pack(len(tail) + 4, cid)
        entry.reply = [head + tail] if len(tail) < _JOIN_BELOW else [head, tail]
        if (self._unread_by is None or self.chain.for_done(entry.api_key) or entry.sampled
                or entry.api_key in self._unread_by.get(_TELEMETRY, ())):
            # Telemetry or an on_done filter reads the completed entry: it gets the answer decoded.
            header_codec, _ = response_codecs(entry.api_key, version)
            entry.response = Response(entry.api_key, version, header_codec.cls(cid), got.body, got.trailing)
        entry.throttle_ms = got.throttle_ms
        if got.names:
            names = self.topic_names
            if names is not None and names.learning:
                # What decoding the broker's answer would have taught (upstream_frame), in its order.
                names.learn_again(got.names)
        entry.handling_s += self.ctx.clock() - answered
        return self._flush()

    def _remember(self, entry: InFlight, version: int, seen: bytes, taught: tuple = ()) -> None:
        """Remember what the client got for ``seen``, keyed by the filters' state after they ran
        (what they learned from this answer is part of the state the next one meets)."""
        memo = self.memo
        assert memo is not None and entry.reply is not None
        keys = self._filter_keys(entry.api_key, version, entry)
        if keys is None:
            return
        data = joined(entry.reply)
        try:
            # Decoded from bytes the memo owns: lazy arrays must never view a receive buffer.
            stored = decode_response(memoryview(data)[4:], entry.api_key, version, keep_trailing=True)
        except DecodeError:  # pragma: no cover - kproxy's own encoding decodes
            return
        # The decoded body is counted as twice the bytes; the pairs taught again are counted whole.
        size = len(seen) + 2 * len(data) + (TopicNames.taught_bytes(taught) if taught else 0)
        memo.put((entry.api_key, version, self.ctx.listener, keys, seen),
                 Remembered(data[8:], stored.body, stored.trailing, entry.throttle_ms, taught), size)
        if memo.lane is not None and entry.api_key in _LANE_REMEMBERS:
            memo.to_lane((entry.api_key, version, self.ctx.listener, keys), seen, data[8:])

    def _response_filters(self, entry: InFlight, resp: Response) -> float:
        """Run the response filters; the longest throttle any asks for. FilterFailed if one raises."""
        throttle = 0.0
        req = entry.request
        assert req is not None
        ctx = self.ctx
        for f in self.chain.for_response(entry.api_key):
            try:
                t = f.on_response(ctx, entry, resp)
            except Exception as e:
                raise self._filter_failed(f, "on_response", entry.api_key) from e
            if t > throttle:
                throttle = t
        return throttle

    def _flush(self) -> list[Action]:
        out: list[Action] = []
        q = self.in_flight
        while q and q[0].reply is not None:
            entry = q.popleft()
            reply = entry.reply
            assert reply is not None
            if entry.close_after is not None:
                if reply:
                    entry.response_bytes = _I32.unpack_from(reply[0], 0)[0] + 4
                    out.append(ToClient(reply))
                out.append(Close(entry.close_after, (entry,)))
                break
            # Encoded frames start with their 4-byte size prefix.
            entry.response_bytes = _I32.unpack_from(reply[0], 0)[0] + 4 if reply else 0
            out.append(ToClient(reply, (entry,)))
        return out

    # -- faults

    def upstream_lost(self, reason: str) -> list[Action]:
        """The broker connection ended: answer what was waiting on it, in order, with retriable errors."""
        if self.streaming is not None:
            # Part of an answer is with the client and the rest will never come: a frame cannot be
            # finished with made-up bytes, so the connection closes; the client retries.
            entry, stream = self.streaming
            self.streaming = None
            entry.outcome = UPSTREAM_LOST
            self.in_flight.clear()
            self._by_upstream.clear()
            return [Close(f"broker connection lost in the middle of a streamed {api_name(entry.api_key)} answer "
                          f"({stream.sent - 4} of {stream.size} bytes sent): {reason}", (entry,))]
        up = self.streaming_up
        if up is not None and up.entry is not None and up.lost is None:
            # Part of a request is with the broker and the rest can never follow on this connection:
            # the rest is read and dropped (never sent to another), and answered once it is in.
            up.lost = reason
            entry = up.entry
            entry.broken = "broker"
            if entry.outcome == NO_RESPONSE:
                # acks=0: no answer is owed; close as a broker does when such a produce fails.
                self.streaming_up = None
                entry.outcome = UPSTREAM_LOST
                return [Close(f"broker connection lost while an acks=0 Produce request streamed to it "
                              f"({reason})", (entry,))]
            if entry.upstream_correlation_id is not None:
                self._by_upstream.pop(entry.upstream_correlation_id, None)
        waiting = list(self._by_upstream.values())
        self._by_upstream.clear()
        self._raw_sasl = False
        # After SASL a new broker connection would be unauthenticated, and only the client can
        # authenticate again: end the client connection, as the broker's own loss would.
        # With kproxy's own SASL front the client logged in to kproxy, which logs in again itself.
        authenticated = self.ctx.authenticated and self.front is None
        if authenticated and not self.in_flight and self.asking is None:
            return [Close(f"broker connection lost after SASL authentication ({reason})")]
        for entry in waiting:
            entry.outcome = UPSTREAM_LOST
            req = entry.decoded_request()
            code = lost_connection_error(req.api_key) if req is not None else None
            if authenticated or req is None or code is None:
                entry.reply = []
                entry.close_after = f"broker connection lost ({reason})"
                continue
            resp = error_response(req, code, f"kproxy: broker connection lost ({reason})")
            if resp is None:
                entry.reply = []
                entry.close_after = f"broker connection lost ({reason})"
                continue
            # Filters see this answer like the broker's, so one that changed the request (a tenant
            # prefix) changes the answer back; the connection stays up, so the throttle is moot.
            try:
                self._response_filters(entry, resp)
            except FilterFailed as e:
                entry.reply = []
                entry.close_after = str(e)
                continue
            resp.correlation_id = entry.client_correlation_id
            entry.response = resp
            entry.reply = encode_response_frame(resp)
        actions = self._flush()
        if self.asking is not None:
            closing = next((a for a in actions if isinstance(a, Close)), None)
            if closing is not None:
                # The connection ends before the question could be settled: the request ends with it.
                q, self.asking = self.asking, None
                q.entry.outcome = UPSTREAM_LOST
                closing.done = (*closing.done, q.entry)
                return actions
            if authenticated:
                # A new broker connection would not be authenticated: end it as for the others.
                q, self.asking = self.asking, None
                q.entry.reply = []
                q.entry.close_after = f"broker connection lost ({reason})"
                self.in_flight.append(q.entry)
                return actions + self._flush()
            actions += self._resume(None)
        return actions

    def finish(self, entry: InFlight) -> None:
        """The I/O layer completed ``entry`` (its answer written, or the connection gone): the filters
        hear it once in ``on_done``. A failing hook is logged; the request is over either way."""
        if entry not in self.open:
            return
        self.open.discard(entry)
        for f in self.chain.for_done(entry.api_key):
            try:
                f.on_done(self.ctx, entry)
            except Exception:
                log.error("connection %d: filter %r failed in on_done on %s", self.ctx.connection_id, f.name,
                          api_name(entry.api_key), exc_info=True)

    def abandon(self, outcome: str) -> list[InFlight]:
        """The connection is ending: every request not yet done ends with ``outcome`` (CLIENT_GONE or
        CLOSED), in the order the client sent them. The caller completes them (``finish``)."""
        left = sorted(self.open, key=_read_order)
        for entry in left:
            entry.outcome = outcome
        self.in_flight.clear()
        self._by_upstream.clear()
        self.asking = None
        self._key_wait = None
        self.streaming = None
        up, self.streaming_up = self.streaming_up, None
        if up is not None and up.entry is not None and up.entry.broken is None:
            up.entry.broken = "client"
        return left

    def close(self) -> None:
        """The connection ended: every filter's ``on_close`` runs, whatever the others do, then their
        per-connection state is dropped."""
        if self.closed:
            return
        self.closed = True
        for f in self.chain.filters:
            try:
                f.on_close(self.ctx)
            except Exception:
                log.error("connection %d: filter %r failed in on_close", self.ctx.connection_id, f.name,
                          exc_info=True)
        self.ctx.clear_state()


def _relay_step() -> tuple[Callable | None, Callable | None]:
    """The accelerator's relay step (``_accel.relay_request``/``relay_answer``): what ``client_frame``
    and ``_relay``/``_forwarding`` do for a request nothing reads, and what ``upstream_frame`` and
    ``_flush`` do for its answer when nobody reads that either, each in one C call that returns None
    (having changed nothing) for any other frame, which then takes the Python path, the reference.
    Its entries are copies of an entry of attrs' defaults, so those must all be constants (a
    factory's list would be shared). (None, None) without the accelerator (``KPROXY_CODEC=python``, a
    build without a compiler)."""
    setup = native_function("relay_setup")
    if setup is None:
        return None, None
    if any(isinstance(f.default, attrs.Factory) for f in attrs.fields(InFlight)):  # type: ignore[arg-type]
        raise TypeError("InFlight's defaults must be constants for the accelerator's relay step")
    setup(InFlight, InFlight(0, 0, 0, 0.0), ToUpstream, ToClient, FORWARDED, NO_RESPONSE, WALKED_UP_TO)
    return native_function("relay_request"), native_function("relay_answer")


_RELAY_REQUEST, _RELAY_ANSWER = _relay_step()

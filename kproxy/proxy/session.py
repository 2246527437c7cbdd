"""One client connection, sans-I/O: frames in, actions out.

The session decodes each request, runs the filters, gives it a correlation id of kproxy's own on the
upstream connection, and remembers it until the answer comes back; answers go to the client in the
order the client asked, whether they came from the broker or from a filter. Every request ends in
exactly one completed ``InFlight`` entry, handed to the I/O layer on the action that finishes it. It
also follows SASL so the principal is the one the broker accepted, never one the client claims. No
sockets, no clock: time comes from the context's injected clock.
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

from kproxy.logs import safe
from kproxy.protocol.errors import DecodeError, UnsupportedVersionError
from kproxy.protocol.messages import (
    Request,
    Response,
    api_name,
    body_class,
    decode_request,
    decode_response,
    encode_request_frame,
    encode_response_frame,
    peek_request_header,
    request_header_version,
    response_codecs,
    supported_versions,
)
from kproxy.protocol.primitives import ShortBuffer, read_uvarint
from kproxy.proxy.filters import AskBroker, ConnectionContext, Delay, Filter, FilterChain, Respond, Throttle
from kproxy.proxy.memo import AnswerMemo, Remembered
from kproxy.proxy.reencode import ReencodeCheck, joined
from kproxy.proxy.replies import error_response, lost_connection_error, raise_throttle
from kproxy.proxy.sasl import FrontAnswer, SaslFront
from kproxy.proxy.streaming import (
    STREAM_MIN_BYTES,
    FrameStream,
    StreamError,
    StreamHead,
    node_endpoints_rewrite,
    why_stored,
)
from kproxy.proxy.topics import TopicNames

log = logging.getLogger("kproxy.session")

_I32 = struct.Struct(">i")
_HEAD = struct.Struct(">ihhi")          # size prefix, api key, api version, correlation id
_HHI = struct.Struct(">hhi").unpack_from
_HEAD_ID = struct.Struct(">ii")         # size prefix, correlation id
# Frames kproxy patches rather than encodes go out as one buffer below this size.
_JOIN_BELOW = 16 * 1024

PRODUCE, METADATA, SASL_HANDSHAKE, API_VERSIONS, SASL_AUTHENTICATE = 0, 3, 17, 18, 36
UNSUPPORTED_VERSION = 35

# Outcomes of a request (``InFlight.outcome``).
FORWARDED = "forwarded"          # the broker answered
LOCAL = "local"                  # kproxy answered (a filter, an unsupported version)
NO_RESPONSE = "no_response"      # acks=0 Produce: complete once written to the broker
UPSTREAM_LOST = "upstream_lost"  # the broker connection was lost or timed out first
PASSTHROUGH = "passthrough"      # forwarded opaquely (passthrough_unknown_versions)
CLIENT_GONE = "client_gone"      # the client went away before its answer was written
CLOSED = "closed"                # kproxy closed the connection first (a bad frame, a drain timeout, a fault)

# How an answer reached the client (``InFlight.path``): stored whole and then forwarded, or streamed
# while it arrived (cut-through, kproxy.proxy.streaming).
STORED, STREAMED = "stored", "streamed"

METADATA_TOPIC_IDS_SINCE = 10    # Metadata responses name topic ids from v10 (KIP-516)
DESCRIBE_TOPIC_PARTITIONS = 75


class Action:
    """Something the I/O layer must do, in order."""

    __slots__ = ()


class ToUpstream(Action):
    """Write ``buffers`` to the broker. ``entry`` is the request they carry (None for raw SASL
    tokens); the I/O layer stamps its ``forwarded_at`` and, for an acks=0 Produce, completes it."""

    __slots__ = ("buffers", "entry")

    def __init__(self, buffers: list, entry: InFlight | None = None) -> None:
        self.buffers = buffers
        self.entry = entry

    def __repr__(self) -> str:
        return f"ToUpstream({sum(len(b) for b in self.buffers)} bytes)"


class StreamUp(Action):
    """Write the next ``buffers`` of a request that goes to the broker while it arrives (cut-through,
    ``Session.request_piece``). ``first``: the I/O layer takes the broker write lock (connecting if
    need be) and keeps it until ``last``, so no other bytes come between the frame's pieces. The
    pieces are views of the client's receive chunk: written before it is refilled."""

    __slots__ = ("buffers", "entry", "first", "last")

    def __init__(self, buffers: list, entry: InFlight, first: bool, last: bool) -> None:
        self.buffers = buffers
        self.entry = entry
        self.first = first
        self.last = last

    def __repr__(self) -> str:
        return (f"StreamUp({sum(len(b) for b in self.buffers)} bytes"
                f"{', first' if self.first else ''}{', last' if self.last else ''})")


class ToClient(Action):
    """Write ``buffers`` to the client; the requests in ``done`` are complete once they are written."""

    __slots__ = ("buffers", "done")

    def __init__(self, buffers: list, done: tuple[InFlight, ...] = ()) -> None:
        self.buffers = buffers
        self.done = done

    def __repr__(self) -> str:
        return f"ToClient({sum(len(b) for b in self.buffers)} bytes, {len(self.done)} done)"


class Hold(Action):
    """Wait this long before doing the actions that follow (throttling, filter delays)."""

    __slots__ = ("seconds",)

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __repr__(self) -> str:
        return f"Hold({self.seconds:.3f}s)"


class Listen(Action):
    """Open these broker ports before doing what follows: the next write names them to the client."""

    __slots__ = ("ports",)

    def __init__(self, ports: tuple[int, ...]) -> None:
        self.ports = ports

    def __repr__(self) -> str:
        return f"Listen({', '.join(map(str, self.ports))})"


class Ask(Action):
    """Send ``buffers``, a question a filter asks the broker before it decides, then read nothing more
    from the client until the session has the answer (``Session.asking`` is None again); if none
    comes within the request timeout, tell the session with ``question_unanswered``."""

    __slots__ = ("buffers",)

    def __init__(self, buffers: list) -> None:
        self.buffers = buffers

    def __repr__(self) -> str:
        return f"Ask({sum(len(b) for b in self.buffers)} bytes)"


class Close(Action):
    """Close the client connection, logging ``reason``; the requests in ``done`` end with it
    (answered with the closed connection, as a broker does when it cannot answer). ``undecodable``
    is "request" or "response" when a frame from that side could not be decoded (for metrics)."""

    __slots__ = ("done", "reason", "undecodable")

    def __init__(self, reason: str, done: tuple[InFlight, ...] = (), undecodable: str | None = None) -> None:
        self.reason = reason
        self.done = done
        self.undecodable = undecodable

    def __repr__(self) -> str:
        return f"Close({self.reason!r})"


@attrs.define(slots=True, eq=False)
class InFlight:
    """A request from the moment it is read until its answer is written: the completed-request entry.

    Times come from the session's clock: ``started`` when the frame was read, ``forwarded_at`` when
    it was written to the broker, ``answered_at`` when the response was complete, ``finished_at``
    when the answer was written to the client (the last two stamped by the I/O layer).
    ``handling_s`` is the time the session spent on it: from reading the request until it was
    encoded for the broker, plus from ``answered_at`` until the answer was encoded for the client
    (decoding, filters and encoding; no waiting). Response filters see only the first part.
    """

    client_correlation_id: int
    api_key: int
    api_version: int
    started: float
    request: Request | None = None         # None for frames forwarded opaquely
    upstream_correlation_id: int | None = None
    reply: list | None = None              # the encoded response, once known
    close_after: str | None = None         # close the connection once this reply is sent
    request_bytes: int = 0
    response_bytes: int = 0                # as sent to the client, size prefix included
    outcome: str = FORWARDED
    response: Response | None = None       # the decoded answer (after filters), when there is one
    forwarded_at: float | None = None
    answered_at: float | None = None
    finished_at: float | None = None
    broker: tuple[str, int] | None = None  # the broker connection it went to
    throttle_ms: int = 0                   # throttle_time_ms as sent to the client
    handling_s: float = 0.0
    seq: int = 0                           # the request's place among the connection's requests
    # What filters decided about this request (rule names, quota keys), for metrics and logs.
    notes: dict[str, Any] | None = None
    # Each filter's own state from the request to its answer (keep / kept); dies with the entry.
    kept_by: dict[Any, Any] | None = None
    # Broker ports an answer names that no listener holds yet (the address rewriter's ``listen``).
    ports: list[int] | None = None
    # How the broker's answer reached the client (STORED or STREAMED); for a streamed one, what each
    # records field held (kproxy.proxy.streaming.RecordsFacts, in the answer's order), since the
    # decoded ``response`` then has its records left out.
    path: str = STORED
    records_facts: list | None = None
    spliced_bytes: int = 0                 # of a streamed answer, bytes spliced (never in kproxy's memory)
    # How the request reached the broker: STORED, or STREAMED while it arrived (a large Produce;
    # ``records_facts`` then says what its records held, the decoded ``request`` has them left out).
    request_path: str = STORED
    # Why a request large enough to stream was stored instead (kproxy.proxy.streaming.why_stored).
    why_stored: str | None = None
    # A streamed frame cut off part-way: "client" (it went away mid-frame) or "broker" (lost mid-frame).
    broken: str | None = None
    # The broker's answer as it arrived, without its 4-byte size prefix (0 until then, and for an
    # answer kproxy made up): what a fetch quota charges, as a Kafka broker charges a response's size.
    upstream_bytes: int = 0
    # Why an answer large enough to stream was stored whole instead (``why_stored``'s reason, or
    # "order" when an earlier answer was still owed); None for one that streamed or was never a candidate.
    response_why_stored: str | None = None
    # A response filter changed the answer (``Filter.reports_changes``): it is encoded again.
    response_changed: bool = False

    def note(self, key: str, value: Any) -> None:
        if self.notes is None:
            self.notes = {}
        self.notes[key] = value

    def keep(self, owner: Any, value: Any) -> None:
        """Carry ``owner``'s (a filter's) state for this request to its on_response and on_done."""
        if self.kept_by is None:
            self.kept_by = {}
        self.kept_by[owner] = value

    def kept(self, owner: Any) -> Any:
        return self.kept_by.get(owner) if self.kept_by is not None else None

    def listen(self, port: int) -> None:
        """The answer names ``port``: it must be listening before the answer is written."""
        if self.ports is None:
            self.ports = [port]
        elif port not in self.ports:
            self.ports.append(port)


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


@attrs.define(slots=True, eq=False)
class _UpStream:
    """A request being streamed to the broker while it arrives (``Session.request_stream_start``)."""

    stream: FrameStream
    started: float
    entry: InFlight | None = None    # once the filters have let it stream
    sent_any: bool = False           # its first StreamUp has been handed out
    lost: str | None = None          # the broker connection was lost part-way: the rest is dropped


def sasl_user(mechanism: str | None, token: bytes | memoryview) -> str | None:
    """The user name in a client's first SASL token, for PLAIN and SCRAM; None otherwise.

    Only the name is taken; the token (with its password or proof) is dropped right here. The name is
    a claim: it becomes the principal only once the broker has accepted the authentication.
    """
    if mechanism == "PLAIN":
        parts = bytes(token).split(b"\x00")
        if len(parts) == 3:
            name = parts[1] or parts[0]
            return name.decode("utf-8", "replace")
    elif mechanism and mechanism.startswith("SCRAM-"):
        text = bytes(token).decode("utf-8", "replace")
        for attr in text.split(","):
            if attr.startswith("n="):
                # RFC 5802: "," and "=" in names travel as =2C and =3D.
                return attr[2:].replace("=2C", ",").replace("=3D", "=")
    return None


# Successful SaslAuthenticate round trips after which the broker has accepted the client.
_SASL_ROUND_TRIPS = {"PLAIN": 1, "SCRAM-SHA-256": 2, "SCRAM-SHA-512": 2}


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


@functools.cache
def _produce_versions() -> tuple[int, int]:
    # supported_versions() builds its table anew on every call: asked once per large Produce.
    return supported_versions()[PRODUCE]


def _read_order(entry: InFlight) -> int:
    return entry.seq


def _size_prefixed(frame: Any) -> list:
    return [_I32.pack(len(frame)), frame]


def _frame_size(buffers: list) -> int:
    # Encoded frames start with their 4-byte size prefix.
    return _I32.unpack_from(buffers[0], 0)[0] + 4 if buffers else 0


class FilterFailed(Exception):
    """A filter hook raised; the connection closes, the proxy carries on."""


class Session:
    """The per-connection state machine between one client and its upstream connection."""

    def __init__(self, ctx: ConnectionContext, chain: FilterChain, *,
                 passthrough_unknown_versions: bool = False, reencode: ReencodeCheck | None = None,
                 topic_names: TopicNames | None = None, front: SaslFront | None = None,
                 stream_min_bytes: int | None = STREAM_MIN_BYTES, memo: AnswerMemo | None = None) -> None:
        self.ctx = ctx
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
        self._throttle_until = 0.0
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
        # The frame of the request being dispatched, when no request filter could change it.
        self._untouched: memoryview | None = None

    # -- client side

    @property
    def awaiting_upstream(self) -> int:
        return len(self._by_upstream)

    def client_frame(self, frame: memoryview) -> list[Action]:
        """A complete request frame (without its size prefix) from the client."""
        now = self.ctx.clock()
        actions: list[Action] = []
        if self._throttle_until > now:
            # Kafka mutes a throttled client's channel. The I/O layer stops reading while
            # ``throttled_for`` says so; a request read before the throttle began waits here.
            actions.append(Hold(self._throttle_until - now))
            self._throttle_until = 0.0
        front = self.front
        if front is not None and front.raw_expected:
            return actions + self._front_raw(front.raw_token(frame, now))
        if len(frame) < 8:
            if self._raw_sasl:
                return actions + self._raw_sasl_token(frame)
            return [Close(f"request of {len(frame)} bytes is shorter than a request header",
                          undecodable="request")]
        api_key, api_version, correlation_id = peek_request_header(frame)
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
                         seq=self.requests)
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

    def throttled_for(self, now: float) -> float:
        """Seconds the client must not be read from any more: a filter throttled it (0 for none)."""
        return self._throttle_until - now if self._throttle_until > now else 0.0

    def _mute(self, seconds: float) -> None:
        self._throttle_until = max(self._throttle_until, self.ctx.clock() + seconds)

    def _dispatch(self, entry: InFlight, req: Request, verdict: Any, actions: list[Action],
                  original: tuple[memoryview, bytes] | None = None, since: float | None = None) -> list[Action]:
        """Act on the filters' verdict: wait for a question's answer, answer locally, or forward."""
        frame, self._untouched = self._untouched, None
        if verdict is _ASKED:
            assert self.asking is not None
            self.asking.original = original
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
            return _size_prefixed(patched)
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
        upstream_id = self._take_correlation_id()
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
        if req.client_id is not None and request_header_version(key, req.api_version) > 0:
            ctx.client_id = req.client_id
        if key == API_VERSIONS and req.api_version >= 3:
            ctx.client_software_name = req.body.client_software_name
            ctx.client_software_version = req.body.client_software_version
        elif key == SASL_HANDSHAKE:
            # A new handshake starts over (KIP-368 re-authentication too): until the broker accepts
            # again, the connection keeps the identity it had, and a claim is only a claim.
            ctx.sasl_mechanism = req.body.mechanism
            self.sasl_in_progress = True
            self.sasl_started_at = ctx.clock()
            self._sasl_handshake_ok = False
            self._sasl_round_trips = 0
            self._sasl_claimed_user = None
        elif key == SASL_AUTHENTICATE and self._sasl_round_trips == 0:
            self._sasl_claimed_user = sasl_user(ctx.sasl_mechanism, req.body.auth_bytes)

    def _raw_sasl_token(self, frame: memoryview) -> list[Action]:
        # The first raw token (handshake v0) names the user just as SaslAuthenticate's would.
        if self._sasl_round_trips == 0 and self._sasl_claimed_user is None:
            self._sasl_claimed_user = sasl_user(self.ctx.sasl_mechanism, frame)
        return [ToUpstream(_size_prefixed(frame))]

    def _raw_sasl_reply(self, frame: memoryview) -> list[Action]:
        # A Kafka broker answers each raw token it accepts (PLAIN with an empty one) and closes the
        # connection on failure: the last expected answer is the broker's acceptance.
        self._sasl_round_trips += 1
        needed = _SASL_ROUND_TRIPS.get(self.ctx.sasl_mechanism or "")
        if needed is not None and self._sasl_round_trips >= needed:
            self._sasl_accepted()
        return [ToClient(_size_prefixed(frame))]

    def _sasl_accepted(self) -> None:
        """The broker accepted the authentication: the claimed user becomes the principal."""
        if not self.sasl_in_progress:
            return
        self.sasl_in_progress = False
        ctx = self.ctx
        ctx.authenticated = True
        # Only PLAIN and SCRAM name the user in a form kproxy can read; other mechanisms leave the
        # SASL user unset, so the principal stays what a verified certificate says, or none.
        ctx.sasl_user = self._sasl_claimed_user
        self._sasl_claimed_user = None
        log.info("connection %d authenticated as %s (%s)", ctx.connection_id, safe(ctx.principal),
                 safe(ctx.sasl_mechanism))

    def _sasl_refused(self) -> None:
        """The broker refused: no SASL identity at all, whatever was established before."""
        self.sasl_in_progress = False
        self._sasl_claimed_user = None
        ctx = self.ctx
        if ctx.authenticated or ctx.sasl_user is not None:
            log.info("connection %d: the broker refused SASL re-authentication; identity cleared",
                     ctx.connection_id)
        ctx.authenticated = False
        ctx.sasl_user = None

    def _front_answer(self, entry: InFlight, req: Request, answer: FrontAnswer) -> list[Action]:
        """Answer a request kproxy's SASL front handled: in order, after ``hold_s``, maybe closing."""
        entry.outcome = LOCAL
        out: list[Action] = [Hold(answer.hold_s)] if answer.hold_s > 0 else []
        if answer.body is not None:
            resp = Response.build(req.api_key, req.api_version, entry.client_correlation_id, answer.body)
            entry.response = resp
            entry.reply = encode_response_frame(resp)
        else:
            entry.reply = []
        if answer.close is not None:
            entry.close_after = answer.close
        elif answer.body is None:
            entry.close_after = f"{api_name(req.api_key)} cannot be answered"
        self.in_flight.append(entry)
        return out + self._flush()

    def _front_raw(self, answer: FrontAnswer) -> list[Action]:
        # An unframed token (SaslHandshake v0) comes before any request is forwarded, so nothing is
        # owed to the client ahead of its answer.
        out: list[Action] = [Hold(answer.hold_s)] if answer.hold_s > 0 else []
        if answer.close is not None:
            return [*out, Close(answer.close)]
        if self.ctx.authenticated:
            self.sasl_in_progress = False
        return [*out, ToClient(_size_prefixed(answer.raw or b""))]

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
            return [ToUpstream(_size_prefixed(patched), entry)]
        self.in_flight.append(entry)
        self._by_upstream[upstream_id] = entry
        return [ToUpstream(_size_prefixed(patched), entry)]

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
        if entry.request is None:
            patched = bytearray(frame)
            _I32.pack_into(patched, 0, entry.client_correlation_id)
            entry.reply = _size_prefixed(patched)
            return self._flush()
        version = entry.api_version
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
        original: tuple[memoryview, bytes] | None = None
        check = self.reencode
        if check is not None and check.due():
            encoded = encode_response_frame(resp)
            if not check.matches("response", entry.api_key, version, frame, encoded, 4):
                original = frame, joined(encoded)
        names = self.topic_names
        if names is not None and self._learns_names(entry.api_key, version):
            # The broker's own names, before any filter changes them (a tenant prefix comes off).
            names.learn(resp.body.topics)
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
                self._remember(entry, version, seen)
        elif original is not None and joined(encode_response_frame(resp)) == original[1]:
            # No filter changed it: the client gets the broker's bytes, not kproxy's re-encoding.
            patched = bytearray(original[0])
            _I32.pack_into(patched, 0, entry.client_correlation_id)
            entry.reply = _size_prefixed(patched)
            resp.correlation_id = entry.client_correlation_id
        else:
            resp.correlation_id = entry.client_correlation_id
            entry.reply = encode_response_frame(resp)
            if seen is not None and throttle <= 0:
                self._remember(entry, version, seen)
        entry.handling_s += ctx.clock() - answered
        actions += self._flush()
        return actions

    # -- remembered answers (kproxy.proxy.memo)

    def _learns_names(self, api_key: int, version: int) -> bool:
        names = self.topic_names
        return names is not None and names.learning and (
            (api_key == METADATA and version >= METADATA_TOPIC_IDS_SINCE) or api_key == DESCRIBE_TOPIC_PARTITIONS)

    def _filter_keys(self, api_key: int) -> tuple | None:
        """Every response filter's memo key for ``api_key``; None when one is not pure (or none runs:
        then nothing is rewritten, and answers with nothing to rewrite rarely repeat)."""
        filters = self.chain.for_response(api_key)
        if not filters:
            return None
        keys = []
        for f in filters:
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
                or self._learns_names(api_key, version)):
            # SASL answers move the session's state; learned topic names must be read from each answer.
            return None, None
        keys = self._filter_keys(api_key)
        if keys is None:
            return None, None
        seen = bytes(frame[4:])
        return seen, memo.get((api_key, version, self.ctx.listener, keys, seen))

    def _send_remembered(self, entry: InFlight, version: int, got: Remembered, answered: float) -> list[Action]:
        cid = entry.client_correlation_id
        tail = got.tail
        head = _HEAD_ID.pack(len(tail) + 4, cid)
        entry.reply = [head + tail] if len(tail) < _JOIN_BELOW else [head, tail]
        header_codec, _ = response_codecs(entry.api_key, version)
        entry.response = Response(entry.api_key, version, header_codec.cls(cid), got.body, got.trailing)
        entry.throttle_ms = got.throttle_ms
        entry.handling_s += self.ctx.clock() - answered
        return self._flush()

    def _remember(self, entry: InFlight, version: int, seen: bytes) -> None:
        """Remember what the client got for ``seen``, keyed by the filters' state after they ran
        (what they learned from this answer is part of the state the next one meets)."""
        memo = self.memo
        assert memo is not None and entry.reply is not None
        keys = self._filter_keys(entry.api_key)
        if keys is None:
            return
        data = joined(entry.reply)
        try:
            # Decoded from bytes the memo owns: lazy arrays must never view a receive buffer.
            stored = decode_response(memoryview(data)[4:], entry.api_key, version, keep_trailing=True)
        except DecodeError:  # pragma: no cover - kproxy's own encoding decodes
            return
        memo.put((entry.api_key, version, self.ctx.listener, keys, seen),
                 Remembered(data[8:], stored.body, stored.trailing, entry.throttle_ms), len(seen) + 2 * len(data))

    # -- cut-through: a broker answer streamed to the client while it arrives

    def stream_start(self, size: int, head: memoryview, transport_streams: bool) -> bool:
        """A broker answer of ``size`` bytes is arriving; ``head`` is what has arrived of it (at least
        its 4-byte correlation id). True when the session takes it piece by piece (``stream_piece``)
        rather than whole (``upstream_frame``): a large Fetch answer that is the next one owed to
        the client, on transports that can stream, that no filter must see whole."""
        if (self.stream_min_bytes is None or size < self.stream_min_bytes or len(head) < 4
                or self._raw_sasl or self.streaming is not None):
            return False
        (upstream_id,) = _I32.unpack_from(head, 0)
        entry = self._by_upstream.get(upstream_id)
        if (entry is None or entry.request is None
                or (self.asking is not None and upstream_id == self.asking.upstream_correlation_id)):
            return False
        if not self.in_flight or self.in_flight[0] is not entry:
            self._stored_because(entry, "order", size)
            return False
        entry.upstream_bytes = size
        ctx = self.ctx
        consenting: list[Filter] = []

        def consents(f: Filter) -> bool:
            try:
                ok = f.may_stream_response(ctx, entry)
            except Exception:
                # Asked again as on_response, which closes the connection if it fails too.
                self._filter_failed(f, "may_stream_response", entry.api_key)
                return False
            if ok:
                consenting.append(f)
            return bool(ok)

        reason = why_stored(self.chain, entry.api_key, "response", size, transport_streams=transport_streams,
                            min_bytes=self.stream_min_bytes, consents=consents)
        if reason is not None:
            self._stored_because(entry, reason, size)
            return False
        del self._by_upstream[upstream_id]
        version = entry.api_version
        rewriters = [f for f in self.chain.for_response(entry.api_key) if hasattr(f, "rewrite_node_endpoints")]

        def endpoints(found: list) -> bool:
            return any([r.rewrite_node_endpoints(entry, found) for r in rewriters])

        def decide(head: StreamHead) -> dict:
            patches: dict[str, Any] = {"correlation_id": entry.client_correlation_id}
            throttle = 0.0
            for f in consenting:
                try:
                    t = f.on_response_head(ctx, entry, head)
                except Exception as e:
                    raise self._filter_failed(f, "on_response_head", entry.api_key) from e
                if t > throttle:
                    throttle = t
            if throttle > 0:
                # As for a stored answer (``raise_throttle``): told in the answer, whose head has not
                # gone out yet, keeping the broker's own value when larger; the client is then muted.
                self._mute(throttle)
                ms = math.ceil(throttle * 1000)
                patches["throttle_time_ms"] = lambda broker: max(broker, ms)
            return patches

        stream = FrameStream(entry.api_key, version, "response", size, decide=decide,
                             rewrite_tail=node_endpoints_rewrite(version, endpoints) if rewriters else None)
        entry.path = STREAMED
        entry.response_why_stored = None
        self.streaming = (entry, stream)
        return True

    def _stored_because(self, entry: InFlight, reason: str, size: int) -> None:
        """A large answer is stored whole: say why on its entry (for the metrics), and in the log once
        per answer (the reader asks again as more of it arrives)."""
        if entry.response_why_stored == reason:
            return
        entry.response_why_stored = reason
        if log.isEnabledFor(logging.DEBUG):
            log.debug("connection %d: %s answer of %d bytes stored whole, not streamed: %s",
                      self.ctx.connection_id, api_name(entry.api_key), size + 4, reason)

    def stream_piece(self, piece: memoryview) -> list[Action]:
        """The next bytes of the answer being streamed; its buffers to write (views of ``piece``
        among them: written before the receive buffer is reused). The last piece completes it."""
        assert self.streaming is not None
        entry, stream = self.streaming
        try:
            buffers = stream.feed(piece)
        except FilterFailed as e:
            # Raised deciding on the head, before any of the answer was sent: closed as when a filter
            # fails on a stored answer (the entry ends with the connection).
            self.streaming = None
            return [Close(str(e))]
        except StreamError as e:
            # Part of the answer is already with the client: the connection cannot go on.
            self.streaming = None
            entry.outcome = UPSTREAM_LOST
            return [Close(f"malformed {api_name(entry.api_key)} v{entry.api_version} response from the broker "
                          f"while streaming it: {e}", (entry,), undecodable="response")]
        return self._streamed(entry, stream, buffers)

    def stream_splice_room(self) -> int:
        """Bytes of the answer being streamed that may now go to the client without kproxy seeing them
        (the body of a record batch whose header was counted): spliced, then ``stream_skip``."""
        return self.streaming[1].splice_room() if self.streaming is not None else 0

    def stream_take_unseen(self, head: Any) -> int:
        """``head``: the next bytes of the answer being streamed, peeked at, not taken. When they start
        a record batch, it is counted and the bytes that may be spliced are returned (0: feed them)."""
        return self.streaming[1].take_unseen(head) if self.streaming is not None else 0

    def stream_recv_hint(self) -> int | None:
        """How many bytes to receive next so that only a batch header comes in (its body may then be
        spliced); None when any amount will do."""
        return self.streaming[1].recv_hint() if self.streaming is not None else None

    def stream_skip(self, n: int) -> list[Action]:
        """``n`` bytes that ``stream_splice_room`` allowed went to the client (spliced); what to do
        now (the end of the answer, when they were its last bytes)."""
        assert self.streaming is not None
        entry, stream = self.streaming
        buffers = stream.skip(n)
        entry.spliced_bytes += n
        return self._streamed(entry, stream, buffers)

    def _streamed(self, entry: InFlight, stream: FrameStream, buffers: list) -> list[Action]:
        actions: list[Action] = []
        if entry.ports:
            # The rewritten node endpoints (in the tail, the last buffers) name ports to open first.
            actions.append(Listen(tuple(entry.ports)))
            entry.ports = None
        if not stream.done:
            if buffers:
                actions.append(ToClient(buffers))
            return actions
        self.streaming = None
        now = self.ctx.clock()
        entry.answered_at = now
        entry.records_facts = stream.facts
        skeleton = stream.skeleton
        try:
            resp = decode_response(memoryview(skeleton), entry.api_key, entry.api_version, keep_trailing=True)
        except DecodeError as e:
            actions.append(Close(f"malformed {api_name(entry.api_key)} v{entry.api_version} response from "
                                 f"the broker while streaming it: {e}", (entry,), undecodable="response"))
            return actions
        check = self.reencode
        if check is not None and check.due():
            # The transparency check over what was sent: the head and tail re-encode to the same bytes
            # (the records went through untouched).
            check.matches("response", entry.api_key, entry.api_version, skeleton, encode_response_frame(resp), 4)
        entry.response = resp
        entry.throttle_ms = getattr(resp.body, "throttle_time_ms", 0) or 0
        entry.reply = []
        entry.response_bytes = stream.sent
        self.in_flight.popleft()
        actions.append(ToClient(buffers, (entry,)))
        return actions + self._flush()

    # -- cut-through: a client's request streamed to the broker while it arrives

    def request_stream_start(self, size: int, head: memoryview, transport_streams: bool) -> bool:
        """A request of ``size`` bytes is arriving; ``head`` is what has arrived of it (at least its
        8-byte header start). True when the session takes it piece by piece (``request_piece``): a
        large Produce request of a version kproxy knows, on transports that can stream, while
        nothing holds the client back. Whether it then streams is decided at its first records
        (``may_stream_request``); until then nothing leaves, and a frame the filters want whole is
        handed on whole as ``client_frame`` would have been."""
        if self.stream_min_bytes is None or size < self.stream_min_bytes or len(head) < 8:
            return False
        api_key, api_version = _HHI(head, 0)[:2]
        if api_key != PRODUCE:
            return False
        lo, hi = _produce_versions()
        if not lo <= api_version <= hi:
            return False
        why = self._why_request_stored(transport_streams)
        if why is not None:
            self._why_next = why
            return False
        self._why_next = None
        stream = FrameStream(PRODUCE, api_version, "request", size, decide=self._decide_up)
        self.streaming_up = _UpStream(stream, self.ctx.clock())
        return True

    def _why_request_stored(self, transport_streams: bool) -> str | None:
        """Why a large Produce request is stored before its head is even read (None: it may stream)."""
        if not transport_streams:
            return "transport"
        now = self.ctx.clock()
        if self._throttle_until > now:
            return "throttled"          # it waits out the throttle whole (client_frame's Hold)
        front = self.front
        if self._raw_sasl or (front is not None and (front.raw_expected or (
                front.termination is not None
                and not (front.termination.authenticated and not front.termination.expired(now))))):
            return "sasl"               # kproxy's SASL front answers it (or closes)
        if self.asking is not None or self.streaming_up is not None:
            return "busy"
        return None

    def _decide_up(self, head: StreamHead) -> dict | None:
        """The head of the request streaming in is known: the filters that must see Produce requests
        whole say whether this one may stream anyway. Patches for the walker, or None to store it."""
        up = self.streaming_up
        assert up is not None
        ctx = self.ctx
        values = head.values
        if values.get("client_id") is not None:
            ctx.client_id = values["client_id"]      # as _observe_request does, for the filters' selectors
        entry = InFlight(values["correlation_id"], PRODUCE, head.api_version, up.started,
                         request_bytes=head.size + 4)
        for f in self.chain.whole_frame_filters(PRODUCE, "request"):
            try:
                ok = f.may_stream_request(ctx, entry, head)
            except Exception:
                log.error("connection %d: filter %r failed in may_stream_request", ctx.connection_id, f.name,
                          exc_info=True)
                ok = False
            if not ok:
                self._why_next = f"filter {f.name}"
                log.debug("connection %d: Produce request of %d bytes stored whole (filter %s must see it)",
                          ctx.connection_id, head.size, f.name)
                return None
        self.requests += 1
        entry.seq = self.requests
        entry.request_path = STREAMED
        self.open.add(entry)
        upstream_id = self._forwarding(entry, values.get("acks") == 0)
        up.entry = entry
        return {"correlation_id": upstream_id}

    def request_piece(self, piece: memoryview) -> list[Action]:
        """The next bytes of the request being streamed in; what to do with them (``StreamUp`` with
        views of ``piece`` among its buffers: written before the receive chunk is refilled). The last
        piece completes the request: its filters run on it (records left out) before its last bytes
        are handed out, so its answer can never overtake them."""
        up = self.streaming_up
        assert up is not None
        stream = up.stream
        try:
            buffers = stream.feed(piece)
        except StreamError as e:
            self.streaming_up = None
            done: tuple[InFlight, ...] = ()
            if up.entry is not None:
                up.entry.outcome = CLOSED
                done = (up.entry,)
            return [Close(f"malformed Produce v{stream.api_version} request: {e}", done, undecodable="request")]
        if stream.stored:
            if not stream.done:
                return []
            # A filter must see it whole: it goes on as if it had been read whole.
            self.streaming_up = None
            return self.client_frame(memoryview(buffers[1]))
        entry = up.entry
        if entry is None:
            return []       # the head is still arriving
        actions: list[Action] = []
        last = stream.done
        finished: list[Action] = self._request_streamed(up) if last else []
        if up.lost is None and (buffers or last):
            actions.append(StreamUp(buffers, entry, not up.sent_any, last))
            up.sent_any = True
        return actions + finished

    def _request_streamed(self, up: _UpStream) -> list[Action]:
        """Every byte of a streamed request has arrived: decode what was sent with its records left
        out, and let the filters see it, as they would a stored one."""
        self.streaming_up = None
        entry = up.entry
        assert entry is not None
        stream = up.stream
        since = self.ctx.clock()
        entry.records_facts = stream.facts
        skeleton = stream.skeleton
        try:
            req = decode_request(memoryview(skeleton), keep_trailing=True)
        except DecodeError as e:
            # The walker followed the schema, so this is kproxy's fault or a frame it cannot judge:
            # the broker must not be left with it either.
            entry.outcome = CLOSED
            return [Close(f"malformed Produce v{stream.api_version} request: {e}", (entry,),
                          undecodable="request")]
        entry.request = req
        check = self.reencode
        if check is not None and check.due():
            # Head and tail re-encode to what was sent (the records went through untouched).
            check.matches("request", PRODUCE, req.api_version, skeleton, encode_request_frame(req), 4)
        self._observe_request(req)
        if up.lost is not None:
            return self._lost_streamed_request(entry, req, up.lost)
        actions: list[Action] = []
        try:
            verdict = self._request_filters(entry, req, actions)
        except FilterFailed as e:
            return [Close(str(e), (entry,))]
        if verdict is not None:
            # It has gone to the broker already; the filter said it would not do this.
            log.error("connection %d: filter answered a streamed Produce request after letting it stream "
                      "(%r); the broker's answer goes to the client", self.ctx.connection_id, verdict)
        entry.handling_s += self.ctx.clock() - since
        return actions

    def _lost_streamed_request(self, entry: InFlight, req: Request, reason: str) -> list[Action]:
        """The broker connection was lost while the request streamed to it: the broker never had it
        whole, so the client gets the retriable error a lost connection gets, now that kproxy knows
        every topic and partition the answer must name."""
        entry.outcome = UPSTREAM_LOST
        code = lost_connection_error(PRODUCE)
        resp = error_response(req, code, f"kproxy: broker connection lost ({reason})") if code is not None else None
        if resp is None or (self.ctx.authenticated and self.front is None):
            entry.reply = []
            entry.close_after = f"broker connection lost while a Produce request streamed to it ({reason})"
            return self._flush()
        try:
            self._response_filters(entry, resp)
        except FilterFailed as e:
            entry.reply = []
            entry.close_after = str(e)
            return self._flush()
        resp.correlation_id = entry.client_correlation_id
        entry.response = resp
        entry.reply = encode_response_frame(resp)
        return self._flush()

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

    def _observe_response(self, entry: InFlight, resp: Response) -> None:
        if entry.api_key == SASL_HANDSHAKE:
            if resp.body.error_code != 0:
                self._sasl_refused()
                return
            self._sasl_handshake_ok = True
            if entry.api_version == 0:
                self._raw_sasl = True
        elif entry.api_key == SASL_AUTHENTICATE:
            if resp.body.error_code != 0 or not self._sasl_handshake_ok:
                self._sasl_refused()
                return
            self._sasl_round_trips += 1
            needed = _SASL_ROUND_TRIPS.get(self.ctx.sasl_mechanism or "")
            if needed is not None and self._sasl_round_trips >= needed:
                self._sasl_accepted()
        elif self.sasl_in_progress and self._sasl_handshake_ok:
            # A broker answers other requests only after authentication succeeded (mechanisms
            # whose round trips kproxy does not count, such as OAUTHBEARER or GSSAPI).
            self._sasl_accepted()

    def _flush(self) -> list[Action]:
        out: list[Action] = []
        q = self.in_flight
        while q and q[0].reply is not None:
            entry = q.popleft()
            reply = entry.reply
            assert reply is not None
            if entry.close_after is not None:
                if reply:
                    entry.response_bytes = _frame_size(reply)
                    out.append(ToClient(reply))
                out.append(Close(entry.close_after, (entry,)))
                break
            entry.response_bytes = _frame_size(reply)
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
            req = entry.request
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

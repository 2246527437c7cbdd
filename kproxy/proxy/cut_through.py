"""The session's side of cut-through, sans-I/O: which frames go on while they arrive instead of being
stored whole (a large Fetch answer to the client, a large Produce request to the broker), and the
actions for their pieces. The walk over a frame's bytes is ``kproxy.proxy.streaming.FrameStream``;
reading and writing the pieces is the server's (``ClientConnection._stream_pieces``,
``_stream_request``).
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import struct
from typing import TYPE_CHECKING, Any

import attrs

from kproxy.protocol.errors import DecodeError
from kproxy.protocol.messages import (
    Request,
    Response,
    api_name,
    decode_request,
    decode_response,
    encode_request_frame,
    encode_response_frame,
    supported_versions,
)
from kproxy.proxy.actions import Action, Close, Listen, StreamUp, ToClient
from kproxy.proxy.filters import ConnectionContext, Filter, FilterChain, FilterFailed
from kproxy.proxy.inflight import CLOSED, STREAMED, UPSTREAM_LOST, InFlight
from kproxy.proxy.reencode import ReencodeCheck
from kproxy.proxy.replies import error_response, lost_connection_error
from kproxy.proxy.sasl import SaslFront
from kproxy.proxy.streaming import FrameStream, StreamError, StreamHead, node_endpoints_rewrite, why_stored

if TYPE_CHECKING:                   # session.py builds on this module
    from kproxy.proxy.session import _Question

log = logging.getLogger("kproxy.session")

_I32 = struct.Struct(">i")
_HHI = struct.Struct(">hhi").unpack_from
PRODUCE = 0


@attrs.define(slots=True, eq=False)
class _UpStream:
    """A request being streamed to the broker while it arrives (``Session.request_stream_start``)."""

    stream: FrameStream
    started: float
    entry: InFlight | None = None    # once the filters have let it stream
    sent_any: bool = False           # its first StreamUp has been handed out
    lost: str | None = None          # the broker connection was lost part-way: the rest is dropped


@functools.cache
def _produce_versions() -> tuple[int, int]:
    # supported_versions() builds its table anew on every call: asked once per large Produce.
    return supported_versions()[PRODUCE]


class SessionCutThrough:
    """The session's cut-through part (a base of ``Session``, whose ``__init__`` sets the state
    below): ``stream_start``/``stream_piece`` for answers, ``request_stream_start``/``request_piece``
    for requests."""

    ctx: ConnectionContext
    chain: FilterChain
    front: SaslFront | None
    reencode: ReencodeCheck | None
    stream_min_bytes: int | None
    # The answer being streamed to the client: its entry and the walker (stream_start).
    streaming: tuple[InFlight, FrameStream] | None
    # The request being streamed to the broker (request_stream_start).
    streaming_up: _UpStream | None
    _why_next: str | None            # why the next large Produce request is stored
    open: set[InFlight]
    in_flight: collections.deque[InFlight]
    _by_upstream: dict[int, InFlight]
    asking: _Question | None
    requests: int
    throttle_until: float
    _raw_sasl: bool

    if TYPE_CHECKING:               # the session's own parts this one calls
        def client_frame(self, frame: memoryview) -> list[Action]: ...

        def _filter_failed(self, f: Filter, hook: str, api_key: int) -> FilterFailed: ...

        def _mute(self, seconds: float) -> None: ...

        def _sample(self, api_key: int) -> int | None: ...

        def _flush(self) -> list[Action]: ...

        def _forwarding(self, entry: InFlight, no_response: bool) -> int: ...

        def _request_filters(self, entry: InFlight, req: Request, actions: list[Action], start: int = 0,
                             resumed: Any = None) -> Any: ...

        def _response_filters(self, entry: InFlight, resp: Response) -> float: ...

        def _observe_request(self, req: Request) -> None: ...

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
        if (entry is None or entry.decoded_request() is None
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
        if self.throttle_until > now:
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
                         request_bytes=head.size + 4, sampled=self._sample(PRODUCE))
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

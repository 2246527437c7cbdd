"""One client connection, sans-I/O: frames in, actions out.

The session decodes each request, runs the filters, gives it a correlation id of kproxy's own on the
upstream connection, and remembers it until the answer comes back; answers go to the client in the
order the client asked, whether they came from the broker or from a filter. It also follows SASL so
the authenticated principal is known, without ever keeping or showing a token. No sockets, no clock:
time comes from the context's injected clock.
"""

from __future__ import annotations

import collections
import logging
import struct
from typing import Any

import attrs

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
    supported_versions,
)
from kproxy.protocol.primitives import read_uvarint
from kproxy.proxy.filters import ConnectionContext, Delay, FilterChain, Respond
from kproxy.proxy.replies import error_response

log = logging.getLogger("kproxy.session")

_I32 = struct.Struct(">i")

PRODUCE, METADATA, SASL_HANDSHAKE, API_VERSIONS, SASL_AUTHENTICATE = 0, 3, 17, 18, 36
UNSUPPORTED_VERSION = 35

# What a client is told about a request whose broker connection was lost: an error that makes every
# client refresh its view and retry. Partition-level APIs point at leadership, group and transaction
# APIs at the coordinator; Metadata and the handshake APIs have no such error, so the client
# connection is closed instead, which clients also treat as retriable.
_LEADER_APIS = frozenset({0, 1, 2, 23, 78, 79})
_COORDINATOR_APIS = frozenset({8, 9, 10, 11, 12, 13, 14, 15, 16, 22, 24, 25, 26, 28, 42, 47, 68, 69,
                               76, 77, 88, 89, 90, 91})
_CLOSE_ON_LOSS = frozenset({3, 17, 18, 36})
NOT_LEADER_OR_FOLLOWER, REQUEST_TIMED_OUT, COORDINATOR_NOT_AVAILABLE = 6, 7, 15


class Action:
    """Something the I/O layer must do, in order."""

    __slots__ = ()


class ToUpstream(Action):
    __slots__ = ("buffers",)

    def __init__(self, buffers: list) -> None:
        self.buffers = buffers

    def __repr__(self) -> str:
        return f"ToUpstream({sum(len(b) for b in self.buffers)} bytes)"


class ToClient(Action):
    __slots__ = ("buffers",)

    def __init__(self, buffers: list) -> None:
        self.buffers = buffers

    def __repr__(self) -> str:
        return f"ToClient({sum(len(b) for b in self.buffers)} bytes)"


class Hold(Action):
    """Wait this long before doing the actions that follow (throttling, filter delays)."""

    __slots__ = ("seconds",)

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __repr__(self) -> str:
        return f"Hold({self.seconds:.3f}s)"


class Close(Action):
    """Close the client connection, logging ``reason``."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"Close({self.reason!r})"


@attrs.define(slots=True, eq=False)
class InFlight:
    """A request the client is waiting on."""

    client_correlation_id: int
    api_key: int
    api_version: int
    started: float
    request: Request | None = None         # None for frames forwarded opaquely
    upstream_correlation_id: int | None = None
    reply: list | None = None              # the encoded response, once known
    close_after: str | None = None         # close the connection once this reply is sent
    request_bytes: int = 0
    response_bytes: int = 0


def sasl_user(mechanism: str | None, token: bytes | memoryview) -> str | None:
    """The user name in a client's first SASL token, for PLAIN and SCRAM; None otherwise.

    Only the name is taken; the token (with its password or proof) is dropped right here.
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
    except (struct.error, IndexError, ValueError):
        return None


def _size_prefixed(frame: Any) -> list:
    return [_I32.pack(len(frame)), frame]


class Session:
    """The per-connection state machine between one client and its upstream connection."""

    def __init__(self, ctx: ConnectionContext, chain: FilterChain, *,
                 passthrough_unknown_versions: bool = False) -> None:
        self.ctx = ctx
        self.chain = chain
        self.passthrough = passthrough_unknown_versions
        self.in_flight: collections.deque[InFlight] = collections.deque()
        self._by_upstream: dict[int, InFlight] = {}
        self._next_correlation_id = 0
        # Correlation ids of recent acks=0 Produce requests (bounded: only a misbehaving broker
        # answers them, and it answers promptly).
        self._no_response: collections.deque[int] = collections.deque(maxlen=1024)
        self._throttle_until = 0.0
        self._raw_sasl = False               # after SaslHandshake v0: unframed SASL tokens follow
        self._sasl_pending_user: str | None = None
        self._sasl_exchanges = 0
        self.sasl_in_progress = False
        self.requests = 0
        self.closed = False

    # -- client side

    @property
    def awaiting_upstream(self) -> int:
        return len(self._by_upstream)

    def client_frame(self, frame: memoryview) -> list[Action]:
        """A complete request frame (without its size prefix) from the client."""
        now = self.ctx.clock()
        actions: list[Action] = []
        if self._throttle_until > now:
            # Kafka mutes a throttled client's channel; kproxy holds its next request instead.
            actions.append(Hold(self._throttle_until - now))
            self._throttle_until = 0.0
        if len(frame) < 8:
            if self._raw_sasl:
                return actions + self._raw_sasl_token(frame)
            return [Close(f"request of {len(frame)} bytes is shorter than a request header")]
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
            return [Close(f"malformed {api_name(api_key)} v{api_version} request: {e}")]
        if self._raw_sasl:
            # A frame that decodes as a whole request ends the raw token exchange (SASL v0).
            self._raw_sasl = False
            self._sasl_done()
        self.requests += 1
        if self.sasl_in_progress and api_key not in (SASL_HANDSHAKE, SASL_AUTHENTICATE):
            # The broker only answers other requests once authentication has succeeded.
            self._sasl_done()
        self._observe_request(req)
        entry = InFlight(correlation_id, api_key, api_version, now, req, request_bytes=len(frame) + 4)
        for f in self.chain.for_request(api_key):
            verdict = f.on_request(self.ctx, req)
            if verdict is None:
                continue
            if isinstance(verdict, Delay):
                if verdict.seconds > 0:
                    actions.append(Hold(verdict.seconds))
                if verdict.then is None:
                    continue
                verdict = verdict.then
            return actions + self._answer_locally(entry, verdict)
        if api_key == PRODUCE and req.body.acks == 0:
            # acks=0: the broker sends no response, so nothing waits for one. Some brokers (tansu
            # 0.6) answer anyway; the id is remembered so such an answer is dropped, not forwarded.
            req.correlation_id = self._take_correlation_id()
            self._no_response.append(req.correlation_id)
            actions.append(ToUpstream(encode_request_frame(req)))
            return actions
        upstream_id = self._take_correlation_id()
        entry.upstream_correlation_id = upstream_id
        req.correlation_id = upstream_id
        self.in_flight.append(entry)
        self._by_upstream[upstream_id] = entry
        actions.append(ToUpstream(encode_request_frame(req)))
        return actions

    def _take_correlation_id(self) -> int:
        cid = self._next_correlation_id
        self._next_correlation_id = (cid + 1) & 0x7FFFFFFF
        return cid

    def _observe_request(self, req: Request) -> None:
        ctx = self.ctx
        if req.client_id is not None:
            ctx.client_id = req.client_id
        key = req.api_key
        if key == API_VERSIONS and req.api_version >= 3:
            ctx.client_software_name = req.body.client_software_name
            ctx.client_software_version = req.body.client_software_version
        elif key == SASL_HANDSHAKE:
            ctx.sasl_mechanism = req.body.mechanism
            self.sasl_in_progress = True
            self._sasl_exchanges = 0
            self._sasl_pending_user = None
        elif key == SASL_AUTHENTICATE:
            self.sasl_in_progress = True
            if self._sasl_exchanges == 0:
                self._sasl_pending_user = sasl_user(ctx.sasl_mechanism, req.body.auth_bytes)

    def _raw_sasl_token(self, frame: memoryview) -> list[Action]:
        # The first raw token (handshake v0) names the user just as SaslAuthenticate's would.
        if self._sasl_exchanges == 0:
            self._sasl_pending_user = sasl_user(self.ctx.sasl_mechanism, frame)
        self._sasl_exchanges += 1
        return [ToUpstream(_size_prefixed(frame))]

    def _sasl_done(self) -> None:
        if not self.sasl_in_progress:
            return
        self.sasl_in_progress = False
        self.ctx.authenticated = True
        if self._sasl_pending_user is not None:
            self.ctx.sasl_user = self._sasl_pending_user
        log.info("connection %d authenticated as %s (%s)", self.ctx.connection_id,
                 self.ctx.principal, self.ctx.sasl_mechanism)

    def _unsupported(self, frame: memoryview, api_key: int, api_version: int, correlation_id: int,
                     err: Exception, now: float) -> list[Action]:
        if api_key == API_VERSIONS:
            # A client newer than kproxy: answer as a broker does, in v0 with UNSUPPORTED_VERSION
            # and kproxy's own ApiVersions range, so the client retries with a version we decode.
            lo, hi = supported_versions()[API_VERSIONS]
            cls: Any = body_class(API_VERSIONS, "response")
            body = cls(error_code=UNSUPPORTED_VERSION,
                       api_keys=[cls.ApiVersion(api_key=API_VERSIONS, min_version=lo, max_version=hi)])
            entry = InFlight(correlation_id, api_key, 0, now, None)
            entry.reply = encode_response_frame(Response.build(API_VERSIONS, 0, correlation_id, body))
            self.in_flight.append(entry)
            return self._flush()
        if not self.passthrough:
            return [Close(f"cannot decode {err}; set passthrough_unknown_versions to forward such "
                          "frames opaquely")]
        # Opaque passthrough: only the correlation id (bytes 4..8 of the header) is touched.
        upstream_id = self._take_correlation_id()
        patched = bytearray(frame)
        _I32.pack_into(patched, 4, upstream_id)
        if api_key == PRODUCE and future_produce_acks(frame) == 0:
            self._no_response.append(upstream_id)
            return [ToUpstream(_size_prefixed(patched))]
        entry = InFlight(correlation_id, api_key, api_version, now, None, upstream_id,
                         request_bytes=len(frame) + 4)
        self.in_flight.append(entry)
        self._by_upstream[upstream_id] = entry
        return [ToUpstream(_size_prefixed(patched))]

    def _answer_locally(self, entry: InFlight, verdict: Respond) -> list[Action]:
        req = entry.request
        assert req is not None
        if req.api_key == PRODUCE and req.body.acks == 0:
            return []  # the client expects no answer
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
        entry.reply = encode_response_frame(resp)
        self.in_flight.append(entry)
        return self._flush()

    # -- upstream side

    def upstream_frame(self, frame: memoryview) -> list[Action]:
        """A complete response frame (without its size prefix) from the broker."""
        if self._raw_sasl and not self._by_upstream:
            # Unframed SASL tokens (handshake v0) have no Kafka header: relay them untouched.
            return [ToClient(_size_prefixed(frame))]
        if len(frame) < 4:
            return [Close(f"broker sent a {len(frame)}-byte response, shorter than its header")]
        (upstream_id,) = _I32.unpack_from(frame, 0)
        entry = self._by_upstream.pop(upstream_id, None)
        if entry is None:
            if upstream_id in self._no_response:
                self._no_response.remove(upstream_id)
                log.debug("connection %d: dropped the broker's answer to an acks=0 Produce",
                          self.ctx.connection_id)
                return []
            return [Close(f"broker answered correlation id {upstream_id}, which kproxy never sent")]
        entry.response_bytes = len(frame) + 4
        if entry.request is None:
            patched = bytearray(frame)
            _I32.pack_into(patched, 0, entry.client_correlation_id)
            entry.reply = _size_prefixed(patched)
            return self._flush()
        version = entry.api_version
        if entry.api_key == API_VERSIONS and len(frame) >= 6 and frame[4:6] == b"\x00\x23":
            # A broker that does not know the requested ApiVersions version answers in v0 (KIP-511).
            version = 0
        try:
            resp = decode_response(frame, entry.api_key, version, keep_trailing=True)
        except DecodeError as e:
            return [Close(f"malformed {api_name(entry.api_key)} v{version} response from the broker: {e}")]
        throttle = 0.0
        req = entry.request
        for f in self.chain.for_response(entry.api_key):
            t = f.on_response(self.ctx, req, resp)
            if t > throttle:
                throttle = t
        if throttle > 0:
            self._throttle_until = max(self._throttle_until, self.ctx.clock() + throttle)
        self._observe_response(entry, resp)
        resp.correlation_id = entry.client_correlation_id
        entry.reply = encode_response_frame(resp)
        return self._flush()

    def _observe_response(self, entry: InFlight, resp: Response) -> None:
        if entry.api_key == SASL_HANDSHAKE:
            if resp.body.error_code == 0 and entry.api_version == 0:
                self._raw_sasl = True
            elif resp.body.error_code != 0:
                self.sasl_in_progress = False
        elif entry.api_key == SASL_AUTHENTICATE:
            if resp.body.error_code != 0:
                self.sasl_in_progress = False
                self._sasl_pending_user = None
                return
            self._sasl_exchanges += 1
            mech = self.ctx.sasl_mechanism or ""
            if (mech == "PLAIN" and self._sasl_exchanges >= 1) or (
                    mech.startswith("SCRAM-") and self._sasl_exchanges >= 2):
                self._sasl_done()

    def _flush(self) -> list[Action]:
        out: list[Action] = []
        q = self.in_flight
        while q and q[0].reply is not None:
            entry = q.popleft()
            if entry.reply:
                out.append(ToClient(entry.reply))
            self.completed(entry)
            if entry.close_after is not None:
                out.append(Close(entry.close_after))
                break
        return out

    def completed(self, entry: InFlight) -> None:
        """Hook for the I/O layer (metrics); called once per answered request."""

    # -- faults

    def upstream_lost(self, reason: str) -> list[Action]:
        """The broker connection ended: answer what was waiting on it, in order, with retriable errors."""
        waiting = list(self._by_upstream.values())
        self._by_upstream.clear()
        self._raw_sasl = False
        # After SASL a new broker connection would be unauthenticated, and only the client can
        # authenticate again: end the client connection, as the broker's own loss would.
        authenticated = self.ctx.authenticated
        if authenticated and not self.in_flight:
            return [Close(f"broker connection lost after SASL authentication ({reason})")]
        for entry in waiting:
            req = entry.request
            if authenticated or req is None or req.api_key in _CLOSE_ON_LOSS:
                entry.reply = []
                entry.close_after = f"broker connection lost ({reason})"
                continue
            if req.api_key in _LEADER_APIS:
                code = NOT_LEADER_OR_FOLLOWER
            elif req.api_key in _COORDINATOR_APIS:
                code = COORDINATOR_NOT_AVAILABLE
            else:
                code = REQUEST_TIMED_OUT
            resp = error_response(req, code, f"kproxy: broker connection lost ({reason})")
            if resp is None:
                entry.reply = []
                entry.close_after = f"broker connection lost ({reason})"
                continue
            resp.correlation_id = entry.client_correlation_id
            entry.reply = encode_response_frame(resp)
        return self._flush()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for f in self.chain.filters:
            f.on_close(self.ctx)


"""What the session does with SASL, sans-I/O.

When kproxy handles identity itself (``SaslFront``): with termination (``sasl`` in the config) kproxy
answers ApiVersions, SaslHandshake and SaslAuthenticate, and nothing else from the client is
forwarded until it has logged in. With origination only (``upstream.sasl``), a client's own SASL is
refused: kproxy holds the cluster's credentials and never relays a login. Failures are answered
after a fixed delay, then the connection closes, as a Kafka broker does.

When the client's SASL is relayed to the broker (``SessionSasl``, a part of the session), kproxy
follows the exchange so that the principal is the user the broker accepted, never one the client
only claims.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import attrs

from kproxy.identity.termination import (
    ILLEGAL_SASL_STATE,
    SASL_AUTHENTICATION_FAILED,
    UNSUPPORTED_SASL_MECHANISM,
    FailedLogins,
    Outcome,
    SaslState,
    SaslTermination,
)
from kproxy.logs import safe
from kproxy.protocol.messages import (
    Request,
    Response,
    api_name,
    body_class,
    encode_response_frame,
    supported_versions,
)
from kproxy.proxy.actions import Action, Close, Hold, ToClient, ToUpstream, size_prefixed
from kproxy.proxy.filters import ConnectionContext
from kproxy.proxy.inflight import LOCAL, InFlight
from kproxy.proxy.replies import error_response

log = logging.getLogger("kproxy.identity")
session_log = logging.getLogger("kproxy.session")      # the session's own lines keep its logger

SASL_HANDSHAKE, API_VERSIONS, SASL_AUTHENTICATE = 17, 18, 36
UNSUPPORTED_VERSION: Final = 35
# APIs that manage credentials of the brokers' own SASL, which a terminating kproxy does not hold:
# the delegation-token APIs (38-41) and Describe/AlterUserScramCredentials (50, 51).
HIDDEN_APIS: Final = frozenset({38, 39, 40, 41, 50, 51})
ORIGINATING_REFUSAL: Final = ("kproxy holds the cluster's credentials and logs in to the brokers itself; "
                              "connect without SASL")

VersionRanges = list[tuple[int, int, int]]     # (api key, min version, max version)


@attrs.frozen
class FrontAnswer:
    """The session's answer to a request the front handled: a response ``body``, or ``raw`` bytes
    for an unframed v0 token (None: that token gets no answer); then close when ``close`` is set;
    ``hold_s`` before it is sent."""

    body: Any = None
    raw: bytes | None = None
    close: str | None = None
    hold_s: float = 0.0


class SaslFront:
    """One client connection's SASL, when kproxy terminates it or originates its own."""

    def __init__(self, ctx: ConnectionContext, termination: SaslTermination | None, *,
                 broker_versions: Callable[[], VersionRanges | None] = lambda: None,
                 failed_logins: FailedLogins | None = None, failure_delay_s: float = 0.5,
                 on_login: Callable[[str, str], None] | None = None) -> None:
        self.ctx = ctx
        self.termination = termination
        self.broker_versions = broker_versions
        self.failed_logins = failed_logins
        self.failure_delay_s = failure_delay_s
        self.on_login = on_login              # (mechanism, outcome) for metrics
        # SASL requests refused on an authenticated connection (a re-authentication not begun, a
        # SaslAuthenticate after the login): logged at most once a second, with the count held.
        self._refusal_logged_at = float("-inf")
        self._refusals_held = 0

    @property
    def raw_expected(self) -> bool:
        """SaslHandshake v0 was accepted: the next frame is an unframed token, not a request."""
        t = self.termination
        return t is not None and t.raw and t.state is SaslState.REQUIRING_AUTHENTICATE

    def request(self, req: Request, started: float) -> FrontAnswer | None:
        """The answer to ``req``, or None when it goes on to the filters and the broker."""
        key = req.api_key
        t = self.termination
        if t is None:
            if key == SASL_HANDSHAKE:
                log.info("connection %d: refused the client's SASL handshake (%s): %s", self.ctx.connection_id,
                         safe(req.body.mechanism), ORIGINATING_REFUSAL)
                return FrontAnswer(self._body(req, error_code=UNSUPPORTED_SASL_MECHANISM, mechanisms=[]),
                                   close="client tried SASL, but kproxy originates the cluster's SASL itself")
            if key == SASL_AUTHENTICATE:
                return FrontAnswer(self._body(req, error_code=ILLEGAL_SASL_STATE, error_message=ORIGINATING_REFUSAL,
                                              auth_bytes=b""),
                                   close="client tried SASL, but kproxy originates the cluster's SASL itself")
            return None
        if t.authenticated and key != SASL_HANDSHAKE and t.expired(self.ctx.clock()) and not (
                key == SASL_AUTHENTICATE and t.reauthenticating):
            # As a broker does (KIP-368): once the session has ended, any request closes the
            # connection, except a SaslHandshake, which starts re-authentication however late it
            # comes, and the SaslAuthenticate of that exchange.
            return FrontAnswer(close="SASL session expired without re-authentication (KIP-368)")
        if key == API_VERSIONS:
            return FrontAnswer(self._api_versions(req))
        if key == SASL_HANDSHAKE:
            return self._handshake(req, t, started)
        if key == SASL_AUTHENTICATE:
            if t.state is SaslState.AUTHENTICATED:
                o, close, hold = self._after_login(t), None, 0.0
            else:
                o, close, hold = self._authenticate(bytes(req.body.auth_bytes), t, started)
            extra = {"session_lifetime_ms": o.session_lifetime_ms} if req.api_version >= 1 else {}
            return FrontAnswer(self._body(req, error_code=o.error_code, error_message=o.error_message,
                                          auth_bytes=o.auth_bytes, **extra), close=close, hold_s=hold)
        if not t.authenticated:
            return FrontAnswer(close=f"{api_name(key)} before SASL authentication (only ApiVersions, "
                                     "SaslHandshake and SaslAuthenticate are answered until then)")
        if key in HIDDEN_APIS:
            return FrontAnswer(self._error_body(req))
        return None

    def raw_token(self, frame: memoryview | bytes, started: float) -> FrontAnswer:
        """An unframed token after SaslHandshake v0: answered unframed; a failure just closes (Kafka)."""
        t = self.termination
        assert t is not None
        o, close, hold = self._authenticate(bytes(frame), t, started)
        if close is not None:
            return FrontAnswer(close=close, hold_s=hold)
        return FrontAnswer(raw=o.auth_bytes if o.raw_answer else None)

    # -- the exchange

    def _handshake(self, req: Request, t: SaslTermination, started: float) -> FrontAnswer:
        mechanism = req.body.mechanism
        now = t.clock()
        if t.reauth_disabled:
            return self._not_begun(req, t, now, "reauth_disabled", "the session has no end (max_session_s: 0), "
                                   "and a Kafka broker re-authenticates only sessions that end")
        since = t.reauth_too_soon(now)
        if since is not None:
            return self._not_begun(req, t, now, "reauth_too_soon", f"it began {int(since * 1000)} ms after the "
                                   "previous one, and a Kafka broker begins at most one a second")
        code = t.handshake(mechanism, req.api_version)
        body = self._body(req, error_code=code, mechanisms=list(t.settings.mechanisms))
        if code == 0:
            self.ctx.sasl_mechanism = mechanism
            return FrontAnswer(body)
        self._count(str(mechanism), "refused")
        reason = (f"SASL handshake for {safe(mechanism)} refused (error {code}; offered: "
                  f"{', '.join(t.settings.mechanisms)})")
        return FrontAnswer(body, close=reason, hold_s=self._hold(started))

    def _not_begun(self, req: Request, t: SaslTermination, now: float, outcome: str, why: str) -> FrontAnswer:
        """A re-authentication Kafka's broker would not begin (KafkaChannel.maybeBeginServerReauthentication):
        on a session with no end (``connections.max.reauth.ms=0``), or less than a second after the
        previous one began. The broker then handles the SaslHandshake as any request on an
        authenticated connection (KafkaApis), answering ILLEGAL_SASL_STATE with no mechanisms; the
        connection and its session go on, unless the session has ended, when it closes. No credential
        is checked, so a client looping on re-authentication costs no PBKDF2 or token check."""
        self._count(t.mechanism or "?", outcome)
        self._log_refusal(now, t, "connection %d: re-authentication of %s (%s) refused: %s%s", why)
        body = self._body(req, error_code=ILLEGAL_SASL_STATE, mechanisms=[])
        if t.expired(now):
            return FrontAnswer(body, close="SASL session expired without re-authentication (KIP-368)")
        return FrontAnswer(body)

    def _after_login(self, t: SaslTermination) -> Outcome:
        """A SaslAuthenticate after the login completed, with no SaslHandshake before it: Kafka's broker
        answers it as any request on an authenticated connection (KafkaApis), ILLEGAL_SASL_STATE, and
        the connection and its login go on. Nothing is checked."""
        self._count(t.mechanism or "?", "authenticate_after_login")
        self._log_refusal(t.clock(), t, "connection %d: SaslAuthenticate from %s (%s) refused: %s%s",
                          "the login had completed and no SaslHandshake began another")
        return t.authenticate(b"")

    def _log_refusal(self, now: float, t: SaslTermination, line: str, why: str) -> None:
        # A looping client gets one line a second per connection, with the count of those held back.
        if now - self._refusal_logged_at >= 1.0:
            held = f" ({self._refusals_held} more refused since the last line)" if self._refusals_held else ""
            log.info(line, self.ctx.connection_id, safe(self.ctx.principal), safe(t.mechanism), why, held)
            self._refusal_logged_at, self._refusals_held = now, 0
        else:
            self._refusals_held += 1

    def _authenticate(self, message: bytes, t: SaslTermination, started: float) -> tuple[Outcome, str | None, float]:
        ctx = self.ctx
        address = ctx.client_address[0] if ctx.client_address else "?"
        limiter = self.failed_logins
        mechanism = t.mechanism or "?"
        if limiter is not None and not t.reauthenticating and limiter.blocked(address, started):
            t.state = SaslState.FAILED
            self._count(mechanism, "rate_limited")
            o = Outcome(error_code=SASL_AUTHENTICATION_FAILED,
                        error_message="Authentication failed: too many failed logins from this address; "
                                      "try again later")
            log.info("connection %d from %s: SASL login refused: too many failed logins from this address",
                     ctx.connection_id, safe(address))
            return o, "too many failed logins from this address", self._hold(started)
        o = t.authenticate(message)
        if o.failed:
            if limiter is not None:
                limiter.failed(address, started)
            self._count(mechanism, "failed")
            log.info("connection %d from %s: SASL login failed (%s): %s", ctx.connection_id, safe(address),
                     safe(mechanism), safe(o.reason or o.error_message, 300))
            return o, f"SASL authentication failed ({mechanism})", self._hold(started)
        if o.done:
            again = ctx.authenticated
            ctx.authenticated = True
            ctx.sasl_user = t.user
            ctx.sasl_mechanism = mechanism
            self._count(mechanism, "reauthenticated" if again else "ok")
            lifetime = f"; session {o.session_lifetime_ms / 1000:g}s" if o.session_lifetime_ms else ""
            log.info("connection %d %s as %s (%s, verified by kproxy%s)", ctx.connection_id,
                     "re-authenticated" if again else "authenticated", safe(ctx.principal), safe(mechanism),
                     lifetime)
        return o, None, 0.0

    def _hold(self, started: float) -> float:
        # Measured from when the request arrived, so how long checking took never shows.
        return max(0.0, self.failure_delay_s - (self.ctx.clock() - started))

    def _count(self, mechanism: str, outcome: str) -> None:
        if self.on_login is not None:
            self.on_login(mechanism, outcome)

    # -- answers

    @staticmethod
    def _body(req: Request, **fields: Any) -> Any:
        return body_class(req.api_key, "response")(**fields)

    def _api_versions(self, req: Request) -> Any:
        """ApiVersions from what the brokers offer (learned at discovery), narrowed to what kproxy
        decodes, without the APIs of credentials kproxy does not hold."""
        ours = supported_versions()
        ranges = self.broker_versions()
        if ranges is None:
            ranges = [(k, lo, hi) for k, (lo, hi) in ours.items()]
        offered: dict[int, tuple[int, int]] = {}
        for key, lo, hi in ranges:
            mine = ours.get(key)
            if mine is None or key in HIDDEN_APIS:
                continue
            lo, hi = max(lo, mine[0]), min(hi, mine[1])
            if lo <= hi:
                offered[key] = (lo, hi)
        # kproxy answers the SASL requests itself, whatever the brokers offer.
        for key in (SASL_HANDSHAKE, SASL_AUTHENTICATE, API_VERSIONS):
            offered[key] = ours[key]
        cls: Any = body_class(API_VERSIONS, "response")
        return cls(error_code=0, api_keys=[cls.ApiVersion(api_key=k, min_version=lo, max_version=hi)
                                           for k, (lo, hi) in sorted(offered.items())])

    def _error_body(self, req: Request) -> Any:
        resp = error_response(req, UNSUPPORTED_VERSION, "kproxy terminates SASL and does not manage the "
                                                        "brokers' SASL credentials")
        return resp.body if resp is not None else None


# -- following a client's own SASL exchange with the broker (passthrough)


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


class SessionSasl:
    """The session's SASL part (a base of ``Session``, whose ``__init__`` sets the state below): it
    follows a client's SASL exchange with the broker, relayed untouched (SaslHandshake v0's unframed
    tokens included), so that the principal is the user the broker accepted; and it turns the
    front's answers into the session's actions."""

    ctx: ConnectionContext
    in_flight: collections.deque[InFlight]
    sasl_in_progress: bool                   # a SASL exchange has begun and is not settled
    sasl_started_at: float                   # when it began (the session's clock)
    _raw_sasl: bool                          # after SaslHandshake v0: unframed SASL tokens follow
    _sasl_claimed_user: str | None           # from the client's token; not trusted
    _sasl_round_trips: int
    _sasl_handshake_ok: bool

    if TYPE_CHECKING:               # the session's own parts this one calls
        def _flush(self) -> list[Action]: ...

    def _observe_sasl_request(self, req: Request) -> None:
        ctx = self.ctx
        if req.api_key == SASL_HANDSHAKE:
            # A new handshake starts over (KIP-368 re-authentication too): until the broker accepts
            # again, the connection keeps the identity it had, and a claim is only a claim.
            ctx.sasl_mechanism = req.body.mechanism
            self.sasl_in_progress = True
            self.sasl_started_at = ctx.clock()
            self._sasl_handshake_ok = False
            self._sasl_round_trips = 0
            self._sasl_claimed_user = None
        elif self._sasl_round_trips == 0:
            self._sasl_claimed_user = sasl_user(ctx.sasl_mechanism, req.body.auth_bytes)

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

    def _raw_sasl_token(self, frame: memoryview) -> list[Action]:
        # The first raw token (handshake v0) names the user just as SaslAuthenticate's would.
        if self._sasl_round_trips == 0 and self._sasl_claimed_user is None:
            self._sasl_claimed_user = sasl_user(self.ctx.sasl_mechanism, frame)
        return [ToUpstream(size_prefixed(frame))]

    def _raw_sasl_reply(self, frame: memoryview) -> list[Action]:
        # A Kafka broker answers each raw token it accepts (PLAIN with an empty one) and closes the
        # connection on failure: the last expected answer is the broker's acceptance.
        self._sasl_round_trips += 1
        needed = _SASL_ROUND_TRIPS.get(self.ctx.sasl_mechanism or "")
        if needed is not None and self._sasl_round_trips >= needed:
            self._sasl_accepted()
        return [ToClient(size_prefixed(frame))]

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
        session_log.info("connection %d authenticated as %s (%s)", ctx.connection_id, safe(ctx.principal),
                 safe(ctx.sasl_mechanism))

    def _sasl_refused(self) -> None:
        """The broker refused: no SASL identity at all, whatever was established before."""
        self.sasl_in_progress = False
        self._sasl_claimed_user = None
        ctx = self.ctx
        if ctx.authenticated or ctx.sasl_user is not None:
            session_log.info("connection %d: the broker refused SASL re-authentication; identity cleared",
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
        if answer.raw is None:
            return out          # a step with no answer (GSSAPI's last)
        return [*out, ToClient(size_prefixed(answer.raw))]

"""SASL termination: the server side of one client's login, as a state machine (h11 style).

``RequiringHandshake -> RequiringAuthenticate -> Authenticated | Failed``; an authenticated
connection whose session ends may go through the handshake again to re-authenticate (KIP-368),
keeping its principal.
Each call takes a client message and returns what to answer. PLAIN and SCRAM are checked against a
``UserBook``, OAUTHBEARER against the JWKS keys handed in, GSSAPI (Kerberos, RFC 4752) by the GSS-API
acceptor handed in (kproxy's keytab, in ``kproxy.server.kerberos``); time comes from the clocks handed in.
"""

from __future__ import annotations

import collections
import enum
import hashlib
import hmac
from collections.abc import Callable, Mapping
from typing import Final

import attrs
from scramp import ScramException, ScramMechanism

from kproxy.identity.kerberos import GssAcceptor, GssapiSettings, GssFailure
from kproxy.identity.tokens import TokenRules, VerificationKey, bearer_token, verify_token
from kproxy.identity.users import (
    MAX_USER_NAME,
    SCRAM_MECHANISMS,
    ScramCredential,
    UserBook,
    password_matches,
)

MECHANISMS: Final = ("PLAIN", *SCRAM_MECHANISMS, "OAUTHBEARER", "GSSAPI")
ILLEGAL_SASL_STATE: Final = 34
UNSUPPORTED_SASL_MECHANISM: Final = 33
SASL_AUTHENTICATION_FAILED: Final = 58
# What a failed login is told; the reason goes to kproxy's log only (as a broker does).
FAILED_MESSAGE: Final = "Authentication failed: invalid credentials"
INVALID_TOKEN: Final = 'Authentication failed: {"status":"invalid_token"}'
# What a SaslAuthenticate after a completed login is told (it changes nothing).
AFTER_LOGIN: Final = "SaslAuthenticate after the login completed: send SaslHandshake first to re-authenticate"
# Kafka's broker begins at most one re-authentication a second on a connection (KafkaChannel's
# minimum re-authentication interval, counted between the starts of two re-authentications).
MIN_REAUTH_INTERVAL_S: Final = 1.0


class SaslState(enum.Enum):
    REQUIRING_HANDSHAKE = "requiring handshake"
    REQUIRING_AUTHENTICATE = "requiring authenticate"
    AUTHENTICATED = "authenticated"
    FAILED = "failed"


@attrs.frozen
class TerminationSettings:
    """What kproxy accepts from clients, and the bounds on the exchange."""

    mechanisms: tuple[str, ...]
    users: UserBook = attrs.field(factory=UserBook)
    token_rules: TokenRules | None = None
    max_session_s: float = 3600.0             # 0: sessions never expire
    failure_delay_s: float = 0.5              # every failure is answered this long after it began
    max_auth_bytes: int = 4096                # one PLAIN or SCRAM message
    max_token_bytes: int = 131072             # one OAUTHBEARER or GSSAPI message (a ticket with a PAC is large)
    gssapi: GssapiSettings | None = None
    # A per-process secret for the decoy credentials of unknown SCRAM users, so an unknown name gets
    # the same kind of answer as a known one with a wrong password.
    decoy_secret: bytes = b""


@attrs.frozen
class Outcome:
    """The answer to one SaslAuthenticate (or raw v0 token). ``error_code`` 0 means go on; a failure
    ends the connection once answered, unless ``keeps_connection``. ``reason`` is for kproxy's log, never for the client."""

    auth_bytes: bytes = b""
    error_code: int = 0
    error_message: str | None = None
    session_lifetime_ms: int = 0
    reason: str | None = None
    done: bool = False                        # this answer completes the login
    # After SaslHandshake v0 (unframed tokens), whether an answer is sent at all: GSSAPI's last
    # step has none (Kafka's broker sends nothing when its SaslServer returns no challenge).
    raw_answer: bool = True
    keeps_connection: bool = False            # an error that leaves the connection and its login as they were

    @property
    def failed(self) -> bool:
        return self.error_code != 0


class LoginFailed(Exception):
    """One exchange failed: ``message`` goes to the client, ``reason`` to the log."""

    def __init__(self, reason: str, message: str = FAILED_MESSAGE) -> None:
        super().__init__(reason)
        self.reason = reason
        self.message = message


class SaslTermination:
    """One client connection's SASL state."""

    def __init__(self, settings: TerminationSettings, *, clock: Callable[[], float],
                 wall_clock: Callable[[], float],
                 keys: Callable[[], Mapping[str, VerificationKey]] = dict) -> None:
        self.settings = settings
        self.clock = clock                    # monotonic seconds: session expiry
        self.wall_clock = wall_clock          # epoch seconds: token exp and nbf
        self.keys = keys
        self.state = SaslState.REQUIRING_HANDSHAKE
        self.mechanism: str | None = None
        self.user: str | None = None          # the verified user, once authenticated
        self.expires_at: float | None = None  # clock time the session ends (KIP-368), None: never
        self.raw = False                      # handshake v0: unframed tokens follow
        self.reauthenticating = False
        self.reauth_started_at: float | None = None   # clock time the last re-authentication began
        self._exchange: _Exchange | None = None
        # PLAIN verdicts worked out ahead by the I/O layer (off the event loop, ``plain_check``),
        # by the message's SHA-256; taken once.
        self.plain_checked: dict[bytes, bool] = {}

    @property
    def authenticated(self) -> bool:
        return self.user is not None and self.state is not SaslState.FAILED

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at

    @property
    def reauth_disabled(self) -> bool:
        """Whether a SaslHandshake now would be refused as a re-authentication of a session that never
        ends (``max_session_s: 0`` and a credential with no expiry): Kafka's broker begins one only on a
        session with an end (KafkaChannel.maybeBeginServerReauthentication), and with
        ``connections.max.reauth.ms=0`` answers the handshake as on any authenticated connection."""
        return self.state is SaslState.AUTHENTICATED and self.expires_at is None

    def reauth_too_soon(self, now: float) -> float | None:
        """Seconds since the last re-authentication began, when a SaslHandshake at ``now`` would
        begin another less than MIN_REAUTH_INTERVAL_S after it; None when it may begin one. As in
        Kafka, the first re-authentication is never too soon: the login itself does not count."""
        if self.state is not SaslState.AUTHENTICATED or self.reauth_started_at is None:
            return None
        since = now - self.reauth_started_at
        return since if since < MIN_REAUTH_INTERVAL_S else None

    def handshake(self, mechanism: str, version: int) -> int:
        """A SaslHandshake: the error code to answer with (0 when the exchange may start)."""
        if self.state is SaslState.AUTHENTICATED:
            now = self.clock()
            if self.reauth_disabled or self.reauth_too_soon(now) is not None:
                # Kafka's broker then handles the handshake as a request outside any exchange
                # (ILLEGAL_SASL_STATE) and the session goes on as it was.
                return ILLEGAL_SASL_STATE
            self.reauth_started_at = now
            # KIP-368: only SaslHandshake v1+ may re-authenticate, with the same mechanism.
            if version < 1 or mechanism != self.mechanism:
                self.state = SaslState.FAILED
                return ILLEGAL_SASL_STATE if version < 1 else UNSUPPORTED_SASL_MECHANISM
            self.reauthenticating = True
        elif self.state is not SaslState.REQUIRING_HANDSHAKE:
            self.state = SaslState.FAILED
            return ILLEGAL_SASL_STATE
        if mechanism not in self.settings.mechanisms:
            self.state = SaslState.FAILED
            return UNSUPPORTED_SASL_MECHANISM
        self.mechanism = mechanism
        self.raw = version == 0
        self._exchange = self._new_exchange(mechanism)
        self.state = SaslState.REQUIRING_AUTHENTICATE
        return 0

    def authenticate(self, message: bytes) -> Outcome:
        """A SaslAuthenticate's auth_bytes (or a raw v0 token): the answer."""
        exchange = self._exchange
        if self.state is SaslState.AUTHENTICATED:
            # Kafka's broker answers this as any request on an authenticated connection (KafkaApis):
            # ILLEGAL_SASL_STATE, with the login and the connection as they were.
            return Outcome(error_code=ILLEGAL_SASL_STATE, error_message=AFTER_LOGIN,
                           reason="SaslAuthenticate after the login completed", keeps_connection=True)
        if self.state is not SaslState.REQUIRING_AUTHENTICATE or exchange is None:
            self.state = SaslState.FAILED
            return Outcome(error_code=ILLEGAL_SASL_STATE, error_message="SaslAuthenticate before SaslHandshake",
                           reason="SaslAuthenticate before SaslHandshake")
        cap = (self.settings.max_token_bytes if self.mechanism in ("OAUTHBEARER", "GSSAPI")
               else self.settings.max_auth_bytes)
        try:
            if len(message) > cap:
                raise LoginFailed(f"{len(message)} bytes of {self.mechanism} exchange, more than the {cap} allowed")
            reply = exchange.step(message)
            if not exchange.done:
                return Outcome(auth_bytes=reply)
            user = exchange.user
            assert user is not None
            if self.reauthenticating and user != self.user:
                raise LoginFailed(f"re-authentication as {user!r} on a connection of {self.user!r} (KIP-368 "
                                  "keeps the principal)")
        except LoginFailed as e:
            self.state = SaslState.FAILED
            self._exchange = None
            return Outcome(error_code=SASL_AUTHENTICATION_FAILED, error_message=e.message, reason=e.reason)
        self._exchange = None
        self.state = SaslState.AUTHENTICATED
        self.user = user
        self.raw = False
        self.reauthenticating = False
        lifetime = self.settings.max_session_s
        if exchange.expires_at is not None:
            remaining = exchange.expires_at - self.wall_clock()
            lifetime = remaining if lifetime <= 0 else min(lifetime, remaining)
        lifetime_ms = max(int(lifetime * 1000), 1) if lifetime > 0 else 0
        self.expires_at = self.clock() + lifetime_ms / 1000 if lifetime_ms else None
        return Outcome(auth_bytes=reply, session_lifetime_ms=lifetime_ms, done=True,
                       raw_answer=self.mechanism != "GSSAPI")

    def _new_exchange(self, mechanism: str) -> _Exchange:
        s = self.settings
        if mechanism == "PLAIN":
            return _Plain(s.users, self.plain_checked)
        if mechanism == "OAUTHBEARER":
            assert s.token_rules is not None
            return _Bearer(s.token_rules, self.keys(), self.wall_clock())
        if mechanism == "GSSAPI":
            assert s.gssapi is not None
            return _Gssapi(s.gssapi)
        return _Scram(mechanism, s.users, s.decoy_secret)


class _Exchange:
    user: str | None = None
    done = False
    expires_at: float | None = None           # epoch seconds the credential stops being valid

    def step(self, message: bytes) -> bytes:
        raise NotImplementedError


class _Plain(_Exchange):
    """RFC 4616: ``authzid NUL authcid NUL passwd``, checked by deriving the user's SCRAM keys."""

    def __init__(self, users: UserBook, checked: dict[bytes, bool] | None = None) -> None:
        self.users = users
        self.checked = checked if checked is not None else {}

    def step(self, message: bytes) -> bytes:
        parts = message.split(b"\x00")
        if len(parts) != 3:
            raise LoginFailed("malformed PLAIN message")
        try:
            authzid, user, password = (p.decode("utf-8") for p in parts)
        except UnicodeDecodeError:
            raise LoginFailed("PLAIN message is not UTF-8") from None
        if not user or len(parts[1]) > MAX_USER_NAME:
            raise LoginFailed("PLAIN user name empty or too long")
        if authzid and authzid != user:
            raise LoginFailed(f"PLAIN user {user!r} asked to act as {authzid!r}")
        ok = self.checked.pop(hashlib.sha256(message).digest(), None)
        if ok is None:
            ok = plain_check(self.users, user, password)
        if not ok:
            raise LoginFailed(f"wrong password or unknown user {user!r} (PLAIN)")
        self.user, self.done = user, True
        return b""


def plain_check(users: UserBook, user: str, password: str) -> bool:
    """Whether ``password`` is ``user``'s: one PBKDF2 with the stored salt and iterations (a few ms
    of CPU, which the I/O layer runs in a thread ahead of the login)."""
    for mechanism in SCRAM_MECHANISMS:
        credential = users.credential(user, mechanism)
        if credential is not None:
            return password_matches(mechanism, credential, password)
    return False


def plain_parts(message: bytes) -> tuple[str, str] | None:
    """(user, password) of a well-formed PLAIN message, else None (the exchange says why)."""
    parts = message.split(b"\x00")
    if len(parts) != 3:
        return None
    try:
        return parts[1].decode("utf-8"), parts[2].decode("utf-8")
    except UnicodeDecodeError:
        return None


class _Scram(_Exchange):
    """RFC 5802 / RFC 7677 through scramp: client-first, then client-final with the proof."""

    def __init__(self, mechanism: str, users: UserBook, decoy_secret: bytes, s_nonce: str | None = None) -> None:
        self.mechanism = mechanism
        self.users = users
        self.decoy_secret = decoy_secret
        self.known = False
        # s_nonce only for tests against published vectors; otherwise scramp draws a fresh one.
        self._server = ScramMechanism(mechanism).make_server(self._credential, s_nonce=s_nonce)
        self._first_done = False

    def _credential(self, user: str) -> tuple[bytes, bytes, bytes, int]:
        if len(user.encode()) > MAX_USER_NAME:
            raise ScramException("user name too long")
        self.user = user
        found = self.users.credential(user, self.mechanism)
        self.known = found is not None
        c = found if found is not None else _decoy(self.mechanism, user, self.decoy_secret)
        return c.salt, c.stored_key, c.server_key, c.iterations

    def step(self, message: bytes) -> bytes:
        try:
            text = message.decode("utf-8")
            if not self._first_done:
                self._first_done = True
                self._server.set_client_first(text)
                return self._server.get_server_first().encode()
            self._server.set_client_final(text)
            if not self.known:
                raise LoginFailed(f"unknown user {self.user!r} ({self.mechanism})")
            final = self._server.get_server_final()
        except (ScramException, UnicodeDecodeError) as e:
            who = f"user {self.user!r}" if self.user is not None else "a client"
            raise LoginFailed(f"{self.mechanism} failed for {who}: {_scram_problem(e)}") from None
        self.done = True
        return final.encode()


def _scram_problem(e: Exception) -> str:
    text = str(e).split(":")[0].strip().rstrip(".")
    return text[:80] or type(e).__name__


def _decoy(mechanism: str, user: str, secret: bytes) -> ScramCredential:
    # Stable per user, so asking twice shows the same salt, as for a real user.
    seed = hmac.digest(secret or b"kproxy", user.encode(), "sha256")
    width = hashlib.new(SCRAM_HASH[mechanism]).digest_size
    return ScramCredential(seed[:16], 4096, (seed * 2)[:width], (seed[::-1] * 2)[:width])


SCRAM_HASH: Final = {"SCRAM-SHA-256": "sha256", "SCRAM-SHA-512": "sha512"}


class _Bearer(_Exchange):
    """RFC 7628 with Kafka's unsecured-free profile: one client message with a signed JWT."""

    def __init__(self, rules: TokenRules, keys: Mapping[str, VerificationKey], now: float) -> None:
        self.rules = rules
        self.keys = keys
        self.now = now

    def step(self, message: bytes) -> bytes:
        try:
            token, _extensions = bearer_token(message)
        except ValueError as e:
            raise LoginFailed(f"malformed OAUTHBEARER message: {e}", INVALID_TOKEN) from None
        verdict = verify_token(token, self.keys, self.rules, self.now)
        if verdict.problem is not None:
            raise LoginFailed(f"token refused: {verdict.problem}", INVALID_TOKEN)
        self.user, self.expires_at, self.done = verdict.principal, verdict.expires_at, True
        return b""


# RFC 4752 section 3.1: the first octet of the server's last challenge is the security layers it
# offers; 1 is "no security layer", the only one Kafka uses. With no layer, the size is 0.
NO_SECURITY_LAYER: Final = 1


class _Gssapi(_Exchange):
    """RFC 4752 on the accepting side, as Kafka's broker runs it: GSS-API context tokens until the
    context is established (the client's ticket checked with kproxy's keytab; its last token, the
    mutual authentication, answered, and the client's empty reply awaited); then a wrapped offer of
    no security layer, and the client's wrapped choice. The identity is the principal the ticket
    proved, mapped by the principal_to_local rules; an authorization id the client adds is ignored,
    as Kafka's broker ignores it (kafka-python sends the service name there)."""

    def __init__(self, settings: GssapiSettings) -> None:
        self.settings = settings
        self.principal: str | None = None            # the verified Kerberos principal
        self._acceptor: GssAcceptor | None = None
        self._stage = "context"                     # context, empty (awaiting it), choice

    def step(self, message: bytes) -> bytes:
        try:
            if self._stage == "context":
                return self._context(message)
            if self._stage == "empty":
                if message:
                    raise LoginFailed(f"GSSAPI: expected an empty reply after the context was established, "
                                      f"got {len(message)} bytes")
                self._stage = "choice"
                return self._offer()
            return self._choice(message)
        except GssFailure as e:
            raise LoginFailed(f"GSSAPI: {e.reason}") from None

    def _context(self, token: bytes) -> bytes:
        if self._acceptor is None:
            # Made at the first token, so a keytab that cannot be read fails this login with its reason.
            self._acceptor = self.settings.acceptor()
        acceptor = self._acceptor
        reply = acceptor.step(token)
        if not acceptor.complete:
            return reply
        principal = acceptor.initiator()
        name, why = self.settings.mapper.map(principal)
        if name is None:
            raise LoginFailed(f"GSSAPI: {principal!r} has no local name: {why}")
        self.principal, self.user = principal, name
        if reply:
            self._stage = "empty"
            return reply
        # No mutual-authentication token to send: the offer goes at once (RFC 4752 section 3.1).
        self._stage = "choice"
        return self._offer()

    def _offer(self) -> bytes:
        assert self._acceptor is not None
        return self._acceptor.wrap(bytes((NO_SECURITY_LAYER, 0, 0, 0)))

    def _choice(self, token: bytes) -> bytes:
        assert self._acceptor is not None
        message = self._acceptor.unwrap(token)
        if len(message) < 4:
            raise LoginFailed(f"GSSAPI: the security layer choice is {len(message)} bytes, not at least 4")
        if message[0] != NO_SECURITY_LAYER:
            raise LoginFailed(f"GSSAPI: {self.principal!r} chose security layer {message[0]}; kproxy offers none")
        self.done = True
        return b""


class FailedLogins:
    """Failed logins per source address over a sliding minute, to refuse addresses that guess.

    Memory is bounded by ``max_addresses``: the address seen longest ago is forgotten first, so a
    flood from many addresses costs a fixed amount, and one address costs one small entry.
    """

    def __init__(self, per_minute: int, max_addresses: int = 10000) -> None:
        self.per_minute = per_minute
        self.max_addresses = max_addresses
        self._seen: collections.OrderedDict[str, collections.deque[float]] = collections.OrderedDict()

    def blocked(self, address: str, now: float) -> bool:
        times = self._seen.get(address)
        if times is None or self.per_minute <= 0:
            return False
        while times and now - times[0] >= 60.0:
            times.popleft()
        return len(times) >= self.per_minute

    def failed(self, address: str, now: float) -> None:
        if self.per_minute <= 0:
            return
        times = self._seen.pop(address, None)
        if times is None:
            times = collections.deque(maxlen=self.per_minute)
            while len(self._seen) >= self.max_addresses:
                self._seen.popitem(last=False)
        times.append(now)
        self._seen[address] = times

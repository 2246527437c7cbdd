"""A SASL-enforcing gate in front of tansu, for end-to-end tests of kproxy with authenticating brokers.

tansu 0.6 can enforce SCRAM (``--authentication``) but its users live in the storage engine, and the
only engine built into the shipped binary without an outside service is ``memory://``: its first user
cannot be created once authentication is on (``tansu user create`` gets an early EOF, NotAuthenticated).
So the gate plays the broker's SASL part (KIP-43 / KIP-152 / KIP-368), standing in for Apache Kafka's
SASL listener: it answers SaslHandshake v1 and SaslAuthenticate itself (PLAIN; SCRAM-SHA-256/512 per
RFC 5802 and RFC 7677, verified for real from stored keys, independently of kproxy's own SCRAM code;
OAUTHBEARER per RFC 7628 and KIP-255, with the JWT checked against a JWKS by PyJWT for signature,
issuer, audience and expiry; GSSAPI per RFC 4752 as Kafka's broker runs it, with a real ``gssapi``
acceptor and the test KDC's service keytab), closes the connection on any other request before
authentication, and
relays frames to tansu afterwards. With ``require_sasl`` off it is an open listener that only counts
what it relays (a broker without SASL, for kproxy's termination tests). tansu
is started with its advertised listener pointing at the gate, so every address a client learns leads
back through it. Threads and blocking sockets only; it never logs a token or a password.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import os
import socket
import struct
import threading
import time
import traceback
from collections.abc import Iterable
from typing import Any

import attrs

from kproxy.localports import free_port
from kproxy.protocol.messages import Response, body_class, decode_request, encode_response_frame

_I32 = struct.Struct(">i")
_HHI = struct.Struct(">hhi")

PRODUCE, API_VERSIONS, SASL_HANDSHAKE, SASL_AUTHENTICATE = 0, 18, 17, 36
UNSUPPORTED_SASL_MECHANISM, ILLEGAL_SASL_STATE, SASL_AUTHENTICATION_FAILED = 33, 34, 58

SCRAM_HASHES = {"SCRAM-SHA-256": "sha256", "SCRAM-SHA-512": "sha512"}
MECHANISMS = ("PLAIN", *SCRAM_HASHES)


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports, handed out to nobody else (kproxy.localports)."""
    return [free_port() for _ in range(n)]


# --------------------------------------------------------------------------------------------------
# SASL servers
# --------------------------------------------------------------------------------------------------


class AuthFailed(Exception):
    """A SASL exchange failed; the message is safe to show (it names no secret)."""


@attrs.define
class ScramCredential:
    """What a broker stores for a SCRAM user (RFC 5802 section 3): never the password itself."""

    salt: bytes
    iterations: int
    stored_key: bytes
    server_key: bytes

    @classmethod
    def create(cls, hash_name: str, password: str, iterations: int = 4096) -> ScramCredential:
        salt = os.urandom(16)
        salted = hashlib.pbkdf2_hmac(hash_name, password.encode(), salt, iterations)
        client_key = hmac.digest(salted, b"Client Key", hash_name)
        return cls(salt, iterations, hashlib.new(hash_name, client_key).digest(),
                   hmac.digest(salted, b"Server Key", hash_name))


class PlainServer:
    """SASL/PLAIN (RFC 4616): one token ``authzid NUL authcid NUL passwd``."""

    def __init__(self, passwords: dict[str, str]) -> None:
        self.passwords = passwords
        self.user: str | None = None
        self.done = False

    def step(self, token: bytes) -> bytes:
        parts = token.split(b"\x00")
        if len(parts) != 3:
            raise AuthFailed("malformed PLAIN token")
        authzid, user, password = (p.decode("utf-8", "replace") for p in parts)
        expected = self.passwords.get(user)
        if expected is None or not hmac.compare_digest(expected.encode(), password.encode()) or (
                authzid and authzid != user):
            raise AuthFailed("Authentication failed: Invalid username or password")
        self.user, self.done = user, True
        return b""


class BearerServer:
    """OAUTHBEARER (RFC 7628) as Kafka's OAuthBearerValidatorCallbackHandler checks it: a signed JWT
    whose key is in the JWKS, with the expected issuer and audience, not expired; ``sub`` is the user."""

    def __init__(self, jwks: Any, issuer: str, audience: str) -> None:
        self.jwks = jwks            # a callable returning the JWKS document
        self.issuer = issuer
        self.audience = audience
        self.user: str | None = None
        self.done = False

    def step(self, token: bytes) -> bytes:
        import jwt

        text = token.decode("ascii", "replace")
        fields = dict(kv.partition("=")[::2] for kv in text.split("\x01")[1:] if kv)
        auth = fields.get("auth", "")
        if not auth.startswith("Bearer "):
            raise AuthFailed('{"status":"invalid_request"}')
        raw = auth[len("Bearer "):]
        try:
            kid = jwt.get_unverified_header(raw).get("kid")
            keys = {k["kid"]: k for k in self.jwks()["keys"]}
            key = jwt.PyJWK(keys[kid])
            claims = jwt.decode(raw, key.key, algorithms=["RS256"], audience=self.audience, issuer=self.issuer,
                                options={"require": ["exp", "sub"]})
        except (jwt.PyJWTError, KeyError):
            raise AuthFailed('{"status":"invalid_token"}') from None
        self.user, self.done = claims["sub"], True
        return b""


class GssapiServer:
    """GSSAPI (RFC 4752) as Kafka's broker runs it (Java's GSS-API SASL server): context tokens until the
    context is established, its last token answered and an empty reply awaited even when there was
    none to send, then a wrapped offer (no security layer, a 64 KiB buffer) and the client's wrapped
    choice. The acceptor holds only ``principal`` from ``keytab``; the user is the principal the
    ticket proved. Written on ``gssapi`` directly, independently of kproxy's own GSSAPI code."""

    def __init__(self, keytab: str, principal: str) -> None:
        import gssapi

        self.gssapi = gssapi
        creds = gssapi.Credentials(name=gssapi.Name(principal, gssapi.NameType.kerberos_principal),
                                   usage="accept", store={b"keytab": keytab.encode()})
        self.context = gssapi.SecurityContext(creds=creds, usage="accept")
        self.stage = "context"
        self.user: str | None = None
        self.done = False

    def step(self, token: bytes) -> bytes:
        GSSError = self.gssapi.exceptions.GSSError
        try:
            if self.stage == "context":
                out = self.context.step(token)
                if not self.context.complete:
                    return out or b""
                if not self.context.lifetime:
                    raise AuthFailed("Authentication failed: the ticket has expired")
                self.user = str(self.context.initiator_name)
                self.stage = "empty"
                return out or b""
            if self.stage == "empty":
                if token:
                    raise AuthFailed("Authentication failed: expected an empty response")
                self.stage = "choice"
                return bytes(self.context.wrap(bytes((1, 0x01, 0x00, 0x00)), False).message)
            choice = bytes(self.context.unwrap(token).message)
        except GSSError as e:
            raise AuthFailed(f"Authentication failed: GSSAPI: {e.gen_message()}") from None
        if len(choice) < 4 or choice[0] != 1:
            raise AuthFailed("Authentication failed: a security layer was chosen, none is offered")
        self.done = True
        return b""


class ScramServer:
    """The server side of SCRAM-SHA-256/512 (RFC 5802, RFC 7677): two client tokens, two answers."""

    def __init__(self, mechanism: str, credentials: dict[str, ScramCredential]) -> None:
        self.hash_name = SCRAM_HASHES[mechanism]
        self.credentials = credentials
        self.user: str | None = None
        self.done = False
        self._first: tuple[str, str, str, ScramCredential] | None = None

    def step(self, token: bytes) -> bytes:
        text = token.decode("utf-8", "replace")
        return self._final(text) if self._first else self._start(text)

    def _start(self, client_first: str) -> bytes:
        gs2, sep, bare = _split_gs2(client_first)
        if not sep:
            raise AuthFailed("malformed SCRAM client-first message")
        attrs_ = _scram_attrs(bare)
        user = attrs_.get("n", "").replace("=2C", ",").replace("=3D", "=")
        nonce = attrs_.get("r")
        cred = self.credentials.get(user)
        if not nonce or cred is None:
            raise AuthFailed("Authentication failed during authentication due to invalid credentials "
                             "with SASL mechanism SCRAM")
        full_nonce = nonce + base64.b64encode(os.urandom(18)).decode()
        server_first = f"r={full_nonce},s={base64.b64encode(cred.salt).decode()},i={cred.iterations}"
        self._first = (gs2, bare, server_first, cred)
        self.user = user
        return server_first.encode()

    def _final(self, client_final: str) -> bytes:
        assert self._first is not None
        gs2, client_first_bare, server_first, cred = self._first
        without_proof, _, proof_b64 = client_final.rpartition(",p=")
        attrs_ = _scram_attrs(without_proof)
        server_nonce = _scram_attrs(server_first)["r"]
        if attrs_.get("c") != base64.b64encode(gs2.encode()).decode() or attrs_.get("r") != server_nonce:
            raise AuthFailed("SCRAM channel binding or nonce mismatch")
        auth_message = f"{client_first_bare},{server_first},{without_proof}".encode()
        signature = hmac.digest(cred.stored_key, auth_message, self.hash_name)
        try:
            proof = base64.b64decode(proof_b64, validate=True)
        except ValueError:
            raise AuthFailed("malformed SCRAM proof") from None
        if len(proof) != len(signature):
            raise AuthFailed("malformed SCRAM proof")
        client_key = bytes(a ^ b for a, b in zip(proof, signature, strict=True))
        if not hmac.compare_digest(hashlib.new(self.hash_name, client_key).digest(), cred.stored_key):
            raise AuthFailed("Authentication failed during authentication due to invalid credentials "
                             "with SASL mechanism SCRAM")
        self.done = True
        server_signature = hmac.digest(cred.server_key, auth_message, self.hash_name)
        return b"v=" + base64.b64encode(server_signature)


def _split_gs2(message: str) -> tuple[str, bool, str]:
    # gs2-header is "n,," (or "y,," / "n,a=authzid,"): everything up to the second comma, kept with it.
    first = message.find(",")
    second = message.find(",", first + 1) if first >= 0 else -1
    if second < 0:
        return "", False, ""
    return message[: second + 1], True, message[second + 1:]


def _scram_attrs(text: str) -> dict[str, str]:
    out = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if sep:
            out[key] = value
    return out


# --------------------------------------------------------------------------------------------------
# The gate
# --------------------------------------------------------------------------------------------------


@attrs.define
class Authentication:
    """One SASL exchange the gate finished, successfully or not (no secrets)."""

    connection: int
    mechanism: str
    user: str | None
    ok: bool
    reauthentication: bool


class SaslGate:
    """Listens on a free loopback port; one pair of threads per client connection.

    ``tokens`` keeps every SASL token clients sent, so a test can check none of them leaked into a log.
    ``session_lifetime_ms`` > 0 asks clients to re-authenticate (KIP-368); a connection whose session
    has expired is closed at its next request, as Kafka brokers do.
    """

    def __init__(self, upstream: tuple[str, int] | None, users: dict[str, str], *,
                 mechanisms: Iterable[str] = MECHANISMS, session_lifetime_ms: int = 0,
                 port: int | None = None, bearer: tuple[Any, str, str] | None = None,
                 gssapi: tuple[str, str] | None = None) -> None:
        self.upstream = upstream
        self.passwords = dict(users)
        self.bearer = bearer        # (jwks callable, issuer, audience) for OAUTHBEARER
        self.gssapi = gssapi        # (keytab, service principal) for GSSAPI
        self.mechanisms = tuple(mechanisms) + (("OAUTHBEARER",) if bearer is not None else ()) + \
            (("GSSAPI",) if gssapi is not None else ())
        self.require_sasl = True
        self.accepted = 0
        self.scram = {mech: {u: ScramCredential.create(h, p) for u, p in users.items()}
                      for mech, h in SCRAM_HASHES.items()}
        self.session_lifetime_ms = session_lifetime_ms
        self.failed_authentication_delay_s = 0.1
        self.host = "127.0.0.1"
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((self.host, port or 0))
        self._listener.listen(64)
        self.port: int = self._listener.getsockname()[1]
        self.tokens: list[bytes] = []
        self.authentications: list[Authentication] = []
        self.refused: list[tuple[int, int]] = []           # (connection, api key) closed before auth
        self.errors: list[str] = []                        # exceptions in the gate itself
        self.expired: list[int] = []                       # connections closed for an expired session
        self.too_soon: list[int] = []                      # re-authentications refused as too soon
        self.not_begun: list[int] = []                     # ... refused as the session has no end
        self.forwarded: list[tuple[int, int, str | None]] = []  # (connection, api key, user) relayed
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._live = 0                                     # client connections still being served
        self._idle = threading.Condition(self._lock)
        self._ids = iter(range(1, 1 << 30))
        self._closed = False
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> SaslGate:
        self._thread = threading.Thread(target=self._accept_loop, name="sasl-gate", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            socks = list(self._sockets)
        for s in socks:
            _close(s)
        if self._thread is not None:
            self._thread.join(5)

    def drop_connections(self) -> None:
        """Cut every open connection (as a broker restart would), keep listening."""
        with self._lock:
            socks, self._sockets = list(self._sockets), set()
        for s in socks:
            _close(s)

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until every client connection has been served to its end, so what those connections
        did (``authentications``, ``forwarded``...) is all recorded. A test that counts from a mark
        calls this once its clients are gone: a connection a client dropped mid-login is still read
        to its end here, and its login would otherwise land after the next test's mark."""
        with self._idle:
            if not self._idle.wait_for(lambda: self._live == 0, timeout):
                raise TimeoutError(f"{self._live} gate connections still open after {timeout:g}s")

    def __enter__(self) -> SaslGate:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self.accepted += 1
            with self._lock:
                self._live += 1
            threading.Thread(target=self._serve, args=(client, next(self._ids)), daemon=True).start()

    def _track(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.add(sock)

    def _serve(self, client: socket.socket, cid: int) -> None:
        try:
            self._track(client)
            assert self.upstream is not None
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                _close(client)
                return
            upstream.settimeout(None)
            self._track(upstream)
            GateConnection(self, cid, client, upstream).run()
        finally:
            with self._idle:
                self._live -= 1
                self._idle.notify_all()


class GateConnection:
    """One client connection through the gate: SASL answered here, everything else relayed in order."""

    def __init__(self, gate: SaslGate, cid: int, client: socket.socket, upstream: socket.socket) -> None:
        self.gate = gate
        self.cid = cid
        self.client = client
        self.upstream = upstream
        self.send_lock = threading.Lock()
        self.pending: set[int] = set()         # correlation ids relayed and not yet answered
        self.pending_changed = threading.Condition()
        self.user: str | None = None
        self.expires_at: float | None = None
        self.mechanism: str | None = None
        self.server: PlainServer | ScramServer | BearerServer | GssapiServer | None = None
        self.reauth_started_at: float | None = None      # when the last re-authentication began

    def run(self) -> None:
        pump = threading.Thread(target=self._upstream_pump, daemon=True)
        pump.start()
        try:
            while (frame := _read_frame(self.client)) is not None:
                if not self._client_frame(frame):
                    break
        except OSError:
            pass
        except Exception:  # a bug in the gate itself: kept for the tests to see
            self.gate.errors.append(traceback.format_exc())
        finally:
            _close(self.client)
            _close(self.upstream)
            pump.join(5)

    def _upstream_pump(self) -> None:
        try:
            while (frame := _read_frame(self.upstream)) is not None:
                (correlation_id,) = _I32.unpack_from(frame, 0)
                with self.send_lock:
                    self.client.sendall(_I32.pack(len(frame)) + frame)
                with self.pending_changed:
                    self.pending.discard(correlation_id)
                    self.pending_changed.notify_all()
        except OSError:
            pass
        finally:
            _close(self.client)

    def _client_frame(self, frame: bytes) -> bool:
        """Handle one request; False ends the connection."""
        api_key, _version, correlation_id = _HHI.unpack_from(frame, 0)
        if api_key == SASL_AUTHENTICATE and self.user is not None and self.server is not None and not self.server.done:
            # A re-authentication under way takes its SaslAuthenticate steps past the old session's
            # end, as Kafka's broker does: there the channel is not ready while it re-authenticates,
            # and its frames go to the authenticator, which no expiry check stands in front of.
            return self._sasl(frame)
        if self.expires_at is not None and time.monotonic() > self.expires_at:
            # KIP-368: once the session has ended, any request closes the connection, even one that
            # would start re-authentication. Stricter than Kafka's broker, whose Processor lets a
            # SaslHandshake begin re-authentication before it checks expiry: a late start fails here.
            self.gate.expired.append(self.cid)
            return False
        if api_key in (SASL_HANDSHAKE, SASL_AUTHENTICATE):
            return self._sasl(frame)
        if self.user is None and api_key != API_VERSIONS and self.gate.require_sasl:
            # A broker that requires SASL only takes ApiVersions and the SASL requests before it.
            self.gate.refused.append((self.cid, api_key))
            return False
        expects_answer = not (api_key == PRODUCE and decode_request(frame).body.acks == 0)
        if expects_answer:
            with self.pending_changed:
                self.pending.add(correlation_id)
        self.gate.forwarded.append((self.cid, api_key, self.user))
        self.upstream.sendall(_I32.pack(len(frame)) + frame)
        return True

    def _answer(self, api_key: int, api_version: int, correlation_id: int, body: Any) -> None:
        # Answers in request order: wait until everything relayed before this request is answered.
        with self.pending_changed:
            if not self.pending_changed.wait_for(lambda: not self.pending, timeout=10):
                raise OSError("upstream did not answer earlier requests")
        data = b"".join(bytes(b) for b in encode_response_frame(
            Response.build(api_key, api_version, correlation_id, body)))
        with self.send_lock:
            self.client.sendall(data)

    def _sasl(self, frame: bytes) -> bool:
        req = decode_request(frame)
        key, version, correlation_id = req.api_key, req.api_version, req.correlation_id
        body_cls = body_class(key, "response")
        if key == SASL_HANDSHAKE:
            if self.user is not None:
                # Kafka's broker re-authenticates only a session that ends, at most once a second
                # (KafkaChannel; the first login does not count). Another SaslHandshake is answered
                # ILLEGAL_SASL_STATE with no mechanisms, as on any authenticated connection, which
                # stays open.
                now = time.monotonic()
                if self.expires_at is None:
                    self.gate.not_begun.append(self.cid)
                    self._answer(key, version, correlation_id, body_cls(error_code=ILLEGAL_SASL_STATE, mechanisms=[]))
                    return True
                if self.reauth_started_at is not None and now - self.reauth_started_at < 1.0:
                    self.gate.too_soon.append(self.cid)
                    self._answer(key, version, correlation_id, body_cls(error_code=ILLEGAL_SASL_STATE, mechanisms=[]))
                    return True
                self.reauth_started_at = now
            if version == 0:
                # v0 is followed by unframed tokens (pre KIP-152); every current client uses v1.
                return False
            mechanism = req.body.mechanism
            ok = mechanism in self.gate.mechanisms
            if ok:
                self.mechanism = mechanism
                if mechanism == "PLAIN":
                    self.server = PlainServer(self.gate.passwords)
                elif mechanism == "OAUTHBEARER":
                    assert self.gate.bearer is not None
                    self.server = BearerServer(*self.gate.bearer)
                elif mechanism == "GSSAPI":
                    assert self.gate.gssapi is not None
                    self.server = GssapiServer(*self.gate.gssapi)
                else:
                    self.server = ScramServer(mechanism, self.gate.scram[mechanism])
            self._answer(key, version, correlation_id, body_cls(
                error_code=0 if ok else UNSUPPORTED_SASL_MECHANISM, mechanisms=list(self.gate.mechanisms)))
            return True
        token = bytes(req.body.auth_bytes)
        self.gate.tokens.append(token)
        server = self.server
        if server is None or server.done:
            # After a login Kafka's broker answers this as any request (KafkaApis) and keeps the
            # connection; before one, its authenticator fails the login and closes it.
            after_login = self.user is not None
            self._answer(key, version, correlation_id, body_cls(
                error_code=ILLEGAL_SASL_STATE, auth_bytes=b"",
                error_message="SaslAuthenticate after the login" if after_login else "SaslAuthenticate before SaslHandshake"))
            return after_login
        reauth = self.user is not None
        try:
            reply = server.step(token)
        except AuthFailed as e:
            self.gate.authentications.append(
                Authentication(self.cid, self.mechanism or "?", server.user, False, reauth))
            self._answer(key, version, correlation_id, body_cls(
                error_code=SASL_AUTHENTICATION_FAILED, error_message=str(e), auth_bytes=b""))
            # Kafka closes the connection after a failed authentication, a little later
            # (connection.failed.authentication.delay.ms, 100 by default).
            time.sleep(self.gate.failed_authentication_delay_s)
            return False
        lifetime = 0
        if server.done:
            if reauth and server.user != self.user:
                # KIP-368: re-authentication must not change the principal.
                self._answer(key, version, correlation_id, body_cls(
                    error_code=SASL_AUTHENTICATION_FAILED, error_message="principal changed",
                    auth_bytes=b""))
                return False
            self.user = server.user
            self.gate.authentications.append(
                Authentication(self.cid, self.mechanism or "?", server.user, True, reauth))
            lifetime = self.gate.session_lifetime_ms
            self.expires_at = time.monotonic() + lifetime / 1000 if lifetime > 0 else None
        extra = {"session_lifetime_ms": lifetime} if version >= 1 else {}
        self._answer(key, version, correlation_id, body_cls(
            error_code=0, error_message=None, auth_bytes=reply, **extra))
        return True


def _read_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return bytes(buf)


def _read_frame(sock: socket.socket) -> bytes | None:
    head = _read_exact(sock, 4)
    if head is None:
        return None
    (size,) = _I32.unpack(head)
    if not 0 <= size <= 100 << 20:
        raise OSError(f"bad frame size {size}")
    return _read_exact(sock, size)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


# --------------------------------------------------------------------------------------------------
# Real clients with security settings (shared by the TLS and SASL tests)
# --------------------------------------------------------------------------------------------------

N_RECORDS = 10
CLIENT_TIMEOUT = 20.0


def expected_pairs(n: int = N_RECORDS) -> list[tuple[bytes, bytes]]:
    return [(f"k{i}".encode(), f"value {i}".encode()) for i in range(n)]


def confluent_roundtrip(settings: dict[str, Any], topic: str, n: int = N_RECORDS) -> list[tuple[bytes, bytes]]:
    """Create ``topic`` (1 partition), produce ``n`` records and read them back, with librdkafka."""
    import confluent_kafka
    import confluent_kafka.admin

    common = {"socket.timeout.ms": int(CLIENT_TIMEOUT * 1000), **settings}
    admin = confluent_kafka.admin.AdminClient(common)
    for future in admin.create_topics([confluent_kafka.admin.NewTopic(topic, 1, 1)]).values():
        future.result(CLIENT_TIMEOUT)
    producer = confluent_kafka.Producer({**common, "acks": "all", "linger.ms": 5})
    for key, value in expected_pairs(n):
        producer.produce(topic, key=key, value=value)
    assert producer.flush(CLIENT_TIMEOUT) == 0
    consumer = confluent_kafka.Consumer({**common, "group.id": "unused", "enable.auto.commit": False})
    try:
        consumer.assign([confluent_kafka.TopicPartition(topic, 0, confluent_kafka.OFFSET_BEGINNING)])
        seen: list[tuple[bytes, bytes]] = []
        deadline = time.monotonic() + CLIENT_TIMEOUT
        while len(seen) < n and time.monotonic() < deadline:
            message = consumer.poll(0.2)
            if message is None:
                continue
            if message.error():
                raise confluent_kafka.KafkaException(message.error())
            seen.append((message.key() or b"", message.value() or b""))
        return seen
    finally:
        consumer.close()


def kafka_python_roundtrip(settings: dict[str, Any], topic: str, n: int = N_RECORDS) -> list[tuple[bytes, bytes]]:
    """The same round trip with kafka-python (``settings`` are its keyword arguments)."""
    import kafka
    import kafka.admin

    admin = kafka.KafkaAdminClient(**settings)
    try:
        admin.create_topics([kafka.admin.NewTopic(topic, 1, 1)])
    finally:
        admin.close()
    producer = kafka.KafkaProducer(acks="all", **settings)
    try:
        for key, value in expected_pairs(n):
            producer.send(topic, key=key, value=value)
        producer.flush(CLIENT_TIMEOUT)
    finally:
        producer.close(CLIENT_TIMEOUT)
    consumer = kafka.KafkaConsumer(enable_auto_commit=False, consumer_timeout_ms=int(CLIENT_TIMEOUT * 1000),
                                   **settings)
    try:
        tp = kafka.TopicPartition(topic, 0)
        consumer.assign([tp])
        consumer.seek_to_beginning(tp)
        seen: list[tuple[bytes, bytes]] = []
        for message in consumer:
            seen.append((message.key, message.value))
            if len(seen) == n:
                break
        return seen
    finally:
        consumer.close()

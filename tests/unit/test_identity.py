"""kproxy.identity: SCRAM against RFC 7677's vectors, PLAIN against SCRAM keys, JWT checks with keys
made here, the termination state machine and its KIP-368 timers under injected clocks."""

from __future__ import annotations

import base64
import json
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from scramp import ScramClient

from kproxy.identity.termination import (
    ILLEGAL_SASL_STATE,
    SASL_AUTHENTICATION_FAILED,
    UNSUPPORTED_SASL_MECHANISM,
    FailedLogins,
    LoginFailed,
    SaslState,
    SaslTermination,
    TerminationSettings,
    _Scram,
)
from kproxy.identity.tokens import (
    TokenRules,
    bearer_message,
    bearer_token,
    keys_from_jwks,
    token_kid,
    verify_token,
)
from kproxy.identity.users import (
    UserBook,
    UsersError,
    new_credential,
    password_matches,
    users_from_mapping,
    users_to_mapping,
)

# RFC 7677 section 3: user "user", password "pencil", salt and nonces as given there.
RFC7677_SALT = base64.b64decode("W22ZaJ0SNY7soEsUEjb6gQ==")
RFC7677_CLIENT_FIRST = "n,,n=user,r=rOprNGfwEbeRWgbNEkqO"
RFC7677_SERVER_NONCE = "%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0"
RFC7677_SERVER_FIRST = "r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096"
RFC7677_CLIENT_FINAL = ("c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,"
                        "p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=")
RFC7677_SERVER_FINAL = "v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="

ISSUER, AUDIENCE = "https://idp.test/", "kafka"


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def book(**passwords: str) -> UserBook:
    out = UserBook()
    for user, password in passwords.items():
        out = out.with_user(user, {m: new_credential(m, password) for m in ("SCRAM-SHA-256", "SCRAM-SHA-512")})
    return out


# -- SCRAM


def test_scram_sha256_answers_rfc7677_exactly() -> None:
    users = UserBook({"user": {"SCRAM-SHA-256": new_credential("SCRAM-SHA-256", "pencil", 4096, RFC7677_SALT)}})
    server = _Scram("SCRAM-SHA-256", users, b"secret", s_nonce=RFC7677_SERVER_NONCE)
    assert server.step(RFC7677_CLIENT_FIRST.encode()).decode() == RFC7677_SERVER_FIRST
    assert server.step(RFC7677_CLIENT_FINAL.encode()).decode() == RFC7677_SERVER_FINAL
    assert server.done and server.user == "user"


def test_scram_refuses_a_proof_from_another_password() -> None:
    users = UserBook({"user": {"SCRAM-SHA-256": new_credential("SCRAM-SHA-256", "not pencil", 4096, RFC7677_SALT)}})
    server = _Scram("SCRAM-SHA-256", users, b"secret", s_nonce=RFC7677_SERVER_NONCE)
    server.step(RFC7677_CLIENT_FIRST.encode())
    with pytest.raises(LoginFailed):
        server.step(RFC7677_CLIENT_FINAL.encode())
    assert not server.done


def terminate(mechanisms=("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"), *, users: UserBook | None = None,
              keys: Any = dict, wall: Clock | None = None, clock: Clock | None = None, max_session_s: float = 3600,
              **settings: Any) -> SaslTermination:
    rules = TokenRules(ISSUER, AUDIENCE)
    s = TerminationSettings(tuple(mechanisms), users or book(alice="alice-secret"), rules,
                            max_session_s=max_session_s, decoy_secret=b"d", **settings)
    return SaslTermination(s, clock=clock or Clock(1000.0), wall_clock=wall or Clock(1_700_000_000.0), keys=keys)


def scram_login(t: SaslTermination, mechanism: str, user: str, password: str, version: int = 1):
    assert t.handshake(mechanism, version) == 0
    client = ScramClient([mechanism], user, password)
    first = t.authenticate(client.get_client_first().encode())
    assert not first.failed and not first.done
    client.set_server_first(first.auth_bytes.decode())
    final = t.authenticate(client.get_client_final().encode())
    if not final.failed:
        client.set_server_final(final.auth_bytes.decode())   # the client checks the server too
    return final


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_scram_login_with_a_real_client(mechanism: str) -> None:
    t = terminate()
    o = scram_login(t, mechanism, "alice", "alice-secret")
    assert o.done and not o.failed and o.session_lifetime_ms == 3_600_000
    assert t.state is SaslState.AUTHENTICATED and t.user == "alice"


@pytest.mark.parametrize("user,password", [("alice", "wrong"), ("mallory", "alice-secret")])
def test_scram_wrong_password_and_unknown_user_fail_the_same_way(user: str, password: str) -> None:
    t = terminate()
    o = scram_login(t, "SCRAM-SHA-512", user, password)
    assert o.error_code == SASL_AUTHENTICATION_FAILED
    assert o.error_message == "Authentication failed: invalid credentials"
    assert t.state is SaslState.FAILED and t.user is None and not t.authenticated


def test_unknown_user_gets_a_stable_plausible_salt() -> None:
    salts = []
    for _ in range(2):
        t = terminate()
        t.handshake("SCRAM-SHA-256", 1)
        first = t.authenticate(b"n,,n=mallory,r=abcdef").auth_bytes.decode()
        salts.append(dict(kv.split("=", 1) for kv in first.split(","))["s"])
    assert salts[0] == salts[1] and len(base64.b64decode(salts[0])) == 16


# -- PLAIN


def test_plain_is_checked_against_the_scram_keys() -> None:
    t = terminate()
    assert t.handshake("PLAIN", 1) == 0
    o = t.authenticate(b"\x00alice\x00alice-secret")
    assert o.done and t.user == "alice"


@pytest.mark.parametrize("message", [b"\x00alice\x00wrong", b"\x00bob\x00alice-secret", b"bob\x00alice\x00alice-secret",
                                     b"alice-secret", b"\x00\x00alice-secret", b"\x00\xff\x00x"])
def test_plain_refusals(message: bytes) -> None:
    t = terminate()
    t.handshake("PLAIN", 1)
    o = t.authenticate(message)
    assert o.error_code == SASL_AUTHENTICATION_FAILED and t.state is SaslState.FAILED


def test_plain_uses_a_verdict_worked_out_ahead_once() -> None:
    """The I/O layer runs PLAIN's PBKDF2 in a thread and hands the verdict in by the message's hash."""
    import hashlib

    message = b"\x00alice\x00alice-secret"
    t = terminate()
    t.plain_checked[hashlib.sha256(message).digest()] = False     # as if the thread said no
    t.handshake("PLAIN", 1)
    assert t.authenticate(message).failed
    assert t.plain_checked == {}


def test_auth_bytes_and_user_names_are_capped() -> None:
    t = terminate(max_auth_bytes=100)
    t.handshake("PLAIN", 1)
    assert t.authenticate(b"\x00alice\x00" + b"x" * 200).failed
    t = terminate()
    t.handshake("PLAIN", 1)
    assert t.authenticate(b"\x00" + b"u" * 300 + b"\x00pw").failed
    t = terminate()
    t.handshake("SCRAM-SHA-256", 1)
    assert t.authenticate(b"n,,n=" + b"u" * 300 + b",r=abc").failed


def test_password_matches_uses_the_stored_salt_and_iterations() -> None:
    c = new_credential("SCRAM-SHA-512", "pw", 5000)
    assert c.iterations == 5000
    assert password_matches("SCRAM-SHA-512", c, "pw") and not password_matches("SCRAM-SHA-512", c, "pw2")


# -- the state machine


def test_unoffered_mechanism_and_authenticate_before_handshake_fail() -> None:
    t = terminate(mechanisms=("SCRAM-SHA-512",))
    assert t.handshake("PLAIN", 1) == UNSUPPORTED_SASL_MECHANISM and t.state is SaslState.FAILED
    t = terminate()
    assert t.authenticate(b"\x00alice\x00alice-secret").failed and not t.authenticated


def test_session_expires_and_reauthentication_keeps_the_principal() -> None:
    clock = Clock(50.0)
    t = terminate(clock=clock, max_session_s=10)
    assert scram_login(t, "SCRAM-SHA-256", "alice", "alice-secret").session_lifetime_ms == 10_000
    clock.now = 59.9
    assert not t.expired(clock())
    clock.now = 60.0
    assert t.expired(clock())
    o = scram_login(t, "SCRAM-SHA-256", "alice", "alice-secret")      # KIP-368 on the same connection
    assert o.done and t.expires_at == 70.0 and not t.expired(clock())


def test_reauthentication_as_someone_else_fails() -> None:
    t = terminate(users=book(alice="a", bob="b"))
    scram_login(t, "SCRAM-SHA-256", "alice", "a")
    o = scram_login(t, "SCRAM-SHA-256", "bob", "b")
    assert o.failed and t.state is SaslState.FAILED and not t.authenticated


def test_reauthentication_must_keep_the_mechanism_and_use_v1() -> None:
    t = terminate()
    scram_login(t, "SCRAM-SHA-256", "alice", "alice-secret")
    assert t.handshake("SCRAM-SHA-512", 1) != 0 and t.state is SaslState.FAILED
    t = terminate()
    scram_login(t, "SCRAM-SHA-256", "alice", "alice-secret")
    assert t.handshake("SCRAM-SHA-256", 0) != 0


def test_a_reauthentication_begins_at_most_once_a_second_and_a_refused_one_changes_nothing() -> None:
    """KafkaChannel.maybeBeginServerReauthentication: the first re-authentication may come at once;
    another less than a second after the previous one began is not begun (the handshake is refused
    before its mechanism or version is looked at) and the session stays as it was."""
    clock = Clock(50.0)
    t = terminate(clock=clock, max_session_s=10)
    scram_login(t, "SCRAM-SHA-256", "alice", "alice-secret")
    assert t.reauth_too_soon(clock()) is None
    scram_login(t, "SCRAM-SHA-256", "alice", "alice-secret")           # at once: the first one
    assert t.reauth_started_at == 50.0
    clock.now = 50.5
    assert t.reauth_too_soon(clock()) == pytest.approx(0.5)
    for mechanism, version in (("SCRAM-SHA-256", 1), ("SCRAM-SHA-512", 1), ("SCRAM-SHA-256", 0)):
        assert t.handshake(mechanism, version) == ILLEGAL_SASL_STATE
        assert t.state is SaslState.AUTHENTICATED and t.mechanism == "SCRAM-SHA-256" and not t.reauthenticating
    assert t.authenticated and t.expires_at == 60.0 and t.reauth_started_at == 50.0
    clock.now = 51.0
    assert t.reauth_too_soon(clock()) is None
    o = scram_login(t, "SCRAM-SHA-256", "alice", "alice-secret")
    assert o.done and t.expires_at == 61.0 and t.reauth_started_at == 51.0


def test_with_no_session_end_a_reauthentication_is_not_begun_as_in_kafka() -> None:
    """Kafka's broker begins a re-authentication only on a session that ends
    (KafkaChannel.maybeBeginServerReauthentication; ``connections.max.reauth.ms=0`` and a password):
    the handshake is refused ILLEGAL_SASL_STATE, whatever its mechanism or version, and the login
    stays as it was."""
    t = terminate(max_session_s=0)
    o = scram_login(t, "SCRAM-SHA-256", "alice", "alice-secret")
    assert o.done and o.session_lifetime_ms == 0 and t.expires_at is None and t.reauth_disabled
    for mechanism, version in (("SCRAM-SHA-256", 1), ("SCRAM-SHA-512", 1), ("SCRAM-SHA-256", 0)):
        assert t.handshake(mechanism, version) == ILLEGAL_SASL_STATE
        assert t.state is SaslState.AUTHENTICATED and t.user == "alice" and not t.reauthenticating
    assert t.reauth_started_at is None                    # nothing was begun


def test_with_no_max_session_a_token_still_ends_the_session_and_allows_reauthentication(rsa_key) -> None:
    """The session of a token ends with the token even with ``max_session_s: 0``, as Kafka's broker
    takes the credential's expiry as the session's end: re-authentication is begun."""
    keys = keys_from_jwks(jwks_of(("k1", rsa_key)))
    t = terminate(keys=lambda: keys, wall=Clock(NOW), clock=Clock(10.0), max_session_s=0)
    t.handshake("OAUTHBEARER", 1)
    assert t.authenticate(bearer_message(token(rsa_key))).session_lifetime_ms == 600_000
    assert not t.reauth_disabled and t.handshake("OAUTHBEARER", 1) == 0 and t.reauthenticating


def test_a_saslauthenticate_after_the_login_is_refused_and_changes_nothing() -> None:
    """KafkaApis answers a SaslAuthenticate on an authenticated connection ILLEGAL_SASL_STATE and the
    connection goes on; an exchange under way or a handshake still begins as before."""
    clock = Clock(50.0)
    t = terminate(clock=clock, max_session_s=10)
    scram_login(t, "SCRAM-SHA-256", "alice", "alice-secret")
    o = t.authenticate(b"\x00alice\x00alice-secret")
    assert (o.error_code, o.keeps_connection, o.done) == (ILLEGAL_SASL_STATE, True, False)
    assert t.state is SaslState.AUTHENTICATED and t.user == "alice" and t.expires_at == 60.0
    assert scram_login(t, "SCRAM-SHA-256", "alice", "alice-secret").done      # re-authentication still works


def test_failed_logins_per_address_over_a_minute() -> None:
    limiter = FailedLogins(per_minute=3, max_addresses=2)
    for i in range(3):
        assert not limiter.blocked("10.0.0.1", 100.0 + i)
        limiter.failed("10.0.0.1", 100.0 + i)
    assert limiter.blocked("10.0.0.1", 103.0)
    assert not limiter.blocked("10.0.0.2", 103.0)
    assert not limiter.blocked("10.0.0.1", 160.5)           # the oldest failure left the window
    limiter.failed("10.0.0.2", 104.0)
    limiter.failed("10.0.0.3", 104.0)                       # bounded: the address seen longest ago goes
    assert len(limiter._seen) == 2 and "10.0.0.1" not in limiter._seen


# -- JWT


@pytest.fixture(scope="module")
def rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def jwks_of(*pairs: tuple[str, Any], alg: str | None = "RS256") -> dict[str, Any]:
    keys = []
    for kid, private in pairs:
        if isinstance(private, ec.EllipticCurvePrivateKey):
            data = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(private.public_key()))
        else:
            data = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(private.public_key()))
        data.update(kid=kid, use="sig")
        if alg:
            data["alg"] = alg
        keys.append(data)
    return {"keys": keys}


NOW = 1_700_000_000.0


def token(key: Any, kid: str = "k1", alg: str = "RS256", **claims: Any) -> str:
    body = {"iss": ISSUER, "aud": AUDIENCE, "sub": "svc-orders", "exp": NOW + 600, "nbf": NOW - 10}
    body.update(claims)
    return jwt.encode({k: v for k, v in body.items() if v is not None}, key, algorithm=alg,
                      headers={"kid": kid})


RULES = TokenRules(ISSUER, AUDIENCE)


def test_a_good_token_gives_its_subject_and_expiry(rsa_key) -> None:
    keys = keys_from_jwks(jwks_of(("k1", rsa_key)))
    v = verify_token(token(rsa_key), keys, RULES, NOW)
    assert v.problem is None and v.principal == "svc-orders" and v.expires_at == NOW + 600


def test_principal_from_another_claim(rsa_key) -> None:
    keys = keys_from_jwks(jwks_of(("k1", rsa_key)))
    rules = TokenRules(ISSUER, AUDIENCE, principal_claim="client_id")
    assert verify_token(token(rsa_key, client_id="orders"), keys, rules, NOW).principal == "orders"
    assert verify_token(token(rsa_key), keys, rules, NOW).problem is not None


def unsigned(claims: dict[str, Any], kid: str = "k1") -> str:
    def part(d: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(d).encode()).rstrip(b"=").decode()
    return f"{part({'alg': 'none', 'kid': kid, 'typ': 'JWT'})}.{part(claims)}."


def test_token_refusals(rsa_key) -> None:
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    keys = keys_from_jwks(jwks_of(("k1", rsa_key)))
    public_pem = rsa_key.public_key().public_bytes(
        encoding=__import__("cryptography.hazmat.primitives.serialization", fromlist=["Encoding"]).Encoding.PEM,
        format=__import__("cryptography.hazmat.primitives.serialization", fromlist=["PublicFormat"])
        .PublicFormat.SubjectPublicKeyInfo)
    cases = {
        "bad signature": token(other),
        "algorithm 'none' is not allowed": unsigned({"iss": ISSUER, "aud": AUDIENCE, "sub": "x", "exp": NOW + 60}),
        "algorithm 'HS256' is not allowed": jwt.encode({"iss": ISSUER, "aud": AUDIENCE, "sub": "x", "exp": NOW + 60},
                                                       public_pem.decode()[:64], algorithm="HS256",
                                                       headers={"kid": "k1"}),
        "expired": token(rsa_key, exp=NOW - 31),
        "not valid yet (nbf)": token(rsa_key, nbf=NOW + 60),
        "wrong audience": token(rsa_key, aud="billing"),
        "wrong issuer": token(rsa_key, iss="https://evil.test/"),
        "no exp claim": token(rsa_key, exp=None),
        "no key in the JWKS for the token's kid": token(rsa_key, kid="k2"),
        "not a JWT": "not-a-jwt",
    }
    for expected, tok in cases.items():
        assert verify_token(tok, keys, RULES, NOW).problem == expected, expected


def test_expiry_within_leeway_is_accepted(rsa_key) -> None:
    keys = keys_from_jwks(jwks_of(("k1", rsa_key)))
    assert verify_token(token(rsa_key, exp=NOW - 5), keys, RULES, NOW).problem is None


def test_key_pinned_to_another_algorithm(rsa_key) -> None:
    keys = keys_from_jwks(jwks_of(("k1", rsa_key), alg="RS512"))
    assert verify_token(token(rsa_key), keys, RULES, NOW).problem == "the token's algorithm is not its key's"


def test_ec_keys_and_jwks_entries_that_are_not_for_signing(rsa_key) -> None:
    ec_key = ec.generate_private_key(ec.SECP256R1())
    doc = jwks_of(("e1", ec_key), alg="ES256")
    doc["keys"].append({"kid": "enc", "use": "enc", "kty": "RSA", "n": "AQAB", "e": "AQAB"})
    doc["keys"].append({"kid": "junk", "kty": "nope"})
    keys = keys_from_jwks(doc)
    assert set(keys) == {"e1"}
    assert verify_token(token(ec_key, kid="e1", alg="ES256"), keys, RULES, NOW).principal == "svc-orders"
    with pytest.raises(ValueError):
        keys_from_jwks({"nokeys": 1})


def test_unknown_kid_then_a_refreshed_jwks(rsa_key) -> None:
    """The I/O layer refreshes the JWKS when a token names an unknown kid (token_kid), then the
    termination sees the new keys."""
    rotated = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    cache = {"keys": keys_from_jwks(jwks_of(("k1", rsa_key)))}
    tok = token(rotated, kid="k2")
    assert token_kid(tok) == "k2" and "k2" not in cache["keys"]
    t = terminate(keys=lambda: cache["keys"], wall=Clock(NOW))
    t.handshake("OAUTHBEARER", 1)
    assert t.authenticate(bearer_message(tok)).failed
    cache["keys"] = keys_from_jwks(jwks_of(("k1", rsa_key), ("k2", rotated)))       # the refresh
    t = terminate(keys=lambda: cache["keys"], wall=Clock(NOW))
    t.handshake("OAUTHBEARER", 1)
    assert t.authenticate(bearer_message(tok)).done and t.user == "svc-orders"


def test_oauth_session_lifetime_is_the_shorter_of_max_session_and_the_token(rsa_key) -> None:
    keys = keys_from_jwks(jwks_of(("k1", rsa_key)))
    for max_session, expected_ms in ((3600, 600_000), (60, 60_000)):
        clock = Clock(10.0)
        t = terminate(keys=lambda: keys, wall=Clock(NOW), clock=clock, max_session_s=max_session)
        t.handshake("OAUTHBEARER", 1)
        o = t.authenticate(bearer_message(token(rsa_key)))
        assert o.session_lifetime_ms == expected_ms and t.expires_at == 10.0 + expected_ms / 1000


def test_bad_token_message_says_invalid_token(rsa_key) -> None:
    t = terminate(keys=lambda: keys_from_jwks(jwks_of(("k1", rsa_key))), wall=Clock(NOW))
    t.handshake("OAUTHBEARER", 1)
    o = t.authenticate(bearer_message(token(rsa_key, aud="billing")))
    assert o.error_code == SASL_AUTHENTICATION_FAILED and "invalid_token" in (o.error_message or "")
    assert "audience" in (o.reason or "")


def test_bearer_messages_round_trip_with_extensions() -> None:
    msg = bearer_message("abc.def.ghi", {"logicalCluster": "lkc-1"})
    assert msg == b"n,,\x01auth=Bearer abc.def.ghi\x01logicalCluster=lkc-1\x01\x01"
    assert bearer_token(msg) == ("abc.def.ghi", {"logicalCluster": "lkc-1"})
    for bad in (b"n,,\x01auth=Basic x\x01\x01", b"n,,\x01\x01", b"garbage", b"n,,\x01auth=Bearer x\x01", b"\xff"):
        with pytest.raises(ValueError):
            bearer_token(bad)


# -- the users file


def test_users_mapping_round_trip_and_no_password_kept() -> None:
    b = book(alice="s3cret-password")
    data = users_to_mapping(b)
    assert "s3cret-password" not in json.dumps(data)
    again = users_from_mapping(data)
    c = again.credential("alice", "SCRAM-SHA-512")
    assert c is not None and password_matches("SCRAM-SHA-512", c, "s3cret-password")


@pytest.mark.parametrize("data,where", [
    ({"users": {"a": {"SCRAM-SHA-1": {}}}}, "users.a.SCRAM-SHA-1"),
    ({"users": {"a": {"SCRAM-SHA-256": {"salt": "!!", "iterations": 4096, "stored_key": "AA==",
                                        "server_key": "AA=="}}}}, "users.a.SCRAM-SHA-256.salt"),
    ({"users": {"a": {"SCRAM-SHA-256": {"salt": "AA==", "iterations": 10, "stored_key": "AA==",
                                        "server_key": "AA=="}}}}, "users.a.SCRAM-SHA-256.iterations"),
    ({"users": {"a": {"SCRAM-SHA-256": {"password": "x"}}}}, "users.a.SCRAM-SHA-256.password"),
    ({"people": {}}, ""),
])
def test_users_mapping_errors_name_the_entry(data: Any, where: str) -> None:
    with pytest.raises(UsersError) as e:
        users_from_mapping(data)
    assert e.value.path == where

"""OAUTHBEARER (RFC 7628) client messages and the checks on the JWT they carry.

A token is accepted only when its header names an allowed asymmetric algorithm and a key the JWKS
holds, its signature verifies with that key, and ``exp``, ``nbf``, issuer and audience hold at the
time given. The keys and the time are handed in: fetching the JWKS is ``kproxy.server.oauth``'s job.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import attrs
import jwt

# Only public-key algorithms: with a shared secret anyone who can check a token could mint one, and
# "none" or HS* with a public key as the secret are the classic forgeries.
ALLOWED_ALGORITHMS: Final = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384",
                             "ES512", "EdDSA")
# The most a principal name taken from a claim may be, as for user names.
MAX_PRINCIPAL: Final = 255


@attrs.frozen
class TokenRules:
    """What a token must say to be accepted."""

    issuer: str
    audience: str
    principal_claim: str = "sub"
    algorithms: tuple[str, ...] = ALLOWED_ALGORITHMS
    leeway_s: float = 30.0          # clock skew allowed on exp and nbf


@attrs.frozen(repr=False)
class VerificationKey:
    """One key of a JWKS: the public key, and the algorithm the JWK pins it to (None: any allowed)."""

    key: Any
    alg: str | None = None

    def __repr__(self) -> str:
        return f"VerificationKey(alg={self.alg!r})"


def keys_from_jwks(jwks: Any) -> dict[str, VerificationKey]:
    """The signing keys of a parsed JWKS document by kid; keys without a kid, for encryption, or of a
    type PyJWT cannot read are left out (a JWKS may hold keys for other uses)."""
    out: dict[str, VerificationKey] = {}
    if not isinstance(jwks, Mapping) or not isinstance(jwks.get("keys"), list):
        raise ValueError("a JWKS is a JSON object with a 'keys' list")
    for data in jwks["keys"]:
        if not isinstance(data, Mapping) or not isinstance(data.get("kid"), str) or data.get("use", "sig") != "sig":
            continue
        try:
            key = jwt.PyJWK(dict(data))
        except (jwt.PyJWTError, ValueError, TypeError):
            continue
        alg = data.get("alg")
        out[data["kid"]] = VerificationKey(key.key, alg if isinstance(alg, str) else None)
    return out


@attrs.frozen
class TokenVerdict:
    """``principal`` and ``expires_at`` (seconds since the epoch) when accepted, else ``problem``."""

    principal: str | None = None
    expires_at: float | None = None
    problem: str | None = None
    unknown_key: bool = False       # the JWKS has no key by the token's kid: worth refreshing once


def bearer_token(message: bytes) -> tuple[str, dict[str, str]]:
    """The token and SASL extensions of an OAUTHBEARER client initial response (RFC 7628 3.1):
    ``gs2-header \\x01 auth=Bearer TOKEN \\x01 [key=value \\x01]* \\x01``. ValueError if malformed."""
    try:
        text = message.decode("ascii")
    except UnicodeDecodeError:
        raise ValueError("not ASCII") from None
    gs2, sep, rest = text.partition("\x01")
    if not sep or not gs2.startswith(("n,", "y,")) or not rest.endswith("\x01\x01"):
        raise ValueError("not an OAUTHBEARER client response")
    token: str | None = None
    extensions: dict[str, str] = {}
    for item in rest[:-2].split("\x01"):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError("a key/value pair without '='")
        if key == "auth":
            scheme, _, token = value.partition(" ")
            if scheme.lower() != "bearer" or not token:
                raise ValueError("auth is not 'Bearer TOKEN'")
        else:
            extensions[key] = value
    if token is None:
        raise ValueError("no auth=Bearer")
    return token, extensions


def bearer_message(token: str, extensions: Mapping[str, str] | None = None) -> bytes:
    """The client initial response carrying ``token`` (and SASL extensions, KIP-342)."""
    items = [f"auth=Bearer {token}", *(f"{k}={v}" for k, v in (extensions or {}).items())]
    return ("n,,\x01" + "\x01".join(items) + "\x01\x01").encode("ascii")


def token_kid(token: str) -> str | None:
    """The ``kid`` a token's header names, without checking anything (to pick or fetch keys)."""
    try:
        kid = jwt.get_unverified_header(token).get("kid")
    except jwt.PyJWTError:
        return None
    return kid if isinstance(kid, str) else None


def verify_token(token: str, keys: Mapping[str, VerificationKey], rules: TokenRules, now: float) -> TokenVerdict:
    """Check ``token`` against ``keys`` (by kid) and ``rules`` at ``now`` (epoch seconds)."""
    try:
        header = jwt.get_unverified_header(token)
    except jwt.PyJWTError:
        return TokenVerdict(problem="not a JWT")
    alg = header.get("alg")
    if alg not in rules.algorithms:
        return TokenVerdict(problem=f"algorithm {str(alg)[:20]!r} is not allowed")
    kid = header.get("kid")
    key = keys.get(kid) if isinstance(kid, str) else None
    if key is None:
        return TokenVerdict(problem="no key in the JWKS for the token's kid", unknown_key=True)
    if key.alg is not None and key.alg != alg:
        return TokenVerdict(problem="the token's algorithm is not its key's")
    try:
        # exp and nbf are checked below against the time handed in, not PyJWT's own clock.
        claims = jwt.decode(token, key=key.key, algorithms=[alg], audience=rules.audience, issuer=rules.issuer,
                            options={"require": ["exp", "iss", "aud"], "verify_exp": False,
                                     "verify_nbf": False, "verify_iat": False})
    except jwt.InvalidSignatureError:
        return TokenVerdict(problem="bad signature")
    except jwt.InvalidAudienceError:
        return TokenVerdict(problem="wrong audience")
    except jwt.InvalidIssuerError:
        return TokenVerdict(problem="wrong issuer")
    except jwt.MissingRequiredClaimError as e:
        return TokenVerdict(problem=f"no {e.claim} claim")
    except jwt.PyJWTError as e:
        return TokenVerdict(problem=f"invalid token ({type(e).__name__})")
    exp = claims.get("exp")
    if not isinstance(exp, int | float) or isinstance(exp, bool):
        return TokenVerdict(problem="exp is not a number")
    if now > exp + rules.leeway_s:
        return TokenVerdict(problem="expired")
    nbf = claims.get("nbf")
    if nbf is not None and (not isinstance(nbf, int | float) or now + rules.leeway_s < nbf):
        return TokenVerdict(problem="not valid yet (nbf)")
    principal = claims.get(rules.principal_claim)
    if not isinstance(principal, str) or not principal or len(principal.encode()) > MAX_PRINCIPAL:
        return TokenVerdict(problem=f"no usable {rules.principal_claim[:40]!r} claim for the principal")
    return TokenVerdict(principal=principal, expires_at=float(exp))

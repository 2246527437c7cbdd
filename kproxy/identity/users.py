"""The users kproxy authenticates itself: SCRAM credentials per user and mechanism, never passwords.

A user entry holds what Kafka stores for SCRAM (RFC 5802 section 3): salt, iteration count, stored
key and server key. A PLAIN login is checked by deriving the same keys from the password offered.
This module turns the parsed users file (a mapping) into a book and back; it reads no file.
"""

from __future__ import annotations

import base64
import binascii
import hmac
from collections.abc import Mapping
from typing import Any, Final

import attrs
from scramp import ScramMechanism

SCRAM_MECHANISMS: Final = ("SCRAM-SHA-256", "SCRAM-SHA-512")
# RFC 7677 asks for at least 4096 iterations; Kafka's own default is the same.
MIN_ITERATIONS: Final = 4096
MAX_USER_NAME: Final = 255


class UsersError(ValueError):
    """The users file says something kproxy cannot use; ``path`` names the entry (``alice.salt``)."""

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(f"{path}: {problem}" if path else problem)


@attrs.frozen(repr=False)
class ScramCredential:
    """What a broker keeps for one SCRAM user and mechanism; enough to verify, not to log in."""

    salt: bytes
    iterations: int
    stored_key: bytes
    server_key: bytes

    def __repr__(self) -> str:
        return f"ScramCredential(iterations={self.iterations})"


def new_credential(mechanism: str, password: str, iterations: int = MIN_ITERATIONS,
                   salt: bytes | None = None) -> ScramCredential:
    """Derive the stored credential for ``password`` (a fresh random salt unless one is given)."""
    salt_, stored, server, count = ScramMechanism(mechanism).make_auth_info(
        password, iteration_count=iterations, salt=salt)
    return ScramCredential(salt_, count, stored, server)


def password_matches(mechanism: str, credential: ScramCredential, password: str) -> bool:
    """Whether ``password`` derives ``credential``'s stored key (PLAIN checked against SCRAM keys)."""
    derived = new_credential(mechanism, password, credential.iterations, credential.salt)
    return hmac.compare_digest(derived.stored_key, credential.stored_key)


@attrs.frozen
class UserBook:
    """Every user kproxy knows, by name, with a credential per SCRAM mechanism."""

    users: Mapping[str, Mapping[str, ScramCredential]] = attrs.field(factory=dict)

    def credential(self, user: str, mechanism: str) -> ScramCredential | None:
        return self.users.get(user, {}).get(mechanism)

    def with_user(self, user: str, credentials: Mapping[str, ScramCredential]) -> UserBook:
        """A book with ``user``'s credentials for these mechanisms replaced (others kept)."""
        problem = user_name_problem(user)
        if problem is not None:
            raise UsersError(user, problem)
        users = {name: dict(creds) for name, creds in self.users.items()}
        users.setdefault(user, {}).update(credentials)
        return UserBook(users)


def user_name_problem(user: str) -> str | None:
    if not user:
        return "a user name must not be empty"
    if len(user.encode()) > MAX_USER_NAME:
        return f"a user name is at most {MAX_USER_NAME} bytes"
    if any(ord(c) < 32 for c in user):
        return "a user name must not hold control characters"
    return None


def users_from_mapping(data: Any) -> UserBook:
    """The book a parsed users file describes: ``{users: {NAME: {MECHANISM: {salt, iterations,
    stored_key, server_key}}}}`` with the byte strings in base64. UsersError says what is wrong."""
    if data is None:
        return UserBook()
    if not isinstance(data, Mapping) or set(data) - {"users"}:
        raise UsersError("", "expected a mapping with one key, 'users'")
    entries = data.get("users") or {}
    if not isinstance(entries, Mapping):
        raise UsersError("users", "expected a mapping of user names")
    users: dict[str, dict[str, ScramCredential]] = {}
    for name, mechanisms in entries.items():
        path = f"users.{name}"
        if not isinstance(name, str):
            raise UsersError(path, "a user name must be a string")
        problem = user_name_problem(name)
        if problem is not None:
            raise UsersError(path, problem)
        if not isinstance(mechanisms, Mapping) or not mechanisms:
            raise UsersError(path, f"expected a mapping of mechanisms ({', '.join(SCRAM_MECHANISMS)})")
        creds: dict[str, ScramCredential] = {}
        for mechanism, fields in mechanisms.items():
            if mechanism not in SCRAM_MECHANISMS:
                raise UsersError(f"{path}.{mechanism}", f"unknown mechanism; expected one of "
                                                         f"{', '.join(SCRAM_MECHANISMS)}")
            creds[mechanism] = _credential(f"{path}.{mechanism}", fields)
        users[name] = creds
    return UserBook(users)


def users_to_mapping(book: UserBook) -> dict[str, Any]:
    """The inverse of ``users_from_mapping``, for writing the file."""
    return {"users": {
        name: {mech: {"salt": _b64(c.salt), "iterations": c.iterations, "stored_key": _b64(c.stored_key),
                      "server_key": _b64(c.server_key)} for mech, c in sorted(creds.items())}
        for name, creds in sorted(book.users.items())}}


def _credential(path: str, fields: Any) -> ScramCredential:
    if not isinstance(fields, Mapping):
        raise UsersError(path, "expected salt, iterations, stored_key and server_key")
    unknown = set(fields) - {"salt", "iterations", "stored_key", "server_key"}
    if unknown:
        raise UsersError(f"{path}.{sorted(unknown)[0]}", "unknown key (a users file keeps salt, iterations, "
                                                         "stored_key and server_key, never a password)")
    iterations = fields.get("iterations")
    if type(iterations) is not int or iterations < MIN_ITERATIONS:
        raise UsersError(f"{path}.iterations", f"must be an integer of at least {MIN_ITERATIONS}")
    values = {}
    for key in ("salt", "stored_key", "server_key"):
        text = fields.get(key)
        if not isinstance(text, str):
            raise UsersError(f"{path}.{key}", "missing (base64)")
        try:
            values[key] = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise UsersError(f"{path}.{key}", "not valid base64") from None
        if not values[key]:
            raise UsersError(f"{path}.{key}", "must not be empty")
    return ScramCredential(values["salt"], iterations, values["stored_key"], values["server_key"])


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")

"""The one small interface every KMS client has, and its error.

A client makes a DEK under a named KEK (``generate``: the plaintext key and the KEK's wrapping of
it, always with the KEK's latest version), unwraps a wrapped DEK (``unwrap``), says whether a KEK
exists (``kek_exists``) and describes itself without secrets (``describe``). It holds no DEK and
caches nothing: lifetimes, caches, single flight and backoff are ``kproxy.envelope.keys``' and
``kproxy.kms.service``'s. Neither keys nor tokens reach a log line, a span or an error message.
"""

from __future__ import annotations

from typing import Final, NamedTuple, Protocol

from kproxy.envelope.format import Kms
from kproxy.protocol.errors import KProxyError

# Why a KMS call failed, for metrics and logs (``KmsError.reason``).
RETRIABLE_REASONS: Final = ("unreachable", "timeout", "server_error", "throttled", "token")
FINAL_REASONS: Final = ("unknown_kek", "denied", "refused", "bad_answer", "wrong_kms")


class KmsError(KProxyError):
    """A KMS call failed. ``retriable``: the same call may succeed later (the KMS could not be
    reached, timed out, answered 5xx or 429, or the token file could not be read); otherwise the
    KMS said no (an unknown KEK, permission denied, a wrapped DEK it cannot unwrap) or answered
    something that is not a DEK. ``reason`` is one word from the lists above."""

    def __init__(self, reason: str, message: str, *, retriable: bool) -> None:
        self.reason = reason
        self.retriable = retriable
        super().__init__(message)


class NewKey(NamedTuple):
    """A fresh DEK: its 32 bytes, and its wrapping by the KEK in the client's compact form."""

    key: bytes
    wrapped: bytes

    def __repr__(self) -> str:
        return f"NewKey(key=<32 bytes>, wrapped={len(self.wrapped)} bytes)"


class KmsClient(Protocol):
    """What ``kproxy.kms.service.KeyService`` needs of a KMS."""

    kind: Kms     # the envelope's byte naming this kind of KMS
    name: str     # "vault", "aws", "pkcs11" or "local": the backend label of metrics and logs

    async def generate(self, kek: str) -> NewKey: ...

    async def unwrap(self, kek: str, wrapped: bytes) -> bytes: ...

    async def kek_exists(self, kek: str) -> bool: ...

    def describe(self) -> str: ...

    async def aclose(self) -> None: ...

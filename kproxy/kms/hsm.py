"""A PKCS#11 token (an HSM, or SoftHSM for tests) as kproxy's KMS, through python-pkcs11 (the
``pkcs11`` extra). A KEK is an AES secret key on the token, named by its label (CKA_LABEL) and
allowed to wrap and unwrap (CKA_WRAP, CKA_UNWRAP). The token makes each DEK (a session key, never
stored) and wraps it with the KEK by AES key wrap with padding (CKM_AES_KEY_WRAP_PAD, RFC 5649);
unwrapping does the reverse. The KEK never leaves the token.

Several keys may share a label: the one with the highest CKA_ID (longer ids above shorter ones,
then bytewise) wraps new DEKs, and a wrapped DEK names the id that unwraps it. So a rotation is a
new key with the same label and a higher id; old records still open while the old key is there.

PKCS#11 logs an application in per token, not per session, and closing the last session logs it
out: so every client of one process shares one logged-in session per (module, token), counted,
and each call holds that session's lock. A library calls into the token synchronously: each call
runs in a worker thread, abandoned at the client's ``timeout_s``. The PIN is read from its file
when the session opens (the first call, and after the token was lost); it never reaches a log.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Final, TypeVar

import trio

from kproxy.envelope.format import Kms
from kproxy.kms.client import KmsError, NewKey
from kproxy.kms.settings import Pkcs11Settings
from kproxy.kms.vault import TokenFile
from kproxy.protocol.primitives import ShortBuffer, read_uvarint, write_uvarint

log = logging.getLogger("kproxy.kms")

T = TypeVar("T")
MAX_ID_BYTES: Final = 64
# A lost session: the next call opens the token again (retriable). Other PKCS#11 errors are final.
_SESSION_LOST: Final = ("SessionClosed", "SessionHandleInvalid", "DeviceRemoved", "DeviceError",
                        "TokenNotPresent", "TokenNotRecognised", "UserNotLoggedIn", "NoSuchToken",
                        "DeviceMemory", "HostMemory", "FunctionFailed", "OperationActive")


def key_order(key_id: bytes) -> tuple[int, bytes]:
    """How key ids of one label rank: the highest wraps new DEKs."""
    return len(key_id), key_id


def pack_wrapped(key_id: bytes, wrapped: bytes) -> bytes:
    """The envelope's form of a wrapped DEK: ``uvarint(len(id)) || CKA_ID || AES key wrap``."""
    return write_uvarint(len(key_id)) + key_id + wrapped


def unpack_wrapped(data: bytes) -> tuple[bytes, bytes]:
    """``(CKA_ID, wrapped)``; ValueError when ``data`` is not that form."""
    try:
        n, pos = read_uvarint(data, 0)
    except (IndexError, ShortBuffer):
        raise ValueError("no key id length") from None
    # RFC 5649 wraps a 32-byte key in 40 bytes.
    if n > MAX_ID_BYTES or len(data) != pos + n + 40:
        raise ValueError("not a wrapped 32-byte key")
    return bytes(data[pos:pos + n]), bytes(data[pos + n:])


class _Token:
    """One logged-in session on a token, shared by the process's clients of it (``users``)."""

    def __init__(self, module: str, label: str) -> None:
        self.module, self.label = module, label
        self.lock = threading.Lock()
        self.session: Any = None
        self.users = 0

    def open(self, pins: TokenFile) -> Any:
        """The session, opened and logged in if it is not (called with ``lock`` held)."""
        if self.session is None:
            import pkcs11

            lib = pkcs11.lib(self.module)
            token = lib.get_token(token_label=self.label)
            try:
                self.session = token.open(user_pin=pins.token())
            except pkcs11.exceptions.UserAlreadyLoggedIn:
                # Logged in by a session this process opened elsewhere (its login is ours too).
                self.session = token.open()
        return self.session

    def drop(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            try:
                session.close()
            except Exception:     # the token is gone already; nothing else to undo
                log.debug("kms: closing a lost PKCS#11 session failed", exc_info=True)


_TOKENS: dict[tuple[str, str], _Token] = {}
_TOKENS_LOCK = threading.Lock()


class Pkcs11Kms:
    """A ``KmsClient`` for a PKCS#11 token."""

    kind = Kms.PKCS11
    name = "pkcs11"

    def __init__(self, settings: Pkcs11Settings) -> None:
        try:
            import pkcs11  # noqa: F401
        except ImportError:
            raise KmsError("refused", "kms.pkcs11 needs python-pkcs11: pip install 'kproxy-kafka[pkcs11]'",
                           retriable=False) from None
        self.settings = settings
        self.pins = TokenFile(settings.pin_file, what="PIN")
        with _TOKENS_LOCK:
            key = (settings.module, settings.token_label)
            self._token = _TOKENS.setdefault(key, _Token(*key))
            self._token.users += 1
        self._closed = False

    def describe(self) -> str:
        return f"PKCS#11 token {self.settings.token_label!r} through {self.settings.module}"

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        token = self._token

        def release() -> None:
            with _TOKENS_LOCK:
                token.users -= 1
                if token.users > 0:
                    return
                del _TOKENS[(token.module, token.label)]
            with token.lock:
                token.drop()

        await trio.to_thread.run_sync(release)

    async def generate(self, kek: str) -> NewKey:
        def make(session: Any) -> NewKey:
            from pkcs11 import Attribute, KeyType, Mechanism

            key_id, key = self._wrapping_key(session, kek)
            dek = session.generate_key(KeyType.AES, 256, store=False,
                                       template={Attribute.SENSITIVE: False, Attribute.EXTRACTABLE: True})
            try:
                wrapped = key.wrap_key(dek, mechanism=Mechanism.AES_KEY_WRAP_PAD)
                value = bytes(dek[Attribute.VALUE])
            finally:
                dek.destroy()
            return NewKey(value, pack_wrapped(key_id, bytes(wrapped)))

        new = await self._call(f"data key under KEK {kek!r}", make)
        if len(new.key) != 32:
            raise KmsError("bad_answer", f"data key under KEK {kek!r}: the token made no 32-byte key", retriable=False)
        return new

    async def unwrap(self, kek: str, wrapped: bytes) -> bytes:
        what = f"unwrap with KEK {kek!r}"
        try:
            key_id, blob = unpack_wrapped(wrapped)
        except ValueError as e:
            raise KmsError("refused", f"{what}: the wrapped DEK is not a PKCS#11 wrapping ({e})", retriable=False) from None

        def unwrap(session: Any) -> bytes:
            from pkcs11 import Attribute, KeyType, Mechanism, ObjectClass
            from pkcs11.exceptions import PKCS11Error

            key = next((k for i, k in self._keys(session, kek) if i == key_id), None)
            if key is None:
                raise KmsError("unknown_kek", f"{what}: the token has no key labelled {kek!r} with id "
                                              f"{key_id.hex() or '(none)'}", retriable=False)
            try:
                dek = key.unwrap_key(ObjectClass.SECRET_KEY, KeyType.AES, blob, mechanism=Mechanism.AES_KEY_WRAP_PAD,
                                     store=False, template={Attribute.SENSITIVE: False, Attribute.EXTRACTABLE: True})
            except PKCS11Error as e:
                if type(e).__name__ in _SESSION_LOST:
                    raise
                # Tampered with, or wrapped by another key: the token's integrity check failed.
                raise KmsError("refused", f"{what}: the token refused the wrapped DEK ({type(e).__name__})",
                               retriable=False) from None
            try:
                return bytes(dek[Attribute.VALUE])
            finally:
                dek.destroy()

        key = await self._call(what, unwrap)
        if len(key) != 32:
            raise KmsError("bad_answer", f"{what}: the unwrapped key is not 32 bytes", retriable=False)
        return key

    async def kek_exists(self, kek: str) -> bool:
        def exists(session: Any) -> bool:
            try:
                self._wrapping_key(session, kek)
            except KmsError as e:
                if e.reason == "unknown_kek":
                    return False
                raise
            return True

        return await self._call(f"find KEK {kek!r}", exists)

    # -- on the token, in a worker thread, the session's lock held

    @staticmethod
    def _keys(session: Any, label: str) -> list[tuple[bytes, Any]]:
        """AES secret keys labelled ``label`` that may wrap and unwrap, with their ids."""
        from pkcs11 import Attribute, KeyType, ObjectClass

        out = []
        for key in session.get_objects({Attribute.CLASS: ObjectClass.SECRET_KEY, Attribute.LABEL: label,
                                         Attribute.KEY_TYPE: KeyType.AES}):
            if key[Attribute.WRAP] and key[Attribute.UNWRAP]:
                try:
                    key_id = bytes(key[Attribute.ID])
                except KeyError:
                    key_id = b""
                out.append((key_id, key))
        return out

    def _wrapping_key(self, session: Any, kek: str) -> tuple[bytes, Any]:
        keys = [(i, k) for i, k in self._keys(session, kek) if len(i) <= MAX_ID_BYTES]
        if not keys:
            raise KmsError("unknown_kek", f"the token {self.settings.token_label!r} has no AES key labelled "
                                          f"{kek!r} that may wrap and unwrap", retriable=False)
        return max(keys, key=lambda pair: key_order(pair[0]))

    async def _call(self, what: str, work: Callable[[Any], T]) -> T:
        from pkcs11.exceptions import PinIncorrect, PinLenRange, PKCS11Error

        token, timeout = self._token, self.settings.timeout_s

        def run() -> T:
            if not token.lock.acquire(timeout=timeout):
                raise KmsError("timeout", f"{what}: the token stayed busy for {timeout:g}s", retriable=True)
            try:
                session = token.open(self.pins)
                try:
                    return work(session)
                except PKCS11Error as e:
                    if type(e).__name__ in _SESSION_LOST:
                        token.drop()
                    raise
            finally:
                token.lock.release()

        try:
            with trio.fail_after(timeout + 1.0):
                return await trio.to_thread.run_sync(run, abandon_on_cancel=True)
        except trio.TooSlowError:
            raise KmsError("timeout", f"{what}: no answer from the token within {timeout:g}s", retriable=True) from None
        except (PinIncorrect, PinLenRange):
            raise KmsError("denied", f"{what}: the token refused the PIN in {self.settings.pin_file}",
                           retriable=False) from None
        except PKCS11Error as e:
            # The library's own message names the problem (a missing module, no such token), never a PIN.
            detail = str(e) or type(e).__name__
            if type(e).__name__ in _SESSION_LOST or "loading" in detail:
                raise KmsError("unreachable", f"{what}: {detail[:200]}", retriable=True) from None
            raise KmsError("refused", f"{what}: {type(e).__name__} {detail[:200]}", retriable=False) from None

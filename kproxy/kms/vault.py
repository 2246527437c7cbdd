"""HashiCorp Vault's and OpenBao's Transit engine as kproxy's KMS, over httpx (under trio through
anyio's backend detection): ``datakey/plaintext/NAME`` makes a DEK wrapped with the KEK's latest
version, ``decrypt/NAME`` unwraps one, ``keys/NAME`` says whether a KEK exists.

The token is read from a file, surrounding whitespace stripped, and read again whenever the file
changes (its size, modification time or inode), so a rotated token is used from the next call. The
token and every plaintext key stay out of logs and error messages; Vault's own error text is kept
(it names no secret).
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import re
from typing import Any, Final
from urllib.parse import quote

import httpx

from kproxy.envelope.format import Kms
from kproxy.kms.client import KmsError, NewKey
from kproxy.kms.settings import VaultSettings
from kproxy.protocol.primitives import ShortBuffer, read_uvarint, write_uvarint

log = logging.getLogger("kproxy.kms")
# httpx logs every request at INFO; kproxy logs what matters about KMS calls itself.
logging.getLogger("httpx").setLevel(logging.WARNING)

MAX_ANSWER_BYTES: Final = 64 << 10     # a Transit answer is a few hundred bytes
_CIPHERTEXT: Final = re.compile(r"^vault:v([1-9][0-9]{0,9}):([A-Za-z0-9+/=]+)$")
# Compact forms of a Transit ciphertext ("vault:vN:BASE64"): the version and the raw bytes (60 for a
# 32-byte DEK under an AES-GCM KEK) instead of the 89 characters; any other form is kept as text.
_COMPACT: Final = 0x01
_TEXT: Final = 0x00


def compact_ciphertext(text: str) -> bytes:
    """``vault:vN:BASE64`` as ``01 || uvarint(N) || raw``; any other text as ``00 || text``."""
    m = _CIPHERTEXT.match(text)
    if m is not None:
        try:
            raw = base64.b64decode(m.group(2), validate=True)
        except binascii.Error:
            raw = b""
        version = int(m.group(1))
        if raw and base64.b64encode(raw).decode() == m.group(2) and version < 1 << 28:
            return bytes((_COMPACT,)) + write_uvarint(version) + raw
    return bytes((_TEXT,)) + text.encode()


def expand_ciphertext(wrapped: bytes) -> str:
    """The Transit ciphertext text a compact form stands for; ValueError if it is not one."""
    if not wrapped:
        raise ValueError("empty")
    if wrapped[0] == _TEXT:
        return wrapped[1:].decode()
    if wrapped[0] != _COMPACT:
        raise ValueError("unknown form")
    try:
        version, pos = read_uvarint(wrapped, 1)
    except (IndexError, ShortBuffer):
        raise ValueError("bad version") from None
    if pos >= len(wrapped) or version == 0:
        raise ValueError("bad version")
    return f"vault:v{version}:{base64.b64encode(wrapped[pos:]).decode()}"


class TokenFile:
    """A token (or a PIN: ``what``) kept in a file, read again when the file changes."""

    def __init__(self, path: str, what: str = "token") -> None:
        self.path = path
        self.what = what
        self._seen: tuple[int, int, int, int] | None = None
        self._token = ""
        self.reads = 0

    def token(self) -> str:
        try:
            st = os.stat(self.path)
            seen = (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns)
            if seen != self._seen:
                with open(self.path, encoding="utf-8") as f:
                    token = f.read(64 << 10).strip()
                self.reads += 1
                self._seen, self._token = seen, token
        except (OSError, UnicodeDecodeError) as e:
            self._seen = None
            # Retriable: a token file being replaced comes back; the operator sees the reason.
            raise KmsError("token", f"cannot read the {self.what} file {self.path}: "
                                    f"{getattr(e, 'strerror', None) or type(e).__name__}", retriable=True) from None
        if not self._token:
            raise KmsError("token", f"the {self.what} file {self.path} is empty", retriable=True)
        return self._token


def _classify(status: int, errors: str, what: str) -> KmsError:
    if status == 403:
        return KmsError("denied", f"{what}: permission denied (HTTP 403){errors}", retriable=False)
    if status == 429:
        return KmsError("throttled", f"{what}: rate limited (HTTP 429){errors}", retriable=True)
    if status >= 500 or status == 412:
        # 503: sealed or standby; 412: a performance standby not yet consistent (Vault Enterprise)
        return KmsError("server_error", f"{what}: HTTP {status}{errors}", retriable=True)
    if status == 404 or "key not found" in errors or "no existing key" in errors:
        return KmsError("unknown_kek", f"{what}: the KEK does not exist (HTTP {status}){errors}", retriable=False)
    return KmsError("refused", f"{what}: HTTP {status}{errors}", retriable=False)


def _key(text: Any, what: str) -> bytes:
    try:
        key = base64.b64decode(text, validate=True) if isinstance(text, str) else b""
    except binascii.Error:
        key = b""
    if len(key) != 32:
        raise KmsError("bad_answer", f"{what}: the answer holds no 32-byte key", retriable=False)
    return key


class VaultTransit:
    """A ``KmsClient`` for Vault's or OpenBao's Transit engine."""

    kind = Kms.VAULT_TRANSIT
    name = "vault"

    def __init__(self, settings: VaultSettings, *, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.settings = settings
        self.tokens = TokenFile(settings.token_file)
        self._prefix = f"/v1/{settings.mount}"
        headers = {"X-Vault-Namespace": settings.namespace} if settings.namespace else {}
        self._client = httpx.AsyncClient(
            base_url=settings.url.rstrip("/"), headers=headers, transport=transport,
            timeout=httpx.Timeout(settings.timeout_s), verify=settings.ca_file or True,
            follow_redirects=False, trust_env=False)

    def describe(self) -> str:
        return f"Vault/OpenBao Transit at {self.settings.url}, mount {self.settings.mount}"

    async def aclose(self) -> None:
        await self._client.aclose()

    async def generate(self, kek: str) -> NewKey:
        what = f"datakey for KEK {kek!r}"
        # No key_version: Transit wraps with the KEK's latest version, so a rotation reaches new DEKs.
        data = await self._call("POST", f"datakey/plaintext/{_segment(kek)}", {"bits": 256}, what)
        text = data.get("ciphertext")
        if not isinstance(text, str) or not text:
            raise KmsError("bad_answer", f"{what}: the answer holds no ciphertext", retriable=False)
        return NewKey(_key(data.get("plaintext"), what), compact_ciphertext(text))

    async def unwrap(self, kek: str, wrapped: bytes) -> bytes:
        what = f"decrypt with KEK {kek!r}"
        try:
            text = expand_ciphertext(wrapped)
        except (ValueError, UnicodeDecodeError):
            raise KmsError("refused", f"{what}: the wrapped DEK is not a Transit ciphertext", retriable=False) from None
        data = await self._call("POST", f"decrypt/{_segment(kek)}", {"ciphertext": text}, what)
        return _key(data.get("plaintext"), what)

    async def kek_exists(self, kek: str) -> bool:
        what = f"read KEK {kek!r}"
        try:
            data = await self._call("GET", f"keys/{_segment(kek)}", None, what)
        except KmsError as e:
            if e.reason == "unknown_kek":
                return False
            raise
        return bool(data.get("supports_encryption", True)) and not data.get("soft_deleted", False)

    async def _call(self, method: str, path: str, body: dict[str, Any] | None, what: str) -> dict[str, Any]:
        token = self.tokens.token()
        try:
            async with self._client.stream(method, f"{self._prefix}/{path}", json=body,
                                           headers={"X-Vault-Token": token}) as resp:
                raw = bytearray()
                async for chunk in resp.aiter_bytes():
                    raw += chunk
                    if len(raw) > MAX_ANSWER_BYTES:
                        raise KmsError("bad_answer", f"{what}: answer larger than {MAX_ANSWER_BYTES} bytes",
                                       retriable=False)
                status = resp.status_code
        except httpx.TimeoutException:
            raise KmsError("timeout", f"{what}: no answer from {self.settings.url} within "
                                      f"{self.settings.timeout_s:g}s", retriable=True) from None
        except httpx.TransportError as e:
            raise KmsError("unreachable", f"{what}: {self.settings.url} unreachable ({type(e).__name__})",
                           retriable=True) from None
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = None
        if status != 200:
            errors = answer.get("errors") if isinstance(answer, dict) else None
            detail = "; ".join(str(e)[:200] for e in errors[:3]) if isinstance(errors, list) and errors else ""
            raise _classify(status, f": {detail}" if detail else "", what)
        data = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(data, dict):
            raise KmsError("bad_answer", f"{what}: the answer is not Transit's JSON", retriable=False)
        return data


def _segment(name: str) -> str:
    """A KEK name as one URL path segment (Transit key names never hold '/')."""
    if not name or "/" in name or name in (".", "..") or not name.isprintable():
        raise KmsError("unknown_kek", f"{name!r} is not a Transit key name", retriable=False)
    return quote(name, safe="")

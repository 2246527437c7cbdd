"""A local key file as kproxy's KMS: FOR DEVELOPMENT ONLY. The KEKs sit in plain in a JSON file on
the proxy's own disk, so whoever reads the file (or a backup of it) can open every record; a real
KMS keeps KEKs where the proxy can only ask for wraps and unwraps. kproxy logs a warning when it
opens one, and ``kproxy check`` refuses it in ``mode: gateway`` unless explicitly allowed.

The file: ``{"kproxy_local_keys": 1, "keks": {"NAME": ["BASE64 of 32 bytes", ...]}}``, one list of
versions per KEK, the last the latest (append one to rotate). It is read again when it changes.
A wrapped DEK is ``uvarint(version) || nonce || AES-256-GCM(KEK version, DEK)`` (61 bytes).
"""

from __future__ import annotations

import base64
import json
import logging
import os
from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kproxy.envelope.format import Kms
from kproxy.kms.client import KmsError, NewKey
from kproxy.protocol.primitives import ShortBuffer, read_uvarint, write_uvarint

log = logging.getLogger("kproxy.kms")

FORMAT: Final = 1
_AAD: Final = b"kproxy local KEK\x00"


def _aad(kek: str, version: int) -> bytes:
    return _AAD + kek.encode() + b"\x00" + str(version).encode()


def _versions(path: str) -> dict[str, list[bytes]]:
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or doc.get("kproxy_local_keys") != FORMAT or not isinstance(doc.get("keks"), dict):
        raise ValueError(f'not a kproxy local key file (expected {{"kproxy_local_keys": {FORMAT}, "keks": {{...}}}})')
    out: dict[str, list[bytes]] = {}
    for name, versions in doc["keks"].items():
        if not isinstance(versions, list) or not versions:
            raise ValueError(f"KEK {name!r}: expected a list of base64 keys")
        keys = []
        for i, text in enumerate(versions, 1):
            key = base64.b64decode(text, validate=True) if isinstance(text, str) else b""
            if len(key) != 32:
                raise ValueError(f"KEK {name!r} version {i}: not 32 bytes of base64")
            keys.append(key)
        out[name] = keys
    return out


def write_key_file(path: str, names: list[str], *, rotate: str | None = None) -> None:
    """Create ``path`` with a new KEK for each of ``names`` (mode 0600), or with ``rotate``, add a
    version to that KEK of the existing file."""
    keks: dict[str, list[str]] = {}
    if rotate is not None:
        keks = {n: [base64.b64encode(k).decode() for k in v] for n, v in _versions(path).items()}
        names = [rotate]
    for name in names:
        keks.setdefault(name, []).append(base64.b64encode(AESGCM.generate_key(256)).decode())
    text = json.dumps({"kproxy_local_keys": FORMAT, "keks": keks}, indent=1)
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text + "\n")
    os.replace(tmp, path)


class LocalKeyFile:
    """A ``KmsClient`` over a local key file (development only)."""

    kind = Kms.LOCAL_FILE
    name = "local"

    def __init__(self, path: str) -> None:
        self.path = path
        self._seen: tuple[int, int, int] | None = None
        self._keks: dict[str, list[bytes]] = {}
        self.calls = 0
        log.warning("kms: using the local key file %s: its key-encryption keys sit in plain on this machine, "
                    "so anyone who reads the file can decrypt every record. For development only; use "
                    "Vault/OpenBao, AWS KMS or an HSM for data that matters.", path)

    def describe(self) -> str:
        return f"local key file {self.path} (development only)"

    async def aclose(self) -> None:
        return None

    def _load(self) -> dict[str, list[bytes]]:
        try:
            st = os.stat(self.path)
            seen = (st.st_ino, st.st_size, st.st_mtime_ns)
            if seen != self._seen:
                self._keks, self._seen = _versions(self.path), seen
        except OSError as e:
            raise KmsError("unreachable", f"cannot read the key file {self.path}: {e.strerror}", retriable=True) from None
        except ValueError as e:
            raise KmsError("refused", f"{self.path}: {e}", retriable=False) from None
        return self._keks

    def _kek(self, kek: str) -> list[bytes]:
        versions = self._load().get(kek)
        if versions is None:
            raise KmsError("unknown_kek", f"the key file {self.path} has no KEK {kek!r}", retriable=False)
        return versions

    async def generate(self, kek: str) -> NewKey:
        self.calls += 1
        versions = self._kek(kek)
        version = len(versions)
        dek = AESGCM.generate_key(256)
        nonce = os.urandom(12)
        sealed = AESGCM(versions[-1]).encrypt(nonce, dek, _aad(kek, version))
        return NewKey(dek, write_uvarint(version) + nonce + sealed)

    async def unwrap(self, kek: str, wrapped: bytes) -> bytes:
        self.calls += 1
        versions = self._kek(kek)
        try:
            version, pos = read_uvarint(wrapped, 0)
        except (IndexError, ShortBuffer):
            version, pos = 0, 0
        if not 1 <= version <= len(versions) or len(wrapped) != pos + 12 + 48:
            raise KmsError("refused", f"KEK {kek!r} cannot unwrap this DEK (no version {version}, or "
                                      f"not a wrapped key)", retriable=False)
        try:
            return AESGCM(versions[version - 1]).decrypt(wrapped[pos:pos + 12], wrapped[pos + 12:],
                                                         _aad(kek, version))
        except InvalidTag:
            raise KmsError("refused", f"KEK {kek!r} version {version} cannot unwrap this DEK",
                           retriable=False) from None

    async def kek_exists(self, kek: str) -> bool:
        return kek in self._load()


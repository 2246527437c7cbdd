"""The ``kms:`` section's settings, checked on construction, and the checks ``kproxy check`` makes of
them: one backend (``vault``, ``aws``, ``pkcs11`` or ``local``), https except on loopback, the token,
PIN and module files there, and a local key file refused in ``mode: gateway`` unless
``allow_in_gateway`` says otherwise.

A bad value raises ``KmsSettingError`` naming the setting (``kms.vault.url``); the YAML loader adds
the file and line when the section is wired into ``kproxy.config``.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from typing import Any, Final
from urllib.parse import urlsplit

import attrs

_MOUNT: Final = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$")
MAX_TIMEOUT_S: Final = 60.0


class KmsSettingError(ValueError):
    """A ``kms:`` setting breaks its rule; ``path`` names it (``("kms", "vault", "url")``)."""

    def __init__(self, path: tuple[str, ...], problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(f"{'.'.join(path)}: {problem}")


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def url_problem(url: str) -> str | None:
    """Why ``url`` cannot be a KMS endpoint: https only, plain http on a loopback address only (a DEK
    or a token sent in clear elsewhere could be read by anyone on the path)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
    except ValueError:
        return f"{url!r} is not a URL"
    if parts.scheme not in ("https", "http") or not host:
        return f"{url!r} is not an https:// URL"
    if parts.scheme == "http" and not is_loopback(host):
        return f"http:// is allowed only for a loopback address; use https:// for {host}"
    if parts.username or parts.password:
        return "put the token in token_file, not in the URL"
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        return f"give the server's address only (scheme, host and port), not {parts.path or '?' + parts.query}"
    return None


def _fail(section: str, name: str, problem: str) -> KmsSettingError:
    return KmsSettingError(("kms", section, name), problem)


def _timeout(section: str, value: float) -> None:
    if not (isinstance(value, int | float) and 0 < value <= MAX_TIMEOUT_S):
        raise _fail(section, "timeout_s", f"must be a number of seconds above 0 and at most {MAX_TIMEOUT_S:g}, "
                                          f"got {value!r}")


def _file(section: str, name: str, value: Any, required: bool = True) -> None:
    if value is None and not required:
        return
    if not isinstance(value, str) or not value.strip():
        raise _fail(section, name, f"expected a file name, got {value!r}")


@attrs.frozen
class VaultSettings:
    """HashiCorp Vault's or OpenBao's Transit engine: ``url`` of the server, ``token_file`` holding
    the token (reread when it changes), the engine's ``mount``."""

    url: str
    token_file: str
    mount: str = "transit"
    namespace: str | None = None     # X-Vault-Namespace (Vault Enterprise, OpenBao namespaces)
    ca_file: str | None = None       # CA bundle for the server's certificate (default: the system's)
    timeout_s: float = 5.0           # per HTTP call, connecting included

    def __attrs_post_init__(self) -> None:
        problem = url_problem(self.url) if isinstance(self.url, str) else f"expected a URL, got {self.url!r}"
        if problem is not None:
            raise _fail("vault", "url", problem)
        _file("vault", "token_file", self.token_file)
        if not isinstance(self.mount, str) or not _MOUNT.match(self.mount):
            raise _fail("vault", "mount", f"{self.mount!r} is not a mount path (letters, digits, '_', '.', '-', "
                                          f"parts joined by '/')")
        _file("vault", "ca_file", self.ca_file, required=False)
        _timeout("vault", self.timeout_s)


@attrs.frozen
class LocalKeySettings:
    """KEKs in a local file: for development only (kproxy warns at start, and ``kproxy check``
    refuses it in ``mode: gateway`` unless ``allow_in_gateway``)."""

    file: str
    allow_in_gateway: bool = False

    def __attrs_post_init__(self) -> None:
        _file("local", "file", self.file)
        if not isinstance(self.allow_in_gateway, bool):
            raise _fail("local", "allow_in_gateway", f"expected true or false, got {self.allow_in_gateway!r}")


@attrs.frozen
class AwsKmsSettings:
    """The AWS KMS API: ``region``, and ``endpoint_url`` for a private endpoint or an emulator.
    Credentials come from boto3's usual chain (environment, shared files, instance role)."""

    region: str
    endpoint_url: str | None = None
    timeout_s: float = 5.0

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.region, str) or not re.fullmatch(r"[a-z0-9-]{1,40}", self.region):
            raise _fail("aws", "region", f"{self.region!r} is not an AWS region name")
        if self.endpoint_url is not None:
            problem = url_problem(self.endpoint_url)
            if problem is not None:
                raise _fail("aws", "endpoint_url", problem)
        _timeout("aws", self.timeout_s)


@attrs.frozen
class Pkcs11Settings:
    """A PKCS#11 token (an HSM, or SoftHSM): ``module``, the path of the vendor's PKCS#11 library;
    ``token_label``, the token's label; ``pin_file`` holding the user PIN (surrounding whitespace
    stripped). KEKs are AES secret keys on the token, named by their label."""

    module: str
    token_label: str
    pin_file: str
    timeout_s: float = 5.0           # per call, waiting for the token included

    def __attrs_post_init__(self) -> None:
        _file("pkcs11", "module", self.module)
        if not isinstance(self.token_label, str) or not 0 < len(self.token_label.encode()) <= 32:
            raise _fail("pkcs11", "token_label", f"expected a token label of 1 to 32 bytes, got {self.token_label!r}")
        _file("pkcs11", "pin_file", self.pin_file)
        _timeout("pkcs11", self.timeout_s)


BACKENDS: Final = ("vault", "aws", "pkcs11", "local")


@attrs.frozen
class KmsSettings:
    """The ``kms:`` section: exactly one backend."""

    vault: VaultSettings | None = None
    aws: AwsKmsSettings | None = None
    local: LocalKeySettings | None = None
    pkcs11: Pkcs11Settings | None = None

    def __attrs_post_init__(self) -> None:
        given = [n for n in BACKENDS if getattr(self, n) is not None]
        if len(given) != 1:
            raise KmsSettingError(("kms",), "needs exactly one of vault, aws, pkcs11 or local" if not given
                                  else f"names {' and '.join(given)}: give exactly one")

    @property
    def backend(self) -> str:
        return next(n for n in BACKENDS if getattr(self, n) is not None)


_SECTIONS: Final[Mapping[str, type]] = {"vault": VaultSettings, "aws": AwsKmsSettings, "pkcs11": Pkcs11Settings,
                                        "local": LocalKeySettings}


def kms_settings(data: Any) -> KmsSettings:
    """``KmsSettings`` from the ``kms:`` mapping as YAML gives it; KmsSettingError names what is wrong."""
    if not isinstance(data, Mapping):
        raise KmsSettingError(("kms",), f"expected a mapping with one of vault, aws, pkcs11 or local, got {data!r}")
    sections: dict[str, Any] = {}
    for name, body in data.items():
        cls = _SECTIONS.get(name)
        if cls is None:
            raise KmsSettingError(("kms", str(name)), "unknown KMS; kproxy knows vault, aws, pkcs11 and local")
        if not isinstance(body, Mapping):
            raise KmsSettingError(("kms", name), f"expected a mapping, got {body!r}")
        known = {f.name for f in attrs.fields(cls)}
        for key in body:
            if key not in known:
                raise KmsSettingError(("kms", name, str(key)), f"unknown setting; {name} takes "
                                                               f"{', '.join(sorted(known))}")
        try:
            sections[name] = cls(**body)
        except TypeError:
            missing = [f.name for f in attrs.fields(cls) if f.default is attrs.NOTHING and f.name not in body]
            raise KmsSettingError(("kms", name, missing[0] if missing else "?"), "is required") from None
    return KmsSettings(**sections)


def file_problems(settings: KmsSettings) -> list[KmsSettingError]:
    """Files the settings name that cannot be read now (for ``kproxy check`` and start)."""
    named: list[tuple[tuple[str, ...], str]] = []
    if settings.vault is not None:
        named.append((("kms", "vault", "token_file"), settings.vault.token_file))
        if settings.vault.ca_file is not None:
            named.append((("kms", "vault", "ca_file"), settings.vault.ca_file))
    if settings.local is not None:
        named.append((("kms", "local", "file"), settings.local.file))
    if settings.pkcs11 is not None:
        named.append((("kms", "pkcs11", "module"), settings.pkcs11.module))
        named.append((("kms", "pkcs11", "pin_file"), settings.pkcs11.pin_file))
    out = []
    for path, name in named:
        if not os.access(name, os.R_OK) or not os.path.isfile(name):
            why = "does not exist" if not os.path.exists(name) else "is not a readable file"
            out.append(KmsSettingError(path, f"{name} {why}"))
    return out


def local_key_problem(settings: KmsSettings, mode: str) -> KmsSettingError | None:
    """A local key file in a gateway: refused unless explicitly allowed (it holds KEKs in plain on
    the gateway's disk, where a KMS would keep them out of the proxy's reach)."""
    local = settings.local
    if local is None or mode != "gateway" or local.allow_in_gateway:
        return None
    return KmsSettingError(("kms", "local"), "a local key file is for development only and mode: gateway "
                                             "refuses it; use vault, aws or pkcs11, or set allow_in_gateway: true")


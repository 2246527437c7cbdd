"""The ``kms:`` section: which KMS holds the key-encryption keys (KEKs) that record encryption wraps
its data keys with (``vault``, ``aws``, a ``pkcs11`` token or a development-only ``local`` key file), and how long a data
key serves. The values are checked here like every setting; ``kproxy.kms.settings`` turns the
section into the client's own settings (``KmsConfig.client_settings``)."""

from typing import Any

import attrs

from kproxy.config.checks import SettingError, check_files, path_of, setting, with_checks


def _url_problem(url: str) -> str | None:
    # kproxy.kms.settings holds the rule (https, or http on loopback); imported here so that the
    # config package does not pull the KMS clients in.
    from kproxy.kms.settings import url_problem

    return url_problem(url)


@attrs.frozen(field_transformer=with_checks)
class VaultKmsConfig:
    """HashiCorp Vault's or OpenBao's Transit engine: the server's ``url`` (https, or http on a
    loopback address), ``token_file`` holding the token (reread when it changes), the engine's
    ``mount``."""

    url: str
    token_file: str = setting(file=True)
    mount: str = "transit"
    namespace: str | None = None
    ca_file: str | None = setting(None, file=True)
    timeout_s: float = setting(5.0, above=0, max=60)

    def __attrs_post_init__(self) -> None:
        problem = _url_problem(self.url)
        if problem is not None:
            raise SettingError(path_of(self, "url"), problem)
        from kproxy.kms.settings import KmsSettingError, VaultSettings

        try:
            VaultSettings(self.url, self.token_file, self.mount, self.namespace, self.ca_file, self.timeout_s)
        except KmsSettingError as e:
            raise SettingError(path_of(self, e.path[-1]), e.problem) from None
        check_files(self)


@attrs.frozen(field_transformer=with_checks)
class AwsKmsConfig:
    """The AWS KMS API: ``region``, and ``endpoint_url`` for a private endpoint or an emulator.
    Credentials come from boto3's usual chain."""

    region: str
    endpoint_url: str | None = None
    timeout_s: float = setting(5.0, above=0, max=60)

    def __attrs_post_init__(self) -> None:
        from kproxy.kms.settings import AwsKmsSettings, KmsSettingError

        try:
            AwsKmsSettings(self.region, self.endpoint_url, self.timeout_s)
        except KmsSettingError as e:
            raise SettingError(path_of(self, e.path[-1]), e.problem) from None


@attrs.frozen(field_transformer=with_checks)
class Pkcs11KmsConfig:
    """A PKCS#11 token (an HSM, or SoftHSM): the vendor's PKCS#11 library (``module``), the token's
    label, and ``pin_file`` holding the user PIN. KEKs are AES keys on the token, named by label."""

    module: str = setting(file=True)
    token_label: str = setting()
    pin_file: str = setting(file=True)
    timeout_s: float = setting(5.0, above=0, max=60)

    def __attrs_post_init__(self) -> None:
        from kproxy.kms.settings import KmsSettingError, Pkcs11Settings

        check_files(self)
        try:
            Pkcs11Settings(self.module, self.token_label, self.pin_file, self.timeout_s)
        except KmsSettingError as e:
            raise SettingError(path_of(self, e.path[-1]), e.problem) from None


@attrs.frozen(field_transformer=with_checks)
class LocalKmsConfig:
    """KEKs in a local file: for development only. kproxy warns at start, and a ``mode: gateway``
    config refuses it unless ``allow_in_gateway`` is true."""

    file: str = setting(file=True)
    allow_in_gateway: bool = False

    def __attrs_post_init__(self) -> None:
        check_files(self)


@attrs.frozen(field_transformer=with_checks)
class KmsConfig:
    """Exactly one backend, and the data keys' lifetimes: a DEK seals at most ``dek_max_records``
    records for at most ``dek_max_age_s``; unwrapped DEKs are cached for at most ``cache_age_s``
    (which also bounds how long a KEK revoked in the KMS still opens records here)."""

    vault: VaultKmsConfig | None = None
    aws: AwsKmsConfig | None = None
    local: LocalKmsConfig | None = None
    pkcs11: Pkcs11KmsConfig | None = None
    dek_max_records: int = setting(1 << 24, min=1, max=1 << 30)
    dek_max_age_s: float = setting(600.0, above=0)
    cache_entries: int = setting(1024, min=1)
    cache_age_s: float = setting(600.0, above=0)

    def __attrs_post_init__(self) -> None:
        given = [n for n in ("vault", "aws", "pkcs11", "local") if getattr(self, n) is not None]
        if len(given) != 1:
            raise SettingError(path_of(self, "vault")[:-1],
                               "needs exactly one of vault, aws, pkcs11 or local" if not given
                               else f"names {' and '.join(given)}: give exactly one")

    @property
    def backend(self) -> str:
        return next(n for n in ("vault", "aws", "pkcs11", "local") if getattr(self, n) is not None)

    def client_settings(self) -> Any:
        """The KMS client's settings (``kproxy.kms.settings.KmsSettings``)."""
        from kproxy.kms import settings as s

        if self.vault is not None:
            v = self.vault
            return s.KmsSettings(vault=s.VaultSettings(v.url, v.token_file, v.mount, v.namespace, v.ca_file,
                                                       v.timeout_s))
        if self.aws is not None:
            a = self.aws
            return s.KmsSettings(aws=s.AwsKmsSettings(a.region, a.endpoint_url, a.timeout_s))
        if self.pkcs11 is not None:
            p = self.pkcs11
            return s.KmsSettings(pkcs11=s.Pkcs11Settings(p.module, p.token_label, p.pin_file, p.timeout_s))
        assert self.local is not None
        return s.KmsSettings(local=s.LocalKeySettings(self.local.file, self.local.allow_in_gateway))

    def key_policy(self) -> Any:
        """The DEK lifetimes and cache bounds (``kproxy.envelope.KeyPolicy``)."""
        from kproxy.envelope.keys import KeyPolicy

        return KeyPolicy(max_records=self.dek_max_records, max_age_s=self.dek_max_age_s,
                         cache_entries=self.cache_entries, cache_age_s=self.cache_age_s)

"""The KMS backends by name: the one place that turns `kms:` settings into a client.

Each backend is imported only when it is configured, so boto3 loads only for `kms.aws` and python-pkcs11 only for `kms.pkcs11`.
"""

from __future__ import annotations

from kproxy.kms.client import KmsClient
from kproxy.kms.settings import KmsSettings


def open_client(settings: KmsSettings) -> KmsClient:
    """The client for the configured backend (imported here, so each backend loads only its own)."""
    if settings.vault is not None:
        from kproxy.kms.vault import VaultTransit

        return VaultTransit(settings.vault)
    if settings.aws is not None:
        from kproxy.kms.aws import AwsKms

        return AwsKms(settings.aws)
    if settings.pkcs11 is not None:
        from kproxy.kms.hsm import Pkcs11Kms

        return Pkcs11Kms(settings.pkcs11)
    assert settings.local is not None
    from kproxy.kms.local import LocalKeyFile

    return LocalKeyFile(settings.local.file)

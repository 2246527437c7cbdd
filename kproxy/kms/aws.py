"""The AWS KMS API as kproxy's KMS, through boto3 (the ``aws`` extra): ``GenerateDataKey`` makes a DEK
under a KEK named by key id, ARN or ``alias/NAME``, ``Decrypt`` unwraps one, ``DescribeKey`` says
whether a KEK exists and is enabled. boto3 is blocking, so each call runs in a worker thread; trio
stops waiting for it at the caller's deadline. Tested against moto's server mode, an emulator of the
API, not against AWS itself.

Rotation is AWS's own (automatic or on demand): the key id stays, new DEKs are wrapped with the
newest key material, and the ciphertext names the material that can unwrap it.
"""

from __future__ import annotations

import logging
from typing import Any, Final

import trio

from kproxy.envelope.format import Kms
from kproxy.kms.client import KmsError, NewKey
from kproxy.kms.settings import AwsKmsSettings

log = logging.getLogger("kproxy.kms")

_FINAL: Final = {
    "NotFoundException": "unknown_kek",
    "DisabledException": "unknown_kek",
    "KMSInvalidStateException": "unknown_kek",
    "AccessDeniedException": "denied",
    "IncorrectKeyException": "refused",
    "InvalidCiphertextException": "refused",
    "InvalidKeyUsageException": "refused",
    "ValidationException": "refused",
}
_RETRIABLE: Final = {
    "ThrottlingException": "throttled",
    "LimitExceededException": "throttled",
    "KMSInternalException": "server_error",
    "DependencyTimeoutException": "timeout",
    "KeyUnavailableException": "server_error",
}


class AwsKms:
    """A ``KmsClient`` for the AWS KMS API."""

    kind = Kms.AWS_KMS
    name = "aws"

    def __init__(self, settings: AwsKmsSettings) -> None:
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise KmsError("refused", "kms.aws needs boto3: pip install 'kproxy-kafka[aws]'", retriable=False) from None
        self.settings = settings
        # kproxy retries through its own backoff; botocore's would multiply the calls per DEK.
        config = Config(connect_timeout=settings.timeout_s, read_timeout=settings.timeout_s,
                        retries={"max_attempts": 1, "mode": "standard"})
        self._client = boto3.session.Session().client(
            "kms", region_name=settings.region, endpoint_url=settings.endpoint_url, config=config)

    def describe(self) -> str:
        return f"AWS KMS in {self.settings.region}" + (f" at {self.settings.endpoint_url}"
                                                        if self.settings.endpoint_url else "")

    async def aclose(self) -> None:
        self._client.close()

    async def generate(self, kek: str) -> NewKey:
        answer = await self._call("GenerateDataKey", f"data key under KEK {kek!r}",
                                  KeyId=kek, KeySpec="AES_256")
        key, blob = answer.get("Plaintext"), answer.get("CiphertextBlob")
        if not isinstance(key, bytes) or len(key) != 32 or not isinstance(blob, bytes) or not blob:
            raise KmsError("bad_answer", f"data key under KEK {kek!r}: the answer holds no 32-byte key",
                           retriable=False)
        return NewKey(key, blob)

    async def unwrap(self, kek: str, wrapped: bytes) -> bytes:
        answer = await self._call("Decrypt", f"decrypt with KEK {kek!r}", KeyId=kek, CiphertextBlob=wrapped)
        key = answer.get("Plaintext")
        if not isinstance(key, bytes) or len(key) != 32:
            raise KmsError("bad_answer", f"decrypt with KEK {kek!r}: the answer holds no 32-byte key",
                           retriable=False)
        return key

    async def kek_exists(self, kek: str) -> bool:
        try:
            answer = await self._call("DescribeKey", f"describe KEK {kek!r}", KeyId=kek)
        except KmsError as e:
            if e.reason == "unknown_kek":
                return False
            raise
        meta = answer.get("KeyMetadata") or {}
        return bool(meta.get("Enabled")) and meta.get("KeyUsage", "ENCRYPT_DECRYPT") == "ENCRYPT_DECRYPT"

    async def _call(self, operation: str, what: str, **kwargs: Any) -> dict[str, Any]:
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            ConnectTimeoutError,
            EndpointConnectionError,
            NoCredentialsError,
            ReadTimeoutError,
        )

        method = getattr(self._client, _snake(operation))
        try:
            answer: dict[str, Any] = await trio.to_thread.run_sync(lambda: method(**kwargs), abandon_on_cancel=True)
            return answer
        except ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if code in _FINAL:
                raise KmsError(_FINAL[code], f"{what}: {code}", retriable=False) from None
            if code in _RETRIABLE or status >= 500:
                raise KmsError(_RETRIABLE.get(code, "server_error"), f"{what}: {code or status}",
                               retriable=True) from None
            raise KmsError("refused", f"{what}: {code or status}", retriable=False) from None
        except (ConnectTimeoutError, ReadTimeoutError):
            raise KmsError("timeout", f"{what}: no answer within {self.settings.timeout_s:g}s",
                           retriable=True) from None
        except NoCredentialsError:
            raise KmsError("token", f"{what}: no AWS credentials found", retriable=True) from None
        except EndpointConnectionError:
            raise KmsError("unreachable", f"{what}: AWS KMS unreachable", retriable=True) from None
        except BotoCoreError as e:
            # No credentials, a bad region...: the message names the problem, not a secret.
            raise KmsError("unreachable", f"{what}: {type(e).__name__}", retriable=True) from None


def _snake(operation: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in operation).lstrip("_")

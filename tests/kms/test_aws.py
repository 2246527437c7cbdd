"""The AWS KMS API as kproxy's KMS, against moto's server mode (an emulator of the API, not AWS)."""

from __future__ import annotations

import pytest
import trio

from kproxy.envelope import Binding, KeyPolicy, key_refs, open_values, seal
from kproxy.kms.client import KmsError
from kproxy.kms.service import KeyService


@pytest.fixture
def key_id(moto_kms) -> str:
    return str(moto_kms.client().create_key()["KeyMetadata"]["KeyId"])


@pytest.fixture
def aws_kek(moto_kms, key_id) -> str:
    alias = f"alias/kek-{key_id[:8]}"
    moto_kms.client().create_alias(AliasName=alias, TargetKeyId=key_id)
    return alias


async def test_round_trip_through_a_fresh_service(aws, aws_kek, nursery):
    writer = KeyService(aws)
    await nursery.start(writer.run)
    ((dek, _),) = await writer.data_keys(aws_kek, 2)
    assert dek.ref.kek == aws_kek
    sealed = seal(dek, [b"a", b"b"], Binding("t"))
    reader = KeyService(aws)
    await nursery.start(reader.run)
    deks = await reader.unwrap_all(key_refs(sealed))
    assert open_values(sealed, Binding("t"), deks)[0] == [b"a", b"b"]   # type: ignore[arg-type]
    assert await aws.kek_exists(aws_kek) and not await aws.kek_exists("alias/nothing")


async def test_old_deks_unwrap_after_rotation(aws, aws_kek, key_id, moto_kms):
    old = await aws.generate(aws_kek)
    moto_kms.client().rotate_key_on_demand(KeyId=key_id)
    assert await aws.unwrap(aws_kek, old.wrapped) == old.key


async def test_a_missing_or_disabled_kek_is_final(aws, aws_kek, key_id, moto_kms, nursery):
    with pytest.raises(KmsError) as e:
        await aws.generate("alias/nothing")
    assert e.value.reason == "unknown_kek" and not e.value.retriable
    service = KeyService(aws)
    await nursery.start(service.run)
    await service.data_keys(aws_kek, 1)
    moto_kms.client().disable_key(KeyId=key_id)
    # A disabled key fails kproxy's check at start and reload. (moto still makes data keys under a
    # disabled key, where AWS answers DisabledException, which kproxy takes as final.)
    assert not await aws.kek_exists(aws_kek)
    assert (await service.check_keks([aws_kek]))[aws_kek] is not None


async def test_a_paused_kms_times_out_retriably_then_recovers(aws, aws_kek, moto_kms, nursery):
    service = KeyService(aws, KeyPolicy(backoff_initial_s=0.1, backoff_max_s=0.5))
    await nursery.start(service.run)
    moto_kms.pause()
    try:
        with pytest.raises(KmsError) as e:
            await service.data_keys(aws_kek, 1)
        assert e.value.retriable and e.value.reason == "timeout"
    finally:
        moto_kms.resume()
    with trio.fail_after(30):
        while True:
            try:
                await service.data_keys(aws_kek, 1)
                break
            except KmsError as again:
                assert again.retriable
                await trio.sleep(0.05)


async def test_many_waiters_make_one_call(aws, aws_kek, moto_kms, nursery):
    service = KeyService(aws)
    await nursery.start(service.run)
    before = moto_kms.requests("GenerateDataKey")
    async with trio.open_nursery() as waiters:
        for _ in range(100):
            waiters.start_soon(service.data_keys, aws_kek, 5)
    assert moto_kms.requests("GenerateDataKey") == before + 1

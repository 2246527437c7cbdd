"""Vault/OpenBao Transit as kproxy's KMS, against OpenBao's real server: wrap and unwrap, KEK rotation,
a missing KEK, the token file, a paused server, and one call per key however many wait."""

from __future__ import annotations

import base64
import logging

import pytest
import trio

from kproxy.envelope import Binding, KeyPolicy, key_refs, open_values, seal
from kproxy.kms.client import KmsError
from kproxy.kms.service import KeyService
from kproxy.kms.settings import VaultSettings
from kproxy.kms.vault import VaultTransit, expand_ciphertext

TOPIC = Binding("payments-eu")


async def started(nursery: trio.Nursery, client: VaultTransit, policy: KeyPolicy | None = None) -> KeyService:
    service = KeyService(client, policy)
    await nursery.start(service.run)
    return service


async def test_generate_and_unwrap_round_trip(vault, kek, openbao, caplog):
    caplog.set_level(logging.DEBUG)
    new = await vault.generate(kek)
    assert len(new.key) == 32
    assert expand_ciphertext(new.wrapped).startswith("vault:v1:")
    assert len(new.wrapped) == 62          # 1 form byte, 1 version byte, 60 raw bytes
    assert await vault.unwrap(kek, new.wrapped) == new.key
    assert openbao.requests(f"transit/datakey/plaintext/{kek}") == 1
    assert openbao.requests(f"transit/decrypt/{kek}") == 1
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert base64.b64encode(new.key).decode() not in logged and openbao.root_token not in logged


async def test_records_sealed_through_one_service_open_through_a_fresh_one(vault, kek, nursery):
    writer = await started(nursery, vault)
    ((dek, n),) = await writer.data_keys(kek, 3)
    assert n == 3
    sealed = seal(dek, [b"a", b"b", None], TOPIC)
    reader = await started(nursery, vault)          # a fresh kproxy: nothing cached
    refs = key_refs(sealed)
    deks = await reader.unwrap_all(refs)
    assert open_values(sealed, TOPIC, deks)[0] == [b"a", b"b", None]   # type: ignore[arg-type]
    assert reader.cache.misses == 1 and writer.cache.hits == 0


async def test_rotation_reaches_new_deks_and_old_records_still_open(vault, kek, openbao, nursery):
    clock = [0.0]
    service = KeyService(vault, KeyPolicy(max_age_s=60), clock=lambda: clock[0])
    await nursery.start(service.run)
    ((old, _),) = await service.data_keys(kek, 1)
    old_records = seal(old, [b"before the rotation"], TOPIC)
    openbao.rotate(kek)
    clock[0] = 30.0
    ((same, _),) = await service.data_keys(kek, 1)
    assert same is old                          # within its lifetime the DEK serves on
    clock[0] = 61.0                             # ... and no longer: the rotation is reached by max_age_s
    ((new, _),) = await service.data_keys(kek, 1)
    assert expand_ciphertext(new.ref.wrapped).startswith("vault:v2:")
    assert expand_ciphertext(old.ref.wrapped).startswith("vault:v1:")
    fresh = await started(nursery, vault)
    deks = await fresh.unwrap_all(key_refs(old_records))
    assert open_values(old_records, TOPIC, deks)[0] == [b"before the rotation"]   # type: ignore[arg-type]


async def test_a_deactivated_old_version_does_not_stop_sealing(vault, kek, openbao, nursery):
    """Kroxylicious #1767: nothing cached names a KEK version, so once the old version may no longer
    be used, the next DEK comes from the latest one and sealing goes on."""
    clock = [0.0]
    service = KeyService(vault, KeyPolicy(max_age_s=60), clock=lambda: clock[0])
    await nursery.start(service.run)
    ((first, _),) = await service.data_keys(kek, 1)
    openbao.rotate(kek)
    openbao.api("POST", f"transit/keys/{kek}/config", {"min_decryption_version": 2, "min_encryption_version": 2})
    clock[0] = 61.0
    ((dek, _),) = await service.data_keys(kek, 1)
    assert expand_ciphertext(dek.ref.wrapped).startswith("vault:v2:")
    assert service.ring.error(kek, clock[0]) is None
    # Records under version 1 can no longer be opened by anyone: the KMS says so, and it is final.
    with pytest.raises(KmsError) as e:
        await vault.unwrap(kek, first.ref.wrapped)
    assert not e.value.retriable and e.value.reason == "refused"


async def test_a_missing_kek_is_final(vault, openbao, nursery):
    with pytest.raises(KmsError) as e:
        await vault.generate("no-such-kek")
    assert e.value.reason == "unknown_kek" and not e.value.retriable
    assert await vault.kek_exists("no-such-kek") is False
    service = await started(nursery, vault)
    assert (await service.check_keks(["no-such-kek"]))["no-such-kek"].reason == "unknown_kek"   # type: ignore[union-attr]


async def test_kek_exists(vault, kek, nursery):
    assert await vault.kek_exists(kek) is True
    service = await started(nursery, vault)
    assert await service.check_keks([kek]) == {kek: None}


async def test_the_token_file_is_read_again_when_it_changes(vault, kek, token_file, openbao):
    token_file.write_text("not-a-token\n")
    with pytest.raises(KmsError) as e:
        await vault.generate(kek)
    assert e.value.reason == "denied" and not e.value.retriable
    assert "not-a-token" not in str(e.value)
    limited = openbao.token(f'path "transit/datakey/plaintext/{kek}" {{ capabilities = ["update"] }}')
    token_file.write_text(f"\n{limited}  \n")
    assert len((await vault.generate(kek)).key) == 32
    with pytest.raises(KmsError) as e:      # that token may not decrypt
        await vault.unwrap(kek, (await vault.generate(kek)).wrapped)
    assert e.value.reason == "denied"
    reads = vault.tokens.reads
    await vault.generate(kek)
    assert vault.tokens.reads == reads      # unchanged file: not read again
    token_file.unlink()
    with pytest.raises(KmsError) as e:
        await vault.generate(kek)
    assert e.value.reason == "token" and e.value.retriable


async def test_a_paused_kms_times_out_retriably_then_recovers(vault, kek, openbao, nursery):
    # The second call must come inside the backoff after the first one's failure: 2 s leaves room
    # for a loaded machine between the two, and the recovery below waits at most that long.
    service = await started(nursery, vault, KeyPolicy(backoff_initial_s=2.0, backoff_max_s=2.0))
    openbao.pause()
    try:
        with pytest.raises(KmsError) as e:
            await service.data_keys(kek, 1)
        assert e.value.reason == "timeout" and e.value.retriable
        with pytest.raises(KmsError) as e2:      # backing off: answered at once with the same error
            await service.data_keys(kek, 1)
        assert e2.value is e.value
    finally:
        openbao.resume()
    with trio.fail_after(30):                    # a client's retries, until the backoff lets a call out
        while True:
            try:
                grants = await service.data_keys(kek, 1)
                break
            except KmsError as again:
                assert again.retriable
                await trio.sleep(0.05)
    assert grants[0][1] == 1
    assert service.calls[("generate", "timeout")] == 1 and service.calls[("generate", "ok")] == 1


async def test_many_waiters_make_one_call_per_key(vault, kek, openbao, nursery):
    """Kroxylicious #1426: however many requests wait for a key, the KMS sees one call for it."""
    service = await started(nursery, vault)
    results: list[object] = []

    async def produce() -> None:
        results.append(await service.data_keys(kek, 10))

    async with trio.open_nursery() as waiters:
        for _ in range(200):
            waiters.start_soon(produce)
    assert len(results) == 200
    assert openbao.requests(f"transit/datakey/plaintext/{kek}") == 1

    sealed = seal(results[0][0][0], [b"x"], TOPIC)   # type: ignore[index]
    reader = await started(nursery, vault)
    ref = key_refs(sealed)[0]
    opened: list[object] = []

    async def fetch() -> None:
        opened.append((await reader.unwrap_all([ref]))[ref])

    async with trio.open_nursery() as waiters:
        for _ in range(200):
            waiters.start_soon(fetch)
    assert len(opened) == 200 and all(d is opened[0] for d in opened)
    assert openbao.requests(f"transit/decrypt/{kek}") == 1


async def test_failures_back_off_instead_of_flooding_the_kms(vault, openbao, nursery):
    service = await started(nursery, vault, KeyPolicy(backoff_initial_s=5.0, backoff_max_s=10.0))

    async def produce() -> None:
        with pytest.raises(KmsError):
            await service.data_keys("missing-kek", 1)

    for _ in range(3):                          # three rounds of 50 producers within the backoff
        async with trio.open_nursery() as waiters:
            for _ in range(50):
                waiters.start_soon(produce)
    assert openbao.requests("transit/datakey/plaintext/missing-kek") == 1


def test_https_is_required_except_on_loopback():
    with pytest.raises(ValueError, match=r"kms\.vault\.url: http:// is allowed only for a loopback"):
        VaultSettings(url="http://vault.example.com:8200", token_file="t")
    for url in ("http://127.0.0.1:8200", "http://localhost:8200", "http://[::1]:8200", "https://vault.example.com"):
        assert VaultSettings(url=url, token_file="t").url == url

"""KeyService over the local key file KMS, on trio's virtual clock: renewal ahead of need, calls that
outlive the request that started them, and the metrics it exports."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from prometheus_client import CollectorRegistry, generate_latest

from kproxy.envelope import Binding, KeyPolicy, KeyRef, Kms, key_refs, seal
from kproxy.kms.client import NewKey
from kproxy.kms.local import LocalKeyFile, write_key_file
from kproxy.kms.service import KeyService
from kproxy.telemetry.metrics import kms_families


class SlowKms(LocalKeyFile):
    """The local key file behind a KMS that takes ``delay`` seconds (virtual time) per call."""

    delay = 0.5
    started = 0

    async def generate(self, kek: str) -> NewKey:
        self.started += 1
        await trio.sleep(self.delay)
        return await super().generate(kek)

    async def unwrap(self, kek: str, wrapped: bytes) -> bytes:
        self.started += 1
        await trio.sleep(self.delay)
        return await super().unwrap(kek, wrapped)


@pytest.fixture
def kms(tmp_path: Path) -> SlowKms:
    path = tmp_path / "keks.json"
    write_key_file(str(path), ["k1"])
    return SlowKms(str(path))


async def test_a_steady_producer_never_waits_for_a_renewal(kms, nursery, autojump_clock):
    """Kroxylicious #757/#1526 through the service: by count (small DEKs) and by time (renewed by the
    timer between produces), no produce after the first waits for the KMS."""
    service = KeyService(kms, KeyPolicy(max_records=2000, max_age_s=20.0))
    await nursery.start(service.run)
    await service.data_keys("k1", 1)
    waited = 0
    for i in range(3000):                       # 5 minutes at 10 batches/s of 1 to 300 records
        start = trio.current_time()
        await service.data_keys("k1", 1 + (i * 37) % 300)
        waited += trio.current_time() > start
        await trio.sleep(0.1)
    assert waited == 0
    assert kms.calls == service.ring.generated <= 3000 * 150 // 2000 + 5 * 60 // 16 + 2


async def test_a_waiter_that_gives_up_does_not_cancel_the_call(kms, nursery, autojump_clock):
    service = KeyService(kms)
    await nursery.start(service.run)
    with trio.move_on_after(0.1):
        await service.data_keys("k1", 1)       # gives up before the KMS answers
    assert kms.started == 1
    grants = await service.data_keys("k1", 1)   # the same call's DEK
    assert kms.started == kms.calls == 1 and grants[0][1] == 1

    sealed = seal(grants[0][0], [b"v"], Binding("t"))
    reader = KeyService(kms)
    await nursery.start(reader.run)
    ref = key_refs(sealed)[0]
    with trio.move_on_after(0.1):
        await reader.unwrap_all([ref])
    assert (await reader.unwrap_all([ref]))[ref].ref == ref      # type: ignore[union-attr]
    assert kms.started == kms.calls == 2


async def test_a_dek_from_another_kind_of_kms_is_refused_without_a_call(kms, nursery):
    service = KeyService(kms)
    await nursery.start(service.run)
    ref = KeyRef(Kms.VAULT_TRANSIT, "k1", b"\x01\x01" + bytes(60))
    (error,) = (await service.unwrap_all([ref])).values()
    assert error.reason == "wrong_kms" and not error.retriable     # type: ignore[union-attr]
    assert kms.calls == 0


async def test_the_service_must_run(kms):
    with pytest.raises(RuntimeError, match="not running"):
        await KeyService(kms).data_keys("k1", 1)


async def test_metrics(kms, nursery, autojump_clock):
    service = KeyService(kms, KeyPolicy(backoff_initial_s=60, backoff_max_s=60))
    await nursery.start(service.run)
    ((dek, _),) = await service.data_keys("k1", 1)
    await service.unwrap_all([dek.ref])           # sealed here: opened from the cache
    await service.unwrap_all([KeyRef(Kms.LOCAL_FILE, "k1", b"\x01" + bytes(60))])   # refused by the KMS
    with pytest.raises(Exception, match="no KEK"):
        await service.data_keys("gone", 1)

    class Collector:
        def collect(self):
            return kms_families(service.snapshot())

    registry = CollectorRegistry()
    registry.register(Collector())  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    assert 'kproxy_kms_calls_total{backend="local",op="generate",outcome="ok"} 1.0' in text
    assert 'kproxy_kms_calls_total{backend="local",op="generate",outcome="unknown_kek"} 1.0' in text
    assert 'kproxy_kms_calls_total{backend="local",op="unwrap",outcome="refused"} 1.0' in text
    assert 'kproxy_kms_call_duration_seconds_count{backend="local",op="generate"} 2.0' in text
    assert 'kproxy_dek_cache_lookups_total{result="hit"} 1.0' in text
    assert 'kproxy_dek_cache_lookups_total{result="miss"} 1.0' in text
    assert "kproxy_kms_keys_backing_off 2.0" in text

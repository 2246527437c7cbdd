"""A PKCS#11 token as kproxy's KMS, against a real SoftHSM token (Debian's softhsm2) in a temporary
folder: DEKs made and wrapped on the token, rotation by a new key under the same label, tampered or
foreign wrapped DEKs refused, the PIN file, one login shared by the process's clients, metrics."""

from __future__ import annotations

import pytest

from kproxy.envelope import Binding, key_refs, open_values, seal
from kproxy.envelope.format import Kms
from kproxy.kms import hsm as hsm_module
from kproxy.kms.client import KmsError
from kproxy.kms.hsm import Pkcs11Kms, pack_wrapped, unpack_wrapped
from kproxy.kms.service import KeyService
from kproxy.kms.settings import Pkcs11Settings
from kproxy.telemetry.metrics import kms_families


async def test_round_trip_through_a_fresh_service(hsm, hsm_kek, softhsm, nursery):
    writer = KeyService(hsm)
    await nursery.start(writer.run)
    ((dek, _),) = await writer.data_keys(hsm_kek, 2)
    assert dek.ref.kms == Kms.PKCS11 and dek.ref.kek == hsm_kek
    key_id, blob = unpack_wrapped(dek.ref.wrapped)
    assert key_id == b"\x01" and len(blob) == 40          # RFC 5649 wraps 32 bytes in 40
    sealed = seal(dek, [b"a", b"b"], Binding("t"))
    reader = KeyService(hsm)
    await nursery.start(reader.run)
    deks = await reader.unwrap_all(key_refs(sealed))
    assert open_values(sealed, Binding("t"), deks)[0] == [b"a", b"b"]   # type: ignore[arg-type]
    # A key that may only encrypt is not a KEK here: it must be allowed to wrap and unwrap.
    softhsm.create_key(f"{hsm_kek}-enc", wrap=False)
    assert await hsm.kek_exists(hsm_kek)
    assert not await hsm.kek_exists("no-such-kek") and not await hsm.kek_exists(f"{hsm_kek}-enc")
    families = {f.name: f for f in kms_families(writer.snapshot())}
    (sample,) = [s for s in families["kproxy_kms_calls"].samples if s.name.endswith("_total")]
    assert sample.labels == {"backend": "pkcs11", "op": "generate", "outcome": "ok"} and sample.value == 1


async def test_a_new_key_under_the_same_label_wraps_new_deks_and_old_ones_still_open(hsm, hsm_kek, softhsm):
    old = await hsm.generate(hsm_kek)
    softhsm.create_key(hsm_kek, b"\x02")
    new = await hsm.generate(hsm_kek)
    assert unpack_wrapped(old.wrapped)[0] == b"\x01" and unpack_wrapped(new.wrapped)[0] == b"\x02"
    assert await hsm.unwrap(hsm_kek, old.wrapped) == old.key
    assert await hsm.unwrap(hsm_kek, new.wrapped) == new.key


async def test_tampered_foreign_or_malformed_wrapped_deks_are_refused_for_good(hsm, hsm_kek, softhsm):
    new = await hsm.generate(hsm_kek)
    key_id, blob = unpack_wrapped(new.wrapped)
    flipped = bytearray(blob)
    flipped[5] ^= 1
    cases = {
        pack_wrapped(key_id, bytes(flipped)): "refused",        # the token's integrity check fails
        pack_wrapped(b"\x09", blob): "unknown_kek",             # no key with that id under the label
        b"\x01\x01" + blob[:20]: "refused",                     # not a wrapping at all
    }
    other = f"{hsm_kek}-other"
    softhsm.create_key(other)
    for wrapped, reason in cases.items():
        with pytest.raises(KmsError) as e:
            await hsm.unwrap(hsm_kek, wrapped)
        assert e.value.reason == reason and not e.value.retriable, wrapped
    with pytest.raises(KmsError) as e:
        await hsm.unwrap(other, new.wrapped)                    # another KEK's key cannot unwrap it
    assert e.value.reason == "refused" and not e.value.retriable
    with pytest.raises(KmsError) as e:
        await hsm.generate("no-such-kek")
    assert e.value.reason == "unknown_kek" and not e.value.retriable


async def test_the_process_shares_one_login_and_closing_one_client_keeps_the_others(softhsm, hsm_kek):
    settings = Pkcs11Settings(softhsm.module, softhsm.label, str(softhsm.pin_file), timeout_s=2.0)
    first, second = Pkcs11Kms(settings), Pkcs11Kms(settings)
    try:
        made = await first.generate(hsm_kek)
        assert await second.unwrap(hsm_kek, made.wrapped) == made.key
        await first.aclose()
        # PKCS#11 logs in per process: had the first client closed its own session, the second
        # would have been logged out and found no private keys.
        assert await second.kek_exists(hsm_kek)
        assert await second.unwrap(hsm_kek, made.wrapped) == made.key
    finally:
        await first.aclose()
        await second.aclose()


async def test_the_pin_file_wrong_or_missing(softhsm, hsm_kek, tmp_path):
    # No client of this process is open here, so the token's login is this test's own (an open one
    # would have logged the process in, and the wrong PIN would never be asked for).
    assert not hsm_module._TOKENS, "a PKCS#11 client of an earlier test is still open"
    wrong = tmp_path / "pin"
    wrong.write_text("0000\n")
    client = Pkcs11Kms(Pkcs11Settings(softhsm.module, softhsm.label, str(wrong), timeout_s=2.0))
    try:
        with pytest.raises(KmsError) as e:
            await client.generate(hsm_kek)
        assert e.value.reason == "denied" and not e.value.retriable and "0000" not in str(e.value)
        wrong.unlink()
        with pytest.raises(KmsError) as e:
            await client.generate(hsm_kek)
        assert e.value.reason == "token" and e.value.retriable and "cannot read the PIN file" in str(e.value)
        wrong.write_text(f"  {softhsm.pin}\n")        # fixed: the next call logs in
        assert len((await client.generate(hsm_kek)).key) == 32
    finally:
        await client.aclose()

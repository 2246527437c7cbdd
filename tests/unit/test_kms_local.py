"""The local key file KMS (development only) and the ``kms:`` settings with kproxy check's checks."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kproxy.kms.backends import open_client
from kproxy.kms.client import KmsError
from kproxy.kms.local import LocalKeyFile, write_key_file
from kproxy.kms.settings import (
    KmsSettingError,
    KmsSettings,
    LocalKeySettings,
    file_problems,
    kms_settings,
    local_key_problem,
)
from kproxy.kms.vault import compact_ciphertext, expand_ciphertext


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "keks.json"
    write_key_file(str(path), ["payments-kek", "orders-kek"])
    return path


async def test_local_keys_wrap_and_unwrap(key_file, caplog):
    caplog.set_level(logging.WARNING)
    kms = LocalKeyFile(str(key_file))
    assert "development only" in caplog.text and str(key_file) in caplog.text
    assert key_file.stat().st_mode & 0o077 == 0
    new = await kms.generate("payments-kek")
    assert len(new.key) == 32 and len(new.wrapped) == 61
    assert await kms.unwrap("payments-kek", new.wrapped) == new.key
    with pytest.raises(KmsError) as e:      # bound to its KEK
        await kms.unwrap("orders-kek", new.wrapped)
    assert e.value.reason == "refused" and not e.value.retriable
    tampered = bytearray(new.wrapped)
    tampered[-1] ^= 1
    with pytest.raises(KmsError, match="cannot unwrap"):
        await kms.unwrap("payments-kek", bytes(tampered))
    assert await kms.kek_exists("payments-kek") and not await kms.kek_exists("nope")
    with pytest.raises(KmsError) as e:
        await kms.generate("nope")
    assert e.value.reason == "unknown_kek" and not e.value.retriable


async def test_local_rotation_is_read_from_the_changed_file(key_file):
    kms = LocalKeyFile(str(key_file))
    old = await kms.generate("payments-kek")
    write_key_file(str(key_file), [], rotate="payments-kek")
    new = await kms.generate("payments-kek")
    assert old.wrapped[0] == 1 and new.wrapped[0] == 2          # the version leads the wrapped key
    assert await kms.unwrap("payments-kek", old.wrapped) == old.key
    key_file.write_text("{}")
    with pytest.raises(KmsError, match="not a kproxy local key file"):
        await kms.generate("payments-kek")


def test_a_local_key_file_is_refused_in_a_gateway_unless_allowed(key_file):
    local = kms_settings({"local": {"file": str(key_file)}})
    assert local_key_problem(local, "sidecar") is None
    problem = local_key_problem(local, "gateway")
    assert problem is not None and problem.path == ("kms", "local") and "development only" in problem.problem
    allowed = kms_settings({"local": {"file": str(key_file), "allow_in_gateway": True}})
    assert local_key_problem(allowed, "gateway") is None
    assert local_key_problem(kms_settings({"vault": {"url": "https://v:8200", "token_file": "t"}}), "gateway") is None
    assert isinstance(open_client(allowed), LocalKeyFile)


@pytest.mark.parametrize(("data", "where", "what"), [
    ({}, "kms", "exactly one"),
    ({"vault": {"url": "https://v", "token_file": "t"}, "local": {"file": "f"}}, "kms", "vault and local"),
    ({"hsm": {}}, "kms.hsm", "unknown KMS"),
    ({"vault": {"url": "https://v"}}, "kms.vault.token_file", "is required"),
    ({"vault": {"url": "https://v", "token_file": "t", "tokne": 1}}, "kms.vault.tokne", "unknown setting"),
    ({"vault": {"url": "http://vault.internal:8200", "token_file": "t"}}, "kms.vault.url", "loopback"),
    ({"vault": {"url": "https://user:pw@v", "token_file": "t"}}, "kms.vault.url", "token_file"),
    ({"vault": {"url": "https://v/v1/transit", "token_file": "t"}}, "kms.vault.url", "address only"),
    ({"vault": {"url": "https://v", "token_file": "t", "mount": "/x/"}}, "kms.vault.mount", "mount path"),
    ({"vault": {"url": "https://v", "token_file": "t", "timeout_s": 0}}, "kms.vault.timeout_s", "above 0"),
    ({"vault": {"url": "https://v", "token_file": " "}}, "kms.vault.token_file", "file name"),
    ({"local": {"file": "f", "allow_in_gateway": "yes"}}, "kms.local.allow_in_gateway", "true or false"),
    ({"aws": {"region": "Not A Region"}}, "kms.aws.region", "region"),
    ({"pkcs11": {"module": "m.so", "pin_file": "p"}}, "kms.pkcs11.token_label", "is required"),
    ({"pkcs11": {"module": "m.so", "token_label": "x" * 33, "pin_file": "p"}}, "kms.pkcs11.token_label", "32 bytes"),
    ({"pkcs11": {"module": "m.so", "token_label": "t", "pin_file": " "}}, "kms.pkcs11.pin_file", "file name"),
    ({"pkcs11": {"module": "m.so", "token_label": "t", "pin_file": "p"}, "aws": {"region": "eu-west-1"}}, "kms",
     "aws and pkcs11"),
])
def test_settings_errors_name_the_setting(data, where, what):
    with pytest.raises(KmsSettingError) as e:
        kms_settings(data)
    assert str(e.value).startswith(f"{where}: ") and what in str(e.value)


def test_settings_defaults_and_files(tmp_path):
    s = kms_settings({"vault": {"url": "http://127.0.0.1:8200", "token_file": str(tmp_path / "token")}})
    assert s.backend == "vault" and s.vault is not None and s.vault.mount == "transit"
    (problem,) = file_problems(s)
    assert problem.path == ("kms", "vault", "token_file") and "does not exist" in problem.problem
    (tmp_path / "token").write_text("t")
    assert file_problems(s) == []
    assert file_problems(KmsSettings(local=LocalKeySettings(str(tmp_path)))) != []   # a directory
    hsm = kms_settings({"pkcs11": {"module": str(tmp_path / "token"), "token_label": "t",
                                   "pin_file": str(tmp_path / "pin")}})
    assert hsm.backend == "pkcs11"
    (problem,) = file_problems(hsm)
    assert problem.path == ("kms", "pkcs11", "pin_file") and "does not exist" in problem.problem


def test_transit_ciphertexts_are_kept_compact():
    text = "vault:v12:" + "A" * 78 + "=="
    wrapped = compact_ciphertext(text)
    assert len(wrapped) == 2 + 58 and expand_ciphertext(wrapped) == text   # form, version, raw bytes
    odd = "vault:v1:not base64!"
    assert expand_ciphertext(compact_ciphertext(odd)) == odd
    for bad in (b"", b"\x02abc", b"\x01", b"\x01\x00abc"):
        with pytest.raises(ValueError):
            expand_ciphertext(bad)


def test_pkcs11_wrapped_deks_name_their_key_id_and_ids_rank_by_length_then_bytes():
    from kproxy.kms.hsm import key_order, pack_wrapped, unpack_wrapped

    blob = bytes(range(40))
    assert unpack_wrapped(pack_wrapped(b"\x07", blob)) == (b"\x07", blob)
    assert unpack_wrapped(pack_wrapped(b"", blob)) == (b"", blob)
    for bad in (b"", b"\x01\x07" + blob[:-1], pack_wrapped(b"x" * 65, blob), b"\x80"):
        with pytest.raises(ValueError):
            unpack_wrapped(bad)
    assert sorted([b"\x02", b"\x01\x00", b"\x09", b""], key=key_order) == [b"", b"\x02", b"\x09", b"\x01\x00"]

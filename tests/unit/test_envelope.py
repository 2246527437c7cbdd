"""The record envelope: round trips, and every change to a sealed record detected (kproxy.envelope)."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kproxy.envelope import (
    MAGIC,
    Binding,
    DataKey,
    KeyRef,
    Kms,
    MissingDataKey,
    Part,
    TamperedRecord,
    UnknownEnvelope,
    bound_topic,
    describe,
    is_sealed,
    key_refs,
    open_values,
    parse_header,
    seal,
)
from kproxy.envelope.format import NONCE_SIZE, TAG_SIZE

REF = KeyRef(Kms.VAULT_TRANSIT, "payments-kek", bytes(range(61)))
DEK = DataKey(REF, bytes(range(32)))
TOPIC = Binding("payments-eu")
VALUES = [b"card 4111 1111 1111 1111", b"", None, os.urandom(1024)]


def opened(values, binding=TOPIC, deks=None, keys=None):
    return open_values(values, binding, {REF: DEK} if deks is None else deks, keys)[0]


def test_round_trip_keeps_nulls_and_empty_values():
    sealed = seal(DEK, VALUES, TOPIC)
    assert sealed[2] is None                  # a tombstone stays a tombstone
    assert all(is_sealed(v) for v in sealed if v is not None)
    assert all(v is None or v not in s for v, s in zip(VALUES, sealed, strict=True) if v)  # no plaintext
    assert opened(sealed) == VALUES
    assert opened([memoryview(v) if v is not None else None for v in sealed]) == VALUES


def test_each_record_gets_its_own_nonce():
    sealed = seal(DEK, [b"same"] * 50, TOPIC)
    size = parse_header(sealed[0])[2]
    assert len({v[size:size + NONCE_SIZE] for v in sealed}) == 50
    assert len(set(sealed)) == 50


def test_plain_values_pass_through_and_are_counted():
    sealed = seal(DEK, [b"x", b"y"], TOPIC)
    out, plain = open_values([b"written before the rule", sealed[0], None, sealed[1]], TOPIC, {REF: DEK})
    assert out == [b"written before the rule", b"x", None, b"y"]
    assert plain == 1


def test_keys_round_trip_bound_to_their_record_key():
    keys = [b"alice", None, b"", b"bob"]
    sealed = seal(DEK, VALUES, TOPIC, keys)
    assert describe(sealed[0])["key_bound"]
    assert opened(sealed, keys=keys) == VALUES
    # alice's value under bob's key
    swapped = [sealed[3], sealed[1], sealed[2], sealed[0]]
    with pytest.raises(TamperedRecord) as e:
        opened(swapped, keys=keys)
    assert e.value.index == 0
    # a null key is not an empty key
    with pytest.raises(TamperedRecord):
        opened(sealed, keys=[b"alice", b"", b"", b"bob"])
    with pytest.raises(ValueError, match="pass keys"):
        opened(sealed)


def test_a_sealed_key_opens_as_a_key_only():
    key_part = Binding("payments-eu", Part.KEY)
    sealed = seal(DEK, [b"alice"], key_part)
    assert opened(sealed, key_part) == [b"alice"]
    with pytest.raises(TamperedRecord):
        opened(sealed)   # as the value


def flip(value: bytes, at: int) -> bytes:
    b = bytearray(value)
    b[at] ^= 0x01
    return bytes(b)


def test_every_byte_of_a_sealed_value_is_protected():
    """Flipping any one bit-position in any byte of an envelope is refused (the tamper cases below
    name the parts); never opened into a value, not even an empty one."""
    sealed = seal(DEK, [b"0123456789"], TOPIC)[0]
    for at in range(len(MAGIC), len(sealed)):
        tampered = flip(sealed, at)
        try:
            ref = parse_header(tampered)[0]
        except TamperedRecord:
            with pytest.raises(TamperedRecord):
                opened([tampered], keys=[b"k"])
            continue
        # Even a KMS that unwrapped a changed reference to the same key would not help.
        with pytest.raises(TamperedRecord):
            opened([tampered], deks={ref: DEK}, keys=[b"k"])


def test_a_changed_magic_reads_as_a_plain_value():
    # The documented limit: without the magic a value is not an envelope. Whoever can write to the
    # broker can write plain values anyway; what they get is ciphertext, never the plaintext.
    sealed = seal(DEK, [b"0123456789"], TOPIC)[0]
    for at in range(len(MAGIC)):
        tampered = flip(sealed, at)
        assert open_values([tampered], TOPIC, {REF: DEK}) == ([tampered], 1)


def parts(value: bytes) -> dict[str, int]:
    size = parse_header(value)[2]
    return {"ciphertext": size + NONCE_SIZE, "nonce": size, "tag": len(value) - TAG_SIZE,
            "wrapped DEK": size - 10, "KEK name": 8, "version": 4, "kms": 5, "flags": 6}


@pytest.mark.parametrize("part", ["ciphertext", "nonce", "tag", "wrapped DEK", "KEK name"])
def test_tampered_part_is_refused(part):
    sealed = seal(DEK, [b"a value"], TOPIC)[0]
    tampered = flip(sealed, parts(sealed)[part])
    ref = parse_header(tampered)[0]
    if ref != REF:
        # The reference changed: kproxy has no DEK for it (the KMS would refuse to unwrap it) ...
        with pytest.raises(MissingDataKey):
            opened([tampered])
    # ... and if one were found, the header is in the associated data.
    with pytest.raises(TamperedRecord, match="authentication failed"):
        opened([tampered], deks={ref: DEK})


def test_changed_version_byte_is_refused():
    sealed = seal(DEK, [b"a value"], TOPIC)[0]
    with pytest.raises(UnknownEnvelope, match="version 2"):
        opened([sealed[:4] + b"\x02" + sealed[5:]])
    assert issubclass(UnknownEnvelope, TamperedRecord)


def test_unknown_flags_and_changed_kms_are_refused():
    sealed = seal(DEK, [b"a value"], TOPIC)[0]
    with pytest.raises(UnknownEnvelope, match="flags"):
        opened([sealed[:6] + b"\x80" + sealed[7:]])
    other_kms = sealed[:5] + bytes((Kms.LOCAL_FILE,)) + sealed[6:]
    ref = parse_header(other_kms)[0]
    with pytest.raises(TamperedRecord):
        opened([other_kms], deks={ref: DEK})
    # The key-bound flag set on a value sealed without it
    with pytest.raises(TamperedRecord):
        opened([sealed[:6] + b"\x01" + sealed[7:]], keys=[b"k"])


def test_moving_a_record_to_another_topic_is_detected():
    sealed = seal(DEK, [b"a value"], TOPIC)
    with pytest.raises(TamperedRecord):
        opened(sealed, Binding("payments-us"))
    with pytest.raises(TamperedRecord):
        opened(sealed, Binding("primary.payments-eu"))


def test_a_configured_replica_prefix_opens_mirrored_copies():
    sealed = seal(DEK, [b"a value"], Binding(bound_topic("payments-eu", ["primary."])))
    assert opened(sealed, Binding(bound_topic("primary.payments-eu", ["primary."]))) == [b"a value"]
    assert bound_topic("primary.payments-eu", ["backup.", "primary."]) == "payments-eu"
    assert bound_topic("primary.", ["primary."]) == "primary."
    assert bound_topic("orders", ["primary."]) == "orders"


def test_a_bad_record_refuses_the_whole_batch_naming_it():
    sealed = seal(DEK, [b"a", b"b", b"c"], TOPIC)
    sealed[1] = flip(sealed[1], len(sealed[1]) - 1)
    with pytest.raises(TamperedRecord) as e:
        opened(sealed)
    assert e.value.index == 1


@pytest.mark.parametrize("cut", [5, 8, 20, 80, 95])
def test_truncated_envelopes_are_refused(cut):
    sealed = seal(DEK, [b"a value"], TOPIC)[0]
    with pytest.raises(TamperedRecord):
        opened([sealed[:cut]])


def test_a_plain_value_that_starts_with_the_magic_is_refused_not_delivered():
    with pytest.raises(TamperedRecord):
        opened([MAGIC + b"\x01 looks like an envelope but is not one at all, not even close"])


def test_key_refs_lists_each_dek_once():
    other = DataKey(KeyRef(Kms.VAULT_TRANSIT, "payments-kek", b"another wrapped key"), os.urandom(32))
    values = [*seal(DEK, [b"a", b"b"], TOPIC), b"plain", None, *seal(other, [b"c"], TOPIC), *seal(DEK, [b"d"], TOPIC)]
    assert key_refs(values) == [REF, other.ref]
    with pytest.raises(MissingDataKey) as e:
        opened(values)
    assert e.value.ref == other.ref
    assert opened(values, deks={REF: DEK, other.ref: other}) == [b"a", b"b", b"plain", None, b"c", b"d"]


def test_describe_shows_the_envelope_without_the_key():
    sealed = seal(DEK, [b"x" * 1024], TOPIC)[0]
    d = describe(sealed)
    assert d["kek"] == "payments-kek" and d["kms"] == "vault_transit" and d["ciphertext_bytes"] == 1024
    assert d["overhead_bytes"] == len(sealed) - 1024 == 4 + 3 + 1 + 12 + 1 + 61 + 12 + 16
    assert "DataKey(KeyRef(vault_transit" in repr(DEK) and bytes(range(32)).hex() not in repr(DEK)


def test_data_keys_and_names_are_checked():
    with pytest.raises(ValueError, match="32 bytes"):
        DataKey(REF, b"short")
    with pytest.raises(ValueError, match="KEK name"):
        DataKey(KeyRef(Kms.VAULT_TRANSIT, "", b"w"), bytes(32))
    long_name = KeyRef(Kms.VAULT_TRANSIT, "k" * 300, b"w" * 200)   # two-byte lengths
    dek = DataKey(long_name, bytes(32))
    assert opened(seal(dek, [b"v"], TOPIC), deks={long_name: dek}) == [b"v"]


@given(values=st.lists(st.one_of(st.none(), st.binary(max_size=300)), max_size=20),
       topic=st.text(min_size=1, max_size=40), with_keys=st.booleans())
def test_round_trip_property(values, topic, with_keys):
    keys = [os.urandom(3) if i % 3 else None for i in range(len(values))] if with_keys else None
    binding = Binding(topic)
    assert opened(seal(DEK, values, binding, keys), binding, keys=keys) == values

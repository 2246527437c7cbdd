"""Record encryption and masking without a KMS: the ``kms:`` section's checks (file:line, as
``kproxy check`` prints them), sealing and opening whole batches with every codec (producer fields
kept, control batches untouched, tampering and moves detected), masks, and the policy filter's
questions to the key service through a real session (``AskKeys`` -> ``Keys`` actions)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from kproxy.cli import check_config_file
from kproxy.config import ConfigError, load_config
from kproxy.envelope import DataKey, KeyPolicy, KeyRef, KeyRing, Kms, UnwrapCache, is_sealed
from kproxy.kms.client import KmsError
from kproxy.policy import crypto as C
from kproxy.policy.filter import PolicyFilter
from kproxy.policy.model import Mask
from kproxy.policy.store import RuleStore
from kproxy.protocol.errors import INVALID_RECORD, KAFKA_STORAGE_ERROR
from kproxy.protocol.messages import (
    Request,
    body_class,
    decode_request,
    decode_response,
    encode_request_frame,
)
from kproxy.protocol.records import Compression, RecordBatch, build_batch, iter_batches
from kproxy.proxy.actions import Keys, ToClient, ToUpstream
from kproxy.proxy.filters import ConnectionContext, FilterChain
from kproxy.proxy.session import Session

HEADER = 'listen: "127.0.0.1:9092"\nupstream:\n  bootstrap_servers: ["kafka:9092"]\n'


def load_error(tmp_path: Path, text: str) -> ConfigError:
    path = tmp_path / "kproxy.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.file == str(path)
    return info.value


# -- the kms: section ---------------------------------------------------------------------------------


def test_kms_errors_name_the_file_line_and_setting(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t\n")
    err = load_error(tmp_path, HEADER + "kms:\n  hsm: {slot: 1}\n")
    assert err.line == 5 and "kms: unknown key 'hsm' (expected one of: vault, aws, local," in str(err)
    err = load_error(tmp_path, HEADER + f"kms:\n  vault:\n    url: http://127.0.0.1:8200\n    token_file: {tmp_path}/nope\n")
    assert err.line == 7 and f"kms.vault.token_file: file not found: {tmp_path}/nope" in str(err)
    err = load_error(tmp_path, HEADER + f"kms:\n  vault:\n    url: http://vault.example:8200\n    token_file: {token}\n")
    assert err.line == 6 and "kms.vault.url: http:// is allowed only for a loopback address" in str(err)
    err = load_error(tmp_path, HEADER + "kms:\n  dek_max_age_s: 60\n")
    assert err.line == 4 and "needs exactly one of vault, aws, pkcs11 or local" in str(err)
    err = load_error(tmp_path, HEADER + f"kms:\n  pkcs11:\n    module: {tmp_path}/no.so\n    token_label: t\n"
                                        f"    pin_file: {token}\n")
    assert err.line == 6 and f"kms.pkcs11.module: file not found: {tmp_path}/no.so" in str(err)
    err = load_error(tmp_path, HEADER + f"kms:\n  pkcs11:\n    module: {token}\n    token_label: t\n"
                                        f"    pin_file: {tmp_path}/pin\n")
    assert err.line == 8 and f"kms.pkcs11.pin_file: file not found: {tmp_path}/pin" in str(err)
    err = load_error(tmp_path, HEADER + f"kms:\n  pkcs11:\n    module: {token}\n    pin_file: {token}\n")
    assert err.line == 5 and "kms.pkcs11: missing required key 'token_label'" in str(err)
    keys = tmp_path / "keys.json"
    keys.write_text("{}")
    err = load_error(tmp_path, HEADER + f"kms:\n  local:\n    file: {keys}\n")
    assert err.line == 5 and "kms.local: a local key file is for development only" in str(err)
    cfg = load_config(_write(tmp_path, HEADER + f"kms:\n  local:\n    file: {keys}\n    allow_in_gateway: true\n"))
    assert cfg.kms is not None and cfg.kms.backend == "local"
    cfg = load_config(_write(tmp_path, HEADER + f"mode: sidecar\nkms:\n  local: {{file: {keys}}}\n"))
    assert cfg.kms is not None and cfg.kms.local is not None


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kproxy.yaml"
    path.write_text(text)
    return path


def test_kproxy_check_refuses_an_encrypt_rule_without_a_kms(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text('rules:\n  - name: enc\n    match: {topic: "p-*"}\n    action: encrypt\n    encrypt: {kek: k}\n')
    path = _write(tmp_path, HEADER + f"rules: [{rules}]\n")
    assert check_config_file(str(path)) == 2
    assert f"{rules}:2: rule 'enc' encrypts records, but the configuration has no kms: section" in \
        capsys.readouterr().err


def test_encrypt_and_mask_rules_load_and_check_their_settings(tmp_path: Path) -> None:
    from kproxy.policy.loader import RuleError, load_rules

    good = tmp_path / "good.yaml"
    good.write_text('rules:\n  - name: e\n    match: {topic: "p-*"}\n    action: encrypt\n'
                    '    encrypt: {kek: "k-${topic}", keys: true}\n'
                    '  - name: m\n    match: {topic: "p-*", api: fetch}\n    action: mask\n'
                    '    mask: {fields: ["card.number"], with: "XX"}\n')
    rs = load_rules([str(good)])
    enc, mask = rs.rules
    assert enc.params.kek_for("p-1") == "k-p-1" and enc.params.keys
    assert mask.params == Mask((("card", "number"),), "XX")
    bad = tmp_path / "bad.yaml"
    bad.write_text('rules:\n  - name: e\n    action: encrypt\n    encrypt: {kek: "k-${client_id}"}\n'
                   '  - name: m\n    match: {api: produce}\n    action: mask\n    mask: {fields: ["a..b"]}\n')
    with pytest.raises(RuleError) as info:
        load_rules([str(bad)])
    text = str(info.value)
    assert "unknown variable ${client_id}" in text and "must include fetch" in text and "'a..b'" in text


# -- sealing and opening batches -----------------------------------------------------------------------


def dek(n: int = 1) -> DataKey:
    return DataKey(KeyRef(Kms.LOCAL_FILE, "kek", bytes([n]) * 40), os.urandom(32))


def open_all(records: bytes, topic: str, deks: dict[KeyRef, DataKey], masks: tuple[Mask, ...] = ()) -> bytes | None:
    return C.open_partition(C.read_fetched(records, 1 << 24), topic, deks, masks, None, 1 << 24)


def values(records: bytes) -> list[Any]:
    return [None if r.value is None else bytes(r.value) for b in iter_batches(records) for r in b.records()]


@pytest.mark.parametrize("codec", list(Compression))
@pytest.mark.parametrize("seal_keys", [False, True])
def test_sealed_batches_keep_codec_and_producer_fields_and_open_again(codec: Compression, seal_keys: bool) -> None:
    recs = [(b"k%d" % i, b'{"n": %d}' % i, [("h", b"x")]) for i in range(5)] + [(b"tomb", None)]
    raw = build_batch(recs, compression=codec, producer_id=77, producer_epoch=3, base_sequence=40,
                      is_transactional=True, base_timestamp=1000)
    batches = C.sealable_batches(raw)
    # Two DEKs share the batch: the grant runs out after three records.
    d1, d2 = dek(1), dek(2)
    per = 2 if seal_keys else 1
    grants = C.Grants([(d1, 3 * per), (d2, 3 * per)])
    sealed, nb, nr = C.seal_partition(batches, "pay", grants, seal_keys, 1 << 24)
    assert (nb, nr) == (1, 5)
    (b,) = list(iter_batches(sealed, verify_crc=True))
    assert isinstance(b, RecordBatch)
    assert (b.compression, b.producer_id, b.producer_epoch, b.base_sequence, b.is_transactional, b.record_count) == \
        (codec, 77, 3, 40, True, 6)
    rs = b.records()
    assert all(is_sealed(bytes(r.value)) for r in rs[:5]) and rs[5].value is None
    assert all(is_sealed(bytes(r.key)) == seal_keys for r in rs)
    assert [h.key for h in rs[0].headers] == ["h"]
    opened = open_all(sealed, "pay", {d1.ref: d1, d2.ref: d2})
    assert opened is not None
    assert values(opened) == [v for _, v, *_ in recs]
    assert [bytes(r.key) for b in iter_batches(opened) for r in b.records()] == [k for k, *_ in recs]
    # Moved to another topic, or opened without one of its DEKs: refused, never delivered.
    with pytest.raises(C.Tampered):
        open_all(sealed, "other", {d1.ref: d1, d2.ref: d2})
    from kproxy.envelope import MissingDataKey

    with pytest.raises(MissingDataKey):
        open_all(sealed, "pay", {d1.ref: d1})


def test_a_tampered_batch_ends_the_delivered_records_and_one_alone_is_refused() -> None:
    d = dek()

    def sealed_value(value: bytes) -> bytes:
        records = C.seal_partition(C.sealable_batches(build_batch([(b"k", value)])), "t", C.Grants([(d, 1)]),
                                   False, 1 << 24)[0]
        return values(records)[0]

    good = build_batch([(b"k", sealed_value(b"one"))], base_offset=0)
    flipped = bytearray(sealed_value(b"two"))
    flipped[-20] ^= 1                     # one ciphertext bit, in a batch with a valid CRC
    bad = build_batch([(b"k", bytes(flipped))], base_offset=1)
    opened = open_all(good + bad, "t", {d.ref: d})
    assert opened is not None and values(opened) == [b"one"]      # up to the tampered batch
    with pytest.raises(C.Tampered) as info:
        open_all(bad, "t", {d.ref: d})
    assert info.value.offset == 1
    # A value moved under another key fails too (the key is bound), and so does a cut envelope.
    with pytest.raises(C.Tampered):
        open_all(build_batch([(b"other-key", sealed_value(b"x"))]), "t", {d.ref: d})
    with pytest.raises(C.Tampered):
        open_all(build_batch([(b"k", sealed_value(b"x")[:-17])]), "t", {d.ref: d})


def test_plain_and_control_batches_pass_unchanged_and_legacy_ones_cannot_be_sealed() -> None:
    plain = build_batch([(b"k", b"v")]) + build_batch([(None, b"\x00\x00\x00\x00\x00\x00")], is_control=True,
                                                      base_offset=1)
    assert open_all(plain, "t", {}) is None
    with pytest.raises(C.Unsealable, match="v0/v1"):
        C.sealable_batches(build_batch([(b"k", b"v")], magic=1))


def test_masks_replace_fields_of_json_values_and_count_the_rest() -> None:
    crypto = C.RecordCrypto(KeyRing(KeyPolicy()), UnwrapCache(4, 60), lambda: 0.0)
    masks = (Mask((("card", "number"), ("ssn",)), "****"),)
    vals = [b'{"card": {"number": "4111", "cvv": 1}, "ssn": "1"}', b"not json", b'{"other": 1}', None, b"[1, 2]"]
    out, changed = C.mask_values(vals, masks, crypto)
    assert changed
    assert json.loads(out[0]) == {"card": {"number": "****", "cvv": 1}, "ssn": "****"}
    assert out[1:] == vals[1:]
    assert (crypto.records_masked, crypto.mask_not_json) == (1, 1)


# -- the filter's questions through a session ----------------------------------------------------------

RULES = ('rules:\n  - name: enc\n    match: {topic: "pay-*"}\n    action: encrypt\n    encrypt: {kek: kek}\n')


def session_with(tmp_path: Path, crypto: C.RecordCrypto) -> Session:
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    f = PolicyFilter(RuleStore([str(rules)]), crypto=crypto)
    return Session(ConnectionContext(1, clock=lambda: 0.0), FilterChain([f]), stream_min_bytes=None)


def produce_frame(topics: dict[str, bytes], acks: int = -1) -> memoryview:
    cls: Any = body_class(0, "request")
    body = cls(acks=acks, timeout_ms=5000, topic_data=[
        cls.TopicProduceData(name=t, partition_data=[cls.PartitionProduceData(index=0, records=r)])
        for t, r in topics.items()])
    frame = b"".join(bytes(b) for b in encode_request_frame(Request.build(0, 9, 7, "c", body)))
    return memoryview(frame)[4:]


def test_a_produce_waits_for_the_key_service_then_goes_sealed_or_is_answered_retriably(tmp_path: Path) -> None:
    ring = KeyRing(KeyPolicy())
    crypto = C.RecordCrypto(ring, UnwrapCache(4, 60), lambda: 0.0)
    s = session_with(tmp_path, crypto)
    plain = build_batch([(b"k", b"card 4111")])
    actions = s.client_frame(produce_frame({"pay-1": plain, "free": plain}))
    (keys,) = actions
    assert isinstance(keys, Keys) and keys.question == C.SealKeys((("kek", 1),))
    d = dek()
    d.used = 1
    out = keys.then({"kek": [(d, 1)]})
    (up,) = [a for a in out if isinstance(a, ToUpstream)]
    sent = decode_request(memoryview(b"".join(bytes(b) for b in up.buffers))[4:])
    by_topic = {t.name: bytes(t.partition_data[0].records) for t in sent.body.topic_data}
    assert by_topic["free"] == plain
    assert b"card 4111" not in by_topic["pay-1"] and is_sealed(values(by_topic["pay-1"])[0])

    # The KMS is unreachable: the partition is answered retriably and nothing goes to the broker.
    s2 = session_with(tmp_path, C.RecordCrypto(KeyRing(KeyPolicy()), UnwrapCache(4, 60), lambda: 0.0))
    (keys,) = s2.client_frame(produce_frame({"pay-1": plain}))
    out = keys.then({"kek": KmsError("unreachable", "vault: cannot connect", retriable=True)})
    assert not any(isinstance(a, ToUpstream) for a in out)
    (answer,) = [a for a in out if isinstance(a, ToClient)]
    resp = decode_response(memoryview(b"".join(bytes(b) for b in answer.buffers))[4:], 0, 9)
    part = resp.body.responses[0].partition_responses[0]
    assert part.error_code == KAFKA_STORAGE_ERROR and "cannot connect" in part.error_message

    # acks=0: no answer can say so; the connection closes as a broker's would.
    s3 = session_with(tmp_path, C.RecordCrypto(KeyRing(KeyPolicy()), UnwrapCache(4, 60), lambda: 0.0))
    (keys,) = s3.client_frame(produce_frame({"pay-1": plain}, acks=0))
    out = keys.then(None)
    assert not any(isinstance(a, ToUpstream) for a in out)
    assert any(type(a).__name__ == "Close" for a in out)


def test_a_fetch_answer_waits_for_dek_and_refuses_only_the_partitions_it_cannot_open(tmp_path: Path) -> None:
    cache = UnwrapCache(4, 60)
    crypto = C.RecordCrypto(KeyRing(KeyPolicy()), cache, lambda: 0.0)
    s = session_with(tmp_path, crypto)
    d = dek()
    sealed = C.seal_partition(C.sealable_batches(build_batch([(b"k", b"secret")])), "pay-1", C.Grants([(d, 1)]),
                              False, 1 << 24)[0]
    fetch_cls: Any = body_class(1, "request")
    req = Request.build(1, 12, 9, "c", fetch_cls(replica_id=-1, max_wait_ms=0, min_bytes=1, topics=[
        fetch_cls.FetchTopic(topic=t, partitions=[fetch_cls.FetchPartition(partition=p, fetch_offset=0,
                                                                           partition_max_bytes=1 << 20)
                                                  for p in (0, 1)]) for t in ("pay-1",)]))
    frame = b"".join(bytes(b) for b in encode_request_frame(req))
    (up,) = s.client_frame(memoryview(frame)[4:])
    upstream_id = decode_request(memoryview(b"".join(bytes(b) for b in up.buffers))[4:]).correlation_id
    resp_cls: Any = body_class(1, "response")
    body = resp_cls(responses=[resp_cls.FetchableTopicResponse(topic="pay-1", partitions=[
        resp_cls.PartitionData(partition_index=0, high_watermark=1, records=sealed),
        resp_cls.PartitionData(partition_index=1, high_watermark=1, records=build_batch([(b"k", b"plain")]))])])
    from kproxy.protocol.messages import Response, encode_response_frame

    answer = b"".join(bytes(b) for b in encode_response_frame(Response.build(1, 12, upstream_id, body)))
    (keys,) = s.upstream_frame(memoryview(answer)[4:])
    assert isinstance(keys, Keys) and keys.question == C.OpenKeys((d.ref,))
    out = keys.then({d.ref: KmsError("timeout", "no answer", retriable=True)})
    (to_client,) = [a for a in out if isinstance(a, ToClient)]
    got = decode_response(memoryview(b"".join(bytes(b) for b in to_client.buffers))[4:], 1, 12)
    p0, p1 = got.body.responses[0].partitions
    assert p0.error_code == KAFKA_STORAGE_ERROR and not p0.records
    assert p1.error_code == 0 and values(bytes(p1.records)) == [b"plain"]
    assert crypto.failures == {"timeout": 1}

    def again() -> list[Any]:
        (up,) = s.client_frame(memoryview(frame)[4:])
        upstream_id = decode_request(memoryview(b"".join(bytes(b) for b in up.buffers))[4:]).correlation_id
        answer = b"".join(bytes(b) for b in encode_response_frame(Response.build(1, 12, upstream_id, body)))
        return s.upstream_frame(memoryview(answer)[4:])

    def first_partition(out: list[Any]) -> Any:
        (to_client,) = [a for a in out if isinstance(a, ToClient)]
        got = decode_response(memoryview(b"".join(bytes(b) for b in to_client.buffers))[4:], 1, 12)
        return got.body.responses[0].partitions[0]

    # An unknown KEK is not retriable.
    (keys,) = again()
    p0 = first_partition(keys.then({d.ref: KmsError("unknown_kek", "no such key", retriable=False)}))
    assert p0.error_code == INVALID_RECORD and not p0.records
    # With the DEK cached the answer is opened at once, with no question, into the partition's
    # buffer (where the accelerator is built: make test always builds it).
    from kproxy.envelope import records as R

    cache.put(d, 0.0)
    into = R.PATHS["into"]
    p0 = first_partition(again())
    assert p0.error_code == 0 and values(bytes(p0.records)) == [b"secret"]
    assert R.PATHS["into"] > into or R._native_open is None


def test_kproxy_decode_shows_an_envelope_without_opening_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kproxy.cli import main

    d = dek()
    records = C.seal_partition(C.sealable_batches(build_batch([(b"k", b"card 4111")])), "pay", C.Grants([(d, 1)]),
                               False, 1 << 24)[0]
    frame = b"".join(bytes(b) for b in encode_request_frame(Request.build(0, 9, 7, "c", body_class(0, "request")(
        acks=-1, timeout_ms=5000, topic_data=[body_class(0, "request").TopicProduceData(
            name="pay", partition_data=[body_class(0, "request").PartitionProduceData(index=0, records=records)])]))))
    path = tmp_path / "frame.bin"
    path.write_bytes(frame)
    assert main(["decode", "--raw", str(path)]) == 0
    out = capsys.readouterr().out
    assert "card 4111" not in out
    result = json.loads(out)
    (record,) = result["body"]["topic_data"][0]["partition_data"][0]["records"]["batches"][0]["records"]
    env = record["value"]["envelope"]
    assert env["kek"] == "kek" and env["kms"] == "local_file" and env["ciphertext_bytes"] == len(b"card 4111")
    assert env["key_bound"] is True and record["key"] == "k"


# -- the C accelerator's split and join hold to the Python ones ----------------------------------------


def test_native_split_and_join_match_python_on_valid_and_broken_records() -> None:
    import random

    from kproxy.protocol.errors import RecordsError
    from kproxy.protocol.records import rewrite

    if rewrite._native_split is None or rewrite._native_join is None:
        pytest.fail("the C accelerator is not built (or predates this test): `pip install -e .` builds it")
    rng = random.Random(28)
    for _ in range(200):
        recs = []
        for _ in range(rng.randrange(1, 40)):
            key = None if rng.random() < 0.2 else rng.randbytes(rng.choice([0, 1, 70, 300]))
            value = None if rng.random() < 0.2 else rng.randbytes(rng.choice([0, 5, 63, 64, 1024, 20000]))
            headers = [(f"h{j}", rng.randbytes(rng.randrange(0, 90))) for j in range(rng.randrange(0, 3))]
            recs.append((key, value, headers, 1000 + rng.randrange(0, 1 << 40)))
        (batch,) = list(iter_batches(build_batch(recs, base_timestamp=1000)))
        buf = batch.payload()
        native = rewrite._native_split(buf, batch.record_count)
        python = rewrite._split_records(buf, batch.record_count, 0, False)
        assert [[None if x is None else bytes(x) for x in part] for part in native] == \
               [[None if x is None else bytes(x) for x in part] for part in python]
        assert rewrite._native_join(*native) == rewrite._join_records(*python) == bytes(buf)
        # Cut short, or with bytes left over: both refuse.
        for broken, count in ((buf[:rng.randrange(0, len(buf))], batch.record_count),
                              (bytes(buf) + b"\x00", batch.record_count),
                              (buf, batch.record_count + 1)):
            with pytest.raises(ValueError):
                rewrite._native_split(memoryview(bytes(broken)), count)
            with pytest.raises((RecordsError, IndexError)):
                rewrite._split_records(memoryview(bytes(broken)), count, 0, False)


def test_a_share_fetch_answer_is_opened_too(tmp_path: Path) -> None:
    import types
    import uuid

    from kproxy.protocol.messages import Response, encode_response_frame

    cache = UnwrapCache(4, 60)
    crypto = C.RecordCrypto(KeyRing(KeyPolicy()), cache, lambda: 0.0)
    s = session_with(tmp_path, crypto)
    policy_filter = s.chain.filters[0]
    tid = uuid.uuid4()
    policy_filter.topic_ids.learn([types.SimpleNamespace(name="pay-1", topic_id=tid)])
    d = dek()
    cache.put(d, 0.0)
    sealed = C.seal_partition(C.sealable_batches(build_batch([(b"k", b"secret")])), "pay-1", C.Grants([(d, 1)]),
                              False, 1 << 24)[0]
    req_cls: Any = body_class(78, "request")
    req = Request.build(78, 1, 9, "c", req_cls(group_id="g", member_id="m", share_session_epoch=0, max_wait_ms=0,
                                               min_bytes=1, max_records=10, batch_size=10, topics=[
        req_cls.FetchTopic(topic_id=tid, partitions=[req_cls.FetchPartition(partition_index=0)])]))
    frame = b"".join(bytes(b) for b in encode_request_frame(req))
    (up,) = s.client_frame(memoryview(frame)[4:])
    upstream_id = decode_request(memoryview(b"".join(bytes(b) for b in up.buffers))[4:]).correlation_id
    cls: Any = body_class(78, "response")
    body = cls(responses=[cls.ShareFetchableTopicResponse(topic_id=tid, partitions=[
        cls.PartitionData(partition_index=0, records=sealed, current_leader=cls.LeaderIdAndEpoch(leader_id=1,
                                                                                                 leader_epoch=0))])])
    answer = b"".join(bytes(b) for b in encode_response_frame(Response.build(78, 1, upstream_id, body)))
    (to_client,) = [a for a in s.upstream_frame(memoryview(answer)[4:]) if isinstance(a, ToClient)]
    got = decode_response(memoryview(b"".join(bytes(b) for b in to_client.buffers))[4:], 78, 1)
    assert values(bytes(got.body.responses[0].partitions[0].records)) == [b"secret"]


def test_the_traffic_log_and_the_span_name_the_encrypt_rule() -> None:
    import jsonschema

    from kproxy.telemetry.exchange import Exchange, Learned
    from kproxy.telemetry.spans import span_attributes
    from kproxy.telemetry.traffic_log import SCHEMA_PATH, traffic_line
    from tests.unit.test_telemetry import ctx, produce_entry

    e = produce_entry({("pay", 0): build_batch([(b"k", b"v")])}, {("pay", 0): 0})
    e.notes = {"rewritten_batches": 1, "encrypted_batches": 1, "record_rule": "encrypt-payments"}
    line = traffic_line(Exchange(e, ctx(), Learned()), 0.0)
    jsonschema.Draft202012Validator(json.loads(SCHEMA_PATH.read_text())).validate(line)
    assert line["record_rule"] == "encrypt-payments" and line["encrypted_batches"] == 1
    attributes = span_attributes(Exchange(e, ctx(), Learned()))
    assert attributes["kproxy.record_rule"] == "encrypt-payments" and attributes["kproxy.encrypted_batches"] == 1


# -- sealing and opening a records section in one pass: the C accelerator holds to the Python reference


def _random_batch(rng: Any, keys_null: float = 0.2) -> RecordBatch:
    recs = []
    for _ in range(rng.randrange(1, 30)):
        key = None if rng.random() < keys_null else rng.randbytes(rng.choice([0, 1, 70, 300]))
        value = None if rng.random() < 0.2 else rng.randbytes(rng.choice([0, 5, 63, 64, 1024, 20000]))
        headers = [(f"h{j}", rng.randbytes(rng.randrange(0, 90))) for j in range(rng.randrange(0, 3))]
        recs.append((key, value, headers, 1000 + rng.randrange(0, 1 << 40)))
    (batch,) = list(iter_batches(build_batch(recs, base_timestamp=1000)))
    return batch


def test_native_seal_and_open_match_the_python_reference_byte_for_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    import random

    from kproxy.envelope import Binding, MissingDataKey, Part, TamperedRecord
    from kproxy.envelope import records as R

    if R._native_seal is None or R._native_open is None:
        pytest.fail("the C accelerator is not built (or predates this test): `pip install -e .` builds it")
    rng = random.Random(2828)
    # Nonces from a seeded generator, so that both paths seal with the same ones.
    monkeypatch.setattr(R.os, "urandom", lambda n: rng.randbytes(n))
    deks = [dek(1), dek(2), dek(3)]
    by_ref = {d.ref: d for d in deks}
    vb, kb = Binding("pay", Part.VALUE), Binding("pay", Part.KEY)
    for round_ in range(150):
        batch = _random_batch(rng)
        buf, count = batch.payload(), batch.record_count
        seal_keys = round_ % 2 == 1
        # Runs of records over one, two or three DEKs (a DEK's limit reached inside a batch).
        cuts = sorted(rng.sample(range(count + 1), k=min(2, count + 1)))
        runs = [(n, d) for n, d in zip((cuts[0], cuts[-1] - cuts[0], count - cuts[-1]), deks, strict=True) if n]
        reserve = rng.choice([0, 61])
        state = rng.getstate()
        native = R.seal_records(buf, count, runs, seal_keys, vb, kb, reserve, native=True)
        rng.setstate(state)
        python = R.seal_records(buf, count, runs, seal_keys, vb, kb, reserve, native=False)
        assert bytes(native[0]) == bytes(python[0]) and native[1] == python[1]
        assert native[1] == sum(1 for v in C.split_records(batch)[2] if v is not None)
        sealed = memoryview(native[0])[reserve:]
        opened_n = R.open_records(sealed, count, by_ref, vb, kb, reserve, native=True)
        opened_p = R.open_records(sealed, count, by_ref, vb, kb, reserve, native=False)
        assert bytes(opened_n[0]) == bytes(opened_p[0]) and opened_n[1:] == opened_p[1:]
        assert bytes(opened_n[0][reserve:]) == bytes(buf)      # the records as they were produced
        assert opened_n[1] == native[1]
        # Into a partition's buffer at an offset: the same bytes there, and nothing outside them touched.
        at = rng.randrange(0, 100)
        for use_native in (True, False):
            into = bytearray(b"\xee" * (at + reserve + len(sealed) + 7))
            end, *counts = R.open_records_into(into, at, sealed, count, by_ref, vb, kb, reserve, native=use_native)
            assert (end, tuple(counts)) == (at + len(opened_n[0]), opened_n[1:])
            assert into[at:end] == opened_n[0]
            assert into[:at] == b"\xee" * at and into[-7:] == b"\xee" * 7
            with pytest.raises(ValueError, match="no room"):
                R.open_records_into(bytearray(at + reserve + len(sealed) - 1), at, sealed, count, by_ref, vb, kb,
                                    reserve, native=use_native)
        # Tampered: one or two bits of the sealed section flipped (a length, a header, a nonce, a
        # cipher byte or a tag). Both paths fail alike: the same error, at the same first record.
        for trial in range(8):
            broken = bytearray(sealed)
            for _ in range(1 + trial % 2):
                broken[rng.randrange(len(broken))] ^= 1 << rng.randrange(8)
            outcome = []
            for use_native in (True, False):
                try:
                    got = R.open_records(memoryview(bytes(broken)), count, by_ref, vb, kb, 0, native=use_native)
                    outcome.append(("ok", bytes(got[0]), got[1:]))
                except TamperedRecord as e:
                    outcome.append((type(e).__name__, e.index, e.reason))
                except R.RecordsBroken as e:
                    outcome.append(("broken", e.reason, e.position))
                except MissingDataKey as e:
                    outcome.append(("missing", e.ref))
            assert outcome[0] == outcome[1], outcome
        # Opened under another topic: refused by both, at the first sealed record.
        other = Binding("pay-2", Part.VALUE), Binding("pay-2", Part.KEY)
        if native[1] or seal_keys:
            for use_native in (True, False):
                with pytest.raises(TamperedRecord):
                    R.open_records(sealed, count, by_ref, *other, 0, native=use_native)
        # A DEK not supplied: MissingDataKey from both.
        if native[1]:
            for use_native in (True, False):
                with pytest.raises(MissingDataKey):
                    R.open_records(sealed, count, {}, vb, kb, 0, native=use_native)


def test_the_data_path_seals_and_opens_through_the_accelerator_when_it_is_built() -> None:
    from kproxy.envelope import records as R

    if R._native_seal is None or R._native_open is None:
        pytest.fail("the C accelerator is not built (or predates this test): `pip install -e .` builds it")
    d = dek()
    before = dict(R.PATHS)
    batches = C.sealable_batches(build_batch([(None, b"v%d" % i) for i in range(10)]) * 3)
    sealed, nb, nr = C.seal_partition(batches, "pay", C.Grants([(d, 30)]), False, 1 << 24)
    assert (nb, nr) == (3, 30)
    opened = open_all(sealed, "pay", {d.ref: d})
    assert opened is not None and values(opened) == [b"v%d" % i for i in range(10)] * 3
    assert R.PATHS["native"] - before["native"] == 6 and R.PATHS["python"] == before["python"]


def test_a_partition_opens_into_one_buffer_whatever_its_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Uncompressed batches are opened in place in the partition's buffer (counted in PATHS["into"]);
    compressed ones, plain ones, control ones and masked ones (which may grow) are written there too,
    in order; the result is what opening each batch alone gives."""
    from kproxy.envelope import records as R

    d = dek()
    plain_json = [b'{"card": {"number": "4111"}, "n": %d}' % i for i in range(4)]

    def sealed(recs: list[tuple[bytes | None, bytes | None]], codec: Compression, at: int) -> bytes:
        batches = C.sealable_batches(build_batch(recs, compression=codec, base_offset=at))
        return C.seal_partition(batches, "pay", C.Grants([(d, 1 << 20)]), False, 1 << 24)[0]

    parts = [
        sealed([(b"k", v) for v in plain_json], Compression.NONE, 0),
        sealed([(b"k", v) for v in plain_json], Compression.LZ4, 4),
        build_batch([(b"k", b"plain")], base_offset=8),
        build_batch([(None, b"\x00\x00\x00\x00\x00\x00")], is_control=True, base_offset=9),
        sealed([(None, b"x" * 2000), (b"k", None)], Compression.NONE, 10),
    ]
    records = b"".join(parts)
    expected = [v for v in plain_json] * 2 + [b"plain", b"\x00\x00\x00\x00\x00\x00", b"x" * 2000, None]
    before = R.PATHS["into"]
    opened = open_all(records, "pay", {d.ref: d})
    assert opened is not None and values(opened) == expected
    assert R.PATHS["into"] - before == 3      # the three uncompressed data batches (one of them plain)
    assert len(list(iter_batches(opened, verify_crc=True))) == 5
    # Masks that make values longer than the sealed ones: the buffer grows, the batches stay whole.
    long_mask = (Mask((("card", "number"),), "*" * 300),)
    masked = open_all(records, "pay", {d.ref: d}, long_mask)
    assert masked is not None
    got = values(masked)
    assert [json.loads(v)["card"]["number"] for v in got[:8]] == ["*" * 300] * 8
    assert got[8:] == expected[8:] and len(list(iter_batches(masked, verify_crc=True))) == 5
    # An accelerator built before it could write into a buffer (its own output copied in), and the
    # Python reference, give the same bytes.
    monkeypatch.setattr(R, "_OPEN_INTO", False)
    before = R.PATHS["into"]
    assert open_all(records, "pay", {d.ref: d}) == opened
    assert R.PATHS["into"] == before
    monkeypatch.setattr(R, "_native_open", None)
    assert open_all(records, "pay", {d.ref: d}) == opened


def test_the_python_reference_serves_where_the_accelerator_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    from kproxy.envelope import records as R

    monkeypatch.setattr(R, "_native_seal", None)
    monkeypatch.setattr(R, "_native_open", None)
    d = dek()
    before = dict(R.PATHS)
    raw = build_batch([(b"k%d" % i, b"plain value %d" % i) for i in range(4)] + [(b"tomb", None)])
    sealed, _, nr = C.seal_partition(C.sealable_batches(raw), "pay", C.Grants([(d, 10)]), True, 1 << 24)
    assert nr == 4 and b"plain value" not in sealed and b"tomb" not in sealed
    assert open_all(sealed, "pay", {d.ref: d}) == raw
    assert R.PATHS["python"] - before["python"] == 2 and R.PATHS["native"] == before["native"]


def test_holds_sealed_finds_a_sealed_value_or_key_in_a_fetched_partition() -> None:
    d = dek()
    plain = build_batch([(b"k", b"v")])
    sealed_values = C.seal_partition(C.sealable_batches(plain), "pay", C.Grants([(d, 1)]), False, 1 << 24)[0]
    assert C.holds_sealed(C.read_fetched(plain + sealed_values, 1 << 24), 1 << 24)
    assert not C.holds_sealed(C.read_fetched(plain + plain, 1 << 24), 1 << 24)
    # Only the key sealed (a value-less record): still found.
    keyed = C.seal_partition(C.sealable_batches(build_batch([(b"k", None)])), "pay", C.Grants([(d, 2)]), True,
                             1 << 24)[0]
    assert C.holds_sealed(C.read_fetched(keyed, 1 << 24), 1 << 24)


def test_a_batch_that_cannot_be_read_ends_the_opened_records_before_it() -> None:
    import struct

    d = dek()
    good = C.seal_partition(C.sealable_batches(build_batch([(b"k", b"secret one")])), "pay", C.Grants([(d, 1)]),
                            False, 1 << 24)[0]
    bad = bytearray(C.seal_partition(C.sealable_batches(build_batch([(b"k", b"secret two")], base_offset=1)),
                                     "pay", C.Grants([(d, 1)]), False, 1 << 24)[0])
    struct.pack_into(">i", bad, 57, 2)      # the record count says two: the records run short
    opened = open_all(good + bytes(bad), "pay", {d.ref: d})
    assert opened is not None and values(opened) == [b"secret one"]
    # Alone, the broker's answer stands: the client fails on that batch as it would without kproxy.
    assert open_all(bytes(bad), "pay", {d.ref: d}) is None

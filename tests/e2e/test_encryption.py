"""Record encryption and masking end to end: real clients (confluent-kafka, kafka-python, aiokafka, kcat) through
kproxy on tansu, with the KEKs in a real OpenBao dev server (``bao server -dev``).

- plaintext through kproxy, only envelopes on the broker (read directly);
- a KEK rotated in Transit is used for new DEKs, old records still open;
- OpenBao paused (SIGSTOP) while a producer needs a DEK: nothing lands, the client's retries
  succeed after SIGCONT; paused while a fresh kproxy needs a DEK to open a Fetch: nothing is
  delivered meanwhile, then everything;
- a record tampered with on the broker, or moved to another topic, is never delivered;
- a mask rule hides a field from one client while another reads it in the clear;
- with AWS KMS (moto's server mode, an emulator of its API): plaintext through kproxy, envelopes
  on the broker, records still open after the key's rotation, an unknown key refused at start;
- with a PKCS#11 token (SoftHSM): the same round trip, and an unknown key label refused by
  ``kproxy check``, at start and on reload.

One OpenBao, one tansu and one kproxy serve the module; tests that pause OpenBao use KEKs of their
own (``own-*`` topics name their KEK by ``${topic}``) so no cached DEK hides the outage.
"""

from __future__ import annotations

import asyncio
import gc
import json
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiokafka
import confluent_kafka
import pytest
import trio

from kproxy.envelope import is_sealed, parse_header
from kproxy.envelope.format import Kms
from kproxy.kms.vault import expand_ciphertext
from kproxy.server.embedded import ProxyThread
from kproxy.tansu import Tansu
from tests.e2e.kcat import kcat_roundtrip
from tests.e2e.proxied import start_proxy
from tests.e2e.tansu import unique_name
from tests.e2e.test_policy import TIMEOUT, ck_producer, create_topics
from tests.kms.moto import CREDENTIALS as AWS_CREDENTIALS
from tests.kms.moto import REGION as AWS_REGION
from tests.kms.moto import MotoKms
from tests.kms.openbao import OpenBao
from tests.kms.softhsm import SoftHsm, shared_softhsm

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import kafka

pytestmark = pytest.mark.e2e

KEK = "pay-kek"
DEK_AGE_S = 2.0       # short, so a rotated KEK reaches new DEKs within the test
RULES = """\
rules:
  - name: encrypt-pay
    match: {topic: "pay-*"}
    action: encrypt
    encrypt: {kek: "pay-kek"}
  - name: encrypt-own
    match: {topic: "own-*"}
    action: encrypt
    encrypt: {kek: "k-${topic}", keys: true}
  - name: mask-cards
    match: {topic: "pay-*", api: fetch, client_id: "masked-*"}
    action: mask
    mask: {fields: ["card.number", "ssn"], with: "****"}
"""


class Stack:
    def __init__(self, bao: OpenBao, tansu: Tansu, proxy: ProxyThread, kms: dict[str, Any], rules: str) -> None:
        self.bao, self.tansu, self.proxy, self.kms, self.rules = bao, tansu, proxy, kms, rules

    def fresh_proxy(self) -> ProxyThread:
        """Another kproxy on the same broker and KMS, with nothing cached."""
        return start_proxy(self.tansu.bootstrap, rules=[self.rules], kms=self.kms)


@pytest.fixture(scope="module")
def stack(tansu_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("encryption")
    bao = OpenBao(work).start()
    tansu = Tansu(tansu_binary).start()
    proxy = None
    try:
        bao.create_key(KEK)
        token = work / "vault-token"
        token.write_text(f"{bao.root_token}\n")
        rules = work / "rules.yaml"
        rules.write_text(RULES)
        kms = {"vault": {"url": bao.url, "token_file": str(token), "timeout_s": 1.0}, "dek_max_age_s": DEK_AGE_S}
        proxy = start_proxy(tansu.bootstrap, rules=[str(rules)], kms=kms,
                            upstream_settings={"request_timeout_s": 5.0})
        yield Stack(bao, tansu, proxy, kms, str(rules))
    finally:
        bao.resume()
        if proxy is not None:
            proxy.stop()
        tansu.stop()
        bao.stop()


def read(bootstrap: str, topic: str, count: int, client_id: str = "reader", seconds: float = TIMEOUT,
         errors: list[Any] | None = None) -> list[Any]:
    """Up to ``count`` records of partition 0 from the start (confluent-kafka), within ``seconds``."""
    c = confluent_kafka.Consumer({"bootstrap.servers": bootstrap, "group.id": unique_name("g"),
                                  "client.id": client_id, "enable.auto.commit": False,
                                  "fetch.error.backoff.ms": 100})
    try:
        c.assign([confluent_kafka.TopicPartition(topic, 0, confluent_kafka.OFFSET_BEGINNING)])
        out: list[Any] = []
        deadline = time.monotonic() + seconds
        while len(out) < count and time.monotonic() < deadline:
            m = c.poll(0.2)
            if m is None:
                continue
            if m.error() is not None:
                if errors is not None:
                    errors.append(m.error())
                continue
            out.append(m)
        return out
    finally:
        c.close()


# A card number as the plaintext holds it: quoted, so a test looks for it and not for four digits that
# a key id in an envelope's header may hold (an AWS key id, a UUID, once ended in ...4111).
CARD_NUMBER = b'"4111-'


def card(i: int) -> bytes:
    return json.dumps({"id": i, "card": {"number": f"4111-{i:04d}"}, "note": "secret-plaintext"}).encode()


def test_clients_read_plaintext_through_kproxy_and_the_broker_holds_only_envelopes(stack: Stack):
    topic = unique_name("pay")
    create_topics(stack.proxy.bootstrap, topic)
    # confluent-kafka, idempotent, zstd; kafka-python, gzip, acks=0.
    p = ck_producer(stack.proxy.bootstrap, "ck-pay", **{"compression.type": "zstd", "enable.idempotence": True})
    for i in range(20):
        p.produce(topic, key=b"k%d" % i, value=card(i), partition=0)
    assert p.flush(TIMEOUT) == 0
    kp = kafka.KafkaProducer(bootstrap_servers=stack.proxy.bootstrap, client_id="kp-pay", acks=0,
                             compression_type="gzip")
    try:
        for i in range(20, 30):
            kp.send(topic, key=b"k%d" % i, value=card(i), partition=0)
        kp.flush(TIMEOUT)
    finally:
        kp.close(timeout=5)
    through = read(stack.proxy.bootstrap, topic, 30)
    assert sorted(m.value() for m in through) == sorted(card(i) for i in range(30))
    assert {m.key() for m in through} == {b"k%d" % i for i in range(30)}   # keys stay clear on pay-*

    # kafka-python (without zstd or lz4 libraries here) reads the gzip records it wrote.
    kc = kafka.KafkaConsumer(bootstrap_servers=stack.proxy.bootstrap, client_id="kp-read", auto_offset_reset="earliest",
                             consumer_timeout_ms=10_000, enable_auto_commit=False)
    try:
        kc.assign([kafka.TopicPartition(topic, 0)])
        got = []
        kc.seek(kafka.TopicPartition(topic, 0), 20)
        for m in kc:
            got.append(m.value)
            if len(got) == 10:
                break
    finally:
        kc.close()
    assert sorted(got) == sorted(card(i) for i in range(20, 30))

    direct = read(stack.tansu.bootstrap, topic, 30, "direct")
    assert len(direct) == 30
    for m in direct:
        assert is_sealed(m.value()), m.value()[:20]
        assert b"secret-plaintext" not in m.value() and CARD_NUMBER not in m.value()
        assert parse_header(m.value())[0].kek == KEK


def test_a_rotated_kek_seals_new_records_and_old_ones_still_open(stack: Stack):
    topic = unique_name("pay")
    create_topics(stack.proxy.bootstrap, topic)
    p = ck_producer(stack.proxy.bootstrap, "ck-rotate")
    p.produce(topic, value=card(1), partition=0)
    assert p.flush(TIMEOUT) == 0
    before = read(stack.tansu.bootstrap, topic, 1, "direct")[0].value()
    stack.bao.rotate(KEK)
    time.sleep(DEK_AGE_S + 1.5)       # the DEK in use expires; the next one is wrapped with the new version
    p.produce(topic, value=card(2), partition=0)
    assert p.flush(TIMEOUT) == 0
    direct = [m.value() for m in read(stack.tansu.bootstrap, topic, 2, "direct")]
    versions = [expand_ciphertext(parse_header(v)[0].wrapped).split(":")[1] for v in direct]
    assert direct[0] == before and versions[0] != versions[1], versions
    assert int(versions[1][1:]) > int(versions[0][1:])
    assert [m.value() for m in read(stack.proxy.bootstrap, topic, 2)] == [card(1), card(2)]


def test_kms_paused_on_produce_nothing_lands_and_retries_succeed_after(stack: Stack):
    topic = unique_name("own")
    stack.bao.create_key(f"k-{topic}")
    create_topics(stack.proxy.bootstrap, topic)
    reports: list[Any] = []
    p = ck_producer(stack.proxy.bootstrap, "ck-paused", **{"message.timeout.ms": 60_000, "retry.backoff.ms": 200})
    stack.bao.pause()
    try:
        for i in range(5):
            p.produce(topic, key=b"k%d" % i, value=card(i), partition=0, on_delivery=lambda e, m: reports.append(e))
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            p.poll(0.2)
        assert reports == []            # still retrying: no DEK, nothing written
        consumer = confluent_kafka.Consumer({"bootstrap.servers": stack.tansu.bootstrap, "group.id": "w"})
        try:
            _low, high = consumer.get_watermark_offsets(confluent_kafka.TopicPartition(topic, 0), timeout=TIMEOUT)
        finally:
            consumer.close()
        assert high == 0, "records reached the broker while the KMS was paused"
    finally:
        stack.bao.resume()
    assert p.flush(TIMEOUT) == 0
    assert reports == [None] * 5
    assert sorted(m.value() for m in read(stack.proxy.bootstrap, topic, 5)) == sorted(card(i) for i in range(5))
    direct = read(stack.tansu.bootstrap, topic, 5, "direct")
    assert all(is_sealed(m.key()) and is_sealed(m.value()) for m in direct)    # keys: true


def test_kms_paused_for_a_fresh_kproxy_on_fetch_delivers_nothing_wrong_then_everything(stack: Stack):
    topic = unique_name("own")
    stack.bao.create_key(f"k-{topic}")
    create_topics(stack.proxy.bootstrap, topic)
    p = ck_producer(stack.proxy.bootstrap, "ck-fetch")
    for i in range(10):
        p.produce(topic, key=b"k%d" % i, value=card(i), partition=0)
    assert p.flush(TIMEOUT) == 0
    fresh = stack.fresh_proxy()
    try:
        stack.bao.pause()
        try:
            errors: list[Any] = []
            assert read(fresh.bootstrap, topic, 10, "fresh", seconds=4, errors=errors) == []
        finally:
            stack.bao.resume()
        got = read(fresh.bootstrap, topic, 10, "fresh")
        assert sorted(m.value() for m in got) == sorted(card(i) for i in range(10))
        assert sorted(m.key() for m in got) == sorted(b"k%d" % i for i in range(10))
    finally:
        fresh.stop()


def test_a_record_tampered_with_or_moved_on_the_broker_is_never_delivered(stack: Stack):
    topic, other = unique_name("pay"), unique_name("pay")
    create_topics(stack.proxy.bootstrap, topic, other)
    p = ck_producer(stack.proxy.bootstrap, "ck-tamper")
    for i in range(3):
        p.produce(topic, key=b"k", value=card(i), partition=0)
        assert p.flush(TIMEOUT) == 0
    sealed = [m.value() for m in read(stack.tansu.bootstrap, topic, 3, "direct")]
    flipped = bytearray(sealed[0])
    flipped[-20] ^= 0x01                      # one bit of the ciphertext
    direct = confluent_kafka.Producer({"bootstrap.servers": stack.tansu.bootstrap})
    direct.produce(topic, key=b"k", value=bytes(flipped), partition=0)                 # offset 3
    direct.produce(other, key=b"k", value=sealed[1], partition=0)                      # moved
    assert direct.flush(TIMEOUT) == 0
    p.produce(topic, key=b"k", value=card(9), partition=0)                             # offset 4
    assert p.flush(TIMEOUT) == 0

    crypto = stack.proxy.server.record_crypto
    assert crypto is not None
    before = crypto.failures.get("tampered", 0)
    got = read(stack.proxy.bootstrap, topic, 5, "tamper-read", seconds=5)
    # Up to the tampered record, never it nor past it (librdkafka backs off and asks again; kproxy
    # answers INVALID_RECORD each time and counts it).
    assert [m.value() for m in got] == [card(0), card(1), card(2)]
    assert crypto.failures.get("tampered", 0) > before
    before = crypto.failures["tampered"]
    assert read(stack.proxy.bootstrap, other, 1, "moved-read", seconds=3) == []
    assert crypto.failures["tampered"] > before


def test_mask_hides_fields_from_one_client_while_another_reads_them(stack: Stack):
    topic = unique_name("pay")
    create_topics(stack.proxy.bootstrap, topic)
    p = ck_producer(stack.proxy.bootstrap, "ck-mask")
    values = [card(1), b"not json at all", json.dumps({"id": 2, "ssn": "123-45-6789"}).encode(),
              json.dumps({"id": 3}).encode()]
    for v in values:
        p.produce(topic, value=v, partition=0)
    assert p.flush(TIMEOUT) == 0
    masked = [m.value() for m in read(stack.proxy.bootstrap, topic, 4, "masked-app")]
    clear = [m.value() for m in read(stack.proxy.bootstrap, topic, 4, "billing")]
    assert clear == values
    assert json.loads(masked[0]) == {"id": 1, "card": {"number": "****"}, "note": "secret-plaintext"}
    assert masked[1] == b"not json at all"
    assert json.loads(masked[2]) == {"id": 2, "ssn": "****"}
    assert masked[3] == values[3]                   # JSON without the fields passes unchanged


def test_batches_from_a_producer_that_bypasses_kproxy_pass_unchanged(stack: Stack):
    topic = unique_name("pay")
    create_topics(stack.proxy.bootstrap, topic)
    direct = confluent_kafka.Producer({"bootstrap.servers": stack.tansu.bootstrap})
    direct.produce(topic, value=b"written before the rule", partition=0)
    assert direct.flush(TIMEOUT) == 0
    assert [m.value() for m in read(stack.proxy.bootstrap, topic, 1)] == [b"written before the rule"]


def test_rules_naming_an_unknown_kek_are_refused_at_start_and_on_reload(stack: Stack, tmp_path: Path):
    bad = 'rules:\n  - name: nope\n    match: {topic: "x-*"}\n    action: encrypt\n    encrypt: {kek: "no-such-kek"}\n'
    rules = tmp_path / "rules.yaml"
    rules.write_text(bad)
    with pytest.raises(BaseExceptionGroup) as caught:
        start_proxy(stack.tansu.bootstrap, rules=[str(rules)], kms=stack.kms)
    (error,) = caught.value.exceptions
    assert f"{rules}:2: encrypt.kek: rule 'nope' names KEK 'no-such-kek'" in str(error)
    del caught, error
    gc.collect()        # a KMS connection left open by the refused start is a ResourceWarning (an error) here

    rules.write_text(RULES)
    proxy = start_proxy(stack.tansu.bootstrap, rules=[str(rules)], kms=stack.kms)
    try:
        store = proxy.server.rule_store
        assert store is not None
        rules.write_text(bad)
        assert trio.from_thread.run(proxy.server.reload_rules_checked, "test", trio_token=proxy._token) is False
        assert store.reloads_failed == 1 and "no-such-kek" in (store.last_error or "")
        assert [r.name for r in store.rule_set.rules] == ["encrypt-pay", "encrypt-own", "mask-cards"]
    finally:
        proxy.stop()


def test_a_transactional_producer_writes_sealed_records_read_committed_through_kproxy(stack: Stack):
    topic = unique_name("pay")
    create_topics(stack.proxy.bootstrap, topic)
    p = ck_producer(stack.proxy.bootstrap, "ck-txn", **{"transactional.id": unique_name("txn")})
    p.init_transactions(TIMEOUT)
    p.begin_transaction()
    for i in range(5):
        p.produce(topic, key=b"k%d" % i, value=card(i), partition=0)
    p.commit_transaction(TIMEOUT)
    c = confluent_kafka.Consumer({"bootstrap.servers": stack.proxy.bootstrap, "group.id": unique_name("g"),
                                  "isolation.level": "read_committed", "enable.auto.commit": False})
    try:
        c.assign([confluent_kafka.TopicPartition(topic, 0, confluent_kafka.OFFSET_BEGINNING)])
        got: list[bytes] = []
        deadline = time.monotonic() + TIMEOUT
        while len(got) < 5 and time.monotonic() < deadline:
            m = c.poll(0.2)
            if m is not None and m.error() is None:
                got.append(m.value())
    finally:
        c.close()
    assert got == [card(i) for i in range(5)]
    assert all(is_sealed(m.value()) for m in read(stack.tansu.bootstrap, topic, 5, "direct"))


def test_kproxy_check_asks_the_kms_for_the_keks(stack: Stack, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    from kproxy.cli import check_config_file

    rules = tmp_path / "rules.yaml"
    rules.write_text('rules:\n  - name: typo\n    match: {topic: "p-*"}\n    action: encrypt\n'
                     '    encrypt: {kek: "pay-kekk"}\n')
    vault = stack.kms["vault"]
    config = tmp_path / "kproxy.yaml"
    config.write_text(f'listen: "127.0.0.1:19092"\nupstream: {{bootstrap_servers: ["{stack.tansu.bootstrap}"]}}\n'
                      f'mode: sidecar\nrules: [{rules}]\n'
                      f'kms:\n  vault: {{url: "{vault["url"]}", token_file: "{vault["token_file"]}"}}\n')
    assert check_config_file(str(config)) == 2
    assert f"{rules}:2: encrypt.kek: rule 'typo' names KEK 'pay-kekk'" in capsys.readouterr().err
    rules.write_text(rules.read_text().replace("pay-kekk", KEK))
    assert check_config_file(str(config)) == 0
    assert capsys.readouterr().out.startswith(f"ok: {config}")


# -- AWS KMS (moto's server mode, an emulator of the AWS KMS API) on the module's broker

AWS_RULES = """\
rules:
  - name: encrypt-aws
    match: {topic: "aws-*"}
    action: encrypt
    encrypt: {kek: "alias/aws-kek"}
"""


class AwsStack:
    def __init__(self, moto: MotoKms, key_id: str, proxy: ProxyThread, kms: dict[str, Any], rules: str) -> None:
        self.moto, self.key_id, self.proxy, self.kms, self.rules = moto, key_id, proxy, kms, rules


@pytest.fixture(scope="module")
def aws_stack(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AwsStack]:
    """A kproxy with ``kms: {aws: ...}`` on the module's tansu, its KEK an alias in a moto server."""
    work = tmp_path_factory.mktemp("aws")
    moto = MotoKms(work).start()
    proxy = None
    # boto3 in kproxy's thread finds its credentials in the environment, as it would on a host.
    with pytest.MonkeyPatch.context() as env:
        for name, value in AWS_CREDENTIALS.items():
            env.setenv(name, value)
        try:
            key_id = str(moto.client().create_key()["KeyMetadata"]["KeyId"])
            moto.client().create_alias(AliasName="alias/aws-kek", TargetKeyId=key_id)
            rules = work / "rules.yaml"
            rules.write_text(AWS_RULES)
            kms = {"aws": {"region": AWS_REGION, "endpoint_url": moto.url, "timeout_s": 2.0}}
            proxy = start_proxy(stack.tansu.bootstrap, rules=[str(rules)], kms=kms,
                                upstream_settings={"request_timeout_s": 5.0})
            yield AwsStack(moto, key_id, proxy, kms, str(rules))
        finally:
            if proxy is not None:
                proxy.stop()
            moto.stop()


def test_aws_kms_plaintext_through_kproxy_envelopes_on_the_broker_and_a_rotated_key_still_opens(
        stack: Stack, aws_stack: AwsStack):
    topic = unique_name("aws")
    create_topics(aws_stack.proxy.bootstrap, topic)
    p = ck_producer(aws_stack.proxy.bootstrap, "ck-aws", **{"compression.type": "lz4"})
    for i in range(10):
        p.produce(topic, key=b"k%d" % i, value=card(i), partition=0)
    assert p.flush(TIMEOUT) == 0
    assert [m.value() for m in read(aws_stack.proxy.bootstrap, topic, 10)] == [card(i) for i in range(10)]
    direct = read(stack.tansu.bootstrap, topic, 10, "direct")
    assert len(direct) == 10
    for m in direct:
        assert is_sealed(m.value()) and b"secret-plaintext" not in m.value() and CARD_NUMBER not in m.value()
        ref = parse_header(m.value())[0]
        assert ref.kms == Kms.AWS_KMS and ref.kek == "alias/aws-kek"

    # The key's material rotated in the KMS; a fresh kproxy (nothing cached) asks AWS KMS to
    # Decrypt the DEK the records name, wrapped with the old material, and reads them all.
    aws_stack.moto.client().rotate_key_on_demand(KeyId=aws_stack.key_id)
    decrypts = aws_stack.moto.requests("Decrypt")
    with pytest.MonkeyPatch.context() as env:
        for name, value in AWS_CREDENTIALS.items():
            env.setenv(name, value)
        fresh = start_proxy(stack.tansu.bootstrap, rules=[aws_stack.rules], kms=aws_stack.kms)
        try:
            assert [m.value() for m in read(fresh.bootstrap, topic, 10, "fresh")] == [card(i) for i in range(10)]
        finally:
            fresh.stop()
    assert aws_stack.moto.requests("Decrypt") == decrypts + 1      # one DEK, one call


def test_aws_kms_an_unknown_key_is_refused_at_start(stack: Stack, aws_stack: AwsStack, tmp_path: Path):
    rules = tmp_path / "rules.yaml"
    rules.write_text(AWS_RULES.replace("alias/aws-kek", "alias/no-such-key"))
    with pytest.MonkeyPatch.context() as env, pytest.raises(BaseExceptionGroup) as caught:
        for name, value in AWS_CREDENTIALS.items():
            env.setenv(name, value)
        start_proxy(stack.tansu.bootstrap, rules=[str(rules)], kms=aws_stack.kms)
    (error,) = caught.value.exceptions
    assert f"{rules}:2: encrypt.kek: rule 'encrypt-aws' names KEK 'alias/no-such-key'" in str(error)
    del caught, error
    gc.collect()


# -- the other real clients: aiokafka and kcat (Debian's, librdkafka 2.0.2) on the Vault stack


async def _aiokafka_round_trip(bootstrap: str, topic: str, values: list[bytes]) -> list[tuple[bytes, bytes]]:
    # Not idempotent: aiokafka 0.14 sends InitProducerId v0, which tansu 0.6 fails (docs/testing.md);
    # idempotent sealed batches are confluent-kafka's part above.
    producer = aiokafka.AIOKafkaProducer(bootstrap_servers=bootstrap, client_id="ak-pay", acks="all",
                                         enable_idempotence=False, compression_type="gzip",
                                         request_timeout_ms=10_000)
    try:
        await producer.start()
        sent = [await producer.send(topic, key=b"k%d" % i, value=v, partition=0) for i, v in enumerate(values)]
        await producer.flush()
        await asyncio.gather(*sent)
    finally:
        await producer.stop()
    consumer = aiokafka.AIOKafkaConsumer(bootstrap_servers=bootstrap, client_id="ak-read", group_id=None,
                                         enable_auto_commit=False, auto_offset_reset="earliest",
                                         request_timeout_ms=10_000)
    got: list[tuple[bytes, bytes]] = []
    try:
        await consumer.start()
        consumer.assign([aiokafka.TopicPartition(topic, 0)])
        await consumer.seek_to_beginning()
        deadline = time.monotonic() + TIMEOUT
        while len(got) < len(values) and time.monotonic() < deadline:
            for messages in (await consumer.getmany(timeout_ms=200)).values():
                got.extend((m.key, m.value) for m in messages)
    finally:
        await consumer.stop()
    return got


def assert_only_envelopes_on_the_broker(stack: Stack, topic: str, count: int, plaintext: bytes) -> None:
    direct = read(stack.tansu.bootstrap, topic, count, "direct")
    assert len(direct) == count
    for m in direct:
        assert is_sealed(m.value()) and plaintext not in m.value(), m.value()[:40]
        assert parse_header(m.value())[0].kek == KEK


def test_aiokafka_writes_and_reads_plaintext_through_kproxy_and_the_broker_holds_envelopes(stack: Stack):
    topic = unique_name("pay")
    create_topics(stack.proxy.bootstrap, topic)
    values = [card(i) for i in range(10)]
    got = asyncio.run(asyncio.wait_for(_aiokafka_round_trip(stack.proxy.bootstrap, topic, values), 3 * TIMEOUT))
    assert got == [(b"k%d" % i, v) for i, v in enumerate(values)]
    assert_only_envelopes_on_the_broker(stack, topic, 10, b"secret-plaintext")


@pytest.mark.usefixtures("kcat_binary")
def test_kcat_writes_and_reads_plaintext_through_kproxy_and_the_broker_holds_envelopes(stack: Stack):
    # Debian's kcat cannot talk to tansu directly (tests/e2e/kcat.py), but through kproxy it can.
    topic = unique_name("pay")
    create_topics(stack.proxy.bootstrap, topic)
    records = [(f"key-{i}", f"kcat-plaintext-{i}") for i in range(10)]
    ok, output = kcat_roundtrip(stack.proxy.bootstrap, topic, records)
    assert ok, output
    assert_only_envelopes_on_the_broker(stack, topic, 10, b"kcat-plaintext")


# -- a PKCS#11 token (SoftHSM, Debian's softhsm2) on the module's broker

HSM_RULES = """\
rules:
  - name: encrypt-hsm
    match: {topic: "hsm-*"}
    action: encrypt
    encrypt: {kek: "hsm-kek", keys: true}
"""


class HsmStack:
    def __init__(self, hsm: SoftHsm, proxy: ProxyThread, kms: dict[str, Any], rules: str) -> None:
        self.hsm, self.proxy, self.kms, self.rules = hsm, proxy, kms, rules


@pytest.fixture(scope="module")
def hsm_stack(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HsmStack]:
    """A kproxy with ``kms: {pkcs11: ...}`` on the module's tansu, its KEK an AES key on a SoftHSM token."""
    hsm = shared_softhsm()
    hsm.create_key("hsm-kek")
    rules = tmp_path_factory.mktemp("hsm") / "rules.yaml"
    rules.write_text(HSM_RULES)
    kms = {"pkcs11": {"module": hsm.module, "token_label": hsm.label, "pin_file": str(hsm.pin_file)}}
    proxy = start_proxy(stack.tansu.bootstrap, rules=[str(rules)], kms=kms, upstream_settings={"request_timeout_s": 5.0})
    try:
        yield HsmStack(hsm, proxy, kms, str(rules))
    finally:
        proxy.stop()


def test_pkcs11_plaintext_through_kproxy_envelopes_on_the_broker_and_a_fresh_kproxy_reads_them(
        stack: Stack, hsm_stack: HsmStack):
    proxy, kms, rules = hsm_stack.proxy, hsm_stack.kms, hsm_stack.rules
    topic = unique_name("hsm")
    create_topics(proxy.bootstrap, topic)
    p = ck_producer(proxy.bootstrap, "ck-hsm", **{"compression.type": "snappy", "enable.idempotence": True})
    for i in range(10):
        p.produce(topic, key=b"k%d" % i, value=card(i), partition=0)
    assert p.flush(TIMEOUT) == 0
    assert [(m.key(), m.value()) for m in read(proxy.bootstrap, topic, 10)] == [(b"k%d" % i, card(i)) for i in range(10)]
    direct = read(stack.tansu.bootstrap, topic, 10, "direct")
    assert len(direct) == 10
    for m in direct:
        assert is_sealed(m.key()) and is_sealed(m.value()) and b"secret-plaintext" not in m.value()
        ref = parse_header(m.value())[0]
        assert ref.kms == Kms.PKCS11 and ref.kek == "hsm-kek"
    # A second kproxy in this process (nothing cached) unwraps the DEK on the token: it shares the
    # process's login with the first, and stopping it leaves the first logged in.
    fresh = start_proxy(stack.tansu.bootstrap, rules=[rules], kms=kms)
    try:
        assert [m.value() for m in read(fresh.bootstrap, topic, 10, "fresh")] == [card(i) for i in range(10)]
    finally:
        fresh.stop()
    again = unique_name("hsm")
    create_topics(proxy.bootstrap, again)
    p.produce(again, value=card(1), partition=0)
    assert p.flush(TIMEOUT) == 0
    assert [m.value() for m in read(proxy.bootstrap, again, 1)] == [card(1)]


def test_pkcs11_an_unknown_key_is_refused_by_kproxy_check_at_start_and_on_reload(
        stack: Stack, hsm_stack: HsmStack, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    from kproxy.cli import check_config_file

    hsm, kms = hsm_stack.hsm, hsm_stack.kms
    bad = HSM_RULES.replace('"hsm-kek"', '"no-such-label"')
    rules = tmp_path / "rules.yaml"
    rules.write_text(bad)
    config = tmp_path / "kproxy.yaml"
    config.write_text(f'listen: "127.0.0.1:19092"\nupstream: {{bootstrap_servers: ["{stack.tansu.bootstrap}"]}}\n'
                      f'mode: sidecar\nrules: [{rules}]\nkms:\n  pkcs11: {{module: {hsm.module}, '
                      f'token_label: {hsm.label}, pin_file: {hsm.pin_file}}}\n')
    assert check_config_file(str(config)) == 2
    assert f"{rules}:2: encrypt.kek: rule 'encrypt-hsm' names KEK 'no-such-label'" in capsys.readouterr().err
    with pytest.raises(BaseExceptionGroup) as caught:
        start_proxy(stack.tansu.bootstrap, rules=[str(rules)], kms=kms)
    (error,) = caught.value.exceptions
    assert f"{rules}:2: encrypt.kek: rule 'encrypt-hsm' names KEK 'no-such-label'" in str(error)
    del caught, error
    gc.collect()

    rules.write_text(HSM_RULES)
    assert check_config_file(str(config)) == 0
    proxy = start_proxy(stack.tansu.bootstrap, rules=[str(rules)], kms=kms)
    try:
        store = proxy.server.rule_store
        assert store is not None
        rules.write_text(bad)
        assert trio.from_thread.run(proxy.server.reload_rules_checked, "test", trio_token=proxy._token) is False
        assert "no-such-label" in (store.last_error or "")
        assert [r.name for r in store.rule_set.rules] == ["encrypt-hsm"]
    finally:
        proxy.stop()

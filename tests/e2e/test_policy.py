"""Policy rules end to end: real clients through kproxy on tansu (refused topics, tenants with groups,
mTLS admins, acks), live reloads while a consumer polls, SIGHUP, and the topic-id question on a fake
broker."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiokafka
import aiokafka.errors
import confluent_kafka
import confluent_kafka.admin
import pytest
import trustme

from kproxy.config import parse_config
from kproxy.protocol.errors import TOPIC_AUTHORIZATION_FAILED, UNKNOWN_TOPIC_ID
from kproxy.protocol.messages import body_class
from kproxy.server.embedded import ProxyThread
from kproxy.tansu import broker_answers
from tests.e2e.fake_cluster import METADATA, PRODUCE, TOPIC_ID, FakeCluster
from tests.e2e.proxied import free_port_block, start_proxy
from tests.e2e.tansu import TansuBroker, unique_name
from tests.e2e.wire import Wire

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "rules"
TIMEOUT = 30.0
GROUP_SETTINGS = {"session.timeout.ms": 6000, "max.poll.interval.ms": 6000, "heartbeat.interval.ms": 1000}

with warnings.catch_warnings():
    # kafka-python 3.0 loads its schemas with the importlib.resources calls deprecated in 3.11.
    warnings.simplefilter("ignore", DeprecationWarning)
    import kafka
    import kafka.errors


def write(path: Path, text: str) -> str:
    # Write next to the target, then rename: a reader never sees half a file.
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return str(path)


def create_topics(bootstrap: str, *names: str, partitions: int = 1, client_id: str = "e2e-admin") -> None:
    admin = confluent_kafka.admin.AdminClient({"bootstrap.servers": bootstrap, "client.id": client_id})
    futures = admin.create_topics([confluent_kafka.admin.NewTopic(n, partitions, 1) for n in names],
                                  request_timeout=TIMEOUT)
    for future in futures.values():
        future.result(timeout=TIMEOUT)


def ck_producer(bootstrap: str, client_id: str, **extra: Any) -> confluent_kafka.Producer:
    return confluent_kafka.Producer({"bootstrap.servers": bootstrap, "client.id": client_id, "acks": "all",
                                     "linger.ms": 5, "message.timeout.ms": 20_000, **extra})


def ck_produce(producer: confluent_kafka.Producer, topic: str, values: list[bytes]) -> list[Any]:
    """Produce and flush; the delivery error of each record (None when written)."""
    errors: list[Any] = []
    for value in values:
        producer.produce(topic, value=value, on_delivery=lambda err, _msg: errors.append(err))
    assert producer.flush(TIMEOUT) == 0
    return errors


# -- a refused topic fails at the client, an allowed one keeps working -----------------------------


@pytest.fixture(scope="module")
def guarded(broker: TansuBroker, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[ProxyThread, str, str]]:
    d = tmp_path_factory.mktemp("guarded")
    rules = write(d / "rules.yaml", "rules: [{name: no-secrets, match: {topic: 'secret-*'}, action: deny}]\n")
    allowed, secret = unique_name("open"), unique_name("secret-x")
    create_topics(broker.bootstrap, allowed, secret)       # both exist: the refusal is the proxy's
    proxy = start_proxy(broker.bootstrap, rules=[rules])
    try:
        yield proxy, allowed, secret
    finally:
        proxy.stop()


def test_confluent_kafka_gets_topic_authorization_failed_and_keeps_writing(guarded):
    proxy, allowed, secret = guarded
    producer = ck_producer(proxy.bootstrap, "ck-guarded")
    assert ck_produce(producer, allowed, [b"a1"]) == [None]
    (err,) = ck_produce(producer, secret, [b"s1"])
    assert err is not None and err.code() == confluent_kafka.KafkaError.TOPIC_AUTHORIZATION_FAILED
    assert ck_produce(producer, allowed, [b"a2"]) == [None]


def test_kafka_python_gets_topic_authorization_failed_and_keeps_writing(guarded):
    proxy, allowed, secret = guarded
    producer = kafka.KafkaProducer(bootstrap_servers=proxy.bootstrap, client_id="kp-guarded", acks="all",
                                   max_block_ms=10_000, request_timeout_ms=10_000)
    try:
        producer.send(allowed, b"a1").get(timeout=TIMEOUT)
        with pytest.raises(kafka.errors.TopicAuthorizationFailedError):
            producer.send(secret, b"s1").get(timeout=TIMEOUT)
        producer.send(allowed, b"a2").get(timeout=TIMEOUT)
    finally:
        producer.close(timeout=5)


def test_aiokafka_gets_topic_authorization_failed_and_keeps_writing(guarded):
    proxy, allowed, secret = guarded

    async def run() -> None:
        producer = aiokafka.AIOKafkaProducer(bootstrap_servers=proxy.bootstrap, client_id="ak-guarded", acks="all")
        await producer.start()
        try:
            await producer.send_and_wait(allowed, b"a1")
            with pytest.raises(aiokafka.errors.TopicAuthorizationFailedError):
                await producer.send_and_wait(secret, b"s1")
            await producer.send_and_wait(allowed, b"a2")
        finally:
            await producer.stop()

    asyncio.run(asyncio.wait_for(run(), TIMEOUT))


def test_consumers_are_refused_the_topic_and_metadata_hides_it(guarded):
    proxy, allowed, secret = guarded
    admin = confluent_kafka.admin.AdminClient({"bootstrap.servers": proxy.bootstrap, "client.id": "ck-list"})
    listed = admin.list_topics(timeout=TIMEOUT).topics
    assert allowed in listed and secret not in listed
    consumer = confluent_kafka.Consumer({"bootstrap.servers": proxy.bootstrap, "client.id": "ck-reader",
                                         "group.id": unique_name("g"), "enable.auto.commit": False})
    try:
        consumer.subscribe([secret])      # the refusal comes with the topic's metadata, before any join
        deadline = time.monotonic() + TIMEOUT
        error = None
        while error is None and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is not None and message.error():
                error = message.error()
        assert error is not None and error.code() == confluent_kafka.KafkaError.TOPIC_AUTHORIZATION_FAILED
    finally:
        consumer.close()


# -- two tenants on one cluster --------------------------------------------------------------------


def tenant_round(bootstrap: str, team: str, topic: str, group: str, values: list[bytes]) -> dict[str, Any]:
    """As team ``team``: create ``topic``, produce ``values``, consume them in ``group``, list topics
    and groups. Returns what the tenant saw."""
    create_topics(bootstrap, topic, client_id=f"{team}-admin")
    producer = ck_producer(bootstrap, f"{team}-producer")
    assert ck_produce(producer, topic, values) == [None] * len(values)
    consumer = confluent_kafka.Consumer({"bootstrap.servers": bootstrap, "client.id": f"{team}-consumer",
                                         "group.id": group, "auto.offset.reset": "earliest",
                                         "enable.auto.commit": False, **GROUP_SETTINGS})
    seen: list[bytes] = []
    try:
        consumer.subscribe([topic])
        deadline = time.monotonic() + TIMEOUT
        while len(seen) < len(values) and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is not None and not message.error():
                seen.append(message.value())
        consumer.commit(asynchronous=False)
    finally:
        consumer.close()
    admin = confluent_kafka.admin.AdminClient({"bootstrap.servers": bootstrap, "client.id": f"{team}-lister"})
    groups = admin.list_consumer_groups(request_timeout=TIMEOUT).result(timeout=TIMEOUT)
    return {"seen": sorted(seen), "topics": sorted(t for t in admin.list_topics(timeout=TIMEOUT).topics
                                                    if not t.startswith("__")),
            "groups": sorted(g.group_id for g in groups.valid)}


def test_two_tenants_share_a_cluster_without_seeing_each_other(broker: TansuBroker):
    proxy = start_proxy(broker.bootstrap, rules=[str(RULES / "multi-tenant.yaml")])
    topic, group = unique_name("orders"), unique_name("g")
    results: dict[str, Any] = {}

    def run(team: str) -> None:
        results[team] = tenant_round(proxy.bootstrap, team, topic, group, [f"{team}-{i}".encode() for i in range(5)])

    try:
        threads = [threading.Thread(target=run, args=(team,)) for team in ("team-a", "team-b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(3 * TIMEOUT)
        stranger = ck_producer(proxy.bootstrap, "someone-else")
        (err,) = ck_produce(stranger, topic, [b"x"])
        assert err is not None and err.code() == confluent_kafka.KafkaError.TOPIC_AUTHORIZATION_FAILED
    finally:
        proxy.stop()
    for team in ("team-a", "team-b"):
        assert results[team] == {"seen": [f"{team}-{i}".encode() for i in range(5)], "topics": [topic],
                                 "groups": [group]}, team
    direct = confluent_kafka.admin.AdminClient({"bootstrap.servers": broker.bootstrap})
    held = set(direct.list_topics(timeout=TIMEOUT).topics)
    assert {f"tenant-a.{topic}", f"tenant-b.{topic}"} <= held and topic not in held
    groups = {g.group_id for g in direct.list_consumer_groups(request_timeout=TIMEOUT).result(TIMEOUT).valid}
    assert {f"tenant-a.{group}", f"tenant-b.{group}"} <= groups and group not in groups


# -- admin APIs by mTLS identity -------------------------------------------------------------------


def test_admin_apis_are_allowed_to_the_operator_certificate_only(broker: TansuBroker, tmp_path: Path):
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    server = ca.issue_cert("127.0.0.1", "localhost")
    server.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "server.pem"))
    for name in ("ops", "alice"):
        leaf = ca.issue_cert(f"{name}.clients.test", common_name=name)
        leaf.private_key_pem.write_to_path(str(tmp_path / f"{name}.key"))
        leaf.cert_chain_pems[0].write_to_path(str(tmp_path / f"{name}.pem"))
    port = free_port_block()
    cfg = parse_config(f"""\
listen: "127.0.0.1:{port}"
upstream: {{bootstrap_servers: ["{broker.bootstrap}"]}}
exposure: {{advertised_host: 127.0.0.1, broker_port_count: 6}}
tls: {{enabled: true, cert_file: {tmp_path / 'server.pem'}, key_file: {tmp_path / 'server.pem'},
      ca_file: {tmp_path / 'ca.pem'}, require_client_cert: true}}
rules: [{RULES / 'admin-lockdown.yaml'}]
""")

    def create_as(name: str, topic: str) -> Any:
        admin = confluent_kafka.admin.AdminClient({
            "bootstrap.servers": f"127.0.0.1:{port}", "client.id": f"{name}-admin", "security.protocol": "SSL",
            "ssl.ca.location": str(tmp_path / "ca.pem"), "ssl.certificate.location": str(tmp_path / f"{name}.pem"),
            "ssl.key.location": str(tmp_path / f"{name}.key")})
        (future,) = admin.create_topics([confluent_kafka.admin.NewTopic(topic, 1, 1)],
                                        request_timeout=TIMEOUT).values()
        try:
            future.result(timeout=TIMEOUT)
        except confluent_kafka.KafkaException as e:
            return e.args[0].code()
        return None

    with ProxyThread(cfg).start():
        mine, theirs = unique_name("ops-topic"), unique_name("alice-topic")
        assert create_as("ops", mine) is None
        assert create_as("alice", theirs) == confluent_kafka.KafkaError.TOPIC_AUTHORIZATION_FAILED
    held = confluent_kafka.admin.AdminClient({"bootstrap.servers": broker.bootstrap}).list_topics(
        timeout=TIMEOUT).topics
    assert mine in held and theirs not in held


# -- producer standards ----------------------------------------------------------------------------


def test_acks_1_is_refused_and_acks_all_accepted(broker: TansuBroker):
    topic = unique_name("acks")
    create_topics(broker.bootstrap, topic)
    proxy = start_proxy(broker.bootstrap, rules=[str(RULES / "producer-standards.yaml")])
    try:
        one = ck_produce(ck_producer(proxy.bootstrap, "acks-1", acks="1", **{"compression.type": "lz4"}),
                         topic, [b"v"])
        assert [e.code() for e in one] == [confluent_kafka.KafkaError.INVALID_REQUIRED_ACKS]
        every = ck_produce(ck_producer(proxy.bootstrap, "acks-all", **{"compression.type": "lz4"}), topic, [b"v"])
        assert every == [None]
        # Small batches may go uncompressed (librdkafka sends them so when compression would not
        # help); larger ones must be compressed.
        assert ck_produce(ck_producer(proxy.bootstrap, "small"), topic, [b"v"]) == [None]
        (plain,) = ck_produce(ck_producer(proxy.bootstrap, "uncompressed"), topic, [b"v" * 4000])
        assert plain.code() == confluent_kafka.KafkaError.POLICY_VIOLATION
    finally:
        proxy.stop()


# -- live reload while a consumer polls ------------------------------------------------------------


def test_an_edit_takes_effect_while_a_consumer_polls_and_a_broken_edit_changes_nothing(broker, tmp_path):
    topic, other = unique_name("live"), unique_name("other")
    create_topics(broker.bootstrap, topic, other)
    rules = write(tmp_path / "rules.yaml", "default: allow\n")
    proxy = start_proxy(broker.bootstrap, rules=[rules])
    producer = ck_producer(broker.bootstrap, "direct-writer")
    consumer = confluent_kafka.Consumer({"bootstrap.servers": proxy.bootstrap, "client.id": "live-reader",
                                         "group.id": unique_name("g"), "enable.auto.commit": False,
                                         "fetch.wait.max.ms": 100})
    store = proxy.server.rule_store
    assert store is not None

    def poll_until(predicate, what: str) -> Any:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            message = consumer.poll(0.2)
            if message is not None and predicate(message):
                return message
        raise AssertionError(f"no {what} within {TIMEOUT}s")

    try:
        consumer.assign([confluent_kafka.TopicPartition(topic, 0, confluent_kafka.OFFSET_BEGINNING)])
        assert ck_produce(producer, topic, [b"before"]) == [None]
        assert poll_until(lambda m: not m.error(), "record").value() == b"before"
        connections = proxy.server.stats.connections_total
        write(tmp_path / "rules.yaml", f"rules: [{{name: close-{topic}, match: {{topic: {topic}}}, "
                                       "action: deny}]\n")
        error = poll_until(lambda m: m.error() is not None, "refusal").error()
        assert error.code() == confluent_kafka.KafkaError.TOPIC_AUTHORIZATION_FAILED
        assert store.generation == 2
        write(tmp_path / "rules.yaml", "rules: [{name: broken, action: alow}]\n")
        deadline = time.monotonic() + TIMEOUT
        while store.reloads_failed == 0 and time.monotonic() < deadline:
            consumer.poll(0.2)
        assert store.reloads_failed == 1 and store.generation == 2
        assert "unknown action 'alow'" in (store.last_error or "")
        # The old rules still hold: the topic stays refused, another one is readable.
        assert ck_produce(producer, topic, [b"after"]) == [None]
        assert ck_produce(producer, other, [b"elsewhere"]) == [None]
        consumer.assign([confluent_kafka.TopicPartition(other, 0, confluent_kafka.OFFSET_BEGINNING)])
        assert poll_until(lambda m: not m.error(), "record").value() == b"elsewhere"
        # No connection was opened again: the consumer kept the ones it had.
        assert proxy.server.stats.connections_total == connections
    finally:
        consumer.close()
        proxy.stop()


# -- the process: bad rules stop a start, SIGHUP reloads -------------------------------------------


def test_kproxy_run_reloads_on_sighup_and_refuses_to_start_with_bad_rules(broker: TansuBroker, tmp_path: Path):
    port = free_port_block()
    rules = write(tmp_path / "rules.yaml", "rules: [{name: a, action: allow}]\n")
    argv = [sys.executable, "-m", "kproxy", "run", "--upstream", broker.bootstrap, "--listen",
            f"127.0.0.1:{port}", "--rules", rules]
    bad = write(tmp_path / "bad.yaml", "rules: [{name: a, action: alow}]\n")
    refused = subprocess.run([*argv[:-1], bad], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2
    assert f"{bad}:1:27: rule 'a': action: unknown action 'alow' (did you mean 'allow'?)" in refused.stderr
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not broker_answers("127.0.0.1", port) and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=TIMEOUT)
    finally:
        proc.kill()
    assert "rules in force: 1 rule (1 allow) from 1 file" in err
    assert "rules reloaded (SIGHUP): generation 2, 1 rule (1 allow)" in err
    assert proc.returncode == 0


# -- topic ids: kproxy asks the broker on the client's connection ------------------------------------


def test_a_produce_by_unknown_topic_id_is_judged_after_asking_the_broker(tmp_path):
    rules = write(tmp_path / "rules.yaml", "rules: [{name: no-t, match: {topic: t}, action: deny}]\n")
    with FakeCluster((1,), coordinator_id=1) as cluster:
        proxy = start_proxy(cluster.bootstrap, rules=[rules])
        questions_before = len(cluster.brokers[1].received(METADATA))   # kproxy's own discovery
        try:
            cls = body_class(PRODUCE, "request")
            stranger = uuid.UUID(int=7)
            body = cls(acks=-1, timeout_ms=1000, topic_data=[
                cls.TopicProduceData(topic_id=i, partition_data=[cls.PartitionProduceData(index=0, records=b"")])
                for i in (TOPIC_ID, stranger)])
            wire = Wire(proxy.bootstrap)
            wire.send(PRODUCE, 13, 5, body)
            resp = wire.receive(PRODUCE, 13)
            wire.close()
        finally:
            proxy.stop()
        codes = {t.topic_id: t.partition_responses[0].error_code for t in resp.body.responses}
        assert codes == {TOPIC_ID: TOPIC_AUTHORIZATION_FAILED, stranger: UNKNOWN_TOPIC_ID}
        asked = cluster.brokers[1].received(METADATA)[questions_before:]
        assert [(r.client_id, r.api_version) for r in asked] == [("kproxy", 12)]
        assert cluster.brokers[1].received(PRODUCE) == []
        assert cluster.errors == []

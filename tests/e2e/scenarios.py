"""Client scenarios that run unchanged against a broker or through kproxy, returning comparable results.

Every scenario is a plain synchronous function of a bootstrap "host:port" (and names), bounded in
time, returning values without hosts, ports, topic names or member ids, so that
`scenario(direct) == scenario(proxied)` is a meaningful assertion. aiokafka scenarios run their own
event loop with `asyncio.run`: never call them from inside a trio task (use `trio.to_thread.run_sync`).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import aiokafka
import aiokafka.admin
import aiokafka.admin.config_resource
import confluent_kafka
import confluent_kafka.admin

with warnings.catch_warnings():
    # kafka-python 3.0 loads its schemas with the importlib.resources calls deprecated in 3.11.
    warnings.simplefilter("ignore", DeprecationWarning)
    import kafka
    import kafka.admin
    from kafka.partitioner.default import murmur2

Headers = tuple[tuple[str, bytes], ...]
Record = tuple[int, bytes | None, bytes | None, Headers]
"""(partition, key, value, headers): what a consumer saw, minus offsets and timestamps."""

Endpoints = tuple[tuple[int, str, int], ...]
"""(node_id, host, port) per broker, sorted: what a proxy must rewrite to its own listeners."""

PARTITIONS = 3
N_RECORDS = 50
TIMEOUT = 30.0
"""Upper bound in seconds for one scenario step (create, produce, consume, join)."""

# tansu holds the first JoinGroup for the rebalance timeout; with 6 s a join completes in ~3 s
# (docs/testing.md). A 1 s heartbeat makes the existing member notice the second one's join quickly.
SESSION_TIMEOUT_MS = 6000
MAX_POLL_INTERVAL_MS = 6000
HEARTBEAT_INTERVAL_MS = 1000

TOPIC_CONFIGS = {"cleanup.policy": "compact", "retention.ms": "86400000"}


@dataclass(frozen=True)
class GroupResult:
    """Two members of one group sharing a topic: what they consumed together and how it was split."""

    records: tuple[Record, ...]  # sorted, duplicates (re-delivery after rebalance) removed
    assignment_sizes: tuple[int, ...]  # partitions per member, sorted: (1, 2) for 3 partitions
    partitions: tuple[int, ...]  # union of assigned partitions, sorted


@dataclass(frozen=True)
class AdminTopicsResult:
    """Create then delete some topics; one entry per topic, in the order they were given."""

    created_partitions: tuple[int, ...]
    present_after_create: tuple[bool, ...]
    present_after_delete: tuple[bool, ...]


@dataclass(frozen=True)
class ClusterFacts:
    """DescribeCluster/Metadata facts that survive a proxy: no hosts, no ports."""

    cluster_id: str | None
    broker_count: int
    controller_present: bool  # the controller id names one of the listed brokers


# --------------------------------------------------------------------------------------------------
# Data shared by every client


def sent_records(n: int = N_RECORDS) -> list[tuple[bytes, bytes | None, Headers]]:
    """The (key, value, headers) every produce scenario sends: keyed, some headers, one tombstone."""
    records: list[tuple[bytes, bytes | None, Headers]] = []
    for i in range(n):
        key = b"key-%03d" % i
        value: bytes | None = None if i % 25 == 24 else (b"value-%03d|" % i) * (1 + i % 4)
        headers: Headers
        if i % 3 == 0:
            headers = ()
        elif i % 3 == 1:
            headers = (("trace", b"t-%d" % i),)
        else:
            headers = (("a", b"1"), ("empty", b""), ("a", b"2"))  # repeated and empty, in order
        records.append((key, value, headers))
    return records


def partition_for(key: bytes, partitions: int = PARTITIONS) -> int:
    """Java's default partitioner (murmur2, positive, modulo): what all three clients are set to use."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


def expected_records(n: int = N_RECORDS, partitions: int = PARTITIONS) -> list[Record]:
    """What a produce-then-consume scenario must return when nothing was lost or altered."""
    return sort_records(
        (partition_for(key, partitions), key, value, headers) for key, value, headers in sent_records(n)
    )


def sort_records(records: Iterable[Record]) -> list[Record]:
    # Keys are unique per scenario; the key function only guards against None compared with bytes.
    return sorted(set(records), key=lambda r: (r[0], r[1] or b"", r[2] or b"", r[3]))


def _deadline(timeout: float) -> Callable[[], float]:
    end = time.monotonic() + timeout
    return lambda: end - time.monotonic()


def _client_id(client: str) -> str:
    return f"kproxy-e2e-{client}-{uuid.uuid4().hex[:6]}"


# --------------------------------------------------------------------------------------------------
# kafka-python


def _kp_admin(bootstrap: str) -> kafka.KafkaAdminClient:
    return kafka.KafkaAdminClient(
        bootstrap_servers=bootstrap, client_id=_client_id("kafka-python"), request_timeout_ms=10_000
    )


def _kp_partition_count(admin: kafka.KafkaAdminClient, topic: str) -> int:
    (description,) = admin.describe_topics([topic])
    return len(description["partitions"])


def kafka_python_create_topic(
    bootstrap: str, topic: str, partitions: int = PARTITIONS, configs: dict[str, str] | None = None
) -> int:
    """CreateTopics, then the partition count Metadata reports for it."""
    admin = _kp_admin(bootstrap)
    try:
        admin.create_topics([kafka.admin.NewTopic(topic, partitions, 1, topic_configs=configs or {})])
        return _kp_partition_count(admin, topic)
    finally:
        admin.close()


def _kp_produce(bootstrap: str, topic: str, n: int, idempotent: bool) -> None:
    producer = kafka.KafkaProducer(
        bootstrap_servers=bootstrap,
        client_id=_client_id("kafka-python"),
        acks="all",
        enable_idempotence=idempotent,  # kafka-python 3.0 defaults to True: always say which
        linger_ms=5,
        max_block_ms=int(TIMEOUT * 1000),
        request_timeout_ms=10_000,
        delivery_timeout_ms=int(TIMEOUT * 1000),
    )
    try:
        futures = [
            producer.send(topic, key=key, value=value, headers=list(headers))
            for key, value, headers in sent_records(n)
        ]
        producer.flush(timeout=TIMEOUT)
        for future in futures:
            future.get(timeout=TIMEOUT)  # raises the delivery error, if any
    finally:
        producer.close(timeout=5)


def _kp_record(message: Any) -> Record:
    return (message.partition, message.key, message.value, tuple((k, v) for k, v in message.headers or ()))


def _kp_consume_assigned(bootstrap: str, topic: str, n: int, partitions: int) -> list[Record]:
    consumer = kafka.KafkaConsumer(
        bootstrap_servers=bootstrap,
        client_id=_client_id("kafka-python"),
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        request_timeout_ms=10_000,
    )
    try:
        consumer.assign([kafka.TopicPartition(topic, p) for p in range(partitions)])
        consumer.seek_to_beginning()
        seen: list[Record] = []
        remaining = _deadline(TIMEOUT)
        while len(seen) < n and remaining() > 0:
            for messages in consumer.poll(timeout_ms=200).values():
                seen.extend(_kp_record(m) for m in messages)
        return sort_records(seen)
    finally:
        consumer.close()


def kafka_python_produce_consume(
    bootstrap: str, topic: str, n: int = N_RECORDS, *, idempotent: bool = False
) -> list[Record]:
    """Create a 3-partition topic, produce `sent_records(n)` with acks=all, read all back by assign."""
    kafka_python_create_topic(bootstrap, topic)
    _kp_produce(bootstrap, topic, n, idempotent)
    return _kp_consume_assigned(bootstrap, topic, n, PARTITIONS)


def kafka_python_idempotent_produce_consume(bootstrap: str, topic: str, n: int = N_RECORDS) -> list[Record]:
    return kafka_python_produce_consume(bootstrap, topic, n, idempotent=True)


def _kp_group_member(bootstrap: str, topic: str, group: str) -> kafka.KafkaConsumer:
    consumer = kafka.KafkaConsumer(
        bootstrap_servers=bootstrap,
        client_id=_client_id("kafka-python"),
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        session_timeout_ms=SESSION_TIMEOUT_MS,
        max_poll_interval_ms=MAX_POLL_INTERVAL_MS,
        heartbeat_interval_ms=HEARTBEAT_INTERVAL_MS,
        request_timeout_ms=10_000,
    )
    consumer.subscribe([topic])
    return consumer


def kafka_python_group(bootstrap: str, topic: str, group: str, n: int = N_RECORDS) -> GroupResult:
    """Member A joins alone, member B joins (rebalance), then n records are produced and consumed.

    Each member polls from its own thread: kafka-python blocks inside poll() while its group
    rebalances, so one thread polling both members would leave the other out of the join.
    """
    kafka_python_create_topic(bootstrap, topic)
    members: list[kafka.KafkaConsumer] = []
    threads: list[threading.Thread] = []
    seen: list[Record] = []
    assignments: dict[int, set[Any]] = {}
    lock = threading.Lock()
    stop = threading.Event()

    def run(index: int, member: kafka.KafkaConsumer) -> None:
        while not stop.is_set():
            batch = member.poll(timeout_ms=100)
            with lock:
                for messages in batch.values():
                    seen.extend(_kp_record(m) for m in messages)
                assignments[index] = set(member.assignment())

    def start_member() -> None:
        member = _kp_group_member(bootstrap, topic, group)
        members.append(member)
        t = threading.Thread(target=run, args=(len(members) - 1, member), daemon=True)
        threads.append(t)
        t.start()

    def current() -> list[set[Any]]:
        with lock:
            return [set(assignments.get(i, set())) for i in range(len(members))]

    try:
        remaining = _deadline(TIMEOUT)
        start_member()
        while not current()[0] and remaining() > 0:
            time.sleep(0.05)
        start_member()
        while not _split(current()) and remaining() > 0:
            time.sleep(0.05)
        _kp_produce(bootstrap, topic, n, idempotent=False)
        remaining = _deadline(TIMEOUT)
        while remaining() > 0:
            with lock:
                if len(set(seen)) >= n:
                    break
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(TIMEOUT)
        return _group_result(seen, current())
    finally:
        stop.set()
        for t in threads:
            t.join(TIMEOUT)
        for member in members:
            member.close()


def kafka_python_describe_cluster_raw(bootstrap: str) -> dict[str, Any]:
    """kafka-python's DescribeCluster answer as it gives it (hosts included): for fixtures, not tests."""
    admin = _kp_admin(bootstrap)
    try:
        return dict(admin.describe_cluster())
    finally:
        admin.close()


def kafka_python_describe_cluster(bootstrap: str) -> ClusterFacts:
    info = kafka_python_describe_cluster_raw(bootstrap)
    broker_ids = {b["broker_id"] for b in info["brokers"]}
    return ClusterFacts(info["cluster_id"], len(broker_ids), info["controller_id"] in broker_ids)


def kafka_python_endpoints(bootstrap: str) -> dict[str, Endpoints]:
    """Advertised broker endpoints, by the API that carried them (kafka-python uses DescribeCluster)."""
    info = kafka_python_describe_cluster_raw(bootstrap)
    brokers = tuple(sorted((b["broker_id"], b["host"], b["port"]) for b in info["brokers"]))
    return {"DescribeCluster": brokers}


def kafka_python_admin_topics(
    bootstrap: str, topics: Sequence[str], partitions: int = PARTITIONS
) -> AdminTopicsResult:
    """CreateTopics, list, DeleteTopics, list: do the topics appear and then disappear?"""
    admin = _kp_admin(bootstrap)
    try:
        admin.create_topics([kafka.admin.NewTopic(t, partitions, 1) for t in topics])
        created = tuple(_kp_partition_count(admin, t) for t in topics)
        after_create = _wait_listing(lambda: admin.list_topics(), topics, present=True)
        admin.delete_topics(list(topics))
        after_delete = _wait_listing(lambda: admin.list_topics(), topics, present=False)
        return AdminTopicsResult(created, after_create, after_delete)
    finally:
        admin.close()


def kafka_python_describe_configs(bootstrap: str, topic: str) -> dict[str, str | None]:
    """Create `topic` with TOPIC_CONFIGS, then DescribeConfigs: every entry, name -> value."""
    kafka_python_create_topic(bootstrap, topic, configs=TOPIC_CONFIGS)
    admin = _kp_admin(bootstrap)
    try:
        resource = kafka.admin.ConfigResource(kafka.admin.ConfigResourceType.TOPIC, topic)
        # tansu reports explicitly set topic configs with source DEFAULT_CONFIG, which kafka-python's
        # default filter ("modified") drops: ask for all of them.
        result = admin.describe_configs([resource], config_filter="all")
        return {name: entry.get("value") for name, entry in result["topic"][topic].items()}
    finally:
        admin.close()


# --------------------------------------------------------------------------------------------------
# confluent-kafka (librdkafka)


def _ck_admin(bootstrap: str) -> confluent_kafka.admin.AdminClient:
    return confluent_kafka.admin.AdminClient(
        {"bootstrap.servers": bootstrap, "client.id": _client_id("confluent")}
    )


def _ck_wait(futures: dict[Any, Any]) -> dict[Any, Any]:
    return {key: future.result(timeout=TIMEOUT) for key, future in futures.items()}


def _ck_topic_names(admin: confluent_kafka.admin.AdminClient) -> list[str]:
    return list(admin.list_topics(timeout=TIMEOUT).topics)


def _ck_partition_count(admin: confluent_kafka.admin.AdminClient, topic: str) -> int:
    # Only for a topic known to exist: a Metadata request naming a missing topic may auto-create it.
    metadata = admin.list_topics(topic=topic, timeout=TIMEOUT)
    return len(metadata.topics[topic].partitions)


def confluent_create_topic(
    bootstrap: str, topic: str, partitions: int = PARTITIONS, configs: dict[str, str] | None = None
) -> int:
    admin = _ck_admin(bootstrap)
    new_topic = confluent_kafka.admin.NewTopic(
        topic, num_partitions=partitions, replication_factor=1, config=configs or {}
    )
    _ck_wait(admin.create_topics([new_topic], request_timeout=TIMEOUT))
    return _ck_partition_count(admin, topic)


def _ck_produce(bootstrap: str, topic: str, n: int, idempotent: bool) -> None:
    producer = confluent_kafka.Producer(
        {
            "bootstrap.servers": bootstrap,
            "client.id": _client_id("confluent"),
            "acks": "all",
            "enable.idempotence": idempotent,
            # librdkafka's default (consistent_random, CRC32) differs from Java's; use Java's like the others.
            "partitioner": "murmur2_random",
            "linger.ms": 5,
            "message.timeout.ms": int(TIMEOUT * 1000),
        }
    )
    errors: list[Any] = []

    def on_delivery(error: Any, _message: Any) -> None:
        if error is not None:
            errors.append(error)

    for key, value, headers in sent_records(n):
        producer.produce(topic, key=key, value=value, headers=list(headers), on_delivery=on_delivery)
        producer.poll(0)
    undelivered = producer.flush(TIMEOUT)
    if undelivered or errors:
        raise RuntimeError(f"confluent producer: {undelivered} undelivered, errors {errors[:3]}")


def _ck_record(message: Any) -> Record:
    return (message.partition(), message.key(), message.value(), tuple(message.headers() or ()))


def _ck_poll(consumer: confluent_kafka.Consumer, timeout: float) -> Record | None:
    message = consumer.poll(timeout)
    if message is None:
        return None
    if message.error():
        raise confluent_kafka.KafkaException(message.error())
    return _ck_record(message)


def _ck_consume_assigned(bootstrap: str, topic: str, n: int, partitions: int) -> list[Record]:
    consumer = confluent_kafka.Consumer(
        {
            "bootstrap.servers": bootstrap,
            "client.id": _client_id("confluent"),
            "group.id": f"unused-{uuid.uuid4().hex[:8]}",  # assign() never joins; nothing is committed
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
        }
    )
    try:
        consumer.assign(
            [
                confluent_kafka.TopicPartition(topic, p, confluent_kafka.OFFSET_BEGINNING)
                for p in range(partitions)
            ]
        )
        seen: list[Record] = []
        remaining = _deadline(TIMEOUT)
        while len(seen) < n and remaining() > 0:
            record = _ck_poll(consumer, 0.2)
            if record is not None:
                seen.append(record)
        return sort_records(seen)
    finally:
        consumer.close()


def confluent_produce_consume(
    bootstrap: str, topic: str, n: int = N_RECORDS, *, idempotent: bool = False
) -> list[Record]:
    confluent_create_topic(bootstrap, topic)
    _ck_produce(bootstrap, topic, n, idempotent)
    return _ck_consume_assigned(bootstrap, topic, n, PARTITIONS)


def confluent_idempotent_produce_consume(bootstrap: str, topic: str, n: int = N_RECORDS) -> list[Record]:
    return confluent_produce_consume(bootstrap, topic, n, idempotent=True)


def _ck_group_member(bootstrap: str, topic: str, group: str) -> confluent_kafka.Consumer:
    consumer = confluent_kafka.Consumer(
        {
            "bootstrap.servers": bootstrap,
            "client.id": _client_id("confluent"),
            "group.id": group,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "session.timeout.ms": SESSION_TIMEOUT_MS,
            "max.poll.interval.ms": MAX_POLL_INTERVAL_MS,
            "heartbeat.interval.ms": HEARTBEAT_INTERVAL_MS,
        }
    )
    consumer.subscribe([topic])
    return consumer


def _ck_assignment(consumer: confluent_kafka.Consumer) -> set[int]:
    return {tp.partition for tp in consumer.assignment()}


def confluent_group(bootstrap: str, topic: str, group: str, n: int = N_RECORDS) -> GroupResult:
    confluent_create_topic(bootstrap, topic)
    members: list[confluent_kafka.Consumer] = []
    try:
        seen: list[Record] = []

        def poll_all() -> None:
            for member in members:
                record = _ck_poll(member, 0.1)
                if record is not None:
                    seen.append(record)

        remaining = _deadline(TIMEOUT)
        members.append(_ck_group_member(bootstrap, topic, group))
        while not members[0].assignment() and remaining() > 0:
            poll_all()
        members.append(_ck_group_member(bootstrap, topic, group))
        while not _split(_ck_assignment(m) for m in members) and remaining() > 0:
            poll_all()
        _ck_produce(bootstrap, topic, n, idempotent=False)
        remaining = _deadline(TIMEOUT)
        while len(set(seen)) < n and remaining() > 0:
            poll_all()
        return _group_result(seen, [_ck_assignment(m) for m in members])
    finally:
        for member in members:
            member.close()


def confluent_describe_cluster(bootstrap: str) -> ClusterFacts:
    """DescribeCluster (API 60) as librdkafka's admin client sends it."""
    admin = _ck_admin(bootstrap)
    description = admin.describe_cluster(request_timeout=TIMEOUT).result(timeout=TIMEOUT)
    node_ids = {node.id for node in description.nodes}
    controller = description.controller
    return ClusterFacts(
        description.cluster_id, len(node_ids), controller is not None and controller.id in node_ids
    )


def confluent_endpoints(bootstrap: str) -> dict[str, Endpoints]:
    """Advertised broker endpoints as Metadata and as DescribeCluster (API 60) report them."""
    admin = _ck_admin(bootstrap)
    metadata = admin.list_topics(timeout=TIMEOUT)
    description = admin.describe_cluster(request_timeout=TIMEOUT).result(timeout=TIMEOUT)
    return {
        "Metadata": tuple(sorted((b.id, b.host, b.port) for b in metadata.brokers.values())),
        "DescribeCluster": tuple(sorted((n.id, n.host, n.port) for n in description.nodes)),
    }


def confluent_admin_topics(
    bootstrap: str, topics: Sequence[str], partitions: int = PARTITIONS
) -> AdminTopicsResult:
    admin = _ck_admin(bootstrap)
    new_topics = [
        confluent_kafka.admin.NewTopic(t, num_partitions=partitions, replication_factor=1) for t in topics
    ]
    _ck_wait(admin.create_topics(new_topics, request_timeout=TIMEOUT))
    created = tuple(_ck_partition_count(admin, t) for t in topics)
    after_create = _wait_listing(lambda: _ck_topic_names(admin), topics, present=True)
    _ck_wait(admin.delete_topics(list(topics), request_timeout=TIMEOUT))
    after_delete = _wait_listing(lambda: _ck_topic_names(admin), topics, present=False)
    return AdminTopicsResult(created, after_create, after_delete)


def confluent_describe_configs(bootstrap: str, topic: str) -> dict[str, str | None]:
    confluent_create_topic(bootstrap, topic, configs=TOPIC_CONFIGS)
    admin = _ck_admin(bootstrap)
    resource = confluent_kafka.admin.ConfigResource(confluent_kafka.admin.ResourceType.TOPIC, topic)
    (entries,) = _ck_wait(admin.describe_configs([resource], request_timeout=TIMEOUT)).values()
    return {name: entry.value for name, entry in entries.items()}


# --------------------------------------------------------------------------------------------------
# aiokafka: each public function runs one asyncio loop to completion, bounded by wait_for.


def _run_asyncio(coro: Any, timeout: float) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


async def _ak_admin(bootstrap: str) -> aiokafka.admin.AIOKafkaAdminClient:
    admin = aiokafka.admin.AIOKafkaAdminClient(
        bootstrap_servers=bootstrap, client_id=_client_id("aiokafka"), request_timeout_ms=10_000
    )
    try:
        await admin.start()
    except BaseException:
        await admin.close()
        raise
    return admin


async def _ak_partition_count(admin: aiokafka.admin.AIOKafkaAdminClient, topic: str) -> int:
    (description,) = await admin.describe_topics([topic])
    return len(description["partitions"])


def _ak_check_topic_errors(response: Any) -> None:
    # aiokafka's admin returns the raw response; errors are per topic, not raised.
    entries = getattr(response, "topic_errors", None) or getattr(response, "topic_error_codes", ())
    for entry in entries:  # CreateTopics: (topic, error_code, ...); DeleteTopics: (topic, error_code)
        if entry[1] != 0:
            raise RuntimeError(f"aiokafka admin: topic {entry[0]!r} error code {entry[1]}")


async def _ak_create_topic(
    bootstrap: str, topic: str, partitions: int, configs: dict[str, str] | None
) -> int:
    admin = await _ak_admin(bootstrap)
    try:
        new_topic = aiokafka.admin.NewTopic(topic, partitions, 1, topic_configs=configs or {})
        _ak_check_topic_errors(await admin.create_topics([new_topic]))
        return await _ak_partition_count(admin, topic)
    finally:
        await admin.close()


def aiokafka_create_topic(
    bootstrap: str, topic: str, partitions: int = PARTITIONS, configs: dict[str, str] | None = None
) -> int:
    return _run_asyncio(_ak_create_topic(bootstrap, topic, partitions, configs), TIMEOUT)


async def _ak_produce(bootstrap: str, topic: str, n: int, idempotent: bool) -> None:
    producer = aiokafka.AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        client_id=_client_id("aiokafka"),
        acks="all",
        enable_idempotence=idempotent,
        linger_ms=5,
        request_timeout_ms=10_000,
    )
    try:
        await producer.start()  # inside the try: a failed start still needs stop() to close sockets
        futures = [
            await producer.send(topic, value=value, key=key, headers=list(headers))
            for key, value, headers in sent_records(n)
        ]
        await producer.flush()
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


def _ak_record(message: Any) -> Record:
    return (message.partition, message.key, message.value, tuple((k, v) for k, v in message.headers or ()))


async def _ak_consume_assigned(bootstrap: str, topic: str, n: int, partitions: int) -> list[Record]:
    consumer = aiokafka.AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        client_id=_client_id("aiokafka"),
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        request_timeout_ms=10_000,
    )
    try:
        await consumer.start()
        consumer.assign([aiokafka.TopicPartition(topic, p) for p in range(partitions)])
        await consumer.seek_to_beginning()
        seen: list[Record] = []
        remaining = _deadline(TIMEOUT)
        while len(seen) < n and remaining() > 0:
            for messages in (await consumer.getmany(timeout_ms=200)).values():
                seen.extend(_ak_record(m) for m in messages)
        return sort_records(seen)
    finally:
        await consumer.stop()


async def _ak_produce_consume(bootstrap: str, topic: str, n: int, idempotent: bool) -> list[Record]:
    await _ak_create_topic(bootstrap, topic, PARTITIONS, None)
    await _ak_produce(bootstrap, topic, n, idempotent)
    return await _ak_consume_assigned(bootstrap, topic, n, PARTITIONS)


def aiokafka_produce_consume(
    bootstrap: str, topic: str, n: int = N_RECORDS, *, idempotent: bool = False
) -> list[Record]:
    return _run_asyncio(_ak_produce_consume(bootstrap, topic, n, idempotent), 3 * TIMEOUT)


def aiokafka_idempotent_produce_consume(bootstrap: str, topic: str, n: int = N_RECORDS) -> list[Record]:
    return aiokafka_produce_consume(bootstrap, topic, n, idempotent=True)


async def _ak_group_member(bootstrap: str, topic: str, group: str) -> aiokafka.AIOKafkaConsumer:
    consumer = aiokafka.AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        client_id=_client_id("aiokafka"),
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        session_timeout_ms=SESSION_TIMEOUT_MS,
        max_poll_interval_ms=MAX_POLL_INTERVAL_MS,
        heartbeat_interval_ms=HEARTBEAT_INTERVAL_MS,
        request_timeout_ms=10_000,
    )
    try:
        await consumer.start()
    except BaseException:
        await consumer.stop()
        raise
    return consumer


def _ak_assignment(consumer: aiokafka.AIOKafkaConsumer) -> set[int]:
    return {tp.partition for tp in consumer.assignment()}


async def _ak_group(bootstrap: str, topic: str, group: str, n: int) -> GroupResult:
    await _ak_create_topic(bootstrap, topic, PARTITIONS, None)
    members: list[aiokafka.AIOKafkaConsumer] = []
    try:
        seen: list[Record] = []

        async def poll_all() -> None:
            batches = await asyncio.gather(*(m.getmany(timeout_ms=100) for m in members))
            for batch in batches:
                for messages in batch.values():
                    seen.extend(_ak_record(m) for m in messages)

        remaining = _deadline(TIMEOUT)
        members.append(await _ak_group_member(bootstrap, topic, group))
        while not _ak_assignment(members[0]) and remaining() > 0:
            await poll_all()
        members.append(await _ak_group_member(bootstrap, topic, group))
        while not _split(_ak_assignment(m) for m in members) and remaining() > 0:
            await poll_all()
        await _ak_produce(bootstrap, topic, n, idempotent=False)
        remaining = _deadline(TIMEOUT)
        while len(set(seen)) < n and remaining() > 0:
            await poll_all()
        return _group_result(seen, [_ak_assignment(m) for m in members])
    finally:
        for member in members:
            await member.stop()


def aiokafka_group(bootstrap: str, topic: str, group: str, n: int = N_RECORDS) -> GroupResult:
    return _run_asyncio(_ak_group(bootstrap, topic, group, n), 3 * TIMEOUT)


async def _ak_describe_cluster(bootstrap: str) -> ClusterFacts:
    admin = await _ak_admin(bootstrap)
    try:
        info = await admin.describe_cluster()  # aiokafka answers this from Metadata, not API 60
    finally:
        await admin.close()
    broker_ids = {b["node_id"] for b in info["brokers"]}
    return ClusterFacts(info.get("cluster_id"), len(broker_ids), info.get("controller_id") in broker_ids)


def aiokafka_describe_cluster(bootstrap: str) -> ClusterFacts:
    return _run_asyncio(_ak_describe_cluster(bootstrap), TIMEOUT)


async def _ak_endpoints(bootstrap: str) -> dict[str, Endpoints]:
    admin = await _ak_admin(bootstrap)
    try:
        info = await admin.describe_cluster()
    finally:
        await admin.close()
    return {"Metadata": tuple(sorted((b["node_id"], b["host"], b["port"]) for b in info["brokers"]))}


def aiokafka_endpoints(bootstrap: str) -> dict[str, Endpoints]:
    """Advertised broker endpoints (aiokafka reads them from Metadata)."""
    return _run_asyncio(_ak_endpoints(bootstrap), TIMEOUT)


async def _ak_admin_topics(bootstrap: str, topics: Sequence[str], partitions: int) -> AdminTopicsResult:
    admin = await _ak_admin(bootstrap)
    try:
        new_topics = [aiokafka.admin.NewTopic(t, partitions, 1) for t in topics]
        _ak_check_topic_errors(await admin.create_topics(new_topics))
        created = tuple([await _ak_partition_count(admin, t) for t in topics])
        after_create = await _ak_wait_listing(admin, topics, present=True)
        _ak_check_topic_errors(await admin.delete_topics(list(topics)))
        after_delete = await _ak_wait_listing(admin, topics, present=False)
        return AdminTopicsResult(created, after_create, after_delete)
    finally:
        await admin.close()


async def _ak_wait_listing(
    admin: aiokafka.admin.AIOKafkaAdminClient, topics: Sequence[str], present: bool
) -> tuple[bool, ...]:
    remaining = _deadline(10.0)
    while True:
        listed = set(await admin.list_topics())
        found = tuple(t in listed for t in topics)
        if all(f == present for f in found) or remaining() <= 0:
            return found
        await asyncio.sleep(0.1)


def aiokafka_admin_topics(
    bootstrap: str, topics: Sequence[str], partitions: int = PARTITIONS
) -> AdminTopicsResult:
    return _run_asyncio(_ak_admin_topics(bootstrap, topics, partitions), 2 * TIMEOUT)


async def _ak_describe_configs(bootstrap: str, topic: str) -> dict[str, str | None]:
    await _ak_create_topic(bootstrap, topic, PARTITIONS, TOPIC_CONFIGS)
    admin = await _ak_admin(bootstrap)
    try:
        resource = aiokafka.admin.config_resource.ConfigResource(
            aiokafka.admin.config_resource.ConfigResourceType.TOPIC, topic
        )
        responses = await admin.describe_configs([resource])
    finally:
        await admin.close()
    configs: dict[str, str | None] = {}
    for response in responses:
        for resource_result in response.to_object()["resources"]:
            if resource_result["error_code"] != 0:
                raise RuntimeError(f"aiokafka describe_configs: {resource_result}")
            for entry in resource_result["config_entries"]:
                configs[entry["config_names"]] = entry["config_value"]
    return configs


def aiokafka_describe_configs(bootstrap: str, topic: str) -> dict[str, str | None]:
    return _run_asyncio(_ak_describe_configs(bootstrap, topic), 2 * TIMEOUT)


# --------------------------------------------------------------------------------------------------
# Shared


def _split(assignments: Iterable[set[Any]]) -> bool:
    """Every member has partitions, none shared, all covered: the rebalance has settled."""
    sets = [set(a) for a in assignments]
    union = set().union(*sets)
    return (
        len(sets) > 1 and all(sets) and sum(len(s) for s in sets) == len(union) and len(union) == PARTITIONS
    )


def _group_result(seen: Iterable[Record], assignments: Iterable[Iterable[Any]]) -> GroupResult:
    partition_sets = [{getattr(p, "partition", p) for p in a} for a in assignments]
    return GroupResult(
        records=tuple(sort_records(seen)),
        assignment_sizes=tuple(sorted(len(s) for s in partition_sets)),
        partitions=tuple(sorted(set().union(*partition_sets))),
    )


def _wait_listing(
    list_topics: Callable[[], Iterable[str]], topics: Sequence[str], present: bool
) -> tuple[bool, ...]:
    """Which of `topics` are listed, polling until all are (present) or none are (deleted), max 10 s."""
    remaining = _deadline(10.0)
    while True:
        listed = set(list_topics())
        found = tuple(t in listed for t in topics)
        if all(f == present for f in found) or remaining() <= 0:
            return found
        time.sleep(0.1)


@dataclass(frozen=True)
class Client:
    """One real client's implementation of every scenario, so tests can be parametrized by client."""

    name: str
    create_topic: Callable[..., int]
    produce_consume: Callable[..., list[Record]]
    idempotent_produce_consume: Callable[..., list[Record]]
    group: Callable[..., GroupResult]
    describe_cluster: Callable[[str], ClusterFacts]
    admin_topics: Callable[..., AdminTopicsResult]
    describe_configs: Callable[[str, str], dict[str, str | None]]
    endpoints: Callable[[str], dict[str, Endpoints]]  # hosts included: for address-rewrite checks


KAFKA_PYTHON = Client(
    "kafka-python",
    kafka_python_create_topic,
    kafka_python_produce_consume,
    kafka_python_idempotent_produce_consume,
    kafka_python_group,
    kafka_python_describe_cluster,
    kafka_python_admin_topics,
    kafka_python_describe_configs,
    kafka_python_endpoints,
)
CONFLUENT = Client(
    "confluent-kafka",
    confluent_create_topic,
    confluent_produce_consume,
    confluent_idempotent_produce_consume,
    confluent_group,
    confluent_describe_cluster,
    confluent_admin_topics,
    confluent_describe_configs,
    confluent_endpoints,
)
AIOKAFKA = Client(
    "aiokafka",
    aiokafka_create_topic,
    aiokafka_produce_consume,
    aiokafka_idempotent_produce_consume,
    aiokafka_group,
    aiokafka_describe_cluster,
    aiokafka_admin_topics,
    aiokafka_describe_configs,
    aiokafka_endpoints,
)
CLIENTS = (KAFKA_PYTHON, CONFLUENT, AIOKAFKA)

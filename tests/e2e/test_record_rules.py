"""Record rules end to end on tansu with real clients: a validate rule refuses batches with invalid
JSON (confluent-kafka's delivery reports, kafka-python and aiokafka see INVALID_RECORD) while the
valid records are written and read back; a headers rule stamps records and injects the trace
context of kproxy's produce span (checked against the span the OTLP receiver got); and the bytes the
broker received, recorded by a relay between kproxy and tansu, are the client's own for every
topic no headers rule selects."""

from __future__ import annotations

import asyncio
import http.server
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiokafka
import aiokafka.errors
import confluent_kafka
import pytest

from kproxy.protocol.messages import body_class, decode_request
from kproxy.protocol.records import Compression, build_batch, iter_batches
from kproxy.server.embedded import ProxyThread
from kproxy.tansu import Tansu
from tests.e2e.proxied import start_proxy
from tests.e2e.relay import Relay
from tests.e2e.tansu import free_port, unique_name
from tests.e2e.test_policy import TIMEOUT, ck_producer, create_topics
from tests.e2e.test_telemetry import _OtlpReceiver
from tests.e2e.wire import Wire

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import kafka
    import kafka.errors

pytestmark = pytest.mark.e2e

PRODUCE = 0
RULES = """\
rules:
  - name: orders-json
    match: {topic: "orders-*", api: produce}
    action: validate
    validate:
      value: json
  - name: stamp
    match: {topic: "stamped-*", api: produce}
    action: headers
    headers:
      set: {x-producer: "${client_id}", x-rule: "${rule}"}
      traceparent: inject
"""
OWN_TRACEPARENT = b"00-11111111111111111111111111111111-2222222222222222-01"


class Recorded:
    def __init__(self, relay: Relay, tansu: Tansu, proxy: ProxyThread, rules: str) -> None:
        self.relay, self.tansu, self.proxy, self.rules = relay, tansu, proxy, rules

    def produced(self) -> list[Any]:
        """Every Produce request the broker received (decoded), in order per connection."""
        out = []
        assert self.relay.sent is not None
        for stream in list(self.relay.sent):
            data = bytes(stream)
            pos = 0
            while len(data) - pos >= 4:
                n = int.from_bytes(data[pos:pos + 4], "big", signed=True)
                if len(data) - pos - 4 < n:
                    break
                frame = data[pos + 4:pos + 4 + n]
                pos += 4 + n
                if int.from_bytes(frame[:2], "big") == PRODUCE:
                    out.append(decode_request(frame))
        return out

    def records_received(self, topic: str) -> list[bytes]:
        return [bytes(p.records) for req in self.produced() for t in req.body.topic_data if t.name == topic
                for p in t.partition_data]


@pytest.fixture(scope="module")
def recorded(tansu_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Recorded]:
    # The broker advertises the relay, so every byte kproxy sends it passes the relay's tap.
    relay_port = free_port()
    tansu = Tansu(tansu_binary, advertised=("127.0.0.1", relay_port)).start()
    relay = Relay((tansu.host, tansu.port), relay_port, record=True)
    relay.start()
    rules = str(tmp_path_factory.mktemp("record-rules") / "rules.yaml")
    Path(rules).write_text(RULES)
    proxy = start_proxy(relay.bootstrap, rules=[rules])
    try:
        yield Recorded(relay, tansu, proxy, rules)
    finally:
        proxy.stop()
        relay.stop()
        tansu.stop()


def consume_all(bootstrap: str, topic: str, client_id: str) -> list[Any]:
    """Every record of partition 0, read up to the high watermark."""
    consumer = confluent_kafka.Consumer({"bootstrap.servers": bootstrap, "group.id": unique_name("g"),
                                         "client.id": client_id, "enable.auto.commit": False})
    try:
        tp = confluent_kafka.TopicPartition(topic, 0)
        _, high = consumer.get_watermark_offsets(tp, timeout=TIMEOUT)
        consumer.assign([confluent_kafka.TopicPartition(topic, 0, confluent_kafka.OFFSET_BEGINNING)])
        out: list[Any] = []
        deadline = time.monotonic() + TIMEOUT
        while len(out) < high:
            assert time.monotonic() < deadline, f"read {len(out)} of {high} records"
            msg = consumer.poll(0.5)
            if msg is not None:
                assert msg.error() is None, msg.error()
                out.append(msg)
        return out
    finally:
        consumer.close()


# -- validate --------------------------------------------------------------------------------------


def test_confluent_kafka_sees_invalid_record_on_bad_batches_and_consumers_read_the_valid(recorded):
    topic = unique_name("orders")
    create_topics(recorded.proxy.bootstrap, topic)
    producer = ck_producer(recorded.proxy.bootstrap, "ck-orders", **{"linger.ms": 50})
    reports: list[tuple[bytes, Any]] = []

    def produce(*values: bytes) -> None:
        for v in values:
            producer.produce(topic, key=b"k", value=v, partition=0,
                             on_delivery=lambda err, msg: reports.append((msg.value(), err)))
        assert producer.flush(TIMEOUT) == 0

    produce(b'{"id": 1}')
    produce(b"{not json")
    produce(b'{"id": 2}')
    produce(b'{"id": 3}', b"<xml/>")        # one batch: refused whole, as Kafka writes batches
    producer.flush(TIMEOUT)
    errors = {v: (None if e is None else e.code()) for v, e in reports}
    invalid = confluent_kafka.KafkaError.INVALID_RECORD
    assert errors == {b'{"id": 1}': None, b"{not json": invalid, b'{"id": 2}': None, b'{"id": 3}': invalid,
                      b"<xml/>": invalid}
    refused = next(e for v, e in reports if v == b"{not json")
    assert refused.name() == "INVALID_RECORD" and not refused.retriable()
    assert [m.value() for m in consume_all(recorded.proxy.bootstrap, topic, "ck-orders-read")] == [
        b'{"id": 1}', b'{"id": 2}']


def test_kafka_python_and_aiokafka_get_the_error_too(recorded):
    topic = unique_name("orders")
    create_topics(recorded.proxy.bootstrap, topic)
    producer = kafka.KafkaProducer(bootstrap_servers=recorded.proxy.bootstrap, client_id="kp-orders", acks="all",
                                   max_block_ms=10_000, request_timeout_ms=10_000)
    try:
        producer.send(topic, b'{"kp": 1}').get(timeout=TIMEOUT)
        with pytest.raises(kafka.errors.InvalidRecordError):
            producer.send(topic, b"kp-not-json").get(timeout=TIMEOUT)
    finally:
        producer.close(timeout=5)

    async def run() -> None:
        producer = aiokafka.AIOKafkaProducer(bootstrap_servers=recorded.proxy.bootstrap, client_id="ak-orders",
                                             acks="all")
        await producer.start()
        try:
            await producer.send_and_wait(topic, b'{"ak": 1}')
            # aiokafka 0.14 has no class for INVALID_RECORD (87): it raises UnknownError, not retried.
            with pytest.raises(aiokafka.errors.UnknownError):
                await producer.send_and_wait(topic, b"ak-not-json")
        finally:
            await producer.stop()

    asyncio.run(asyncio.wait_for(run(), TIMEOUT))
    assert [m.value() for m in consume_all(recorded.proxy.bootstrap, topic, "kp-read")] == [b'{"kp": 1}',
                                                                                             b'{"ak": 1}']


# -- what the broker received ------------------------------------------------------------------------


def test_the_broker_gets_the_clients_bytes_unless_a_headers_rule_selects_the_topic(recorded):
    plain, orders, stamped = unique_name("plain"), unique_name("orders"), unique_name("stamped")
    create_topics(recorded.proxy.bootstrap, plain, orders, stamped)
    cls = body_class(PRODUCE, "request")
    sent = {}
    for i, (topic, codec) in enumerate([(plain, Compression.LZ4), (orders, Compression.ZSTD),
                                        (stamped, Compression.LZ4)]):
        sent[topic] = build_batch([(b"k", b'{"n": %d}' % n, [("h", b"x")]) for n in range(5)], compression=codec,
                                  base_timestamp=int(time.time() * 1000), producer_id=-1)
        body = cls(acks=-1, timeout_ms=5000, topic_data=[cls.TopicProduceData(
            name=topic, partition_data=[cls.PartitionProduceData(index=0, records=sent[topic])])])
        w = Wire(recorded.proxy.bootstrap)
        try:
            w.send(PRODUCE, 9, 100 + i, body)
            assert w.read_frame() is not None
        finally:
            w.sock.close()
    # No record rule, or only a validate rule: the very bytes the client sent.
    assert recorded.records_received(plain) == [sent[plain]]
    assert recorded.records_received(orders) == [sent[orders]]
    (rewritten,) = recorded.records_received(stamped)
    assert rewritten != sent[stamped]
    (batch,) = iter_batches(rewritten, verify_crc=True)
    assert batch.compression is Compression.LZ4
    headers = [[(h.key, bytes(h.value or b"")) for h in r.headers] for r in batch.records()]
    assert all(h[:3] == [("h", b"x"), ("x-producer", b"wire"), ("x-rule", b"stamp")] for h in headers)
    assert all(h[3][0] == "traceparent" for h in headers)


# -- headers and trace context -------------------------------------------------------------------------


class _Receiver(_OtlpReceiver):
    received = []


def test_consumer_sees_stamped_headers_and_the_produce_spans_trace(recorded, monkeypatch):
    server = http.server.HTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Receiver.received = []
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    topic = unique_name("stamped")
    try:
        proxy = start_proxy(recorded.relay.bootstrap, rules=[recorded.rules],
                            tracing={"enabled": True, "sample_ratio": 0.0})
        try:
            create_topics(proxy.bootstrap, topic)
            producer = ck_producer(proxy.bootstrap, "ck-stamper", **{"compression.type": "zstd"})
            errors: list[Any] = []
            producer.produce(topic, value=b"plain", partition=0, on_delivery=lambda e, _m: errors.append(e))
            assert producer.flush(TIMEOUT) == 0
            producer.produce(topic, value=b"traced", partition=0, headers=[("traceparent", OWN_TRACEPARENT)],
                             on_delivery=lambda e, _m: errors.append(e))
            assert producer.flush(TIMEOUT) == 0
            assert errors == [None, None]
            got = {m.value(): dict(m.headers()) for m in consume_all(proxy.bootstrap, topic, "reader")}
        finally:
            proxy.stop()        # flushes the span processor
    finally:
        server.shutdown()
        server.server_close()
    assert got[b"plain"]["x-producer"] == b"ck-stamper" and got[b"plain"]["x-rule"] == b"stamp"
    assert got[b"traced"]["traceparent"] == OWN_TRACEPARENT          # the producer's own is kept
    _, trace_id, span_id, flags = got[b"plain"]["traceparent"].decode().split("-")
    spans = [s for msg in _Receiver.received for rs in msg.resource_spans for ss in rs.scope_spans
             for s in ss.spans]
    produce_spans = [s for s in spans if s.name == f"produce {topic}" and s.trace_id.hex() == trace_id]
    # sample_ratio 0 exports nothing else, but a span records name stays exported.
    assert [s.span_id.hex() for s in produce_spans if s.kind == 2] == [span_id] and flags == "01"
    assert not [s for s in spans if s.name.startswith("metadata")]

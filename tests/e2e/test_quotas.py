"""Client quotas through kproxy on tansu, with real clients: rates measured in the test.

A producer with a 1 MiB/s produce quota and a consumer with a 1 MiB/s fetch quota are held to their
rates over 20 s (by bytes acknowledged and bytes consumed) and see the throttle in their own
statistics, while a producer without a quota, on the same kproxy at the same time, keeps its
throughput. A Metadata request-rate quota is held on one connection, answers a throttled connection
already owes all come, in order, and another connection is not slowed meanwhile. Every assertion
fails with the quotas off: the throttled clients then run at the machine's speed.
"""

from __future__ import annotations

import json
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import confluent_kafka
import pytest

from kproxy.protocol.messages import body_class
from kproxy.server.embedded import ProxyThread
from tests.e2e.proxied import start_proxy
from tests.e2e.tansu import TansuBroker, unique_name
from tests.e2e.wire import Wire

pytestmark = pytest.mark.e2e

MIB = 1 << 20
RATE = MIB                   # the produce and fetch quotas, bytes per second
WINDOW_S = 20.0              # how long the quotas are measured
TOLERANCE = 0.15             # above the quota: what kproxy lets through beyond the limit
SLOWER = 0.35                # below it: a busy machine may run a client slower than its quota
VALUE = b"q" * 16384         # large records keep the clients' Python loops light beside kproxy
FREE_PACE = 4 * MIB          # the unthrottled producer's own pace (see test docstring)
METADATA = 3
PURGED = (confluent_kafka.KafkaError._PURGE_QUEUE, confluent_kafka.KafkaError._PURGE_INFLIGHT)

RULES = f"""\
quotas:
  - name: slow-producer
    match: {{client_id: quota-slow-producer}}
    produce_bytes_per_s: {RATE}
  - name: slow-consumer
    match: {{client_id: quota-slow-consumer}}
    fetch_bytes_per_s: {RATE}
  - name: metadata-rate
    match: {{client_id: wire, api: metadata}}
    per: connection
    requests_per_s: 10
"""


@pytest.fixture(scope="module")
def proxy(broker: TansuBroker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyThread]:
    rules = tmp_path_factory.mktemp("quotas") / "quotas.yaml"
    rules.write_text(textwrap.dedent(RULES))
    p = start_proxy(broker.bootstrap, advertised_host="127.0.0.1", rules=[str(rules)])
    try:
        yield p
    finally:
        p.stop()


class Throttles:
    """The largest throttle librdkafka reports (its statistics' per-broker ``throttle`` window)."""

    def __init__(self) -> None:
        self.max_ms = 0

    def __call__(self, stats: str) -> None:
        for b in json.loads(stats)["brokers"].values():
            self.max_ms = max(self.max_ms, b["throttle"]["max"])


class Acked:
    """(time, bytes) of every acknowledged record."""

    def __init__(self) -> None:
        self.at: list[tuple[float, int]] = []
        self.errors: list[str] = []

    def __call__(self, err: Any, msg: Any) -> None:
        if err is not None:
            if err.code() not in PURGED:    # what the test left unsent at the end
                self.errors.append(str(err))
        else:
            self.at.append((time.monotonic(), len(msg.value())))


def bytes_between(events: list[tuple[float, int]], start: float, end: float) -> int:
    return sum(n for t, n in events if start <= t < end)


def producer(bootstrap: str, client_id: str, throttles: Throttles) -> confluent_kafka.Producer:
    return confluent_kafka.Producer({
        "bootstrap.servers": bootstrap, "client.id": client_id, "linger.ms": 5, "batch.size": 131072,
        # A small local queue: what is measured is what the broker acknowledged, not what waits.
        "queue.buffering.max.kbytes": 2048, "statistics.interval.ms": 500, "stats_cb": throttles,
    })


def produce_flat_out(p: confluent_kafka.Producer, topic: str, acked: Acked, stop: threading.Event,
                     value: bytes = VALUE) -> None:
    while not stop.is_set():
        try:
            p.produce(topic, value, partition=0, on_delivery=acked)
            p.poll(0)
        except BufferError:
            p.poll(0.01)
    # What it has not had acknowledged by now is past every measuring window: dropped, not waited for.
    p.purge(in_queue=True, in_flight=True)
    p.flush(5)


def produce_paced(p: confluent_kafka.Producer, topic: str, acked: Acked, stop: threading.Event) -> None:
    start, sent = time.monotonic(), 0
    while not stop.is_set():
        while sent < FREE_PACE * (time.monotonic() - start):
            p.produce(topic, VALUE, partition=0, on_delivery=acked)
            sent += len(VALUE)
        p.poll(0.02)
    p.flush(10)


def consume(bootstrap: str, topic: str, got: list[tuple[float, int]], throttles: Throttles,
            stop: threading.Event) -> None:
    c = confluent_kafka.Consumer({
        "bootstrap.servers": bootstrap, "client.id": "quota-slow-consumer", "group.id": unique_name("q"),
        "enable.auto.commit": False, "statistics.interval.ms": 500, "stats_cb": throttles,
    })
    try:
        c.assign([confluent_kafka.TopicPartition(topic, 0, 0)])
        while not stop.is_set():
            m = c.poll(0.1)
            if m is not None and m.error() is None:
                got.append((time.monotonic(), len(m.value())))
    finally:
        c.close()


def fill(bootstrap: str, topic: str, nbytes: int) -> None:
    p = confluent_kafka.Producer({"bootstrap.servers": bootstrap, "linger.ms": 5,
                                  "queue.buffering.max.kbytes": 2_097_151})
    acked = Acked()
    for _ in range(nbytes // len(VALUE)):
        p.produce(topic, VALUE, partition=0, on_delivery=acked)
        p.poll(0)
    assert p.flush(30) == 0 and not acked.errors


def run(target: Any, *args: Any) -> threading.Thread:
    t = threading.Thread(target=target, args=args, daemon=True)
    t.start()
    return t


def test_produce_and_fetch_quotas_hold_their_clients_and_spare_the_others(proxy: ProxyThread,
                                                                          broker: TansuBroker) -> None:
    """The unthrottled producer runs at its own pace (4 MiB/s) rather than flat out: tansu keeps
    everything in memory for the whole test session and slows as it fills, and what this checks is
    that a throttled client delays no one else, not the machine's capacity."""
    slow_topic, free_topic, read_topic = (unique_name(n) for n in ("quota-slow", "quota-free", "quota-read"))
    fill(broker.bootstrap, read_topic, int(RATE * (WINDOW_S + 8)))

    stop_free, stop_rest = threading.Event(), threading.Event()
    free_acked, free_throttles = Acked(), Throttles()
    free = run(produce_paced, producer(proxy.bootstrap, "quota-free-producer", free_throttles), free_topic,
               free_acked, stop_free)
    time.sleep(5.0)
    alone_end = time.monotonic()
    alone = bytes_between(free_acked.at, alone_end - 3.0, alone_end) / 3.0     # past its start-up

    slow_acked, slow_throttles = Acked(), Throttles()
    read: list[tuple[float, int]] = []
    read_throttles = Throttles()
    threads = [run(produce_flat_out, producer(proxy.bootstrap, "quota-slow-producer", slow_throttles),
                   slow_topic, slow_acked, stop_rest),
               run(consume, proxy.bootstrap, read_topic, read, read_throttles, stop_rest)]
    deadline = time.monotonic() + WINDOW_S + 15
    while time.monotonic() < deadline and not (
            slow_acked.at and read and time.monotonic() > max(slow_acked.at[0][0], read[0][0]) + WINDOW_S + 0.5):
        time.sleep(0.2)
    stop_rest.set()
    stop_free.set()
    for t in (*threads, free):
        t.join(30)

    assert slow_acked.at and read, "the throttled clients never got going"
    slow_start, read_start = slow_acked.at[0][0], read[0][0]
    produced = bytes_between(slow_acked.at, slow_start, slow_start + WINDOW_S) / WINDOW_S
    fetched = bytes_between(read, read_start, read_start + WINDOW_S) / WINDOW_S
    together = bytes_between(free_acked.at, slow_start, slow_start + WINDOW_S) / WINDOW_S
    report = (f"throttled producer {produced / MIB:.3f} MiB/s, throttled consumer {fetched / MIB:.3f} MiB/s, "
              f"free producer {alone / MIB:.2f} MiB/s alone and {together / MIB:.2f} MiB/s beside them; "
              f"throttle seen {slow_throttles.max_ms} / {read_throttles.max_ms} / {free_throttles.max_ms} ms")
    assert (1 - SLOWER) * RATE <= produced <= (1 + TOLERANCE) * RATE, report
    assert (1 - SLOWER) * RATE <= fetched <= (1 + TOLERANCE) * RATE, report
    assert together >= 0.75 * alone, report
    assert slow_throttles.max_ms > 0 and read_throttles.max_ms > 0 and free_throttles.max_ms == 0, report
    assert not (slow_acked.errors or free_acked.errors), report


def metadata_request() -> Any:
    return body_class(METADATA, "request")(topics=[])


def test_a_request_rate_quota_holds_one_connection_to_its_rate(proxy: ProxyThread) -> None:
    w = Wire(proxy.bootstrap)
    try:
        told, waited = [], []
        started = time.monotonic()
        for cid in range(1, 31):
            resp = w.metadata(cid)
            told.append(resp.body.throttle_time_ms)
            waited.append(time.monotonic() - started)
            if cid == 10:
                after_burst = time.monotonic()
        # 10 requests a second with 1 s of burst: the burst goes at once, and is paid back within
        # the sampled span, so thirty requests take three seconds from the first.
        finished = time.monotonic()
        rate = 30 / (finished - started)
        assert (1 - SLOWER) * 10 <= rate <= (1 + TOLERANCE) * 10, f"{rate:.2f} requests/s, told {told}"
        assert told[:10] == [0] * 10, told
        # Past the burst, the i-th request owes (i - 10) / 10 s from the first: waited already (kproxy
        # muted the connection, or a busy machine was slow to send it) or told in its answer, as in
        # the pipelined test below. (A request a slow machine sent late enough owes nothing more and
        # is rightly told 0, so "every answer past the burst is throttled" fails on a busy machine.)
        owed = [(i - 10) / 10 for i in range(1, 31)]
        assert all(w_ + t / 1000 >= 0.9 * o for w_, t, o in zip(waited, told, owed, strict=True)), (waited, told)
        assert any(t > 0 for t in told[10:]), told
        # The burst took a fraction of what the twenty after it took (throttled, about 2 s): a
        # ratio, so a slow machine slows both sides alike.
        assert after_burst - started < 0.5 * (finished - after_burst), (after_burst - started, finished - after_burst)
    finally:
        w.close()


def test_a_throttled_connection_gets_every_answer_it_is_owed_in_order_and_others_go_on(
        proxy: ProxyThread) -> None:
    w, other = Wire(proxy.bootstrap), Wire(proxy.bootstrap)
    try:
        first = time.monotonic()
        for cid in range(1, 21):                      # twenty pipelined before any answer
            w.send(METADATA, 12, cid, metadata_request())
        answers, waited = [], []
        for _ in range(20):
            answers.append(w.receive(METADATA, 12))
            waited.append(time.monotonic() - first)
        assert [a.correlation_id for a in answers] == list(range(1, 21))
        told = [a.body.throttle_time_ms for a in answers]
        # 10/s with 1 s of burst: the i-th request owes (i - 10) / 10 s from the first, either waited
        # already (kproxy muted the connection, or a busy machine answered slowly) or told in its
        # answer. How it splits depends on the machine's speed; the sum does not.
        owed = [(i - 10) / 10 for i in range(1, 21)]
        assert all(w_ + t / 1000 >= 0.9 * o for w_, t, o in zip(waited, told, owed, strict=True)), (waited, told)
        assert told[-1] > 0, told
        # The connection is muted for what it was told; another one is not.
        sent = time.monotonic()
        w.send(METADATA, 12, 21, metadata_request())
        t0 = time.monotonic()
        assert other.metadata(1).correlation_id == 1
        other_took = time.monotonic() - t0
        assert w.receive(METADATA, 12).correlation_id == 21
        muted = time.monotonic() - sent
        # The other connection was answered while this one was still muted.
        assert muted >= 0.8 * told[-1] / 1000 and other_took < muted, (muted, other_took, told)
    finally:
        w.close()
        other.close()

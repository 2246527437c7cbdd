"""Cut-through on tansu: real clients consume large Fetch answers that kproxy streams while they
arrive, and get every record back; /metrics says the answers were streamed (and, with cut-through
off, that they were not: the test that fails when streaming is off). A broker connection cut in the
middle of a streamed answer closes the client connection, and the client reconnects and loses
nothing."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import threading
import urllib.request
import warnings
from collections.abc import Iterator

import attrs
import confluent_kafka
import pytest

from kproxy.config import config_from_args
from kproxy.server.embedded import ProxyThread
from tests import socket_origins
from tests.e2e.kcat import kcat_roundtrip
from tests.e2e.proxied import free_port_block, start_proxy
from tests.e2e.relay import Relay
from tests.e2e.scenarios import (
    _ak_consume_assigned,
    _ck_admin,
    _ck_consume_assigned,
    _ck_wait,
    _kp_consume_assigned,
    confluent_create_topic,
)
from tests.e2e.tansu import Tansu, TansuBroker, free_port

pytestmark = pytest.mark.e2e

N = 400
VALUE = 2000   # 400 x 2 KB: tansu answers a Fetch with everything, about 0.8 MB, streamed
STREAMED = ("kproxy_frames_total", (("api", "fetch"), ("direction", "response"), ("path", "streamed")))
STORED = ("kproxy_frames_total", (("api", "fetch"), ("direction", "response"), ("path", "stored")))
BROKEN = ("kproxy_streamed_answers_broken_total", ())
SPLICED = ("kproxy_spliced_bytes_total", ())


def records() -> list[tuple[bytes, bytes]]:
    return [(b"k%05d" % i, (b"%05d|" % i) * (VALUE // 6)) for i in range(N)]


def produce_direct(bootstrap: str, topic: str) -> None:
    """The records go straight to the broker, so only the consuming passes through kproxy."""
    confluent_create_topic(bootstrap, topic, partitions=1)
    p = confluent_kafka.Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 20})
    for key, value in records():
        p.produce(topic, value, key, partition=0)
    assert p.flush(30) == 0


def metrics(admin: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://{admin}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, value = line.rsplit(" ", 1)
        name, _, labels = name_labels.partition("{")
        pairs = tuple(sorted(tuple(kv.split("=", 1)) for kv in labels.rstrip("}").split(",") if kv))
        # One virtual cluster here: its label is left out of the keys.
        out[(name, tuple((k, v.strip('"')) for k, v in pairs if k != "virtual_cluster"))] = float(value)
    return out


# These tests are about how a frame streams, not which frames do by default (2 MiB): they stream
# everything from 64 KiB, so that records of a few hundred KiB take the streaming path.
STREAM_FROM = 64 * 1024


@contextlib.contextmanager
def proxy(upstream: str, cut_through: bool = True, splice: bool = False) -> Iterator[tuple[ProxyThread, str]]:
    admin = f"127.0.0.1:{free_port()}"
    if cut_through:
        p = start_proxy(upstream, advertised_host="127.0.0.1", admin={"listen": admin}, cut_through_splice=splice,
                        cut_through_min_bytes=STREAM_FROM)
    else:
        # null in a file; None among quick-mode overrides means "not given", so the setting is
        # replaced on the built config.
        cfg = config_from_args(upstream, f"127.0.0.1:{free_port_block()}", admin={"listen": admin},
                               exposure={"advertised_host": "127.0.0.1", "broker_port_count": 6})
        p = ProxyThread(attrs.evolve(cfg, cut_through_min_bytes=None)).start()
    try:
        yield p, admin
    finally:
        p.stop()


@pytest.fixture
def cleanup(broker: TansuBroker) -> Iterator[list[str]]:
    """Topics a test made on the shared broker, deleted afterwards: later tests list every topic."""
    made: list[str] = []
    yield made
    with contextlib.suppress(Exception):
        _ck_wait(_ck_admin(broker.bootstrap).delete_topics(made, request_timeout=30))


# Where kafka-python's connection manager makes a connection's socket (tests/socket_origins.py's
# frames, innermost first): its own connect, not kproxy's.
_KP_OWN_CONNECT = "kafka/net/inet.py:88 connect < kafka/net/inet.py:21 create_connection < kafka/net/manager.py"


def consumed_all(got: list) -> bool:
    return sorted((key, value) for _, key, value, _ in got) == records()


def test_real_clients_consume_streamed_answers_and_get_every_record(broker: TansuBroker, topic: str,
                                                                    cleanup: list[str]) -> None:
    cleanup += [topic, f"{topic}-kcat"]
    produce_direct(broker.bootstrap, topic)
    with proxy(broker.bootstrap) as (p, admin):
        for name, consume in (("kafka-python", _kp_consume_assigned), ("confluent-kafka", _ck_consume_assigned),
                              ("aiokafka", lambda *a: asyncio.run(_ak_consume_assigned(*a)))):
            before = metrics(admin)
            with warnings.catch_warnings(record=True) as left:
                warnings.simplefilter("always", ResourceWarning)
                got = consume(p.bootstrap, topic, N, 1)
                gc.collect()
            # An unclosed socket found here twice in pair rounds, by a collection the next lines set
            # off: collected at once, it says which test, thread and frames made it.
            # Joined into the message: pytest's own rendering of the list cuts it before the frames.
            leaks = [f"{w.message} ({socket_origins.origin(w.source) or 'origin unknown'})"
                     for w in left if issubclass(w.category, ResourceWarning)]
            # kafka-python 3.0.12 can leave the socket of a connection it was still opening when the
            # consumer closed (its connection manager's own connect, seen once under load on the
            # kproxy port); that is the library's, collected here so no later test meets it. Any
            # other socket left, kproxy's above all, fails the test.
            leaks = [leak for leak in leaks if not (name == "kafka-python" and _KP_OWN_CONNECT in leak)]
            assert not leaks, f"{name} left: " + "\n".join(leaks)
            assert consumed_all(got), f"{name}: {len(got)} of {N} records"
            after = metrics(admin)
            assert after.get(STREAMED, 0) > before.get(STREAMED, 0), f"{name}: no answer was streamed"
        # kcat (librdkafka 2.0) produces and consumes through kproxy; values large enough to stream.
        before = metrics(admin)
        ok, output = kcat_roundtrip(p.bootstrap, f"{topic}-kcat",
                                    [(f"k{i:04d}", f"{i:05d}|" * 400) for i in range(300)], timeout=60)
        assert ok, output
        assert metrics(admin).get(STREAMED, 0) > before.get(STREAMED, 0)


def test_with_splice_on_real_clients_get_every_record_and_the_record_bodies_are_spliced(
        broker: TansuBroker, topic: str, cleanup: list[str]) -> None:
    cleanup.append(topic)
    produce_direct(broker.bootstrap, topic)
    with proxy(broker.bootstrap, splice=True) as (p, admin):
        for name, consume in (("kafka-python", _kp_consume_assigned), ("confluent-kafka", _ck_consume_assigned)):
            before = metrics(admin)
            got = consume(p.bootstrap, topic, N, 1)
            assert consumed_all(got), f"{name}: {len(got)} of {N} records"
            after = metrics(admin)
            assert after.get(STREAMED, 0) > before.get(STREAMED, 0), f"{name}: no answer was streamed"
            # Most of the 0.8 MB went socket to socket: not a byte of it through kproxy's buffers.
            assert after.get(SPLICED, 0) - before.get(SPLICED, 0) > N * VALUE // 2, name


def test_with_cut_through_off_every_answer_is_stored(broker: TansuBroker, topic: str, cleanup: list[str]) -> None:
    cleanup.append(topic)
    produce_direct(broker.bootstrap, topic)
    with proxy(broker.bootstrap, cut_through=False) as (p, admin):
        assert consumed_all(_ck_consume_assigned(p.bootstrap, topic, N, 1))
        m = metrics(admin)
        assert m.get(STREAMED, 0) == 0 and m.get(STORED, 0) > 0


class CuttingRelay(Relay):
    """A relay that, once armed, forwards half of the first large piece of a broker answer (with
    ``towards_broker``, of a request) and then cuts both connections: a broker that dies in the
    middle of a frame."""

    def __init__(self, target: tuple[str, int], port: int, towards_broker: bool = False) -> None:
        super().__init__(target, port)
        self.towards_broker = towards_broker
        self.armed = threading.Event()
        self.cuts = 0

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._conns |= {client, upstream}
            threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, from_broker: bool) -> None:
        try:
            while data := src.recv(262144):
                if from_broker != self.towards_broker and len(data) >= 65536 and self.armed.is_set():
                    self.armed.clear()
                    self.cuts += 1
                    dst.sendall(data[: len(data) // 2])
                    for s in (src, dst):
                        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                    return
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    s.close()


@pytest.mark.parametrize("splice", [False, True], ids=["copied", "spliced"])
def test_a_broker_cut_mid_answer_closes_the_client_which_reconnects_and_loses_nothing(tansu_binary: str,
                                                                                      splice: bool) -> None:
    relay_port = free_port()
    tansu = Tansu(tansu_binary, advertised=("127.0.0.1", relay_port))
    relay = CuttingRelay(("127.0.0.1", tansu.port), relay_port)
    relay.start()
    try:
        with tansu, proxy(relay.bootstrap, splice=splice) as (p, admin):
            topic = f"cut-{relay_port}"
            produce_direct(relay.bootstrap, topic)
            relay.armed.set()
            got = _ck_consume_assigned(p.bootstrap, topic, N, 1)
            assert relay.cuts == 1
            assert consumed_all(got), f"{len(got)} of {N} records after the cut"
            m = metrics(admin)
            assert m.get(BROKEN, 0) == 1
            assert m.get(STREAMED, 0) >= 1
            assert (m.get(SPLICED, 0) > 0) == splice
    finally:
        relay.stop()

"""``kproxy top --once`` against a kproxy (one process, and a two-worker supervisor) carrying a steady
produce load from a real client: the request rate it prints agrees within 20% with the client's own
count over a window as long as top's, its bytes per request with librdkafka's own byte counters, and
the client id shows though per-client metric labels are off."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import confluent_kafka
import confluent_kafka.admin
import pytest

from tests.e2e.proxied import free_port_block
from tests.e2e.tansu import TansuBroker, free_port, unique_name
from tests.e2e.test_workers import http
from tests.polling import wait_until

pytestmark = pytest.mark.e2e

RATE = 80             # produce requests per second the load aims at
RECORD = 4096         # bytes of each record's value
CLIENT_ID = "top-test-producer"


class SteadyProducer(threading.Thread):
    """One record per Produce request (flushed before the next), paced at RATE; it notes when each
    request was answered, and librdkafka's statistics (bytes on the wire) every 100 ms."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        super().__init__(daemon=True)
        self.topic = topic
        self.done: list[float] = []
        self.stats: list[tuple[float, int]] = []     # (time, bytes sent + received, all brokers)
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.producer = confluent_kafka.Producer({
            "bootstrap.servers": bootstrap, "client.id": CLIENT_ID, "acks": 1, "linger.ms": 0,
            "statistics.interval.ms": 100, "stats_cb": self._stats})

    def _stats(self, text: str) -> None:
        brokers = json.loads(text)["brokers"].values()
        self.stats.append((time.monotonic(), sum(b["txbytes"] + b["rxbytes"] for b in brokers)))

    def run(self) -> None:
        try:
            value = b"v" * RECORD
            start = time.monotonic()
            n = 0
            while not self.stop.is_set():
                self.producer.produce(self.topic, key=b"k", value=value)
                assert self.producer.flush(10) == 0
                self.done.append(time.monotonic())
                n += 1
                # Pacing the load (not waiting for a state): the next request is due at start + n / RATE.
                self.stop.wait(max(0.0, start + n / RATE - time.monotonic()))
            self.producer.flush(10)
        except BaseException as e:
            self.error = e

    def requests_between(self, a: float, b: float) -> float:
        return sum(1 for t in self.done if a <= t <= b) / (b - a)

    def requests_in_windows(self, a: float, b: float, width: float) -> tuple[float, float]:
        """The lowest and the highest rate of answered requests over any ``width`` seconds inside
        [a, b]: ``kproxy top`` reads its two scrapes at some moment between a and b, and a paced load
        that fell behind on a busy machine catches up in a burst, so its rate is not the same in every
        window. The count in a window changes only where an edge crosses a request, so those starts
        give every count there is."""
        last = b - width
        starts = {a, last}
        for t in self.done:
            starts |= {t, t + 1e-6, t - width, t - width + 1e-6}
        counts = [sum(1 for t in self.done if s <= t <= s + width) for s in starts if a <= s <= last]
        return min(counts) / width, max(counts) / width

    def bytes_between(self, a: float, b: float) -> float:
        first = next(s for s in self.stats if s[0] >= a)
        last = next(s for s in reversed(self.stats) if s[0] <= b)
        return (last[1] - first[1]) / (last[0] - first[0])


def start_kproxy(broker: TansuBroker, tmp_path: Path, workers: int) -> tuple[subprocess.Popen[bytes], int, int]:
    port, admin = free_port_block(3), free_port()
    config = tmp_path / "kproxy.yaml"
    config.write_text(f'listen: "127.0.0.1:{port}"\nupstream: {{bootstrap_servers: "{broker.bootstrap}"}}\n'
                      f"exposure: {{advertised_host: 127.0.0.1, node_id_base: {broker.node_id}, "
                      f"broker_port_count: 2}}\n"
                      f'admin: {{listen: "127.0.0.1:{admin}"}}\nworkers: {workers}\n')
    log = tmp_path / "kproxy.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kproxy", "run", "--config", str(config)],
                                stdout=subprocess.DEVNULL, stderr=out, start_new_session=True)
    wait_until(lambda: http(f"http://127.0.0.1:{admin}/readyz")[0] == 200 or proc.poll() is not None,
             what=log.read_text())
    assert proc.poll() is None, log.read_text()
    return proc, port, admin


def parse_top(text: str) -> tuple[dict[str, tuple[float, float]], list[str]]:
    """({api: (requests/s, bytes/s)}, client ids) from ``kproxy top --once``."""
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["api", "requests/s", "bytes/s"])
    apis = {}
    for line in lines[header + 1:]:
        if not line.strip():
            break
        name, requests, nbytes = line.split()[:3]
        apis[name] = (float(requests), float(nbytes))
    start = next(i for i, line in enumerate(lines) if line.startswith("client_id"))
    clients = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        clients.append(line.split()[0])
    return apis, clients


@pytest.mark.parametrize("workers", [1, 2])
def test_top_once_prints_the_rates_the_client_produced(broker: TansuBroker, tmp_path: Path, workers: int) -> None:
    proc, port, admin = start_kproxy(broker, tmp_path, workers)
    load: SteadyProducer | None = None
    try:
        topic = unique_name("top")
        adm = confluent_kafka.admin.AdminClient({"bootstrap.servers": f"127.0.0.1:{port}"})
        adm.create_topics([confluent_kafka.admin.NewTopic(topic, 1, 1)])[topic].result(20)
        load = SteadyProducer(f"127.0.0.1:{port}", topic)
        load.start()
        wait_until(lambda: len(load.done) >= RATE or load.error is not None, timeout=30, what="the load started")
        assert load.error is None, load.error

        before = time.monotonic()
        top = subprocess.run([sys.executable, "-m", "kproxy", "top", "--admin", f"127.0.0.1:{admin}", "--once"],
                             capture_output=True, text=True, timeout=60)
        after = time.monotonic()
        assert top.returncode == 0, top.stderr
        load.stop.set()
        load.join(20)
        assert load.error is None, load.error

        apis, clients = parse_top(top.stdout)
        requests, nbytes = apis["produce"]
        own_requests = load.requests_between(before, after)
        own_bytes = load.bytes_between(before, after)
        assert own_requests > RATE / 4, f"the load was not steady: {own_requests:.1f}/s"
        # top's rates are over its own window (its first line says how long), somewhere in
        # [before, after]: the client's rate over some window that long agrees with them.
        width = float(top.stdout.split(": rates over ", 1)[1].split(" s", 1)[0])
        low, high = load.requests_in_windows(before, after, width)
        assert low * 0.8 <= requests <= high * 1.2, (low, high, top.stdout)
        # Bytes per request as librdkafka counted them on the wire over the whole time.
        assert nbytes / requests == pytest.approx(own_bytes / own_requests, rel=0.2), top.stdout
        assert nbytes > RECORD * requests * 0.8
        # The client id shows with per-client metric labels off (the default).
        assert CLIENT_ID in clients, top.stdout
        status, metrics = http(f"http://127.0.0.1:{admin}/metrics")
        assert status == 200 and "kproxy_by_client_requests_total" not in metrics
        if workers > 1:
            assert f"({workers} workers)" in top.stdout.splitlines()[0]
    finally:
        if load is not None:
            load.stop.set()
        proc.terminate()
        proc.wait(30)


def test_top_says_why_it_cannot_read_the_admin_listener() -> None:
    port = free_port()
    done = subprocess.run([sys.executable, "-m", "kproxy", "top", "--admin", f"127.0.0.1:{port}", "--once"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.startswith(f"kproxy top: cannot read http://127.0.0.1:{port}/metrics:")

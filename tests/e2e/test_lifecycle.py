"""kproxy as a process, the way an operator meets it: start-up errors, ports it cannot bind, signals
(drain, a second signal, SIGHUP), and what the log says about each."""

from __future__ import annotations

import contextlib
import functools
import logging
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kproxy.protocol.messages import body_class
from tests.e2e.fake_cluster import METADATA, FakeCluster
from tests.e2e.proxied import free_port_block, in_flight, start_proxy
from tests.e2e.scenarios import confluent_create_topic
from tests.e2e.tansu import TansuBroker, unique_name
from tests.e2e.wire import Wire
from tests.polling import wait_until

pytestmark = pytest.mark.e2e

FETCH = 1


@contextlib.contextmanager
def kproxy_process(tmp_path: Path, *args: str) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """``python -m kproxy run ARGS`` with its log in a file; killed on the way out if still running.

    In a session of its own, as a service manager would start it: in pytest's session the kernel's
    autogroup scheduler shares one session's CPU among everything in it (pytest, its xdist sibling,
    their JVMs), and under load kproxy alone then took 10-14 s to start."""
    log = tmp_path / f"kproxy-{time.monotonic_ns()}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kproxy", "run", *args],
                                stdout=subprocess.DEVNULL, stderr=out, start_new_session=True)
    try:
        yield proc, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def connect_when_up(address: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 15) -> Wire:
    """A connection to kproxy once it handles signals (the port listens a little earlier)."""
    deadline = time.monotonic() + timeout
    while "signals: SIGTERM or SIGINT drains" not in log.read_text():
        assert time.monotonic() < deadline and proc.poll() is None, f"kproxy did not start: {log.read_text()}"
        time.sleep(0.05)
    return Wire(address)


def readable(w: Wire) -> bool:
    """Whether bytes (or the end of the stream) wait on ``w`` right now."""
    return bool(select.select([w.sock], [], [], 0)[0])


def long_poll(w: Wire, topic: str, correlation_id: int, max_wait_ms: int) -> None:
    fetch = body_class(FETCH, "request")
    w.send(FETCH, 12, correlation_id, fetch(max_wait_ms=max_wait_ms, min_bytes=1_000_000, max_bytes=1_000_000,
                                            topics=[fetch.FetchTopic(topic=topic, partitions=[fetch.FetchPartition(
                                                partition=0, fetch_offset=0, partition_max_bytes=1_000_000)])]))


def test_drain_closes_idle_connections_at_once_and_busy_ones_when_answered(broker: TansuBroker,
                                                                           tmp_path: Path) -> None:
    port = free_port_block()
    admin = f"127.0.0.1:{free_port_block(1)}"
    topic = unique_name("drain")
    confluent_create_topic(broker.bootstrap, topic)
    with kproxy_process(tmp_path, "--upstream", broker.bootstrap, "--listen", f"127.0.0.1:{port}",
                        "--admin", admin) as (proc, log):
        idle = connect_when_up(f"127.0.0.1:{port}", proc, log)
        assert idle.metadata(1).correlation_id == 1          # a consumer between polls
        busy = Wire(f"127.0.0.1:{port}")
        long_poll(busy, topic, 42, max_wait_ms=3000)
        wait_until(lambda: in_flight(admin) == 1, "the long poll never reached kproxy")
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert idle.closed_by_peer()                          # owes nothing: closed at once,
        assert not readable(busy)                             # while the long poll is still held
        resp = busy.receive(FETCH, 12)                        # the long poll is still answered
        assert resp.correlation_id == 42
        assert busy.closed_by_peer()
        # Done before the 10 s drain timeout: nothing waits for it once nothing is owed.
        assert proc.wait(10) == 0
        assert time.monotonic() - started < 9
        text = log.read_text()
        assert "draining" in text and "kproxy stopped" in text
        assert "shutting down (nothing in flight)" in text
        assert "shutting down (answered what was in flight)" in text
        idle.close()
        busy.close()


def test_a_second_signal_stops_at_once(broker: TansuBroker, tmp_path: Path) -> None:
    port = free_port_block()
    admin = f"127.0.0.1:{free_port_block(1)}"
    topic = unique_name("drain2")
    confluent_create_topic(broker.bootstrap, topic)
    with kproxy_process(tmp_path, "--upstream", broker.bootstrap, "--listen", f"127.0.0.1:{port}",
                        "--admin", admin) as (proc, log):
        w = connect_when_up(f"127.0.0.1:{port}", proc, log)
        long_poll(w, topic, 7, max_wait_ms=20_000)            # would hold the drain for its timeout
        wait_until(lambda: in_flight(admin) == 1, "the long poll never reached kproxy")
        proc.send_signal(signal.SIGINT)
        wait_until(lambda: "draining" in log.read_text(), "SIGINT did not start a drain")
        assert proc.poll() is None                            # draining, waiting for the long poll
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0
        assert time.monotonic() - started < 10                # not the 20 s long poll, nor the drain timeout
        assert "again: stopping now" in log.read_text()
        w.close()


def test_a_sigterm_once_ready_drains_even_while_discovery_still_waits(tmp_path: Path) -> None:
    """/readyz says ready once a bootstrap server has answered ApiVersions; discovery's Metadata may
    still be on its way. A SIGTERM from then on drains and stops cleanly. (It once ended the process
    outright: signals became kproxy's only after start-up, which lost a worker's last log line when
    a supervisor passed a SIGTERM on right after the worker said it was ready.)"""
    port = free_port_block()
    admin = f"127.0.0.1:{free_port_block(1)}"
    answer_metadata = threading.Event()
    with FakeCluster((1,), coordinator_id=1) as cluster:
        broker = cluster.brokers[1]
        broker.metadata_gate = answer_metadata
        try:
            with kproxy_process(tmp_path, "--upstream", cluster.bootstrap, "--listen", f"127.0.0.1:{port}",
                                "--admin", admin) as (proc, log):
                wait_until(lambda: readyz(admin) == 200 or proc.poll() is not None, "never ready")
                wait_until(lambda: broker.received(METADATA), "discovery never asked for Metadata")
                assert "kproxy listening" not in log.read_text()       # still starting: Metadata is held
                proc.send_signal(signal.SIGTERM)
                answer_metadata.set()
                assert proc.wait(15) == 0, log.read_text()
                text = log.read_text()
                assert "SIGTERM: draining" in text and "kproxy stopped" in text, text
        finally:
            answer_metadata.set()
        assert not cluster.errors


def readyz(admin: str) -> int:
    try:
        with urllib.request.urlopen(f"http://{admin}/readyz", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def test_sighup_is_logged_and_the_proxy_keeps_serving(broker: TansuBroker, tmp_path: Path) -> None:
    port = free_port_block()
    with kproxy_process(tmp_path, "--upstream", broker.bootstrap, "--listen", f"127.0.0.1:{port}") as (proc, log):
        w = connect_when_up(f"127.0.0.1:{port}", proc, log)
        assert w.metadata(1).correlation_id == 1
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 5
        while "SIGHUP" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        assert proc.poll() is None
        assert w.metadata(2).correlation_id == 2              # the same connection, still served
        w.close()


def test_a_bootstrap_port_in_use_is_one_line_naming_the_address(broker: TansuBroker, tmp_path: Path) -> None:
    holder = socket.create_server(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    try:
        proc = subprocess.run([sys.executable, "-m", "kproxy", "run", "--upstream", broker.bootstrap,
                               "--listen", f"127.0.0.1:{port}"], capture_output=True, timeout=30)
    finally:
        holder.close()
    assert proc.returncode == 1
    err = proc.stderr.decode()
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("kproxy run:")]
    assert f"cannot listen on 127.0.0.1:{port}" in line and "in use" in line


def test_a_broker_port_held_by_another_process_is_never_advertised(broker: TansuBroker,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kproxy")
    first = free_port_block()
    holder = socket.create_server(("127.0.0.1", first + 1))    # the first per-broker port
    try:
        p = start_proxy(broker.bootstrap, advertised_host="127.0.0.1", listen_port=first)
        try:
            w = Wire(p.bootstrap)
            (b,) = w.metadata(1).body.brokers
            assert b.port == first + 2                          # the next port kproxy could bind
            node = Wire(f"127.0.0.1:{b.port}")
            assert node.metadata(2).correlation_id == 2         # and it leads to the broker
            node.close()
            w.close()
            assert any(f"cannot listen on 127.0.0.1:{first + 1}" in r.getMessage() and
                       "will not be advertised" in r.getMessage() for r in caplog.records)
        finally:
            p.stop()
    finally:
        holder.close()


def _reload_config(path: Path, port: int, admin: str, bootstrap: str, traffic_log: Path, sample: str,
                   in_flight: int = 256) -> None:
    path.write_text(f"""listen: "127.0.0.1:{port}"
upstream: {{bootstrap_servers: ["{bootstrap}"]}}
admin: {{listen: "{admin}"}}
limits: {{max_in_flight_requests: {in_flight}}}
traffic_log:
  dir: "{traffic_log}"
  sample: {sample}
""")


def test_sighup_puts_new_sample_ratios_in_force_and_names_what_waits_for_a_restart(
        broker: TansuBroker, tmp_path: Path) -> None:
    """An operator turns the traffic log's sampling down on a running kproxy: the next requests
    follow the new ratio, on a connection opened before too; a setting that needs a restart is
    named, not silently ignored; a file that does not load is refused with its line, and the ratios
    in force stay."""
    from tests.e2e.test_cut_through import metrics

    port = free_port_block()
    admin = f"127.0.0.1:{free_port_block(1)}"
    config = tmp_path / "kproxy.yaml"
    tlog = tmp_path / "traffic"
    tlog.mkdir()
    write = functools.partial(_reload_config, config, port, admin, broker.bootstrap, tlog)
    write("{default: 1.0}")

    def counts() -> tuple[float, float]:
        """Requests completed (every api) and traffic log lines written."""
        m = metrics(admin)
        return (sum(v for (name, _), v in m.items() if name == "kproxy_requests_total"),
                m.get(("kproxy_traffic_log_lines_written_total", ()), 0.0))

    def metadata_round(w: Wire, first_id: int) -> tuple[float, float]:
        before = counts()[0]
        for i in range(3):
            assert w.metadata(first_id + i).correlation_id == first_id + i
        wait_until(lambda: counts()[0] >= before + 3, "kproxy did not count the three requests")
        return counts()

    def sighup_and_wait(text: str) -> str:
        proc.send_signal(signal.SIGHUP)
        wait_until(lambda: text in log.read_text(), f"no {text!r} in the log after SIGHUP")
        return log.read_text()

    with contextlib.ExitStack() as stack:
        proc, log = stack.enter_context(kproxy_process(tmp_path, "--config", str(config)))
        w = connect_when_up(f"127.0.0.1:{port}", proc, log)
        stack.callback(w.close)
        metadata_round(w, 1)
        wait_until(lambda: counts()[1] == counts()[0] >= 3, "every request should be logged at sample 1.0")

        write("{default: 0.0}", in_flight=100)
        text = sighup_and_wait("the config file changes")
        assert "SIGHUP: traffic_log.sample: {default: 1} -> {default: 0} (in force from the next request)" in text
        assert "changes limits.max_in_flight_requests; it takes effect only at a restart" in text
        m = metrics(admin)
        assert m[("kproxy_settings_reloads_total", (("outcome", "ok"),))] == 1
        assert m[("kproxy_settings_restart_pending", ())] == 1
        logged = counts()[1]
        _, after = metadata_round(w, 4)                      # the connection opened at 1.0
        assert after == logged, "a request was logged at sample 0.0"

        config.write_text(config.read_text().replace("sample: {default: 0.0}", "sample: {default: 2.0}"))
        text = sighup_and_wait("settings reload refused")
        refused = next(line for line in text.splitlines() if "settings reload refused" in line)
        assert f"{config}:7" in refused and "must be a number from 0 to 1" in refused, refused
        assert metrics(admin)[("kproxy_settings_reloads_total", (("outcome", "failed"),))] == 1
        _, after = metadata_round(w, 7)
        assert after == logged, "the refused file's ratio went in force"

        write("{default: 1.0, metadata: 1.0}")
        sighup_and_wait("-> {default: 1, metadata: 1}")
        metadata_round(w, 10)
        wait_until(lambda: counts()[1] >= logged + 3, "the ratio raised again was not followed")
        assert metrics(admin)[("kproxy_settings_restart_pending", ())] == 0
        assert proc.poll() is None

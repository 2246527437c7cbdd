"""``workers: 2`` as an operator runs it: one supervisor, two worker processes on the same ports, a
real client through them, merged metrics, a killed worker restarted, and one SIGTERM for all."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.proxied import free_port_block
from tests.e2e.sasl_gate import confluent_roundtrip, expected_pairs
from tests.e2e.tansu import TansuBroker, free_port, unique_name
from tests.e2e.wire import Wire
from tests.polling import wait_until

pytestmark = pytest.mark.e2e


def http(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return 0, str(e)


def launch_workers(broker: TansuBroker, tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path, int, int]:
    """``kproxy run --config`` with ``workers: 2``, just started; (process, log, port, admin port).

    The supervisor gets a session of its own, as a service manager would give it (and as it gives
    its workers). In the test's session the kernel's autogroup scheduler would share one session's
    CPU between it, pytest, the other xdist worker and the JVMs they start: on a loaded machine its
    own start-up alone then took 10-20 s, while its workers, in sessions of their own, took 4."""
    port, admin = free_port_block(3), free_port()
    config = tmp_path / "kproxy.yaml"
    config.write_text(f'listen: "127.0.0.1:{port}"\nupstream: {{bootstrap_servers: "{broker.bootstrap}"}}\n'
                      f"exposure: {{advertised_host: 127.0.0.1, node_id_base: {broker.node_id}, "
                      f"broker_port_count: 2}}\n"
                      f'admin: {{listen: "127.0.0.1:{admin}"}}\nworkers: 2\n')
    log = tmp_path / "kproxy.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kproxy", "run", "--config", str(config)],
                                stdout=subprocess.DEVNULL, stderr=out, start_new_session=True)
    return proc, log, port, admin


def start_workers(broker: TansuBroker, tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path, int, int]:
    """``kproxy run --config`` with ``workers: 2``, ready; (process, log, port, admin port)."""
    proc, log, port, admin = launch_workers(broker, tmp_path)
    wait_until(lambda: http(f"http://127.0.0.1:{admin}/readyz")[0] == 200 or proc.poll() is not None, log)
    return proc, log, port, admin


def test_two_workers_share_the_ports_and_are_supervised(broker: TansuBroker, tmp_path: Path) -> None:
    proc, log, port, admin = start_workers(broker, tmp_path)
    try:
        assert "ready (2 workers)" in http(f"http://127.0.0.1:{admin}/readyz")[1]

        # A real client, and enough connections that the kernel gives both workers some.
        assert confluent_roundtrip({"bootstrap.servers": f"127.0.0.1:{port}"}, unique_name("workers")) == \
            expected_pairs()
        wires = [Wire(f"127.0.0.1:{port}") for _ in range(24)]
        for i, w in enumerate(wires):
            assert w.metadata(i + 1).correlation_id == i + 1
        text = log.read_text()
        assert "[worker 0]: connection" in text and "[worker 1]: connection" in text

        # /metrics adds the workers up: every Metadata above is counted once.
        status, metrics = http(f"http://127.0.0.1:{admin}/metrics")
        assert status == 200
        counted = re.search(r'^kproxy_requests_total\{api="metadata",virtual_cluster="default"\} (\d+)', metrics, re.MULTILINE)
        assert counted is not None and int(counted.group(1)) >= 24
        assert 'kproxy_workers{virtual_cluster=""} 2' in metrics
        for w in wires:
            w.close()

        # A worker that dies is started again; the proxy keeps serving meanwhile.
        pid = int(re.findall(r"worker 1 started \(pid (\d+)\)", log.read_text())[-1])
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: "worker 1 exited unexpectedly" in log.read_text(), log)
        w = Wire(f"127.0.0.1:{port}")
        assert w.metadata(99).correlation_id == 99
        w.close()
        wait_until(lambda: len(re.findall(r"worker 1 started", log.read_text())) == 2, log)
        wait_until(lambda: http(f"http://127.0.0.1:{admin}/readyz")[0] == 200, log)

        # One SIGTERM drains both workers, and the supervisor exits with them.
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        assert time.monotonic() - started < 10
        text = log.read_text()
        # Each worker drained and exited cleanly, and said so last. (A SIGTERM that reached a worker
        # after it answered /readyz but before it handled signals once ended it outright: see
        # test_lifecycle's test_a_sigterm_once_ready_drains_even_while_discovery_still_waits.)
        assert "worker 0 exited (0)" in text and "worker 1 exited (0)" in text
        assert "[worker 0]: kproxy stopped" in text and "[worker 1]: kproxy stopped" in text
        assert "kproxy stopped (2 workers)" in text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_sigterm_while_the_workers_start_drains_them(broker: TansuBroker, tmp_path: Path) -> None:
    """A SIGTERM the supervisor passes on while its workers are still importing waits in each worker
    until it handles signals, then drains it: each exits 0 and says so last. (Before, it ended
    them outright: exit -15, no drain, no "kproxy stopped" line.)"""
    proc, log, _port, _admin = launch_workers(broker, tmp_path)
    try:
        wait_until(lambda: "worker 1 started" in log.read_text() or proc.poll() is not None, log)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()
        text = log.read_text()
        assert "worker 0 exited (0)" in text and "worker 1 exited (0)" in text, text
        assert "[worker 0]: kproxy stopped" in text and "[worker 1]: kproxy stopped" in text, text
        assert "[worker 0]: SIGTERM: draining" in text and "[worker 1]: SIGTERM: draining" in text, text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_workers_stop_when_their_supervisor_is_killed(broker: TansuBroker, tmp_path: Path) -> None:
    proc, log, port, _admin = start_workers(broker, tmp_path)
    pids = [int(p) for p in re.findall(r"worker \d started \(pid (\d+)\)", log.read_text())]
    try:
        assert len(pids) == 2
        proc.kill()                                   # no chance to pass a signal on
        proc.wait()

        def gone(pid: int) -> bool:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"

        wait_until(lambda: all(gone(p) for p in pids), log, timeout=20)
        assert "the supervisor (pid" in log.read_text()
        with pytest.raises(OSError):
            Wire(f"127.0.0.1:{port}", timeout=2).metadata()
    finally:
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)


def test_a_worker_whose_supervisor_died_while_it_started_stops_once_it_serves(broker: TansuBroker,
                                                                               tmp_path: Path) -> None:
    """The supervisor writes its pid in each worker's environment. A worker that comes up after its
    supervisor was killed (its parent is already another process) compares with that pid, not with
    the parent it finds, so it drains and stops instead of holding the ports for ever. Here the
    worker is started directly, named the worker of a supervisor that has already exited."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    port = free_port_block(3)
    config = tmp_path / "kproxy.yaml"
    config.write_text(f'listen: "127.0.0.1:{port}"\nupstream: {{bootstrap_servers: "{broker.bootstrap}"}}\n'
                      f"exposure: {{advertised_host: 127.0.0.1, node_id_base: {broker.node_id}, "
                      f"broker_port_count: 2}}\nworkers: 2\n")
    log = tmp_path / "kproxy.log"
    env = {**os.environ, "KPROXY_WORKER": "0/2", "KPROXY_SUPERVISOR": str(gone.pid)}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kproxy", "run", "--config", str(config)], env=env,
                                stdout=subprocess.DEVNULL, stderr=out, start_new_session=True)
    try:
        wait_until(lambda: proc.poll() is not None, log, timeout=60)
        text = log.read_text()
        assert f"the supervisor (pid {gone.pid}) is gone: draining and stopping this worker" in text
        assert "kproxy listening on" in text         # it had started: the stop came after, not a failure
        assert proc.returncode == 0, text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

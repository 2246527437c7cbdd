"""A tansu broker as a child process, for end-to-end tests; plus free ports and unique names.

Memory storage only: a restart empties the broker. Nothing here knows about pytest or kproxy.
"""

from __future__ import annotations

import ctypes
import re
import signal
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

from kproxy.server.demo import broker_answers


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the kernel's pick; racy only against other processes)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def unique_name(prefix: str) -> str:
    """A Kafka-legal topic or group name ([a-zA-Z0-9._-], well under 249 chars), unique per call."""
    clean = re.sub(r"[^a-zA-Z0-9._-]+", "-", prefix).strip("-")[:80] or "e2e"
    return f"{clean}-{uuid.uuid4().hex[:10]}"


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: PR_SET_PDEATHSIG=1, so a SIGKILLed pytest leaves no broker.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)


class TansuBroker:
    """A tansu broker child process on a fixed loopback port.

    Storage is `memory://`, so `stop()` followed by `start()` gives an empty broker on the same
    port: topics, records and committed offsets are gone. The node id survives (tansu uses 111).
    """

    def __init__(
        self, binary: str, host: str = "127.0.0.1", port: int | None = None, *, silent: bool = True
    ) -> None:
        self.binary = binary
        self.silent = silent
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.bootstrap = f"{host}:{self.port}"
        self.node_id: int | None = None
        self.cluster_id: str | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None

    def __repr__(self) -> str:
        return f"TansuBroker({self.bootstrap}, node_id={self.node_id}, running={self.running})"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, ready_timeout: float = 10.0) -> None:
        """Start (or restart) the broker on `self.port` and wait until it answers ApiVersions."""
        if self.running:
            return
        # Someone else's broker on this port would answer our readiness probe while ours dies
        # (tansu panics on EADDRINUSE): refuse up front, and check our process again once ready.
        if _listening(self.host, self.port):
            raise RuntimeError(f"{self.bootstrap} is already in use; not starting tansu there")
        url = f"tcp://{self.host}:{self.port}"
        argv = [self.binary, "broker", "--listener-url", url, "--advertised-listener-url", url]
        if self.silent:
            argv.append("--silent")
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            # PDEATHSIG follows the forking *thread*; only the main thread lives as long as pytest.
            in_main_thread = threading.current_thread() is threading.main_thread()
            self.process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent if in_main_thread else None,
            )
        finally:
            if log is not subprocess.DEVNULL:
                log.close()
        deadline = time.monotonic() + ready_timeout
        while not broker_answers(self.host, self.port, timeout=1.0) or not self.running:
            if not self.running:
                code = self.process.returncode
                self.process = None
                raise RuntimeError(
                    f"tansu exited with {code} before answering (log: {self.log_path}): {argv}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"tansu did not answer ApiVersions on {self.bootstrap} in {ready_timeout}s"
                )
            time.sleep(0.05)
        self._discover_cluster()

    def stop(self, timeout: float = 5.0) -> None:
        """Terminate the broker and wait for it; SIGKILL if SIGTERM is not enough. Idempotent."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout)

    def _discover_cluster(self) -> None:
        from tests.e2e.scenarios import kafka_python_describe_cluster_raw

        info = kafka_python_describe_cluster_raw(self.bootstrap)
        self.cluster_id = info["cluster_id"]
        self.node_id = int(info["brokers"][0]["broker_id"])

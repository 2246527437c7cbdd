"""A KMS server the tests run as a child process on a free loopback port: started and waited for until
it answers, paused and resumed with SIGSTOP/SIGCONT (an outage that keeps its in-memory state), and
killed with its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from kproxy.tansu import die_with_parent, free_port


class ServerProcess:
    name = "server"

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"{self.name}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def answers(self) -> bool:
        raise NotImplementedError

    def start(self, ready_timeout: float = 30.0) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("BAO_", "VAULT_", "AWS_"))}
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                cwd=self.workdir,   # moto writes its request recording to the working directory
                # PDEATHSIG follows the forking thread; only the main thread lives as long as the process.
                preexec_fn=die_with_parent if sys.platform == "linux" and
                threading.current_thread() is threading.main_thread() else None)
        deadline = time.monotonic() + ready_timeout
        while not self.answers():
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}: "
                                   f"{self.log_path.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} did not answer on {self.url} within {ready_timeout:g}s")
            time.sleep(0.05)
        if self.process.poll() is not None:     # what answered is not this process (its port was taken)
            raise RuntimeError(f"{self.name} exited with {self.process.returncode} while {self.url} answered: "
                               f"{self.log_path.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.process is not None:
            self.resume()
            self.process.kill()
            self.process.wait()
            self.process = None

    def pause(self, timeout: float = 10.0) -> None:
        """Stop the server, and return only once every thread of it has stopped. kill() returns
        before the stop takes effect: on a loaded machine a just-signalled server was seen to answer
        requests for tens of milliseconds afterwards, so a test that then expects a timeout got an
        answer instead."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        while not _all_threads_stopped(self.process.pid):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} (pid {self.process.pid}) did not stop within {timeout:g}s")
            time.sleep(0.001)

    def resume(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGCONT)


def _all_threads_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is in the stopped state (``T`` in /proc/PID/task/TID/stat)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except FileNotFoundError:       # the thread ended while we looked
            continue
        if stat[stat.rindex(")") + 2] not in "Tt":
            return False
    return True

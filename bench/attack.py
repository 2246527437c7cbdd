"""kproxy under attack, at scale: idle connections, many connections, and a million mutated frames.

Run from the repository root:  ``.venv/bin/python bench/attack.py [--idle 1000] [--connections 5000]
[--frames 1000000] [--threads 8]``

One tansu broker and one kproxy process (``python -m kproxy run``, log level WARNING). Three phases:

1. ``--idle N``: N connections that send nothing or one ApiVersions, held open; kproxy's RSS growth in
   total and per connection (goal: 1,000 idle connections within 100 MB).
2. ``--connections N``: N connections opened at once and closed; kproxy must still answer after.
3. ``--frames N``: N mutated request frames (tests/e2e/mutation.py) from ``--threads`` senders over
   short-lived connections; frames per second, kproxy's peak RSS, and "internal error" lines in its log
   (must be 0: every malformed frame may only close its own connection). Then a real client
   (confluent-kafka) produces and consumes through kproxy.

The figures are kproxy's own (RSS from /proc), not ratios: there is no "direct" side to an attack.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import re
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kproxy.tansu import Tansu  # noqa: E402
from tests.e2e.mutation import mutate, request_corpus  # noqa: E402

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def proc_status(pid: int, key: str) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    m = re.search(rf"{key}:\s+(\d+) kB", text)
    assert m is not None
    return int(m.group(1)) * 1024


@contextlib.contextmanager
def kproxy(upstream: str, log: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kproxy", "run", "--upstream", upstream,
                                 "--listen", f"{HOST}:{port}", "--log-level", "WARNING"],
                                stdout=subprocess.DEVNULL, stderr=out, cwd=REPO)
    try:
        deadline = time.monotonic() + 20
        while not answers(f"{HOST}:{port}"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"kproxy did not start: {log.read_text()[-2000:]}")
            time.sleep(0.1)
        yield proc, f"{HOST}:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def api_versions_frame(correlation_id: int = 1) -> bytes:
    client_id = b"bench"
    body = struct.pack(">hhih", 18, 0, correlation_id, len(client_id)) + client_id
    return struct.pack(">i", len(body)) + body


def answers(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=2) as s:
            s.sendall(api_versions_frame())
            return len(s.recv(16)) > 0
    except OSError:
        return False


def idle_phase(pid: int, address: str, n: int) -> None:
    host, port = address.rsplit(":", 1)
    time.sleep(0.3)
    before = proc_status(pid, "VmRSS")
    conns = []
    for i in range(n):
        c = socket.create_connection((host, int(port)), timeout=10)
        if i % 2:
            c.sendall(api_versions_frame())
            c.recv(65536)
        conns.append(c)
    time.sleep(1.0)
    grown = proc_status(pid, "VmRSS") - before
    print(f"idle: {n} connections (half after one ApiVersions): RSS +{grown / 2**20:.1f} MiB "
          f"({grown / n / 1024:.1f} KiB each); goal for 1,000: <= 100 MB -> "
          f"{'met' if grown * 1000 / n <= 100e6 else 'NOT met'}")
    for c in conns:
        c.close()


def connections_phase(address: str, n: int) -> None:
    host, port = address.rsplit(":", 1)
    started = time.monotonic()
    conns = [socket.create_connection((host, int(port)), timeout=10) for _ in range(n)]
    opened = time.monotonic() - started
    for c in conns:
        c.close()
    time.sleep(1.0)
    print(f"connections: {n} opened in {opened:.2f} s and closed; kproxy still answers: {answers(address)}")


def frames_phase(pid: int, address: str, total: int, threads: int) -> None:
    corpus = request_corpus()
    host, port = address.rsplit(":", 1)
    sent = [0] * threads
    closed_by_kproxy = [0] * threads

    def sender(index: int) -> None:
        rng = random.Random(1000 + index)
        quota = total // threads
        while sent[index] < quota:
            try:
                conn = socket.create_connection((host, int(port)), timeout=5)
            except OSError:
                time.sleep(0.01)
                continue
            with conn:
                frames = [mutate(rng, rng.choice(corpus)) for _ in range(rng.randint(1, 8))]
                try:
                    conn.sendall(b"".join(struct.pack(">i", len(d)) + d for d in frames))
                except OSError:
                    closed_by_kproxy[index] += 1    # a bad frame closed it mid-send
                sent[index] += len(frames)
                conn.settimeout(0.01)
                with contextlib.suppress(OSError):
                    conn.recv(65536)

    started = time.monotonic()
    workers = [threading.Thread(target=sender, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.monotonic() - started
    frames = sum(sent)
    print(f"frames: {frames} mutated frames in {elapsed:.1f} s ({frames / elapsed:,.0f}/s) from {threads} "
          f"senders, {sum(closed_by_kproxy)} sends cut short by kproxy closing; kproxy peak RSS {proc_status(pid, 'VmHWM') / 2**20:.1f} MiB; still answers: {answers(address)}")


def client_roundtrip(address: str) -> bool:
    from tests.e2e.sasl_gate import confluent_roundtrip, expected_pairs
    from tests.e2e.tansu import unique_name

    return confluent_roundtrip({"bootstrap.servers": address}, unique_name("after-attack")) == expected_pairs()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--idle", type=int, default=1000)
    ap.add_argument("--connections", type=int, default=5000)
    ap.add_argument("--frames", type=int, default=1_000_000)
    ap.add_argument("--threads", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, Tansu() as broker:
        upstream = broker.bootstrap
        log = Path(tmp) / "kproxy.log"
        with kproxy(upstream, log) as (proc, address):
            if args.idle:
                idle_phase(proc.pid, address, args.idle)
            if args.connections:
                connections_phase(address, args.connections)
            if args.frames:
                frames_phase(proc.pid, address, args.frames, args.threads)
            if proc.poll() is not None:
                raise SystemExit(f"kproxy exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            print(f"real client through kproxy afterwards: {'ok' if client_roundtrip(address) else 'FAILED'}")
            internal = len(re.findall("internal error", log.read_text()))
            print(f"internal errors in kproxy's log: {internal}")


if __name__ == "__main__":
    main()

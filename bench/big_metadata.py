"""Metadata of a large cluster through kproxy: the added latency of one 10,000- or 100,000-partition
Metadata v12 answer, and how long a concurrent client's small requests stall meanwhile.

Run from the repository root:  ``.venv/bin/python bench/big_metadata.py [--partitions 100000]
[--samples 30] [--codec native|python] [--tls]``

``--tls`` puts TLS on both sides (clients to kproxy, kproxy to the fake broker; certificates from
trustme), as SNI mode requires: the big answer is then decrypted and encrypted again by kproxy, and
the loop-lag and memory figures must hold there too. Every run reports kproxy's resident memory at
the end and its peak (VmRSS, VmHWM).

A small in-process fake broker (threads, blocking sockets; no Kafka broker can be filled with
100,000 partitions here in reasonable time) answers ApiVersions, Metadata with no topics (its 50
brokers) and Metadata for all topics (5,000 topics x 20 partitions x 3 replicas, or 500 x 20, the
same bytes as bench/codec.py's scale cases). kproxy runs as its own process (``python -m kproxy
run``). The big request goes to the fake directly and through kproxy, interleaved; meanwhile another
connection through kproxy loops on small Metadata requests, and the longest gap between its answers
is the longest the event loop was held.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import ssl
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from codec import SCALE_BROKERS, metadata_body  # noqa: E402

from kproxy.protocol.messages import (  # noqa: E402
    Response,
    body_class,
    decode_request,
    encode_response_frame,
    supported_versions,
)
from tests.e2e.proxied import free_port_block  # noqa: E402

HOST = "127.0.0.1"
_I32 = struct.Struct(">i")


def _read_frame(sock: socket.socket) -> bytes | None:
    head = b""
    while len(head) < 4:
        chunk = sock.recv(4 - len(head))
        if not chunk:
            return None
        head += chunk
    (size,) = _I32.unpack(head)
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(min(1 << 20, size - len(data)))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


class FakeCluster:
    """Answers ApiVersions and Metadata v12 from canned bodies; nothing else (over TLS with ``tls``)."""

    def __init__(self, big_body: bytes, tls: ssl.SSLContext | None = None) -> None:
        self.big_body = big_body
        self.tls = tls
        cls = body_class(3, "response")
        small = cls(brokers=[cls.MetadataResponseBroker(node_id=i, host=f"b-{i}.kafka-prod.internal", port=9092)
                             for i in SCALE_BROKERS], cluster_id="fake", controller_id=1, topics=[])
        self.small = small
        self.listener = socket.create_server((HOST, 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        if self.tls is not None:
            try:
                conn = self.tls.wrap_socket(conn, server_side=True)
            except (OSError, ssl.SSLError):
                conn.close()
                return
        with conn:
            while (frame := _read_frame(conn)) is not None:
                req = decode_request(frame, keep_trailing=True)
                cid = req.correlation_id
                if req.api_key == 18:
                    av = body_class(18, "response")
                    # Metadata up to v12 only: the canned answers are v12.
                    keys = [av.ApiVersion(api_key=k, min_version=lo, max_version=min(hi, 12 if k == 3 else hi))
                            for k, (lo, hi) in supported_versions().items() if k in (3, 18)]
                    v = min(req.api_version, 3)
                    out = b"".join(bytes(b) for b in encode_response_frame(
                        Response.build(18, v, cid, av(api_keys=keys))))
                elif req.api_key == 3 and req.api_version == 12:
                    if req.body.topics is None:         # all topics: the big answer
                        header = _I32.pack(cid) + b"\x00"
                        out = _I32.pack(len(header) + len(self.big_body)) + header + self.big_body
                    else:
                        out = b"".join(bytes(b) for b in encode_response_frame(
                            Response.build(3, 12, cid, self.small)))
                else:
                    return
                conn.sendall(out)

    def close(self) -> None:
        self.listener.close()


def metadata_request(correlation_id: int, all_topics: bool) -> bytes:
    client_id = b"bench"
    header = struct.pack(">hhih", 3, 12, correlation_id, len(client_id)) + client_id + b"\x00"
    body = (b"\x00" if all_topics else b"\x01") + b"\x00\x00\x00"
    return _I32.pack(len(header) + len(body)) + header + body


def round_trip(sock: socket.socket, cid: int, all_topics: bool) -> float:
    t0 = time.perf_counter()
    sock.sendall(metadata_request(cid, all_topics))
    frame = _read_frame(sock)
    assert frame is not None and _I32.unpack_from(frame)[0] == cid
    return time.perf_counter() - t0


def connect(port: int, ca: str | None) -> socket.socket:
    """A client connection, over TLS trusting ``ca`` when given."""
    sock = socket.create_connection((HOST, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if ca is None:
        return sock
    return ssl.create_default_context(cafile=ca).wrap_socket(sock, server_hostname=HOST)


def small_loop(port: int, stop: Any, out: Any, ca: str | None = None) -> None:
    """In its own process: small Metadata requests in a loop on one connection until ``stop`` is set;
    sends back every round-trip time (the longest is how long kproxy's event loop was held)."""
    sock = connect(port, ca)
    gaps = []
    cid = 0
    while not stop.is_set():
        cid += 1
        gaps.append(round_trip(sock, cid, all_topics=False))
        time.sleep(0.001)
    out.send(gaps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--partitions", type=int, choices=(10_000, 100_000), default=100_000)
    ap.add_argument("--samples", type=int, default=30)
    ap.add_argument("--codec", choices=("native", "python"), help="KPROXY_CODEC for kproxy (default: its own pick)")
    ap.add_argument("--tls", action="store_true", help="TLS from the clients to kproxy and from kproxy to the broker")
    args = ap.parse_args()
    topics = args.partitions // 20
    body, _ = metadata_body(topics, 20, SCALE_BROKERS, seed=13)
    workdir = Path(tempfile.mkdtemp(prefix="kproxy-big-metadata-"))
    ca_file: str | None = None
    broker_tls: ssl.SSLContext | None = None
    if args.tls:
        import trustme

        ca = trustme.CA()
        cert = ca.issue_cert(HOST, "localhost")
        ca_file, cert_file, key_file = str(workdir / "ca.pem"), str(workdir / "cert.pem"), str(workdir / "key.pem")
        ca.cert_pem.write_to_path(ca_file)
        cert.cert_chain_pems[0].write_to_path(cert_file)
        cert.private_key_pem.write_to_path(key_file)
        broker_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        cert.configure_cert(broker_tls)
    fake = FakeCluster(body, broker_tls)
    kp = free_port_block(64)      # the bootstrap port and one per broker after it
    log_path = Path(tempfile.gettempdir()) / f"kproxy-big-metadata-{os.getpid()}.log"
    log = open(log_path, "wb")  # noqa: SIM115 (closed in the finally below)
    env = dict(os.environ)
    if args.codec:
        env["KPROXY_CODEC"] = args.codec
    admin = free_port_block(1)
    # The fake broker and the clients run niced, so on a small machine the scheduler gives kproxy the
    # CPU when it has work: the lags measured are then kproxy's, not time it spent preempted.
    nice = os.nice(0)
    os.nice(10)
    if args.tls:
        config = workdir / "kproxy.yaml"
        config.write_text(f"""\
listen: "{HOST}:{kp}"
upstream:
  bootstrap_servers: ["{HOST}:{fake.port}"]
  tls: {{enabled: true, ca_file: "{ca_file}"}}
tls: {{enabled: true, cert_file: "{cert_file}", key_file: "{key_file}"}}
admin: {{listen: "{HOST}:{admin}"}}
log_level: WARNING
""")
        command = ["--config", str(config)]
    else:
        command = ["--upstream", f"{HOST}:{fake.port}", "--listen", f"{HOST}:{kp}", "--log-level", "WARNING",
                   "--admin", f"{HOST}:{admin}"]
    proc = subprocess.Popen([sys.executable, "-m", "kproxy", "run", *command], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=log, preexec_fn=lambda: os.nice(nice - os.nice(0)))
    try:
        deadline = time.monotonic() + 20
        while not ready(admin):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"kproxy did not start (its log: {log_path})")
            time.sleep(0.1)
        direct = connect(fake.port, ca_file)
        through = connect(kp, ca_file)
        for s in (direct, through):
            for i in range(3):
                round_trip(s, 1000 + i, all_topics=True)     # warm-up
        ctx = multiprocessing.get_context("fork")
        stop = ctx.Event()
        receive, send = ctx.Pipe(duplex=False)
        loop = ctx.Process(target=small_loop, args=(kp, stop, send, ca_file))
        loop.start()
        # The same client with no big answer in flight: how long gaps are on this machine anyway.
        time.sleep(3.0)
        stop.set()
        baseline = receive.recv()
        loop.join(5)
        stop = ctx.Event()
        loop = ctx.Process(target=small_loop, args=(kp, stop, send, ca_file))
        loop.start()
        time.sleep(0.5)
        lag_before = loop_lag(admin)
        times: dict[str, list[float]] = {"direct": [], "kproxy": []}
        for i in range(args.samples):
            for name, s in (("direct", direct), ("kproxy", through)) if i % 2 else (("kproxy", through), ("direct", direct)):
                times[name].append(round_trip(s, i + 1, all_topics=True))
        stop.set()
        gaps = receive.recv()
        loop.join(5)
        lag_after = loop_lag(admin)
        rss, peak_rss = memory_of(proc.pid)
    finally:
        proc.terminate()
        proc.wait(15)
        fake.close()
        log.close()
    d50, k50 = statistics.median(times["direct"]) * 1000, statistics.median(times["kproxy"]) * 1000
    print(f"Metadata v12, {args.partitions:,} partitions ({topics:,} topics x 20, 3 replicas, 50 brokers), "
          f"{len(body) / 1e6:.1f} MB, {args.samples} samples each, kproxy codec: {args.codec or 'default'}, "
          f"{'TLS on both sides' if args.tls else 'plaintext'}")
    print(f"  direct p50 {d50:.1f} ms; through kproxy p50 {k50:.1f} ms; added {k50 - d50:+.1f} ms (goal <= 10 ms)")
    print(f"  a concurrent client's small requests through kproxy: p50 {statistics.median(gaps) * 1000:.2f} ms, "
          f"longest {max(gaps) * 1000:.1f} ms (goal: the event loop never held > 10 ms); with no big "
          f"answer in flight: p50 {statistics.median(baseline) * 1000:.2f} ms, longest {max(baseline) * 1000:.1f} ms")
    held = {bound: lag_after[bound] - lag_before.get(bound, 0) for bound in lag_after}
    total = held.get("+Inf", 0)
    over = {b: total - n for b, n in held.items() if b != "+Inf"}
    worst = max((float(b) for b, n in over.items() if n > 0), default=0.0)
    print(f"  kproxy's own event-loop lag while it ran (a timer, every 5 ms while held, {total:,} samples): "
          f"{over.get('0.01', 0)} over 10 ms, {over.get('0.005', 0)} over 5 ms; the worst was over "
          f"{worst * 1000:g} ms")
    print(f"  kproxy's memory: resident {rss / 1e6:.0f} MB at the end, peak {peak_rss / 1e6:.0f} MB")
    return 0


def ready(admin: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{admin}/readyz", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def memory_of(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process, in bytes."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) * 1024
    return values["VmRSS"], values["VmHWM"]


def loop_lag(admin: int) -> dict[str, int]:
    """kproxy_event_loop_lag_seconds, bucket bound -> cumulative count, from its /metrics."""
    with urllib.request.urlopen(f"http://{HOST}:{admin}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("kproxy_event_loop_lag_seconds_bucket"):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            out[bound] = int(float(line.rsplit(" ", 1)[1]))
    return out


if __name__ == "__main__":
    sys.exit(main())

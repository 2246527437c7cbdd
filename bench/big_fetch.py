"""What one huge Fetch answer costs kproxy in memory: the RSS it adds while passing a 64 MiB answer.

Run from the repository root:  ``.venv/bin/python bench/big_fetch.py [--mib 64] [--answers 3]``

The fake page-cache broker (bench/fake_broker.py, its own process) holds a partition of 1 KiB
records; kproxy (its own process, defaults) sits in front of it. One raw client connection asks
through kproxy for a small answer first (so codecs, buffers and the broker connection exist), reads
kproxy's resident set size, then asks ``--answers`` times for ``--mib`` MiB (``max_bytes`` and
``partition_max_bytes`` both that size) and reads each answer whole but in 1 MiB pieces, so the
client's own buffers do not count. Added RSS is kproxy's peak resident size (VmHWM) minus its size
before the first large answer. With ``--slow-client`` the client pauses 1 ms per MiB read.

``--tls`` puts TLS between the client and kproxy (certificates from trustme; the fake broker speaks
plain TCP). ``--rules`` gives kproxy a rules file with a topic rule and a quota that applies to every
Fetch without throttling: the configuration of a real deployment, in which the policy and the quota
must consent for an answer to stream.
"""

from __future__ import annotations

import argparse
import signal
import socket
import ssl
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from proxy import HOST, Child, free_port, free_port_pair

from kproxy.protocol.messages import Request, body_class, decode_response, encode_request_frame

FETCH, METADATA = 1, 3
_I32 = struct.Struct(">i")


def proc_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def fetch_frame(correlation_id: int, topic_id: Any, size: int) -> bytes:
    rq: Any = body_class(FETCH, "request")
    body = rq(max_wait_ms=500, min_bytes=1, max_bytes=size, topics=[rq.FetchTopic(
        topic_id=topic_id, partitions=[rq.FetchPartition(partition=0, fetch_offset=0, partition_max_bytes=size)])])
    return b"".join(bytes(b) for b in encode_request_frame(Request.build(FETCH, 16, correlation_id, "big-fetch", body)))


def topic_id_of(sock: socket.socket, name: str) -> Any:
    rq: Any = body_class(METADATA, "request")
    frame = encode_request_frame(Request.build(METADATA, 12, 1, "big-fetch", rq(topics=[rq.MetadataRequestTopic(name=name)])))
    sock.sendall(b"".join(bytes(b) for b in frame))
    read_answer(sock, keep=True)
    topic = decode_response(memoryview(kept), METADATA, 12).body.topics[0]
    if topic.error_code:
        raise RuntimeError(f"Metadata for {name}: error {topic.error_code}")
    return topic.topic_id


def read_answer(sock: socket.socket, keep: bool = False, pause_per_mib: float = 0.0) -> int:
    """Read one answer; its size (``keep``: the answer itself is in ``kept``)."""
    head = bytearray(4)
    got = 0
    while got < 4:
        n = sock.recv_into(memoryview(head)[got:])
        if n == 0:
            raise ConnectionError("kproxy closed the connection")
        got += n
    (size,) = _I32.unpack(head)
    piece = bytearray(1 << 20)
    kept.clear()
    left = size
    while left:
        n = sock.recv_into(piece, min(left, len(piece)))
        if n == 0:
            raise ConnectionError("kproxy closed the connection mid-answer")
        if keep:
            kept.extend(piece[:n])
        left -= n
        if pause_per_mib:
            time.sleep(pause_per_mib * n / (1 << 20))
    return size


kept = bytearray()

RULES = """\
rules:
  - name: no-secrets
    match: {topic: "secret-*"}
    action: deny
quotas:
  - name: readers
    fetch_bytes_per_s: 1.0e12
"""


def connect(port: int, tls: ssl.SSLContext | None, timeout: float = 20.0) -> socket.socket:
    """A client connection to kproxy (over TLS with ``tls``), retried until kproxy listens."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((HOST, port))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return tls.wrap_socket(sock, server_hostname=HOST) if tls is not None else sock
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="answer size in MiB (default 64)")
    ap.add_argument("--answers", type=int, default=3, help="large answers to pass (default 3)")
    ap.add_argument("--slow-client", action="store_true", help="the client pauses 1 ms per MiB it reads")
    ap.add_argument("--profile-kproxy", metavar="FILE.prof", help="run kproxy under cProfile, write its profile here")
    ap.add_argument("--no-cut-through", action="store_true", help="kproxy stores every answer whole (as before)")
    ap.add_argument("--tls", action="store_true", help="TLS between the client and kproxy")
    ap.add_argument("--rules", action="store_true", help="a topic rule and a (non-throttling) fetch quota in force")
    args = ap.parse_args(argv)
    # The frame must stay under kproxy's default limits.max_buffered_bytes (64 MiB, the frame cap):
    # the records take the size asked for less 1 KiB for the frame's head.
    size = (args.mib << 20) - 1024
    records = size // 1024 + 1024
    with tempfile.TemporaryDirectory(prefix="kproxy-big-fetch-") as tmp:
        bp = free_port()
        broker = Child("fake broker", [sys.executable, "bench/fake_broker.py", "--listen", f"{HOST}:{bp}",
                                       "--preload", f"big:1:{records}:1024"], Path(tmp) / "broker.log")
        kp = free_port_pair()
        argv = [sys.executable]
        if args.profile_kproxy:
            argv += ["-m", "cProfile", "-o", str(Path(args.profile_kproxy).resolve())]
        argv += ["-m", "kproxy", "run", "--log-level", "WARNING"]
        client_tls = None
        if args.no_cut_through or args.tls or args.rules:
            config = Path(tmp) / "kproxy.yaml"
            text = f'listen: "{HOST}:{kp}"\nupstream: {{bootstrap_servers: "{HOST}:{bp}"}}\n'
            if args.no_cut_through:
                text += "cut_through_min_bytes: null\n"
            if args.tls:
                import trustme

                ca = trustme.CA()
                cert = ca.issue_cert(HOST, "localhost")
                cert.cert_chain_pems[0].write_to_path(str(Path(tmp) / "cert.pem"))
                cert.private_key_pem.write_to_path(str(Path(tmp) / "key.pem"))
                client_tls = ssl.create_default_context()
                ca.configure_trust(client_tls)
                text += f'tls: {{enabled: true, cert_file: "{tmp}/cert.pem", key_file: "{tmp}/key.pem"}}\n'
            if args.rules:
                (Path(tmp) / "rules.yaml").write_text(RULES)
                text += f'rules: ["{tmp}/rules.yaml"]\n'
            config.write_text(text)
            argv += ["--config", str(config)]
        else:
            argv += ["--upstream", f"{HOST}:{bp}", "--listen", f"{HOST}:{kp}"]
        kproxy = Child("kproxy", argv, Path(tmp) / "kproxy.log")
        try:
            broker.start([bp])
            # The readiness probe speaks plain Kafka: over TLS, wait for a handshake instead.
            kproxy.start([] if client_tls else [kp, kp + 1])
            assert kproxy.proc is not None
            pid = kproxy.proc.pid
            # kp + 1 is the port kproxy exposes for node 0, the partition's leader (on the bootstrap
            # port kproxy answers a Fetch with NOT_LEADER_OR_FOLLOWER, as a client must go to the leader).
            sock = connect(kp + 1, client_tls)
            topic_id = topic_id_of(sock, "big")
            sock.sendall(fetch_frame(2, topic_id, 1 << 20))
            read_answer(sock)
            before = proc_kib(pid, "VmRSS")
            t0 = time.perf_counter()
            for i in range(args.answers):
                sock.sendall(fetch_frame(3 + i, topic_id, size))
                got = read_answer(sock, keep=i == 0, pause_per_mib=0.001 if args.slow_client else 0.0)
                if got < size - 70 * 1024:   # whole batches of 64 records, the last one cut
                    raise RuntimeError(f"a Fetch answer of {got} bytes, expected at least {size}: "
                                       f"{decode_response(memoryview(kept), FETCH, 16)}")
            dt = time.perf_counter() - t0
            peak = proc_kib(pid, "VmHWM")
            after = proc_kib(pid, "VmRSS")
            sock.close()
        except Exception:
            print(f"broker log:\n{broker.log_tail()}\nkproxy log:\n{kproxy.log_tail()}", file=sys.stderr)
            raise
        finally:
            kproxy.stop(signal.SIGINT)   # a cProfile'd kproxy writes its profile on the way out
            broker.stop()
    print(f"{args.answers} Fetch answers of {args.mib} MiB through kproxy in {dt:.2f}s "
          f"({args.answers * (args.mib << 20) / dt / 1e9:.2f} GB/s){' to a slow client' if args.slow_client else ''}"
          f"{' over TLS' if args.tls else ''}{' with rules and a quota' if args.rules else ''}")
    print(f"kproxy RSS before {before / 1024:.1f} MiB, peak {peak / 1024:.1f} MiB, after {after / 1024:.1f} MiB: "
          f"added at peak {(peak - before) / 1024:.1f} MiB (goal <= 8 MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

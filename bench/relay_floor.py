"""The floor under a lone heartbeat: what two byte relays that decode nothing cost per Heartbeat, at a
low rate and back to back, beside kproxy. One relay is a bare ``selectors`` loop (the least a Python
process can do per wake-up: one ``epoll_wait``, one receive, one send), the other a plain trio relay
(``SocketStream`` pumps, as a trio-based proxy would write one). Both run as their own processes.
A third, ``lane``, is kproxy's lane alone (``kproxy/server/lane.py``): a ``selectors`` loop reads each
connection's first request (to learn its client id, as the session does), connects to the broker and
hands both sockets to the lane, which relays ApiVersions and Heartbeat from then on in its C thread.

For each target: kproxy's (or the relay's) CPU per heartbeat, timed from /proc (every thread of the
process), for one connection back to back, 100 connections back to back, one connection at 333 a
second and 1,000 connections every 3 s (333 a second, each arriving alone); and, with ``--instructions``, its instructions per heartbeat back to back under
callgrind (2,000 on one connection, the ``bench/per_request.py`` method). The timings move with the
machine's load (it is printed); the instructions do not.

Run from the repository root:  ``.venv/bin/python bench/relay_floor.py [--seconds 10] [--instructions]
[--targets selectors,trio,lane,kproxy]``
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from heartbeats import Group, cpu_seconds  # noqa: E402
from per_request import HOST, sequential, start_kproxy, stop  # noqa: E402
from small_requests import heartbeat_v4_request  # noqa: E402

from kproxy.tansu import Tansu, broker_answers, free_port  # noqa: E402

# The relays' programs, run with ``python -c PROGRAM LISTEN_PORT BROKER_PORT``.
LISTEN = """
sel = selectors.EpollSelector()
ls = socket.socket()
ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind(("127.0.0.1", port))
ls.listen(1024)
ls.setblocking(False)
sel.register(ls, selectors.EVENT_READ, None)
"""

SELECTORS_RELAY = """
import selectors, socket, sys
port, broker = int(sys.argv[1]), int(sys.argv[2])
""" + LISTEN + """while True:
    for key, _ in sel.select():
        if key.data is None:
            client, _ = ls.accept()
            up = socket.create_connection(("127.0.0.1", broker))
            for s in (client, up):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.setblocking(False)
            sel.register(client, selectors.EVENT_READ, up)
            sel.register(up, selectors.EVENT_READ, client)
            continue
        try:
            data = key.fileobj.recv(65536)
            if data:
                key.data.sendall(data)
                continue
        except OSError:
            pass
        for s in (key.fileobj, key.data):      # one side ended: both go
            sel.unregister(s)
            s.close()
"""

TRIO_RELAY = """
import functools, sys, trio
port, broker = int(sys.argv[1]), int(sys.argv[2])
async def pump(src, dst):
    while True:
        data = await src.receive_some(65536)
        if not data:
            return
        await dst.send_all(data)
async def handle(client):
    up = await trio.open_tcp_stream("127.0.0.1", broker)
    try:
        async with up, client:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pump, client, up)
                await pump(up, client)
                nursery.cancel_scope.cancel()
    except* (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass        # a client that closed with answers unread (RST): only its connection ends
trio.run(functools.partial(trio.serve_tcp, handle, port, host="127.0.0.1"))
"""

LANE_RELAY = """
import selectors, socket, struct, sys
from kproxy.protocol.compiler import whole_skip
from kproxy.protocol.messages import request_codecs
from kproxy.server.lane import Lane, LaneApi
port, broker = int(sys.argv[1]), int(sys.argv[2])
table = {}
for api_key, versions in ((18, range(0, 4)), (12, range(0, 5))):
    for v in versions:
        table[(api_key, v)] = LaneApi(*(whole_skip(c) for c in request_codecs(api_key, v)))
lane = Lane()
""" + LISTEN + """while True:
    for key, _ in sel.select():
        if key.data is None:
            client, _ = ls.accept()
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client.setblocking(False)
            sel.register(client, selectors.EVENT_READ, [b""])
        elif isinstance(key.data, list):      # the first request: its client id
            client, buf = key.fileobj, key.data
            try:
                data = client.recv(65536)
            except OSError:         # reset before its first request
                data = b""
            buf[0] += data
            if data and (len(buf[0]) < 4 or len(buf[0]) < 4 + struct.unpack_from(">i", buf[0])[0]):
                continue
            sel.unregister(client)
            if not data:
                client.close()
                continue
            (n,) = struct.unpack_from(">h", buf[0], 12)
            up = socket.create_connection(("127.0.0.1", broker))
            up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            up.setblocking(False)
            handle = lane.adopt(client.fileno(), up.fileno(), table=table, next_correlation_id=0,
                                client_bytes=buf[0], client_id=buf[0][14:14 + n] if n >= 0 else None,
                                max_in_flight=100, request_timeout_s=30, idle_timeout_s=600, frame_timeout_s=30)
            sel.register(handle.fd, selectors.EVENT_READ, (handle, client, up))
        else:                               # given back: this relay ends the connection
            handle, client, up = key.data
            sel.unregister(handle.fd)
            handle.take()
            client.close()
            up.close()
"""

RELAYS = {"selectors": SELECTORS_RELAY, "trio": TRIO_RELAY, "lane": LANE_RELAY}
# (connections, seconds between one connection's heartbeats, what it is)
CASES = ((1, 0.0, "1 connection, back to back"), (100, 0.0, "100 connections, back to back"),
         (1, 0.003, "1 connection, 333/s"),
         (1000, 3.0, "1,000 connections, each every 3 s"))


def start(target: str, broker: int, wrap: list[str], workdir: Path) -> tuple[subprocess.Popen[bytes], int]:
    if target == "kproxy":
        return start_kproxy(broker, None, wrap, workdir, f"floor-{len(wrap)}", timeout=300)
    port = free_port()
    proc = subprocess.Popen([*wrap, sys.executable, "-c", RELAYS[target], str(port), str(broker)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not broker_answers(HOST, port, timeout=5.0):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the {target} relay did not start")
        time.sleep(0.2)
    return proc, port


def timed(target: str, broker: int, seconds: float, workdir: Path) -> dict[str, float]:
    """CPU seconds per heartbeat in each of CASES."""
    proc, port = start(target, broker, [], workdir)
    got = {}
    try:
        for connections, period, what in CASES:
            group = Group(port, connections, max(period, 1e-6))
            try:
                group.run(max(period, 0.5) * 1.2, send=True)      # warm-up: every connection once
                c0, t0 = cpu_seconds(proc.pid), time.monotonic()
                answered = group.run(seconds, send=True)
                elapsed = time.monotonic() - t0
                got[what] = (cpu_seconds(proc.pid) - c0) / answered
                got[what + " rate"] = answered / elapsed
            finally:
                group.close()
    finally:
        stop(proc)
    return got


def instructions(target: str, broker: int, n: int, workdir: Path) -> float:
    """Instructions per heartbeat, ``n`` back to back on one connection (callgrind, user space)."""
    out = workdir / f"callgrind.{target}.out"
    wrap = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]
    proc, port = start(target, broker, wrap, workdir)
    try:
        request = heartbeat_v4_request(1, "relay-floor")
        sequential(port, request, 200)
        subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], check=True, capture_output=True)
        sequential(port, request, n)
        subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True)
    finally:
        stop(proc)
    return sum(int(line.split()[1]) for line in Path(f"{out}.1").read_text(errors="replace").splitlines()
               if line.startswith("summary:")) / n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", default="selectors,trio,lane,kproxy")
    ap.add_argument("--seconds", type=float, default=10.0, help="seconds timed per case (default 10)")
    ap.add_argument("--instructions", action="store_true", help="also count instructions per heartbeat (callgrind)")
    ap.add_argument("--n", type=int, default=2000, help="heartbeats counted under callgrind (default 2000)")
    args = ap.parse_args(argv)
    targets = args.targets.split(",")
    if set(targets) - {*RELAYS, "kproxy"}:
        ap.error("--targets: any of selectors, trio, lane, kproxy")
    load_before = "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    got: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="kproxy-relay-floor-") as tmp, Tansu(port=free_port()) as broker:
        for target in targets:
            got[target] = timed(target, broker.port, args.seconds, Path(tmp))
            if args.instructions:
                got[target]["instructions"] = instructions(target, broker.port, args.n, Path(tmp))
            print(f"  {target}: {got[target]}", file=sys.stderr, flush=True)
    print(f"{os.cpu_count()} CPUs; {load_before} before, load average "
          "{:.2f} {:.2f} {:.2f} after".format(*os.getloadavg()))
    print("CPU per Heartbeat v4 round trip (user + system, from /proc)"
          + (" and instructions per heartbeat back to back (callgrind)" if args.instructions else ""))
    hdr = f"{'target':<11}" + "".join(f"{what:>38}" for _, _, what in CASES) + (f"{'instructions':>14}" if args.instructions else "")
    print(hdr)
    print("-" * len(hdr))
    for target, g in got.items():
        print(f"{target:<11}" + "".join(f"{g[what] * 1e6:>20.0f} us at {g[what + ' rate']:>7,.0f}/s" for _, _, what in CASES)
              + (f"{g['instructions']:>14,.0f}" if args.instructions else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

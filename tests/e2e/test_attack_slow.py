"""The big attack runs (bench/attack.py at its defaults): 1,000 idle connections, 5,000 connections at
once, a million mutated frames. Marked slow: `make test-slow` runs it, the default run does not."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def test_a_million_mutated_frames_and_thousands_of_connections() -> None:
    out = subprocess.run([sys.executable, "bench/attack.py"], cwd=REPO, capture_output=True, text=True,
                         timeout=3600).stdout
    assert "goal for 1,000: <= 100 MB -> met" in out, out
    assert "kproxy still answers: True" in out, out
    frames = re.search(r"frames: (\d+) mutated frames", out)
    assert frames is not None and int(frames.group(1)) >= 1_000_000, out
    assert "still answers: True" in out.split("frames:")[1], out
    assert "real client through kproxy afterwards: ok" in out, out
    assert "internal errors in kproxy's log: 0" in out, out

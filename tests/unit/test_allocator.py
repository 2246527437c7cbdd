"""``kproxy run``'s allocator settings (``kproxy.server.main.keep_freed_memory``): memory freed after
an answer of a few MB serves the next one without fresh pages, and an operator's own glibc
settings win. Measured in a child process, whose allocator the test may change."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Three 6 MiB buffers at once, freed, twenty times: with glibc's adaptive defaults the freed heap top
# (18 MiB) is over the trim threshold those sizes set, so every round gets fresh pages.
CHILD = """
import resource, sys
from kproxy.server.main import keep_freed_memory
print(keep_freed_memory(), file=sys.stderr)
def answer():
    held = [bytearray(6 << 20) for _ in range(3)]
    del held
for _ in range(3):
    answer()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    answer()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def page_faults(env: dict[str, str], call: bool = True) -> tuple[int, str]:
    code = CHILD if call else CHILD.replace("print(keep_freed_memory(), file=sys.stderr)", "")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in {**os.environ, **env}.items() if v})
    assert done.returncode == 0, done.stderr
    return int(done.stdout), done.stderr.strip()


pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="glibc's mallopt")


def test_freed_answers_are_reused_instead_of_faulted_in_again():
    unset = {"MALLOC_MMAP_THRESHOLD_": "", "MALLOC_TRIM_THRESHOLD_": ""}
    without, _ = page_faults(unset, call=False)
    with_settings, said = page_faults(unset)
    assert said == "True"
    assert without > 20 * 3 * 1000          # about 1,536 pages per buffer, every round
    assert with_settings < 100


def test_an_operators_own_glibc_settings_are_left_alone():
    _, said = page_faults({"MALLOC_TRIM_THRESHOLD_": str(1 << 20)})
    assert said == "False"

"""How many examples the heaviest property tests draw.

The codec fuzzers and cross-checks run once per message and version of the whole schema (over a
thousand parametrised tests), so their example counts decide much of ``make test``'s time. The
counts written in those tests are the default run's; ``KPROXY_EXAMPLES`` multiplies them for a
deeper run (``make test-deep`` uses 3, the counts of before 2026-11), or shrinks them for a quick
look. Hypothesis draws new cases every run, so successive default runs keep exploring; a failure it
finds is kept in the local example database and tried first next time."""

from __future__ import annotations

import math
import os


def _scale() -> float:
    text = os.environ.get("KPROXY_EXAMPLES", "1")
    try:
        scale = float(text)
    except ValueError:
        raise ValueError(f"KPROXY_EXAMPLES={text!r}: expected a number, e.g. 4 for four times the examples") from None
    if not scale > 0:
        raise ValueError(f"KPROXY_EXAMPLES={text!r}: must be above 0")
    return scale


SCALE = _scale()


def examples(default_run: int) -> int:
    """``default_run`` examples, times ``KPROXY_EXAMPLES``; never fewer than one."""
    return max(1, math.ceil(default_run * SCALE))

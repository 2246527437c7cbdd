"""Waiting in tests for something that happens in another thread or process: one polling loop."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path


def wait_until(check: Callable[[], object], what: str | Callable[[], str] | Path = "",
               timeout: float = 60.0, every: float = 0.05) -> None:
    """Poll ``check`` every ``every`` seconds until it holds. Past ``timeout`` seconds, fail saying
    ``what``: a message, a function that tells how things stand then, or a log file as it reads then."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() >= deadline:
            said = what.read_text() if isinstance(what, Path) else what() if callable(what) else what
            raise AssertionError(f"not within {timeout:g} s: {said}")
        time.sleep(every)

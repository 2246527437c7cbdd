"""Where each socket of the test process was made, so that an unclosed one names its maker.

An unclosed socket in a reference cycle is found by the garbage collector, and its ResourceWarning
is raised in whatever code runs then: with warnings as errors, in a later, unrelated test. pytest
can say where such an object was allocated only with tracemalloc on, which slows the whole run.
``track`` instead notes, for each ``socket.socket`` made in this process (trio's, asyncio's,
kafka-python's and kproxy's sockets are all of them), the test that was running, the thread, and
the innermost frames of the stack; a socket forgets its note when it is closed. ``origin`` gives
the note of a socket, and the unraisable hook pytest reports with is wrapped so that an unclosed
socket's report carries it. The sockets and their behaviour are not touched otherwise.
"""

from __future__ import annotations

import functools
import os
import socket
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

FRAMES = 10            # innermost frames noted per socket

_origins: dict[int, str] = {}


def _note(frame: FrameType | None) -> str:
    where: list[str] = []
    while frame is not None and len(where) < FRAMES:
        code = frame.f_code
        if not code.co_filename.endswith(("/socket.py", "/ssl.py")):
            where.append(f"{code.co_filename.rsplit('/site-packages/', 1)[-1]}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    test = os.environ.get("PYTEST_CURRENT_TEST", "no test running")
    return f"made during {test}, thread {threading.current_thread().name}, at " + " < ".join(where)


def origin(sock: object) -> str | None:
    """Where the open socket ``sock`` was made; None for a socket closed, or made before ``track``."""
    return _origins.get(id(sock)) if isinstance(sock, socket.socket) else None


def track() -> None:
    """Note the origin of every socket made from now on (once per process)."""
    cls = socket.socket
    if getattr(cls.__init__, "notes_origin", False):
        return
    init, real_close, detach = cls.__init__, cls._real_close, cls.detach   # type: ignore[attr-defined]

    @functools.wraps(init)
    def __init__(self: socket.socket, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        _origins[id(self)] = _note(sys._getframe(1))

    @functools.wraps(real_close)
    def _real_close(self: socket.socket, *args: Any, **kwargs: Any) -> Any:
        _origins.pop(id(self), None)
        return real_close(self, *args, **kwargs)

    @functools.wraps(detach)
    def detach_(self: socket.socket) -> int:
        _origins.pop(id(self), None)
        return detach(self)

    __init__.notes_origin = True     # type: ignore[attr-defined]
    cls.__init__ = __init__          # type: ignore[method-assign]
    cls._real_close = _real_close    # type: ignore[attr-defined]
    cls.detach = detach_             # type: ignore[method-assign,assignment]


class _Unraisable:
    """An unraisable report with its message extended (``sys.UnraisableHookArgs`` cannot be made)."""

    def __init__(self, u: Any, err_msg: str) -> None:
        self.exc_type, self.exc_value, self.exc_traceback = u.exc_type, u.exc_value, u.exc_traceback
        self.object = u.object
        self.err_msg = err_msg


def name_unclosed_sockets_in_reports() -> None:
    """Wrap the current unraisable hook (pytest's, once it has set it) so an unclosed socket's
    report names where the socket was made."""
    previous: Callable[[Any], object] = sys.unraisablehook

    def hook(u: Any) -> None:
        made = origin(u.object)
        if made is not None:
            u = _Unraisable(u, f"{u.err_msg or 'Exception ignored in'} (a socket {made})")
        previous(u)

    sys.unraisablehook = hook

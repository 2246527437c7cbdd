"""Zero-copy relaying with Linux splice(2): bytes move from one socket to another through a pipe,
inside the kernel, never copied through kproxy's memory.

Cut-through uses it for the bodies of record batches in a streamed Fetch answer: the walker reads
each batch's header (telemetry counts records and offsets from it) and the rest of the batch goes
from the broker's socket to the client's without a copy. Linux and plain TCP only; elsewhere the
bytes pass through the receive buffer as before.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import sys

import trio

# What one pipe may hold: the kernel's default cap for an unprivileged process (pipe-max-size), 16
# times the default pipe; fewer system calls per batch. The kernel may grant less.
PIPE_BYTES = 1024 * 1024
# Bytes moved without waiting between two turns of the event loop (fairness, as a plain send's slice).
_YIELD_BYTES = 2 * 1024 * 1024
_MOVE = getattr(os, "SPLICE_F_MOVE", 1)
_NONBLOCK = getattr(os, "SPLICE_F_NONBLOCK", 2)
_MORE = getattr(os, "SPLICE_F_MORE", 4)


def available() -> bool:
    """Whether this platform can splice between sockets."""
    return sys.platform.startswith("linux") and hasattr(os, "splice") and hasattr(fcntl, "F_SETPIPE_SZ")


class SinkError(OSError):
    """Writing to the destination socket failed (the client went away); the source is not at fault."""


class Pipe:
    """One non-blocking pipe between two sockets, emptied at the end of every ``relay``, so it never
    holds bytes between relays. ``capacity`` is what the kernel granted (counted in the buffer budget)."""

    __slots__ = ("_r", "_unfair", "_w", "capacity", "delivered")

    def __init__(self, size: int = PIPE_BYTES) -> None:
        self._r, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            self.capacity = fcntl.fcntl(self._w, fcntl.F_SETPIPE_SZ, size)
        except OSError:
            # Over the system's cap (or pipe-user-pages-soft reached): the default pipe still works.
            self.capacity = fcntl.fcntl(self._w, fcntl.F_GETPIPE_SZ)
        self.delivered = 0     # bytes of the current (or last) relay that reached the destination
        self._unfair = 0       # bytes moved since the last turn of the event loop

    async def relay(self, src: socket.socket, dst: socket.socket, n: int, *, more: bool = False) -> int:
        """Move exactly ``n`` bytes from ``src`` to ``dst``; returns ``n``. ``delivered`` says how many
        reached ``dst`` when it raises: ConnectionError when ``src`` ends first, OSError when ``src``
        fails, SinkError when ``dst`` does. ``more``: more bytes follow soon (the kernel may hold a
        partial segment back). A ``dst`` that does not take bytes stops the reading from ``src``: the
        pipe holds at most ``capacity``, and nothing more is read until it drains."""
        self.delivered = 0
        left = n               # still to take from src
        held = 0               # in the pipe
        src_fd, dst_fd = src.fileno(), dst.fileno()
        while left or held:
            progress = False
            if left:
                try:
                    k = os.splice(src_fd, self._w, left, flags=_MOVE | _NONBLOCK)
                except (BlockingIOError, InterruptedError):
                    k = -1     # nothing waiting on src, or the pipe is full
                if k == 0:
                    raise ConnectionError("broker closed the connection")
                if k > 0:
                    left -= k
                    held += k
                    progress = True
            if held:
                try:
                    k = os.splice(self._r, dst_fd, held, flags=_MOVE | _NONBLOCK | (_MORE if left or more else 0))
                except (BlockingIOError, InterruptedError):
                    k = 0
                except OSError as e:
                    raise SinkError(e.errno, f"client connection error: {e.strerror}") from e
                if k > 0:
                    held -= k
                    self.delivered += k
                    self._unfair += k
                    progress = True
            if progress:
                if self._unfair >= _YIELD_BYTES:
                    self._unfair = 0
                    await trio.lowlevel.checkpoint()
                continue
            self._unfair = 0
            if held:
                # The client is not taking bytes: wait for it, reading nothing more from the broker.
                try:
                    await trio.lowlevel.wait_writable(dst)
                except (trio.ClosedResourceError, trio.BrokenResourceError) as e:
                    raise SinkError("client connection closed") from e
            else:
                await trio.lowlevel.wait_readable(src)
        return n

    def close(self) -> None:
        for fd in (self._r, self._w):
            with contextlib.suppress(OSError):
                os.close(fd)

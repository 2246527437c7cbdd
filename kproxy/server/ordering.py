"""The two orders a client connection keeps, whichever of its tasks acts (client pump, upstream pump,
watchdog): answers reach the client in the order the session made them (``ClientWriter``), and
writes to the broker happen one at a time, in the order they were asked for (``FifoLock``). Also the
exceptions that end a connection on purpose. No protocol logic: bytes and tasks only.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import trio

from kproxy.proxy.inflight import InFlight
from kproxy.server.splice import Pipe, SinkError
from kproxy.server.transport import PlainTransport, Transport


def run_clock() -> Callable[[], float]:
    """``trio.current_time`` without its two layers of indirection (the run's own clock, the same
    readings): a small request reads the time several times."""
    try:
        return trio.lowlevel.current_clock().current_time
    except RuntimeError:        # outside a run (a connection built by a test before trio.run)
        return trio.current_time


class ConnectionClosed(Exception):
    """Ends a connection on purpose; the reason is logged once."""


class ClientGone(ConnectionClosed):
    """The client's socket failed or closed while kproxy wrote to it."""


class ClientWriter:
    """Answers for one client socket, written in the order they were queued, whichever task queued
    them: the first task that flushes writes everything queued (several answers in one vectored
    send) while the others wait until what they queued is out. Queuing never waits, so the order is
    the session's; ``complete`` is called for each answer's entries once its bytes are written."""

    __slots__ = ("_failed", "_idle", "_now", "_queue", "_queued", "_waiting", "_written", "complete", "pending",
                 "transport", "writing")

    def __init__(self, transport: Transport, complete: Callable[[tuple[InFlight, ...], float], None]) -> None:
        self.transport = transport
        self.complete = complete
        self._queue: list[tuple[list, tuple[InFlight, ...]]] = []
        self._queued = 0          # answers ever queued
        self._written = 0         # answers ever written
        self.pending = 0          # answers queued and not yet written (read after every answer)
        self.writing = False
        self._idle = trio.Event()
        self._waiting = 0         # tasks waiting for another's write to finish
        self._now = run_clock()
        self._failed: BaseException | None = None

    def put(self, buffers: list, done: tuple[InFlight, ...]) -> None:
        self._queue.append((buffers, done))
        self._queued += 1
        self.pending += 1

    async def flush(self) -> None:
        """Return once everything queued so far is written; ClientGone if the client went away."""
        target = self._queued
        while self.writing and self._written < target:
            # Another task is writing: it writes what this one queued too.
            self._waiting += 1
            try:
                await self._idle.wait()
            finally:
                self._waiting -= 1
        if self._failed is not None:
            raise ClientGone("client closed the connection") from self._failed
        if self._written >= target:
            return
        self.writing = True
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                buffers = batch[0][0] if len(batch) == 1 else [b for bufs, _ in batch for b in bufs]
                try:
                    await self.transport.send(buffers)
                except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
                    self._failed = e
                    raise ClientGone(f"client connection error: {e!r}") from e
                self._written += len(batch)
                self.pending -= len(batch)
                now = self._now()
                for _, done in batch:
                    if done:
                        self.complete(done, now)
        finally:
            self.writing = False
            if self._waiting:
                idle, self._idle = self._idle, trio.Event()
                idle.set()

    async def splice(self, pipe: Pipe, src: Any, n: int) -> None:
        """Move ``n`` bytes from socket ``src`` to the client (``Pipe.relay``), after everything queued
        and with no other task writing meanwhile. ClientGone if the client went away; an error of
        ``src`` propagates as it is."""
        await self.flush()
        assert isinstance(self.transport, PlainTransport)
        self.writing = True
        try:
            await pipe.relay(src, self.transport.raw, n)
        except SinkError as e:
            self._failed = e
            raise ClientGone(str(e)) from e
        finally:
            self.writing = False
            if self._waiting:
                idle, self._idle = self._idle, trio.Event()
                idle.set()


class FifoLock:
    """Held by one task at a time, handed on in the order tasks asked. Taking it uncontended is a
    flag (trio's StrictFIFOLock also records its owner for the parking-lot breaker on every take,
    a measurable share of a small request); a waiter is woken owning it, so none can barge in."""

    __slots__ = ("_held", "_waiters")

    def __init__(self) -> None:
        self._held = False
        self._waiters: collections.deque[trio.Event] = collections.deque()

    def locked(self) -> bool:
        return self._held

    def take(self) -> bool:
        """Take it if it is free (True), without waiting; False when another task holds it."""
        if self._held:
            return False
        self._held = True
        return True

    def acquire_nowait(self) -> None:
        if self._held:
            raise trio.WouldBlock
        self._held = True

    async def acquire(self) -> None:
        await trio.lowlevel.checkpoint()     # a cancellation lands before anything is held
        if not self._held:
            self._held = True
            return
        handed = trio.Event()
        self._waiters.append(handed)
        try:
            await handed.wait()
        except BaseException:
            if handed.is_set():
                self.release()      # handed over as this task was cancelled: pass it on
            else:
                self._waiters.remove(handed)
            raise

    def release(self) -> None:
        if not self._held:
            raise RuntimeError("release of a FifoLock that is not held")
        if self._waiters:
            self._waiters.popleft().set()     # still held: now by the first waiter
        else:
            self._held = False

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self.release()

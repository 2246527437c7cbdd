"""The process-wide budget of buffered bytes: all connections, both directions, together.

Frame readers allocate as bytes arrive; each connection reports what its readers hold. When the
total passes the budget, client pumps stop reading (backpressure) until buffers are released, as a
Kafka broker stops reading requests at ``queued.max.request.bytes``. Broker pumps never wait: the
answers they read are what frees the memory.
"""

from __future__ import annotations

import logging

import trio

log = logging.getLogger("kproxy.server")


class BufferBudget:
    """Counts held bytes against ``limit`` (None: unlimited) and wakes waiting readers."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.used = 0
        # used >= limit: client pumps read nothing new (an attribute, not a property: each receive reads it)
        self.exhausted = False
        self.peak = 0
        self.pauses = 0                  # times a reader had to wait
        self._room = trio.Event()
        self._room.set()
        self._warned = False

    def adjust(self, delta: int) -> None:
        self.used += delta
        if self.used > self.peak:
            self.peak = self.used
        if self.limit is None:
            return
        self.exhausted = self.used >= self.limit
        if self.exhausted:
            if self._room.is_set():
                self._room = trio.Event()
                if not self._warned:
                    self._warned = True
                    log.warning("buffered bytes reached the budget of %d bytes "
                                "(limits.max_buffered_bytes_total): pausing reads from clients until "
                                "buffers drain", self.limit)
        elif not self._room.is_set():
            self._room.set()
            if self._warned:
                self._warned = False
                log.warning("buffered bytes back under the budget (%d of %d bytes): reading clients again",
                            self.used, self.limit)

    def release(self, n: int) -> None:
        if n:
            self.adjust(-n)

    async def wait_for_room(self) -> None:
        self.pauses += 1
        while self.exhausted:
            await self._room.wait()

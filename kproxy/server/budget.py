"""The process-wide budget of buffered bytes: all connections, both directions, together.

Frame readers allocate as bytes arrive; each connection reports what its readers hold. When the
total passes the budget, client pumps stop reading (backpressure) until buffers are released, as a
Kafka broker stops reading requests at ``queued.max.request.bytes``. Broker pumps never wait: the
answers they read are what frees the memory. The lanes (``kproxy.server.lane``) count in it too and
stop reading clients at the same total (``attach_lane``).
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from kproxy.server.lane import held_bytes

log = logging.getLogger("kproxy.server")


# A lane frees bytes without telling the event loop: a client pump waiting for room looks again this often.
LANE_POLL_S = 0.01


class BufferBudget:
    """Counts held bytes against ``limit`` (None: unlimited) and wakes waiting readers. ``used`` is what
    the Python path holds; with lanes attached, what they hold (``lane_held``, as of the last look)
    counts against the same limit."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.used = 0
        # used >= limit: client pumps read nothing new (an attribute, not a property: each receive reads it)
        self.exhausted = False
        self.peak = 0
        self.pauses = 0                  # times a reader had to wait
        self.lane_held = 0               # what every lane of the process held at the last adjust
        self._lanes: list[Any] = []
        self._room = trio.Event()
        self._room.set()
        self._warned = False

    def attach_lane(self, lane: Any) -> None:
        """Count what ``lane`` holds in this budget, and tell it, at each change of what the Python path
        holds, the limit and that: it reads no client while the two together reach the limit."""
        self._lanes.append(lane)
        self.adjust(0)

    def detach_lane(self, lane: Any) -> None:
        self._lanes.remove(lane)
        lane.budget(None, 0)
        self.adjust(0)

    def total(self) -> int:
        """Every byte held now: the Python path's and the lanes' (what the gauge reports)."""
        return self.used + (held_bytes() if self._lanes else 0)

    def adjust(self, delta: int) -> None:
        self.used += delta
        total = self.used
        if self._lanes:
            # One C call a lane: the lane reads the Python path's bytes from here, and this reads its.
            for lane in self._lanes:
                self.lane_held = lane.budget(self.limit, self.used)
            total += self.lane_held
        if total > self.peak:
            self.peak = total
        if self.limit is None:
            return
        self.exhausted = total >= self.limit
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
                            total, self.limit)

    def release(self, n: int) -> None:
        if n:
            self.adjust(-n)

    async def wait_for_room(self) -> None:
        self.pauses += 1
        while self.exhausted:
            if self._lanes:
                # The lanes' bytes may be what fills it, and they go without an adjust here.
                with trio.move_on_after(LANE_POLL_S):
                    await self._room.wait()
                self.adjust(0)
            else:
                await self._room.wait()

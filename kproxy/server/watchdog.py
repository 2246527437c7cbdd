"""The connections' watchdog: one task per event loop and period looks at every connection's
timeouts in turn, instead of a sleeping task per connection. With thousands of mostly idle
connections (consumers between polls) a wake-up per connection and period was most of an idle
proxy's CPU (bench/heartbeats.py); one pass over them costs a call each.

A connection is watched while it runs (``watch`` returns the call that stops it). A check never
waits: what must wait (dropping a broker connection that stopped answering) the connection starts
in its own nursery.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import trio

log = logging.getLogger("kproxy.server")


class Watched(Protocol):
    def check(self, now: float) -> None:
        """Look at the connection's timeouts (never waits)."""

    def close_from_watchdog(self, reason: str) -> None:
        """End the connection (its check failed: a bug ends that connection only)."""


class _Sweep:
    """The connections watched every ``period`` seconds, and the task that looks at them."""

    __slots__ = ("members", "period")

    def __init__(self, period: float) -> None:
        self.period = period
        self.members: dict[Watched, None] = {}       # in the order they came

    async def run(self, sweeps: dict[float, _Sweep]) -> None:
        try:
            # Ends once a period passes with nobody left to watch; the next connection starts another.
            while self.members:
                await trio.sleep(self.period)
                now = trio.current_time()
                for m in list(self.members):
                    if m not in self.members:
                        continue        # ended by then
                    try:
                        m.check(now)
                    except Exception:
                        log.error("connection watchdog: internal error", exc_info=True)
                        m.close_from_watchdog("internal error in the connection watchdog")
        finally:
            if sweeps.get(self.period) is self:
                del sweeps[self.period]


_SWEEPS: trio.lowlevel.RunVar[dict[float, _Sweep]] = trio.lowlevel.RunVar("kproxy_watchdog_sweeps")


def watch(member: Watched, period: float) -> Callable[[], None]:
    """Have ``member.check(now)`` called every ``period`` seconds from now on; returns the call that
    stops it. Each event loop (a worker process, an embedded proxy's thread) has its own sweeps."""
    try:
        sweeps = _SWEEPS.get()
    except LookupError:
        sweeps = {}
        _SWEEPS.set(sweeps)
    sweep = sweeps.get(period)
    if sweep is None:
        sweep = sweeps[period] = _Sweep(period)
        # A system task: it outlives any one connection's nursery and ends with the event loop.
        trio.lowlevel.spawn_system_task(sweep.run, sweeps, name=f"kproxy connection watchdog ({period:g}s)")
    sweep.members[member] = None

    def stop() -> None:
        sweep.members.pop(member, None)

    return stop

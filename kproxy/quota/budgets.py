"""The usage measured for every quota budget, kept by quota name and budget key across rule reloads.

A budget is one quota's measured rates for one key (a client id, a principal, ...): a reload that
keeps the quota's name keeps its usage, and a changed limit applies from the next request. Keys
come from what clients send, so the table is bounded: budgets idle for longer than they remember
are dropped, and past ``limit`` the least recently used go first, so a flood of new keys cannot
push out (and reset) the budgets in use. Pure: time is passed in.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable

from kproxy.quota.rate import SampledRate

log = logging.getLogger("kproxy.quota")

BudgetKey = tuple[str, str]     # (quota name, key such as "client_id=app-1")


class Budget:
    """One quota's rates for one key: produce and fetch bytes, requests, and request time (in
    percent-seconds of one thread), each created when first used. ``share`` is the part of the
    quota's limits this budget is held to: 1 when the quota was scaled already, a fleet share
    (``kproxy.quota.fleet``) set by the coordinator between intervals when quotas are coordinated.
    ``muted`` measures the seconds per second its clients were told to wait (their demand beyond
    what was let through)."""

    __slots__ = ("fetch", "last_used", "muted", "produce", "requests", "share", "span_s", "time")

    def __init__(self, now: float, span_s: float, share: float = 1.0) -> None:
        self.produce: SampledRate | None = None
        self.fetch: SampledRate | None = None
        self.requests: SampledRate | None = None
        self.time: SampledRate | None = None
        self.muted: SampledRate | None = None
        self.share = share
        self.last_used = now
        self.span_s = span_s    # how long its samples remember: idle longer, it measures nothing

    def new(self, limit: str) -> SampledRate:
        """The rate of ``limit`` (produce, fetch, requests or time), started now it is first used."""
        rate = SampledRate()
        setattr(self, limit, rate)
        return rate


class Budgets:
    """Every budget of one kproxy process, shared by all connections."""

    def __init__(self, limit: int = 100_000, initial_share: float = 1.0) -> None:
        self.limit = limit
        self.initial_share = initial_share      # the share a new budget starts with
        # Least recently used first: every use moves a budget to the end.
        self._budgets: OrderedDict[BudgetKey, Budget] = OrderedDict()
        self._next_sweep = min(limit, 1024)
        self.evicted = 0            # budgets dropped while still remembering usage (the limit was hit)

    def __len__(self) -> int:
        return len(self._budgets)

    def get(self, key: BudgetKey, now: float, span_s: float) -> Budget:
        budget = self._budgets.get(key)
        if budget is None:
            if len(self._budgets) >= self._next_sweep:
                self._sweep(now)
            budget = self._budgets[key] = Budget(now, span_s, self.initial_share)
        else:
            budget.span_s = span_s
            self._budgets.move_to_end(key)
        budget.last_used = now
        return budget

    def peek(self, key: BudgetKey) -> Budget | None:
        return self._budgets.get(key)

    def items(self) -> Iterable[tuple[BudgetKey, Budget]]:
        return self._budgets.items()

    def drop(self, keys: Iterable[BudgetKey]) -> None:
        for key in keys:
            self._budgets.pop(key, None)

    def _sweep(self, now: float) -> None:
        budgets = self._budgets
        for key in [k for k, b in budgets.items() if now - b.last_used >= b.span_s]:
            del budgets[key]
        if len(budgets) >= self.limit:
            # Least recently used first, a tenth of the table at a time so the next sweep is not due
            # at the next new key: their usage is forgotten early.
            over = len(budgets) - self.limit + max(1, self.limit // 10)
            for _ in range(over):
                budgets.popitem(last=False)
            self.evicted += over
            log.warning("quota budgets: more keys in use than the limit of %d; the %d least recently used "
                        "were dropped with the usage they measured", self.limit, over)
        self._next_sweep = min(self.limit, max(1024, 2 * len(budgets)))

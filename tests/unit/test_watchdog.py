"""The connections' watchdog (kproxy.server.watchdog): one task per period looks at every watched
connection in turn, a failing check ends its own connection only, and the task ends when nobody is
left. Driven on trio's autojump clock, so the periods take no real time."""

from __future__ import annotations

import trio

from kproxy.server import watchdog


class Member:
    def __init__(self, fail: bool = False) -> None:
        self.checks: list[float] = []
        self.closed: str | None = None
        self.fail = fail

    def check(self, now: float) -> None:
        self.checks.append(now)
        if self.fail:
            raise RuntimeError("a bug in a check")

    def close_from_watchdog(self, reason: str) -> None:
        self.closed = reason


async def test_one_task_checks_every_connection_each_period(autojump_clock: trio.abc.Clock) -> None:
    members = [Member() for _ in range(500)]
    stops = [watchdog.watch(m, 2.0) for m in members]
    assert len(watchdog._SWEEPS.get()) == 1           # one sweep for the period, not one task each
    await trio.sleep(7.0)
    assert all(len(m.checks) == 3 for m in members)   # at 2, 4 and 6 s
    stops[0]()
    await trio.sleep(2.0)
    assert len(members[0].checks) == 3 and len(members[1].checks) == 4
    for stop in stops:
        stop()
    await trio.sleep(2.5)                             # a period with nobody left: the sweep ends
    assert watchdog._SWEEPS.get() == {}
    late = Member()
    stop = watchdog.watch(late, 2.0)                  # and the next connection starts another
    await trio.sleep(2.5)
    assert len(late.checks) == 1
    stop()


async def test_a_failing_check_closes_its_own_connection_only(autojump_clock: trio.abc.Clock) -> None:
    bad, good = Member(fail=True), Member()
    stops = [watchdog.watch(bad, 1.0), watchdog.watch(good, 1.0)]
    await trio.sleep(1.5)
    assert bad.closed == "internal error in the connection watchdog"
    assert good.closed is None and len(good.checks) == 1
    await trio.sleep(1.0)
    assert len(good.checks) == 2                      # the sweep goes on
    for stop in stops:
        stop()


async def test_each_period_has_its_own_sweep(autojump_clock: trio.abc.Clock) -> None:
    fast, slow = Member(), Member()
    stops = [watchdog.watch(fast, 1.0), watchdog.watch(slow, 5.0)]
    await trio.sleep(5.5)
    assert (len(fast.checks), len(slow.checks)) == (5, 1)
    for stop in stops:
        stop()

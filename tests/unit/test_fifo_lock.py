"""The broker write lock: one holder, handed on in the order tasks asked, never lost to a cancel."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from kproxy.server.ordering import FifoLock


async def test_waiters_get_the_lock_in_the_order_they_asked():
    lock = FifoLock()
    order: list[int] = []
    lock.acquire_nowait()

    async def take(i: int) -> None:
        async with lock:
            order.append(i)

    async with trio.open_nursery() as nursery:
        for i in range(5):
            nursery.start_soon(take, i)
            await trio.testing.wait_all_tasks_blocked()
        assert order == []
        lock.release()
    assert order == [0, 1, 2, 3, 4]
    assert not lock.locked()


async def test_no_task_barges_in_ahead_of_a_waiter():
    lock = FifoLock()
    got: list[str] = []
    lock.acquire_nowait()

    async def waiter() -> None:
        async with lock:
            got.append("waiter")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        lock.release()
        # Handed to the waiter at release: still held, so a newcomer cannot take it first.
        assert lock.locked()
        with pytest.raises(trio.WouldBlock):
            lock.acquire_nowait()
    assert got == ["waiter"] and not lock.locked()


async def test_a_cancelled_waiter_leaves_the_queue_and_the_lock_moves_on():
    lock = FifoLock()
    got: list[int] = []
    lock.acquire_nowait()

    async def take(i: int, scope: trio.CancelScope) -> None:
        with scope:
            async with lock:
                got.append(i)

    scopes = [trio.CancelScope() for _ in range(3)]
    async with trio.open_nursery() as nursery:
        for i, scope in enumerate(scopes):
            nursery.start_soon(take, i, scope)
            await trio.testing.wait_all_tasks_blocked()
        scopes[0].cancel()
        await trio.testing.wait_all_tasks_blocked()
        lock.release()
        # Cancelled in the same turn as the hand-over: it holds the lock already and passes it on.
        scopes[1].cancel()
    assert got == [1, 2] and not lock.locked()


async def test_a_cancelled_acquire_holds_nothing():
    lock = FifoLock()
    with trio.CancelScope() as scope:
        scope.cancel()
        await lock.acquire()
    assert not lock.locked()


def test_release_of_a_lock_not_held_is_an_error():
    with pytest.raises(RuntimeError):
        FifoLock().release()


async def test_take_holds_a_free_lock_and_never_barges_in():
    lock = FifoLock()
    assert lock.take() and lock.locked()
    assert not lock.take()              # held: the caller must wait its turn with acquire()
    got: list[str] = []

    async def waiter() -> None:
        await lock.acquire()
        got.append("waiter")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        lock.release()                  # handed to the waiter, still held
        assert not lock.take()
        await trio.testing.wait_all_tasks_blocked()
    assert got == ["waiter"] and lock.locked()
    lock.release()
    assert lock.take()

"""kproxy.localports: ports outside the kernel's ephemeral range, leased per process, never handed out
twice in a row, and always free when handed out."""

from __future__ import annotations

import socket
import subprocess
import sys

from kproxy import localports
from kproxy.localports import WINDOW, bindable, ephemeral_range, free_port, free_port_run, windows


def test_windows_lie_outside_the_ephemeral_range() -> None:
    starts = windows((32768, 60999))
    assert starts and starts == sorted(set(starts))
    for start in starts:
        assert start >= localports.LOWEST and start + WINDOW <= 65536
        assert start + WINDOW <= 32768 or start >= 61000
    assert windows((1024, 65535)) == []       # a range that leaves no room: the kernel picks, as before


def test_ports_come_from_outside_the_ephemeral_range_and_are_free() -> None:
    # The kernel hands out ports from the ephemeral range to every outgoing connection: on a busy
    # machine, there, a port found free can be taken before it is bound (and the range fills up).
    first, last = ephemeral_range()
    port = free_port_run(65)
    assert not (first <= port <= last or first <= port + 64 <= last)
    assert bindable(localports.HOST, port, 65)


def test_a_port_is_not_handed_out_again_while_it_may_still_be_bound() -> None:
    handed = [free_port() for _ in range(40)] + [free_port_run(8) + i for _ in range(10) for i in range(8)]
    assert len(set(handed)) == len(handed)


def test_a_port_that_is_bound_or_in_time_wait_is_skipped() -> None:
    free_port()
    start = localports._allocator().windows[0][0]          # this process's lease: nobody else's ports
    first = localports._Allocator()._search(start, start, 1, localports.HOST)
    assert first is not None
    with socket.create_server((localports.HOST, first)):
        assert localports._Allocator()._search(start, start, 1, localports.HOST) != first
    # A connection from `first` that its own side closes first: `first` sits in TIME_WAIT for a minute.
    with socket.create_server((localports.HOST, 0)) as server:
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        client.bind((localports.HOST, first))
        client.connect(server.getsockname())
        conn, _ = server.accept()
        client.close()
        conn.close()
    assert not bindable(localports.HOST, first, 1)
    assert localports._Allocator()._search(start, start, 1, localports.HOST) != first


def test_two_processes_lease_different_windows() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "from kproxy import localports; localports.free_port(); "
         "print(*(s for s, _ in localports._allocator().windows), flush=True); input()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        theirs = {int(s) for s in child.stdout.readline().split()}
        free_port()
        ours = {s for s, _ in localports._allocator().windows}
        assert theirs and ours and not theirs & ours
    finally:
        child.communicate("\n", timeout=30)

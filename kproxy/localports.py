"""Free loopback ports for the things kproxy starts on one machine: the demo's broker and proxy, and
the tests' and benchmarks' brokers, proxies and relays.

A port is picked now and bound a little later (by a child process, or by kproxy once discovery
names a broker), so it must stay free in between, also on a machine where other programs (other
test runs) open and close connections all the time. These make that so:

- Ports come from outside the kernel's ephemeral range (``net.ipv4.ip_local_port_range``). The
  kernel hands out ports from that range on its own, to every outgoing connection and to every
  ``bind`` to port 0, and a connection its own side closed first holds its port in TIME_WAIT for a
  minute: on a busy machine the range fills up (no run of free ports is left), and a port found free
  there can be taken before it is bound. Outside it, a port is only used by a program that asks for
  it by number.
- Each process leases windows of ports there, each with a lock on a file in the temporary
  directory (``kproxy-ports/``; the kernel releases it when the process ends, however it ends). So
  two processes on the machine never hand out the same port.
- In its windows a process hands out ports in turn, each once, leasing another window when those
  it holds are used up. Only past ``MAX_WINDOWS`` windows (or when none is left to lease) does it
  hand out a port a second time, and never one it handed out in the last ``REUSE_AFTER_S`` seconds
  (whoever has it may bind it late: kproxy binds a broker port once discovery names the broker). A
  port handed out once is rarely seen again, so a client an earlier test left behind, still
  reconnecting to it, does not reach what a later test started there.
- Every port handed out could be bound a moment before without SO_REUSEADDR: nothing holds it, not
  even a connection in TIME_WAIT.

A process that holds no window (no room outside the ephemeral range, the temporary directory not
writable, every window taken) gets the kernel's pick, as before.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import tempfile
import threading
import time
from pathlib import Path

HOST = "127.0.0.1"
WINDOW = 256                    # ports in one lease
MAX_WINDOWS = 8                 # leased by one process before it hands out ports a second time
LOWEST = 20000                  # below this, well-known services listen
REUSE_AFTER_S = 60.0            # a port handed out is not handed out again for this long
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_DEFAULT_RANGE = (32768, 60999)  # Linux's default ephemeral range


class PortError(OSError):
    """No run of free ports could be found; the message says how many were wanted."""


def free_port(host: str = HOST) -> int:
    """A TCP port on ``host`` that is free and handed out to nobody else on this machine."""
    return free_port_run(1, host)


def free_port_run(count: int, host: str = HOST) -> int:
    """A port P such that P .. P+count-1 are free and handed out to nobody else on this machine (a
    proxy's listen port and the broker ports after it)."""
    port = _allocator().take(count, host)
    return port if port is not None else _kernel_run(count, host)


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (first, last), Linux's default where it cannot be read."""
    try:
        first, last = (int(v) for v in _RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return _DEFAULT_RANGE
    return first, last


def windows(ephemeral: tuple[int, int] | None = None) -> list[int]:
    """The first port of every window outside the ephemeral range, from LOWEST up to 65535."""
    first, last = ephemeral or ephemeral_range()
    starts: list[int] = []
    for low, high in ((LOWEST, first), (max(last + 1, LOWEST), 65536)):
        starts += range(low, high - WINDOW + 1, WINDOW)
    return starts


def bindable(host: str, first: int, count: int) -> bool:
    """Whether ``first`` .. ``first+count-1`` can all be bound on ``host`` now, without SO_REUSEADDR
    (so no socket holds any of them, one in TIME_WAIT included)."""
    socks: list[socket.socket] = []
    try:
        for port in range(first, first + count):
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((host, port))
        return True
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()


class _Allocator:
    """One process's windows and the ports it handed out lately."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.windows: list[tuple[int, int]] = []            # (first port, lease file descriptor)
        self.next: dict[int, int] = {}                      # window -> its first port never handed out
        self.recent: list[tuple[float, int, int]] = []      # (handed out at, first port, end)
        self.lock = threading.Lock()

    def take(self, count: int, host: str) -> int | None:
        """Ports never handed out before, from the windows held or a newly leased one; once
        MAX_WINDOWS are held (or none is left to lease), a lap of the held windows."""
        if count > WINDOW:
            return None
        with self.lock:
            now = time.monotonic()
            self.recent = [r for r in self.recent if now - r[0] < REUSE_AFTER_S]
            for start, _ in self.windows:
                port = self._search(start, self.next[start], count, host)
                if port is not None:
                    return self._handed_out(now, start, port, count)
            while len(self.windows) < MAX_WINDOWS and (leased := _lease()) is not None:
                self.windows.append(leased)
                start = self.next[leased[0]] = leased[0]
                port = self._search(start, start, count, host)
                if port is not None:
                    return self._handed_out(now, start, port, count)
            for start, _ in self.windows:
                port = self._search(start, start, count, host, lap=True)
                if port is not None:
                    return self._handed_out(now, start, port, count)
        return None

    def _search(self, start: int, first: int, count: int, host: str, lap: bool = False) -> int | None:
        """The first run of ``count`` free ports from ``first`` to the window's end; in a lap, from
        the window's start, skipping runs handed out in the last REUSE_AFTER_S seconds."""
        end = start + WINDOW
        while first + count <= end:
            taken = next((e for _, f, e in self.recent if f < first + count and first < e), None) if lap else None
            if taken is None and bindable(host, first, count):
                return first
            first = taken if taken is not None else first + 1
        return None

    def _handed_out(self, now: float, start: int, port: int, count: int) -> int:
        self.recent.append((now, port, port + count))
        self.next[start] = max(self.next[start], port + count)
        return port


_current: _Allocator | None = None
_creating = threading.Lock()


def _allocator() -> _Allocator:
    """This process's allocator (a new one in a child forked from a process that had one: the child
    shares its parent's locks, so it must not share its windows)."""
    global _current
    with _creating:
        if _current is None or _current.pid != os.getpid():
            _current = _Allocator()
        return _current


def _lease() -> tuple[int, int] | None:
    """A window nobody on the machine holds, locked for this process's lifetime; None if none is left."""
    directory = Path(tempfile.gettempdir()) / "kproxy-ports"
    try:
        directory.mkdir(exist_ok=True)
        with contextlib.suppress(OSError):
            directory.chmod(0o1777)          # every user on the machine leases here, as in /tmp
    except OSError:
        return None
    starts = windows()
    random.Random().shuffle(starts)     # its own generator: the global one may be seeded by a test
    for start in starts:
        try:
            fd = os.open(directory / f"{start}.lock", os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError:
            continue
        try:
            # Taken if another open of the file holds it: another process's, or this one's own.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        return start, fd                 # the lock is held until this process ends
    return None


def _kernel_run(count: int, host: str, attempts: int = 50) -> int:
    for _ in range(attempts):
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            first = int(s.getsockname()[1])
        if first + count - 1 <= 65535 and bindable(host, first, count):
            return first
    raise PortError(f"found no {count} consecutive free ports on {host}")

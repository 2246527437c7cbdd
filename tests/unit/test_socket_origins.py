"""tests/socket_origins.py: an unclosed socket, found by the garbage collector wherever, names the
test, thread and frames that made it; a closed one is forgotten."""

from __future__ import annotations

import gc
import socket
import sys
import warnings
from typing import Any

from tests import socket_origins


def leave_an_unclosed_socket_in_a_cycle() -> None:
    cycle: list[Any] = [socket.socket(socket.AF_INET, socket.SOCK_STREAM)]
    cycle.append(cycle)


def test_an_unclosed_socket_names_the_test_and_the_function_that_made_it() -> None:
    socket_origins.track()
    with warnings.catch_warnings(record=True) as left:
        warnings.simplefilter("always", ResourceWarning)
        leave_an_unclosed_socket_in_a_cycle()
        gc.collect()
    made = [socket_origins.origin(w.source) for w in left if issubclass(w.category, ResourceWarning)]
    assert len(made) == 1 and made[0] is not None, made
    assert "test_an_unclosed_socket_names_the_test_and_the_function_that_made_it" in made[0]
    assert "leave_an_unclosed_socket_in_a_cycle" in made[0] and "test_socket_origins.py" in made[0]


def test_a_closed_or_detached_socket_is_forgotten() -> None:
    socket_origins.track()
    s = socket.socket()
    assert socket_origins.origin(s) is not None
    s.close()
    assert socket_origins.origin(s) is None
    t = socket.socket()
    fd = t.detach()
    assert socket_origins.origin(t) is None
    socket.close(fd)
    a, b = socket.socketpair()            # made by the library, from fds: noted as well
    assert socket_origins.origin(a) is not None
    a.close()
    b.close()


def test_the_unraisable_report_of_an_unclosed_socket_carries_its_origin() -> None:
    socket_origins.track()
    reports: list[Any] = []
    outer = sys.unraisablehook
    sys.unraisablehook = reports.append
    try:
        socket_origins.name_unclosed_sockets_in_reports()
        with warnings.catch_warnings():
            warnings.simplefilter("error", ResourceWarning)     # as the suite runs: raised, unraisable
            leave_an_unclosed_socket_in_a_cycle()
            gc.collect()
    finally:
        sys.unraisablehook = outer
    assert len(reports) == 1 and isinstance(reports[0].exc_value, ResourceWarning)
    assert "leave_an_unclosed_socket_in_a_cycle" in reports[0].err_msg, reports[0].err_msg

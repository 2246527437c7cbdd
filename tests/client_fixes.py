"""A fix the test suite applies to a client library it drives, for a defect of the library's own.

kafka-python 3.0.12 (the newest on the package index) makes a socket for each connection attempt and
does not close it when the attempt fails: the connect is refused, or its deadline passes, which on a
loaded machine can happen after the connection was in fact made. The socket stays referenced from
the failure's traceback, in a reference cycle, until the garbage collector finds it, in whatever
code runs then. With warnings as errors (pyproject.toml), that failed an unrelated test:
``ResourceWarning: unclosed <socket.socket ... raddr=('127.0.0.1', 62056)>`` raised inside
``test_cut_through``'s list of expected records.

``close_failed_connects`` closes the socket when kafka-python's connect raises, and changes nothing
else it does (``tests/e2e/test_client_fixes.py`` shows the leak and that this closes it).
``close_failed_handshakes`` does the same for a TLS handshake that fails (the peer closes, or the
certificate is refused): the connection manager's ``_build_transport`` raises without closing the
transport it made, and its wrapped ``ssl.SSLSocket`` waits for the collector in the same way.
kproxy's own code is held to the warning as before.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any


def close_failed_connects() -> bool:
    """Wrap kafka-python's ``KafkaNetSocket.sock_connect`` so a failed connect closes its socket.
    False when kafka-python is not installed or has no such method (nothing to fix)."""
    try:
        with warnings.catch_warnings():
            # kafka-python 3.0 loads its schemas with the importlib.resources calls deprecated in 3.11.
            warnings.simplefilter("ignore", DeprecationWarning)
            from kafka.net.inet import KafkaNetSocket
    except ImportError:
        return False
    original = getattr(KafkaNetSocket, "sock_connect", None)
    if original is None or getattr(original, "closes_on_failure", False):
        return original is not None

    @functools.wraps(original)
    async def sock_connect(self: Any, net: Any, sock: Any, sockaddr: Any, timeout_at: float | None = None) -> Any:
        try:
            return await original(self, net, sock, sockaddr, timeout_at=timeout_at)
        except BaseException:
            sock.close()
            raise

    sock_connect.closes_on_failure = True    # type: ignore[attr-defined]
    KafkaNetSocket.sock_connect = sock_connect
    return True


def close_failed_handshakes() -> bool:
    """Wrap kafka-python's ``KafkaSSLTransport.handshake`` so a failed handshake closes the transport
    (its own ``_close``: the socket leaves the selector, then closes). False when kafka-python is not
    installed or has no such method (nothing to fix)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from kafka.net.transport import KafkaSSLTransport
    except ImportError:
        return False
    original = getattr(KafkaSSLTransport, "handshake", None)
    if original is None or not hasattr(KafkaSSLTransport, "_close"):
        return False
    if getattr(original, "closes_on_failure", False):
        return True

    @functools.wraps(original)
    async def handshake(self: Any) -> Any:
        try:
            return await original(self)
        except BaseException as e:
            self._close(e)
            raise

    handshake.closes_on_failure = True    # type: ignore[attr-defined]
    KafkaSSLTransport.handshake = handshake
    return True

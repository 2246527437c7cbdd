"""The suite's fixes to kafka-python (tests/client_fixes.py): a connect or a TLS handshake that fails
leaves no socket for the garbage collector. Without them, every refused attempt of a consumer
bootstrapping from a closed port, and every handshake a listener ends at once, is an unclosed socket
(an ``ssl.SSLSocket`` for the handshake), found by ``gc.collect()``."""

from __future__ import annotations

import contextlib
import gc
import logging
import socket
import threading
import warnings
from collections.abc import Callable

import pytest

from tests.client_fixes import close_failed_connects, close_failed_handshakes

with warnings.catch_warnings():
    # kafka-python 3.0 loads its schemas with the importlib.resources calls deprecated in 3.11.
    warnings.simplefilter("ignore", DeprecationWarning)
    import kafka
    import kafka.errors
    from kafka.net.inet import KafkaNetSocket
    from kafka.net.transport import KafkaSSLTransport


def _unclosed_after_a_refused_bootstrap() -> list[str]:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()      # nothing listens: every connect is refused
    return _unclosed_after_a_failed_bootstrap(port)


def _unclosed_after_a_failed_bootstrap(port: int, **settings: object) -> list[str]:
    # kafka-python logs each failure with the exception as an argument; pytest keeps log records
    # until the test ends, and with them the exception, its traceback and the socket: none are made.
    kafka_log = logging.getLogger("kafka")
    level = kafka_log.level
    kafka_log.setLevel(logging.CRITICAL)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always", ResourceWarning)
        try:
            kafka.KafkaConsumer(bootstrap_servers=f"127.0.0.1:{port}", bootstrap_timeout_ms=1000,
                                reconnect_backoff_ms=50, reconnect_backoff_max_ms=100, **settings)
        except kafka.errors.KafkaError:
            pass        # "Unable to bootstrap"; its traceback is dropped here, the sockets' cycle with it
        else:
            raise AssertionError("a consumer bootstrapped from a port nothing listens on")
        finally:
            kafka_log.setLevel(level)
        gc.collect()
    return [str(w.message) for w in got if issubclass(w.category, ResourceWarning)]


def test_kafka_pythons_refused_connects_leave_no_socket() -> None:
    assert getattr(KafkaNetSocket.sock_connect, "closes_on_failure", False), "conftest did not apply the fix"
    assert _unclosed_after_a_refused_bootstrap() == []


def test_without_the_fix_they_do(monkeypatch: pytest.MonkeyPatch) -> None:
    # The defect the fix is for is still there in the installed kafka-python: when a release fixes
    # it, this fails, and tests/client_fixes.py can go.
    monkeypatch.setattr(KafkaNetSocket, "sock_connect", KafkaNetSocket.sock_connect.__wrapped__)
    unclosed = _unclosed_after_a_refused_bootstrap()
    assert unclosed and all("unclosed <socket.socket" in m for m in unclosed), unclosed
    assert close_failed_connects()


def _with_a_listener_that_hangs_up(check: Callable[[int], list[str]]) -> list[str]:
    """``check(port)`` while a listener on ``port`` accepts each connection and closes it at once:
    a TLS client's handshake then fails (EOF)."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def hang_up() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.close()

    thread = threading.Thread(target=hang_up, daemon=True)
    thread.start()
    try:
        return check(listener.getsockname()[1])
    finally:
        stop.set()
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)     # wakes the accept() (a close alone does not)
        thread.join(5)
        listener.close()


def _unclosed_after_failed_handshakes(port: int) -> list[str]:
    return _unclosed_after_a_failed_bootstrap(port, security_protocol="SSL")


def test_kafka_pythons_failed_tls_handshakes_leave_no_socket() -> None:
    assert getattr(KafkaSSLTransport.handshake, "closes_on_failure", False), "conftest did not apply the fix"
    assert _with_a_listener_that_hangs_up(_unclosed_after_failed_handshakes) == []


def test_without_the_handshake_fix_they_do(monkeypatch: pytest.MonkeyPatch) -> None:
    # As above: when a kafka-python release closes them itself, this fails and the fix can go.
    monkeypatch.setattr(KafkaSSLTransport, "handshake", KafkaSSLTransport.handshake.__wrapped__)
    unclosed = _with_a_listener_that_hangs_up(_unclosed_after_failed_handshakes)
    assert unclosed and all("unclosed <ssl.SSLSocket" in m for m in unclosed), unclosed
    assert close_failed_handshakes()

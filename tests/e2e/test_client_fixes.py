"""The suite's fix to kafka-python (tests/client_fixes.py): a connect that fails leaves no socket for
the garbage collector. Without the fix, every refused attempt of a consumer bootstrapping from a
closed port is an unclosed socket, found by ``gc.collect()``."""

from __future__ import annotations

import gc
import logging
import socket
import warnings

import pytest

from tests.client_fixes import close_failed_connects

with warnings.catch_warnings():
    # kafka-python 3.0 loads its schemas with the importlib.resources calls deprecated in 3.11.
    warnings.simplefilter("ignore", DeprecationWarning)
    import kafka
    import kafka.errors
    from kafka.net.inet import KafkaNetSocket


def _unclosed_after_a_refused_bootstrap() -> list[str]:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()      # nothing listens: every connect is refused
    # kafka-python logs each failure with the exception as an argument; pytest keeps log records
    # until the test ends, and with them the exception, its traceback and the socket: none are made.
    kafka_log = logging.getLogger("kafka")
    level = kafka_log.level
    kafka_log.setLevel(logging.CRITICAL)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always", ResourceWarning)
        try:
            kafka.KafkaConsumer(bootstrap_servers=f"127.0.0.1:{port}", bootstrap_timeout_ms=1000,
                                reconnect_backoff_ms=50, reconnect_backoff_max_ms=100)
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

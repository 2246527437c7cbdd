"""Connection limits through kproxy on tansu: idle and unauthenticated timeouts, slow senders, and
memory that follows the bytes received rather than what a size prefix claims."""

from __future__ import annotations

import time

import pytest

from kproxy.protocol.messages import body_class
from tests.e2e.proxied import start_proxy
from tests.e2e.sasl_gate import SaslGate
from tests.e2e.tansu import Tansu, TansuBroker
from tests.e2e.wire import Wire

pytestmark = pytest.mark.e2e

SASL_HANDSHAKE = 17


def test_silent_connections_are_closed_after_the_idle_timeout(broker: TansuBroker) -> None:
    idle_timeout = 1.5
    p = start_proxy(broker.bootstrap, advertised_host="127.0.0.1", limits={"idle_timeout_s": idle_timeout})

    def open_connections() -> int:
        return p.call(lambda: len(p.server.connections))

    try:
        silent = Wire(p.bootstrap)
        talking = Wire(p.bootstrap)
        deadline = time.monotonic() + 15
        while open_connections() < 2:
            assert time.monotonic() < deadline, "kproxy never accepted both connections"
            time.sleep(0.01)
        started = time.monotonic()
        n = 0
        # Keep one connection busy (a request every few milliseconds, far inside the timeout) until
        # kproxy closes the other.
        while open_connections() == 2:
            assert time.monotonic() - started < 30, "the silent connection was never closed"
            n += 1
            assert talking.metadata(n).correlation_id == n
            time.sleep(0.02)
        assert time.monotonic() - started > idle_timeout / 2   # not before it had been idle a while
        assert silent.closed_by_peer()
        assert talking.metadata(n + 1).correlation_id == n + 1
        talking.close()
        silent.close()
    finally:
        p.stop()


def test_the_unauthenticated_timeout_is_only_for_an_unfinished_sasl_exchange(tansu_binary: str) -> None:
    gate = SaslGate(None, {"alice": "pw"})
    with Tansu(tansu_binary, advertised=gate.address) as tansu:
        gate.upstream = (tansu.host, tansu.port)
        with gate:
            p = start_proxy(gate.bootstrap, advertised_host="127.0.0.1",
                            limits={"unauthenticated_idle_timeout_s": 0.5, "idle_timeout_s": 0})
            try:
                quiet = Wire(p.bootstrap)        # sends nothing: not the unauthenticated timeout's business
                stuck = Wire(p.bootstrap)        # starts SASL and never finishes it
                stuck.send(SASL_HANDSHAKE, 1, 1, body_class(SASL_HANDSHAKE, "request")(mechanism="PLAIN"))
                assert stuck.receive(SASL_HANDSHAKE, 1).body.error_code == 0
                started = time.monotonic()
                assert stuck.closed_by_peer()
                assert 0.4 < time.monotonic() - started < 4
                time.sleep(0.5)
                quiet.send(SASL_HANDSHAKE, 1, 2, body_class(SASL_HANDSHAKE, "request")(mechanism="PLAIN"))
                assert quiet.receive(SASL_HANDSHAKE, 1).correlation_id == 2
                quiet.close()
                stuck.close()
            finally:
                p.stop()

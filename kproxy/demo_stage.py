"""The stage both demos run on: an embedded tansu broker, kproxy's ports beside it, and kafka-python.

``kproxy.tour`` (the product tour, ``kproxy demo``) and ``kproxy.demo`` (the command itself and the
plain round trip behind ``--plain``) both build on this module; it imports neither of them.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

from kproxy import localports
from kproxy.config import ProxyConfig, config_from_args
from kproxy.tansu import HOST, Tansu, TansuError

# One broker needs one exposed port; a few spare ones keep the range honest without hunting for 64.
BROKER_PORT_COUNT = 4
CLIENT_TIMEOUT_MS = 10_000


class DemoError(Exception):
    """A step of the demo failed; the message says which and why, for the user to read."""


def free_port_run(count: int) -> int:
    """A port P such that P..P+count-1 are free: kproxy's listen and broker ports (kproxy.localports)."""
    try:
        return localports.free_port_run(count, HOST)
    except localports.PortError as e:
        raise DemoError(str(e)) from None


def proxy_config(broker: str, **settings: Any) -> ProxyConfig:
    """kproxy in front of ``broker`` on free local ports (chosen after the broker binds, so the range
    cannot collide with it), logging warnings only; ``settings`` are further top-level settings."""
    listen = free_port_run(1 + BROKER_PORT_COUNT)
    return config_from_args(broker, f"{HOST}:{listen}", log_level="WARNING",
                            exposure={"advertised_host": HOST, "broker_port_count": BROKER_PORT_COUNT},
                            **settings)


@contextlib.contextmanager
def embedded_broker() -> Iterator[str]:
    """A tansu broker for the block, stopped on the way out (Ctrl-C included); its bootstrap address."""
    try:
        tansu = Tansu().start()
    except TansuError as e:
        raise DemoError(str(e)) from None
    try:
        yield tansu.bootstrap
    finally:
        tansu.stop()


def import_kafka() -> Any:
    """kafka-python, the demos' client."""
    with warnings.catch_warnings():
        # kafka-python 3.0 loads its schemas with importlib.resources calls deprecated in 3.11.
        warnings.simplefilter("ignore", DeprecationWarning)
        import kafka
        import kafka.admin
    return kafka

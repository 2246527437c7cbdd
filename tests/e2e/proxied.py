"""kproxy in front of a test broker, with a tap that keeps every response a client receives.

The tap is the last filter, so it sees each response exactly as kproxy encodes it for the client:
after address rewriting. Tests use it to prove that no upstream host or port ever reaches a client.
"""

from __future__ import annotations

import threading
import urllib.request
from typing import Any

import attrs

from kproxy.config import ExposureConfig, config_from_args
from kproxy.localports import free_port_run
from kproxy.protocol.messages import Response, api_name
from kproxy.proxy.filters import ALL, ConnectionContext, Filter
from kproxy.server.embedded import ProxyThread


class ResponseTap(Filter):
    """Records (api name, version, body as plain dict) of every response, for every api key."""

    name = "tap"
    response_api_keys = ALL

    def __init__(self) -> None:
        self.seen: list[tuple[str, int, dict[str, Any]]] = []
        self._lock = threading.Lock()

    def on_response(self, ctx: ConnectionContext, exchange, response: Response) -> float:
        with self._lock:
            self.seen.append(
                (
                    api_name(response.api_key),
                    response.api_version,
                    response.body.to_dict(response.api_version),
                )
            )
        return 0.0

    def apis(self) -> set[str]:
        with self._lock:
            return {name for name, _, _ in self.seen}

    def leaks(self, host: str, port: int) -> list[str]:
        """Every place in a recorded response where the upstream host, or a port field equal to
        the upstream port, appears."""
        found: list[str] = []

        def walk(v: Any, path: str) -> None:
            if isinstance(v, dict):
                for k, x in v.items():
                    if k == "port" and x == port:
                        found.append(f"{path}.{k}={x}")
                    walk(x, f"{path}.{k}")
            elif isinstance(v, list):
                for i, x in enumerate(v):
                    walk(x, f"{path}[{i}]")
            elif isinstance(v, str) and host in v:
                found.append(f"{path}={v!r}")

        with self._lock:
            for name, version, body in self.seen:
                walk(body, f"{name}.v{version}")
        return found


def in_flight(admin: str) -> float:
    """kproxy_requests_in_flight from a kproxy process's /metrics (``admin`` is host:port)."""
    with urllib.request.urlopen(f"http://{admin}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(("kproxy_requests_in_flight ", "kproxy_requests_in_flight{")):
                return float(line.rpartition(" ")[2])
    raise AssertionError("no kproxy_requests_in_flight in /metrics")


# What a kproxy that does not set exposure.broker_port_count may bind after its listen port.
DEFAULT_BROKER_PORT_COUNT: int = attrs.fields(ExposureConfig).broker_port_count.default


def free_port_block(count: int = 1 + DEFAULT_BROKER_PORT_COUNT) -> int:
    """A port P with P..P+count-1 free and handed out to nobody else (kproxy.localports): by
    default the listen port and every broker port a kproxy with the default
    ``exposure.broker_port_count`` may bind after it."""
    return free_port_run(count)


def start_proxy(
    upstream: str, advertised_host: str = "localhost", filters: list[Filter] | None = None,
    listen_port: int | None = None, server_options: dict[str, Any] | None = None, **overrides: Any
) -> ProxyThread:
    exposure = {"advertised_host": advertised_host, "broker_port_count": 6}
    exposure.update(overrides.pop("exposure", {}))
    port = listen_port or free_port_block(1 + exposure["broker_port_count"])
    up = overrides.pop("upstream_settings", {})
    cfg = config_from_args(upstream, f"127.0.0.1:{port}", exposure=exposure, **overrides)
    if up:
        cfg = attrs.evolve(cfg, upstream=attrs.evolve(cfg.upstream, **up))
    return ProxyThread(cfg, filters or [], **(server_options or {})).start()

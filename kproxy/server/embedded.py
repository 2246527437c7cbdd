"""kproxy in a background thread of another program: for blocking clients in tests, demo and bench.

``with ProxyThread(config) as proxy:`` starts a trio loop in a daemon thread, waits until the
bootstrap ports listen, and on exit drains and joins the thread. ``proxy.call(fn)`` runs a function
on the proxy's loop (to inspect the address map or stats without races). ``proxy.process`` is the
whole process; ``proxy.server`` its first (or only) virtual cluster, ``proxy.cluster(name)`` any.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

import trio

from kproxy.config import ProxyConfig
from kproxy.proxy.filters import Filter
from kproxy.server.app import ProxyServer
from kproxy.server.process import ProxyProcess


class ProxyThread:
    def __init__(self, config: ProxyConfig, filters: Sequence[Filter] = (), **server_options: Any) -> None:
        self.process = ProxyProcess.from_config(config, filters, **server_options)
        self.server: ProxyServer = next(iter(self.process.servers.values()))
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._cancel: trio.CancelScope | None = None
        self._error: BaseException | None = None

    @property
    def bootstrap(self) -> str:
        return self.bootstrap_of(self.server)

    def cluster(self, name: str) -> ProxyServer:
        return self.process.cluster(name)

    @staticmethod
    def bootstrap_of(server: ProxyServer) -> str:
        assert server.bootstrap_address is not None
        host, port = server.bootstrap_address
        return f"{host}:{port}"

    def start(self, timeout: float = 30.0) -> ProxyThread:
        self._thread = threading.Thread(target=self._run, name="kproxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("kproxy did not start listening in time")
        if self._error is not None:
            raise self._error
        return self

    def _run(self) -> None:
        async def main() -> None:
            self._token = trio.lowlevel.current_trio_token()
            with trio.CancelScope() as scope:
                self._cancel = scope
                async with trio.open_nursery() as nursery:
                    await nursery.start(self.process.serve)
                    self._ready.set()

        try:
            trio.run(main)
        except BaseException as e:  # reported to start() or stop()
            self._error = e
        finally:
            self._ready.set()

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the proxy's trio loop and return its result."""
        assert self._token is not None
        return trio.from_thread.run_sync(fn, trio_token=self._token)

    def drain(self, timeout: float | None = None) -> None:
        """Graceful stop: stop accepting, let in-flight requests finish, close (as on SIGTERM)."""
        assert self._token is not None
        trio.from_thread.run(self.process.drain, timeout, trio_token=self._token)

    def stop(self) -> None:
        if self._thread is None:
            return
        if self._thread.is_alive() and self._token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(self._cancel_all, trio_token=self._token)
        self._thread.join(10)
        self._thread = None
        if self._error is not None:
            raise self._error

    def _cancel_all(self) -> None:
        if self._cancel is not None:
            self._cancel.cancel()

    def __enter__(self) -> ProxyThread:
        return self if self._thread is not None else self.start()   # already started is fine

    def __exit__(self, *exc: object) -> None:
        self.stop()

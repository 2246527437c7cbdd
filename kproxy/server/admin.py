"""The admin HTTP listener (``admin.listen``): /metrics, /livez, /readyz, /config, /rules, /clients,
/upstream and POST /switch, for every virtual cluster of the process.

HTTP/1.1 comes from h11 (sans-I/O); this module moves its bytes over trio in the proxy's own event
loop, so /livez answering proves the loop is alive. It only reads the server's state, with one
exception: POST /switch moves a virtual cluster to another upstream cluster (``kproxy switch``), so
the listener belongs on an address only operators reach. Requests are small and bounded; a slow or
silent client is dropped.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import urllib.parse
from typing import Any, Protocol

import attrs
import h11
import trio

from kproxy.config import PROCESS_SETTINGS, HostPort, ProxyConfig, cluster_settings
from kproxy.logs import safe
from kproxy.protocol.errors import KProxyError
from kproxy.telemetry.metrics import ProcessMetrics, epoch_seconds

log = logging.getLogger("kproxy.admin")

MAX_REQUEST_BYTES = 16 * 1024
REQUEST_TIMEOUT_S = 10.0
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
REDACTED = "<redacted>"
INTERNAL_ERROR = b"internal error while answering; see kproxy's log\n"
# Setting names that hold a secret, or may: their values never leave (upstream.sasl.password,
# client_secret; SASL extensions may carry account ids; token URLs may carry credentials).
_SECRET_NAME = re.compile(r"pass(word|phrase)?|secret|token|credential|private|api_?key|hmac|salt|extensions",
                          re.IGNORECASE)
# Paths to key files are fine to show; the keys themselves are not in the config.
_PATH_SUFFIX = ("_file", "_path", "_dir")


class AdminView(Protocol):
    """What the admin listener reads from the proxy (``kproxy.server.process.ProxyProcess``, every
    virtual cluster of the process)."""

    config: ProxyConfig

    def readiness(self) -> tuple[bool, str]: ...

    @property
    def metrics(self) -> ProcessMetrics | None: ...

    def rules(self) -> dict[str, Any]: ...

    def clients_view(self) -> dict[str, Any]: ...

    def switchable(self) -> dict[str, Any]:
        """The virtual clusters by name, each its ``kproxy.server.clusters.UpstreamClusters``."""


def public_config(value: Any, name: str = "") -> Any:
    """``value`` (a config object or part of it) as JSON data with every secret-looking setting
    replaced by ``<redacted>``. A root with virtual clusters shows the process-wide settings and,
    under ``virtual_clusters``, each one's own."""
    if name and value is not None and _SECRET_NAME.search(name) and not name.endswith(_PATH_SUFFIX):
        return REDACTED
    if isinstance(value, HostPort):
        return str(value)
    if isinstance(value, ProxyConfig) and value.virtual_clusters:
        own = cluster_settings(ProxyConfig)
        return {**{f.name: public_config(getattr(value, f.name), f.name) for f in attrs.fields(ProxyConfig)
                   if f.name in PROCESS_SETTINGS or f.name == "source"},
                "virtual_clusters": [{key: public_config(getattr(vc, key), key) for key in own}
                                     for vc in value.virtual_clusters]}
    if attrs.has(type(value)):
        return {f.name: public_config(getattr(value, f.name), f.name) for f in attrs.fields(type(value))}
    if isinstance(value, dict):
        return {str(k): public_config(v, str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [public_config(v) for v in value]
    return value


def rules_view(store: Any) -> dict[str, Any]:
    if store is None:
        return {"configured": False, "message": "no rule files are configured"}
    out: dict[str, Any] = {"configured": True}
    for key in ("generation", "rule_count", "reloads_ok", "reloads_failed"):
        out[key] = getattr(store, key, None)
    loaded = getattr(store, "loaded_at", None)
    seconds = epoch_seconds(loaded)
    out["loaded_at"] = seconds
    sources = getattr(store, "sources", None)
    out["sources"] = [str(s) for s in sources] if sources is not None else None
    describe = getattr(store, "describe", None)
    out["rules"] = describe() if callable(describe) else None
    return out


def bind(hp: HostPort) -> trio.SocketListener:
    family = socket.AF_INET6 if ":" in hp.host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((hp.host, hp.port))
        s.listen(64)
    except OSError as e:
        s.close()
        raise AdminListenError(f"cannot listen on {hp} (admin.listen): {e.strerror or e}") from e
    s.setblocking(False)
    return trio.SocketListener(trio.socket.from_stdlib_socket(s))


class AdminListenError(KProxyError):
    """The admin port cannot be bound."""


class AdminServer:
    def __init__(self, view: AdminView, listener: trio.SocketListener) -> None:
        self.view = view
        self.listener = listener
        self.requests = 0
        self.failures = 0       # answers that failed with a bug (500) and connections it ended

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.listener.socket.getsockname()[:2]
        return host, port

    async def serve(self) -> None:
        await trio.serve_listeners(self._handle, [self.listener])

    async def _handle(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_BYTES)
        try:
            while True:
                with trio.move_on_after(REQUEST_TIMEOUT_S) as timer:
                    request = await self._read_request(stream, conn)
                if timer.cancelled_caught or request is None:
                    return
                method = request.method.decode("ascii", "replace")
                target = request.target.decode("ascii", "replace")
                try:
                    status, ctype, body = await self.answer(method, target)
                except Exception:
                    # A bug in rendering (a metric reader, /config) fails this one answer; the
                    # listener, and the Kafka traffic sharing its process, go on.
                    self.failures += 1
                    log.exception("admin: %s %s failed; answered 500", method, safe(target))
                    status, ctype, body = 500, "text/plain; charset=utf-8", INTERNAL_ERROR
                self.requests += 1
                headers = [("content-type", ctype), ("content-length", str(len(body))),
                           ("cache-control", "no-store")]
                await stream.send_all(conn.send(h11.Response(status_code=status, headers=headers)))
                if request.method != b"HEAD":
                    await stream.send_all(conn.send(h11.Data(data=body)))
                await stream.send_all(conn.send(h11.EndOfMessage()))
                if conn.our_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
        except (h11.RemoteProtocolError, h11.LocalProtocolError) as e:
            log.debug("admin: bad HTTP request: %s", e)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception:
            # Anything else is a bug here; it must end this HTTP connection only, never the server's
            # nursery (trio.serve_listeners runs handlers in it).
            self.failures += 1
            log.exception("admin: connection failed")
        finally:
            await trio.aclose_forcefully(stream)

    @staticmethod
    async def _read_request(stream: trio.SocketStream, conn: h11.Connection) -> h11.Request | None:
        request: h11.Request | None = None
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                # An empty read is the peer closing: h11 turns it into ConnectionClosed (or an error
                # when a request was cut short).
                conn.receive_data(await stream.receive_some(8192))
                continue
            if isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.EndOfMessage):
                return request
            elif isinstance(event, h11.ConnectionClosed):
                return None

    async def answer(self, method: str, target: str) -> tuple[int, str, bytes]:
        """(status, content type, body); a supervisor's listener asks its workers instead."""
        if target.split("?", 1)[0] == "/switch":
            return await self.switch(method, target)
        return self.respond(method, target)

    async def switch(self, method: str, target: str) -> tuple[int, str, bytes]:
        """POST /switch?cluster=NAME[&virtual_cluster=VC]: move the virtual cluster (the only one, when
        VC is left out) to upstream cluster NAME; answers once new connections go there."""
        from kproxy.server.clusters import SwitchError, switch_answer

        if method != "POST":
            return 405, "text/plain; charset=utf-8", b"POST /switch?cluster=NAME[&virtual_cluster=VC]\n"
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(target).query)
        cluster = (query.get("cluster") or [""])[0]
        vc: str | None = query["virtual_cluster"][0] if query.get("virtual_cluster") else None
        groups = self.view.switchable()
        if not cluster:
            return 400, "text/plain; charset=utf-8", b"name the cluster: /switch?cluster=NAME\n"
        if vc is None:
            several = [name for name, g in groups.items() if len(g.clusters) > 1]
            if len(groups) == 1 or len(several) == 1:
                vc = next(iter(groups)) if len(groups) == 1 else several[0]
            else:
                return 400, "text/plain; charset=utf-8", (f"name the virtual cluster (virtual_cluster=...): one of "
                                                          f"{', '.join(sorted(groups))}\n").encode()
        group = groups.get(vc)
        if group is None:
            return 404, "text/plain; charset=utf-8", (f"no virtual cluster {safe(vc)!r}; there are "
                                                      f"{', '.join(sorted(groups))}\n").encode()
        log.info("admin: switch of virtual cluster %s to cluster %s requested", safe(vc), safe(cluster))
        try:
            report = await group.switch(cluster, "planned")
        except SwitchError as e:
            return 409, "text/plain; charset=utf-8", f"{e}\n".encode()
        return 200, "application/json", switch_answer(report)

    def respond(self, method: str, target: str) -> tuple[int, str, bytes]:
        """(status, content type, body) for one request: pure apart from reading the server."""
        path = target.split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            return 405, "text/plain; charset=utf-8", b"only GET and HEAD\n"
        view = self.view
        if path == "/metrics":
            metrics = view.metrics
            if metrics is None:
                return 404, "text/plain; charset=utf-8", b"metrics are off\n"
            return 200, PROMETHEUS_TEXT, metrics.exposition()
        if path == "/livez":
            return 200, "text/plain; charset=utf-8", b"ok\n"
        if path == "/readyz":
            ready, reason = view.readiness()
            return (200 if ready else 503), "text/plain; charset=utf-8", f"{reason}\n".encode()
        if path == "/config":
            return 200, "application/json", _json(public_config(view.config))
        if path == "/rules":
            return 200, "application/json", _json(view.rules())
        if path == "/clients":
            return 200, "application/json", _json(view.clients_view())
        if path == "/upstream":
            return 200, "application/json", _json({name: g.view() for name, g in view.switchable().items()})
        return 404, "text/plain; charset=utf-8", (b"not found; try /metrics, /livez, /readyz, /config, /rules, "
                                                 b"/clients, /upstream or POST /switch\n")


def _json(data: Any) -> bytes:
    return (json.dumps(data, indent=2, default=str) + "\n").encode()

"""The broker address map and the filter that rewrites every endpoint a client can see.

Which responses carry endpoints is read from the schema, not listed by hand: any struct with a
``host`` string and a ``port`` beside a node id (its own, or its parent's) is a broker endpoint. So a
new API or version that adds endpoints is rewritten as soon as its schema is written. Endpoints
without a node id (Kafka Streams application endpoints) are the client's own and are left alone.
Pure: a port exposed for the first time is only a promise until the I/O layer reports it bound
(``confirm``); the session asks for it to be opened before the response that names it is written.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import attrs

from kproxy.protocol.entities import node_id_fields, quorum_apis
from kproxy.protocol.errors import KProxyError
from kproxy.protocol.messages import Response, apis
from kproxy.protocol.schema import MessageSpec, StructSpec
from kproxy.proxy.fetch_bytes import WALKED_UP_TO as FETCH_WALKED_UP_TO
from kproxy.proxy.fetch_bytes import fetch_counts
from kproxy.proxy.filters import ConnectionContext, Filter
from kproxy.proxy.produce_bytes import WALKED_UP_TO, answer_endpoints

log = logging.getLogger("kproxy.addresses")


# KRaft quorum APIs (``to=quorum`` in the schema) name controller endpoints; a controller may share
# its node id with a broker (combined mode) while listening elsewhere, so controllers get ports of
# their own.
CONTROLLER_APIS = quorum_apis()
DESCRIBE_CLUSTER, CONTROLLER_ENDPOINTS = 60, 2
PRODUCE, FETCH, FETCH_SNAPSHOT, SHARE_FETCH, SHARE_ACKNOWLEDGE = 0, 1, 59, 78, 79


class AddressMapError(KProxyError):
    """A broker cannot be exposed: its node id falls outside the configured port range."""


@attrs.frozen(slots=True)
class Route:
    """Where a client connection on an exposed port or SNI name goes."""

    role: str             # "broker" or "controller"
    node_id: int
    upstream: tuple[str, int]


class AddressMap:
    """Upstream endpoints (learned from responses) and the endpoints kproxy exposes for them.

    Port-per-broker: node id -> port, either ``port_start + node_id - node_id_base`` (deterministic,
    so every kproxy replica agrees) or, without a base, in order of discovery. SNI: every node is
    exposed on the one TLS port as ``broker-<node_id>.<domain>``.
    """

    def __init__(self, advertised_host: str, port_start: int, port_count: int,
                 node_id_base: int | None = None, sni_domain: str | None = None,
                 sni_port: int | None = None) -> None:
        self.advertised_host = advertised_host
        self.port_start = port_start
        self.port_count = port_count
        self.node_id_base = node_id_base
        self.sni_domain = sni_domain
        self.sni_port = sni_port
        self._unconfirmed: set[int] = set()               # exposed, not yet reported bound
        self._unusable: dict[int, str] = {}               # ports that could not be bound, and why
        self._port_of: dict[tuple[str, int], int] = {}      # (role, node id) -> port
        self._routes: dict[int, Route] = {}                  # port -> route
        self._by_name: dict[str, Route] = {}                 # SNI name -> route
        self._next_broker = port_start
        self._next_controller = port_start + port_count - 1
        # Routes of a cluster the virtual cluster left (a switch): kept for their ports, leading
        # nowhere until the new cluster's node of that id is learned.
        self._stale: set[int] = set()
        self._stale_names: set[str] = set()
        # Bumped whenever what a rewrite gives could change (a node exposed, moved or withdrawn):
        # remembered rewritten answers (kproxy.proxy.memo) are keyed by it.
        self.generation = 0
        # Told after each move of ``generation`` (the server's lane forgets the rewrites it remembered).
        self.on_move: list[Callable[[], None]] = []

    def _moved(self) -> None:
        self.generation += 1
        for tell in self.on_move:
            tell()

    # -- learning and exposing

    def expose(self, role: str, node_id: int, host: str, port: int) -> tuple[str, int]:
        """Record the upstream endpoint of a node and return the endpoint clients should use."""
        upstream = (host, port)
        if self.sni_domain is not None:
            # route_for_name looks names up in lower case (DNS names are case-insensitive).
            name = f"{'broker' if role == 'broker' else 'controller'}-{node_id}.{self.sni_domain}".lower()
            route = Route(role, node_id, upstream)
            if self._by_name.get(name) != route or name in self._stale_names:
                self._by_name[name] = route
                self._stale_names.discard(name)
                self._moved()
            assert self.sni_port is not None
            return name, self.sni_port
        key = (role, node_id)
        exposed = self._port_of.get(key)
        if exposed is None:
            exposed = self._allocate(role, node_id)
            self._port_of[key] = exposed
            self._routes[exposed] = Route(role, node_id, upstream)
            self._unconfirmed.add(exposed)
            self._moved()
        elif self._routes[exposed].upstream != upstream or exposed in self._stale:
            # The node moved (new host or port), or is the new cluster's node of that id: the same
            # exposed port now leads to its new place.
            self._routes[exposed] = Route(role, node_id, upstream)
            self._stale.discard(exposed)
            self._moved()
        return self.advertised_host, exposed

    def forget_upstreams(self) -> None:
        """The virtual cluster moved to another upstream cluster: every exposed port and name keeps
        its node id (clients hold those addresses) but leads nowhere until that cluster's node of the
        id is learned (``expose``); meanwhile connections to it go through the bootstrap servers."""
        self._stale = set(self._routes)
        self._stale_names = set(self._by_name)
        self._moved()

    def pending_ports(self) -> list[int]:
        """Ports exposed but not yet reported bound."""
        return sorted(self._unconfirmed)

    def is_confirmed(self, port: int) -> bool:
        return port not in self._unconfirmed

    def confirm(self, port: int) -> None:
        """The I/O layer listens on ``port`` now."""
        self._unconfirmed.discard(port)

    def withdraw(self, port: int, reason: str) -> Route | None:
        """``port`` could not be bound: forget its route so it is never advertised again.

        In discovery order the node gets another port the next time a response names it; with
        ``node_id_base`` its port is fixed, so it stays unreachable and every attempt says why.
        """
        self._unconfirmed.discard(port)
        self._unusable[port] = reason
        self._moved()
        route = self._routes.pop(port, None)
        if route is not None:
            self._port_of.pop((route.role, route.node_id), None)
        return route

    def _allocate(self, role: str, node_id: int) -> int:
        end = self.port_start + self.port_count
        if role == "broker" and self.node_id_base is not None:
            port = self.port_start + node_id - self.node_id_base
            if not self.port_start <= port < end or port in self._routes:
                raise AddressMapError(
                    f"broker node {node_id} maps to port {port}, outside {self.port_start}-{end - 1} "
                    f"(exposure.node_id_base {self.node_id_base}); raise exposure.broker_port_count "
                    f"or set exposure.node_id_base to the lowest broker id")
            return port
        taken = self._routes.keys() | self._unusable.keys()
        if role == "broker":
            while self._next_broker in taken:
                self._next_broker += 1
            port = self._next_broker
        else:
            while self._next_controller in taken:
                self._next_controller -= 1
            port = self._next_controller
        if not self.port_start <= port < end:
            raise AddressMapError(f"no free port left in {self.port_start}-{end - 1} for {role} node "
                                  f"{node_id}; raise exposure.broker_port_count (the cluster has more "
                                  f"nodes than ports)")
        return port

    # -- routing client connections

    def route_for_port(self, port: int) -> Route | None:
        return self._routes.get(port) if port not in self._stale else None

    def route_for_name(self, server_name: str) -> Route | None:
        name = server_name.lower()
        return self._by_name.get(name) if name not in self._stale_names else None

    def route_for_node(self, node_id: int, role: str = "broker") -> Route | None:
        port = self._port_of.get((role, node_id))
        if port is not None:
            return self.route_for_port(port)
        for name, r in self._by_name.items():
            if r.node_id == node_id and r.role == role and name not in self._stale_names:
                return r
        return None

    def exposed_ports(self) -> list[int]:
        return sorted(self._routes)

    def upstream_endpoints(self) -> set[tuple[str, int]]:
        return {r.upstream for r in self._routes.values()} | {r.upstream for r in self._by_name.values()}


# ---------------------------------------------------------------------------------------------
# Where endpoints sit in each response, derived from the schema


@attrs.frozen(slots=True)
class _Step:
    field: str
    array: bool
    node_field: str | None     # node id field of the struct this step enters, if it has one


def _node_field(s: StructSpec, v: int) -> str | None:
    # The struct's own node id: a node id field of the schema (entity=broker), but not the cluster's
    # controller_id, which names another node than the endpoint beside it.
    return next((n for n in node_id_fields(s, v) if n != "controller_id"), None)


def _sites(s: StructSpec, v: int, has_node: bool, steps: tuple[_Step, ...],
           out: list[tuple[_Step, ...]], seen: frozenset[str]) -> None:
    present = {f.name: f for f in s.fields if v in f.versions}
    has_node = has_node or _node_field(s, v) is not None
    host, port = present.get("host"), present.get("port")
    if (host is not None and port is not None and host.type == "string" and not host.array
            and port.type in ("int32", "uint16") and has_node):
        out.append(steps)
    if s.name in seen:
        return
    for f in present.values():
        if f.type == "struct":
            assert f.struct is not None
            step = _Step(f.name, f.array, _node_field(f.struct, v))
            _sites(f.struct, v, has_node, (*steps, step), out, seen | {s.name})


def endpoint_sites(msg: MessageSpec, v: int) -> list[tuple[_Step, ...]]:
    """Paths from the message root to every broker endpoint struct in version ``v``."""
    out: list[tuple[_Step, ...]] = []
    _sites(msg.root, v, False, (), out, frozenset())
    return out


@functools.cache
def apis_with_endpoints() -> frozenset[int]:
    """The APIs some version of whose answer holds a broker endpoint (a walk of the whole schema,
    done once per process)."""
    keys = set()
    for key, api in apis().items():
        msg = api.response
        assert msg is not None and msg.versions.hi is not None
        if any(endpoint_sites(msg, v) for v in range(msg.versions.lo, msg.versions.hi + 1)):
            keys.add(key)
    return frozenset(keys)


# Answers with broker endpoints (KIP-951 hints) whose bodies change with every request.
_NEVER_REPEAT = frozenset({PRODUCE, FETCH, FETCH_SNAPSHOT, SHARE_FETCH, SHARE_ACKNOWLEDGE})


class AddressRewriter(Filter):
    """Rewrites every broker endpoint in responses to the one kproxy exposes for that node."""

    name = "addresses"
    reports_changes = True    # every endpoint it reaches is rewritten, dropped or blanked (``_rewrite``)
    # A Produce answer names brokers only when a leader moved (KIP-951): most have nothing to rewrite.
    reads_by_bytes = frozenset({PRODUCE, FETCH})

    def __init__(self, address_map: AddressMap) -> None:
        self.address_map = address_map
        self.response_api_keys = apis_with_endpoints()
        self._unexposable: set[tuple[str, int]] = set()   # nodes already reported as unexposable

    @staticmethod
    @functools.cache
    def _plan(api_key: int, api_version: int) -> tuple[str | None, tuple[tuple[_Step, ...], ...]]:
        """The answer's own node id field and its endpoint paths: the same for every rewriter, so
        worked out once per process for each API version met."""
        msg = apis()[api_key].response
        assert msg is not None
        return _node_field(msg.root, api_version), tuple(endpoint_sites(msg, api_version))

    def reads_response(self, api_key: int, api_version: int) -> bool:
        # Only versions with endpoints: Produce answers carry KIP-951's leader hints from v10 on.
        return bool(self._plan(api_key, api_version)[1])

    def reads_answer(self, api_key: int, api_version: int, frame: Any) -> bool:
        # Whether the answer carries node_endpoints (tag 0 of its body's closing tagged fields), when
        # the schema puts this version's only endpoints there and the walk knows its layout; None
        # (the answer cannot be walked) is read decoded, and the decoder says what is wrong with it.
        if api_key == FETCH:
            # A Fetch answer's only endpoints are its node_endpoints (v16+, ``sees_whole`` below); the
            # empty array some brokers always send (tansu) is nothing to rewrite.
            read = fetch_counts(None, frame, api_version) if api_version <= FETCH_WALKED_UP_TO else None
            return read is None or read[2]
        return not _endpoints_walked(api_version) or answer_endpoints(frame, api_version) is not False

    def lane_walks(self, api_key: int, api_version: int) -> bool:
        # reads_answer above is the node_endpoints walk wherever it walks at all (an answer it cannot
        # walk by its layout is always read, and stays out of the lane).
        if api_key == FETCH:
            return api_version <= FETCH_WALKED_UP_TO
        return api_key == PRODUCE and _endpoints_walked(api_version)

    def on_response(self, ctx: ConnectionContext, exchange: Any, response: Response) -> float:
        root_node, sites = self._plan(response.api_key, response.api_version)
        if not sites:
            return 0.0
        body = response.body
        # DescribeCluster v1+ lists controllers instead of brokers when asked for endpoint type 2
        # (KIP-919); as brokers they would take over the broker ports of the same node ids.
        role = "controller" if response.api_key in CONTROLLER_APIS or (
            response.api_key == DESCRIBE_CLUSTER and body.endpoint_type == CONTROLLER_ENDPOINTS) else "broker"
        node_id = getattr(body, root_node) if root_node is not None else None
        for steps in sites:
            if not self._walk(exchange, body, steps, 0, role, node_id):
                _blank(body)    # the endpoint is the body itself (FindCoordinator v0-3)
        return 0.0

    def memo_key(self, ctx: ConnectionContext, api_key: int) -> int | None:
        # A rewrite depends on the answer's bytes and the address map, nothing else (the role comes
        # from the api key and the body). Answers about data never repeat (records, offsets): each
        # would cost a copy and a decode to remember, and push out answers that do repeat.
        return None if api_key in _NEVER_REPEAT else self.address_map.generation

    def sees_whole(self, api_key: int, kind: str) -> bool:
        # A Fetch answer's only endpoints are KIP-951's node_endpoints, in its closing tagged fields:
        # a streamed answer has them rewritten at its end (``rewrite_node_endpoints``).
        if api_key == FETCH and kind == "response":
            return False
        return super().sees_whole(api_key, kind)

    def rewrite_node_endpoints(self, exchange: Any, endpoints: list) -> bool:
        """Rewrite a Fetch answer's node_endpoints in place, as ``on_response`` would (a node that
        cannot be exposed is left out; ports not yet open are asked of ``exchange``); whether
        anything was there to rewrite."""
        if not endpoints:
            return False
        kept = [e for e in endpoints if self._rewrite(exchange, e, "broker", e.node_id)]
        endpoints[:] = kept
        return True

    def _walk(self, exchange: Any, obj: Any, steps: tuple[_Step, ...], i: int, role: str,
              node_id: int | None) -> bool:
        """Rewrite the endpoints under ``obj``; False when ``obj`` itself is an endpoint to drop."""
        if i == len(steps):
            return self._rewrite(exchange, obj, role, node_id)
        step = steps[i]
        child = getattr(obj, step.field)
        if child is None:
            return True
        if not step.array:
            nid = getattr(child, step.node_field) if step.node_field is not None else node_id
            if not self._walk(exchange, child, steps, i + 1, role, nid):
                _blank(child)
            return True
        dropped = False
        for item in child:
            nid = getattr(item, step.node_field) if step.node_field is not None else node_id
            if not self._walk(exchange, item, steps, i + 1, role, nid):
                dropped = True
        if dropped and i + 1 == len(steps):
            # A node kproxy cannot expose is left out of the list: clients treat its partitions as
            # leaderless and retry, rather than being sent to the real broker behind kproxy.
            setattr(obj, step.field, [e for e in child if e.host != _DROP])
        return True

    def _rewrite(self, exchange: Any, endpoint: Any, role: str, node_id: int | None) -> bool:
        exchange.response_changed = True
        if node_id is None or node_id < 0 or not endpoint.host or endpoint.port <= 0:
            # FindCoordinator errors carry node -1, host "" and port -1: nothing to expose, but no
            # upstream detail may survive either.
            if endpoint.host:
                endpoint.host = ""
            return True
        amap = self.address_map
        try:
            host, port = amap.expose(role, node_id, endpoint.host, endpoint.port)
        except AddressMapError as e:
            if (role, node_id) not in self._unexposable:
                self._unexposable.add((role, node_id))
                log.error("cannot expose %s node %d: %s", role, node_id, e)
            endpoint.host = _DROP
            return False
        if not amap.is_confirmed(port):
            # Opened by the I/O layer before this answer is written (the session's Listen action).
            exchange.listen(port)
        endpoint.host, endpoint.port = host, port
        return True


@functools.cache
def _endpoints_walked(version: int) -> bool:
    """Whether ``answer_endpoints`` can tell if a Produce answer of this version has endpoints: the
    walk knows its layout, and the schema's only endpoints in it are the body's node_endpoints."""
    return version <= WALKED_UP_TO and AddressRewriter._plan(PRODUCE, version)[1] == (
        (_Step("node_endpoints", True, "node_id"),),)


# Marks an endpoint that must not reach the client (its node has no port); never a real host name.
_DROP = "\x00kproxy-unexposable"


def _blank(endpoint: Any) -> None:
    endpoint.host, endpoint.port = "", -1

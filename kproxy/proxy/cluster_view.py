"""What clients see of the cluster behind a virtual cluster, whichever upstream cluster it runs on.

- ``ClusterIdentity``: every answer that carries a cluster id (the schema says which: Metadata and
  DescribeCluster) carries the virtual cluster's own, so tools see one cluster, the same before and
  after a switch, and two virtual clusters on one upstream cluster are two clusters to them (KIP-78).
  Requests are left alone: only KRaft's replication and quorum requests name a cluster id (Fetch's
  tagged field, Vote...), which clients do not send, and a request filter on Fetch would cost every
  Fetch its forwarding as received.
- ``ReplicaNames``: a replica whose topics carry a prefix (MirrorMaker 2's default replication
  policy names the primary's ``orders`` ``primary.orders``): the prefix goes on every topic name of a
  request and comes off every name in the answer, with the tenant-prefix mechanism of
  ``kproxy.proxy.names``. It is two filters: the prefix goes on last (after a tenant's prefix) and
  comes off first (before the tenant's comes off).

Pure: the ids and prefixes are given when the server builds one filter chain per upstream cluster
(the id is ``ProxyConfig.presented_cluster_id``: ``cluster_id``, else derived from the name).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from kproxy.protocol.messages import Response, apis
from kproxy.proxy.filters import ALL, ConnectionContext, Filter, RequestVerdict, Respond
from kproxy.proxy.names import prefixes_of, uses_patterns

FETCH = 1
INVALID_REGULAR_EXPRESSION = 128

def _answers_with_cluster_id() -> frozenset[int]:
    """Api keys whose response has a ``cluster_id`` string at its root, in some version."""
    keys = set()
    for key, api in apis().items():
        msg = api.response
        if msg is not None and any(f.name == "cluster_id" and f.type == "string" for f in msg.root.fields):
            keys.add(key)
    return frozenset(keys)


class ClusterIdentity(Filter):
    """Answers carry ``cluster_id``: the virtual cluster's."""

    name = "cluster-id"
    reports_changes = True      # on_response marks each answer whose id it replaced

    def __init__(self, cluster_id: str) -> None:
        self.cluster_id = cluster_id
        self.upstream_id: str | None = None      # learned from the cluster's own answers
        self.response_api_keys = _answers_with_cluster_id()
        self._key = ("cluster-id", cluster_id)

    def on_response(self, ctx: ConnectionContext, exchange: Any, response: Response) -> float:
        body = response.body
        theirs = getattr(body, "cluster_id", None)
        if theirs is not None:
            self.upstream_id = theirs
        if theirs != self.cluster_id and hasattr(body, "cluster_id"):
            body.cluster_id = self.cluster_id
            exchange.response_changed = True
        return 0.0

    def memo_key(self, ctx: ConnectionContext, api_key: int) -> Hashable | None:
        return self._key

    def sees_whole(self, api_key: int, kind: str) -> bool:
        return False    # the id sits at the root of small answers; a streamed Fetch never has one


class ReplicaNames:
    """The two filters of one replica's topic prefix: ``outgoing`` (last in the chain) and
    ``incoming`` (first in the chain)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.outgoing = _PrefixOn(prefix)
        self.incoming = _PrefixOff(self.outgoing)


class _PrefixOn(Filter):
    """Puts the replica's prefix on every topic name a request carries."""

    name = "replica-names"
    request_api_keys = ALL

    def __init__(self, prefix: str) -> None:
        self.names = prefixes_of({"topic": prefix})

    def on_request(self, ctx: ConnectionContext, exchange: Any) -> RequestVerdict:
        req = exchange.request
        if uses_patterns(req):
            return Respond(error_code=INVALID_REGULAR_EXPRESSION,
                           error_message="kproxy: this cluster is a replica whose topics carry a prefix, which a "
                                         "name pattern cannot follow; subscribe by topic names")
        if self.names.put_on(req):
            # The answer's names come off again (kproxy's own answers to refusals never had them).
            exchange.keep(self, True)
        return None

    def sees_whole(self, api_key: int, kind: str) -> bool:
        # A name changes the frame's size; Produce by topic id (v13+) could stream, but no name-based
        # version can.
        return kind == "request"


class _PrefixOff(Filter):
    """Takes the replica's prefix off every topic name of an answer, and drops the replica's own
    topics (MirrorMaker 2's internal ones, heartbeats) from what clients see."""

    name = "replica-names-off"
    response_api_keys = ALL
    reports_changes = True

    def __init__(self, on: _PrefixOn) -> None:
        self.on = on
        self.names = on.names

    def on_response(self, ctx: ConnectionContext, exchange: Any, response: Response) -> float:
        if exchange.kept(self.on) and self.names.take_off(response, exchange.request.body):
            exchange.response_changed = True
        return 0.0

    def may_stream_response(self, ctx: ConnectionContext, exchange: Any) -> bool:
        # Fetch from v13 names topics by id only: nothing to take off, so it may stream.
        return exchange.api_key == FETCH and not self.names.undoing(FETCH, exchange.api_version)

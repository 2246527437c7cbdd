"""Who is connected, for the admin listener's ``/clients`` and ``kproxy top``: each live connection
and the most recently closed ones, with their client id, address, principal, listener, request count
and bytes.

Client ids show here whatever ``metrics.client_labels`` says, because this list is bounded by
connections, not by label values over time. Every string a client chose goes through ``kproxy.logs.safe``,
as in the logs; the principal is the verified one (``ConnectionContext.principal``), never a claim.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from kproxy.logs import safe
from kproxy.proxy.filters import ConnectionContext

# Rows in one /clients answer: enough for a busy gateway's view, small enough for a terminal and a
# scrape (a few hundred bytes a row).
MAX_LISTED = 500
RECENT_CLOSED = 200


class ClientRecord:
    """One connection's counters; the context is read at snapshot time while the connection lives
    (the client id arrives with the first request), and frozen when it closes."""

    __slots__ = ("closed_at", "ctx", "frozen", "lane", "opened_at", "request_bytes", "requests", "response_bytes")

    def __init__(self, ctx: ConnectionContext) -> None:
        self.ctx: ConnectionContext | None = ctx
        self.frozen: dict[str, Any] | None = None
        self.opened_at = time.time()
        self.closed_at: float | None = None
        self.requests = 0
        self.request_bytes = 0
        self.response_bytes = 0
        # The lane's handle while it holds the connection (its counts reach the fields above only when
        # it gives the connection back): read at each snapshot, so a laned connection's row is current.
        self.lane: Any = None

    def completed(self, request_bytes: int, response_bytes: int) -> None:
        self.requests += 1
        self.request_bytes += request_bytes
        self.response_bytes += response_bytes

    def add(self, requests: int, request_bytes: int, response_bytes: int) -> None:
        """Requests the lane relayed for this connection, counted when it gives the connection back."""
        self.requests += requests
        self.request_bytes += request_bytes
        self.response_bytes += response_bytes

    def identity(self) -> dict[str, Any]:
        if self.frozen is not None:
            return self.frozen
        ctx = self.ctx
        assert ctx is not None
        address = ctx.client_address
        return {
            "connection": ctx.connection_id,
            "client_id": None if ctx.client_id is None else safe(ctx.client_id),
            "address": None if address is None else safe(f"{address[0]}:{address[1]}"),
            "principal": None if ctx.principal is None else safe(ctx.principal),
            "listener": safe(ctx.listener),
            "software": None if ctx.client_software_name is None else safe(
                f"{ctx.client_software_name} {ctx.client_software_version or ''}".strip()),
        }

    def close(self) -> None:
        self.frozen = self.identity()
        self.ctx = None
        self.closed_at = time.time()

    def counts(self) -> tuple[int, int, int]:
        """Requests, request bytes and response bytes as of now, the lane's so far included."""
        if self.lane is None:
            return self.requests, self.request_bytes, self.response_bytes
        requests, request_bytes, response_bytes = self.lane.progress()
        return self.requests + requests, self.request_bytes + request_bytes, self.response_bytes + response_bytes

    def row(self, counts: tuple[int, int, int] | None = None) -> dict[str, Any]:
        requests, request_bytes, response_bytes = counts if counts is not None else self.counts()
        return {**self.identity(), "requests": requests, "request_bytes": request_bytes,
                "response_bytes": response_bytes, "opened_at": round(self.opened_at, 3),
                "closed_at": None if self.closed_at is None else round(self.closed_at, 3)}


class ClientTable:
    """The live connections and the last ``RECENT_CLOSED`` closed ones, in this process."""

    def __init__(self) -> None:
        self.live: dict[int, ClientRecord] = {}
        self.recent: deque[ClientRecord] = deque(maxlen=RECENT_CLOSED)

    def opened(self, ctx: ConnectionContext) -> ClientRecord:
        record = self.live[ctx.connection_id] = ClientRecord(ctx)
        return record

    def closed(self, record: ClientRecord) -> None:
        assert record.ctx is not None
        self.live.pop(record.ctx.connection_id, None)
        record.close()
        self.recent.append(record)

    def view(self, limit: int = MAX_LISTED) -> dict[str, Any]:
        """The JSON body of /clients: the busiest live connections first, then the newest closed."""
        live = sorted(((r, r.counts()) for r in self.live.values()), key=lambda rc: rc[1][1] + rc[1][2],
                      reverse=True)
        recent = list(reversed(self.recent))
        return {
            "time": round(time.time(), 3),
            "live": len(live),
            "connections": [r.row(counts) for r, counts in live[:limit]],
            "recent": [r.row() for r in recent[:limit]],
            "omitted": max(0, len(live) - limit) + max(0, len(recent) - limit),
        }

"""The lane: kproxy's own readiness loop in C (``_lane.c``), one thread per process without the GIL, to
which a plain connection is handed so that small frames are relayed without a trio task switch each.
It relays only what its table says the Python path would relay unread, checked by the very programs
``Session._relay`` runs, and gives the connection back at a frame boundary for anything else; it must
never decide what the Python path would decide otherwise, and never touch an fd after ``take`` or
``detach`` returned. Without a compiler there is no ``_lane`` and ``AVAILABLE`` is False."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

try:
    from kproxy.server import _lane  # type: ignore[attr-defined]
except ImportError:         # built without a compiler, or the accelerator is missing
    _lane = None

AVAILABLE = _lane is not None


@attrs.frozen
class LaneApi:
    """How the lane relays one (api_key, api_version): a request goes on only if both of the
    accelerator's programs pass it (``Session._relayable``'s ``programs[0]`` and ``[1]``)."""

    header: Any
    body: Any
    # session.py's ``_throttle_at``: 4 (right behind the answer's correlation id, header v0) or 5
    # (behind header v1's tagged fields, which the lane skips first); -1: no throttle time read.
    throttle_at: int = -1
    # Produce v10+ and Fetch v16+: each answer is walked first (the accelerator's endpoints walk, the
    # address rewriter's ``reads_answer``); one that carries node_endpoints, which name a broker behind
    # kproxy, or cannot be walked is not relayed: the connection is given back with it unread
    # (reason "endpoints" or "bad_answer") and the Python path rewrites or refuses it.
    walk: bool = False
    # An answer kproxy rewrites (Metadata): it goes to the client only as the Python path rewrote the
    # same bytes before (``Lane.memo_put`` under ``memo_class``); else the connection comes back with
    # the answer unread (reason "answer_unknown"). The class stands for everything the rewrite read
    # besides the bytes (``Session.lane_memo_class``).
    remember: bool = False
    memo_class: int = 0


@attrs.frozen
class LaneEntry:
    """A request sent to the broker and not answered when the lane gave the connection back."""

    client_correlation_id: int
    api_key: int
    api_version: int
    upstream_correlation_id: int
    age_s: float
    request: bytes          # as the client sent it, without the size prefix (b"" when no_response)
    no_response: bool       # Produce with acks=0: owed no answer; its id is kept for a broker that answers


@attrs.frozen
class Given:
    """The state of a connection the lane gave back (``LaneHandle.take``/``detach``)."""

    reason: str
    detail: str
    client_bytes: bytes
    broker_bytes: bytes
    next_correlation_id: int
    in_flight: tuple[LaneEntry, ...]
    requests: int
    bytes_in: int
    bytes_out: int
    quiet_s: float
    client_id: bytes | None
    # Bytes the lane had queued and the socket had not taken yet (a peer not reading): answers for
    # the client and requests for the broker, whole frames after a possibly partly written first one.
    # The caller writes them before anything else.
    client_out: bytes = b""
    broker_out: bytes = b""


@attrs.frozen
class ApiCounts:
    """What the lane relayed of one api key between two ``Lane.counts`` calls."""

    count: int
    request_bytes: int
    response_bytes: int
    latency_sum_s: float
    latencies: tuple[float, ...]
    throttle_ms_sum: int
    throttled: int


@attrs.frozen
class MemoCounts:
    """The lane's answer memo: entries and bytes now; hits, misses and entries stored in all."""

    entries: int
    bytes: int
    hits: int
    misses: int
    stored: int


def _given(t: tuple) -> Given:
    (reason, detail, client_bytes, broker_bytes, next_cid, entries, requests, bytes_in, bytes_out, quiet_s,
     client_id, client_out, broker_out) = t
    return Given(reason, detail, client_bytes, broker_bytes, next_cid,
                 tuple(LaneEntry(c, k, v, u, age, req, bool(nr)) for c, k, v, u, age, req, nr in entries),
                 requests, bytes_in, bytes_out, quiet_s, client_id, client_out, broker_out)


class LaneHandle:
    """One adopted connection. ``fd`` (an eventfd) becomes readable when the lane has given it back;
    it stays open until the handle is dropped."""

    __slots__ = ("_h", "fd")

    def __init__(self, handle: Any) -> None:
        self._h = handle
        self.fd: int = handle.fd

    def recall(self) -> None:
        """Give it back at the next frame boundary once nothing is in flight."""
        self._h.recall()

    def take(self) -> Given:
        """After ``fd`` is readable, exactly once: the lane no longer touches the fds."""
        return _given(self._h.take())

    def progress(self) -> tuple[int, int, int]:
        """Requests relayed, their bytes and the answers' bytes since adopt, as of now (``Given`` has
        the same at the give-back)."""
        counts: tuple[int, int, int] = self._h.progress()
        return counts

    def detach(self) -> Given:
        """Synchronous: the lane stops touching both fds before this returns. The reason is
        "detached", or the one it was given back for if that happened first."""
        return _given(self._h.detach())


class Lane:
    """One per process (per worker). Its thread starts at the first adopt and stops at close()."""

    def __init__(self, *, max_frame: int = 65536, write_limit: int = 256 * 1024) -> None:
        if _lane is None:
            raise RuntimeError("kproxy was built without its native lane (kproxy.server._lane)")
        self._lane = _lane.Lane(max_frame=max_frame, write_limit=write_limit)
        self.max_frame = max_frame
        self.write_limit = write_limit

    def adopt(self, client_fd: int, broker_fd: int, *, table: Mapping[tuple[int, int], LaneApi],
              next_correlation_id: int, client_bytes: bytes, client_id: bytes | None, max_in_flight: int,
              request_timeout_s: float, idle_timeout_s: float, frame_timeout_s: float) -> LaneHandle:
        """Relay this connection until something the lane does not take happens. Both fds must be
        non-blocking sockets; ``client_bytes`` starts at a frame boundary and holds at most
        ``max_frame + 4`` bytes. Timeouts of 0 are none."""
        apis = [(k, v, a.header, a.body, a.throttle_at, a.walk, a.remember, a.memo_class)
                for (k, v), a in table.items()]
        return LaneHandle(self._lane.adopt(client_fd, broker_fd, apis, next_correlation_id, client_bytes,
                                           client_id, max_in_flight, float(request_timeout_s),
                                           float(idle_timeout_s), float(frame_timeout_s)))

    def memo_put(self, memo_class: int, seen: bytes, tail: bytes) -> bool:
        """Remember that the broker's answer bytes ``seen`` (after its correlation id) go to a connection
        of ``memo_class`` as ``tail``. Bounded as ``AnswerMemo`` is (512 entries, 8 MiB, least recently
        used first out); False when the answer is larger than the lane relays."""
        stored: bool = self._lane.memo_put(memo_class, seen, tail)
        return stored

    def memo_clear(self) -> None:
        """Forget every remembered answer (what a rewrite reads changed: the address map moved)."""
        self._lane.memo_clear()

    def memo_counts(self) -> MemoCounts:
        """What the memo holds and has done since the lane was made."""
        return MemoCounts(*self._lane.memo_counts())

    def budget(self, limit: int | None, outside: int) -> int:
        """The process's buffer budget (``BufferBudget``; None: none) and the bytes the Python path
        holds of it: the lane reads no client while what every lane holds plus ``outside`` is at the
        limit, and looks again every 10 ms. Returns what every lane of the process holds now."""
        held: int = self._lane.budget(-1 if limit is None else limit, outside)
        return held

    def counts(self) -> dict[int, ApiCounts]:
        """Per api key, what the lane relayed since the previous call, across all its connections."""
        return {k: ApiCounts(*v) for k, v in self._lane.counts().items()}

    def close(self) -> None:
        """Give every connection back (reason "closed") and stop the thread."""
        self._lane.close()


def held_bytes() -> int:
    """What every lane of the process holds for its connections now: the buffers' capacity (input
    buffers start at 4 KiB and grow only to the frame a size prefix announces) and requests kept."""
    return _lane.held() if _lane is not None else 0


def path_counts() -> tuple[int, int, int, int]:
    """Process totals (adopted, given back, requests relayed, answers relayed), for tests."""
    return _lane.counts() if _lane is not None else (0, 0, 0, 0)

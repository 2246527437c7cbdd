"""The server's side of the lane (``kproxy.server.lane``): a virtual cluster's lane opened when the
``lane`` setting and the build allow it, the table entries a connection hands the lane, and what the
lane counted merged into the statistics and metrics before each scrape. The hand-over and give-back
themselves are the connection's (``ClientConnection._lane_turn`` in connection.py)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any

import attrs

from kproxy.protocol.messages import api_name

if TYPE_CHECKING:
    from kproxy.server.lane import ApiCounts, Lane, LaneApi
    from kproxy.server.stats import ProxyStats
    from kproxy.telemetry.metrics import Metrics

log = logging.getLogger("kproxy.server")

# The largest frame the lane relays: small requests and answers are what it is for (a larger one is
# given back and goes the Python path, which streams it when it is large enough).
LANE_MAX_FRAME = 65536


@functools.cache
def _lane_module() -> ModuleType | None:
    from kproxy.server import lane
    # Built without a C compiler: no lane, everything on the event loop.
    return lane if lane.AVAILABLE else None


def lane_built() -> bool:
    """Whether this installation has the lane (its C extension was built)."""
    return _lane_module() is not None


def open_lane(setting: str, frame_cap: int, stream_min_bytes: int | None) -> Lane | None:
    """The lane for one virtual cluster's connections, or None: ``lane: off``, or not built here.
    It relays no frame the Python path would stream (``cut_through_min_bytes``) or refuse."""
    module = _lane_module()
    if setting == "off" or module is None:
        if setting != "off":
            log.info("lane: not built in this installation (no C compiler); every connection stays on "
                     "the event loop")
        return None
    max_frame = min(LANE_MAX_FRAME, frame_cap)
    if stream_min_bytes is not None:
        max_frame = min(max_frame, stream_min_bytes - 1)
    lane: Lane = module.Lane(max_frame=max_frame)
    return lane


def lane_api(programs: tuple[Any, Any, int, bool, bool]) -> LaneApi:
    """The lane's table entry from ``Session.lane_programs`` (its memo class is set at each hand-over,
    ``lane_table``)."""
    module = _lane_module()
    assert module is not None
    api: LaneApi = module.LaneApi(header=programs[0], body=programs[1], throttle_at=programs[2],
                                  walk=programs[3], remember=programs[4])
    return api


def lane_table(apis: Mapping[tuple[int, int], LaneApi | None],
               memo_class: Callable[[int, int], int | None]) -> dict[tuple[int, int], LaneApi]:
    """The table a connection hands the lane: what it may relay, each answer served from the memo
    with its class as it is now (``Session.lane_memo_class``; left out when it has none)."""
    table = {}
    for pair, api in apis.items():
        if api is not None and api.remember:
            klass = memo_class(*pair)
            api = attrs.evolve(api, memo_class=klass) if klass is not None else None
        if api is not None:
            table[pair] = api
    return table


def merge_counts(counts: Mapping[int, ApiCounts], stats: ProxyStats, metrics: Metrics | None) -> None:
    """What the lane relayed since the last call, per api key, into the server's statistics and its
    metrics: requests, bytes, durations (from the lane's sample), the broker's throttle time."""
    for key, c in counts.items():
        if not c.count:
            continue
        stats.add_relayed(key, c.count, c.request_bytes, c.response_bytes, c.latency_sum_s, c.latencies)
        if metrics is not None:
            metrics.add_relayed(api_name(key), c.count, c.request_bytes, c.response_bytes, c.latency_sum_s,
                                c.latencies, c.throttle_ms_sum)

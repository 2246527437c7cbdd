"""The session's side of the lane, without sockets: which api versions the lane may take
(``Session.lane_programs``) and the requests it gives back (``Session.lane_returned``), whose
answers then go the session's own way."""

from __future__ import annotations

import attrs
import pytest

from kproxy.protocol.messages import body_class, decode_response
from kproxy.proxy.actions import ToClient
from kproxy.proxy.filters import Filter
from kproxy.proxy.session import _SKIP, Session
from tests.unit.test_session import make_session, request_frame, response_frame

pytestmark = pytest.mark.skipif(_SKIP is None, reason="the relay needs the accelerator's programs")

LIST_OFFSETS, METADATA, API_VERSIONS, PRODUCE, HEARTBEAT = 2, 3, 18, 0, 12


@attrs.frozen
class Given:
    """A ``kproxy.server.lane.LaneEntry`` as the lane hands one back."""

    client_correlation_id: int
    api_key: int
    api_version: int
    upstream_correlation_id: int
    age_s: float
    request: bytes
    no_response: bool = False


class Reads(Filter):
    name = "reads"
    response_api_keys = frozenset({HEARTBEAT})

    def on_response(self, ctx, exchange, response):
        return 0.0


def session(*filters: Filter, metrics: bool = False) -> Session:
    """A session as the server makes one with no traffic log or spans (``read_answers`` False), with
    metrics or not."""
    s = make_session(*filters)
    return Session(s.ctx, s.chain, read_answers=False, telemetry_reads=frozenset() if metrics else None)


def test_the_lane_takes_what_is_relayed_unread_both_ways_and_nothing_else() -> None:
    s = session()
    got = s.lane_programs(LIST_OFFSETS, 7)
    assert got is not None and got[2] == -1       # no throttle read without metrics
    assert s.lane_programs(HEARTBEAT, 4) is not None
    assert s.lane_programs(PRODUCE, 9) is not None
    assert s.lane_programs(METADATA, 12) is None        # names are learned from its answers
    assert s.lane_programs(API_VERSIONS, 3) is None     # the session reads it
    assert session(Reads()).lane_programs(HEARTBEAT, 4) is None   # a filter reads the answer
    assert make_session().lane_programs(HEARTBEAT, 4) is None     # telemetry reads every exchange


def test_with_metrics_produce_and_fetch_stay_and_the_throttle_offset_goes_along() -> None:
    s = session(metrics=True)
    assert s.lane_programs(PRODUCE, 9) is None and s.lane_programs(1, 12) is None
    got = s.lane_programs(HEARTBEAT, 4)
    assert got is not None and got[2] == 5       # header v1: behind its tagged fields
    assert s.lane_programs(HEARTBEAT, 3)[2] == 4  # type: ignore[index]


def test_an_entry_given_back_is_answered_as_one_the_session_relayed() -> None:
    s = session()
    hb = body_class(HEARTBEAT, "request")(group_id="g", generation_id=1, member_id="m")
    request = bytes(request_frame(HEARTBEAT, 4, 77, hb))
    s.lane_returned([Given(77, HEARTBEAT, 4, 41, 0.5, request)], next_correlation_id=42, requests=5,
                    client_id="app", now=10.0, broker=("b", 1))
    assert s.requests == 6 and s.next_correlation_id == 42 and len(s.open) == 1
    entry = next(iter(s.open))
    assert entry.started == 9.5 and entry.forwarded_at == 9.5 and entry.seq == 6
    answer = response_frame(HEARTBEAT, 4, 41, body_class(HEARTBEAT, "response")(error_code=0))
    actions = s.upstream_frame(memoryview(answer))
    assert len(actions) == 1 and type(actions[0]) is ToClient
    reply = b"".join(bytes(b) for b in actions[0].buffers)
    assert decode_response(memoryview(reply[4:]), HEARTBEAT, 4).correlation_id == 77
    assert not s.in_flight


def test_an_acks_zero_produce_given_back_is_done_and_its_late_answer_dropped() -> None:
    s = session()
    s.lane_returned([Given(5, PRODUCE, 9, 3, 0.1, b"", no_response=True)], next_correlation_id=4, requests=1,
                    client_id=None, now=1.0, broker=None)
    assert s.requests == 1 and not s.open
    answer = response_frame(PRODUCE, 9, 3, body_class(PRODUCE, "response")(responses=[]))
    assert s.upstream_frame(memoryview(answer)) == []

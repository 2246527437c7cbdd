"""verify_reencode: sampled frames are re-encoded before filters and compared with the bytes received;
a frame that re-encodes differently is counted, logged once per API version and direction, and its
own bytes go on (unless a filter changed it); the check off costs a session nothing."""

from __future__ import annotations

import logging

import pytest

from kproxy.protocol.messages import Request, body_class
from kproxy.proxy.actions import ToClient, ToUpstream
from kproxy.proxy.filters import ALL, AskBroker, Filter, FilterChain
from kproxy.proxy.reencode import ReencodeCheck, first_difference
from kproxy.proxy.session import Session
from tests.unit.test_session import (
    Clock,
    ConnectionContext,
    metadata_request,
    metadata_response,
    request_frame,
    response_frame,
    wire,
)

API_VERSIONS = 18


def session(check: ReencodeCheck | None, *filters: Filter) -> Session:
    return Session(ConnectionContext(1, clock=Clock()), FilterChain(filters), reencode=check)


def non_minimal_api_versions(correlation_id: int) -> bytes:
    """ApiVersions v3 whose client_software_name length is a two-byte varint where one would do:
    valid Kafka, but kproxy writes lengths minimally, so its re-encoding differs."""
    body = body_class(API_VERSIONS, "request")(client_software_name="abcd", client_software_version="1.0")
    frame = bytes(request_frame(API_VERSIONS, 3, correlation_id, body))
    at = frame.index(b"\x05abcd")
    return frame[:at] + b"\x85\x00" + frame[at + 1:]


def test_matching_frames_are_counted_and_re_encoded() -> None:
    check = ReencodeCheck(1.0)
    s = session(check)
    up, = s.client_frame(request_frame(3, 12, 5, metadata_request()))
    assert isinstance(up, ToUpstream)
    down, = s.upstream_frame(memoryview(response_frame(3, 12, 0, metadata_response())))
    assert isinstance(down, ToClient)
    assert (check.checked, check.mismatches) == (2, 0)


def test_a_mismatch_forwards_the_bytes_received_and_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    check = ReencodeCheck(1.0)
    s = session(check)
    for cid in (1, 2):
        frame = non_minimal_api_versions(cid)
        up, = s.client_frame(memoryview(frame))
        sent = wire(up)
        # Only kproxy's correlation id differs from what the client sent.
        assert sent[:4] == frame[:4] and sent[8:] == frame[8:] and sent[4:8] == (cid - 1).to_bytes(4, "big")
    assert (check.checked, check.mismatches) == (2, 2)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "api_versions v3 request" in warnings[0] and "first difference at byte" in warnings[0]


class RenameClient(Filter):
    name = "rename"
    request_api_keys = ALL

    def on_request(self, ctx, exchange):
        request = exchange.request
        request.client_id = "renamed"
        return None


def test_a_filter_change_wins_over_the_original_bytes() -> None:
    check = ReencodeCheck(1.0)
    up, = session(check, RenameClient()).client_frame(memoryview(non_minimal_api_versions(1)))
    assert b"renamed" in wire(up) and check.mismatches == 1


def test_the_rate_samples_every_nth_frame() -> None:
    check = ReencodeCheck(0.25)
    assert [check.due() for _ in range(8)] == [False, False, False, True] * 2


def test_first_difference() -> None:
    a = bytes(range(256)) * 40
    for at in (0, 63, 64, 5000, len(a) - 1):
        b = bytearray(a)
        b[at] ^= 1
        assert first_difference(a, bytes(b)) == at
    assert first_difference(a, a[:100]) == 100


class AskFirst(Filter):
    """Asks the broker about every ApiVersions request, then lets it through unchanged."""

    name = "ask-first"
    request_api_keys = frozenset({API_VERSIONS})

    def on_request(self, ctx, exchange):
        return AskBroker(Request.build(3, 12, 0, "kproxy", metadata_request()), lambda answer: None)


def test_the_bytes_received_still_go_on_after_a_filter_asked_the_broker() -> None:
    check = ReencodeCheck(1.0)
    s = session(check, AskFirst())
    frame = non_minimal_api_versions(1)
    (ask,) = s.client_frame(memoryview(frame))
    question_id = int.from_bytes(wire(ask)[4:8], "big")
    (up,) = s.upstream_frame(memoryview(response_frame(3, 12, question_id, metadata_response())))
    sent = wire(up)
    assert sent[:4] == frame[:4] and sent[8:] == frame[8:]

"""Produce v10+ and Fetch v16+ in the lane: each answer is walked for KIP-951's node_endpoints before it
is relayed (``LaneApi.walk``). A clean answer goes on; one naming a broker, or one the walk cannot read,
gives the connection back with that answer unread, and the session then rewrites or refuses it as it
does any answer. Over real sockets on 127.0.0.1 (``test_lane``'s Link and fake broker), then through a
``Session`` with the address rewriter, as the server hands a given-back connection over."""

from __future__ import annotations

import struct
from typing import Any

import pytest

from kproxy.protocol.compiler import whole_skip
from kproxy.protocol.messages import decode_response, request_codecs
from kproxy.proxy.actions import Close, ToClient
from kproxy.proxy.addresses import AddressMap, AddressRewriter
from kproxy.proxy.filters import ConnectionContext, Filter, FilterChain
from kproxy.proxy.session import Session
from kproxy.server import lane as lane_module
from kproxy.server.lane import Given, Lane, LaneApi

from .test_fetch_relay import _fetch_answer, _fetch_request
from .test_lane import Link, frame, frames_of, given_back, lane, link  # noqa: F401 (fixtures)
from .test_produce_relay import RECORDS, _answer, _request
from .test_session import FETCH, PRODUCE, Clock, response_frame

pytestmark = pytest.mark.skipif(not lane_module.AVAILABLE, reason="the lane is native")

UPSTREAM = b"kafka-1.internal"
CASES = [pytest.param(PRODUCE, 10, id="produce-v10"), pytest.param(PRODUCE, 11, id="produce-v11"),
         pytest.param(PRODUCE, 13, id="produce-v13"), pytest.param(FETCH, 16, id="fetch-v16"),
         pytest.param(FETCH, 18, id="fetch-v18")]


def _walked(api_key: int, version: int, walk: bool = True) -> dict[tuple[int, int], LaneApi]:
    header, body = request_codecs(api_key, version)
    return {(api_key, version): LaneApi(whole_skip(header), whole_skip(body), -1, walk)}


def _request_frame(api_key: int, version: int, cid: int) -> bytes:
    body = _request(version, 1, RECORDS) if api_key == PRODUCE else _fetch_request(version)
    return frame(api_key, version, cid, body)


def _answer_tail(api_key: int, version: int, how: str) -> bytes:
    """An answer's bytes after its correlation id: "clean" (no endpoints; for Fetch, tansu's empty
    node_endpoints array), "endpoints" (the broker's own address in node_endpoints) or "malformed"
    (node_endpoints announced with more bytes than the answer holds)."""
    if api_key == PRODUCE:
        body = _answer(version, RECORDS, {("orders", 1): 6} if how == "endpoints" else {})
        if how == "endpoints":
            body.node_endpoints = [type(body).NodeEndpoint(node_id=1, host=UPSTREAM.decode(), port=9092)]
    else:
        body = _fetch_answer(version, endpoints=how == "endpoints")
    tail = response_frame(api_key, version, 0, body)[4:]
    if how == "clean" and api_key == FETCH:
        assert tail.endswith(b"\x00")
        tail = tail[:-1] + b"\x01\x00\x01\x01"        # tag 0 present, an empty array (tansu's way)
    if how == "malformed":
        assert tail.endswith(b"\x00")
        tail = tail[:-1] + b"\x01\x00\x20" + UPSTREAM
    return tail


def _answering(hows: list[str], api_key: int, version: int) -> Any:
    """The fake broker's reply: the answers named in ``hows``, in turn, each with its request's id."""
    tails = iter([_answer_tail(api_key, version, h) for h in hows])

    def reply(f: bytes) -> bytes:
        answer = f[4:8] + next(tails)
        return struct.pack(">i", len(answer)) + answer
    return reply


@pytest.mark.parametrize(("api_key", "version"), CASES)
def test_a_clean_answer_is_relayed(lane: Lane, link: Link, api_key: int, version: int) -> None:  # noqa: F811
    link.broker.reply = _answering(["clean", "clean"], api_key, version)
    handle = link.adopt(lane, table=_walked(api_key, version))
    link.client.sendall(_request_frame(api_key, version, 5) + _request_frame(api_key, version, 6))
    tails = [_answer_tail(api_key, version, "clean")] * 2
    got = frames_of(link.recv_exactly(sum(8 + len(t) for t in tails)))
    assert got == [struct.pack(">i", 5) + tails[0], struct.pack(">i", 6) + tails[1]]
    handle.recall()
    back = given_back(handle)
    assert (back.reason, back.requests, back.in_flight, back.broker_bytes) == ("recalled", 2, (), b"")


@pytest.mark.parametrize(("api_key", "version"), CASES)
@pytest.mark.parametrize(("how", "reason"), [("endpoints", "endpoints"), ("malformed", "bad_answer")])
def test_an_answer_naming_a_broker_or_unreadable_is_given_back_unread(
        lane: Lane, link: Link, api_key: int, version: int, how: str, reason: str) -> None:  # noqa: F811
    link.broker.reply = _answering(["clean", how], api_key, version)
    handle = link.adopt(lane, table=_walked(api_key, version))
    link.client.sendall(_request_frame(api_key, version, 5) + _request_frame(api_key, version, 6))
    back = given_back(handle)
    assert back.reason == reason and f"api {api_key} v{version} answer" in back.detail
    # The answer before it was relayed, and dropped; this one is handed back exact, its request still
    # owed, and the client got nothing of it.
    clean = struct.pack(">i", 5) + _answer_tail(api_key, version, "clean")
    assert frames_of(link.recv_exactly(4 + len(clean))) == [clean]
    (entry,) = back.in_flight
    assert back.broker_bytes[8:] == _answer_tail(api_key, version, how)
    assert back.broker_bytes[4:8] == struct.pack(">i", entry.upstream_correlation_id)
    assert (entry.client_correlation_id, back.requests, back.client_out) == (6, 2, b"")
    link.client.setblocking(False)
    with pytest.raises(BlockingIOError):
        link.client.recv(1)
    # Through the session, as the server hands it over: rewritten to kproxy's address, or refused.
    out = _session_takes(back)
    if how == "endpoints":
        assert isinstance(out[-1], ToClient)
        sent = b"".join(bytes(b) for b in out[-1].buffers)[4:]
        assert UPSTREAM not in sent and struct.pack(">i", 9092) not in sent
        body = decode_response(memoryview(sent), api_key, version)
        assert body.correlation_id == 6
        assert [(e.host, e.port) for e in body.body.node_endpoints] == [("proxy.example", 19000)]
    else:
        assert isinstance(out[-1], Close) and "malformed" in out[-1].reason
        assert not any(isinstance(a, ToClient) for a in out)


def test_without_the_walk_an_answer_with_endpoints_is_relayed_raw(lane: Lane, link: Link) -> None:  # noqa: F811
    # What the flag guards: the same answer in a table entry without it goes straight to the client
    # (the session never puts such an entry in the table; see test_session_lane_endpoints below).
    link.broker.reply = _answering(["endpoints"], PRODUCE, 11)
    handle = link.adopt(lane, table=_walked(PRODUCE, 11, walk=False))
    link.client.sendall(_request_frame(PRODUCE, 11, 5))
    tail = _answer_tail(PRODUCE, 11, "endpoints")
    assert UPSTREAM in link.recv_exactly(8 + len(tail))
    handle.detach()


def test_only_produce_and_fetch_answers_are_walked(lane: Lane, link: Link) -> None:  # noqa: F811
    with pytest.raises(ValueError, match="only Produce and Fetch"):
        link.adopt(lane, table=_walked(12, 4))


def _rewriter() -> AddressRewriter:
    return AddressRewriter(AddressMap("proxy.example", 19000, 16))


def _session(*filters: Filter, metrics: bool = False) -> Session:
    return Session(ConnectionContext(1, clock=Clock()), FilterChain(list(filters)), read_answers=False,
                   telemetry_reads=frozenset() if metrics else None)


def _session_takes(back: Given) -> list:
    """A session with the address rewriter takes the connection back and reads the broker's bytes."""
    s = _session(_rewriter())
    s.lane_returned(back.in_flight, back.next_correlation_id, back.requests, "app", 10.0, ("b", 1))
    (size,) = struct.unpack_from(">i", back.broker_bytes)
    assert size == len(back.broker_bytes) - 4
    return s.upstream_frame(memoryview(back.broker_bytes[4:]))


class ReadsProduceBytes(Filter):
    """A filter that reads Produce answers by their bytes with a check of its own (not the lane's walk)."""

    name = "reads-bytes"
    response_api_keys = frozenset({PRODUCE})
    reads_by_bytes = frozenset({PRODUCE})

    def reads_response(self, api_key: int, api_version: int) -> bool:
        return True

    def on_response(self, ctx: Any, exchange: Any, response: Any) -> float:
        return 0.0


def test_session_lane_endpoints() -> None:
    s = _session(_rewriter())
    for key, version, walk in ((PRODUCE, 9, False), (PRODUCE, 10, True), (PRODUCE, 13, True),
                               (FETCH, 15, False), (FETCH, 16, True), (FETCH, 18, True)):
        got = s.lane_programs(key, version)
        assert got is not None and got[3] is walk, (key, version)
    # Metrics read Produce and Fetch records from their bytes: not laned, walk or not.
    metered = _session(_rewriter(), metrics=True)
    assert metered.lane_programs(PRODUCE, 11) is None and metered.lane_programs(FETCH, 16) is None
    # Another guard that reads the answer's bytes its own way keeps it out of the lane.
    assert _session(_rewriter(), ReadsProduceBytes()).lane_programs(PRODUCE, 11) is None
    assert _session(ReadsProduceBytes()).lane_programs(PRODUCE, 9) is None
    # The heartbeat's entry is unchanged: nothing to walk.
    assert _session(_rewriter()).lane_programs(12, 4)[3] is False      # type: ignore[index]

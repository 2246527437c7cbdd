"""The lane's answer memo (``_lane.c``'s remembered_answer, fed by ``AnswerMemo.to_lane``) over real
sockets: an answer the address rewriter reads goes to the client only as the Python path rewrote the
same bytes before, with the client's correlation id; any other is given back unread, and the Python
path answers it rewritten. The memo is bounded, and a class the connection does not carry misses."""
# ruff: noqa: F811

from __future__ import annotations

import struct
import threading
from typing import Any

import pytest

from kproxy.protocol.compiler import whole_skip
from kproxy.protocol.messages import (
    Request,
    body_class,
    decode_response,
    encode_request_frame,
    request_codecs,
)
from kproxy.proxy.actions import Listen, ToClient
from kproxy.proxy.addresses import AddressMap, AddressRewriter
from kproxy.proxy.filters import ConnectionContext, FilterChain
from kproxy.proxy.memo import AnswerMemo
from kproxy.proxy.session import Session
from kproxy.proxy.topics import TopicNames
from kproxy.server import lane as lane_module
from kproxy.server.lane import Lane, LaneApi

from .test_answer_memo import metadata_answer

# test_lane's fixtures, used by name as arguments (ruff's F811 reads each argument as a redefinition).
from .test_lane import Link, frame, frames_of, given_back, lane, link, readable, wait_for  # noqa: F401
from .test_session import METADATA, metadata_request, response_frame

FIND_COORDINATOR = 10

pytestmark = pytest.mark.skipif(not lane_module.AVAILABLE, reason="the lane is native")

PROXY = "proxy.example"
BROKERS = [(1, "b1.internal", 9092), (2, "b2.internal", 9092)]


def remembering(klass: int, version: int = 12) -> dict[tuple[int, int], LaneApi]:
    header, body = request_codecs(METADATA, version)
    return {(METADATA, version): LaneApi(whole_skip(header), whole_skip(body), 5, remember=True, memo_class=klass)}


def metadata(cid: int, version: int = 12) -> bytes:
    return frame(METADATA, version, cid, metadata_request(()))


def broker_answer(up_cid: int, tail: bytes) -> bytes:
    return struct.pack(">ii", 4 + len(tail), up_cid) + tail


SEEN = b"\x00\x00\x00\x00 the broker's own addresses"
TAIL = b"\x00\x00\x00\x00 kproxy's addresses, rewritten"


def test_a_remembered_answer_goes_out_rewritten_with_the_clients_correlation_id(lane: Lane, link: Link) -> None:
    assert lane.memo_put(7, SEEN, TAIL)
    link.broker.reply = lambda f: broker_answer(struct.unpack_from(">i", f, 4)[0], SEEN)
    handle = link.adopt(lane, table=remembering(7))
    link.client.sendall(metadata(41) + metadata(42))
    want = struct.pack(">ii", 4 + len(TAIL), 41) + TAIL + struct.pack(">ii", 4 + len(TAIL), 42) + TAIL
    assert link.recv_exactly(len(want)) == want
    handle.recall()
    got = given_back(handle)
    assert (got.reason, got.requests, got.bytes_out) == ("recalled", 2, len(want))
    counts = lane.memo_counts()
    assert (counts.hits, counts.misses, counts.entries) == (2, 0, 1)
    assert lane.counts()[METADATA].response_bytes == len(want)


def test_an_answer_not_remembered_is_given_back_unread_and_never_relayed(lane: Lane, link: Link) -> None:
    lane.memo_put(7, SEEN, TAIL)
    other = b"\x00\x00\x00\x00 a broker that moved"
    replies = iter([SEEN, other])
    link.broker.reply = lambda f: broker_answer(struct.unpack_from(">i", f, 4)[0], next(replies))
    handle = link.adopt(lane, table=remembering(7))
    link.client.sendall(metadata(41))
    first = link.recv_exactly(8 + len(TAIL))
    assert first[8:] == TAIL
    link.client.sendall(metadata(42))
    got = given_back(handle)
    # Exactly the broker's answer comes back, with the request it answers: nothing of it reached the
    # client.
    assert got.reason == "answer_unknown" and "not in the lane's memo" in got.detail
    assert got.broker_bytes == broker_answer(1001, other)
    assert [(e.client_correlation_id, e.upstream_correlation_id) for e in got.in_flight] == [(42, 1001)]
    assert not readable(link.client.fileno(), 0.1)
    assert lane.memo_counts().misses == 1


def test_a_class_the_connection_does_not_carry_misses(lane: Lane, link: Link) -> None:
    lane.memo_put(7, SEEN, TAIL)
    link.broker.reply = lambda f: broker_answer(struct.unpack_from(">i", f, 4)[0], SEEN)
    handle = link.adopt(lane, table=remembering(8))
    link.client.sendall(metadata(41))
    got = given_back(handle)
    assert got.reason == "answer_unknown" and got.broker_bytes == broker_answer(1000, SEEN)


def test_a_cleared_memo_misses(lane: Lane, link: Link) -> None:
    lane.memo_put(7, SEEN, TAIL)
    lane.memo_clear()
    assert lane.memo_counts().entries == 0
    link.broker.reply = lambda f: broker_answer(struct.unpack_from(">i", f, 4)[0], SEEN)
    handle = link.adopt(lane, table=remembering(7))
    link.client.sendall(metadata(41))
    assert given_back(handle).reason == "answer_unknown"


def test_after_a_recall_a_remembered_answer_is_given_back_unread(lane: Lane, link: Link) -> None:
    # A rules reload recalls the connection: what its class stood for may have changed (names wanted).
    gate = threading.Event()
    lane.memo_put(7, SEEN, TAIL)

    def reply(f: bytes) -> bytes:
        gate.wait(5)
        return broker_answer(struct.unpack_from(">i", f, 4)[0], SEEN)
    link.broker.reply = reply
    handle = link.adopt(lane, table=remembering(7))
    link.client.sendall(metadata(41))
    wait_for(lambda: bool(link.broker.received))
    handle.recall()
    gate.set()
    got = given_back(handle)
    assert (got.reason, got.broker_bytes) == ("recalled", broker_answer(1000, SEEN))
    assert [e.client_correlation_id for e in got.in_flight] == [41]


def test_an_answer_over_max_frame_is_a_bad_answer_and_one_is_never_remembered(link: Link) -> None:
    small = Lane(max_frame=64)
    try:
        big = broker_answer(1000, b"x" * 100)
        link.broker.reply = lambda f: big
        handle = link.adopt(small, table=remembering(7))
        link.client.sendall(metadata(41))
        got = given_back(handle)
        assert got.reason == "bad_answer" and big.startswith(got.broker_bytes)
        assert not small.memo_put(7, b"y" * 61, b"")        # larger than the lane relays: not kept
        assert not small.memo_put(7, b"", b"z" * 61)
        assert small.memo_put(7, b"y" * 60, b"z" * 60)
    finally:
        small.close()


def test_garbage_from_the_broker_is_given_back_unread(lane: Lane, link: Link) -> None:
    garbage = broker_answer(1000, b"\xff" * 3)
    link.broker.reply = lambda f: garbage
    handle = link.adopt(lane, table=remembering(7))
    link.client.sendall(metadata(41))
    got = given_back(handle)
    assert (got.reason, got.broker_bytes) == ("answer_unknown", garbage)
    assert not readable(link.client.fileno(), 0.1)


def test_the_memo_is_bounded_in_entries_and_bytes(lane: Lane) -> None:
    for i in range(600):
        lane.memo_put(1, b"seen %d" % i, b"tail")
    counts = lane.memo_counts()
    assert (counts.entries, counts.stored) == (512, 600)
    for i in range(200):
        lane.memo_put(2, b"%d" % i + b"s" * 30000, b"t" * 30000)
    counts = lane.memo_counts()
    assert counts.bytes <= 8 << 20 and counts.entries < 512
    assert counts.bytes > (8 << 20) - 2 * 60100     # full, less at most two entries' worth
    # The least recently used goes first (a put of what is there already counts as a use and stores
    # nothing new).
    lane.memo_clear()
    for i in range(512):
        lane.memo_put(3, b"%d" % i, b"t")
    lane.memo_put(3, b"0", b"t")
    stored = lane.memo_counts().stored
    lane.memo_put(3, b"new", b"t")          # pushes out "1", the least recently used
    lane.memo_put(3, b"0", b"t")
    assert lane.memo_counts().stored == stored + 1      # "0" was still there
    lane.memo_put(3, b"1", b"t")
    assert lane.memo_counts().stored == stored + 2      # "1" was not
    assert lane.memo_counts().entries == 512


# -- fed by the session's memo, served as the session would


class Recorder:
    """A lane's memo_put, recorded."""

    def __init__(self) -> None:
        self.puts: list[tuple[int, bytes, bytes]] = []

    def memo_put(self, klass: int, seen: bytes, tail: bytes) -> bool:
        self.puts.append((klass, seen, tail))
        return True


def python_path(sink: Any, names: TopicNames | None = None) -> tuple[AddressMap, Session]:
    m = AddressMap(PROXY, 19000, 16)
    memo = AnswerMemo()
    memo.lane = sink
    s = Session(ConnectionContext(1), FilterChain([AddressRewriter(m)]), memo=memo, read_answers=False,
                topic_names=names)
    return m, s


def ask(s: Session, cid: int, body: Any, version: int = 12) -> bytes:
    """A Metadata exchange through the session; the bytes the client got (no size prefix)."""
    return exchange(s, METADATA, version, cid, body_class(METADATA, "request")(topics=[]), body)


def exchange(s: Session, api_key: int, version: int, cid: int, request: Any, body: Any) -> bytes:
    """One exchange through the session; the bytes the client got (no size prefix)."""
    req = Request.build(api_key, version, cid, "app", request)
    out = s.client_frame(memoryview(b"".join(encode_request_frame(req))[4:]))
    up = struct.unpack_from(">i", bytes(out[-1].buffers[0]), 8)[0]
    got = s.upstream_frame(memoryview(response_frame(api_key, version, up, body)))
    sent = got[-1]
    assert isinstance(sent, ToClient)
    for a in got:
        if isinstance(a, Listen):
            for p in a.ports:
                s.chain.filters[0].address_map.confirm(p)       # type: ignore[attr-defined]
    return b"".join(bytes(b) for b in sent.buffers)[4:]


def test_the_session_feeds_the_lane_each_rewrite_it_remembers_or_serves() -> None:
    recorder = Recorder()
    m, s = python_path(recorder)
    body = metadata_answer(BROKERS)
    ask(s, 1, body)                       # new ports: not remembered
    assert recorder.puts == []
    sent = ask(s, 2, body)
    seen = response_frame(METADATA, 12, 0, body)[4:]
    klass = s.lane_memo_class(METADATA, 12)
    assert recorder.puts == [(klass, seen, sent[4:])]
    ask(s, 3, body)                       # served from the session's memo: the lane learns it again
    assert recorder.puts[-1] == (klass, seen, sent[4:]) and len(recorder.puts) == 2
    # The class is the address map's state: when it moves, the class does.
    m.expose("broker", 3, "b3.internal", 9092)
    assert s.lane_memo_class(METADATA, 12) not in (None, klass)


def test_the_lane_serves_metadata_from_memory_only_with_a_lane_and_while_no_names_are_learned() -> None:
    _, s = python_path(Recorder())
    got = s.lane_programs(METADATA, 12)
    assert got is not None and got[4] is True and got[3] is False and got[2] == 5       # throttle behind header v1's tags
    assert python_path(None)[1].lane_programs(METADATA, 12) is None    # no lane to feed
    names = TopicNames()
    learning = [False]
    names.want(lambda: learning[0])
    _, s = python_path(Recorder(), names)
    assert s.lane_programs(METADATA, 12) is not None
    learning[0] = True
    # The lane cannot teach the table what a served answer names (Metadata v10+): while anything
    # learns names, such a version stays on the Python path; one that names no ids may go.
    assert s.lane_programs(METADATA, 12) is None
    assert s.lane_programs(METADATA, 9) is not None


def test_a_session_and_a_lane_answer_alike(lane: Lane, link: Link) -> None:
    """The Python path answers, remembers and feeds the real lane; the laned connection then gets the
    very bytes the Python path sent for the same broker answer, with its own correlation id."""
    _, s = python_path(lane)
    body = metadata_answer(BROKERS)
    ask(s, 1, body)
    sent = ask(s, 2, body)
    assert lane.memo_counts().entries == 1
    programs = s.lane_programs(METADATA, 12)
    assert programs is not None
    table = {(METADATA, 12): LaneApi(programs[0], programs[1], programs[2], programs[3], programs[4],
                                     s.lane_memo_class(METADATA, 12) or 0)}
    link.broker.reply = lambda f: struct.pack(">i", len(response_frame(METADATA, 12, 0, body))) + response_frame(
        METADATA, 12, struct.unpack_from(">i", f, 4)[0], body)
    handle = link.adopt(lane, table=table)
    link.client.sendall(metadata(77))
    (answer,) = frames_of(link.recv_exactly(4 + len(sent)))
    assert answer == struct.pack(">i", 77) + sent[4:]
    resp = decode_response(memoryview(answer), METADATA, 12)
    assert [(b.host, b.port) for b in resp.body.brokers] == [(PROXY, 19000), (PROXY, 19001)]
    handle.recall()
    assert given_back(handle).reason == "recalled"


def test_a_find_coordinator_answer_from_the_lane_is_the_sessions_rewrite(lane: Lane, link: Link) -> None:
    """FindCoordinator v4, a consumer's look-up of its group coordinator: the Python path rewrites the
    coordinator's address and feeds the lane; the laned connection then gets those very bytes with its
    own correlation id, and never the broker's address."""
    _, s = python_path(lane)
    answer_cls = body_class(FIND_COORDINATOR, "response")
    body = answer_cls(coordinators=[answer_cls.Coordinator(key="g1", node_id=2, host="b2.internal", port=9092)])
    request = body_class(FIND_COORDINATOR, "request")(key_type=0, coordinator_keys=["g1"])
    exchange(s, FIND_COORDINATOR, 4, 1, request, body)          # a new port: not remembered yet
    sent = exchange(s, FIND_COORDINATOR, 4, 2, request, body)
    assert lane.memo_counts().entries == 1
    programs = s.lane_programs(FIND_COORDINATOR, 4)
    assert programs is not None and programs[4] is True         # served only as remembered
    table = {(FIND_COORDINATOR, 4): LaneApi(programs[0], programs[1], programs[2], programs[3], programs[4],
                                            s.lane_memo_class(FIND_COORDINATOR, 4) or 0)}
    link.broker.reply = lambda f: struct.pack(">i", len(response_frame(FIND_COORDINATOR, 4, 0, body))) + response_frame(
        FIND_COORDINATOR, 4, struct.unpack_from(">i", f, 4)[0], body)
    handle = link.adopt(lane, table=table)
    link.client.sendall(frame(FIND_COORDINATOR, 4, 77, request))
    (answer,) = frames_of(link.recv_exactly(4 + len(sent)))
    assert answer == struct.pack(">i", 77) + sent[4:]
    resp = decode_response(memoryview(answer), FIND_COORDINATOR, 4)
    assert [(c.key, c.node_id, c.host, c.port) for c in resp.body.coordinators] == [("g1", 2, PROXY, 19000)]
    assert lane.memo_counts().hits == 1
    handle.recall()
    assert given_back(handle).reason == "recalled"

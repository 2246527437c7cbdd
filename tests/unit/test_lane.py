"""The lane (``kproxy/server/_lane.c`` through ``lane.py``) over real TCP sockets on 127.0.0.1: a test
client on one side, a fake broker in a thread on the other that answers each request with its
correlation id. What each side receives must be what a straight relay would give, and whatever the
lane does not take comes back exact, with nothing relayed past it."""

from __future__ import annotations

import contextlib
import itertools
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kproxy.protocol.compiler import whole_skip
from kproxy.protocol.messages import request_codecs
from kproxy.server import lane as lane_module
from kproxy.server.budget import BufferBudget
from kproxy.server.lane import Given, Lane, LaneApi, held_bytes, path_counts

from .test_session import HEARTBEAT, METADATA, PRODUCE, heartbeat_request, metadata_request, produce_request
from .test_session import request_frame as session_request_frame

pytestmark = pytest.mark.skipif(not lane_module.AVAILABLE, reason="the lane is native")

WAIT_S = 5.0


def programs(api_key: int, version: int) -> LaneApi:
    header, body = request_codecs(api_key, version)
    return LaneApi(whole_skip(header), whole_skip(body), 4)


TABLE = {(HEARTBEAT, 4): programs(HEARTBEAT, 4), (PRODUCE, 9): programs(PRODUCE, 9)}


def frame(api_key: int, version: int, cid: int, body, client_id: str = "app") -> bytes:
    """A request frame with its size prefix."""
    f = bytes(session_request_frame(api_key, version, cid, body, client_id))
    return struct.pack(">i", len(f)) + f


def heartbeat(cid: int, client_id: str = "app") -> bytes:
    return frame(HEARTBEAT, 4, cid, heartbeat_request(), client_id)


def frames_of(data: bytes) -> list[bytes]:
    """Whole frames (without size prefixes) in data; asserts nothing is left over."""
    out, pos = [], 0
    while pos < len(data):
        (n,) = struct.unpack_from(">i", data, pos)
        out.append(data[pos + 4:pos + 4 + n])
        pos += 4 + n
    assert pos == len(data)
    return out


def answer(cid: int, payload: bytes = b"\x00\x00\x00\x00ok") -> bytes:
    """An answer: header v0 (the correlation id), then a throttle time of 0 and a few bytes."""
    return struct.pack(">ii", 4 + len(payload), cid) + payload


class Broker:
    """A fake broker on 127.0.0.1: answers every request with its correlation id, unless `hold` is
    set (then it keeps the requests), or `reply` gives other bytes for a request frame."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.received: list[bytes] = []
        self.hold = threading.Event()
        self.stop_reading = threading.Event()
        self.reply: Callable[[bytes], bytes] | None = None
        self.conn: socket.socket | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            # Closed before anyone connected: a test whose adopt was refused never dials the broker.
            return
        self.conn = conn
        buf = b""
        # The thread closes what it accepted: close() may run before self.conn is set (a test that
        # ends right after dialling), and a socket left to the collector fails the test it lands in
        # with a ResourceWarning.
        with conn, contextlib.suppress(OSError):
            while True:
                while self.stop_reading.is_set():
                    time.sleep(0.05)
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
                while len(buf) >= 4 and len(buf) >= 4 + struct.unpack_from(">i", buf)[0]:
                    (n,) = struct.unpack_from(">i", buf)
                    f, buf = buf[4:4 + n], buf[4 + n:]
                    self.received.append(f)
                    if not self.hold.is_set():
                        conn.sendall(self.reply(f) if self.reply else answer(struct.unpack_from(">i", f, 4)[0]))

    def close(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(OSError):
                self.conn.shutdown(socket.SHUT_RDWR)
            self.conn.close()
        self.listener.close()


class Link:
    """client <-> (proxy_client fd | lane | proxy_broker fd) <-> broker, all on 127.0.0.1."""

    def __init__(self) -> None:
        self.broker = Broker()
        front = socket.create_server(("127.0.0.1", 0))
        self.client = socket.create_connection(front.getsockname())
        self.proxy_client, _ = front.accept()
        front.close()
        self.proxy_broker = socket.create_connection(self.broker.listener.getsockname())
        for s in (self.proxy_client, self.proxy_broker):
            s.setblocking(False)
        self.client.settimeout(WAIT_S)

    def adopt(self, lane: Lane, client_bytes: bytes = b"", table=None, **kw):
        args = dict(table=TABLE if table is None else table, next_correlation_id=1000, client_bytes=client_bytes,
                    client_id=b"app", max_in_flight=16, request_timeout_s=0, idle_timeout_s=0,
                    frame_timeout_s=0)
        args.update(kw)
        return lane.adopt(self.proxy_client.fileno(), self.proxy_broker.fileno(), **args)

    def recv_exactly(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            got = self.client.recv(n - len(data))
            assert got, f"the client got {len(data)} of {n} bytes, then end of stream"
            data += got
        return data

    def close(self) -> None:
        for s in (self.client, self.proxy_client, self.proxy_broker):
            s.close()
        self.broker.close()


@pytest.fixture
def lane() -> Iterator[Lane]:
    lane = Lane(max_frame=65536, write_limit=256 * 1024)
    yield lane
    lane.close()


@pytest.fixture
def link() -> Iterator[Link]:
    link = Link()
    yield link
    link.close()


def readable(fd: int, timeout: float) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout * 1000))


def given_back(handle, timeout: float = WAIT_S) -> Given:
    assert readable(handle.fd, timeout), "the lane did not give the connection back"
    return handle.take()


def wait_for(predicate: Callable[[], bool], timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_relays_requests_and_answers_rewriting_correlation_ids(lane: Lane, link: Link) -> None:
    before = path_counts()
    handle = link.adopt(lane)
    sent = [heartbeat(7), heartbeat(8), heartbeat(9)]
    link.client.sendall(b"".join(sent))
    answers = frames_of(link.recv_exactly(3 * len(answer(0))))
    assert [struct.unpack_from(">i", a)[0] for a in answers] == [7, 8, 9]
    # The broker got the client's bytes with kproxy's correlation ids, in order.
    assert [f[4:8] for f in link.broker.received] == [struct.pack(">i", i) for i in (1000, 1001, 1002)]
    assert [f[:4] + f[8:] for f in link.broker.received] == [s[4:8] + s[12:] for s in sent]
    handle.recall()
    got = given_back(handle)
    assert got.reason == "recalled"
    assert (got.next_correlation_id, got.requests, got.in_flight, got.client_bytes) == (1003, 3, (), b"")
    assert got.bytes_in == sum(map(len, sent)) and got.bytes_out == 3 * len(answer(0))
    after = path_counts()
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1, 3, 3]
    counted = lane.counts()[HEARTBEAT]
    assert (counted.count, counted.request_bytes, counted.response_bytes) == (3, got.bytes_in, got.bytes_out)
    assert len(counted.latencies) == 3 and counted.latency_sum_s == pytest.approx(sum(counted.latencies))
    assert lane.counts() == {}


def test_frame_not_in_table_given_back_exact_with_nothing_relayed_past_it(lane: Lane, link: Link) -> None:
    handle = link.adopt(lane)
    other = frame(METADATA, 12, 5, metadata_request())
    rest = other + heartbeat(6)
    link.client.sendall(heartbeat(4) + rest)
    got = given_back(handle)
    assert (got.reason, got.client_bytes) == ("frame", rest)
    assert "not in the lane's table" in got.detail
    assert len(link.broker.received) == 1 and got.requests == 1
    assert frames_of(link.recv_exactly(len(answer(0)))) == [answer(4)[4:]]


def test_client_bytes_at_adopt_are_relayed(lane: Lane, link: Link) -> None:
    handle = link.adopt(lane, client_bytes=heartbeat(1) + heartbeat(2)[:5])
    link.client.sendall(heartbeat(2)[5:])
    assert frames_of(link.recv_exactly(2 * len(answer(0)))) == [answer(1)[4:], answer(2)[4:]]
    handle.detach()


def test_detach_while_busy_returns_what_is_in_flight(lane: Lane, link: Link) -> None:
    link.broker.hold.set()
    handle = link.adopt(lane)
    sent = heartbeat(11)
    link.client.sendall(sent + heartbeat(12)[:10])
    wait_for(lambda: len(link.broker.received) == 1)
    got = handle.detach()
    assert got.reason == "detached"
    assert [(e.client_correlation_id, e.upstream_correlation_id, e.request) for e in got.in_flight] == [
        (11, 1000, sent[4:])]
    # The partial frame behind it may or may not have been read yet, but if so from its start.
    assert heartbeat(12)[:10].startswith(got.client_bytes)
    with pytest.raises(RuntimeError):
        handle.take()


def test_broker_closing_returns_requests_in_flight(lane: Lane, link: Link) -> None:
    link.broker.hold.set()
    handle = link.adopt(lane)
    link.client.sendall(heartbeat(1) + heartbeat(2))
    wait_for(lambda: len(link.broker.received) == 2)
    link.broker.close()
    got = given_back(handle)
    assert got.reason == "broker_closed"
    assert [e.request for e in got.in_flight] == [heartbeat(1)[4:], heartbeat(2)[4:]]
    assert [e.upstream_correlation_id for e in got.in_flight] == [1000, 1001]


def test_client_closing_is_given_back(lane: Lane, link: Link) -> None:
    handle = link.adopt(lane)
    link.client.close()
    assert given_back(handle).reason == "client_closed"


def test_changed_client_id_is_a_frame_given_back(lane: Lane, link: Link) -> None:
    handle = link.adopt(lane)
    link.client.sendall(heartbeat(1, "other"))
    got = given_back(handle)
    assert (got.reason, got.client_bytes) == ("frame", heartbeat(1, "other"))
    assert "client id" in got.detail


def test_produce_acks_0_owes_no_answer(lane: Lane, link: Link) -> None:
    link.broker.reply = lambda f: b""      # a broker that does not answer acks=0 (Kafka's way)
    handle = link.adopt(lane)
    sent = frame(PRODUCE, 9, 3, produce_request(acks=0))
    link.client.sendall(sent)
    wait_for(lambda: len(link.broker.received) == 1)
    handle.recall()
    got = given_back(handle)
    assert got.reason == "recalled" and got.requests == 1
    assert [(e.no_response, e.upstream_correlation_id) for e in got.in_flight] == [(True, 1000)]


def test_request_failing_its_check_is_given_back(lane: Lane, link: Link) -> None:
    good = heartbeat(1)
    bad = struct.pack(">i", len(good) - 6) + good[4:-2]     # the body cut short: the decoder refuses it
    handle = link.adopt(lane)
    link.client.sendall(bad + good)
    got = given_back(handle)
    assert (got.reason, got.client_bytes, got.requests) == ("frame", bad + good, 0)
    assert "fails its check" in got.detail
    assert link.broker.received == []


def test_frame_over_max_frame_is_given_back(link: Link) -> None:
    lane = Lane(max_frame=64)
    try:
        handle = link.adopt(lane)
        big = frame(HEARTBEAT, 4, 1, heartbeat_request(), client_id="c" * 80)
        link.client.sendall(heartbeat(1) + big)
        got = given_back(handle)
        assert got.reason == "frame" and got.client_bytes == big[:len(got.client_bytes)]
        assert got.requests == 1 and "8 to 64" in got.detail
    finally:
        lane.close()


def test_answer_out_of_order_is_a_bad_answer_given_back_exact(lane: Lane, link: Link) -> None:
    wrong = answer(999_999, b"\x00\x00\x00\x00??")
    link.broker.reply = lambda f: wrong
    handle = link.adopt(lane)
    link.client.sendall(heartbeat(5))
    got = given_back(handle)
    assert (got.reason, got.broker_bytes) == ("bad_answer", wrong)
    assert "999999 where 1000 is owed" in got.detail
    assert [e.client_correlation_id for e in got.in_flight] == [5]


def test_answer_over_max_frame_is_a_bad_answer(link: Link) -> None:
    lane = Lane(max_frame=64)
    try:
        big = answer(1000, b"x" * 100)
        link.broker.reply = lambda f: big
        handle = link.adopt(lane)
        link.client.sendall(heartbeat(5))
        got = given_back(handle)
        assert got.reason == "bad_answer" and big.startswith(got.broker_bytes) and len(got.broker_bytes) >= 4
    finally:
        lane.close()


def test_request_timeout(lane: Lane, link: Link) -> None:
    link.broker.hold.set()
    handle = link.adopt(lane, request_timeout_s=0.2, idle_timeout_s=30, frame_timeout_s=30)
    started = time.monotonic()
    link.client.sendall(heartbeat(1))
    got = given_back(handle)
    assert got.reason == "request_timeout" and 0.2 <= time.monotonic() - started < 2
    assert got.in_flight[0].age_s >= 0.2


def test_idle_timeout(lane: Lane, link: Link) -> None:
    handle = link.adopt(lane, request_timeout_s=30, idle_timeout_s=0.2, frame_timeout_s=30)
    link.client.sendall(heartbeat(1))
    assert frames_of(link.recv_exactly(len(answer(0)))) == [answer(1)[4:]]
    got = given_back(handle)
    assert got.reason == "idle" and got.quiet_s >= 0.2 and got.requests == 1


def test_no_idle_timeout_while_a_request_is_in_flight(lane: Lane, link: Link) -> None:
    link.broker.hold.set()
    handle = link.adopt(lane, request_timeout_s=0.6, idle_timeout_s=0.2, frame_timeout_s=30)
    link.client.sendall(heartbeat(1))
    assert given_back(handle).reason == "request_timeout"


def test_frame_timeout(lane: Lane, link: Link) -> None:
    handle = link.adopt(lane, request_timeout_s=30, idle_timeout_s=30, frame_timeout_s=0.2)
    part = heartbeat(1)[:9]
    link.client.sendall(part)
    got = given_back(handle)
    assert (got.reason, got.client_bytes) == ("frame_timeout", part)


def test_recall_waits_for_what_is_in_flight(lane: Lane, link: Link) -> None:
    link.broker.hold.set()
    handle = link.adopt(lane)
    link.client.sendall(heartbeat(1))
    wait_for(lambda: len(link.broker.received) == 1)
    handle.recall()
    assert not readable(handle.fd, 0.2)
    assert link.broker.conn is not None
    link.broker.conn.sendall(answer(1000))
    got = given_back(handle)
    assert got.reason == "recalled" and got.in_flight == ()
    assert frames_of(link.recv_exactly(len(answer(0)))) == [answer(1)[4:]]


def test_close_gives_every_connection_back(link: Link) -> None:
    lane = Lane()
    handle = link.adopt(lane)
    lane.close()
    assert given_back(handle, 0).reason == "closed"
    with pytest.raises(RuntimeError):
        link.adopt(lane)


def test_client_not_reading_stops_the_lane_reading_the_broker(link: Link) -> None:
    """Backpressure to the broker: answers pile up only to write_limit (plus one frame) in the lane,
    then the lane stops reading, the broker's socket fills and it stops sending."""
    lane = Lane(max_frame=65536, write_limit=128 * 1024)
    try:
        link.client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        big = b"\x00\x00\x00\x00" + b"a" * 60_000
        link.broker.reply = lambda f: answer(struct.unpack_from(">i", f, 4)[0], big)
        handle = link.adopt(lane, max_in_flight=400)
        link.client.sendall(b"".join(heartbeat(i) for i in range(400)))   # 24 MB of answers owed
        sent = -1
        while sent != len(link.broker.received):      # until the broker stops getting anywhere
            sent = len(link.broker.received)
            time.sleep(0.3)
        got = handle.detach()
        assert len(got.client_out) <= 128 * 1024 + 65536 + 4
        assert len(got.broker_bytes) <= 65536 + 4
        assert got.reason == "detached"
        answered = 400 - len(got.in_flight)
        assert answered * 60_000 < 8 * 1024 * 1024       # the rest is still in the broker or its socket
        assert len(got.in_flight) > 0
    finally:
        lane.close()


def test_broker_not_reading_stops_the_lane_reading_the_client(link: Link) -> None:
    """Backpressure to the client: requests pile up only to write_limit (plus one frame) in the
    lane, then it stops reading the client, whose sends stall."""
    lane = Lane(max_frame=65536, write_limit=64 * 1024)
    try:
        link.broker.stop_reading.set()
        wait_for(lambda: link.broker.conn is not None)
        for s, opt in ((link.proxy_broker, socket.SO_SNDBUF), (link.client, socket.SO_SNDBUF),
                       (link.proxy_client, socket.SO_RCVBUF)):
            s.setsockopt(socket.SOL_SOCKET, opt, 16384)
        handle = link.adopt(lane, max_in_flight=65536)
        sent = flood(link, 0.5)
        got = handle.detach()
        assert (got.reason, got.detail) == ("detached", "detached by the caller")
        # What the lane took is what was sent, but for the client's and our sockets' small buffers.
        assert 0 <= sent - got.requests * len(heartbeat(1)) - len(got.client_bytes) < 1024 * 1024
        assert len(got.broker_out) >= 64 * 1024      # the lane stopped reading because of it
        assert len(got.broker_out) <= 64 * 1024 + 65536 + 4
        assert len(got.client_bytes) <= 65536 + 4
        assert sent < 8 * 1024 * 1024
    finally:
        lane.close()


def test_buffers_grow_to_a_large_frame_and_shrink_once_it_has_gone(lane: Lane, link: Link) -> None:
    """Memory bounded by the bytes received: a connection's input buffers start at 4 KiB, grow to
    the frame a size prefix announces (relayed whole), and go back to 4 KiB about a second later."""
    before = held_bytes()
    big = b"\x00\x00\x00\x00" + b"a" * 50_000
    link.broker.reply = lambda f: answer(struct.unpack_from(">i", f, 4)[0], big)
    handle = link.adopt(lane)
    assert held_bytes() - before == 2 * 4096         # the two input buffers; no output buffer yet
    link.client.sendall(heartbeat(7))
    got = link.recv_exactly(len(answer(7, big)))
    assert got == answer(7, big)
    grown = held_bytes() - before
    assert grown >= 2 * 50_000                      # the broker's input buffer and the client's output one
    assert grown <= 4 * 4096 + 2 * (50_008 + 4096)
    wait_for(lambda: held_bytes() - before == 4 * 4096, timeout=3.0)
    link.client.sendall(heartbeat(8))               # still relays after shrinking
    assert link.recv_exactly(len(answer(8, big))) == answer(8, big)
    handle.detach()
    del handle                                      # the lane frees it at once
    wait_for(lambda: held_bytes() == before)


def flood(link: Link, quiet_s: float = 0.3) -> int:
    """Sends heartbeats without waiting until the client's socket takes nothing for quiet_s; the bytes sent."""
    link.client.setblocking(False)
    chunk, sent, quiet_since = heartbeat(1) * 500, 0, time.monotonic()
    while time.monotonic() - quiet_since < quiet_s:
        try:
            sent += link.client.send(chunk[sent % len(chunk):])
            quiet_since = time.monotonic()
        except BlockingIOError:
            time.sleep(0.01)
    return sent


def test_buffer_budget_stops_the_lane_reading_clients_until_there_is_room(link: Link) -> None:
    """With the process's budget exhausted the lane reads no client (a broker that keeps every request
    unanswered makes it hold them all), and it reads again within its 10 ms poll once there is room."""
    lane = Lane(max_frame=65536, write_limit=1 << 20)
    try:
        link.broker.hold.set()
        for s, opt in ((link.client, socket.SO_SNDBUF), (link.proxy_client, socket.SO_RCVBUF)):
            s.setsockopt(socket.SOL_SOCKET, opt, 16384)
        before = held_bytes()
        limit = before + 64 * 1024
        assert lane.budget(limit, 0) == before
        handle = link.adopt(lane, max_in_flight=65536)
        sent = flood(link)
        taken = len(link.broker.received)
        held = held_bytes() - before
        # It stopped at the limit, overshooting by at most what one read brought (a receive buffer's
        # worth, kept twice: queued for the broker and as a request in flight).
        assert 64 * 1024 <= held <= 64 * 1024 + 3 * (65536 + 4)
        assert sent - taken * len(heartbeat(1)) > 8 * 1024      # the rest waits in the sockets
        time.sleep(0.1)
        assert len(link.broker.received) == taken               # paused, not slowed
        # The Python path's bytes count too: room in the limit, but not with what Python holds.
        lane.budget(limit + 1024 * 1024, 1024 * 1024)
        time.sleep(0.1)
        assert len(link.broker.received) == taken
        lane.budget(limit + 1024 * 1024, 0)                     # room: it reads the client again
        wait_for(lambda: len(link.broker.received) > taken)
        got = handle.detach()
        assert got.reason == "detached"
        assert got.requests * len(heartbeat(1)) > taken * len(heartbeat(1))
    finally:
        lane.close()


def test_buffer_budget_counts_the_lanes_bytes_and_wakes_python_readers_when_they_go(lane: Lane,
                                                                                      link: Link) -> None:
    """The Python path's budget is exhausted by what a lane holds, and a client pump waiting for room
    goes on once the lane lets go of it (the lane does not tell: the wait looks again every 10 ms)."""
    before = held_bytes()
    handles = [link.adopt(lane, client_bytes=struct.pack(">i", 60_000) + b"\x00" * 2000)]  # a frame begun
    laned = held_bytes() - before
    assert laned == (2004 + 4096) + 4096
    budget = BufferBudget(before + laned)
    budget.attach_lane(lane)
    assert budget.exhausted and budget.used == 0 and budget.total() == before + laned
    waited: list[float] = []

    async def main() -> None:
        async def wait() -> None:
            started = trio.current_time()
            await budget.wait_for_room()
            waited.append(trio.current_time() - started)

        with trio.fail_after(WAIT_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(wait)
                await trio.sleep(0.1)
                assert not waited
                handles.pop().detach()          # and dropped: the lane frees what it held
                await trio.to_thread.run_sync(wait_for, lambda: held_bytes() < before + laned)

    trio.run(main)
    assert waited and waited[0] >= 0.1 and not budget.exhausted
    budget.detach_lane(lane)


def cut(data: bytes, points: list[int]) -> list[bytes]:
    at = sorted({p % (len(data) + 1) for p in points} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(at)]


def send_cut(sock: socket.socket, pieces: list[bytes]) -> None:
    """Each piece in its own send, a moment apart, so the lane mostly receives them apart."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for p in pieces:
        sock.sendall(p)
        time.sleep(0.0005)


requests_st = st.lists(st.tuples(st.sampled_from(["heartbeat", "produce"]), st.integers(0, 2**31 - 1)),
                       min_size=1, max_size=6)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=requests_st, client_cuts=st.lists(st.integers(0, 10**6), max_size=8),
       broker_cuts=st.lists(st.integers(0, 10**6), max_size=8))
def test_frames_cut_anywhere_relay_as_a_straight_relay_would(lane: Lane, requests, client_cuts,
                                                             broker_cuts) -> None:
    sent = [heartbeat(cid) if kind == "heartbeat" else frame(PRODUCE, 9, cid, produce_request(acks=1))
            for kind, cid in requests]
    link = Link()
    try:
        link.broker.hold.set()
        handle = link.adopt(lane)
        send_cut(link.client, cut(b"".join(sent), client_cuts))
        wait_for(lambda: len(link.broker.received) == len(sent))
        # The broker gets each request as sent, with kproxy's correlation ids in order.
        assert link.broker.received == [
            s[4:8] + struct.pack(">i", 1000 + i) + s[12:] for i, s in enumerate(sent)]
        answers = [answer(1000 + i, bytes([i]) * (3 + i)) for i in range(len(sent))]
        assert link.broker.conn is not None
        send_cut(link.broker.conn, cut(b"".join(answers), broker_cuts))
        expected = [struct.pack(">i", cid) + a[8:] for (_, cid), a in zip(requests, answers, strict=True)]
        assert frames_of(link.recv_exactly(sum(map(len, answers)))) == expected
        handle.recall()
        got = given_back(handle)
        assert (got.reason, got.requests, got.client_bytes, got.broker_bytes) == ("recalled", len(sent), b"", b"")
    finally:
        link.close()


class ManyBroker:
    """One thread answering every request on many connections (selectors)."""

    def __init__(self) -> None:
        import selectors
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=2048)
        self.listener.setblocking(False)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ, None)
        self.stopping = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        import selectors
        bufs: dict[socket.socket, bytes] = {}
        while not self.stopping:
            for key, _ in self.sel.select(0.05):
                if key.data is None:
                    with contextlib.suppress(BlockingIOError):
                        conn, _ = self.listener.accept()
                        self.sel.register(conn, selectors.EVENT_READ, True)
                        bufs[conn] = b""
                    continue
                conn = key.fileobj
                data = conn.recv(65536)
                if not data:
                    self.sel.unregister(conn)
                    conn.close()
                    continue
                buf = bufs[conn] + data
                out = b""
                while len(buf) >= 4 and len(buf) >= 4 + struct.unpack_from(">i", buf)[0]:
                    (n,) = struct.unpack_from(">i", buf)
                    out += answer(struct.unpack_from(">i", buf, 8)[0])
                    buf = buf[4 + n:]
                bufs[conn] = buf
                conn.sendall(out)
        for key in list(self.sel.get_map().values()):
            key.fileobj.close()

    def close(self) -> None:
        self.stopping = True
        self.thread.join()


def test_a_thousand_connections_on_one_lane(lane: Lane) -> None:
    broker = ManyBroker()
    front = socket.create_server(("127.0.0.1", 0), backlog=2048)
    links, handles = [], []
    before = held_bytes()
    try:
        for _ in range(1000):
            client = socket.create_connection(front.getsockname())
            proxy_client, _ = front.accept()
            proxy_broker = socket.create_connection(broker.listener.getsockname())
            proxy_client.setblocking(False)
            proxy_broker.setblocking(False)
            client.settimeout(WAIT_S)
            links.append((client, proxy_client, proxy_broker))
            handles.append(lane.adopt(proxy_client.fileno(), proxy_broker.fileno(), table=TABLE,
                                      next_correlation_id=0, client_bytes=b"", client_id=b"app",
                                      max_in_flight=4, request_timeout_s=30, idle_timeout_s=60,
                                      frame_timeout_s=30))
        for rounds in range(3):
            for i, (client, _, _) in enumerate(links):
                client.sendall(heartbeat(i * 10 + rounds))
            for i, (client, _, _) in enumerate(links):
                data = b""
                while len(data) < len(answer(0)):
                    data += client.recv(64)
                assert struct.unpack_from(">i", data, 4)[0] == i * 10 + rounds
        # Idle, each holds its four buffers at their first 4 KiB and nothing else (its input buffers
        # no longer start at max_frame + 4: 128 KiB a connection).
        assert held_bytes() - before == 1000 * 4 * 4096
        for h in handles:
            h.recall()
        given = [given_back(h) for h in handles]
        assert {g.reason for g in given} == {"recalled"} and {g.requests for g in given} == {3}
        assert sum(c.count for c in lane.counts().values()) == 3000
    finally:
        front.close()
        for sockets in links:
            for s in sockets:
                s.close()
        broker.close()

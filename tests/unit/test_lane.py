"""The lane (``kproxy/server/_lane.c`` through ``lane.py``) over real TCP sockets on 127.0.0.1: a test
client on one side, a fake broker in a thread on the other that answers each request with its
correlation id. What each side receives must be what a straight relay would give, and whatever the
lane does not take comes back exact, with nothing relayed past it."""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from kproxy.protocol.compiler import whole_skip
from kproxy.protocol.messages import request_codecs
from kproxy.server import lane as lane_module
from kproxy.server.lane import Given, Lane, LaneApi, path_counts

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
        self.reply: Callable[[bytes], bytes] | None = None
        self.conn: socket.socket | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        self.conn = conn
        buf = b""
        with contextlib.suppress(OSError):
            while True:
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


def given_back(handle, timeout: float = WAIT_S) -> Given:
    ready, _, _ = select.select([handle.fd], [], [], timeout)
    assert ready, "the lane did not give the connection back"
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

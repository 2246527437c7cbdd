"""The connection executor (``ClientConnection``) under interleavings of its two pumps.

A fake client and a fake broker stand in for the sockets; trio's MockClock jumps over every wait, so
a 40-second hold takes no real time. Each test drives the real pumps, watchdog and writer through the
public ``run()``; the broker side is reached through ``open_upstream``'s ``connect``, replaced here by
a fake.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kproxy.protocol.messages import body_class, decode_request
from kproxy.proxy.filters import Delay, Filter, FilterChain
from kproxy.proxy.inflight import CLIENT_GONE, InFlight
from kproxy.proxy.session import Session
from kproxy.server import upstream as upstream_module
from kproxy.server.budget import BufferBudget
from kproxy.server.connection import ClientConnection, ConnectionSettings
from kproxy.server.transport import Transport
from kproxy.server.upstream import UpstreamSettings

from .test_session import (
    HEARTBEAT,
    METADATA,
    Refuse,
    heartbeat_request,
    metadata_request,
    metadata_response,
    request_frame,
    response_frame,
)

_I32 = struct.Struct(">i")


class Pipe(Transport):
    """One socket end: bytes the test pushes are received; what kproxy sends is split into frames.
    While ``gate`` is an unset Event, sends wait on it (a client that does not read)."""

    def __init__(self) -> None:
        self.inbox = bytearray()
        self.eof = False
        self.closed = False
        self._readable = trio.Event()
        self.gate: trio.Event | None = None
        self.sends = 0
        self._out = bytearray()
        self.frames: list[bytes] = []

    def push(self, data: bytes) -> None:
        self.inbox += data
        self._readable.set()

    def end(self) -> None:
        self.eof = True
        self._readable.set()

    def readable_now(self) -> bool:
        return bool(self.inbox) or self.eof or self.closed

    async def recv_into(self, buf: memoryview) -> int:
        while not self.inbox and not self.eof and not self.closed:
            self._readable = trio.Event()
            await self._readable.wait()
        if self.closed:
            raise trio.ClosedResourceError
        n = min(len(buf), len(self.inbox))
        buf[:n] = self.inbox[:n]
        del self.inbox[:n]
        return n

    async def send(self, buffers: list) -> None:
        if self.gate is not None:
            await self.gate.wait()
        if self.closed or self.eof:
            raise trio.BrokenResourceError("peer went away")
        self.sends += 1
        self._out += b"".join(bytes(b) for b in buffers)
        while len(self._out) >= 4:
            (size,) = _I32.unpack_from(self._out, 0)
            if len(self._out) < 4 + size:
                break
            self.frames.append(bytes(self._out[4:4 + size]))
            del self._out[:4 + size]
        await trio.lowlevel.checkpoint()

    def close(self) -> None:
        self.closed = True
        self._readable.set()


class NoRouter:
    def route_for(self, port, name):
        return None

    def open_ports(self, ports):
        return None


class Harness:
    """A ClientConnection over a fake client, with fake broker connections made on demand."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *filters: Filter, request_timeout_s: float = 30.0,
                 budget: BufferBudget | None = None, upstream: UpstreamSettings | None = None,
                 broker: Callable[[], Pipe] = Pipe) -> None:
        from kproxy.proxy.filters import ConnectionContext

        self.client = Pipe()
        self.brokers: list[Pipe] = []
        self.completed: list[InFlight] = []
        ctx = ConnectionContext(1, clock=trio.current_time)
        self.session = Session(ctx, FilterChain(filters))
        settings = ConnectionSettings(1 << 20, 100, (("broker", 9092),), upstream or UpstreamSettings(1.0),
                                      request_timeout_s)

        async def fake_connect(*args, **kwargs) -> Transport:
            self.brokers.append(broker())
            return self.brokers[-1]

        monkeypatch.setattr(upstream_module, "connect", fake_connect)
        self.conn = ClientConnection(settings, NoRouter(), self.client, self.session,
                                     on_complete=self.completed.append, budget=budget)

    def ask(self, api_key: int, version: int, correlation_id: int, body) -> None:
        frame = bytes(request_frame(api_key, version, correlation_id, body))
        self.client.push(_I32.pack(len(frame)) + frame)

    def answered_ids(self) -> list[int]:
        return [_I32.unpack_from(f, 0)[0] for f in self.client.frames]

    def requests_at(self, i: int = -1) -> list:
        return [decode_request(f) for f in self.brokers[i].frames]

    def answer(self, api_key: int, version: int, upstream_id: int, body, broker: int = -1) -> None:
        frame = response_frame(api_key, version, upstream_id, body)
        self.brokers[broker].push(_I32.pack(len(frame)) + frame)


def heartbeat_response():
    return body_class(HEARTBEAT, "response")()


async def settle() -> None:
    await trio.testing.wait_all_tasks_blocked()


# -- fault 1: answers in the client's order, whichever task made them


async def test_a_local_answer_made_while_a_flush_is_blocked_waits_its_turn(monkeypatch, autojump_clock):
    h = Harness(monkeypatch, Refuse({HEARTBEAT}))
    async with trio.open_nursery() as n:
        n.start_soon(h.conn.run)
        h.ask(METADATA, 12, 1, metadata_request())        # forwarded
        h.ask(HEARTBEAT, 4, 2, heartbeat_request())       # answered by kproxy, owed after 1
        await settle()
        (meta,) = h.requests_at()
        h.client.gate = trio.Event()                      # the client stops reading
        h.answer(METADATA, 12, meta.correlation_id, metadata_response())
        await settle()                                    # the upstream pump is stuck writing 1 and 2
        h.ask(HEARTBEAT, 4, 3, heartbeat_request())       # a local answer made meanwhile
        await settle()
        h.client.gate.set()
        await settle()
        assert h.answered_ids() == [1, 2, 3]
        n.cancel_scope.cancel()


class Mixed(Filter):
    """Heartbeats whose group starts with "local" are answered by kproxy; the rest go to the broker."""

    name = "mixed"
    request_api_keys = frozenset({HEARTBEAT})

    def on_request(self, ctx, exchange):
        from kproxy.proxy.filters import Respond

        return Respond(error_code=25) if exchange.request.body.group_id.startswith("local") else None


_STEP = st.one_of(
    st.tuples(st.just("ask"), st.booleans()),        # a request; True: kproxy answers it itself
    st.tuples(st.just("answer"), st.integers(0, 5)),  # the broker answers one of the requests it holds
    st.tuples(st.just("gate"), st.booleans()),        # the client stops (True) or resumes reading
)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(st.lists(_STEP, min_size=1, max_size=30))
def test_random_interleavings_of_forwarded_and_local_answers_keep_the_clients_order(steps):
    with pytest.MonkeyPatch.context() as mp:
        async def main() -> None:
            h = Harness(mp, Mixed())
            asked = 0
            pending: list[int] = []           # upstream correlation ids the broker has not answered
            async with trio.open_nursery() as n:
                n.start_soon(h.conn.run)
                for kind, arg in steps:
                    if kind == "ask":
                        asked += 1
                        group = "local" if arg else "remote"
                        h.ask(HEARTBEAT, 4, asked, body_class(HEARTBEAT, "request")(
                            group_id=group, generation_id=1, member_id="m"))
                    elif kind == "answer" and h.brokers:
                        seen = [r.correlation_id for r in h.requests_at()]
                        pending = [c for c in seen if c not in answered_up]
                        if pending:
                            up = pending[arg % len(pending)]
                            answered_up.add(up)
                            h.answer(HEARTBEAT, 4, up, heartbeat_response())
                    elif kind == "gate":
                        if arg and h.client.gate is None:
                            h.client.gate = trio.Event()
                        elif not arg and h.client.gate is not None:
                            h.client.gate.set()
                            h.client.gate = None
                    await settle()
                if h.client.gate is not None:
                    h.client.gate.set()
                    h.client.gate = None
                await settle()
                if h.brokers:   # the broker answers the rest, in its own order
                    for r in reversed(h.requests_at()):
                        if r.correlation_id not in answered_up:
                            answered_up.add(r.correlation_id)
                            h.answer(HEARTBEAT, 4, r.correlation_id, heartbeat_response())
                await settle()
                assert h.answered_ids() == list(range(1, asked + 1))
                n.cancel_scope.cancel()

        answered_up: set[int] = set()
        trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


# -- fault 2: a request kproxy holds is timed from when it is sent, and never sent after its answer


class Hold40(Filter):
    """Holds every Heartbeat 40 s before it goes on (chaos latency, or a long throttle)."""

    name = "hold"
    request_api_keys = frozenset({HEARTBEAT})

    def on_request(self, ctx, exchange):
        return Delay(40.0)


async def test_a_held_request_is_not_timed_out_by_its_hold(monkeypatch, autojump_clock):
    h = Harness(monkeypatch, Hold40(), request_timeout_s=30.0)
    async with trio.open_nursery() as n:
        n.start_soon(h.conn.run)
        h.ask(METADATA, 12, 1, metadata_request())         # opens the broker connection
        await settle()
        h.answer(METADATA, 12, h.requests_at()[0].correlation_id, metadata_response())
        await settle()
        started = trio.current_time()
        h.ask(HEARTBEAT, 4, 2, heartbeat_request())
        with trio.fail_after(120):   # mock time
            while len(h.requests_at(0)) < 2:
                await trio.sleep(1.0)
        assert trio.current_time() - started >= 40.0
        # Still the first broker connection: the watchdog did not call it dead at 30 s.
        assert len(h.brokers) == 1 and h.answered_ids() == [1]
        h.answer(HEARTBEAT, 4, h.requests_at(0)[1].correlation_id, heartbeat_response(), broker=0)
        await settle()
        assert h.answered_ids() == [1, 2]
        assert [e.outcome for e in h.completed] == ["forwarded", "forwarded"]
        n.cancel_scope.cancel()


async def test_a_request_answered_while_held_is_never_sent(monkeypatch, autojump_clock):
    h = Harness(monkeypatch, Hold40(), request_timeout_s=30.0)
    async with trio.open_nursery() as n:
        n.start_soon(h.conn.run)
        h.ask(METADATA, 12, 1, metadata_request())
        await settle()
        h.answer(METADATA, 12, h.requests_at()[0].correlation_id, metadata_response())
        await settle()
        h.ask(HEARTBEAT, 4, 2, heartbeat_request())
        await trio.sleep(5.0)
        h.brokers[0].end()                              # the broker goes away during the hold
        await trio.sleep(60.0)
        # The client was told to retry (a retriable error) ...
        assert h.answered_ids() == [1, 2]
        assert [e.outcome for e in h.completed] == ["forwarded", "upstream_lost"]
        # ... and the request was sent nowhere: not on the lost connection, not on a new one.
        assert [r.api_key for b in h.brokers for r in decode_all(b)] == [METADATA]
        n.cancel_scope.cancel()


def decode_all(broker: Pipe) -> list:
    return [decode_request(f) for f in broker.frames]


# -- fault 4: a pump waiting for the process-wide budget holds no idle buffer


async def test_idle_buffers_alone_cannot_stall_a_connection_on_the_budget(monkeypatch, autojump_clock):
    budget = BufferBudget(64 * 1024)
    h = Harness(monkeypatch, Refuse({METADATA}), budget=budget)
    async with trio.open_nursery() as n:
        n.start_soon(h.conn.run)
        # Large requests grow the receive buffer past the budget; each is answered by kproxy.
        big = metadata_request([f"t{i:05d}" + "x" * 200 for i in range(300)])
        for cid in range(1, 4):
            h.ask(METADATA, 12, cid, big)
            await settle()
        h.ask(METADATA, 12, 4, metadata_request())
        with trio.move_on_after(600):
            while len(h.answered_ids()) < 4:
                await trio.sleep(1.0)
        assert h.answered_ids() == [1, 2, 3, 4]
        n.cancel_scope.cancel()


# -- every request completes exactly once


async def test_a_request_owed_when_the_client_goes_away_completes_as_client_gone(monkeypatch, autojump_clock):
    h = Harness(monkeypatch)
    async with trio.open_nursery() as n:
        n.start_soon(h.conn.run)
        h.ask(METADATA, 12, 1, metadata_request())
        h.ask(METADATA, 12, 2, metadata_request())
        await settle()
        h.answer(METADATA, 12, h.requests_at()[0].correlation_id, metadata_response())
        await settle()
        h.client.end()                                  # gone before the second answer
        await settle()
    assert [(e.client_correlation_id, e.outcome) for e in h.completed] == [(1, "forwarded"), (2, CLIENT_GONE)]
    assert h.completed[1].finished_at is not None and h.completed[1].response_bytes == 0


# -- a filter's question: the resumed request and the next one reach the broker whole and in order


class AskFirst(Filter):
    """Asks the broker a Metadata question before every Heartbeat, then forwards it."""

    name = "ask-first"
    request_api_keys = frozenset({HEARTBEAT})

    def on_request(self, ctx, exchange):
        from kproxy.protocol.messages import Request
        from kproxy.proxy.filters import AskBroker

        return AskBroker(Request.build(METADATA, 12, 0, "kproxy", metadata_request(())), lambda answer: None)


async def test_a_question_answered_as_it_times_out_keeps_the_brokers_order(monkeypatch, autojump_clock):
    h = Harness(monkeypatch, AskFirst(), request_timeout_s=5.0)
    async with trio.open_nursery() as n:
        n.start_soon(h.conn.run)
        h.ask(HEARTBEAT, 4, 1, heartbeat_request())
        await settle()
        (question,) = h.requests_at()
        broker = h.brokers[0]
        broker.gate = trio.Event()               # the broker stops reading
        h.answer(METADATA, 12, question.correlation_id, metadata_response())
        await settle()                           # the upstream pump resumes the Heartbeat: stuck sending
        await trio.sleep(6.0)                    # the client pump's wait for the answer times out too
        h.ask(METADATA, 12, 2, metadata_request())
        await settle()
        broker.gate.set()
        broker.gate = None
        await settle()
        assert [r.api_key for r in h.requests_at()] == [METADATA, HEARTBEAT, METADATA]
        hb, meta = h.requests_at()[1:]
        h.answer(HEARTBEAT, 4, hb.correlation_id, heartbeat_response())
        h.answer(METADATA, 12, meta.correlation_id, metadata_response())
        await settle()
        assert h.answered_ids() == [1, 2] and len(h.brokers) == 1
        n.cancel_scope.cancel()

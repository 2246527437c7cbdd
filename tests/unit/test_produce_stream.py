"""A large Produce request streamed to the broker while it arrives, through the real connection
executor (``ClientConnection``) over fake sockets, under MockClock: what the broker receives, and the
faults. A client that dies mid-frame leaves the broker connection holding half a request, which is
closed, never completed; a broker lost mid-frame has the rest of the client's frame read and dropped,
and the client told to retry; a slow broker holds the client back; acks=0 is owed no answer; a
malformed head closes only that connection."""

from __future__ import annotations

import logging
import struct
from typing import Any

import pytest
import trio

from kproxy.protocol.messages import Request, body_class, decode_response, encode_request_frame
from kproxy.protocol.records import build_batch
from kproxy.proxy.filters import Filter, FilterChain
from kproxy.proxy.inflight import CLIENT_GONE, NO_RESPONSE, STORED, STREAMED, UPSTREAM_LOST

from .test_connection import Harness, Pipe, settle

PRODUCE = 0
_I32 = struct.Struct(">i")
NOT_LEADER_OR_FOLLOWER = 6


class StreamingPipe(Pipe):
    can_stream = True


def produce(correlation_id: int, acks: int = -1, batches: int = 3, version: int = 9) -> bytes:
    """A Produce request frame (size prefix included) of two topics, about 100 KiB a batch."""
    rq: Any = body_class(PRODUCE, "request")
    batch = build_batch([(None, b"v" * 1000)] * 100)
    topics = [rq.TopicProduceData(name=name, partition_data=[
        rq.PartitionProduceData(index=i, records=batch) for i in range(batches)]) for name in ("a", "b")]
    body = rq(transactional_id=None, acks=acks, timeout_ms=30_000, topic_data=topics)
    return b"".join(bytes(b) for b in encode_request_frame(Request.build(PRODUCE, version, correlation_id, "app", body)))


def produce_answer(upstream_id: int, version: int = 9) -> bytes:
    cls: Any = body_class(PRODUCE, "response")
    body = cls(responses=[cls.TopicProduceResponse(name=n, partition_responses=[
        cls.PartitionProduceResponse(index=i, base_offset=0) for i in range(3)]) for n in ("a", "b")])
    from .test_session import response_frame
    frame = response_frame(PRODUCE, version, upstream_id, body)
    return _I32.pack(len(frame)) + frame


def harness(monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> Harness:
    h = Harness(monkeypatch, **kwargs)
    h.client.__class__ = StreamingPipe
    real = h.brokers

    async def fake_connect(*args: Any, **kw: Any) -> StreamingPipe:
        broker = StreamingPipe()
        real.append(broker)
        return broker

    from kproxy.server import upstream as upstream_module
    monkeypatch.setattr(upstream_module, "connect", fake_connect)
    return h


async def push_in_pieces(h: Harness, frame: bytes, step: int) -> None:
    """The client sends ``frame`` ``step`` bytes at a time, kproxy settling after each piece."""
    for i in range(0, len(frame), step):
        h.client.push(frame[i:i + step])
        await settle()


def as_sent(frame: bytes, upstream_id: int) -> bytes:
    """``frame`` as kproxy forwards it: kproxy's correlation id in place of the client's."""
    out = bytearray(frame)
    _I32.pack_into(out, 8, upstream_id)
    return bytes(out)


async def test_a_large_produce_reaches_the_broker_in_pieces_as_it_would_whole(monkeypatch, autojump_clock):
    h = harness(monkeypatch)
    frame = produce(7)
    async with trio.open_nursery() as n:
        n.start_soon(h.conn.run)
        await push_in_pieces(h, frame, 50_000)
        (broker,) = h.brokers
        assert broker.frames == [as_sent(frame, 0)[4:]]
        assert broker.sends > 1                            # it went in pieces, not whole
        broker.push(produce_answer(0))
        await settle()
        assert h.answered_ids() == [7]
        h.client.end()
    (entry,) = h.completed
    assert entry.request_path == STREAMED and entry.outcome == "forwarded" and entry.request_bytes == len(frame)
    assert sum(f.records for f in entry.records_facts or ()) == 600


async def test_a_large_produce_that_arrives_whole_in_one_receive_streams_too(monkeypatch, autojump_clock):
    h = harness(monkeypatch)
    first, second = produce(7), produce(8)
    async with trio.open_nursery() as n:
        n.start_soon(h.conn.run)
        h.client.push(first[:50_000])
        await settle()
        h.client.push(first[50_000:])
        await settle()
        (broker,) = h.brokers
        broker.push(produce_answer(0))
        await settle()
        # The reader now holds a streaming chunk: the next request fits in it and arrives whole.
        h.client.push(second)
        await settle()
        assert broker.frames == [as_sent(first, 0)[4:], as_sent(second, 1)[4:]]
        broker.push(produce_answer(1))
        await settle()
        assert h.answered_ids() == [7, 8]
        h.client.end()
    assert [e.request_path for e in h.completed] == [STREAMED, STREAMED]
    assert sum(f.records for f in h.completed[1].records_facts or ()) == 600


async def test_off_it_is_stored(monkeypatch, autojump_clock):
    h = harness(monkeypatch)
    h.session.stream_min_bytes = None
    frame = produce(7)
    async with trio.open_nursery() as n:
        n.start_soon(h.conn.run)
        h.client.push(frame[:50_000])
        await settle()
        h.client.push(frame[50_000:])
        await settle()
        (broker,) = h.brokers
        assert broker.frames == [as_sent(frame, 0)[4:]] and broker.sends == 1
        h.client.end()
    (entry,) = h.completed
    assert entry.request_path == STORED


@pytest.mark.parametrize("how", ["broker closes", "send fails"])
async def test_a_broker_lost_mid_request_drops_the_rest_and_the_client_is_told_to_retry(monkeypatch, autojump_clock,
                                                                                        how):
    h = harness(monkeypatch)
    frame = produce(7)
    async with trio.open_nursery() as n:
        n.start_soon(h.conn.run)
        h.client.push(frame[:150_000])
        await settle()
        (broker,) = h.brokers
        assert broker.sends and not broker.frames         # half a request is with the broker
        if how == "broker closes":
            broker.end()
        else:
            broker.closed = True                           # the next send fails
        await settle()
        h.client.push(frame[150_000:])
        await settle()
        # The rest of the frame was read and dropped: never sent to this broker or to a new one.
        assert not broker.frames
        assert all(not b.sends for b in h.brokers[1:])
        (answer,) = h.client.frames
        resp = decode_response(answer, PRODUCE, 9)
        assert resp.correlation_id == 7
        assert {p.error_code for t in resp.body.responses for p in t.partition_responses} == {NOT_LEADER_OR_FOLLOWER}
        assert sorted((t.name, p.index) for t in resp.body.responses for p in t.partition_responses) == [
            (t, i) for t in ("a", "b") for i in range(3)]
        # The connection goes on: the client's retry reaches a new broker connection whole.
        retry = produce(8)
        h.client.push(retry)
        await settle()
        assert h.brokers[-1].frames == [as_sent(retry, 1)[4:]]
        h.client.end()
    entry = h.completed[0]
    assert entry.outcome == UPSTREAM_LOST and entry.broken == "broker" and entry.request_path == STREAMED


async def test_a_client_gone_mid_request_closes_the_broker_connection_holding_half_of_it(monkeypatch, autojump_clock,
                                                                                        caplog):
    h = harness(monkeypatch)
    frame = produce(7)
    with caplog.at_level(logging.WARNING, "kproxy.server"):
        async with trio.open_nursery() as n:
            n.start_soon(h.conn.run)
            h.client.push(frame[:150_000])
            await settle()
            (broker,) = h.brokers
            assert broker.sends and not broker.frames
            h.client.end()
            await settle()
    # Never completed with garbage: the broker connection holding half a request is closed.
    assert broker.closed and not broker.frames
    (entry,) = h.completed
    assert entry.outcome == CLIENT_GONE and entry.broken == "client"
    assert any("ended" in r.getMessage() and "Produce request streaming to the broker" in r.getMessage()
               for r in caplog.records)


async def test_a_slow_broker_holds_the_client_back(monkeypatch, autojump_clock):
    h = harness(monkeypatch)
    h.conn.client_reader.max_frame_size = 8 << 20
    frame = produce(7, batches=15)                        # about 3 MiB
    async with trio.open_nursery() as n:
        n.start_soon(h.conn.run)
        h.client.push(frame[:10_000])
        await settle()
        (broker,) = h.brokers
        broker.gate = trio.Event()                         # the broker stops reading
        h.client.push(frame[10_000:])
        await settle()
        # kproxy holds one receive chunk (1 MiB) and reads no further until the broker takes it.
        assert len(h.client.inbox) > len(frame) - 3 * (1 << 20)
        assert h.conn.client_reader.held_bytes <= 2 << 20
        broker.gate.set()
        await settle()
        assert not h.client.inbox and broker.frames == [as_sent(frame, 0)[4:]]
        h.client.end()


async def test_acks_0_is_owed_no_answer(monkeypatch, autojump_clock):
    h = harness(monkeypatch)
    frame = produce(7, acks=0)
    async with trio.open_nursery() as n:
        n.start_soon(h.conn.run)
        await push_in_pieces(h, frame, 100_000)
        (broker,) = h.brokers
        assert broker.frames == [as_sent(frame, 0)[4:]]
        (entry,) = h.completed                           # complete once its last byte was written
        assert entry.outcome == NO_RESPONSE and entry.request_path == STREAMED
        h.client.end()
    assert not h.client.frames


async def test_a_malformed_head_closes_only_that_connection(monkeypatch, autojump_clock, caplog):
    h = harness(monkeypatch)
    frame = bytearray(produce(7))
    # After the header (size, api key, version, correlation id, client id "app", no tags): the
    # transactional id's length, a varint that never ends.
    frame[4 + 8 + 2 + 3 + 1:4 + 8 + 2 + 3 + 1 + 6] = b"\xff" * 6
    with caplog.at_level(logging.INFO, "kproxy.server"):
        async with trio.open_nursery() as n:
            n.start_soon(h.conn.run)
            h.client.push(bytes(frame[:100_000]))
            await settle()
    assert h.client.closed
    assert all(not b.frames for b in h.brokers)
    assert any("malformed Produce v9 request" in r.getMessage() for r in caplog.records)


async def test_a_drain_mid_request_reads_it_to_its_end_and_answers_it(monkeypatch, autojump_clock):
    h = harness(monkeypatch)
    frame = produce(7)
    async with trio.open_nursery() as n:
        n.start_soon(h.conn.run)
        h.client.push(frame[:150_000])
        await settle()
        h.conn.drain()
        h.client.push(frame[150_000:])
        await settle()
        (broker,) = h.brokers
        assert broker.frames == [as_sent(frame, 0)[4:]]
        broker.push(produce_answer(0))
        await settle()
    assert h.answered_ids() == [7]
    (entry,) = h.completed
    assert entry.outcome == "forwarded" and entry.request_path == STREAMED


async def test_metrics_count_streamed_requests_and_the_ones_cut_off(monkeypatch, autojump_clock):
    from kproxy.telemetry.exchange import Exchange, Learned
    from kproxy.telemetry.metrics import Metrics

    h = harness(monkeypatch)
    async with trio.open_nursery() as n:
        n.start_soon(h.conn.run)
        h.client.push(produce(7))
        await settle()
        h.brokers[0].push(produce_answer(0))
        await settle()
        h.client.push(produce(8)[:150_000])
        await settle()
        h.client.end()
    m = Metrics()
    for entry in h.completed:
        m.record(Exchange(entry, h.session.ctx, Learned()))
    text = m.exposition().decode()
    assert 'kproxy_frames_total{api="produce",direction="request",path="streamed"} 2.0' in text
    assert 'kproxy_streamed_requests_broken_total{side="client"} 1.0' in text
    assert 'kproxy_records_total{direction="produced"} 600.0' in text


class Whole(Filter):
    """A filter that must see Produce requests whole (the default for one that registers for them)."""

    name = "whole"
    request_api_keys = frozenset({PRODUCE})


async def test_a_request_a_filter_wants_whole_is_stored_counted_in_the_budget_and_sent_whole(monkeypatch,
                                                                                             autojump_clock):
    h = harness(monkeypatch)
    h.session.chain = FilterChain([Whole()])
    frame = produce(7)
    async with trio.open_nursery() as n:
        n.start_soon(h.conn.run)
        h.client.push(frame[:150_000])
        await settle()
        assert not h.brokers                               # nothing leaves before the end
        # What the walker keeps counts in the buffer budget, beyond the reader's receive chunk.
        assert h.conn._held - h.conn.client_reader.held_bytes >= 140_000
        h.client.push(frame[150_000:])
        await settle()
        (broker,) = h.brokers
        assert broker.frames == [as_sent(frame, 0)[4:]] and broker.sends == 1
        h.client.end()
    (entry,) = h.completed
    assert entry.request_path == STORED and entry.why_stored == "filter whole"

"""Splicing streamed record batch bodies (``cut_through_splice``) on real loopback sockets: the real
``ClientConnection`` between a client socket and a broker socket the test drives. The client gets
the bytes store-and-forward would send, the batch headers are counted as ``records.summarize``
counts them, a client that does not read holds the broker back, and a broker that dies in the middle
of a batch closes the client connection with part of a frame, never a whole corrupt one."""

from __future__ import annotations

import logging
import os
import select
import socket
import struct
import threading
import uuid
from typing import Any

import pytest
import trio
import trio.testing

from kproxy.protocol.messages import (
    Request,
    Response,
    body_class,
    encode_request_frame,
    encode_response_frame,
)
from kproxy.protocol.records import build_batch, summarize
from kproxy.proxy.filters import ConnectionContext, FilterChain
from kproxy.proxy.inflight import STREAMED, UPSTREAM_LOST, InFlight
from kproxy.proxy.session import Session
from kproxy.server import splice
from kproxy.server.connection import ClientConnection, ConnectionSettings
from kproxy.server.transport import PlainTransport
from kproxy.server.upstream import UpstreamSettings

FETCH = 1
TOPIC_ID = uuid.UUID("1b4e28ba-2fa1-11d2-883f-0016d3cca427")
_I32 = struct.Struct(">i")
DEADLINE = 20.0


def batches(count: int, records: int = 40, size: int = 1000, first: int = 0) -> bytes:
    return b"".join(build_batch([(None, os.urandom(size))] * records, base_offset=first + i * records)
                    for i in range(count))


def fetch_request(correlation_id: int, version: int) -> bytes:
    rq: Any = body_class(FETCH, "request")
    body = rq(max_wait_ms=100, min_bytes=1, max_bytes=1 << 26, topics=[rq.FetchTopic(
        topic_id=TOPIC_ID, topic="t", partitions=[rq.FetchPartition(partition=0, fetch_offset=0,
                                                                   partition_max_bytes=1 << 26)])])
    return b"".join(bytes(b) for b in encode_request_frame(Request.build(FETCH, version, correlation_id, "c", body)))


def fetch_answer(correlation_id: int, version: int, records: bytes) -> bytes:
    """A Fetch answer, size prefix included, with two partitions of ``records`` halves."""
    cls: Any = body_class(FETCH, "response")
    half = summarize(records).total_bytes // 2
    cut = 0
    while cut < half:       # a batch boundary near the middle
        cut += 12 + _I32.unpack_from(records, cut + 8)[0]
    parts = [cls.PartitionData(partition_index=i, high_watermark=10**6, records=r)
             for i, r in enumerate((records[:cut], records[cut:]))]
    body = cls(throttle_time_ms=0, responses=[cls.FetchableTopicResponse(topic_id=TOPIC_ID, topic="t",
                                                                         partitions=parts)])
    return b"".join(bytes(b) for b in encode_response_frame(Response.build(FETCH, version, correlation_id, body)))


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    return a, b


class Broker:
    """A listening socket kproxy connects to; the test reads its requests and writes its answers
    from a thread (blocking sockets, as a broker would)."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.sock: socket.socket | None = None
        self.written = 0
        self.blocked = threading.Event()    # a send could not complete at once: kproxy is not reading

    @property
    def address(self) -> tuple[str, int]:
        return self.listener.getsockname()

    def serve(self, answer: Any, *, pieces: tuple[int, ...] = (), close_after: int | None = None) -> threading.Thread:
        """Accept, read one request, answer it (``answer(upstream correlation id)``) in ``pieces`` (the
        sizes of the first writes), or write only ``close_after`` bytes and reset the connection."""

        def run() -> None:
            sock, _ = self.listener.accept()
            self.sock = sock
            head = recv_exactly(sock, 4)
            request = recv_exactly(sock, _I32.unpack(head)[0])
            data = memoryview(answer(_I32.unpack_from(request, 4)[0]))
            if close_after is not None:
                data = data[:close_after]
            sock.setblocking(False)
            for n in (*pieces, len(data)):
                chunk, data = data[:n], data[n:]
                while chunk:
                    try:
                        sent = sock.send(chunk[:1 << 20])
                    except BlockingIOError:
                        self.blocked.set()
                        select.select([], [sock], [], DEADLINE)
                        continue
                    chunk = chunk[sent:]
                    self.written += sent
            if close_after is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.close()

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    def close(self) -> None:
        self.listener.close()
        if self.sock is not None:
            self.sock.close()


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        got = sock.recv(n - len(out))
        if not got:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += got
    return bytes(out)


async def read_all(sock: trio.socket.SocketType, limit: int) -> bytes:
    """What arrives until the peer closes or ``limit`` bytes came."""
    out = bytearray()
    while len(out) < limit:
        got = await sock.recv(min(1 << 20, limit - len(out)))
        if not got:
            break
        out += got
    return bytes(out)


class Proxy:
    """The real ClientConnection between a client socket (``client``, the test's end) and ``broker``."""

    def __init__(self, broker: Broker, splicing: bool) -> None:
        self.completed: list[InFlight] = []
        kproxy_end, self.raw_client = tcp_pair()
        kproxy_end.setblocking(False)
        self.client = trio.socket.from_stdlib_socket(self.raw_client)
        transport = PlainTransport(trio.socket.from_stdlib_socket(kproxy_end), kproxy_end)
        self.session = Session(ConnectionContext(1, clock=trio.current_time), FilterChain([]))
        settings = ConnectionSettings(1 << 26, 10, (broker.address,), UpstreamSettings(5.0), 30.0, splice=splicing)
        self.conn = ClientConnection(settings, _NoRouter(), transport, self.session, on_complete=self.completed.append)


class _NoRouter:
    def route_for(self, port: int | None, name: str | None) -> None:
        return None

    def open_ports(self, ports: tuple[int, ...]) -> None:
        return None


async def wait_for(predicate: Any, what: str) -> None:
    with trio.fail_after(DEADLINE):
        while not predicate():
            await trio.sleep(0.01)   # polling state, with a deadline; not synchronisation by time
    assert predicate(), what


@pytest.mark.parametrize("splicing", [True, False])
@pytest.mark.parametrize("version", [4, 12, 16])
async def test_a_spliced_answer_is_the_stored_one_and_counts_what_summarize_counts(splicing, version):
    records = batches(12)
    broker = Broker()
    # The head and part of the first batch first: the answer streams, then the rest arrives.
    broker.serve(lambda cid: fetch_answer(cid, version, records), pieces=(300, 5000))
    proxy = Proxy(broker, splicing)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(proxy.conn.run)
            await proxy.client.send(fetch_request(7, version))
            want = fetch_answer(7, version, records)     # the client's correlation id, nothing else
            got = await read_all(proxy.client, len(want))
            assert got == want
            await wait_for(lambda: proxy.completed, "the Fetch completes")
            proxy.client.close()
    finally:
        broker.close()
    (entry,) = proxy.completed
    assert entry.path == STREAMED and entry.response_bytes == len(want)
    if splicing:
        # Most of the records never passed through kproxy; every batch header was still counted.
        assert entry.spliced_bytes > len(records) // 2
    else:
        assert entry.spliced_bytes == 0
    assert entry.records_facts is not None
    halves = [f.size for f in entry.records_facts]
    assert sum(halves) == len(records)
    for facts, data in zip(entry.records_facts, (records[:halves[0]], records[halves[0]:]), strict=True):
        s = summarize(data)
        assert (facts.batches, facts.records, facts.whole_bytes, facts.compressed) == (
            s.batch_count, s.record_count, s.total_bytes, s.compressed)
    assert entry.records_facts[0].first_offset == 0
    assert entry.records_facts[1].last_offset == 12 * 40 - 1


async def test_a_client_that_does_not_read_holds_the_broker_back():
    records = batches(8, records=64, size=16 * 1024)             # 8 MiB
    copies = 3
    broker = Broker()
    broker.serve(lambda cid: fetch_answer(cid, 12, records * copies), pieces=(300,))
    proxy = Proxy(broker, splicing=True)
    proxy.raw_client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    total = len(fetch_answer(0, 12, records * copies))
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(proxy.conn.run)
            await proxy.client.send(fetch_request(7, 12))
            # The client reads nothing: kproxy stops taking from the broker, whose sends then block.
            await wait_for(broker.blocked.is_set, "the broker's sends block")
            await trio.testing.wait_all_tasks_blocked()
            assert broker.written < total, (broker.written, total)
            assert proxy.conn._held <= 4 << 20    # the chunk and the pipe, not the answer
            got = await read_all(proxy.client, total)
            assert len(got) == total and got == fetch_answer(7, 12, records * copies)
            await wait_for(lambda: proxy.completed, "the Fetch completes")
            proxy.client.close()
    finally:
        broker.close()
    assert proxy.completed[0].spliced_bytes > 0


async def test_a_broker_dying_mid_batch_closes_the_client_with_part_of_the_frame(caplog):
    records = batches(12)
    answer = fetch_answer(0, 12, records)
    broker = Broker()
    # Half the answer: the head, some whole batches, and the middle of a batch's body.
    broker.serve(lambda cid: fetch_answer(cid, 12, records), pieces=(300, 5000), close_after=len(answer) // 2)
    proxy = Proxy(broker, splicing=True)
    caplog.set_level(logging.INFO, logger="kproxy")
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(proxy.conn.run)
            await proxy.client.send(fetch_request(7, 12))
            got = await read_all(proxy.client, len(answer))
            proxy.client.close()
    finally:
        broker.close()
    # Never a whole frame: the size prefix promised more than ever came, so no client takes it.
    assert 0 < len(got) < len(answer)
    assert got == (answer[:4] + _I32.pack(7) + answer[8:])[:len(got)]
    (entry,) = proxy.completed
    assert entry.outcome == UPSTREAM_LOST and entry.spliced_bytes > 0
    assert any("broker connection lost in the middle of a streamed fetch answer" in r.getMessage()
               for r in caplog.records)


async def test_the_pipe_moves_exactly_what_it_is_asked_and_leaves_the_rest():
    a, b = tcp_pair()
    c, d = tcp_pair()
    for s in (b, c):
        s.setblocking(False)
    data = os.urandom(3 << 20)
    pipe = splice.Pipe()
    try:
        a.sendall(data[:100_000])
        async with trio.open_nursery() as nursery:
            async def send_rest() -> None:
                await trio.to_thread.run_sync(a.sendall, data[100_000:])

            async def receive() -> bytes:
                return await trio.to_thread.run_sync(recv_exactly, d, 2 << 20)

            nursery.start_soon(send_rest)
            results: list[bytes] = []

            async def collect() -> None:
                results.append(await receive())

            nursery.start_soon(collect)
            assert await pipe.relay(b, c, 2 << 20) == 2 << 20
        assert results == [data[:2 << 20]]
        # The rest is still on the source socket, untouched.
        b.setblocking(True)
        assert recv_exactly(b, 1 << 20) == data[2 << 20:]
    finally:
        pipe.close()
        for s in (a, b, c, d):
            s.close()

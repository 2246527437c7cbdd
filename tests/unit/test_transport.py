"""The TLS transport keeps the plain transport's promises, over a real TLS connection on a socket
pair: ``readable_now`` tells an idle connection from a busy one, a receive into the rest of a huge
frame allocates a bounded amount, and a multi-megabyte send is encrypted a slice at a time."""

from __future__ import annotations

import hashlib
import socket
import ssl
import tracemalloc
from collections.abc import AsyncIterator

import pytest
import trio
import trustme

from kproxy.server.transport import _SLICE, _YIELD_EVERY, PlainTransport, TlsTransport

MiB = 1 << 20


@pytest.fixture(scope="module")
def contexts() -> tuple[ssl.SSLContext, ssl.SSLContext]:
    ca = trustme.CA()
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("kproxy.test").configure_cert(server)
    client = ssl.create_default_context()
    ca.configure_trust(client)
    return server, client


@pytest.fixture
async def pair(contexts: tuple[ssl.SSLContext, ssl.SSLContext]) -> AsyncIterator[tuple[TlsTransport, TlsTransport]]:
    """(kproxy's side, the peer's side), both TLS transports over one socket pair, handshake done."""
    raws = socket.socketpair()
    transports = []
    for raw, ctx, server_side in zip(raws, contexts, (True, False), strict=True):
        raw.setblocking(False)
        stream = trio.SSLStream(trio.SocketStream(trio.socket.from_stdlib_socket(raw)), ctx,
                                server_side=server_side, server_hostname=None if server_side else "kproxy.test")
        transports.append(TlsTransport(stream, raw))
    async with trio.open_nursery() as nursery:
        for t in transports:
            nursery.start_soon(t.stream.do_handshake)
    yield transports[0], transports[1]
    for t in transports:
        t.close()


async def test_readable_now_is_false_on_an_idle_connection_and_true_when_bytes_wait(pair):
    kproxy, peer = pair
    assert not kproxy.readable_now()
    await peer.send([b"hello"])
    with trio.fail_after(10):
        while not kproxy.readable_now():
            await trio.sleep(0.001)     # bytes in flight on a local socket: arrives at once
    buf = bytearray(1024)
    assert await kproxy.recv_into(memoryview(buf)) == 5 and bytes(buf[:5]) == b"hello"
    assert not kproxy.readable_now()


async def test_readable_now_is_true_while_full_records_keep_coming(pair):
    kproxy, peer = pair
    async with trio.open_nursery() as nursery:
        nursery.start_soon(peer.send, [b"x" * (4 * MiB + 100)])
        buf = memoryview(bytearray(4 * MiB + 100))
        got = await kproxy.recv_into(buf)
        assert got == 16 * 1024 and kproxy.readable_now()
        while got < 4 * MiB + 100:
            got += await kproxy.recv_into(buf[got:])
    assert not kproxy.readable_now()


async def test_a_receive_smaller_than_a_record_leaves_the_rest_readable(pair):
    kproxy, peer = pair
    await peer.send([b"0123456789"])
    small = memoryview(bytearray(4))
    assert await kproxy.recv_into(small) == 4 and bytes(small) == b"0123"
    assert kproxy.readable_now()            # six bytes decrypted and waiting, none on the socket
    rest = memoryview(bytearray(100))
    assert await kproxy.recv_into(rest) == 6 and bytes(rest[:6]) == b"456789"
    assert not kproxy.readable_now()


async def test_a_receive_into_a_huge_frame_allocates_a_bounded_amount(pair):
    kproxy, peer = pair
    frame = memoryview(bytearray(64 * MiB))        # the rest of a 64 MiB frame to fill
    payload = b"y" * MiB
    async with trio.open_nursery() as nursery:
        nursery.start_soon(peer.send, [payload])
        tracemalloc.start()
        try:
            got = 0
            while got < 1 * MiB:
                got += await kproxy.recv_into(frame[got:])
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert got == 1 * MiB and bytes(frame[:got]) == b"y" * MiB
    # Asking for the whole 64 MiB allocated 64 MiB per read; what is left is mostly the peer's
    # side (it encrypts the megabyte in this same process).
    assert peak < 4 * MiB, peak


async def test_a_multi_megabyte_answer_is_encrypted_a_slice_at_a_time(pair):
    kproxy, peer = pair
    total = 16 * MiB
    buffers = [bytes([i % 251]) * (64 * 1024) for i in range(total // (64 * 1024))]
    received = hashlib.sha256()
    count = 0
    turns = 0

    async def read_all() -> None:
        nonlocal count
        buf = memoryview(bytearray(256 * 1024))
        while count < total:
            n = await peer.recv_into(buf)
            received.update(buf[:n])
            count += n

    async def count_turns() -> None:
        nonlocal turns
        while True:
            await trio.lowlevel.checkpoint()
            turns += 1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_all)
        nursery.start_soon(count_turns)
        tracemalloc.start()
        try:
            await kproxy.send(buffers)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        with trio.fail_after(30):
            while count < total:
                await trio.sleep(0.001)
        nursery.cancel_scope.cancel()
    assert received.digest() == hashlib.sha256(b"".join(buffers)).digest()
    # Joined and encrypted whole, the answer took twice its size at once (plaintext copy and
    # ciphertext); a slice at a time, a few slices (the peer's reads included).
    assert peak < 4 * _SLICE, peak
    assert turns >= total // _SLICE


async def test_small_sends_that_never_wait_still_let_other_connections_run():
    # A client whose small answers always fit the socket buffer never waits for the socket: the
    # plain transport gives the other tasks a turn every _YIELD_EVERY sends all the same.
    raws = socket.socketpair()
    try:
        for raw in raws:
            raw.setblocking(False)
        kproxy = PlainTransport(trio.socket.from_stdlib_socket(raws[0]), raws[0])
        turns = 0

        async def count_turns() -> None:
            nonlocal turns
            while True:
                await trio.lowlevel.checkpoint()
                turns += 1

        async with trio.open_nursery() as nursery:
            nursery.start_soon(count_turns)
            await trio.lowlevel.checkpoint()      # the counter is running
            before = turns
            for _ in range(4 * _YIELD_EVERY):
                await kproxy.send([b"x" * 100])
            ran = turns - before
            nursery.cancel_scope.cancel()
        assert 3 <= ran <= 5, ran
        assert len(raws[1].recv(1 << 20)) == 4 * _YIELD_EVERY * 100
    finally:
        for raw in raws:
            raw.close()

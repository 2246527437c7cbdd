"""The PROXY stage on real sockets (a socketpair): headers that trickle in, headers followed at once
by the client's bytes, and refusals. Whatever happens, the bytes after the header stay in the socket
for TLS or the frame reader, and nothing before a refusal is taken from a client without a header."""

from __future__ import annotations

import socket

import pytest
import trio

from kproxy.config import ProxyProtocolConfig
from kproxy.identity.proxy_header import V2_SIGNATURE, encode_v1, encode_v2
from kproxy.server.proxy_protocol import ProxyProtocolGate

BALANCER = ("10.0.0.5", 40000)
OUTSIDER = ("192.0.2.1", 5000)
CLIENT = ("203.0.113.9", 51234)
KAFKA = (10).to_bytes(4, "big") + b"\x00\x12\x00\x00\x00\x00\x00\x01\xff\xff"   # an ApiVersions v0 frame


def gate(mode: str = "optional") -> ProxyProtocolGate:
    return ProxyProtocolGate(ProxyProtocolConfig(mode=mode, trusted=("10.0.0.0/8",), timeout_s=5))


def pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.setblocking(False)
    return a, b


def rest_of(sock: socket.socket) -> bytes:
    sock.setblocking(False)
    try:
        return sock.recv(65536)
    except BlockingIOError:
        return b""


@pytest.mark.parametrize("header", [encode_v2(CLIENT, ("10.0.0.9", 9092)), encode_v1(CLIENT, ("10.0.0.9", 9092)),
                                    encode_v2(CLIENT, ("10.0.0.9", 9092), b"\xea\x00\x04vpce")])
async def test_a_trickled_header_then_the_client_bytes(header: bytes) -> None:
    ours, theirs = pair()
    with ours, theirs:
        async def send() -> None:
            for i in range(len(header)):
                theirs.send(header[i:i + 1])
                await trio.sleep(0)
            theirs.send(KAFKA)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            got = await gate().admit(ours, BALANCER)
        assert got.refused is None
        assert got.client == CLIENT and got.via == BALANCER
        assert rest_of(ours) == KAFKA


async def test_header_and_client_bytes_in_one_segment() -> None:
    ours, theirs = pair()
    with ours, theirs:
        theirs.send(encode_v1(CLIENT, ("10.0.0.9", 9092)) + b"\x16\x03\x01hello")
        got = await gate("required").admit(ours, BALANCER)
        assert got.client == CLIENT
        assert rest_of(ours) == b"\x16\x03\x01hello"


@pytest.mark.parametrize("peer", [BALANCER, OUTSIDER, ("::ffff:192.0.2.1", 5000)])
async def test_optional_mode_takes_nothing_from_a_client_without_a_header(peer: tuple[str, int]) -> None:
    ours, theirs = pair()
    with ours, theirs:
        theirs.send(KAFKA)
        got = await gate().admit(ours, peer)
        assert got.refused is None and got.client == peer and got.via is None
        assert rest_of(ours) == KAFKA


@pytest.mark.parametrize(("mode", "peer", "payload", "kind"), [
    ("optional", OUTSIDER, encode_v2(CLIENT, BALANCER), "untrusted"),
    ("optional", OUTSIDER, b"PRO", "untrusted"),
    ("required", OUTSIDER, KAFKA, "untrusted"),
    ("required", BALANCER, KAFKA, "missing"),
    ("optional", BALANCER, b"PROXY TCP4 1.2.3.4 5.6.7.8 1 2\n", "malformed"),
    ("optional", BALANCER, V2_SIGNATURE + b"\x21\x11\x10\x00", "malformed"),
])
async def test_refusals(mode: str, peer: tuple[str, int], payload: bytes, kind: str) -> None:
    ours, theirs = pair()
    g = gate(mode)
    with ours, theirs:
        theirs.send(payload)
        got = await g.admit(ours, peer)
        assert got.refused is not None and got.kind == kind
        assert g.refused == {kind: 1}


async def test_a_signature_that_goes_wrong_after_it_was_taken(autojump_clock: trio.testing.MockClock) -> None:
    # "PRO" alone may begin a header, so the gate takes it; when "XZ" follows, those bytes are gone
    # and the connection cannot be served as anything else.
    ours, theirs = pair()
    with ours, theirs:
        async def send() -> None:
            theirs.send(b"PRO")
            await trio.sleep(1)     # virtual time: it passes once the gate waits for more
            theirs.send(b"XZ" + KAFKA)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            got = await gate().admit(ours, BALANCER)
        assert got.kind == "malformed"


async def test_a_peer_that_closes_or_stalls(autojump_clock: trio.testing.MockClock) -> None:
    ours, theirs = pair()
    with ours:
        theirs.close()
        assert (await gate().admit(ours, BALANCER)).kind == "closed"
    ours, theirs = pair()
    with ours, theirs:
        theirs.send(V2_SIGNATURE[:5])
        got = await gate().admit(ours, BALANCER)
        assert got.kind == "timeout" and "proxy_protocol.timeout_s" in (got.refused or "")

"""The PROXY protocol parser against whole, cut, corrupted and oversized headers: it must say
need-more, parsed, not-a-header or malformed, never raise, and never claim more bytes than the header."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kproxy.identity.proxy_header import (
    MAX_V1_BYTES,
    MAX_V2_BYTES,
    V2_SIGNATURE,
    Malformed,
    NeedMore,
    NotProxy,
    ProxyHeader,
    encode_v1,
    encode_v2,
    parse,
)

ipv4 = st.ip_addresses(v=4).map(str)
ipv6 = st.ip_addresses(v=6).map(str)
ports = st.integers(0, 65535)
# A Kafka frame or a TLS ClientHello: what follows the header, or comes instead of one.
kafka_frame = st.binary(min_size=0, max_size=64).map(lambda b: len(b).to_bytes(4, "big") + b)
client_hello = st.binary(min_size=0, max_size=64).map(lambda b: b"\x16\x03\x01" + b)


def tlv(kind: int, value: bytes) -> bytes:
    return bytes([kind]) + len(value).to_bytes(2, "big") + value


@st.composite
def headers(draw: st.DrawFn) -> tuple[bytes, tuple[str, int], tuple[str, int]]:
    family = draw(st.sampled_from([4, 6]))
    addr = ipv4 if family == 4 else ipv6
    src, dst = (draw(addr), draw(ports)), (draw(addr), draw(ports))
    if draw(st.booleans()):
        return encode_v1(src, dst), src, dst
    tlvs = b"".join(draw(st.lists(st.tuples(st.integers(0, 255), st.binary(max_size=40)), max_size=4).map(
        lambda items: [tlv(k, v) for k, v in items])))
    return encode_v2(src, dst, tlvs), src, dst


@settings(deadline=None)   # a busy 2-core machine must not fail a property on time
@given(headers(), st.one_of(kafka_frame, client_hello))
def test_whole_header_then_client_bytes(h: tuple[bytes, tuple[str, int], tuple[str, int]], rest: bytes) -> None:
    raw, src, dst = h
    got = parse(raw + rest)
    assert isinstance(got, ProxyHeader)
    assert got.length == len(raw)            # exactly the header, never the client's bytes
    assert got.source == src and got.destination == dst


@settings(deadline=None)   # a busy 2-core machine must not fail a property on time
@given(headers(), st.data())
def test_every_cut_asks_for_more_within_the_header(h: tuple[bytes, tuple[str, int], tuple[str, int]],
                                                   data: st.DataObject) -> None:
    raw = h[0]
    cut = data.draw(st.integers(0, len(raw) - 1))
    got = parse(raw[:cut])
    assert isinstance(got, NeedMore)
    assert got.up_to >= 1
    # What it asks to read never runs past the bound of the header's form.
    bound = MAX_V1_BYTES if raw.startswith(b"PROXY") else len(raw)
    assert cut + got.up_to <= bound


@settings(deadline=None)   # a busy 2-core machine must not fail a property on time
@given(st.one_of(kafka_frame, client_hello))
def test_client_traffic_is_not_a_header(data: bytes) -> None:
    # A Kafka frame starts with its size: a PROXY signature would be a frame of over 200 MB.
    assert isinstance(parse(data), NotProxy)


@settings(max_examples=300, deadline=None)
@given(headers(), st.data())
def test_corrupted_headers_never_raise(h: tuple[bytes, tuple[str, int], tuple[str, int]], data: st.DataObject) -> None:
    raw = bytearray(h[0])
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    got = parse(bytes(raw) + data.draw(st.binary(max_size=32)))
    assert isinstance(got, NeedMore | NotProxy | ProxyHeader | Malformed)
    if isinstance(got, ProxyHeader):
        assert got.length <= len(raw) + 32


@settings(deadline=None)   # a busy 2-core machine must not fail a property on time
@given(st.binary(max_size=300))
def test_arbitrary_bytes_after_a_signature_never_raise(tail: bytes) -> None:
    for prefix in (b"PROXY ", V2_SIGNATURE):
        got = parse(prefix + tail)
        assert isinstance(got, NeedMore | ProxyHeader | Malformed)


def test_oversized_headers_are_refused_before_they_arrive() -> None:
    # v2 says its length up front: refused from the first 16 bytes, nothing buffered.
    header = V2_SIGNATURE + bytes([0x21, 0x11]) + (MAX_V2_BYTES).to_bytes(2, "big")
    got = parse(header)
    assert isinstance(got, Malformed) and "longer than the 4096" in got.reason
    # v1 without CRLF in its 107 bytes.
    got = parse(b"PROXY TCP4 " + b"1" * 200)
    assert isinstance(got, Malformed) and "without CRLF" in got.reason


@pytest.mark.parametrize(("raw", "reason"), [
    (b"PROXY TCP4 1.2.3.4 5.6.7.8 1 2\n", "LF, not CRLF"),
    (b"PROXY TCP4 1.2.3.4 5.6.7.8 1\r\n", "has 5 fields"),
    (b"PROXY TCP5 1.2.3.4 5.6.7.8 1 2\r\n", "family 'TCP5'"),
    (b"PROXY TCP4 1.2.3.400 5.6.7.8 1 2\r\n", "not an IPv4 address"),
    (b"PROXY TCP6 1.2.3.4 5.6.7.8 1 2\r\n", "not an IPv6 address"),
    (b"PROXY TCP4 1.2.3.4 5.6.7.8 01 2\r\n", "'01' is not a port"),
    (b"PROXY TCP4 1.2.3.4 5.6.7.8 1 65536\r\n", "'65536' is not a port"),
    (b"PROXY TCP4 1.2.3.4  5.6.7.8 1 2\r\n", "fields"),
    (b"PROXY TCP4 \xff.2.3.4 5.6.7.8 1 2\r\n", "not ASCII"),
    (V2_SIGNATURE + b"\x11\x11\x00\x0c" + bytes(12), "version 1"),
    (V2_SIGNATURE + b"\x22\x11\x00\x0c" + bytes(12), "unknown command 2"),
    (V2_SIGNATURE + b"\x21\x41\x00\x0c" + bytes(12), "unknown address family 4"),
    (V2_SIGNATURE + b"\x21\x13\x00\x0c" + bytes(12), "unknown transport 3"),
    (V2_SIGNATURE + b"\x21\x11\x00\x08" + bytes(8), "address block of 8 bytes"),
    (V2_SIGNATURE + b"\x21\x11\x00\x0e" + bytes(14), "TLV header cut short"),
    (V2_SIGNATURE + b"\x21\x11\x00\x10" + bytes(12) + b"\x04\x00\x05\x00", "runs 4 bytes past"),
])
def test_malformed_headers(raw: bytes, reason: str) -> None:
    got = parse(raw)
    assert isinstance(got, Malformed)
    assert reason in got.reason


def test_headers_without_an_address_leave_the_peer_as_the_client() -> None:
    local = V2_SIGNATURE + b"\x20\x00\x00\x00"
    assert parse(local) == ProxyHeader(2, 16)
    unspec = V2_SIGNATURE + b"\x21\x00\x00\x03abc"
    assert parse(unspec) == ProxyHeader(2, 19)
    unix = V2_SIGNATURE + b"\x21\x31" + (216).to_bytes(2, "big") + bytes(216)
    assert parse(unix) == ProxyHeader(2, 232)
    assert parse(b"PROXY UNKNOWN whatever\r\nrest") == ProxyHeader(1, 24)
    assert parse(b"PROXY UNKNOWN\r\n") == ProxyHeader(1, 15)


def test_aws_nlb_style_header_with_a_vpc_endpoint_tlv() -> None:
    # AWS NLB sends its VPC endpoint id in a custom TLV (type 0xEA) after the IPv4 addresses.
    raw = encode_v2(("10.1.2.3", 40000), ("10.0.0.5", 9092), tlv(0xEA, b"\x01vpce-0123456789abcdef"))
    got = parse(raw + b"\x00\x00\x00\x10")
    assert got == ProxyHeader(2, len(raw), ("10.1.2.3", 40000), ("10.0.0.5", 9092))

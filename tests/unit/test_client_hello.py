"""The host name of a TLS ClientHello, read before any TLS is done: real ClientHellos from OpenSSL (one
record, split over records, cut anywhere), none, and bytes that are no ClientHello, each with a verdict
and never a read past what is there."""

from __future__ import annotations

import functools
import ssl

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kproxy.identity.client_hello import (
    MAX_HELLO_BYTES,
    NeedMore,
    NotClientHello,
    ServerName,
    read_server_name,
)


@functools.cache
def client_hello(server_name: str | None, *, tls13_only: bool = False) -> bytes:
    """The first flight OpenSSL sends for ``server_name`` (None: an IP address, which carries no SNI)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    if tls13_only:
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname=server_name or "127.0.0.1")
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


def split_records(hello: bytes, piece: int) -> bytes:
    """The same handshake message carried in records of at most ``piece`` bytes (RFC 8446 5.1 allows it)."""
    assert hello[0] == 22
    body = hello[5:]
    out = b""
    for at in range(0, len(body), piece):
        chunk = body[at:at + piece]
        out += hello[:3] + len(chunk).to_bytes(2, "big") + chunk
    return out


def test_openssl_client_hello_names_its_host_in_lower_case_without_final_dot() -> None:
    hello = client_hello("Broker-7.Team-A.Kafka.Test")
    assert read_server_name(hello) == ServerName("broker-7.team-a.kafka.test", len(hello))
    assert read_server_name(client_hello("bootstrap.kafka.test", tls13_only=True)).name == "bootstrap.kafka.test"


def test_an_ip_address_sends_no_name() -> None:
    hello = client_hello(None)
    assert read_server_name(hello) == ServerName(None, len(hello))


def test_every_cut_asks_for_more_and_never_for_less_than_it_has() -> None:
    hello = client_hello("bootstrap.kafka.test")
    for cut in range(len(hello)):
        verdict = read_server_name(hello[:cut])
        assert isinstance(verdict, NeedMore) and cut < verdict.up_to <= len(hello), cut


def test_a_client_hello_split_over_records_is_put_together() -> None:
    hello = client_hello("broker-1.kafka.test")
    split = split_records(hello, 100)
    assert read_server_name(split) == ServerName("broker-1.kafka.test", len(split))
    # Bytes after the ClientHello (the rest of a flight) are not read.
    assert read_server_name(split + b"\x17\x03\x03\x00\x05hello").name == "broker-1.kafka.test"


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"\x00\x00\x00\x1a\x00\x12\x00\x03", "not a TLS handshake"),                  # a Kafka ApiVersions frame
        (b"PROXY TCP4 1.2.3.4 5.6.7.8 1 2\r\n", "not a TLS handshake"),
        (b"\x16\x02\x00\x00\x10", "TLS record version 2.0 is not 3.x"),
        (b"\x16\x03\x01\x00\x00", "a TLS record of 0 bytes"),
        (b"\x16\x03\x01\x40\x01", "a TLS record of 16385 bytes"),
        (b"\x16\x03\x01\x00\x04\x02\x00\x00\x00", "the first handshake message is of type 2, not a ClientHello"),
        (b"\x16\x03\x01\x00\x04\x01\xff\xff\xff", "a ClientHello of 16777215 bytes"),
    ],
)
def test_bytes_that_are_no_client_hello_say_why(data: bytes, reason: str) -> None:
    assert read_server_name(data) == NotClientHello(reason)


def _hello_with(extensions: bytes) -> bytes:
    body = b"\x03\x03" + bytes(32) + b"\x00" + b"\x00\x02\x13\x01" + b"\x01\x00" + len(extensions).to_bytes(2, "big")
    body += extensions
    handshake = b"\x01" + len(body).to_bytes(3, "big") + body
    return b"\x16\x03\x01" + len(handshake).to_bytes(2, "big") + handshake


def _sni(*names: tuple[int, bytes]) -> bytes:
    entries = b"".join(kind.to_bytes(1, "big") + len(name).to_bytes(2, "big") + name for kind, name in names)
    data = len(entries).to_bytes(2, "big") + entries
    return b"\x00\x00" + len(data).to_bytes(2, "big") + data


def _malformed(why: str) -> NotClientHello:
    return NotClientHello(f"a malformed ClientHello: {why}")


@pytest.mark.parametrize(
    ("extensions", "expected"),
    [
        (_sni((0, b"a.kafka.test.")), "a.kafka.test"),
        (_sni((7, b"future"), (0, b"b.kafka.test")), "b.kafka.test"),                # unknown name types skipped
        (b"", None),
        (_sni((0, b"a.test"), (0, b"b.test")), _malformed("two host names")),
        (_sni((0, b"a\x00.test")), _malformed("a host name that is not printable ASCII")),
        (_sni((0, b"a b.test")), _malformed("a host name that is not printable ASCII")),
        (_sni((0, b".")), _malformed("an empty host name")),
        (_sni((0, b"a.test")) + _sni((0, b"b.test")), _malformed("extension 0 appears twice")),
        (b"\x00\x00\x00\x08\x00\x06\x00\x00\x09abc", _malformed("a server name runs past the end (9 bytes, 3 left)")),
    ],
)
def test_server_name_extension(extensions: bytes, expected: str | NotClientHello | None) -> None:
    got = read_server_name(_hello_with(extensions))
    if isinstance(expected, NotClientHello):
        assert got == expected
    else:
        assert isinstance(got, ServerName) and got.name == expected


def test_a_client_hello_past_the_bound_is_refused_before_it_is_read() -> None:
    record = b"\x16\x03\x01\x40\x00" + b"\x01\x00\xff\xfc" + bytes(16380)
    verdict = read_server_name(record)
    assert verdict == NeedMore(len(record) + 5)    # 65532 bytes of ClientHello: the next record header
    many = record + (b"\x16\x03\x01\x40\x00" + bytes(16384)) * 3
    assert read_server_name(many) == NotClientHello(f"no whole ClientHello in the first {MAX_HELLO_BYTES} bytes")


@given(st.binary(max_size=600))
def test_any_bytes_get_a_verdict_and_never_an_exception(data: bytes) -> None:
    verdict = read_server_name(data)
    if isinstance(verdict, NeedMore):
        assert verdict.up_to > len(data) or verdict.up_to <= MAX_HELLO_BYTES


# No deadline: the first example makes the ClientHello (an SSL context loading the system's CA store),
# which took over Hypothesis' 200 ms once in a unit run at load average 7.
@settings(deadline=None)
@given(st.integers(min_value=0, max_value=600), st.binary(min_size=1, max_size=8))
def test_a_real_client_hello_with_any_byte_changed_gets_a_verdict(at: int, junk: bytes) -> None:
    hello = bytearray(client_hello("broker-3.kafka.test"))
    at %= len(hello)
    hello[at:at + len(junk)] = junk
    read_server_name(bytes(hello))

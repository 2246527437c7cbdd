"""The HAProxy PROXY protocol header (v1 text, v2 binary) that a load balancer sends before the
client's own bytes, carrying the client's real address.

Pure: ``parse`` looks at the bytes received so far and says whether more are needed, what the header
holds and how many bytes it took, or why it is unusable. It never reads past the header, never
allocates more than it was given, and bounds both forms (107 bytes for v1, ``MAX_V2_BYTES`` for v2).
Which peers may send a header, and what happens to the socket, is ``kproxy.server``'s business.
"""

from __future__ import annotations

import ipaddress
from typing import Final

import attrs

V1_PREFIX: Final = b"PROXY "
V2_SIGNATURE: Final = b"\r\n\r\n\x00\r\nQUIT\n"
# The longest v1 line the spec allows: "PROXY TCP6 " + two full IPv6 addresses + two 5-digit ports + CRLF.
MAX_V1_BYTES: Final = 107
# v2 headers are 16 bytes and a 16-bit length; real senders (AWS NLB, HAProxy, Envoy) stay well under
# this with their TLVs, so a longer one is refused rather than buffered.
MAX_V2_BYTES: Final = 4096
_V2_FIXED: Final = 16
_V2_ADDRESS_BYTES: Final = {0x1: 12, 0x2: 36, 0x3: 216}   # INET, INET6, UNIX


@attrs.frozen(slots=True)
class NeedMore:
    """Not enough bytes yet; at most ``up_to`` more belong to the header (never read further)."""

    up_to: int


@attrs.frozen(slots=True)
class NotProxy:
    """The bytes cannot begin a PROXY header: the client's own traffic starts here."""


@attrs.frozen(slots=True)
class ProxyHeader:
    """A whole header of ``length`` bytes. ``source`` is the client's (address, port), None when the
    header carries no usable address (LOCAL, UNKNOWN, UNSPEC, UNIX): then the connection's own peer
    is the client."""

    version: int
    length: int
    source: tuple[str, int] | None = None
    destination: tuple[str, int] | None = None


@attrs.frozen(slots=True)
class Malformed:
    """The bytes start a PROXY header that is wrong or too long; ``reason`` says how."""

    reason: str


Result = NeedMore | NotProxy | ProxyHeader | Malformed


def parse(data: bytes | bytearray | memoryview) -> Result:
    """Judge ``data``, the first bytes a peer sent (all of them so far)."""
    data = bytes(data[: max(MAX_V1_BYTES, MAX_V2_BYTES)])
    if not data:
        return NeedMore(1)
    if V2_SIGNATURE.startswith(data[: len(V2_SIGNATURE)]):
        if len(data) < len(V2_SIGNATURE):
            return NeedMore(len(V2_SIGNATURE) - len(data))
        return _parse_v2(data)
    if V1_PREFIX.startswith(data[: len(V1_PREFIX)]):
        if len(data) < len(V1_PREFIX):
            return NeedMore(len(V1_PREFIX) - len(data))
        return _parse_v1(data)
    return NotProxy()


def _parse_v1(data: bytes) -> Result:
    end = data.find(b"\r\n", 0, MAX_V1_BYTES)
    if end < 0:
        if len(data) >= MAX_V1_BYTES:
            return Malformed(f"PROXY v1 line without CRLF in its first {MAX_V1_BYTES} bytes")
        if b"\n" in data:
            return Malformed("PROXY v1 line ends with LF, not CRLF")
        return NeedMore(MAX_V1_BYTES - len(data))
    length = end + 2
    try:
        line = data[:end].decode("ascii")
    except UnicodeDecodeError:
        return Malformed("PROXY v1 line is not ASCII")
    fields = line.split(" ")
    if len(fields) >= 2 and fields[1] == "UNKNOWN":
        # The sender could not tell the address; whatever follows UNKNOWN is to be ignored.
        return ProxyHeader(1, length)
    if len(fields) != 6:
        return Malformed(f"PROXY v1 line has {len(fields)} fields, expected 6: {line[:MAX_V1_BYTES]!r}")
    _, family, src, dst, sport, dport = fields
    version = {"TCP4": 4, "TCP6": 6}.get(family)
    if version is None:
        return Malformed(f"PROXY v1 family {family!r} is not TCP4, TCP6 or UNKNOWN")
    try:
        source = (_v1_address(src, version), _v1_port(sport))
        destination = (_v1_address(dst, version), _v1_port(dport))
    except ValueError as e:
        return Malformed(f"PROXY v1 line: {e}")
    return ProxyHeader(1, length, source, destination)


def _v1_address(text: str, version: int) -> str:
    try:
        address = ipaddress.IPv4Address(text) if version == 4 else ipaddress.IPv6Address(text)
    except ValueError:
        raise ValueError(f"{text!r} is not an IPv{version} address") from None
    return str(address)


def _v1_port(text: str) -> int:
    # Decimal, no sign, no leading zero (the spec's own words); 0..65535.
    if not (text.isascii() and text.isdigit()) or (len(text) > 1 and text[0] == "0") or int(text) > 65535:
        raise ValueError(f"{text!r} is not a port")
    return int(text)


def _parse_v2(data: bytes) -> Result:
    if len(data) < _V2_FIXED:
        return NeedMore(_V2_FIXED - len(data))
    ver_cmd, fam = data[12], data[13]
    if ver_cmd >> 4 != 2:
        return Malformed(f"PROXY v2 header with version {ver_cmd >> 4}")
    command = ver_cmd & 0xF
    if command > 1:
        return Malformed(f"PROXY v2 header with unknown command {command}")
    body_length = int.from_bytes(data[14:16], "big")
    total = _V2_FIXED + body_length
    if total > MAX_V2_BYTES:
        return Malformed(f"PROXY v2 header of {total} bytes is longer than the {MAX_V2_BYTES} kproxy accepts")
    if len(data) < total:
        return NeedMore(total - len(data))
    body = data[_V2_FIXED:total]
    if command == 0:
        # LOCAL: the balancer's own connection (a health check); its family and addresses are ignored.
        return ProxyHeader(2, total)
    family, transport = fam >> 4, fam & 0xF
    if family == 0:
        return ProxyHeader(2, total)
    needed = _V2_ADDRESS_BYTES.get(family)
    if needed is None:
        return Malformed(f"PROXY v2 header with unknown address family {family}")
    if transport not in (0x1, 0x2):
        return Malformed(f"PROXY v2 header with unknown transport {transport}")
    if body_length < needed:
        return Malformed(f"PROXY v2 address block of {body_length} bytes, family {family} needs {needed}")
    problem = _tlv_problem(body[needed:])
    if problem is not None:
        return Malformed(problem)
    if family == 0x3:
        return ProxyHeader(2, total)     # a UNIX socket names no IP: the peer is the client
    size = 4 if family == 0x1 else 16
    src = ipaddress.ip_address(body[:size])
    dst = ipaddress.ip_address(body[size:2 * size])
    ports = body[2 * size:2 * size + 4]
    return ProxyHeader(2, total, (str(src), int.from_bytes(ports[:2], "big")),
                       (str(dst), int.from_bytes(ports[2:], "big")))


def _tlv_problem(tlvs: bytes) -> str | None:
    """Why the TLVs after the addresses do not tile their space exactly, or None. Their contents
    are not used (AWS's VPC endpoint id, ALPN, TLS details): only their lengths are checked."""
    pos = 0
    while pos < len(tlvs):
        if len(tlvs) - pos < 3:
            return f"PROXY v2 TLV header cut short at byte {pos} of {len(tlvs)}"
        length = int.from_bytes(tlvs[pos + 1:pos + 3], "big")
        if pos + 3 + length > len(tlvs):
            return f"PROXY v2 TLV of type {tlvs[pos]:#x} runs {pos + 3 + length - len(tlvs)} bytes past the header"
        pos += 3 + length
    return None


def encode_v2(source: tuple[str, int], destination: tuple[str, int], tlvs: bytes = b"") -> bytes:
    """A v2 PROXY header for a TCP connection (what a load balancer sends; tests and benches use it)."""
    src, dst = ipaddress.ip_address(source[0]), ipaddress.ip_address(destination[0])
    if src.version != dst.version:
        raise ValueError("source and destination must both be IPv4 or both IPv6")
    family = 0x11 if src.version == 4 else 0x21
    body = src.packed + dst.packed + source[1].to_bytes(2, "big") + destination[1].to_bytes(2, "big") + tlvs
    return V2_SIGNATURE + bytes([0x21, family]) + len(body).to_bytes(2, "big") + body


def encode_v1(source: tuple[str, int], destination: tuple[str, int]) -> bytes:
    """A v1 PROXY line for a TCP connection."""
    family = "TCP4" if ipaddress.ip_address(source[0]).version == 4 else "TCP6"
    return f"PROXY {family} {source[0]} {destination[0]} {source[1]} {destination[1]}\r\n".encode("ascii")

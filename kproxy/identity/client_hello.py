"""The host name a TLS ClientHello asks for (its ``server_name`` extension, RFC 6066 section 3), read
from the first bytes a client sends, so that one port can serve several virtual clusters told apart
by host name before any TLS is done for either.

Pure: bytes in, a verdict out. ``read_server_name`` says how many bytes it needs (``NeedMore``), the
name (``ServerName``, None when the client sent none), or why the bytes are not a ClientHello. Every
length is checked against the bytes that are there, the records it reads are bounded by
``MAX_HELLO_BYTES``, and it never looks past the ClientHello. It does no cryptography: the TLS library
does the handshake afterwards on the same bytes.
"""

from __future__ import annotations

from typing import Final

import attrs

# A ClientHello is rarely over 2 KiB (post-quantum key shares included); a client may split it over
# several TLS records. Past this many bytes of records the connection is not worth routing.
MAX_HELLO_BYTES: Final = 64 * 1024
_HANDSHAKE: Final = 22
_CLIENT_HELLO: Final = 1
_SERVER_NAME: Final = 0
_HOST_NAME: Final = 0
# TLSPlaintext.length: at most 2^14 (RFC 8446 section 5.1).
_MAX_RECORD: Final = 1 << 14


@attrs.frozen
class NeedMore:
    """Call again with the first ``up_to`` bytes of the stream (the bytes so far, and more)."""

    up_to: int


@attrs.frozen
class ServerName:
    """The ClientHello is whole: ``name`` is the host name it asks for, in lower case without a final
    dot, or None when it names none (an IP address, or a client that sends no SNI)."""

    name: str | None
    length: int         # bytes of TLS records up to the end of the ClientHello


@attrs.frozen
class NotClientHello:
    """The bytes are not (or not only) a TLS ClientHello; ``reason`` is fit for a log line."""

    reason: str


Result = NeedMore | ServerName | NotClientHello


class _Malformed(Exception):
    pass


def read_server_name(data: bytes | bytearray | memoryview) -> Result:
    """What the first bytes a client sent say about the host name it wants."""
    view = memoryview(data)
    handshake = bytearray()
    pos = 0
    while True:
        if len(view) < pos + 5:
            return NeedMore(pos + 5)
        kind, major, length = view[pos], view[pos + 1], int.from_bytes(view[pos + 3:pos + 5], "big")
        if kind != _HANDSHAKE:
            return NotClientHello("not a TLS handshake" if pos == 0 else
                                  "the ClientHello is cut by a TLS record that is not a handshake")
        if major != 3:
            return NotClientHello(f"TLS record version {major}.{view[pos + 2]} is not 3.x")
        if not 0 < length <= _MAX_RECORD:
            return NotClientHello(f"a TLS record of {length} bytes")
        end = pos + 5 + length
        if end > MAX_HELLO_BYTES:
            return NotClientHello(f"no whole ClientHello in the first {MAX_HELLO_BYTES} bytes")
        if len(view) < end:
            return NeedMore(end)
        handshake += view[pos + 5:end]
        pos = end
        if len(handshake) < 4:
            continue
        if handshake[0] != _CLIENT_HELLO:
            return NotClientHello(f"the first handshake message is of type {handshake[0]}, not a ClientHello")
        body_length = int.from_bytes(handshake[1:4], "big")
        if 4 + body_length > MAX_HELLO_BYTES:
            return NotClientHello(f"a ClientHello of {body_length} bytes")
        if len(handshake) >= 4 + body_length:
            try:
                return ServerName(_server_name(memoryview(handshake)[4:4 + body_length]), pos)
            except _Malformed as e:
                return NotClientHello(f"a malformed ClientHello: {e}")


class _Reader:
    __slots__ = ("at", "data")

    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.at = 0

    @property
    def left(self) -> int:
        return len(self.data) - self.at

    def take(self, n: int, what: str) -> memoryview:
        if n > self.left:
            raise _Malformed(f"{what} runs past the end ({n} bytes, {self.left} left)")
        out = self.data[self.at:self.at + n]
        self.at += n
        return out

    def number(self, size: int, what: str) -> int:
        return int.from_bytes(self.take(size, what), "big")

    def vector(self, size: int, what: str) -> memoryview:
        return self.take(self.number(size, f"the length of {what}"), what)


def _server_name(body: memoryview) -> str | None:
    r = _Reader(body)
    r.take(2 + 32, "legacy_version and random")
    if len(r.vector(1, "legacy_session_id")) > 32:
        raise _Malformed("legacy_session_id is longer than 32 bytes")
    suites = r.vector(2, "cipher_suites")
    if not suites or len(suites) % 2:
        raise _Malformed(f"cipher_suites of {len(suites)} bytes")
    if not r.vector(1, "legacy_compression_methods"):
        raise _Malformed("no compression method")
    if r.left == 0:
        return None     # a ClientHello without extensions (TLS 1.2 allows it) names no host
    extensions = _Reader(r.vector(2, "extensions"))
    if r.left:
        raise _Malformed(f"{r.left} bytes after the extensions")
    found: str | None = None
    seen: set[int] = set()
    while extensions.left:
        kind = extensions.number(2, "an extension type")
        data = extensions.vector(2, f"extension {kind}")
        if kind in seen:
            raise _Malformed(f"extension {kind} appears twice")
        seen.add(kind)
        if kind == _SERVER_NAME:
            found = _host_name(data)
    return found


def _host_name(data: memoryview) -> str | None:
    r = _Reader(data)
    names = _Reader(r.vector(2, "server_name_list"))
    if r.left:
        raise _Malformed("bytes after the server_name_list")
    host: str | None = None
    while names.left:
        kind = names.number(1, "a name_type")
        name = bytes(names.vector(2, "a server name"))
        if kind != _HOST_NAME:
            continue    # no other name type is defined; skip what a later RFC might add
        if host is not None:
            raise _Malformed("two host names")     # RFC 6066: one name of each type
        if not name or any(b <= 0x20 or b >= 0x7F for b in name):
            raise _Malformed("a host name that is not printable ASCII")
        host = name.decode("ascii").lower().rstrip(".")
        if not host:
            raise _Malformed("an empty host name")
    return host

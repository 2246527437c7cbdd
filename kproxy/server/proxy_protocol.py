"""The PROXY protocol on an accepted client socket: who may send a header, and reading exactly the
header's bytes before TLS or Kafka see the stream.

Bytes are peeked first and consumed only once they are known to belong to the header, so a client
that sends no header loses nothing, and TLS or the frame reader start at the client's first byte.
The parsing itself is ``kproxy.identity.proxy_header`` (pure).
"""

from __future__ import annotations

import ipaddress
import socket

import attrs
import trio

from kproxy.config import ProxyProtocolConfig
from kproxy.identity import proxy_header
from kproxy.identity.proxy_header import Malformed, NeedMore, NotProxy, ProxyHeader

# Enough to tell a v1 or v2 signature from a Kafka frame or a ClientHello, and to read a v2 length.
_FIRST_PEEK = 16


@attrs.frozen
class Admission:
    """What the PROXY stage decided for one connection: ``client`` is the address the rest of kproxy
    sees as the source; ``refused`` (a log-ready reason) means close the connection."""

    client: tuple[str, int]
    refused: str | None = None
    via: tuple[str, int] | None = None     # the load balancer, when a header named someone else
    kind: str = ""                         # why refused: untrusted, missing, malformed, timeout, closed


class ProxyProtocolGate:
    """``proxy_protocol`` for the client listeners."""

    def __init__(self, cfg: ProxyProtocolConfig) -> None:
        self.mode = cfg.mode
        self.timeout_s = cfg.timeout_s
        self.trusted = tuple(ipaddress.ip_network(c) for c in cfg.trusted)
        self.refused: dict[str, int] = {}     # reason kind -> count, for /metrics

    @property
    def active(self) -> bool:
        return self.mode != "off"

    def is_trusted(self, host: str) -> bool:
        try:
            address = ipaddress.ip_address(host.partition("%")[0])
        except ValueError:
            return False
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            # A dual-stack listener sees IPv4 peers as ::ffff:a.b.c.d; the CIDRs are written as IPv4.
            mapped = address.ipv4_mapped
            return any(mapped in net or address in net for net in self.trusted)
        return any(address in net for net in self.trusted)

    async def admit(self, raw: socket.socket, peer: tuple[str, int]) -> Admission:
        """Read (or refuse) the PROXY header of a new connection from ``peer``; never raises for
        anything the peer sends."""
        trusted = self.is_trusted(peer[0])
        if not trusted:
            if self.mode == "required":
                return self._refuse(peer, "untrusted", f"peer {peer[0]} is not in proxy_protocol.trusted "
                                                       "(proxy_protocol.mode: required)")
            # optional: a header from this peer is refused; anything else is the client's own bytes.
            verdict = await self._peek_verdict(raw)
            if verdict is None or isinstance(verdict, NotProxy):
                return Admission(peer)
            return self._refuse(peer, "untrusted", f"peer {peer[0]} sent a PROXY header but is not in "
                                                   "proxy_protocol.trusted")
        with trio.move_on_after(self.timeout_s):
            try:
                return await self._read(raw, peer)
            except OSError as e:     # a reset between peeking and taking the bytes
                return self._refuse(peer, "closed", f"connection lost in the PROXY header: {e}")
        return self._refuse(peer, "timeout", f"no whole PROXY header within {self.timeout_s:g}s "
                                             "(proxy_protocol.timeout_s)")

    async def _peek_verdict(self, raw: socket.socket) -> proxy_header.Result | None:
        with trio.move_on_after(self.timeout_s):
            try:
                data = await _peek(raw, _FIRST_PEEK)
            except OSError:
                return None
            return proxy_header.parse(data) if data else None
        return None

    async def _read(self, raw: socket.socket, peer: tuple[str, int]) -> Admission:
        taken = bytearray()
        want = _FIRST_PEEK
        while True:
            try:
                chunk = await _peek(raw, want)
            except OSError as e:
                return self._refuse(peer, "closed", f"connection lost before the PROXY header: {e}")
            if not chunk:
                return self._refuse(peer, "closed", "closed before sending a PROXY header")
            verdict = proxy_header.parse(bytes(taken) + chunk)
            if isinstance(verdict, NotProxy):
                if taken:
                    return self._refuse(peer, "malformed", "bytes that began a PROXY signature and then "
                                                           "did not follow it")
                if self.mode == "required":
                    return self._refuse(peer, "missing", "no PROXY header (proxy_protocol.mode: required)")
                return Admission(peer)
            if isinstance(verdict, Malformed):
                return self._refuse(peer, "malformed", verdict.reason)
            if isinstance(verdict, ProxyHeader):
                _consume(raw, verdict.length - len(taken))
                if verdict.source is None:
                    return Admission(peer)
                return Admission(verdict.source, via=peer)
            # Every byte peeked so far belongs to the header: take it, then wait for the rest.
            assert isinstance(verdict, NeedMore)
            _consume(raw, len(chunk))
            taken += chunk
            want = verdict.up_to
            await trio.lowlevel.wait_readable(raw)

    def _refuse(self, peer: tuple[str, int], kind: str, reason: str) -> Admission:
        self.refused[kind] = self.refused.get(kind, 0) + 1
        return Admission(peer, refused=reason, kind=kind)


async def _peek(raw: socket.socket, limit: int) -> bytes:
    while True:
        try:
            return raw.recv(limit, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            await trio.lowlevel.wait_readable(raw)


def _consume(raw: socket.socket, n: int) -> None:
    # Only bytes already peeked are consumed, so they are in the kernel's buffer and this never blocks.
    while n > 0:
        got = raw.recv(n)
        if not got:
            return
        n -= len(got)

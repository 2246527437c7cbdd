"""A bare Kafka connection built on kproxy's own codec, for tests that need exact frames on the wire
(pipelining, malformed input, long polls) rather than a client library's behaviour."""

from __future__ import annotations

import socket
import struct
from typing import Any

from kproxy.protocol.messages import Request, Response, body_class, decode_response, encode_request_frame


class Wire:
    def __init__(self, address: str, timeout: float = 10.0) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self._buf = b""

    def send(self, api_key: int, version: int, correlation_id: int, body: Any) -> None:
        req = Request.build(api_key, version, correlation_id, "wire", body)
        self.sock.sendall(b"".join(bytes(b) for b in encode_request_frame(req)))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read_frame(self) -> bytes | None:
        """The next frame without its size prefix; None when the peer closed the connection."""
        while True:
            if len(self._buf) >= 4:
                (n,) = struct.unpack(">i", self._buf[:4])
                if len(self._buf) >= 4 + n:
                    frame, self._buf = self._buf[4 : 4 + n], self._buf[4 + n :]
                    return frame
            try:
                chunk = self.sock.recv(65536)
            except ConnectionResetError:
                return None
            if not chunk:
                return None
            self._buf += chunk

    def receive(self, api_key: int, version: int) -> Response:
        frame = self.read_frame()
        assert frame is not None, "connection closed instead of a response"
        return decode_response(frame, api_key, version)

    def metadata(self, correlation_id: int = 1, version: int = 12) -> Response:
        self.send(3, version, correlation_id, body_class(3, "request")(topics=[]))
        return self.receive(3, version)

    def closed_by_peer(self) -> bool:
        return self.read_frame() is None

    def close(self) -> None:
        self.sock.close()

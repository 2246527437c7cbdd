"""A TCP relay that can be cut and restored, standing in for a broker that goes away and comes back.

tansu's only durable storage engines here are S3 and PostgreSQL, and memory storage forgets every
record on restart; so the outage is made in the network instead: the relay drops every connection
and refuses new ones while it is down, exactly what kproxy sees of a restarting broker, while the
records survive behind it.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class Relay:
    def __init__(self, target: tuple[str, int], port: int, host: str = "127.0.0.1", record: bool = False) -> None:
        self.target = target
        # With ``record``: every byte sent towards the target, per connection in accept order.
        self.sent: list[bytearray] | None = [] if record else None
        self.address = (host, port)
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.connections_accepted = 0
        self.hung = threading.Event()   # set: bytes are swallowed, connections stay open

    @property
    def bootstrap(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    def start(self) -> None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(self.address)
        s.listen(64)
        self._listener = s
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def stop(self) -> None:
        """Cut every connection (RST) and refuse new ones until ``start``."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        with self._lock:
            conns, self._conns = self._conns, set()
        for c in conns:
            try:
                c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)   # the timeout was for connecting; idle connections stay up
            tap = None
            with self._lock:
                self._conns |= {client, upstream}
                self.connections_accepted += 1
                if self.sent is not None:
                    tap = bytearray()
                    self.sent.append(tap)
            for a, b, t in ((client, upstream, tap), (upstream, client, None)):
                threading.Thread(target=pipe, args=(a, b, self.hung, t), daemon=True).start()


def pipe(src: socket.socket, dst: socket.socket, hung: threading.Event | None = None,
         tap: bytearray | None = None) -> None:
    """Copy ``src`` to ``dst`` until either ends (bytes are swallowed while ``hung`` is set; ``tap``
    keeps a copy of what was sent), then shut both down so the other direction ends too."""
    try:
        while data := src.recv(262144):
            if hung is None or not hung.is_set():
                if tap is not None:
                    tap += data
                dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

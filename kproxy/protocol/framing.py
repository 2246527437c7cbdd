"""Splits a Kafka byte stream into size-prefixed frames, without I/O and without concatenating chunks.

The caller receives straight into the buffer that ``recv_buffer()`` hands out (``recv_into``) and
reports how many bytes arrived with ``received(n)``; ``next_frame()`` then yields each complete frame
(without its 4-byte prefix) as a memoryview. Small frames are views into a shared chunk buffer that
is never overwritten while a frame may still reference it; a frame larger than what is left of the
chunk gets a buffer of its own, sized from its prefix once the prefix has passed the size checks.
"""

from __future__ import annotations

import struct

from kproxy.protocol.errors import FrameError

_SIZE = struct.Struct(">i")

DEFAULT_MAX_FRAME_SIZE = 100 * 1024 * 1024  # Kafka's socket.request.max.bytes default
DEFAULT_CHUNK_SIZE = 256 * 1024


class FrameReader:
    """Incremental frame splitter. Not thread-safe; one per connection direction."""

    __slots__ = ("_big", "_big_fill", "_buf", "_chunk_size", "_end", "_start", "max_frame_size",
                 "total_bytes")

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
                 chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        if max_frame_size < 1:
            raise ValueError("max_frame_size must be positive")
        self.max_frame_size = max_frame_size
        self._chunk_size = chunk_size
        self._buf = bytearray(chunk_size)
        self._start = 0          # first unconsumed byte in _buf
        self._end = 0            # one past the last received byte in _buf
        self._big: bytearray | None = None   # dedicated buffer of a large frame being received
        self._big_fill = 0
        self.total_bytes = 0

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as frames."""
        return self._end - self._start + (self._big_fill if self._big is not None else 0)

    @property
    def at_frame_boundary(self) -> bool:
        return self._big is None and self._end == self._start

    def recv_buffer(self) -> memoryview:
        """A writable view to receive into; never empty."""
        if self._big is not None:
            return memoryview(self._big)[self._big_fill:]
        if self._end == len(self._buf):
            self._make_room()
            if self._big is not None:
                return memoryview(self._big)[self._big_fill:]
        return memoryview(self._buf)[self._end:]

    def received(self, n: int) -> None:
        self.total_bytes += n
        if self._big is not None:
            self._big_fill += n
        else:
            self._end += n

    def feed(self, data: bytes) -> None:
        """Convenience for tests and non-recv_into callers: copy ``data`` in."""
        mv = memoryview(data)
        while mv:
            dst = self.recv_buffer()
            k = min(len(dst), len(mv))
            dst[:k] = mv[:k]
            self.received(k)
            mv = mv[k:]

    def next_frame(self) -> memoryview | None:
        """The next complete frame, or None until more bytes arrive. FrameError on a bad prefix."""
        big = self._big
        if big is not None:
            if self._big_fill < len(big):
                return None
            self._big = None
            self._big_fill = 0
            return memoryview(big)
        avail = self._end - self._start
        if avail < 4:
            return None
        start = self._start
        (size,) = _SIZE.unpack_from(self._buf, start)
        if size < 0:
            raise FrameError(f"negative frame size {size}", self.total_bytes - avail, "frame.size")
        if size > self.max_frame_size:
            raise FrameError(f"frame of {size} bytes exceeds the {self.max_frame_size}-byte limit",
                             self.total_bytes - avail, "frame.size")
        if avail >= 4 + size:
            frame = memoryview(self._buf)[start + 4 : start + 4 + size]
            self._start = start + 4 + size
            if self._start == self._end and self._end > len(self._buf) // 2:
                # Everything consumed and the chunk is half used: start the next frame on a fresh
                # chunk so a small frame does not keep a nearly full chunk alive on its own.
                self._new_chunk()
            return frame
        if start + 4 + size <= len(self._buf):
            return None  # fits in the current chunk: keep receiving into it
        if size <= self._chunk_size // 2:
            # Small frame that straddles the chunk end: move its head to a fresh chunk.
            self._new_chunk()
            return None
        self._to_big_buffer(size)
        return None

    def _to_big_buffer(self, size: int) -> None:
        # Large frame: one buffer exactly its size, the bytes already here copied once.
        big = bytearray(size)
        have = self._end - self._start - 4
        big[:have] = self._buf[self._start + 4 : self._end]
        self._start = self._end = 0
        self._buf = bytearray(self._chunk_size)
        self._big = big
        self._big_fill = have

    def _make_room(self) -> None:
        """The chunk is full: move a large incomplete frame to its own buffer, else start a chunk."""
        avail = self._end - self._start
        if avail >= 4:
            (size,) = _SIZE.unpack_from(self._buf, self._start)
            if self._chunk_size // 2 < size <= self.max_frame_size and avail < 4 + size:
                self._to_big_buffer(size)
                return
        self._new_chunk()

    def _new_chunk(self) -> None:
        tail = self._buf[self._start : self._end]
        # Room for at least one more chunk of reads: a full chunk of unconsumed bytes (a caller
        # feeding without taking frames) must still get a non-empty receive buffer.
        size = self._chunk_size if len(tail) <= self._chunk_size // 2 else len(tail) + self._chunk_size
        self._buf = bytearray(size)
        self._buf[: len(tail)] = tail
        self._start = 0
        self._end = len(tail)


def frame_size_prefix(size: int) -> bytes:
    return _SIZE.pack(size)

"""Splits a Kafka byte stream into size-prefixed frames, without I/O and without concatenating chunks.

The caller receives straight into the buffer that ``recv_buffer()`` hands out (``recv_into``) and
reports how many bytes arrived with ``received(n)``; ``next_frame()`` then yields each complete frame
(without its 4-byte prefix) as a memoryview. Memory follows the bytes that actually arrived: the
receive chunk is allocated on first use, starts small and grows with the traffic, and an idle reader
can give it back; a frame larger than the chunk gets a buffer of its own that, unless the peer's
size claims are trusted, grows as its bytes arrive rather than by what its prefix claims.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from kproxy.protocol.errors import FrameError

_SIZE = struct.Struct(">i")

DEFAULT_MAX_FRAME_SIZE = 100 * 1024 * 1024  # Kafka's socket.request.max.bytes default
DEFAULT_CHUNK_SIZE = 256 * 1024
FIRST_CHUNK_SIZE = 4 * 1024        # an idle connection costs a few KiB, not a whole chunk
GROWTH_FLOOR = 64 * 1024           # first step of an untrusted large frame's buffer
STREAM_CHUNK_SIZE = 1024 * 1024    # what a frame taken piece by piece (cut-through) holds
# Streaming chunks given back by idle connections and kept for the next streamed answer, at most
# this many per process: a consumer's chunk is not reallocated per answer, and an idle connection
# still holds nothing (the buffer budget never waits on a chunk no connection uses).
SPARE_CHUNKS = 4
# A whole frame up to this size found in a streaming chunk is copied out rather than lent (above).
COPY_MAX = 64 * 1024
_SPARE: list[bytearray] = []


# ``FrameReader.next_frame(stream_from)``'s answer for a frame that is for the streaming path: a
# sentinel no frame is (compared by identity).
STREAMS = memoryview(b"")
# ``stream_from`` for a pump whose session streams nothing: only a frame already streaming is.
STREAM_NONE = 1 << 62

class FrameReader:
    """Incremental frame splitter. Not thread-safe; one per connection direction.

    ``trust_claims``: allocate a large frame's buffer from its size prefix at once (the broker
    side, where one copy of multi-megabyte Fetch answers matters); otherwise the buffer grows in
    doubling steps no larger than twice what has arrived (the client side, where four bytes must not
    buy an allocation of the frame limit).
    """

    __slots__ = ("_big", "_big_fill", "_big_size", "_buf", "_chunk_size", "_end", "_hot", "_lent", "_next_chunk",
                 "_ready", "_reusable", "_start", "chunk_is_large", "frames", "held_bytes", "limit_name", "max_frame_size",
                 "recv_cap", "streaming_left", "total_bytes", "trust_claims")

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
                 chunk_size: int = DEFAULT_CHUNK_SIZE, *, trust_claims: bool = True,
                 limit_name: str | None = None) -> None:
        if max_frame_size < 1:
            raise ValueError("max_frame_size must be positive")
        self.max_frame_size = max_frame_size
        self.limit_name = limit_name     # the setting behind max_frame_size, named in errors
        self.trust_claims = trust_claims
        self._chunk_size = chunk_size
        self._next_chunk = min(FIRST_CHUNK_SIZE, chunk_size)
        self._buf: bytearray | None = None   # allocated on first receive
        self._start = 0          # first unconsumed byte in _buf
        self._end = 0            # one past the last received byte in _buf
        self._big: bytearray | None = None   # dedicated buffer of a large frame being received
        self._big_fill = 0
        self._big_size = 0       # the large frame's size (its buffer may still be smaller)
        self._ready: memoryview | None = None   # a complete large frame not yet taken
        self.total_bytes = 0
        self.frames = 0          # frames returned so far
        self.streaming_left = 0  # bytes of a frame taken piece by piece (cut-through) still to take
        self.held_bytes = 0      # bytes of buffer held allocated (for the process-wide buffer budget)
        self.chunk_is_large = False   # the receive chunk has grown past the first size
        self._reusable = False   # every byte of the chunk went out as pieces: it may be refilled
        # The last frame was taken piece by piece and no whole frame came since: the next one is
        # most likely large too, so the next receive takes a spare streaming chunk (``_SPARE``)
        # rather than a small first chunk (no chunk allocated per answer of a busy consumer, no
        # small first receive split off as its own write).
        self._hot = False
        self._lent = False       # a frame was returned as a view of the chunk: never a spare
        # The most the next receive into the chunk may take (None: its room): a streamed frame's
        # next record batch header and no more, so the batch's body can bypass the chunk (splice).
        self.recv_cap: int | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as frames."""
        ready = len(self._ready) + 4 if self._ready is not None else 0
        return self._end - self._start + (self._big_fill if self._big is not None else 0) + ready

    def _held(self) -> None:
        # ``held_bytes``, worked out again whenever a buffer is taken, let go or replaced: the pumps
        # read it after every receive, and most receives change none.
        held = len(self._buf) if self._buf is not None else 0
        if self._ready is not None:
            held += len(self._ready)
        self.held_bytes = held + (len(self._big) if self._big is not None else 0)
        self.chunk_is_large = self._buf is not None and len(self._buf) > FIRST_CHUNK_SIZE

    @property
    def at_frame_boundary(self) -> bool:
        return self._big is None and self._ready is None and self._end == self._start and not self.streaming_left

    # -- cut-through: a large frame taken piece by piece as it arrives, never held whole

    def frame_starting(self, whole: bool = False) -> tuple[int, memoryview] | None:
        """The frame at the head of the chunk when its size prefix has arrived but not all of it, and
        it is not held in a buffer of its own: (its size, its bytes here so far). Ask before
        ``next_frame``, which would give such a frame a buffer of its own. With ``whole``, a frame
        that has arrived whole too (its bytes, no more): taken piece by piece, its chunk is refilled
        at once, where a frame returned whole keeps its chunk (and a new one is allocated)."""
        if self._big is not None or self._ready is not None or self.streaming_left or self._buf is None:
            return None
        start = self._start
        avail = self._end - start
        if avail < 4:
            return None
        (size,) = _SIZE.unpack_from(self._buf, start)
        if size < 0 or (avail >= 4 + size and not whole):
            return None
        return size, memoryview(self._buf)[start + 4:start + 4 + min(avail - 4, size)]

    def stream_current(self) -> None:
        """Take the frame ``frame_starting`` reported piece by piece (``take_piece``) from now on.
        Its size may exceed ``max_frame_size``: only a chunk of it is ever held."""
        got = self.frame_starting(whole=True)
        if got is None:
            raise ValueError("no frame is starting")
        self.streaming_left = got[0]
        self._start += 4
        assert self._buf is not None
        if len(self._buf) < STREAM_CHUNK_SIZE and len(got[1]) < got[0]:
            # The chunk is refilled rather than outgrown while a frame streams: take its full size
            # now, or a large frame would pass through a first, small chunk a few KiB at a time.
            # Larger than a stored frame's chunk: fewer, larger receives and sends per frame.
            self._new_chunk(grow=False, need=STREAM_CHUNK_SIZE)

    def take_piece(self) -> memoryview | None:
        """The next bytes of the streamed frame that have arrived, or None. The view is valid until
        the next ``recv_buffer``: the chunk is then refilled, so a streamed frame holds one chunk."""
        if not self.streaming_left or self._buf is None:
            return None
        k = min(self._end - self._start, self.streaming_left)
        if k <= 0:
            return None
        piece = memoryview(self._buf)[self._start:self._start + k]
        self._start += k
        self.streaming_left -= k
        if not self.streaming_left:
            self.frames += 1
            self._hot = True
        if self._start == self._end:
            self._reusable = True
        return piece

    def skip_streamed(self, n: int) -> None:
        """``n`` bytes of the streamed frame went from the socket to their destination without
        passing through this reader (spliced). Only when everything received has been taken."""
        if not 0 < n <= self.streaming_left or self._start != self._end:
            raise ValueError(f"cannot skip {n} bytes ({self.streaming_left} left, "
                             f"{self._end - self._start} received and not taken)")
        self.total_bytes += n
        self.streaming_left -= n
        if not self.streaming_left:
            self.frames += 1
            self._hot = True

    def recv_buffer(self) -> memoryview:
        """A writable view to receive into; never empty."""
        big = self._big
        if big is not None:
            if self._big_fill == self._big_size:
                # Complete but not taken yet (a caller feeding ahead): set it aside.
                self._ready = memoryview(big)
                self._big = None
                self._big_fill = 0
                self._held()
                return self.recv_buffer()
            if self._big_fill == len(big):
                big = self._grow_big()
            return memoryview(big)[self._big_fill:]
        if self._buf is None:
            self._buf = _SPARE.pop() if self._hot and _SPARE else bytearray(self._next_chunk)
            self._lent = False
            self._held()
        if self._reusable:
            self._reusable = False
            if self._start == self._end:
                self._start = self._end = 0
        if self._end == len(self._buf):
            self._make_room()
            if self._big is not None:
                return self.recv_buffer()
        cap = self.recv_cap
        if cap is not None and self.streaming_left:
            return memoryview(self._buf)[self._end:self._end + max(1, min(cap, self.streaming_left))]
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

    def take_buffered(self) -> bytes | None:
        """The bytes received and not yet returned as frames, taken out (the reader is then at a frame
        boundary), when they sit in the receive chunk from a frame boundary: what another reader of
        the socket (the lane) must see first. None, taking nothing, when a frame has a buffer of its
        own or is being taken piece by piece."""
        if self._big is not None or self._ready is not None or self.streaming_left:
            return None
        if self._buf is None or self._start == self._end:
            return b""
        # Frames already returned may be views of the chunk: the bytes are copied, the chunk kept.
        data = bytes(self._buf[self._start:self._end])
        self._start = self._end
        return data

    @property
    def idle_chunk_is_large(self) -> bool:
        """Nothing buffered, and the receive chunk has grown past the first size: worth releasing
        if the connection is about to wait. (``chunk_is_large`` first saves the call when it has not.)"""
        return (self.chunk_is_large and self._big is None
                and self._ready is None and self._end == self._start and not self.streaming_left)

    def release_idle(self) -> int:
        """Give back the receive chunk when nothing is buffered; returns the bytes released.

        Call it only between receives (never while a view from ``recv_buffer`` is being filled).
        Frames already returned stay valid: they keep their chunk alive for as long as they are used.
        The next chunk is allocated at the next receive, at the size the traffic had grown it to.
        """
        if self._buf is None or not self.at_frame_boundary:
            return 0
        released = len(self._buf)
        if not self._lent and len(self._buf) == STREAM_CHUNK_SIZE and len(_SPARE) < SPARE_CHUNKS:
            # Only pieces were taken from it, each written before the next receive: no view of it
            # is in use, so another streamed answer may refill it.
            _SPARE.append(self._buf)
        self._buf = None
        self._start = self._end = 0
        self._held()
        return released

    def next_frame(self, stream_from: int = 0) -> memoryview | None:
        """The next complete frame, or None until more bytes arrive. FrameError on a bad prefix.

        A pump that streams large frames passes ``stream_from`` (their least size): ``STREAMS`` then
        says the frame at the head is for the streaming path (its size prefix says at least that
        much, or a streamed frame is under way), which the pump tries before it takes the frame
        with ``next_frame()``. One call per frame, where a separate look at the head took two."""
        if self.streaming_left:
            return STREAMS if stream_from else None
        if self._ready is not None:
            frame, self._ready = self._ready, None
            self.frames += 1
            self._held()
            self._hot = False
            return frame
        big = self._big
        if big is not None:
            if self._big_fill < self._big_size:
                return None
            self._big = None
            self._big_fill = 0
            self.frames += 1
            self._held()
            self._hot = False
            return memoryview(big)
        buf = self._buf
        avail = self._end - self._start
        if avail < 4 or buf is None:
            return None
        start = self._start
        (size,) = _SIZE.unpack_from(buf, start)
        if stream_from and size >= stream_from:
            return STREAMS
        if size < 0 or size > self.max_frame_size:
            raise FrameError(self._size_problem(size, buf[start:start + 4]), self.total_bytes - avail,
                             "frame.size")
        if avail >= 4 + size:
            self._start = start + 4 + size
            self.frames += 1
            self._hot = False
            if size <= COPY_MAX and len(buf) == STREAM_CHUNK_SIZE and not self._lent:
                # A small frame behind a streamed one, in a streaming chunk: a copy, so the chunk is
                # not lent and goes back to the spares (a fresh 1 MiB chunk costs a zero fill). A
                # large one is lent: copying it would cost more than the fill.
                frame = memoryview(bytes(buf[start + 4 : start + 4 + size]))
                if self._start == self._end:
                    self._start = self._end = 0     # nothing of it is in use: refilled from the top
                return frame
            frame = memoryview(buf)[start + 4 : start + 4 + size]
            self._reusable = False     # the frame is a view of the chunk: never refilled under it
            self._lent = True
            if self._start == self._end and self._end > len(buf) // 2:
                # Everything consumed and the chunk is half used: start the next frame on a fresh
                # chunk so a small frame does not keep a nearly full chunk alive on its own.
                self._new_chunk(grow=self._end == len(buf))
            return frame
        if start + 4 + size <= len(buf):
            return None  # fits in the current chunk: keep receiving into it
        if size <= self._chunk_size // 2:
            # Small frame that straddles the chunk end: move its head to a fresh chunk.
            self._new_chunk(grow=True, need=size + 4)
            return None
        self._to_big_buffer(size)
        return None

    def _size_problem(self, size: int, prefix: bytes | bytearray) -> str:
        what = f"negative frame size {size}" if size < 0 else (
            f"frame of {size} bytes exceeds the {self.max_frame_size}-byte limit"
            + (f" ({self.limit_name})" if self.limit_name else ""))
        hint = foreign_protocol(bytes(prefix))
        return f"{what}; {hint}" if hint else what

    def _to_big_buffer(self, size: int) -> None:
        # Large frame: a buffer of its own, the bytes already here copied once.
        assert self._buf is not None
        have = self._end - self._start - 4
        first = size if self.trust_claims else min(size, max(2 * have, GROWTH_FLOOR))
        big = bytearray(first)
        big[:have] = self._buf[self._start + 4 : self._end]
        self._start = self._end = 0
        self._buf = None       # the next chunk is allocated when the frame is done
        self._big = big
        self._big_fill = have
        self._big_size = size
        self._held()

    def _grow_big(self) -> bytearray:
        # An untrusted large frame's buffer is full: double it, never past the frame's size.
        assert self._big is not None
        old = self._big
        new = bytearray(min(self._big_size, 2 * len(old)))
        new[: len(old)] = old
        self._big = new
        self._held()
        return new

    def _make_room(self) -> None:
        """The chunk is full: move a large incomplete frame to its own buffer, else start a chunk."""
        assert self._buf is not None
        if self.streaming_left:
            # Mid-frame of a streamed frame: no size prefix here, the rest is taken as pieces.
            self._new_chunk(grow=False)
            return
        avail = self._end - self._start
        if avail >= 4:
            (size,) = _SIZE.unpack_from(self._buf, self._start)
            if self._chunk_size // 2 < size <= self.max_frame_size and avail < 4 + size:
                self._to_big_buffer(size)
                return
        self._new_chunk(grow=True)

    def _new_chunk(self, grow: bool, need: int = 0) -> None:
        old = self._buf
        assert old is not None
        if grow:
            # The traffic filled a chunk: the next one is larger, up to the configured chunk size.
            self._next_chunk = min(self._chunk_size, max(self._next_chunk * 2, len(old)))
        tail = old[self._start : self._end]
        # Room for at least one more receive: a chunk full of unconsumed bytes (a caller feeding
        # without taking frames) must still get a non-empty receive buffer.
        size = max(self._next_chunk, need, 2 * len(tail) if len(tail) > self._next_chunk // 2 else 0)
        if len(tail) >= size:
            size = len(tail) + self._next_chunk
        buf = _SPARE.pop() if size == STREAM_CHUNK_SIZE and _SPARE else bytearray(size)
        buf[: len(tail)] = tail
        self._buf = buf
        self._lent = False
        self._start = 0
        self._end = len(tail)
        self._held()


_HTTP_STARTS = (b"GET ", b"POST", b"PUT ", b"HEAD", b"DELE", b"OPTI", b"PATC", b"CONN", b"HTTP", b"PRI ")


def foreign_protocol(head: bytes) -> str | None:
    """A hint when the first bytes of a stream are not Kafka at all but HTTP or TLS; None otherwise."""
    if head[:4] in _HTTP_STARTS:
        return ("the bytes look like HTTP, not Kafka: a web client or health check is pointed at the "
                "Kafka port (the admin listener serves HTTP)")
    if len(head) >= 3 and head[0] == 0x16 and head[1] == 0x03:
        return ("the bytes look like a TLS handshake: the client uses TLS but this listener is plaintext "
                "(set tls.enabled in kproxy, or security.protocol=PLAINTEXT in the client)")
    return None


def frame_size_prefix(size: int) -> bytes:
    return _SIZE.pack(size)


def frame_taker() -> Callable[[FrameReader, int], memoryview | None]:
    """``FrameReader.next_frame`` as a function of the reader, for the pumps: the accelerator's
    ``next_frame``, which does the method's two common cases (a frame wholly in the receive chunk, a
    chunk without a complete frame) in C and calls the method, the reference, for every other; the
    method itself without the accelerator (``KPROXY_CODEC=python``, a build without a compiler)."""
    from kproxy.protocol.compiler import native_function

    setup = native_function("frames_setup")
    take = native_function("next_frame")
    if setup is None or take is None:
        return FrameReader.next_frame
    setup(FrameReader, STREAMS, COPY_MAX, STREAM_CHUNK_SIZE)
    return take

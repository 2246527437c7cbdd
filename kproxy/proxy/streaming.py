"""Cut-through: forward a large frame while it arrives, once nothing that could change its size is left.

A ``FrameStream`` walks one frame (a Fetch response, a Produce request) by its schema as its bytes
come in, in any chunking: every field up to a ``records`` payload is decoded as it passes and handed
on (fixed-size integer fields patched in place), the records go through untouched while their batch
headers are counted, and the frame's closing tagged fields are held back and re-encoded at the end
with exactly the length they had, since the size prefix went out first. Pure: bytes in, buffers out.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import attrs

from kproxy.protocol import primitives as P
from kproxy.protocol.compiler import encode_to
from kproxy.protocol.errors import DecodeError
from kproxy.protocol.messages import (
    api_by_key,
    request_header_version,
    response_codecs,
    response_header_version,
)
from kproxy.protocol.primitives import read_uvarint, write_uvarint
from kproxy.protocol.records import LOG_OVERHEAD, MAGIC_OFFSET, V2_HEADER_SIZE
from kproxy.protocol.schema import FieldSpec, StructSpec
from kproxy.proxy.filters import Filter, FilterChain

# Below this a frame is stored and forwarded whole: streaming it would save nothing measurable.
STREAM_MIN_BYTES = 64 * 1024
FETCH, PRODUCE = 1, 0
# What one receive takes while a streamed frame's walker decodes fields between records payloads,
# when record bodies are spliced: a partition's fields fit, and little of the records after them.
HEAD_RECV_BYTES = 512
# The tag of the field that pads a re-encoded tail to its original length. Unknown to every Kafka
# version, so every flexible-version parser skips it (KIP-482); high enough that Kafka will not
# plausibly give it a meaning, small enough to take two bytes.
PAD_TAG = 10_000

_FIXED = {"int8": P.INT8, "bool": P.INT8, "int16": P.INT16, "uint16": P.UINT16, "int32": P.INT32,
          "uint32": P.UINT32, "int64": P.INT64, "float64": P.FLOAT64}
_INTS = frozenset({"int8", "int16", "uint16", "int32", "uint32", "int64"})
# A RecordBatch v2 header: base offset, length, leader epoch, magic, crc, attributes, last offset
# delta, first and max timestamps, producer id and epoch, base sequence, record count (61 bytes).
_V2_HEADER = struct.Struct(">qiibIhiqqqhii")


# What can stream: Fetch answers (records towards the client) and Produce requests (towards the broker).
STREAMED = frozenset({(FETCH, "response"), (PRODUCE, "request")})


def why_stored(chain: FilterChain, api_key: int, kind: str, size: int, *, transport_streams: bool,
               min_bytes: int = STREAM_MIN_BYTES, consents: Callable[[Filter], bool] | None = None) -> str | None:
    """Why a frame of ``size`` bytes must be stored and forwarded whole; None when it may stream.
    The reason is what the completed-request entry and the log say. ``consents`` asks a filter that
    must see whole frames of this api whether it lets this one exchange stream all the same
    (``Filter.may_stream_response``); without it, any such filter stores the frame."""
    if (api_key, kind) not in STREAMED:
        return "api"
    if size < min_bytes:
        return "small"
    if not transport_streams:
        return "transport"
    if consents is None:
        name = chain.whole_frame_filter(api_key, kind)
        return f"filter {name}" if name is not None else None
    for f in chain.whole_frame_filters(api_key, kind):
        if not consents(f):
            return f"filter {f.name}"
    return None


class StreamError(DecodeError):
    """The bytes do not follow the schema; the frame cannot be streamed (nor forwarded)."""


@attrs.define(slots=True)
class RecordsFacts:
    """What the batch headers of one ``records`` field said as they passed: what telemetry and quotas
    read from ``kproxy.protocol.records.summarize`` on a stored frame."""

    path: tuple[Any, ...]              # (topic name or id, partition index)
    size: int = -1                     # bytes of the field (-1: null)
    batches: int = 0
    records: int = 0
    whole_bytes: int = 0               # bytes of whole batches (a cut last batch is not counted)
    first_batch_bytes: int = 0         # the size the first batch's header claims (it may be cut)
    first_offset: int | None = None
    last_offset: int | None = None
    compressed: bool = False
    malformed: bool = False            # bytes that are not batches: counting stopped there
    # Per whole batch: (base offset, last offset, records, first timestamp, max timestamp,
    # attributes), what telemetry reads from a stored frame's batch headers.
    batch_headers: list[tuple[int, int, int, int | None, int | None, int]] = attrs.field(factory=list)


@attrs.define(slots=True)
class StreamHead:
    """The frame as far as the first records payload: what a decision to stream is made on."""

    api_key: int
    api_version: int
    size: int                          # of the frame, without its 4-byte prefix
    values: dict[str, Any]             # the root's scalar fields and the header's, by name


Patch = int | Callable[[int], int]
# Given the head, the fixed-size integers to patch (dotted path from the root, "correlation_id" for
# the header), or None to store the frame and forward it whole instead.
Decide = Callable[[StreamHead], dict[str, Patch] | None]
# Given the root's tagged fields {tag: bytes}, the ones to send instead (same tags or fewer).
TailRewrite = Callable[[dict[int, bytes]], dict[int, bytes]]


class FrameStream:
    """One frame of ``kind`` ("request" or "response") of ``api_key`` v``api_version``, ``size`` bytes
    after the 4-byte prefix. ``feed`` the bytes as they arrive; it returns the buffers to write now,
    size prefix first. Views of the fed data are among them: write them before reusing that memory.

    ``decide`` runs once, when the head is known: at the first records payload, or at the end of a
    frame that has none; until then nothing is returned. It returns the fixed-size integers to patch
    (dotted paths from the root, ``correlation_id`` for the header's), or None to store the frame:
    ``stored`` is then True and the ``feed`` that completes the frame returns it whole, unchanged.
    ``rewrite_tail`` (responses) gets the root's closing tagged fields at the end and returns those
    to send instead; they are re-encoded in exactly the length they had (``fit_tags``).

    ``skeleton`` holds what was sent with every records payload left out (empty records in their
    place): decoded with the ordinary codec, it is the answer filters, telemetry and the
    transparency check see, while ``facts`` says what the records held.
    """

    def __init__(self, api_key: int, api_version: int, kind: str, size: int, *,
                 decide: Decide | None = None, rewrite_tail: TailRewrite | None = None) -> None:
        api = api_by_key(api_key)
        spec = api.request if kind == "request" else api.response
        if spec is None or api_version not in spec.versions:
            raise StreamError(f"no {kind} schema for api {api_key} v{api_version}", 0, kind)
        self.api_key = api_key
        self.api_version = api_version
        self.kind = kind
        self.size = size
        self.flexible = api_version in spec.flexible
        self.decide = decide
        self.rewrite_tail = rewrite_tail if self.flexible and kind == "response" else None
        self.facts: list[RecordsFacts] = []
        self.values: dict[str, Any] = {}
        self.patches: dict[str, Patch] = {}
        self.stored = False
        self.padded = 0                    # bytes of padding the tail rewrite added
        self.dropped_hint = False          # the rewritten tail did not fit: the hint was dropped
        self.sent = 0                      # bytes returned so far, size prefix included
        self._spec = spec
        self._pos = 0                      # bytes of the frame taken so far
        self._decided = decide is None
        self._notes: list[tuple[int, int, str, Any, int]] = []   # ints read before the decision
        self._head = bytearray()           # head bytes read, not yet returned
        self._head_at = 0                  # their offset in the frame
        self._stash = bytearray()          # bytes received that the walker has not taken yet
        self._store: bytearray | None = None
        self._records_left = 0             # of the records payload passing through
        self._unseen = 0                   # bytes of a batch header counted from a peek, not yet passed
        self._batches: _BatchCounter | None = None
        self._tail: bytearray | None = None  # the root's closing tagged fields, held back
        self._rest = False                 # past the schema: bytes pass as they are
        self._topic: Any = None
        self._partition: Any = None
        self._out: list = [P.INT32.pack(size)]
        self.skeleton = bytearray()
        # The walk: a flat program of the frame's fields (``_program``), run from ``_pc``; the counts
        # of the arrays being walked, innermost last, with where each item's fields start.
        self._ops = _program(api_key, api_version, kind, self.rewrite_tail is not None)
        self._pc: int | None = 0
        self._loops: list[list[int]] = []
        self._run_notes: list[tuple[int, Any, str, int]] = []
        self._need = 0                     # bytes the step the walk stopped at needs, from its start

    @property
    def done(self) -> bool:
        return self._pos == self.size and self._pc is None and self._tail is None

    @property
    def held_bytes(self) -> int:
        """Bytes the stream itself holds: the head not yet handed out, or a stored frame so far."""
        return len(self._head) + len(self._stash) + (len(self._store) if self._store is not None else 0)

    # -- driving

    def feed(self, data: Any) -> list:
        """The next bytes of the frame (never past its end); the buffers to write now."""
        view = data if isinstance(data, memoryview) else memoryview(data)
        n = len(view)
        if self._pos + len(self._stash) + n > self.size:
            raise StreamError(f"{n} bytes fed past the end of a {self.size}-byte frame", self._pos, self.kind)
        i = 0
        while i < n:
            if self._store is not None:
                self._store += view[i:]
                self._pos += n - i
                break
            if self._records_left or self._rest:
                take = n - i if self._rest else min(self._records_left, n - i)
                piece = view[i:i + take]
                if self._batches is not None:
                    self._batches.feed(piece)
                elif self._rest:
                    self.skeleton += piece
                self._flush_head()
                self._out.append(piece)
                self._pos += take
                i += take
                if self._records_left:
                    self._records_left -= take
                    if not self._records_left:
                        self._batches = None
                        self._run(view, i, i)     # fields that need no bytes (the end of the walk)
                continue
            if self._tail is not None:
                self._tail += view[i:]
                self._pos += n - i
                break
            stash = self._stash
            if not stash:
                at = self._run(view, i, n)
                if at == i and self._pc is not None and not (self._records_left or self._tail is not None
                                                             or self._store is not None or self._rest):
                    # The next field is not here whole: keep its first bytes until the rest comes.
                    stash += view[i:]
                    break
                i = at
                continue
            # A field began in an earlier piece: join it with enough of this one to finish it (a copy
            # of the field's bytes, not of the piece) and walk on from there.
            held = len(stash)
            if held + n - i < self._need:
                stash += view[i:]      # the field is not whole yet: each byte is held once
                break
            extra = min(n - i, max(_JOIN, self._need - held, 2 * held))
            while True:
                joined = bytes(stash) + bytes(view[i:i + extra])
                at = self._run(memoryview(joined), 0, len(joined))
                if at or extra == n - i:
                    break
                extra = min(n - i, 2 * extra)
            if not at:
                stash += view[i:]
                break
            stash.clear()
            i += at - held
        if self._pos + len(self._stash) == self.size:
            self._end()
        if self._store is not None:
            return self._finish_stored()
        if not self._decided:
            return []
        self._flush_head()
        out, self._out = self._out, []
        self.sent += sum(len(b) for b in out)
        return out

    # -- splicing: the body of a record batch may pass outside ``feed``, never seen (zero-copy)

    def splice_room(self) -> int:
        """Bytes that may pass to the client now without the walker seeing them: the rest of the body
        of a record batch whose header has been counted (0 when the next bytes must be fed)."""
        counter = self._batches
        if counter is None or self._store is not None or self._head:
            return 0
        return min(self._unseen + counter.in_body, self._records_left)

    def take_unseen(self, head: Any) -> int:
        """At a record batch boundary, ``head`` is what is waiting of the next batch, read without
        taking it (a peek). When it holds a whole v2 batch header, the batch is counted as ``feed``
        would count it, and the return says how many bytes, from the batch's start, may now go to
        the client unseen (``skip``): the whole batch, as far as the records go. 0 otherwise."""
        counter = self._batches
        if (counter is None or counter.in_body or not counter.at_boundary or counter.facts.malformed
                or self._store is not None or self._head or self._unseen
                or self._records_left < V2_HEADER_SIZE or len(head) < V2_HEADER_SIZE
                or head[MAGIC_OFFSET] != 2):
            return 0
        counter.feed(memoryview(head)[:V2_HEADER_SIZE])
        if counter.facts.malformed:
            return 0      # the bytes are forwarded as they come, uncounted, as ``feed`` does
        self._unseen = V2_HEADER_SIZE
        return self.splice_room()

    def recv_hint(self) -> int | None:
        """At a batch boundary inside records: how many bytes to receive next so that the walker reads
        the next batch header and no more (its body may then be spliced); None when any amount will do."""
        counter = self._batches
        if self._store is not None or self._rest or self._tail is not None:
            return None
        if counter is None:
            # Between records payloads (the next partition's fields): a little, so that the records
            # after them are mostly left on the socket for splicing.
            return HEAD_RECV_BYTES
        if counter.in_body or counter.facts.malformed:
            return None
        return min(counter.header_missing, self._records_left)

    def skip(self, n: int) -> list:
        """``n`` bytes of the batch body ``splice_room`` allowed went to the client outside ``feed``;
        returns what to write now (the same as ``feed``: usually nothing)."""
        if not 0 < n <= self.splice_room():
            raise StreamError(f"{n} bytes skipped where {self.splice_room()} may be", self._pos, self.kind)
        assert self._batches is not None
        head = min(n, self._unseen)
        self._unseen -= head
        if n > head:
            self._batches.passed(n - head)
        self._pos += n
        self.sent += n
        self._records_left -= n
        if not self._records_left:
            self._batches = None
            self._run(memoryview(b""), 0, 0)
        if self._pos + len(self._stash) == self.size:
            self._end()
        self._flush_head()
        out, self._out = self._out, []
        self.sent += sum(len(b) for b in out)
        return out

    def _end(self) -> None:
        """Every byte of the frame has arrived."""
        if self._tail is not None:
            tail, self._tail = bytes(self._tail), None
            self._pc = None
            tail = self._rewrite(tail)
            self._head += tail
            self.skeleton += _minimal_count(tail) if self.padded else tail
            self._head_known()
            return
        if self._store is not None:
            return
        if self._pc is not None and not self._records_left:
            raise StreamError(f"the {self.kind} ends inside a field ({self.size} bytes)", self.size, self.kind)

    def _flush_head(self) -> None:
        if self._head:
            self._out.append(bytes(self._head))
            self._head_at += len(self._head)
            self._head.clear()

    def _head_known(self) -> None:
        """The head is decoded up to the first records payload, or the frame ended: decide."""
        if self._decided:
            return
        self._decided = True
        assert self.decide is not None
        patches = self.decide(StreamHead(self.api_key, self.api_version, self.size, dict(self.values)))
        if patches is None:
            self.stored = True
            self._store = self._head
            self._head = bytearray()
            self._out = []
            self._pc = None
            self._records_left = 0
            self._tail = None
            return
        self.patches = patches
        for at, skel_at, path, codec, value in self._notes:
            self._patch(at, skel_at, path, codec, value)
        self._notes = []

    def _patch(self, at: int, skel_at: int, path: str, codec: Any, value: int) -> None:
        new = self.patches.get(path)
        if new is not None:
            value = new(value) if callable(new) else new
            codec.pack_into(self._head, at - self._head_at, value)
            codec.pack_into(self.skeleton, skel_at, value)

    def _finish_stored(self) -> list:
        assert self._store is not None
        if self._pos < self.size:
            return []
        whole, self._store = self._store, None
        self.sent = 4 + self.size
        return [P.INT32.pack(self.size), whole]

    # -- the walk: the frame's program (``_program``) run over the bytes that have arrived. Every
    # step is whole or not at all: one that finds too few bytes stops the run where it began, and
    # ``feed`` keeps those bytes until more come. The bytes taken go to the head and the skeleton.

    def _run(self, buf: Any, p: int, end: int) -> int:
        """Walk ``buf[p:end]`` from the current step; returns where the walk stopped: the bytes are
        exhausted, a records payload or the closing tags begin (``_records_left``, ``_tail``), or the
        program ended."""
        pc = self._pc
        if pc is None:
            return p
        ops = self._ops
        last = len(ops)
        loops = self._loops
        notes = self._run_notes
        values = self.values
        start = p
        need = 0
        try:
            while True:
                if pc == last:
                    self._pc = None
                    self._take(buf, start, p)
                    # Bytes past what this version's schema holds: kept, as the codec keeps them.
                    self._rest = self._pos < self.size
                    self._head_known()
                    return p
                op = ops[pc]
                code = op[0]
                if code <= _FIX:                         # _INT, _FIX: a fixed-size value
                    codec = op[1]
                    q = p + codec.size
                    if q > end:
                        need = q
                        break
                    (value,) = codec.unpack_from(buf, p)
                    if code == _INT:
                        notes.append((p, codec, op[2], value))
                    if op[3]:
                        values[op[2]] = value
                    if op[4]:
                        self._partition = value
                    p = q
                elif code == _NEXT:                      # the end of an array item
                    loop = loops[-1]
                    loop[0] -= 1
                    if loop[0] > 0:
                        pc = op[1]
                        continue
                    loops.pop()
                elif code == _ARRAY:
                    got = _length_at(buf, p, end, op[1], P.INT32)
                    if got is None:
                        need = end + 1
                        break
                    count, p = got
                    if count <= 0:
                        pc = op[2]
                        continue
                    loops.append([count])
                elif code == _TAGS:
                    q = _tags_end(buf, p, end)
                    if q < 0:
                        need = -q
                        break
                    p = q
                elif code == _UUID:
                    q = p + 16
                    if q > end:
                        need = q
                        break
                    if op[1]:
                        self._topic = P.make_uuid(*P.UUID_PAIR.unpack_from(buf, p))
                    p = q
                elif code == _BLOB:                      # a string or bytes: length, then its bytes
                    got = _length_at(buf, p, end, op[1], op[2])
                    if got is None:
                        need = end + 1
                        break
                    n, q = got
                    if n > 0 and q + n > end:
                        need = q + n
                        break
                    if op[4] or op[5]:
                        raw: bytes | None = bytes(buf[q:q + n]) if n > 0 else b"" if n == 0 else None
                        if op[4] and raw is not None:
                            self._topic = raw.decode("utf-8", "replace")
                        if op[5]:
                            values[op[3]] = raw
                    p = q + max(n, 0)
                elif code == _RECORDS:
                    got = _length_at(buf, p, end, op[1], P.INT32)
                    if got is None:
                        need = end + 1
                        break
                    n, q = got
                    self._take(buf, start, q)
                    facts = RecordsFacts((self._topic, self._partition), n)
                    self.facts.append(facts)
                    p_was = p
                    p = start = q
                    pc += 1
                    if n <= 0:
                        continue
                    # The skeleton holds empty records in their place.
                    del self.skeleton[len(self.skeleton) - (q - p_was):]
                    self.skeleton += b"\x01" if op[1] else b"\x00\x00\x00\x00"
                    self._pc = pc
                    self._head_known()
                    if self._store is None:
                        self._batches = _BatchCounter(facts)
                        self._records_left = n
                    return p
                elif code == _TAIL:
                    # The root's closing tags: held back and re-encoded at the end (``_end``).
                    self._take(buf, start, p)
                    self._pc = None
                    self._head_known()
                    if self._store is None:
                        if self._decided:
                            self._flush_head()
                        self._tail = bytearray()
                    return p
                elif code == _CLIENT_ID:                 # a request header's client_id: never compact
                    q = p + 2
                    if q > end:
                        need = q
                        break
                    (n,) = P.INT16.unpack_from(buf, p)
                    if n > 0:
                        if q + n > end:
                            need = q + n
                            break
                        values["client_id"] = bytes(buf[q:q + n]).decode("utf-8", "replace")
                        q += n
                    else:
                        values["client_id"] = "" if n == 0 else None
                    p = q
                else:
                    raise StreamError(f"field {op[1]} of type {op[2]} cannot be walked",
                                      self._pos + p - start, self.kind)
                pc += 1
        except _TooLong as e:
            raise StreamError("unsigned varint longer than 5 bytes", self._pos + e.at - start, self.kind) from None
        self._pc = pc
        self._need = need - p
        self._take(buf, start, p)
        return p

    def _take(self, buf: Any, start: int, p: int) -> None:
        """``buf[start:p]`` was walked: it joins the head and the skeleton, and the integers read in
        it are patched (or noted until the decision)."""
        pos, skel = self._pos, len(self.skeleton)
        if p > start:
            chunk = buf[start:p]
            self._head += chunk
            self.skeleton += chunk
            self._pos += p - start
        notes = self._run_notes
        if not notes:
            return
        for at, codec, path, value in notes:
            frame_at, skel_at = pos + at - start, skel + at - start
            if self._decided:
                self._patch(frame_at, skel_at, path, codec, value)
            else:
                self._notes.append((frame_at, skel_at, path, codec, value))
        notes.clear()

    # -- the tail

    def _rewrite(self, tail: bytes) -> bytes:
        parsed = parse_tags(tail)
        if parsed is None:
            raise StreamError("the closing tagged fields do not parse", self.size - len(tail), self.kind)
        tags, end = parsed
        assert self.rewrite_tail is not None
        wanted = self.rewrite_tail(dict(tags))
        if wanted == dict(tags):
            return tail
        fitted, self.padded, self.dropped_hint = fit_tags(wanted, end)
        return fitted + tail[end:]


_PARTITION_KEYS = frozenset({"partition_index", "partition", "index"})

# The steps of a walk. Each is a tuple, its opcode first:
#   (_INT | _FIX, codec, path, is a root field, is a partition index): a fixed-size value; _INT ones
#       may be patched;
#   (_UUID, names the topic); (_BLOB, compact, length codec, path, names the topic, is a root
#       string): a string or bytes; (_RECORDS, compact); (_TAGS,): a tagged-field section, skipped;
#   (_ARRAY, compact, where an empty array goes on), its item's steps, then (_NEXT, the item's first
#   step); (_TAIL,): the root's closing tags; (_CLIENT_ID,): a request header's client id;
#   (_BAD, path, type): a field the walk cannot pass.
_INT, _FIX, _UUID, _BLOB, _RECORDS, _TAGS, _ARRAY, _NEXT, _TAIL, _CLIENT_ID, _BAD = range(11)
# Bytes of a new piece joined with a field's first bytes held from the last one (doubled when the
# field is longer).
_JOIN = 256
_PROGRAMS: dict[tuple[int, int, str, bool], tuple[tuple, ...]] = {}


class _TooLong(Exception):
    def __init__(self, at: int) -> None:
        self.at = at


def _program(api_key: int, version: int, kind: str, tail: bool) -> tuple[tuple, ...]:
    """The steps that walk a frame of ``api_key`` v``version`` (header included); ``tail``: the
    root's closing tags are held back for ``rewrite_tail``. Built once per version."""
    key = (api_key, version, kind, tail)
    got = _PROGRAMS.get(key)
    if got is None:
        api = api_by_key(api_key)
        spec = api.request if kind == "request" else api.response
        assert spec is not None
        flexible = version in spec.flexible
        ops: list[tuple] = []
        if kind == "request":
            ops += [(_INT, P.INT16, "api_key", True, False), (_INT, P.INT16, "api_version", True, False),
                    (_INT, P.INT32, "correlation_id", True, False), (_CLIENT_ID,)]
            if request_header_version(api_key, version) >= 2:
                ops.append((_TAGS,))
        else:
            ops.append((_INT, P.INT32, "correlation_id", True, False))
            if response_header_version(api_key, version) >= 1:
                ops.append((_TAGS,))
        _compile_struct(spec.root, "", version, flexible, tail, ops)
        got = _PROGRAMS[key] = tuple(ops)
    return got


def _compile_struct(s: StructSpec, path: str, v: int, flexible: bool, tail: bool, ops: list[tuple]) -> None:
    for f in s.fields:
        if v in f.versions and not f.is_tagged(v, flexible):
            _compile_field(f, f"{path}{f.name}", v, flexible, ops)
    if flexible:
        ops.append((_TAIL,) if not path and tail else (_TAGS,))


def _compile_field(f: FieldSpec, path: str, v: int, flexible: bool, ops: list[tuple]) -> None:
    compact = flexible and not f.flex_never
    if f.array:
        at = len(ops)
        ops.append(())
        if f.struct is not None:
            _compile_struct(f.struct, path + ".", v, flexible, False, ops)
        else:
            _compile_scalar(f, path, compact, ops)
        ops.append((_NEXT, at + 1))
        ops[at] = (_ARRAY, compact, len(ops))
    elif f.struct is not None:
        _compile_struct(f.struct, path + ".", v, flexible, False, ops)
    else:
        _compile_scalar(f, path, compact, ops)


def _compile_scalar(f: FieldSpec, path: str, compact: bool, ops: list[tuple]) -> None:
    t = f.type
    root = "." not in path
    codec = _FIXED.get(t)
    if codec is not None:
        ops.append((_INT if t in _INTS else _FIX, codec, path, root, f.name in _PARTITION_KEYS))
    elif t == "uuid":
        ops.append((_UUID, f.entity == "topic_id"))
    elif t == "string":
        ops.append((_BLOB, compact, P.INT16, path, f.entity == "topic", root))
    elif t == "bytes":
        ops.append((_BLOB, compact, P.INT32, path, False, False))
    elif t == "records":
        ops.append((_RECORDS, compact))
    else:
        ops.append((_BAD, path, t))


def _uvarint_at(buf: Any, p: int, end: int) -> tuple[int, int] | None:
    value = shift = 0
    for q in range(p, p + 5):
        if q >= end:
            return None
        b = buf[q]
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, q + 1
        shift += 7
    raise _TooLong(p + 5)


def _length_at(buf: Any, p: int, end: int, compact: bool, codec: Any) -> tuple[int, int] | None:
    """A length or count prefix at ``p`` and where it ends; negative for null; None: not all here."""
    if compact:
        got = _uvarint_at(buf, p, end)
        return None if got is None else (got[0] - 1, got[1])
    q = p + codec.size
    if q > end:
        return None
    return codec.unpack_from(buf, p)[0], q


def _tags_end(buf: Any, p: int, end: int) -> int:
    """Where the tagged-field section at ``p`` ends; when it is not all here, minus the least end
    it needs (so a large field is waited for whole, not walked again as each piece comes)."""
    got = _uvarint_at(buf, p, end)
    if got is None:
        return -(end + 1)
    count, p = got
    for _ in range(count):
        got = _uvarint_at(buf, p, end)
        if got is None:
            return -(end + 1)
        got = _uvarint_at(buf, got[1], end)
        if got is None:
            return -(end + 1)
        size, p = got
        p += size
        if p > end:
            return -p
    return p


class _BatchCounter:
    """Counts the batches of one records payload from their headers as the bytes pass, in any
    chunking: the figures ``records.summarize`` gives for the whole payload. A batch counts once its
    last byte has passed (a Fetch answer's last batch may be cut at max_bytes). Bytes that are not
    batches stop the count (``RecordsFacts.malformed``); they are forwarded all the same, as a stored
    frame's records are."""

    __slots__ = ("_head", "_need", "_pending", "_size", "_skip", "facts")

    def __init__(self, facts: RecordsFacts) -> None:
        self.facts = facts
        self._head = bytearray()         # the current batch's header, when it straddles pieces
        self._skip = 0                   # bytes of the current batch's body still to pass
        self._need = LOG_OVERHEAD
        self._pending: tuple[int, int, int, int | None, int | None, int] | None = None
        self._size = 0                   # of the batch being passed

    def feed(self, piece: memoryview) -> None:
        i, n = 0, len(piece)
        f = self.facts
        unpack = P.INT32.unpack_from
        while i < n and not f.malformed:
            if self._skip:
                take = min(self._skip, n - i)
                self._skip -= take
                i += take
                if not self._skip:
                    self._commit()
                continue
            if not self._head and n - i >= V2_HEADER_SIZE:
                # The usual case: the whole header is in this piece; read it where it lies.
                length = unpack(piece, i + 8)[0]
                if length < 14:
                    f.malformed = True
                    return
                need = min(V2_HEADER_SIZE, LOG_OVERHEAD + length)
                self._header(piece, i, need, length)
                i += need
                continue
            take = min(self._need - len(self._head), n - i)
            self._head += piece[i:i + take]
            i += take
            if len(self._head) < self._need:
                continue
            length = unpack(self._head, 8)[0]
            if self._need == LOG_OVERHEAD:
                if length < 14:
                    f.malformed = True
                    return
                # Enough of the header to count the batch: a v2 batch's whole header, a legacy
                # message's magic and attributes.
                self._need = min(V2_HEADER_SIZE, LOG_OVERHEAD + length)
                if len(self._head) < self._need:
                    continue
            head, self._head = self._head, bytearray()
            need, self._need = self._need, LOG_OVERHEAD
            self._header(head, 0, need, length)

    @property
    def in_body(self) -> int:
        """Bytes of the current batch's body still to pass (its header has been counted)."""
        return self._skip

    @property
    def at_boundary(self) -> bool:
        """No part of a batch header is held: the next byte starts a batch."""
        return not self._skip and not self._head

    @property
    def header_missing(self) -> int:
        """At most this many bytes complete the next batch's header."""
        return V2_HEADER_SIZE - len(self._head)

    def passed(self, n: int) -> None:
        """``n`` bytes of the current batch's body passed unseen (``n`` <= ``in_body``)."""
        self._skip -= n
        if not self._skip:
            self._commit()

    def _header(self, buf: Any, at: int, head_len: int, length: int) -> None:
        """A batch whose first ``head_len`` bytes are at ``buf[at:]``; the rest of it follows."""
        magic = buf[at + MAGIC_OFFSET] if head_len > MAGIC_OFFSET else -1
        if magic == 2 and head_len == V2_HEADER_SIZE:
            # One unpack of the whole header: this runs once per batch of every streamed frame.
            base, _, _, _, _, attributes, delta, ts, max_ts, _, _, _, count = _V2_HEADER.unpack_from(buf, at)
            if count < 0:
                self.facts.malformed = True
                return
            self._pending = (base, base + delta, count, ts, max_ts, attributes)
        elif magic in (0, 1) and head_len > MAGIC_OFFSET + 1:
            # A legacy message: one record; magic 1 carries a timestamp after its attributes.
            base = P.INT64.unpack_from(buf, at)[0]
            ts = P.INT64.unpack_from(buf, at + 18)[0] if magic == 1 and head_len >= 26 else None
            self._pending = (base, base, 1, ts, ts, buf[at + MAGIC_OFFSET + 1])
        else:
            self.facts.malformed = True
            return
        self._skip = LOG_OVERHEAD + length - head_len
        self._size = LOG_OVERHEAD + length
        if not self.facts.first_batch_bytes:
            self.facts.first_batch_bytes = self._size
        if not self._skip:
            self._commit()

    def _commit(self) -> None:
        assert self._pending is not None
        pending = self._pending
        base, last, records, _, _, attributes = pending
        self._pending = None
        f = self.facts
        f.batches += 1
        f.records += records
        f.whole_bytes += self._size
        f.compressed |= bool(attributes & 0x07)
        f.batch_headers.append(pending)
        if f.first_offset is None:
            f.first_offset = base
        f.last_offset = last


# ---------------------------------------------------------------------------------------------
# Tagged fields that keep their length


def parse_tags(data: bytes) -> tuple[dict[int, bytes], int] | None:
    """The tagged-field section at the start of ``data``: ({tag: bytes}, where it ends), or None when
    it does not parse."""
    try:
        count, pos = read_uvarint(data, 0)
        out: dict[int, bytes] = {}
        for _ in range(count):
            tag, pos = read_uvarint(data, pos)
            size, pos = read_uvarint(data, pos)
            if pos + size > len(data) or tag in out:
                return None
            out[tag] = bytes(data[pos:pos + size])
            pos += size
    except (IndexError, P.ShortBuffer):
        return None
    return out, pos


def _uvarint_exactly(value: int, width: int) -> bytes | None:
    """``value`` as an unsigned varint of exactly ``width`` bytes, or None when it needs more. A
    varint with trailing zero groups (0x80 0x00 for 0) is valid: parsers read to the last byte."""
    out = bytearray()
    for i in range(width):
        out.append((value & 0x7F) | (0x80 if i < width - 1 else 0))
        value >>= 7
    return bytes(out) if value == 0 else None


def encode_tags(tags: dict[int, bytes], pad: int = 0) -> bytes | None:
    """Tagged fields in tag order; with ``pad`` > 0, plus a field of tag ``PAD_TAG`` that takes
    exactly ``pad`` bytes on the wire (None when no such field exists: fewer than 3 bytes)."""
    items = sorted(tags.items())
    field = b""
    if pad:
        tag = write_uvarint(PAD_TAG)
        for width in range(1, 6):
            n = pad - len(tag) - width
            length = _uvarint_exactly(n, width) if n >= 0 else None
            if length is not None:
                field = tag + length + bytes(n)
                break
        else:
            return None
    out = bytearray(write_uvarint(len(items) + (1 if pad else 0)))
    for t, data in items:
        if field and t > PAD_TAG:
            out += field
            field = b""
        out += write_uvarint(t)
        out += write_uvarint(len(data))
        out += data
    out += field
    return bytes(out)


def _fit(tags: dict[int, bytes], length: int) -> tuple[bytes, int] | None:
    if PAD_TAG in tags:
        return None
    plain = encode_tags(tags)
    assert plain is not None
    room = length - len(plain)
    if room == 0:
        return plain, 0
    if room < 0:
        return None
    # The pad field adds one to the count, whose varint may grow by a byte.
    grow = len(write_uvarint(len(tags) + 1)) - len(write_uvarint(len(tags)))
    padded = encode_tags(tags, room - grow) if room - grow > 0 else None
    if padded is not None and len(padded) == length:
        return padded, room
    # Too little room for a pad field (under 3 bytes): the count's varint takes it instead, with
    # trailing zero groups, which every parser reads as the same number.
    count = write_uvarint(len(tags))
    stretched = _uvarint_exactly(len(tags), len(count) + room)
    if stretched is None:
        return None
    return stretched + plain[len(count):], room


def fit_tags(wanted: dict[int, bytes], length: int, hint_tag: int = 0) -> tuple[bytes, int, bool]:
    """``wanted`` encoded in exactly ``length`` bytes: (bytes, bytes of padding, hint dropped).

    Shorter: padded with an unknown tagged field (``PAD_TAG``), which every flexible-version parser
    skips (KIP-482), or for one or two bytes by writing the field count's varint longer. Longer, or too little room left for a pad field: the hint (``hint_tag``, KIP-951's
    node_endpoints) is dropped and the rest padded; clients then refresh metadata, as before KIP-951."""
    fitted = _fit(wanted, length)
    if fitted is not None:
        return fitted[0], fitted[1], False
    fitted = _fit({t: d for t, d in wanted.items() if t != hint_tag}, length)
    if fitted is None:
        raise StreamError(f"the closing tagged fields cannot be re-encoded in {length} bytes", 0, "response")
    return fitted[0], fitted[1], True


def _minimal_count(tail: bytes) -> bytes:
    """``tail`` with its field count written in the fewest bytes. A tail fitted into one or two
    spare bytes carries a stretched count (``_fit``): valid on the wire, but the codec re-encodes it
    minimally, so the skeleton (what the transparency check re-encodes) holds the minimal form."""
    count, at = read_uvarint(tail, 0)
    minimal = write_uvarint(count)
    return tail if at == len(minimal) else minimal + tail[at:]


def strip_padding(tags: dict[int, bytes]) -> dict[int, bytes]:
    return {t: d for t, d in tags.items() if t != PAD_TAG}


# A Fetch response body with nothing but its closing tags: throttle_time_ms, error_code, session_id,
# an empty compact array of topics. The schema's codec decodes and encodes node_endpoints through it.
_EMPTY_FETCH_HEAD = bytes(10) + b"\x01"


def node_endpoints_rewrite(version: int, rewrite: Callable[[list], bool]) -> TailRewrite:
    """A ``rewrite_tail`` for Fetch responses: decodes KIP-951's node_endpoints (tag 0) with the
    schema's codec, lets ``rewrite`` change the list in place (it returns whether it did), and
    encodes it again; the other tags pass as they are."""
    _, codec = response_codecs(FETCH, version)

    def rewrite_tail(tags: dict[int, bytes]) -> dict[int, bytes]:
        data = tags.get(0)
        if data is None:
            return tags
        section = encode_tags({0: data})
        assert section is not None
        raw = memoryview(_EMPTY_FETCH_HEAD + section)
        body, _ = codec.decode_checked(raw, 0, len(raw))
        if not rewrite(body.node_endpoints):
            return tags
        out: bytearray = bytearray()
        ins: list = []
        encode_to(codec, body, out, ins)
        parsed = parse_tags(bytes(out[len(_EMPTY_FETCH_HEAD):]))
        assert parsed is not None
        return {**tags, 0: parsed[0][0]} if 0 in parsed[0] else {t: d for t, d in tags.items() if t != 0}

    return rewrite_tail

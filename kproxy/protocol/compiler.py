"""Codecs generated from the schema: one slotted class per message, one decoder and one encoder per
(message, version), compiled on first use and cached.

The generated decoders read from a memoryview without copying bytes or records fields, check every
length and count against the bytes that remain before allocating, and keep unknown tagged fields.
Arrays of structs of ``LAZY_MIN_ITEMS`` or more elements are walked by a validating skip that rejects
exactly what decoding them would, then left as ``LazyArray`` views decoded on first access; the skip
runs in the optional C accelerator (``_accel``) where it was built, else in generated Python.
Their source is registered with ``linecache`` so tracebacks show it. A second, *traced* variant of
each decoder is generated only when the fast one fails; it records the field path for DecodeError.

The source is written by ``kproxy.protocol.codegen``; this module holds what it runs with (the base
class, the helpers in its namespace, ``Codec``), the caches, and the choice of implementation.
This module must not do I/O.
"""

from __future__ import annotations

import importlib
import linecache
import os
import struct as _struct
from collections.abc import Callable
from typing import Any

from kproxy.protocol import primitives as P
from kproxy.protocol.codegen.decode_program import DECODER_ABI, decode_program, lazy_entries
from kproxy.protocol.codegen.layout import FIXED, Layout
from kproxy.protocol.codegen.python_decoders import generate_decoders
from kproxy.protocol.codegen.python_encoders import generate_encoders
from kproxy.protocol.codegen.python_source import class_source, generate_isdefault
from kproxy.protocol.codegen.skip_program import ACCEL_ABI, skip_program
from kproxy.protocol.errors import DecodeError, EncodeError
from kproxy.protocol.lazy import LazyArray
from kproxy.protocol.schema import FieldSpec, MessageSpec, StructSpec

# Bytes and records values at least this long are not copied into the output buffer; the encoder
# hands them to the writer as separate buffers for one vectored send.
ZERO_COPY_MIN = 1024

# Messages whose decode runs compiled, in the accelerator's Decoder, when the native codec is chosen:
# the Python decoder stays the reference and gets every message the compiled one does not handle.
# Measured (docs/performance.md, "The codec"): a one-record Produce through kproxy with rules.
# Metadata was measured too and left out: since its answers are served from memory where rules name
# topics, its compiled decode moved nothing (1.000x).
COMPILED = frozenset({"ProduceRequest", "ProduceResponse", "RequestHeader", "ResponseHeader"})

# Arrays of structs with at least this many elements are decoded lazily (LazyArray) by the fast
# decoders: validated at once, decoded on first access, re-encoded as views of the input until then.
# Smaller ones cost less decoded at once than validated now and decoded later, if touched.
DEFAULT_LAZY_MIN_ITEMS = 8
LAZY_MIN_ITEMS = DEFAULT_LAZY_MIN_ITEMS  # in force; set_codec changes it


class Bad(Exception):
    """Raised by generated decoders for a structural violation; becomes a DecodeError with a path."""

    def __init__(self, reason: str, pos: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.pos = pos


# Exceptions a fast decoder may raise on malformed input; any of them triggers the traced re-run.
DECODE_FAILURES = (Bad, P.ShortBuffer, _struct.error, IndexError, ValueError, OverflowError)


class _NewType:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NEW"


NEW: Any = _NewType()  # "build a fresh empty list / default struct" marker for constructor defaults


class Struct:
    """Base of every generated message and struct class."""

    __slots__ = ()
    _spec: StructSpec
    _fields: tuple[str, ...]
    _message: MessageSpec

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(getattr(self, n) == getattr(other, n) for n in self._fields) and (
            (self._unknown or None) == (other._unknown or None)  # type: ignore[attr-defined]
        )

    __hash__ = None  # type: ignore[assignment]  # mutable

    def omit_default_tags(self) -> None:
        """Encode tagged fields that hold their default by leaving them out, as Kafka does.

        A decoded message remembers which default-valued tags it carried, so it re-encodes byte
        for byte; this forgets that (for this struct, not its children).
        """
        self._explicit = None  # type: ignore[misc]  # slot declared by each generated subclass

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={getattr(self, n)!r}" for n in self._fields)
        return f"{type(self).__name__}({inner})"

    def to_dict(self, version: int | None = None) -> dict[str, Any]:
        """Nested dicts and lists with Kafka's field names, only the fields present in ``version``."""
        if version is None:
            version = getattr(self, "_version", None)
            if version is None:
                raise ValueError(f"{type(self).__name__}.to_dict() needs a version")
        out: dict[str, Any] = {}
        for f in self._spec.fields:
            if version in f.versions:
                out[f.name] = _plain(f, getattr(self, f.name), version)
        unknown = self._unknown  # type: ignore[attr-defined]
        if unknown:
            out["_unknown_tagged_fields"] = [{"tag": t, "data": bytes(b)} for t, b in unknown]
        return out


def _plain(f: FieldSpec, v: Any, version: int) -> Any:
    if v is None:
        return None
    if f.array:
        if f.type == "struct":
            return [e.to_dict(version) for e in v]
        if f.type in ("bytes", "records"):
            return [bytes(e) for e in v]
        return list(v)
    if f.type == "struct":
        return v.to_dict(version)
    if f.type in ("bytes", "records"):
        return bytes(v)
    return v


class Codec:
    """Decoder and encoder of one message at one version, generated for one implementation of the
    validating skip (``native``) and one lazy-array threshold (``lazy_min_items``)."""

    __slots__ = ("_traced", "cls", "decode", "encode", "lazy_min_items", "message", "name", "native",
                 "source", "version")

    def __init__(self, message: MessageSpec, version: int, native: bool, lazy_min_items: int) -> None:
        self.message = message
        self.version = version
        self.cls = message_class(message)
        self.name = f"{message.api_name or message.name}.v{version}"
        self.native = native
        self.lazy_min_items = lazy_min_items
        self.decode: Callable = _unbuilt      # (buf: memoryview, pos, end) -> (obj, pos)
        self.encode: Callable = _unbuilt      # (obj, out: bytearray, ins: list[(offset, buffer)]) -> None
        self.source = ""
        self._traced: Callable | None = None
        _build(self)

    def variant(self, *, native: bool | None = None, lazy_min_items: int | None = None) -> Codec:
        """The same message and version generated for another implementation or lazy threshold
        (None: this codec's own); cached. Lets tests and benchmarks compare them side by side."""
        return _get(self.message, self.version,
                    self.native if native is None else native,
                    self.lazy_min_items if lazy_min_items is None else lazy_min_items)

    def decode_checked(self, buf: memoryview, pos: int, end: int, base: int = 0) -> tuple[Any, int]:
        """Decode, turning any failure into a DecodeError naming the field path and offset.

        ``base`` is added to offsets in the error so they are relative to the whole frame.
        """
        try:
            return self.decode(buf, pos, end)
        except DECODE_FAILURES:
            pass
        if self._traced is None:
            src = (generate_isdefault(Layout(self.message, self.version))
                   + generate_decoders(self.message, self.version, traced=True))
            ns = exec_source(src, f"<kproxy-codec {self.name} traced>", _namespace(self.message))
            self._traced = ns["d_" + self.message.root.name]
        tr: list = []
        try:
            obj, pos = self._traced(buf, pos, end, tr)
        except DECODE_FAILURES as e:
            path = self.name + "".join(
                f".{name}" + (f"[{i}]" if i is not None else "") for name, i, _ in tr if name
            )
            at = getattr(e, "pos", None)
            if at is None:
                at = tr[-1][2] if tr else pos
            reason = e.reason if isinstance(e, Bad) else _reason(e)
            raise DecodeError(reason, at - base, path) from None
        return obj, pos


def _reason(e: BaseException) -> str:
    if isinstance(e, _struct.error | IndexError | P.ShortBuffer):
        return "not enough bytes" if not isinstance(e, P.ShortBuffer) else str(e)
    return f"{type(e).__name__}: {e}"


def exec_source(src: str, filename: str, ns: dict[str, Any]) -> dict[str, Any]:
    """Run generated source in ``ns``, registered with linecache so tracebacks show its lines."""
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    exec(compile(src, filename, "exec"), ns)
    return ns


_ARRAY_READERS: dict[str, dict[int, Callable]] = {code: {} for code, _ in FIXED.values()}


def _array_reader(code: str, n: int) -> Callable:
    """``unpack_from`` of ``n`` big-endian values of struct ``code``; cached for small ``n``."""
    reader = _struct.Struct(f">{n}{code}").unpack_from
    if n <= 64:
        _ARRAY_READERS[code][n] = reader
    return reader


def _base_ns() -> dict[str, Any]:
    return {
        **{f"_A_{t}": _ARRAY_READERS[code] for t, (code, _) in FIXED.items()}, "_mka": _array_reader,
        "_uv": P.read_uvarint, "_wuv": P.write_uvarint, "_UV1": P.UVARINT_1,
        "_I8": P.INT8.unpack_from, "_I16": P.INT16.unpack_from, "_I32": P.INT32.unpack_from,
        "_P16": P.INT16.pack, "_P32": P.INT32.pack, "_P8": P.INT8.pack,
        "_uuid": P.make_uuid, "_ZERO_UUID": P.ZERO_UUID, "_St": _struct.Struct,
        "_pack": _struct.pack, "_Bad": Bad, "_NEW": NEW, "_ZC": ZERO_COPY_MIN,
        "_Lazy": LazyArray, "_skip_tags": _skip_tags,
        **({"_nskip": _accel.skip, "_NProgram": _accel.Program} if _accel is not None else {}),
    }


def _skip_tags(buf: Any, pos: int, end: int, nt: int, sp: Any) -> int:
    """Skip a tagged-field section without known tags (``nt`` fields, the count already read)."""
    if nt > end - pos:
        raise Bad("tagged-field count")
    for _ in range(nt):
        _, pos = P.read_uvarint(buf, pos)
        sz, pos = P.read_uvarint(buf, pos)
        if sz > end - pos:
            raise Bad("tagged-field size")
        pos += sz
    return pos


def join_parts(out: bytearray, ins: list) -> bytes | bytearray:
    """Flatten an encoder's output and its zero-copy inserts into one contiguous buffer."""
    if not ins:
        return out
    parts = []
    last = 0
    for off, b in ins:
        parts.append(out[last:off])
        parts.append(b)
        last = off
    parts.append(out[last:])
    return b"".join(parts)


def split_parts(out: bytearray, ins: list) -> list:
    """The encoder's output as a list of buffers, zero-copy inserts in place, for a vectored send."""
    if not ins:
        return [out]
    mv = memoryview(out)
    parts = []
    last = 0
    for off, b in ins:
        if off > last:
            parts.append(mv[last:off])
        parts.append(b)
        last = off
    if last < len(out):
        parts.append(mv[last:])
    return parts


# ---------------------------------------------------------------------------------------------
# Caches


_classes: dict[int, dict[str, Any]] = {}
_codecs: dict[tuple[int, int, bool, int], Codec] = {}  # (message, version, native, lazy_min_items)
# Called when set_codec changes what get_codec hands out, so caches of codecs elsewhere start over.
settings_listeners: list[Callable[[], None]] = []


def _namespace(msg: MessageSpec) -> dict[str, Any]:
    """A fresh namespace holding the message's classes and the runtime helpers."""
    key = id(msg)
    cls_ns = _classes.get(key)
    if cls_ns is None:
        cls_ns = {"Struct": Struct, **_base_ns()}
        src = class_source(msg)
        exec_source(src, f"<kproxy-classes {msg.api_name or msg.name} {msg.kind}>", cls_ns)
        root = cls_ns["C_" + msg.root.name]
        for s in msg.structs():
            c = cls_ns["C_" + s.name]
            c._spec = s
            c._message = msg
            if s is not msg.root:
                setattr(root, s.name, c)
        _classes[key] = cls_ns
    ns = dict(_base_ns())
    ns.update({k: v for k, v in cls_ns.items() if k.startswith("C_")})
    ns["_join"] = join_parts
    ns["_tagkey"] = _tag_key
    return ns


def _tag_key(item: tuple[int, Any]) -> int:
    return item[0]


def message_class(msg: MessageSpec) -> type:
    ns = _namespace(msg)
    return ns["C_" + msg.root.name]


def codec_source(msg: MessageSpec, version: int, native: bool | None = None,
                 lazy_min_items: int | None = None) -> str:
    """The generated source of one version's codec: classes excluded, decoders and encoders."""
    native = _native if native is None else native
    lazy_min_items = LAZY_MIN_ITEMS if lazy_min_items is None else lazy_min_items
    return (generate_isdefault(Layout(msg, version)) + "\n"
            + generate_decoders(msg, version, False, native=native, lazy_min_items=lazy_min_items)
            + "\n" + generate_encoders(msg, version))


def compiled_text(c: Codec) -> str:
    """The decode program the accelerator's compiled decoder runs for ``c``, as comments, one row per
    struct (class, slots, ops, defaults); empty when ``c`` decodes in generated Python only."""
    if not hasattr(c.decode, "hits"):
        return ""
    lines = ["", "# Decoded by the accelerator's compiled Decoder (kproxy/protocol/_accel.c) running this program;",
             "# d_" + c.message.root.name + " above is its reference and fallback. One row per struct:"]
    for i, (cls, names, ops, defaults) in enumerate(decode_program(c.message, c.version, _namespace(c.message))):
        lines.append(f"#   {i} {cls.__name__}: slots {', '.join(names)}")
        lines.append(f"#     ops {', '.join(map(str, ops))}")
        lines.append(f"#     defaults {', '.join(f'{k}:{v!r}' for k, v in defaults)}")
    return "\n".join(lines) + "\n"


def _unbuilt(*args: Any) -> Any:  # pragma: no cover - replaced by _build before any use
    raise AssertionError("codec not built")


def _build(c: Codec) -> None:
    """(Re)generate a codec's functions for its implementation and lazy threshold."""
    src = codec_source(c.message, c.version, c.native, c.lazy_min_items)
    # One linecache name per variant, so a traceback shows the source that actually ran.
    name = (f"{c.message.api_name or c.message.name}.{c.message.kind}.v{c.version} "
            f"{'native' if c.native else 'python'} lazy>={c.lazy_min_items}")
    ns = exec_source(src, f"<kproxy-codec {name}>", _namespace(c.message))
    root = c.message.root.name
    c.decode, c.encode, c.source, c._traced = ns["d_" + root], ns["e_" + root], src, None
    if c.native and c.message.name in COMPILED and compiled_decoding():
        c.decode = _decoder(c, ns)


def compiled_decoding() -> bool:
    """True when the accelerator was built with the compiled Decoder this compiler emits programs for."""
    return getattr(_accel, "DECODER_ABI", None) == DECODER_ABI


def _decoder(c: Codec, ns: dict[str, Any]) -> Any:
    """The accelerator's compiled decoder of ``c`` in front of the generated ``d_`` root in ``ns``."""
    lazy = (ns["_SKIP"], LazyArray, lazy_entries(c.message, c.version, ns)) if "_SKIP" in ns else None
    return _accel.Decoder(decode_program(c.message, c.version, ns), ns["d_" + c.message.root.name],
                          P.make_uuid, c.version, c.lazy_min_items, lazy)


def compiled_decoder(c: Codec) -> Any:
    """A compiled decoder of any native codec ``c``, COMPILED or not, for tests and benchmarks: called
    as ``c.decode``, its Python decoder (a fresh copy) behind it."""
    if not c.native or not compiled_decoding():
        raise RuntimeError("the compiled decoder needs the native codec and an accelerator built with it")
    src = codec_source(c.message, c.version, True, c.lazy_min_items)
    return _decoder(c, exec_source(src, f"<kproxy-codec {c.name} compiled-check>", _namespace(c.message)))


def get_codec(msg: MessageSpec, version: int) -> Codec:
    """The codec of one message version, with the implementation and lazy threshold in force."""
    return _get(msg, version, _native, LAZY_MIN_ITEMS)


def _get(msg: MessageSpec, version: int, native: bool, lazy_min_items: int) -> Codec:
    key = (id(msg), version, native, lazy_min_items)
    c = _codecs.get(key)
    if c is not None:
        return c
    if version not in msg.versions:
        raise ValueError(f"{msg.name} has no version {version}")
    if native and _accel is None:
        raise RuntimeError(f"the native codec accelerator is {_accel_status}")
    if lazy_min_items < 0:
        raise ValueError("lazy_min_items must be >= 0")
    c = _codecs[key] = Codec(msg, version, native, lazy_min_items)
    return c


# The native validating skip over a whole message, by codec (``whole_skip``).
_WHOLE: dict[Codec, Any] = {}
# A lazy-array threshold no array reaches: a whole-message check records no spans.
NO_LAZY = 1 << 62


def whole_skip(codec: Codec) -> Any:
    """The accelerator's validating skip program over a whole message of ``codec``'s version, its root
    as struct 0: ``_accel.skip(program, 0, buf, pos, end, 1, None, NO_LAZY)`` accepts and rejects
    exactly what ``codec.decode`` does and returns the position after the message, building nothing
    (a ValueError on bad bytes). None without the accelerator, or when the Python codec is chosen."""
    got = _WHOLE.get(codec)
    if got is None and _native and _accel is not None:
        rows = skip_program(Layout.whole(codec.message, codec.version))
        got = _WHOLE[codec] = _accel.Program(tuple(tuple(ops) for _, ops in rows))
    return got


def native_skip() -> Callable | None:
    """``_accel.skip`` when the accelerator runs the codecs' checks, else None."""
    return _accel.skip if _native and _accel is not None else None


def native_function(name: str) -> Callable | None:
    """The accelerator's function ``name`` when it runs the codecs' checks and has it, else None."""
    return getattr(_accel, name, None) if _native and _accel is not None else None


# ---------------------------------------------------------------------------------------------
# Which implementation runs the validating skips


# What the pure-Python path costs (bench/codec.py, 2 cores: the validating check of a 100,000-partition
# Metadata answer, 4.4 MB, in C and in Python), for the start-up warning when the accelerator is missing.
ACCEL_MISSING_COST = ("large responses are checked 10-20x slower in pure Python (a 100,000-partition "
                      "Metadata answer holds the event loop ~30 ms instead of ~2 ms)")
ACCEL_MODULE = "kproxy.protocol._accel"


def _load_accelerator() -> tuple[Any, str]:
    """The native accelerator module, or None and why not, in a few words."""
    try:
        # By full name: ``from kproxy.protocol import _accel`` inside the package's own import turns a
        # missing file into "cannot import name (most likely due to a circular import)", which misleads.
        _accel = importlib.import_module(ACCEL_MODULE)
    except ModuleNotFoundError as e:
        if e.name != ACCEL_MODULE:
            raise
        return None, "not built"
    except ImportError as e:
        return None, f"not loaded ({e})"
    if getattr(_accel, "ABI", None) != ACCEL_ABI:
        return None, f"built for program ABI {getattr(_accel, 'ABI', '?')}, not {ACCEL_ABI}: reinstall kproxy"
    return _accel, "built"


_accel, _accel_status = _load_accelerator()
# KPROXY_CODEC=python forces the pure-Python codec even where the accelerator is built.
_native = _accel is not None and os.environ.get("KPROXY_CODEC", "").strip().lower() != "python"


def accelerator_warning() -> str | None:
    """What is missing, what it costs and how to fix it, when the accelerator is not loaded; None when
    it is (a KPROXY_CODEC=python choice is not a fault)."""
    if _accel is not None:
        return None
    if _accel_status == "not built":
        what = (f"this install has no {ACCEL_MODULE} extension: it was built without a C compiler or the "
                "Python headers")
    else:
        what = f"the {ACCEL_MODULE} extension is {_accel_status}"
    return (f"codec accelerator missing: {what}; {ACCEL_MISSING_COST}; to fix it, reinstall kproxy where gcc "
            "and the Python headers are present (Debian: apt-get install gcc python3-dev)")


def accelerator_available() -> bool:
    return _accel is not None


def codec_implementation() -> str:
    """Which codec runs, in words, for logs and ``kproxy check``."""
    if _native:
        return "generated Python with the native accelerator"
    why = "KPROXY_CODEC=python" if _accel is not None else f"accelerator {_accel_status}"
    return f"generated Python ({why})"


def set_codec(*, native: bool | None = None, lazy_min_items: int | None = None) -> None:
    """Choose the implementation (``native``) and the lazy-array threshold that ``get_codec`` hands
    out from now on (None: keep). For tests and benchmarks; objects already decoded stay valid."""
    global _native, LAZY_MIN_ITEMS
    if native and _accel is None:
        raise RuntimeError(f"the native codec accelerator is {_accel_status}")
    if lazy_min_items is not None and lazy_min_items < 0:
        raise ValueError("lazy_min_items must be >= 0")
    if native is not None:
        _native = native
    if lazy_min_items is not None:
        LAZY_MIN_ITEMS = lazy_min_items
    for listener in settings_listeners:
        listener()


def codec_settings() -> tuple[bool, int]:
    """(native, lazy_min_items) now in force, to restore after ``set_codec``."""
    return _native, LAZY_MIN_ITEMS


def encode_to(codec: Codec, obj: Any, out: bytearray, ins: list) -> None:
    """Run a generated encoder, reporting bad values as EncodeError."""
    try:
        codec.encode(obj, out, ins)
    except (_struct.error, AttributeError, TypeError, ValueError, OverflowError) as e:
        raise EncodeError(f"{codec.name}: {type(e).__name__}: {e}") from e

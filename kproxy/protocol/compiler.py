"""Generates Python codecs from the schema: one slotted class per message, one decoder and one
encoder per (message, version), compiled on first use and cached.

The generated decoders read from a memoryview without copying bytes or records fields, check every
length and count against the bytes that remain before allocating, and keep unknown tagged fields.
Arrays of structs of ``LAZY_MIN_ITEMS`` or more elements are walked by a validating skip that rejects
exactly what decoding them would, then left as ``LazyArray`` views decoded on first access; the skip
runs in the optional C accelerator (``_accel``) where it was built, else in generated Python.
Their source is registered with ``linecache`` so tracebacks show it. A second, *traced* variant of
each decoder is generated only when the fast one fails; it records the field path for DecodeError.
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
from kproxy.protocol.errors import DecodeError, EncodeError
from kproxy.protocol.lazy import LazyArray
from kproxy.protocol.schema import FieldSpec, MessageSpec, StructSpec

# Bytes and records values at least this long are not copied into the output buffer; the encoder
# hands them to the writer as separate buffers for one vectored send.
ZERO_COPY_MIN = 1024

# Arrays of structs with at least this many elements are decoded lazily (LazyArray) by the fast
# decoders: validated at once, decoded on first access, re-encoded as views of the input until then.
# Smaller ones cost less decoded at once than validated now and decoded later, if touched.
DEFAULT_LAZY_MIN_ITEMS = 8
LAZY_MIN_ITEMS = DEFAULT_LAZY_MIN_ITEMS  # in force; set_codec changes it

_FIXED = {  # type -> (struct format, size)
    "int8": ("b", 1), "int16": ("h", 2), "int32": ("i", 4), "int64": ("q", 8),
    "uint16": ("H", 2), "uint32": ("I", 4), "float64": ("d", 8), "bool": ("?", 1), "uuid": ("QQ", 16),
}


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
            src = (_generate_isdefault(_V(self.message, self.version))
                   + _generate_decoders(self.message, self.version, traced=True))
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


# ---------------------------------------------------------------------------------------------
# Source generation helpers


class _Src:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.depth = 0
        self.readers: dict[str, str] = {}   # name -> struct format, defined once atop the source

    def reader(self, fmt: str) -> str:
        """A module-level name bound to ``Struct(fmt).unpack_from`` (no format lookup per call)."""
        name = "_U_" + fmt[1:].replace("?", "o")
        self.readers[name] = fmt
        return name

    def __call__(self, line: str) -> None:
        self.lines.append("    " * self.depth + line)

    def indent(self) -> _Src:
        self.depth += 1
        return self

    def dedent(self) -> None:
        self.depth -= 1

    def __enter__(self) -> _Src:
        return self

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1

    def text(self) -> str:
        head = [f"{name} = _St({fmt!r}).unpack_from" for name, fmt in sorted(self.readers.items())]
        return "\n".join([*head, *self.lines]) + "\n"


def exec_source(src: str, filename: str, ns: dict[str, Any]) -> dict[str, Any]:
    """Run generated source in ``ns``, registered with linecache so tracebacks show its lines."""
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    exec(compile(src, filename, "exec"), ns)
    return ns


_ARRAY_READERS: dict[str, dict[int, Callable]] = {code: {} for code, _ in _FIXED.values()}


def _array_reader(code: str, n: int) -> Callable:
    """``unpack_from`` of ``n`` big-endian values of struct ``code``; cached for small ``n``."""
    reader = _struct.Struct(f">{n}{code}").unpack_from
    if n <= 64:
        _ARRAY_READERS[code][n] = reader
    return reader


def _base_ns() -> dict[str, Any]:
    return {
        **{f"_A_{t}": _ARRAY_READERS[code] for t, (code, _) in _FIXED.items()}, "_mka": _array_reader,
        "_uv": P.read_uvarint, "_wuv": P.write_uvarint, "_UV1": P.UVARINT_1,
        "_I8": P.INT8.unpack_from, "_I16": P.INT16.unpack_from, "_I32": P.INT32.unpack_from,
        "_P16": P.INT16.pack, "_P32": P.INT32.pack, "_P8": P.INT8.pack,
        "_uuid": P.make_uuid, "_ZERO_UUID": P.ZERO_UUID, "_St": _struct.Struct,
        "_pack": _struct.pack, "_Bad": Bad, "_NEW": NEW, "_ZC": ZERO_COPY_MIN,
        "_Lazy": LazyArray, "_skip_tags": _skip_tags,
        **({"_nskip": _accel.skip, "_NProgram": _accel.Program} if _accel is not None else {}),
    }


def _default_expr(f: FieldSpec, cls_prefix: str = "C_") -> str:
    """Python expression for the field's default value (fresh for mutable ones)."""
    if f.has_default and f.default is None:
        return "None"
    if f.array:
        return "[]"
    if f.type == "struct":
        return f"{cls_prefix}{f.struct.name}()"  # type: ignore[union-attr]
    if f.has_default:
        return repr(f.default)
    return {
        "bool": "False", "string": "''", "bytes": "b''", "records": "None", "uuid": "_ZERO_UUID",
        "float64": "0.0",
    }.get(f.type, "0")


# ---------------------------------------------------------------------------------------------
# Classes


def _class_source(msg: MessageSpec) -> str:
    src = _Src()
    for s in reversed(msg.structs()):
        top = s is msg.root
        names = [f.name for f in s.fields]
        slots = [*names, "_unknown", "_explicit"] + (["_version"] if top else [])
        src(f"class C_{s.name}(Struct):")
        with src.indent():
            src(f"__slots__ = {tuple(slots)!r}")
            src(f"_fields = {tuple(names)!r}")
            params = []
            for f in s.fields:
                d = _default_expr(f)
                params.append(f"{f.name}={'_NEW' if d.endswith(')') or d == '[]' else d}")
            params += ["_unknown=None", "_explicit=None"] + (["_version=None"] if top else [])
            src(f"def __init__(self, {', '.join(params)}):")
            with src.indent():
                for f in s.fields:
                    d = _default_expr(f)
                    if d.endswith(")") or d == "[]":
                        src(f"self.{f.name} = {d} if {f.name} is _NEW else {f.name}")
                    else:
                        src(f"self.{f.name} = {f.name}")
                src("self._unknown = _unknown")
                src("self._explicit = _explicit")
                if top:
                    src("self._version = _version")
        src(f"C_{s.name}.__name__ = C_{s.name}.__qualname__ = {s.name!r}")
        src("")
    return src.text()


# ---------------------------------------------------------------------------------------------
# Version-specific facts


class _V:
    """Facts about one message version used while generating code."""

    def __init__(self, msg: MessageSpec, v: int, native: bool = False, lazy_min_items: int = 0) -> None:
        self.msg = msg
        self.v = v
        self.flex = v in msg.flexible
        self.native = native  # validating skips run in the accelerator
        self.lz = lazy_min_items
        self._skip_structs: list[StructSpec] | None = None

    def fields(self, s: StructSpec) -> tuple[list[FieldSpec], list[FieldSpec]]:
        regular, tagged = [], []
        for f in s.fields:
            if self.v not in f.versions:
                continue
            if f.is_tagged(self.v, self.flex):
                tagged.append(f)
            else:
                regular.append(f)
        tagged.sort(key=lambda f: f.tag if f.tag is not None else -1)
        return regular, tagged

    def nullable(self, f: FieldSpec) -> bool:
        return self.v in f.nullable

    def compact(self, f: FieldSpec) -> bool:
        return self.flex and not f.flex_never

    def structs(self) -> list[StructSpec]:
        return self.reachable([self.msg.root])

    def reachable(self, roots: list[StructSpec]) -> list[StructSpec]:
        """``roots`` and every struct inside them in this version, each once, in walk order."""
        seen: dict[str, StructSpec] = {}

        def walk(s: StructSpec) -> None:
            if s.name in seen:
                return
            seen[s.name] = s
            for f in s.fields:
                if f.struct is not None and self.v in f.versions:
                    walk(f.struct)

        for s in roots:
            walk(s)
        return list(seen.values())

    def array_structs(self) -> list[StructSpec]:
        """Structs that are the elements of an array in this version."""
        out: dict[str, StructSpec] = {}
        for s in self.structs():
            for f in s.fields:
                if self.v in f.versions and f.array and f.struct is not None:
                    out[f.struct.name] = f.struct
        return list(out.values())

    def skip_ids(self) -> dict[str, int]:
        return {s.name: i for i, s in enumerate(self.skip_structs())}

    def skip_structs(self) -> list[StructSpec]:
        """Structs a validating pass walks: elements of (regular) arrays of structs, which may be
        lazy, and every struct inside them."""
        if self._skip_structs is None:
            elements = [f.struct for s in self.structs() for f in self.fields(s)[0]
                        if f.array and f.struct is not None]
            self._skip_structs = self.reachable(elements)
        return self._skip_structs

    def min_size(self, s: StructSpec) -> int:
        regular, _ = self.fields(s)
        return sum(self.min_field_size(f) for f in regular) + (1 if self.flex else 0)

    def min_field_size(self, f: FieldSpec) -> int:
        if f.array:
            return 1 if self.compact(f) else 4
        return self.min_elem_size(f, nullable=self.nullable(f))

    def min_elem_size(self, f: FieldSpec, nullable: bool = False) -> int:
        t = f.type
        if t in _FIXED:
            return _FIXED[t][1]
        if t == "string":
            return 1 if self.compact(f) else 2
        if t in ("bytes", "records"):
            return 1 if self.compact(f) else 4
        assert f.struct is not None
        return 1 if nullable else self.min_size(f.struct)


# ---------------------------------------------------------------------------------------------
# Decoders


def _generate_decoders(msg: MessageSpec, v: int, traced: bool, native: bool = False,
                       lazy_min_items: int = 0) -> str:
    """One decoder per struct. The fast variant (``traced=False``) leaves large arrays of structs
    as ``LazyArray`` views after a validating pass; the traced one decodes everything eagerly and
    records the field path, for error reports. ``native``: the validating skips run in _accel."""
    vf = _V(msg, v, native, lazy_min_items)
    src = _Src()
    for s in vf.structs():
        regular, tagged = vf.fields(s)
        root = s is msg.root
        params = "buf, pos, end" + (", tr" if traced else "" if root else ", sp")
        src(f"def d_{s.name}({params}):")
        src.indent()
        if traced:
            src("tr.append(None)")
        elif root:
            # Spans of nested arrays found by a validating pass, so decoding a lazy array's
            # elements later does not walk their nested arrays' bytes a second time.
            src("sp = {}" if vf.array_structs() else "sp = None")
        _decode_fields(src, vf, regular, traced)
        if vf.flex:
            _decode_tagged(src, vf, tagged, traced)
        else:
            src("_unk = _exp = None")
        args = []
        for f in s.fields:
            if v in f.versions:
                args.append("t_" + f.name if f in tagged else "f_" + f.name)
            else:
                args.append(_default_expr(f))
        args += ["_unk", "_exp"]
        if root:
            args.append(str(v))
        if traced:
            src("tr.pop()")
        src(f"return C_{s.name}({', '.join(args)}), pos")
        src.dedent()
        src("")
    if not traced:
        for s in vf.array_structs():
            # The elements of an array: what a lazy array calls on first access.
            src(f"def da_{s.name}(buf, pos, end, n, sp):")
            with src.indent():
                src("out = []")
                src("_ap = out.append")
                src("for _ in range(n):")
                src(f"    e, pos = d_{s.name}(buf, pos, end, sp)")
                src("    _ap(e)")
                src("return out, pos")
            src("")
        _generate_skippers(src, vf)
    return src.text()


def _mark(src: _Src, traced: bool, name: str, index: str = "None") -> None:
    if traced:
        src(f"tr[-1] = ({name!r}, {index}, pos)")


def _decode_fields(src: _Src, vf: _V, fields: list[FieldSpec], traced: bool) -> None:
    i = 0
    while i < len(fields):
        f = fields[i]
        if f.type in _FIXED and not f.array:
            group = [f]
            j = i + 1
            while not traced and j < len(fields) and fields[j].type in _FIXED and not fields[j].array:
                group.append(fields[j])
                j += 1
            _decode_fixed_group(src, group, traced)
            i = j
            continue
        _mark(src, traced, f.name)
        _decode_value(src, vf, f, "f_" + f.name, traced, lazy=not traced)
        i += 1


def _decode_fixed_group(src: _Src, group: list[FieldSpec], traced: bool) -> None:
    fmt = ">" + "".join(_FIXED[f.type][0] for f in group)
    size = sum(_FIXED[f.type][1] for f in group)
    names = []
    for f in group:
        if f.type == "uuid":
            names += [f"f_{f.name}_hi", f"f_{f.name}_lo"]
        else:
            names.append("f_" + f.name)
    if traced:
        _mark(src, traced, group[0].name)
    if len(names) == 1:
        src(f"{names[0]}, = {src.reader(fmt)}(buf, pos)")
    else:
        src(f"{', '.join(names)} = {src.reader(fmt)}(buf, pos)")
    src(f"pos += {size}")
    for f in group:
        if f.type == "uuid":
            src(f"f_{f.name} = _uuid(f_{f.name}_hi, f_{f.name}_lo)")


def _read_length(src: _Src, var: str, compact: bool, width: int) -> None:
    if compact:
        src(f"{var} = buf[pos]")
        src(f"if {var} < 128: pos += 1")
        src(f"else: {var}, pos = _uv(buf, pos)")
        src(f"{var} -= 1")
    else:
        reader = "_I16" if width == 2 else "_I32"
        src(f"{var}, = {reader}(buf, pos)")
        src(f"pos += {width}")


def _null_check(src: _Src, var: str, target: str, nullable: bool, what: str) -> None:
    """Emit the branch for a negative length; leaves src indented in the non-null branch."""
    src(f"if {var} < 0:")
    with src.indent():
        if nullable:
            src(f"if {var} != -1: raise _Bad('negative length {{}} for {what}'.format({var}), pos)")
            src(f"{target} = None")
        else:
            src(f"raise _Bad('null or negative length {{}} for non-nullable {what}'.format({var}), pos)")
    src("else:")
    src.indent()


def _decode_value(src: _Src, vf: _V, f: FieldSpec, target: str, traced: bool, lazy: bool) -> None:
    """Decode one field value (an array, a struct or a primitive) into ``target``.

    ``lazy``: an array of structs at least ``vf.lz`` long becomes a LazyArray (regular fields of the
    fast decoders; tagged fields are small and always decoded)."""
    nullable = vf.nullable(f)
    compact = vf.compact(f)
    if f.array:
        lazy = lazy and f.type == "struct"
        if lazy:
            src("_st = pos")
        _read_length(src, "n", compact, 4)
        _null_check(src, "n", target, nullable, f"array {f.name}")
        elem = vf.min_elem_size(f)
        src(f"if n * {elem} > end - pos: raise _Bad('array {f.name} has {{}} elements but only {{}} bytes remain'.format(n, end - pos), pos)")
        if lazy:
            assert f.struct is not None
            name = f.struct.name
            if vf.lz:
                src(f"if n >= {vf.lz}:")
                src.indent()
            src("_e = sp.get(_st)")
            src(f"if _e is None: _e = {_skip_call(vf, name, 'buf', 'pos', 'end', 'n', 'sp')}")
            src(f"{target} = _Lazy(buf, _st, pos, _e, n, da_{name}, sp)")
            src("pos = _e")
            if not vf.lz:
                src.dedent()
                return
            src.dedent()
            src("else:")
            src.indent()
        _decode_array_body(src, vf, f, target, traced)
        if lazy:
            src.dedent()
        src.dedent()
        return
    _decode_scalar(src, vf, f, target, traced, nullable)


def _decode_array_body(src: _Src, vf: _V, f: FieldSpec, target: str, traced: bool) -> None:
    t = f.type
    if t in _FIXED and t != "uuid":
        code, size = _FIXED[t]
        # One cached struct per (type, small count): a format string per array costs 3x the read.
        src(f"if n: {target} = list((_A_{t}.get(n) or _mka({code!r}, n))(buf, pos))")
        src(f"else: {target} = []")
        src(f"pos += n * {size}")
        return
    if t == "struct" and not traced:
        assert f.struct is not None
        src(f"{target}, pos = da_{f.struct.name}(buf, pos, end, n, sp)")
        return
    src(f"{target} = []")
    src(f"_ap = {target}.append")
    src("for i in range(n):")
    with src.indent():
        if traced:
            src(f"tr[-1] = ({f.name!r}, i, pos)")
        if t == "struct":
            assert f.struct is not None
            src(f"e, pos = d_{f.struct.name}(buf, pos, end, tr)")
        else:
            _decode_scalar(src, vf, f, "e", traced, nullable=False)
        src("_ap(e)")


def _decode_scalar(src: _Src, vf: _V, f: FieldSpec, target: str, traced: bool, nullable: bool) -> None:
    t = f.type
    compact = vf.compact(f)
    if t in _FIXED:
        code, size = _FIXED[t]
        if t == "uuid":
            src(f"_hi, _lo = {src.reader('>QQ')}(buf, pos)")
            src(f"{target} = _uuid(_hi, _lo)")
        else:
            src(f"{target}, = {src.reader('>' + code)}(buf, pos)")
        src(f"pos += {size}")
    elif t == "string":
        _read_length(src, "n", compact, 2)
        _null_check(src, "n", target, nullable, f"string {f.name}")
        src(f"if n > end - pos: raise _Bad('string {f.name} of {{}} bytes but only {{}} remain'.format(n, end - pos), pos)")
        src(f"{target} = str(buf[pos:pos + n], 'utf-8', 'surrogateescape')")
        src("pos += n")
        src.dedent()
    elif t in ("bytes", "records"):
        _read_length(src, "n", compact, 4)
        _null_check(src, "n", target, nullable, f"{t} {f.name}")
        src(f"if n > end - pos: raise _Bad('{t} {f.name} of {{}} bytes but only {{}} remain'.format(n, end - pos), pos)")
        src(f"{target} = buf[pos:pos + n]")
        src("pos += n")
        src.dedent()
    elif t == "struct":
        assert f.struct is not None
        call = f"d_{f.struct.name}(buf, pos, end{', tr' if traced else ', sp'})"
        if nullable:
            src("_b, = _I8(buf, pos)")
            src("pos += 1")
            src(f"if _b < 0: {target} = None")
            src(f"else: {target}, pos = {call}")
        else:
            src(f"{target}, pos = {call}")
    else:  # pragma: no cover - the parser rejects other types
        raise AssertionError(t)


def _tag_loop(src: _Src) -> None:
    """The head of the loop over ``nt`` tagged fields (the count already read): each one's tag, size
    and end (``tend``), checked against the bytes left. The caller writes the rest of its body."""
    src("if nt > end - pos: raise _Bad('tagged-field count {} exceeds the {} bytes left'.format(nt, end - pos), pos)")
    src("for _ in range(nt):")
    with src.indent():
        src("tag, pos = _uv(buf, pos)")
        src("sz, pos = _uv(buf, pos)")
        src("if sz > end - pos: raise _Bad('tagged field {} of {} bytes but only {} remain'.format(tag, sz, end - pos), pos)")
        src("tend = pos + sz")


def _tag_cases(src: _Src, tagged: list[FieldSpec], value: Callable[[FieldSpec], None],
               after: Callable[[FieldSpec], None] | None = None) -> None:
    """One branch per known tag: ``value(f)`` writes the code that reads the field, which must end
    exactly at the tagged field's declared size (``tend``); then ``after(f)``."""
    kw = "if"
    for f in tagged:
        src(f"{kw} tag == {f.tag}:")
        kw = "elif"
        with src.indent():
            src("_end = end")
            src("end = tend")
            value(f)
            src("end = _end")
            src(f"if pos != tend: raise _Bad('tagged field {f.name} declared {{}} bytes but used {{}}'.format(sz, pos - tend + sz), pos)")
            if after is not None:
                after(f)


def _decode_tagged(src: _Src, vf: _V, tagged: list[FieldSpec], traced: bool) -> None:
    for f in tagged:
        src(f"t_{f.name} = {_default_expr(f)}")
    src("_unk = _exp = None")
    _mark(src, traced, "_tagged_fields")
    src("nt = buf[pos]")
    src("if nt < 128: pos += 1")
    src("else: nt, pos = _uv(buf, pos)")
    src("if nt:")
    with src.indent():
        _tag_loop(src)
        with src.indent():

            def value(f: FieldSpec) -> None:
                if traced:
                    src(f"tr[-1] = ({f.name!r}, None, pos)")
                _decode_value(src, vf, f, "t_" + f.name, traced, lazy=False)

            def after(f: FieldSpec) -> None:
                src(f"if {_is_default_expr(vf, f, 't_' + f.name)}:")
                with src.indent():
                    src(f"_exp = (_exp or frozenset()) | {{{f.tag}}}")

            _tag_cases(src, tagged, value, after)
            src(f"{'else' if tagged else 'if True'}:")
            with src.indent():
                src("if _unk is None: _unk = []")
                src("_unk.append((tag, buf[pos:tend]))")
                src("pos = tend")


# ---------------------------------------------------------------------------------------------
# Validating skippers: walk an array's bytes, rejecting exactly what its decoder would reject, so a
# lazy array can be decoded later without failing. Widths of fixed fields are folded into the
# offset of the next read; bounds are checked once per array, since ``pos`` only grows.


def _skip_call(vf: _V, name: str, buf: str, pos: str, end: str, n: str, sp: str) -> str:
    """The expression that skips ``n`` encoded ``name`` structs and gives the position after them."""
    if vf.native:
        return f"_nskip(_SKIP, {vf.skip_ids()[name]}, {buf}, {pos}, {end}, {n}, {sp}, {vf.lz})"
    return f"s_a_{name}({buf}, {pos}, {end}, {n}, {sp})"


# Opcodes of a skip program for the native accelerator; the table _accel.c was built with is ABI.
ACCEL_ABI = 1
_OP_FIXED, _OP_CBLOB, _OP_BLOB, _OP_ARRFIX, _OP_ARRBLOB, _OP_ARRSTRUCT, _OP_STRUCT, _OP_NSTRUCT, \
    _OP_TAGS = range(1, 10)


def _skip_program(vf: _V) -> list[tuple[str, list[int]]]:
    """One row of ops per struct of ``skip_structs()`` (in that order), then one per known tagged
    field, which the row of its struct's OP_TAGS refers to. _accel.c documents the ops."""
    ids = vf.skip_ids()

    def ops_of(f: FieldSpec, regular: bool) -> list[int]:
        t, nl, c = f.type, int(vf.nullable(f)), int(vf.compact(f))
        width = 2 if t == "string" else 4
        if f.array:
            if t in _FIXED:
                return [_OP_ARRFIX, c, nl, _FIXED[t][1]]
            if f.struct is not None:
                size = vf.min_elem_size(f)
                if size < 1:  # pragma: no cover - no Kafka struct is empty; it would skip forever
                    raise ValueError(f"array {f.name} of empty structs")
                return [_OP_ARRSTRUCT, c, nl, ids[f.struct.name], size, int(regular)]
            return [_OP_ARRBLOB, c, nl, width]
        if t in _FIXED:
            return [_OP_FIXED, _FIXED[t][1]]
        if f.struct is not None:
            return [_OP_NSTRUCT if nl else _OP_STRUCT, ids[f.struct.name]]
        return [_OP_CBLOB, nl] if c else [_OP_BLOB, width, nl]

    rows: list[tuple[str, list[int]]] = [(name, []) for name in ids]
    for s in vf.skip_structs():
        regular, tagged = vf.fields(s)
        ops: list[int] = []
        last = -1
        for f in regular:
            o = ops_of(f, True)
            if o[0] == _OP_FIXED and last >= 0 and ops[last] == _OP_FIXED:
                ops[last + 1] += o[1]
                continue
            last = len(ops)
            ops += o
        if vf.flex:
            known: list[int] = []
            for f in tagged:
                rows.append((f"{s.name}.{f.name} (tag {f.tag})", ops_of(f, False)))
                known += [f.tag, len(rows) - 1]  # type: ignore[list-item]
            ops += [_OP_TAGS, len(tagged), *known]
        rows[ids[s.name]] = (s.name, ops)
    return rows


def _program_source(vf: _V) -> str:
    lines = ["# The validating skip program run by the native accelerator (kproxy/protocol/_accel.c):",
             "# one row of ops per struct; the comment gives the row's number and struct.",
             "_SKIP = _NProgram(("]
    for i, (name, ops) in enumerate(_skip_program(vf)):
        lines.append(f"    ({', '.join(map(str, ops))}{',' if len(ops) == 1 else ''}),  # {i} {name}")
    lines.append("))")
    return "\n".join(lines) + "\n"


class _Skip:
    def __init__(self, src: _Src, vf: _V) -> None:
        self.src = src
        self.vf = vf
        self.k = 0  # bytes of fixed fields not yet added to pos

    def at(self) -> str:
        return f"pos + {self.k}" if self.k else "pos"

    def flush(self) -> None:
        if self.k:
            self.src(f"pos += {self.k}")
            self.k = 0

    def length(self, compact: bool, width: int) -> None:
        """Read a length or count into ``n``: compact, the uvarint as sent (0 null, else value + 1)."""
        src = self.src
        if compact:
            src(f"n = buf[{self.at()}]")
            src(f"if n < 128: pos += {self.k + 1}")
            src(f"else: n, pos = _uv(buf, {self.at()})")
        else:
            src(f"n, = {'_I16' if width == 2 else '_I32'}(buf, {self.at()})")
            src(f"pos += {self.k + width}")
        self.k = 0

    def sized(self, compact: bool, nullable: bool, unit: int) -> None:
        """After ``length``: skip ``n`` units of ``unit`` bytes, rejecting a null or negative ``n``
        where the decoder does."""
        src = self.src
        times = "n" if unit == 1 else f"{unit} * n"
        if compact:
            if nullable:
                src(f"if n: pos += {times} - {unit}")
            else:
                src("if n == 0: raise _Bad('null')")
                src(f"pos += {times} - {unit}")
        elif nullable:
            src(f"if n >= 0: pos += {times}")
            src("elif n != -1: raise _Bad('negative length')")
        else:
            src("if n < 0: raise _Bad('negative length')")
            src(f"pos += {times}")

    def field(self, f: FieldSpec, regular: bool) -> None:
        vf, src, t = self.vf, self.src, f.type
        nullable, compact = vf.nullable(f), vf.compact(f)
        if not f.array:
            if t in _FIXED:
                self.k += _FIXED[t][1]
            elif t == "struct":
                assert f.struct is not None
                if nullable:
                    src(f"_b = buf[{self.at()}]")
                    src(f"pos += {self.k + 1}")
                    self.k = 0
                    src(f"if _b < 128: pos = {_skip_call(vf, f.struct.name, 'buf', 'pos', 'end', '1', 'sp')}")
                else:
                    src(f"pos = {_skip_call(vf, f.struct.name, 'buf', self.at(), 'end', '1', 'sp')}")
                    self.k = 0
            else:
                self.length(compact, 2 if t == "string" else 4)
                self.sized(compact, nullable, 1)
            return
        lazy = regular and t == "struct"
        if lazy:
            src(f"_st = {self.at()}")
        self.length(compact, 4)
        if t in _FIXED:
            self.sized(compact, nullable, _FIXED[t][1])
            return
        if compact:
            src("n -= 1")
        elif nullable:
            src("if n < -1: raise _Bad('negative count')")
        if not nullable:
            src("if n < 0: raise _Bad('null or negative count')")
        src("if n > 0:")
        with src.indent():
            src(f"if n * {vf.min_elem_size(f)} > end - pos: raise _Bad('count')")
            if t == "struct":
                assert f.struct is not None
                src(f"pos = {_skip_call(vf, f.struct.name, 'buf', 'pos', 'end', 'n', 'sp')}")
                if lazy:
                    src(f"if n >= {vf.lz}: sp[_st] = pos")
            else:
                src("for _ in range(n):")
                with src.indent():
                    self.length(compact, 2 if t == "string" else 4)
                    self.sized(compact, False, 1)

    def tags(self, s: StructSpec, tagged: list[FieldSpec]) -> None:
        src = self.src
        src(f"nt = buf[{self.at()}]")
        src(f"if nt < 128: pos += {self.k + 1}")
        src(f"else: nt, pos = _uv(buf, {self.at()})")
        self.k = 0
        src(f"if nt: pos = {'t_' + s.name if tagged else '_skip_tags'}(buf, pos, end, nt, sp)")


def _generate_skippers(src: _Src, vf: _V) -> None:
    if vf.native:
        if vf.skip_structs():
            src.lines += _program_source(vf).splitlines()
        return
    for s in vf.skip_structs():
        regular, tagged = vf.fields(s)
        src(f"def s_a_{s.name}(buf, pos, end, count, sp):")
        with src.indent():
            src("for _ in range(count):")
            with src.indent():
                mark = len(src.lines)
                sk = _Skip(src, vf)
                for f in regular:
                    sk.field(f, regular=True)
                if vf.flex:
                    sk.tags(s, tagged)
                sk.flush()
                if len(src.lines) == mark:
                    src("pass")
            src(f"if pos > end: raise _Bad('{s.name} runs past its bytes')")
            src("return pos")
        src("")
        if not (vf.flex and tagged):
            continue
        # Known tagged fields are checked as the decoder does: each value must fill its size exactly.
        src(f"def t_{s.name}(buf, pos, end, nt, sp):")
        with src.indent():
            _tag_loop(src)
            with src.indent():

                def value(f: FieldSpec) -> None:
                    sk = _Skip(src, vf)
                    sk.field(f, regular=False)
                    sk.flush()

                _tag_cases(src, tagged, value)
                src("pos = tend")
            src("return pos")
        src("")


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


def _is_default_expr(vf: _V, f: FieldSpec, var: str) -> str:
    """An expression true when ``var`` equals the field's default (so the encoder would omit it)."""
    if f.has_default and f.default is None:
        return f"{var} is None"
    if f.array:
        return f"({var} is not None and not {var})"
    if f.type == "struct":
        assert f.struct is not None
        return f"({var} is not None and isdef_{f.struct.name}({var}))"
    if f.type == "records":
        return f"{var} is None"
    if f.type == "uuid":
        return f"{var}.int == 0"
    if f.type == "bytes":
        return f"({var} is not None and len({var}) == 0)"
    return f"{var} == {_default_expr(f)}"


def _generate_isdefault(vf: _V) -> str:
    src = _Src()
    for s in vf.structs():
        regular, tagged = vf.fields(s)
        parts = [_is_default_expr(vf, f, f"o.{f.name}") for f in regular + tagged]
        parts.append("not o._unknown")
        src(f"def isdef_{s.name}(o):")
        src(f"    return {' and '.join(parts)}")
    return src.text()


# ---------------------------------------------------------------------------------------------
# Encoders


def _generate_encoders(msg: MessageSpec, v: int) -> str:
    vf = _V(msg, v)
    src = _Src()
    for s in vf.structs():
        regular, tagged = vf.fields(s)
        src(f"def e_{s.name}(o, out, ins):")
        with src.indent():
            i = 0
            while i < len(regular):
                f = regular[i]
                if f.type in _FIXED and not f.array and f.type != "uuid":
                    group = [f]
                    j = i + 1
                    while j < len(regular) and regular[j].type in _FIXED and not regular[j].array \
                            and regular[j].type != "uuid":
                        group.append(regular[j])
                        j += 1
                    fmt = ">" + "".join(_FIXED[g.type][0] for g in group)
                    src(f"out += _pack({fmt!r}, {', '.join('o.' + g.name for g in group)})")
                    i = j
                    continue
                src(f"v = o.{f.name}")
                _encode_value(src, vf, f, "v", lazy=True)
                i += 1
            if vf.flex:
                _encode_tagged(src, vf, tagged)
            src("pass")
        src("")
    return src.text()


def _write_length(src: _Src, expr: str, compact: bool, width: int) -> None:
    if compact:
        src(f"_n = {expr} + 1")
        src("out += _UV1[_n] if _n < 128 else _wuv(_n)")
    else:
        src(f"out += {'_P16' if width == 2 else '_P32'}({expr})")


def _write_null(src: _Src, compact: bool, width: int) -> None:
    null = b"\x00" if compact else b"\xff" * width
    src(f"out += {null!r}")


def _encode_value(src: _Src, vf: _V, f: FieldSpec, var: str, lazy: bool = False) -> None:
    """Encode one field value. ``lazy``: the field may hold a LazyArray of this very version, which
    is written as the bytes it was decoded from until its elements have been decoded."""
    nullable = vf.nullable(f)
    compact = vf.compact(f)
    if f.array:
        if nullable:
            src(f"if {var} is None:")
            with src.indent():
                _write_null(src, compact, 4)
            src("else:")
            src.indent()
        if lazy and f.struct is not None:
            src(f"if {var}.__class__ is _Lazy and {var}._items is None and {var}._dec is da_{f.struct.name}:")
            with src.indent():
                src(f"_r = {var}.raw")
                src("if len(_r) >= _ZC: ins.append((len(out), _r))")
                src("else: out += _r")
            src("else:")
            src.indent()
        _write_length(src, f"len({var})", compact, 4)
        t = f.type
        if t in _FIXED and t != "uuid":
            code = _FIXED[t][0]
            src(f"if {var}: out += _pack('>%d{code}' % len({var}), *{var})")
        else:
            src(f"for e in {var}:")
            with src.indent():
                _encode_scalar(src, vf, f, "e", nullable=False)
        if lazy and f.struct is not None:
            src.dedent()
        if nullable:
            src.dedent()
        return
    _encode_scalar(src, vf, f, var, nullable)


def _encode_scalar(src: _Src, vf: _V, f: FieldSpec, var: str, nullable: bool) -> None:
    t = f.type
    compact = vf.compact(f)
    if t in _FIXED:
        if t == "uuid":
            src(f"out += {var}.bytes")
        else:
            src(f"out += _pack('>{_FIXED[t][0]}', {var})")
        return
    if t == "struct":
        assert f.struct is not None
        if nullable:
            src(f"if {var} is None: out += b'\\xff'")
            src("else:")
            with src.indent():
                src("out += b'\\x01'")
                src(f"e_{f.struct.name}({var}, out, ins)")
        else:
            src(f"e_{f.struct.name}({var}, out, ins)")
        return
    width = 2 if t == "string" else 4
    if nullable:
        src(f"if {var} is None:")
        with src.indent():
            _write_null(src, compact, width)
        src("else:")
        src.indent()
    if t == "string":
        src(f"_b = {var}.encode('utf-8', 'surrogateescape')")
        _write_length(src, "len(_b)", compact, 2)
        src("out += _b")
    else:
        _write_length(src, f"len({var})", compact, 4)
        src(f"if len({var}) >= _ZC: ins.append((len(out), {var}))")
        src(f"else: out += {var}")
    if nullable:
        src.dedent()


def _encode_tagged(src: _Src, vf: _V, tagged: list[FieldSpec]) -> None:
    src("_tags = []")
    src("_x = o._explicit")
    for f in tagged:
        src(f"v = o.{f.name}")
        src(f"if not ({_is_default_expr(vf, f, 'v')}) or (_x and {f.tag} in _x):")
        with src.indent():
            src("_o = out; _i = ins")
            src("out = bytearray(); ins = []")
            _encode_value(src, vf, f, "v")
            src(f"_tags.append(({f.tag}, _join(out, ins)))")
            src("out = _o; ins = _i")
    src("if o._unknown:")
    with src.indent():
        src("_tags.extend(o._unknown)")
        src("_tags.sort(key=_tagkey)")
    src("out += _UV1[len(_tags)] if len(_tags) < 128 else _wuv(len(_tags))")
    src("for _t, _d in _tags:")
    with src.indent():
        src("out += _UV1[_t] if _t < 128 else _wuv(_t)")
        src("out += _UV1[len(_d)] if len(_d) < 128 else _wuv(len(_d))")
        src("out += _d")


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
        src = _class_source(msg)
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
    return (_generate_isdefault(_V(msg, version)) + "\n"
            + _generate_decoders(msg, version, False, native=native, lazy_min_items=lazy_min_items)
            + "\n" + _generate_encoders(msg, version))


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

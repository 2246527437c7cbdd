"""Generates Python codecs from the schema: one slotted class per message, one decoder and one
encoder per (message, version), compiled on first use and cached.

The generated decoders read from a memoryview without copying bytes or records fields, check every
length and count against the bytes that remain before allocating, and keep unknown tagged fields.
Their source is registered with ``linecache`` so tracebacks show it. A second, *traced* variant of
each decoder is generated only when the fast one fails; it records the field path for DecodeError.
This module must not do I/O.
"""

from __future__ import annotations

import linecache
import struct as _struct
from collections.abc import Callable
from typing import Any

from kproxy.protocol import primitives as P
from kproxy.protocol.errors import DecodeError, EncodeError
from kproxy.protocol.schema import FieldSpec, MessageSpec, StructSpec

# Bytes and records values at least this long are not copied into the output buffer; the encoder
# hands them to the writer as separate buffers for one vectored send.
ZERO_COPY_MIN = 1024

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
    """Decoder and encoder of one message at one version."""

    __slots__ = ("_traced", "cls", "decode", "encode", "message", "name", "source", "version")

    def __init__(self, message: MessageSpec, version: int, cls: type, decode: Callable,
                 encode: Callable, source: str) -> None:
        self.message = message
        self.version = version
        self.cls = cls
        self.decode = decode      # (buf: memoryview, pos, end) -> (obj, pos)
        self.encode = encode      # (obj, out: bytearray, ins: list[(offset, buffer)]) -> None
        self.source = source
        self.name = f"{message.api_name or message.name}.v{version}"
        self._traced: Callable | None = None

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

    def __init__(self, msg: MessageSpec, v: int) -> None:
        self.msg = msg
        self.v = v
        self.flex = v in msg.flexible

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
        seen: dict[str, StructSpec] = {}

        def walk(s: StructSpec) -> None:
            if s.name in seen:
                return
            seen[s.name] = s
            for f in s.fields:
                if f.struct is not None and self.v in f.versions:
                    walk(f.struct)

        walk(self.msg.root)
        return list(seen.values())

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


def _generate_decoders(msg: MessageSpec, v: int, traced: bool) -> str:
    vf = _V(msg, v)
    src = _Src()
    extra = ", tr" if traced else ""
    for s in vf.structs():
        regular, tagged = vf.fields(s)
        src(f"def d_{s.name}(buf, pos, end{extra}):")
        src.indent()
        if traced:
            src("tr.append(None)")
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
        if s is msg.root:
            args.append(str(v))
        if traced:
            src("tr.pop()")
        src(f"return C_{s.name}({', '.join(args)}), pos")
        src.dedent()
        src("")
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
        _decode_value(src, vf, f, "f_" + f.name, traced, top=True)
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


def _decode_value(src: _Src, vf: _V, f: FieldSpec, target: str, traced: bool, top: bool) -> None:
    """Decode one field value (an array, a struct or a primitive) into ``target``."""
    nullable = vf.nullable(f)
    compact = vf.compact(f)
    if f.array:
        _read_length(src, "n", compact, 4)
        _null_check(src, "n", target, nullable, f"array {f.name}")
        elem = vf.min_elem_size(f)
        src(f"if n * {elem} > end - pos: raise _Bad('array {f.name} has {{}} elements but only {{}} bytes remain'.format(n, end - pos), pos)")
        _decode_array_body(src, vf, f, target, traced)
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
    src(f"{target} = []")
    src(f"_ap = {target}.append")
    src("for i in range(n):")
    with src.indent():
        if traced:
            src(f"tr[-1] = ({f.name!r}, i, pos)")
        if t == "struct":
            assert f.struct is not None
            src(f"e, pos = d_{f.struct.name}(buf, pos, end{', tr' if traced else ''})")
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
        call = f"d_{f.struct.name}(buf, pos, end{', tr' if traced else ''})"
        if nullable:
            src("_b, = _I8(buf, pos)")
            src("pos += 1")
            src(f"if _b < 0: {target} = None")
            src(f"else: {target}, pos = {call}")
        else:
            src(f"{target}, pos = {call}")
    else:  # pragma: no cover - the parser rejects other types
        raise AssertionError(t)


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
        src("if nt > end - pos: raise _Bad('tagged-field count {} exceeds the {} bytes left'.format(nt, end - pos), pos)")
        src("for _ in range(nt):")
        with src.indent():
            src("tag, pos = _uv(buf, pos)")
            src("sz, pos = _uv(buf, pos)")
            src("if sz > end - pos: raise _Bad('tagged field {} of {} bytes but only {} remain'.format(tag, sz, end - pos), pos)")
            src("tend = pos + sz")
            kw = "if"
            for f in tagged:
                src(f"{kw} tag == {f.tag}:")
                kw = "elif"
                with src.indent():
                    if traced:
                        src(f"tr[-1] = ({f.name!r}, None, pos)")
                    # The value must fit exactly in its declared size.
                    src("_end = end")
                    src("end = tend")
                    _decode_value(src, vf, f, "t_" + f.name, traced, top=True)
                    src("end = _end")
                    src(f"if pos != tend: raise _Bad('tagged field {f.name} declared {{}} bytes but used {{}}'.format(sz, pos - tend + sz), pos)")
                    src(f"if {_is_default_expr(vf, f, 't_' + f.name)}:")
                    with src.indent():
                        src(f"_exp = (_exp or frozenset()) | {{{f.tag}}}")
            src(f"{'else' if tagged else 'if True'}:")
            with src.indent():
                src("if _unk is None: _unk = []")
                src("_unk.append((tag, buf[pos:tend]))")
                src("pos = tend")


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
                _encode_value(src, vf, f, "v")
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


def _encode_value(src: _Src, vf: _V, f: FieldSpec, var: str) -> None:
    nullable = vf.nullable(f)
    compact = vf.compact(f)
    if f.array:
        if nullable:
            src(f"if {var} is None:")
            with src.indent():
                _write_null(src, compact, 4)
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
_codecs: dict[tuple[int, int], Codec] = {}


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


def codec_source(msg: MessageSpec, version: int) -> str:
    """The generated source of one version's codec: classes excluded, decoders and encoders."""
    return (_generate_isdefault(_V(msg, version)) + "\n" + _generate_decoders(msg, version, False)
            + "\n" + _generate_encoders(msg, version))


def get_codec(msg: MessageSpec, version: int) -> Codec:
    key = (id(msg), version)
    c = _codecs.get(key)
    if c is not None:
        return c
    if version not in msg.versions:
        raise ValueError(f"{msg.name} has no version {version}")
    src = codec_source(msg, version)
    name = f"{msg.api_name or msg.name}.{msg.kind}.v{version}"
    ns = exec_source(src, f"<kproxy-codec {name}>", _namespace(msg))
    root = msg.root.name
    c = Codec(msg, version, ns["C_" + root], ns["d_" + root], ns["e_" + root], src)
    _codecs[key] = c
    return c


def encode_to(codec: Codec, obj: Any, out: bytearray, ins: list) -> None:
    """Run a generated encoder, reporting bad values as EncodeError."""
    try:
        codec.encode(obj, out, ins)
    except (_struct.error, AttributeError, TypeError, ValueError, OverflowError) as e:
        raise EncodeError(f"{codec.name}: {type(e).__name__}: {e}") from e

"""Python encoders, one per struct of a message version. Fixed-width runs are packed at once; bytes
and records values of ``ZERO_COPY_MIN`` or more, and lazy arrays not yet decoded, are handed to the
writer as separate buffers instead of copied; tagged fields holding their default are left out
unless the decoded message carried them."""

from __future__ import annotations

from kproxy.protocol.codegen.layout import FIXED, Layout
from kproxy.protocol.codegen.python_source import Source, is_default_expr
from kproxy.protocol.schema import FieldSpec, MessageSpec


def generate_encoders(msg: MessageSpec, v: int) -> str:
    vf = Layout(msg, v)
    src = Source()
    for s in vf.structs():
        regular, tagged = vf.fields(s)
        src(f"def e_{s.name}(o, out, ins):")
        with src.indent():
            i = 0
            while i < len(regular):
                f = regular[i]
                if f.type in FIXED and not f.array and f.type != "uuid":
                    group = [f]
                    j = i + 1
                    while j < len(regular) and regular[j].type in FIXED and not regular[j].array \
                            and regular[j].type != "uuid":
                        group.append(regular[j])
                        j += 1
                    fmt = ">" + "".join(FIXED[g.type][0] for g in group)
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


def _write_length(src: Source, expr: str, compact: bool, width: int) -> None:
    if compact:
        src(f"_n = {expr} + 1")
        src("out += _UV1[_n] if _n < 128 else _wuv(_n)")
    else:
        src(f"out += {'_P16' if width == 2 else '_P32'}({expr})")


def _write_null(src: Source, compact: bool, width: int) -> None:
    null = b"\x00" if compact else b"\xff" * width
    src(f"out += {null!r}")


def _encode_value(src: Source, vf: Layout, f: FieldSpec, var: str, lazy: bool = False) -> None:
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
        if t in FIXED and t != "uuid":
            code = FIXED[t][0]
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


def _encode_scalar(src: Source, vf: Layout, f: FieldSpec, var: str, nullable: bool) -> None:
    t = f.type
    compact = vf.compact(f)
    if t in FIXED:
        if t == "uuid":
            src(f"out += {var}.bytes")
        else:
            src(f"out += _pack('>{FIXED[t][0]}', {var})")
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


def _encode_tagged(src: Source, vf: Layout, tagged: list[FieldSpec]) -> None:
    src("_tags = []")
    src("_x = o._explicit")
    for f in tagged:
        src(f"v = o.{f.name}")
        src(f"if not ({is_default_expr(vf, f, 'v')}) or (_x and {f.tag} in _x):")
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

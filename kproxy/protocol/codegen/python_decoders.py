"""Python decoders, one per struct of a message version: the fast variant, which leaves large arrays
of structs as ``LazyArray`` views after a validating skip, and the traced one, which decodes
everything and records the field path for a DecodeError. The validating skips, in Python or as the
accelerator's program, reject exactly what decoding would. Every length and count is checked
against the bytes that remain before anything is allocated."""

from __future__ import annotations

from collections.abc import Callable

from kproxy.protocol.codegen.layout import FIXED, Layout
from kproxy.protocol.codegen.python_source import Source, default_expr, is_default_expr
from kproxy.protocol.codegen.skip_program import skip_program
from kproxy.protocol.schema import FieldSpec, MessageSpec, StructSpec


def generate_decoders(msg: MessageSpec, v: int, traced: bool, native: bool = False,
                      lazy_min_items: int = 0) -> str:
    """One decoder per struct. The fast variant (``traced=False``) leaves large arrays of structs
    as ``LazyArray`` views after a validating pass; the traced one decodes everything eagerly and
    records the field path, for error reports. ``native``: the validating skips run in _accel."""
    vf = Layout(msg, v, native, lazy_min_items)
    src = Source()
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
                args.append(default_expr(f))
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


def _mark(src: Source, traced: bool, name: str, index: str = "None") -> None:
    if traced:
        src(f"tr[-1] = ({name!r}, {index}, pos)")


def _decode_fields(src: Source, vf: Layout, fields: list[FieldSpec], traced: bool) -> None:
    i = 0
    while i < len(fields):
        f = fields[i]
        if f.type in FIXED and not f.array:
            group = [f]
            j = i + 1
            while not traced and j < len(fields) and fields[j].type in FIXED and not fields[j].array:
                group.append(fields[j])
                j += 1
            _decode_fixed_group(src, group, traced)
            i = j
            continue
        _mark(src, traced, f.name)
        _decode_value(src, vf, f, "f_" + f.name, traced, lazy=not traced)
        i += 1


def _decode_fixed_group(src: Source, group: list[FieldSpec], traced: bool) -> None:
    fmt = ">" + "".join(FIXED[f.type][0] for f in group)
    size = sum(FIXED[f.type][1] for f in group)
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


def _read_length(src: Source, var: str, compact: bool, width: int) -> None:
    if compact:
        src(f"{var} = buf[pos]")
        src(f"if {var} < 128: pos += 1")
        src(f"else: {var}, pos = _uv(buf, pos)")
        src(f"{var} -= 1")
    else:
        reader = "_I16" if width == 2 else "_I32"
        src(f"{var}, = {reader}(buf, pos)")
        src(f"pos += {width}")


def _null_check(src: Source, var: str, target: str, nullable: bool, what: str) -> None:
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


def _decode_value(src: Source, vf: Layout, f: FieldSpec, target: str, traced: bool, lazy: bool) -> None:
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


def _decode_array_body(src: Source, vf: Layout, f: FieldSpec, target: str, traced: bool) -> None:
    t = f.type
    if t in FIXED and t != "uuid":
        code, size = FIXED[t]
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


def _decode_scalar(src: Source, vf: Layout, f: FieldSpec, target: str, traced: bool, nullable: bool) -> None:
    t = f.type
    compact = vf.compact(f)
    if t in FIXED:
        code, size = FIXED[t]
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


def _tag_loop(src: Source) -> None:
    """The head of the loop over ``nt`` tagged fields (the count already read): each one's tag, size
    and end (``tend``), checked against the bytes left. The caller writes the rest of its body."""
    src("if nt > end - pos: raise _Bad('tagged-field count {} exceeds the {} bytes left'.format(nt, end - pos), pos)")
    src("for _ in range(nt):")
    with src.indent():
        src("tag, pos = _uv(buf, pos)")
        src("sz, pos = _uv(buf, pos)")
        src("if sz > end - pos: raise _Bad('tagged field {} of {} bytes but only {} remain'.format(tag, sz, end - pos), pos)")
        src("tend = pos + sz")


def _tag_cases(src: Source, tagged: list[FieldSpec], value: Callable[[FieldSpec], None],
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


def _decode_tagged(src: Source, vf: Layout, tagged: list[FieldSpec], traced: bool) -> None:
    for f in tagged:
        src(f"t_{f.name} = {default_expr(f)}")
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
                src(f"if {is_default_expr(vf, f, 't_' + f.name)}:")
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


def _skip_call(vf: Layout, name: str, buf: str, pos: str, end: str, n: str, sp: str) -> str:
    """The expression that skips ``n`` encoded ``name`` structs and gives the position after them."""
    if vf.native:
        return f"_nskip(_SKIP, {vf.skip_ids()[name]}, {buf}, {pos}, {end}, {n}, {sp}, {vf.lz})"
    return f"s_a_{name}({buf}, {pos}, {end}, {n}, {sp})"


def _program_source(vf: Layout) -> str:
    lines = ["# The validating skip program run by the native accelerator (kproxy/protocol/_accel.c):",
             "# one row of ops per struct; the comment gives the row's number and struct.",
             "_SKIP = _NProgram(("]
    for i, (name, ops) in enumerate(skip_program(vf)):
        lines.append(f"    ({', '.join(map(str, ops))}{',' if len(ops) == 1 else ''}),  # {i} {name}")
    lines.append("))")
    return "\n".join(lines) + "\n"


class _Skip:
    def __init__(self, src: Source, vf: Layout) -> None:
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
            if t in FIXED:
                self.k += FIXED[t][1]
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
        if t in FIXED:
            self.sized(compact, nullable, FIXED[t][1])
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


def _generate_skippers(src: Source, vf: Layout) -> None:
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

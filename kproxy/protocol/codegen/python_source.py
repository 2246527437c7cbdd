"""Writing Python source: the line builder the generators share, the expressions for a field's
default and for "holds its default", and the slotted classes of a message (one per struct, every
version). Decoders are in ``python_decoders``, encoders in ``python_encoders``."""

from __future__ import annotations

from kproxy.protocol.codegen.layout import Layout
from kproxy.protocol.schema import FieldSpec, MessageSpec


class Source:
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

    def indent(self) -> Source:
        self.depth += 1
        return self

    def dedent(self) -> None:
        self.depth -= 1

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1

    def text(self) -> str:
        head = [f"{name} = _St({fmt!r}).unpack_from" for name, fmt in sorted(self.readers.items())]
        return "\n".join([*head, *self.lines]) + "\n"


def default_expr(f: FieldSpec, cls_prefix: str = "C_") -> str:
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


def class_source(msg: MessageSpec) -> str:
    src = Source()
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
                d = default_expr(f)
                params.append(f"{f.name}={'_NEW' if d.endswith(')') or d == '[]' else d}")
            params += ["_unknown=None", "_explicit=None"] + (["_version=None"] if top else [])
            src(f"def __init__(self, {', '.join(params)}):")
            with src.indent():
                for f in s.fields:
                    d = default_expr(f)
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


def is_default_expr(vf: Layout, f: FieldSpec, var: str) -> str:
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
    return f"{var} == {default_expr(f)}"


def generate_isdefault(vf: Layout) -> str:
    src = Source()
    for s in vf.structs():
        regular, tagged = vf.fields(s)
        parts = [is_default_expr(vf, f, f"o.{f.name}") for f in regular + tagged]
        parts.append("not o._unknown")
        src(f"def isdef_{s.name}(o):")
        src(f"    return {' and '.join(parts)}")
    return src.text()

"""What the schema says about one message version on the wire, in no particular language: the fields
present, which are tagged, nullable or compactly encoded, the structs a decoder meets (and those a
validating skip walks), and the fewest bytes each takes. The code generators ask this; none of it
is Python source. ``Layout`` also carries the two choices a codec is generated for (validating
skips in the accelerator, the lazy-array threshold), which the generators read from it."""

from __future__ import annotations

from kproxy.protocol.schema import FieldSpec, MessageSpec, StructSpec

FIXED = {  # type -> (struct format, size)
    "int8": ("b", 1), "int16": ("h", 2), "int32": ("i", 4), "int64": ("q", 8),
    "uint16": ("H", 2), "uint32": ("I", 4), "float64": ("d", 8), "bool": ("?", 1), "uuid": ("QQ", 16),
}


class Layout:
    """Facts about one message version used while generating code."""

    def __init__(self, msg: MessageSpec, v: int, native: bool = False, lazy_min_items: int = 0) -> None:
        self.msg = msg
        self.v = v
        self.flex = v in msg.flexible
        self.native = native  # validating skips run in the accelerator
        self.lz = lazy_min_items
        self._skip_structs: list[StructSpec] | None = None

    @classmethod
    def whole(cls, msg: MessageSpec, v: int) -> Layout:
        """A layout whose validating skip walks the whole message, its root as struct 0: a check of a
        frame that decodes nothing (``compiler.whole_skip``)."""
        vf = cls(msg, v, native=True)
        vf._skip_structs = vf.structs()
        return vf

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
        if t in FIXED:
            return FIXED[t][1]
        if t == "string":
            return 1 if self.compact(f) else 2
        if t in ("bytes", "records"):
            return 1 if self.compact(f) else 4
        assert f.struct is not None
        return 1 if nullable else self.min_size(f.struct)

"""The validating skip as a program for the native accelerator (``kproxy/protocol/_accel.c``): one row
of opcodes per struct a skip walks, from the message version's layout. The opcodes and their
operands are the ABI shared with ``_accel.c``, whose comments document them."""

from __future__ import annotations

from kproxy.protocol.codegen.layout import FIXED, Layout
from kproxy.protocol.schema import FieldSpec

# Opcodes of a skip program for the native accelerator; the table _accel.c was built with is ABI.
ACCEL_ABI = 1
_OP_FIXED, _OP_CBLOB, _OP_BLOB, _OP_ARRFIX, _OP_ARRBLOB, _OP_ARRSTRUCT, _OP_STRUCT, _OP_NSTRUCT, \
    _OP_TAGS = range(1, 10)


def skip_program(vf: Layout) -> list[tuple[str, list[int]]]:
    """One row of ops per struct of ``skip_structs()`` (in that order), then one per known tagged
    field, which the row of its struct's OP_TAGS refers to. _accel.c documents the ops."""
    ids = vf.skip_ids()

    def ops_of(f: FieldSpec, regular: bool) -> list[int]:
        t, nl, c = f.type, int(vf.nullable(f)), int(vf.compact(f))
        width = 2 if t == "string" else 4
        if f.array:
            if t in FIXED:
                return [_OP_ARRFIX, c, nl, FIXED[t][1]]
            if f.struct is not None:
                size = vf.min_elem_size(f)
                if size < 1:  # pragma: no cover - no Kafka struct is empty; it would skip forever
                    raise ValueError(f"array {f.name} of empty structs")
                return [_OP_ARRSTRUCT, c, nl, ids[f.struct.name], size, int(regular)]
            return [_OP_ARRBLOB, c, nl, width]
        if t in FIXED:
            return [_OP_FIXED, FIXED[t][1]]
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

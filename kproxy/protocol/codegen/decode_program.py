"""The decode of one message version as a program for the accelerator's compiled decoder
(``_accel.Decoder``, in ``kproxy/protocol/_accel.c``): one row per struct the decoder meets, the root
first, each ``(class, slot names, ops, defaults)``. The opcodes are the ABI shared with ``_accel.c``,
whose comments document them; the Python decoder of the same version stays the reference, and the
compiled one hands it every message it does not handle."""

from __future__ import annotations

from typing import Any

from kproxy.protocol import primitives as P
from kproxy.protocol.codegen.layout import FIXED, Layout
from kproxy.protocol.codegen.python_source import default_expr
from kproxy.protocol.schema import FieldSpec, MessageSpec

# The encoding of a program, as _accel.c's Decoder was built for it; a mismatch runs pure Python.
DECODER_ABI = 1
D_FIXED, D_STRING, D_BYTES, D_ARRFIX, D_ARRBLOB, D_ARRSTRUCT, D_STRUCT, D_NSTRUCT, D_TAGS = range(1, 10)
# Fixed-width types, as _accel.c numbers them (DT_*).
DT = {t: i for i, t in enumerate(("int8", "int16", "int32", "int64", "uint16", "uint32", "float64",
                                  "bool", "uuid"))}
assert set(DT) == set(FIXED)
DEF_SET, DEF_CONST, DEF_LIST, DEF_CALL = range(4)


def decode_program(msg: MessageSpec, v: int, classes: dict[str, Any]) -> tuple:
    """The rows of ``msg`` version ``v``; ``classes`` maps ``C_<struct>`` to the generated classes."""
    vf = Layout(msg, v)
    structs = vf.structs()
    ids = {s.name: i for i, s in enumerate(structs)}
    rows = []
    for s in structs:
        regular, tagged = vf.fields(s)
        slot = {f.name: i for i, f in enumerate(s.fields)}
        ops: list[int] = []
        for f in regular:
            ops += _ops(vf, f, slot[f.name], ids)
        if vf.flex:
            ops += [D_TAGS, len(tagged), *(int(f.tag or 0) for f in tagged)]
        defaults = tuple((DEF_SET, None) if f in regular else _default(f, classes) for f in s.fields)
        names = (*slot, "_unknown", "_explicit", *(("_version",) if s is msg.root else ()))
        rows.append((classes["C_" + s.name], names, tuple(ops), defaults))
    return tuple(rows)


def lazy_entries(msg: MessageSpec, v: int, ns: dict[str, Any]) -> tuple:
    """Per row of ``decode_program``: None, or (the struct's id in the validating skip program
    ``ns["_SKIP"]``, the generated ``da_<struct>`` a LazyArray of it decodes with)."""
    vf = Layout(msg, v)
    skip_ids = vf.skip_ids()
    return tuple((skip_ids[s.name], ns["da_" + s.name]) if s.name in skip_ids and "da_" + s.name in ns
                 else None for s in vf.structs())


def _ops(vf: Layout, f: FieldSpec, slot: int, ids: dict[str, int]) -> list[int]:
    t, nl, c = f.type, int(vf.nullable(f)), int(vf.compact(f))
    if f.array:
        if t in FIXED:
            return [D_ARRFIX, slot, c, nl, DT[t]]
        if f.struct is not None:
            return [D_ARRSTRUCT, slot, c, nl, ids[f.struct.name], vf.min_elem_size(f)]
        return [D_ARRBLOB, slot, c, nl, int(t != "string")]
    if t in FIXED:
        return [D_FIXED, slot, DT[t]]
    if f.struct is not None:
        return [D_NSTRUCT if nl else D_STRUCT, slot, ids[f.struct.name]]
    return [D_STRING if t == "string" else D_BYTES, slot, c, nl]


def _default(f: FieldSpec, classes: dict[str, Any]) -> tuple[int, Any]:
    """What the Python decoder passes for a field it does not read: the same expression, evaluated."""
    expr = default_expr(f)
    if expr == "[]":
        return DEF_LIST, None
    if expr.endswith(")"):
        return DEF_CALL, classes[expr[:-2]]
    return DEF_CONST, eval(expr, {"_ZERO_UUID": P.ZERO_UUID})

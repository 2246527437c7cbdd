"""Hypothesis strategies that build random kproxy messages straight from the schema."""

from __future__ import annotations

import uuid
from typing import Any

import hypothesis.strategies as st

from kproxy.protocol.compiler import message_class
from kproxy.protocol.schema import FieldSpec, MessageSpec, StructSpec

_INTS = {
    "int8": (-(2**7), 2**7 - 1), "int16": (-(2**15), 2**15 - 1), "int32": (-(2**31), 2**31 - 1),
    "int64": (-(2**63), 2**63 - 1), "uint16": (0, 2**16 - 1), "uint32": (0, 2**32 - 1),
}

# Keep arrays short: Hypothesis explores shapes (null, empty, several) rather than sizes.
MAX_ITEMS = 3


def _scalar(f: FieldSpec, msg: MessageSpec, v: int, classes: dict[str, type]) -> st.SearchStrategy:
    t = f.type
    if t in _INTS:
        lo, hi = _INTS[t]
        return st.integers(lo, hi)
    if t == "float64":
        return st.floats(allow_nan=False)
    if t == "bool":
        return st.booleans()
    if t == "string":
        return st.text(max_size=12)
    if t in ("bytes", "records"):
        return st.binary(max_size=24)
    if t == "uuid":
        return st.uuids()
    assert f.struct is not None
    return struct_strategy(f.struct, msg, v, classes)


def field_strategy(f: FieldSpec, msg: MessageSpec, v: int, classes: dict[str, type]) -> st.SearchStrategy:
    base = _scalar(f, msg, v, classes)
    s = st.lists(base, max_size=MAX_ITEMS) if f.array else base
    if v in f.nullable:
        s = st.none() | s
    if f.tag is not None and not f.array and f.type != "struct":
        # A tagged field equal to its default is omitted on the wire; exercise that path often.
        s = st.just(None if f.default is None and f.has_default else _implicit(f)) | s
    return s


def _implicit(f: FieldSpec) -> Any:
    if f.has_default:
        return f.default
    return {"bool": False, "string": "", "bytes": b"", "records": None, "float64": 0.0}.get(
        f.type, uuid.UUID(int=0) if f.type == "uuid" else 0)


def struct_strategy(s: StructSpec, msg: MessageSpec, v: int, classes: dict[str, type]) -> st.SearchStrategy:
    cls = classes[s.name]
    fields = {f.name: field_strategy(f, msg, v, classes) for f in s.fields if v in f.versions}
    return st.fixed_dictionaries(fields).map(lambda kw: cls(**kw))


def classes_of(msg: MessageSpec) -> dict[str, type]:
    root = message_class(msg)
    out = {msg.root.name: root}
    for s in msg.structs():
        if s is not msg.root:
            out[s.name] = getattr(root, s.name)
    return out


def message_strategy(msg: MessageSpec, v: int) -> st.SearchStrategy[Any]:
    return struct_strategy(msg.root, msg, v, classes_of(msg))


def all_messages() -> list[MessageSpec]:
    from kproxy.protocol.messages import apis

    out = []
    for key in sorted(apis()):
        api = apis()[key]
        out += [api.request, api.response]
    return out  # type: ignore[return-value]

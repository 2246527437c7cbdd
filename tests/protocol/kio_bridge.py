"""Bridge to kio, the independent implementation kproxy's codec is cross-checked against.

Maps kio's per-version dataclasses to plain values in kproxy's terms (``timeout`` as a timedelta
becomes ``timeout_ms`` as an int, error codes become ints) so the two can be compared field by
field. Run as a script to print kio's view of one API: ``python -m tests.protocol.kio_bridge produce``.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import sys
import types
import typing
import uuid

from kio.index import load_entity_schema
from kio.schema.index import api_key_map, schema_name_map
from kio.static.constants import EntityType

_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)


def kio_versions(api_name: str) -> list[int]:
    return sorted(schema_name_map.get(api_name, {}))


def kio_api_names() -> dict[int, str]:
    return dict(api_key_map)


def kio_class(api_name: str, version: int, kind: str) -> type:
    et = EntityType.request if kind == "request" else EntityType.response
    return load_entity_schema(api_name, version, et)


def _inner(tp: object) -> tuple[object, bool, bool]:
    """Return (element type, is_array, is_optional) of a kio field annotation."""
    array = False
    optional = False
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = True
        tp = args[0]
    if typing.get_origin(tp) is tuple:
        array = True
        tp = typing.get_args(tp)[0]
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
    return tp, array, optional


def kproxy_name(f: dataclasses.Field) -> str:
    """kio drops the ``_ms`` unit suffix on fields it types as timedelta or datetime."""
    kt = f.metadata.get("kafka_type", "")
    # kio appends "_" to names that shadow Python builtins (``id_``); Kafka's name has none.
    name = f.name[:-1] if f.name.endswith("_") else f.name
    if kt.startswith(("timedelta", "datetime")) and not name.endswith("_ms"):
        return name + "_ms"
    return name


def describe(cls: type, indent: int = 0) -> list[str]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        tp, array, optional = _inner(hints[f.name])
        kt = f.metadata.get("kafka_type")
        extra = []
        if optional and kt not in ("uuid", "datetime_i64"):
            extra.append("nullable")  # kio types -1 timestamps and zero UUIDs as None; not wire nulls
        if "tag" in f.metadata:
            extra.append(f"tag={f.metadata['tag']}")
        if f.default is not dataclasses.MISSING and not dataclasses.is_dataclass(f.default):
            d = f.default
            if isinstance(d, datetime.timedelta):
                d = int(d.total_seconds() * 1000)
            elif isinstance(d, enum.Enum):
                d = d.value
            elif isinstance(d, datetime.datetime):
                d = int((d - _EPOCH).total_seconds() * 1000)
            extra.append(f"default={d!r}")
        if dataclasses.is_dataclass(tp):
            out.append(f"{'  ' * indent}{kproxy_name(f)} {'[]' if array else ''}{tp.__name__} {' '.join(extra)}")
            out.extend(describe(tp, indent + 1))  # type: ignore[arg-type]
        else:
            out.append(f"{'  ' * indent}{kproxy_name(f)} {'[]' if array else ''}{kt} {' '.join(extra)}")
    return out


def to_plain(entity: object) -> dict:
    """A kio entity as nested dicts of kproxy-typed values (ints for times, UUIDs, bytes)."""
    out = {}
    hints = typing.get_type_hints(type(entity))
    for f in dataclasses.fields(entity):  # type: ignore[arg-type]
        v = getattr(entity, f.name)
        kt = f.metadata.get("kafka_type")
        array = _inner(hints[f.name])[1]
        # kio shows a -1 timestamp and the all-zero UUID as None; on the wire they are values.
        # A None array (nullable []uuid) is a real wire null and stays None.
        if v is None and array:
            pass
        elif v is None and kt == "datetime_i64":
            v = -1
        elif v is None and kt == "uuid":
            v = uuid.UUID(int=0)
        out[kproxy_name(f)] = _plain(v)
    return out


def _plain(v: object) -> object:
    if dataclasses.is_dataclass(v):
        return to_plain(v)
    if isinstance(v, tuple):
        return [_plain(x) for x in v]
    if isinstance(v, datetime.timedelta):
        return round(v.total_seconds() * 1000)
    if isinstance(v, datetime.datetime):
        return round((v - _EPOCH).total_seconds() * 1000)
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, bool | float | str | uuid.UUID) or v is None:
        return v
    if isinstance(v, int):
        return int(v)
    if isinstance(v, bytes | bytearray | memoryview):
        return bytes(v)
    raise TypeError(f"unexpected kio value {v!r}")


if __name__ == "__main__":
    name = sys.argv[1]
    kinds = sys.argv[2:] or ["request", "response"]
    for kind in kinds:
        for v in kio_versions(name):
            cls = kio_class(name, v, kind)
            print(f"== {name} {kind} v{v} flexible={cls.__flexible__}")
            print("\n".join(describe(cls, 1)))


def kio_strategy(cls: type, max_items: int = 3):
    """Random kio entities of ``cls`` with short arrays (``from_type`` builds huge nested ones)."""
    import hypothesis.strategies as st

    hints = typing.get_type_hints(cls)
    fields = {}
    for f in dataclasses.fields(cls):
        tp, array, optional = _inner(hints[f.name])
        if dataclasses.is_dataclass(tp):
            leaf = st.deferred(lambda tp=tp: kio_strategy(tp, max_items))  # type: ignore[misc]
        else:
            leaf = st.from_type(tp)
        s = st.lists(leaf, max_size=max_items).map(tuple) if array else leaf
        if optional:
            s = st.none() | s
        if f.default is not dataclasses.MISSING:
            # Defaults matter most for tagged fields: kio omits them, so the decoder must supply them.
            s = st.just(f.default) | s
        fields[f.name] = s
    return st.fixed_dictionaries(fields).map(lambda kw: cls(**kw))

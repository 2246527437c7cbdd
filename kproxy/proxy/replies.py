"""Kafka error responses that kproxy builds itself from a request, for any API and version.

A broker answers a failed Produce with an error per partition, not one for the whole request, and
clients only retry what the response names. So the reply mirrors the request's topic and partition
arrays into the response's, matched by field names, and sets every error code it creates. Pure.
"""

from __future__ import annotations

from typing import Any

from kproxy.protocol.compiler import message_class
from kproxy.protocol.entities import coordinator_apis, partition_apis
from kproxy.protocol.messages import Request, Response, api_by_key, response_codecs
from kproxy.protocol.schema import FieldSpec, StructSpec

FETCH = 1

# Identity fields copied from a request element into the response element it mirrors, with the
# request-side names each may have (Fetch says ``partition``, Produce says ``index``).
_ALIASES: dict[str, tuple[str, ...]] = {
    "name": ("name", "topic", "topic_name"),
    "topic": ("topic", "name"),
    "topic_name": ("topic_name", "name", "topic"),
    "topic_id": ("topic_id",),
    "group_id": ("group_id",),
    "transactional_id": ("transactional_id",),
    "partition_index": ("partition_index", "partition", "index"),
    "partition": ("partition", "partition_index", "index"),
    "index": ("index", "partition_index", "partition"),
    "key": ("key",),
    "resource_type": ("resource_type",),
    "resource_name": ("resource_name",),
}


def _present(s: StructSpec, v: int) -> dict[str, FieldSpec]:
    return {f.name: f for f in s.fields if v in f.versions}


def _score(resp_elem: StructSpec, req_field: FieldSpec, rv: int, qv: int) -> int:
    rf = _present(resp_elem, rv)
    if req_field.type == "struct":
        assert req_field.struct is not None
        qf = _present(req_field.struct, qv)
        return sum(1 for n in rf if n in _ALIASES and any(a in qf for a in _ALIASES[n]))
    if req_field.type == "string" and any(n in rf for n in ("name", "topic", "group_id", "key")):
        return 1
    if req_field.type == "int32" and any(n in rf for n in ("partition_index", "partition")):
        return 1
    return 0


def _fill(resp_obj: Any, resp_spec: StructSpec, req_obj: Any, req_spec: StructSpec | None,
          rv: int, qv: int, error_code: int, message: str | None, top: bool) -> int:
    """Fill ``resp_obj`` from ``req_obj``; returns how many error codes it set."""
    set_codes = 0
    rf = _present(resp_spec, rv)
    qf = _present(req_spec, qv) if req_spec is not None else {}
    if "error_code" in rf:
        resp_obj.error_code = error_code
        set_codes += 1
    for name, f in rf.items():
        # Offsets in an error answer are Kafka's "unknown" (-1), as a broker would send.
        if f.type == "int64" and not f.array and not f.has_default and (
                name.endswith("offset") or name == "high_watermark"):
            setattr(resp_obj, name, -1)
        # Records and bytes default to null, which versions where they are not nullable cannot carry.
        if (f.type in ("records", "bytes") and not f.array and rv not in f.nullable
                and getattr(resp_obj, name) is None):
            setattr(resp_obj, name, b"")
    if message is not None and "error_message" in rf and rf["error_message"].type == "string":
        resp_obj.error_message = message
    for name, f in rf.items():
        if name in _ALIASES and not top and req_obj is not None and f.type != "struct":
            for alias in _ALIASES[name]:
                if alias in qf and qf[alias].type == f.type and not qf[alias].array:
                    value = getattr(req_obj, alias)
                    # A null the request may carry (Metadata v10-11 names) the response cannot.
                    if value is not None or rv in f.nullable:
                        setattr(resp_obj, name, value)
                    break
        if not (f.array and f.type == "struct") or req_spec is None:
            continue
        assert f.struct is not None
        best, best_score = None, 0
        for q in qf.values():
            if q.array:
                s = _score(f.struct, q, rv, qv)
                if s > best_score:
                    best, best_score = q, s
        if best is None:
            continue
        items = getattr(req_obj, best.name)
        if items is None:
            continue
        # Generated classes hang every nested struct class on the message's root class.
        cls = getattr(message_class(type(resp_obj)._message), f.struct.name)
        out = []
        for item in items:
            elem = cls()
            if best.type == "struct":
                set_codes += _fill(elem, f.struct, item, best.struct, rv, qv, error_code, message, False)
            else:
                set_codes += _fill(elem, f.struct, None, None, rv, qv, error_code, message, False)
                key = next((n for n in ("name", "topic", "group_id", "key", "partition_index", "partition")
                            if n in _present(f.struct, rv)), None)
                if key is not None:
                    setattr(elem, key, item)
            out.append(elem)
        setattr(resp_obj, f.name, out)
    return set_codes


def error_response(request: Request, error_code: int, message: str | None = None,
                   throttle_time_ms: int = 0) -> Response | None:
    """The response a broker would give ``request`` had it failed with ``error_code`` everywhere.

    None when the response would carry no error code at all (it would read as a success).
    """
    hc, bc = response_codecs(request.api_key, request.api_version)
    api = api_by_key(request.api_key)
    assert api.response is not None and api.request is not None
    body = bc.cls()
    if not _fill(body, api.response.root, request.body, api.request.root, request.api_version,
                 request.api_version, error_code, message, True):
        return None
    if request.api_key == FETCH and any(t.partitions for t in body.responses):
        # Fetch's top-level error is for fetch-session failures; with it set, consumers skip the
        # per-partition errors that say what really happened (and retry a refusal forever).
        body.error_code = 0
    if throttle_time_ms and "throttle_time_ms" in _present(api.response.root, request.api_version):
        body.throttle_time_ms = throttle_time_ms
    return Response(request.api_key, request.api_version, hc.cls(request.correlation_id), body)


_HAS_THROTTLE: dict[tuple[int, int], bool] = {}


def raise_throttle(response: Response, throttle_ms: int) -> bool:
    """Make the response tell the client to wait ``throttle_ms`` (KIP-219), keeping the broker's own
    ``throttle_time_ms`` when it is larger; False when this version has no such field."""
    key = (response.api_key, response.api_version)
    has = _HAS_THROTTLE.get(key)
    if has is None:
        spec = api_by_key(response.api_key).response
        has = _HAS_THROTTLE[key] = spec is not None and "throttle_time_ms" in _present(spec.root, key[1])
    if has and throttle_ms > response.body.throttle_time_ms:
        response.body.throttle_time_ms = throttle_ms
    return has


# What a client is told about a request whose broker connection was lost: an error that makes every
# client refresh its view and retry. Requests sent to partition leaders (``to=leader`` in the schema)
# get NOT_LEADER_OR_FOLLOWER, those sent to a coordinator (``to=coordinator``, plus FindCoordinator
# and ListGroups, whose clients also handle COORDINATOR_NOT_AVAILABLE) get that. Metadata and the
# handshake APIs have no error that makes a client retry, so the connection is closed instead,
# which clients also treat as retriable.
_CLOSE_ON_LOSS = frozenset({3, 17, 18, 36})
NOT_LEADER_OR_FOLLOWER, REQUEST_TIMED_OUT, COORDINATOR_NOT_AVAILABLE = 6, 7, 15
FIND_COORDINATOR, LIST_GROUPS = 10, 16


def lost_connection_error(api_key: int) -> int | None:
    """The retriable error for a request whose broker connection was lost; None: close instead."""
    if api_key in _CLOSE_ON_LOSS:
        return None
    if api_key in partition_apis():
        return NOT_LEADER_OR_FOLLOWER
    if api_key in coordinator_apis() or api_key in (FIND_COORDINATOR, LIST_GROUPS):
        return COORDINATOR_NOT_AVAILABLE
    return REQUEST_TIMED_OUT


# Entity kinds that identify an element of a response array (the topic of a topic entry, the group
# of a group entry): two elements with the same values are answers about the same thing.
_IDENTITY = frozenset({"topic", "topic_id", "group", "txn"})


def _merge(into: Any, part: Any, spec: StructSpec, version: int) -> None:
    for f in spec.fields:
        if version not in f.versions or not f.array or f.type != "struct":
            continue
        assert f.struct is not None
        extra = getattr(part, f.name)
        if not extra:
            continue
        mine = getattr(into, f.name)
        if mine is None:
            setattr(into, f.name, list(extra))
            continue
        keys = [g.name for g in f.struct.fields if version in g.versions and g.entity in _IDENTITY
                and not g.array]
        for elem in extra:
            same = None
            if keys:
                ident = tuple(getattr(elem, k) for k in keys)
                same = next((m for m in mine if tuple(getattr(m, k) for k in keys) == ident), None)
            if same is None:
                mine.append(elem)
            else:
                _merge(same, elem, f.struct, version)


def merge_response(api_key: int, version: int, into: Any, part: Any) -> None:
    """Add the elements of response body ``part`` to response body ``into`` (same api and version).

    For answering one request from two places: the broker's answer to the part kproxy forwarded and
    kproxy's own errors for the part it refused. Arrays of structs are merged by the names and ids
    their elements carry (a transaction entry present in both gets the other's topics), other
    elements are appended; single fields keep ``into``'s values.
    """
    api = api_by_key(api_key)
    assert api.response is not None
    _merge(into, part, api.response.root, version)

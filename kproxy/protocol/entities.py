"""Where topic names, topic ids, group ids, transactional ids, node ids and producer ids travel in
every Kafka message, and fast ways to collect, rewrite and filter them in decoded bodies.

Everything here is read from the schema's ``entity=``, ``hold=ms`` and ``to=`` marks (FORMAT.md), never
from lists of field names. For each (api, version, request or response, entity) three small functions
are generated once and cached, so a rule that looks at every request runs a plain loop instead of
walking the schema. Pure: no I/O, no clocks, no state beyond the caches.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kproxy.protocol.compiler import exec_source
from kproxy.protocol.messages import apis
from kproxy.protocol.schema import RESOURCE_KINDS, FieldSpec, MessageSpec, StructSpec, resource_type_field

# What collect, rewrite and filter_elements resolve to. The schema's other kinds (config_resource,
# acl_resource, coordinator_key) are names whose kind a type code decides, per element.
ENTITIES = frozenset({"topic", "topic_id", "group", "txn", "broker", "producer"})

# The type codes that make a typed name one of ENTITIES (FORMAT.md, "Entities"). Codes not listed
# (client metrics, cluster, users, the ACL filter's ANY, share-state keys) resolve to nothing.
TYPE_CODES: dict[str, dict[int, str]] = {
    "config_resource": {2: "topic", 4: "broker", 8: "broker", 32: "group"},
    "acl_resource": {2: "topic", 3: "group", 5: "txn"},
    "coordinator_key": {0: "group", 1: "txn"},
}

Step = tuple[str, bool]    # (field name, the field is an array)
Path = tuple[Step, ...]    # from the message root; the last step is the entity field itself

Keep = Callable[[Any], bool]
Rewrite = Callable[[Any], Any]


def _message(api_key: int, version: int, kind: str) -> MessageSpec:
    if kind not in ("request", "response"):
        raise ValueError(f"kind must be 'request' or 'response', not {kind!r}")
    api = apis().get(api_key)
    if api is None:
        raise ValueError(f"unknown api key {api_key}")
    msg: MessageSpec | None = getattr(api, kind)
    assert msg is not None
    if version not in msg.versions:
        raise ValueError(f"{api.name} has no {kind} version {version} (kproxy knows v{msg.versions})")
    return msg


def _fields_at(msg: MessageSpec, version: int) -> list[tuple[FieldSpec, ...]]:
    """Every entity field present in ``version``, as the chain of fields from the root to it."""
    out: list[tuple[FieldSpec, ...]] = []

    def walk(s: StructSpec, prefix: tuple[FieldSpec, ...]) -> None:
        for f in s.fields:
            if version not in f.versions:
                continue
            if f.entity is not None:
                out.append((*prefix, f))
            if f.struct is not None:
                walk(f.struct, (*prefix, f))

    walk(msg.root, ())
    return out


_PATHS: dict[tuple[int, int, str], dict[str, tuple[Path, ...]]] = {}


def entity_paths(api_key: int, version: int, kind: str) -> dict[str, tuple[Path, ...]]:
    """For each entity kind in the schema (including the typed ones, ``config_resource``,
    ``acl_resource`` and ``coordinator_key``), the paths to its fields in this message version."""
    key = (api_key, version, kind)
    paths = _PATHS.get(key)
    if paths is None:
        found: dict[str, list[Path]] = {}
        for chain in _fields_at(_message(api_key, version, kind), version):
            found.setdefault(chain[-1].entity or "", []).append(tuple((f.name, f.array) for f in chain))
        paths = {k: tuple(v) for k, v in found.items()}
        _PATHS[key] = paths
    return paths


# ---------------------------------------------------------------------------------------------
# Sites: where one resolved entity sits, with the type-code test that applies there


@dataclass(frozen=True, slots=True)
class _Site:
    chain: tuple[FieldSpec, ...]    # root to the entity field
    sibling: str | None             # type code field beside the entity field, tested per element
    key_type: bool                  # tested once against the request's key_type
    codes: tuple[int, ...]          # the type codes that make the field this entity


def _sites(msg: MessageSpec, version: int, entity: str, request: MessageSpec) -> list[_Site]:
    out = []
    for chain in _fields_at(msg, version):
        f = chain[-1]
        if f.entity == entity:
            out.append(_Site(chain, None, False, ()))
            continue
        codes = tuple(c for c, e in TYPE_CODES.get(f.entity or "", {}).items() if e == entity)
        if not codes:
            continue
        if f.entity in RESOURCE_KINDS:
            holder = chain[-2].struct if len(chain) > 1 else msg.root
            assert holder is not None
            tf = next(t for t in holder.fields if t.name == resource_type_field(f.name))
        else:
            tf = next(t for t in request.root.fields if t.name == "key_type")
        if version in tf.versions:
            out.append(_Site(chain, tf.name if f.entity in RESOURCE_KINDS else None,
                             f.entity not in RESOURCE_KINDS, codes))
        elif (tf.default if tf.has_default else 0) in codes:
            # A version without the type code field means its default kind (FORMAT.md).
            out.append(_Site(chain, None, False, ()))
    return out


# ---------------------------------------------------------------------------------------------
# Generated functions


class _Src:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.depth = 0

    def __call__(self, line: str) -> None:
        self.lines.append("    " * self.depth + line)


def _test(expr: str, codes: tuple[int, ...]) -> str:
    return f"{expr} == {codes[0]}" if len(codes) == 1 else f"{expr} in {codes!r}"


@dataclass(slots=True)
class _Node:
    field: FieldSpec | None
    items: dict[str, _Node | _Site]     # by field name, in schema order: structs and entity fields


def _trie(sites: list[_Site]) -> _Node:
    root = _Node(None, {})
    for site in sites:
        node = root
        for f in site.chain[:-1]:
            child = node.items.setdefault(f.name, _Node(f, {}))
            assert isinstance(child, _Node)
            node = child
        node.items[site.chain[-1].name] = site
    return root


def _enter(src: _Src, f: FieldSpec, holder: str, var: str, version: int) -> None:
    """Open a loop over an array field's elements, or bind a struct field and skip it when null."""
    if f.array:
        src(f"for {var} in {holder}.{f.name}{' or ()' if version in f.nullable else ''}:")
    else:
        src(f"{var} = {holder}.{f.name}")
        src(f"if {var} is not None:")
    src.depth += 1


def _walk_trie(src: _Src, node: _Node, var: str, depth: int, version: int,
               leaf: Callable[[_Src, _Site, str], None]) -> None:
    for item in node.items.values():
        if isinstance(item, _Site):
            guard = item.sibling is not None or item.key_type
            if item.sibling is not None:
                src(f"if {_test(f'{var}.{item.sibling}', item.codes)}:")
            elif item.key_type:
                src(f"if {_test('kt', item.codes)}:")
            src.depth += guard
            leaf(src, item, var)
            src.depth -= guard
            continue
        assert item.field is not None
        inner = f"e{depth}"
        _enter(src, item.field, var, inner, version)
        _walk_trie(src, item, inner, depth + 1, version, leaf)
        src.depth -= 1


def _collect_leaf(src: _Src, site: _Site, var: str) -> None:
    f = site.chain[-1]
    src(f"x = {var}.{f.name}")
    src("if x is not None:")
    src(f"    {'extend' if f.array else 'add'}(x)")


def _rewrite_leaf(src: _Src, site: _Site, var: str) -> None:
    f = site.chain[-1]
    src(f"x = {var}.{f.name}")
    if f.array:
        src("if x:")
        src("    for i, y in enumerate(x):")
        src("        y = fn(y)")
        src("        if y is not None:")
        src("            x[i] = y")
        src("            n += 1")
    else:
        src("if x is not None:")
        src("    y = fn(x)")
        src("    if y is not None:")
        src(f"        {var}.{f.name} = y")
        src("        n += 1")


def _filter_site(src: _Src, site: _Site, no: int, version: int, helpers: list[str]) -> None:
    """Remove the elements of the innermost array on the site's path whose value ``keep`` rejects."""
    chain = site.chain
    k = max(i for i, f in enumerate(chain) if f.array)
    guard = site.key_type
    if guard:
        src(f"if {_test('kt', site.codes)}:")
        src.depth += 1
    var = "b"
    for depth, f in enumerate(chain[:k]):
        _enter(src, f, var, f"e{depth}", version)
        var = f"e{depth}"
    src(f"x = {var}.{chain[k].name}")
    src("if x:")
    if k == len(chain) - 1:
        src("    kept = [y for y in x if keep(y)]")
    else:
        # The value sits below the element, through structs only: a generated test per element.
        h = _Src()
        h(f"def _keep{no}(e, keep):")
        h.depth += 1
        var = "e"
        for f in chain[k + 1:-1]:
            h(f"e = {var}.{f.name}")
            h("if e is None:")
            h("    return True")
            var = "e"
        if site.sibling is not None:
            h(f"if not ({_test(f'{var}.{site.sibling}', site.codes)}):")
            h("    return True")
        h(f"v = {var}.{chain[-1].name}")
        h("return v is None or keep(v)")
        helpers.extend(h.lines)
        src(f"    kept = [e for e in x if _keep{no}(e, keep)]")
    src("    if len(kept) != len(x):")
    src("        n += len(x) - len(kept)")
    src("        x[:] = kept")
    src.depth -= k + guard


def _key_type_line(sites: list[_Site], kind: str, name: str) -> list[str]:
    if not any(s.key_type for s in sites):
        return []
    if kind == "request":
        return ["kt = b.key_type"]
    # The response does not repeat the key type; the request it answers has it.
    return ["if r is None:",
            f"    raise ValueError({name + ' response: pass the request, whose key_type decides the keys'!r})",
            "kt = r.key_type"]


def _function(signature: str, head: list[str], *body: str) -> _Src:
    src = _Src()
    src(f"def {signature}:")
    src.depth += 1
    for line in (*head, *body):
        src(line)
    return src


def _source(msg: MessageSpec, version: int, kind: str, sites: list[_Site]) -> str:
    head = _key_type_line(sites, kind, f"{msg.api_name} v{version}")
    trie = _trie(sites)

    c = _function("collect(b, r)", head, "out = []", "add = out.append", "extend = out.extend")
    _walk_trie(c, trie, "b", 0, version, _collect_leaf)
    c("return out")

    w = _function("rewrite(b, r, fn)", head, "n = 0")
    _walk_trie(w, trie, "b", 0, version, _rewrite_leaf)
    w("return n")

    f = _function("filter_elements(b, r, keep)", head, "n = 0")
    helpers: list[str] = []
    # Outer arrays first, so inner ones are only walked in the elements that stay.
    removable = [s for s in sites if any(x.array for x in s.chain)]
    removable.sort(key=lambda s: max(i for i, x in enumerate(s.chain) if x.array))
    for no, site in enumerate(removable):
        _filter_site(f, site, no, version, helpers)
    f("return n")
    return "\n".join([*helpers, *c.lines, *w.lines, *f.lines]) + "\n"


@dataclass(frozen=True, slots=True)
class _Plan:
    collect: Callable[[Any, Any], list]
    rewrite: Callable[[Any, Any, Rewrite], int]
    filter: Callable[[Any, Any, Keep], int]
    source: str
    empty: bool


_PLANS: dict[tuple[int, int, str, str], _Plan] = {}


def _plan(api_key: int, version: int, kind: str, entity: str) -> _Plan:
    key = (api_key, version, kind, entity)
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    if entity not in ENTITIES:
        raise ValueError(f"unknown entity {entity!r}; expected one of {', '.join(sorted(ENTITIES))}")
    msg = _message(api_key, version, kind)
    request = apis()[api_key].request
    assert request is not None
    sites = _sites(msg, version, entity, request)
    src = _source(msg, version, kind, sites)
    ns = exec_source(src, f"<kproxy-entities {msg.api_name}.{kind}.v{version} {entity}>", {})
    plan = _Plan(ns["collect"], ns["rewrite"], ns["filter_elements"], src, not sites)
    _PLANS[key] = plan
    return plan


# ---------------------------------------------------------------------------------------------
# Public queries over decoded bodies


def collect(body: Any, api_key: int, version: int, kind: str, entity: str,
            request: Any = None) -> list:
    """The values of ``entity`` in a decoded body, in schema order (depth first); nulls are skipped.

    ``kind`` is "request" or "response". Typed names count only where their type code says they
    are ``entity``. A FindCoordinator v4+ response needs ``request`` (the request body it answers),
    since only the request carries the key type; other messages ignore it.
    """
    return _plan(api_key, version, kind, entity).collect(body, request)


def rewrite(body: Any, api_key: int, version: int, kind: str, entity: str, fn: Rewrite,
            request: Any = None) -> int:
    """Replace, in place, each value ``v`` of ``entity`` by ``fn(v)``; ``fn`` returns None to leave
    ``v`` as it is. Nulls are never passed to ``fn``. Returns how many values were replaced."""
    return _plan(api_key, version, kind, entity).rewrite(body, request, fn)


def filter_elements(body: Any, api_key: int, version: int, kind: str, entity: str, keep: Keep,
                    request: Any = None) -> int:
    """Remove, in place, every element that holds a value of ``entity`` that ``keep`` rejects.

    The element removed is the one of the innermost array on the value's path: for a field inside
    an array of structs (Metadata ``topics[].name``), the struct in that array (the whole topic);
    for an array of values (DeleteTopics ``topic_names``), the value itself. Fields outside any
    array (JoinGroup ``group_id``) are never removed, and null values are kept. Returns how many
    elements were removed.
    """
    return _plan(api_key, version, kind, entity).filter(body, request, keep)


def has_entity(api_key: int, version: int, kind: str, entity: str) -> bool:
    """Whether this message version can carry ``entity`` at all (typed names included)."""
    return not _plan(api_key, version, kind, entity).empty


def entity_source(api_key: int, version: int, kind: str, entity: str) -> str:
    """The generated source of collect, rewrite and filter_elements for one message version."""
    return _plan(api_key, version, kind, entity).source


_APIS_WITH: dict[tuple[str, str], frozenset[int]] = {}


def apis_with(entity: str, kind: str = "request") -> frozenset[int]:
    """The api keys whose request (or response) carries ``entity`` in at least one version, so a
    filter can ask to see only those."""
    keys = _APIS_WITH.get((entity, kind))
    if keys is None:
        found = set()
        for key, api in apis().items():
            msg: MessageSpec | None = getattr(api, kind)
            assert msg is not None and msg.versions.hi is not None
            if any(has_entity(key, v, kind, entity) for v in range(msg.versions.lo, msg.versions.hi + 1)):
                found.add(key)
        keys = frozenset(found)
        _APIS_WITH[(entity, kind)] = keys
    return keys


# ---------------------------------------------------------------------------------------------
# Classifications the session and the address rewriter need


@functools.cache
def _destined(to: str) -> frozenset[int]:
    return frozenset(key for key, api in apis().items() if api.to == to)


def partition_apis() -> frozenset[int]:
    """APIs whose requests go to the leader of each partition they name (``to=leader``)."""
    return _destined("leader")


def coordinator_apis() -> frozenset[int]:
    """APIs whose requests go to the group, share or transaction coordinator (``to=coordinator``)."""
    return _destined("coordinator")


def quorum_apis() -> frozenset[int]:
    """KRaft quorum APIs (``to=quorum``): their node ids and endpoints are controllers'."""
    return _destined("quorum")


def node_id_fields(struct: StructSpec, version: int) -> tuple[str, ...]:
    """The struct's single node id fields (int32, ``entity=broker``) present in ``version``."""
    return tuple(f.name for f in struct.fields
                 if f.entity == "broker" and not f.array and version in f.versions)


_HOLD: dict[tuple[int, int], tuple[str, ...]] = {}


def hold_fields(api_key: int, version: int) -> tuple[str, ...]:
    """The request's top-level ``hold=ms`` fields present in ``version``."""
    names = _HOLD.get((api_key, version))
    if names is None:
        msg = _message(api_key, version, "request")
        names = tuple(f.name for f in msg.root.fields if f.hold and version in f.versions)
        _HOLD[(api_key, version)] = names
    return names


def hold_ms(body: Any, api_key: int, version: int) -> int:
    """How long, in milliseconds, the request lets the broker hold it before answering (0: none)."""
    longest = 0
    for name in hold_fields(api_key, version):
        v = getattr(body, name)
        if v > longest:
            longest = v
    return longest

"""A tenant prefix (``rewrite: topic_prefix`` and the like): the functions that put it on the names a
request carries and take it off, or hide, the names of an answer, made once per prefix and kept
per api version; and the requests a prefix cannot keep inside the tenant's namespace (ACL changes,
name patterns), which are refused. Pure.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from kproxy.policy.engine import CACHE_LIMIT, CREATE_ACLS, DELETE_ACLS
from kproxy.policy.model import Rewrite
from kproxy.protocol import entities
from kproxy.protocol.errors import CLUSTER_AUTHORIZATION_FAILED
from kproxy.protocol.messages import Request, api_by_key, body_class
from kproxy.protocol.schema import StructSpec
from kproxy.proxy.filters import Respond

INVALID_REGULAR_EXPRESSION = 128


@attrs.frozen
class TenantNames:
    """The functions that put a tenant's prefixes on names and take them off, made once per rule."""

    prefixes: dict[str, str] = attrs.field(hash=False)
    add: tuple[tuple[str, Callable[[str], str | None]], ...] = attrs.field(hash=False)
    undo: tuple[tuple[str, Callable[[str], bool], Callable[[str], str | None]], ...] = attrs.field(hash=False)
    # Per (api key, version): only the kinds of names that message carries at all.
    _adding: dict[tuple[int, int], tuple] = attrs.field(factory=dict, hash=False)
    _undoing: dict[tuple[int, int], tuple] = attrs.field(factory=dict, hash=False)

    def adding(self, api_key: int, version: int) -> tuple[tuple[str, Callable[[str], str | None]], ...]:
        got = self._adding.get((api_key, version))
        if got is None:
            got = self._adding[(api_key, version)] = tuple(
                (e, f) for e, f in self.add if entities.has_entity(api_key, version, "request", e))
        return got

    def undoing(self, api_key: int, version: int
                ) -> tuple[tuple[str, Callable[[str], bool], Callable[[str], str | None]], ...]:
        got = self._undoing.get((api_key, version))
        if got is None:
            got = self._undoing[(api_key, version)] = tuple(
                u for u in self.undo if entities.has_entity(api_key, version, "response", u[0]))
        return got


_TENANTS: dict[tuple[tuple[str, str], ...], TenantNames] = {}


def tenant_of(prefixes: dict[str, str]) -> TenantNames:
    key = tuple(prefixes.items())
    got = _TENANTS.get(key)
    if got is None:
        if len(_TENANTS) >= CACHE_LIMIT:
            _TENANTS.clear()
        got = _TENANTS[key] = TenantNames(
            prefixes,
            tuple((e, functools.partial(_prefixed, p)) for e, p in prefixes.items()),
            tuple((e, functools.partial(_in_namespace, p), functools.partial(_unprefixed, p))
                  for e, p in prefixes.items()))
    return got


_BY_REWRITE: dict[int, tuple[Rewrite, TenantNames]] = {}


def tenant_of_rewrite(rewrite: Rewrite) -> TenantNames:
    got = _BY_REWRITE.get(id(rewrite))
    if got is None or got[0] is not rewrite:
        if len(_BY_REWRITE) >= CACHE_LIMIT:
            _BY_REWRITE.clear()
        got = _BY_REWRITE[id(rewrite)] = (rewrite, tenant_of(rewrite.prefixes()))
    return got[1]


def _prefixed(prefix: str, name: str) -> str | None:
    return prefix + name if name else None


def _unprefixed(prefix: str, name: str) -> str | None:
    return name[len(prefix):] if name.startswith(prefix) else None


def _in_namespace(prefix: str, name: str) -> bool:
    return not name or name.startswith(prefix)


_PATTERNS: dict[tuple[int, int], tuple[entities.Path, ...]] = {}


def pattern_fields(api_key: int, version: int) -> tuple[entities.Path, ...]:
    """Paths ((field name, is an array), ... from the root) of the request's name patterns: string
    fields named ``*_regex`` or ``*_pattern``, which the schema leaves unmarked because no prefix can
    rewrite them."""
    got = _PATTERNS.get((api_key, version))
    if got is None:
        found: list[entities.Path] = []

        def walk(s: StructSpec, prefix: entities.Path) -> None:
            for f in s.fields:
                if version not in f.versions:
                    continue
                if f.type == "string" and f.name.endswith(("_regex", "_pattern")):
                    found.append((*prefix, (f.name, f.array)))
                if f.struct is not None:
                    walk(f.struct, (*prefix, (f.name, f.array)))

        spec = api_by_key(api_key).request
        assert spec is not None
        walk(spec.root, ())
        got = _PATTERNS[(api_key, version)] = tuple(found)
    return got


def _values_at(obj: Any, path: entities.Path) -> Iterable[Any]:
    if obj is None:
        return
    if not path:
        yield obj
        return
    (name, array), rest = path[0], path[1:]
    value = getattr(obj, name)
    # Arrays may be lazy (kproxy.protocol.LazyArray): the schema says which fields are arrays.
    for item in (value or ()) if array else (value,):
        yield from _values_at(item, rest)


def tenant_refusal(req: Request) -> Respond | None:
    """The answer to a request a tenant prefix cannot keep inside the tenant's namespace, or None."""
    if req.api_key in (CREATE_ACLS, DELETE_ACLS):
        # Wildcards, null filters and the ANY type would reach other tenants' resources. One result
        # per creation or filter, as the broker gives.
        message = "kproxy: ACLs cannot be changed by a client with a tenant prefix"
        cls: Any = body_class(req.api_key, "response")
        if req.api_key == CREATE_ACLS:
            body = cls(results=[cls.AclCreationResult(error_code=CLUSTER_AUTHORIZATION_FAILED, error_message=message)
                                for _ in req.body.creations])
        else:
            body = cls(filter_results=[cls.DeleteAclsFilterResult(error_code=CLUSTER_AUTHORIZATION_FAILED,
                                                                  error_message=message)
                                       for _ in req.body.filters])
        return Respond(body=body)
    for path in pattern_fields(req.api_key, req.api_version):
        if any(_values_at(req.body, path)):
            return Respond(error_code=INVALID_REGULAR_EXPRESSION,
                           error_message="kproxy: name patterns cannot be used with a tenant prefix; subscribe "
                                         "by topic names, or match them in the client")
    return None

"""Names with a prefix the client never sees: the one mechanism behind a tenant's namespace (the
policy's ``rewrite`` rule) and a replica cluster's topic prefix (MirrorMaker 2's ``primary.orders``).

A prefix goes on every name of its kind in a request and comes off every name in the answer; names
outside the namespace are dropped from the answer. Which fields are names of which kind is read from
the schema (``kproxy.protocol.entities``), so every API and version is covered. Name patterns
(``*_regex`` fields) cannot be rewritten and are refused by the users of this module. Pure.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from kproxy.protocol import entities
from kproxy.protocol.messages import Request, Response, api_by_key
from kproxy.protocol.schema import StructSpec

_CACHE_LIMIT = 4096     # prefix sets kept before the cache starts over (bounded, whatever rules say)


@attrs.frozen
class NamePrefixes:
    """The functions that put prefixes on names and take them off, made once per set of prefixes."""

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

    def put_on(self, req: Request) -> bool:
        """Prefix every name of ``req`` (in place); whether the request carries any such name kind."""
        adding = self.adding(req.api_key, req.api_version)
        for entity, add in adding:
            entities.rewrite(req.body, req.api_key, req.api_version, "request", entity, add)
        return bool(adding)

    def take_off(self, response: Response, request_body: Any) -> bool:
        """Take the prefixes off every name of ``response`` (in place), dropping names outside the
        namespace; whether the answer carries any such name kind."""
        key, version, body = response.api_key, response.api_version, response.body
        undoing = self.undoing(key, version)
        for entity, inside, strip in undoing:
            entities.filter_elements(body, key, version, "response", entity, inside, request_body)
            entities.rewrite(body, key, version, "response", entity, strip, request_body)
        return bool(undoing)


_PREFIXES: dict[tuple[tuple[str, str], ...], NamePrefixes] = {}


def prefixes_of(prefixes: dict[str, str]) -> NamePrefixes:
    """The NamePrefixes for ``{entity kind: prefix}`` (kinds of ``kproxy.protocol.entities``)."""
    key = tuple(prefixes.items())
    got = _PREFIXES.get(key)
    if got is None:
        if len(_PREFIXES) >= _CACHE_LIMIT:
            _PREFIXES.clear()
        got = _PREFIXES[key] = NamePrefixes(
            prefixes,
            tuple((e, functools.partial(_prefixed, p)) for e, p in prefixes.items()),
            tuple((e, functools.partial(_in_namespace, p), functools.partial(_unprefixed, p))
                  for e, p in prefixes.items()))
    return got


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


def uses_patterns(req: Request) -> bool:
    """Whether ``req`` carries a name pattern (a regex subscription), which no prefix can follow."""
    return any(any(_values_at(req.body, path)) for path in pattern_fields(req.api_key, req.api_version))


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

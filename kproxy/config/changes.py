"""Which settings differ between two loaded configs: what a reload (SIGHUP) reports as waiting for a
restart. Paths only, never values, so that no secret reaches a log line."""

from __future__ import annotations

from typing import Any

import attrs

from kproxy.config.checks import _SECTION_PATHS, INTERNAL
from kproxy.config.proxy import ProxyConfig

# Settings a SIGHUP puts in force (``ProxyProcess.reload_settings``), as (section, setting).
RELOADED: frozenset[tuple[str, str]] = frozenset({("traffic_log", "sample"), ("tracing", "sample_ratio")})


def changed_settings(old: ProxyConfig, new: ProxyConfig, skip: frozenset[tuple[str, str]] = RELOADED) -> list[str]:
    """The dotted paths of the settings whose values differ between the configs ``old`` and ``new``
    (``upstream.bootstrap_servers``, ``virtual_clusters[1].listen``), leaving out ``skip``'s."""
    out: list[str] = []
    _walk(old, new, "", "", skip, out)
    return out


def _walk(old: Any, new: Any, prefix: str, section: str, skip: frozenset[tuple[str, str]], out: list[str]) -> None:
    for f in attrs.fields(type(old)):
        if f.metadata.get(INTERNAL) or (section, f.name) in skip:
            continue
        a, b = getattr(old, f.name), getattr(new, f.name)
        path = prefix + f.name
        if a == b:
            continue
        if _section(a) and type(a) is type(b):
            _walk(a, b, path + ".", f.name, skip, out)
        elif (isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b)
              and all(_section(x) and type(x) is type(y) for x, y in zip(a, b, strict=True))):
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                if x != y:
                    _walk(x, y, f"{path}[{i}].", "", skip, out)
        else:
            out.append(path)


def _section(value: Any) -> bool:
    """A section of settings (descended into), not a value that is an object (a HostPort)."""
    return attrs.has(type(value)) and (type(value) in _SECTION_PATHS or type(value) is ProxyConfig)

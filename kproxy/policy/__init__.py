"""Policy rules: a YAML rule language that allows, denies, rewrites, caps and disturbs Kafka traffic.

``loader`` turns rule files into a ``RuleSet`` (``model``), ``engine`` judges requests against it
(pure; ``decide`` works on plain values), ``filter``'s ``PolicyFilter`` judges live requests the
same way and carries the decisions out (``tenants``: tenant prefixes; ``record_rules``: records),
and ``store`` keeps the rule set in force across reloads. The names below are imported when first
used, so importing the pure modules (``model``, ``engine``, ``filter``, and ``kproxy.quota`` that
builds on them) never pulls in the YAML loader or the store's clock.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "Decision": "engine", "Facts": "engine", "Policy": "engine", "PolicyFilter": "filter",
    "Refusal": "engine", "decide": "engine",
    "RuleError": "loader", "load_rules": "loader",
    "Match": "model", "Rule": "model", "RuleSet": "model",
    "RuleStore": "store",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'kproxy.policy' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kproxy.policy.{home}"), name)

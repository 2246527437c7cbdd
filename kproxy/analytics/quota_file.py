"""Writes the report's quota advice as a rules file in kproxy's quota syntax; no Spark here.

The rows come from the report's ``quota_advice`` table (one per client id or principal). This module
only turns them into YAML a person can read, review and pass to ``kproxy check``; the rates
themselves are computed in Spark.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

# Characters kproxy's match patterns treat as glob syntax: an id holding one cannot be matched
# literally, so it gets no quota of its own (the file says which ids were left out).
_GLOB_CHARS = re.compile(r"[*?\[\]]")
_NAME_UNSAFE = re.compile(r"[^a-z0-9]+")

RATE_KEYS = ("produce_bytes_per_s", "fetch_bytes_per_s", "requests_per_s")


def quota_name(per: str, key: str, taken: set[str]) -> str:
    """A readable, unique quota name from a client id or principal (``client-app-1``)."""
    prefix = "client" if per == "client_id" else "principal"
    base = f"{prefix}-{_NAME_UNSAFE.sub('-', key.lower()).strip('-') or 'unnamed'}"[:60]
    name, n = base, 2
    while name in taken:
        name, n = f"{base}-{n}", n + 1
    taken.add(name)
    return name


def quota_document(advice: Iterable[Mapping[str, Any]], per: str) -> tuple[dict[str, Any], list[str]]:
    """The rules document for ``advice`` rows of one dimension, and the keys left out (glob syntax)."""
    quotas: list[dict[str, Any]] = []
    skipped: list[str] = []
    taken: set[str] = set()
    for row in sorted(advice, key=lambda r: str(r["key"])):
        key = row["key"]
        if key is None or row["dimension"] != per:
            continue
        if _GLOB_CHARS.search(key):
            skipped.append(key)
            continue
        entry: dict[str, Any] = {"name": quota_name(per, key, taken), "match": {per: key}, "per": per}
        # A direction the client never used gets no limit rather than a guess.
        for rate in RATE_KEYS:
            value = row[f"recommended_{rate}"]
            if value:
                entry[rate] = int(value)
        entry["burst_s"] = 1
        quotas.append(entry)
    return {"default": "allow", "rules": [], "quotas": quotas}, skipped


def write_quota_file(path: Path, advice: Iterable[Mapping[str, Any]], per: str, header: str) -> int:
    """Writes the rules file; returns the number of quotas in it."""
    doc, skipped = quota_document(advice, per)
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    if skipped:
        lines.append(f"# Left out (their {per} holds glob characters): {', '.join(sorted(skipped))}")
    body = yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, allow_unicode=True, width=100)
    path.write_text("\n".join(lines) + "\n" + body, encoding="utf-8")
    return len(doc["quotas"])

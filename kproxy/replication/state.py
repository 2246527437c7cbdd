"""The state file: which cluster each virtual cluster is on, kept across restarts and reloads.

One JSON document for the process, one entry per virtual cluster::

    {"version": 1, "virtual_clusters": {"default": {"active": "secondary", "epoch": 1,
     "configured_active": "primary", "from": "primary", "reason": "failover",
     "switched_at": 1767225600.0, "abandoned": ["primary"]}}}

``epoch`` counts the switches; a process that reads a higher one than its own follows it (worker
processes share the file). Which cluster a virtual cluster starts on (``choose_active``): the one the
file names, unless the configuration's ``upstream.active`` was changed since that switch (then the
configuration is the newer decision) or the file names a cluster the configuration no longer has.
Pure: the server reads and writes the file.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from kproxy.protocol.errors import KProxyError

VERSION = 1


class StateError(KProxyError):
    """The state file cannot be read as kproxy's state."""


@attrs.frozen
class VirtualClusterState:
    active: str
    epoch: int = 0
    configured_active: str | None = None   # upstream.active when the switch happened
    from_cluster: str | None = None
    reason: str | None = None              # planned, failover, ...
    switched_at: float | None = None       # seconds since the epoch
    # Clusters failover left: automatic failover never goes back to them (a planned switch clears it).
    abandoned: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"active": self.active, "epoch": self.epoch, "configured_active": self.configured_active,
                "from": self.from_cluster, "reason": self.reason, "switched_at": self.switched_at,
                "abandoned": list(self.abandoned)}


def parse_state(text: str) -> dict[str, VirtualClusterState]:
    """The virtual clusters' states in a state file's text; StateError when it is not one."""
    if not text.strip():
        return {}
    try:
        data = json.loads(text)
    except ValueError as e:
        raise StateError(f"not JSON: {e}") from None
    if not isinstance(data, dict) or data.get("version") != VERSION:
        raise StateError(f"not a kproxy state file of version {VERSION}")
    clusters = data.get("virtual_clusters")
    if not isinstance(clusters, dict):
        raise StateError("no virtual_clusters mapping")
    out = {}
    for name, entry in clusters.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("active"), str):
            raise StateError(f"virtual cluster {name!r}: no active cluster")
        epoch = entry.get("epoch", 0)
        if type(epoch) is not int or epoch < 0:
            raise StateError(f"virtual cluster {name!r}: epoch {epoch!r} is not a count")
        abandoned = entry.get("abandoned") or []
        switched_at = entry.get("switched_at")
        out[str(name)] = VirtualClusterState(
            entry["active"], epoch, _text(entry.get("configured_active")), _text(entry.get("from")),
            _text(entry.get("reason")), float(switched_at) if isinstance(switched_at, int | float) else None,
            tuple(str(a) for a in abandoned if isinstance(a, str)))
    return out


def render_state(states: Mapping[str, VirtualClusterState]) -> str:
    body = {"version": VERSION, "virtual_clusters": {name: s.to_json() for name, s in sorted(states.items())}}
    return json.dumps(body, indent=2, sort_keys=True) + "\n"


def choose_active(configured: str, names: Iterable[str], state: VirtualClusterState | None) -> tuple[str, str]:
    """(the cluster to start on, why): see the module docstring."""
    if state is None:
        return configured, "upstream.active (no switch recorded)"
    if state.active not in set(names):
        return configured, f"upstream.active (the state file names {state.active!r}, which is not configured)"
    if state.configured_active is not None and state.configured_active != configured:
        return configured, (f"upstream.active (changed from {state.configured_active!r} since the switch to "
                            f"{state.active!r}; the configuration is the newer decision)")
    if state.active == configured:
        return configured, "upstream.active"
    return state.active, f"the state file (switch {state.epoch}, {state.reason or 'a switch'}, from {state.from_cluster})"


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None

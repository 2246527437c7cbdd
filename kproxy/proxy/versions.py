"""Narrows ApiVersions responses to the versions kproxy decodes, so clients never send others.

A broker newer than kproxy may offer versions (or whole APIs) kproxy's schema lacks; a client that
picked one would send a frame kproxy cannot read. Offering only the intersection keeps every client
working across version skew, with no frame forwarded blind. Pure.
"""

from __future__ import annotations

from kproxy.protocol.messages import Request, Response, supported_versions
from kproxy.proxy.filters import ConnectionContext, Filter

API_VERSIONS = 18


def narrow_api_keys(api_keys: list, supported: dict[int, tuple[int, int]]) -> list:
    """Keep each entry's range intersected with kproxy's; drop APIs kproxy does not know."""
    out = []
    for entry in api_keys:
        ours = supported.get(entry.api_key)
        if ours is None:
            continue
        lo, hi = max(entry.min_version, ours[0]), min(entry.max_version, ours[1])
        if lo > hi:
            continue
        entry.min_version, entry.max_version = lo, hi
        out.append(entry)
    return out


class ApiVersionsNarrower(Filter):
    name = "api_versions"
    response_api_keys = frozenset({API_VERSIONS})

    def __init__(self) -> None:
        self.supported = supported_versions()

    def on_response(self, ctx: ConnectionContext, request: Request, response: Response) -> float:
        response.body.api_keys = narrow_api_keys(response.body.api_keys, self.supported)
        return 0.0

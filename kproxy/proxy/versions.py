"""Narrows ApiVersions responses to the versions kproxy decodes, so clients never send others.

A broker newer than kproxy may offer versions (or whole APIs) kproxy's schema lacks; a client that
picked one would send a frame kproxy cannot read. Offering only the intersection keeps every client
working across version skew, with no frame forwarded blind. Tagged fields that only restate their
defaults are dropped too, which old librdkafka builds need. Pure.
"""

from __future__ import annotations

from typing import Any

from kproxy.protocol.messages import Response, supported_versions
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

    def on_response(self, ctx: ConnectionContext, exchange: Any, response: Response) -> float:
        body = response.body
        body.api_keys = narrow_api_keys(body.api_keys, self.supported)
        # Tagged fields that hold their default are left out, as Apache Kafka sends them. Some brokers
        # (tansu) send all four explicitly, and librdkafka up to 2.0 (Debian's kcat) cannot skip
        # tagged-field data in this response; the meaning is the same either way.
        body.omit_default_tags()
        return 0.0

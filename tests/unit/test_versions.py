"""ApiVersions responses are narrowed to what kproxy decodes, so clients never pick a version it cannot read."""

from __future__ import annotations

from kproxy.protocol.messages import Request, Response, body_class, supported_versions
from kproxy.proxy.filters import ConnectionContext, FilterChain
from kproxy.proxy.inflight import InFlight
from kproxy.proxy.versions import ApiVersionsNarrower, narrow_api_keys

API_VERSIONS = 18
ApiVersion = body_class(API_VERSIONS, "response").ApiVersion


def entries(*ranges):
    return [ApiVersion(api_key=k, min_version=lo, max_version=hi) for k, lo, hi in ranges]


def ranges(api_keys):
    return [(e.api_key, e.min_version, e.max_version) for e in api_keys]


def test_ranges_are_intersected_and_unknown_apis_dropped():
    ours = {0: (3, 9), 1: (4, 13), 3: (0, 12), 18: (0, 4)}
    got = narrow_api_keys(entries((0, 0, 11), (1, 5, 12), (3, 0, 12), (18, 0, 5), (1000, 0, 1)), ours)
    assert ranges(got) == [(0, 3, 9), (1, 5, 12), (3, 0, 12), (18, 0, 4)]


def test_disjoint_ranges_drop_the_api():
    ours = {0: (3, 9), 1: (4, 13)}
    assert ranges(narrow_api_keys(entries((0, 10, 12), (1, 0, 3)), ours)) == []


def test_single_version_overlap_is_kept():
    assert ranges(narrow_api_keys(entries((0, 9, 12)), {0: (3, 9)})) == [(0, 9, 9)]


def test_narrower_filter_on_a_response():
    supported = supported_versions()
    narrower = ApiVersionsNarrower()
    chain = FilterChain([narrower])
    assert chain.for_response(API_VERSIONS) == (narrower,)
    assert chain.for_response(3) == () and chain.for_request(API_VERSIONS) == ()
    lo, hi = supported[3]
    body = body_class(API_VERSIONS, "response")(api_keys=entries(
        (3, 0, hi + 5), (18, 0, 99), (32000, 0, 3)))
    resp = Response.build(API_VERSIONS, 3, 1, body)
    req = Request.build(API_VERSIONS, 3, 1, "app", body_class(API_VERSIONS, "request")())
    assert narrower.on_response(ConnectionContext(1), InFlight(1, API_VERSIONS, 3, 0.0, req), resp) == 0.0
    assert ranges(resp.body.api_keys) == [(3, lo, hi), (18, supported[18][0], supported[18][1])]


def test_every_kproxy_api_survives_against_a_broker_offering_everything():
    supported = supported_versions()
    offered = entries(*((k, 0, 200) for k in supported))
    assert ranges(narrow_api_keys(offered, supported)) == [(k, lo, hi) for k, (lo, hi) in supported.items()]

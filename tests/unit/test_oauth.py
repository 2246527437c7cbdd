"""kproxy.server.oauth against a loopback OIDC provider, with injected clocks: kproxy's own token is
reused until 80% of its life and then fetched again; the JWKS is fetched again for an unknown kid,
at most every 10 s, and a failed fetch keeps the keys held. The login metrics are exported."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kproxy.server.oauth import ClientCredentials, JwksCache, OAuthError
from kproxy.telemetry import metrics as metric_families
from kproxy.telemetry.metrics import Metrics
from tests.e2e.oidc import OidcProvider


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def oidc() -> Iterator[OidcProvider]:
    with OidcProvider({"kproxy": "secret"}, lifetime_s=100) as provider:
        yield provider


async def test_token_is_reused_until_80_percent_of_its_life(oidc: OidcProvider) -> None:
    clock = Clock(1000.0)
    tokens = ClientCredentials(oidc.token_url, "kproxy", lambda: "secret", "kafka", wall_clock=clock)
    first = await tokens.token()
    clock.now = 1079.0
    assert await tokens.token() == first and oidc.token_requests == [("kproxy", "kafka")]
    clock.now = 1080.5
    await tokens.token()
    assert len(oidc.token_requests) == 2


async def test_a_wrong_client_secret_is_an_error_naming_no_secret(oidc: OidcProvider) -> None:
    tokens = ClientCredentials(oidc.token_url, "kproxy", lambda: "wrong-secret-value")
    with pytest.raises(OAuthError) as e:
        await tokens.token()
    assert "HTTP 401" in str(e.value) and "wrong-secret-value" not in str(e.value)


async def test_jwks_refetch_for_unknown_kids_is_rate_limited(oidc: OidcProvider) -> None:
    clock = Clock(50.0)
    cache = JwksCache(oidc.jwks_url, 3600, clock=clock)
    assert await cache.refresh() and set(cache.keys) == {"k1"}
    await cache.ensure("k1")
    assert oidc.jwks_requests == 1                       # known kid: no fetch
    oidc.add_key("k2")
    await cache.ensure("k2")                             # right after the scheduled fetch: fetched
    assert set(cache.keys) == {"k1", "k2"} and oidc.jwks_requests == 2
    await cache.ensure("nope")                           # within 10 s of the last unknown-kid fetch
    assert oidc.jwks_requests == 2
    clock.now = 60.5
    await cache.ensure("nope")
    await cache.ensure("nope-again")
    assert oidc.jwks_requests == 3


async def test_a_failed_jwks_fetch_keeps_the_keys(oidc: OidcProvider) -> None:
    cache = JwksCache(oidc.jwks_url, 3600)
    await cache.refresh()
    cache.url = oidc.base + "/missing"
    assert not await cache.refresh()
    assert set(cache.keys) == {"k1"} and cache.fetches_failed == 1


def test_identity_metrics_are_exported() -> None:
    class Identity:
        logins = {("SCRAM-SHA-512", "ok"): 3, ("PLAIN", "failed"): 1}
        originator = type("O", (), {"logins": 2, "failures": 0})()
        jwks = type("J", (), {"fetches_ok": 1, "fetches_failed": 0, "keys": {"k1": None}})()
        kerberos = None

    m = Metrics()
    m.add_reader(lambda: metric_families.identity_families(Identity()))
    text = m.exposition().decode()
    assert 'kproxy_sasl_logins_total{mechanism="SCRAM-SHA-512",outcome="ok"} 3.0' in text
    assert 'kproxy_upstream_sasl_logins_total{outcome="ok"} 2.0' in text
    assert "kproxy_jwks_keys 1.0" in text

"""The HTTP side of OAuth: the JWKS that client tokens are checked against, and kproxy's own token
from a client-credentials grant (RFC 6749 4.4) for OAUTHBEARER origination.

The key set is fetched at start, every ``jwks_refresh_s``, and again (at most every 10 s) when a
token names a kid it lacks, so a rotated signing key is picked up before the login is judged. A
failed fetch keeps the keys already held. kproxy's token is fetched again once 80% of its life has
passed. Secrets (the client secret, tokens) never reach a log line.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import httpx
import trio

from kproxy.identity.tokens import VerificationKey, keys_from_jwks
from kproxy.logs import safe

log = logging.getLogger("kproxy.oauth")
# httpx logs every request at INFO; kproxy logs what matters about these itself.
logging.getLogger("httpx").setLevel(logging.WARNING)

MAX_DOCUMENT_BYTES = 1 << 20       # a JWKS or token answer larger than this is refused
REFETCH_UNKNOWN_KID_S = 10.0       # an unknown kid fetches the key set again at most this often
HTTP_TIMEOUT_S = 10.0


class OAuthError(Exception):
    """An identity provider did not give what was asked; the message names no secret."""


async def _get_json(client: httpx.AsyncClient, method: str, url: str, **kwargs: Any) -> Any:
    try:
        async with client.stream(method, url, **kwargs) as resp:
            body = bytearray()
            async for chunk in resp.aiter_bytes():
                body += chunk
                if len(body) > MAX_DOCUMENT_BYTES:
                    raise OAuthError(f"{url}: answer larger than {MAX_DOCUMENT_BYTES} bytes")
            if resp.status_code != 200:
                raise OAuthError(f"{url}: HTTP {resp.status_code}")
    except httpx.HTTPError as e:
        raise OAuthError(f"{url}: {type(e).__name__}: {e}") from None
    try:
        return json.loads(bytes(body))
    except ValueError:
        raise OAuthError(f"{url}: the answer is not JSON") from None


class JwksCache:
    """The signing keys of ``url``, by kid; read by every terminating connection."""

    def __init__(self, url: str, refresh_s: float, *, verify: bool | str = True,
                 clock: Callable[[], float] = trio.current_time) -> None:
        self.url = url
        self.refresh_s = refresh_s
        self.verify = verify
        self.clock = clock
        self.keys: Mapping[str, VerificationKey] = {}
        self.fetched_at = -math.inf           # last attempt, successful or not
        self._unknown_kid_at = -math.inf      # last fetch an unknown kid caused
        self.fetches_ok = 0
        self.fetches_failed = 0
        self._lock = trio.Lock()

    def current(self) -> Mapping[str, VerificationKey]:
        return self.keys

    async def refresh(self) -> bool:
        """Fetch the key set now; False (keeping the old keys) if that failed."""
        async with self._lock:
            self.fetched_at = self.clock()
            try:
                async with httpx.AsyncClient(timeout=HTTP_TIMEOUT_S, verify=self.verify) as client:
                    keys = keys_from_jwks(await _get_json(client, "GET", self.url))
            except (OAuthError, ValueError) as e:
                self.fetches_failed += 1
                log.error("JWKS %s: cannot refresh the keys (keeping %d held): %s", safe(self.url),
                          len(self.keys), safe(str(e)))
                return False
            if set(keys) != set(self.keys):
                log.info("JWKS %s: keys %s", safe(self.url), ", ".join(sorted(map(safe, keys))) or "none")
            self.keys = keys
            self.fetches_ok += 1
            return True

    async def ensure(self, kid: str | None) -> None:
        """Before a token naming ``kid`` is judged: fetch again if the kid is unknown (rate-limited)."""
        if kid is None or kid in self.keys:
            return
        # Only fetches caused by unknown kids count against the limit: a key rotated just after the
        # scheduled fetch is picked up by the first token that uses it.
        now = self.clock()
        if now - self._unknown_kid_at >= REFETCH_UNKNOWN_KID_S:
            self._unknown_kid_at = now
            log.info("JWKS %s: a token names unknown kid %s; fetching the keys again", safe(self.url),
                     safe(kid, 80))
            await self.refresh()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Keep the keys fresh; started once the first fetch was tried."""
        await self.refresh()
        task_status.started()
        while True:
            await trio.sleep(self.refresh_s)
            await self.refresh()


class ClientCredentials:
    """kproxy's own access token from ``token_url`` (client credentials, HTTP Basic client auth as
    RFC 6749 2.3.1 prefers); one fetch at a time, reused until 80% of its life has passed."""

    def __init__(self, token_url: str, client_id: str, secret: Callable[[], str], scope: str | None = None,
                 *, verify: bool | str = True, wall_clock: Callable[[], float] = time.time) -> None:
        self.token_url = token_url
        self.client_id = client_id
        self.secret = secret
        self.scope = scope
        self.verify = verify
        self.wall_clock = wall_clock
        self._token: str | None = None
        self._renew_at = -math.inf
        self._lock = trio.Lock()
        self.fetches = 0

    async def token(self) -> str:
        async with self._lock:
            now = self.wall_clock()
            if self._token is None or now >= self._renew_at:
                self._token, lifetime = await self._fetch()
                self._renew_at = now + 0.8 * lifetime
            return self._token

    async def _fetch(self) -> tuple[str, float]:
        data = {"grant_type": "client_credentials"}
        if self.scope:
            data["scope"] = self.scope
        async with httpx.AsyncClient(timeout=HTTP_TIMEOUT_S, verify=self.verify) as client:
            answer = await _get_json(client, "POST", self.token_url, data=data,
                                     auth=httpx.BasicAuth(self.client_id, self.secret()))
        token = answer.get("access_token") if isinstance(answer, dict) else None
        if not isinstance(token, str) or not token:
            raise OAuthError(f"{self.token_url}: no access_token in the answer")
        expires_in = answer.get("expires_in", 300)
        if not isinstance(expires_in, int | float) or expires_in <= 0:
            expires_in = 300
        self.fetches += 1
        log.info("got an access token for %s from %s (expires in %ds)", safe(self.client_id), safe(self.token_url),
                 int(expires_in))
        return token, float(expires_in)

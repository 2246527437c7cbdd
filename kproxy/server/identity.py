"""The I/O half of identity: builds kproxy's SASL front for each connection from the config, keeps
what the pure checks need fresh (the users file, the JWKS, the brokers' ApiVersions), logs in to
brokers as kproxy (``Originator``), and counts logins for /metrics.

The users file is read again when it changes on disk (at the next handshake), so ``kproxy users
add`` takes effect without a restart; a broken file keeps the users already loaded.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import secrets
import time
from typing import Any

import attrs
import trio

from kproxy.config import ProxyConfig
from kproxy.identity.kerberos import GssapiSettings, KerberosMapper, realm_of
from kproxy.identity.termination import (
    FailedLogins,
    SaslState,
    SaslTermination,
    TerminationSettings,
    plain_check,
    plain_parts,
)
from kproxy.identity.tokens import TokenRules, bearer_token, token_kid
from kproxy.logs import safe
from kproxy.protocol.errors import KProxyError
from kproxy.protocol.messages import decode_request, peek_request_header
from kproxy.proxy.filters import ConnectionContext
from kproxy.proxy.sasl import SaslFront, VersionRanges
from kproxy.server.kerberos import KerberosStats, KeytabAcceptor, keytab_problem
from kproxy.server.oauth import JwksCache
from kproxy.server.origination import Originator
from kproxy.userfile import load_users_file

log = logging.getLogger("kproxy.identity")

API_VERSIONS, SASL_AUTHENTICATE = 18, 36


class IdentityService:
    """Everything about SASL that lives longer than a connection."""

    def __init__(self, config: ProxyConfig) -> None:
        """Raises ConfigError when the users file cannot be loaded."""
        sasl = config.sasl
        up = config.upstream.sasl
        sides = (("initiate",) if up is not None and up.mechanism == "GSSAPI" else ()) + \
                (("accept",) if sasl is not None and sasl.gssapi is not None else ())
        self.kerberos = KerberosStats(sides) if sides else None      # Kerberos failures, for /metrics
        self.originator = Originator(up, kerberos_stats=self.kerberos) if up is not None else None
        self.jwks: JwksCache | None = None
        self.settings: TerminationSettings | None = None
        self.failed_logins: FailedLogins | None = None
        self.broker_versions: VersionRanges | None = None    # what discovery learned
        self.logins: dict[tuple[str, str], int] = {}         # (mechanism, outcome) -> count
        self._users_mtime: float | None = None
        self._discovery_tried_at = -math.inf
        self._warn_about_keytabs(config)
        if sasl is None:
            return
        rules = None
        if sasl.oauth is not None:
            o = sasl.oauth
            self.jwks = JwksCache(o.jwks_url, o.jwks_refresh_s)
            rules = TokenRules(o.issuer, o.audience, o.principal_claim, leeway_s=o.leeway_s)
        gssapi = None
        if sasl.gssapi is not None and "GSSAPI" in sasl.mechanisms:   # read only when offered
            g = sasl.gssapi
            gssapi = GssapiSettings(KeytabAcceptor(g.principal, g.keytab, self.kerberos),
                                    KerberosMapper.from_config(g.principal_to_local, realm_of(g.principal)))
        self.settings = TerminationSettings(
            sasl.mechanisms, token_rules=rules, max_session_s=sasl.max_session_s,
            failure_delay_s=sasl.failed_login_delay_s, decoy_secret=secrets.token_bytes(32), gssapi=gssapi)
        if sasl.users_file is not None:
            self._users_mtime = _mtime(sasl.users_file)
            self.settings = attrs.evolve(self.settings, users=load_users_file(sasl.users_file))
        self.failed_logins = FailedLogins(sasl.max_failed_logins_per_minute)
        self.users_file = sasl.users_file

    @staticmethod
    def _warn_about_keytabs(config: ProxyConfig) -> None:
        # `kproxy check` refuses such a keytab; a running kproxy says so at start and keeps going,
        # since the keytab may be put right (each login reads it again).
        up, sasl = config.upstream.sasl, config.sasl
        checks = []
        if up is not None and up.mechanism == "GSSAPI" and up.principal and up.keytab:
            checks.append(("upstream.sasl", up.principal, up.keytab))
        if sasl is not None and sasl.gssapi is not None and "GSSAPI" in sasl.mechanisms:
            checks.append(("sasl.gssapi", sasl.gssapi.principal, sasl.gssapi.keytab))
        for where, principal, keytab in checks:
            problem = keytab_problem(principal, keytab)
            if problem is not None:
                log.error("%s: %s; Kerberos logins will fail until it is put right", where, safe(problem, 400))

    @property
    def active(self) -> bool:
        return self.settings is not None or self.originator is not None

    def front(self, ctx: ConnectionContext) -> SaslFront | None:
        """The SASL front of a new connection; None when clients' SASL is simply relayed."""
        if not self.active:
            return None
        termination = None
        if self.settings is not None:
            jwks = self.jwks
            termination = SaslTermination(self.settings, clock=ctx.clock, wall_clock=time.time,
                                          keys=jwks.current if jwks is not None else dict)
        return SaslFront(ctx, termination, broker_versions=lambda: self.broker_versions,
                         failed_logins=self.failed_logins,
                         failure_delay_s=self.settings.failure_delay_s if self.settings else 0.5,
                         on_login=self._count)

    def _count(self, mechanism: str, outcome: str) -> None:
        key = (mechanism, outcome)
        self.logins[key] = self.logins.get(key, 0) + 1

    async def prepare(self, front: SaslFront | None, frame: memoryview, discover: Any) -> None:
        """The I/O a request needs before the session judges it: a JWKS refresh for a token's unknown
        kid, the users file again if it changed, the brokers' versions for a first ApiVersions."""
        if front is None or front.termination is None:
            return
        t = front.termination
        if front.raw_expected:
            message: bytes | None = bytes(frame) if t.mechanism in ("OAUTHBEARER", "PLAIN") else None
        else:
            if len(frame) < 8:
                return
            api_key = peek_request_header(frame)[0]
            if api_key == API_VERSIONS:
                if self.broker_versions is None and trio.current_time() - self._discovery_tried_at >= 5.0:
                    # Unauthenticated clients must not make kproxy dial the brokers at will: one try
                    # every 5 s at most; meanwhile ApiVersions offers kproxy's own version ranges.
                    self._discovery_tried_at = trio.current_time()
                    await discover()
                self._reload_users()
                return
            if api_key != SASL_AUTHENTICATE or t.mechanism not in ("OAUTHBEARER", "PLAIN"):
                return
            if t.state is not SaslState.REQUIRING_AUTHENTICATE:
                # No exchange under way (say, after a re-authentication refused as too soon): the
                # session refuses the message unread, so no PBKDF2 or JWKS fetch is spent on it.
                return
            try:
                message = bytes(decode_request(frame).body.auth_bytes)
            except KProxyError:
                return      # the session refuses it
        if message is None:
            return
        if t.mechanism == "PLAIN":
            await self._check_plain(t, message)
            return
        if self.jwks is None:
            return
        try:
            kid = token_kid(bearer_token(message)[0])
        except ValueError:
            return
        await self.jwks.ensure(kid)

    async def _check_plain(self, t: SaslTermination, message: bytes) -> None:
        # PLAIN costs a PBKDF2 (milliseconds of CPU); hashlib releases the GIL, so in a thread it
        # does not hold up every other connection on the event loop.
        parts = plain_parts(message)
        if parts is None or len(message) > t.settings.max_auth_bytes:
            return
        users = t.settings.users
        ok = await trio.to_thread.run_sync(plain_check, users, *parts)
        t.plain_checked[hashlib.sha256(message).digest()] = ok

    def _reload_users(self) -> None:
        path = self.users_file
        if path is None or self.settings is None:
            return
        mtime = _mtime(path)
        if mtime == self._users_mtime:
            return
        self._users_mtime = mtime
        try:
            users = load_users_file(path)
        except KProxyError as e:
            log.error("users file %s not reloaded (keeping %d users): %s", safe(path),
                      len(self.settings.users.users), safe(str(e)))
            return
        self.settings = attrs.evolve(self.settings, users=users)
        log.info("users file %s reloaded: %d users", safe(path), len(users.users))

    async def run(self, nursery: trio.Nursery) -> None:
        """Start what runs for the server's lifetime (the JWKS refresh)."""
        if self.jwks is not None:
            await nursery.start(self.jwks.run)


def _mtime(path: str) -> float | None:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None

"""Kerberos through the ``gssapi`` package (MIT krb5): kproxy's service keytab accepting clients'
tickets (termination), kproxy's own principal getting tickets for the brokers (origination), and
the check that a keytab holds a principal (``kproxy check``).

Accepting is CPU-only: the client's ticket is decrypted with the keytab, no KDC is asked, so it runs
on the event loop, a fraction of a millisecond per login. Getting tickets asks the KDC, so the
origination side runs in a worker thread. The keytab is always the one the configuration names,
given to the library through its credential store, never ``KRB5_KTNAME``; kproxy's own tickets live
in a private in-memory credential cache, never the process's default one. Every failure becomes a
``GssFailure`` whose reason names the principal and says what the library (or the KDC) said, and is
counted by kind for /metrics.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from typing import Any, Final

from kproxy.identity.kerberos import GssAcceptor, GssFailure, KerberosName, realm_of

log = logging.getLogger("kproxy.kerberos")

# The krb5 error table's base (krb5_err.et) and the codes that tell a person what to fix. GSS-API
# minor codes from the krb5 mechanism are these, as unsigned 32-bit numbers.
_KRB5: Final = -1765328384
_KINDS: Final = {
    _KRB5 + 6: "unknown_principal",     # KDC_ERR_C_PRINCIPAL_UNKNOWN: client not found in the database
    _KRB5 + 7: "unknown_principal",     # KDC_ERR_S_PRINCIPAL_UNKNOWN: server not found in the database
    _KRB5 + 32: "expired",              # KRB_AP_ERR_TKT_EXPIRED
    _KRB5 + 37: "clock_skew",           # KRB_AP_ERR_SKEW: clock skew too great
    _KRB5 + 41: "keytab",               # KRB_AP_ERR_MODIFIED: the ticket is not for the key we hold
    _KRB5 + 44: "keytab",               # KRB_AP_ERR_BADKEYVER: a key version the keytab lacks
    _KRB5 + 45: "keytab",               # KRB_AP_ERR_NOKEY: no key of the ticket's type
    _KRB5 + 24: "keytab",               # KDC_ERR_PREAUTH_FAILED: kproxy's keytab holds an old key
    _KRB5 + 179: "keytab",              # KRB5_KT_NOTFOUND: no such entry in the keytab
    _KRB5 + 180: "keytab",              # KRB5_KT_KVNONOTFOUND: key version not in the keytab
    _KRB5 + 181: "keytab",              # KRB5_KT_END / keytab nonexistent or empty
    _KRB5 + 183: "keytab",              # KRB5_KT_NAME_TOOLONG etc.: a keytab that cannot be used
    39756033: "keytab",                 # KG_KEYTAB_NOMATCH: no keytab entry matches the principal
    2: "keytab",                        # ENOENT
    13: "keytab",                       # EACCES: the keytab cannot be read
}
KINDS: Final = ("keytab", "clock_skew", "unknown_principal", "expired", "other")
# Kafka's client renews its ticket once 80% of its lifetime has passed (sasl.kerberos.ticket.renew.
# window.factor), with up to 5% of jitter, so that many processes do not all ask the KDC at once.
RENEW_AT, RENEW_JITTER = 0.80, 0.05


def _gssapi() -> Any:
    try:
        import gssapi
    except ImportError as e:
        raise GssFailure("Kerberos needs the gssapi package: pip install 'kproxy-kafka[kerberos]' "
                         f"(with MIT krb5's libraries; {e})", "other") from None
    return gssapi


def _signed(code: int) -> int:
    return code - (1 << 32) if code >= 1 << 31 else code


def failure(e: Exception, what: str) -> GssFailure:
    """A GSSError as a GssFailure: ``what`` (naming the principal) and the library's own words."""
    minor = getattr(e, "min_code", 0) or 0
    kind = _KINDS.get(_signed(minor), "other")
    text = ""
    try:
        if minor:
            text = "; ".join(s for s in e.get_all_statuses(minor, False) if s)   # type: ignore[attr-defined]
        if not text:
            text = "; ".join(s for s in e.get_all_statuses(e.maj_code, True) if s)  # type: ignore[attr-defined]
    except Exception:
        text = ""
    text = " ".join((text or str(e)).split())
    if kind == "other":
        lower = text.lower()
        kind = next((k for words, k in _KIND_WORDS if any(w in lower for w in words)), "other")
    return GssFailure(f"{what}: {text}", kind)


# When a code is not in the table above, the library's words sort it.
_KIND_WORDS: Final = (
    (("key table", "keytab", "key version"), "keytab"),
    (("clock skew",), "clock_skew"),
    (("not found in kerberos database",), "unknown_principal"),
    (("expired",), "expired"),
)


class KerberosStats:
    """Kerberos failures by side (accept: clients' logins; initiate: kproxy's own) and kind."""

    def __init__(self, sides: tuple[str, ...] = ()) -> None:
        # Every kind of the sides in use starts at 0, so a rate over it exists before the first failure.
        self.failures: dict[tuple[str, str], int] = {(side, kind): 0 for side in sides for kind in KINDS}
        self._lock = threading.Lock()     # the initiating side counts from worker threads

    def failed(self, side: str, kind: str) -> None:
        with self._lock:
            key = (side, kind)
            self.failures[key] = self.failures.get(key, 0) + 1


def keytab_problem(principal: str, keytab: str) -> str | None:
    """Why ``keytab`` cannot serve ``principal`` (missing, unreadable, or without its key), or None.
    Reads the keytab only; no KDC is asked."""
    try:
        gssapi = _gssapi()
        name = gssapi.Name(principal, gssapi.NameType.kerberos_principal)
        gssapi.Credentials(name=name, usage="accept", store={b"keytab": keytab.encode()})
    except GssFailure as e:
        return e.reason
    except Exception as e:      # GSSError
        return failure(e, f"the keytab {keytab} has no usable key for {principal}").reason
    return None


# -- termination: kproxy's service keytab accepts clients' tickets


class KeytabAcceptor:
    """Makes one acceptor per client login, with the keytab of ``sasl.gssapi``. A client may ask for
    any principal of the configured service and realm that the keytab holds (one per host name
    clients reach kproxy by); a ticket for anything else in the keytab is refused."""

    def __init__(self, principal: str, keytab: str, stats: KerberosStats | None = None) -> None:
        self.principal = principal
        self.keytab = keytab
        self.stats = stats or KerberosStats()
        own = KerberosName.parse(principal)
        self.service, self.realm = own.primary, own.realm

    def __call__(self) -> GssAcceptor:
        gssapi = _gssapi()
        try:
            # No name: any key of the keytab may decrypt a ticket; initiator() checks whose it was.
            creds = gssapi.raw.acquire_cred_from({b"keytab": self.keytab.encode()}, usage="accept").creds
        except Exception as e:
            raise self._failed(failure(e, f"cannot accept as {self.principal}: keytab {self.keytab}")) from None
        return _Acceptor(self, gssapi.raw, creds)

    def _failed(self, f: GssFailure) -> GssFailure:
        self.stats.failed("accept", f.kind)
        return f


class _Acceptor:
    """One client's context on the raw GSS-API calls, which raise at once (the object layer of
    ``gssapi`` hands back an error token and raises only at the next call)."""

    def __init__(self, owner: KeytabAcceptor, raw: Any, creds: Any) -> None:
        self.owner = owner
        self.raw = raw
        self.creds = creds
        self.context: Any = None
        self.initiator_name: Any = None
        self._complete = False

    @property
    def complete(self) -> bool:
        return self._complete

    def _failed(self, e: Exception, what: str) -> GssFailure:
        return self.owner._failed(failure(e, what))

    def _name(self, name: Any) -> str:
        return bytes(self.raw.display_name(name, name_type=False).name).decode("utf-8", "replace")

    def step(self, token: bytes) -> bytes:
        o = self.owner
        try:
            result = self.raw.accept_sec_context(token, acceptor_creds=self.creds, context=self.context)
        except Exception as e:
            raise self._failed(e, f"a client's ticket for {o.service}/*@{o.realm} refused (keytab {o.keytab})") from None
        self.context = result.context
        self.initiator_name = result.initiator_name
        self._complete = not result.more_steps
        return bytes(result.token or b"")

    def initiator(self) -> str:
        try:
            return self._initiator()
        except GssFailure:
            raise
        except Exception as e:
            raise self._failed(e, "reading the established context") from None

    def _initiator(self) -> str:
        o = self.owner
        principal = self._name(self.initiator_name)
        # MIT refuses a ticket past its end plus the clock skew allowed (krb5.conf's clockskew); a
        # context established with no time left (its end within the skew, or a mechanism that only
        # marks it expired) is refused here too, so an old ticket never starts a session.
        try:
            remaining = self.raw.context_time(self.context)
        except Exception:
            remaining = 0
        if remaining <= 0:
            raise o._failed(GssFailure(f"the ticket of {principal} for {o.service}/*@{o.realm} has expired",
                                       "expired"))
        target = self._name(self.raw.inquire_context(self.context, initiator_name=False, lifetime=False,
                                                     mech=False, flags=False, locally_init=False,
                                                     complete=False).target_name)
        try:
            service = KerberosName.parse(target)
        except ValueError:
            service = None
        if service is None or service.primary != o.service or service.realm != o.realm:
            raise o._failed(GssFailure(f"{principal} brought a ticket for {target}, which is not one of kproxy's "
                                       f"principals ({o.service}/<host>@{o.realm})", "keytab"))
        return principal

    def wrap(self, message: bytes) -> bytes:
        try:
            return bytes(self.raw.wrap(self.context, message, confidential=False).message)
        except Exception as e:
            raise self._failed(e, "wrapping the security layer offer") from None

    def unwrap(self, token: bytes) -> bytes:
        try:
            return bytes(self.raw.unwrap(self.context, token).message)
        except Exception as e:
            raise self._failed(e, f"the security layer choice of {self._name(self.initiator_name)}") from None


# -- origination: kproxy's own principal logs in to the brokers


class KerberosLogin:
    """kproxy's Kerberos identity for the brokers: a ticket-granting ticket got from ``keytab`` into a
    private in-memory cache, renewed once 80-85% of its lifetime has passed, and a service ticket for
    ``<service_name>/<broker host>@<realm>`` per broker. Blocking (the KDC is asked): call from a
    worker thread."""

    _names = itertools.count(1)

    def __init__(self, principal: str, keytab: str, service_name: str = "kafka",
                 stats: KerberosStats | None = None, clock: Any = time.monotonic) -> None:
        self.principal = principal
        self.keytab = keytab
        self.service_name = service_name
        self.realm = realm_of(principal)
        self.stats = stats or KerberosStats()
        self.clock = clock
        self.tickets = 0                    # ticket-granting tickets got from the keytab
        self._creds: Any = None
        self._renew_at = 0.0
        self._expires_at = 0.0
        self._cache = 0
        self._lock = threading.Lock()

    def service_principal(self, host: str) -> str:
        """The broker's principal, as Kafka's clients build it: service name, the host connected to."""
        return f"{self.service_name}/{host}@{self.realm}"

    def credentials(self) -> Any:
        """kproxy's credentials, renewed first when due. GssFailure when none can be had."""
        with self._lock:
            now = self.clock()
            if self._creds is not None and now < self._renew_at:
                return self._creds
            try:
                self._creds, lifetime = self._acquire()
            except GssFailure as e:
                self.stats.failed("initiate", e.kind)
                if self._creds is not None and now < self._expires_at:
                    # The ticket held is still good: use it, and try again at the next login.
                    log.warning("could not renew kproxy's Kerberos ticket (%s); the current one is valid "
                                "for %.0fs more", e.reason, self._expires_at - now)
                    return self._creds
                raise
            self.tickets += 1
            share = RENEW_AT + random.random() * RENEW_JITTER
            self._renew_at = now + share * lifetime
            self._expires_at = now + lifetime
            log.info("kproxy got a Kerberos ticket for %s from keytab %s, valid for %ds; renewed after %ds",
                     self.principal, self.keytab, lifetime, int(share * lifetime))
            return self._creds

    def _acquire(self) -> tuple[Any, int]:
        gssapi = _gssapi()
        # Two caches taken in turn: a renewal fills the one not in use, and memory stays bounded.
        self._cache += 1
        cache = f"MEMORY:kproxy-{id(self)}-{self._cache % 2}"
        try:
            name = gssapi.Name(self.principal, gssapi.NameType.kerberos_principal)
            creds = gssapi.Credentials(name=name, usage="initiate",
                                       store={b"client_keytab": self.keytab.encode(), b"ccache": cache.encode()})
            lifetime = int(creds.lifetime or 0)
        except Exception as e:
            problem = keytab_problem(self.principal, self.keytab)
            if problem is not None:
                # MIT says "No credentials cache found" when the keytab lacks the key: say what is wrong.
                raise GssFailure(f"{self.principal} cannot log in: {problem}", "keytab") from None
            raise failure(e, f"{self.principal} could not get a ticket from the KDC (keytab {self.keytab})") from None
        if lifetime <= 0:
            raise GssFailure(f"the ticket the KDC gave {self.principal} has no lifetime left", "expired")
        return creds, lifetime

    def start(self, host: str) -> tuple[Initiator, bytes]:
        """A new context for the broker at ``host``, and its first token (asks the KDC for a service
        ticket when none is cached)."""
        gssapi = _gssapi()
        creds = self.credentials()
        target = self.service_principal(host)
        initiator = Initiator(self, gssapi.raw, target)
        try:
            name = gssapi.raw.import_name(target.encode(), gssapi.NameType.kerberos_principal)
            token = initiator.first(name, creds)
        except Exception as e:
            f = failure(e, f"{self.principal} could not get a ticket for {target}")
            self.stats.failed("initiate", f.kind)
            raise f from None
        return initiator, token


class Initiator:
    """kproxy's side of one GSSAPI login (RFC 4752), on the raw GSS-API calls (they raise at once):
    after the first token, CPU-only."""

    def __init__(self, login: KerberosLogin, raw: Any, target: str) -> None:
        self.login = login
        self.raw = raw
        self.target = target
        self.context: Any = None
        self._name: Any = None
        self._creds: Any = None
        self._complete = False

    @property
    def complete(self) -> bool:
        return self._complete

    def _init(self, token: bytes | None) -> bytes:
        flags = self.raw.RequirementFlag
        result = self.raw.init_sec_context(self._name, creds=self._creds, context=self.context,
                                           mech=self.raw.OID.from_int_seq("1.2.840.113554.1.2.2"),
                                           flags=[flags.mutual_authentication, flags.out_of_sequence_detection],
                                           input_token=token)
        self.context = result.context
        self._complete = not result.more_steps
        return bytes(result.token or b"")

    def first(self, name: Any, creds: Any) -> bytes:
        self._name, self._creds = name, creds
        return self._init(None)

    def _failed(self, e: Exception, what: str) -> GssFailure:
        f = failure(e, what)
        self.login.stats.failed("initiate", f.kind)
        return f

    def step(self, token: bytes) -> bytes:
        try:
            return self._init(token)
        except Exception as e:
            raise self._failed(e, f"{self.target} did not prove itself to {self.login.principal}") from None

    def unwrap(self, token: bytes) -> bytes:
        try:
            return bytes(self.raw.unwrap(self.context, token).message)
        except Exception as e:
            raise self._failed(e, f"the security layer offer of {self.target}") from None

    def wrap(self, message: bytes) -> bytes:
        try:
            return bytes(self.raw.wrap(self.context, message, confidential=False).message)
        except Exception as e:
            raise self._failed(e, "wrapping the security layer choice") from None

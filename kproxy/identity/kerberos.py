"""Kerberos names and Kafka's ``sasl.kerberos.principal.to.local.rules``: how the principal a client
proved (``alice@EXAMPLE.COM``, ``app/host.example.com@EXAMPLE.COM``) becomes the short name that rules
see as ``User:<name>``; and the interface of the GSS-API acceptor the SASL GSSAPI exchange drives.

Pure: no Kerberos library is imported here. The acceptor (``GssAcceptor``) is handed in by the I/O
layer (``kproxy.server.kerberos``, over the ``gssapi`` package and a keytab), as the JWKS keys are for
OAUTHBEARER. The rule language is Kafka's (``KerberosShortNamer``): ``DEFAULT`` gives the first
component of a principal of the default realm, and ``RULE:[n:format](filter)s/pattern/replacement/[g]``
with an optional ``/L`` or ``/U`` rewrites principals of ``n`` components; the first rule that gives
a name wins, and no rule at all means no principal (the login fails). Patterns and replacements are
Java's, read with the same helpers as the mTLS mapping rules (``kproxy.identity.principal``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import Final, Protocol

import attrs

from kproxy.identity.principal import MappingRuleError, expand_replacement, java_pattern

# Kafka's KerberosName: up to two components and a realm, "primary[/instance]@REALM".
_NAME: Final = re.compile(r"([^/@]*)(?:/([^/@]*))?@([^/@]*)")
# One rule, as Kafka's KerberosShortNamer reads it (a filter cannot hold ')', a pattern no '/'), then
# a comma or the end: Kafka's property is a comma-separated list, so one entry may hold several.
_RULE: Final = re.compile(
    r"\s*(?:(DEFAULT)|RULE:\[(\d+):([^\]]*)\](?:\(([^)]*)\))?(?:s/([^/]*)/([^/]*)/(g)?)?/?([LU])?)\s*(?:,|$)")
_PARAMETER: Final = re.compile(r"\$(\d*)")
_NOT_SIMPLE: Final = re.compile(r"[/@]")


@attrs.frozen
class KerberosName:
    """``primary[/instance]@realm``; ``instance`` is None for a one-component name."""

    primary: str
    instance: str | None
    realm: str

    @classmethod
    def parse(cls, text: str) -> KerberosName:
        """A ValueError when ``text`` is not a principal with a realm and at most two components."""
        m = _NAME.fullmatch(text)
        if m is None:
            raise ValueError(f"{text!r} is not a Kerberos principal of the form primary[/instance]@REALM")
        return cls(m.group(1), m.group(2), m.group(3))

    def __str__(self) -> str:
        middle = f"/{self.instance}" if self.instance is not None else ""
        return f"{self.primary}{middle}@{self.realm}"


@attrs.frozen
class KerberosRule:
    """``DEFAULT`` (``components`` 0), or one ``RULE:[n:format](filter)s/pattern/replacement/[g][/L|/U]``."""

    components: int = 0
    format: str = ""
    filter: re.Pattern[str] | None = None
    pattern: re.Pattern[str] | None = None
    replacement: str = ""
    every: bool = False             # "g": replace every match, not the first
    case: str = ""                  # "L", "U" or ""
    text: str = "DEFAULT"

    @property
    def default(self) -> bool:
        return self.components == 0

    def apply(self, name: KerberosName, default_realm: str) -> str | None:
        """The short name this rule gives ``name``, or None when it does not apply. A ValueError when
        it gives a name with '/' or '@' in it (Kafka refuses such a login)."""
        if self.default:
            result = name.primary if name.realm == default_realm else None
        else:
            params = [name.realm, name.primary] + ([name.instance] if name.instance is not None else [])
            if len(params) - 1 != self.components:
                return None
            base = _PARAMETER.sub(lambda m: params[int(m.group(1))], self.format)
            if self.filter is not None and self.filter.fullmatch(base) is None:
                return None
            result = base
            if self.pattern is not None:
                result = self.pattern.sub(lambda m: expand_replacement(self.replacement, m), base,
                                          count=0 if self.every else 1)
        if result is None:
            return None
        if _NOT_SIMPLE.search(result):
            raise ValueError(f"rule {self.text!r} maps {str(name)!r} to {result!r}, which is not a simple name")
        if self.case == "L":
            return result.lower()
        if self.case == "U":
            return result.upper()
        return result


def parse_kerberos_rules(entries: Sequence[str]) -> tuple[KerberosRule, ...]:
    """The rules in ``entries`` (an entry may hold several, comma-separated, as Kafka's property does).
    A MappingRuleError names the entry that is wrong and why."""
    rules: list[KerberosRule] = []
    for index, entry in enumerate(entries):
        text = entry.strip()
        if not text:
            raise MappingRuleError(index, entry, "an empty rule; write DEFAULT or RULE:[n:format](filter)s/a/b/")
        pos = 0
        while pos < len(text):
            m = _RULE.match(text, pos)
            if m is None or m.end() == pos:
                rest = text[pos:]
                raise MappingRuleError(index, entry, f"cannot read {rest!r}; expected DEFAULT or "
                                                     "RULE:[n:format](filter)s/pattern/replacement/ with an "
                                                     "optional g, then /L or /U or nothing")
            pos = m.end()
            if m.group(1):
                rules.append(KerberosRule())
                continue
            components = int(m.group(2))
            form = m.group(3)
            if components < 1:
                raise MappingRuleError(index, entry, "[n:...] counts the principal's components: 1 or more")
            for ref in _PARAMETER.finditer(form):
                if not ref.group(1) or int(ref.group(1)) > components:
                    raise MappingRuleError(index, entry, f"{form!r} refers to {ref.group(0)!r}; $0 is the realm and "
                                                         f"$1..${components} the components")
            filter_ = java_pattern(m.group(4), index, entry) if m.group(4) is not None else None
            pattern = java_pattern(m.group(5), index, entry) if m.group(5) is not None else None
            rules.append(KerberosRule(components, form, filter_, pattern, m.group(6) or "", m.group(7) == "g",
                                      m.group(8) or "", m.group(0).strip().rstrip(",").strip()))
    return tuple(rules)


@attrs.frozen
class KerberosMapper:
    """How a verified principal becomes a short name: ``rules`` in order, ``DEFAULT`` against
    ``default_realm`` (kproxy's own realm)."""

    default_realm: str
    rules: tuple[KerberosRule, ...] = (KerberosRule(),)

    @classmethod
    def from_config(cls, rules: Iterable[str], default_realm: str) -> KerberosMapper:
        return cls(default_realm, parse_kerberos_rules(tuple(rules)))

    def map(self, principal: str) -> tuple[str | None, str]:
        """(name, why): the short name for ``principal``, or None and the reason there is none."""
        try:
            name = KerberosName.parse(principal)
            for rule in self.rules:
                short = rule.apply(name, self.default_realm)
                if short is not None:
                    if not short:
                        return None, f"rule {rule.text!r} maps {principal!r} to an empty name"
                    return short, rule.text
        except ValueError as e:
            return None, str(e)
        return None, (f"no sasl.gssapi.principal_to_local rule applies to {principal!r} (DEFAULT takes only "
                      f"principals of {self.default_realm})")


def realm_of(principal: str) -> str:
    """The realm of ``primary[/instance]@REALM`` (a ValueError when there is none)."""
    return KerberosName.parse(principal).realm


# -- the acceptor the SASL GSSAPI exchange drives (RFC 4752)


class GssFailure(Exception):
    """A GSS-API call failed. ``reason`` says what the Kerberos library said, with the principal it was
    about (never a key); ``kind`` sorts it for the metric: keytab, clock_skew, unknown_principal,
    expired or other."""

    def __init__(self, reason: str, kind: str = "other") -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind = kind


class GssAcceptor(Protocol):
    """One login's GSS-API security context, on the accepting side (no KDC is contacted: the client's
    ticket is checked with kproxy's keytab). Every method raises GssFailure when the library refuses."""

    @property
    def complete(self) -> bool: ...

    def step(self, token: bytes) -> bytes:
        """Take a context token from the client; the token to answer with (may be empty)."""
        ...

    def initiator(self) -> str:
        """The client's principal, once complete; a GssFailure when its ticket has expired."""
        ...

    def wrap(self, message: bytes) -> bytes:
        """``message`` with an integrity check, not encrypted (RFC 4752's negotiation messages)."""
        ...

    def unwrap(self, token: bytes) -> bytes:
        """The message in a wrapped ``token``, its integrity checked."""
        ...


@attrs.frozen
class GssapiSettings:
    """What the GSSAPI exchange needs: a new acceptor per login (``acceptor``, from kproxy's keytab)
    and how the client's principal becomes its name (``mapper``)."""

    acceptor: Callable[[], GssAcceptor] = attrs.field(eq=False)
    mapper: KerberosMapper

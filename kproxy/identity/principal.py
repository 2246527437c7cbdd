"""The principal of a verified client certificate: Kafka's ``ssl.principal.mapping.rules``, or a
SPIFFE ID from the URI SAN.

Pure: it takes the certificate as the dict ``ssl.SSLObject.getpeercert()`` returns and gives back a
name; loading, verifying and the handshake stay in ``kproxy.server``. The rule language follows
Kafka's ``SslPrincipalMapper``: the first rule whose pattern matches the whole RFC 2253 subject wins,
and no match at all means no principal (Kafka fails the authentication).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any, Final

import attrs

# RFC 2253 section 2.3 keywords, as Java's X500Principal.getName() writes them (Kafka maps that
# string); OpenSSL's long names are what getpeercert() gives.
_KEYWORDS: Final = {
    "commonName": "CN", "countryName": "C", "localityName": "L", "stateOrProvinceName": "ST",
    "organizationName": "O", "organizationalUnitName": "OU", "streetAddress": "STREET",
    "domainComponent": "DC", "userId": "UID",
}
_SPECIAL: Final = frozenset(',+"\\<>;')

# One rule: DEFAULT, or RULE:pattern/replacement/ with an optional L or U. A backslash escapes any
# character (so "\/" is a slash inside the pattern), as in Kafka's grammar.
_RULE: Final = re.compile(r"\s*(?:(DEFAULT)|RULE:((?:\\.|[^\\/])*)/((?:\\.|[^\\/])*)/([LU]?))\s*(?:,|$)",
                          re.DOTALL)
_JAVA_NAMED_GROUP: Final = re.compile(r"\(\?<(?![=!])")


class MappingRuleError(ValueError):
    """A mapping rule that cannot be used; ``index`` is its place in the list (0-based)."""

    def __init__(self, index: int, rule: str, problem: str) -> None:
        self.index = index
        self.rule = rule
        self.problem = problem
        super().__init__(f"rule {rule!r}: {problem}")


@attrs.frozen
class MappingRule:
    """``RULE:pattern/replacement/[LU]``; a ``pattern`` of None is ``DEFAULT`` (the subject as is)."""

    pattern: re.Pattern[str] | None
    replacement: str = ""
    case: str = ""      # "L", "U" or ""
    text: str = "DEFAULT"

    def apply(self, subject: str) -> str | None:
        """The name this rule gives ``subject``, or None when its pattern does not match all of it."""
        if self.pattern is None:
            return subject
        if self.pattern.fullmatch(subject) is None:
            return None
        # Kafka then runs replaceAll over the subject, so a pattern that can also match the empty
        # string at the end (".*") substitutes twice, as Java does; Python's sub behaves the same.
        result = self.pattern.sub(lambda m: expand_replacement(self.replacement, m), subject)
        if self.case == "L":
            return result.lower()
        if self.case == "U":
            return result.upper()
        return result


def parse_rules(entries: Sequence[str]) -> tuple[MappingRule, ...]:
    """The rules in ``entries``; an entry may hold several comma-separated rules, as Kafka's single
    property does. Raises MappingRuleError naming the entry that is wrong and why."""
    rules: list[MappingRule] = []
    for index, entry in enumerate(entries):
        pos = 0
        text = entry.strip()
        if not text:
            raise MappingRuleError(index, entry, "an empty rule; write DEFAULT or RULE:pattern/replacement/")
        while pos < len(text):
            m = _RULE.match(text, pos)
            if m is None or m.end() == pos:
                rest = text[pos:]
                hint = ("; a rule ends with '/', then L or U or nothing"
                        if rest.lstrip().startswith("RULE:") else "; expected DEFAULT or RULE:pattern/replacement/")
                raise MappingRuleError(index, entry, f"cannot read {rest!r}{hint}")
            if m.group(1):
                rules.append(MappingRule(None))
            else:
                pattern = java_pattern(m.group(2), index, entry)
                rule_text = m.group(0).strip().rstrip(",").strip()
                rules.append(MappingRule(pattern, m.group(3), m.group(4), rule_text))
            pos = m.end()
    return tuple(rules)


def java_pattern(text: str, index: int, entry: str) -> re.Pattern[str]:
    """``text``, a Java regular expression from a rule, compiled for Python (named groups
    ``(?<name>...)`` become ``(?P<name>...)``); a MappingRuleError for rule ``index`` when it cannot be."""
    try:
        return re.compile(_JAVA_NAMED_GROUP.sub("(?P<", text))
    except re.error as e:
        raise MappingRuleError(index, entry, f"bad regular expression {text!r}: {e}") from None


def expand_replacement(replacement: str, m: re.Match[str]) -> str:
    """Java's Matcher replacement syntax: ``$n`` and ``${name}`` are groups, a backslash quotes the
    next character. As Kafka does, a ``$n`` past the pattern's groups is kept as literal text."""
    groups = m.re.groups
    out: list[str] = []
    i, n = 0, len(replacement)
    while i < n:
        c = replacement[i]
        if c == "\\" and i + 1 < n:
            out.append(replacement[i + 1])
            i += 2
            continue
        if c == "$" and i + 1 < n and replacement[i + 1] == "{":
            end = replacement.find("}", i + 2)
            name = replacement[i + 2:end] if end > 0 else ""
            if name in m.re.groupindex:
                out.append(m.group(name) or "")
                i = end + 1
                continue
        if c == "$" and i + 1 < n and replacement[i + 1].isdigit():
            # The first digit always belongs to the reference; later ones while the group exists.
            ref = int(replacement[i + 1])
            j = i + 2
            while j < n and replacement[j].isdigit() and ref * 10 + int(replacement[j]) <= groups:
                ref = ref * 10 + int(replacement[j])
                j += 1
            if ref <= groups:
                out.append(m.group(ref) or "")
                i = j
                continue
        out.append(c)
        i += 1
    return "".join(out)


def distinguished_name(cert: dict[str, Any]) -> str | None:
    """The certificate's subject as an RFC 2253 string (``CN=alice,OU=Payments,O=Acme``), the form
    Kafka's rules match: most specific RDN first, multi-valued RDNs joined by ``+``, special
    characters escaped. Attributes without an RFC 2253 keyword keep OpenSSL's name
    (``emailAddress=...``) where Java would write the OID and a hex value."""
    rdns = []
    for rdn in reversed(cert.get("subject", ())):
        rdns.append("+".join(f"{_KEYWORDS.get(key, key)}={_escape(value)}" for key, value in rdn))
    return ",".join(rdns) or None


def _escape(value: str) -> str:
    out = "".join(f"\\{c}" if c in _SPECIAL else c for c in value)
    if out.startswith(("#", " ")):
        out = "\\" + out
    if out.endswith(" ") and not out.endswith("\\ "):
        out = out[:-1] + "\\ "
    return out


def uri_sans(cert: dict[str, Any]) -> list[str]:
    """The certificate's URI subject alternative names, in order."""
    return [value for kind, value in cert.get("subjectAltName", ()) if kind == "URI"]


@attrs.frozen
class PrincipalMapper:
    """How a verified certificate becomes a principal name: ``rules`` over its subject, or (with
    ``san_uri``) its one URI SAN, the SPIFFE ID of an X.509-SVID."""

    rules: tuple[MappingRule, ...] = (MappingRule(None),)
    san_uri: bool = False

    @classmethod
    def from_config(cls, mapping_rules: Iterable[str], san_uri: bool) -> PrincipalMapper:
        return cls(parse_rules(tuple(mapping_rules)), san_uri)

    def map(self, cert: dict[str, Any]) -> tuple[str | None, str]:
        """(name, why): the principal name for ``cert``, or None and the reason there is none."""
        if self.san_uri:
            uris = uri_sans(cert)
            if len(uris) != 1:
                # An X.509-SVID carries exactly one URI SAN; with several, none can be chosen safely.
                return None, (f"the certificate has {len(uris)} URI SANs, and tls.principal.san_uri "
                              f"needs exactly one (its SPIFFE ID)")
            return uris[0], "URI SAN"
        subject = distinguished_name(cert)
        if subject is None:
            return None, "the certificate has an empty subject"
        for rule in self.rules:
            name = rule.apply(subject)
            if name is not None:
                if not name:
                    return None, f"rule {rule.text!r} maps {subject!r} to an empty name"
                return name, rule.text
        return None, f"no tls.principal.mapping_rules rule matches {subject!r}"

"""What a setting is and the rules every one is held to; the errors configuration raises.

A section is an attrs frozen class built with ``with_checks``; each field declared with ``setting``
carries its rules (bounds, choices, case, name kind, file), which are checked whenever the class is
built, by the YAML loader, in code or by ``attrs.evolve``. A broken value is a ``SettingError``
naming the full setting (each section's place in the tree is registered by ``name_sections``).
Besides the checks of single values, this module holds the values both sides share (``HostPort``,
the SASL mechanisms, identity provider URLs); it reads only file metadata (``check_files``).
"""

import difflib
import math
import os
import re
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any, Final, Self

import attrs

from kproxy.protocol.errors import LocatedError


class ConfigError(LocatedError):
    """Invalid configuration or rules; ``file`` and ``line`` point at the offending text when known.
    It lives here, above kproxy.protocol, because only configuration (this package, the rule loader,
    the command line) raises it."""


MAX_PORT: Final = 65535

# Field metadata keys. RULES holds the per-value rules every config class checks on construction;
# INTERNAL marks a field that is not a setting (it cannot be written in YAML).
RULES: Final = "kproxy.rules"
INTERNAL: Final = "kproxy.internal"

SettingPath = tuple[str | int, ...]


class _NotGiven(tuple):
    """An empty tuple that stands for "not written" (a list that is required unless another setting
    stands in for it), told apart from a written empty list by identity."""

    __slots__ = ()


NOT_GIVEN: Final = _NotGiven()

# Where each section class sits in the settings tree (LimitsConfig -> ("limits",)), so an error
# raised inside a section names the full setting. Filled by name_sections once the classes exist.
_SECTION_PATHS: dict[type, SettingPath] = {}


class SettingError(ConfigError):
    """One setting breaks a rule: ``path`` is where it sits (``("limits", "max_frame_size")``).

    The config classes raise it themselves; the YAML loader catches it and adds file and line.
    """

    def __init__(self, path: SettingPath, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(f"{dotted(path)}: {problem}" if path else problem)


def setting(default: Any = attrs.NOTHING, **rules: Any) -> Any:
    """A field with ``rules``: min, above, max, choices, case (upper/lower), name (a kind), file,
    sections (a list of config objects)."""
    return attrs.field(default=default, metadata={RULES: rules})


def with_checks(cls: type, fields: "list[attrs.Attribute[Any]]") -> "list[attrs.Attribute[Any]]":
    """attrs field transformer: every field of a config class gets its converter and its checks."""
    out = []
    for field in fields:
        rules = field.metadata.get(RULES, {})
        case = rules.get("case")
        converter: Any = None
        if case is not None:
            converter = _upper if case == "upper" else _lower
        elif float in _scalar_types(field.type):
            converter = _to_float
        elif typing.get_origin(field.type) is tuple:
            converter = _to_tuple
        out.append(field.evolve(validator=_check_setting, converter=converter))
    return out


def _scalar_types(tp: Any) -> tuple[Any, ...]:
    return typing.get_args(tp) if typing.get_origin(tp) is types.UnionType else (tp,)


# Converters run again on every attrs.evolve, so each must leave its own output unchanged.
def _upper(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_upper(v) for v in value)
    return value.upper() if isinstance(value, str) else value


def _lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


def _to_float(value: Any) -> Any:
    # bool is an int in Python; true is not a number of seconds.
    return float(value) if type(value) is int else value


def _to_tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _check_setting(instance: Any, attribute: "attrs.Attribute[Any]", value: Any) -> None:
    problem = _value_problem(attribute.type, attribute.metadata.get(RULES, {}), value)
    if problem is not None:
        raise SettingError(path_of(instance, attribute.name), problem)


def path_of(section: Any, name: str) -> SettingPath:
    return (*_SECTION_PATHS.get(type(section), ()), name)


EXPECTED: Final[Mapping[type, str]] = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
}


def _value_problem(tp: Any, rules: Mapping[str, Any], value: Any) -> str | None:
    """Why ``value`` cannot be a setting of type ``tp`` with ``rules``, or None if it can."""
    if typing.get_origin(tp) is types.UnionType:
        # Every union in the config classes is "X | None".
        if value is None:
            return None
        (tp,) = (a for a in typing.get_args(tp) if a is not type(None))
    if typing.get_origin(tp) is tuple:
        if rules.get("sections"):
            ok = isinstance(value, tuple) and all(attrs.has(type(v)) for v in value)
            return None if ok else f"expected a list of sections, got {value!r}"
        if rules.get("words"):
            ok = isinstance(value, tuple) and all(isinstance(w, str) and w.strip() for w in value)
            return None if ok else f"expected a list of names, got {value!r}"
        item = typing.get_args(tp)[0]
        if item is str:
            return _strings_problem(value) if rules.get("text") else _paths_problem(value)
        if attrs.has(item) and item is not HostPort:
            ok = isinstance(value, tuple) and all(isinstance(v, item) for v in value)
            return None if ok else f"expected a list of {item.__name__}, got {value!r}"
        return None if value is NOT_GIVEN else _host_ports_problem(value)
    if typing.get_origin(tp) is dict:
        # dict[str, float] is the only mapping setting; its section checks the keys and values.
        return None if isinstance(value, dict) else f"expected a mapping, got {value!r}"
    if attrs.has(tp):
        return None if isinstance(value, tp) else f"expected a {tp.__name__}, got {value!r}"
    if type(value) is not tp:
        return f"expected {EXPECTED[tp]}, got {value!r}"
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number, got {value}"
    choices = rules.get("choices")
    if choices is not None and value not in choices:
        return f"must be one of {', '.join(choices)}; got {value!r}{did_you_mean(str(value), choices)}"
    if "min" in rules and value < rules["min"]:
        return f"must be at least {rules['min']}, got {value}"
    if "above" in rules and value <= rules["above"]:
        return f"must be greater than {rules['above']}, got {value}"
    if "max" in rules and value > rules["max"]:
        return f"must be at most {rules['max']}, got {value}"
    if "name" in rules:
        return _name_problem(rules["name"], value)
    if rules.get("file") and not value.strip():
        return "an empty file name; leave the key out or write null"
    return None


def _paths_problem(value: Any) -> str | None:
    if not (isinstance(value, tuple) and all(isinstance(p, str) for p in value)):
        return f"expected a list of file or directory names, got {value!r}"
    if any(not p.strip() for p in value):
        return "an empty file name"
    return None


def _strings_problem(value: Any) -> str | None:
    if not (isinstance(value, tuple) and all(isinstance(p, str) for p in value)):
        return f"expected a list of strings, got {value!r}"
    return None


def _host_ports_problem(value: Any) -> str | None:
    if not (isinstance(value, tuple) and all(isinstance(hp, HostPort) for hp in value)):
        return f"expected \"HOST:PORT\" addresses, got {value!r}"
    if not value:
        return "needs at least one \"HOST:PORT\""
    seen: set[HostPort] = set()
    for hp in value:
        if hp in seen:
            return f"lists {hp} twice"
        seen.add(hp)
    return None


_LABEL: Final = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def _name_problem(kind: str, value: str) -> str | None:
    """Why ``value`` is not a usable host (``host``), DNS name (``domain``) or DNS label, or None."""
    if not value:
        return "must not be empty"
    if kind == "label":
        return None if _LABEL.fullmatch(value) else f"{value!r} is not a DNS label (letters, digits, '-')"
    if kind == "domain":
        labels = value.rstrip(".").split(".")
        if len(value) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
            return f"{value!r} is not a DNS domain name"
        return None
    if any(c.isspace() for c in value) or "/" in value:
        return f"{value!r} is not a host name or address"
    if value.count(":") == 1:
        return f"give the host only, without a port: {value.partition(':')[0]!r}"
    return None


def dotted(path: SettingPath) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def did_you_mean(word: str, choices: typing.Iterable[str]) -> str:
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


@attrs.frozen
class HostPort:
    """A host and a TCP port. IPv6 hosts are held without brackets and printed with them.

    A value, not a section: a bad one is a ValueError, which the loader turns into a ConfigError
    naming the setting that holds it.
    """

    host: str
    port: int

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.host, str) or _name_problem("host", self.host) is not None:
            raise ValueError(f"{self.host!r} is not a host name or address")
        if type(self.port) is not int or not 1 <= self.port <= MAX_PORT:
            raise ValueError(f"port {self.port!r} is outside 1..{MAX_PORT}")

    @classmethod
    def parse(cls, text: str) -> Self:
        """Parse ``host:port`` or ``[v6addr]:port``; a ValueError says what is wrong with ``text``."""
        text = text.strip()
        if text.startswith("["):
            end = text.find("]")
            if end < 0 or not text[end + 1 :].startswith(":"):
                raise ValueError(f"expected [IPV6]:PORT, got {text!r}")
            host, port_text = text[1:end], text[end + 2 :]
        else:
            host, sep, port_text = text.rpartition(":")
            if not sep:
                raise ValueError(f"expected HOST:PORT, got {text!r}")
            if ":" in host:
                raise ValueError(f"an IPv6 address needs brackets: [{host}]:{port_text}")
        if not host:
            raise ValueError(f"no host in {text!r} (use 0.0.0.0 for every interface)")
        if not (port_text.isascii() and port_text.isdigit()):
            raise ValueError(f"port {port_text!r} in {text!r} is not a number")
        port = int(port_text)
        if not 1 <= port <= MAX_PORT:
            raise ValueError(f"port {port} in {text!r} is outside 1..{MAX_PORT}")
        return cls(host, port)

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


SASL_MECHANISMS: Final = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER", "GSSAPI")
# A Kerberos principal with its realm: primary[/instance]@REALM (Kafka's KerberosName).
_KERBEROS_PRINCIPAL: Final = re.compile(r"[^/@\s]+(/[^/@\s]+)?@[^/@\s]+")


def kerberos_principal_problem(principal: str, *, instance: bool) -> str | None:
    """Why ``principal`` cannot be a configured Kerberos principal, or None; ``instance``: it must
    have the ``/host`` part (a service principal)."""
    if not _KERBEROS_PRINCIPAL.fullmatch(principal):
        return (f"{principal!r} is not a Kerberos principal; write it whole, with its realm: "
                f"{'service/host@REALM' if instance else 'name[/instance]@REALM'}")
    if instance and "/" not in principal:
        return f"{principal!r} is not a service principal; write service/host@REALM (e.g. kafka/localhost@EXAMPLE.COM)"
    return None
_LOOPBACK: Final = re.compile(r"^(localhost|127(\.\d{1,3}){3}|\[::1\]|::1)$", re.IGNORECASE)


def url_problem(url: str) -> str | None:
    """Why ``url`` cannot be an identity provider's address: https only, http on loopback only
    (a token or key set fetched in clear from elsewhere could be swapped by anyone on the path)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        host = parts.hostname
    except ValueError:
        return f"{url!r} is not a URL"
    if parts.scheme not in ("https", "http") or not host:
        return f"{url!r} is not an https:// URL"
    if parts.scheme == "http" and not _LOOPBACK.match(host if ":" not in host else f"[{host}]"):
        return f"http:// is allowed only for a loopback address; use https:// for {host}"
    if parts.username or parts.password:
        return "put credentials in client_secret or client_secret_file, not in the URL"
    return None


def check_files(section: Any) -> None:
    for field in attrs.fields(type(section)):
        value = getattr(section, field.name)
        if value is None or not field.metadata.get(RULES, {}).get("file"):
            continue
        problem = None
        if not os.path.exists(value):
            problem = f"file not found: {value}"
        elif not os.path.isfile(value):
            problem = f"not a regular file: {value}"
        elif not os.access(value, os.R_OK):
            problem = f"cannot read {value} (permissions)"
        if problem is not None:
            raise SettingError(path_of(section, field.name), problem)


def _section_paths(cls: type, path: SettingPath) -> Iterator[tuple[type, SettingPath]]:
    for field in attrs.fields(cls):
        (inner,) = (a for a in _scalar_types(field.type) if a is not type(None))
        if attrs.has(inner) and inner is not HostPort:
            yield inner, (*path, field.name)
            yield from _section_paths(inner, (*path, field.name))


def name_sections(root: type) -> None:
    """Register where every section class under ``root`` sits, so its errors name the full setting."""
    _SECTION_PATHS.update(_section_paths(root, ()))


def rebased(path: SettingPath, cls: type, at: SettingPath) -> SettingPath:
    """``path``, raised by a section of class ``cls`` (named from where ``cls`` is registered), as
    seen from where that section really is (``at``): a section class held in a list
    (``upstream.clusters[1]``) or in two places (``tls`` of a cluster) is registered at one place."""
    registered = _SECTION_PATHS.get(cls, ())
    if path[:len(registered)] == registered:
        return (*at, *path[len(registered):])
    return path

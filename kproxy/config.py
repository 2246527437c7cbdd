"""The proxy's settings: attrs frozen classes that check their own values, loaded from YAML.

The classes hold every rule, so a config built in code, by quick mode or with ``attrs.evolve`` is
checked exactly like a file; a broken setting is a ``SettingError`` naming it. The YAML loader adds
the file and the 1-based line of the offending key, expands ``${VAR}`` and gives "did you mean"
hints. This module reads the config file, checks that the TLS files it names exist and reads the
cgroup memory limit; it must not open sockets, load certificates or start tasks.
"""

import contextlib
import difflib
import math
import os
import re
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any, Final, NoReturn, Self

import attrs
import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from kproxy.protocol.errors import LocatedError


class ConfigError(LocatedError):
    """Invalid configuration or rules; ``file`` and ``line`` point at the offending text when known.
    It lives here, above kproxy.protocol, because only configuration (this module, the rule loader,
    the command line) raises it."""


_MAX_PORT: Final = 65535
_WILDCARD_HOSTS: Final = frozenset({"0.0.0.0", "::"})

# Field metadata keys. _RULES holds the per-value rules every config class checks on construction;
# _INTERNAL marks a field that is not a setting (it cannot be written in YAML).
_RULES: Final = "kproxy.rules"
_INTERNAL: Final = "kproxy.internal"

_Path = tuple[str | int, ...]

# Where each section class sits in the settings tree (LimitsConfig -> ("limits",)), so an error
# raised inside a section names the full setting. Filled once the classes exist.
_SECTION_PATHS: dict[type, _Path] = {}


class SettingError(ConfigError):
    """One setting breaks a rule: ``path`` is where it sits (``("limits", "max_frame_size")``).

    The config classes raise it themselves; the YAML loader catches it and adds file and line.
    """

    def __init__(self, path: _Path, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(f"{_dotted(path)}: {problem}" if path else problem)


def _setting(default: Any = attrs.NOTHING, **rules: Any) -> Any:
    """A field with ``rules``: min, above, max, choices, case (upper/lower), name (a kind), file."""
    return attrs.field(default=default, metadata={_RULES: rules})


def _with_checks(cls: type, fields: "list[attrs.Attribute[Any]]") -> "list[attrs.Attribute[Any]]":
    """attrs field transformer: every field of a config class gets its converter and its checks."""
    out = []
    for field in fields:
        rules = field.metadata.get(_RULES, {})
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
    problem = _value_problem(attribute.type, attribute.metadata.get(_RULES, {}), value)
    if problem is not None:
        raise SettingError(_path_of(instance, attribute.name), problem)


def _path_of(section: Any, name: str) -> _Path:
    return (*_SECTION_PATHS.get(type(section), ()), name)


_EXPECTED: Final[Mapping[type, str]] = {
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
        if rules.get("words"):
            ok = isinstance(value, tuple) and all(isinstance(w, str) and w.strip() for w in value)
            return None if ok else f"expected a list of names, got {value!r}"
        if typing.get_args(tp)[0] is str:
            return _strings_problem(value) if rules.get("text") else _paths_problem(value)
        return _host_ports_problem(value)
    if typing.get_origin(tp) is dict:
        # dict[str, float] is the only mapping setting; its section checks the keys and values.
        return None if isinstance(value, dict) else f"expected a mapping, got {value!r}"
    if attrs.has(tp):
        return None if isinstance(value, tp) else f"expected a {tp.__name__}, got {value!r}"
    if type(value) is not tp:
        return f"expected {_EXPECTED[tp]}, got {value!r}"
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number, got {value}"
    choices = rules.get("choices")
    if choices is not None and value not in choices:
        return f"must be one of {', '.join(choices)}; got {value!r}{_did_you_mean(str(value), choices)}"
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
        if type(self.port) is not int or not 1 <= self.port <= _MAX_PORT:
            raise ValueError(f"port {self.port!r} is outside 1..{_MAX_PORT}")

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
        if not 1 <= port <= _MAX_PORT:
            raise ValueError(f"port {port} in {text!r} is outside 1..{_MAX_PORT}")
        return cls(host, port)

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@attrs.frozen(field_transformer=_with_checks)
class TlsClientSide:
    """TLS from kproxy to the brokers (origination)."""

    enabled: bool = False
    ca_file: str | None = _setting(None, file=True)
    cert_file: str | None = _setting(None, file=True)
    key_file: str | None = _setting(None, file=True)
    server_hostname: str | None = _setting(None, name="host")
    verify: bool = True

    def __attrs_post_init__(self) -> None:
        if not self.enabled:
            return  # charts template the paths in always and switch TLS with one flag
        if (self.cert_file is None) != (self.key_file is None):
            given, missing = ("cert_file", "key_file") if self.key_file is None else ("key_file", "cert_file")
            raise SettingError(_path_of(self, given), f"a client certificate needs both cert_file and key_file; "
                                                      f"{_dotted(_path_of(self, missing))} is not set")
        _check_files(self)


SASL_MECHANISMS: Final = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER")
_LOOPBACK: Final = re.compile(r"^(localhost|127(\.\d{1,3}){3}|\[::1\]|::1)$", re.IGNORECASE)


def _url_problem(url: str) -> str | None:
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


def _one_secret(section: Any, value: str, file: str, what: str) -> None:
    given = [n for n in (value, file) if getattr(section, n) is not None]
    if len(given) != 1:
        problem = (f"give {what} as {value} (from ${{VAR}}) or {file}, not both" if given
                   else f"needs {what}: {value} (from ${{VAR}}) or {file}")
        raise SettingError(_path_of(section, given[-1] if given else value), problem)


@attrs.frozen(field_transformer=_with_checks)
class UpstreamOAuth:
    """OAUTHBEARER origination: kproxy gets its own token by client credentials (RFC 6749 4.4)."""

    token_endpoint_url: str = _setting()
    client_id: str = _setting()
    client_secret: str | None = None
    client_secret_file: str | None = _setting(None, file=True)
    scope: str | None = None
    # SASL extensions sent with the token (KIP-342), such as logicalCluster on Confluent Cloud.
    extensions: dict[str, str] = attrs.field(factory=dict, hash=False)

    def __attrs_post_init__(self) -> None:
        problem = _url_problem(self.token_endpoint_url)
        if problem is not None:
            raise SettingError(_path_of(self, "token_endpoint_url"), problem)
        _one_secret(self, "client_secret", "client_secret_file", "the client secret")
        for key, value in self.extensions.items():
            if not re.fullmatch(r"[A-Za-z]+", key) or key == "auth" or not isinstance(value, str):
                raise SettingError((*_path_of(self, "extensions"), key),
                                   "an extension name is letters only (not 'auth'), its value a string")
        _check_files(self)


@attrs.frozen(field_transformer=_with_checks)
class UpstreamSasl:
    """Origination: every broker connection kproxy opens logs in as kproxy, before any request."""

    mechanism: str = _setting(case="upper", choices=SASL_MECHANISMS)
    username: str | None = None
    password: str | None = None
    password_file: str | None = _setting(None, file=True)
    oauth: UpstreamOAuth | None = None      # read only with OAUTHBEARER

    def __attrs_post_init__(self) -> None:
        if self.mechanism == "OAUTHBEARER":
            if self.oauth is None:
                raise SettingError(_path_of(self, "mechanism"), "OAUTHBEARER needs upstream.sasl.oauth "
                                                                "(token_endpoint_url, client_id, client secret)")
            return
        if not self.username:
            raise SettingError(_path_of(self, "username"), f"{self.mechanism} needs a username")
        _one_secret(self, "password", "password_file", "a password")
        _check_files(self)


@attrs.frozen(field_transformer=_with_checks)
class UpstreamConfig:
    """The real cluster: where to bootstrap, how to reach it, how long to wait for it."""

    bootstrap_servers: tuple[HostPort, ...]
    tls: TlsClientSide = TlsClientSide()
    sasl: UpstreamSasl | None = None
    connect_timeout_s: float = _setting(10.0, above=0)
    # A request with no response after this gets a retriable error sent back to the client.
    request_timeout_s: float = _setting(30.0, above=0)


@attrs.frozen(field_transformer=_with_checks)
class SniConfig:
    """Names for SNI routing: brokers are ``broker-<node_id>.<domain>``, bootstrap ``<bootstrap_name>.<domain>``."""

    domain: str = _setting(name="domain")
    bootstrap_name: str = _setting("bootstrap", name="label")


@attrs.frozen(field_transformer=_with_checks)
class ExposureConfig:
    """How brokers are presented to clients: one port each, or one port with SNI names."""

    mode: str = _setting("port_per_broker", choices=("port_per_broker", "sni"))
    advertised_host: str | None = _setting(None, name="host")  # None: the listen host
    broker_port_start: int | None = _setting(None, min=1, max=_MAX_PORT)  # None: listen port + 1
    broker_port_count: int = _setting(64, min=1, max=_MAX_PORT)
    # None: ports handed out in order of discovery; an int: port = start + node_id - node_id_base.
    node_id_base: int | None = _setting(None, min=0)
    sni: SniConfig | None = None

    def __attrs_post_init__(self) -> None:
        if self.mode == "sni" and self.sni is None:
            raise SettingError(_path_of(self, "mode"), "sni needs exposure.sni.domain")


@attrs.frozen(field_transformer=_with_checks)
class PrincipalConfig:
    """How a verified client certificate becomes the principal: Kafka's ``ssl.principal.mapping.rules``
    over its RFC 2253 subject, or (``san_uri``) its URI SAN, a SPIFFE ID."""

    mapping_rules: tuple[str, ...] = _setting(("DEFAULT",), text=True)
    san_uri: bool = False

    def __attrs_post_init__(self) -> None:
        from kproxy.identity.principal import MappingRuleError, parse_rules

        if not self.mapping_rules:
            raise SettingError(_path_of(self, "mapping_rules"), "needs at least one rule (DEFAULT keeps the subject)")
        try:
            parse_rules(self.mapping_rules)
        except MappingRuleError as e:
            raise SettingError((*_path_of(self, "mapping_rules"), e.index), str(e)) from None
        if self.san_uri and self.mapping_rules != ("DEFAULT",):
            raise SettingError(_path_of(self, "san_uri"), "takes the URI SAN as it is; remove mapping_rules, "
                                                          "or set san_uri: false to map the subject")


@attrs.frozen(field_transformer=_with_checks)
class TlsServerSide:
    """TLS from clients to kproxy (termination); mTLS when ``require_client_cert``."""

    enabled: bool = False
    cert_file: str | None = _setting(None, file=True)
    key_file: str | None = _setting(None, file=True)
    ca_file: str | None = _setting(None, file=True)
    require_client_cert: bool = False
    principal: PrincipalConfig = PrincipalConfig()

    def __attrs_post_init__(self) -> None:
        if self.principal != PrincipalConfig() and self.ca_file is None:
            raise SettingError(_path_of(self, "principal"), "maps client certificates, which need tls.ca_file "
                                                            "(the CA that signs them)")
        if self.require_client_cert:
            if not self.enabled:
                raise SettingError(_path_of(self, "require_client_cert"), "needs tls.enabled: true")
            if self.ca_file is None:
                raise SettingError(_path_of(self, "require_client_cert"),
                                   "needs tls.ca_file, the CA that signs the client certificates")
        if self.enabled:
            for name in ("cert_file", "key_file"):
                if getattr(self, name) is None:
                    raise SettingError(_path_of(self, "enabled"), f"TLS termination needs tls.{name}")
            _check_files(self)


@attrs.frozen(field_transformer=_with_checks)
class ProxyProtocolConfig:
    """The HAProxy PROXY protocol header on the client listeners, from load balancers in ``trusted``."""

    mode: str = _setting("off", case="lower", choices=("off", "optional", "required"), off=True)
    trusted: tuple[str, ...] = _setting((), text=True)    # CIDRs of the peers that may send one
    timeout_s: float = _setting(10.0, above=0)             # to receive the whole header

    def __attrs_post_init__(self) -> None:
        import ipaddress

        for i, cidr in enumerate(self.trusted):
            try:
                ipaddress.ip_network(cidr, strict=True)
            except ValueError as e:
                hint = ""
                with contextlib.suppress(ValueError):
                    hint = f" (did you mean {str(ipaddress.ip_network(cidr, strict=False))!r}?)"
                raise SettingError((*_path_of(self, "trusted"), i), f"{cidr!r} is not a CIDR: {e}{hint}") from None
        if self.mode != "off" and not self.trusted:
            raise SettingError(_path_of(self, "mode"), "needs proxy_protocol.trusted, the CIDRs of the load "
                                                       "balancers allowed to send the header")


@attrs.frozen(field_transformer=_with_checks)
class SaslOAuth:
    """How client tokens (OAUTHBEARER) are checked: signed by a key of ``jwks_url``, for this issuer
    and audience; the principal is ``User:<principal_claim>``."""

    jwks_url: str = _setting()
    issuer: str = _setting()
    audience: str = _setting()
    principal_claim: str = "sub"
    # The key set is fetched again this often, and at once (at most every 10 s) for an unknown kid.
    jwks_refresh_s: float = _setting(3600.0, min=10)
    leeway_s: float = _setting(30.0, min=0, max=600)

    def __attrs_post_init__(self) -> None:
        problem = _url_problem(self.jwks_url)
        if problem is not None:
            raise SettingError(_path_of(self, "jwks_url"), problem)


@attrs.frozen(field_transformer=_with_checks)
class SaslConfig:
    """Termination: kproxy authenticates clients itself; nothing reaches a broker before that."""

    mechanisms: tuple[str, ...] = _setting(words=True, case="upper")
    users_file: str | None = _setting(None, file=True)
    # KIP-368: clients re-authenticate within this (or their token's remaining life); 0: never.
    max_session_s: float = _setting(3600.0, min=0)
    # Every failed login is answered this long after it began, whatever failed.
    failed_login_delay_s: float = _setting(0.5, min=0, max=10)
    # Failed logins allowed per source address per minute; then its logins are refused. 0: no limit.
    max_failed_logins_per_minute: int = _setting(10, min=0)
    oauth: SaslOAuth | None = None

    def __attrs_post_init__(self) -> None:
        if not self.mechanisms:
            raise SettingError(_path_of(self, "mechanisms"), f"list at least one of {', '.join(SASL_MECHANISMS)}")
        for i, mechanism in enumerate(self.mechanisms):
            if mechanism not in SASL_MECHANISMS:
                raise SettingError((*_path_of(self, "mechanisms"), i),
                                   f"must be one of {', '.join(SASL_MECHANISMS)}; got {mechanism!r}"
                                   f"{_did_you_mean(mechanism, SASL_MECHANISMS)}")
            if mechanism in self.mechanisms[:i]:
                raise SettingError((*_path_of(self, "mechanisms"), i), f"lists {mechanism} twice")
        if any(m != "OAUTHBEARER" for m in self.mechanisms) and self.users_file is None:
            raise SettingError(_path_of(self, "mechanisms"), "PLAIN and SCRAM check clients against sasl.users_file "
                                                             "(write it with `kproxy users add`)")
        if "OAUTHBEARER" in self.mechanisms and self.oauth is None:
            raise SettingError(_path_of(self, "mechanisms"), "OAUTHBEARER needs sasl.oauth (jwks_url, issuer, "
                                                             "audience)")
        _check_files(self)


@attrs.frozen(field_transformer=_with_checks)
class LimitsConfig:
    """Bounds on what connections may make kproxy hold; sizes in bytes, durations in seconds."""

    max_frame_size: int = _setting(104857600, min=1)
    max_in_flight_requests: int = _setting(256, min=1)  # per client connection
    max_buffered_bytes: int = _setting(67108864, min=1)  # per connection, before backpressure
    # All connections together; None: derived at start (see effective_buffer_budget).
    max_buffered_bytes_total: int | None = _setting(None, min=1)
    max_decompressed_batch_bytes: int = _setting(268435456, min=1)
    # A connection part-way through a SASL exchange the broker has not accepted yet gets this long;
    # silent connections are the idle timeout's business.
    unauthenticated_idle_timeout_s: float = _setting(30.0, above=0)
    # Kafka's connections.max.idle.ms is 10 minutes; 0: never.
    idle_timeout_s: float = _setting(600.0, min=0)
    # From a frame's first byte to its last: a peer that trickles a frame cannot hold its buffer forever.
    frame_timeout_s: float = _setting(30.0, above=0)
    tls_handshake_timeout_s: float = _setting(10.0, above=0)  # client side
    drain_timeout_s: float = _setting(10.0, min=0)


@attrs.frozen(field_transformer=_with_checks)
class AdminConfig:
    """The admin HTTP listener (health, metrics); off when ``listen`` is None."""

    listen: HostPort | None = None


@attrs.frozen(field_transformer=_with_checks)
class MetricsConfig:
    """Prometheus metrics on the admin listener. Per-client and per-topic series are opt-in: their
    number grows with the clients and topics, so each kind is capped and the rest is counted as
    ``other``."""

    client_labels: bool = False
    topic_labels: bool = False
    label_cap: int = _setting(100, min=1)


@attrs.frozen(field_transformer=_with_checks)
class TrafficLogConfig:
    """One JSON line per completed request, under ``dir`` (off when None), in hourly partitions."""

    dir: str | None = _setting(None, file=True)
    rotate_bytes: int = _setting(67108864, min=4096)
    rotate_s: float = _setting(3600.0, above=0)
    compression: str = _setting("gzip", case="lower", choices=("gzip", "none"))
    queue_size: int = _setting(10000, min=1)
    # API name -> share of its requests logged (0..1); "default" for the APIs not named.
    sample: dict[str, float] = attrs.field(factory=dict, hash=False)

    def __attrs_post_init__(self) -> None:
        if self.dir is not None:
            problem = _writable_dir_problem(self.dir)
            if problem is not None:
                raise SettingError(_path_of(self, "dir"), problem)
        if not self.sample:
            return
        from kproxy.protocol.messages import apis

        names = {api.name for api in apis().values()} | {"default"}
        for name, ratio in self.sample.items():
            if name not in names:
                raise SettingError(_path_of(self, "sample"), f"unknown API {name!r}"
                                                             f"{_did_you_mean(str(name), names)}")
            if type(ratio) not in (int, float) or not 0 <= ratio <= 1:
                raise SettingError((*_path_of(self, "sample"), name), f"must be a number from 0 to 1, got {ratio!r}")


@attrs.frozen(field_transformer=_with_checks)
class TracingConfig:
    """OpenTelemetry spans, one per request; exported as the OTEL_* environment variables say."""

    enabled: bool = False
    sample_ratio: float = _setting(1.0, min=0, max=1)
    # Read W3C traceparent headers of records: off, uncompressed batches only, or all (decompressing,
    # up to limits.max_decompressed_batch_bytes per batch).
    link_record_traces: str = _setting("uncompressed", case="lower", choices=("off", "uncompressed", "all"))
    # otlp, console or none; null: OTEL_TRACES_EXPORTER, else otlp.
    exporter: str | None = _setting(None, case="lower", choices=("otlp", "console", "none"))


_TOPIC_NAME: Final = re.compile(r"[a-zA-Z0-9._-]{1,249}")


@attrs.frozen(field_transformer=_with_checks)
class CoordinationConfig:
    """Fleet-wide quotas (docs/fleet-quotas.md): every process of ``fleet`` reports its use of each
    budget to ``topic`` every ``publish_interval_ms`` and enforces its demand-weighted share of the
    whole limit; peers silent for ``stale_after_s`` are ignored, and without fresh coordination a
    process falls back to the static share (limit / (quota_replicas x workers))."""

    fleet: str = _setting()
    # false keeps the section written but off (charts template it in and switch it with one flag).
    enabled: bool = True
    topic: str = _setting("__kproxy_quotas")
    publish_interval_ms: int = _setting(500, min=50, max=60000)
    stale_after_s: float = _setting(5.0, above=0, max=3600)
    # Used when kproxy creates the topic (an existing one is used as it is).
    partitions: int = _setting(1, min=1, max=1000)
    replication_factor: int = _setting(-1, min=-1, max=32)     # -1: the broker's default
    retention_ms: int = _setting(300000, min=1000)

    def __attrs_post_init__(self) -> None:
        if not self.fleet.strip() or "/" in self.fleet or len(self.fleet) > 200:
            raise SettingError(_path_of(self, "fleet"), f"{self.fleet!r} is not a fleet name (1 to 200 characters, "
                                                        f"no '/')")
        if not _TOPIC_NAME.fullmatch(self.topic) or self.topic in (".", ".."):
            raise SettingError(_path_of(self, "topic"), f"{self.topic!r} is not a Kafka topic name "
                                                        f"(letters, digits, '.', '_', '-'; at most 249)")
        if self.replication_factor == 0:
            raise SettingError(_path_of(self, "replication_factor"), "must be -1 (the broker's default) or at least 1")
        if self.stale_after_s * 1000 < 2 * self.publish_interval_ms:
            raise SettingError(_path_of(self, "stale_after_s"),
                               f"must be at least two publish intervals ({2 * self.publish_interval_ms / 1000:g}s), "
                               f"got {self.stale_after_s:g}: every record would be stale before the next is read")


@attrs.frozen(field_transformer=_with_checks)
class QuotaConfig:
    """How client quotas measure rates (Kafka's quota.window.num and quota.window.size.seconds):
    ``samples`` sliding samples of ``window_s`` seconds each; ``coordination`` shares every quota
    across a fleet of kproxy processes (off when None)."""

    samples: int = _setting(11, min=1, max=3600)
    window_s: float = _setting(1.0, above=0, max=3600)
    coordination: CoordinationConfig | None = None

    @property
    def coordinated(self) -> CoordinationConfig | None:
        """The coordination settings when fleet quotas are on, else None."""
        c = self.coordination
        return c if c is not None and c.enabled else None


@attrs.frozen(field_transformer=_with_checks)
class ProxyConfig:
    """Everything kproxy needs to run. Build it with ``load_config`` or ``config_from_args``."""

    listen: HostPort
    upstream: UpstreamConfig
    mode: str = _setting("gateway", choices=("gateway", "sidecar"))
    exposure: ExposureConfig = ExposureConfig()
    tls: TlsServerSide = TlsServerSide()
    proxy_protocol: ProxyProtocolConfig = ProxyProtocolConfig()
    sasl: SaslConfig | None = None
    limits: LimitsConfig = LimitsConfig()
    passthrough_unknown_versions: bool = False
    # Policy rule files, or directories of them (every *.yaml), relative to the config file.
    rules: tuple[str, ...] = ()
    chaos: bool = False    # chaos rules inject faults only when this is true
    # Replicas of the gateway that share every quota; each process enforces quota_share() of it
    # (per-connection quotas excepted: a connection lives on one process, which holds it whole).
    quota_replicas: int = _setting(1, min=1)
    quota: QuotaConfig = QuotaConfig()
    admin: AdminConfig = AdminConfig()
    metrics: MetricsConfig = MetricsConfig()
    traffic_log: TrafficLogConfig = TrafficLogConfig()
    tracing: TracingConfig = TracingConfig()
    # Share of frames (0..1) whose re-encoding is compared with the bytes received.
    verify_reencode: float = _setting(0.0, min=0, max=1)
    # Fetch answers and Produce requests at least this large are forwarded while they arrive (cut-through);
    # null: never.
    cut_through_min_bytes: int | None = _setting(65536, min=1)
    # Streamed record batch bodies move broker -> client by splice(2), never copied through kproxy
    # (Linux, plain TCP on both sides). Off by default: on loopback it measured no faster than the
    # copy (docs/performance-streaming.md).
    cut_through_splice: bool = False
    log_level: str = _setting("INFO", case="upper", choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"))
    log_format: str = _setting("text", case="lower", choices=("text", "json"))
    # Processes sharing the listening ports; 0 (written "auto") means one per CPU the process may use.
    workers: int = _setting(1, min=0, auto=True)
    source: str | None = attrs.field(default=None, metadata={_INTERNAL: True})  # file loaded from

    def __attrs_post_init__(self) -> None:
        _check_exposure(self)
        if self.rules and self.passthrough_unknown_versions:
            raise SettingError(("passthrough_unknown_versions",), "frames forwarded opaquely would bypass the "
                                                                  "policy rules; turn it off to use rules")
        if self.mode == "sidecar" and self.exposure.advertised_host is not None:
            raise SettingError(("exposure", "advertised_host"),
                               "a sidecar is always advertised as localhost; remove exposure.advertised_host, "
                               "or use mode: gateway")
        if self.mode == "gateway" and self.exposure.advertised_host is None and self.listen.host in _WILDCARD_HOSTS:
            raise SettingError(("listen",), f"clients cannot connect to {self.listen.host}; set "
                                            f"exposure.advertised_host to the name they reach kproxy by")
        if self.workers != 1 and self.exposure.mode != "sni" and self.exposure.node_id_base is None:
            raise SettingError(("workers",), "more than one worker needs broker ports every worker agrees on: "
                                             "set exposure.node_id_base (or use exposure.mode: sni)")
        if (self.proxy_protocol.mode == "optional" and not self.tls.enabled
                and self.limits.max_frame_size >= _PROXY_V2_AS_FRAME_SIZE):
            raise SettingError(("limits", "max_frame_size"), "with proxy_protocol.mode: optional, frames must stay "
                                                             f"under {_PROXY_V2_AS_FRAME_SIZE} bytes, or a frame's "
                                                             "size could read as a PROXY v2 signature")
        admin = self.admin.listen
        if admin is not None and _may_share(admin.host, self.listen.host):
            taken = {self.listen.port}
            if self.exposure.mode != "sni":
                taken.update(range(self.broker_port_start, self.broker_port_start + self.exposure.broker_port_count))
            if admin.port in taken:
                raise SettingError(("admin", "listen"), f"port {admin.port} is already used by the Kafka listeners")

    @property
    def advertised_host(self) -> str:
        """The host clients are told to connect to; a sidecar is always reached on localhost."""
        if self.mode == "sidecar":
            return "localhost"
        return self.exposure.advertised_host or self.listen.host

    def quota_share(self, workers: int = 1) -> float:
        """The part of every quota one kproxy process enforces: 1 / (quota_replicas x workers), the
        worker processes of this replica (``ProxyServer.workers``; budgets are per process)."""
        return 1.0 / (self.quota_replicas * workers)

    @property
    def broker_port_start(self) -> int:
        """The first per-broker port (port_per_broker mode)."""
        start = self.exposure.broker_port_start
        return self.listen.port + 1 if start is None else start


# The first four bytes of a PROXY v2 signature (\r\n\r\n) read as a Kafka frame size; "PROXY"
# reads larger still. Frames below this cannot be mistaken for a header.
_PROXY_V2_AS_FRAME_SIZE: Final = 0x0D0A0D0A


def _check_exposure(cfg: ProxyConfig) -> None:
    exp = cfg.exposure
    if exp.mode == "sni":
        if not cfg.tls.enabled:
            raise SettingError(("exposure", "mode"),
                               "sni needs tls.enabled: true; clients name the broker in the TLS ClientHello")
        return
    start, last = cfg.broker_port_start, cfg.broker_port_start + exp.broker_port_count - 1
    blame: _Path = ("listen",) if exp.broker_port_start is None else ("exposure", "broker_port_start")
    if last > _MAX_PORT:
        if blame == ("listen",) and exp.broker_port_count != _DEFAULT_PORT_COUNT:
            blame = ("exposure", "broker_port_count")
        raise SettingError(blame, f"broker ports {start}..{last} run past {_MAX_PORT}; lower "
                                  f"exposure.broker_port_start or exposure.broker_port_count")
    if start <= cfg.listen.port <= last:
        raise SettingError(blame, f"broker ports {start}..{last} include the listen port {cfg.listen.port}")


def _writable_dir_problem(path: str) -> str | None:
    """Why kproxy could not write files under ``path`` (created at start when missing), or None."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            return f"not a directory: {path}"
        return None if os.access(path, os.W_OK | os.X_OK) else f"cannot write to {path} (permissions)"
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot create {path}: {parent} is not a writable directory"
    return None


def _check_files(section: Any) -> None:
    for field in attrs.fields(type(section)):
        value = getattr(section, field.name)
        if value is None or not field.metadata.get(_RULES, {}).get("file"):
            continue
        problem = None
        if not os.path.exists(value):
            problem = f"file not found: {value}"
        elif not os.path.isfile(value):
            problem = f"not a regular file: {value}"
        elif not os.access(value, os.R_OK):
            problem = f"cannot read {value} (permissions)"
        if problem is not None:
            raise SettingError(_path_of(section, field.name), problem)


_DEFAULT_PORT_COUNT: Final = attrs.fields(ExposureConfig).broker_port_count.default


def _section_paths(cls: type, path: _Path) -> Iterator[tuple[type, _Path]]:
    for field in attrs.fields(cls):
        (inner,) = (a for a in _scalar_types(field.type) if a is not type(None))
        if attrs.has(inner) and inner is not HostPort:
            yield inner, (*path, field.name)
            yield from _section_paths(inner, (*path, field.name))


_SECTION_PATHS.update(_section_paths(ProxyConfig, ()))


# --------------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------------


def load_config(path: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> ProxyConfig:
    """Read and validate the YAML file at ``path``. Relative TLS file paths are taken from its directory.

    ``${NAME}`` and ``${NAME:-default}`` in values are read from ``env`` (default: the environment).
    """
    file = os.fspath(path)
    return _load(read_text_file(file), file, os.path.dirname(file), env)


def read_text_file(file: str, what: str = "the file") -> str:
    """The UTF-8 text of ``file``; a ConfigError naming the file when it cannot be read."""
    try:
        with open(file, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"cannot read {what}: {e.strerror or e}", file=file) from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"not UTF-8 text (byte {e.start})", file=file) from None


def parse_config(text: str, source: str = "<string>", env: Mapping[str, str] | None = None) -> ProxyConfig:
    """Validate YAML ``text``; errors name ``source``. Relative TLS file paths are taken from the cwd."""
    return _load(text, source, None, env)


def config_from_args(upstream: str, listen: str, **overrides: object) -> ProxyConfig:
    """Quick mode (``kproxy run --upstream H:P[,H:P] --listen H:P``): defaults for everything else.

    ``overrides`` are the other top-level settings (``mode="sidecar"``, ``log_level="DEBUG"``); a
    section may be given as its object or as a mapping of its keys (``exposure={"advertised_host":
    "kp"}``), and None means "not given". They pass through the same checks as a file; errors carry
    no file or line. Values are taken literally: no ``${VAR}`` expansion.
    """
    data: dict[str, object] = {"listen": listen, "upstream": {"bootstrap_servers": upstream}}
    # argparse leaves an option that was not given as None.
    data.update((key, value) for key, value in overrides.items() if value is not None)
    pairs = []
    for key, value in data.items():
        try:
            pairs.append((_node_of(key), _node_of(value)))
        except yaml.YAMLError:
            raise ConfigError(f"{key}: cannot use {value!r} as a setting") from None
    return _Builder(file=None, base_dir=None, env=None).build(MappingNode("tag:yaml.org,2002:map", pairs))


def apply_overrides(cfg: ProxyConfig, **settings: object) -> ProxyConfig:
    """``cfg`` with top-level ``settings`` replaced (None means "not given"), checked like a file.

    For ``kproxy run --config F --log-level debug``: ``log_level="verbose"`` is a ConfigError.
    """
    given: dict[str, Any] = {key: value for key, value in settings.items() if value is not None}
    names = {f.name for f in attrs.fields(ProxyConfig) if not f.metadata.get(_INTERNAL)}
    for key in given:
        if key not in names:
            raise ConfigError(f"unknown setting {key!r}{_unknown_key_hint(key, ProxyConfig)}")
    return attrs.evolve(cfg, **given)


def describe_config(cfg: ProxyConfig, codec: str | None = None) -> str:
    """A one-line summary of what ``cfg`` will do, for ``kproxy check`` and the startup log; ``codec``
    names the codec in use (the caller asks kproxy.protocol: configuration does not import it)."""
    exp = cfg.exposure
    if exp.mode == "sni":
        domain = exp.sni.domain if exp.sni is not None else "?"
        brokers = f"SNI names broker-<node_id>.{domain} on port {cfg.listen.port}"
    else:
        start = cfg.broker_port_start
        brokers = f"brokers on ports {start}-{start + exp.broker_port_count - 1}"
    idle = cfg.limits.idle_timeout_s
    parts = [
        f"listen {cfg.listen} -> upstream {','.join(map(str, cfg.upstream.bootstrap_servers))}",
        f"{cfg.mode}, advertised as {cfg.advertised_host}, {brokers}",
        f"client TLS {_on_off(cfg.tls.enabled)}{' (mTLS)' if cfg.tls.require_client_cert else ''}",
        f"upstream TLS {_on_off(cfg.upstream.tls.enabled)}",
        *_identity_summary(cfg),
        f"client SASL {'terminated: ' + ', '.join(cfg.sasl.mechanisms) if cfg.sasl else 'relayed'}",
        f"upstream SASL {cfg.upstream.sasl.mechanism + ' as kproxy' if cfg.upstream.sasl else 'off'}",
        f"idle timeout {f'{idle:g}s' if idle > 0 else 'off'}",
        f"admin {cfg.admin.listen or 'off'}",
        f"traffic log {cfg.traffic_log.dir or 'off'}",
        f"tracing {f'on at {cfg.tracing.sample_ratio:g}' if cfg.tracing.enabled else 'off'}",
        f"logs {cfg.log_level} as {cfg.log_format}",
        *([f"codec {codec}"] if codec else []),
        f"workers {effective_workers(cfg)}{' (auto)' if cfg.workers == 0 else ''}",
    ]
    if cfg.rules:
        parts.append(f"rules from {', '.join(cfg.rules)}{' (chaos on)' if cfg.chaos else ''}")
        if cfg.quota_replicas > 1:
            parts.append(f"quotas split over {cfg.quota_replicas} replicas")
        coord = cfg.quota.coordinated
        if coord is not None:
            parts.append(f"quotas shared by fleet {coord.fleet!r} through topic {coord.topic}")
    return "; ".join(parts)


def _identity_summary(cfg: ProxyConfig) -> list[str]:
    out = []
    principal = cfg.tls.principal
    if principal.san_uri:
        out.append("mTLS principal from the URI SAN (SPIFFE ID)")
    elif principal.mapping_rules != ("DEFAULT",):
        out.append(f"mTLS principal by {len(principal.mapping_rules)} mapping rules")
    pp = cfg.proxy_protocol
    if pp.mode != "off":
        out.append(f"PROXY protocol {pp.mode} from {', '.join(pp.trusted)}")
    return out


def _on_off(flag: bool) -> str:
    return "on" if flag else "off"


# A container's memory limit, cgroup v2 then v1. v1 reports "no limit" as a huge number.
_CGROUP_LIMIT_FILES: Final = ("memory.max", "memory/memory.limit_in_bytes")
_NO_CGROUP_LIMIT: Final = 1 << 60
_DEFAULT_BUFFER_BUDGET: Final = 1 << 30


def effective_buffer_budget(cfg: ProxyConfig, cgroup_dir: str = "/sys/fs/cgroup") -> int:
    """The process-wide buffered-bytes budget: ``limits.max_buffered_bytes_total`` when set.

    Otherwise a quarter of the cgroup memory limit under ``cgroup_dir`` when one is readable (the
    rest is for Python, the codecs and the kernel's socket buffers), else 1 GiB.
    """
    total = cfg.limits.max_buffered_bytes_total
    if total is not None:
        return total
    for name in _CGROUP_LIMIT_FILES:
        try:
            with open(os.path.join(cgroup_dir, name), encoding="ascii") as f:
                text = f.read(64).strip()
        except (OSError, UnicodeDecodeError):
            continue
        if text.isdigit() and 0 < int(text) < _NO_CGROUP_LIMIT:
            return max(1, int(text) // 4)
    return _DEFAULT_BUFFER_BUDGET


def _load(text: str, file: str, base_dir: str | None, env: Mapping[str, str] | None) -> ProxyConfig:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        raise _yaml_error(e, file) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"not valid YAML: {e}", file=file) from None
    if node is None or (isinstance(node, ScalarNode) and node.tag == _NULL_TAG and not node.value):
        raise ConfigError("the file is empty; it needs at least 'listen' and 'upstream'", file=file, line=1)
    cfg = _Builder(file=file, base_dir=base_dir, env=os.environ if env is None else env).build(node)
    return attrs.evolve(cfg, source=file)


def _yaml_error(e: yaml.MarkedYAMLError, file: str | None) -> ConfigError:
    # The problem mark is where the parser gave up, which is the line a person has to look at.
    mark = e.problem_mark or e.context_mark
    reason = " ".join(p for p in (e.context, e.problem) if p)
    return ConfigError(f"YAML syntax error: {reason}", file=file, line=mark.line + 1 if mark else None)


# --------------------------------------------------------------------------------------------------
# The loader: YAML node tree -> attrs objects, driven by the fields' types; the classes check values
# --------------------------------------------------------------------------------------------------

_NULL_TAG: Final = "tag:yaml.org,2002:null"
_STR_TAG: Final = "tag:yaml.org,2002:str"
_MERGE_TAG: Final = "tag:yaml.org,2002:merge"
_BOOL_TAG: Final = "tag:yaml.org,2002:bool"

# "$$" is a literal "$"; "${NAME}" and "${NAME:-default}" are references (a default may hold "$$"
# but no reference); any other "${" is a mistake.
_ENV_REFERENCE: Final = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?::-((?:[^}$]|\$\$)*))?\}|(\{))")


class _Builder:
    """Turns one composed YAML tree into a ProxyConfig, remembering the line of every key it saw."""

    def __init__(self, file: str | None, base_dir: str | None, env: Mapping[str, str] | None) -> None:
        self.file = file
        self.base_dir = base_dir
        self.env = env  # None: values are literal (quick mode)
        self.lines: dict[_Path, int] = {}
        self._scalars = yaml.constructor.SafeConstructor()
        self._resolver = yaml.resolver.Resolver()

    def build(self, node: Node) -> ProxyConfig:
        if not isinstance(node, MappingNode):
            self.fail((), f"the top level must be a mapping of settings, got {_describe(node)}", node)
        line = _line(node)
        if line is not None:
            self.lines[()] = line
        cfg: ProxyConfig = self.section(ProxyConfig, node, ())
        return cfg

    # -- errors -------------------------------------------------------------------------------------

    def fail(self, path: _Path, reason: str, node: Node | None = None, line: int | None = None) -> NoReturn:
        if line is None:
            line = _line(node) if node is not None else self.line_of(path)
        raise ConfigError(f"{_dotted(path)}: {reason}" if path else reason, file=self.file, line=line)

    def line_of(self, path: _Path) -> int | None:
        # A setting left at its default has no line; point at the nearest enclosing key instead.
        while path not in self.lines and path:
            path = path[:-1]
        return self.lines.get(path)

    # -- structure ----------------------------------------------------------------------------------

    def section(self, cls: type[Any], node: Node, path: _Path) -> Any:
        if not isinstance(node, MappingNode):
            self.fail(path, f"expected a mapping of settings, got {_describe(node)}", node)
        fields = {f.name: f for f in attrs.fields(cls) if not f.metadata.get(_INTERNAL)}
        # Duplicates are checked before merge keys are flattened, since a key may rightly override
        # one merged from an anchor; YAML itself would silently keep the last of two.
        first_seen: dict[str, int | None] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG or not isinstance(key_node, ScalarNode):
                continue
            if key_node.value in first_seen:
                self.fail(path, f"duplicate key {key_node.value!r} (first at line {first_seen[key_node.value]})",
                          key_node)
            first_seen[key_node.value] = _line(key_node)
        try:
            self._scalars.flatten_mapping(node)
        except yaml.MarkedYAMLError as e:
            raise _yaml_error(e, self.file) from None

        values: dict[str, Any] = {}
        for key_node, value_node in node.value:
            if not (isinstance(key_node, ScalarNode) and key_node.tag == _STR_TAG):
                self.fail(path, f"keys must be names, got {_describe(key_node)}", key_node)
            key = key_node.value
            field = fields.get(key)
            if field is None:
                self.fail(path, f"unknown key {key!r}{_unknown_key_hint(key, cls)}", key_node)
            sub = (*path, key)
            line = _line(key_node)
            if line is not None:
                self.lines[sub] = line
            value_node = self.expand(value_node, sub)
            if attrs.has(field.type) and _is_null(value_node) and field.default is not attrs.NOTHING:
                # "tls:" with everything under it commented out means the defaults.
                values[key] = field.default
            else:
                values[key] = self.value(field.type, value_node, sub, field.metadata.get(_RULES, {}))

        for name, field in fields.items():
            if name not in values and field.default is attrs.NOTHING:
                # Point at the section's own key ("upstream:"), not at its first child.
                self.fail(path, f"missing required key {name!r}", line=self.lines.get(path, _line(node)))
        try:
            return cls(**values)
        except SettingError as e:
            self.fail(e.path, e.problem)

    def value(self, tp: Any, node: Node, path: _Path, rules: Mapping[str, Any]) -> Any:
        if rules.get("off") and isinstance(node, ScalarNode) and node.tag == _BOOL_TAG:
            # YAML 1.1 reads a bare off/no/false as a boolean; for a mode that is the word "off".
            if node.value.lower() in ("off", "no", "false"):
                return "off"
            self.fail(path, f"expected one of {', '.join(rules.get('choices', ()))}, got {node.value}", node)
        if rules.get("auto") and isinstance(node, ScalarNode) and node.tag == _STR_TAG:
            if node.value == "auto":
                return 0    # an int setting that also takes "auto" (workers): 0 stands for it
            self.fail(path, f"expected an integer or auto, got {_describe(node)}", node)
        origin = typing.get_origin(tp)
        if origin is types.UnionType:
            # Every union in the config classes is "X | None".
            (inner,) = (a for a in typing.get_args(tp) if a is not type(None))
            return None if _is_null(node) else self.value(inner, node, path, rules)
        if tp is HostPort:
            return self.host_port(node, path)
        if origin is tuple:
            if rules.get("words"):
                return self.words(node, path, rules)
            if typing.get_args(tp)[0] is str:
                return self.strings(node, path) if rules.get("text") else self.paths(node, path)
            return self.host_ports(node, path)
        if origin is dict:
            return self.mapping(typing.get_args(tp)[1], node, path)
        if attrs.has(tp):
            return self.section(tp, node, path)
        value = self.scalar(tp, node, path)
        # Relative to the config file, so the same file works from any cwd (as a mounted Secret).
        if rules.get("file") and value.strip() and self.base_dir and not os.path.isabs(value):
            value = os.path.join(self.base_dir, value)
        return value

    def scalar(self, tp: type, node: Node, path: _Path) -> Any:
        expected = _EXPECTED[tp]
        if not isinstance(node, ScalarNode):
            self.fail(path, f"expected {expected}, got {_describe(node)}", node)
        try:
            value = self._scalars.construct_object(node)
        except yaml.MarkedYAMLError as e:
            raise _yaml_error(e, self.file) from None
        # bool is an int in Python; YAML's true is not a port number.
        ok = type(value) is tp or (tp is float and type(value) is int)
        if not ok:
            self.fail(path, f"expected {expected}, got {_describe(node)}", node)
        return value

    def mapping(self, value_type: type, node: Node, path: _Path) -> dict[str, Any]:
        """A mapping of names to scalars (traffic_log.sample); the section checks the names."""
        if _is_null(node):
            return {}
        if not isinstance(node, MappingNode):
            self.fail(path, f"expected a mapping, got {_describe(node)}", node)
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            if not (isinstance(key_node, ScalarNode) and key_node.tag == _STR_TAG):
                self.fail(path, f"keys must be names, got {_describe(key_node)}", key_node)
            sub = (*path, key_node.value)
            if key_node.value in out:
                self.fail(path, f"duplicate key {key_node.value!r}", key_node)
            line = _line(key_node)
            if line is not None:
                self.lines[sub] = line
            out[key_node.value] = self.scalar(value_type, self.expand(value_node, sub), sub)
        return out

    def host_port(self, node: Node, path: _Path) -> HostPort:
        if not (isinstance(node, ScalarNode) and node.tag == _STR_TAG):
            # Unquoted 10:30 is a YAML 1.1 base-60 integer, hence the advice to quote.
            self.fail(path, f"expected \"HOST:PORT\" (quoted if it looks like a number), got {_describe(node)}",
                      node)
        try:
            return HostPort.parse(node.value)
        except ValueError as e:
            self.fail(path, str(e), node)

    def strings(self, node: Node, path: _Path) -> tuple[str, ...]:
        """A list of strings (or one), each item's line remembered so an error can point at it."""
        if _is_null(node):
            return ()
        items = node.value if isinstance(node, SequenceNode) else [node]
        out = []
        for i, item in enumerate(items):
            at = (*path, i) if isinstance(node, SequenceNode) else path
            line = _line(item)
            if line is not None:
                self.lines[at] = line
            if not (isinstance(item, ScalarNode) and item.tag == _STR_TAG):
                self.fail(at, f"expected a string (quote it), got {_describe(item)}", item)
            out.append(item.value)
        return tuple(out)

    def paths(self, node: Node, path: _Path) -> tuple[str, ...]:
        """A list of file or directory names (or one), each relative to the config file, each existing."""
        items = node.value if isinstance(node, SequenceNode) else [node]
        out = []
        for i, item in enumerate(items):
            at = (*path, i) if isinstance(node, SequenceNode) else path
            if not (isinstance(item, ScalarNode) and item.tag == _STR_TAG and item.value.strip()):
                self.fail(at, f"expected a file or directory name, got {_describe(item)}", item)
            value = item.value
            if self.base_dir and not os.path.isabs(value):
                value = os.path.join(self.base_dir, value)
            if not os.path.exists(value):
                self.fail(at, f"not found: {value}", item)
            out.append(value)
        return tuple(out)

    def words(self, node: Node, path: _Path, rules: Mapping[str, Any]) -> tuple[str, ...]:
        """A list of names (or one comma-separated string), such as SASL mechanisms."""
        items = node.value if isinstance(node, SequenceNode) else [node]
        out = []
        for i, item in enumerate(items):
            at = (*path, i) if isinstance(node, SequenceNode) else path
            if not (isinstance(item, ScalarNode) and item.tag == _STR_TAG):
                self.fail(at, f"expected a name, got {_describe(item)}", item)
            out += [w.strip() for w in item.value.split(",") if w.strip()]
        if rules.get("case") == "upper":
            out = [w.upper() for w in out]
        return tuple(out)

    def host_ports(self, node: Node, path: _Path) -> tuple[HostPort, ...]:
        if isinstance(node, SequenceNode):
            return tuple(self.host_port(item, (*path, i)) for i, item in enumerate(node.value))
        if not (isinstance(node, ScalarNode) and node.tag == _STR_TAG):
            self.fail(path, f"expected a list of \"HOST:PORT\" or one comma-separated string, got "
                            f"{_describe(node)}", node)
        parts = [p.strip() for p in node.value.split(",")]
        if any(not p for p in parts) and node.value.strip():
            self.fail(path, f"an empty entry in {node.value!r}", node)
        try:
            return tuple(HostPort.parse(p) for p in parts if p)
        except ValueError as e:
            self.fail(path, str(e), node)

    # -- environment variables ----------------------------------------------------------------------

    def expand(self, node: Node, path: _Path) -> Node:
        """``node`` with ``${NAME}`` references in its scalars replaced, keeping its marks."""
        if self.env is None or isinstance(node, MappingNode):
            return node  # a mapping is a section; its own values are expanded as it is built
        if isinstance(node, SequenceNode):
            items = [self.expand(item, (*path, i)) for i, item in enumerate(node.value)]
            return SequenceNode(node.tag, items, node.start_mark, node.end_mark, node.flow_style)
        if not isinstance(node, ScalarNode) or "$" not in node.value:
            return node
        env = self.env

        def replace(m: re.Match[str]) -> str:
            dollar, name, default, stray = m.groups()
            if dollar:
                return "$"
            if stray:
                self.fail(path, f"{m.string!r} has a '${{' that is not a variable reference; write ${{NAME}} or "
                                f"${{NAME:-default}}, and $$ for a literal $", node)
            value = env.get(name)
            if default is not None and not value:
                return default.replace("$$", "$")  # like the shell's ${NAME:-default}: unset or empty
            if value is None:
                self.fail(path, f"environment variable {name} is not set (used as ${{{name}}}); set it, or "
                                f"give a default: ${{{name}:-...}}", node)
            return value

        text = _ENV_REFERENCE.sub(replace, node.value)
        tag = node.tag
        if node.style is None:
            # A plain scalar is typed by what it says once expanded: ${PORT} can be the integer 9092.
            tag = self._resolver.resolve(ScalarNode, text, (True, False))
        return ScalarNode(tag, text, node.start_mark, node.end_mark, node.style)


# --------------------------------------------------------------------------------------------------
# Small pieces the loader uses
# --------------------------------------------------------------------------------------------------

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


def _may_share(a: str, b: str) -> bool:
    # Two listeners can use one port only on two distinct, specific addresses.
    return a == b or a in _WILDCARD_HOSTS or b in _WILDCARD_HOSTS


def _line(node: Node | None) -> int | None:
    mark = node.start_mark if node is not None else None
    return mark.line + 1 if mark is not None else None


def _is_null(node: Node) -> bool:
    return isinstance(node, ScalarNode) and node.tag == _NULL_TAG


def _describe(node: Node) -> str:
    if isinstance(node, MappingNode):
        return "a mapping"
    if isinstance(node, SequenceNode):
        return "a list"
    if node.tag == _NULL_TAG:
        return "nothing" if node.value in ("", "~") else node.value
    if node.tag == _STR_TAG:
        quoted = node.style in ("'", '"')
        return f"{node.value!r}" + (" (quoted, so a string)" if quoted else "")
    return str(node.value)


def _dotted(path: _Path) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def _did_you_mean(word: str, choices: typing.Iterable[str]) -> str:
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _setting_paths(cls: type[Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    """(key, dotted path) for every setting under ``cls``, nested sections included."""
    for field in attrs.fields(cls):
        if field.metadata.get(_INTERNAL):
            continue
        path = f"{prefix}{field.name}"
        yield field.name, path
        inner = field.type
        if typing.get_origin(inner) is types.UnionType:
            (inner,) = (a for a in typing.get_args(inner) if a is not type(None))
        if attrs.has(inner) and inner is not HostPort:
            yield from _setting_paths(inner, f"{path}.")


def _unknown_key_hint(key: str, cls: type[Any]) -> str:
    names = [f.name for f in attrs.fields(cls) if not f.metadata.get(_INTERNAL)]
    hint = _did_you_mean(key, names)
    if hint:
        return hint
    # A right key in the wrong section (max_frame_size at the top level) is the commonest slip.
    homes = [path.rpartition(".")[0] for name, path in _setting_paths(ProxyConfig) if name == key]
    if homes:
        return f" (it belongs {' or '.join(f'under {h!r}' if h else 'at the top level' for h in homes)})"
    return f" (expected one of: {', '.join(names)})"


_REPRESENTER: Final = yaml.representer.SafeRepresenter()


def _node_of(value: object) -> Node:
    """A YAML node (without marks) for a Python value, so quick mode goes through the file's checks."""
    cls = type(value)
    if cls is HostPort:
        value = str(value)
    elif attrs.has(cls):
        value = {f.name: getattr(value, f.name) for f in attrs.fields(cls)}
    if isinstance(value, Mapping):
        return MappingNode("tag:yaml.org,2002:map", [(_node_of(k), _node_of(v)) for k, v in value.items()])
    if isinstance(value, list | tuple):
        return SequenceNode("tag:yaml.org,2002:seq", [_node_of(v) for v in value])
    return _REPRESENTER.represent_data(value)


def effective_workers(cfg: ProxyConfig, cgroup_dir: str = "/sys/fs/cgroup") -> int:
    """``cfg.workers``, with ``auto`` (0) resolved: the CPUs this process may use, capped by a cgroup
    CPU quota (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us``) when one is set."""
    if cfg.workers:
        return cfg.workers
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_cpus(cgroup_dir)
    return max(1, min(cpus, quota)) if quota is not None else max(1, cpus)


def _cgroup_cpus(cgroup_dir: str) -> int | None:
    try:
        with open(os.path.join(cgroup_dir, "cpu.max"), encoding="ascii") as f:
            limit_text, period_text = f.read().split()[:2]
        if limit_text != "max":
            return math.ceil(int(limit_text) / int(period_text))
        return None
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(cgroup_dir, "cpu", "cpu.cfs_quota_us"), encoding="ascii") as f:
            quota = int(f.read())
        with open(os.path.join(cgroup_dir, "cpu", "cpu.cfs_period_us"), encoding="ascii") as f:
            period = int(f.read())
        return math.ceil(quota / period) if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None

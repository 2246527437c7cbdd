"""The proxy's settings: attrs frozen classes, loaded from YAML and validated before anything starts.

Every mistake is a ``ConfigError`` naming the file, the 1-based line of the offending key or value,
and the reason; unknown keys are errors with a "did you mean". This module reads the config file and
checks that the TLS files it names exist; it must not open sockets, load certificates or start tasks.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import sys
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any, Final, NoReturn

import attrs
import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from kproxy.protocol.compiler import codec_implementation
from kproxy.protocol.errors import ConfigError

_MAX_PORT: Final = 65535
_WILDCARD_HOSTS: Final = frozenset({"0.0.0.0", "::"})

# Field metadata keys. _RULES holds the per-value checks the loader applies at the value's line;
# _INTERNAL marks a field that is not a setting (it cannot be written in YAML).
_RULES: Final = "kproxy.rules"
_INTERNAL: Final = "kproxy.internal"


def _setting(default: Any = attrs.NOTHING, **rules: Any) -> Any:
    """An attrs field whose ``rules`` (min, above, max, choices, upper, name, file) the loader checks."""
    return attrs.field(default=default, metadata={_RULES: rules})


@attrs.frozen
class HostPort:
    """A host and a TCP port. IPv6 hosts are held without brackets and printed with them."""

    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> HostPort:
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
        if any(c.isspace() for c in host) or "/" in host:
            raise ValueError(f"{host!r} is not a host name or address")
        if not (port_text.isascii() and port_text.isdigit()):
            raise ValueError(f"port {port_text!r} in {text!r} is not a number")
        port = int(port_text)
        if not 1 <= port <= _MAX_PORT:
            raise ValueError(f"port {port} in {text!r} is outside 1..{_MAX_PORT}")
        return cls(host, port)

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@attrs.frozen
class TlsClientSide:
    """TLS from kproxy to the brokers (origination)."""

    enabled: bool = False
    ca_file: str | None = _setting(None, file=True)
    cert_file: str | None = _setting(None, file=True)
    key_file: str | None = _setting(None, file=True)
    server_hostname: str | None = _setting(None, name="host")
    verify: bool = True


@attrs.frozen
class UpstreamConfig:
    """The real cluster: where to bootstrap, how to reach it, how long to wait for it."""

    bootstrap_servers: tuple[HostPort, ...]
    tls: TlsClientSide = TlsClientSide()
    connect_timeout_s: float = _setting(10.0, above=0)
    # A request with no response after this gets a retriable error sent back to the client.
    request_timeout_s: float = _setting(30.0, above=0)


@attrs.frozen
class SniConfig:
    """Names for SNI routing: brokers are ``broker-<node_id>.<domain>``, bootstrap ``<bootstrap_name>.<domain>``."""

    domain: str = _setting(name="domain")
    bootstrap_name: str = _setting("bootstrap", name="label")


@attrs.frozen
class ExposureConfig:
    """How brokers are presented to clients: one port each, or one port with SNI names."""

    mode: str = _setting("port_per_broker", choices=("port_per_broker", "sni"))
    advertised_host: str | None = _setting(None, name="host")  # None: the listen host
    broker_port_start: int | None = _setting(None, min=1, max=_MAX_PORT)  # None: listen port + 1
    broker_port_count: int = _setting(64, min=1, max=_MAX_PORT)
    # None: ports handed out in order of discovery; an int: port = start + node_id - node_id_base.
    node_id_base: int | None = _setting(None, min=0)
    sni: SniConfig | None = None


@attrs.frozen
class TlsServerSide:
    """TLS from clients to kproxy (termination); mTLS when ``require_client_cert``."""

    enabled: bool = False
    cert_file: str | None = _setting(None, file=True)
    key_file: str | None = _setting(None, file=True)
    ca_file: str | None = _setting(None, file=True)
    require_client_cert: bool = False


@attrs.frozen
class LimitsConfig:
    """Bounds on what one connection may make kproxy hold; sizes in bytes, durations in seconds."""

    max_frame_size: int = _setting(104857600, min=1)
    max_in_flight_requests: int = _setting(256, min=1)  # per client connection
    max_buffered_bytes: int = _setting(67108864, min=1)  # per connection, before backpressure
    max_decompressed_batch_bytes: int = _setting(268435456, min=1)
    # Only applies when the broker requires SASL and the connection never authenticates.
    unauthenticated_idle_timeout_s: float = _setting(30.0, above=0)
    idle_timeout_s: float = _setting(0.0, min=0)  # 0: no idle timeout
    drain_timeout_s: float = _setting(10.0, min=0)


@attrs.frozen
class AdminConfig:
    """The admin HTTP listener (health, metrics); off when ``listen`` is None."""

    listen: HostPort | None = None


@attrs.frozen
class ProxyConfig:
    """Everything kproxy needs to run. Build it with ``load_config`` or ``config_from_args``."""

    listen: HostPort
    upstream: UpstreamConfig
    mode: str = _setting("gateway", choices=("gateway", "sidecar"))
    exposure: ExposureConfig = ExposureConfig()
    tls: TlsServerSide = TlsServerSide()
    limits: LimitsConfig = LimitsConfig()
    passthrough_unknown_versions: bool = False
    admin: AdminConfig = AdminConfig()
    log_level: str = _setting("INFO", upper=True, choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"))
    source: str | None = attrs.field(default=None, metadata={_INTERNAL: True})  # file loaded from

    @property
    def advertised_host(self) -> str:
        """The host clients are told to connect to; a sidecar is always reached on localhost."""
        if self.mode == "sidecar":
            return "localhost"
        return self.exposure.advertised_host or self.listen.host

    @property
    def broker_port_start(self) -> int:
        """The first per-broker port (port_per_broker mode)."""
        start = self.exposure.broker_port_start
        return self.listen.port + 1 if start is None else start


_SECTIONS: Final = (
    HostPort, TlsClientSide, UpstreamConfig, SniConfig, ExposureConfig, TlsServerSide, LimitsConfig,
    AdminConfig, ProxyConfig,
)
for _cls in _SECTIONS:
    # The annotations are strings (PEP 563); the loader dispatches on the real types.
    attrs.resolve_types(_cls)


# --------------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------------


def load_config(path: str | os.PathLike[str]) -> ProxyConfig:
    """Read and validate the YAML file at ``path``. Relative TLS file paths are taken from its directory."""
    file = os.fspath(path)
    try:
        with open(file, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read the file: {e.strerror or e}", file=file) from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"not UTF-8 text (byte {e.start})", file=file) from None
    return _load(text, file, os.path.dirname(file))


def parse_config(text: str, source: str = "<string>") -> ProxyConfig:
    """Validate YAML ``text``; errors name ``source``. Relative TLS file paths are taken from the cwd."""
    return _load(text, source, None)


def config_from_args(upstream: str, listen: str, **overrides: object) -> ProxyConfig:
    """Quick mode (``kproxy run --upstream H:P[,H:P] --listen H:P``): defaults for everything else.

    ``overrides`` are the other top-level settings (``mode="sidecar"``, ``log_level="DEBUG"``); a
    section may be given as its object or as a mapping of its keys (``exposure={"advertised_host":
    "kp"}``), and None means "not given". They pass through the same checks as a file; errors carry
    no file or line.
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
    return _Builder(file=None, base_dir=None).build(MappingNode("tag:yaml.org,2002:map", pairs))


def check_config_file(path: str) -> int:
    """``kproxy check FILE``: print an ``ok:`` summary and return 0, or print the error to stderr and return 2."""
    try:
        cfg = load_config(path)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    print(f"ok: {path}: {describe_config(cfg)}")
    return 0


def describe_config(cfg: ProxyConfig) -> str:
    """A one-line summary of what ``cfg`` will do, for ``kproxy check`` and the startup log."""
    exp = cfg.exposure
    if exp.mode == "sni":
        domain = exp.sni.domain if exp.sni is not None else "?"
        brokers = f"SNI names broker-<node_id>.{domain} on port {cfg.listen.port}"
    else:
        start = cfg.broker_port_start
        brokers = f"brokers on ports {start}-{start + exp.broker_port_count - 1}"
    parts = [
        f"listen {cfg.listen} -> upstream {','.join(map(str, cfg.upstream.bootstrap_servers))}",
        f"{cfg.mode}, advertised as {cfg.advertised_host}, {brokers}",
        f"client TLS {_on_off(cfg.tls.enabled)}{' (mTLS)' if cfg.tls.require_client_cert else ''}",
        f"upstream TLS {_on_off(cfg.upstream.tls.enabled)}",
        f"admin {cfg.admin.listen or 'off'}",
        f"codec {codec_implementation()}",
    ]
    return "; ".join(parts)


def _on_off(flag: bool) -> str:
    return "on" if flag else "off"


def _load(text: str, file: str, base_dir: str | None) -> ProxyConfig:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        raise _yaml_error(e, file) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"not valid YAML: {e}", file=file) from None
    if node is None or (isinstance(node, ScalarNode) and node.tag == _NULL_TAG and not node.value):
        raise ConfigError("the file is empty; it needs at least 'listen' and 'upstream'", file=file, line=1)
    cfg = _Builder(file=file, base_dir=base_dir).build(node)
    return attrs.evolve(cfg, source=file)


def _yaml_error(e: yaml.MarkedYAMLError, file: str | None) -> ConfigError:
    # The problem mark is where the parser gave up, which is the line a person has to look at.
    mark = e.problem_mark or e.context_mark
    reason = " ".join(p for p in (e.context, e.problem) if p)
    return ConfigError(f"YAML syntax error: {reason}", file=file, line=mark.line + 1 if mark else None)


# --------------------------------------------------------------------------------------------------
# The loader: YAML node tree -> attrs objects, driven by the fields' types and rules
# --------------------------------------------------------------------------------------------------

_NULL_TAG: Final = "tag:yaml.org,2002:null"
_STR_TAG: Final = "tag:yaml.org,2002:str"
_MERGE_TAG: Final = "tag:yaml.org,2002:merge"

_Path = tuple[str | int, ...]

_EXPECTED: Final[Mapping[type, str]] = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
}


class _Builder:
    """Turns one composed YAML tree into a ProxyConfig, remembering the line of every key it saw."""

    def __init__(self, file: str | None, base_dir: str | None) -> None:
        self.file = file
        self.base_dir = base_dir
        self.lines: dict[_Path, int] = {}
        self._scalars = yaml.constructor.SafeConstructor()

    def build(self, node: Node) -> ProxyConfig:
        if not isinstance(node, MappingNode):
            self.fail((), f"the top level must be a mapping of settings, got {_describe(node)}", node)
        line = _line(node)
        if line is not None:
            self.lines[()] = line
        cfg = self.section(ProxyConfig, node, ())
        self.check(cfg)
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
            if attrs.has(field.type) and _is_null(value_node) and field.default is not attrs.NOTHING:
                # "tls:" with everything under it commented out means the defaults.
                values[key] = field.default
            else:
                values[key] = self.value(field.type, value_node, sub, field.metadata.get(_RULES, {}))

        for name, field in fields.items():
            if name not in values and field.default is attrs.NOTHING:
                # Point at the section's own key ("upstream:"), not at its first child.
                self.fail(path, f"missing required key {name!r}", line=self.lines.get(path, _line(node)))
        return cls(**values)

    def value(self, tp: Any, node: Node, path: _Path, rules: Mapping[str, Any]) -> Any:
        origin = typing.get_origin(tp)
        if origin is types.UnionType or origin is typing.Union:
            # Every union in the config classes is "X | None".
            (inner,) = (a for a in typing.get_args(tp) if a is not type(None))
            return None if _is_null(node) else self.value(inner, node, path, rules)
        if tp is HostPort:
            return self.host_port(node, path)
        if origin is tuple:
            return self.host_ports(node, path)  # tuple[HostPort, ...] is the only tuple setting
        if attrs.has(tp):
            return self.section(tp, node, path)
        return self.apply_rules(self.scalar(tp, node, path), node, path, rules)

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
        return float(value) if tp is float else value

    def apply_rules(self, value: Any, node: Node, path: _Path, rules: Mapping[str, Any]) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            self.fail(path, f"must be a finite number, got {_describe(node)}", node)
        if rules.get("upper"):
            value = value.upper()
        choices = rules.get("choices")
        if choices is not None and value not in choices:
            hint = _did_you_mean(str(value), choices)
            self.fail(path, f"must be one of {', '.join(choices)}; got {value!r}{hint}", node)
        if "min" in rules and value < rules["min"]:
            self.fail(path, f"must be at least {rules['min']}, got {value}", node)
        if "above" in rules and value <= rules["above"]:
            self.fail(path, f"must be greater than {rules['above']}, got {value}", node)
        if "max" in rules and value > rules["max"]:
            self.fail(path, f"must be at most {rules['max']}, got {value}", node)
        if "name" in rules:
            problem = _name_problem(rules["name"], value)
            if problem:
                self.fail(path, problem, node)
        if rules.get("file"):
            if not value.strip():
                self.fail(path, "an empty file name; leave the key out or write null", node)
            # Relative to the config file, so the same file works from any cwd (as a mounted Secret).
            if self.base_dir and not os.path.isabs(value):
                value = os.path.join(self.base_dir, value)
        return value

    def host_port(self, node: Node, path: _Path) -> HostPort:
        if not (isinstance(node, ScalarNode) and node.tag == _STR_TAG):
            # Unquoted 10:30 is a YAML 1.1 base-60 integer, hence the advice to quote.
            self.fail(path, f"expected \"HOST:PORT\" (quoted if it looks like a number), got {_describe(node)}",
                      node)
        try:
            return HostPort.parse(node.value)
        except ValueError as e:
            self.fail(path, str(e), node)

    def host_ports(self, node: Node, path: _Path) -> tuple[HostPort, ...]:
        if isinstance(node, SequenceNode):
            result = tuple(self.host_port(item, (*path, i)) for i, item in enumerate(node.value))
        elif isinstance(node, ScalarNode) and node.tag == _STR_TAG:
            parts = [p.strip() for p in node.value.split(",")]
            if any(not p for p in parts) and node.value.strip():
                self.fail(path, f"an empty entry in {node.value!r}", node)
            try:
                result = tuple(HostPort.parse(p) for p in parts if p)
            except ValueError as e:
                self.fail(path, str(e), node)
        else:
            self.fail(path, f"expected a list of \"HOST:PORT\" or one comma-separated string, got "
                            f"{_describe(node)}", node)
        if not result:
            self.fail(path, "needs at least one \"HOST:PORT\"", node)
        seen: set[HostPort] = set()
        for hp in result:
            if hp in seen:
                self.fail(path, f"lists {hp} twice", node)
            seen.add(hp)
        return result

    # -- rules that span settings -------------------------------------------------------------------

    def check(self, cfg: ProxyConfig) -> None:
        up_tls = cfg.upstream.tls
        if up_tls.enabled:
            if (up_tls.cert_file is None) != (up_tls.key_file is None):
                given, missing = ("cert_file", "key_file") if up_tls.key_file is None else ("key_file", "cert_file")
                self.fail(("upstream", "tls", given),
                          f"a client certificate needs both cert_file and key_file; upstream.tls.{missing} is not set")
            self.check_files(("upstream", "tls"), up_tls)

        tls = cfg.tls
        if tls.require_client_cert:
            if not tls.enabled:
                self.fail(("tls", "require_client_cert"), "needs tls.enabled: true")
            if tls.ca_file is None:
                self.fail(("tls", "require_client_cert"),
                          "needs tls.ca_file, the CA that signs the client certificates")
        if tls.enabled:
            for name in ("cert_file", "key_file"):
                if getattr(tls, name) is None:
                    self.fail(("tls", "enabled"), f"TLS termination needs tls.{name}")
            self.check_files(("tls",), tls)

        exp = cfg.exposure
        if exp.mode == "sni":
            if not tls.enabled:
                self.fail(("exposure", "mode"),
                          "sni needs tls.enabled: true; clients name the broker in the TLS ClientHello")
            if exp.sni is None:
                self.fail(("exposure", "mode"), "sni needs exposure.sni.domain")
        else:
            start, last = cfg.broker_port_start, cfg.broker_port_start + exp.broker_port_count - 1
            blame: _Path = ("listen",)
            if exp.broker_port_start is not None:
                blame = ("exposure", "broker_port_start")
            if last > _MAX_PORT:
                if blame == ("listen",) and ("exposure", "broker_port_count") in self.lines:
                    blame = ("exposure", "broker_port_count")
                self.fail(blame, f"broker ports {start}..{last} run past {_MAX_PORT}; lower "
                                 f"exposure.broker_port_start or exposure.broker_port_count")
            if start <= cfg.listen.port <= last:
                self.fail(blame, f"broker ports {start}..{last} include the listen port {cfg.listen.port}")

        if cfg.mode == "gateway" and exp.advertised_host is None and cfg.listen.host in _WILDCARD_HOSTS:
            self.fail(("listen",), f"clients cannot connect to {cfg.listen.host}; set "
                                   f"exposure.advertised_host to the name they reach kproxy by")

        admin = cfg.admin.listen
        if admin is not None and _may_share(admin.host, cfg.listen.host):
            taken = {cfg.listen.port}
            if exp.mode != "sni":
                taken.update(range(cfg.broker_port_start, cfg.broker_port_start + exp.broker_port_count))
            if admin.port in taken:
                self.fail(("admin", "listen"), f"port {admin.port} is already used by the Kafka listeners")

    def check_files(self, path: _Path, section: Any) -> None:
        for field in attrs.fields(type(section)):
            value = getattr(section, field.name)
            if value is None or not field.metadata.get(_RULES, {}).get("file"):
                continue
            if not os.path.exists(value):
                self.fail((*path, field.name), f"file not found: {value}")
            if not os.path.isfile(value):
                self.fail((*path, field.name), f"not a regular file: {value}")
            if not os.access(value, os.R_OK):
                self.fail((*path, field.name), f"cannot read {value} (permissions)")


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

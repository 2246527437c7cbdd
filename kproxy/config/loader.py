"""Configuration from YAML: the file, a string, or quick mode's command-line values.

The loader walks the composed YAML tree driven by the classes' field types, remembers the 1-based
line of every key, expands ``${VAR}`` and gives "did you mean" hints; the classes check the values
and the loader adds file and line to the ``SettingError`` they raise. It reads the config file and
must not open sockets, load certificates or start tasks.
"""

import os
import re
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any, Final, NoReturn

import attrs
import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from kproxy.config.checks import (
    EXPECTED,
    INTERNAL,
    RULES,
    ConfigError,
    HostPort,
    SettingError,
    SettingPath,
    did_you_mean,
    dotted,
    rebased,
)
from kproxy.config.clusters import PROCESS_SETTINGS, cluster_settings
from kproxy.config.proxy import ProxyConfig


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


def setting_line(file: str, path: SettingPath) -> int | None:
    """The 1-based line of setting ``path`` in the YAML file ``file``, or of the nearest enclosing key
    written there: for problems found after loading (a keytab without the principal it should hold)."""
    try:
        node = yaml.compose(read_text_file(file), Loader=yaml.SafeLoader)
    except (ConfigError, yaml.YAMLError):
        return None
    line = None
    for key in path:
        if isinstance(key, int):                    # an item of a list (virtual_clusters.0...)
            if not isinstance(node, SequenceNode) or key >= len(node.value):
                break
            node = node.value[key]
            line = node.start_mark.line + 1
            continue
        if not isinstance(node, MappingNode):
            break
        found = next(((k, v) for k, v in node.value if isinstance(k, ScalarNode) and k.value == key), None)
        if found is None:
            break
        line, node = _line(found[0]), found[1]
    return line


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
    names = {f.name for f in attrs.fields(ProxyConfig) if not f.metadata.get(INTERNAL)}
    for key in given:
        if key not in names:
            raise ConfigError(f"unknown setting {key!r}{_unknown_key_hint(key, ProxyConfig)}")
    if cfg.virtual_clusters and given:
        # Every virtual cluster carries the process-wide settings, and a cluster setting given here
        # is each one's: the root and its clusters change together.
        given["virtual_clusters"] = tuple(attrs.evolve(vc, **given) for vc in cfg.virtual_clusters)
    return attrs.evolve(cfg, **given)


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
    # Each virtual cluster knows its file too (its default state file sits beside it).
    clusters = tuple(attrs.evolve(vc, source=file) for vc in cfg.virtual_clusters)
    return attrs.evolve(cfg, source=file, virtual_clusters=clusters)


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
        self.lines: dict[SettingPath, int] = {}
        self._scalars = yaml.constructor.SafeConstructor()
        self._resolver = yaml.resolver.Resolver()

    def build(self, node: Node) -> ProxyConfig:
        if not isinstance(node, MappingNode):
            self.fail((), f"the top level must be a mapping of settings, got {_describe(node)}", node)
        line = _line(node)
        if line is not None:
            self.lines[()] = line
        if any(isinstance(k, ScalarNode) and k.value == "virtual_clusters" for k, _ in node.value):
            return self.clusters(node)
        cfg: ProxyConfig = self.section(ProxyConfig, node, ())
        return cfg

    def clusters(self, node: MappingNode) -> ProxyConfig:
        """A file with ``virtual_clusters``: each entry is built as a whole ProxyConfig from its own
        keys and the top level's process-wide ones, then the root checks them together."""
        process: list[tuple[Node, Node]] = []
        entries: Node | None = None
        own = set(cluster_settings(ProxyConfig))
        for key_node, value_node in self.pairs(node, ()):
            key = key_node.value
            if key == "virtual_clusters":
                entries = value_node
                key_line = _line(key_node)
                if key_line is not None:
                    self.lines[(key,)] = key_line
            elif key in own:
                self.fail((key,), "belongs to a virtual cluster: with virtual_clusters, set it in each entry (or "
                                  "remove virtual_clusters for the single-cluster form)", key_node)
            else:
                process.append((key_node, value_node))
        assert entries is not None
        entries = self.expand(entries, ("virtual_clusters",))
        if not isinstance(entries, SequenceNode):
            self.fail(("virtual_clusters",), f"expected a list of virtual clusters, got {_describe(entries)}",
                      entries)
        if not entries.value:
            self.fail(("virtual_clusters",), "needs at least one virtual cluster", entries)
        clusters = [self.cluster(item, i, process) for i, item in enumerate(entries.value)]
        try:
            return ProxyConfig.of_clusters(clusters)
        except SettingError as e:
            self.fail(e.path, e.problem)

    def cluster(self, item: Node, index: int, process: list[tuple[Node, Node]]) -> ProxyConfig:
        path: SettingPath = ("virtual_clusters", index)
        line = _line(item)
        if line is not None:
            self.lines[path] = line
        if not isinstance(item, MappingNode):
            self.fail(path, f"expected a mapping of settings (a virtual cluster), got {_describe(item)}", item)
        pairs = self.pairs(item, path)
        name: str | None = None
        for key_node, value_node in pairs:
            key = key_node.value
            if key in PROCESS_SETTINGS:
                self.fail((*path, key), "is process-wide: set it once at the top level, not in a virtual cluster",
                          key_node)
            if key == "virtual_clusters":
                self.fail((*path, key), "virtual clusters do not nest", key_node)
            if key == "name" and isinstance(value_node, ScalarNode):
                name = value_node.value
        sub = _ClusterBuilder(self, path, name)
        merged = MappingNode(item.tag, [*process, *pairs], item.start_mark, item.end_mark)
        cfg: ProxyConfig = sub.section(ProxyConfig, merged, ())
        for at, at_line in sub.lines.items():
            if at and at[0] not in PROCESS_SETTINGS:
                self.lines[(*path, *at)] = at_line
        return cfg

    # -- errors -------------------------------------------------------------------------------------

    def fail(self, path: SettingPath, reason: str, node: Node | None = None, line: int | None = None) -> NoReturn:
        if line is None:
            line = _line(node) if node is not None else self.line_of(path)
        raise ConfigError(f"{dotted(path)}: {reason}" if path else reason, file=self.file, line=line)

    def line_of(self, path: SettingPath) -> int | None:
        # A setting left at its default has no line; point at the nearest enclosing key instead.
        while path not in self.lines and path:
            path = path[:-1]
        return self.lines.get(path)

    # -- structure ----------------------------------------------------------------------------------

    def pairs(self, node: MappingNode, path: SettingPath) -> list[tuple[ScalarNode, Node]]:
        """The (key, value) nodes of a mapping of settings, anchors merged, every key a name."""
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
        out: dict[str, tuple[ScalarNode, Node]] = {}
        for key_node, value_node in node.value:
            if not (isinstance(key_node, ScalarNode) and key_node.tag == _STR_TAG):
                self.fail(path, f"keys must be names, got {_describe(key_node)}", key_node)
            # A key written beside a merge key overrides the merged one (flattening put it last).
            out.pop(key_node.value, None)
            out[key_node.value] = (key_node, value_node)
        return list(out.values())

    def section(self, cls: type[Any], node: Node, path: SettingPath) -> Any:
        if not isinstance(node, MappingNode):
            self.fail(path, f"expected a mapping of settings, got {_describe(node)}", node)
        fields = {f.name: f for f in attrs.fields(cls) if not f.metadata.get(INTERNAL)}
        values: dict[str, Any] = {}
        for key_node, value_node in self.pairs(node, path):
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
                values[key] = self.value(field.type, value_node, sub, field.metadata.get(RULES, {}))

        for name, field in fields.items():
            if name not in values and field.default is attrs.NOTHING:
                # Point at the section's own key ("upstream:"), not at its first child.
                self.fail(path, f"missing required key {name!r}", line=self.lines.get(path, _line(node)))
        try:
            return cls(**values)
        except SettingError as e:
            self.fail(rebased(e.path, cls, path), e.problem)

    def value(self, tp: Any, node: Node, path: SettingPath, rules: Mapping[str, Any]) -> Any:
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
            item = typing.get_args(tp)[0]
            if item is str:
                return self.strings(node, path) if rules.get("text") else self.paths(node, path)
            if attrs.has(item) and item is not HostPort:
                return self.sections(item, node, path)
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

    def scalar(self, tp: type, node: Node, path: SettingPath) -> Any:
        expected = EXPECTED[tp]
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

    def sections(self, cls: type[Any], node: Node, path: SettingPath) -> tuple[Any, ...]:
        """A list of sections (``upstream.clusters``), each item's errors named by its index."""
        if not isinstance(node, SequenceNode):
            self.fail(path, f"expected a list, got {_describe(node)}", node)
        out = []
        for i, item in enumerate(node.value):
            line = _line(item)
            if line is not None:
                self.lines[(*path, i)] = line
            out.append(self.section(cls, item, (*path, i)))
        return tuple(out)

    def mapping(self, value_type: type, node: Node, path: SettingPath) -> dict[str, Any]:
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

    def host_port(self, node: Node, path: SettingPath) -> HostPort:
        if not (isinstance(node, ScalarNode) and node.tag == _STR_TAG):
            # Unquoted 10:30 is a YAML 1.1 base-60 integer, hence the advice to quote.
            self.fail(path, f"expected \"HOST:PORT\" (quoted if it looks like a number), got {_describe(node)}",
                      node)
        try:
            return HostPort.parse(node.value)
        except ValueError as e:
            self.fail(path, str(e), node)

    def strings(self, node: Node, path: SettingPath) -> tuple[str, ...]:
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

    def paths(self, node: Node, path: SettingPath) -> tuple[str, ...]:
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

    def words(self, node: Node, path: SettingPath, rules: Mapping[str, Any]) -> tuple[str, ...]:
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

    def host_ports(self, node: Node, path: SettingPath) -> tuple[HostPort, ...]:
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

    def expand(self, node: Node, path: SettingPath) -> Node:
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


class _ClusterBuilder(_Builder):
    """Builds one entry of ``virtual_clusters`` as a whole ProxyConfig (its keys and the top level's
    process-wide ones) and names the setting in errors: ``virtual_clusters[1].listen`` for the
    entry's own, the top-level name with the virtual cluster's for a process-wide one."""

    def __init__(self, parent: _Builder, path: SettingPath, name: str | None) -> None:
        super().__init__(parent.file, parent.base_dir, parent.env)
        self.path = path
        self.name = name
        # A process-wide setting's line is the top level's; the entry's own keys are added as read.
        self.lines = {at[len(path):] if at[:len(path)] == path else at: line for at, line in parent.lines.items()
                      if at[:len(path)] == path or (at and at[0] in PROCESS_SETTINGS)}

    def fail(self, path: SettingPath, reason: str, node: Node | None = None, line: int | None = None) -> NoReturn:
        if line is None:
            line = _line(node) if node is not None else self.line_of(path)
        if path and path[0] in PROCESS_SETTINGS:
            which = repr(self.name) if self.name else dotted(self.path)
            raise ConfigError(f"{dotted(path)}: {reason} (in virtual cluster {which})", file=self.file, line=line)
        raise ConfigError(f"{dotted((*self.path, *path))}: {reason}", file=self.file, line=line)


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


def _setting_paths(cls: type[Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    """(key, dotted path) for every setting under ``cls``, nested sections included."""
    for field in attrs.fields(cls):
        if field.metadata.get(INTERNAL):
            continue
        path = f"{prefix}{field.name}"
        yield field.name, path
        inner = field.type
        if typing.get_origin(inner) is types.UnionType:
            (inner,) = (a for a in typing.get_args(inner) if a is not type(None))
        if attrs.has(inner) and inner is not HostPort:
            yield from _setting_paths(inner, f"{path}.")


def _unknown_key_hint(key: str, cls: type[Any]) -> str:
    names = [f.name for f in attrs.fields(cls) if not f.metadata.get(INTERNAL)]
    hint = did_you_mean(key, names)
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

"""Rule files in, a compiled ``RuleSet`` out, or a ``RuleError`` that names every problem.

A file is read with ``yaml.compose`` so every value keeps its line and column, checked against the
JSON Schema (``kproxy.policy.schema``), then checked for what a schema cannot say (unique names,
regular expressions that compile, CIDRs, version ranges, what each action needs) and compiled.
Nothing is half-loaded: any problem in any file fails the whole load. This module reads files; it
starts no tasks and keeps no state.
"""

from __future__ import annotations

import difflib
import glob
import ipaddress
import json
import logging
import os
import re
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import jsonschema
import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from kproxy.config import ConfigError
from kproxy.policy import model as M
from kproxy.policy.schema import rules_schema
from kproxy.protocol.errors import ERROR_CODES_BY_NAME, is_retriable

Path = tuple[str | int, ...]

_MAX_VALUES = 200_000     # values a rule file may hold once its aliases are expanded


class _TooBig(Exception):
    def __init__(self, path: Path) -> None:
        self.path = path


_LOG_LEVELS = {"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING,
               "ERROR": logging.ERROR}
_MERGE_TAG = "tag:yaml.org,2002:merge"
_STR_TAG = "tag:yaml.org,2002:str"
_QUOTA_NUMBERS = frozenset({*M.QUOTA_LIMITS, "burst_s"})
_TEMPLATE = re.compile(r"\$\{([^}]*)\}")
_EXPONENT = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)[eE][-+]?\d+")


@attrs.frozen
class RuleProblem:
    """One problem: where it is, which rule it concerns, and why."""

    file: str
    line: int | None
    column: int | None
    rule: str | None
    reason: str

    def __str__(self) -> str:
        where = self.file
        if self.line is not None:
            where += f":{self.line}" + (f":{self.column}" if self.column is not None else "")
        return f"{where}: {self.rule + ': ' if self.rule else ''}{self.reason}"


class RuleError(ConfigError):
    """Rule files that do not load. ``problems`` holds every problem found, one line each."""

    def __init__(self, problems: Sequence[RuleProblem]) -> None:
        self.problems = tuple(problems)
        first = self.problems[0]
        self.reason, self.file, self.line = first.reason, first.file, first.line
        self.column, self.rule = first.column, first.rule
        Exception.__init__(self, "\n".join(str(p) for p in self.problems))


def rule_files(paths: Iterable[str]) -> list[str]:
    """The files ``paths`` name: a file as itself, a directory as its ``*.yaml`` in name order.

    Hidden entries are skipped, so a Kubernetes ConfigMap's ``..data`` and timestamped directories
    are never read twice; the visible names are symlinks through ``..data`` and resolve to the
    current version.
    """
    out = []
    for path in paths:
        if os.path.isdir(path):
            out += sorted(glob.glob(os.path.join(glob.escape(path), "*.yaml")))
        else:
            out.append(path)
    return out


def load_rules(paths: Sequence[str], chaos: bool = False) -> M.RuleSet:
    """Load every rule file ``paths`` name (files or directories), in order, as one rule set.

    ``chaos`` is kproxy.yaml's ``chaos`` setting: without it chaos rules load but do nothing (a
    warning says so). Raises RuleError listing every problem in every file.
    """
    problems: list[RuleProblem] = []
    warnings: list[str] = []
    rules: list[M.Rule] = []
    quotas: list[M.QuotaRule] = []
    default: tuple[str, str] | None = None      # (action, where it was set)
    seen: dict[str, dict[str, str]] = {"rules": {}, "quotas": {}}
    files = rule_files(paths)
    for path in paths:
        if os.path.isdir(path) and not rule_files([path]):
            warnings.append(f"{path}: no *.yaml files in this directory")
    for file in files:
        parsed = _File(file)
        parsed.load()
        problems += parsed.problems
        for section, names in seen.items():
            # Rule names and quota names are each unique (budgets are kept by quota name).
            for position, name in parsed.names(section):
                first = names.get(name)
                if first is not None:
                    problems.append(parsed.problem((section, position, "name"),
                                                   f"the name {name!r} is already used at {first}"))
                names.setdefault(name, parsed.where((section, position)))
        if parsed.problems:
            continue
        for rule in parsed.rules:
            if rule.action == "chaos" and not chaos:
                warnings.append(f"{rule.where}: rule {rule.name!r}: chaos is off (enable it with chaos: "
                                "true in kproxy.yaml, or kproxy run --chaos); this rule does nothing")
        for quota in parsed.quotas:
            if not quota.limits:
                warnings.append(f"{quota.where}: quota {quota.name!r} sets no limit "
                                f"({', '.join(M.QUOTA_LIMITS)}); it does nothing")
        rules += parsed.rules
        quotas += parsed.quotas
        if parsed.default is not None:
            where = parsed.where(("default",))
            if default is not None and default[0] != parsed.default:
                problems.append(parsed.problem(("default",), f"default {parsed.default} contradicts "
                                                             f"default {default[0]} at {default[1]}"))
            default = default or (parsed.default, where)
    if problems:
        raise RuleError(problems)
    return M.RuleSet(tuple(rules), default[0] if default else "allow", tuple(quotas), tuple(files), chaos,
                     tuple(warnings))


def describe_rules(rule_set: M.RuleSet) -> str:
    """One line about a loaded rule set, for ``kproxy check`` and the reload log."""
    actions: dict[str, int] = {}
    for rule in rule_set.rules:
        actions[rule.action] = actions.get(rule.action, 0) + 1
    counts = ", ".join(f"{n} {a}" for a, n in actions.items())
    files = len(rule_set.sources)
    n = len(rule_set.rules)
    q = len(rule_set.quotas)
    quotas = f", {q} quota{'s' * (q != 1)}" if q else ""
    return (f"{n} rule{'s' * (n != 1)} ({counts or 'none'}){quotas} from {files} file{'s' * (files != 1)}, "
            f"default {rule_set.default}, chaos {'on' if rule_set.chaos_enabled else 'off'}")


def check_rules_files(paths: Sequence[str], chaos: bool = False) -> int:
    """``kproxy check --rules PATH``: print ``ok: ...`` and return 0, or print the problems and return 2."""
    try:
        rule_set = load_rules(paths, chaos)
    except RuleError as e:
        print(e, file=sys.stderr)
        return 2
    for warning in rule_set.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(f"ok: {', '.join(paths)}: {describe_rules(rule_set)}")
    return 0


# --------------------------------------------------------------------------------------------------
# One file


_VALIDATOR: jsonschema.protocols.Validator | None = None


def _validator() -> jsonschema.protocols.Validator:
    global _VALIDATOR
    if _VALIDATOR is None:
        schema = rules_schema()
        cls = jsonschema.validators.validator_for(schema)
        cls.check_schema(schema)
        _VALIDATOR = cls(schema)
    return _VALIDATOR


class _File:
    """One rule file: its data with the line and column of every value and key."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.marks: dict[Path, tuple[int, int]] = {}
        self.key_marks: dict[Path, tuple[int, int]] = {}
        self.problems: list[RuleProblem] = []
        self.data: Any = None
        self.rules: list[M.Rule] = []
        self.quotas: list[M.QuotaRule] = []
        self.positions: list[int] = []      # each rule's index in the file's rules list
        self.default: str | None = None
        self._scalars = yaml.constructor.SafeConstructor()
        self._values = 0

    def names(self, section: str = "rules") -> list[tuple[int, str]]:
        """(position, name) of every rule (or quota) that has a name, compiled or not."""
        items = self.data.get(section) if isinstance(self.data, dict) else None
        if not isinstance(items, list):
            return []
        return [(i, r["name"]) for i, r in enumerate(items)
                if isinstance(r, dict) and isinstance(r.get("name"), str) and r["name"]]

    # -- errors

    def where(self, path: Path, key: bool = False) -> str:
        line, column = self._mark(path, key)
        return f"{self.file}:{line}:{column}" if line is not None else self.file

    def _mark(self, path: Path, key: bool = False) -> tuple[int | None, int | None]:
        if key and path in self.key_marks:
            return self.key_marks[path]
        while path not in self.marks and path:
            path = path[:-1]
        return self.marks.get(path, (None, None))

    def _rule_label(self, path: Path) -> str | None:
        if len(path) >= 2 and path[0] in ("rules", "quotas") and isinstance(path[1], int):
            kind = "rule" if path[0] == "rules" else "quota"
            items = self.data.get(path[0]) if isinstance(self.data, dict) else None
            item = items[path[1]] if isinstance(items, list) and path[1] < len(items) else None
            name = item.get("name") if isinstance(item, dict) else None
            return f"{kind} {name!r}" if isinstance(name, str) and name else f"{path[0]}[{path[1]}]"
        return None

    def problem(self, path: Path, reason: str, key: bool = False, at: Path | None = None) -> RuleProblem:
        """A problem with the value at ``path`` (the key at ``at``, when the key itself is the problem)."""
        line, column = self._mark(at, True) if at is not None else self._mark(path, key)
        where = _dotted(path[2:] if self._rule_label(path) else path)
        return RuleProblem(self.file, line, column, self._rule_label(path),
                           f"{where}: {reason}" if where else reason)

    def fail(self, path: Path, reason: str, key: bool = False, at: Path | None = None) -> None:
        self.problems.append(self.problem(path, reason, key, at))

    # -- reading

    def load(self) -> None:
        try:
            with open(self.file, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            self.problems.append(RuleProblem(self.file, None, None, None,
                                             f"cannot read the file: {e.strerror or e}"))
            return
        except UnicodeDecodeError as e:
            self.problems.append(RuleProblem(self.file, None, None, None, f"not UTF-8 text (byte {e.start})"))
            return
        try:
            node = yaml.compose(text, Loader=yaml.SafeLoader)
        except yaml.MarkedYAMLError as e:
            mark = e.problem_mark or e.context_mark
            reason = " ".join(p for p in (e.context, e.problem) if p)
            self.problems.append(RuleProblem(self.file, mark.line + 1 if mark else None,
                                             mark.column + 1 if mark else None, None,
                                             f"YAML syntax error: {reason}"))
            return
        except yaml.YAMLError as e:
            self.problems.append(RuleProblem(self.file, None, None, None, f"not valid YAML: {e}"))
            return
        if node is None:
            self.data = {}          # an empty file: no rules, default allow
            return
        try:
            self.data = self._build(node, ())
        except _TooBig as e:
            self.data = None
            self.fail(e.path, f"the file stands for more than {_MAX_VALUES:,} values (through YAML aliases?)")
            return
        if self.problems:
            return
        broken: set[tuple[str | int, ...]] = set()
        for error in _validator().iter_errors(self.data):
            self._schema_problem(error)
            path = tuple(error.absolute_path)
            # A rule or quota the schema refuses is not compiled; the rest still are, so one run
            # reports their problems too. A problem elsewhere stops here.
            broken.add(path[:2] if len(path) >= 2 and path[0] in ("rules", "quotas") else ())
        if () not in broken:
            self._compile(broken)
        self.problems.sort(key=lambda p: (p.line or 0, p.column or 0))

    def _build(self, node: Node, path: Path) -> Any:
        self._values += 1
        if self._values > _MAX_VALUES:
            # YAML aliases can make a small file stand for an enormous tree ("billion laughs").
            raise _TooBig(path)
        self.marks[path] = (node.start_mark.line + 1, node.start_mark.column + 1)
        if isinstance(node, MappingNode):
            seen: dict[str, int] = {}
            for key_node, _ in node.value:
                if isinstance(key_node, ScalarNode) and key_node.tag != _MERGE_TAG:
                    if key_node.value in seen:
                        self.key_marks[(*path, key_node.value)] = (key_node.start_mark.line + 1,
                                                                    key_node.start_mark.column + 1)
                        self.fail(path, f"duplicate key {key_node.value!r} (first at line {seen[key_node.value]})",
                                  at=(*path, key_node.value))
                    seen[key_node.value] = key_node.start_mark.line + 1
            try:
                self._scalars.flatten_mapping(node)
            except yaml.MarkedYAMLError as e:
                self.fail(path, f"YAML merge error: {e.problem}")
                return {}
            out: dict[str, Any] = {}
            for key_node, value_node in node.value:
                if not (isinstance(key_node, ScalarNode) and key_node.tag == _STR_TAG):
                    self.fail(path, "keys must be names")
                    continue
                key = key_node.value
                self.key_marks[(*path, key)] = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
                out[key] = self._build(value_node, (*path, key))
            return out
        if isinstance(node, SequenceNode):
            return [self._build(item, (*path, i)) for i, item in enumerate(node.value)]
        if (node.style is None and node.tag == _STR_TAG and len(path) == 3 and path[0] == "quotas"
                and path[2] in _QUOTA_NUMBERS and _EXPONENT.fullmatch(node.value)):
            # YAML 1.1 reads 1e6 (no dot, no sign) as text; a rate is naturally written so.
            return float(node.value)
        try:
            return self._scalars.construct_object(node)
        except yaml.MarkedYAMLError as e:
            self.fail(path, f"cannot read the value: {e.problem}")
            return None

    # -- schema errors, worded for people

    def _schema_problem(self, error: jsonschema.ValidationError) -> None:
        error = _deepest(error)
        path: Path = tuple(error.absolute_path)
        kind, value, schema = error.validator, error.instance, error.schema
        if kind == "additionalProperties" and isinstance(value, dict):
            known = list(schema.get("properties", {}))
            for key in value:
                if key not in known:
                    hint = _hint(key, known) or f" (expected one of: {', '.join(known)})"
                    self.fail(path, f"unknown {_key_kind(path)} {key!r}{hint}", at=(*path, key))
            return
        if kind == "enum":
            title = schema.get("title", "value")
            choices = [str(c) for c in schema["enum"]]
            hint = _hint(str(value), choices) if isinstance(value, str) else ""
            if not hint and len(choices) <= 12:
                hint = f" (expected one of: {', '.join(choices)})"
            self.fail(path, f"unknown {title} {value!r}{hint}")
            return
        if kind == "required":
            missing = [k for k in error.validator_value if not isinstance(value, dict) or k not in value]
            self.fail(path, f"missing required key {missing[0]!r}" if missing else error.message)
            return
        if kind == "type":
            self.fail(path, f"expected {_type_words(error.validator_value)}, got {_describe(value)}")
            return
        if kind == "pattern":
            if schema.get("description"):
                self.fail(path, f"{value!r} is not {schema['description']}")
            else:
                self.fail(path, f"{value!r} may only hold letters, digits, '.', '_' and '-'")
            return
        messages = {
            "minItems": "needs at least one entry",
            "minProperties": "needs at least one setting",
            "minLength": "must not be empty",
            "minimum": f"must be at least {error.validator_value}, got {value!r}",
            "exclusiveMinimum": f"must be more than {error.validator_value}, got {value!r}",
            "maximum": f"must be at most {error.validator_value}, got {value!r}",
        }
        self.fail(path, messages.get(str(kind), error.message))

    # -- compiling

    def _compile(self, broken: set[Path]) -> None:
        data = self.data
        self.default = data.get("default")
        for i, raw in enumerate(data.get("rules") or []):
            if ("rules", i) in broken:
                continue
            rule = self._rule(raw, ("rules", i))
            if rule is not None:
                self.rules.append(rule)
                self.positions.append(i)
        for i, raw in enumerate(data.get("quotas") or []):
            path: Path = ("quotas", i)
            if path not in broken:
                quota = self._quota(raw, path)
                if quota is not None:
                    self.quotas.append(quota)

    def _where(self, path: Path) -> M.Where:
        line, column = self._mark(path)
        return M.Where(self.file, line or 0, column or 0)

    def _rule(self, raw: dict[str, Any], path: Path) -> M.Rule | None:
        before = len(self.problems)
        action = raw["action"]
        for other in M.ACTIONS:
            if other in raw and other != action:
                self.fail(path, f"'{other}:' settings do nothing in a rule whose action is {action}; "
                                f"remove them", at=(*path, other))
        if action in ("rewrite", "require", "cap", "chaos", "validate", "headers", "encrypt", "mask") \
                and action not in raw:
            self.fail(path, f"action {action} needs '{action}:' settings")
        match = self._match(raw.get("match") or {}, (*path, "match"))
        params = self._params(action, raw.get(action), (*path, action))
        if action == "rewrite" and isinstance(raw.get("match"), dict) and "topic" in raw["match"]:
            self.fail((*path, "match", "topic"), "a rewrite rule cannot select topics: it sets the "
                                                 "namespace of whole requests; select clients instead "
                                                 "(client_id, principal, source, listener)", key=True)
        if action in M.RECORD_ACTIONS and match is not None and match.api is not None and not match.api(0):
            self.fail((*path, "match", "api"), f"a {action} rule acts on produced records: its api selector "
                                               "must include produce", key=True)
        if action in M.FETCH_RECORD_ACTIONS and match is not None and match.api is not None and not match.api(1):
            self.fail((*path, "match", "api"), f"a {action} rule acts on fetched records: its api selector "
                                               "must include fetch", key=True)
        if len(self.problems) > before or match is None:
            return None
        return M.Rule(raw["name"], match, action, params, self._where(path))

    def _quota(self, raw: dict[str, Any], path: Path) -> M.QuotaRule | None:
        before = len(self.problems)
        selectors = raw.get("match") or {}
        for key in M.QUOTA_UNSUPPORTED:
            if key in selectors:
                self.fail((*path, "match", key), f"a quota cannot select by {key}: budgets count whole "
                                                 "requests; select clients and APIs instead (client_id, "
                                                 "principal, source, listener, client_software, api, "
                                                 "api_version, acks)", key=True)
        match = self._match(selectors, (*path, "match"))
        if len(self.problems) > before or match is None:
            return None
        limits = {k: float(raw[k]) for k in M.QUOTA_LIMITS if k in raw}
        return M.QuotaRule(raw["name"], match, raw.get("per", "client_id"), **limits,
                           burst_s=float(raw.get("burst_s", 1.0)), where=self._where(path))

    def _params(self, action: str, raw: Any, path: Path) -> M.Params:
        raw = raw or {}
        if action == "deny":
            return M.Deny(self._error(raw.get("error"), (*path, "error")))
        if action == "rewrite":
            return M.Rewrite(raw.get("topic_prefix"), raw.get("group_prefix"), raw.get("transactional_id_prefix"))
        if action == "require":
            codecs = raw.get("compression")
            if isinstance(codecs, str):
                codecs = [codecs]
            if "uncompressed_max_bytes" in raw and not codecs:
                self.fail((*path, "uncompressed_max_bytes"), "only means something with 'compression:'")
            return M.Require(M.ACKS[str(raw["acks"])] if "acks" in raw else None, raw.get("max_batch_bytes"),
                             frozenset(M.COMPRESSIONS.index(c) for c in codecs) if codecs else None,
                             raw.get("uncompressed_max_bytes", 0))
        if action == "cap":
            return M.Cap(**raw)
        if action == "chaos":
            error = self._error(raw.get("error"), (*path, "error"))
            if error is not None and not is_retriable(error):
                self.fail((*path, "error"), f"{raw['error']} is not retriable, so clients would fail instead of "
                                            "retrying; chaos injects retriable errors such as "
                                            "NOT_LEADER_OR_FOLLOWER, REQUEST_TIMED_OUT or NETWORK_EXCEPTION")
            return M.Chaos(raw.get("rate", 1.0), self._latency(raw.get("latency_ms"), (*path, "latency_ms")),
                           error)
        if action == "validate":
            return self._validate(raw, path)
        if action == "headers":
            for name, value in (raw.get("set") or {}).items():
                for m in _TEMPLATE.finditer(value):
                    if m.group(1) not in M.HEADER_VARIABLES:
                        self.fail((*path, "set", name), f"unknown variable ${{{m.group(1)}}} (use "
                                  + ", ".join(f"${{{v}}}" for v in M.HEADER_VARIABLES) + ")")
            return M.Headers(tuple((str(k), str(v)) for k, v in (raw.get("set") or {}).items()),
                             raw.get("traceparent") == "inject")
        if action == "encrypt":
            kek = str(raw.get("kek", ""))
            for m in _TEMPLATE.finditer(kek):
                if m.group(1) != "topic":
                    self.fail((*path, "kek"), f"unknown variable ${{{m.group(1)}}} (use ${{topic}})")
            return M.Encrypt(kek, bool(raw.get("keys", False)))
        if action == "mask":
            fields = []
            for i, f in enumerate(raw.get("fields") or ()):
                parts = tuple(str(f).split("."))
                if any(not p for p in parts):
                    self.fail((*path, "fields", i), f"{f!r} is not a dotted path (card.number)")
                fields.append(parts)
            return M.Mask(tuple(fields), raw.get("with", "****"))
        if action == "log":
            return M.Log(_LOG_LEVELS[raw.get("level", "INFO")], raw.get("sample", 1.0))
        return None

    def _validate(self, raw: dict[str, Any], path: Path) -> M.Validate:
        keys = raw.get("key")
        keys = keys if isinstance(keys, list) else [keys] if keys is not None else []
        key_required = "required" in keys
        key_checks = [k for k in keys if k != "required"]
        if len(key_checks) > 1:
            self.fail((*path, "key"), "give at most one check of the key's bytes (and required)")
        return M.Validate(
            value=self._value_check(raw.get("value"), (*path, "value")),
            key=self._value_check(key_checks[0], (*path, "key")) if key_checks else None,
            key_required=key_required,
            max_record_bytes=raw.get("max_record_bytes"),
            required_headers=tuple((raw.get("headers") or {}).get("required") or ()),
            allow_null=raw.get("allow_null", True),
        )

    def _value_check(self, raw: Any, path: Path) -> M.ValueCheck | None:
        if raw is None:
            return None
        if raw == "json":
            return M.ValueCheck("json")
        if raw == "avro_schema_registry":
            return M.ValueCheck("avro_schema_registry")
        if "avro_schema_registry" in raw:
            ids = (raw["avro_schema_registry"] or {}).get("allowed_ids")
            return M.ValueCheck("avro_schema_registry", allowed_ids=frozenset(ids) if ids else None)
        at = (*path, "json_schema")
        given = raw["json_schema"]
        # Relative to the rule file, so a rules directory (a ConfigMap) carries its schemas along.
        file = given if os.path.isabs(given) else os.path.join(os.path.dirname(self.file), given)
        try:
            with open(file, encoding="utf-8") as f:
                schema = json.load(f)
        except OSError as e:
            self.fail(at, f"cannot read the JSON Schema {file}: {e.strerror or e}")
            return None
        except (ValueError, UnicodeDecodeError) as e:
            self.fail(at, f"{file} is not JSON: {e}")
            return None
        if not isinstance(schema, dict | bool):
            self.fail(at, f"{file} is not a JSON Schema (a JSON object)")
            return None
        cls = jsonschema.validators.validator_for(schema)
        try:
            cls.check_schema(schema)
        except jsonschema.SchemaError as e:
            where = "/".join(str(p) for p in e.absolute_path) or "the top level"
            self.fail(at, f"{file} is not a valid JSON Schema (at {where}: {e.message})")
            return None
        return M.ValueCheck("json_schema", file, cls(schema))

    def _error(self, name: str | None, path: Path) -> int | None:
        if name is None:
            return None
        return ERROR_CODES_BY_NAME[name].code      # the schema's enum has checked the name

    def _latency(self, raw: Any, path: Path) -> M.Latency | None:
        if raw is None:
            return None
        if isinstance(raw, int | float):
            return M.Latency("fixed", raw / 1000.0)
        if "mean" in raw:
            return M.Latency("exponential", raw["mean"] / 1000.0)
        if raw["min"] > raw["max"]:
            self.fail(path, f"min {raw['min']} is above max {raw['max']}")
        return M.Latency("uniform", raw["min"] / 1000.0, raw["max"] / 1000.0)

    def _match(self, raw: dict[str, Any], path: Path) -> M.Match | None:
        before = len(self.problems)
        out: dict[str, Any] = {}
        for key, value in raw.items():
            items, negate = _items(value)
            at: Path = (*path, key) if not negate else (*path, key, "not")
            compiled = getattr(self, f"_sel_{key}")(items, negate, at, isinstance(value, list) or (
                negate and isinstance(value["not"], list)))
            out[key] = compiled
        if len(self.problems) > before:
            return None
        return M.Match(**out)

    # One method per selector: (items, negate, path, items came as a list) -> compiled selector.

    def _names(self, items: list[Any], negate: bool, path: Path, listed: bool) -> M.Names | None:
        for i, item in enumerate(items):
            if item.startswith("re:"):
                try:
                    re.compile(item[3:])
                except re.error as e:
                    self.fail((*path, i) if listed else path, f"bad regular expression {item[3:]!r}: {e}")
                    return None
        return M.names(items, negate)

    _sel_client_id = _sel_principal = _sel_listener = _sel_topic = _sel_group = _sel_transactional_id = _names

    def _sel_source(self, items: list[str], negate: bool, path: Path, listed: bool) -> M.Networks | None:
        nets = []
        for i, item in enumerate(items):
            at = (*path, i) if listed else path
            try:
                nets.append(ipaddress.ip_network(item, strict=True))
            except ValueError as e:
                try:
                    loose = ipaddress.ip_network(item, strict=False)
                    self.fail(at, f"{item!r} has host bits set (did you mean {str(loose)!r}?)")
                except ValueError:
                    self.fail(at, f"{item!r} is not an IP address or CIDR ({e})")
        return M.Networks(tuple(nets), negate)

    def _sel_api(self, items: list[Any], negate: bool, path: Path, listed: bool) -> M.Ints | None:
        by_name = M.api_keys_by_name()
        keys: set[int] = set()
        for i, item in enumerate(items):
            if isinstance(item, int):
                if item not in by_name.values():
                    self.fail((*path, i) if listed else path, f"no Kafka API has key {item}")
                keys.add(item)
            elif item in by_name:
                keys.add(by_name[item])
            else:
                keys |= M.api_group_keys(item)
        if negate:
            keys = set(by_name.values()) - keys
        return M.Ints(frozenset(keys))

    def _sel_api_version(self, items: list[Any], negate: bool, path: Path, listed: bool) -> M.Ranges:
        ranges: list[tuple[int, int | None]] = []
        for i, item in enumerate(items):
            text = str(item)
            if text.endswith("+"):
                ranges.append((int(text[:-1]), None))
                continue
            lo, _, hi = text.partition("-")
            low, high = int(lo), int(hi or lo)
            if low > high:
                self.fail((*path, i) if listed else path, f"range {text!r} is empty (write {high}-{low})")
            ranges.append((low, high))
        return M.Ranges(tuple(ranges), negate)

    def _sel_acks(self, items: list[Any], negate: bool, path: Path, listed: bool) -> M.Ints:
        values = {M.ACKS[str(item)] for item in items}
        return M.Ints(frozenset({-1, 0, 1} - values if negate else values))

    def _sel_compression(self, items: list[str], negate: bool, path: Path, listed: bool) -> M.Codecs:
        return M.Codecs(frozenset(M.COMPRESSIONS.index(c) for c in items), negate)

    def _sel_client_software(self, items: list[Any], negate: bool, path: Path,
                             listed: bool) -> M.Software | None:
        if len(items) != 1:
            # Any of several (name, version) pairs: kept simple, one pair per rule.
            self.fail(path, "give one client_software (a name, or {name, version}); use one rule per client")
            return None
        item = items[0]
        if isinstance(item, str):
            return M.Software(M.names([item]), (), negate)
        name = self._names([item["name"]], False, (*path, "name"), False) if "name" in item else None
        bounds: list[M.VersionBound] = []
        for part in str(item.get("version", "")).split(","):
            part = part.strip()
            if not part:
                continue
            op = next((o for o in (">=", "<=", "==", "!=", ">", "<") if part.startswith(o)), "==")
            bounds.append((op, M.version_tuple(part[len(op):] if part.startswith(op) else part)))
        return M.Software(name, tuple(bounds), negate)


def _items(value: Any) -> tuple[list[Any], bool]:
    if isinstance(value, dict) and "not" in value:
        inner = value["not"]
        return (inner if isinstance(inner, list) else [inner]), True
    return (value if isinstance(value, list) else [value]), False


def _deepest(error: jsonschema.ValidationError) -> jsonschema.ValidationError:
    """The sub-error that says what is wrong, through anyOf/oneOf branches: errors about a branch of
    the value's own type first ("type" errors only say which branch it is not), then the deepest."""
    while error.validator in ("anyOf", "oneOf") and error.context:
        candidates = [e for e in error.context if e.validator != "type"] or list(error.context)
        error = max(candidates, key=lambda e: (len(e.absolute_path), _typed_for(e)))
    return error


def _typed_for(error: jsonschema.ValidationError) -> bool:
    """Whether the branch ``error`` comes from is written for the value's type (an integer's
    "maximum" says more than a list of names it is not in)."""
    declared = error.schema.get("type") if isinstance(error.schema, dict) else None
    if declared is None:
        return False
    value = error.instance
    kinds: dict[str, type | tuple[type, ...]] = {"integer": int, "number": (int, float), "string": str,
                                                 "array": list, "object": dict, "boolean": bool}
    declared = [declared] if isinstance(declared, str) else declared
    return any(isinstance(value, kinds.get(d, ())) for d in declared)


def _key_kind(path: Path) -> str:
    if path and path[-1] == "match":
        return "selector"
    if len(path) == 2 and path[0] in ("rules", "quotas"):
        return "key"
    if not path:
        return "top-level key"
    return "setting"


def _hint(word: str, choices: Sequence[str]) -> str:
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


_TYPE_WORDS = {"string": "a string", "integer": "an integer", "number": "a number", "object": "a mapping",
               "array": "a list", "boolean": "true or false", "null": "nothing"}


def _type_words(types: Any) -> str:
    types = [types] if isinstance(types, str) else list(types)
    return " or ".join(_TYPE_WORDS.get(t, t) for t in types)


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "nothing"
    return repr(value)


def _dotted(path: Path) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out

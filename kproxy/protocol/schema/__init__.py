"""kproxy's schema of the Kafka protocol: the ``*.kschema`` files in this folder and their parser.

Each file declares one API (its request and response) or a set of standalone messages, in the
line-oriented format described in ``FORMAT.md``. The parser turns text into frozen specs that
``kproxy.protocol.compiler`` generates codecs from; it never touches the network or the clock.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from kproxy.protocol.errors import SchemaError

SCHEMA_DIR = Path(__file__).parent

PRIMITIVES = frozenset(
    {"int8", "int16", "int32", "int64", "uint16", "uint32", "float64", "bool", "string", "bytes",
     "records", "uuid"}
)

# entity=KIND: what a field's value names, and the one primitive type that can carry it. The
# resource kinds and coordinator_key are names whose kind a type code beside them decides (FORMAT.md).
ENTITY_TYPES = {
    "topic": "string", "topic_id": "uuid", "group": "string", "txn": "string", "broker": "int32",
    "producer": "int64", "config_resource": "string", "acl_resource": "string",
    "coordinator_key": "string",
}
RESOURCE_KINDS = frozenset({"config_resource", "acl_resource"})

# to=DEST on the api line: where a client sends the request (FORMAT.md).
DESTINATIONS = frozenset({"leader", "coordinator", "quorum"})


def resource_type_field(name: str) -> str:
    """The sibling that holds a resource name's type code: ``resource_name_filter`` ->
    ``resource_type_filter``."""
    head, _, tail = name.rpartition("name")
    return head + "type" + tail


@dataclass(frozen=True, slots=True)
class Versions:
    """An inclusive version range; ``hi is None`` means open-ended, ``lo > hi`` means empty."""

    lo: int
    hi: int | None

    def __contains__(self, v: int) -> bool:
        return v >= self.lo and (self.hi is None or v <= self.hi)

    @property
    def empty(self) -> bool:
        return self.hi is not None and self.lo > self.hi

    def __str__(self) -> str:
        if self.empty:
            return "none"
        if self.hi is None:
            return f"{self.lo}+"
        return f"{self.lo}" if self.lo == self.hi else f"{self.lo}-{self.hi}"


NONE = Versions(1, 0)
ALL = Versions(0, None)


def parse_versions(text: str) -> Versions:
    t = text[1:] if text.startswith("v") else text
    if t == "none":
        return NONE
    if t.endswith("+"):
        return Versions(int(t[:-1]), None)
    if "-" in t:
        lo, hi = t.split("-", 1)
        return Versions(int(lo), int(hi))
    return Versions(int(t), int(t))


@dataclass(frozen=True, slots=True)
class FieldSpec:
    name: str
    type: str                 # a primitive name, or "struct"
    array: bool
    versions: Versions
    nullable: Versions
    tag: int | None
    tagged: Versions          # versions in which the field travels as a tagged field
    default: object           # parsed default; see FORMAT.md for the implicit ones
    has_default: bool         # the file gave default= explicitly
    flex_never: bool          # string keeps the classic encoding even in flexible versions
    struct: StructSpec | None
    line: int
    entity: str | None = None  # entity=KIND: the value names a topic, group, broker, ... (FORMAT.md)
    hold: bool = False         # hold=ms: the broker may hold the request this many milliseconds

    def present(self, v: int) -> bool:
        return v in self.versions

    def is_tagged(self, v: int, flexible: bool) -> bool:
        return self.tag is not None and flexible and v in self.tagged and v in self.versions


@dataclass(frozen=True, slots=True)
class StructSpec:
    name: str
    fields: tuple[FieldSpec, ...]
    line: int


@dataclass(frozen=True, slots=True)
class MessageSpec:
    name: str                 # class name, e.g. "ProduceRequest"
    kind: str                 # "request", "response" or "message"
    api_key: int | None
    api_name: str | None      # snake_case API name, e.g. "produce"
    versions: Versions
    flexible: Versions
    root: StructSpec
    file: str

    def structs(self) -> list[StructSpec]:
        """Every struct reachable from the root, root first, each once."""
        seen: dict[str, StructSpec] = {}

        def walk(s: StructSpec) -> None:
            if s.name in seen:
                return
            seen[s.name] = s
            for f in s.fields:
                if f.struct is not None:
                    walk(f.struct)

        walk(self.root)
        return list(seen.values())


@dataclass(slots=True)
class ApiSpec:
    key: int
    name: str
    file: str
    request: MessageSpec | None = None
    response: MessageSpec | None = None
    to: str | None = None      # to=DEST: the broker a client sends the request to, when it matters


@dataclass(slots=True)
class SchemaFile:
    path: str
    api: ApiSpec | None = None
    messages: list[MessageSpec] = field(default_factory=list)


def _camel(snake: str) -> str:
    return "".join(p[:1].upper() + p[1:] for p in snake.split("_"))


def _parse_default(raw: str, ftype: str, array: bool, where: tuple[str, int]) -> object:
    if raw == "null":
        return None
    if array:
        raise SchemaError("arrays take only default=null", *where)
    try:
        if ftype in ("int8", "int16", "int32", "int64", "uint16", "uint32"):
            return int(raw, 0)
        if ftype == "float64":
            return float(raw)
        if ftype == "bool":
            if raw not in ("true", "false"):
                raise ValueError(raw)
            return raw == "true"
        if ftype == "string":
            return raw
    except ValueError:
        raise SchemaError(f"default {raw!r} does not fit type {ftype}", *where) from None
    raise SchemaError(f"type {ftype} takes no default other than null", *where)


class _Line:
    __slots__ = ("indent", "no", "tokens")

    def __init__(self, indent: int, tokens: list[str], no: int) -> None:
        self.indent = indent
        self.tokens = tokens
        self.no = no


def _lines(text: str, path: str) -> list[_Line]:
    out = []
    for no, raw in enumerate(text.splitlines(), 1):
        stripped = raw.lstrip(" ")
        if not stripped or stripped.startswith("#"):
            continue
        if "\t" in raw[: len(raw) - len(stripped) + 1]:
            raise SchemaError("indent with spaces, not tabs", path, no)
        indent = len(raw) - len(stripped)
        if indent % 2:
            raise SchemaError("indentation must be a multiple of two spaces", path, no)
        try:
            tokens = shlex.split(stripped, comments=True)
        except ValueError as e:
            raise SchemaError(str(e), path, no) from None
        if tokens:
            out.append(_Line(indent // 2, tokens, no))
    return out


class _Parser:
    def __init__(self, text: str, path: str) -> None:
        self.path = path
        self.lines = _lines(text, path)
        self.i = 0
        self.common_lines: dict[str, tuple[int, int]] = {}
        self.common: dict[str, StructSpec] = {}

    def err(self, msg: str, no: int) -> SchemaError:
        return SchemaError(msg, self.path, no)

    def block_end(self, start: int, depth: int) -> int:
        j = start
        while j < len(self.lines) and self.lines[j].indent > depth:
            j += 1
        return j

    def parse(self) -> SchemaFile:
        sf = SchemaFile(self.path)
        # First pass: remember where each common struct's body is, so fields may use one declared later.
        headers = []
        j = 0
        while j < len(self.lines):
            ln = self.lines[j]
            if ln.indent != 0:
                raise self.err("unexpected indentation", ln.no)
            end = self.block_end(j + 1, 0)
            headers.append((ln, j + 1, end))
            if ln.tokens[0] == "struct":
                if len(ln.tokens) != 2:
                    raise self.err("expected: struct Name", ln.no)
                name = ln.tokens[1]
                if name in self.common_lines:
                    raise self.err(f"struct {name} declared twice", ln.no)
                self.common_lines[name] = (j + 1, end)
            j = end
        for ln, start, end in headers:
            kw = ln.tokens[0]
            if kw == "api":
                sf.api = self.api(ln, sf.api)
            elif kw == "struct":
                self.common_struct(ln.tokens[1], ln.no)
            elif kw in ("request", "response", "message"):
                msg = self.message(ln, start, end, sf.api)
                if kw == "message":
                    sf.messages.append(msg)
                else:
                    if sf.api is None:
                        raise self.err(f"{kw} before the api line", ln.no)
                    if getattr(sf.api, kw) is not None:
                        raise self.err(f"second {kw} for this api", ln.no)
                    setattr(sf.api, kw, msg)
            else:
                raise self.err(f"unknown directive {kw!r}", ln.no)
        if sf.api is not None and (sf.api.request is None or sf.api.response is None):
            raise self.err("an api needs both a request and a response", 1)
        if sf.api is not None:
            self.check_coordinator_keys(sf.api)
        return sf

    def api(self, ln: _Line, seen: ApiSpec | None) -> ApiSpec:
        t = ln.tokens
        to = t[3][3:] if len(t) == 4 and t[3].startswith("to=") else None
        if seen is not None or len(t) != (3 if to is None else 4):
            raise self.err("expected one line: api KEY snake_name [to=DEST]", ln.no)
        if to is not None and to not in DESTINATIONS:
            raise self.err(f"unknown destination to={to}; expected one of {', '.join(sorted(DESTINATIONS))}",
                           ln.no)
        return ApiSpec(int(t[1]), t[2], self.path, to=to)

    def check_coordinator_keys(self, api: ApiSpec) -> None:
        """A coordinator key's kind is the request's root ``key_type``, in the response too."""
        assert api.request is not None and api.response is not None
        kt = next((k for k in api.request.root.fields if k.name == "key_type"), None)
        if kt is not None and kt.type == "int8" and not kt.array:
            return
        for msg in (api.request, api.response):
            for s in msg.structs():
                for f in s.fields:
                    if f.entity == "coordinator_key":
                        raise self.err("entity=coordinator_key needs an int8 key_type at the "
                                       "request's root", f.line)

    def common_struct(self, name: str, no: int) -> StructSpec:
        if name in self.common:
            s = self.common[name]
            if s is None:
                raise self.err(f"struct {name} refers to itself", no)
            return s
        if name not in self.common_lines:
            raise self.err(f"struct {name} has no fields here and no 'struct {name}' declaration", no)
        self.common[name] = None  # type: ignore[assignment]  # marks "in progress" for cycle detection
        start, end = self.common_lines[name]
        s = StructSpec(name, self.fields(start, end, 1, ALL), no)
        self.common[name] = s
        return s

    def message(self, ln: _Line, start: int, end: int, api: ApiSpec | None) -> MessageSpec:
        t = ln.tokens
        kind = t[0]
        if kind == "message":
            if len(t) != 5 or t[3] != "flex":
                raise self.err("expected: message Name VERSIONS flex VERSIONS", ln.no)
            name, vtext, ftext = t[1], t[2], t[4]
        else:
            if len(t) != 4 or t[2] != "flex":
                raise self.err(f"expected: {kind} VERSIONS flex VERSIONS", ln.no)
            assert api is not None or kind == "message"
            name = _camel(api.name) + kind.capitalize() if api else kind
            vtext, ftext = t[1], t[3]
        try:
            versions, flexible = parse_versions(vtext), parse_versions(ftext)
        except ValueError:
            raise self.err(f"bad version range in {' '.join(t)!r}", ln.no) from None
        if versions.hi is None or versions.empty:
            raise self.err("message versions must be a closed range like 0-12", ln.no)
        fields = self.fields(start, end, 1, versions)
        root = StructSpec(name, fields, ln.no)
        msg = MessageSpec(name, kind, api.key if api else None, api.name if api else None,
                          versions, flexible, root, self.path)
        names: dict[str, StructSpec] = {}
        for s in msg.structs():
            if s.name in names and names[s.name] is not s:
                raise self.err(f"two different structs named {s.name}", s.line)
            names[s.name] = s
        return msg

    def fields(self, start: int, end: int, depth: int, parent: Versions) -> tuple[FieldSpec, ...]:
        out: list[FieldSpec] = []
        seen: set[str] = set()
        tags: set[int] = set()
        j = start
        while j < end:
            ln = self.lines[j]
            if ln.indent != depth:
                raise self.err(f"expected indentation of {2 * depth} spaces", ln.no)
            body_end = self.block_end(j + 1, depth)
            f = self.field(ln, j + 1, body_end, depth)
            if f.name in seen:
                raise self.err(f"field {f.name} declared twice", ln.no)
            seen.add(f.name)
            if f.tag is not None:
                if f.tag in tags:
                    raise self.err(f"tag {f.tag} used twice in one struct", ln.no)
                tags.add(f.tag)
            out.append(f)
            j = body_end
        by_name = {f.name: f for f in out}
        for f in out:
            if f.entity in RESOURCE_KINDS:
                # The type code decides what the name is; a version without it uses its default.
                tf = by_name.get(resource_type_field(f.name))
                if tf is None or tf.type != "int8" or tf.array:
                    raise self.err(f"entity={f.entity} on {f.name} needs an int8 sibling "
                                   f"{resource_type_field(f.name)}", f.line)
        return tuple(out)

    def field(self, ln: _Line, start: int, end: int, depth: int) -> FieldSpec:
        where = (self.path, ln.no)
        t = ln.tokens
        if len(t) < 2:
            raise self.err("a field needs a name and a type", ln.no)
        name, ftype = t[0], t[1]
        if not name.isidentifier() or name != name.lower() or name.startswith("_"):
            raise self.err(f"field name {name!r} must be snake_case", ln.no)
        array = ftype.startswith("[]")
        base = ftype[2:] if array else ftype
        versions, nullable, tagged = ALL, NONE, None
        tag = None
        default: object = None
        has_default = False
        flex_never = False
        entity: str | None = None
        hold = False
        for tok in t[2:]:
            try:
                if tok.startswith("v") and tok[1:2].isdigit():
                    versions = parse_versions(tok)
                elif tok == "nullable":
                    nullable = ALL
                elif tok.startswith("nullable="):
                    nullable = parse_versions(tok[9:])
                elif tok.startswith("tag="):
                    tag = int(tok[4:])
                elif tok.startswith("tagged="):
                    tagged = parse_versions(tok[7:])
                elif tok.startswith("default="):
                    has_default = True
                    default = tok[8:]
                elif tok == "flex=never":
                    flex_never = True
                elif tok.startswith("entity="):
                    entity = tok[7:]
                    if entity not in ENTITY_TYPES:
                        raise self.err(f"unknown entity kind {entity!r}; expected one of "
                                       f"{', '.join(sorted(ENTITY_TYPES))}", ln.no)
                elif tok == "hold=ms":
                    hold = True
                else:
                    raise self.err(f"unknown option {tok!r}", ln.no)
            except ValueError:
                raise self.err(f"bad version range in {tok!r}", ln.no) from None
        struct = None
        if base in PRIMITIVES:
            if end > start:
                raise self.err(f"field {name} of type {base} cannot have nested fields", ln.no)
            kind = base
        elif base[:1].isupper() and base.isidentifier():
            kind = "struct"
            if end > start:
                if base in self.common_lines:
                    raise self.err(f"struct {base} is also declared as a common struct", ln.no)
                struct = StructSpec(base, self.fields(start, end, depth + 1, versions), ln.no)
            else:
                struct = self.common_struct(base, ln.no)
        else:
            raise self.err(f"unknown type {ftype!r}", ln.no)
        if flex_never and (base != "string" or array):
            raise self.err("flex=never applies to string fields only", ln.no)
        if entity is not None and base != ENTITY_TYPES[entity]:
            raise self.err(f"entity={entity} needs a {ENTITY_TYPES[entity]} field, not {ftype}", ln.no)
        if entity in RESOURCE_KINDS and array:
            raise self.err(f"entity={entity} applies to a single name, not an array", ln.no)
        if hold and (base != "int32" or array):
            raise self.err(f"hold=ms needs an int32 field, not {ftype}", ln.no)
        if tag is not None and tagged is None:
            tagged = versions
        if has_default:
            if kind == "struct" and default != "null":
                raise self.err("struct fields take only default=null", ln.no)
            default = _parse_default(str(default), kind, array, where)
            if default is None and nullable.empty:
                raise self.err("default=null on a field that is never nullable", ln.no)
        return FieldSpec(name, kind, array, versions, nullable, tag, tagged or NONE, default,
                         has_default, flex_never, struct, ln.no, entity, hold)


def parse_schema(text: str, path: str = "<schema>") -> SchemaFile:
    return _Parser(text, path).parse()


def load_schema_files(directory: Path = SCHEMA_DIR) -> list[SchemaFile]:
    files = []
    for p in sorted(directory.glob("*.kschema")):
        files.append(parse_schema(p.read_text(encoding="utf-8"), str(p)))
    return files

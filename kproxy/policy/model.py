"""The policy vocabulary as frozen values: compiled selectors, actions, rules and rule sets.

``kproxy.policy.loader`` builds these once per load, with every glob, regular expression, CIDR and
API name already compiled, so nothing on the data path parses text. The selectors are usable on
their own (quotas match clients with the same ``Match``). Pure: no I/O, no clocks.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import re
from collections.abc import Callable
from typing import Any

import attrs

from kproxy.protocol.messages import apis

# --------------------------------------------------------------------------------------------------
# API names and groups

# The groups a rule's ``api`` selector may name besides single APIs. A policy vocabulary, not a
# protocol fact, so it is written here once; tests/unit/test_policy_model.py fails when an API in
# the schema is in no group and not listed in UNGROUPED, so a new API is always placed on purpose.
API_GROUPS: dict[str, frozenset[str]] = {
    # Reading records and the metadata and offsets a consumer needs to read them.
    "read": frozenset({
        "fetch", "list_offsets", "metadata", "offset_fetch", "offset_for_leader_epoch",
        "describe_topic_partitions", "share_fetch", "share_acknowledge",
    }),
    # Writing records, transactional writes included.
    "write": frozenset({
        "produce", "delete_records", "init_producer_id", "add_partitions_to_txn", "add_offsets_to_txn",
        "end_txn", "txn_offset_commit",
    }),
    # Consumer groups (classic, KIP-848 and streams): membership, offsets, listing.
    "group": frozenset({
        "offset_commit", "offset_fetch", "join_group", "heartbeat", "leave_group", "sync_group",
        "describe_groups", "list_groups", "delete_groups", "offset_delete", "consumer_group_heartbeat",
        "consumer_group_describe", "streams_group_heartbeat", "streams_group_describe",
    }),
    "transaction": frozenset({
        "init_producer_id", "add_partitions_to_txn", "add_offsets_to_txn", "end_txn", "txn_offset_commit",
        "describe_transactions", "list_transactions",
    }),
    # Share groups (KIP-932), client and broker-to-broker APIs.
    "share": frozenset({
        "share_group_heartbeat", "share_group_describe", "share_fetch", "share_acknowledge",
        "describe_share_group_offsets", "alter_share_group_offsets", "delete_share_group_offsets",
        "initialize_share_group_state", "read_share_group_state", "write_share_group_state",
        "delete_share_group_state", "read_share_group_state_summary",
    }),
    # Cluster administration, and every API only brokers and controllers send each other.
    "admin": frozenset({
        "create_topics", "delete_topics", "create_partitions", "delete_groups", "offset_delete",
        "describe_configs", "alter_configs", "incremental_alter_configs", "list_config_resources",
        "describe_acls", "create_acls", "delete_acls", "describe_log_dirs", "alter_replica_log_dirs",
        "elect_leaders", "alter_partition_reassignments", "list_partition_reassignments",
        "create_delegation_token", "renew_delegation_token", "expire_delegation_token",
        "describe_delegation_token", "describe_client_quotas", "alter_client_quotas",
        "describe_user_scram_credentials", "alter_user_scram_credentials", "update_features",
        "describe_cluster", "describe_producers", "describe_transactions", "list_transactions",
        "describe_quorum", "unregister_broker", "add_raft_voter", "remove_raft_voter", "update_raft_voter",
        "alter_share_group_offsets", "delete_share_group_offsets",
        "leader_and_isr", "stop_replica", "update_metadata", "controlled_shutdown", "write_txn_markers",
        "vote", "begin_quorum_epoch", "end_quorum_epoch", "alter_partition", "envelope", "fetch_snapshot",
        "broker_registration", "broker_heartbeat", "allocate_producer_ids", "controller_registration",
        "assign_replicas_to_dirs", "initialize_share_group_state", "read_share_group_state",
        "write_share_group_state", "delete_share_group_state", "read_share_group_state_summary",
    }),
}
# Every client needs these whatever it does; only ``any`` (or the API's own name) selects them.
UNGROUPED = frozenset({
    "api_versions", "sasl_handshake", "sasl_authenticate", "find_coordinator",
    "get_telemetry_subscriptions", "push_telemetry",
})
ANY_API = "any"


def api_keys_by_name() -> dict[str, int]:
    """Every API kproxy knows, by its snake_case name."""
    return {api.name: key for key, api in apis().items()}


def api_group_keys(group: str) -> frozenset[int]:
    """The api keys of a group name (``read``, ``admin``, ``any``, ...)."""
    keys = api_keys_by_name()
    if group == ANY_API:
        return frozenset(keys.values())
    return frozenset(keys[name] for name in API_GROUPS[group] if name in keys)


ACKS = {"all": -1, "-1": -1, "0": 0, "1": 1}
COMPRESSIONS = ("none", "gzip", "snappy", "lz4", "zstd")   # the codec ids 0-4 of a batch header
ACTIONS = ("allow", "deny", "rewrite", "require", "cap", "chaos", "log", "validate", "headers", "encrypt", "mask")
# Actions on the records a producer writes (Produce only): validate refuses a partition's batch when a
# record breaks it; headers changes the records and lets the evaluation go on.
# encrypt seals the values (and optionally keys) of produced records; Fetch answers are opened again.
RECORD_ACTIONS = frozenset({"validate", "headers", "encrypt"})
# Actions on the records a consumer reads (Fetch answers): mask replaces JSON fields.
FETCH_RECORD_ACTIONS = frozenset({"mask"})
# What a headers rule's values may name, filled in per connection.
HEADER_VARIABLES = ("client_id", "principal", "rule")
# Actions that decide what they match; the others act and let the evaluation go on (require decides
# only when the request breaks it).
DECIDING = frozenset({"allow", "deny", "rewrite"})
ANONYMOUS = "User:ANONYMOUS"   # Kafka's principal for a client that did not authenticate


# --------------------------------------------------------------------------------------------------
# Selectors: each is a compiled test of one value, already negated when the rule says ``not``


@attrs.frozen(slots=True)
class Names:
    """A string selector: exact names, globs (``team-a-*``) and ``re:`` regular expressions, any of
    which may match the whole value; ``negate`` for ``{not: ...}``."""

    exact: frozenset[str]
    patterns: tuple[re.Pattern[str], ...]
    negate: bool = False
    text: str = ""      # as written, for messages

    def __call__(self, value: str) -> bool:
        hit = value in self.exact or any(p.fullmatch(value) for p in self.patterns)
        return hit != self.negate


def compile_name(item: str) -> tuple[str | None, re.Pattern[str] | None]:
    """(exact name, None) or (None, pattern) for one selector item. ``re:`` is a regular expression
    (re.error on a bad one); ``*``, ``?`` and ``[...]`` make a glob; anything else is exact."""
    if item.startswith("re:"):
        return None, re.compile(item[3:])
    if any(c in item for c in "*?["):
        return None, re.compile(fnmatch.translate(item))
    return item, None


def names(items: list[str] | tuple[str, ...], negate: bool = False) -> Names:
    exact, patterns = set(), []
    for item in items:
        e, p = compile_name(item)
        if e is not None:
            exact.add(e)
        else:
            assert p is not None
            patterns.append(p)
    text = items[0] if len(items) == 1 else "[" + ", ".join(items) + "]"
    return Names(frozenset(exact), tuple(patterns), negate, f"not {text}" if negate else text)


@attrs.frozen(slots=True)
class Networks:
    """A ``source`` selector: the client's address is in one of these CIDRs (or is not, negated)."""

    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]
    negate: bool = False

    def __call__(self, address: str | None) -> bool:
        if address is None:
            return self.negate
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return self.negate
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped     # a dual-stack listener reports IPv4 clients as ::ffff:a.b.c.d
        hit = any(ip.version == n.version and ip in n for n in self.networks)
        return hit != self.negate


@attrs.frozen(slots=True)
class Ints:
    """A set of small integers (api keys, acks values) already negated where the rule says ``not``."""

    values: frozenset[int]

    def __call__(self, value: int) -> bool:
        return value in self.values


@attrs.frozen(slots=True)
class Ranges:
    """``api_version``: inclusive (low, high) ranges, high None for open-ended; ``negate`` for not."""

    ranges: tuple[tuple[int, int | None], ...]
    negate: bool = False

    def __call__(self, value: int) -> bool:
        hit = any(lo <= value and (hi is None or value <= hi) for lo, hi in self.ranges)
        return hit != self.negate


@attrs.frozen(slots=True)
class Codecs:
    """``compression``: holds when any produced batch uses one of ``codecs`` (ids 0-4)."""

    codecs: frozenset[int]
    negate: bool = False

    def __call__(self, used: frozenset[int]) -> bool:
        if not used:
            return False        # nothing produced: no compression to judge
        hit = not self.codecs.isdisjoint(used)
        return hit != self.negate


VersionBound = tuple[str, tuple[int, ...]]     # (">=", (3, 5)) from ">=3.5"


def version_tuple(text: str) -> tuple[int, ...]:
    """The leading numeric components of a software version (``2.16.0-RC1`` -> (2, 16, 0))."""
    out = []
    for part in re.split(r"[.\-+_]", text.strip()):
        m = re.match(r"\d+", part)
        if m is None:
            break
        out.append(int(m.group()))
        if m.end() != len(part):
            break
    return tuple(out)


_COMPARE: dict[str, Callable[[tuple[int, ...], tuple[int, ...]], bool]] = {
    ">=": lambda a, b: a >= b, ">": lambda a, b: a > b, "<=": lambda a, b: a <= b,
    "<": lambda a, b: a < b, "==": lambda a, b: a[:len(b)] == b, "!=": lambda a, b: a[:len(b)] != b,
}


@attrs.frozen(slots=True)
class Software:
    """``client_software``: a name selector and version bounds (all must hold), from ApiVersions v3+."""

    name: Names | None
    bounds: tuple[VersionBound, ...] = ()
    negate: bool = False

    def __call__(self, name: str | None, version: str | None) -> bool:
        hit = name is not None and (self.name is None or self.name(name))
        if hit and self.bounds:
            v = version_tuple(version or "")
            hit = bool(v) and all(_COMPARE[op](v, bound) for op, bound in self.bounds)
        return hit != self.negate


# --------------------------------------------------------------------------------------------------
# A rule's match


@attrs.frozen(slots=True)
class Match:
    """The selectors of one rule; absent ones (None) always hold. Connection selectors are judged
    once per connection, request selectors per request, ``topic`` per topic."""

    client_id: Names | None = None
    principal: Names | None = None
    source: Networks | None = None
    listener: Names | None = None
    client_software: Software | None = None
    api: Ints | None = None
    api_version: Ranges | None = None
    acks: Ints | None = None
    compression: Codecs | None = None
    group: Names | None = None
    transactional_id: Names | None = None
    topic: Names | None = None

    CONNECTION = ("client_id", "principal", "source", "listener", "client_software")
    REQUEST = ("api", "api_version", "acks", "compression", "group", "transactional_id")

    def holds_for_connection(self, client_id: str | None, principal: str | None, source: str | None,
                             listener: str | None, software_name: str | None,
                             software_version: str | None) -> bool:
        """The connection selectors (a null client id reads as "", no principal as User:ANONYMOUS)."""
        if self.client_id is not None and not self.client_id(client_id or ""):
            return False
        if self.principal is not None and not self.principal(principal or ANONYMOUS):
            return False
        if self.source is not None and not self.source(source):
            return False
        if self.listener is not None and not self.listener(listener or ""):
            return False
        return self.client_software is None or self.client_software(software_name, software_version)

    @property
    def request_level(self) -> bool:
        """Whether any selector beyond ``api`` needs the request's contents."""
        return any(getattr(self, name) is not None for name in self.REQUEST[1:])

    @property
    def uses_batches(self) -> bool:
        return self.compression is not None


# --------------------------------------------------------------------------------------------------
# Actions


@attrs.frozen(slots=True)
class Deny:
    error: int | None = None            # None: the authorization error that fits the API


@attrs.frozen(slots=True)
class Rewrite:
    topic_prefix: str | None = None
    group_prefix: str | None = None
    transactional_id_prefix: str | None = None

    def prefixes(self) -> dict[str, str]:
        """{entity kind (kproxy.protocol.entities): prefix} for the prefixes set."""
        out = {}
        if self.topic_prefix:
            out["topic"] = self.topic_prefix
        if self.group_prefix:
            out["group"] = self.group_prefix
        if self.transactional_id_prefix:
            out["txn"] = self.transactional_id_prefix
        return out


@attrs.frozen(slots=True)
class Require:
    acks: int | None = None                       # -1 for all
    max_batch_bytes: int | None = None
    compression: frozenset[int] | None = None     # allowed codec ids
    # Uncompressed batches up to this size pass a compression requirement anyway: librdkafka sends
    # a batch uncompressed when compressing would not make it smaller.
    uncompressed_max_bytes: int = 0

    @property
    def uses_batches(self) -> bool:
        return self.max_batch_bytes is not None or self.compression is not None


@attrs.frozen(slots=True)
class Cap:
    max_bytes: int | None = None                  # Fetch
    partition_max_bytes: int | None = None        # Fetch, per partition
    max_wait_ms: int | None = None                # Fetch
    timeout_ms: int | None = None                 # Produce


# The longest latency chaos injects into one request, in total: a held request must not outlive the
# broker connection's timeouts or the client's. Rule files asking for more are refused (``kproxy
# check``); exponential draws, unbounded by nature, are cut to it.
MAX_LATENCY_S = 60.0


@attrs.frozen(slots=True)
class Latency:
    """Injected latency in seconds: ``fixed`` (a), ``uniform`` (a..b) or ``exponential`` (mean a)."""

    kind: str
    a: float
    b: float = 0.0

    def draw(self, rng: Any) -> float:
        """One delay from ``rng`` (a ``random.Random``), never more than ``MAX_LATENCY_S``."""
        if self.kind == "fixed":
            seconds = self.a
        elif self.kind == "uniform":
            seconds = rng.uniform(self.a, self.b)
        else:
            seconds = rng.expovariate(1.0 / self.a)
        return min(seconds, MAX_LATENCY_S)


@attrs.frozen(slots=True)
class Chaos:
    rate: float = 1.0
    latency: Latency | None = None
    error: int | None = None


@attrs.frozen(slots=True)
class Log:
    level: int = 20                    # logging.INFO
    sample: float = 1.0


@attrs.frozen(slots=True)
class ValueCheck:
    """A check of a record's key or value bytes: ``json`` (well-formed UTF-8 JSON), ``json_schema``
    (JSON that a schema file accepts; ``validator`` is the compiled schema) or
    ``avro_schema_registry`` (Confluent's wire format: magic byte 0, a 4-byte schema id in
    ``allowed_ids`` when given)."""

    kind: str
    schema_path: str | None = None
    validator: Any = attrs.field(default=None, eq=False, repr=False)
    allowed_ids: frozenset[int] | None = None


@attrs.frozen(slots=True)
class Validate:
    """What every record of a produced batch must satisfy; a batch with one record that does not is
    refused whole (INVALID_RECORD). Null values (tombstones) skip the value check unless
    ``allow_null`` is false."""

    value: ValueCheck | None = None
    key: ValueCheck | None = None
    key_required: bool = False
    max_record_bytes: int | None = None
    required_headers: tuple[str, ...] = ()
    allow_null: bool = True


@attrs.frozen(slots=True)
class Headers:
    """Headers put on every produced record: ``set`` (name, template) pairs, whose values may hold
    ``${client_id}``, ``${principal}`` and ``${rule}``; ``traceparent`` adds W3C trace context
    (kproxy's produce span) to records that carry none."""

    set: tuple[tuple[str, str], ...] = ()
    traceparent: bool = False


@attrs.frozen(slots=True)
class Encrypt:
    """Seal produced records with a data key wrapped by the KEK ``kek`` (``${topic}`` is the
    record's topic): values always, keys too when ``keys`` (a sealed key is bound to its value,
    so the broker can no longer compact by key)."""

    kek: str
    keys: bool = False

    def kek_for(self, topic: str) -> str:
        return self.kek.replace("${topic}", topic)


@attrs.frozen(slots=True)
class Mask:
    """Replace JSON fields (dotted paths into objects) of fetched record values with ``with_``."""

    fields: tuple[tuple[str, ...], ...]
    with_: Any = "****"


Params = Deny | Rewrite | Require | Cap | Chaos | Log | Validate | Headers | Encrypt | Mask | None


@attrs.frozen(slots=True)
class Where:
    """Where a rule is written, for messages: ``rules/tenants.yaml:12:5``."""

    file: str
    line: int
    column: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"


@attrs.frozen(slots=True)
class Rule:
    name: str
    match: Match
    action: str
    params: Params = None
    where: Where | None = None

    @property
    def deciding(self) -> bool:
        return self.action in DECIDING


# Who shares one quota budget (``per:``), and the limits a quota may set.
QUOTA_PER = ("client_id", "principal", "source", "connection", "rule")
QUOTA_LIMITS = ("produce_bytes_per_s", "fetch_bytes_per_s", "requests_per_s", "request_time_percent")
# Selectors a quota cannot use: budgets are per client and API, and these name parts of a request.
QUOTA_UNSUPPORTED = ("topic", "group", "transactional_id", "compression")


@attrs.frozen(slots=True)
class QuotaRule:
    """An entry of ``quotas:``: which requests it counts (``match``, as a rule's), who shares a budget
    (``per``), and its limits per second for the whole deployment (None: not limited); ``burst_s``
    is how many seconds of a limit may be used at once."""

    name: str
    match: Match
    per: str = "client_id"
    produce_bytes_per_s: float | None = None
    fetch_bytes_per_s: float | None = None
    requests_per_s: float | None = None
    request_time_percent: float | None = None
    burst_s: float = 1.0
    where: Where | None = None

    @property
    def limits(self) -> dict[str, float]:
        """The limits set, by their names in the rule file."""
        return {k: v for k in QUOTA_LIMITS if (v := getattr(self, k)) is not None}


@attrs.frozen(slots=True)
class RuleSet:
    """Every rule file loaded together: rules in order (files in the order given, a directory's
    ``*.yaml`` in name order), the default action, the quotas, and the files they came from."""

    rules: tuple[Rule, ...] = ()
    default: str = "allow"
    quotas: tuple[QuotaRule, ...] = ()
    sources: tuple[str, ...] = ()
    chaos_enabled: bool = False
    # What loaded but deserves a word (chaos rules while chaos is off, an empty directory).
    warnings: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.rules)

"""The whole configuration: ``ProxyConfig``, the sections it holds, the rules that span several of
them (ports that must not overlap, settings that exclude each other), and its one-line summary."""

import re
from collections.abc import Sequence
from typing import Final

import attrs

from kproxy.config.checks import (
    INTERNAL,
    MAX_PORT,
    HostPort,
    SettingError,
    SettingPath,
    name_sections,
    setting,
    with_checks,
)
from kproxy.config.clusters import DEFAULT_NAME, check_virtual_clusters, derived_cluster_id, may_share
from kproxy.config.kms import KmsConfig
from kproxy.config.limits import LimitsConfig, effective_workers
from kproxy.config.listener import ExposureConfig, ProxyProtocolConfig, SaslConfig, TlsServerSide
from kproxy.config.quotas import QuotaConfig
from kproxy.config.telemetry import AdminConfig, MetricsConfig, TracingConfig, TrafficLogConfig
from kproxy.config.upstream import UpstreamConfig

_WILDCARD_HOSTS: Final = frozenset({"0.0.0.0", "::"})


@attrs.frozen(field_transformer=with_checks)
class ProxyConfig:
    """Everything kproxy needs to run. Build it with ``load_config`` or ``config_from_args``.

    One object is one virtual cluster (listeners, exposure, upstream, client identity, rules) with
    the process-wide settings. A file with ``virtual_clusters`` gives a root whose
    ``virtual_clusters`` holds one whole ProxyConfig per entry (each with the process-wide settings
    too), and whose own cluster settings are those of the first entry, so code written for one
    cluster keeps reading one object; code that serves clients iterates ``clusters``. Build such a
    root in code with ``ProxyConfig.of_clusters``.
    """

    listen: HostPort
    upstream: UpstreamConfig
    mode: str = setting("gateway", choices=("gateway", "sidecar"))
    exposure: ExposureConfig = ExposureConfig()
    tls: TlsServerSide = TlsServerSide()
    proxy_protocol: ProxyProtocolConfig = ProxyProtocolConfig()
    sasl: SaslConfig | None = None
    limits: LimitsConfig = LimitsConfig()
    passthrough_unknown_versions: bool = False
    # Policy rule files, or directories of them (every *.yaml), relative to the config file.
    rules: tuple[str, ...] = ()
    chaos: bool = False    # chaos rules inject faults only when this is true
    # The KMS holding the KEKs of encrypt rules (docs/encryption.md); None: no rule may encrypt.
    kms: KmsConfig | None = None
    # Replicas of the gateway that share every quota; each process enforces quota_share() of it
    # (per-connection quotas excepted: a connection lives on one process, which holds it whole).
    quota_replicas: int = setting(1, min=1)
    quota: QuotaConfig = QuotaConfig()
    admin: AdminConfig = AdminConfig()
    metrics: MetricsConfig = MetricsConfig()
    traffic_log: TrafficLogConfig = TrafficLogConfig()
    tracing: TracingConfig = TracingConfig()
    # Share of frames (0..1) whose re-encoding is compared with the bytes received.
    verify_reencode: float = setting(0.0, min=0, max=1)
    # Fetch answers and Produce requests at least this large are forwarded while they arrive (cut-through);
    # null: never. A streamed frame holds a 1 MiB chunk; below 2 MiB storing holds about as much and
    # costs less CPU (the accelerator walks a stored frame, Python a streamed one piece by piece).
    cut_through_min_bytes: int | None = setting(2 * 1024 * 1024, min=1)
    # Streamed record batch bodies move broker -> client by splice(2), never copied through kproxy
    # (Linux, plain TCP on both sides). Off by default: on loopback it measured no faster than the
    # copy (docs/performance-streaming.md).
    cut_through_splice: bool = False
    # The lane (docs/architecture.md): plain connections in a steady state relayed by a thread of
    # kproxy's own, without the event loop. auto: where it was built; off: never.
    lane: str = setting("auto", case="lower", choices=("auto", "off"), off=True)
    log_level: str = setting("INFO", case="upper", choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"))
    log_format: str = setting("text", case="lower", choices=("text", "json"))
    # Processes sharing the listening ports; 0 (written "auto") means one per CPU the process may use.
    workers: int = setting(1, min=0, auto=True)
    # The virtual cluster's name (metrics, logs, spans, /readyz); a file without virtual_clusters
    # is one virtual cluster, named "default" unless it says otherwise.
    name: str = setting(DEFAULT_NAME, name="label")
    # The cluster id clients see in every answer that carries one (Metadata, DescribeCluster, ...),
    # the same whichever upstream cluster is active; null: derived from the virtual cluster's name.
    cluster_id: str | None = None
    # Several virtual clusters in one process (kproxy/config/clusters.py): each a whole ProxyConfig.
    virtual_clusters: tuple["ProxyConfig", ...] = setting((), sections=True)
    source: str | None = attrs.field(default=None, metadata={INTERNAL: True})  # file loaded from

    def __attrs_post_init__(self) -> None:
        _check_exposure(self)
        if self.cluster_id is not None and not _CLUSTER_ID.fullmatch(self.cluster_id):
            raise SettingError(("cluster_id",), f"{self.cluster_id!r} is not a cluster id (1 to 64 letters, digits, "
                                                "'-' or '_'; Kafka's own are 22 characters of URL-safe base64)")
        if self.upstream.several and self.quota.coordinated is not None:
            raise SettingError(("quota", "coordination"), "fleet quotas cannot follow a switch between "
                                                          "upstream.clusters yet; use one of the two")
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
        local = self.kms.local if self.kms is not None else None
        if local is not None and self.mode == "gateway" and not local.allow_in_gateway:
            raise SettingError(("kms", "local"), "a local key file is for development only and mode: gateway "
                                                 "refuses it; use vault, aws or pkcs11, or set allow_in_gateway: true")
        admin = self.admin.listen
        if admin is not None and may_share(admin.host, self.listen.host):
            taken = {self.listen.port}
            if self.exposure.mode != "sni":
                taken.update(range(self.broker_port_start, self.broker_port_start + self.exposure.broker_port_count))
            if admin.port in taken:
                raise SettingError(("admin", "listen"), f"port {admin.port} is already used by the Kafka listeners")
        if self.virtual_clusters:
            check_virtual_clusters(self)

    @classmethod
    def of_clusters(cls, clusters: Sequence["ProxyConfig"]) -> "ProxyConfig":
        """The root of several virtual clusters (each a whole ProxyConfig with the same process-wide
        settings), checked as a file with ``virtual_clusters`` is."""
        if not clusters:
            raise SettingError(("virtual_clusters",), "needs at least one virtual cluster")
        return attrs.evolve(clusters[0], virtual_clusters=tuple(clusters))

    @property
    def presented_cluster_id(self) -> str:
        """The cluster id this virtual cluster's clients see: ``cluster_id``, else derived from its name."""
        return self.cluster_id if self.cluster_id is not None else derived_cluster_id(self.name)

    @property
    def clusters(self) -> tuple["ProxyConfig", ...]:
        """The virtual clusters to serve: those of ``virtual_clusters``, or this one alone."""
        return self.virtual_clusters or (self,)

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


_CLUSTER_ID: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")

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
    blame: SettingPath = ("listen",) if exp.broker_port_start is None else ("exposure", "broker_port_start")
    if last > MAX_PORT:
        if blame == ("listen",) and exp.broker_port_count != _DEFAULT_PORT_COUNT:
            blame = ("exposure", "broker_port_count")
        raise SettingError(blame, f"broker ports {start}..{last} run past {MAX_PORT}; lower "
                                  f"exposure.broker_port_start or exposure.broker_port_count")
    if start <= cfg.listen.port <= last:
        raise SettingError(blame, f"broker ports {start}..{last} include the listen port {cfg.listen.port}")


_DEFAULT_PORT_COUNT: Final = attrs.fields(ExposureConfig).broker_port_count.default


name_sections(ProxyConfig)


def describe_config(cfg: ProxyConfig, codec: str | None = None) -> str:
    """A one-line summary of what ``cfg`` will do, for ``kproxy check`` and the startup log; ``codec``
    names the codec in use (the caller asks kproxy.protocol: configuration does not import it). With
    virtual clusters it says the process's part; ``describe_cluster`` says each cluster's."""
    if cfg.virtual_clusters:
        names = ", ".join(vc.name for vc in cfg.virtual_clusters)
        return "; ".join([f"{len(cfg.virtual_clusters)} virtual clusters ({names})", *_process_summary(cfg, codec)])
    return "; ".join([*_cluster_summary(cfg), *_process_summary(cfg, codec), *_rules_summary(cfg)])


def describe_cluster(cfg: ProxyConfig) -> str:
    """A one-line summary of one virtual cluster: its listeners, upstream, identity and rules."""
    return "; ".join([*_cluster_summary(cfg), *_rules_summary(cfg)])


def _cluster_summary(cfg: ProxyConfig) -> list[str]:
    exp = cfg.exposure
    if exp.mode == "sni":
        domain = exp.sni.domain if exp.sni is not None else "?"
        brokers = f"SNI names broker-<node_id>.{domain} on port {cfg.listen.port}"
    else:
        start = cfg.broker_port_start
        brokers = f"brokers on ports {start}-{start + exp.broker_port_count - 1}"
    up = cfg.upstream
    if up.several:
        clusters = ", ".join(f"{c.name} {','.join(map(str, c.bootstrap_servers))}" for c in up.clusters)
        target = f"upstream clusters {clusters} (active {up.first_active} unless switched)"
    else:
        target = f"upstream {','.join(map(str, up.bootstrap_servers))}"
    return [
        f"listen {cfg.listen} -> {target}",
        f"{cfg.mode}, advertised as {cfg.advertised_host}, {brokers}",
        f"client TLS {_on_off(cfg.tls.enabled)}{' (mTLS)' if cfg.tls.require_client_cert else ''}",
        *([f"upstream TLS {_on_off(cfg.upstream.tls.enabled)}"] if not up.several else []),
        *_identity_summary(cfg),
        f"client SASL {'terminated: ' + ', '.join(cfg.sasl.mechanisms) if cfg.sasl else 'relayed'}",
        *([f"upstream SASL {cfg.upstream.sasl.mechanism + ' as kproxy' if cfg.upstream.sasl else 'off'}"]
          if not up.several else []),
        *([f"failover after {up.failing_over.after_s:g}s unreachable" if up.failing_over else "failover off",
           f"offset translation {up.offset_translation}"] if up.several else []),
    ]


def _process_summary(cfg: ProxyConfig, codec: str | None) -> list[str]:
    idle = cfg.limits.idle_timeout_s
    return [
        f"idle timeout {f'{idle:g}s' if idle > 0 else 'off'}",
        f"admin {cfg.admin.listen or 'off'}",
        f"traffic log {cfg.traffic_log.dir or 'off'}",
        f"tracing {f'on at {cfg.tracing.sample_ratio:g}' if cfg.tracing.enabled else 'off'}",
        f"logs {cfg.log_level} as {cfg.log_format}",
        *([f"codec {codec}"] if codec else []),
        f"workers {effective_workers(cfg)}{' (auto)' if cfg.workers == 0 else ''}",
    ]


def _rules_summary(cfg: ProxyConfig) -> list[str]:
    parts = []
    if cfg.rules:
        parts.append(f"rules from {', '.join(cfg.rules)}{' (chaos on)' if cfg.chaos else ''}")
        if cfg.quota_replicas > 1:
            parts.append(f"quotas split over {cfg.quota_replicas} replicas")
        coord = cfg.quota.coordinated
        if coord is not None:
            parts.append(f"quotas shared by fleet {coord.fleet!r} through topic {coord.topic}")
    return parts


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

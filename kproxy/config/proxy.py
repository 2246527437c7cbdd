"""The whole configuration: ``ProxyConfig``, the sections it holds, the rules that span several of
them (ports that must not overlap, settings that exclude each other), and its one-line summary."""

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
from kproxy.config.kms import KmsConfig
from kproxy.config.limits import LimitsConfig, effective_workers
from kproxy.config.listener import ExposureConfig, ProxyProtocolConfig, SaslConfig, TlsServerSide
from kproxy.config.quotas import QuotaConfig
from kproxy.config.telemetry import AdminConfig, MetricsConfig, TracingConfig, TrafficLogConfig
from kproxy.config.upstream import UpstreamConfig

_WILDCARD_HOSTS: Final = frozenset({"0.0.0.0", "::"})


@attrs.frozen(field_transformer=with_checks)
class ProxyConfig:
    """Everything kproxy needs to run. Build it with ``load_config`` or ``config_from_args``."""

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
    # null: never.
    cut_through_min_bytes: int | None = setting(65536, min=1)
    # Streamed record batch bodies move broker -> client by splice(2), never copied through kproxy
    # (Linux, plain TCP on both sides). Off by default: on loopback it measured no faster than the
    # copy (docs/performance-streaming.md).
    cut_through_splice: bool = False
    log_level: str = setting("INFO", case="upper", choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"))
    log_format: str = setting("text", case="lower", choices=("text", "json"))
    # Processes sharing the listening ports; 0 (written "auto") means one per CPU the process may use.
    workers: int = setting(1, min=0, auto=True)
    source: str | None = attrs.field(default=None, metadata={INTERNAL: True})  # file loaded from

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
        local = self.kms.local if self.kms is not None else None
        if local is not None and self.mode == "gateway" and not local.allow_in_gateway:
            raise SettingError(("kms", "local"), "a local key file is for development only and mode: gateway "
                                                 "refuses it; use vault or aws, or set allow_in_gateway: true")
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
    blame: SettingPath = ("listen",) if exp.broker_port_start is None else ("exposure", "broker_port_start")
    if last > MAX_PORT:
        if blame == ("listen",) and exp.broker_port_count != _DEFAULT_PORT_COUNT:
            blame = ("exposure", "broker_port_count")
        raise SettingError(blame, f"broker ports {start}..{last} run past {MAX_PORT}; lower "
                                  f"exposure.broker_port_start or exposure.broker_port_count")
    if start <= cfg.listen.port <= last:
        raise SettingError(blame, f"broker ports {start}..{last} include the listen port {cfg.listen.port}")


_DEFAULT_PORT_COUNT: Final = attrs.fields(ExposureConfig).broker_port_count.default


def _may_share(a: str, b: str) -> bool:
    # Two listeners can use one port only on two distinct, specific addresses.
    return a == b or a in _WILDCARD_HOSTS or b in _WILDCARD_HOSTS


name_sections(ProxyConfig)


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

"""The proxy's settings: attrs frozen classes that check their own values, loaded from YAML.

The classes hold every rule, so a config built in code, by quick mode or with ``attrs.evolve`` is
checked exactly like a file; a broken setting is a ``SettingError`` naming it. The YAML loader adds
the file and the 1-based line of the offending key, expands ``${VAR}`` and gives "did you mean"
hints. The package reads the config file, checks that the TLS files it names exist and reads the
cgroup limits; it must not open sockets, load certificates or start tasks, and it imports nothing
from kproxy.protocol but its errors.

- ``checks``: what a setting is (``setting``, ``with_checks``), the rules every value is held to,
  ``ConfigError`` and ``SettingError``, and the values both sides share (``HostPort``).
- ``upstream``: the brokers' side (bootstrap servers, TLS and SASL origination), or several clusters
  with the active one, failover and what a switch does.
- ``listener``: the clients' side (exposure, SNI, TLS termination and principals, the PROXY
  protocol, SASL termination).
- ``limits``: bounds on what connections may make kproxy hold, and the amounts derived from the
  machine (buffer budget, workers).
- ``telemetry``: the admin listener, metrics, the traffic log, tracing.
- ``kms``: the KMS holding record encryption's KEKs, and data key lifetimes.
- ``quotas``: how quotas measure rates and how a fleet shares them.
- ``proxy``: ``ProxyConfig``, the whole, with the rules that span sections and its summary.
- ``clusters``: virtual clusters: which settings are each one's and which the process's, and the
  rules across them (names, ports, SNI host names).
- ``loader``: YAML (file, string, quick mode) to ``ProxyConfig``, errors with file and line.
- ``changes``: which settings differ between two configs (what a SIGHUP names as waiting for a restart).
"""

from kproxy.config.checks import SASL_MECHANISMS, ConfigError, HostPort, SettingError
from kproxy.config.clusters import DEFAULT_NAME, PROCESS_SETTINGS, cluster_settings, derived_cluster_id
from kproxy.config.kms import AwsKmsConfig, KmsConfig, LocalKmsConfig, Pkcs11KmsConfig, VaultKmsConfig
from kproxy.config.limits import LimitsConfig, effective_buffer_budget, effective_workers
from kproxy.config.listener import (
    ExposureConfig,
    PrincipalConfig,
    ProxyProtocolConfig,
    SaslConfig,
    SaslGssapi,
    SaslOAuth,
    SniConfig,
    TlsServerSide,
)
from kproxy.config.loader import apply_overrides, config_from_args, load_config, parse_config, read_text_file
from kproxy.config.proxy import ProxyConfig, describe_cluster, describe_config
from kproxy.config.quotas import CoordinationConfig, QuotaConfig
from kproxy.config.telemetry import AdminConfig, MetricsConfig, TracingConfig, TrafficLogConfig
from kproxy.config.upstream import (
    FailoverConfig,
    SwitchConfig,
    TlsClientSide,
    UpstreamCluster,
    UpstreamConfig,
    UpstreamOAuth,
    UpstreamSasl,
)

__all__ = [
    "DEFAULT_NAME",
    "PROCESS_SETTINGS",
    "SASL_MECHANISMS",
    "AdminConfig",
    "AwsKmsConfig",
    "ConfigError",
    "CoordinationConfig",
    "ExposureConfig",
    "FailoverConfig",
    "HostPort",
    "KmsConfig",
    "LimitsConfig",
    "LocalKmsConfig",
    "MetricsConfig",
    "Pkcs11KmsConfig",
    "PrincipalConfig",
    "ProxyConfig",
    "ProxyProtocolConfig",
    "QuotaConfig",
    "SaslConfig",
    "SaslGssapi",
    "SaslOAuth",
    "SettingError",
    "SniConfig",
    "SwitchConfig",
    "TlsClientSide",
    "TlsServerSide",
    "TracingConfig",
    "TrafficLogConfig",
    "UpstreamCluster",
    "UpstreamConfig",
    "UpstreamOAuth",
    "UpstreamSasl",
    "VaultKmsConfig",
    "apply_overrides",
    "cluster_settings",
    "config_from_args",
    "derived_cluster_id",
    "describe_cluster",
    "describe_config",
    "effective_buffer_budget",
    "effective_workers",
    "load_config",
    "parse_config",
    "read_text_file",
]

"""The brokers' side: where the cluster is, how kproxy reaches it (TLS origination) and how it logs
in as itself (SASL origination, with its own OAuth client credentials when OAUTHBEARER); or several
clusters one virtual cluster can run on (``upstream.clusters``), which one is active, and when kproxy
switches by itself (``failover``)."""

import re
from typing import Any, Final

import attrs

from kproxy.config.checks import (
    NOT_GIVEN,
    SASL_MECHANISMS,
    HostPort,
    SettingError,
    check_files,
    did_you_mean,
    dotted,
    kerberos_principal_problem,
    path_of,
    setting,
    url_problem,
    with_checks,
)


@attrs.frozen(field_transformer=with_checks)
class TlsClientSide:
    """TLS from kproxy to the brokers (origination)."""

    enabled: bool = False
    ca_file: str | None = setting(None, file=True)
    cert_file: str | None = setting(None, file=True)
    key_file: str | None = setting(None, file=True)
    server_hostname: str | None = setting(None, name="host")
    verify: bool = True

    def __attrs_post_init__(self) -> None:
        if not self.enabled:
            return  # charts template the paths in always and switch TLS with one flag
        if (self.cert_file is None) != (self.key_file is None):
            given, missing = ("cert_file", "key_file") if self.key_file is None else ("key_file", "cert_file")
            raise SettingError(path_of(self, given), f"a client certificate needs both cert_file and key_file; "
                                                     f"{dotted(path_of(self, missing))} is not set")
        check_files(self)


def _one_secret(section: Any, value: str, file: str, what: str) -> None:
    given = [n for n in (value, file) if getattr(section, n) is not None]
    if len(given) != 1:
        problem = (f"give {what} as {value} (from ${{VAR}}) or {file}, not both" if given
                   else f"needs {what}: {value} (from ${{VAR}}) or {file}")
        raise SettingError(path_of(section, given[-1] if given else value), problem)


@attrs.frozen(field_transformer=with_checks)
class UpstreamOAuth:
    """OAUTHBEARER origination: kproxy gets its own token by client credentials (RFC 6749 4.4)."""

    token_endpoint_url: str = setting()
    client_id: str = setting()
    client_secret: str | None = None
    client_secret_file: str | None = setting(None, file=True)
    scope: str | None = None
    # SASL extensions sent with the token (KIP-342), such as logicalCluster on Confluent Cloud.
    extensions: dict[str, str] = attrs.field(factory=dict, hash=False)

    def __attrs_post_init__(self) -> None:
        problem = url_problem(self.token_endpoint_url)
        if problem is not None:
            raise SettingError(path_of(self, "token_endpoint_url"), problem)
        _one_secret(self, "client_secret", "client_secret_file", "the client secret")
        for key, value in self.extensions.items():
            if not re.fullmatch(r"[A-Za-z]+", key) or key == "auth" or not isinstance(value, str):
                raise SettingError((*path_of(self, "extensions"), key),
                                   "an extension name is letters only (not 'auth'), its value a string")
        check_files(self)


@attrs.frozen(field_transformer=with_checks)
class UpstreamSasl:
    """Origination: every broker connection kproxy opens logs in as kproxy, before any request."""

    mechanism: str = setting(case="upper", choices=SASL_MECHANISMS)
    username: str | None = None
    password: str | None = None
    password_file: str | None = setting(None, file=True)
    oauth: UpstreamOAuth | None = None      # read only with OAUTHBEARER
    # GSSAPI (Kerberos): kproxy's own principal, the keytab holding its key, and the service name of
    # the brokers' principals, <service_name>/<broker host>@<kproxy's realm> (Kafka's
    # sasl.kerberos.service.name).
    principal: str | None = None
    keytab: str | None = setting(None, file=True)
    service_name: str = "kafka"

    def __attrs_post_init__(self) -> None:
        if self.mechanism == "GSSAPI":
            _check_gssapi_origination(self)
            return
        for name in ("principal", "keytab"):
            if getattr(self, name) is not None:
                raise SettingError(path_of(self, name), f"is read only with mechanism: GSSAPI (this is {self.mechanism})")
        if self.mechanism == "OAUTHBEARER":
            if self.oauth is None:
                raise SettingError(path_of(self, "mechanism"), "OAUTHBEARER needs upstream.sasl.oauth "
                                                               "(token_endpoint_url, client_id, client secret)")
            return
        if not self.username:
            raise SettingError(path_of(self, "username"), f"{self.mechanism} needs a username")
        _one_secret(self, "password", "password_file", "a password")
        check_files(self)


def _check_gssapi_origination(section: UpstreamSasl) -> None:
    for name in ("principal", "keytab"):
        if getattr(section, name) is None:
            raise SettingError(path_of(section, "mechanism"), f"GSSAPI needs upstream.sasl.{name} (kproxy's "
                                                              "principal and the keytab that holds its key)")
    for name in ("username", "password", "password_file", "oauth"):
        if getattr(section, name) is not None:
            raise SettingError(path_of(section, name), "GSSAPI logs in with principal and keytab; remove it")
    assert section.principal is not None
    problem = kerberos_principal_problem(section.principal, instance=False)
    if problem is not None:
        raise SettingError(path_of(section, "principal"), problem)
    if not re.fullmatch(r"[A-Za-z0-9._-]+", section.service_name):
        raise SettingError(path_of(section, "service_name"), f"{section.service_name!r} is not a service name "
                                                             "(the first part of the brokers' principals, e.g. kafka)")
    check_files(section)
_TOPIC_CHARS: Final = re.compile(r"[a-zA-Z0-9._-]{1,200}")


@attrs.frozen(field_transformer=with_checks)
class UpstreamCluster:
    """One of the clusters a virtual cluster can run on (``upstream.clusters``): where it is, how
    kproxy reaches it and logs in, and the prefix its topics carry when it is a MirrorMaker 2 replica
    named by the default replication policy (``primary.orders`` for the primary's ``orders``)."""

    name: str = setting(name="label")
    bootstrap_servers: tuple[HostPort, ...] = setting()
    tls: TlsClientSide = TlsClientSide()
    sasl: UpstreamSasl | None = None
    # Clients keep seeing ``orders``; kproxy asks this cluster for ``<topic_prefix>orders``.
    topic_prefix: str | None = None
    # The cluster's alias in MirrorMaker 2's configuration (its internal topics are named by it).
    mm2_alias: str | None = setting(None, name="label")

    def __attrs_post_init__(self) -> None:
        if self.topic_prefix is not None and not _TOPIC_CHARS.fullmatch(self.topic_prefix):
            raise SettingError(path_of(self, "topic_prefix"), f"{self.topic_prefix!r} cannot start a topic name "
                                                              f"(letters, digits, '.', '_', '-')")

    @property
    def alias(self) -> str:
        """The name MirrorMaker 2 knows this cluster by."""
        return self.mm2_alias or self.name


@attrs.frozen(field_transformer=with_checks)
class FailoverConfig:
    """Switch by itself when the active cluster has been unreachable (no broker answers) for
    ``after_s`` seconds; a cluster that answers but refuses (a failed login) is reachable."""

    after_s: float = setting(above=0)
    # false keeps the section written but off (charts template it in and switch it with one flag).
    enabled: bool = True
    # How often each cluster is probed (ApiVersions on a fresh connection); null: after_s / 5, at most 1 s.
    probe_interval_s: float | None = setting(None, above=0)

    @property
    def probe_every(self) -> float:
        return self.probe_interval_s if self.probe_interval_s is not None else min(1.0, self.after_s / 5)


@attrs.frozen(field_transformer=with_checks)
class SwitchConfig:
    """How a switch treats what is under way (``upstream.switch``)."""

    # Connections on the old cluster answer what is in flight for up to this long, then close.
    drain_s: float = setting(5.0, above=0)
    # A planned switch waits up to this long for the replica to hold what the old cluster acknowledged.
    catch_up_s: float = setting(10.0, min=0)


@attrs.frozen(field_transformer=with_checks)
class UpstreamConfig:
    """The real cluster: where to bootstrap, how to reach it, how long to wait for it; or several
    clusters (``clusters``) with the one in use (``active``)."""

    bootstrap_servers: tuple[HostPort, ...] = NOT_GIVEN
    tls: TlsClientSide = TlsClientSide()
    sasl: UpstreamSasl | None = None
    connect_timeout_s: float = setting(10.0, above=0)
    # A request with no response after this gets a retriable error sent back to the client.
    request_timeout_s: float = setting(30.0, above=0)
    clusters: tuple[UpstreamCluster, ...] = ()
    active: str | None = None                  # null: the first of clusters
    failover: FailoverConfig | None = None
    switch: SwitchConfig = SwitchConfig()
    # mm2: on a switch, kproxy commits translated offsets for the groups it saw commit (from MM2's
    # offset syncs) and, for the others, from MM2's checkpoints; off: MM2's own group offset sync.
    offset_translation: str = setting("off", choices=("off", "mm2"), off=True)
    # Where the active cluster is kept across restarts (null: kproxy-state.json beside the config file).
    state_file: str | None = setting(None, file=True)

    def __attrs_post_init__(self) -> None:
        if not self.clusters:
            if self.bootstrap_servers is NOT_GIVEN:
                raise SettingError(path_of(self, "")[:-1], "missing required key 'bootstrap_servers' (or list "
                                                           "several clusters under clusters)")
            if self.active is not None:
                raise SettingError(path_of(self, "active"), "needs several clusters under upstream.clusters")
            if self.failover is not None and self.failover.enabled:
                raise SettingError(path_of(self, "failover"), "needs several clusters under upstream.clusters")
            if self.offset_translation != "off":
                raise SettingError(path_of(self, "offset_translation"),
                                   "needs several clusters under upstream.clusters")
            return
        if self.bootstrap_servers is not NOT_GIVEN:
            raise SettingError(path_of(self, "bootstrap_servers"), "give bootstrap_servers in each of clusters, "
                                                                   "not here as well")
        for key in ("tls", "sasl"):
            if getattr(self, key) != attrs.fields_dict(UpstreamConfig)[key].default:
                raise SettingError(path_of(self, key), f"with clusters, each cluster has its own {key}; move it "
                                                       f"into the clusters that need it")
        if len(self.clusters) < 2:
            raise SettingError(path_of(self, "clusters"), "list two or more clusters (one cluster: write its "
                                                          "bootstrap_servers under upstream)")
        seen: dict[str, int] = {}
        aliases: dict[str, int] = {}
        for i, c in enumerate(self.clusters):
            if c.name in seen:
                raise SettingError((*path_of(self, "clusters"), i, "name"),
                                   f"{c.name!r} is already the name of clusters[{seen[c.name]}]")
            seen[c.name] = i
            if c.alias in aliases:
                raise SettingError((*path_of(self, "clusters"), i, "mm2_alias"),
                                   f"MirrorMaker 2 alias {c.alias!r} is also clusters[{aliases[c.alias]}]'s")
            aliases[c.alias] = i
        if self.active is not None and self.active not in seen:
            raise SettingError(path_of(self, "active"), f"names no cluster; one of {', '.join(seen)}"
                                                        f"{did_you_mean(self.active, seen)}")

    @property
    def failing_over(self) -> FailoverConfig | None:
        """The failover settings when automatic failover is on, else None."""
        f = self.failover
        return f if f is not None and f.enabled else None

    @property
    def several(self) -> bool:
        """Whether this virtual cluster can run on several clusters (``clusters``)."""
        return bool(self.clusters)

    @property
    def first_active(self) -> str:
        """The cluster in use when no switch says otherwise ("default" for the single-cluster form)."""
        if not self.clusters:
            return "default"
        return self.active or self.clusters[0].name

    def cluster(self, name: str) -> "UpstreamConfig":
        """The settings of one cluster as a single-cluster ``upstream`` (the timeouts are shared);
        the single-cluster form is its own one cluster, "default"."""
        if not self.clusters:
            return self
        (c,) = (c for c in self.clusters if c.name == name)
        return UpstreamConfig(bootstrap_servers=c.bootstrap_servers, tls=c.tls, sasl=c.sasl,
                              connect_timeout_s=self.connect_timeout_s, request_timeout_s=self.request_timeout_s)

    def topic_prefix(self, name: str) -> str | None:
        return next((c.topic_prefix for c in self.clusters if c.name == name), None)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.clusters) if self.clusters else ("default",)

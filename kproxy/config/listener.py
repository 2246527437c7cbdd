"""The clients' side: how brokers are presented to clients (a port each, or SNI names), TLS
termination and the principal a certificate maps to, the PROXY protocol header, and SASL
termination (kproxy checking client logins itself)."""

import contextlib

import attrs

from kproxy.config.checks import (
    MAX_PORT,
    SASL_MECHANISMS,
    SettingError,
    check_files,
    did_you_mean,
    kerberos_principal_problem,
    path_of,
    setting,
    url_problem,
    with_checks,
)


@attrs.frozen(field_transformer=with_checks)
class SniConfig:
    """Names for SNI routing: brokers are ``broker-<node_id>.<domain>``, bootstrap ``<bootstrap_name>.<domain>``."""

    domain: str = setting(name="domain")
    bootstrap_name: str = setting("bootstrap", name="label")


@attrs.frozen(field_transformer=with_checks)
class ExposureConfig:
    """How brokers are presented to clients: one port each, or one port with SNI names."""

    mode: str = setting("port_per_broker", choices=("port_per_broker", "sni"))
    advertised_host: str | None = setting(None, name="host")  # None: the listen host
    broker_port_start: int | None = setting(None, min=1, max=MAX_PORT)  # None: listen port + 1
    broker_port_count: int = setting(64, min=1, max=MAX_PORT)
    # None: ports handed out in order of discovery; an int: port = start + node_id - node_id_base.
    node_id_base: int | None = setting(None, min=0)
    sni: SniConfig | None = None

    def __attrs_post_init__(self) -> None:
        if self.mode == "sni" and self.sni is None:
            raise SettingError(path_of(self, "mode"), "sni needs exposure.sni.domain")


@attrs.frozen(field_transformer=with_checks)
class PrincipalConfig:
    """How a verified client certificate becomes the principal: Kafka's ``ssl.principal.mapping.rules``
    over its RFC 2253 subject, or (``san_uri``) its URI SAN, a SPIFFE ID."""

    mapping_rules: tuple[str, ...] = setting(("DEFAULT",), text=True)
    san_uri: bool = False

    def __attrs_post_init__(self) -> None:
        from kproxy.identity.principal import MappingRuleError, parse_rules

        if not self.mapping_rules:
            raise SettingError(path_of(self, "mapping_rules"), "needs at least one rule (DEFAULT keeps the subject)")
        try:
            parse_rules(self.mapping_rules)
        except MappingRuleError as e:
            raise SettingError((*path_of(self, "mapping_rules"), e.index), str(e)) from None
        if self.san_uri and self.mapping_rules != ("DEFAULT",):
            raise SettingError(path_of(self, "san_uri"), "takes the URI SAN as it is; remove mapping_rules, "
                                                         "or set san_uri: false to map the subject")


@attrs.frozen(field_transformer=with_checks)
class TlsServerSide:
    """TLS from clients to kproxy (termination); mTLS when ``require_client_cert``."""

    enabled: bool = False
    cert_file: str | None = setting(None, file=True)
    key_file: str | None = setting(None, file=True)
    ca_file: str | None = setting(None, file=True)
    require_client_cert: bool = False
    principal: PrincipalConfig = PrincipalConfig()

    def __attrs_post_init__(self) -> None:
        if self.principal != PrincipalConfig() and self.ca_file is None:
            raise SettingError(path_of(self, "principal"), "maps client certificates, which need tls.ca_file "
                                                           "(the CA that signs them)")
        if self.require_client_cert:
            if not self.enabled:
                raise SettingError(path_of(self, "require_client_cert"), "needs tls.enabled: true")
            if self.ca_file is None:
                raise SettingError(path_of(self, "require_client_cert"),
                                   "needs tls.ca_file, the CA that signs the client certificates")
        if self.enabled:
            for name in ("cert_file", "key_file"):
                if getattr(self, name) is None:
                    raise SettingError(path_of(self, "enabled"), f"TLS termination needs tls.{name}")
            check_files(self)


@attrs.frozen(field_transformer=with_checks)
class ProxyProtocolConfig:
    """The HAProxy PROXY protocol header on the client listeners, from load balancers in ``trusted``."""

    mode: str = setting("off", case="lower", choices=("off", "optional", "required"), off=True)
    trusted: tuple[str, ...] = setting((), text=True)    # CIDRs of the peers that may send one
    timeout_s: float = setting(10.0, above=0)             # to receive the whole header

    def __attrs_post_init__(self) -> None:
        import ipaddress

        for i, cidr in enumerate(self.trusted):
            try:
                ipaddress.ip_network(cidr, strict=True)
            except ValueError as e:
                hint = ""
                with contextlib.suppress(ValueError):
                    hint = f" (did you mean {str(ipaddress.ip_network(cidr, strict=False))!r}?)"
                raise SettingError((*path_of(self, "trusted"), i), f"{cidr!r} is not a CIDR: {e}{hint}") from None
        if self.mode != "off" and not self.trusted:
            raise SettingError(path_of(self, "mode"), "needs proxy_protocol.trusted, the CIDRs of the load "
                                                      "balancers allowed to send the header")


@attrs.frozen(field_transformer=with_checks)
class SaslOAuth:
    """How client tokens (OAUTHBEARER) are checked: signed by a key of ``jwks_url``, for this issuer
    and audience; the principal is ``User:<principal_claim>``."""

    jwks_url: str = setting()
    issuer: str = setting()
    audience: str = setting()
    principal_claim: str = "sub"
    # The key set is fetched again this often, and at once (at most every 10 s) for an unknown kid.
    jwks_refresh_s: float = setting(3600.0, min=10)
    leeway_s: float = setting(30.0, min=0, max=600)

    def __attrs_post_init__(self) -> None:
        problem = url_problem(self.jwks_url)
        if problem is not None:
            raise SettingError(path_of(self, "jwks_url"), problem)


@attrs.frozen(field_transformer=with_checks)
class SaslGssapi:
    """How Kerberos logins (GSSAPI) are checked: with kproxy's service keytab (never the one
    KRB5_KTNAME names), and how a client's principal becomes ``User:<name>`` (Kafka's
    ``sasl.kerberos.principal.to.local.rules``)."""

    # kproxy's service principal, service/host@REALM; the keytab must hold it, and clients' tickets
    # for any other principal of the same service and realm in it are accepted too (one per host
    # name clients use to reach kproxy).
    principal: str = setting()
    keytab: str = setting(file=True)
    principal_to_local: tuple[str, ...] = setting(("DEFAULT",), text=True)

    def __attrs_post_init__(self) -> None:
        from kproxy.identity.principal import MappingRuleError

        problem = kerberos_principal_problem(self.principal, instance=True)
        if problem is not None:
            raise SettingError(path_of(self, "principal"), problem)
        if not self.principal_to_local:
            raise SettingError(path_of(self, "principal_to_local"), "needs at least one rule (DEFAULT takes the "
                                                                    "first part of principals of kproxy's realm)")
        from kproxy.identity.kerberos import parse_kerberos_rules

        try:
            parse_kerberos_rules(self.principal_to_local)
        except MappingRuleError as e:
            raise SettingError((*path_of(self, "principal_to_local"), e.index), str(e)) from None
        # The keytab is looked for only when GSSAPI is offered (SaslConfig), so a template may keep it.


@attrs.frozen(field_transformer=with_checks)
class SaslConfig:
    """Termination: kproxy authenticates clients itself; nothing reaches a broker before that."""

    mechanisms: tuple[str, ...] = setting(words=True, case="upper")
    users_file: str | None = setting(None, file=True)
    # KIP-368: clients re-authenticate within this (or their token's remaining life); 0: never.
    max_session_s: float = setting(3600.0, min=0)
    # Every failed login is answered this long after it began, whatever failed.
    failed_login_delay_s: float = setting(0.5, min=0, max=10)
    # Failed logins allowed per source address per minute; then its logins are refused. 0: no limit.
    max_failed_logins_per_minute: int = setting(10, min=0)
    oauth: SaslOAuth | None = None
    gssapi: SaslGssapi | None = None

    def __attrs_post_init__(self) -> None:
        if not self.mechanisms:
            raise SettingError(path_of(self, "mechanisms"), f"list at least one of {', '.join(SASL_MECHANISMS)}")
        for i, mechanism in enumerate(self.mechanisms):
            if mechanism not in SASL_MECHANISMS:
                raise SettingError((*path_of(self, "mechanisms"), i),
                                   f"must be one of {', '.join(SASL_MECHANISMS)}; got {mechanism!r}"
                                   f"{did_you_mean(mechanism, SASL_MECHANISMS)}")
            if mechanism in self.mechanisms[:i]:
                raise SettingError((*path_of(self, "mechanisms"), i), f"lists {mechanism} twice")
        if any(m not in ("OAUTHBEARER", "GSSAPI") for m in self.mechanisms) and self.users_file is None:
            raise SettingError(path_of(self, "mechanisms"), "PLAIN and SCRAM check clients against sasl.users_file "
                                                            "(write it with `kproxy users add`)")
        if "OAUTHBEARER" in self.mechanisms and self.oauth is None:
            raise SettingError(path_of(self, "mechanisms"), "OAUTHBEARER needs sasl.oauth (jwks_url, issuer, "
                                                            "audience)")
        if "GSSAPI" in self.mechanisms:
            if self.gssapi is None:
                raise SettingError(path_of(self, "mechanisms"), "GSSAPI needs sasl.gssapi (principal, keytab)")
            check_files(self.gssapi)
        check_files(self)

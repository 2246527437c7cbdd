"""The brokers' side: where the cluster is, how kproxy reaches it (TLS origination) and how it logs
in as itself (SASL origination, with its own OAuth client credentials when OAUTHBEARER)."""

import re
from typing import Any

import attrs

from kproxy.config.checks import (
    SASL_MECHANISMS,
    HostPort,
    SettingError,
    check_files,
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


@attrs.frozen(field_transformer=with_checks)
class UpstreamConfig:
    """The real cluster: where to bootstrap, how to reach it, how long to wait for it."""

    bootstrap_servers: tuple[HostPort, ...]
    tls: TlsClientSide = TlsClientSide()
    sasl: UpstreamSasl | None = None
    connect_timeout_s: float = setting(10.0, above=0)
    # A request with no response after this gets a retriable error sent back to the client.
    request_timeout_s: float = setting(30.0, above=0)

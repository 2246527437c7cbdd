"""The settings loader: exact objects from YAML, defaults, and every error pointing at file and line."""

from __future__ import annotations

import math
import re
import textwrap
import types
import typing
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
import yaml

from kproxy.cli import check_config_file
from kproxy.config import (
    AdminConfig,
    ConfigError,
    ExposureConfig,
    HostPort,
    LimitsConfig,
    ProxyConfig,
    SettingError,
    SniConfig,
    TlsClientSide,
    TlsServerSide,
    UpstreamConfig,
    apply_overrides,
    config_from_args,
    describe_config,
    effective_buffer_budget,
    load_config,
    parse_config,
)
from kproxy.protocol.errors import KProxyError

EXAMPLE = Path(__file__).resolve().parents[2] / "kproxy.example.yaml"

MINIMAL = """\
listen: "127.0.0.1:9092"
upstream:
  bootstrap_servers: ["kafka:9092"]
"""


def write(tmp_path: Path, text: str, name: str = "kproxy.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def load_error(tmp_path: Path, text: str) -> ConfigError:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    err = info.value
    assert err.file == str(path)
    assert str(err).startswith(f"{path}:{err.line}: " if err.line is not None else f"{path}: ")
    return err


# -- a full file, defaults, properties ------------------------------------------------------------


def test_full_file_loads_into_the_exact_objects(tmp_path: Path) -> None:
    for name in ("ca.pem", "kproxy.crt", "kproxy.key", "client.crt", "client.key", "clients-ca.pem"):
        (tmp_path / name).write_text("pem")
    path = write(tmp_path, """\
        listen: "[::1]:19092"
        mode: gateway
        log_level: debug
        log_format: JSON
        passthrough_unknown_versions: true
        upstream:
          bootstrap_servers: "kafka-0:9092, kafka-1:9093"
          connect_timeout_s: 5
          request_timeout_s: 12.5
          tls:
            enabled: true
            ca_file: ca.pem
            cert_file: client.crt
            key_file: client.key
            server_hostname: kafka.internal
            verify: false
        exposure:
          mode: sni
          advertised_host: kp.example.com
          broker_port_start: 20000
          broker_port_count: 8
          node_id_base: 1
          sni:
            domain: kafka.example.com
            bootstrap_name: boot
        tls:
          enabled: true
          cert_file: kproxy.crt
          key_file: kproxy.key
          ca_file: clients-ca.pem
          require_client_cert: true
        limits:
          max_frame_size: 1_048_576
          max_in_flight_requests: 16
          max_buffered_bytes: 2097152
          max_buffered_bytes_total: 8388608
          max_decompressed_batch_bytes: 4194304
          unauthenticated_idle_timeout_s: 3
          idle_timeout_s: 0
          frame_timeout_s: 2.5
          tls_handshake_timeout_s: 4
          drain_timeout_s: 0
        admin:
          listen: "127.0.0.1:9644"
        """)
    d = str(tmp_path)
    assert load_config(path) == ProxyConfig(
        listen=HostPort("::1", 19092),
        upstream=UpstreamConfig(
            bootstrap_servers=(HostPort("kafka-0", 9092), HostPort("kafka-1", 9093)),
            tls=TlsClientSide(
                enabled=True, ca_file=f"{d}/ca.pem", cert_file=f"{d}/client.crt", key_file=f"{d}/client.key",
                server_hostname="kafka.internal", verify=False,
            ),
            connect_timeout_s=5.0,
            request_timeout_s=12.5,
        ),
        mode="gateway",
        exposure=ExposureConfig(
            mode="sni", advertised_host="kp.example.com", broker_port_start=20000, broker_port_count=8,
            node_id_base=1, sni=SniConfig(domain="kafka.example.com", bootstrap_name="boot"),
        ),
        tls=TlsServerSide(
            enabled=True, cert_file=f"{d}/kproxy.crt", key_file=f"{d}/kproxy.key",
            ca_file=f"{d}/clients-ca.pem", require_client_cert=True,
        ),
        limits=LimitsConfig(
            max_frame_size=1048576, max_in_flight_requests=16, max_buffered_bytes=2097152,
            max_buffered_bytes_total=8388608, max_decompressed_batch_bytes=4194304,
            unauthenticated_idle_timeout_s=3.0, idle_timeout_s=0.0, frame_timeout_s=2.5,
            tls_handshake_timeout_s=4.0, drain_timeout_s=0.0,
        ),
        passthrough_unknown_versions=True,
        admin=AdminConfig(listen=HostPort("127.0.0.1", 9644)),
        log_level="DEBUG",
        log_format="json",
        source=str(path),
    )


def test_minimal_file_takes_every_default(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL)
    cfg = load_config(path)
    assert cfg == ProxyConfig(
        listen=HostPort("127.0.0.1", 9092),
        upstream=UpstreamConfig(bootstrap_servers=(HostPort("kafka", 9092),)),
        source=str(path),
    )
    assert cfg.upstream.tls == TlsClientSide()
    assert (cfg.upstream.connect_timeout_s, cfg.upstream.request_timeout_s) == (10.0, 30.0)
    assert cfg.exposure == ExposureConfig(mode="port_per_broker", broker_port_count=64)
    assert cfg.limits.max_frame_size == 100 * 1024 * 1024
    assert cfg.limits.max_in_flight_requests == 256
    assert cfg.limits.max_buffered_bytes == 64 * 1024 * 1024
    assert cfg.limits.max_decompressed_batch_bytes == 256 * 1024 * 1024
    assert cfg.limits.max_buffered_bytes_total is None
    assert (cfg.limits.unauthenticated_idle_timeout_s, cfg.limits.idle_timeout_s) == (30.0, 600.0)
    assert (cfg.limits.frame_timeout_s, cfg.limits.tls_handshake_timeout_s) == (30.0, 10.0)
    assert cfg.limits.drain_timeout_s == 10.0
    assert (cfg.mode, cfg.log_level, cfg.log_format) == ("gateway", "INFO", "text")
    assert cfg.passthrough_unknown_versions is False
    assert cfg.tls == TlsServerSide() and cfg.admin == AdminConfig(listen=None)
    assert cfg.advertised_host == "127.0.0.1"
    assert cfg.broker_port_start == 9093


def test_sections_left_empty_mean_their_defaults() -> None:
    cfg = parse_config(MINIMAL + "tls:\nlimits:\nexposure:\n")
    assert (cfg.tls, cfg.limits, cfg.exposure) == (TlsServerSide(), LimitsConfig(), ExposureConfig())


def test_advertised_host_and_broker_port_start_properties() -> None:
    base = parse_config(MINIMAL)
    assert base.advertised_host == "127.0.0.1"
    explicit = attrs.evolve(base, exposure=ExposureConfig(advertised_host="kp", broker_port_start=30000))
    assert explicit.advertised_host == "kp"
    assert explicit.broker_port_start == 30000
    assert attrs.evolve(base, mode="sidecar").advertised_host == "localhost"


def test_config_objects_are_frozen_and_slotted() -> None:
    cfg = parse_config(MINIMAL)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        cfg.mode = "sidecar"  # type: ignore[misc]
    assert not hasattr(cfg, "__dict__") and not hasattr(cfg.limits, "__dict__")


def test_anchors_and_aliases_are_followed() -> None:
    cfg = parse_config("""\
listen: &addr "127.0.0.1:9092"
upstream:
  bootstrap_servers: ["a:1", "b:2"]
  connect_timeout_s: &t 3
  request_timeout_s: *t
""")
    assert cfg.upstream.bootstrap_servers == (HostPort("a", 1), HostPort("b", 2))
    assert (cfg.upstream.connect_timeout_s, cfg.upstream.request_timeout_s) == (3.0, 3.0)


def test_merge_key_values_can_be_overridden() -> None:
    cfg = parse_config("""\
listen: "127.0.0.1:9092"
upstream:
  <<: {bootstrap_servers: "a:1", connect_timeout_s: 1}
  connect_timeout_s: 2
""")
    assert cfg.upstream.bootstrap_servers == (HostPort("a", 1),)
    assert cfg.upstream.connect_timeout_s == 2.0


# -- HostPort ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected", "printed"),
    [
        ("localhost:9092", HostPort("localhost", 9092), "localhost:9092"),
        ("10.0.0.1:1", HostPort("10.0.0.1", 1), "10.0.0.1:1"),
        ("[::1]:9092", HostPort("::1", 9092), "[::1]:9092"),
        (" kafka.svc:65535 ", HostPort("kafka.svc", 65535), "kafka.svc:65535"),
    ],
)
def test_host_port_parses_and_prints(text: str, expected: HostPort, printed: str) -> None:
    assert HostPort.parse(text) == expected
    assert str(expected) == printed
    assert HostPort.parse(str(expected)) == expected


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("kafka", "expected HOST:PORT"),
        ("kafka:", "is not a number"),
        ("kafka:abc", "is not a number"),
        ("kafka:0", "outside 1..65535"),
        ("kafka:65536", "outside 1..65535"),
        (":9092", "no host"),
        ("::1:9092", "needs brackets"),
        ("[::1]9092", r"expected \[IPV6\]:PORT"),
        ("bad host:1", "not a host name"),
    ],
)
def test_host_port_rejects(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        HostPort.parse(text)


# -- errors, each with its file and line ------------------------------------------------------------

HEADER = 'listen: "127.0.0.1:9092"\nupstream:\n  bootstrap_servers: ["kafka:9092"]\n'


@pytest.mark.parametrize(
    ("text", "line", "reason"),
    [
        # unknown keys, with hints
        (HEADER + "limits:\n  max_frame_sise: 10\n", 5, "limits: unknown key 'max_frame_sise' (did you mean 'max_frame_size'?)"),
        (HEADER + "max_in_flight_requests: 3\n", 4, "unknown key 'max_in_flight_requests' (it belongs under 'limits')"),
        (HEADER + "zzz: 1\n", 4, "unknown key 'zzz' (expected one of: listen, upstream, mode"),
        (HEADER + "source: x.yaml\n", 4, "unknown key 'source'"),
        ('listen: "a:1"\nupstream:\n  bootstrap_servers: "k:1"\n  tls:\n    enable: true\n', 5,
         "upstream.tls: unknown key 'enable' (did you mean 'enabled'?)"),
        # missing and duplicate keys
        ('listen: "a:1"\n', 1, "missing required key 'upstream'"),
        ('listen: "a:1"\nupstream:\n  connect_timeout_s: 1\n', 2, "upstream: missing required key 'bootstrap_servers'"),
        (HEADER + 'listen: "a:2"\n', 4, "duplicate key 'listen' (first at line 1)"),
        # wrong types
        (HEADER + "limits:\n  max_frame_size: abc\n", 5, "limits.max_frame_size: expected an integer, got 'abc'"),
        (HEADER + "limits:\n  max_frame_size: 1.5\n", 5, "expected an integer, got 1.5"),
        (HEADER + 'limits:\n  max_frame_size: "100"\n', 5, "expected an integer, got '100' (quoted, so a string)"),
        (HEADER + "limits:\n  max_frame_size: true\n", 5, "expected an integer, got true"),
        (HEADER + "limits:\n  max_frame_size:\n", 5, "expected an integer, got nothing"),
        (HEADER + "limits:\n  drain_timeout_s: soon\n", 5, "limits.drain_timeout_s: expected a number, got 'soon'"),
        (HEADER + "limits:\n  drain_timeout_s: .inf\n", 5, "must be a finite number"),
        (HEADER + "passthrough_unknown_versions: maybe\n", 4, "expected true or false, got 'maybe'"),
        (HEADER + "log_level: [INFO]\n", 4, "log_level: expected a string, got a list"),
        (HEADER + "limits: 5\n", 4, "limits: expected a mapping of settings, got 5"),
        (HEADER + "1: x\n", 4, "keys must be names, got 1"),
        (HEADER + "limits:\n  max_frame_size: !!binary aGk=\n", 5, "expected an integer"),
        # negative or out-of-range values
        (HEADER + "limits:\n  max_in_flight_requests: 0\n", 5, "limits.max_in_flight_requests: must be at least 1, got 0"),
        (HEADER + "limits:\n  max_buffered_bytes: -1\n", 5, "must be at least 1, got -1"),
        (HEADER + "limits:\n  idle_timeout_s: -0.5\n", 5, "limits.idle_timeout_s: must be at least 0, got -0.5"),
        (HEADER + "limits:\n  unauthenticated_idle_timeout_s: 0\n", 5, "must be greater than 0, got 0.0"),
        (HEADER.replace("]\n", "]\n  request_timeout_s: 0\n"), 4, "upstream.request_timeout_s: must be greater than 0"),
        (HEADER + "exposure:\n  broker_port_count: 0\n", 5, "exposure.broker_port_count: must be at least 1"),
        (HEADER + "exposure:\n  broker_port_start: 70000\n", 5, "must be at most 65535, got 70000"),
        (HEADER + "exposure:\n  node_id_base: -1\n", 5, "exposure.node_id_base: must be at least 0"),
        # addresses
        ('listen: "127.0.0.1:0"\nupstream: {bootstrap_servers: "k:1"}\n', 1, "listen: port 0 in '127.0.0.1:0' is outside 1..65535"),
        ("listen: 9092\nupstream: {bootstrap_servers: \"k:1\"}\n", 1, 'listen: expected "HOST:PORT"'),
        ("listen: 10:30\nupstream: {bootstrap_servers: \"k:1\"}\n", 1, "got 10:30"),
        ('listen: "a:1"\nupstream:\n  bootstrap_servers:\n    - "k:1"\n    - "k"\n', 5,
         "upstream.bootstrap_servers[1]: expected HOST:PORT, got 'k'"),
        ('listen: "a:1"\nupstream:\n  bootstrap_servers: []\n', 3, 'needs at least one "HOST:PORT"'),
        ('listen: "a:1"\nupstream:\n  bootstrap_servers: "k:1,,k:2"\n', 3, "an empty entry"),
        ('listen: "a:1"\nupstream:\n  bootstrap_servers: "k:1,k:1"\n', 3, "lists k:1 twice"),
        ('listen: "a:1"\nupstream:\n  bootstrap_servers: {k: 1}\n', 3, "expected a list of"),
        ('listen: "0.0.0.0:9092"\nupstream: {bootstrap_servers: "k:1"}\n', 1, "listen: clients cannot connect to 0.0.0.0"),
        (HEADER + "exposure:\n  advertised_host: kp:9092\n", 5, "exposure.advertised_host: give the host only"),
        # choices
        (HEADER + "mode: sidekick\n", 4, "mode: must be one of gateway, sidecar; got 'sidekick'"),
        (HEADER + "exposure:\n  mode: sin\n", 5, "got 'sin' (did you mean 'sni'?)"),
        (HEADER + "log_level: loud\n", 4, "log_level: must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL; got 'LOUD'"),
        (HEADER + "lane: fast\n", 4, "lane: must be one of auto, off; got 'fast'"),
        # broker ports
        (HEADER + "exposure:\n  broker_port_start: 9050\n", 5,
         "exposure.broker_port_start: broker ports 9050..9113 include the listen port 9092"),
        (HEADER + "exposure:\n  broker_port_start: 65500\n", 5, "broker ports 65500..65563 run past 65535"),
        ('listen: "a:65500"\nupstream: {bootstrap_servers: "k:1"}\nexposure:\n  broker_port_count: 100\n', 4,
         "exposure.broker_port_count: broker ports 65501..65600 run past 65535"),
        ('listen: "a:65535"\nupstream: {bootstrap_servers: "k:1"}\n', 1, "listen: broker ports 65536..65599 run past"),
        (HEADER + 'admin:\n  listen: "127.0.0.1:9100"\n', 5, "admin.listen: port 9100 is already used"),
        (HEADER + 'admin:\n  listen: "0.0.0.0:9092"\n', 5, "admin.listen: port 9092 is already used"),
        # sni
        (HEADER + "exposure:\n  mode: sni\n  sni: {domain: k.example}\n", 5, "exposure.mode: sni needs tls.enabled: true"),
        (HEADER + "exposure:\n  sni:\n    bootstrap_name: b\n", 5, "exposure.sni: missing required key 'domain'"),
        (HEADER + "exposure:\n  sni: {domain: 'bad domain'}\n", 5, "exposure.sni.domain: 'bad domain' is not a DNS domain name"),
        (HEADER + "exposure:\n  sni: {domain: k.example, bootstrap_name: a.b}\n", 5, "'a.b' is not a DNS label"),
        # tls
        (HEADER + "tls:\n  enabled: true\n", 5, "tls.enabled: TLS termination needs tls.cert_file"),
        (HEADER + "tls:\n  require_client_cert: true\n", 5, "tls.require_client_cert: needs tls.enabled: true"),
        (HEADER + "tls:\n  cert_file: ''\n", 5, "tls.cert_file: an empty file name"),
    ],
)
def test_errors_name_file_line_and_reason(tmp_path: Path, text: str, line: int, reason: str) -> None:
    err = load_error(tmp_path, text)
    assert reason in err.reason
    assert err.line == line, str(err)


def test_lane_is_auto_unless_turned_off_and_a_bare_off_is_the_word(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, HEADER)).lane == "auto"
    assert load_config(write(tmp_path, HEADER + "lane: off\n")).lane == "off"
    assert load_config(write(tmp_path, HEADER + "lane: AUTO\n")).lane == "auto"


def test_tls_files_must_exist_and_the_error_points_at_that_key(tmp_path: Path) -> None:
    (tmp_path / "kproxy.crt").write_text("pem")
    err = load_error(tmp_path, HEADER + "tls:\n  enabled: true\n  cert_file: kproxy.crt\n  key_file: kproxy.key\n")
    assert err.line == 7
    assert err.reason == f"tls.key_file: file not found: {tmp_path / 'kproxy.key'}"

    err = load_error(tmp_path, HEADER.replace("]\n", "]\n  tls:\n    enabled: true\n    ca_file: /nonexistent/ca.pem\n"))
    assert err.line == 6
    assert err.reason == "upstream.tls.ca_file: file not found: /nonexistent/ca.pem"

    (tmp_path / "dir").mkdir()
    err = load_error(tmp_path, HEADER.replace("]\n", "]\n  tls:\n    enabled: true\n    ca_file: dir\n"))
    assert "not a regular file" in err.reason and err.line == 6


def test_tls_files_of_a_disabled_side_are_not_checked(tmp_path: Path) -> None:
    # Charts often template the paths in always and switch TLS with one flag.
    cfg = load_config(write(tmp_path, HEADER + "tls:\n  enabled: false\n  cert_file: /nonexistent.crt\n"))
    assert cfg.tls.cert_file == "/nonexistent.crt"


def test_upstream_client_certificate_needs_both_halves(tmp_path: Path) -> None:
    (tmp_path / "c.crt").write_text("pem")
    err = load_error(tmp_path, HEADER.replace("]\n", "]\n  tls:\n    enabled: true\n    cert_file: c.crt\n"))
    assert err.line == 6
    assert "upstream.tls.key_file is not set" in err.reason


def test_mtls_needs_a_ca_file(tmp_path: Path) -> None:
    for name in ("k.crt", "k.key"):
        (tmp_path / name).write_text("pem")
    err = load_error(tmp_path, HEADER + "tls:\n  enabled: true\n  cert_file: k.crt\n  key_file: k.key\n"
                                        "  require_client_cert: true\n")
    assert err.line == 8
    assert "tls.require_client_cert: needs tls.ca_file" in err.reason


def test_sni_mode_needs_the_sni_section(tmp_path: Path) -> None:
    for name in ("k.crt", "k.key"):
        (tmp_path / name).write_text("pem")
    err = load_error(tmp_path, HEADER + "tls: {enabled: true, cert_file: k.crt, key_file: k.key}\n"
                                        "exposure:\n  mode: sni\n")
    assert err.line == 6
    assert err.reason == "exposure.mode: sni needs exposure.sni.domain"


def test_sni_mode_does_not_reserve_broker_ports(tmp_path: Path) -> None:
    for name in ("k.crt", "k.key"):
        (tmp_path / name).write_text("pem")
    cfg = load_config(write(tmp_path, 'listen: "kp:65535"\nupstream: {bootstrap_servers: "k:1"}\n'
                                      "tls: {enabled: true, cert_file: k.crt, key_file: k.key}\n"
                                      "exposure: {mode: sni, sni: {domain: kafka.example}}\n"))
    assert cfg.exposure.sni == SniConfig("kafka.example")


def test_sidecar_may_listen_on_a_wildcard() -> None:
    cfg = parse_config('listen: "0.0.0.0:9092"\nmode: sidecar\nupstream: {bootstrap_servers: "k:1"}\n')
    assert cfg.advertised_host == "localhost"


@pytest.mark.parametrize(
    ("text", "line", "reason"),
    [
        ("", 1, "the file is empty"),
        ("# only a comment\n", 1, "the file is empty"),
        ("- a\n- b\n", 1, "the top level must be a mapping of settings, got a list"),
        ("just words\n", 1, "the top level must be a mapping of settings, got 'just words'"),
        ('listen: "a:1"\nupstream:\n  bootstrap_servers: ["k:1"\nmode: gateway\n', 4, "YAML syntax error"),
        ('listen: "a:1"\n\tmode: x\n', 2, "YAML syntax error"),
        ('listen: "a:1"\n---\nmode: x\n', 2, "YAML syntax error"),
        ('listen: "a:1"\nupstream: *nowhere\n', 2, "YAML syntax error"),
    ],
)
def test_file_level_errors(tmp_path: Path, text: str, line: int, reason: str) -> None:
    err = load_error(tmp_path, text)
    assert err.line == line, str(err)
    assert reason in err.reason


def test_yaml_syntax_error_line_is_yamls_own(tmp_path: Path) -> None:
    text = 'listen: "a:1"\nupstream:\n  bootstrap_servers: "k:1\n'
    with pytest.raises(yaml.MarkedYAMLError) as info:
        yaml.compose(text, Loader=yaml.SafeLoader)
    mark = info.value.problem_mark
    assert mark is not None
    assert load_error(tmp_path, text).line == mark.line + 1


def test_missing_file_names_the_file_without_a_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "absent.yaml")
    assert info.value.file == str(tmp_path / "absent.yaml") and info.value.line is None
    assert "cannot read the file" in str(info.value)
    assert isinstance(info.value, KProxyError)


def test_parse_config_names_its_source() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(HEADER + "mode: x\n", source="values.yaml[kproxy]")
    assert str(info.value).startswith("values.yaml[kproxy]:4: mode: ")
    with pytest.raises(ConfigError, match=r"^<string>:1: "):
        parse_config("listen: x\n")
    assert parse_config(MINIMAL).source == "<string>"


# -- quick mode -------------------------------------------------------------------------------------


def test_quick_mode_is_the_defaults_around_two_addresses() -> None:
    cfg = config_from_args("kafka-0:9092,kafka-1:9092", "127.0.0.1:19092")
    assert cfg == ProxyConfig(
        listen=HostPort("127.0.0.1", 19092),
        upstream=UpstreamConfig((HostPort("kafka-0", 9092), HostPort("kafka-1", 9092))),
    )
    assert cfg.source is None


def test_quick_mode_overrides_go_through_the_same_checks() -> None:
    cfg = config_from_args(
        "k:1", "0.0.0.0:9092", mode="sidecar", log_level="debug", exposure={"broker_port_start": 30000},
        limits=LimitsConfig(max_in_flight_requests=4), admin=None,
    )
    assert (cfg.mode, cfg.log_level, cfg.advertised_host) == ("sidecar", "DEBUG", "localhost")
    assert cfg.broker_port_start == 30000
    assert cfg.limits == LimitsConfig(max_in_flight_requests=4)
    assert cfg.upstream == UpstreamConfig((HostPort("k", 1),))
    assert cfg.admin == AdminConfig()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"upstream": "k:1", "listen": "nohost"}, "listen: expected HOST:PORT, got 'nohost'"),
        ({"upstream": "", "listen": "a:1"}, 'upstream.bootstrap_servers: needs at least one "HOST:PORT"'),
        ({"upstream": "k:1", "listen": "a:1", "mode": "x"}, "mode: must be one of gateway, sidecar; got 'x'"),
        ({"upstream": "k:1", "listen": "a:1", "log_levl": "INFO"}, "unknown key 'log_levl' (did you mean 'log_level'?)"),
        ({"upstream": "k:1", "listen": "a:1", "limits": {"max_frame_size": -1}}, "limits.max_frame_size: must be at least 1"),
        ({"upstream": "k:1", "listen": "a:1", "limits": object()}, "limits: cannot use <object"),
    ],
)
def test_quick_mode_errors_have_no_file_or_line(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_args(**kwargs)  # type: ignore[arg-type]
    assert message in str(info.value)
    assert info.value.file is None and info.value.line is None


# -- kproxy check -----------------------------------------------------------------------------------


def test_check_config_file_ok(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, MINIMAL)
    assert check_config_file(str(path)) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"ok: {path}: listen 127.0.0.1:9092 -> upstream kafka:9092; ")
    assert "brokers on ports 9093-9156" in out and out.endswith("\n") and out.count("\n") == 1
    assert "; codec generated Python" in out  # with the native accelerator, or why not
    assert err == ""


def test_check_config_file_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, MINIMAL + "limits:\n  max_frame_size: abc\n")
    assert check_config_file(str(path)) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"{path}:5: limits.max_frame_size: expected an integer, got 'abc'\n"


def test_kproxy_check_command_uses_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kproxy.cli import main

    assert main(["check", str(write(tmp_path, MINIMAL))]) == 0
    assert main(["check", str(tmp_path / "absent.yaml")]) == 2
    assert "cannot read the file" in capsys.readouterr().err


# -- the example file -------------------------------------------------------------------------------


def test_example_file_loads() -> None:
    cfg = load_config(EXAMPLE)
    assert cfg.listen == HostPort("0.0.0.0", 9092)
    assert cfg.exposure.advertised_host == "kproxy.example.internal"
    assert cfg.limits == LimitsConfig()  # the example shows the defaults


def _keys(node: yaml.Node, prefix: str = "") -> list[tuple[str, int]]:
    out = []
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            path = f"{prefix}{key.value}"
            out.append((path, key.start_mark.line))
            out += _keys(value, f"{path}.")
    return out


def _setting_paths(cls: type, prefix: str = "") -> set[str]:
    out = set()
    for field in attrs.fields(cls):
        if field.name == "source":
            continue
        out.add(f"{prefix}{field.name}")
        inner = field.type
        if typing.get_origin(inner) is types.UnionType:
            (inner,) = (a for a in typing.get_args(inner) if a is not type(None))
        if attrs.has(inner) and inner is not HostPort:
            out |= _setting_paths(inner, f"{prefix}{field.name}.")
    return out


def test_example_file_documents_every_key_with_a_comment() -> None:
    text = EXAMPLE.read_text()
    lines = text.splitlines()
    keys = _keys(yaml.compose(text, Loader=yaml.SafeLoader))
    # virtual_clusters has an example of its own (kproxy.virtual-clusters.example.yaml); kms: is opt-in
    # and names one of three backends, so the example shows it commented out whole.
    optional = {p for p in _setting_paths(ProxyConfig) if p == "kms" or p.startswith("kms.")}
    assert {path for path, _ in keys} == _setting_paths(ProxyConfig) - optional - {"virtual_clusters"}
    commented = {m.group(1) for m in re.finditer(r"^#\s+(\w+):", text, re.MULTILINE)}
    assert {p.rsplit(".", 1)[-1] for p in optional} <= commented
    for path, line in keys:
        assert lines[line - 1].lstrip().startswith("#"), f"{path} (line {line + 1}) has no comment above it"


# -- the classes hold the rules: code, quick mode and attrs.evolve are checked like a file -----------


def test_evolve_is_checked_and_converts() -> None:
    cfg = parse_config(MINIMAL)
    with pytest.raises(ConfigError) as info:
        attrs.evolve(cfg, log_level="verbose")
    assert str(info.value) == "log_level: must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL; got 'VERBOSE'"
    assert isinstance(info.value, SettingError) and info.value.path == ("log_level",)
    assert attrs.evolve(cfg, log_level="debug").log_level == "DEBUG"
    assert attrs.evolve(cfg, log_format="JSON").log_format == "json"
    assert attrs.evolve(cfg.limits, idle_timeout_s=5).idle_timeout_s == 5.0


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: LimitsConfig(max_frame_size=0), "limits.max_frame_size: must be at least 1, got 0"),
        (lambda: LimitsConfig(max_frame_size="big"), "limits.max_frame_size: expected an integer, got 'big'"),
        (lambda: LimitsConfig(max_frame_size=True), "limits.max_frame_size: expected an integer, got True"),
        (lambda: LimitsConfig(idle_timeout_s=-1), "limits.idle_timeout_s: must be at least 0, got -1.0"),
        (lambda: LimitsConfig(frame_timeout_s=0), "limits.frame_timeout_s: must be greater than 0, got 0.0"),
        (lambda: LimitsConfig(tls_handshake_timeout_s=math.nan), "limits.tls_handshake_timeout_s: must be a finite"),
        (lambda: LimitsConfig(max_buffered_bytes_total=0), "limits.max_buffered_bytes_total: must be at least 1"),
        (lambda: UpstreamConfig(()), 'upstream.bootstrap_servers: needs at least one "HOST:PORT"'),
        (lambda: UpstreamConfig((HostPort("k", 1), HostPort("k", 1))), "upstream.bootstrap_servers: lists k:1 twice"),
        (lambda: UpstreamConfig("k:1"), "upstream.bootstrap_servers: expected \"HOST:PORT\" addresses"),  # type: ignore[arg-type]
        (lambda: UpstreamConfig((HostPort("k", 1),), connect_timeout_s=0), "upstream.connect_timeout_s: must be greater"),
        (lambda: TlsClientSide(enabled=True, cert_file="/c.crt"),
         "upstream.tls.cert_file: a client certificate needs both cert_file and key_file; upstream.tls.key_file is not set"),
        (lambda: TlsClientSide(enabled=True, ca_file="/nonexistent/ca.pem"),
         "upstream.tls.ca_file: file not found: /nonexistent/ca.pem"),
        (lambda: TlsServerSide(enabled=True), "tls.enabled: TLS termination needs tls.cert_file"),
        (lambda: TlsServerSide(require_client_cert=True), "tls.require_client_cert: needs tls.enabled: true"),
        (lambda: TlsServerSide(cert_file=" "), "tls.cert_file: an empty file name"),
        (lambda: ExposureConfig(mode="sin"), "exposure.mode: must be one of port_per_broker, sni; got 'sin' (did you mean 'sni'?)"),
        (lambda: ExposureConfig(mode="sni"), "exposure.mode: sni needs exposure.sni.domain"),
        (lambda: ExposureConfig(advertised_host="kp:9092"), "exposure.advertised_host: give the host only"),
        (lambda: SniConfig("bad domain"), "exposure.sni.domain: 'bad domain' is not a DNS domain name"),
        (lambda: AdminConfig(listen="127.0.0.1:9644"), "admin.listen: expected a HostPort, got '127.0.0.1:9644'"),  # type: ignore[arg-type]
        (lambda: ProxyConfig(HostPort("0.0.0.0", 9092), UpstreamConfig((HostPort("k", 1),))),
         "listen: clients cannot connect to 0.0.0.0"),
        (lambda: ProxyConfig(HostPort("a", 9092), UpstreamConfig((HostPort("k", 1),)), limits={"max_frame_size": 1}),  # type: ignore[arg-type]
         "limits: expected a LimitsConfig, got {'max_frame_size': 1}"),
        (lambda: ProxyConfig(HostPort("a", 9092), UpstreamConfig((HostPort("k", 1),)), log_format="xml"),
         "log_format: must be one of text, json; got 'xml'"),
        (lambda: ProxyConfig(HostPort("a", 9092), UpstreamConfig((HostPort("k", 1),)),
                             exposure=ExposureConfig(broker_port_start=9050)),
         "exposure.broker_port_start: broker ports 9050..9113 include the listen port 9092"),
        (lambda: ProxyConfig(HostPort("a", 9092), UpstreamConfig((HostPort("k", 1),)),
                             admin=AdminConfig(HostPort("a", 9093))),
         "admin.listen: port 9093 is already used by the Kafka listeners"),
    ],
)
def test_objects_built_in_code_are_held_to_the_rules(build: Callable[[], object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        build()
    assert str(info.value).startswith(message)
    assert info.value.file is None and info.value.line is None


def test_host_port_built_in_code_is_checked() -> None:
    with pytest.raises(ValueError, match=r"port 0 is outside 1\.\.65535"):
        HostPort("a", 0)
    with pytest.raises(ValueError, match="'bad host' is not a host name"):
        HostPort("bad host", 1)
    with pytest.raises(ValueError, match="'' is not a host name"):
        HostPort("", 1)


def test_bootstrap_servers_may_be_given_as_a_list_in_code() -> None:
    up = UpstreamConfig([HostPort("k", 1)])  # type: ignore[arg-type]
    assert up.bootstrap_servers == (HostPort("k", 1),)


# -- settings that cannot mean anything together --------------------------------------------------


def test_sidecar_with_an_advertised_host_is_an_error_naming_both(tmp_path: Path) -> None:
    err = load_error(tmp_path, HEADER + "mode: sidecar\nexposure:\n  advertised_host: kp.example\n")
    assert err.line == 6
    assert err.reason.startswith("exposure.advertised_host: a sidecar is always advertised as localhost")
    assert "mode: gateway" in err.reason
    with pytest.raises(ConfigError, match=r"exposure\.advertised_host: a sidecar"):
        config_from_args("k:1", "127.0.0.1:9092", mode="sidecar", exposure={"advertised_host": "kp"})


# -- overrides on top of a file ----------------------------------------------------------------------


def test_apply_overrides_goes_through_the_checks() -> None:
    cfg = parse_config(MINIMAL)
    assert apply_overrides(cfg, log_level=None, log_format=None) == cfg
    changed = apply_overrides(cfg, log_level="warning", log_format="json")
    assert (changed.log_level, changed.log_format) == ("WARNING", "json")
    assert changed.source == cfg.source
    with pytest.raises(ConfigError, match=r"^log_level: must be one of .*got 'VERBOSE'"):
        apply_overrides(cfg, log_level="verbose")
    with pytest.raises(ConfigError, match=r"unknown setting 'log_levl' \(did you mean 'log_level'\?\)"):
        apply_overrides(cfg, log_levl="DEBUG")


# -- environment variables in values ----------------------------------------------------------------


def test_environment_variables_are_expanded_in_values() -> None:
    env = {"POD_IP": "10.1.2.3", "PORT": "30000", "EMPTY": "", "KAFKA": "k-0:9092"}
    cfg = parse_config(
        'listen: "${POD_IP}:9092"\n'
        "upstream:\n  bootstrap_servers:\n    - ${KAFKA}\n    - ${KAFKA_1:-k-1:9092}\n"
        "exposure:\n  broker_port_start: ${PORT}\n  broker_port_count: ${COUNT:-8}\n"
        "  advertised_host: ${EMPTY:-kp-$$1}\n"
        "limits:\n  idle_timeout_s: ${IDLE:-0.5}\n",
        env=env,
    )
    assert cfg.listen == HostPort("10.1.2.3", 9092)
    assert cfg.upstream.bootstrap_servers == (HostPort("k-0", 9092), HostPort("k-1", 9092))
    # Unquoted references take the type of what they expand to, as if written in the file.
    assert (cfg.exposure.broker_port_start, cfg.exposure.broker_port_count) == (30000, 8)
    assert cfg.exposure.advertised_host == "kp-$1"
    assert cfg.limits.idle_timeout_s == 0.5


def test_expansion_is_not_recursive_and_an_unquoted_empty_value_is_null() -> None:
    text = 'listen: "a:9092"\nupstream: {bootstrap_servers: "k:1"}\nexposure:\n  advertised_host: ${HOST}\n'
    # A variable's value is taken literally, even when it looks like a reference.
    assert parse_config(text, env={"HOST": "kp${OTHER}"}).exposure.advertised_host == "kp${OTHER}"
    # Expanded to nothing, an unquoted value reads as YAML's null: the setting's default.
    assert parse_config(text, env={"HOST": ""}).exposure.advertised_host is None
    assert parse_config(text.replace("${HOST}", "${HOST:-}"), env={}).exposure.advertised_host is None


def test_quoted_references_stay_strings(tmp_path: Path) -> None:
    err = load_error(tmp_path, HEADER + 'limits:\n  max_frame_size: "${SIZE:-100}"\n')
    assert err.line == 5
    assert err.reason == "limits.max_frame_size: expected an integer, got '100' (quoted, so a string)"


def test_the_environment_is_the_default_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KPROXY_TEST_POD_IP", "10.9.8.7")
    cfg = load_config(write(tmp_path, 'listen: "${KPROXY_TEST_POD_IP}:9092"\nupstream: {bootstrap_servers: "k:1"}\n'))
    assert cfg.listen == HostPort("10.9.8.7", 9092)


@pytest.mark.parametrize(
    ("text", "line", "reason"),
    [
        (HEADER + "exposure:\n  advertised_host: ${POD_IP}\n", 5,
         "exposure.advertised_host: environment variable POD_IP is not set (used as ${POD_IP}); "
         "set it, or give a default: ${POD_IP:-...}"),
        ('listen: "a:1"\nupstream:\n  bootstrap_servers:\n    - "k:1"\n    - "${BROKER_2}"\n', 5,
         "upstream.bootstrap_servers[1]: environment variable BROKER_2 is not set"),
        (HEADER + "exposure:\n  advertised_host: ${POD IP}\n", 5,
         "exposure.advertised_host: '${POD IP}' has a '${' that is not a variable reference; write ${NAME} or "
         "${NAME:-default}, and $$ for a literal $"),
        (HEADER + "exposure:\n  advertised_host: kp-${\n", 5, "'kp-${' has a '${' that is not"),
        (HEADER + "exposure:\n  advertised_host: '${HOST}'\n", 5, "exposure.advertised_host: must not be empty"),
        (HEADER + "exposure:\n  advertised_host: ${A:-${B}}\n", 5, "'${A:-${B}}' has a '${' that is not"),
    ],
)
def test_environment_errors_name_file_line_variable_and_setting(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, line: int, reason: str) -> None:
    monkeypatch.delenv("POD_IP", raising=False)
    monkeypatch.delenv("BROKER_2", raising=False)
    monkeypatch.setenv("HOST", "")
    err = load_error(tmp_path, text)
    assert err.line == line, str(err)
    assert reason in err.reason


def test_quick_mode_values_are_literal() -> None:
    with pytest.raises(ConfigError, match=r"exposure.advertised_host: '\$\{X\}:1' is not|give the host only"):
        config_from_args("k:1", "a:9092", exposure={"advertised_host": "${X}:1"})
    cfg = config_from_args("k:1", "a:9092", exposure={"advertised_host": "kp$$"})
    assert cfg.exposure.advertised_host == "kp$$"


# -- the process-wide buffer budget -----------------------------------------------------------------


def test_buffer_budget_is_the_setting_when_given(tmp_path: Path) -> None:
    (tmp_path / "memory.max").write_text("4096\n")
    cfg = attrs.evolve(parse_config(MINIMAL), limits=LimitsConfig(max_buffered_bytes_total=12345))
    assert effective_buffer_budget(cfg, str(tmp_path)) == 12345


@pytest.mark.parametrize(
    ("files", "budget"),
    [
        ({"memory.max": "2147483648\n"}, 536870912),                       # cgroup v2: a quarter
        ({"memory.max": "max\n"}, 1 << 30),                                # v2 without a limit
        ({"memory/memory.limit_in_bytes": "1073741824\n"}, 268435456),     # cgroup v1
        ({"memory/memory.limit_in_bytes": "9223372036854771712\n"}, 1 << 30),  # v1 "no limit"
        ({"memory.max": "garbage"}, 1 << 30),
        ({}, 1 << 30),                                                     # not in a cgroup we can read
    ],
)
def test_buffer_budget_is_derived_from_the_cgroup_limit(tmp_path: Path, files: dict[str, str], budget: int) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    assert effective_buffer_budget(parse_config(MINIMAL), str(tmp_path)) == budget


# -- the startup line -------------------------------------------------------------------------------


def test_describe_config_mentions_idle_timeout_and_log_format() -> None:
    cfg = parse_config(MINIMAL)
    text = describe_config(cfg)
    assert "idle timeout 600s" in text and "logs INFO as text" in text
    text = describe_config(apply_overrides(cfg, log_format="json", limits=LimitsConfig(idle_timeout_s=0)))
    assert "idle timeout off" in text and "logs INFO as json" in text


def test_changed_settings_names_every_changed_path_and_no_value() -> None:
    from kproxy.config.changes import changed_settings

    base = """listen: "127.0.0.1:9092"
upstream: {bootstrap_servers: ["b:9092"], sasl: {mechanism: PLAIN, username: u, password: old-secret}}
traffic_log: {sample: {default: 1.0}}
"""
    old = parse_config(base)
    assert changed_settings(old, parse_config(base)) == []
    new = parse_config(base.replace("old-secret", "new-secret").replace("b:9092", "c:9092")
                       .replace("{default: 1.0}", "{default: 0.1}") + "limits: {max_in_flight_requests: 9}\n")
    changed = changed_settings(old, new)
    assert sorted(changed) == ["limits.max_in_flight_requests", "upstream.bootstrap_servers", "upstream.sasl.password"]
    assert not any("secret" in c for c in changed)
    # The sample ratios are what a reload puts in force: left out unless asked for.
    assert "traffic_log.sample" in changed_settings(old, new, skip=frozenset())


def test_changed_settings_names_the_virtual_cluster_by_position() -> None:
    from kproxy.config.changes import changed_settings

    text = """virtual_clusters:
  - {name: a, listen: "127.0.0.1:9092", upstream: {bootstrap_servers: ["b:9092"]}}
  - {name: b, listen: "127.0.0.1:9192", upstream: {bootstrap_servers: ["c:9092"]}}
"""
    changed = changed_settings(parse_config(text), parse_config(text.replace('"c:9092"', '"d:9092"')))
    assert changed == ["virtual_clusters[1].upstream.bootstrap_servers"]

"""virtual_clusters in the configuration: each entry a whole virtual cluster with the top level's
process-wide settings, the single-cluster form as the cluster "default", and every collision between
virtual clusters (names, ports, SNI domains on a shared port) refused with file and line before
anything binds."""

from __future__ import annotations

import textwrap
from pathlib import Path

import attrs
import pytest

from kproxy.cli import check_config_file
from kproxy.config import (
    DEFAULT_NAME,
    PROCESS_SETTINGS,
    ConfigError,
    HostPort,
    ProxyConfig,
    SettingError,
    apply_overrides,
    cluster_settings,
    describe_cluster,
    describe_config,
    load_config,
    parse_config,
)
from kproxy.server.admin import public_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "kproxy.virtual-clusters.example.yaml"

# The contract, word for word but for upstream.clusters (which the switchover adds).
CONTRACT = """\
virtual_clusters:
  - name: team-a
    listen: "127.0.0.1:9092"
    exposure: {broker_port_start: 9093}
    upstream: {bootstrap_servers: ["a:9092"]}
  - name: dr-app
    listen: "127.0.0.1:9192"
    exposure: {broker_port_start: 9193}
    upstream:
      bootstrap_servers: ["p:9092"]
admin: {listen: "127.0.0.1:9644"}
"""


def load_error(tmp_path: Path, text: str) -> ConfigError:
    path = tmp_path / "kproxy.yaml"
    path.write_text(textwrap.dedent(text))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    err = info.value
    assert err.file == str(path) and str(err).startswith(f"{path}:{err.line}: ")
    return err


@pytest.fixture
def tls(tmp_path: Path) -> str:
    (tmp_path / "a.pem").write_text("pem")
    (tmp_path / "a.key").write_text("key")
    return "tls: {enabled: true, cert_file: a.pem, key_file: a.key}"


def sni_cluster(name: str, listen: str, domain: str, tls: str, extra: str = "") -> str:
    advertised = ", advertised_host: kp.test" if listen.startswith("0.0.0.0") else ""
    return (f"  - name: {name}\n    listen: \"{listen}\"\n    upstream: {{bootstrap_servers: [\"{name}:9092\"]}}\n"
            f"    {tls}\n    exposure: {{mode: sni, sni: {{domain: {domain}}}{advertised}}}\n{extra}")


# -- the two forms -------------------------------------------------------------------------------------


def test_each_virtual_cluster_is_a_whole_config_with_the_process_settings() -> None:
    cfg = parse_config(CONTRACT + "limits: {idle_timeout_s: 5}\nlog_level: debug\n")
    team_a, dr_app = cfg.clusters
    assert (team_a.name, dr_app.name) == ("team-a", "dr-app")
    assert team_a.listen == HostPort("127.0.0.1", 9092) and dr_app.broker_port_start == 9193
    assert dr_app.upstream.bootstrap_servers == (HostPort("p", 9092),)
    for vc in cfg.clusters:
        assert vc.admin.listen == HostPort("127.0.0.1", 9644)
        assert vc.limits.idle_timeout_s == 5.0 and vc.log_level == "DEBUG"
        assert vc.virtual_clusters == ()
    # The root is the first virtual cluster, with the list: code written for one cluster reads it.
    assert cfg.virtual_clusters == (team_a, dr_app) and cfg.listen == team_a.listen


def test_a_file_without_virtual_clusters_is_the_one_virtual_cluster_default() -> None:
    cfg = parse_config('listen: "127.0.0.1:9092"\nupstream: {bootstrap_servers: ["k:9092"]}\n')
    assert cfg.name == DEFAULT_NAME == "default" and cfg.clusters == (cfg,) and cfg.virtual_clusters == ()
    named = parse_config('name: orders\nlisten: "127.0.0.1:9092"\nupstream: {bootstrap_servers: ["k:9092"]}\n')
    assert named.name == "orders" and named.clusters == (named,)


def test_every_setting_is_either_a_clusters_or_the_processs() -> None:
    own = set(cluster_settings(ProxyConfig))
    fields = {f.name for f in attrs.fields(ProxyConfig)}
    assert own | PROCESS_SETTINGS | {"virtual_clusters", "source"} == fields
    assert own & PROCESS_SETTINGS == set()
    # The list of what each virtual cluster has, and the process-wide ones the docs name.
    assert own >= {"name", "listen", "mode", "exposure", "upstream", "tls", "sasl", "proxy_protocol", "rules", "quota"}
    assert {"admin", "metrics", "traffic_log", "tracing", "workers", "log_level", "log_format"} <= PROCESS_SETTINGS


def test_anchors_share_settings_between_virtual_clusters() -> None:
    cfg = parse_config("""\
virtual_clusters:
  - &a
    name: a
    listen: "127.0.0.1:9092"
    upstream: {bootstrap_servers: ["k:9092"], request_timeout_s: 7}
  - <<: *a
    name: b
    listen: "127.0.0.1:9192"
""")
    a, b = cfg.clusters
    assert b.name == "b" and b.upstream == a.upstream and b.upstream.request_timeout_s == 7.0


def test_command_line_overrides_reach_every_virtual_cluster() -> None:
    cfg = apply_overrides(parse_config(CONTRACT), log_level="warning", log_format="json")
    assert {(vc.log_level, vc.log_format) for vc in (cfg, *cfg.clusters)} == {("WARNING", "json")}


def test_code_built_roots_are_checked_as_files_are() -> None:
    a, b = parse_config(CONTRACT).clusters
    assert ProxyConfig.of_clusters([a, b]).clusters == (a, b)
    with pytest.raises(SettingError) as info:
        ProxyConfig.of_clusters([a, attrs.evolve(b, name="team-a")])
    assert info.value.path == ("virtual_clusters", 1, "name")
    with pytest.raises(SettingError, match="process-wide"):
        ProxyConfig.of_clusters([a, attrs.evolve(b, log_level="DEBUG")])
    with pytest.raises(SettingError, match="set it in each virtual cluster"):
        attrs.evolve(ProxyConfig.of_clusters([a, b]), listen=HostPort("127.0.0.1", 9000))


# -- errors, each with its file and line -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "line", "reason"),
    [
        # mixing the two forms
        (CONTRACT + 'listen: "127.0.0.1:1"\n', 12, "listen: belongs to a virtual cluster: with virtual_clusters, "
                                                   "set it in each entry"),
        ('upstream: {bootstrap_servers: ["k:1"]}\n' + CONTRACT, 1, "upstream: belongs to a virtual cluster"),
        (CONTRACT.replace('    upstream: {bootstrap_servers: ["a:9092"]}\n',
                          '    upstream: {bootstrap_servers: ["a:9092"]}\n    admin: {listen: "127.0.0.1:1"}\n'),
         6, "virtual_clusters[0].admin: is process-wide: set it once at the top level"),
        (CONTRACT.replace("  - name: dr-app\n", "  - name: dr-app\n    virtual_clusters: []\n"), 7,
         "virtual_clusters[1].virtual_clusters: virtual clusters do not nest"),
        # the list itself
        ("virtual_clusters: []\n", 1, "virtual_clusters: needs at least one virtual cluster"),
        ("virtual_clusters: {a: 1}\n", 1, "virtual_clusters: expected a list of virtual clusters, got a mapping"),
        ("virtual_clusters:\n  - 5\n", 2, "virtual_clusters[0]: expected a mapping of settings (a virtual cluster)"),
        # inside one virtual cluster: the entry's own settings are named by their place in the list
        (CONTRACT.replace("  - name: dr-app\n", "  - name: dr-app\n    lisen: x\n"), 7,
         "virtual_clusters[1]: unknown key 'lisen' (did you mean 'listen'?)"),
        (CONTRACT.replace('  - name: dr-app\n    listen: "127.0.0.1:9192"\n', "  - name: dr-app\n"), 6,
         "virtual_clusters[1]: missing required key 'listen'"),
        (CONTRACT.replace("9193}", "70000}"), 8,
         "virtual_clusters[1].exposure.broker_port_start: must be at most 65535, got 70000"),
        (CONTRACT.replace("team-a", "team a"), 2, "virtual_clusters[0].name: 'team a' is not a DNS label"),
        # a process-wide setting that does not suit one virtual cluster names it
        (CONTRACT + "workers: 2\n", 12, "workers: more than one worker needs broker ports every worker agrees "
                                        "on: set exposure.node_id_base (or use exposure.mode: sni) (in virtual "
                                        "cluster 'team-a')"),
        # collisions between virtual clusters
        (CONTRACT.replace("dr-app", "team-a"), 6, "virtual_clusters[1].name: 'team-a' is already the name of "
                                                   "virtual_clusters[0]"),
        (CONTRACT.replace("dr-app", "Team-A"), 6, "'Team-A' is already the name of virtual_clusters[0]"),
        (CONTRACT.replace("9193", "9100"), 8,
         "virtual_clusters[1].exposure.broker_port_start: broker ports 9100..9163 on 127.0.0.1: port 9100 is "
         "already taken by the broker ports 9093..9156 of virtual cluster 'team-a' on 127.0.0.1"),
        (CONTRACT.replace('"127.0.0.1:9192"', '"127.0.0.1:9093"'), 7,
         "virtual_clusters[1].listen: listen port 9093 on 127.0.0.1: port 9093 is already taken by the broker "
         "ports 9093..9156 of virtual cluster 'team-a'"),
        (CONTRACT.replace('"127.0.0.1:9192"', '"0.0.0.0:9192"').replace("9193}", "9093, advertised_host: kp}"), 8,
         "port 9093 is already taken by the broker ports 9093..9156 of virtual cluster 'team-a' on 127.0.0.1"),
        (CONTRACT.replace('"127.0.0.1:9644"', '"127.0.0.1:9200"'), 11,
         "admin.listen: port 9200 is already used by the Kafka listeners (in virtual cluster 'dr-app')"),
    ],
)
def test_errors_name_file_line_and_reason(tmp_path: Path, text: str, line: int, reason: str) -> None:
    err = load_error(tmp_path, text)
    assert reason in err.reason, err.reason
    assert err.line == line, str(err)


def test_distinct_addresses_may_use_one_port() -> None:
    cfg = parse_config(CONTRACT.replace('"127.0.0.1:9192"', '"127.0.0.2:9092"').replace("9193}", "9093}"))
    assert [vc.listen for vc in cfg.clusters] == [HostPort("127.0.0.1", 9092), HostPort("127.0.0.2", 9092)]


def test_sni_virtual_clusters_share_a_port_with_different_domains(tmp_path: Path, tls: str) -> None:
    text = ("virtual_clusters:\n" + sni_cluster("a", "127.0.0.1:9092", "a.kafka.test", tls)
            + sni_cluster("b", "127.0.0.1:9092", "b.kafka.test", tls)
            # a domain under another's is no collision: names are one label under their domain
            + sni_cluster("c", "127.0.0.1:9092", "x.a.kafka.test", tls))
    (tmp_path / "kproxy.yaml").write_text(text)
    cfg = load_config(tmp_path / "kproxy.yaml")
    assert {vc.listen for vc in cfg.clusters} == {HostPort("127.0.0.1", 9092)}


@pytest.mark.parametrize(
    ("second", "line", "reason"),
    [
        # the same domain on one port: every name would match both (case and a final dot do not matter)
        (("b", "127.0.0.1:9092", "A.Kafka.Test."), 11,
         "virtual_clusters[1].exposure.sni.domain: A.Kafka.Test. is already the SNI domain of virtual cluster "
         "'a' on the same port 127.0.0.1:9092"),
        # one port, but one address is a wildcard: two sockets cannot share it
        (("b", "0.0.0.0:9092", "b.kafka.test"), 8,
         "virtual_clusters[1].listen: listen port 9092 on 0.0.0.0: port 9092 is already taken by the listen port "
         "9092 of virtual cluster 'a' on 127.0.0.1; virtual clusters share a port only with exactly the same "
         "listen address"),
    ],
)
def test_sni_collisions_are_refused(tmp_path: Path, tls: str, second: tuple[str, str, str], line: int,
                                    reason: str) -> None:
    text = "virtual_clusters:\n" + sni_cluster("a", "127.0.0.1:9092", "a.kafka.test", tls) + sni_cluster(*second, tls)
    err = load_error(tmp_path, text)
    assert reason in err.reason, err.reason
    assert err.line == line, str(err)


def test_a_shared_port_needs_one_proxy_protocol_and_only_sni_clusters(tmp_path: Path, tls: str) -> None:
    pp = "    proxy_protocol: {mode: required, trusted: [10.0.0.0/8]}\n"
    err = load_error(tmp_path, "virtual_clusters:\n" + sni_cluster("a", "127.0.0.1:9092", "a.kafka.test", tls)
                     + sni_cluster("b", "127.0.0.1:9092", "b.kafka.test", tls, pp))
    assert err.line == 12 and err.reason.startswith("virtual_clusters[1].proxy_protocol: differs from virtual "
                                                    "cluster 'a''s on the same port 127.0.0.1:9092")
    # A port-per-broker cluster cannot share: its listener takes no SNI names.
    err = load_error(tmp_path, "virtual_clusters:\n" + sni_cluster("a", "127.0.0.1:9092", "a.kafka.test", tls)
                     + '  - name: b\n    listen: "127.0.0.1:9092"\n    upstream: {bootstrap_servers: ["b:1"]}\n'
                       "    exposure: {broker_port_start: 9300}\n")
    assert err.line == 8 and "virtual_clusters[1].listen: listen port 9092 on 127.0.0.1: port 9092 is already " \
                             "taken by the listen port 9092 of virtual cluster 'a'" in err.reason


def test_an_sni_clusters_port_is_not_free_for_another_clusters_brokers(tmp_path: Path, tls: str) -> None:
    err = load_error(tmp_path, "virtual_clusters:\n" + sni_cluster("a", "127.0.0.1:9100", "a.kafka.test", tls)
                     + '  - name: b\n    listen: "127.0.0.1:9092"\n    upstream: {bootstrap_servers: ["b:1"]}\n')
    assert err.line == 8 and "virtual_clusters[1].listen: broker ports 9093..9156 on 127.0.0.1: port 9100 is " \
                             "already taken by the listen port 9100 of virtual cluster 'a'" in err.reason


# -- what a person reads -------------------------------------------------------------------------------------


def test_check_prints_the_process_then_each_virtual_cluster(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "kproxy.yaml"
    path.write_text(CONTRACT)
    assert check_config_file(str(path)) == 0
    out, err = capsys.readouterr()
    first, *clusters = out.splitlines()
    assert first.startswith(f"ok: {path}: 2 virtual clusters (team-a, dr-app); idle timeout 600s; admin 127.0.0.1:9644")
    assert clusters == [
        "  virtual cluster team-a: listen 127.0.0.1:9092 -> upstream a:9092; gateway, advertised as 127.0.0.1, "
        "brokers on ports 9093-9156; client TLS off; upstream TLS off; client SASL relayed; upstream SASL off",
        "  virtual cluster dr-app: listen 127.0.0.1:9192 -> upstream p:9092; gateway, advertised as 127.0.0.1, "
        "brokers on ports 9193-9256; client TLS off; upstream TLS off; client SASL relayed; upstream SASL off",
    ]
    assert err == ""


def test_check_loads_each_virtual_clusters_rules(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "good.yaml").write_text("rules:\n  - name: ok\n    match: {api: produce}\n    action: allow\n")
    (tmp_path / "bad.yaml").write_text("rules:\n  - name: bad\n    match: {api: produce}\n    action: explode\n")
    path = tmp_path / "kproxy.yaml"
    path.write_text(CONTRACT.replace("  - name: dr-app\n", "    rules: [good.yaml]\n  - name: dr-app\n    rules: [bad.yaml]\n"))
    assert check_config_file(str(path)) == 2
    assert "bad.yaml:4" in capsys.readouterr().err


def test_the_summary_of_one_cluster_is_unchanged_by_virtual_clusters() -> None:
    one = parse_config('listen: "127.0.0.1:9092"\nupstream: {bootstrap_servers: ["k:9092"]}\n')
    assert describe_config(one).startswith(describe_cluster(one).split("; idle")[0] + "; idle timeout")


def test_config_page_shows_process_settings_then_each_virtual_cluster_with_secrets_hidden() -> None:
    cfg = parse_config(CONTRACT.replace('    upstream: {bootstrap_servers: ["a:9092"]}\n',
                                        '    upstream:\n      bootstrap_servers: ["a:9092"]\n      sasl: '
                                        '{mechanism: PLAIN, username: kp, password: hunter2}\n'))
    shown = public_config(cfg)
    assert shown["admin"] == {"listen": "127.0.0.1:9644"} and "listen" not in shown
    assert [vc["name"] for vc in shown["virtual_clusters"]] == ["team-a", "dr-app"]
    assert shown["virtual_clusters"][0]["upstream"]["sasl"]["password"] == "<redacted>"
    assert "admin" not in shown["virtual_clusters"][0]
    assert "hunter2" not in repr(shown)


def test_the_example_file_loads_and_documents_every_key_with_a_comment(tmp_path: Path) -> None:
    import yaml

    for name in ("payments.crt", "payments.key", "analytics.crt", "analytics.key"):
        (tmp_path / name).write_text("pem")
    cfg = load_config(EXAMPLE, env={"KPROXY_TLS_DIR": str(tmp_path)})
    assert [vc.name for vc in cfg.clusters] == ["team-a", "team-b", "payments", "analytics"]
    assert cfg.clusters[2].listen == cfg.clusters[3].listen       # two SNI clusters on one port
    text = EXAMPLE.read_text()
    lines = text.splitlines()

    def keys(node: yaml.Node) -> list[int]:
        out = []
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                out.append(key.start_mark.line)
                out += keys(value)
        elif isinstance(node, yaml.SequenceNode):
            for item in node.value:
                out += keys(item)
        return out

    for line in keys(yaml.compose(text, Loader=yaml.SafeLoader)):
        above = lines[line - 1].lstrip()
        assert above.startswith("#") or lines[line].lstrip().startswith("- "), f"line {line + 1} has no comment"

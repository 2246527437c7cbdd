"""upstream.clusters, active, failover, switch and cluster_id: what loads, and every mistake refused with
file, line and the setting's full name (an item of a list named by its index)."""

from __future__ import annotations

import attrs
import pytest

from kproxy.config import ConfigError, HostPort, UpstreamConfig, describe_config, parse_config

TWO = """listen: "127.0.0.1:9192"
exposure: {broker_port_start: 9193}
upstream:
  clusters:
    - {name: primary, bootstrap_servers: ["p:9092"]}
    - name: secondary
      bootstrap_servers: ["s:9092"]
      topic_prefix: primary.
  active: primary
  failover: {after_s: 10}
admin: {listen: "127.0.0.1:9644"}
"""


def test_the_contract_example_loads() -> None:
    cfg = parse_config(TWO, "kproxy.yaml")
    up = cfg.upstream
    assert up.several and up.names == ("primary", "secondary")
    assert up.first_active == "primary"
    assert up.failing_over is not None and up.failing_over.after_s == 10.0
    assert up.failing_over.probe_every == 1.0
    assert up.topic_prefix("secondary") == "primary." and up.topic_prefix("primary") is None
    # Each cluster is a single-cluster upstream of its own, sharing the timeouts.
    second = up.cluster("secondary")
    assert second.bootstrap_servers == (HostPort("s", 9092),) and not second.several
    assert second.request_timeout_s == up.request_timeout_s
    assert "upstream clusters primary p:9092, secondary s:9092" in describe_config(cfg)
    assert "failover after 10s unreachable" in describe_config(cfg)


def test_the_single_cluster_form_is_one_cluster_named_default() -> None:
    cfg = parse_config('listen: "127.0.0.1:9092"\nupstream: {bootstrap_servers: "k:1"}\n')
    assert not cfg.upstream.several
    assert cfg.upstream.names == ("default",) and cfg.upstream.first_active == "default"
    assert cfg.upstream.cluster("default") is cfg.upstream
    assert cfg.cluster_id is None


def test_active_defaults_to_the_first_cluster() -> None:
    cfg = parse_config(TWO.replace("  active: primary\n", ""))
    assert cfg.upstream.first_active == "primary"


def test_cluster_id_is_a_setting() -> None:
    cfg = parse_config(TWO + "cluster_id: dr-app_AAAAAAAAAAAAAAAA\n")
    assert cfg.cluster_id == "dr-app_AAAAAAAAAAAAAAAA"


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        (TWO.replace("name: secondary", "name: primary"), 6,
         "upstream.clusters[1].name: 'primary' is already the name of clusters[0]"),
        (TWO.replace("active: primary", "active: secundary"), 9,
         "upstream.active: names no cluster; one of primary, secondary (did you mean 'secondary'?)"),
        (TWO.replace("topic_prefix: primary.", "topic_prefix: 'pri mary.'"), 8,
         "upstream.clusters[1].topic_prefix: 'pri mary.' cannot start a topic name"),
        (TWO.replace('      bootstrap_servers: ["s:9092"]\n', '      bootstrap_servers: ["s:9092"]\n      sasl: '
                                                               '{mechanism: PLAIN}\n'), 8,
         "upstream.clusters[1].sasl.username: PLAIN needs a username"),
        (TWO.replace('      bootstrap_servers: ["s:9092"]\n', '      bootstrap_servers: ["s:9092"]\n      tls: '
                                                               '{enabled: true, cert_file: /c.pem}\n'), 8,
         "upstream.clusters[1].tls.cert_file: a client certificate needs both cert_file and key_file"),
        (TWO.replace('      bootstrap_servers: ["s:9092"]\n', ''), 6,
         "upstream.clusters[1]: missing required key 'bootstrap_servers'"),
        (TWO.replace("    - {name: primary, bootstrap_servers: [\"p:9092\"]}\n", ""), 4,
         "upstream.clusters: list two or more clusters"),
        (TWO.replace("  clusters:\n", '  bootstrap_servers: "x:1"\n  clusters:\n'), 4,
         "upstream.bootstrap_servers: give bootstrap_servers in each of clusters, not here as well"),
        (TWO.replace("  active: primary\n", "  active: primary\n  sasl: {mechanism: PLAIN, username: u, "
                                            "password: p}\n"), 10,
         "upstream.sasl: with clusters, each cluster has its own sasl"),
        (TWO.replace("{after_s: 10}", "{after_s: 0}"), 10, "upstream.failover.after_s: must be greater than 0"),
        (TWO.replace("  clusters:", "  offset_translation: sometimes\n  clusters:"), 4,
         "upstream.offset_translation: must be one of off, mm2"),
        (TWO.replace("  clusters:", "  switch: {drain_s: 0}\n  clusters:"), 4,
         "upstream.switch.drain_s: must be greater than 0"),
        (TWO.replace("    - {name: primary,", "    - {name: 'pri mary',"), 5,
         "upstream.clusters[0].name: 'pri mary' is not a DNS label"),
        (TWO.replace("  clusters:\n", "  clusters: primary\n").split("    - {")[0] + "admin: {}\n", 4,
         "upstream.clusters: expected a list, got 'primary'"),
        ('listen: "a:1"\nupstream:\n  bootstrap_servers: "k:1"\n  failover: {after_s: 3}\n', 4,
         "upstream.failover: needs several clusters under upstream.clusters"),
        ('listen: "a:1"\nupstream:\n  bootstrap_servers: "k:1"\n  active: k\n', 4,
         "upstream.active: needs several clusters under upstream.clusters"),
        ('listen: "a:1"\nupstream:\n  bootstrap_servers: "k:1"\n  offset_translation: mm2\n', 4,
         "upstream.offset_translation: needs several clusters"),
        (TWO + "cluster_id: 'no spaces'\n", 12, "cluster_id: 'no spaces' is not a cluster id"),
        (TWO + "quota: {coordination: {fleet: f}}\n", 12, "quota.coordination: fleet quotas cannot follow a switch"),
    ],
)
def test_mistakes_name_file_line_and_setting(text: str, line: int, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(text, "kproxy.yaml")
    assert info.value.file == "kproxy.yaml"
    assert info.value.line == line, str(info.value)
    assert message in str(info.value)


def test_a_disabled_failover_section_may_stay_in_the_single_cluster_form() -> None:
    cfg = parse_config('listen: "a:1"\nupstream:\n  bootstrap_servers: "k:1"\n  failover: {after_s: 3, '
                       'enabled: false}\n')
    assert cfg.upstream.failing_over is None


def test_classes_check_themselves_too() -> None:
    with pytest.raises(ConfigError, match="missing required key 'bootstrap_servers'"):
        UpstreamConfig()
    cfg = parse_config(TWO)
    with pytest.raises(ConfigError, match=r"upstream\.active: names no cluster"):
        attrs.evolve(cfg.upstream, active="tertiary")

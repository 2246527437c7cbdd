"""Several worker processes: the settings that allow them, the CPU count behind ``auto``, and the
supervisor's merge of the workers' Prometheus expositions."""

from __future__ import annotations

import pytest

from kproxy.config import ConfigError, effective_workers, parse_config
from kproxy.server.workers import merge_expositions, worker_identity

BASE = 'listen: "127.0.0.1:9092"\nupstream: {bootstrap_servers: "kafka:9092"}\n'


def test_more_than_one_worker_needs_deterministic_broker_ports():
    with pytest.raises(ConfigError, match=r"<string>:3: workers: .*exposure\.node_id_base"):
        parse_config(BASE + "workers: 2\n")
    assert parse_config(BASE + "workers: 2\nexposure: {node_id_base: 0}\n").workers == 2


def test_auto_is_zero_and_resolves_to_the_cpus_allowed(tmp_path):
    cfg = parse_config(BASE + "workers: auto\nexposure: {node_id_base: 0}\n")
    assert cfg.workers == 0
    (tmp_path / "cpu.max").write_text("150000 100000\n")          # a 1.5-CPU quota: 2 workers
    assert effective_workers(cfg, str(tmp_path)) == min(2, _cpus())
    (tmp_path / "cpu.max").write_text("max 100000\n")             # no quota: every CPU
    assert effective_workers(cfg, str(tmp_path)) == _cpus()


def test_cgroup_v1_quota(tmp_path):
    cfg = parse_config(BASE + "workers: auto\nexposure: {node_id_base: 0}\n")
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert effective_workers(cfg, str(tmp_path)) == 1


def test_a_word_other_than_auto_is_refused_with_its_line():
    with pytest.raises(ConfigError, match=r"<string>:3: workers: expected an integer or auto, got 'many'"):
        parse_config(BASE + "workers: many\n")


def test_worker_identity_comes_from_the_environment():
    assert worker_identity({}) is None
    assert worker_identity({"KPROXY_WORKER": "1/4"}) == (1, 4)


def test_expositions_are_summed_per_sample_and_keep_their_families():
    a = (b'# HELP kproxy_requests_total Requests.\n# TYPE kproxy_requests_total counter\n'
         b'kproxy_requests_total{api="produce"} 3.0\nkproxy_requests_total{api="fetch"} 1.0\n'
         b'kproxy_requests_created{api="produce"} 1700000000.5\n'
         b'# HELP kproxy_connections_open Open.\n# TYPE kproxy_connections_open gauge\n'
         b'kproxy_connections_open{listener="bootstrap"} 2.0\n')
    b = (b'# HELP kproxy_requests_total Requests.\n# TYPE kproxy_requests_total counter\n'
         b'kproxy_requests_total{api="produce"} 4.0\nkproxy_requests_total{api="metadata"} 7.0\n'
         b'kproxy_requests_created{api="produce"} 1690000000.25\n'
         b'# HELP kproxy_connections_open Open.\n# TYPE kproxy_connections_open gauge\n'
         b'kproxy_connections_open{listener="bootstrap"} 5.0\n')
    merged = merge_expositions([a, b]).decode().splitlines()
    assert merged == [
        "# HELP kproxy_requests_total Requests.",
        "# TYPE kproxy_requests_total counter",
        'kproxy_requests_total{api="produce"} 7',
        'kproxy_requests_total{api="fetch"} 1',
        'kproxy_requests_created{api="produce"} 1690000000.25',   # the earliest, not a sum
        'kproxy_requests_total{api="metadata"} 7',
        "# HELP kproxy_connections_open Open.",
        "# TYPE kproxy_connections_open gauge",
        'kproxy_connections_open{listener="bootstrap"} 7',
    ]


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))

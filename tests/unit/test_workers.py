"""Several worker processes: the settings that allow them, the CPU count behind ``auto``, the
supervisor's merge of the workers' Prometheus expositions by metric type, and its asking every
worker at once within a probe's budget."""

from __future__ import annotations

import pytest

from kproxy.config import ConfigError, effective_workers, parse_config
from kproxy.server.workers import ADDITIVE_GAUGES, MERGED_BY, fetch_all, merge_expositions, worker_identity

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


def test_counters_add_up_gauges_by_what_they_mean_and_families_are_kept():
    a = (b'# HELP kproxy_requests_total Requests.\n# TYPE kproxy_requests_total counter\n'
         b'kproxy_requests_total{api="produce"} 3.0\nkproxy_requests_total{api="fetch"} 1.0\n'
         b'kproxy_requests_created{api="produce"} 1700000000.5\n'
         b'# HELP kproxy_connections_open Open.\n# TYPE kproxy_connections_open gauge\n'
         b'kproxy_connections_open{listener="bootstrap"} 2.0\n'
         b'# HELP kproxy_rules Rules in force.\n# TYPE kproxy_rules gauge\nkproxy_rules 12.0\n'
         b'# HELP kproxy_event_loop_lag_max_seconds Longest.\n# TYPE kproxy_event_loop_lag_max_seconds gauge\n'
         b'kproxy_event_loop_lag_max_seconds 0.004\n')
    b = (b'# HELP kproxy_requests_total Requests.\n# TYPE kproxy_requests_total counter\n'
         b'kproxy_requests_total{api="produce"} 4.0\nkproxy_requests_total{api="metadata"} 7.0\n'
         b'kproxy_requests_created{api="produce"} 1690000000.25\n'
         b'# HELP kproxy_connections_open Open.\n# TYPE kproxy_connections_open gauge\n'
         b'kproxy_connections_open{listener="bootstrap"} 5.0\n'
         b'# HELP kproxy_rules Rules in force.\n# TYPE kproxy_rules gauge\nkproxy_rules 12.0\n'
         b'# HELP kproxy_event_loop_lag_max_seconds Longest.\n# TYPE kproxy_event_loop_lag_max_seconds gauge\n'
         b'kproxy_event_loop_lag_max_seconds 0.25\n')
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
        'kproxy_connections_open{listener="bootstrap"} 7',          # an amount per worker: added
        "# HELP kproxy_rules Rules in force.",
        "# TYPE kproxy_rules gauge",
        "kproxy_rules 12",                                          # the same in every worker
        "# HELP kproxy_event_loop_lag_max_seconds Longest.",
        "# TYPE kproxy_event_loop_lag_max_seconds gauge",
        "kproxy_event_loop_lag_max_seconds 0.25",                   # the worst worker's
    ]


# Gauges a worker exposes that are the same fact in every worker, or a worst case.
NOT_ADDITIVE = {"kproxy_rules", "kproxy_rules_generation", "kproxy_rules_loaded_timestamp_seconds",
                "kproxy_event_loop_lag_max_seconds"}


def worker_exposition(tmp_path) -> bytes:
    """What one worker's /metrics says: a real ProxyServer with rules, its loop lag and budget used (the
    process's, which adds the virtual_cluster label)."""
    from kproxy.config import config_from_args
    from kproxy.server.process import ProxyProcess

    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - name: no-delete\n    match: {api: delete_topics}\n    action: deny\n")
    cfg = config_from_args("kafka:9092", "127.0.0.1:19092", admin={"listen": "127.0.0.1:19999"},
                           rules=[str(rules)])
    server = ProxyProcess.from_config(cfg).cluster()
    shared = server.process.shared
    shared.loop_lag.observe(0.002)
    shared.loop_lag_max = 0.002
    server.stats.opened("bootstrap")
    server.budget.used = 4096
    assert server.process.metrics is not None
    return server.process.metrics.exposition()


def gauges_of(text: bytes) -> set[str]:
    return {line.split()[2] for line in text.decode().splitlines()
            if line.startswith("# TYPE ") and line.split()[3] == "gauge"}


def samples_of(text: bytes) -> dict[str, float]:
    return {key: float(value) for key, _, value in
            (line.rpartition(" ") for line in text.decode().splitlines() if line and not line.startswith("#"))}


def test_every_gauge_a_worker_exposes_has_a_merge_chosen_for_it(tmp_path):
    # A new gauge must be listed as additive (an amount each worker holds) or in MERGED_BY.
    gauges = gauges_of(worker_exposition(tmp_path))
    assert set(MERGED_BY) >= NOT_ADDITIVE
    assert gauges - ADDITIVE_GAUGES - set(MERGED_BY) == set()
    assert gauges >= NOT_ADDITIVE | {"kproxy_connections_open", "kproxy_requests_in_flight"}


def test_three_workers_merge_into_three_times_the_amounts_and_one_of_each_fact(tmp_path):
    one = worker_exposition(tmp_path)
    merged = merge_expositions([one, one, one])
    gauges = gauges_of(one)
    before, after = samples_of(one), samples_of(merged)
    assert before.keys() == after.keys()
    for key, value in before.items():
        name = key.split("{", 1)[0]
        if name.endswith("_created"):
            assert after[key] == value
        elif name in gauges and name not in ADDITIVE_GAUGES:
            assert after[key] == value, key
        else:
            assert after[key] == pytest.approx(3 * value), key
    assert after['kproxy_rules{virtual_cluster="default"}'] == 1
    assert after['kproxy_buffered_bytes{virtual_cluster=""}'] == 3 * 4096
    assert after['kproxy_connections_opened_total{listener="bootstrap",virtual_cluster="default"}'] == 3


@pytest.fixture
def idle_jump_clock():
    """Trio's clock that moves only when the test's tasks have all waited 0.2 s of real time, and then
    straight to the next deadline: the budget below runs out for a silent worker and never for one
    that answered, however slowly a loaded machine runs the test (with the real clock, a 1 s stall on
    a machine at load 10 timed every worker out)."""
    from trio.testing import MockClock

    return MockClock(autojump_threshold=0.2)


async def test_workers_are_asked_at_once_and_a_silent_one_costs_only_the_budget(idle_jump_clock):
    import trio

    async def http_server(listener: trio.SocketListener, silent: bool) -> None:
        async def handle(stream: trio.SocketStream) -> None:
            await stream.receive_some(65536)
            if silent:
                await trio.sleep_forever()
            await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nready\n")
            await stream.aclose()

        await trio.serve_listeners(handle, [listener])

    async with trio.open_nursery() as nursery:
        addresses = []
        for silent in (False, True, False, True):
            (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
            addresses.append(f"127.0.0.1:{listener.socket.getsockname()[1]}")
            nursery.start_soon(http_server, listener, silent)
        started = trio.current_time()
        answers = await fetch_all(addresses, "/readyz", 1.0)
        took = trio.current_time() - started
        nursery.cancel_scope.cancel()
    assert [status for status, _, _ in answers] == [200, 503, 200, 503]
    assert answers[1][2] == b"no answer within 1s\n"
    # Two silent workers asked one after another would take 2 s of the clock; at once, one budget.
    assert took == pytest.approx(1.0)


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))


def test_state_and_time_gauges_are_not_added_up():
    def worker(ready: int, expiry: float, failing: int, generation: int) -> bytes:
        return (f"# TYPE kproxy_ready gauge\nkproxy_ready {ready}\n"
                f"# TYPE kproxy_tls_certificate_expiry_timestamp_seconds gauge\n"
                f'kproxy_tls_certificate_expiry_timestamp_seconds{{file="/tls.crt"}} {expiry}\n'
                f"# TYPE kproxy_rules_reload_failing gauge\nkproxy_rules_reload_failing {failing}\n"
                f"# TYPE kproxy_rules_generation gauge\nkproxy_rules_generation {generation}\n"
                f"# TYPE kproxy_buffered_bytes gauge\nkproxy_buffered_bytes 10\n").encode()

    merged = merge_expositions([worker(1, 1.9e9, 0, 3), worker(0, 1.8e9, 1, 2)]).decode().splitlines()
    assert "kproxy_ready 0" in merged                    # ready only when every worker is
    assert 'kproxy_tls_certificate_expiry_timestamp_seconds{file="/tls.crt"} 1800000000' in merged
    assert "kproxy_rules_reload_failing 1" in merged and "kproxy_rules_generation 3" in merged
    assert "kproxy_buffered_bytes 20" in merged          # an amount: added up

"""What the quota dry run charges each recorded request, without Spark: a Fetch the size of its
answer, as the live quota filter charges it; a Produce the bytes of its records, as it arrives, as the
live filter charges it too."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from kproxy.policy.loader import load_rules

RULES = """\
quotas:
  - name: both
    match: {client_id: app}
    per: client_id
    produce_bytes_per_s: 1000
    fetch_bytes_per_s: 1000
"""


T0 = pd.Timestamp("2024-05-01T10:00:00Z")


def line(api: str, api_key: int, version: int, partition_bytes: int, response_bytes: int | None, *,
         at: float = 0.0, done: float = 1.0, acks: int = -1) -> dict:
    return {"ts": T0 + pd.Timedelta(seconds=at), "virtual_cluster": "default", "api": api, "api_key": api_key, "api_version": version,
            "client_id": "app", "principal": None, "client_address": "10.0.0.1:40000", "listener": "bootstrap",
            "client_software_name": None, "client_software_version": None, "topics": ["t"], "group": None,
            "transactional_id": None, "acks": acks if api == "produce" else None,
            "partitions": [{"topic": "t", "partition": 0, "bytes": partition_bytes, "compression": "none"}],
            "done_ts": T0 + pd.Timedelta(seconds=done), "proxy": "p1", "conn": 3, "kproxy_ms": 0.5,
            "response_bytes": response_bytes}


def test_a_fetch_is_charged_its_answer_and_a_produce_its_records(tmp_path: Path) -> None:
    from kproxy.analytics.dry_run import _charges
    rules_file = tmp_path / "quotas.yaml"
    rules_file.write_text(RULES)
    batch = pd.DataFrame([line("fetch", 1, 13, 4000, 5000), line("produce", 0, 9, 1000, 60),
                          line("fetch", 1, 13, 4000, None)])
    (out,) = list(_charges(load_rules([str(rules_file)]), False)(iter([batch])))
    assert list(out["produced"]) == [0, 1000, 0]
    # The answer as the broker sent it (what reached the client, less its 4-byte size prefix); a line
    # without its answer's size is charged its records.
    assert list(out["fetched"]) == [4996, 0, 4000]
    assert set(out["quota"]) == {"both"} and set(out["key"]) == {"client_id=app"}
    assert set(out["virtual_cluster"]) == {"default"}      # each virtual cluster's budgets are its own


def test_a_produce_is_charged_as_it_arrives_and_a_fetch_when_its_answer_comes(tmp_path: Path) -> None:
    from kproxy.analytics.dry_run import _charges
    rules_file = tmp_path / "quotas.yaml"
    rules_file.write_text(RULES)
    batch = pd.DataFrame([line("produce", 0, 9, 1000, 60, at=2.0, done=7.0),
                          line("fetch", 1, 13, 4000, 5000, at=2.0, done=7.0),
                          line("produce", 0, 9, 1000, None, at=3.0, done=3.0, acks=0)])
    (out,) = list(_charges(load_rules([str(rules_file)]), False)(iter([batch])))
    start = T0.timestamp()
    assert [t - start for t in out["t"]] == [2.0, 7.0, 3.0]
    # The Produce with an answer has its kproxy time charged when that answer came.
    assert out["answered"][0] - start == 7.0 and out["answered"][1:].isna().all()


PRODUCE_ONLY = """\
quotas:
  - name: produce
    match: {client_id: app}
    per: client_id
    produce_bytes_per_s: 1000
"""


def throttled_ms(rules, lines: list[dict]) -> int:
    from kproxy.analytics.dry_run import _charges, _replay
    (charges,) = list(_charges(rules, False)(iter([pd.DataFrame(lines)])))
    (row,) = _replay(rules, 1.0)(charges).itertuples(index=False)
    assert row.requests == len(lines)
    return int(row.throttle_ms_total)


def test_a_produce_slow_to_be_answered_counts_in_the_window_it_arrived_in(tmp_path: Path) -> None:
    """A Produce the broker answered 30 s later still weighs on one that arrived a second after it,
    as the live filter charges both on arrival; charged when answered, 28.5 s apart, each would have
    been alone in its 11 s window."""
    rules_file = tmp_path / "quotas.yaml"
    rules_file.write_text(PRODUCE_ONLY)
    rules = load_rules([str(rules_file)])
    slow = line("produce", 0, 9, 3000, 60, at=0.0, done=30.0)
    quick = line("produce", 0, 9, 3000, 60, at=1.0, done=1.5)
    alone = throttled_ms(rules, [slow]) + throttled_ms(rules, [quick])
    assert alone > 0
    assert throttled_ms(rules, [slow, quick]) > alone

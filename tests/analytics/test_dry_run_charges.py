"""What the quota dry run charges each recorded request, without Spark: a Fetch the size of its
answer, as the live quota filter charges it; a Produce the bytes of its records."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from kproxy.analytics.dry_run import _charges
from kproxy.policy.loader import load_rules

RULES = """\
quotas:
  - name: both
    match: {client_id: app}
    per: client_id
    produce_bytes_per_s: 1000
    fetch_bytes_per_s: 1000
"""


def line(api: str, api_key: int, version: int, partition_bytes: int, response_bytes: int | None) -> dict:
    return {"ts": pd.Timestamp("2024-05-01T10:00:00Z"), "virtual_cluster": "default", "api": api, "api_key": api_key, "api_version": version,
            "client_id": "app", "principal": None, "client_address": "10.0.0.1:40000", "listener": "bootstrap",
            "client_software_name": None, "client_software_version": None, "topics": ["t"], "group": None,
            "transactional_id": None, "acks": -1 if api == "produce" else None,
            "partitions": [{"topic": "t", "partition": 0, "bytes": partition_bytes, "compression": "none"}],
            "done_ts": pd.Timestamp("2024-05-01T10:00:01Z"), "proxy": "p1", "conn": 3, "kproxy_ms": 0.5,
            "response_bytes": response_bytes}


def test_a_fetch_is_charged_its_answer_and_a_produce_its_records(tmp_path: Path) -> None:
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

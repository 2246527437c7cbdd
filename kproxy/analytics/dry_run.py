"""Policy and quota dry-run: a candidate rules file applied to recorded traffic (issue 11, item 6).

This is the one place the dry-run lives. It waits for kproxy's rule engine (``kproxy.policy``):
the engine is to run inside Spark tasks through a vectorised pandas/Arrow function (the one place the
report runs Python per row), and return the tables described in ``dry_run``'s docstring.
"""

from __future__ import annotations

from pathlib import Path

from pyspark.sql import DataFrame

from kproxy.analytics.source import ReportError


def dry_run(requests: DataFrame, rules_path: Path) -> dict[str, DataFrame]:
    """Applies the rules file at ``rules_path`` to ``requests`` (the report's ``requests`` table).

    Returns tables named ``dry_run_<what>``; ``job`` writes each under tables/ and shows it in a
    "Dry run" section of the HTML page: who would have been denied (rule, client_id, principal, api, requests, first/last seen)
    and who would have been throttled, how often and by how much (quota, key, requests,
    throttle_ms_total, throttle_ms_p99).
    """
    raise ReportError(f"--rules {rules_path}: the policy dry-run needs kproxy's rule engine "
                      "(kproxy.policy), which this build does not have yet")

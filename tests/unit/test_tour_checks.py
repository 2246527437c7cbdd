"""The tour's own check: a quota step that had nothing to throttle says so, instead of blaming kproxy."""

from __future__ import annotations

from kproxy.tour import QUOTA_BYTES_PER_S, QUOTA_CLIENT, QUOTA_SECONDS, TourResult, _problems


def quota_problems(per_second: int, throttle_ms: float) -> list[str]:
    """What the check says of the producer (the other steps' findings, all empty here, left out)."""
    result = TourResult(quota_acked=[per_second] * QUOTA_SECONDS, client_throttle_ms=throttle_ms)
    return [p for p in _problems(result) if "producer" in p or p.startswith(QUOTA_CLIENT)]


def test_a_producer_slower_than_its_quota_is_named_as_the_reason_for_no_throttle() -> None:
    (problem,) = quota_problems(QUOTA_BYTES_PER_S // 2, throttle_ms=0.0)
    assert f"{QUOTA_CLIENT} reached only 50 KiB/s, under its quota of 100 KiB/s" in problem
    assert "nothing to throttle" in problem


def test_a_producer_above_its_quota_that_was_never_throttled_is_kproxys_failure() -> None:
    problems = quota_problems(QUOTA_BYTES_PER_S * 2, throttle_ms=0.0)
    assert "the quota's producer reported no throttle" in problems
    assert any("above its quota" in p for p in problems)


def test_a_throttled_producer_at_its_quota_passes_the_quota_check() -> None:
    assert quota_problems(QUOTA_BYTES_PER_S, throttle_ms=120.0) == []

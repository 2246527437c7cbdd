"""The PromQL metric-name extractor the monitoring tests rely on: it must find every selected metric
and nothing else (label names, functions, keywords, Grafana variables)."""

from __future__ import annotations

import pytest

from tests.monitoring.promql import PromQLSyntaxError, metric_names


@pytest.mark.parametrize("expr, names", [
    ('sum by (api) (rate(kproxy_requests_total{namespace=~"$namespace", api=~"$api"}[$__rate_interval]))',
     {"kproxy_requests_total"}),
    ("histogram_quantile(0.99, sum by (namespace, pod, le) (rate(kproxy_added_duration_seconds_bucket[5m]))) > 0.1",
     {"kproxy_added_duration_seconds_bucket"}),
    ('sum(rate(a_total{outcome="x"}[5m])) / on (pod) group_left (api, le) sum(rate(b_total[5m])) by (pod)',
     {"a_total", "b_total"}),
    ("min by (file) (kproxy_tls_certificate_expiry_timestamp_seconds) - time() < 14 * 86400",
     {"kproxy_tls_certificate_expiry_timestamp_seconds"}),
    ('up{job=~".*kproxy.*"} == 0', {"up"}),
    ('{__name__="kproxy_ready", pod="by"} or x offset 1h30m and bool_metric', {"kproxy_ready", "x", "bool_metric"}),
    ("max_over_time(rate(by_client[1m])[10m:1m]) unless ignoring (le) nan_count", {"by_client", "nan_count"}),
    ("topk(10, sum without (instance) (rate(m:recorded:rate5m[5m]))) + Inf * NaN", {"m:recorded:rate5m"}),
])
def test_metric_names(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


@pytest.mark.parametrize("expr", ["sum(rate(x[5m])", 'x{a="b"', "x ? y"])
def test_bad_expressions_are_refused(expr: str) -> None:
    with pytest.raises(PromQLSyntaxError):
        metric_names(expr)

"""Every metric the Grafana dashboard and the alert rules name is one kproxy exports: a kproxy with TLS,
rules, quotas, the traffic log and per-client and per-topic labels on serves real clients through tansu,
and its /metrics is compared with the names parsed out of every PromQL expression. The certificate
expiry it reports is the certificate's own notAfter."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import confluent_kafka
import confluent_kafka.admin
import pytest
import trustme
from cryptography import x509
from prometheus_client.parser import text_string_to_metric_families

from kproxy.config import parse_config
from kproxy.kms.local import write_key_file
from kproxy.server.embedded import ProxyThread
from tests.e2e.sasl_gate import confluent_roundtrip, expected_pairs, free_ports
from tests.e2e.tansu import TansuBroker, unique_name
from tests.monitoring.conftest import alert_rules, as_promql, dashboard_expressions
from tests.monitoring.promql import metric_names

pytestmark = pytest.mark.e2e

# Series Prometheus makes itself for every scrape target, not kproxy.
PROMETHEUS_OWN = {"up"}


def exported_names(exposition: str) -> set[str]:
    """The names a query can select from this exposition: each family by its type (counters as
    name_total, histograms as _bucket, _sum and _count, gauges as they are) and every sample's name."""
    names: set[str] = set()
    for family in text_string_to_metric_families(exposition):
        if family.type == "counter":
            names |= {f"{family.name}_total", f"{family.name}_created"}
        elif family.type == "histogram":
            names |= {f"{family.name}_bucket", f"{family.name}_sum", f"{family.name}_count"}
        elif family.type == "summary":
            names |= {family.name, f"{family.name}_sum", f"{family.name}_count"}
        else:
            names.add(family.name)
        names |= {s.name for s in family.samples}
    return names


def test_exported_names_follow_the_families_types() -> None:
    text = ("# TYPE a counter\na_total 1\n# TYPE h histogram\nh_bucket{le=\"+Inf\"} 1\nh_sum 1\nh_count 1\n"
            "# TYPE g gauge\ng 2\n")
    assert exported_names(text) == {"a_total", "a_created", "h_bucket", "h_sum", "h_count", "g"}


def test_every_metric_of_the_dashboard_and_the_alerts_is_exported(broker: TansuBroker, tmp_path: Path) -> None:
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    cert, key, ca_file = tmp_path / "server.pem", tmp_path / "server.key", tmp_path / "ca.pem"
    leaf.private_key_pem.write_to_path(str(key))
    with open(cert, "wb") as f:
        for blob in leaf.cert_chain_pems:
            f.write(blob.bytes())
    ca.cert_pem.write_to_path(str(ca_file))
    rules = tmp_path / "rules.yaml"
    rules.write_text("default: allow\nrules:\n  - name: nobody-deletes-topics\n    match: {api: delete_topics}\n"
                     "    action: deny\n  - name: seal\n    match: {topic: 'sealed-*'}\n    action: encrypt\n"
                     "    encrypt: {kek: monitoring-kek}\nquotas:\n  - name: per-client\n    match: {client_id: '*'}\n"
                     "    per: client_id\n    produce_bytes_per_s: 104857600\n")
    # Record encryption's metrics: a development key file is enough to export them.
    keys = tmp_path / "keks.json"
    write_key_file(str(keys), ["monitoring-kek"])
    logs = tmp_path / "traffic"
    logs.mkdir()
    port, broker_port, admin = free_ports(3)
    config = parse_config(f"""\
listen: "127.0.0.1:{port}"
upstream: {{bootstrap_servers: ["{broker.bootstrap}"]}}
exposure: {{advertised_host: 127.0.0.1, broker_port_start: {broker_port}, broker_port_count: 1}}
tls: {{enabled: true, cert_file: "{cert}", key_file: "{key}"}}
admin: {{listen: "127.0.0.1:{admin}"}}
metrics: {{client_labels: true, topic_labels: true}}
traffic_log: {{dir: "{logs}"}}
limits: {{max_buffered_bytes_total: 268435456}}
rules: ["{rules}"]
kms: {{local: {{file: "{keys}", allow_in_gateway: true}}}}
""")
    with ProxyThread(config) as proxy:
        settings = {"bootstrap.servers": proxy.bootstrap, "security.protocol": "SSL",
                    "ssl.ca.location": str(ca_file), "client.id": "monitoring-test"}
        topic = unique_name("monitoring")
        assert confluent_roundtrip(settings, topic) == expected_pairs()
        # A denial, so the per-rule family has a sample too.
        adm = confluent_kafka.admin.AdminClient(settings)
        with pytest.raises(confluent_kafka.KafkaException):
            adm.delete_topics([topic])[topic].result(20)
        with urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=10) as r:
            exposition = r.read().decode()
        with urllib.request.urlopen(f"http://127.0.0.1:{admin}/clients", timeout=10) as r:
            clients = json.loads(r.read())

    exported = exported_names(exposition)
    used: dict[str, set[str]] = {}
    for title, expr in dashboard_expressions():
        for name in metric_names(as_promql(expr)):
            used.setdefault(name, set()).add(f"dashboard: {title}")
    for rule in alert_rules():
        for name in metric_names(rule["expr"]):
            used.setdefault(name, set()).add(f"alert {rule['alert']}")
    assert len(used) >= 20
    missing = {name: sorted(where) for name, where in used.items()
               if name not in exported and name not in PROMETHEUS_OWN}
    assert missing == {}

    # The traffic made samples, not only declarations, of the families the panels lean on most.
    samples = {s.name: s for f in text_string_to_metric_families(exposition) for s in f.samples}
    for name in ("kproxy_requests_total", "kproxy_added_duration_seconds_bucket", "kproxy_by_client_requests_total",
                 "kproxy_topic_records_total", "kproxy_denied_requests_total", "kproxy_traffic_log_lines_written_total",
                 "kproxy_ready", "kproxy_rules_reload_failing", "kproxy_buffer_budget_bytes"):
        assert name in samples, name
    # The certificate's own notAfter, by file.
    expiry = next(s for s in text_string_to_metric_families(exposition)
              if s.name == "kproxy_tls_certificate_expiry_timestamp_seconds").samples
    by_file = {s.labels["file"]: s.value for s in expiry}
    not_after = x509.load_pem_x509_certificate(leaf.cert_chain_pems[0].bytes()).not_valid_after_utc.timestamp()
    assert by_file[str(cert)] == pytest.approx(not_after)
    # /clients names the client even though nothing asked for it, with its traffic.
    rows = clients["connections"] + clients["recent"]
    assert {r["client_id"] for r in rows} >= {"monitoring-test"}
    assert sum(r["requests"] for r in rows if r["client_id"] == "monitoring-test") > 5

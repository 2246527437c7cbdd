"""kproxy's Grafana dashboard, built with grafana-foundation-sdk and written as JSON:
``python -m kproxy.ops.dashboard --out deploy/monitoring/grafana/kproxy.json`` (``make monitoring``
writes it and the Helm chart's copy). The checked-in file must equal what this prints
(tests/monitoring checks it).

Every query is filtered by the dashboard's variables (``$namespace``, ``$pod``, ``$virtual_cluster``
for the families of one virtual cluster and, where requests have an API, ``$api``); the namespace and
pod labels are those the Prometheus Operator adds. The families of the process as a whole (buffers,
the event loop, certificate files, the traffic log) carry ``virtual_cluster=""`` and are filtered by
namespace and pod only.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.builders.common import (
    ReduceDataOptions,
    StackingConfig,
    VizLegendOptions,
    VizTooltipOptions,
)
from grafana_foundation_sdk.builders.dashboard import (
    Dashboard,
    DatasourceVariable,
    QueryVariable,
    Row,
    ThresholdsConfig,
)
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import (
    BigValueColorMode,
    BigValueGraphMode,
    LegendDisplayMode,
    LegendPlacement,
    SortOrder,
    StackingMode,
    TooltipDisplayMode,
)
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DataSourceRef,
    Threshold,
    ThresholdsMode,
    VariableRefresh,
    VariableSort,
)

UID = "kproxy-overview"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
# Every series of one kproxy deployment; ``VC`` adds the virtual cluster filter for the families of
# one virtual cluster, ``API`` the API filter for per-request families.
SEL = 'namespace=~"$namespace", pod=~"$pod"'
VC = f'{SEL}, virtual_cluster=~"$virtual_cluster"'
API = f'{VC}, api=~"$api"'
RATE = "$__rate_interval"


def query(expr: str, legend: str, ref: str = "A") -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(DATASOURCE)


def series(title: str, description: str, unit: str, *targets: tuple[str, str], width: int = 12,
           stacked: bool = False) -> timeseries.Panel:
    panel = (timeseries.Panel().title(title).description(description).unit(unit).datasource(DATASOURCE)
             .height(8).span(width).fill_opacity(10).line_width(1).min(0)
             .legend(VizLegendOptions().display_mode(LegendDisplayMode.LIST).placement(LegendPlacement.BOTTOM)
                     .show_legend(True))
             .tooltip(VizTooltipOptions().mode(TooltipDisplayMode.MULTI).sort(SortOrder.DESCENDING)))
    for i, (expr, legend) in enumerate(targets):
        panel = panel.with_target(query(expr, legend, chr(ord("A") + i)))
    if stacked:
        panel = panel.stacking(StackingConfig().mode(StackingMode.NORMAL))
    return panel


def single(title: str, description: str, unit: str, expr: str, legend: str, *, red_below: float | None = None,
           red_above: float | None = None, width: int = 6) -> stat.Panel:
    if red_below is not None:
        steps = [Threshold(color="red", value=None), Threshold(color="green", value=red_below)]
    else:
        steps = [Threshold(color="green", value=None), Threshold(color="red", value=red_above)]
    return (stat.Panel().title(title).description(description).unit(unit).datasource(DATASOURCE)
            .height(8).span(width).with_target(query(expr, legend))
            .graph_mode(BigValueGraphMode.NONE).color_mode(BigValueColorMode.BACKGROUND)
            .reduce_options(ReduceDataOptions().calcs(["lastNotNull"]).values(False))
            .thresholds(ThresholdsConfig().mode(ThresholdsMode.ABSOLUTE).steps(steps)))


def quantile(q: float, family: str, by: str, selector: str = API) -> str:
    return f"histogram_quantile({q}, sum by ({by}le) (rate({family}_bucket{{{selector}}}[{RATE}])))"


def variable(name: str, label: str, expr: str) -> QueryVariable:
    return (QueryVariable(name).label(label).query(expr).datasource(DATASOURCE)
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC)
            .multi(True).include_all(True).all_value(".*"))


def build() -> dict[str, Any]:
    """The dashboard as the JSON data Grafana imports."""
    d = (Dashboard("kproxy").uid(UID).tags(["kafka", "kproxy"]).editable()
         .description("kproxy, the Kafka wire-protocol proxy: traffic, latency, errors, denials and "
                      "throttles, connections and buffers, upstream clusters and switches, the event loop, the "
                      "traffic log and rule reloads.")
         .refresh("30s").time("now-3h", "now").timezone("browser").tooltip(DashboardCursorSync.CROSSHAIR)
         .with_variable(DatasourceVariable("datasource").label("Data source").type("prometheus"))
         .with_variable(variable("namespace", "Namespace", "label_values(kproxy_requests_total, namespace)"))
         .with_variable(variable("pod", "Pod", 'label_values(kproxy_requests_total{namespace=~"$namespace"}, pod)'))
         .with_variable(variable("virtual_cluster", "Virtual cluster",
                                 f"label_values(kproxy_requests_total{{{SEL}}}, virtual_cluster)"))
         .with_variable(variable("api", "API", f"label_values(kproxy_requests_total{{{VC}}}, api)")))

    d = d.with_row(Row("Traffic"))
    d = d.with_panel(series(
        "Requests per second by API", "Requests completed per second, by Kafka API.", "reqps",
        (f"sum by (api) (rate(kproxy_requests_total{{{API}}}[{RATE}]))", "{{api}}")))
    d = d.with_panel(series(
        "Bytes per second, in and out", "Bytes of requests from clients (request) and of responses to "
        "them (response), size prefixes included.", "Bps",
        (f"sum by (direction) (rate(kproxy_client_bytes_total{{{API}}}[{RATE}]))", "{{direction}}")))
    d = d.with_panel(series(
        "Records per second", "Records produced (acknowledged, or written with acks=0) and fetched, "
        "from batch headers.", "rps",
        (f"sum by (direction) (rate(kproxy_records_total{{{VC}}}[{RATE}]))", "{{direction}}"), width=8))
    d = d.with_panel(series(
        "Top clients by requests", "The ten busiest client ids. Needs metrics.client_labels: true "
        "(empty otherwise; kproxy top and /clients show client ids without it).", "reqps",
        (f"topk(10, sum by (client_id) (rate(kproxy_by_client_requests_total{{{API}}}[{RATE}])))",
         "{{client_id}}"), width=8))
    d = d.with_panel(series(
        "Top clients by bytes", "The ten client ids moving the most bytes (requests and responses). Needs "
        "metrics.client_labels: true.", "Bps",
        (f"topk(10, sum by (client_id) (rate(kproxy_by_client_request_bytes_total{{{API}}}[{RATE}]))"
         f" + sum by (client_id) (rate(kproxy_by_client_response_bytes_total{{{API}}}[{RATE}])))",
         "{{client_id}}"), width=8))
    d = d.with_panel(series(
        "Top topics by records", "The ten busiest topics by records produced and fetched. Needs "
        "metrics.topic_labels: true.", "rps",
        (f"topk(10, sum by (virtual_cluster, topic, direction) (rate(kproxy_topic_records_total{{{VC}}}[{RATE}])))",
         "{{virtual_cluster}} {{topic}} {{direction}}")))
    d = d.with_panel(series(
        "Top topics by bytes", "The ten topics with the most record bytes produced and fetched (batch "
        "sizes). Needs metrics.topic_labels: true.", "Bps",
        (f"topk(10, sum by (virtual_cluster, topic, direction) (rate(kproxy_topic_bytes_total{{{VC}}}[{RATE}])))",
         "{{virtual_cluster}} {{topic}} {{direction}}")))
    d = d.with_panel(series(
        "Requests per second by virtual cluster", "Requests completed per second, by virtual cluster (each "
        "listener set and upstream of the process; docs/virtual-clusters.md).", "reqps",
        (f"sum by (virtual_cluster) (rate(kproxy_requests_total{{{API}}}[{RATE}]))", "{{virtual_cluster}}"),
        width=24))

    d = d.with_row(Row("Latency"))
    d = d.with_panel(series(
        "Request latency p50 and p99 by API", "Request read until its answer was written to the client. "
        "Fetch includes the broker's long poll (fetch.max.wait.ms).", "s",
        (quantile(0.99, "kproxy_request_duration_seconds", "api, "), "p99 {{api}}"),
        (quantile(0.5, "kproxy_request_duration_seconds", "api, "), "p50 {{api}}")))
    d = d.with_panel(series(
        "Broker time against kproxy's own time (p99)", "The broker's time (request written until its "
        "response read) and the time kproxy added to the same requests (the rest).", "s",
        (quantile(0.99, "kproxy_broker_duration_seconds", ""), "broker p99"),
        (quantile(0.99, "kproxy_added_duration_seconds", ""), "kproxy p99"),
        (quantile(0.5, "kproxy_added_duration_seconds", ""), "kproxy p50")))

    d = d.with_row(Row("Errors, denials and throttles"))
    d = d.with_panel(series(
        "Requests not answered by the broker, by outcome", "Outcomes other than forwarded: local "
        "(kproxy answered), no_response (acks=0), upstream_lost, client_gone (the client left first), closed "
        "(kproxy closed the connection first), passthrough.", "reqps",
        (f'sum by (outcome) (rate(kproxy_request_outcomes_total{{{API}, outcome!="forwarded"}}[{RATE}]))',
         "{{outcome}}"), width=8))
    d = d.with_panel(series(
        "Error ratio", "Requests that ended without an answer because the broker connection was lost or "
        "timed out (upstream_lost) or kproxy closed the connection (closed), over all requests; and frames "
        "that could not be decoded, per second.", "percentunit",
        (f'sum(rate(kproxy_request_outcomes_total{{{API}, outcome=~"upstream_lost|closed"}}[{RATE}])) / '
         f"sum(rate(kproxy_requests_total{{{API}}}[{RATE}]))", "error ratio"),
        (f"sum by (direction) (rate(kproxy_decode_errors_total{{{VC}}}[{RATE}]))",
         "decode errors/s ({{direction}})"),
        (f"sum by (virtual_cluster, broker) (rate(kproxy_upstream_connect_failures_total{{{VC}}}[{RATE}]))",
         "connect failures/s {{virtual_cluster}} {{broker}}"), width=8))
    d = d.with_panel(series(
        "Denials per rule", "Requests refused by a policy rule, per second, by virtual cluster and rule.", "reqps",
        (f"sum by (virtual_cluster, rule) (rate(kproxy_denied_requests_total{{{VC}}}[{RATE}]))",
         "{{virtual_cluster}} {{rule}}"), width=8))
    d = d.with_panel(series(
        "Throttle time per quota", "Throttle time told to clients per second of wall time, by virtual cluster "
        "and the quota rule that decided it (broker: the broker's own). 1 means one client throttled all the "
        "time.", "s",
        (f"sum by (virtual_cluster, rule) (rate(kproxy_throttle_seconds_total{{{VC}}}[{RATE}]))",
         "{{virtual_cluster}} {{rule}}"), width=24))

    d = d.with_row(Row("Connections and buffers"))
    d = d.with_panel(series(
        "Open connections by listener", "Client connections open now (bootstrap, broker-N, controller-N).",
        "short", (f"sum by (virtual_cluster, listener) (kproxy_connections_open{{{VC}}})",
                  "{{virtual_cluster}} {{listener}}"), width=8, stacked=True))
    d = d.with_panel(series(
        "New connections per second", "Client connections accepted per second, by virtual cluster and "
        "listener.", "cps",
        (f"sum by (virtual_cluster, listener) (rate(kproxy_connections_opened_total{{{VC}}}[{RATE}]))",
         "{{virtual_cluster}} {{listener}}"), width=8))
    d = d.with_panel(series(
        "Buffer budget", "Bytes held in frame buffers against the process budget "
        "(limits.max_buffered_bytes_total), and reads that waited for it.", "bytes",
        (f"sum by (pod) (kproxy_buffered_bytes{{{SEL}}})", "held {{pod}}"),
        (f"sum by (pod) (kproxy_buffer_budget_bytes{{{SEL}}})", "budget {{pod}}"),
        (f"sum by (pod) (rate(kproxy_buffer_budget_pauses_total{{{SEL}}}[{RATE}]))", "pauses/s {{pod}}"),
        width=8))
    d = d.with_panel(single(
        "Virtual clusters ready", "Virtual clusters ready, added over the pods (kproxy_ready: each pod's "
        "/readyz is ready only when all of its virtual clusters are).", "short",
        f"sum(kproxy_ready{{{VC}}})", "ready", red_below=1))
    d = d.with_panel(single(
        "Earliest certificate expiry", "Days until the first certificate kproxy loaded expires "
        "(tls.* and upstream.tls.* files).", "d",
        f"min(kproxy_tls_certificate_expiry_timestamp_seconds{{{SEL}}} - time()) / 86400", "days",
        red_below=14))
    d = d.with_panel(series(
        "Certificate expiry by file", "Days until each certificate file expires.", "d",
        (f"min by (file) (kproxy_tls_certificate_expiry_timestamp_seconds{{{SEL}}} - time()) / 86400",
         "{{file}}")))

    d = d.with_row(Row("Upstream clusters"))
    d = d.with_panel(series(
        "Active upstream cluster", "1 for the upstream cluster each virtual cluster is on "
        "(kproxy_upstream_active; several clusters with upstream.clusters). A step is a switch.", "short",
        (f"max by (virtual_cluster, cluster) (kproxy_upstream_active{{{VC}}})", "{{virtual_cluster}}: {{cluster}}"),
        width=8))
    d = d.with_panel(series(
        "Upstream clusters answering", "1 while a broker of the cluster answers kproxy's probes, 0 when "
        "none does (a refused login still answers); failover moves off an active cluster at 0 for "
        "upstream.failover.after_s.", "short",
        (f"min by (virtual_cluster, cluster) (kproxy_upstream_reachable{{{VC}}})", "{{virtual_cluster}}: {{cluster}}"),
        width=8))
    d = d.with_panel(series(
        "Switches and how long they held clients", "Switches by reason (planned: kproxy switch; failover; "
        "followed: a worker followed another) and the seconds the last switch held new connections.", "short",
        (f"sum by (virtual_cluster, reason) (increase(kproxy_upstream_switches_total{{{VC}}}[{RATE}]))",
         "{{virtual_cluster}} {{reason}}"),
        (f"max by (virtual_cluster) (kproxy_upstream_switch_hold_seconds{{{VC}}})", "{{virtual_cluster}} hold s"),
        width=8))

    d = d.with_row(Row("Event loop, traffic log and rules"))
    d = d.with_panel(series(
        "Event loop lag", "How late a timer fired (every 5 ms while the loop is held, every 100 ms "
        "when it is not): how long other work held the loop (every connection of the pod waited that long).", "s",
        (quantile(0.99, "kproxy_event_loop_lag_seconds", "pod, ", SEL), "p99 {{pod}}"),
        (f"max by (pod) (kproxy_event_loop_lag_max_seconds{{{SEL}}})", "max since start {{pod}}"), width=8))
    d = d.with_panel(series(
        "Traffic log lines", "Lines written and dropped per second (a drop loses an audit record: "
        "queue full or write errors).", "short",
        (f"sum(rate(kproxy_traffic_log_lines_written_total{{{SEL}}}[{RATE}]))", "written/s"),
        (f"sum(rate(kproxy_traffic_log_lines_dropped_total{{{SEL}}}[{RATE}]))", "dropped/s"), width=8))
    d = d.with_panel(series(
        "Rule reloads", "Rule reloads by outcome (failed: the old rules stayed in force) and the "
        "generation of the rules in force.", "short",
        (f"sum by (virtual_cluster, outcome) (increase(kproxy_rule_reloads_total{{{VC}}}[{RATE}]))",
         "reloads {{virtual_cluster}} {{outcome}}"),
        (f"max by (pod, virtual_cluster) (kproxy_rules_generation{{{VC}}})", "generation {{pod}} {{virtual_cluster}}"),
        width=8))
    d = d.with_panel(series(
        "Kerberos failures", "Kerberos (GSSAPI) failures per second, by side (accept: clients' tickets "
        "checked with kproxy's keytab; initiate: kproxy's own tickets) and kind (keytab, clock_skew, "
        "unknown_principal, expired, other).", "short",
        (f"sum by (virtual_cluster, side, kind) (rate(kproxy_kerberos_failures_total{{{VC}}}[{RATE}]))",
         "{{virtual_cluster}} {{side}} {{kind}}"),
        width=24))

    d = d.with_row(Row("Record encryption"))
    d = d.with_panel(series(
        "Records sealed and opened", "Record values encrypt rules sealed on Produce and kproxy opened in "
        "Fetch answers, per second.", "short",
        (f"sum(rate(kproxy_records_encrypted_total{{{SEL}, unit=\"records\"}}[{RATE}]))", "sealed/s"),
        (f"sum(rate(kproxy_records_decrypted_total{{{SEL}, unit=\"records\"}}[{RATE}]))", "opened/s"), width=8))
    d = d.with_panel(series(
        "Partitions refused by encryption", "Produce and Fetch partitions record encryption refused, by "
        "reason (unreachable, timeout: the KMS; unknown_kek, denied; tampered: a record that fails "
        "authentication).", "short",
        (f"sum by (reason) (increase(kproxy_record_encryption_failures_total{{{SEL}}}[{RATE}]))", "{{reason}}"),
        width=8))
    d = d.with_panel(series(
        "KMS calls", "KMS calls per second by operation and outcome, and their p99 time.", "short",
        (f"sum by (op, outcome) (rate(kproxy_kms_calls_total{{{SEL}}}[{RATE}]))", "{{op}} {{outcome}}"),
        (quantile(0.99, "kproxy_kms_call_duration_seconds", "op, ", SEL), "p99 s {{op}}"), width=8))

    built = d.build()
    # Grafana keys panel state (links, edits, alerts) by id: number them in order, rows included.
    for number, panel in enumerate(built.panels or [], start=1):
        panel.id_val = number
    data: dict[str, Any] = json.loads(json.dumps(built, cls=JSONEncoder))
    return data


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kproxy.ops.dashboard", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", action="append", type=Path, help="write the dashboard JSON here (repeatable); "
                   "default: standard output")
    args = p.parse_args(argv)
    text = render()
    if not args.out:
        sys.stdout.write(text)
    for path in args.out or ():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

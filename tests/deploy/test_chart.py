"""The Helm chart, checked offline with Helm itself (helm-python-sdk embeds the Helm v4 library):
every ci/*-values.yaml renders and lints against Kubernetes 1.29 and the newest version
kubernetes-validate knows, every rendered object validates strictly, the values schema rejects wrong
values, and what the chart renders agrees with itself and with kproxy (`kproxy check` on every
rendered kproxy.yaml, laid out where the pod would see it).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
import trustme
import yaml
from helm_python.chart import Chart, lint
from helm_python.errors import HelmError

from kproxy.config import HostPort, ProxyConfig
from kproxy.userfile import add_user
from tests.deploy.pod import lay_out
from tests.deploy.render import (
    CHART_DIR,
    KUBE_VERSIONS,
    NAMESPACE,
    Image,
    Obj,
    by_kind,
    chart_objects,
    ci_values,
    config_maps,
    merged,
    notes,
    one,
    render_chart,
    sidecar_block,
)
from tests.deploy.validation import check_hardened, kproxy_check, kproxy_containers, validate_objects

CI_FILES = sorted(ci_values())
# The kproxy.yaml sections the chart writes from its own values; `config` may hold all the others.
CHART_OWNED = {"listen", "mode", "admin", "exposure", "tls", "tracing", "rules", "quota_replicas"}
# Settings the chart's values do not offer: it renders one virtual cluster; several need a kproxy.yaml
# of your own (existingConfigMap; docs/kubernetes.md).
CHART_LEAVES_OUT = {"virtual_clusters"}


def test_the_ci_files_cover_every_supported_shape() -> None:
    assert {"gateway-values.yaml", "sidecar-values.yaml", "tls-mtls-values.yaml", "sni-values.yaml",
            "tracing-values.yaml", "quotas-values.yaml", "nlb-proxy-protocol-values.yaml"} <= set(CI_FILES)


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("ci_file", ["(defaults)", *CI_FILES])
def test_renders_lints_and_validates(ci_file: str, kube_version: str) -> None:
    values = {} if ci_file == "(defaults)" else ci_values()[ci_file]
    report = lint(CHART_DIR, values, strict=True, namespace=NAMESPACE, kube_version=f"v{kube_version}")
    assert report["errors"] == []
    # Severity 1 is informational (Helm suggests an icon); warnings and errors fail.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []
    objects = chart_objects(render_chart(values, kube_version))
    assert objects
    validate_objects(objects, kube_version)
    for spec, container in kproxy_containers(objects):
        check_hardened(spec, container)


@pytest.mark.parametrize("bad, where", [
    ({"ports": {"kafka": "9092"}}, "kafka"),
    ({"replicaCount": "2"}, "replicaCount"),
    ({"replicas": 2}, "replicas"),
    ({"image": {"tag": 1}}, "tag"),
    ({"exposure": {"mode": "round_robin"}}, "mode"),
    ({"exposure": {"brokerPortCount": 0}}, "brokerPortCount"),
    ({"tls": {"enabled": "yes"}}, "enabled"),
    ({"config": {"limits": {"drain_timeout_s": "20s"}}}, "drain_timeout_s"),
    ({"config": {"limits": {"drain_timeout": 20}}}, "drain_timeout"),
    ({"config": {"log_format": "xml"}}, "log_format"),
    ({"config": {"quota": {"coordination": {"fleet": "a/b"}}}}, "fleet"),
    ({"config": {"quota": {"coordination": {"topic": "__kproxy_quotas"}}}}, "fleet"),
    # What the chart sets itself cannot be set again through config.
    ({"config": {"listen": "0.0.0.0:1"}}, "listen"),
    ({"metrics": {"prometheusRule": {"enabled": "yes"}}}, "enabled"),
    ({"metrics": {"prometheusRule": {"runbookBaseUrl": "docs.example.com"}}}, "runbookBaseUrl"),
    ({"metrics": {"grafanaDashboard": {"labels": {"grafana_dashboard": 1}}}}, "grafana_dashboard"),
    ({"metrics": {"grafanaDashboard": {"folder": "Kafka"}}}, "folder"),
    ({"rules": {"files": {"policy.json": {}}}}, "policy.json"),
])
def test_schema_rejects_wrong_values(bad: dict[str, Any], where: str) -> None:
    with Chart.load(CHART_DIR) as chart:
        values = merged(chart.values, bad)
        with pytest.raises(HelmError, match=re.escape(where)):
            chart.validate_schema(values)
    # Helm validates at install too: the render itself refuses.
    with pytest.raises(HelmError):
        render_chart(bad)


def test_every_ci_file_is_valid_for_check_jsonschema_too() -> None:
    # An independent validator of the same schema (and of the schema against its metaschema).
    files = [str(CHART_DIR / "values.yaml"), *(str(CHART_DIR / "ci" / f) for f in CI_FILES)]
    schema = str(CHART_DIR / "values.schema.json")
    checker = str(Path(sys.executable).parent / "check-jsonschema")
    ok = subprocess.run([checker, "--check-metaschema", schema], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    ok = subprocess.run([checker, "--schemafile", schema, *files], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_values_yaml_has_a_comment_on_every_value() -> None:
    lines = (CHART_DIR / "values.yaml").read_text().splitlines()
    missing = [f"{i + 1}: {line}" for i, line in enumerate(lines)
               if re.match(r"^\s*[A-Za-z_][\w./-]*:", line) and not lines[i - 1].lstrip().startswith("#")]
    assert missing == []


def _schema_type(tp: Any) -> set[str]:
    names = {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null"}
    args = getattr(tp, "__args__", None)
    if tp is HostPort or (args and HostPort in args and getattr(tp, "__origin__", None) is tuple):
        return {"string", "array"}
    if getattr(tp, "__origin__", None) is dict:
        return {"object"}
    if args and getattr(tp, "__origin__", None) is not tuple:
        return set().union(*(_schema_type(a) for a in args))
    if getattr(tp, "__origin__", None) is tuple:
        return {"array"}
    if attrs.has(tp):
        return {"object"}
    return {names[tp]}


def _section_class(tp: Any) -> type | None:
    """The settings class of a section field (``LimitsConfig``, ``SniConfig | None``), else None."""
    if getattr(tp, "__origin__", None) is tuple:
        return None
    classes = [a for a in (getattr(tp, "__args__", None) or (tp,)) if attrs.has(a) and a is not HostPort]
    return classes[0] if classes else None


def _compare(cls: type, schema: Obj, path: str, problems: list[str]) -> None:
    fields = {f.name: f for f in attrs.fields(cls) if not f.metadata.get("kproxy.internal")}
    props = schema["properties"]
    if schema.get("additionalProperties") is not False:
        problems.append(f"{path or 'config'}: unknown keys are not rejected")
    for name in sorted(set(props) - set(fields)):
        problems.append(f"{path}{name}: in the chart's schema, not a kproxy setting")
    for name, field in fields.items():
        if path == "" and name in CHART_OWNED | CHART_LEAVES_OUT:
            continue
        if name not in props:
            problems.append(f"{path}{name}: a kproxy setting the chart's schema does not allow")
            continue
        inner = _section_class(field.type)
        if inner is not None:
            _compare(inner, props[name], f"{path}{name}.", problems)
            continue
        declared = props[name].get("type")
        if declared is None:   # enums and oneOf: check the values allowed instead
            continue
        declared = {declared} if isinstance(declared, str) else set(declared)
        expected = _schema_type(field.type)
        if "number" in expected:
            expected |= {"integer"}
        if not declared <= expected:
            problems.append(f"{path}{name}: the schema says {sorted(declared)}, kproxy takes {sorted(expected)}")


def test_config_schema_follows_kproxy_settings() -> None:
    """values.schema.json's `config` names exactly kproxy's settings, less those the chart owns, with
    types kproxy accepts: a new kproxy setting shows up here until the chart's schema has it."""
    schema = yaml.safe_load((CHART_DIR / "values.schema.json").read_text())["properties"]["config"]
    owned_but_unknown = CHART_OWNED - {f.name for f in attrs.fields(ProxyConfig)}
    problems: list[str] = [f"{name}: the chart owns it but kproxy has no such setting" for name in sorted(owned_but_unknown)]
    _compare(ProxyConfig, schema, "", problems)
    assert problems == []


# -- the rendered kproxy.yaml is one kproxy accepts, where the pod would see it


def _secrets(tmp_path: Path) -> dict[str, dict[str, bytes]]:
    ca = trustme.CA()
    cert = ca.issue_cert("*.kafka.example.com", "kp-kproxy.kafka.svc", "bootstrap.kafka.example.com")
    tls = {"tls.crt": cert.cert_chain_pems[0].bytes(), "tls.key": cert.private_key_pem.bytes(),
           "ca.crt": ca.cert_pem.bytes()}
    users = tmp_path / "users.yaml"
    add_user(str(users), "alice", "alice-password")
    credentials = {"password": b"svc-password\n", "users.yaml": users.read_bytes()}
    return {"kproxy-tls": tls, "kafka-example-com-wildcard": tls, "kafka-cluster-ca-cert": {"ca.crt": ca.cert_pem.bytes()},
            "kafka-credentials": credentials}


# Stand-ins for the ConfigMaps ci/existing-configmaps-values.yaml names.
EXISTING = {
    "kproxy-site-config": {"kproxy.yaml": (
        'listen: "0.0.0.0:9092"\nrules: [rules]\nupstream: {bootstrap_servers: "kafka:9092"}\n'
        "exposure: {advertised_host: kp-kproxy.kafka.svc, broker_port_start: 9093, broker_port_count: 3, node_id_base: 0}\n"
        'admin: {listen: "0.0.0.0:9644"}\nlimits: {drain_timeout_s: 25}\n')},
    "kproxy-site-rules": {"site.yaml": "default: allow\nrules: []\n"},
}


def _kproxy_pod(objects: list[Obj], rendered: dict[str, str]) -> Obj:
    deployments = by_kind(objects, "Deployment")
    if deployments:
        spec: Obj = deployments[0]["spec"]["template"]["spec"]
        return spec
    return {**sidecar_block(rendered), "containers": []}


@pytest.mark.parametrize("ci_file", ["(defaults)", *CI_FILES])
def test_kproxy_accepts_the_rendered_config(ci_file: str, tmp_path: Path) -> None:
    values = {} if ci_file == "(defaults)" else ci_values()[ci_file]
    rendered = render_chart(values)
    objects = chart_objects(rendered)
    spec = _kproxy_pod(objects, rendered)
    laid = lay_out(spec, "kproxy", tmp_path, Image.from_dockerfile(), config_maps={**EXISTING, **config_maps(objects)},
                   secrets_data=_secrets(tmp_path))
    config = laid.argv[laid.argv.index("--config") + 1]
    checked = kproxy_check(Path(config), laid.env)
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.startswith("ok: ")
    replicas = by_kind(objects, "Deployment")[0]["spec"]["replicas"] if by_kind(objects, "Deployment") else 1
    # kproxy mentions the split when there are rules to split (the existing ConfigMap sets no quota_replicas).
    if replicas > 1 and "rules from" in checked.stdout and ci_file != "existing-configmaps-values.yaml":
        assert f"quotas split over {replicas} replicas" in checked.stdout


# -- the objects agree with each other


def _config_of(objects: list[Obj]) -> Obj:
    text = one(objects, "ConfigMap", "kp-kproxy-config")["data"]["kproxy.yaml"]
    config: Obj = yaml.safe_load(text)
    return config


@pytest.mark.parametrize("ci_file", ["gateway-values.yaml", "quotas-values.yaml", "tls-mtls-values.yaml"])
def test_gateway_ports_probes_and_grace_agree_with_kproxy_yaml(ci_file: str) -> None:
    objects = chart_objects(render_chart(ci_values()[ci_file]))
    config = _config_of(objects)
    deployment = one(objects, "Deployment")
    spec = deployment["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    exposure = config["exposure"]
    broker_ports = set(range(exposure["broker_port_start"], exposure["broker_port_start"] + exposure["broker_port_count"]))
    listen_port = int(config["listen"].rsplit(":", 1)[1])
    admin_port = int(config["admin"]["listen"].rsplit(":", 1)[1])
    assert set(ports.values()) == {listen_port, admin_port} | broker_ports
    # Broker N's port is named after its node id, and is where kproxy puts it.
    for name, port in ports.items():
        if name.startswith("broker-"):
            assert port == exposure["broker_port_start"] + int(name[len("broker-"):]) - exposure["node_id_base"]
    service = one(objects, "Service", "kp-kproxy")
    assert {(p["port"], ports[p["targetPort"]]) for p in service["spec"]["ports"]} == \
        {(p, p) for p in {listen_port} | broker_ports}
    for probe in ("livenessProbe", "readinessProbe"):
        assert ports[container[probe]["httpGet"]["port"]] == admin_port
    assert deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(admin_port)
    assert spec["terminationGracePeriodSeconds"] > config["limits"]["drain_timeout_s"]
    replicas = deployment["spec"]["replicas"]
    assert config.get("quota_replicas", 1) == replicas
    assert config["exposure"]["advertised_host"] == f"kp-kproxy.{NAMESPACE}.svc"
    # Selectors pick the gateway pods and nothing else the chart renders.
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    test_pod = one(objects, "Pod")
    for selector in [service["spec"]["selector"], one(objects, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"]]:
        assert all(pod_labels[k] == v for k, v in selector.items())
        assert not all(test_pod["metadata"]["labels"].get(k) == v for k, v in selector.items())


def test_helm_test_pod_checks_readyz_on_the_admin_service() -> None:
    objects = chart_objects(render_chart({}))
    pod = one(objects, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    admin = one(objects, "Service", "kp-kproxy-admin")
    url = pod["spec"]["containers"][0]["command"][-1]
    assert url == f"http://kp-kproxy-admin.{NAMESPACE}.svc:{admin['spec']['ports'][0]['port']}/readyz"


def test_a_config_change_rolls_the_pods_and_a_rules_change_does_not() -> None:
    def checksum(values: Obj) -> str:
        deployment = one(chart_objects(render_chart(values)), "Deployment")
        annotation: str = deployment["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
        return annotation
    base = ci_values()["gateway-values.yaml"]
    assert checksum(base) != checksum(merged(base, {"config": {"log_level": "DEBUG"}}))
    assert checksum(base) == checksum(merged(base, {"rules": {"files": {"extra.yaml": {"rules": []}}}}))


def test_sidecar_mode_renders_config_maps_and_a_native_sidecar_block() -> None:
    rendered = render_chart(ci_values()["sidecar-values.yaml"])
    objects = chart_objects(rendered)
    assert sorted(o["kind"] for o in objects) == ["ConfigMap", "ConfigMap"]
    block = sidecar_block(rendered)
    (sidecar,) = block["initContainers"]
    assert sidecar["restartPolicy"] == "Always"
    assert sidecar["startupProbe"]["httpGet"]["path"] == "/livez"
    assert {v["configMap"]["name"] for v in block["volumes"] if "configMap" in v} == set(config_maps(objects))
    config = _config_of(objects)
    assert (config["mode"], config["listen"]) == ("sidecar", "127.0.0.1:9092")
    assert "quota_replicas" not in config


def test_notes_tell_clients_where_to_connect() -> None:
    text = notes(render_chart(ci_values()["gateway-values.yaml"]))
    assert f"kp-kproxy.{NAMESPACE}.svc:9092" in text and "helm test kp" in text
    sni = notes(render_chart(ci_values()["sni-values.yaml"]))
    assert "bootstrap.kafka.example.com:9092 over TLS" in sni and "*.kafka.example.com" in sni


@pytest.mark.parametrize("bad, message", [
    ({"exposure": {"mode": "sni", "sni": {"domain": "k.example"}}}, "exposure.mode sni needs tls.enabled"),
    ({"exposure": {"mode": "sni"}, "tls": {"enabled": True, "secretName": "s"}}, "needs exposure.sni.domain"),
    ({"tls": {"enabled": True}}, "tls.enabled needs tls.secretName"),
    ({"tls": {"enabled": True, "secretName": "s", "principal": {"san_uri": True}}},
     "tls.principal maps client certificates: it needs tls.requireClientCert: true"),
])
def test_inconsistent_values_fail_with_the_reason(bad: Obj, message: str) -> None:
    with pytest.raises(HelmError, match=re.escape(message)):
        render_chart(bad)



def test_sasl_secrets_come_from_an_existing_secret_as_files() -> None:
    objects = chart_objects(render_chart(ci_values()["sasl-values.yaml"]))
    spec = one(objects, "Deployment")["spec"]["template"]["spec"]
    volume = next(v for v in spec["volumes"] if v["name"] == "kproxy-secret")
    assert volume["secret"] == {"secretName": "kafka-credentials", "defaultMode": 0o400}
    (container,) = spec["containers"]
    assert {"name": "kproxy-secret", "mountPath": "/etc/kproxy/secret", "readOnly": True} in container["volumeMounts"]
    config = _config_of(objects)
    assert config["upstream"]["sasl"]["password_file"].startswith("/etc/kproxy/secret/")
    assert "password" not in config["upstream"]["sasl"]
    assert not by_kind(objects, "Secret")          # the chart makes no Secret of its own


@pytest.mark.parametrize("sasl", [
    {"mechanism": "PLAIN", "username": "svc", "password": "hunter2"},
    {"mechanism": "OAUTHBEARER", "oauth": {"token_endpoint_url": "https://idp/t", "client_id": "k",
                                           "client_secret": "s3cret"}},
])
def test_a_secret_written_in_values_is_refused(sasl: Obj) -> None:
    with pytest.raises(HelmError, match=r"password|secret"):
        render_chart({"config": {"upstream": {"bootstrap_servers": ["kafka:9092"], "sasl": sasl}}})
    # A ${VAR} reference (filled from env: valueFrom a Secret) is fine.
    sasl_ref = {**sasl, "password": "${KAFKA_PASSWORD}"} if "password" in sasl else {
        **sasl, "oauth": {**sasl["oauth"], "client_secret": "${CLIENT_SECRET}"}}
    render_chart({"config": {"upstream": {"bootstrap_servers": ["kafka:9092"], "sasl": sasl_ref}}})


# -- monitoring: the alert rules and the Grafana dashboard, off by default

RULES_FILE = CHART_DIR.parents[1] / "deploy" / "monitoring" / "prometheus-rules.yaml"
DASHBOARD_FILE = CHART_DIR.parents[1] / "deploy" / "monitoring" / "grafana" / "kproxy.json"


def test_monitoring_objects_are_off_by_default() -> None:
    for mode in ("gateway", "sidecar"):
        objects = chart_objects(render_chart({"mode": mode}))
        assert by_kind(objects, "PrometheusRule") == []
        assert [o for o in by_kind(objects, "ConfigMap") if "grafana_dashboard" in o["metadata"]["labels"]] == []


def test_prometheus_rule_renders_the_alert_rules_file() -> None:
    values = ci_values()["gateway-values.yaml"]
    source = yaml.safe_load(RULES_FILE.read_text())
    rule = one(chart_objects(render_chart(values)), "PrometheusRule")
    assert rule["metadata"]["name"] == "kp-kproxy" and rule["metadata"]["labels"]["release"] == "prometheus"
    # With runbookBaseUrl, every runbook link points into the published page, the rest is the file's.
    base = values["metrics"]["prometheusRule"]["runbookBaseUrl"]
    links = [r["annotations"].pop("runbook_url") for g in rule["spec"]["groups"] for r in g["rules"]]
    expected = [r["annotations"].pop("runbook_url").replace("docs/operations.md", base)
                for g in source["groups"] for r in g["rules"]]
    assert links == expected and all(link.startswith(f"{base}#kproxy") for link in links)
    assert rule["spec"] == source
    plain = merged(values, {"metrics": {"prometheusRule": {"runbookBaseUrl": ""}}})
    assert one(chart_objects(render_chart(plain)), "PrometheusRule")["spec"] == yaml.safe_load(RULES_FILE.read_text())


def test_grafana_dashboard_config_map_carries_the_dashboard() -> None:
    import json

    values = ci_values()["gateway-values.yaml"]
    cm = one(chart_objects(render_chart(values)), "ConfigMap", "kp-kproxy-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "Kafka"}
    assert json.loads(cm["data"]["kproxy.json"]) == json.loads(DASHBOARD_FILE.read_text())
    # A ConfigMap holds at most 1 MiB.
    assert len(cm["data"]["kproxy.json"]) < 512 * 1024
    elsewhere = merged(values, {"metrics": {"grafanaDashboard": {"namespace": "monitoring"}}})
    assert one(chart_objects(render_chart(elsewhere)), "ConfigMap", "kp-kproxy-dashboard")["metadata"]["namespace"] == \
        "monitoring"


def test_the_down_alert_matches_the_jobs_the_monitors_scrape_under() -> None:
    # The Prometheus Operator names a ServiceMonitor's job after the Service, a PodMonitor's after itself.
    rules = yaml.safe_load(RULES_FILE.read_text())
    down = next(r for g in rules["groups"] for r in g["rules"] if r.get("alert") == "KproxyDown")
    job = re.fullmatch(r'up\{job=~"(.*)"\} == 0', down["expr"].strip())
    assert job is not None
    objects = chart_objects(render_chart(ci_values()["gateway-values.yaml"]))
    selector = one(objects, "ServiceMonitor")["spec"]["selector"]["matchLabels"]
    (service,) = [s for s in by_kind(objects, "Service")
                  if all(s["metadata"]["labels"].get(k) == v for k, v in selector.items())]
    monitoring = CHART_DIR.parents[1] / "deploy" / "monitoring"
    podmonitor = yaml.safe_load((monitoring / "sidecar" / "podmonitor.yaml").read_text())
    for name in (service["metadata"]["name"], f"{NAMESPACE}/{podmonitor['metadata']['name']}", "kproxy-admin"):
        assert re.fullmatch(job.group(1), name), name

"""The manifests agree with the program: the gateway and the sidecar, from deploy/ and from the chart,
each run with exactly its rendered command, environment and ConfigMaps, in a private network
namespace where the Service's ports and names are the real ones.

What the test changes, and only that: the Kafka cluster the config names becomes a local tansu
broker (its address and, for the gateway, its node id 111 as the lowest node id), and mount paths
move under a temporary root. A real client (kafka-python) then bootstraps through the Service name,
the probes answer as the kubelet expects, a ConfigMap update of the rules (the kubelet's ``..data``
swap) takes effect without a reconnect, and SIGTERM ends kproxy within the grace period.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.isolated import run_isolated
from tests.deploy.pod import PodFacts, lay_out
from tests.deploy.render import (
    DEPLOY_DIR,
    NAMESPACE,
    Image,
    Obj,
    build_kustomization,
    chart_objects,
    ci_values,
    config_maps,
    merged,
    notes,
    one,
    render_chart,
    sidecar_block,
)

pytestmark = pytest.mark.e2e

BROKER_PORT = 19092     # tansu inside the private namespace
TANSU_NODE_ID = 111
POD = PodFacts(name="kproxy-5d8c7-x2x9q", namespace=NAMESPACE, ip="127.0.0.2")
BLOCK_RULE = {"name": "blocked-topics", "match": {"api": "produce", "topic": "blocked-*"}, "action": "deny"}


def point_at_test_cluster(kproxy_yaml: str, node_id_base: bool) -> str:
    """kproxy.yaml with the cluster's bootstrap servers (and lowest node id) of the local broker;
    every other line as written."""
    text, n = re.subn(r"(?m)^(\s*bootstrap_servers:).*$", rf'\1 ["127.0.0.1:{BROKER_PORT}"]', kproxy_yaml)
    assert n == 1, kproxy_yaml
    if node_id_base:
        text, n = re.subn(r"(?m)^(\s*node_id_base:).*$", rf"\g<1> {TANSU_NODE_ID}", text)
        assert n == 1, kproxy_yaml
    return text


def blocking_rules(files: dict[str, str]) -> dict[str, str]:
    """The rule files with a first rule that refuses producing to blocked-* topics."""
    name, text = sorted(files.items())[0]
    doc = yaml.safe_load(text)
    doc["rules"] = [BLOCK_RULE, *(doc.get("rules") or [])]
    return {**files, name: yaml.safe_dump(doc, sort_keys=False)}


def probes_of(container: Obj, laid: Any) -> list[dict[str, Any]]:
    out = []
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        if kind in container:
            get = container[kind]["httpGet"]
            assert get.get("scheme", "HTTP") == "HTTP" and "host" not in get, container[kind]
            out.append({"kind": kind, "path": get["path"], "port": laid.port(get["port"])})
    return out


def run_pod(tmp_path: Path, name: str, spec: Obj, cms: dict[str, dict[str, str]], *, bootstrap: str,
            hosts: dict[str, str], test_pod: Obj | None = None) -> tuple[dict[str, Any], Any]:
    image = Image.from_dockerfile()
    laid = lay_out(spec, "kproxy", tmp_path / "kproxy", image, config_maps=cms, pod=POD)
    container = laid.container
    probes = probes_of(container, laid)
    readiness = next(p for p in probes if p["kind"] == "readinessProbe")
    rules_volume = next(m["name"] for m in container["volumeMounts"] if m["mountPath"] == "/etc/kproxy/rules")
    rules_cm = next(v["configMap"]["name"] for v in spec["volumes"] if v["name"] == rules_volume)
    plan = {
        "name": name, "argv": laid.argv, "env": laid.env, "cwd": str(laid.root), "log": str(tmp_path / "kproxy.log"),
        "pod_ip": POD.ip, "admin_port": readiness["port"], "probes": probes, "hosts": hosts,
        "broker_port": BROKER_PORT, "bootstrap": bootstrap, "grace_s": spec["terminationGracePeriodSeconds"],
        "rules_dir": str(laid.mounts[rules_volume]), "new_rules": blocking_rules(cms[rules_cm]),
    }
    if test_pod is not None:
        test = lay_out(test_pod["spec"], test_pod["spec"]["containers"][0]["name"], tmp_path / "test-pod", image,
                       config_maps=cms, pod=POD)
        plan["helm_test_argv"], plan["helm_test_env"] = test.argv, test.env
    seen = run_isolated("tests.deploy.podrun", plan, timeout=150)
    assert "error" not in seen, f"{seen['error']}\nkproxy's log:\n{seen['kproxy_log']}"
    return seen, plan


def check_pod(seen: dict[str, Any], plan: dict[str, Any], *, broker_host: str, broker_ports: set[int]) -> None:
    log = f"\nkproxy's log:\n{seen['kproxy_log']}"
    # Before the broker exists: alive, not ready (so no Service traffic yet).
    assert seen["before_broker"]["/livez"] == 200, log
    assert seen["before_broker"]["/readyz"] == 503, log
    # Every probe the manifest declares answers 200 once the broker is there.
    assert {p["path"] for p in plan["probes"]} >= {"/livez", "/readyz"}
    assert all(status == 200 for status, _ in seen["probes"].values()), (seen["probes"], log)
    # The client learns the brokers on the host and ports the manifests declare, and works through them.
    assert seen["endpoints"] == [[TANSU_NODE_ID, broker_host, port] for _, _, port in seen["endpoints"]], log
    assert {port for _, _, port in seen["endpoints"]} <= broker_ports, (seen["endpoints"], broker_ports)
    assert seen["records_read_back"] == 30, log
    # The rules ConfigMap update took effect on the client's open connection.
    reload = seen["reload"]
    assert reload["before"] == 0, log
    assert reload["after"] == "TopicAuthorizationFailedError", log
    assert isinstance(reload["other_topic_offset"], int), log
    assert reload["connections_opened_during_reload"] == 0, log
    assert reload["rules"]["generation"] == 2, reload["rules"]
    # SIGTERM: a clean exit well within terminationGracePeriodSeconds.
    assert seen["exit_status"] == 0, log
    assert seen["stop_s"] < plan["grace_s"], log


def service_ports(service: Obj, laid_ports: dict[str, int]) -> set[int]:
    """The Service's ports, checked to reach the same container port number (kproxy advertises its own
    port numbers, so a Service that renumbered them would send clients to the wrong place)."""
    ports = set()
    for port in service["spec"]["ports"]:
        target = port["targetPort"]
        assert laid_ports[target] == port["port"], port
        ports.add(port["port"])
    return ports


def container_ports(container: Obj) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def deploy_pod(name: str, *, node_id_base: bool) -> tuple[list[Obj], dict[str, dict[str, str]], Obj]:
    """deploy/NAME built, its kproxy.yaml pointed at the test cluster: objects, ConfigMaps, pod spec."""
    objects = build_kustomization(DEPLOY_DIR / name)
    cms = config_maps(objects)
    (config,) = [data for data in cms.values() if "kproxy.yaml" in data]
    config["kproxy.yaml"] = point_at_test_cluster(config["kproxy.yaml"], node_id_base=node_id_base)
    return objects, cms, one(objects, "Deployment")["spec"]["template"]["spec"]


def test_deploy_gateway_runs_as_declared(tmp_path: Path) -> None:
    objects, cms, spec = deploy_pod("gateway", node_id_base=True)
    service = one(objects, "Service", "kproxy")
    svc_host = f"kproxy.{NAMESPACE}.svc"
    ports = service_ports(service, container_ports(spec["containers"][0]))
    seen, plan = run_pod(tmp_path, "deploy-gateway", spec, cms, bootstrap=f"{svc_host}:9092",
                         hosts={svc_host: POD.ip, f"kproxy-admin.{NAMESPACE}.svc": POD.ip})
    check_pod(seen, plan, broker_host=svc_host, broker_ports=ports - {9092})


def test_chart_gateway_runs_as_declared(tmp_path: Path) -> None:
    values = merged(ci_values()["gateway-values.yaml"], {
        "config": {"upstream": {"bootstrap_servers": [f"127.0.0.1:{BROKER_PORT}"]}},
        "exposure": {"nodeIdBase": TANSU_NODE_ID}})
    objects = chart_objects(render_chart(values))
    spec = one(objects, "Deployment")["spec"]["template"]["spec"]
    service = one(objects, "Service", "kp-kproxy")
    svc_host = f"kp-kproxy.{NAMESPACE}.svc"
    ports = service_ports(service, container_ports(spec["containers"][0]))
    seen, plan = run_pod(tmp_path, "chart-gateway", spec, config_maps(objects), bootstrap=f"{svc_host}:9092",
                         hosts={svc_host: POD.ip, f"kp-kproxy-admin.{NAMESPACE}.svc": POD.ip},
                         test_pod=one(objects, "Pod"))
    check_pod(seen, plan, broker_host=svc_host, broker_ports=ports - {9092})
    # `helm test`: its pod fails while kproxy is not ready and passes once it is.
    assert seen["helm_test_before_broker"] != 0
    assert seen["helm_test"]["status"] == 0, seen["helm_test"]["output"]


def test_deploy_sidecar_runs_as_declared(tmp_path: Path) -> None:
    _, cms, spec = deploy_pod("sidecar", node_id_base=False)
    app = next(c for c in spec["containers"] if c["name"] == "app")
    bootstrap = next(e["value"] for e in app["env"] if e["name"] == "KAFKA_BOOTSTRAP_SERVERS")
    assert bootstrap == "localhost:9092"
    seen, plan = run_pod(tmp_path, "deploy-sidecar", spec, cms, bootstrap=bootstrap, hosts={})
    check_pod(seen, plan, broker_host="localhost", broker_ports=set(range(9093, 9093 + 16)))


def test_chart_sidecar_block_runs_as_declared(tmp_path: Path) -> None:
    values = merged(ci_values()["sidecar-values.yaml"],
                        {"config": {"upstream": {"bootstrap_servers": [f"127.0.0.1:{BROKER_PORT}"]}}})
    rendered = render_chart(values)
    block = sidecar_block(rendered)
    text = notes(rendered)
    bootstrap = re.search(r"Your application connects to (\S+)\.", text)
    grace = re.search(r"shutdown time plus\s+(\d+) seconds", text)
    assert bootstrap and grace, text
    spec = {**block, "containers": [], "terminationGracePeriodSeconds": int(grace.group(1))}
    seen, plan = run_pod(tmp_path, "chart-sidecar", spec, config_maps(chart_objects(rendered)),
                         bootstrap=bootstrap.group(1), hosts={})
    check_pod(seen, plan, broker_host="localhost", broker_ports=set(range(9093, 9093 + 8)))

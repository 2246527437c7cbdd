"""Checks shared by the chart and manifest tests: Kubernetes' own schemas (kubernetes-validate, strict),
the Prometheus Operator objects it has no schema for, and what every kproxy pod must carry.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import kubernetes_validate

from tests.deploy.render import Obj, by_kind, pod_specs

# kubernetes-validate bundles only the core API schemas; these get structural checks instead.
PROMETHEUS_OPERATOR = "monitoring.coreos.com/v1"


def validate_strict(obj: Obj, kube_version: str) -> None:
    """kubernetes-validate in strict mode (unknown fields are errors); a clear AssertionError otherwise."""
    try:
        kubernetes_validate.validate(obj, kube_version, strict=True)
    except kubernetes_validate.ValidationError as e:
        path = ".".join(str(p) for p in e.path)
        raise AssertionError(f"{obj['kind']}/{obj['metadata']['name']} against {kube_version}: {path}: {e.message}") from None


def validate_objects(objects: list[Obj], kube_version: str) -> None:
    for obj in objects:
        if obj["apiVersion"] == PROMETHEUS_OPERATOR:
            check_monitor(obj, objects)
        else:
            validate_strict(obj, kube_version)


def _labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def check_monitor(monitor: Obj, objects: list[Obj]) -> None:
    """A ServiceMonitor selects a Service with the port it scrapes; a PodMonitor selects pods whose
    containers have that port. Both scrape /metrics. A PrometheusRule has the CRD's shape."""
    spec = monitor["spec"]
    if monitor["kind"] == "PrometheusRule":
        check_rule_groups(spec)
        return
    selector = spec["selector"]["matchLabels"]
    if monitor["kind"] == "ServiceMonitor":
        services = [s for s in by_kind(objects, "Service") if _labels_match(selector, s["metadata"].get("labels", {}))]
        assert services, f"ServiceMonitor {monitor['metadata']['name']} selects no Service"
        for endpoint in spec["endpoints"]:
            assert endpoint["path"] == "/metrics"
            for service in services:
                assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}, (endpoint, service)
    elif monitor["kind"] == "PodMonitor":
        templates = [o["spec"]["template"] for o in objects if o["kind"] == "Deployment"
                     and _labels_match(selector, o["spec"]["template"]["metadata"].get("labels", {}))]
        assert templates, f"PodMonitor {monitor['metadata']['name']} selects no pods"
        for endpoint in spec["podMetricsEndpoints"]:
            assert endpoint["path"] == "/metrics"
            for template in templates:
                names = {p["name"] for c in [*template["spec"].get("initContainers", []), *template["spec"]["containers"]]
                         for p in c.get("ports", [])}
                assert endpoint["port"] in names, (endpoint, names)
    else:
        raise AssertionError(f"no check for {monitor['kind']}")


def check_rule_groups(spec: Obj) -> None:
    """The shape the Prometheus Operator's PrometheusRule CRD requires (promtool checks the rules themselves,
    in tests/monitoring): named groups of rules, each an alert or a record with an expression."""
    assert set(spec) == {"groups"} and spec["groups"], spec
    names = [g["name"] for g in spec["groups"]]
    assert len(names) == len(set(names)), names
    for group in spec["groups"]:
        assert set(group) <= {"name", "interval", "rules", "limit", "partial_response_strategy"}, group
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "record", "expr", "for", "keep_firing_for", "labels", "annotations"}, rule
            assert ("alert" in rule) != ("record" in rule) and isinstance(rule["expr"], str | int), rule
            for key in ("labels", "annotations"):
                assert all(isinstance(v, str) for v in rule.get(key, {}).values()), rule


def kproxy_containers(objects: list[Obj]) -> list[tuple[Obj, Obj]]:
    """(pod spec, kproxy container) of every workload that runs kproxy."""
    out = []
    for obj in objects:
        for spec in pod_specs(obj):
            for container in [*spec.get("initContainers", []), *spec.get("containers", [])]:
                if container["name"] == "kproxy":
                    out.append((spec, container))
    return out


def check_hardened(spec: Obj, container: Obj) -> None:
    """What the issue asks of every kproxy container: non-root, read-only root, no privilege
    escalation, no capabilities, the runtime's seccomp profile, resources, probes on the admin port."""
    sc = container["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    seccomp = sc.get("seccompProfile") or spec.get("securityContext", {}).get("seccompProfile")
    assert seccomp == {"type": "RuntimeDefault"}
    assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
    assert container["resources"]["limits"]["memory"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert spec.get("automountServiceAccountToken") is False


def kproxy_check(config: Path, env: dict[str, str] | None = None, *extra: str) -> subprocess.CompletedProcess[str]:
    """`kproxy check` run as the user would run it."""
    kproxy = Path(sys.executable).parent / "kproxy"
    return subprocess.run([str(kproxy), "check", str(config), *extra], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=60)

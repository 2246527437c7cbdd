"""deploy/ and the Dockerfile, offline: every file under deploy/ is something a check knows (a
kustomization that builds, a Kubernetes object that validates strictly against 1.29 and the newest
version, a kproxy.yaml that `kproxy check` accepts, a rule file), yamllint passes over deploy/ and the
chart (sources and renders), and what the issue asks of the pods holds.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy.render import (
    DEPLOY_DIR,
    DOCKERFILE,
    KUBE_VERSIONS,
    REPO,
    Image,
    build_kustomization,
    by_kind,
    chart_objects,
    ci_values,
    one,
    render_chart,
)
from tests.deploy.validation import check_hardened, kproxy_check, kproxy_containers, validate_objects

KUSTOMIZATIONS = sorted(p.parent for p in DEPLOY_DIR.rglob("kustomization.yaml"))
# Not Kubernetes objects: a Prometheus rule file and a Grafana dashboard, which tests/monitoring checks
# (promtool, the dashboard library's model, the metric names kproxy exports).
MONITORING_FILES = {Path("monitoring/prometheus-rules.yaml"), Path("monitoring/grafana/kproxy.json")}
# Values kproxy.yaml files under deploy/ take from the pod's environment.
POD_ENV = {"KPROXY_ADVERTISED_HOST": "kproxy.kafka.svc", "KAFKA_BOOTSTRAP_SERVERS": "kafka:9092"}


def test_every_file_under_deploy_is_checked_by_something() -> None:
    unchecked = []
    for path in sorted(DEPLOY_DIR.rglob("*")):
        if path.is_dir():
            continue
        if path.name == "kustomization.yaml" or path.name == "kproxy.yaml" or path.parent.name == "rules":
            continue
        if path.relative_to(DEPLOY_DIR) in MONITORING_FILES:
            continue
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        if not docs or not all("apiVersion" in d and "kind" in d for d in docs):
            unchecked.append(str(path.relative_to(REPO)))
    assert unchecked == []


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(DEPLOY_DIR)))
def test_kustomization_builds_and_validates(directory: Path, kube_version: str) -> None:
    objects = build_kustomization(directory)
    validate_objects(objects, kube_version)
    for spec, container in kproxy_containers(objects):
        check_hardened(spec, container)
        assert spec["securityContext"]["runAsNonRoot"] is True


def test_every_object_file_is_in_a_kustomization() -> None:
    # So the builds above validate every object under deploy/.
    listed = {(directory / r).resolve() for directory in KUSTOMIZATIONS
              for r in yaml.safe_load((directory / "kustomization.yaml").read_text()).get("resources", [])}
    files = {p.resolve() for p in DEPLOY_DIR.rglob("*.yaml") if p.name not in ("kustomization.yaml", "kproxy.yaml")
             and p.parent.name != "rules" and p.parent.name != "image" and p.relative_to(DEPLOY_DIR) not in MONITORING_FILES}
    assert files and files <= listed


@pytest.mark.parametrize("config", sorted(DEPLOY_DIR.rglob("kproxy.yaml")), ids=lambda p: str(p.relative_to(DEPLOY_DIR)))
def test_kproxy_accepts_each_kproxy_yaml(config: Path) -> None:
    checked = kproxy_check(config, POD_ENV)
    assert checked.returncode == 0, checked.stderr


def test_the_rules_files_load() -> None:
    files = sorted(DEPLOY_DIR.rglob("rules/*.yaml"))
    assert files
    kproxy = Path(sys.executable).parent / "kproxy"
    checked = subprocess.run([str(kproxy), "check", *(f"--rules={f}" for f in files)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr


def test_yamllint_passes_on_sources_and_renders(tmp_path: Path) -> None:
    rendered = tmp_path / "rendered"
    rendered.mkdir()
    for name, values in {"defaults": {}, **ci_values()}.items():
        objects = chart_objects(render_chart(values))
        # A dashboard ConfigMap holds JSON whose PromQL lines are long; its YAML is checked all the same.
        dashboards = [o for o in objects if "grafana_dashboard" in o["metadata"].get("labels", {})]
        objects = [o for o in objects if o not in dashboards]
        (rendered / f"{name}.yaml").write_text(yaml.safe_dump_all(objects, sort_keys=False))
        if dashboards:
            (rendered / f"{name}-dashboards.yaml").write_text(
                "# yamllint disable rule:line-length\n" + yaml.safe_dump_all(dashboards, sort_keys=False))
    yamllint = Path(sys.executable).parent / "yamllint"
    result = subprocess.run([str(yamllint), "-c", str(REPO / ".yamllint.yaml"), "-f", "parsable", "deploy", "helm/kproxy",
                             str(rendered)], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr


def test_gateway_declares_one_port_per_broker_as_kproxy_yaml_does() -> None:
    objects = build_kustomization(DEPLOY_DIR / "gateway")
    config = yaml.safe_load(next(o for o in by_kind(objects, "ConfigMap")
                                 if "kproxy.yaml" in o["data"])["data"]["kproxy.yaml"])
    exposure = config["exposure"]
    brokers = set(range(exposure["broker_port_start"], exposure["broker_port_start"] + exposure["broker_port_count"]))
    deployment = one(objects, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    service = one(objects, "Service", "kproxy")
    assert {p["port"] for p in service["spec"]["ports"]} == brokers | {9092}
    assert all(ports[p["targetPort"]] == p["port"] for p in service["spec"]["ports"])
    admin = int(config["admin"]["listen"].rsplit(":", 1)[1])
    assert ports["admin"] == admin
    template = deployment["spec"]["template"]
    assert template["metadata"]["annotations"]["prometheus.io/port"] == str(admin)
    assert template["spec"]["terminationGracePeriodSeconds"] > config["limits"]["drain_timeout_s"]
    assert deployment["spec"]["replicas"] == config.get("quota_replicas", 1)
    env = {e["name"]: e for e in container["env"]}
    assert env["KPROXY_ADVERTISED_HOST"]["value"] == "kproxy.$(POD_NAMESPACE).svc"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" in env
    one(objects, "PodDisruptionBudget")


def test_sidecar_is_a_native_sidecar_the_app_reaches_on_localhost() -> None:
    objects = build_kustomization(DEPLOY_DIR / "sidecar")
    spec = one(objects, "Deployment")["spec"]["template"]["spec"]
    (kproxy,) = spec["initContainers"]
    assert kproxy["name"] == "kproxy" and kproxy["restartPolicy"] == "Always"
    assert kproxy["startupProbe"]["httpGet"]["path"] == "/livez"
    assert "kproxy" not in {c["name"] for c in spec["containers"]}
    config = yaml.safe_load(next(o for o in by_kind(objects, "ConfigMap") if "kproxy.yaml" in o["data"])["data"]["kproxy.yaml"])
    assert config["mode"] == "sidecar" and config["listen"].startswith("127.0.0.1:")
    drain = config["limits"]["drain_timeout_s"]
    assert spec["terminationGracePeriodSeconds"] > drain


# -- the image


def test_dockerfile_builds_from_the_repository_as_a_non_root_kproxy() -> None:
    text = DOCKERFILE.read_text()
    image = Image.from_dockerfile()
    assert image.entrypoint == ["kproxy"]
    config = image.cmd[image.cmd.index("--config") + 1]
    assert image.cmd[0] == "run" and config in {destination for _, destination in image.copies}
    for source, _ in image.copies:
        assert source.exists(), source
    assert not any(line.lstrip().upper().startswith("HEALTHCHECK") for line in text.splitlines())
    user = [line.split()[1] for line in text.splitlines() if line.startswith("USER ")]
    assert user and user[-1].split(":")[0].isdigit() and user[-1].split(":")[0] != "0"
    ignored = (REPO / ".dockerignore").read_text().split()
    assert not any(source.relative_to(REPO).parts[0] in ignored for source, _ in image.copies)


def test_image_default_config_reads_the_environment() -> None:
    image_config = REPO / "deploy" / "image" / "kproxy.yaml"
    assert kproxy_check(image_config, {"KAFKA_BOOTSTRAP_SERVERS": "kafka-0:9092,kafka-1:9092"}).returncode == 0
    missing = kproxy_check(image_config)
    assert missing.returncode == 2
    assert "KAFKA_BOOTSTRAP_SERVERS" in missing.stderr

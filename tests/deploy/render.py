"""What the deployment files say, as Kubernetes objects: the Helm chart rendered by Helm itself
(helm-python-sdk embeds the Helm v4 library), the kustomizations built by a small subset of kustomize,
and the image's entrypoint and files read from the Dockerfile.

The kustomize subset knows exactly the fields deploy/ uses (resources, configMapGenerator, labels) and
refuses any other, so a kustomization that needs the real tool cannot pass here by accident. Nothing
here runs kproxy.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from helm_python import _native
from helm_python.chart import Chart
from kubernetes_validate.utils import latest_version

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "helm" / "kproxy"
DEPLOY_DIR = REPO / "deploy"
DOCKERFILE = REPO / "Dockerfile"
# The oldest Kubernetes with native sidecars on by default, and the newest the validator knows.
KUBE_VERSIONS = ("1.29.0", latest_version())
RELEASE = "kp"
NAMESPACE = "kafka"

Obj = dict[str, Any]


# -- Helm


def ci_values() -> dict[str, Obj]:
    """Each helm/kproxy/ci/*-values.yaml by file name."""
    return {p.name: yaml.safe_load(p.read_text()) or {} for p in sorted((CHART_DIR / "ci").glob("*-values.yaml"))}


def merged(base: Obj, over: Obj) -> Obj:
    """Values ``over`` laid on ``base`` the way Helm coalesces ``-f`` files: mappings merge, the rest replaces."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def render_chart(values: Obj | None = None, kube_version: str = KUBE_VERSIONS[0], *,
                 api_versions: tuple[str, ...] = ()) -> dict[str, str]:
    """Template path -> rendered text, as `helm template RELEASE helm/kproxy -n kafka` gives them."""
    options = {"name": RELEASE, "namespace": NAMESPACE, "kube_version": f"v{kube_version}",
               "is_install": True, "api_versions": list(api_versions)}
    with Chart.load(CHART_DIR) as chart:
        # The Python wrapper's render() does not pass kube_version; the native call takes it.
        rendered = _native.call_string("helm_render", chart._raw(), json.dumps(values or {}), json.dumps(options))
    out: dict[str, str] = json.loads(rendered)
    return out


def chart_objects(rendered: dict[str, str]) -> list[Obj]:
    """Every Kubernetes object of a render (NOTES.txt is text, not objects)."""
    return [obj for path, text in sorted(rendered.items()) if not path.endswith("NOTES.txt")
            for obj in yaml.safe_load_all(text) if obj]


def notes(rendered: dict[str, str]) -> str:
    return next(text for path, text in rendered.items() if path.endswith("/NOTES.txt"))


def sidecar_block(rendered: dict[str, str]) -> Obj:
    """The initContainers and volumes NOTES.txt tells a sidecar user to paste into a pod spec."""
    text = notes(rendered)
    begin, end = "# --- kproxy sidecar: begin\n", "# --- kproxy sidecar: end"
    block: Obj = yaml.safe_load(text[text.index(begin) + len(begin):text.index(end)])
    return block


# -- kustomize (the subset deploy/ uses)

_KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "configMapGenerator", "labels"}
_GENERATOR_FIELDS = {"name", "files", "options"}


def build_kustomization(directory: Path) -> list[Obj]:
    """`kustomize build DIR` for the fields deploy/ uses; an unknown field is an error."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(k) - _KUSTOMIZATION_FIELDS
    if unknown:
        raise ValueError(f"{directory}/kustomization.yaml: fields this subset does not implement: {sorted(unknown)}")
    if (k.get("apiVersion"), k.get("kind")) != ("kustomize.config.k8s.io/v1beta1", "Kustomization"):
        raise ValueError(f"{directory}/kustomization.yaml: not a kustomize.config.k8s.io/v1beta1 Kustomization")
    objects: list[Obj] = []
    for resource in k.get("resources", []):
        path = (directory / resource).resolve()
        if path.is_dir():
            objects += build_kustomization(path)
        elif path.is_file():
            objects += [o for o in yaml.safe_load_all(path.read_text()) if o]
        else:
            raise ValueError(f"{directory}/kustomization.yaml: resource {resource} does not exist")
    renames = {}
    for generator in k.get("configMapGenerator", []):
        config_map, old_name = _generate_config_map(directory, generator)
        renames[old_name] = config_map["metadata"]["name"]
        objects.append(config_map)
    for obj in objects:
        _rename_config_map_refs(obj, renames)
        for entry in k.get("labels", []):
            if set(entry) - {"pairs"}:
                raise ValueError(f"{directory}: labels support only `pairs` here")
            obj.setdefault("metadata", {}).setdefault("labels", {}).update(entry["pairs"])
    return objects


def _generate_config_map(directory: Path, generator: Obj) -> tuple[Obj, str]:
    unknown = set(generator) - _GENERATOR_FIELDS
    options = generator.get("options", {})
    if unknown or set(options) - {"disableNameSuffixHash"}:
        raise ValueError(f"{directory}: configMapGenerator fields this subset does not implement: {generator}")
    data = {}
    for file in generator["files"]:
        if "=" in file:
            raise ValueError(f"{directory}: KEY=FILE entries are not implemented here")
        data[Path(file).name] = (directory / file).read_text()
    name = generator["name"]
    if not options.get("disableNameSuffixHash"):
        # kustomize appends a hash of the content, so a change makes a new ConfigMap and rolls the pods.
        digest = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:10]
        name = f"{name}-{digest}"
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": data}, generator["name"]


def _rename_config_map_refs(obj: Obj, renames: dict[str, str]) -> None:
    for spec in pod_specs(obj):
        for volume in spec.get("volumes", []):
            if "configMap" in volume:
                name = volume["configMap"]["name"]
                volume["configMap"]["name"] = renames.get(name, name)


def pod_specs(obj: Obj) -> Iterator[Obj]:
    """The pod spec of a Pod, or of a workload's pod template."""
    if obj.get("kind") == "Pod":
        yield obj["spec"]
    elif obj.get("kind") in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        yield obj["spec"]["template"]["spec"]


def by_kind(objects: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objects if o.get("kind") == kind]


def one(objects: list[Obj], kind: str, name: str | None = None) -> Obj:
    found = [o for o in by_kind(objects, kind) if name is None or o["metadata"]["name"] == name]
    if len(found) != 1:
        raise LookupError(f"expected one {kind}{' ' + name if name else ''}, found {len(found)}")
    return found[0]


def config_maps(objects: list[Obj]) -> dict[str, dict[str, str]]:
    return {o["metadata"]["name"]: dict(o.get("data", {})) for o in by_kind(objects, "ConfigMap")}


def with_config_map_text(objects: list[Obj], name: str, key: str, text: str) -> list[Obj]:
    """A copy of ``objects`` with one ConfigMap file replaced (as `kubectl edit` would)."""
    out = copy.deepcopy(objects)
    one(out, "ConfigMap", name)["data"][key] = text
    return out


# -- the image


class Image:
    """What the Dockerfile gives a container: ENTRYPOINT, CMD and the files COPY puts in place."""

    def __init__(self, entrypoint: list[str], cmd: list[str], copies: list[tuple[Path, str]]) -> None:
        self.entrypoint = entrypoint
        self.cmd = cmd
        self.copies = copies    # (source in the repository, destination in the image)

    @classmethod
    def from_dockerfile(cls, path: Path = DOCKERFILE) -> Image:
        text = re.sub(r"\\\n", " ", path.read_text())
        stages = text.split("\nFROM ")
        final = stages[-1]     # the image is its last stage
        entrypoint: list[str] = []
        cmd: list[str] = []
        copies = []
        for line in final.splitlines():
            word, _, rest = line.strip().partition(" ")
            if word == "ENTRYPOINT":
                entrypoint = json.loads(rest)
            elif word == "CMD":
                cmd = json.loads(rest)
            elif word == "COPY" and not rest.startswith("--from"):
                *sources, destination = shlex.split(rest)
                copies += [(path.parent / source, destination) for source in sources]
        return cls(entrypoint, cmd, copies)

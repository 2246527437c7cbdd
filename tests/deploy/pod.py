"""A rendered pod's container laid out on this machine as the kubelet would lay it out, under a
temporary root: the image's files, ConfigMap and Secret volumes (the ``..data`` symlink layout, or one
file for a subPath), emptyDirs, the command line and the environment.

Kubernetes' rules are followed where they matter to kproxy: ``command``/``args`` replace the image's
ENTRYPOINT/CMD, ``$(VAR)`` in values and arguments names an earlier variable, fieldRef values come from
the pod, and a ConfigMap update swaps the ``..data`` symlink to a new timestamped directory. Every
mount path is moved under the root, in the arguments, the environment and the mounted files alike.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.deploy.render import Image, Obj

# `kproxy` and `python` in a container are this virtual environment's.
VENV_BIN = Path(sys.executable).parent


@dataclass
class PodFacts:
    """What the kubelet knows of the pod and fills into fieldRef variables."""

    name: str = "kproxy-7d9f8-abcde"
    namespace: str = "kafka"
    ip: str = "127.0.0.2"

    def field(self, path: str) -> str:
        values = {"metadata.name": self.name, "metadata.namespace": self.namespace, "status.podIP": self.ip}
        if path not in values:
            raise ValueError(f"fieldRef {path} is not known to this test's kubelet")
        return values[path]


@dataclass
class LaidOutContainer:
    """A container ready to run: ``argv`` and ``env`` as the container would get them, with paths under ``root``."""

    container: Obj
    root: Path
    argv: list[str]
    env: dict[str, str]
    mounts: dict[str, Path] = field(default_factory=dict)    # volume name -> where it is under root

    def port(self, name_or_number: int | str) -> int:
        """A container port by name, or a number as it is."""
        if isinstance(name_or_number, int):
            return name_or_number
        for port in self.container.get("ports", []):
            if port.get("name") == name_or_number:
                return int(port["containerPort"])
        raise LookupError(f"container {self.container['name']} has no port named {name_or_number}")


def find_container(spec: Obj, name: str) -> Obj:
    for container in [*spec.get("initContainers", []), *spec.get("containers", [])]:
        if container["name"] == name:
            return container
    raise LookupError(f"no container {name} in the pod spec")


def expand_kubernetes_vars(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: a defined variable is replaced, $$ escapes, anything else stays."""
    def replace(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", replace, text)


def lay_out(spec: Obj, container_name: str, root: Path, image: Image, *,
            config_maps: dict[str, dict[str, str]], secrets_data: dict[str, dict[str, bytes]] | None = None,
            pod: PodFacts | None = None) -> LaidOutContainer:
    """Lay out container ``container_name`` of pod ``spec`` under ``root`` and return how to run it."""
    pod = pod or PodFacts()
    container = find_container(spec, container_name)
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    mounts = container.get("volumeMounts", [])

    # One pass over all mount paths, longest first (/etc/kproxy/rules before /etc/kproxy), so a path
    # already moved under the root (itself perhaps under /tmp) is never moved again.
    paths = sorted((m["mountPath"] for m in mounts), key=len, reverse=True)
    mount_path = re.compile(rf"(?<![\w./-])({'|'.join(map(re.escape, paths))})(?=/|\b|$)") if paths else None

    def under_root(text: str) -> str:
        return mount_path.sub(lambda m: str(root) + m.group(1), text) if mount_path else text

    for source, destination in image.copies:
        target = root / destination.lstrip("/")
        if source.is_dir():
            shutil.copytree(source, target, dirs_exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)

    laid = LaidOutContainer(container, root, [], {})
    for mount in mounts:
        volume = volumes[mount["name"]]
        target = root / mount["mountPath"].lstrip("/")
        files = _volume_files(volume, config_maps, secrets_data or {})
        if files is None:       # emptyDir
            target.mkdir(parents=True, exist_ok=True)
        else:
            files = {k: under_root(v) if isinstance(v, str) else v for k, v in files.items()}
            if "subPath" in mount:
                target.parent.mkdir(parents=True, exist_ok=True)
                if target.is_dir():
                    shutil.rmtree(target)
                _write(target, files[mount["subPath"]])
            else:
                if target.exists():
                    shutil.rmtree(target)
                write_config_map_dir(target, files)
        laid.mounts[mount["name"]] = target

    env = {"PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}", "HOME": str(root),
           "HOSTNAME": pod.name}
    for entry in container.get("env", []):
        if "value" in entry:
            value = expand_kubernetes_vars(str(entry["value"]), env)
        elif "fieldRef" in entry.get("valueFrom", {}):
            value = pod.field(entry["valueFrom"]["fieldRef"]["fieldPath"])
        else:
            raise ValueError(f"env {entry['name']}: only value and fieldRef are known to this test's kubelet")
        env[entry["name"]] = under_root(value)

    if "command" in container:
        argv = [*container["command"], *container.get("args", [])]
    else:
        argv = [*image.entrypoint, *container.get("args", image.cmd)]
    laid.argv = [under_root(expand_kubernetes_vars(a, env)) for a in argv]
    laid.env = env
    return laid


def _volume_files(volume: Obj, config_maps: dict[str, dict[str, str]],
                  secrets_data: dict[str, dict[str, bytes]]) -> dict[str, Any] | None:
    if "configMap" in volume:
        return dict(config_maps[volume["configMap"]["name"]])
    if "secret" in volume:
        return dict(secrets_data[volume["secret"]["secretName"]])
    if "emptyDir" in volume:
        return None
    raise ValueError(f"volume {volume['name']}: only configMap, secret and emptyDir are known to this test's kubelet")


def _write(path: Path, content: str | bytes) -> None:
    if isinstance(content, str):
        path.write_text(content)
    else:
        path.write_bytes(content)


def write_config_map_dir(directory: Path, files: dict[str, str | bytes]) -> None:
    """Write or update a ConfigMap volume the way the kubelet's atomic writer does: the files go into
    a new ``..<timestamp>`` directory, a ``..data`` symlink is swapped to it with one rename, and the
    visible names are symlinks through ``..data``; the previous directory is then removed."""
    directory.mkdir(parents=True, exist_ok=True)
    stamp = directory / f"..{time.strftime('%Y_%m_%d_%H_%M_%S')}.{secrets.token_hex(5)}"
    stamp.mkdir()
    for name, content in files.items():
        _write(stamp / name, content)
    data = directory / "..data"
    old = os.readlink(data) if data.is_symlink() else None
    tmp = directory / "..data_tmp"
    tmp.symlink_to(stamp.name)
    os.replace(tmp, data)
    for name in files:
        visible = directory / name
        if not visible.is_symlink():
            visible.symlink_to(f"..data/{name}")
    for entry in directory.iterdir():
        if not entry.name.startswith("..") and entry.name not in files:
            entry.unlink()
    if old is not None:
        shutil.rmtree(directory / old)

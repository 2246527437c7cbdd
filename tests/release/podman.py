"""Podman as these test machines allow it (docs/testing.md, "The container image"): a private
storage root, a private containers.conf with the three settings this host needs, and a base image
built from Debian's own packages under the name the Dockerfile's FROM line uses, since no registry
is reachable. Not a fake: the image is built by podman from the Dockerfile and run by runc."""

from __future__ import annotations

import os
import re
import resource
import shutil
import subprocess
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
# The stand-in base: Debian 12's own Python 3.11 and pip, as python:3.11-slim has them.
BASE_PACKAGES = ("python3", "python3-pip", "ca-certificates")
SUITE = "bookworm"
MIRROR = os.environ.get("KPROXY_TEST_DEBIAN_MIRROR", "http://deb.debian.org/debian")
CACHE = Path(os.environ.get("KPROXY_TEST_IMAGE_CACHE", Path.home() / ".cache" / "kproxy-tests"))
HOST_CA = "/etc/ssl/certs/ca-certificates.crt"
TIMEOUT_S = 600


def missing_tools() -> list[str]:
    return [tool for tool in ("podman", "runc", "debootstrap") if shutil.which(tool) is None]


def from_names(dockerfile: Path = DOCKERFILE) -> set[str]:
    """The external images the Dockerfile's FROM lines name (not its own stages)."""
    stages: set[str] = set()
    names: set[str] = set()
    for line in dockerfile.read_text().splitlines():
        m = re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?", line.strip(), re.IGNORECASE)
        if m:
            if m.group(1) not in stages:
                names.add(m.group(1))
            if m.group(2):
                stages.add(m.group(2))
    return names


def qualified(name: str) -> str:
    """The full name podman resolves a short Docker Hub name to."""
    first, _, rest = name.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        return name
    return f"docker.io/{name}" if rest else f"docker.io/library/{name}"


def base_rootfs_tar(work: Path) -> Path:
    """A minbase Debian root file system with Python as a tarball, built once and then cached."""
    tar_path = CACHE / f"debian-{SUITE}-minbase-{'-'.join(BASE_PACKAGES)}.tar"
    if tar_path.is_file():
        return tar_path
    rootfs = work / "rootfs"
    subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", SUITE,
                    str(rootfs), MIRROR], check=True, capture_output=True, timeout=TIMEOUT_S)
    # python:*-slim lets root pip install into the system; Debian's PEP 668 marker would refuse it.
    for marker in rootfs.glob("usr/lib/python3*/EXTERNALLY-MANAGED"):
        marker.unlink()
    CACHE.mkdir(parents=True, exist_ok=True)
    part = tar_path.with_suffix(".part")
    with tarfile.open(part, "w") as tar:
        tar.add(rootfs, arcname=".")
    part.rename(tar_path)
    shutil.rmtree(rootfs, ignore_errors=True)
    return tar_path


class Podman:
    """podman with a private root, runroot and containers.conf under ``home``."""

    def __init__(self, home: Path) -> None:
        self.home = home
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        conf = home / "containers.conf"
        home.mkdir(parents=True, exist_ok=True)
        # No CAP_SYS_RESOURCE here and podman's default ulimits exceed the hard limits; crun refuses
        # this host's hybrid cgroup layout, runc does not.
        conf.write_text(f'[containers]\ndefault_ulimits = ["nofile={hard}:{hard}", "nproc=4096:4096"]\n'
                        '[engine]\nruntime = "runc"\ncgroup_manager = "cgroupfs"\n')
        self.env = {**os.environ, "CONTAINERS_CONF": str(conf)}
        self.base_args = ["podman", "--root", str(home / "root"), "--runroot", str(home / "run")]

    def __call__(self, *args: str, check: bool = True, timeout: float = TIMEOUT_S,
                 input: str | None = None) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([*self.base_args, *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout, input=input)
        if check and done.returncode != 0:
            raise AssertionError(f"podman {' '.join(args)} failed ({done.returncode}):\n"
                                 f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
        return done

    def popen(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen([*self.base_args, *args], env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    def reset(self) -> None:
        subprocess.run([*self.base_args, "system", "reset", "-f"], env=self.env, capture_output=True,
                       timeout=TIMEOUT_S)
        shutil.rmtree(self.home, ignore_errors=True)

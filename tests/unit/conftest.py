"""Fixtures shared by the unit tests."""

import logging
from collections.abc import Iterator

import pytest


@pytest.fixture
def root_logger() -> Iterator[logging.Logger]:
    """The root logger, put back as it was afterwards (configure_logging installs a handler on it)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield root
    for h in root.handlers[:]:
        if h not in handlers:
            root.removeHandler(h)
    root.setLevel(level)

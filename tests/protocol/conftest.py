"""Fixtures of the codec tests."""

from __future__ import annotations

import pytest

from kproxy.protocol import compiler

from .variants import LAZY, require_accelerator


@pytest.fixture(params=["default", *LAZY])
def codec_setting(request: pytest.FixtureRequest):
    """Run a test with the proxy's codecs as configured, then with each lazy variant."""
    before = compiler.codec_settings()
    if request.param != "default":
        require_accelerator()
        compiler.set_codec(native=LAZY[request.param], lazy_min_items=0)
    try:
        yield request.param
    finally:
        compiler.set_codec(native=before[0], lazy_min_items=before[1])

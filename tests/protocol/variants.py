"""The codec variants the codec tests compare: the one the proxy runs, and pure Python and native
with every array of structs lazy (so Hypothesis's short arrays take the lazy path too)."""

from __future__ import annotations

import pytest

from kproxy.protocol import compiler
from kproxy.protocol.compiler import Codec

LAZY = {"python-lazy": False, "native-lazy": True}


def require_accelerator() -> None:
    if not compiler.accelerator_available():
        pytest.fail("the native codec accelerator is not built (a C compiler and the Python headers are "
                    "needed; then `pip install -e .`): its tests cannot run")


def lazy_variants(codec: Codec) -> list[Codec]:
    """``codec`` as pure Python and as native, both lazy from 0 elements."""
    require_accelerator()
    return [codec.variant(native=native, lazy_min_items=0) for native in LAZY.values()]

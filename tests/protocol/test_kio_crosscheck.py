"""Cross-check against kio, an independent implementation of the Kafka 4.x messages.

For every API version both know: random kio entities encoded by kio decode in kproxy to the same
field values and re-encode to the same bytes, and kproxy's encoding decodes in kio to an equal entity.
Only bytes that kio itself produced are ever given to kio's native reader (it aborts the process on
some malformed input).
"""

from __future__ import annotations

import io

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, Phase, assume, given, settings
from kio.serial import entity_reader, entity_writer
from kio.static.primitive import Records

from kproxy.protocol import compiler
from kproxy.protocol.compiler import get_codec, join_parts
from kproxy.protocol.messages import apis
from tests.budget import examples

from .kio_bridge import kio_api_names, kio_class, kio_strategy, kio_versions, to_plain
from .variants import lazy_variants

st.register_type_strategy(Records, st.binary(max_size=32).map(Records))


def _cases():
    names = kio_api_names()
    out = []
    for key, api in sorted(apis().items()):
        if key not in names:
            continue
        for kind in ("request", "response"):
            msg = getattr(api, kind)
            for v in kio_versions(names[key]):
                if v in msg.versions:
                    out.append(pytest.param(names[key], kind, msg, v, id=f"{api.name}-{kind}-v{v}"))
    return out


def test_every_kio_version_is_known_to_kproxy():
    """kproxy must decode every API version kio (Kafka 4.x) defines."""
    names = kio_api_names()
    missing = []
    for key, name in sorted(names.items()):
        api = apis().get(key)
        for v in kio_versions(name):
            for kind in ("request", "response"):
                if api is None or v not in getattr(api, kind).versions:
                    missing.append(f"{name} v{v} {kind}")
    assert not missing, f"{len(missing)} missing: {missing[:20]}"


def _encoded(codec, obj) -> bytes:
    out, ins = bytearray(), []
    compiler.encode_to(codec, obj, out, ins)
    return bytes(join_parts(out, ins))


def _kio_bytes(cls, entity) -> bytes:
    buf = io.BytesIO()
    entity_writer(cls)(buf, entity)
    return buf.getvalue()


@pytest.mark.parametrize(("name", "kind", "msg", "v"), _cases())
def test_kio_agrees(name, kind, msg, v):
    cls = kio_class(name, v, kind)

    # No shrinking: a failing example is printed as found; shrinking kio entities takes minutes.
    @settings(max_examples=examples(10), deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(kio_strategy(cls))
    def check(entity):
        try:
            data = _kio_bytes(cls, entity)
            # A few random kio entities (huge timedeltas) cannot be read back by kio itself.
            again, _ = entity_reader(cls)(data, 0)
        except (ValueError, OverflowError, TypeError):
            assume(False)
        codec = get_codec(msg, v)
        for c in (codec, *lazy_variants(codec)):
            obj, pos = c.decode_checked(memoryview(data), 0, len(data))
            assert pos == len(data)
            untouched = _encoded(c, obj)
            assert obj.to_dict(v) == to_plain(again)
            assert untouched == data
            ours = _encoded(c, obj)  # from the objects, every lazy array decoded by to_dict
            assert ours == data
        theirs, size = entity_reader(cls)(ours, 0)
        assert size == len(ours)
        assert theirs == again

    check()

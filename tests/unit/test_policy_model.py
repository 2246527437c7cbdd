"""The policy vocabulary: API groups cover every API on purpose, and each compiled selector."""

from __future__ import annotations

import ipaddress
import re

import pytest

from kproxy.policy import model as M
from kproxy.protocol.messages import apis


def test_every_api_is_in_a_group_or_listed_as_ungrouped():
    # A new API in the schema fails here until someone decides which groups it belongs to.
    names = {api.name for api in apis().values()}
    grouped = set().union(*M.API_GROUPS.values())
    assert names - grouped - M.UNGROUPED == set()
    assert grouped - names == set(), "a group names an API kproxy does not know"
    assert not (grouped & M.UNGROUPED)


def test_group_keys():
    assert M.api_group_keys("write") >= {0, 21, 22}
    assert 1 not in M.api_group_keys("write")
    assert M.api_group_keys("any") == frozenset(apis())
    assert 18 not in M.api_group_keys("admin") | M.api_group_keys("read")


@pytest.mark.parametrize(("items", "negate", "value", "hit"), [
    (["orders"], False, "orders", True),
    (["orders"], False, "orders-2", False),
    (["team-a-*"], False, "team-a-7", True),
    (["team-a-*"], False, "xteam-a-7", False),
    (["re:app-[0-9]+"], False, "app-12", True),
    (["re:app-[0-9]+"], False, "app-12x", False),      # the whole value must match
    (["a", "b*"], False, "bee", True),
    (["a", "b*"], True, "bee", False),
    (["a", "b*"], True, "c", True),
    (["t?"], False, "tx", True),
])
def test_names(items, negate, value, hit):
    assert M.names(items, negate)(value) is hit


def test_networks():
    nets = M.Networks((ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("fd00::/8")))
    assert nets("10.2.3.4") and nets("fd00::1") and nets("::ffff:10.9.9.9")
    assert not nets("192.168.1.1") and not nets(None) and not nets("not an address")
    assert M.Networks(nets.networks, negate=True)("192.168.1.1")


def test_ranges_codecs_and_software():
    assert M.Ranges(((3, 9),))(9) and not M.Ranges(((3, 9),))(10)
    assert M.Ranges(((12, None),))(99) and M.Ranges(((12, None),), negate=True)(3)
    assert M.Codecs(frozenset({3}))(frozenset({0, 3})) and not M.Codecs(frozenset({3}))(frozenset({0}))
    assert not M.Codecs(frozenset({0}), negate=True)(frozenset())    # nothing produced: nothing to judge
    sw = M.Software(M.names(["librdkafka"]), ((">=", (2, 5)), ("<", (3,))))
    assert sw("librdkafka", "2.16.0") and not sw("librdkafka", "2.4.9") and not sw("librdkafka", "3.0")
    assert not sw("apache-kafka-java", "3.9.0") and not sw(None, None)
    assert M.version_tuple("2.16.0-RC1") == (2, 16, 0) and M.version_tuple("v1") == ()


def test_connection_selectors_read_null_values_as_kafka_does():
    m = M.Match(client_id=M.names([""]), principal=M.names([M.ANONYMOUS]))
    assert m.holds_for_connection(None, None, None, None, None, None)
    assert not m.holds_for_connection("app", None, None, None, None, None)


def test_compile_name_kinds():
    assert M.compile_name("plain") == ("plain", None)
    exact, pattern = M.compile_name("re:x+")
    assert exact is None and pattern is not None and pattern.fullmatch("xxx")
    with pytest.raises(re.error):
        M.compile_name("re:(")

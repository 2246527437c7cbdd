"""Fuzz the session with mutated frames from both sides: it may only ever return actions.

A malformed frame must close its connection with a reason (a ``Close`` action), never raise: an
exception would be a bug that takes the connection down without saying why. Valid frames come from
the schema strategies, then get mutated the way test_fuzz.py mutates them.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from kproxy.protocol.messages import Request, Response, apis, encode_request_frame, encode_response_frame
from kproxy.proxy.actions import Action, Close, ToUpstream
from kproxy.proxy.addresses import AddressMap, AddressRewriter
from kproxy.proxy.filters import ConnectionContext, FilterChain
from kproxy.proxy.session import Session
from kproxy.proxy.versions import ApiVersionsNarrower
from tests.budget import examples

from .strategies import message_strategy
from .test_fuzz import mutated

API_KEYS = sorted(apis())


def _session() -> Session:
    # Two ports only: mutated responses name more nodes than that, which must be handled (logged,
    # the node left out), never raised.
    amap = AddressMap("localhost", 20000, 2)
    chain = FilterChain([ApiVersionsNarrower(), AddressRewriter(amap)])
    return Session(ConnectionContext(1, clock=lambda: 0.0), chain)


def _frame(api_key: int, kind: str):
    api = apis()[api_key]
    msg = getattr(api, kind)
    versions = list(range(msg.versions.lo, msg.versions.hi + 1))

    def build(v_body):
        v, body = v_body
        if kind == "request":
            parts = encode_request_frame(Request.build(api_key, v, 7, "fuzz", body))
        else:
            parts = encode_response_frame(Response.build(api_key, v, 0, body))
        return v, b"".join(bytes(p) for p in parts)[4:]

    return st.sampled_from(versions).flatmap(
        lambda v: message_strategy(msg, v).map(lambda body: (v, body))).map(build)


def _only_actions(out: object) -> None:
    assert isinstance(out, list) and all(isinstance(a, Action) for a in out)


@pytest.mark.parametrize("api_key", API_KEYS)
def test_mutated_requests_only_ever_yield_actions(api_key):
    @settings(max_examples=examples(8), deadline=None, suppress_health_check=list(HealthCheck))
    @given(_frame(api_key, "request").flatmap(lambda vf: mutated(vf[1])))
    def check(data):
        _only_actions(_session().client_frame(memoryview(bytearray(data))))

    check()


@pytest.mark.parametrize("api_key", API_KEYS)
def test_mutated_responses_only_ever_yield_actions(api_key):
    # A valid request goes up first, so the (mutated) answer meets a real in-flight entry.
    @settings(max_examples=examples(8), deadline=None, suppress_health_check=list(HealthCheck))
    @given(_frame(api_key, "request"), _frame(api_key, "response"), st.data())
    def check(req, resp, data):
        _, req_bytes = req
        s = _session()
        out = s.client_frame(memoryview(bytearray(req_bytes)))
        _only_actions(out)
        if not any(isinstance(a, ToUpstream) for a in out) or not s.awaiting_upstream:
            return
        _, resp_bytes = resp
        mutated_resp = bytearray(data.draw(mutated(resp_bytes)))
        mutated_resp[:4] = (0).to_bytes(4, "big")   # the session's first upstream correlation id
        out = s.upstream_frame(memoryview(mutated_resp))
        _only_actions(out)
        _only_actions(s.upstream_lost("fuzz"))
        assert all(not isinstance(a, Close) or a.reason for a in out)

    check()

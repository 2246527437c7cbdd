"""The accelerator's relay step (``_accel.relay_request``/``relay_answer``): a request nothing reads
and its answer nobody reads each take one C call, which must do exactly what the session's Python
path does (the reference): the same bytes to the broker and the client, the same entries, the same
session state, whatever the frames are and however they arrive."""

from __future__ import annotations

import contextlib
import re
import struct
from collections.abc import Iterator

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kproxy.protocol.compiler import native_function
from kproxy.protocol.errors import FrameError
from kproxy.protocol.framing import FrameReader
from kproxy.protocol.messages import body_class
from kproxy.proxy import session as session_module
from kproxy.proxy.actions import ToClient, ToUpstream
from kproxy.proxy.filters import ConnectionContext, FilterChain
from kproxy.proxy.inflight import InFlight
from kproxy.proxy.session import Session

from .rulebook import policy_filter
from .test_session import (
    API_VERSIONS,
    HEARTBEAT,
    METADATA,
    PRODUCE,
    heartbeat_request,
    metadata_request,
    produce_request,
    request_frame,
    response_frame,
)
from .test_telemetry import batch

pytestmark = pytest.mark.skipif(native_function("relay_request") is None,
                                reason="the relay step is the accelerator's")
counts = native_function("relay_counts")


class Ticking:
    """A clock that moves on every reading: both paths must read it as often, in the same places."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        self.now += 0.001
        return self.now


def relaying(*filters, metrics: bool = False) -> Session:
    """A session as the server makes one without telemetry, or (``metrics``) with metrics alone,
    which read Fetch decoded and count Produce from its bytes."""
    return Session(ConnectionContext(1, clock=Ticking()), FilterChain(filters), read_answers=False,
                   telemetry_reads=frozenset({1}) if metrics else None)


@contextlib.contextmanager
def python_path() -> Iterator[None]:
    """The session's Python path only, the relay step's reference."""
    saved = session_module._RELAY_REQUEST, session_module._RELAY_ANSWER
    session_module._RELAY_REQUEST = session_module._RELAY_ANSWER = None
    try:
        yield
    finally:
        session_module._RELAY_REQUEST, session_module._RELAY_ANSWER = saved


def heartbeat_answer(correlation_id: int) -> bytes:
    return response_frame(HEARTBEAT, 4, correlation_id, body_class(HEARTBEAT, "response")(error_code=0))


def test_a_relayable_request_and_its_answer_take_the_compiled_step():
    s = relaying()
    before = counts()
    ups = [s.client_frame(request_frame(HEARTBEAT, 4, i, heartbeat_request()))[0] for i in range(3)]
    # The first of an api version works out whether it may be relayed (Python); the rest are relayed in C.
    assert counts()[0] - before[0] == 2
    for up in ups:
        (out,) = s.upstream_frame(memoryview(heartbeat_answer(up.entry.upstream_correlation_id)))
        assert isinstance(out, ToClient) and out.done == (up.entry,)
    assert counts()[1] - before[1] == 2
    assert all(up.entry.request is None and up.entry.relayed is not None for up in ups)


def test_the_python_path_does_not_count():
    s = relaying()
    before = counts()
    with python_path():
        for i in range(3):
            (up,) = s.client_frame(request_frame(HEARTBEAT, 4, i, heartbeat_request()))
            s.upstream_frame(memoryview(heartbeat_answer(up.entry.upstream_correlation_id)))
    assert counts() == before


def test_entries_are_copies_of_constant_defaults():
    # The C step copies an entry of attrs' defaults: a factory default (a list) would be shared by
    # every entry, so the session refuses to set the step up with one.
    assert not any(isinstance(f.default, attrs.Factory) for f in attrs.fields(InFlight))
    assert session_module._RELAY_REQUEST is not None
    s = relaying()
    ups = [s.client_frame(request_frame(HEARTBEAT, 4, i, heartbeat_request()))[0].entry for i in range(3)]
    made = ups[2]
    assert type(made) is InFlight and made is not ups[1]
    made.note("k", 1)
    assert ups[1].notes is None and InFlight(0, 0, 0, 0.0).notes is None


# -- the compiled step against the Python path, on random traffic

def _client_frames() -> st.SearchStrategy[list[bytes]]:
    """Requests as the client sends them, size prefixes included."""
    def prefixed(frame: memoryview | bytes) -> bytes:
        return struct.pack(">i", len(frame)) + bytes(frame)

    cid = st.integers(0, 2**31 - 1)
    client_id = st.one_of(st.sampled_from(["app", "consumer-7", "", "é-ü"]), st.text(max_size=8))
    heartbeat = st.builds(lambda c, i: prefixed(request_frame(HEARTBEAT, 4, c, heartbeat_request(), client_id=i)),
                          cid, client_id)
    old_heartbeat = st.builds(lambda c: prefixed(request_frame(HEARTBEAT, 1, c, heartbeat_request())), cid)
    def produce_frame(c: int, v: int, acks: int, records: int) -> bytes:
        body = produce_request(acks=acks)
        for topic in body.topic_data:
            for part in topic.partition_data:
                part.records = batch(records) if records else b"batch"     # a real batch, or not one
        return prefixed(request_frame(PRODUCE, v, c, body))

    produce = st.builds(produce_frame, cid, st.sampled_from([3, 8, 9, 11]), st.sampled_from([0, 1, -1]),
                        st.integers(0, 3))
    metadata = st.builds(lambda c: prefixed(request_frame(METADATA, 12, c, metadata_request())), cid)
    api_versions = st.builds(lambda c: prefixed(request_frame(
        API_VERSIONS, 3, c, body_class(API_VERSIONS, "request")(client_software_name="x",
                                                                client_software_version="1"))), cid)
    # A relayable frame cut short inside its body: the decoder says why, and the connection closes.
    truncated = heartbeat.map(lambda f: struct.pack(">i", len(f) - 7) + f[4:-3])
    # A client id whose length runs past the frame.
    bad_client_id = heartbeat.map(lambda f: f[:12] + b"\x7f\xff" + f[14:])
    bad_prefix = st.just(b"\xff\xff\xff\xf0\x00\x00\x00\x00")
    good = st.one_of(heartbeat, old_heartbeat, produce, metadata, api_versions)
    bad = st.one_of(truncated, bad_client_id, bad_prefix)
    # Mostly frames that are relayed, a bad one somewhere in a third of the sequences.
    return st.builds(lambda frames, bad, at: frames if bad is None else [*frames[:at], bad, *frames[at:]],
                     st.lists(good, min_size=1, max_size=16), st.one_of(st.none(), st.none(), bad),
                     st.integers(0, 16))


def _entry(e: InFlight) -> tuple:
    return tuple(bytes(v) if isinstance(v, memoryview) else
                 [bytes(b) for b in v] if f.name == "reply" and v is not None else
                 re.sub(r" at 0x[0-9a-f]+", "", repr(v)) if f.name in ("request", "response") and v is not None else v
                 for f, v in zip(attrs.fields(InFlight), attrs.astuple(e, recurse=False), strict=True))


def _actions(actions: list) -> list:
    out = []
    for a in actions:
        buffers = b"".join(bytes(b) for b in getattr(a, "buffers", ()) or ())
        entries = [a.entry] if isinstance(a, ToUpstream) else list(getattr(a, "done", ()))
        out.append((type(a).__name__, buffers, getattr(a, "reason", None), [_entry(e) for e in entries if e]))
    return out


def _state(s: Session) -> tuple:
    return (s.requests, s._next_correlation_id, s.ctx.client_id, len(s.open), [e.seq for e in s.in_flight],
            sorted(s._by_upstream), list(s._no_response), s.throttle_until)


def _answer(entry: InFlight, throttle: int) -> bytes:
    """The broker's answer to ``entry``, with this throttle time where the answer has one."""
    body = body_class(entry.api_key, "response")()
    if hasattr(body, "throttle_time_ms"):
        body.throttle_time_ms = throttle
    frame = response_frame(entry.api_key, entry.api_version, 0, body)
    return struct.pack(">i", entry.upstream_correlation_id) + frame[4:]


def _run(script: list, rules: bool, metrics: bool, tmp_path, python: bool) -> list:
    """Feed the client's bytes in the script's pieces through a FrameReader, answering requests as the
    script says; everything the session did, in order."""
    filters = ()
    if rules:
        filters = (policy_filter(tmp_path, "rules: [{name: no-dels, match: {api: delete_topics}, action: deny}]\n"),)
    s = relaying(*filters, metrics=metrics)
    reader = FrameReader(1 << 20, trust_claims=False)
    log: list = []
    waiting: list[InFlight] = []
    with python_path() if python else contextlib.nullcontext():
        for piece, answers in script:
            reader.feed(piece)
            try:
                while (frame := reader.next_frame()) is not None:
                    actions = s.client_frame(frame)
                    log.append(_actions(actions))
                    waiting += [a.entry for a in actions if isinstance(a, ToUpstream)
                                and a.entry is not None and a.entry.upstream_correlation_id is not None]
                    if any(type(a).__name__ == "Close" for a in actions):
                        return log
            except FrameError as e:
                log.append(("FrameError", str(e)))
                return log
            for pick in answers:
                if not waiting:
                    break
                entry = waiting.pop(pick % len(waiting))    # the broker may answer out of order
                log.append(_actions(s.upstream_frame(memoryview(_answer(entry, pick * 37)))))
            log.append(_state(s))
    return log


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(frames=_client_frames(), data=st.data(), rules=st.booleans(), metrics=st.booleans())
def test_the_compiled_step_does_what_the_python_path_does(frames, data, rules, metrics, tmp_path):
    stream = b"".join(frames)
    # Cut the stream anywhere: frames split across receives, several in one receive.
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(stream) - 1)), max_size=8)))
    pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True) if b > a]
    script = [(p, data.draw(st.lists(st.integers(0, 10), max_size=3))) for p in pieces]
    script.append((b"", [0] * 20))      # every request still owed is answered at the end
    compiled = _run(script, rules, metrics, tmp_path, python=False)
    assert compiled == _run(script, rules, metrics, tmp_path, python=True)

"""The session's side of cut-through: which answers it streams, and that a streamed answer reaches the
client as the stored one would, completes its entry the same way and fails safe."""

from __future__ import annotations

import struct
import uuid
from typing import Any

import pytest

from kproxy.protocol.messages import (
    Request,
    Response,
    body_class,
    decode_response,
    encode_request_frame,
    encode_response_frame,
)
from kproxy.protocol.records import build_batch
from kproxy.proxy.actions import Close, Listen, ToClient, ToUpstream
from kproxy.proxy.addresses import AddressMap, AddressRewriter
from kproxy.proxy.filters import ConnectionContext, Filter, FilterChain
from kproxy.proxy.inflight import STORED, STREAMED, UPSTREAM_LOST
from kproxy.proxy.reencode import ReencodeCheck
from kproxy.proxy.session import Session
from kproxy.proxy.streaming import PAD_TAG
from kproxy.proxy.versions import ApiVersionsNarrower
from kproxy.telemetry.exchange import fetch_partitions

FETCH = 1
TOPIC_ID = uuid.UUID("1b4e28ba-2fa1-11d2-883f-0016d3cca427")
BATCH = build_batch([(None, b"v" * 1000)] * 100, base_offset=500)   # about 100 KiB


class Learned:
    def topic(self, topic_id: Any) -> str | None:
        return "t" if topic_id == TOPIC_ID else None


def session(*extra: Filter, min_bytes: int | None = 64 * 1024) -> tuple[Session, AddressRewriter]:
    rewriter = AddressRewriter(AddressMap("proxy.example", 19000, 16, node_id_base=0))
    chain = FilterChain([ApiVersionsNarrower(), rewriter, *extra])
    return Session(ConnectionContext(1, clock=lambda: 5.0), chain, stream_min_bytes=min_bytes), rewriter


def fetch(s: Session, correlation_id: int = 7, version: int = 16) -> int:
    """Send a Fetch through ``s``; kproxy's correlation id for it."""
    rq: Any = body_class(FETCH, "request")
    body = rq(max_wait_ms=100, min_bytes=1, max_bytes=1 << 20, topics=[rq.FetchTopic(
        topic_id=TOPIC_ID, topic="t", partitions=[rq.FetchPartition(partition=0, fetch_offset=520,
                                                                   partition_max_bytes=1 << 20)])])
    frame = b"".join(bytes(b) for b in encode_request_frame(Request.build(FETCH, version, correlation_id, "c", body)))
    (up,) = [a for a in s.client_frame(memoryview(frame)[4:]) if isinstance(a, ToUpstream)]
    return struct.unpack_from(">i", b"".join(bytes(b) for b in up.buffers), 8)[0]


def answer(upstream_id: int, version: int = 16, endpoints: bool = True) -> bytes:
    cls: Any = body_class(FETCH, "response")
    body = cls(throttle_time_ms=3, responses=[cls.FetchableTopicResponse(topic_id=TOPIC_ID, topic="t", partitions=[
        cls.PartitionData(partition_index=0, high_watermark=600, records=BATCH,
                          current_leader=cls.LeaderIdAndEpoch(leader_id=2, leader_epoch=1))])],
        node_endpoints=[cls.NodeEndpoint(node_id=2, host="broker-2.internal.example", port=9092)] if endpoints else [])
    return b"".join(bytes(b) for b in encode_response_frame(Response.build(FETCH, version, upstream_id, body)))[4:]


def stream(s: Session, frame: bytes, piece: int = 10_000) -> list:
    assert s.stream_start(len(frame), memoryview(frame)[:16], True)
    actions: list = []
    for i in range(0, len(frame), piece):
        actions += s.stream_piece(memoryview(bytearray(frame[i:i + piece])))
    return actions


def sent(actions: list) -> bytes:
    return b"".join(bytes(b) for a in actions if isinstance(a, ToClient) for b in a.buffers)


@pytest.mark.parametrize("version", [11, 12, 16])
def test_a_streamed_answer_is_what_the_stored_one_would_be_and_completes_its_entry(version):
    streamed, _ = session()
    stored, _ = session(min_bytes=None)
    frame = answer(fetch(streamed, version=version), version)
    assert frame == answer(fetch(stored, version=version), version)
    got = stream(streamed, frame)
    want = stored.upstream_frame(memoryview(frame))
    if version < 16:
        assert sent(got) == sent(want)
    else:
        # The rewritten endpoint is shorter than the broker's: the streamed answer keeps its length
        # with a pad field; otherwise it says what the stored one says.
        a = decode_response(sent(got)[4:], FETCH, version)
        assert [t for t, _ in a.body._unknown] == [PAD_TAG]
        a.body._unknown = None
        assert a.body.node_endpoints[0].host == "proxy.example"
        assert b"".join(encode_response_frame(a)) == sent(want)
        assert len(sent(got)) == len(frame) + 4
    # Ports named by the rewritten endpoints are opened before the tail that names them.
    if version >= 16:
        assert [type(a) for a in got][-2:] == [Listen, ToClient]
    (entry,) = [e for a in got if isinstance(a, ToClient) for e in a.done]
    (stored_entry,) = [e for a in want if isinstance(a, ToClient) for e in a.done]
    assert entry.path == STREAMED and stored_entry.path == STORED
    assert entry.response_bytes == len(frame) + 4
    assert stored_entry.response_bytes == len(sent(want))
    assert entry.throttle_ms == 3 and entry.answered_at == 5.0
    # Telemetry reads the same per-partition facts (records, bytes, offsets from the fetch offset on).
    assert ([p.as_dict() for p in fetch_partitions(entry, Learned())]  # type: ignore[arg-type]
            == [p.as_dict() for p in fetch_partitions(stored_entry, Learned())])  # type: ignore[arg-type]
    assert fetch_partitions(entry, Learned())[0].records == 100   # type: ignore[arg-type]
    assert not streamed.in_flight and streamed.streaming is None


def test_only_the_next_answer_owed_and_large_ones_stream():
    s, _ = session()
    first, second = fetch(s, 1), fetch(s, 2)
    later = answer(second)
    # Broker answers come in order; one that is not the next owed to the client is stored.
    assert not s.stream_start(len(later), memoryview(later)[:8], True)
    small, _ = session(min_bytes=len(answer(0)) + 1)
    f = answer(fetch(small))
    assert not small.stream_start(len(f), memoryview(f)[:8], True)
    assert not s.stream_start(len(answer(first)), memoryview(answer(first))[:8], False)   # TLS
    assert s.stream_start(len(answer(first)), memoryview(answer(first))[:8], True)


def test_a_filter_that_must_see_whole_answers_keeps_them_stored():
    class RecordRule(Filter):
        name = "record-rule"
        response_api_keys = frozenset({FETCH})

    s, _ = session(RecordRule())
    f = answer(fetch(s))
    assert not s.stream_start(len(f), memoryview(f)[:8], True)
    assert s.streaming is None


def test_a_broker_lost_mid_answer_closes_the_client_connection():
    s, _ = session()
    f = answer(fetch(s))
    assert s.stream_start(len(f), memoryview(f)[:8], True)
    part = s.stream_piece(memoryview(bytearray(f[:30_000])))
    assert sent(part)                                       # the client already has part of it
    (close,) = s.upstream_lost("broker closed the connection")
    assert isinstance(close, Close) and "in the middle of a streamed fetch answer (30000 of" in close.reason
    (entry,) = close.done
    assert entry.outcome == UPSTREAM_LOST and entry.path == STREAMED


def test_a_malformed_answer_closes_the_connection_once_streaming():
    s, _ = session()
    f = bytearray(answer(fetch(s), endpoints=False))
    f[-1] = 5        # the closing tagged-field count says five fields follow; none do
    assert s.stream_start(len(f), memoryview(f)[:8], True)
    actions = s.stream_piece(memoryview(f))
    assert isinstance(actions[-1], Close) and actions[-1].undecodable == "response"


def test_verify_reencode_checks_what_a_streamed_answer_sent():
    rewriter = AddressRewriter(AddressMap("proxy.example", 19000, 16, node_id_base=0))
    check = ReencodeCheck(1.0)
    s = Session(ConnectionContext(1, clock=lambda: 5.0), FilterChain([rewriter]), reencode=check)
    f = answer(fetch(s))
    checked = check.checked
    stream(s, f)
    # The head and tail as sent (the records went through untouched) re-encode to the same bytes.
    assert check.checked == checked + 1 and check.mismatches == 0

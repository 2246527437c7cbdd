"""The sans-I/O session: frames in, actions out, with no sockets and an injected clock."""

from __future__ import annotations

import struct
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kproxy.protocol.messages import (
    Request,
    Response,
    body_class,
    decode_request,
    decode_response,
    encode_request_frame,
    encode_response_frame,
    supported_versions,
)
from kproxy.proxy.actions import Ask, Close, Hold, ToClient, ToUpstream
from kproxy.proxy.filters import AskBroker, ConnectionContext, Delay, Filter, FilterChain, Respond
from kproxy.proxy.sasl import sasl_user
from kproxy.proxy.session import Session, future_produce_acks

PRODUCE, FETCH, METADATA, HEARTBEAT, OFFSET_COMMIT = 0, 1, 3, 12, 8
SASL_HANDSHAKE, API_VERSIONS, SASL_AUTHENTICATE = 17, 18, 36
TOPIC_AUTHORIZATION_FAILED, SASL_AUTHENTICATION_FAILED = 29, 58


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_session(*filters: Filter, passthrough: bool = False, clock: Clock | None = None,
                 tls_subject: str | None = None) -> Session:
    ctx = ConnectionContext(1, clock=clock or Clock(), tls_subject=tls_subject)
    return Session(ctx, FilterChain(filters), passthrough_unknown_versions=passthrough)


def request_frame(api_key: int, version: int, correlation_id: int, body, client_id: str = "app") -> memoryview:
    req = Request.build(api_key, version, correlation_id, client_id, body)
    return memoryview(b"".join(encode_request_frame(req))[4:])


def response_frame(api_key: int, version: int, correlation_id: int, body) -> bytes:
    return b"".join(encode_response_frame(Response.build(api_key, version, correlation_id, body)))[4:]


def wire(action) -> bytes:
    """The bytes an action sends, checked to carry a correct size prefix; returned without it."""
    data = b"".join(bytes(b) for b in action.buffers)
    (size,) = struct.unpack_from(">i", data, 0)
    assert size == len(data) - 4
    return data[4:]


def forwarded(action) -> Request:
    assert isinstance(action, ToUpstream)
    return decode_request(wire(action))


def answered(action, api_key: int, version: int) -> Response:
    assert isinstance(action, ToClient)
    return decode_response(wire(action), api_key, version)


def kinds(actions) -> list[type]:
    return [type(a) for a in actions]


# -- request and response bodies


def metadata_request(topics=("t",)):
    cls = body_class(METADATA, "request")
    return cls(topics=[cls.MetadataRequestTopic(name=t) for t in topics])


def metadata_response(brokers=((1, "kafka-1.internal", 9092),)):
    cls = body_class(METADATA, "response")
    return cls(brokers=[cls.MetadataResponseBroker(node_id=n, host=h, port=p) for n, h, p in brokers])


def produce_request(acks: int = 1, topics=(("t", (0, 1)),)):
    cls = body_class(PRODUCE, "request")
    return cls(acks=acks, timeout_ms=1000, topic_data=[
        cls.TopicProduceData(name=name, partition_data=[
            cls.PartitionProduceData(index=p, records=b"batch") for p in parts])
        for name, parts in topics])


def produce_response(topics=(("t", (0, 1)),)):
    cls = body_class(PRODUCE, "response")
    return cls(responses=[
        cls.TopicProduceResponse(name=name, partition_responses=[
            cls.PartitionProduceResponse(index=p, base_offset=42) for p in parts])
        for name, parts in topics])


def api_versions_response():
    cls = body_class(API_VERSIONS, "response")
    return cls(api_keys=[cls.ApiVersion(api_key=METADATA, min_version=0, max_version=12)])


def heartbeat_request():
    return body_class(HEARTBEAT, "request")(group_id="g", generation_id=3, member_id="m")


class Refuse(Filter):
    """Answers every request of the given api keys locally with ``error_code``."""

    name = "refuse"

    def __init__(self, keys, error_code=TOPIC_AUTHORIZATION_FAILED, delay: float | None = None) -> None:
        self.request_api_keys = frozenset(keys)
        self.error_code = error_code
        self.delay = delay
        self.seen: list[int] = []

    def on_request(self, ctx, exchange):
        request = exchange.request
        self.seen.append(request.api_key)
        verdict = Respond(self.error_code, error_message="refused by kproxy")
        return Delay(self.delay, verdict) if self.delay is not None else verdict


# -- correlation ids and order


def test_correlation_ids_are_kproxys_upstream_and_the_clients_downstream():
    s = make_session()
    a = s.client_frame(request_frame(METADATA, 12, 1000, metadata_request()))
    b = s.client_frame(request_frame(API_VERSIONS, 3, 1000, body_class(API_VERSIONS, "request")()))
    up_a, up_b = forwarded(a[0]), forwarded(b[0])
    # The same client id used twice still gets two distinct upstream ids.
    assert up_a.correlation_id != up_b.correlation_id
    assert {up_a.correlation_id, up_b.correlation_id}.isdisjoint({1000})
    assert up_a.client_id == "app" and up_a.body == metadata_request()
    assert s.awaiting_upstream == 2

    out = s.upstream_frame(memoryview(response_frame(METADATA, 12, up_a.correlation_id, metadata_response())))
    assert kinds(out) == [ToClient]
    resp = answered(out[0], METADATA, 12)
    assert resp.correlation_id == 1000
    assert resp.body.brokers[0].host == "kafka-1.internal"

    out = s.upstream_frame(memoryview(response_frame(API_VERSIONS, 3, up_b.correlation_id,
                                                     api_versions_response())))
    assert answered(out[0], API_VERSIONS, 3).correlation_id == 1000
    assert s.awaiting_upstream == 0 and not s.in_flight


def test_replies_keep_the_clients_order_when_the_broker_answers_out_of_order():
    s = make_session()
    first = forwarded(s.client_frame(request_frame(METADATA, 1, 7, metadata_request()))[0])
    second = forwarded(s.client_frame(request_frame(METADATA, 1, 8, metadata_request(["u"])))[0])
    assert s.upstream_frame(memoryview(response_frame(METADATA, 1, second.correlation_id,
                                                      metadata_response()))) == []
    out = s.upstream_frame(memoryview(response_frame(METADATA, 1, first.correlation_id,
                                                     metadata_response())))
    assert [answered(a, METADATA, 1).correlation_id for a in out] == [7, 8]


def test_a_local_answer_waits_behind_an_earlier_forwarded_request():
    refuse = Refuse({PRODUCE})
    s = make_session(refuse)
    meta = forwarded(s.client_frame(request_frame(METADATA, 9, 1, metadata_request()))[0])
    # The filter answers the Produce at once, but the client asked for Metadata first.
    assert s.client_frame(request_frame(PRODUCE, 9, 2, produce_request())) == []
    assert refuse.seen == [PRODUCE]
    assert s.awaiting_upstream == 1

    out = s.upstream_frame(memoryview(response_frame(METADATA, 9, meta.correlation_id, metadata_response())))
    assert kinds(out) == [ToClient, ToClient]
    assert answered(out[0], METADATA, 9).correlation_id == 1
    produce = answered(out[1], PRODUCE, 9)
    assert produce.correlation_id == 2
    assert [p.error_code for p in produce.body.responses[0].partition_responses] == [29, 29]


def test_a_local_answer_with_nothing_pending_goes_out_at_once():
    s = make_session(Refuse({HEARTBEAT}, error_code=25))
    out = s.client_frame(request_frame(HEARTBEAT, 4, 9, heartbeat_request()))
    assert kinds(out) == [ToClient]
    resp = answered(out[0], HEARTBEAT, 4)
    assert resp.correlation_id == 9 and resp.body.error_code == 25


def test_filters_only_see_their_api_keys():
    refuse = Refuse({HEARTBEAT})
    s = make_session(refuse)
    out = s.client_frame(request_frame(METADATA, 4, 1, metadata_request()))
    assert kinds(out) == [ToUpstream]
    assert refuse.seen == []


# -- acks=0


def test_acks_0_produce_is_forwarded_and_not_awaited():
    s = make_session()
    out = s.client_frame(request_frame(PRODUCE, 9, 50, produce_request(acks=0)))
    assert kinds(out) == [ToUpstream]
    sent = forwarded(out[0])
    assert sent.body.acks == 0 and sent.correlation_id != 50
    assert s.awaiting_upstream == 0 and not s.in_flight

    # A request after it is not held behind an answer that never comes.
    meta = forwarded(s.client_frame(request_frame(METADATA, 9, 51, metadata_request()))[0])
    assert meta.correlation_id != sent.correlation_id
    out = s.upstream_frame(memoryview(response_frame(METADATA, 9, meta.correlation_id, metadata_response())))
    assert answered(out[0], METADATA, 9).correlation_id == 51


def test_a_refused_acks_0_produce_gets_no_answer_and_closes_the_connection():
    # The client expects no answer, so it can only learn of the refusal as a Kafka broker tells it:
    # the connection closes, and the client refreshes its metadata and retries.
    s = make_session(Refuse({PRODUCE}))
    out = s.client_frame(request_frame(PRODUCE, 9, 1, produce_request(acks=0)))
    assert kinds(out) == [Close]
    assert "acks=0" in out[0].reason
    (entry,) = out[0].done
    assert entry.outcome == "local" and entry.response_bytes == 0
    assert not s.in_flight


def test_a_refused_acks_0_produce_closes_only_after_answers_owed_before_it():
    s = make_session(Refuse({PRODUCE}))
    meta = forwarded(s.client_frame(request_frame(METADATA, 9, 1, metadata_request()))[0])
    assert s.client_frame(request_frame(PRODUCE, 9, 2, produce_request(acks=0))) == []
    out = s.upstream_frame(memoryview(response_frame(METADATA, 9, meta.correlation_id, metadata_response())))
    assert kinds(out) == [ToClient, Close]
    assert answered(out[0], METADATA, 9).correlation_id == 1


# -- local answers from filters


@pytest.mark.parametrize("version", [3, 9, 13])
def test_respond_error_code_gives_every_produce_partition_the_error(version):
    topics = (("a", (0, 1)), ("b", (7,)))
    body = produce_request(topics=topics)
    if version >= 13:
        for i, t in enumerate(body.topic_data):
            t.topic_id = uuid.UUID(int=i + 1)
    s = make_session(Refuse({PRODUCE}))
    out = s.client_frame(request_frame(PRODUCE, version, 77, body))
    resp = answered(out[0], PRODUCE, version)
    assert resp.correlation_id == 77
    got = [(t.topic_id if version >= 13 else t.name, p.index, p.error_code, p.base_offset)
           for t in resp.body.responses for p in t.partition_responses]
    keys = [uuid.UUID(int=1), uuid.UUID(int=2)] if version >= 13 else ["a", "b"]
    assert got == [(keys[0], 0, 29, -1), (keys[0], 1, 29, -1), (keys[1], 7, 29, -1)]


@pytest.mark.parametrize("version", [4, 11, 13])
def test_respond_error_code_gives_every_fetch_partition_the_error(version):
    cls = body_class(FETCH, "request")
    body = cls(max_wait_ms=500, min_bytes=1, topics=[
        cls.FetchTopic(topic="a", topic_id=uuid.UUID(int=5), partitions=[
            cls.FetchPartition(partition=p, fetch_offset=10, partition_max_bytes=1024) for p in (2, 3)])])
    s = make_session(Refuse({FETCH}))
    resp = answered(s.client_frame(request_frame(FETCH, version, 5, body))[0], FETCH, version)
    topic = resp.body.responses[0]
    if version >= 13:
        assert topic.topic_id == uuid.UUID(int=5)
    else:
        assert topic.topic == "a"
    assert [(p.partition_index, p.error_code, p.high_watermark) for p in topic.partitions] == [
        (2, 29, -1), (3, 29, -1)]


def test_respond_with_a_body_is_sent_as_is():
    class Answer(Filter):
        request_api_keys = frozenset({METADATA})

        def on_request(self, ctx, exchange):
            return Respond(body=metadata_response([(9, "local", 1)]))

    s = make_session(Answer())
    resp = answered(s.client_frame(request_frame(METADATA, 5, 3, metadata_request()))[0], METADATA, 5)
    assert resp.correlation_id == 3
    assert [(b.node_id, b.host, b.port) for b in resp.body.brokers] == [(9, "local", 1)]


def test_respond_for_an_api_without_error_codes_closes():
    # An empty Produce has no partition to carry the error: a "success" would be a lie.
    s = make_session(Refuse({PRODUCE}))
    out = s.client_frame(request_frame(PRODUCE, 9, 1, produce_request(topics=())))
    assert kinds(out) == [Close]
    assert "Produce" in out[0].reason or "produce" in out[0].reason


def test_delay_holds_before_forwarding():
    class Slow(Filter):
        request_api_keys = frozenset({METADATA})

        def on_request(self, ctx, exchange):
            return Delay(0.5)

    s = make_session(Slow())
    out = s.client_frame(request_frame(METADATA, 4, 1, metadata_request()))
    assert kinds(out) == [Hold, ToUpstream]
    assert out[0].seconds == 0.5
    assert s.awaiting_upstream == 1


def test_delay_then_respond_holds_before_answering():
    s = make_session(Refuse({PRODUCE}, delay=0.25))
    out = s.client_frame(request_frame(PRODUCE, 9, 1, produce_request()))
    assert kinds(out) == [Hold, ToClient]
    assert out[0].seconds == 0.25
    assert s.awaiting_upstream == 0


# -- throttling


class Throttle(Filter):
    response_api_keys = frozenset({METADATA})

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_response(self, ctx, exchange, response):
        return self.seconds


def test_throttle_from_a_response_holds_the_next_request():
    clock = Clock(100.0)
    s = make_session(Throttle(2.0), Throttle(0.5), clock=clock)
    up = forwarded(s.client_frame(request_frame(METADATA, 4, 1, metadata_request()))[0])
    out = s.upstream_frame(memoryview(response_frame(METADATA, 4, up.correlation_id, metadata_response())))
    assert kinds(out) == [ToClient]  # the answer itself is not held

    clock.now = 100.5
    out = s.client_frame(request_frame(METADATA, 4, 2, metadata_request()))
    assert kinds(out) == [Hold, ToUpstream]
    assert out[0].seconds == pytest.approx(1.5)  # the largest throttle, less the time gone by

    # Held once: the request after it goes straight through.
    assert kinds(s.client_frame(request_frame(METADATA, 4, 3, metadata_request()))) == [ToUpstream]


def test_a_throttle_is_told_in_the_answer_keeping_the_brokers_if_larger():
    clock = Clock(100.0)
    s = make_session(Throttle(1.2341), clock=clock)
    up = forwarded(s.client_frame(request_frame(METADATA, 12, 1, metadata_request()))[0])
    out = s.upstream_frame(memoryview(response_frame(METADATA, 12, up.correlation_id, metadata_response())))
    assert answered(out[0], METADATA, 12).body.throttle_time_ms == 1235    # whole ms, rounded up
    assert out[0].done[0].throttle_ms == 1235
    assert s.throttled_for(100.0) == pytest.approx(1.2341) and s.throttled_for(101.5) == 0.0
    body = metadata_response()
    body.throttle_time_ms = 7000
    up = forwarded(s.client_frame(request_frame(METADATA, 12, 2, metadata_request()))[-1])
    out = s.upstream_frame(memoryview(response_frame(METADATA, 12, up.correlation_id, body)))
    assert answered(out[0], METADATA, 12).body.throttle_time_ms == 7000
    # A version without throttle_time_ms (Metadata v2) is still muted, and answered as it came.
    up = forwarded(s.client_frame(request_frame(METADATA, 2, 3, metadata_request()))[-1])
    clock.now = 110.0
    out = s.upstream_frame(memoryview(response_frame(METADATA, 2, up.correlation_id, metadata_response())))
    assert kinds(out) == [ToClient] and s.throttled_for(110.0) == pytest.approx(1.2341)


def test_a_throttled_connection_still_gets_every_answer_already_owed_in_order():
    s = make_session(Throttle(3.0))
    ups = [forwarded(s.client_frame(request_frame(METADATA, 12, cid, metadata_request()))[0])
           for cid in (11, 12, 13)]
    got = []
    for up in ups:
        out = s.upstream_frame(memoryview(response_frame(METADATA, 12, up.correlation_id, metadata_response())))
        # Answers are never held: the wait is for the client's next request.
        assert kinds(out) == [ToClient]
        got.append(answered(out[0], METADATA, 12).correlation_id)
    assert got == [11, 12, 13] and s.throttled_for(100.0) == pytest.approx(3.0)


def test_a_throttle_verdict_forwards_the_request_and_mutes_the_connection():
    from kproxy.proxy.filters import Throttle as ThrottleVerdict

    class Mute(Filter):
        request_api_keys = frozenset({PRODUCE})

        def on_request(self, ctx, exchange):
            return ThrottleVerdict(0.75)

    s = make_session(Mute())
    out = s.client_frame(request_frame(PRODUCE, 9, 1, produce_request(acks=0)))
    assert kinds(out) == [ToUpstream] and out[0].entry.outcome == "no_response"
    assert s.throttled_for(100.0) == pytest.approx(0.75)
    out = s.client_frame(request_frame(PRODUCE, 9, 2, produce_request(acks=0)))
    assert kinds(out) == [Hold, ToUpstream] and out[0].seconds == pytest.approx(0.75)


def test_handling_time_counts_the_session_work_on_a_request_and_its_answer():
    class Busy(Filter):
        request_api_keys = response_api_keys = frozenset({METADATA})
        seen: list[float] = []

        def on_request(self, ctx, exchange):
            ctx.clock.now += 0.003

        def on_response(self, ctx, exchange, response):
            ctx.clock.now += 0.002
            self.seen.append(exchange.handling_s)
            return 0.0

    clock = Clock(100.0)
    s = make_session(Busy(), clock=clock)
    up = forwarded(s.client_frame(request_frame(METADATA, 12, 1, metadata_request()))[0])
    clock.now = 150.0       # the broker's time is not kproxy's
    out = s.upstream_frame(memoryview(response_frame(METADATA, 12, up.correlation_id, metadata_response())))
    assert Busy.seen == [pytest.approx(0.003)]
    assert out[0].done[0].handling_s == pytest.approx(0.005)


def test_an_expired_throttle_holds_nothing():
    clock = Clock(100.0)
    s = make_session(Throttle(1.0), clock=clock)
    up = forwarded(s.client_frame(request_frame(METADATA, 4, 1, metadata_request()))[0])
    s.upstream_frame(memoryview(response_frame(METADATA, 4, up.correlation_id, metadata_response())))
    clock.now = 101.5
    assert kinds(s.client_frame(request_frame(METADATA, 4, 2, metadata_request()))) == [ToUpstream]


# -- malformed input


def test_malformed_request_closes_naming_the_field_path():
    s = make_session()
    frame = request_frame(PRODUCE, 3, 1, produce_request())
    out = s.client_frame(frame[:-2])
    assert kinds(out) == [Close]
    assert "produce.v3.topic_data[0].partition_data[1].records" in out[0].reason
    assert s.awaiting_upstream == 0


def test_request_shorter_than_a_header_closes():
    out = make_session().client_frame(memoryview(b"\x00\x03\x00"))
    assert kinds(out) == [Close]


def test_response_with_an_unknown_correlation_id_closes():
    s = make_session()
    up = forwarded(s.client_frame(request_frame(METADATA, 4, 1, metadata_request()))[0])
    out = s.upstream_frame(memoryview(response_frame(METADATA, 4, up.correlation_id + 1000,
                                                     metadata_response())))
    assert kinds(out) == [Close]
    assert str(up.correlation_id + 1000) in out[0].reason


def test_a_response_answered_twice_closes():
    s = make_session()
    up = forwarded(s.client_frame(request_frame(METADATA, 4, 1, metadata_request()))[0])
    frame = memoryview(response_frame(METADATA, 4, up.correlation_id, metadata_response()))
    assert kinds(s.upstream_frame(frame)) == [ToClient]
    assert kinds(s.upstream_frame(frame)) == [Close]


def test_malformed_response_closes():
    s = make_session()
    up = forwarded(s.client_frame(request_frame(METADATA, 4, 1, metadata_request()))[0])
    frame = response_frame(METADATA, 4, up.correlation_id, metadata_response())
    out = s.upstream_frame(memoryview(frame[:-3]))
    assert kinds(out) == [Close]
    assert "Metadata v4" in out[0].reason or "metadata" in out[0].reason.lower()


# -- answers nobody reads pass on undecoded


class Reads(Filter):
    """Reads Produce answers from ``since`` on (``reads_response``); counts what it saw."""

    name = "reads"
    response_api_keys = frozenset({PRODUCE})
    reports_changes = True

    def __init__(self, since: int) -> None:
        self.since = since
        self.seen = 0

    def reads_response(self, api_key, api_version):
        return api_version >= self.since

    def on_response(self, ctx, exchange, response):
        self.seen += 1
        return 0.0


def _produce_round_trip(s: Session, version: int, tail: bytes = b"") -> tuple[bytes, bytes, list]:
    up = forwarded(s.client_frame(request_frame(PRODUCE, version, 7, produce_request()))[0])
    frame = response_frame(PRODUCE, version, up.correlation_id, produce_response()) + tail
    out = s.upstream_frame(memoryview(frame))
    assert kinds(out) == [ToClient]
    return frame, wire(out[0]), out


@pytest.mark.parametrize("read_answers, since, undecoded", [
    (False, 10, True),      # the filter has nothing to do at v9, nothing else reads: never decoded
    (False, 9, False),      # the filter reads v9 answers
    (True, 10, False),      # telemetry reads every answer
])
def test_an_answer_nobody_reads_goes_on_as_received_without_decoding(read_answers, since, undecoded):
    f = Reads(since)
    s = Session(ConnectionContext(1, clock=Clock()), FilterChain([f]), read_answers=read_answers)
    frame, sent, out = _produce_round_trip(s, 9)
    # Either way the client gets the broker's bytes with its own correlation id.
    assert sent == struct.pack(">i", 7) + frame[4:]
    assert f.seen == (0 if undecoded else 1)
    (entry,) = out[0].done
    assert (entry.response is None) is undecoded


def test_an_undecoded_answer_is_not_checked_either():
    # What is never decoded is never refused: bytes the codec would reject go on as the broker sent
    # them (the framing, which the reader checks, is all kproxy vouches for).
    s = Session(ConnectionContext(1, clock=Clock()), FilterChain([Reads(10)]), read_answers=False)
    _, sent, _ = _produce_round_trip(s, 9, tail=b"\xff\xff")
    assert sent.endswith(b"\xff\xff")


def test_answers_the_session_reads_itself_are_always_decoded():
    s = Session(ConnectionContext(1, clock=Clock()), FilterChain([]), read_answers=False)
    up = forwarded(s.client_frame(request_frame(API_VERSIONS, 3, 1, body_class(API_VERSIONS, "request")(
        client_software_name="app", client_software_version="1")))[0])
    out = s.upstream_frame(memoryview(response_frame(API_VERSIONS, 3, up.correlation_id, api_versions_response())))
    (entry,) = out[0].done
    assert entry.response is not None


# -- broker connection lost


def test_upstream_lost_answers_produce_per_partition_and_groups_with_coordinator_errors():
    s = make_session()
    s.client_frame(request_frame(PRODUCE, 9, 10, produce_request(topics=(("a", (0, 1)), ("b", (4,))))))
    s.client_frame(request_frame(HEARTBEAT, 4, 11, heartbeat_request()))
    oc = body_class(OFFSET_COMMIT, "request")
    s.client_frame(request_frame(OFFSET_COMMIT, 8, 12, oc(group_id="g", member_id="m", topics=[
        oc.OffsetCommitRequestTopic(name="a", partitions=[
            oc.OffsetCommitRequestPartition(partition_index=0, committed_offset=5)])])))
    s.client_frame(request_frame(PRODUCE, 9, 13, produce_request(acks=0)))  # never answered

    out = s.upstream_lost("connection reset")
    assert kinds(out) == [ToClient, ToClient, ToClient]
    produce = answered(out[0], PRODUCE, 9)
    assert produce.correlation_id == 10
    assert [(t.name, p.index, p.error_code) for t in produce.body.responses
            for p in t.partition_responses] == [("a", 0, 6), ("a", 1, 6), ("b", 4, 6)]
    heartbeat = answered(out[1], HEARTBEAT, 4)
    assert (heartbeat.correlation_id, heartbeat.body.error_code) == (11, 15)
    commit = answered(out[2], OFFSET_COMMIT, 8)
    assert commit.correlation_id == 12
    assert [p.error_code for p in commit.body.topics[0].partitions] == [15]
    assert s.awaiting_upstream == 0 and not s.in_flight


@pytest.mark.parametrize(("api_key", "version", "body"), [
    (METADATA, 12, metadata_request()),
    (API_VERSIONS, 3, body_class(API_VERSIONS, "request")(client_software_name="x",
                                                          client_software_version="1")),
])
def test_upstream_lost_closes_for_metadata_and_api_versions(api_key, version, body):
    s = make_session()
    s.client_frame(request_frame(api_key, version, 1, body))
    out = s.upstream_lost("eof")
    assert kinds(out) == [Close]
    assert "eof" in out[0].reason


def test_upstream_lost_answers_earlier_requests_before_closing():
    s = make_session()
    s.client_frame(request_frame(HEARTBEAT, 4, 1, heartbeat_request()))
    s.client_frame(request_frame(METADATA, 12, 2, metadata_request()))
    s.client_frame(request_frame(HEARTBEAT, 4, 3, heartbeat_request()))
    out = s.upstream_lost("eof")
    assert kinds(out) == [ToClient, Close]
    assert answered(out[0], HEARTBEAT, 4).correlation_id == 1


def test_upstream_lost_with_nothing_waiting_does_nothing():
    assert make_session().upstream_lost("eof") == []


# -- SASL


def sasl_handshake(s: Session, mechanism: str, version: int = 1, error_code: int = 0) -> None:
    req = body_class(SASL_HANDSHAKE, "request")(mechanism=mechanism)
    up = forwarded(s.client_frame(request_frame(SASL_HANDSHAKE, version, 1, req))[0])
    resp = body_class(SASL_HANDSHAKE, "response")(error_code=error_code, mechanisms=[mechanism])
    out = s.upstream_frame(memoryview(response_frame(SASL_HANDSHAKE, version, up.correlation_id, resp)))
    assert answered(out[0], SASL_HANDSHAKE, version).body.error_code == error_code


def sasl_authenticate(s: Session, token: bytes, error_code: int = 0, cid: int = 2) -> Response:
    req = body_class(SASL_AUTHENTICATE, "request")(auth_bytes=token)
    up = forwarded(s.client_frame(request_frame(SASL_AUTHENTICATE, 2, cid, req))[0])
    resp = body_class(SASL_AUTHENTICATE, "response")(error_code=error_code, auth_bytes=b"server")
    out = s.upstream_frame(memoryview(response_frame(SASL_AUTHENTICATE, 2, up.correlation_id, resp)))
    return answered(out[0], SASL_AUTHENTICATE, 2)


def test_sasl_plain_sets_the_principal_only_after_success():
    s = make_session()
    sasl_handshake(s, "PLAIN")
    assert s.ctx.sasl_mechanism == "PLAIN" and s.sasl_in_progress
    req = body_class(SASL_AUTHENTICATE, "request")(auth_bytes=b"\x00alice\x00secret")
    up = forwarded(s.client_frame(request_frame(SASL_AUTHENTICATE, 2, 2, req))[0])
    assert s.ctx.principal is None and not s.ctx.authenticated  # asked, not yet accepted
    resp = body_class(SASL_AUTHENTICATE, "response")(error_code=0, auth_bytes=b"")
    s.upstream_frame(memoryview(response_frame(SASL_AUTHENTICATE, 2, up.correlation_id, resp)))
    assert s.ctx.authenticated
    assert s.ctx.principal == "User:alice"
    assert not s.sasl_in_progress


def test_sasl_plain_failure_sets_no_principal():
    s = make_session(tls_subject="CN=client")
    sasl_handshake(s, "PLAIN")
    resp = sasl_authenticate(s, b"\x00mallory\x00guess", error_code=SASL_AUTHENTICATION_FAILED)
    assert resp.body.error_code == SASL_AUTHENTICATION_FAILED
    assert not s.ctx.authenticated
    assert s.ctx.sasl_user is None
    assert s.ctx.principal == "User:CN=client"
    # A later request does not promote the failed attempt either.
    s.client_frame(request_frame(METADATA, 4, 3, metadata_request()))
    assert s.ctx.sasl_user is None and s.ctx.principal == "User:CN=client"


def test_sasl_scram_sets_the_principal_after_the_final_exchange():
    s = make_session()
    sasl_handshake(s, "SCRAM-SHA-256")
    sasl_authenticate(s, b"n,,n=b=2Cob=3D,r=clientnonce", cid=2)
    assert s.ctx.principal is None and s.sasl_in_progress  # server-first is no verdict yet
    sasl_authenticate(s, b"c=biws,r=clientnonceservernonce,p=proof", cid=3)
    assert s.ctx.authenticated
    assert s.ctx.principal == "User:b,ob="


def test_sasl_scram_failure_on_the_final_exchange_sets_no_principal():
    s = make_session()
    sasl_handshake(s, "SCRAM-SHA-512")
    sasl_authenticate(s, b"n,,n=bob,r=nonce", cid=2)
    sasl_authenticate(s, b"c=biws,r=nonce2,p=wrong", error_code=SASL_AUTHENTICATION_FAILED, cid=3)
    assert not s.ctx.authenticated and s.ctx.principal is None and not s.sasl_in_progress


def test_sasl_handshake_failure_ends_sasl():
    s = make_session()
    sasl_handshake(s, "GSSAPI", error_code=33)
    assert not s.sasl_in_progress
    s.client_frame(request_frame(METADATA, 4, 3, metadata_request()))
    assert not s.ctx.authenticated


@pytest.mark.parametrize(("mechanism", "token", "user"), [
    ("PLAIN", b"\x00alice\x00pw", "alice"),
    ("PLAIN", b"admin\x00alice\x00pw", "alice"),
    ("PLAIN", b"admin\x00\x00pw", "admin"),
    ("PLAIN", b"no separators", None),
    ("SCRAM-SHA-256", b"n,,n=carol,r=abc", "carol"),
    ("SCRAM-SHA-512", b"n,a=zed,n=c=3Dd=2Ce,r=abc", "c=d,e"),
    ("SCRAM-SHA-256", b"n,,r=abc", None),
    ("GSSAPI", b"\x60\x82opaque", None),
    (None, b"\x00alice\x00pw", None),
])
def test_sasl_user(mechanism, token, user):
    assert sasl_user(mechanism, memoryview(token)) == user


def test_sasl_handshake_v0_relays_raw_tokens_both_ways_then_frames_again():
    s = make_session()
    sasl_handshake(s, "PLAIN", version=0)

    # The client's raw token (no Kafka header) goes upstream byte for byte.
    token = b"\x00alice\x00secret-password"
    out = s.client_frame(memoryview(token))
    assert kinds(out) == [ToUpstream]
    assert wire(out[0]) == token
    assert s.ctx.principal is None and s.awaiting_upstream == 0

    # The broker's raw answer (empty for PLAIN) comes back as it is, with its size prefix.
    out = s.upstream_frame(memoryview(b""))
    assert kinds(out) == [ToClient]
    assert b"".join(bytes(b) for b in out[0].buffers) == b"\x00\x00\x00\x00"

    # The next whole request ends the raw exchange: the broker accepted the client.
    up = forwarded(s.client_frame(request_frame(METADATA, 9, 5, metadata_request()))[0])
    assert s.ctx.authenticated and s.ctx.principal == "User:alice"
    out = s.upstream_frame(memoryview(response_frame(METADATA, 9, up.correlation_id, metadata_response())))
    assert answered(out[0], METADATA, 9).correlation_id == 5


def test_sasl_handshake_v0_relays_short_and_header_like_raw_tokens():
    s = make_session()
    sasl_handshake(s, "SCRAM-SHA-256", version=0)
    for token in (b"n,,n=dave,r=nonce0123", b"abc", b"\x00\x12\x7f\x00garbage"):
        out = s.client_frame(memoryview(token))
        assert kinds(out) == [ToUpstream] and wire(out[0]) == token
        server = b"r=nonce0123server,s=salt,i=4096"
        out = s.upstream_frame(memoryview(server))
        assert kinds(out) == [ToClient] and wire(out[0]) == server
    s.client_frame(request_frame(METADATA, 9, 5, metadata_request()))
    assert s.ctx.principal == "User:dave"


# -- versions kproxy cannot decode


def test_api_versions_of_an_unknown_version_is_answered_locally_in_v0():
    s = make_session()
    frame = bytearray(request_frame(API_VERSIONS, 3, 31, body_class(API_VERSIONS, "request")()))
    struct.pack_into(">h", frame, 2, 99)
    out = s.client_frame(memoryview(frame))
    assert kinds(out) == [ToClient]
    resp = answered(out[0], API_VERSIONS, 0)
    assert resp.correlation_id == 31
    assert resp.body.error_code == 35
    lo, hi = supported_versions()[API_VERSIONS]
    assert [(k.api_key, k.min_version, k.max_version) for k in resp.body.api_keys] == [(18, lo, hi)]
    assert s.awaiting_upstream == 0


def test_api_versions_of_an_unknown_version_waits_its_turn():
    s = make_session()
    up = forwarded(s.client_frame(request_frame(METADATA, 4, 1, metadata_request()))[0])
    frame = bytearray(request_frame(API_VERSIONS, 3, 2, body_class(API_VERSIONS, "request")()))
    struct.pack_into(">h", frame, 2, 99)
    assert s.client_frame(memoryview(frame)) == []
    out = s.upstream_frame(memoryview(response_frame(METADATA, 4, up.correlation_id, metadata_response())))
    assert [answered(a, k, v).correlation_id for a, (k, v) in zip(out, [(METADATA, 4), (API_VERSIONS, 0)],
                                                                 strict=True)] == [1, 2]


def test_broker_answering_api_versions_in_v0_is_decoded_as_v0():
    # KIP-511: a broker that does not know the requested version answers in v0 with error 35.
    s = make_session()
    up = forwarded(s.client_frame(request_frame(API_VERSIONS, 4, 8, body_class(API_VERSIONS, "request")()))[0])
    body = body_class(API_VERSIONS, "response")(error_code=35, api_keys=[
        body_class(API_VERSIONS, "response").ApiVersion(api_key=18, min_version=0, max_version=3)])
    out = s.upstream_frame(memoryview(response_frame(API_VERSIONS, 0, up.correlation_id, body)))
    resp = answered(out[0], API_VERSIONS, 0)
    assert resp.correlation_id == 8 and resp.body.error_code == 35
    assert resp.body.api_keys[0].max_version == 3


def unknown_version_frame(correlation_id: int) -> bytes:
    # Metadata v99: a header kproxy can read, a body it cannot.
    return struct.pack(">hhih", METADATA, 99, correlation_id, 3) + b"app" + b"\x01\x02opaque body\xff"


def test_unknown_version_closes_without_passthrough():
    out = make_session().client_frame(memoryview(unknown_version_frame(4)))
    assert kinds(out) == [Close]
    assert "passthrough_unknown_versions" in out[0].reason


def test_passthrough_forwards_unknown_versions_with_only_the_correlation_id_patched():
    s = make_session(passthrough=True)
    frame = unknown_version_frame(1234)
    out = s.client_frame(memoryview(frame))
    assert kinds(out) == [ToUpstream]
    sent = wire(out[0])
    assert len(sent) == len(frame)
    assert sent[:4] == frame[:4] and sent[8:] == frame[8:]
    (upstream_id,) = struct.unpack_from(">i", sent, 4)
    assert upstream_id != 1234
    assert s.awaiting_upstream == 1

    response = struct.pack(">i", upstream_id) + b"\x00\x00whatever the broker says\x00"
    out = s.upstream_frame(memoryview(response))
    assert kinds(out) == [ToClient]
    back = wire(out[0])
    assert struct.unpack_from(">i", back, 0) == (1234,)
    assert back[4:] == response[4:]
    assert s.awaiting_upstream == 0


def test_passthrough_keeps_order_with_decoded_requests():
    s = make_session(passthrough=True)
    opaque = struct.unpack_from(">i", wire(s.client_frame(memoryview(unknown_version_frame(1)))[0]), 4)[0]
    meta = forwarded(s.client_frame(request_frame(METADATA, 4, 2, metadata_request()))[0])
    assert s.upstream_frame(memoryview(response_frame(METADATA, 4, meta.correlation_id,
                                                      metadata_response()))) == []
    out = s.upstream_frame(memoryview(struct.pack(">i", opaque) + b"\x00"))
    assert kinds(out) == [ToClient, ToClient]
    assert struct.unpack_from(">i", wire(out[0]), 0) == (1,)
    assert answered(out[1], METADATA, 4).correlation_id == 2


def test_upstream_lost_closes_for_passthrough_frames():
    s = make_session(passthrough=True)
    s.client_frame(memoryview(unknown_version_frame(1)))
    assert kinds(s.upstream_lost("eof")) == [Close]


# -- context and lifecycle


def test_client_id_and_software_are_recorded():
    s = make_session()
    req = body_class(API_VERSIONS, "request")(client_software_name="librdkafka", client_software_version="2.4")
    s.client_frame(request_frame(API_VERSIONS, 3, 1, req, client_id="orders"))
    assert s.ctx.client_id == "orders"
    assert (s.ctx.client_software_name, s.ctx.client_software_version) == ("librdkafka", "2.4")


def test_every_request_completes_once_on_the_action_that_finishes_it():
    closed = []

    class Watch(Filter):
        def on_close(self, ctx):
            closed.append(ctx.connection_id)

    s = Session(ConnectionContext(7), FilterChain([Watch()]))
    up = forwarded(s.client_frame(request_frame(METADATA, 4, 3, metadata_request()))[0])
    out = s.upstream_frame(memoryview(response_frame(METADATA, 4, up.correlation_id, metadata_response())))
    (entry,) = out[0].done
    assert (entry.api_key, entry.client_correlation_id, entry.outcome) == (METADATA, 3, "forwarded")
    assert entry.response_bytes == sum(len(b) for b in out[0].buffers)
    assert entry.response is not None and entry.response.body.brokers
    s.close()
    s.close()
    assert closed == [7]


def future_produce_frame(correlation_id: int, acks: int) -> bytes:
    # Produce v99: header v2 (client id "app", one tagged field), then transactional_id null and
    # acks, as every flexible Produce version starts; then a body kproxy cannot read.
    header = struct.pack(">hhih", 0, 99, correlation_id, 3) + b"app" + b"\x01\x05\x02zz"
    return header + b"\x00" + struct.pack(">hi", acks, 1000) + b"\x07future fields"


@pytest.mark.parametrize(("acks", "waits"), [(0, False), (1, True), (-1, True)])
def test_passthrough_produce_of_a_future_version_waits_only_when_acked(acks, waits):
    s = make_session(passthrough=True)
    out = s.client_frame(memoryview(future_produce_frame(77, acks)))
    assert kinds(out) == [ToUpstream]
    assert s.awaiting_upstream == (1 if waits else 0)
    # A request behind an acks=0 one is answered without waiting for it.
    out = s.client_frame(memoryview(unknown_version_frame(78)))
    (upstream_id,) = struct.unpack_from(">i", wire(out[0]), 4)
    out = s.upstream_frame(memoryview(struct.pack(">i", upstream_id) + b"\x00\x00"))
    assert kinds(out) == ([] if waits else [ToClient])


# -- identity: only what the broker accepted (the forged-principal attack)


class SeesPrincipal(Filter):
    """Records the identity a policy filter would act on, per api key."""

    request_api_keys = frozenset({METADATA})

    def __init__(self) -> None:
        self.seen: list[tuple[str | None, bool]] = []

    def on_request(self, ctx, exchange):
        self.seen.append((ctx.principal, ctx.authenticated))
        return None


def start_sasl(s: Session, mechanism: str = "PLAIN", version: int = 1, error_code: int = 0) -> None:
    sasl_handshake(s, mechanism, version=version, error_code=error_code)


@pytest.mark.parametrize("tls_subject", [None, "CN=low-privilege"])
def test_a_request_pipelined_behind_an_unanswered_authenticate_is_judged_without_the_claim(tls_subject):
    watch = SeesPrincipal()
    s = make_session(watch, tls_subject=tls_subject)
    start_sasl(s)
    auth = body_class(SASL_AUTHENTICATE, "request")(auth_bytes=b"\x00admin\x00wrong-password")
    up = forwarded(s.client_frame(request_frame(SASL_AUTHENTICATE, 2, 2, auth))[0])
    s.client_frame(request_frame(METADATA, 12, 3, metadata_request()))
    expected = f"User:{tls_subject}" if tls_subject else None
    assert watch.seen == [(expected, False)]
    # The broker refuses: nothing of the claim survives, for the rest of the connection either.
    resp = body_class(SASL_AUTHENTICATE, "response")(error_code=SASL_AUTHENTICATION_FAILED)
    s.upstream_frame(memoryview(response_frame(SASL_AUTHENTICATE, 2, up.correlation_id, resp)))
    s.client_frame(request_frame(METADATA, 12, 4, metadata_request()))
    assert watch.seen[-1] == (expected, False)
    assert s.ctx.sasl_user is None


def test_a_broker_without_sasl_never_turns_a_claimed_user_into_a_principal():
    # tansu without --authentication answers the handshake with UNSUPPORTED_SASL_MECHANISM (33) and
    # SaslAuthenticate with ILLEGAL_SASL_STATE (34); Apache Kafka's plaintext listeners refuse alike.
    watch = SeesPrincipal()
    s = make_session(watch)
    start_sasl(s, error_code=33)
    assert sasl_authenticate(s, b"\x00admin\x00anything", error_code=34).body.error_code == 34
    s.client_frame(request_frame(METADATA, 12, 3, metadata_request()))
    assert watch.seen == [(None, False)]


def test_an_authenticate_success_without_an_accepted_handshake_is_not_trusted():
    s = make_session()
    start_sasl(s, error_code=33)
    sasl_authenticate(s, b"\x00admin\x00anything", error_code=0)
    assert s.ctx.principal is None and not s.ctx.authenticated


def test_failed_reauthentication_clears_the_identity_established_before():
    watch = SeesPrincipal()
    s = make_session(watch, tls_subject="CN=app")
    start_sasl(s)
    sasl_authenticate(s, b"\x00alice\x00right")
    assert s.ctx.principal == "User:alice"
    # KIP-368: the client authenticates again on the same connection, and this time fails.
    start_sasl(s)
    auth = body_class(SASL_AUTHENTICATE, "request")(auth_bytes=b"\x00admin\x00wrong")
    up = forwarded(s.client_frame(request_frame(SASL_AUTHENTICATE, 2, 7, auth))[0])
    s.client_frame(request_frame(METADATA, 12, 8, metadata_request()))
    assert watch.seen == [("User:alice", True)]        # judged with the identity before, not the claim
    resp = body_class(SASL_AUTHENTICATE, "response")(error_code=SASL_AUTHENTICATION_FAILED)
    s.upstream_frame(memoryview(response_frame(SASL_AUTHENTICATE, 2, up.correlation_id, resp)))
    assert not s.ctx.authenticated and s.ctx.sasl_user is None
    assert s.ctx.principal == "User:CN=app"


def test_sasl_v0_raw_token_counts_only_once_the_broker_answers_it():
    watch = SeesPrincipal()
    s = make_session(watch)
    start_sasl(s, version=0)
    assert kinds(s.client_frame(memoryview(b"\x00admin\x00wrong"))) == [ToUpstream]
    # Pipelined right behind the raw token, before the broker's verdict.
    s.client_frame(request_frame(METADATA, 12, 3, metadata_request()))
    assert watch.seen == [(None, False)]
    assert not s.ctx.authenticated


def test_other_mechanisms_authenticate_without_a_sasl_user():
    s = make_session(tls_subject="CN=svc")
    start_sasl(s, "OAUTHBEARER")
    sasl_authenticate(s, b"n,,\x01auth=Bearer eyJ.claims.sig\x01\x01")
    assert s.sasl_in_progress            # kproxy does not count OAUTHBEARER round trips
    up = forwarded(s.client_frame(request_frame(METADATA, 12, 3, metadata_request()))[0])
    s.upstream_frame(memoryview(response_frame(METADATA, 12, up.correlation_id, metadata_response())))
    # The broker answered a non-SASL request, so it accepted; no user name kproxy could verify.
    assert s.ctx.authenticated and s.ctx.sasl_user is None
    assert s.ctx.principal == "User:CN=svc"


# -- faults in filters stay on their connection


class Raises(Filter):
    request_api_keys = frozenset({METADATA})
    response_api_keys = frozenset({METADATA})

    def __init__(self, hook: str) -> None:
        self.name = f"raises-in-{hook}"
        self.hook = hook

    def on_request(self, ctx, exchange):
        if self.hook == "on_request":
            raise RuntimeError("boom")
        return None

    def on_response(self, ctx, exchange, response):
        if self.hook == "on_response":
            raise RuntimeError("boom")
        return 0.0

    def on_close(self, ctx):
        if self.hook == "on_close":
            raise RuntimeError("boom")


def test_a_filter_that_raises_on_a_request_closes_the_connection_with_a_reason(caplog):
    s = make_session(Raises("on_request"))
    out = s.client_frame(request_frame(METADATA, 12, 1, metadata_request()))
    assert kinds(out) == [Close]
    assert "raises-in-on_request" in out[0].reason
    assert "Traceback" in caplog.text and "boom" in caplog.text


def test_a_filter_that_raises_on_a_response_closes_the_connection_with_a_reason():
    s = make_session(Raises("on_response"))
    up = forwarded(s.client_frame(request_frame(METADATA, 12, 1, metadata_request()))[0])
    out = s.upstream_frame(memoryview(response_frame(METADATA, 12, up.correlation_id, metadata_response())))
    assert kinds(out) == [Close]
    assert "raises-in-on_response" in out[0].reason


def test_every_on_close_runs_even_when_one_raises():
    closed = []

    class Watch(Filter):
        def __init__(self, name):
            self.name = name

        def on_close(self, ctx):
            closed.append(self.name)

    s = make_session(Watch("first"), Raises("on_close"), Watch("last"))
    s.close()                      # must not raise
    assert closed == ["first", "last"]


# -- outcomes: one completed entry per request, delivered on the action that finishes it


def test_a_local_answer_completes_with_outcome_local_and_the_response():
    s = make_session(Refuse({METADATA}))
    out = s.client_frame(request_frame(METADATA, 12, 1, metadata_request()))
    (entry,) = out[-1].done
    assert entry.outcome == "local" and entry.response is not None
    assert entry.response_bytes == sum(len(b) for b in out[-1].buffers)


def test_an_acks_0_produce_completes_when_written_to_the_broker():
    s = make_session()
    (action,) = s.client_frame(request_frame(PRODUCE, 9, 1, produce_request(acks=0)))
    assert isinstance(action, ToUpstream)
    assert action.entry is not None and action.entry.outcome == "no_response"


def test_requests_failed_by_a_lost_broker_complete_as_upstream_lost():
    s = make_session()
    s.client_frame(request_frame(HEARTBEAT, 4, 1, heartbeat_request()))
    s.client_frame(request_frame(METADATA, 12, 2, metadata_request()))
    out = s.upstream_lost("eof")
    assert [e.outcome for a in out for e in a.done] == ["upstream_lost", "upstream_lost"]
    assert kinds(out) == [ToClient, Close]


def test_filters_can_note_decisions_on_the_entry():
    class Tags(Filter):
        request_api_keys = frozenset({METADATA})

        def on_request(self, ctx, exchange):
            exchange.note("rule", "allow-all")
            return None

    s = make_session(Tags())
    up = forwarded(s.client_frame(request_frame(METADATA, 12, 1, metadata_request()))[0])
    out = s.upstream_frame(memoryview(response_frame(METADATA, 12, up.correlation_id, metadata_response())))
    assert out[0].done[0].notes == {"rule": "allow-all"}


# -- a filter asks the broker before deciding (AskBroker)


class Asker(Filter):
    """Asks the broker a Metadata question about every Heartbeat; refuses it when the answer names no
    broker (or there is none), else forwards it. Records what it was told."""

    name = "asker"
    request_api_keys = frozenset({HEARTBEAT})

    def __init__(self) -> None:
        self.answers: list = []

    def on_request(self, ctx, exchange):
        question = Request.build(METADATA, 12, 0, "kproxy", metadata_request(()))

        def then(answer):
            self.answers.append(answer)
            assert exchange.api_key == HEARTBEAT
            if answer is None or not answer.body.brokers:
                return Respond(TOPIC_AUTHORIZATION_FAILED)
            return None

        return AskBroker(question, then)


def question_of(action) -> Request:
    assert isinstance(action, Ask)
    return decode_request(wire(action))


def test_a_question_goes_to_the_broker_and_the_request_waits_for_its_answer():
    class After(Filter):
        request_api_keys = frozenset({HEARTBEAT})
        seen: list[int] = []

        def on_request(self, ctx, exchange):
            request = exchange.request
            self.seen.append(request.api_key)

    asker, after = Asker(), After()
    s = make_session(asker, after)
    up_meta = forwarded(s.client_frame(request_frame(METADATA, 12, 1, metadata_request()))[0])
    (ask,) = s.client_frame(request_frame(HEARTBEAT, 4, 2, heartbeat_request()))
    q = question_of(ask)
    assert (q.api_key, q.api_version, q.client_id) == (METADATA, 12, "kproxy")
    assert q.correlation_id != up_meta.correlation_id and s.asking is not None and after.seen == []
    # The earlier request's answer still goes out while the question is pending.
    out = s.upstream_frame(memoryview(response_frame(METADATA, 12, up_meta.correlation_id, metadata_response())))
    assert kinds(out) == [ToClient]
    out = s.upstream_frame(memoryview(response_frame(METADATA, 12, q.correlation_id, metadata_response())))
    assert s.asking is None and len(asker.answers) == 1 and after.seen == [HEARTBEAT]
    up = forwarded(out[0])
    assert up.api_key == HEARTBEAT and up.correlation_id not in (q.correlation_id, up_meta.correlation_id)
    done = s.upstream_frame(memoryview(response_frame(HEARTBEAT, 4, up.correlation_id,
                                                      body_class(HEARTBEAT, "response")())))
    assert done[0].done[0].client_correlation_id == 2 and done[0].done[0].outcome == "forwarded"


def test_the_answer_can_make_the_filter_answer_locally():
    asker = Asker()
    s = make_session(asker)
    q = question_of(s.client_frame(request_frame(HEARTBEAT, 4, 2, heartbeat_request()))[0])
    out = s.upstream_frame(memoryview(response_frame(METADATA, 12, q.correlation_id, metadata_response(()))))
    assert answered(out[0], HEARTBEAT, 4).body.error_code == TOPIC_AUTHORIZATION_FAILED
    assert out[0].done[0].outcome == "local"


def test_no_answer_in_time_lets_the_filter_decide_without_one_and_drops_a_late_one():
    asker = Asker()
    s = make_session(asker)
    q = question_of(s.client_frame(request_frame(HEARTBEAT, 4, 2, heartbeat_request()))[0])
    out = s.question_unanswered("timed out")
    assert asker.answers == [None] and answered(out[0], HEARTBEAT, 4).body.error_code == TOPIC_AUTHORIZATION_FAILED
    assert s.upstream_frame(memoryview(response_frame(METADATA, 12, q.correlation_id, metadata_response()))) == []
    assert s.question_unanswered("again") == []


def test_a_lost_connection_settles_the_question_after_the_requests_before_it():
    asker = Asker()
    s = make_session(asker)
    s.client_frame(request_frame(METADATA, 12, 1, metadata_request()))
    s.client_frame(request_frame(HEARTBEAT, 4, 2, heartbeat_request()))
    out = s.upstream_lost("eof")
    # Metadata has no retriable error: the connection closes, and the asking request ends with it.
    assert kinds(out) == [Close] and s.asking is None
    assert [e.client_correlation_id for e in out[0].done] == [1, 2]


def test_a_lost_connection_with_only_the_question_pending_lets_the_filter_decide():
    asker = Asker()
    s = make_session(asker)
    s.client_frame(request_frame(HEARTBEAT, 4, 2, heartbeat_request()))
    out = s.upstream_lost("eof")
    assert asker.answers == [None] and kinds(out) == [ToClient]
    assert out[0].done[0].client_correlation_id == 2


def test_a_question_to_an_unanswerable_authenticated_connection_closes():
    s = make_session(Asker())
    sasl_handshake(s, "PLAIN")
    sasl_authenticate(s, b"\x00alice\x00secret")
    s.client_frame(request_frame(HEARTBEAT, 4, 9, heartbeat_request()))
    out = s.upstream_lost("eof")
    assert kinds(out) == [Close] and [e.client_correlation_id for e in out[0].done] == [9]


class Prefix(Filter):
    """Renames topic t to p.t in Produce requests and back in the answers."""

    name = "prefix"
    request_api_keys = response_api_keys = frozenset({PRODUCE})

    def on_request(self, ctx, exchange):
        request = exchange.request
        for t in request.body.topic_data:
            t.name = "p." + t.name

    def on_response(self, ctx, exchange, response):
        for t in response.body.responses:
            t.name = t.name.removeprefix("p.")
        return 0.0


def test_response_filters_see_the_errors_kproxy_makes_up_for_a_lost_broker():
    s = make_session(Prefix())
    assert forwarded(s.client_frame(request_frame(PRODUCE, 9, 1, produce_request()))[0]).body.topic_data[0].name == "p.t"
    (out,) = s.upstream_lost("eof")
    resp = answered(out, PRODUCE, 9)
    assert [t.name for t in resp.body.responses] == ["t"]
    assert resp.body.responses[0].partition_responses[0].error_code == 6


def test_header_v0_requests_keep_the_client_id():
    s = make_session()
    s.client_frame(request_frame(METADATA, 12, 1, metadata_request(), client_id="orders"))
    s.client_frame(request_frame(7, 0, 2, body_class(7, "request")(broker_id=1)))
    assert s.ctx.client_id == "orders"


def test_the_decompression_limit_reaches_filters_through_the_context():
    from kproxy.config import config_from_args
    from kproxy.server.process import ProxyProcess

    cfg = config_from_args("127.0.0.1:9092", "127.0.0.1:19092",
                           limits={"max_decompressed_batch_bytes": 12345})
    seen = []

    class Reads(Filter):
        request_api_keys = frozenset({METADATA})

        def on_request(self, ctx, exchange):
            seen.append(ctx.max_decompressed_batch_bytes)

    server = ProxyProcess.from_config(cfg, [Reads()]).cluster()
    ctx = server.new_context(1, ("127.0.0.1", 5555))
    ctx.clock = Clock()                      # outside trio: the test's clock, not trio's
    Session(ctx, server.chain).client_frame(request_frame(METADATA, 12, 1, metadata_request()))
    assert seen == [12345]


@pytest.mark.parametrize("frame", [
    b"\x00\x00\x00\x0d\x00\x00\x00\x01" + b"\x00\x00" + b"\xff" * 6,   # header tagged-field count too long
    b"\x00\x00\x00\x0d\x00\x00\x00\x01" + b"\x00\x00\x00" + b"\xff\xff\xff\xff\xff\xff",  # txn id length
    b"\x00\x00\x00\x0d\x00\x00\x00\x01\x00",                               # cut inside the client id
])
def test_future_produce_acks_of_a_short_or_garbled_frame_is_unknown_not_an_error(frame):
    assert future_produce_acks(memoryview(frame)) is None


# -- every request read completes exactly once


_EVENT = st.one_of(
    st.just("forwarded"), st.just("local"), st.just("acks0"), st.just("refused_acks0"),
    st.tuples(st.just("answer"), st.integers(0, 7)), st.just("lost"), st.just("gone"),
)


@settings(max_examples=200, deadline=None, database=None)
@given(st.lists(_EVENT, max_size=40))
def test_every_request_read_completes_exactly_once(events):
    """Random requests, broker answers, lost broker connections and a client that goes away, driven
    through the session as the executor drives it: each request read is completed once, no more."""
    s = make_session(Refuse({HEARTBEAT}))
    completed: list = []
    closed = False

    def run(actions) -> None:
        nonlocal closed
        for a in actions:
            done = a.done if isinstance(a, ToClient | Close) else (
                (a.entry,) if isinstance(a, ToUpstream) and a.entry is not None and a.entry.outcome == "no_response"
                else ())
            for e in done:
                completed.append(e)
                s.finish(e)
            if isinstance(a, Close):
                closed = True
                return

    cid = 0
    for ev in events:
        if closed:
            break
        if ev == "forwarded":
            cid += 1
            run(s.client_frame(request_frame(METADATA, 12, cid, metadata_request())))
        elif ev == "local":
            cid += 1
            run(s.client_frame(request_frame(HEARTBEAT, 4, cid, heartbeat_request())))
        elif ev in ("acks0", "refused_acks0"):
            cid += 1
            body = produce_request(acks=0)
            api = PRODUCE
            if ev == "refused_acks0":   # refused by a filter: the connection closes after what is owed
                s.chain = FilterChain([Refuse({HEARTBEAT, PRODUCE})])
            run(s.client_frame(request_frame(api, 9, cid, body)))
            s.chain = FilterChain([Refuse({HEARTBEAT})])
        elif ev == "lost":
            run(s.upstream_lost("gone"))
        elif ev == "gone":
            break
        else:
            waiting = sorted(s._by_upstream)
            if waiting:
                up = waiting[ev[1] % len(waiting)]
                run(s.upstream_frame(memoryview(response_frame(METADATA, 12, up, metadata_response()))))
    # The connection ends (the client left, or kproxy closed it): the rest complete now.
    left = s.abandon("client_gone")
    for e in left:
        completed.append(e)
        s.finish(e)
    assert len(completed) == s.requests
    assert len({id(e) for e in completed}) == len(completed)
    assert not s.open


# -- answers no filter changed reach the client as the broker's own bytes


def _two_byte_tag_count(frame: bytes) -> bytes:
    """A flexible answer whose closing tagged-field count (0) is written in two bytes, 0x80 0x00:
    legal on the wire and decoded alike, but never how kproxy encodes it."""
    assert frame.endswith(b"\x00")
    return frame[:-1] + b"\x80\x00"


def _answer(session: Session, api_key: int, version: int, body, reply: bytes) -> bytes:
    """Send a request, answer it with ``reply`` (a frame with correlation id 0, patched to the
    upstream one); what the client gets, without its size prefix."""
    (up,) = session.client_frame(request_frame(api_key, version, 77, body))
    upstream_id = forwarded(up).correlation_id
    out = session.upstream_frame(memoryview(struct.pack(">i", upstream_id) + reply[4:]))
    assert isinstance(out[-1], ToClient) and out[-1].done
    return wire(out[-1])


def test_an_answer_no_filter_sees_is_the_brokers_bytes_with_the_clients_correlation_id():
    from kproxy.proxy.addresses import AddressMap, AddressRewriter

    session = make_session(AddressRewriter(AddressMap("proxy.example", 19000, 16)))
    reply = _two_byte_tag_count(response_frame(HEARTBEAT, 4, 0, body_class(HEARTBEAT, "response")(error_code=0)))
    got = _answer(session, HEARTBEAT, 4, heartbeat_request(), reply)
    assert got == struct.pack(">i", 77) + reply[4:]


def test_an_answer_the_address_rewriter_leaves_alone_is_not_encoded_again():
    from kproxy.proxy.addresses import AddressMap, AddressRewriter

    session = make_session(AddressRewriter(AddressMap("proxy.example", 19000, 16)))
    reply = _two_byte_tag_count(response_frame(PRODUCE, 10, 0, produce_response()))
    got = _answer(session, PRODUCE, 10, produce_request(), reply)
    assert got == struct.pack(">i", 77) + reply[4:]
    # With a KIP-951 endpoint to rewrite, the answer is encoded again, and the broker's address is gone.
    body = produce_response()
    body.node_endpoints = [type(body).NodeEndpoint(node_id=1, host="kafka-1.internal", port=9092)]
    got = _answer(session, PRODUCE, 10, produce_request(), response_frame(PRODUCE, 10, 0, body))
    assert b"kafka-1.internal" not in got and b"proxy.example" in got
    assert decode_response(got, PRODUCE, 10).body.node_endpoints[0].host == "proxy.example"


def test_an_answer_a_filter_sees_without_saying_what_it_changed_is_encoded_again():
    class Observer(Filter):
        response_api_keys = frozenset({HEARTBEAT})    # reports_changes stays False: any answer may change

    reply = _two_byte_tag_count(response_frame(HEARTBEAT, 4, 0, body_class(HEARTBEAT, "response")(error_code=0)))
    got = _answer(make_session(Observer()), HEARTBEAT, 4, heartbeat_request(), reply)
    assert got == struct.pack(">i", 77) + reply[4:-2] + b"\x00"     # kproxy's own encoding


def test_without_the_accelerator_every_request_is_decoded(monkeypatch):
    # The relay path needs the accelerator's whole-message check; without it (no compiler, or
    # KPROXY_CODEC=python) requests take the full path, as before it existed.
    from kproxy.proxy import session as session_module

    monkeypatch.setattr(session_module, "_SKIP", None)
    s = Session(ConnectionContext(1, clock=Clock()), FilterChain([]), read_answers=False)
    (up,) = s.client_frame(request_frame(HEARTBEAT, 4, 5, heartbeat_request()))
    assert isinstance(up, ToUpstream) and up.entry.request is not None and up.entry.relayed is None

"""Record rules (validate, headers) through the policy filter on live sessions, and their loader
errors: refused partitions answered with INVALID_RECORD and per-record errors, the rest forwarded
and merged; stamped headers and trace context; untouched batches byte-identical. Pure: no sockets."""

from __future__ import annotations

import json
import logging
import struct
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from kproxy.policy.engine import Facts, FixedRules, decide
from kproxy.policy.filter import PolicyFilter
from kproxy.policy.loader import RuleError, load_rules
from kproxy.policy.model import ValueCheck
from kproxy.policy.record_rules import check_bytes, traceparent
from kproxy.protocol.errors import INVALID_RECORD, TOPIC_AUTHORIZATION_FAILED
from kproxy.protocol.messages import body_class
from kproxy.protocol.records import Compression, build_batch, iter_batches
from kproxy.proxy.actions import Close, ToClient, ToUpstream
from kproxy.proxy.reencode import ReencodeCheck

from .rulebook import policy_filter, session, write_rules
from .test_policy_filter import broker_answers, send
from .test_session import answered, forwarded

PRODUCE = 0

VALIDATE = """\
rules:
  - name: orders-json
    match: {topic: "orders-*", api: produce}
    action: validate
    validate:
      value: json
      key: required
      max_record_bytes: 65536
"""
STAMP = """\
rules:
  - name: stamp
    match: {topic: "orders-*", api: produce}
    action: headers
    headers:
      set: {x-producer: "${client_id}", x-rule: "${rule}"}
      traceparent: inject
"""


def batch(rows: list[tuple[Any, Any]] | list[tuple[Any, Any, Any]], codec: Compression = Compression.NONE,
          **kw: Any) -> bytes:
    return build_batch(rows, compression=codec, base_timestamp=1_700_000_000_000, **kw)


def produce(parts: dict[tuple[str, int], bytes], version: int = 9, acks: int = -1) -> Any:
    cls = body_class(PRODUCE, "request")
    topics: dict[str, list] = {}
    for (t, p), records in parts.items():
        topics.setdefault(t, []).append(cls.PartitionProduceData(index=p, records=records))
    return cls(acks=acks, timeout_ms=1000, topic_data=[
        cls.TopicProduceData(name=t, partition_data=ps) for t, ps in topics.items()])


def records_of(req: Any) -> dict[tuple[str, int], bytes]:
    return {(t.name, p.index): bytes(p.records) for t in req.body.topic_data for p in t.partition_data}


def rows(records: bytes) -> list[tuple[Any, Any, list[tuple[str, bytes | None]]]]:
    out = []
    for b in iter_batches(records, verify_crc=True):
        for r in b.records():
            out.append((None if r.key is None else bytes(r.key), None if r.value is None else bytes(r.value),
                        [(h.key, None if h.value is None else bytes(h.value)) for h in r.headers]))
    return out


GOOD = batch([(b"k1", b'{"id": 1}'), (b"k2", b"[1, 2]")])
BAD = batch([(b"k1", b'{"id": 1}'), (b"k2", b"{not json"), (None, b"1")])


# --------------------------------------------------------------------------------------------------
# validate


@pytest.mark.parametrize("version", [3, 7, 8, 9, 12])
def test_bad_partition_refused_with_record_errors_rest_forwarded(tmp_path, version):
    s = session(policy_filter(tmp_path, VALIDATE))
    body = produce({("orders-eu", 0): GOOD, ("orders-eu", 1): BAD, ("logs", 0): BAD}, version)
    acts = send(s, PRODUCE, version, body)
    up = forwarded(acts[-1])
    # The good partition and the topic no rule selects go on, byte for byte.
    assert records_of(up) == {("orders-eu", 0): GOOD, ("logs", 0): BAD}
    back = answered(broker_answers(s, up)[-1], PRODUCE, version)
    got = {(t.name, p.index): p for t in back.body.responses for p in t.partition_responses}
    assert {k: p.error_code for k, p in got.items()} == {("orders-eu", 0): 0, ("orders-eu", 1): INVALID_RECORD,
                                                          ("logs", 0): 0}
    refused = got[("orders-eu", 1)]
    if version >= 8:
        assert [(e.batch_index, e.batch_index_error_message) for e in refused.record_errors] == [
            (1, "value is not JSON: unexpected character, expected a string key: line 1 column 2 (char 1)"),
            (2, "key is null")]
        assert refused.error_message.startswith("kproxy: 2 records break rule 'orders-json' (record 1: value")
    else:
        assert not refused.record_errors and refused.error_message is None


def test_every_partition_refused_is_answered_locally(tmp_path):
    s = session(policy_filter(tmp_path, VALIDATE))
    acts = send(s, PRODUCE, 9, produce({("orders-eu", 0): BAD, ("orders-us", 3): BAD}))
    assert isinstance(acts[-1], ToClient)
    back = answered(acts[-1], PRODUCE, 9)
    assert sorted((t.name, p.index, p.error_code) for t in back.body.responses for p in t.partition_responses) == [
        ("orders-eu", 0, INVALID_RECORD), ("orders-us", 3, INVALID_RECORD)]
    assert s.in_flight == type(s.in_flight)()


def test_topic_refusal_and_record_refusal_merge(tmp_path):
    text = "rules:\n  - {name: no-secrets, match: {topic: 'secret-*'}, action: deny}\n" + VALIDATE.split("\n", 1)[1]
    s = session(policy_filter(tmp_path, text))
    acts = send(s, PRODUCE, 9, produce({("secret-x", 0): GOOD, ("orders-a", 0): BAD, ("orders-a", 1): GOOD}))
    up = forwarded(acts[-1])
    assert records_of(up) == {("orders-a", 1): GOOD}
    back = answered(broker_answers(s, up)[-1], PRODUCE, 9)
    assert sorted((t.name, p.index, p.error_code) for t in back.body.responses for p in t.partition_responses) == [
        ("orders-a", 0, INVALID_RECORD), ("orders-a", 1, 0), ("secret-x", 0, TOPIC_AUTHORIZATION_FAILED)]


def test_acks0_with_a_bad_batch_closes_like_a_broker(tmp_path):
    s = session(policy_filter(tmp_path, VALIDATE))
    acts = send(s, PRODUCE, 9, produce({("orders-eu", 0): BAD}, acks=0))
    assert any(isinstance(a, Close) for a in acts)


@pytest.mark.parametrize("codec", list(Compression))
def test_each_codec_is_validated(tmp_path, codec):
    s = session(policy_filter(tmp_path, VALIDATE))
    good, bad = batch([(b"k", b'{"a": 1}')] * 3, codec), batch([(b"k", b'{"a": 1}'), (b"k", b"nope")], codec)
    up = forwarded(send(s, PRODUCE, 9, produce({("orders-a", 0): good, ("orders-a", 1): bad}))[-1])
    assert records_of(up) == {("orders-a", 0): good}


def test_legacy_message_sets_are_validated(tmp_path):
    s = session(policy_filter(tmp_path, VALIDATE))
    good = build_batch([(b"k", b"{}")], magic=1)
    bad = build_batch([(b"k", b"x")], magic=1, compression=Compression.GZIP)
    up = forwarded(send(s, PRODUCE, 2, produce({("orders-a", 0): good, ("orders-a", 1): bad}, 2))[-1])
    assert records_of(up) == {("orders-a", 0): good}


def test_checks(tmp_path):
    schema = tmp_path / "schemas" / "order.json"
    schema.parent.mkdir()
    schema.write_text(json.dumps({"type": "object", "required": ["id"],
                                  "properties": {"id": {"type": "integer"}}}))
    text = """\
    rules:
      - name: strict
        match: {topic: t}
        action: validate
        validate:
          value: {json_schema: schemas/order.json}
          key: {avro_schema_registry: {allowed_ids: [7]}}
          headers: {required: [x-team]}
          allow_null: false
          max_record_bytes: 100
    """
    s = session(policy_filter(tmp_path, text))
    avro7, avro8 = b"\x00" + struct.pack(">i", 7) + b"k", b"\x00" + struct.pack(">i", 8) + b"k"
    team = [("x-team", b"a")]
    cases = {
        0: ((avro7, b'{"id": 1}', team), None),
        1: ((avro7, b'{"id": "secret-value"}', team), "value does not match the schema at properties/id/type"),
        2: ((avro8, b'{"id": 1}', team), "key names schema id 8, which is not allowed"),
        3: ((b"plain", b'{"id": 1}', team), "key is not in the schema registry's wire format"),
        4: ((avro7, None, team), "value is null (a tombstone) and allow_null is false"),
        5: ((avro7, b'{"id": 1}', []), "header 'x-team' is missing"),
        6: ((avro7, b'{"id": 1, "pad": "' + b"x" * 100 + b'"}', team), "record is 144 bytes, more than max_record_bytes 100"),
        7: ((None, b'{"id": 1}', team), None),                       # keys are not required here
    }
    body = produce({("t", p): batch([row]) for p, (row, _) in cases.items()})
    up = forwarded(send(s, PRODUCE, 9, body)[-1])
    assert sorted(i for _, i in records_of(up)) == [p for p, (_, why) in cases.items() if why is None]
    back = answered(broker_answers(s, up)[-1], PRODUCE, 9)
    for p in back.body.responses[0].partition_responses:
        why = cases[p.index][1]
        if why is None:
            assert p.error_code == 0
        else:
            assert p.error_code == INVALID_RECORD
            assert p.record_errors[0].batch_index_error_message.startswith(why)
            assert "secret-value" not in p.error_message      # never the record's contents


def test_tombstones_pass_value_checks_by_default():
    assert check_bytes(ValueCheck("json"), "value", memoryview(b"{}")) is None
    assert check_bytes(ValueCheck("avro_schema_registry"), "value", memoryview(b"\x00\x00\x00\x00\x01")) is None


def test_validate_rules_after_a_deciding_rule_do_not_reach_it(tmp_path):
    text = "rules:\n  - {name: trusted, match: {client_id: trusted}, action: allow}\n" + VALIDATE.split("\n", 1)[1]
    s = session(policy_filter(tmp_path, text))
    up = forwarded(send(s, PRODUCE, 9, produce({("orders-a", 0): BAD}), client_id="trusted")[-1])
    assert records_of(up) == {("orders-a", 0): BAD}


def test_refusal_is_noted_and_logged_without_contents(tmp_path, caplog):
    s = session(policy_filter(tmp_path, VALIDATE))
    secret = batch([(b"k", b"{secret-token")])
    with caplog.at_level(logging.DEBUG, logger="kproxy.policy"):
        acts = send(s, PRODUCE, 9, produce({("orders-a", 0): secret}))
    entry = acts[-1].done[0]
    assert entry.notes["records_refused"] == [{"rule": "orders-json", "topic": "orders-a", "partition": 0,
                                               "records": 1}]
    assert (entry.notes["rule"], entry.notes["action"]) == ("orders-json", "validate")
    assert "rule 'orders-json' refused the batch of orders-a[0]" in caplog.text
    assert "secret" not in caplog.text


def test_decide_ignores_record_rules_for_other_apis(tmp_path):
    rules = load_rules([write_rules(tmp_path, VALIDATE)])
    assert decide(rules, Facts(PRODUCE, 9, topics=("orders-a",))).action == "allow"
    assert decide(rules, Facts(1, 12, topics=("orders-a",))).action == "allow"


# --------------------------------------------------------------------------------------------------
# headers


@pytest.mark.parametrize("codec", list(Compression))
def test_headers_stamped_with_the_batchs_own_codec(tmp_path, codec):
    s = session(policy_filter(tmp_path, STAMP))
    own = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    original = batch([(b"k", b"v1", [("traceparent", own)]), (None, b"v2", [("x-producer", b"spoofed")]),
                      (b"k3", None)], codec, producer_id=42, producer_epoch=3, base_sequence=17)
    acts = send(s, PRODUCE, 9, produce({("orders-a", 0): original, ("other", 0): original}), client_id="billing")
    up = forwarded(acts[-1])
    got = records_of(up)
    assert got[("other", 0)] == original              # no rule selects it: the same bytes
    rewritten = got[("orders-a", 0)]
    new, old = next(iter(iter_batches(rewritten, verify_crc=True))), next(iter(iter_batches(original)))
    for field in ("base_offset", "attributes", "last_offset_delta", "base_timestamp", "max_timestamp", "producer_id",
                  "producer_epoch", "base_sequence", "record_count", "partition_leader_epoch"):
        assert getattr(new, field) == getattr(old, field), field
    trace_id, span_id = acts[-1].entry.notes["trace_context"]
    tp = traceparent(trace_id, span_id)
    stamped = [("x-producer", b"billing"), ("x-rule", b"stamp")]
    assert rows(rewritten) == [(b"k", b"v1", [("traceparent", own), *stamped]),
                               (None, b"v2", [*stamped, ("traceparent", tp)]),
                               (b"k3", None, [*stamped, ("traceparent", tp)])]
    assert acts[-1].entry.notes["rewritten_batches"] == 1


def test_transactional_batches_are_never_changed(tmp_path):
    s = session(policy_filter(tmp_path, STAMP))
    txn = batch([(b"k", b"v")], producer_id=1, producer_epoch=0, base_sequence=0, is_transactional=True)
    up = forwarded(send(s, PRODUCE, 9, produce({("orders-a", 0): txn}))[-1])
    assert records_of(up) == {("orders-a", 0): txn}


def test_rewritten_frames_are_not_reencode_faults(tmp_path):
    s = session(policy_filter(tmp_path, STAMP))
    check = s.reencode = ReencodeCheck(1.0)
    acts = send(s, PRODUCE, 9, produce({("orders-a", 0): GOOD}))
    assert isinstance(acts[-1], ToUpstream)
    assert rows(records_of(forwarded(acts[-1]))[("orders-a", 0)])[0][2][0] == ("x-producer", b"app")
    assert (check.checked, check.mismatches) == (1, 0)


def test_validate_then_stamp(tmp_path):
    s = session(policy_filter(tmp_path, VALIDATE + STAMP.split("\n", 1)[1]))
    up = forwarded(send(s, PRODUCE, 9, produce({("orders-a", 0): GOOD, ("orders-a", 1): BAD}))[-1])
    got = records_of(up)
    assert list(got) == [("orders-a", 0)] and rows(got[("orders-a", 0)])[0][2][0] == ("x-producer", b"app")


# --------------------------------------------------------------------------------------------------
# kproxy check


@pytest.mark.parametrize(("text", "message"), [
    ("  - {name: r, action: validate, validate: {value: {json_schema: missing.json}}}\n",
     ":2:65: rule 'r': validate.value.json_schema: cannot read the JSON Schema"),
    ("  - {name: r, action: validate, validate: {value: {json_schema: broken.json}}}\n",
     "is not a valid JSON Schema"),
    ("  - {name: r, action: validate, validate: {value: {json_schema: notjson.json}}}\n", "is not JSON"),
    ("  - {name: r, action: validate, validate: {value: xml}}\n", "unknown value check 'xml'"),
    ("  - {name: r, action: headers, headers: {set: {a: '${secret}'}}}\n", "unknown variable ${secret}"),
    ("  - {name: r, action: headers, headers: {traceparent: always}}\n", "unknown traceparent 'always'"),
    ("  - {name: r, match: {api: fetch}, action: headers, headers: {traceparent: inject}}\n",
     "its api selector must include produce"),
    ("  - {name: r, action: validate}\n", "action validate needs 'validate:' settings"),
])
def test_check_errors_with_file_and_line(tmp_path, text, message):
    (tmp_path / "broken.json").write_text('{"type": 12}')
    (tmp_path / "notjson.json").write_text("{")
    path = write_rules(tmp_path, "rules:\n" + text)
    with pytest.raises(RuleError) as e:
        load_rules([path])
    assert message in str(e.value) and str(e.value).startswith(path)


# --------------------------------------------------------------------------------------------------
# telemetry


def test_produce_span_carries_the_chosen_ids_even_unsampled(tmp_path):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind

    from kproxy.telemetry.exchange import Exchange, Learned

    from .test_telemetry import ctx, produce_entry, tracing

    exp = InMemorySpanExporter()
    t = tracing(exp, sample_ratio=0.0)
    e = produce_entry({("orders", 0): GOOD}, {("orders", 0): 0})
    e.notes = {"trace_context": (0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331)}
    t.emit(Exchange(e, ctx(), Learned()), 0)
    t.emit(Exchange(produce_entry({("orders", 0): GOOD}, {("orders", 0): 0}), ctx(), Learned()), 0)  # unsampled
    t.shutdown()
    server, = [s for s in exp.get_finished_spans() if s.kind is SpanKind.SERVER]
    client, = [s for s in exp.get_finished_spans() if s.kind is SpanKind.CLIENT]
    assert (server.context.trace_id, server.context.span_id) == (0x0AF7651916CD43DD8448EB211C80319C,
                                                                 0xB7AD6B7169203331)
    assert client.context.trace_id == server.context.trace_id and client.context.span_id != server.context.span_id


def test_refusals_counted_and_logged_per_rule():
    import jsonschema

    from kproxy.telemetry.exchange import Exchange, Learned
    from kproxy.telemetry.metrics import Metrics
    from kproxy.telemetry.traffic_log import SCHEMA_PATH, traffic_line

    from .test_telemetry import ctx, produce_entry

    e = produce_entry({("orders", 0): GOOD, ("orders", 1): BAD}, {("orders", 0): 0})
    e.notes = {"rule": "orders-json", "action": "validate",
               "records_refused": [{"rule": "orders-json", "topic": "orders", "partition": 1, "records": 2}]}
    m = Metrics()
    m.record(Exchange(e, ctx(), Learned()))
    m.record(Exchange(e, ctx(), Learned()))
    assert b'kproxy_records_refused_total{rule="orders-json"} 2.0' in m.exposition()
    line = traffic_line(Exchange(e, ctx(), Learned()), 0.0)
    jsonschema.Draft202012Validator(json.loads(SCHEMA_PATH.read_text())).validate(line)
    assert line["records_refused"] == [{"rule": "orders-json", "topic": "orders", "partition": 1, "records": 2}]
    assert line["rule"] == "orders-json" and line["action"] == "validate"


def test_produce_by_topic_id_is_judged_by_the_topics_name(tmp_path):
    import uuid

    from kproxy.proxy.topics import TopicNames

    ids = TopicNames()
    orders, logs = uuid.UUID(int=0xA), uuid.UUID(int=0xB)
    meta: Any = body_class(3, "response")
    ids.learn([meta.MetadataResponseTopic(name="orders-a", topic_id=orders),
               meta.MetadataResponseTopic(name="logs", topic_id=logs)])
    s = session(policy_filter(tmp_path, VALIDATE, topic_ids=ids))
    cls = body_class(PRODUCE, "request")
    body = cls(acks=-1, timeout_ms=1000, topic_data=[
        cls.TopicProduceData(topic_id=i, partition_data=[cls.PartitionProduceData(index=0, records=BAD)])
        for i in (orders, logs)])
    acts = send(s, PRODUCE, 13, body)
    up = forwarded(acts[-1])
    assert [t.topic_id for t in up.body.topic_data] == [logs]
    back = answered(broker_answers(s, up)[-1], PRODUCE, 13)
    assert {t.topic_id: t.partition_responses[0].error_code for t in back.body.responses} == {
        orders: INVALID_RECORD, logs: 0}


def test_deeply_nested_json_is_refused_not_a_crash(tmp_path):
    schema = tmp_path / "any.json"
    schema.write_text(json.dumps({"type": "array", "items": {"$ref": "#"}}))
    rules = load_rules([write_rules(tmp_path, "rules:\n  - {name: s, action: validate, "
                                              "validate: {value: {json_schema: any.json}}}\n")])
    check = rules.rules[0].params.value
    deep = b"[" * 1000 + b"]" * 1000
    assert check_bytes(check, "value", memoryview(deep)) == "value is nested too deeply to check against the schema"
    assert check_bytes(check, "value", memoryview(b"[[1]]")) == "value does not match the schema at items/items/type"


_values = st.none() | st.binary(max_size=30) | st.builds(lambda o: json.dumps(o).encode(), st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8)) | st.integers(3000, 70_000).map(lambda n: b'"' + b"x" * n + b'"')
_hdrs = st.lists(st.tuples(st.sampled_from(["x-team", "a"]), st.none() | st.binary(max_size=8)), max_size=2)


def _is_json(value: bytes) -> bool:
    try:
        json.loads(value.decode("utf-8"))
    except ValueError:
        return False
    return True


_PROPERTY_RULES: dict[str, Any] = {}


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.tuples(st.none() | st.binary(max_size=8), _values, _hdrs), min_size=1, max_size=6),
       codec=st.sampled_from(list(Compression)))
def test_property_a_batch_is_refused_exactly_when_a_record_breaks_the_rule(tmp_path, rows, codec):
    text = ("rules:\n  - {name: v, action: validate, validate: {value: json, key: required, "
            "max_record_bytes: 20000, headers: {required: [x-team]}}}\n")
    if text not in _PROPERTY_RULES:
        _PROPERTY_RULES[text] = load_rules([write_rules(tmp_path, text)])
    s = session(PolicyFilter(FixedRules.of(_PROPERTY_RULES[text])))
    records = batch(rows, codec)
    expected = [i for i, (k, v, h) in enumerate(rows)
                if k is None or (v is not None and not _is_json(v)) or "x-team" not in {n for n, _ in h}
                or len(k) + (len(v) if v is not None else 0) > 20000 - 40]
    size_unsure = any(20000 - 40 < (len(k or b"") + len(v or b"")) <= 20000 + 40 for k, v, _ in rows)
    acts = send(s, PRODUCE, 9, produce({("t", 0): records}))
    if isinstance(acts[-1], ToUpstream):
        assert not expected or size_unsure
        assert records_of(forwarded(acts[-1])) == {("t", 0): records}
    else:
        back = answered(acts[-1], PRODUCE, 9)
        got = [e.batch_index for e in back.body.responses[0].partition_responses[0].record_errors]
        assert got == expected or size_unsure

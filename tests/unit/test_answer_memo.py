"""Rewritten answers remembered by their bytes: a repeat is sent as before, never stale, never another
listener's, and never when a filter that is not pure sees the api."""

from __future__ import annotations

import types
import uuid
from typing import Any

from kproxy.protocol.messages import (
    Request,
    Response,
    body_class,
    decode_response,
    encode_request_frame,
    encode_response_frame,
)
from kproxy.proxy.actions import Ask, Listen, ToClient
from kproxy.proxy.addresses import AddressMap, AddressRewriter
from kproxy.proxy.filters import ConnectionContext, Filter, FilterChain
from kproxy.proxy.memo import AnswerMemo, Remembered
from kproxy.proxy.reencode import ReencodeCheck
from kproxy.proxy.session import Session
from kproxy.proxy.topics import TopicNames

from .rulebook import policy_filter

METADATA, FETCH = 3, 1
PROXY = "proxy.example"


def metadata_answer(brokers, cluster_id: str = "c1", version: int = 12) -> Any:
    cls = body_class(METADATA, "response")
    return cls(cluster_id=cluster_id, controller_id=1,
               brokers=[cls.MetadataResponseBroker(node_id=n, host=h, port=p) for n, h, p in brokers])


class Client:
    """One session; each ``ask`` sends a Metadata request and answers it with ``body``."""

    def __init__(self, chain: FilterChain, memo: AnswerMemo, listener: str = "bootstrap", **kw: Any) -> None:
        self.session = Session(ConnectionContext(1, listener=listener), chain, memo=memo, **kw)
        self.cid = 100

    def ask(self, body: Any, version: int = 12) -> tuple[list, Any, Any]:
        """(actions, what the client decodes, the completed entry)."""
        self.cid += 1
        req = Request.build(METADATA, version, self.cid, "app", body_class(METADATA, "request")(topics=[]))
        out = self.session.client_frame(memoryview(b"".join(encode_request_frame(req))[4:]))
        upstream_id = bytes(out[-1].buffers[0][8:12])
        frame = upstream_id + b"".join(encode_response_frame(Response.build(METADATA, version, 0, body)))[8:]
        out = self.session.upstream_frame(memoryview(frame))
        sent = out[-1]
        assert isinstance(sent, ToClient)
        data = b"".join(bytes(b) for b in sent.buffers)
        resp = decode_response(memoryview(data)[4:], METADATA, version)
        assert resp.correlation_id == self.cid
        (entry,) = sent.done
        return out, resp, entry


def rewriter_setup(**kw: Any) -> tuple[AddressMap, FilterChain, AnswerMemo]:
    m = AddressMap(PROXY, 19000, 16, **kw)
    return m, FilterChain([AddressRewriter(m)]), AnswerMemo()


def confirm_all(m: AddressMap) -> None:
    for p in m.pending_ports():
        m.confirm(p)


def test_a_repeated_answer_is_sent_from_memory_byte_for_byte():
    m, chain, memo = rewriter_setup()
    c = Client(chain, memo)
    body = metadata_answer([(1, "b1.internal", 9092), (2, "b2.internal", 9092)])
    first, resp1, _ = c.ask(body)
    # The ports were new: the answer asked for them, so it was not remembered.
    assert isinstance(first[0], Listen) and memo.stored == 0
    confirm_all(m)
    _, resp2, _ = c.ask(body)
    assert memo.stored == 1 and memo.hits == 0
    out, resp3, entry = c.ask(body)
    assert memo.hits == 1
    assert [type(a) for a in out] == [ToClient]
    assert [(b.node_id, b.host, b.port) for b in resp3.body.brokers] == [(1, PROXY, 19000), (2, PROXY, 19001)]
    assert resp3.body == resp2.body == resp1.body
    # The completed entry carries the answer as sent, with this request's correlation id.
    assert entry.response.correlation_id == c.cid and entry.response.body == resp3.body
    assert entry.response_bytes == len(b"".join(bytes(b) for b in out[0].buffers))


def test_a_moved_broker_is_never_answered_from_memory():
    m, chain, memo = rewriter_setup()
    c = Client(chain, memo)
    c.ask(metadata_answer([(1, "b1.internal", 9092)]))
    confirm_all(m)
    c.ask(metadata_answer([(1, "b1.internal", 9092)]))
    assert memo.stored == 1
    # Another connection's answer says node 1 moved; the route must follow it ...
    c.ask(metadata_answer([(1, "b1.elsewhere", 9093)]))
    assert m.route_for_port(19000).upstream == ("b1.elsewhere", 9093)
    # ... and an old answer naming the old place moves it back, as without memory (it was stored
    # under the map as it was then).
    c.ask(metadata_answer([(1, "b1.internal", 9092)]))
    assert m.route_for_port(19000).upstream == ("b1.internal", 9092)


def test_a_withdrawn_port_is_not_advertised_from_memory():
    m, chain, memo = rewriter_setup()
    c = Client(chain, memo)
    body = metadata_answer([(1, "b1.internal", 9092), (2, "b2.internal", 9092)])
    c.ask(body)
    confirm_all(m)
    c.ask(body)
    _, resp, _ = c.ask(body)
    assert memo.hits == 1 and {b.port for b in resp.body.brokers} == {19000, 19001}
    m.withdraw(19001, "address in use")
    out, resp, _ = c.ask(body)
    # Node 2 gets another port (asked for before the answer goes out); 19001 is never named again.
    assert memo.hits == 1
    assert isinstance(out[0], Listen)
    assert 19001 not in {b.port for b in resp.body.brokers}


class ListenerName(Filter):
    """Pure, but its answer depends on the listener: writes it into the cluster id."""

    name = "listener-name"
    response_api_keys = frozenset({METADATA})

    def on_response(self, ctx: ConnectionContext, exchange: Any, response: Response) -> float:
        response.body.cluster_id = ctx.listener
        return 0.0

    def memo_key(self, ctx: ConnectionContext, api_key: int) -> int:
        return 0


def test_an_answer_remembered_on_one_listener_is_not_sent_on_another():
    memo = AnswerMemo()
    chain = FilterChain([ListenerName()])
    a = Client(chain, memo, listener="broker-1")
    b = Client(chain, memo, listener="broker-2")
    body = metadata_answer([])
    for _ in range(2):
        assert a.ask(body)[1].body.cluster_id == "broker-1"
        assert b.ask(body)[1].body.cluster_id == "broker-2"
    assert memo.hits == 2


class Counting(Filter):
    """Not pure (the default): it must see every answer."""

    name = "counting"
    response_api_keys = frozenset({METADATA})

    def __init__(self) -> None:
        self.seen = 0

    def on_response(self, ctx: ConnectionContext, exchange: Any, response: Response) -> float:
        self.seen += 1
        return 0.0


def test_a_filter_that_is_not_pure_sees_every_answer():
    m, _, memo = rewriter_setup()
    counting = Counting()
    c = Client(FilterChain([AddressRewriter(m), counting]), memo)
    for _ in range(3):
        c.ask(metadata_answer([(1, "b1.internal", 9092)]))
        confirm_all(m)
    assert counting.seen == 3 and memo.stored == 0 and memo.hits == 0


def test_different_bytes_and_versions_are_different_answers():
    m, chain, memo = rewriter_setup()
    c = Client(chain, memo)
    c.ask(metadata_answer([(1, "b1.internal", 9092)]))
    confirm_all(m)
    assert c.ask(metadata_answer([(1, "b1.internal", 9092)], cluster_id="c1"))[1].body.cluster_id == "c1"
    assert c.ask(metadata_answer([(1, "b1.internal", 9092)], cluster_id="c2"))[1].body.cluster_id == "c2"
    _, resp, _ = c.ask(metadata_answer([(1, "b1.internal", 9092)]), version=9)
    assert resp.api_version == 9
    assert memo.hits == 0 and memo.stored == 3


def named_answer(topics: dict[str, int], node: tuple[str, int] = ("b1.internal", 9092)) -> Any:
    """A Metadata v12 answer naming ``topics`` (name -> the leader of its one partition), by id too."""
    cls = body_class(METADATA, "response")
    return cls(cluster_id="c1", controller_id=1,
               brokers=[cls.MetadataResponseBroker(node_id=n, host=node[0], port=node[1] + n) for n in (1, 2)],
               topics=[cls.MetadataResponseTopic(name=t, topic_id=topic_id(t), partitions=[
                   cls.MetadataResponsePartition(partition_index=0, leader_id=leader, replica_nodes=[leader],
                                                 isr_nodes=[leader])]) for t, leader in topics.items()])


def topic_id(name: str) -> uuid.UUID:
    return uuid.uuid5(uuid.NAMESPACE_DNS, name)


def learning(flag: list[bool] | None = None) -> TopicNames:
    names = TopicNames()
    names.want(lambda: flag is None or flag[0])
    return names


def warmed(c: Client, m: AddressMap, body: Any) -> None:
    """Ask until ``body``'s answer is remembered (the first one asks for its ports)."""
    c.ask(body)
    confirm_all(m)
    c.ask(body)


def test_topic_names_being_learned_do_not_stop_the_memory():
    m, chain, memo = rewriter_setup()
    names = learning()
    c = Client(chain, memo, topic_names=names, read_answers=False)
    body = named_answer({"orders": 1})
    warmed(c, m, body)
    assert memo.stored == 1 and names.get(topic_id("orders")) == "orders"
    for n in range(1, 4):
        _, resp, _ = c.ask(body)
        assert memo.hits == n and [t.name for t in resp.body.topics] == ["orders"]
    assert memo.stored == 1


def test_an_answer_served_from_memory_teaches_the_names_it_holds():
    # Remembered while nothing learned names (no rule named a topic, no traffic log); then something
    # starts learning: the next answer, served from memory, teaches them as decoding it would.
    m, chain, memo = rewriter_setup()
    on = [False]
    names = learning(on)
    c = Client(chain, memo, topic_names=names, read_answers=False)
    body = named_answer({"orders": 1, "secret-x": 2})
    warmed(c, m, body)
    assert memo.stored == 1 and len(names) == 0
    on[0] = True
    c.ask(body)
    assert memo.hits == 1
    assert names.get(topic_id("orders")) == "orders" and names.get(topic_id("secret-x")) == "secret-x"


FETCH_RULES = "default: allow\nrules: [{name: no-secrets, match: {api: fetch, topic: 'secret-*'}, action: deny}]\n"


def test_a_rule_judges_a_topic_id_by_a_name_taught_from_memory(tmp_path):
    # Two connections with their own name tables (as two processes' tables would be) share the memo:
    # the second learns the names only from the answer memory serves it, and its policy refuses the
    # secret topic's id by that name, without asking the broker.
    from .test_policy_filter import fetch_by_id, forwarded, send

    m = AddressMap(PROXY, 19000, 16)
    memo = AnswerMemo()
    body = named_answer({"orders": 1, "secret-x": 2})
    first = TopicNames()
    c1 = Client(FilterChain([AddressRewriter(m), policy_filter(tmp_path, FETCH_RULES, topic_ids=first)]), memo,
                topic_names=first, read_answers=False)
    warmed(c1, m, body)
    assert memo.stored == 1
    second = TopicNames()
    c2 = Client(FilterChain([AddressRewriter(m), policy_filter(tmp_path, FETCH_RULES, topic_ids=second)]), memo,
                topic_names=second, read_answers=False)
    c2.ask(body)
    assert memo.hits == 1 and second.get(topic_id("secret-x")) == "secret-x"
    acts = send(c2.session, FETCH, 13, fetch_by_id(topic_id("orders"), topic_id("secret-x")))
    assert not any(isinstance(a, Ask) for a in acts)
    up = forwarded(acts[-1])
    assert [t.topic_id for t in up.body.topics] == [topic_id("orders")]


def test_a_changed_answer_is_decoded_and_teaches_its_new_names():
    m, chain, memo = rewriter_setup()
    names = learning()
    c = Client(chain, memo, topic_names=names, read_answers=False)
    warmed(c, m, named_answer({"orders": 1}))
    c.ask(named_answer({"orders": 1}))
    assert memo.hits == 1
    misses = memo.misses
    # A new topic: different bytes, decoded, its name learned.
    _, resp, _ = c.ask(named_answer({"orders": 1, "fresh": 2}))
    assert memo.hits == 1 and memo.misses == misses + 1
    assert [t.name for t in resp.body.topics] == ["orders", "fresh"] and names.get(topic_id("fresh")) == "fresh"
    # A new leader: decoded, never the remembered leader.
    _, resp, _ = c.ask(named_answer({"orders": 2, "fresh": 2}))
    assert memo.hits == 1 and memo.misses == misses + 2
    assert [t.partitions[0].leader_id for t in resp.body.topics] == [2, 2]
    # A topic recreated under its old name gets a new id: the table follows the broker's bytes.
    renamed = named_answer({"orders": 1})
    renamed.topics[0].topic_id = new_id = uuid.UUID(int=7)
    c.ask(renamed)
    assert names.get(new_id) == "orders"


def test_a_sampled_exchange_that_teaches_names_is_decoded():
    m, chain, memo = rewriter_setup()
    names = learning()
    sampled = [0]
    c = Client(chain, memo, topic_names=names, read_answers=False, sample=lambda api_key: sampled[0])
    body = named_answer({"orders": 1})
    warmed(c, m, body)
    c.ask(body)
    assert memo.hits == 1
    sampled[0] = 1      # the traffic log (bit 0) takes the next exchange
    _, resp, entry = c.ask(body)
    assert memo.hits == 1 and entry.sampled and entry.response.body.topics[0].name == "orders"
    assert [(b.host, b.port) for b in resp.body.brokers] == [(PROXY, 19000), (PROXY, 19001)]
    # Telemetry that reads every exchange (no sampler: the traffic log at 1.0) samples them all.
    c = Client(chain, memo, topic_names=names)
    c.ask(body)
    assert memo.hits == 1


def test_no_memory_while_the_transparency_check_runs():
    m, chain, memo = rewriter_setup()
    c = Client(chain, memo, reencode=ReencodeCheck(1.0))
    for _ in range(3):
        c.ask(metadata_answer([(1, "b1.internal", 9092)]))
        confirm_all(m)
    assert memo.stored == 0 and memo.hits == 0 and memo.misses == 0


def test_the_memory_is_bounded_in_entries_and_bytes():
    memo = AnswerMemo(max_entries=2, max_bytes=1000)
    r = Remembered(b"x" * 10, None, None, 0)
    for k in range(3):
        memo.put(k, r, 100)
    assert len(memo) == 2 and memo.get(0) is None and memo.get(2) is r
    memo.get(1)
    memo.put(3, r, 100)
    assert memo.get(2) is None and memo.get(1) is r
    memo.put(4, r, 900)     # the least recently used (3) goes to make room
    assert memo.get(3) is None and memo.get(1) is r and memo.bytes == 1000
    memo.put(5, r, 1001)    # larger than the whole memory: not kept
    assert memo.get(5) is None and memo.bytes == 1000


def test_large_answers_are_not_remembered():
    m, chain, _ = rewriter_setup()
    memo = AnswerMemo(max_frame=64)
    c = Client(chain, memo)
    for _ in range(3):
        c.ask(metadata_answer([(1, "b1.internal", 9092)], cluster_id="c" * 100))
        confirm_all(m)
    assert memo.stored == 0


def test_answers_about_data_are_not_remembered():
    # Produce answers carry new offsets every time: remembering them would cost a copy and a decode
    # per answer and push the Metadata answers that do repeat out of the memo.
    m, chain, memo = rewriter_setup()
    session = Session(ConnectionContext(1), chain, memo=memo)
    rq, rs = body_class(0, "request"), body_class(0, "response")
    for cid in (1, 2, 3):
        req = Request.build(0, 10, cid, "app", rq(acks=-1, timeout_ms=1000, topic_data=[
            rq.TopicProduceData(name="t", partition_data=[rq.PartitionProduceData(index=0, records=None)])]))
        out = session.client_frame(memoryview(b"".join(encode_request_frame(req))[4:]))
        upstream_id = bytes(out[-1].buffers[0][8:12])
        answer = rs(responses=[rs.TopicProduceResponse(name="t", partition_responses=[
            rs.PartitionProduceResponse(index=0, error_code=0, base_offset=0)])])
        # The same bytes each time: still never remembered, nor looked up.
        frame = upstream_id + b"".join(encode_response_frame(Response.build(0, 10, 0, answer)))[8:]
        sent = session.upstream_frame(memoryview(frame))[-1]
        assert isinstance(sent, ToClient) and sent.done[0].response.body.responses[0].name == "t"
    assert memo.stored == 0 and memo.misses == 0
    c = Client(chain, memo)
    confirm_all(m)
    c.ask(metadata_answer([(1, "b1.internal", 9092)]))
    confirm_all(m)
    c.ask(metadata_answer([(1, "b1.internal", 9092)]))
    assert memo.stored == 1


class Done(Filter):
    """Told of every finished Metadata exchange (``on_done``)."""

    name = "done"
    done_api_keys = frozenset({METADATA})


def test_a_remembered_answer_builds_its_decoded_response_only_for_readers_of_the_entry():
    body = metadata_answer([(1, "b1.internal", 9092)])
    for read_answers, extra, built in ((True, [], True), (False, [], False), (False, [Done()], True)):
        m = AddressMap(PROXY, 19000, 16)
        rewriter = AddressRewriter(m)
        memo = AnswerMemo()
        c = Client(FilterChain([rewriter, *extra]), memo, read_answers=read_answers)
        c.ask(body)
        confirm_all(m)
        c.ask(body)
        _, resp, entry = c.ask(body)
        assert memo.hits == 1 and resp.body.brokers[0].port == 19000
        # Telemetry (read_answers) and on_done filters read entry.response; with neither, no one does.
        assert (entry.response is not None) is built
        if built:
            assert entry.response.correlation_id == c.cid and entry.response.body.brokers[0].port == 19000


def test_describe_topic_partitions_answers_rules_pass_are_remembered_with_their_names(tmp_path):
    # No filter rewrites DescribeTopicPartitions (no broker addresses); with rules that do not
    # address it, the policy filter passes it (pure), so its answers are remembered and teach names.
    from .rulebook import Clock
    from .test_policy_filter import roundtrip

    dtp = 75
    cls, rcls = body_class(dtp, "request"), body_class(dtp, "response")
    answer = rcls(topics=[rcls.DescribeTopicPartitionsResponseTopic(name="logs", topic_id=topic_id("logs"))])
    memo = AnswerMemo()
    tables = []
    for _ in range(3):
        names = TopicNames()
        tables.append(names)
        s = Session(ConnectionContext(1, clock=Clock()), FilterChain([policy_filter(tmp_path, FETCH_RULES, topic_ids=names)]),
                    memo=memo, topic_names=names, read_answers=False)
        _, resp = roundtrip(s, dtp, 0, cls(topics=[cls.TopicRequest(name="logs")]), answer=answer)
        assert [t.name for t in resp.body.topics] == ["logs"]
    assert memo.stored == 1 and memo.hits == 2
    assert [t.get(topic_id("logs")) for t in tables] == ["logs"] * 3


def test_a_served_answer_teaches_again_what_another_answer_changed_since():
    # Teaching again is skipped only while the table is as the served pairs last left it: an answer
    # that renamed an id in between is undone by the served one, as decoding it would.
    m, chain, memo = rewriter_setup()
    names = learning()
    c = Client(chain, memo, topic_names=names, read_answers=False)
    body = named_answer({"orders": 1})
    warmed(c, m, body)
    c.ask(body)
    c.ask(body)
    assert memo.hits == 2 and names.get(topic_id("orders")) == "orders"
    renamed = named_answer({"orders": 1})
    renamed.topics[0].name = "orders-v2"        # the same id under another name
    c.ask(renamed)
    assert names.get(topic_id("orders")) == "orders-v2"
    c.ask(body)
    assert memo.hits == 3 and names.get(topic_id("orders")) == "orders"


def test_teaching_the_same_pairs_again_is_skipped_only_while_the_table_has_not_moved():
    names = TopicNames(limit=3)
    first = names.taught([types.SimpleNamespace(name=f"t{i}", topic_id=uuid.UUID(int=i + 1)) for i in range(2)])
    names.learn_again(first)
    assert [names.get(uuid.UUID(int=i + 1)) for i in range(2)] == ["t0", "t1"]
    # Unchanged since: nothing to do (a learn would find every pair there).
    names._names.clear()        # behind its back: the skip is what keeps the table empty now
    names.learn_again(first)
    assert len(names) == 0
    # Any change since (here a new id) and the pairs are taught again.
    names.learn([types.SimpleNamespace(name="x", topic_id=uuid.UUID(int=99))])
    names.learn_again(first)
    assert [names.get(uuid.UUID(int=i + 1)) for i in range(2)] == ["t0", "t1"]
    # A table at its limit is always taught again (the pairs may have pushed out their own).
    many = names.taught([types.SimpleNamespace(name=f"m{i}", topic_id=uuid.UUID(int=200 + i)) for i in range(4)])
    names.learn_again(many)
    names._names.clear()
    names.learn_again(many)
    assert len(names) == 3


def test_the_pairs_kept_to_teach_again_count_against_the_memorys_bytes():
    topics = {f"topic-{i:03d}": 1 for i in range(50)}
    body = named_answer(topics)
    sizes = []
    for names in (None, learning()):
        m, chain, memo = rewriter_setup()
        warmed(Client(chain, memo, topic_names=names, read_answers=False), m, body)
        assert memo.stored == 1
        sizes.append(memo.bytes)
    # 50 pairs of a UUID and a 9-character name: each counted with what keeps it alive.
    assert sizes[1] - sizes[0] == sum(TopicNames.taught_bytes((p,)) for p in learning().taught(body.topics))
    assert sizes[1] - sizes[0] == 50 * (205 + 9)
    # A memory with room for the answer but not for its pairs does not keep it.
    m, chain, _ = rewriter_setup()
    memo = AnswerMemo(max_bytes=sizes[1] - 1)
    warmed(Client(chain, memo, topic_names=learning(), read_answers=False), m, body)
    assert memo.stored == 0 and memo.bytes == 0

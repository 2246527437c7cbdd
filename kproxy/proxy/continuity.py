"""What a virtual cluster with several upstream clusters remembers so that clients outlive a switch.

- **Producer ids.** An idempotent producer's id and epoch come from one cluster's InitProducerId. The
  next cluster does not know them (tansu answers UNKNOWN_PRODUCER_ID, which librdkafka treats as fatal
  for a batch it retries, kafka-python and aiokafka as an error on every batch), and may even use the
  same number for another producer (ids start at 0 in every cluster). So after a switch kproxy
  *carries* such a producer: it asks the new cluster for a producer id of its own (InitProducerId, on
  the producer's connection) and writes that id, epoch and a sequence counted from the first batch it
  carried into each batch (``records.with_producer``: the CRC is computed again). The producer goes on
  with its own id; the broker deduplicates its retries under kproxy's.
- **Acknowledged ends.** The end offset the cluster acknowledged for every partition produced to, so a
  planned switch can wait until the replica holds them.
- **Group commits.** The last offset each group committed on each partition, so a switch can translate
  it through MirrorMaker 2's offset syncs and commit it on the new cluster.

``SwitchBook`` holds it per virtual cluster; ``Continuity`` is the filter (one per upstream cluster)
that fills it, and ``ProducerCarrier`` the one that carries producers: it joins a cluster's chain
only once the virtual cluster has switched, so until then Produce requests meet no request filter
of this module and go out as they were received. Names are the clients' (after a tenant's prefix, before a
replica's). Pure and bounded: time is not read; tables forget their oldest entries past their limits.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

import attrs

from kproxy.protocol.errors import NOT_LEADER_OR_FOLLOWER, RecordsError
from kproxy.protocol.messages import Request, Response, body_class
from kproxy.protocol.records import RecordBatch, iter_batches, summarize, with_producer
from kproxy.proxy.filters import AskBroker, ConnectionContext, Filter, RequestVerdict, Respond

log = logging.getLogger("kproxy.continuity")

PRODUCE, OFFSET_COMMIT, INIT_PRODUCER_ID = 0, 8, 22
_SEQUENCE_SPAN = 1 << 31          # sequences wrap at Integer.MAX_VALUE (KIP-98)
ClientKey = tuple[str | None, str | None]       # (client host, client id): whose producer id it is


def _bounded_put(table: collections.OrderedDict, key: Any, value: Any, limit: int) -> None:
    table[key] = value
    table.move_to_end(key)
    while len(table) > limit:
        table.popitem(last=False)


@attrs.define(slots=True)
class Carried:
    """A producer kproxy carries on one cluster: the id and epoch that cluster gave kproxy, and per
    partition the producer's sequence that became 0 there."""

    producer_id: int
    producer_epoch: int
    bases: dict[tuple[Any, int], int] = attrs.field(factory=dict)

    def sequence(self, partition: tuple[Any, int], theirs: int) -> int:
        base = self.bases.setdefault(partition, theirs)
        return (theirs - base) % _SEQUENCE_SPAN


class SwitchBook:
    """Per virtual cluster: producer ids by the cluster that issued them, the producers kproxy carries,
    the acknowledged end of every partition and the groups' last commits, per upstream cluster."""

    def __init__(self, limit: int = 100_000) -> None:
        self.limit = limit
        # Set once the virtual cluster has switched (now or before a restart): from then on a
        # producer id not seen issued by the active cluster is carried.
        self.switched = False
        self.issued: collections.OrderedDict[tuple[ClientKey, int, int], str] = collections.OrderedDict()
        self.carried: collections.OrderedDict[tuple[str, ClientKey, int, int], Carried] = collections.OrderedDict()
        self.acked: dict[str, dict[tuple[str, int], int]] = {}
        self.commits: dict[str, dict[str, dict[tuple[str, int], int]]] = {}
        self.carried_batches = 0

    # -- producers

    def issue(self, cluster: str, client: ClientKey, producer_id: int, epoch: int) -> None:
        _bounded_put(self.issued, (client, producer_id, epoch), cluster, self.limit)

    def must_carry(self, cluster: str, client: ClientKey, producer_id: int, epoch: int) -> bool:
        """Whether batches of this producer go to ``cluster`` under an id kproxy gets there."""
        issuer = self.issued.get((client, producer_id, epoch))
        if issuer is not None:
            return issuer != cluster
        return self.switched

    def carrying(self, cluster: str, client: ClientKey, producer_id: int, epoch: int) -> Carried | None:
        return self.carried.get((cluster, client, producer_id, epoch))

    def carry(self, cluster: str, client: ClientKey, producer_id: int, epoch: int, carried: Carried) -> None:
        _bounded_put(self.carried, (cluster, client, producer_id, epoch), carried, self.limit)

    # -- what a switch needs

    def acknowledged(self, cluster: str, topic: str, partition: int, end: int) -> None:
        ends = self.acked.setdefault(cluster, {})
        key = (topic, partition)
        if end > ends.get(key, -1):
            if key not in ends and len(ends) >= self.limit:
                return
            ends[key] = end

    def committed(self, cluster: str, group: str, topic: str, partition: int, offset: int) -> None:
        groups = self.commits.setdefault(cluster, {})
        if group not in groups and len(groups) >= self.limit:
            return
        groups.setdefault(group, {})[(topic, partition)] = offset

    def left(self, cluster: str) -> tuple[dict[tuple[str, int], int], dict[str, dict[tuple[str, int], int]]]:
        """What the virtual cluster leaves on ``cluster`` at a switch: (acknowledged ends, group
        commits); they are forgotten here (a later switch back starts afresh)."""
        return self.acked.pop(cluster, {}), self.commits.pop(cluster, {})


@attrs.define(slots=True)
class _Produced:
    """A forwarded Produce request's record counts per (topic, partition), for its acknowledged ends."""

    counts: dict[tuple[str, int], int] = attrs.field(factory=dict)


class Continuity(Filter):
    """Fills the SwitchBook of one upstream cluster: producer ids it issued, acknowledged ends, group
    commits; and asks for a new producer id where a producer names one this cluster did not issue."""

    name = "continuity"
    request_api_keys = frozenset({OFFSET_COMMIT, INIT_PRODUCER_ID})
    response_api_keys = frozenset({INIT_PRODUCER_ID})
    done_api_keys = frozenset({PRODUCE, OFFSET_COMMIT})
    reports_changes = True      # it only reads answers

    def __init__(self, cluster: str, book: SwitchBook) -> None:
        self.cluster = cluster
        self.book = book

    def sees_whole(self, api_key: int, kind: str) -> bool:
        return False            # it changes no frame, and reads a streamed Produce's records facts

    # -- requests

    def on_request(self, ctx: ConnectionContext, exchange: Any) -> RequestVerdict:
        req: Request = exchange.request
        if req.api_key == OFFSET_COMMIT:
            commits = [(t.name, p.partition_index, p.committed_offset)
                       for t in req.body.topics if getattr(t, "name", None) for p in t.partitions]
            exchange.keep(self, (req.body.group_id, commits))
            return None
        body = req.body
        # KIP-360: a producer that bumps its epoch names its id; a cluster that did not issue it
        # refuses (tansu) or ignores it (Kafka, without a transactional id): ask for a new one.
        if (body.transactional_id is None and body.producer_id >= 0
                and self.book.issued.get((_client(ctx), body.producer_id, body.producer_epoch)) != self.cluster):
            body.producer_id, body.producer_epoch = -1, -1
        return None

    # -- answers

    def on_response(self, ctx: ConnectionContext, exchange: Any, response: Response) -> float:
        body = response.body
        if body.error_code == 0 and body.producer_id >= 0:
            self.book.issue(self.cluster, _client(ctx), body.producer_id, body.producer_epoch)
        return 0.0

    def on_done(self, ctx: ConnectionContext, exchange: Any) -> None:
        response = exchange.response
        if response is None:
            return
        if exchange.api_key == OFFSET_COMMIT:
            kept = exchange.kept(self)
            if kept is None:
                return
            group, commits = kept
            refused = {(t.name, p.partition_index) for t in response.body.topics for p in t.partitions
                       if p.error_code != 0}
            for topic, partition, offset in commits:
                if (topic, partition) not in refused and offset >= 0:
                    self.book.committed(self.cluster, group, topic, partition, offset)
            return
        counts = _record_counts(exchange)
        for t in response.body.responses:
            topic = getattr(t, "name", None) or str(getattr(t, "topic_id", ""))
            for p in t.partition_responses:
                n = counts.get((topic, p.index), 0)
                if p.error_code == 0 and p.base_offset >= 0 and n > 0:
                    self.book.acknowledged(self.cluster, topic, p.index, p.base_offset + n)


def _record_counts(exchange: Any) -> dict[tuple[str, int], int]:
    """Records per (topic, partition) of a Produce request: from its batch headers, or from what they
    said as it streamed past (``records_facts``)."""
    counts: dict[tuple[str, int], int] = {}
    if exchange.records_facts:
        for facts in exchange.records_facts:
            topic, partition = facts.path
            counts[(str(topic), partition)] = facts.records
        return counts
    req = exchange.request
    if req is None:
        return counts
    for t in req.body.topic_data:
        topic = getattr(t, "name", None) or str(getattr(t, "topic_id", ""))
        for part in t.partition_data:
            if part.records:
                try:
                    counts[(topic, part.index)] = summarize(part.records).record_count
                except RecordsError:
                    continue
    return counts


class ProducerCarrier(Filter):
    """Carries producers another upstream cluster issued on this one (the module docstring); in a
    cluster's chain only once the virtual cluster has switched."""

    name = "producer-carrier"
    request_api_keys = frozenset({PRODUCE})

    def __init__(self, cluster: str, book: SwitchBook) -> None:
        self.cluster = cluster
        self.book = book

    def on_request(self, ctx: ConnectionContext, exchange: Any) -> RequestVerdict:
        return self._produce(ctx, exchange, exchange.request)

    def _produce(self, ctx: ConnectionContext, exchange: Any, req: Request) -> RequestVerdict:
        body = req.body
        client = _client(ctx)
        need: tuple[int, int] | None = None
        if body.transactional_id is not None:
            return None         # transactions are not carried (docs/switchover.md)
        for t in body.topic_data:
            for part in t.partition_data:
                records = part.records
                if not records:
                    continue
                try:
                    first = next(iter(iter_batches(records)), None)
                except RecordsError:
                    continue            # the broker judges what kproxy cannot read
                if (isinstance(first, RecordBatch) and first.producer_id >= 0
                        and self.book.must_carry(self.cluster, client, first.producer_id, first.producer_epoch)):
                    need = (first.producer_id, first.producer_epoch)
        if need is None:
            return None
        carried = self.book.carrying(self.cluster, client, *need)
        if carried is None:
            return AskBroker(_init_producer_id(), lambda answer: self._got_id(ctx, exchange, req, need, answer))
        self._rewrite(req, client, carried)
        return None

    def _got_id(self, ctx: ConnectionContext, exchange: Any, req: Request, producer: tuple[int, int],
                answer: Response | None) -> RequestVerdict:
        if answer is None or answer.body.error_code != 0:
            # Not written anywhere: the producer retries the same batches, as after a lost broker.
            why = "no answer" if answer is None else f"error {answer.body.error_code}"
            log.info("connection %d: cannot carry producer %d on cluster %s yet (InitProducerId: %s); the "
                     "producer retries", ctx.connection_id, producer[0], self.cluster, why)
            return Respond(error_code=NOT_LEADER_OR_FOLLOWER)
        carried = Carried(answer.body.producer_id, answer.body.producer_epoch)
        client = _client(ctx)
        self.book.carry(self.cluster, client, *producer, carried)
        log.info("connection %d: producer %d (epoch %d) of client %s came from another cluster; kproxy carries "
                 "it on cluster %s as producer %d", ctx.connection_id, producer[0], producer[1],
                 client[1], self.cluster, carried.producer_id)
        self._rewrite(req, client, carried)
        return None

    def _rewrite(self, req: Request, client: ClientKey, carried: Carried) -> None:
        for t in req.body.topic_data:
            topic = getattr(t, "name", None) or str(getattr(t, "topic_id", ""))
            for part in t.partition_data:
                if not part.records:
                    continue
                out = []
                for batch in iter_batches(part.records):
                    if not isinstance(batch, RecordBatch) or batch.producer_id < 0:
                        out.append(bytes(batch.raw))
                        continue
                    sequence = carried.sequence((topic, part.index), batch.base_sequence)
                    out.append(with_producer(batch, carried.producer_id, carried.producer_epoch, sequence))
                    self.book.carried_batches += 1
                part.records = b"".join(out)


def _client(ctx: ConnectionContext) -> ClientKey:
    return (ctx.client_address[0] if ctx.client_address else None, ctx.client_id)


def _init_producer_id() -> Request:
    cls: Any = body_class(INIT_PRODUCER_ID, "request")
    # v4: answered by Kafka 2.7 and later, and by tansu.
    return Request.build(INIT_PRODUCER_ID, 4, 0, "kproxy",
                         cls(transactional_id=None, transaction_timeout_ms=60000))

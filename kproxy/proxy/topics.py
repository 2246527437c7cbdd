"""The process's one table of topic names by topic id, learned from the broker's own answers.

Since KIP-516 requests and answers may name a topic by id only (Fetch v13+, Produce v13+, Metadata by
id). Policy rules judge names and telemetry labels names, so both read this one table, filled by the
session from Metadata (v10+) and DescribeTopicPartitions answers before any filter changes them: the
names are the broker's, a tenant's prefix included. Pure and bounded; no I/O.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from typing import Any

from kproxy.protocol.messages import Request, body_class, supported_versions
from kproxy.protocol.primitives import ZERO_UUID

METADATA = 3


class TopicNames:
    """Topic id -> the broker's topic name. Past ``limit`` ids the least recently learned are forgotten.

    Reading every topic of a Metadata answer costs milliseconds on a cluster of 100,000 partitions,
    so the table learns only while something wants it: each reader registers a predicate with
    ``want`` (the policy while its rules name topics, telemetry while an output labels topics).
    """

    def __init__(self, limit: int = 200_000) -> None:
        self.limit = limit
        self._names: dict[uuid.UUID, str] = {}
        self._wants: list[Callable[[], bool]] = []
        # How many times the table changed (shared with its views), and by ``id``, pairs taught again
        # (``learn_again``) with the count after: while it has not moved, teaching them changes nothing.
        self._changes = [0]
        self._taught: dict[int, tuple[tuple[Any, ...], int]] = {}

    def __len__(self) -> int:
        return len(self._names)

    def want(self, predicate: Callable[[], bool]) -> None:
        """Learn while ``predicate()`` is true (checked on each answer that could teach names)."""
        self._wants.append(predicate)

    @property
    def learning(self) -> bool:
        wants = self._wants
        return bool(wants) and any(w() for w in wants)

    def get(self, topic_id: Any) -> str | None:
        return self._names.get(topic_id)

    def learn(self, topics: Iterable[Any]) -> None:
        """From the ``topics`` array of a Metadata (v10+) or DescribeTopicPartitions response."""
        names = self._names
        for t in topics:
            tid, name = getattr(t, "topic_id", None), t.name
            if name and tid is not None and tid != ZERO_UUID and names.get(tid) != name:
                names.pop(tid, None)
                names[tid] = name
                self._changes[0] += 1
        while len(names) > self.limit:
            del names[next(iter(names))]
            self._changes[0] += 1

    def learn_again(self, taught: tuple[Any, ...]) -> None:
        """``learn(taught)`` for pairs kept from an answer (``taught``), skipped when these very pairs
        were taught last with the table as it is now: every one is there already, so learning them
        would change nothing (a served answer naming many topics costs a look-up, not one per topic)."""
        changes = self._changes
        last = self._taught.get(id(taught))
        if last is not None and last[0] is taught and last[1] == changes[0]:
            return
        self.learn(taught)
        if len(self._names) < self.limit:      # else it may have pushed out some of its own pairs
            if len(self._taught) >= 1024:
                self._taught.clear()
            self._taught[id(taught)] = (taught, changes[0])

    def taught(self, topics: Iterable[Any]) -> tuple[Any, ...]:
        """The (topic id, name) pairs ``learn`` reads from ``topics``, kept apart from the answer they
        came from: an answer served from memory (kproxy.proxy.memo) teaches them again, in order."""
        return tuple(_Named(tid, t.name) for t in topics
                     if t.name and (tid := getattr(t, "topic_id", None)) is not None and tid != ZERO_UUID)

    @staticmethod
    def taught_bytes(taught: tuple[Any, ...]) -> int:
        """What the pairs ``taught`` returned hold in memory, counted as if nothing else held their ids
        and names (a remembered answer keeps them alive after the table lets them go): the tuple's
        slot, the pair, the UUID and its int, the name."""
        return sum(_PAIR_BYTES + len(p.name) for p in taught)

    def without_prefix(self, prefix: str | None) -> TopicNames:
        """This table as a cluster whose topics carry ``prefix`` (a replica's ``primary.``) teaches
        it: the same names by id, learned with the prefix taken off, so they read as the clients'
        names (topic ids differ between clusters, so the clusters never overwrite each other)."""
        if not prefix:
            return self
        view = _Unprefixing(self.limit, prefix)
        view._names, view._wants, view._changes = self._names, self._wants, self._changes
        return view

    def question(self, ids: Iterable[uuid.UUID]) -> Request:
        """A Metadata request naming ``ids`` (v12, the first version brokers answer by id)."""
        version = min(12, supported_versions()[METADATA][1])
        cls: Any = body_class(METADATA, "request")
        body = cls(topics=[cls.MetadataRequestTopic(topic_id=i, name=None) for i in ids],
                   allow_auto_topic_creation=False)
        return Request.build(METADATA, version, 0, "kproxy", body)


class _Unprefixing(TopicNames):
    """A TopicNames sharing another's table, learning names with a replica's prefix taken off (names
    outside it are not the clients' and are not learned)."""

    def __init__(self, limit: int, prefix: str) -> None:
        super().__init__(limit)
        self.prefix = prefix

    def learn(self, topics: Iterable[Any]) -> None:
        prefix, n = self.prefix, len(self.prefix)
        super().learn(_Named(getattr(t, "topic_id", None), t.name[n:]) for t in topics
                      if t.name and t.name.startswith(prefix))


# One kept (topic id, name) pair without its name's characters: a tuple slot 8, the pair 48, a UUID 56
# and its 128-bit int 44, an ASCII str's header 49 (CPython 3.11, 64-bit; sys.getsizeof).
_PAIR_BYTES = 205


class _Named:
    __slots__ = ("name", "topic_id")

    def __init__(self, topic_id: Any, name: str) -> None:
        self.topic_id = topic_id
        self.name = name

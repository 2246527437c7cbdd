"""Rewritten broker answers remembered by their bytes, so an answer seen before skips decoding,
filtering and encoding.

Metadata answers repeat byte for byte between cluster changes, and the address rewriter's output
is a pure function of their bytes and the address map. When every response filter of an api says it
is pure (``Filter.memo_key``), the session looks the answer up by (api, version, listener, the
filters' keys, the bytes after the correlation id) and sends what it sent last time with the new
correlation id. Bounded in entries and bytes (least recently used goes first); only small answers
that asked for no port and no throttle are stored.

An answer that teaches topic ids' names (Metadata v10+, DescribeTopicPartitions) keeps the pairs
the broker's bytes named, before any filter changed them; serving it teaches them again, so the
process's name table (the policy's rules, the traffic log, spans) learns from a remembered answer
exactly what it would have learned decoding it.

The server's lane (kproxy.server.lane) keeps a memo of its own in C for the answers it serves without
the event loop: ``to_lane`` puts every entry of such an api stored or served here there too, under a
number for everything the key holds besides the bytes (``lane_class``).
"""

from __future__ import annotations

import collections
from collections.abc import Hashable
from typing import Any

import attrs

# Answers larger than this are never remembered (Metadata of a few hundred partitions fits).
MAX_FRAME = 64 * 1024
MAX_ENTRIES = 512
MAX_BYTES = 8 * 1024 * 1024
MAX_CLASSES = 4096      # lane classes kept by key before the table starts again (numbers never reused)


@attrs.frozen(slots=True)
class Remembered:
    """What the client got for an answer: its encoding after the correlation id, and its decoded
    form (over bytes the entry owns) for telemetry and the completed-request entry; and the topic
    names by id the broker's answer teaches (``TopicNames.taught``; empty for other answers)."""

    tail: bytes
    body: Any
    trailing: Any
    throttle_ms: int
    names: tuple[Any, ...] = ()


class AnswerMemo:
    """A bounded LRU of rewritten answers, shared by the sessions of one process (sans-I/O)."""

    __slots__ = ("_classes", "_entries", "_next_class", "bytes", "hits", "lane", "max_bytes", "max_entries",
                 "max_frame", "misses", "stored")

    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES,
                 max_frame: int = MAX_FRAME) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.max_frame = max_frame
        self._entries: collections.OrderedDict[Hashable, tuple[Remembered, int]] = collections.OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.stored = 0
        # The virtual cluster's lane (``Lane.memo_put``), when it has one: fed by ``to_lane``.
        self.lane: Any = None
        self._classes: dict[Hashable, int] = {}
        self._next_class = 1

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> Remembered | None:
        got = self._entries.get(key)
        if got is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return got[0]

    def put(self, key: Hashable, value: Remembered, size: int) -> None:
        """Remember ``value`` under ``key``; ``size`` is what both hold in bytes."""
        if size > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        self._entries[key] = (value, size)
        self.bytes += size
        self.stored += 1
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            _, (_, dropped) = self._entries.popitem(last=False)
            self.bytes -= dropped

    def lane_class(self, key: Hashable) -> int:
        """A number for ``key`` (api, version, listener, the filters' keys): the lane memo's class. A
        number is never given to another key, so what the lane stored under an old one is never
        served for a new one; past ``MAX_CLASSES`` the table starts again, with new numbers."""
        got = self._classes.get(key)
        if got is None:
            if len(self._classes) >= MAX_CLASSES:
                self._classes.clear()
            got = self._classes[key] = self._next_class
            self._next_class += 1
        return got

    def to_lane(self, key: Hashable, seen: bytes, tail: bytes) -> None:
        """The lane's memo learns that ``seen`` goes to connections of ``key``'s class as ``tail``."""
        if self.lane is not None:
            self.lane.memo_put(self.lane_class(key), seen, tail)

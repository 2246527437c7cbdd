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

    __slots__ = ("_entries", "bytes", "hits", "max_bytes", "max_entries", "max_frame", "misses", "stored")

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

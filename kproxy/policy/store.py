"""The rule set in force, replaced whole on each successful reload, with a record of every attempt.

A reload loads every file again; only a set that loads completely replaces the one in force, so a
request is always judged by one whole set, and an invalid edit leaves the old set working. Which
files to watch and when to reload is the server's business (``kproxy.server.reload``); this module
reads files only through the loader.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from kproxy.policy.engine import Policy
from kproxy.policy.loader import RuleError, describe_rules, load_rules
from kproxy.policy.model import RuleSet

log = logging.getLogger("kproxy.policy")


class RuleStore:
    """Rule files loaded as one ``Policy``; ``policy`` is what the filter reads on every request.

    ``generation`` counts the sets that have been in force (1 after the first load); ``loaded_at``
    is when the one in force was loaded (seconds since the epoch); ``reloads_ok`` and
    ``reloads_failed`` count reload attempts after the first load, and ``last_error`` holds the
    message of the last failed one. The constructor loads the files and raises RuleError if they
    do not load.
    """

    def __init__(self, paths: Sequence[str], chaos: bool = False, clock: Callable[[], float] = time.time) -> None:
        self.paths = tuple(paths)
        self.chaos = chaos
        self._clock = clock
        self.generation = 0
        self.loaded_at: float | None = None
        self.reloads_ok = 0
        self.reloads_failed = 0
        self.last_error: str | None = None
        # Called after each reload puts a new set in force (the server takes its laned connections
        # back, so that no request is relayed past the new rules).
        self.installed: list[Callable[[], None]] = []
        self.policy = self._install(load_rules(self.paths, chaos))

    @property
    def rule_set(self) -> RuleSet:
        return self.policy.rule_set

    @property
    def rule_count(self) -> int:
        return len(self.policy.rule_set.rules)

    @property
    def sources(self) -> tuple[str, ...]:
        """The files the rules in force came from (a directory's files listed one by one)."""
        return self.policy.rule_set.sources

    def _install(self, rule_set: RuleSet) -> Policy:
        policy = Policy(rule_set)
        self.generation += 1
        self.loaded_at = self._clock()
        for warning in rule_set.warnings:
            log.warning("rules: %s", warning)
        return policy

    def reload(self, reason: str) -> bool:
        """Load the files again; the new set replaces the old one only if it loads completely.

        Logs the outcome either way; returns whether the new set is in force.
        """
        rule_set = self.load(reason)
        if rule_set is None:
            return False
        self.install(rule_set, reason)
        return True

    def load(self, reason: str) -> RuleSet | None:
        """The files loaded again, not yet in force; None (counted and logged as a rejected reload)
        when they do not load. ``install`` or ``refuse`` it next (a caller may check it first, as
        the server checks that the KMS has the KEKs its encrypt rules name)."""
        try:
            return load_rules(self.paths, self.chaos)
        except RuleError as e:
            self.refuse(reason, str(e))
            return None

    def refuse(self, reason: str, message: str) -> None:
        self.reloads_failed += 1
        self.last_error = message
        log.error("rules reload (%s) rejected; generation %d (%d rules) stays in force:\n%s", reason,
                  self.generation, self.rule_count, message)

    def install(self, rule_set: RuleSet, reason: str) -> None:
        self.policy = self._install(rule_set)
        self.reloads_ok += 1
        self.last_error = None
        for hook in self.installed:
            hook()
        log.info("rules reloaded (%s): generation %d, %s", reason, self.generation, describe_rules(rule_set))

    def describe(self) -> dict[str, Any]:
        """The store's state as plain values (for an admin endpoint and metrics)."""
        rule_set = self.rule_set
        return {
            "generation": self.generation,
            "loaded_at": self.loaded_at,
            "rule_count": self.rule_count,
            "sources": list(self.sources),
            "paths": list(self.paths),
            "reloads_ok": self.reloads_ok,
            "reloads_failed": self.reloads_failed,
            "last_error": self.last_error,
            "default": rule_set.default,
            "chaos": rule_set.chaos_enabled,
            "rules": [{"name": r.name, "action": r.action, "where": str(r.where) if r.where else None}
                      for r in rule_set.rules],
            "quotas": [{"name": q.name, "per": q.per, **q.limits, "burst_s": q.burst_s,
                        "where": str(q.where) if q.where else None} for q in rule_set.quotas],
        }

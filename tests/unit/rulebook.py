"""Shared pieces for the policy tests: rule sets from YAML text, sessions with the policy filter."""

from __future__ import annotations

import itertools
import random
import textwrap
from pathlib import Path
from typing import Any

from kproxy.policy.engine import FixedRules
from kproxy.policy.filter import PolicyFilter
from kproxy.policy.loader import load_rules
from kproxy.policy.model import RuleSet
from kproxy.proxy.filters import ConnectionContext, FilterChain
from kproxy.proxy.session import Session
from kproxy.proxy.topics import TopicNames

_files = itertools.count()


def write_rules(directory: Path, text: str, name: str | None = None) -> str:
    path = directory / (name or f"rules-{next(_files)}.yaml")
    path.write_text(textwrap.dedent(text))
    return str(path)


def rule_set(directory: Path, text: str, chaos: bool = False) -> RuleSet:
    return load_rules([write_rules(directory, text)], chaos)


def policy_filter(directory: Path, text: str, chaos: bool = False, seed: int = 1,
                  topic_ids: TopicNames | None = None) -> PolicyFilter:
    return PolicyFilter(FixedRules.of(rule_set(directory, text, chaos)), random.Random(seed), topic_ids)


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def session(*filters: Any, connection_id: int = 1, address: str = "10.1.2.3", listener: str = "bootstrap",
            tls_subject: str | None = None) -> Session:
    ctx = ConnectionContext(connection_id, client_address=(address, 40000), listener=listener, clock=Clock(),
                            tls_subject=tls_subject)
    # As the server does: the sessions fill the table of topic names the policy filter reads.
    names = next((f.topic_ids for f in filters if isinstance(f, PolicyFilter)), None)
    return Session(ctx, FilterChain(filters), topic_names=names)

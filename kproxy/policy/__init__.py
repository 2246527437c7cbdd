"""Policy rules: a YAML rule language that allows, denies, rewrites, caps and disturbs Kafka traffic.

``loader`` turns rule files into a ``RuleSet`` (``model``), ``engine`` judges requests against it
(pure; ``decide`` works on plain values, ``PolicyFilter`` on live connections), and ``store`` keeps
the rule set in force across reloads.
"""

from kproxy.policy.engine import Decision, Facts, Policy, PolicyFilter, Refusal, decide
from kproxy.policy.loader import RuleError, load_rules
from kproxy.policy.model import Match, Rule, RuleSet
from kproxy.policy.store import RuleStore

__all__ = ["Decision", "Facts", "Match", "Policy", "PolicyFilter", "Refusal", "Rule", "RuleError", "RuleSet",
           "RuleStore", "decide", "load_rules"]

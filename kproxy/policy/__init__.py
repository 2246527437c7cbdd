"""Policy rules: a YAML rule language that allows, denies, rewrites, caps and disturbs Kafka traffic.

``loader`` turns rule files into a ``RuleSet`` (``model``), ``engine`` judges requests against it
(pure; ``decide`` works on plain values, ``PolicyFilter`` on live connections), and ``store`` keeps
the rule set in force across reloads.
"""

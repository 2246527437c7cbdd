"""The metric names a PromQL expression reads, from a small tokenizer of PromQL's lexical grammar.

An identifier names a metric when it is an instant-vector selector: not a keyword, not a function or
aggregation (followed by ``(``), not inside ``{...}`` (label matchers), and not in the label list of
``by``/``without``/``on``/``ignoring``/``group_left``/``group_right``, and not an aggregation followed by
its ``by``/``without`` clause. ``{__name__="x"}`` names ``x``.
Grafana's ``$variables`` are accepted where PromQL takes a duration or a string.
"""

from __future__ import annotations

import re

_TOKEN = re.compile(r"""
    (?P<space>\s+|\#[^\n]*)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<duration>\[[^\]]*\])
  | (?P<offset>\d+(?:ms|[smhdwy])(?:\d+(?:ms|[smhdwy]))*(?![\w:]))
  | (?P<number>(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?|[Ii]nf|NaN)(?![\w:]))
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<variable>\$\{?\w+\}?)
  | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=(){},@])
""", re.VERBOSE)

KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
                      "and", "or", "unless", "atan2"})
AGGREGATIONS = frozenset({"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
                          "bottomk", "topk", "quantile", "limitk", "limit_ratio"})
LABEL_LISTS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})


class PromQLSyntaxError(ValueError):
    pass


def tokens(expr: str) -> list[tuple[str, str]]:
    out = []
    pos = 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise PromQLSyntaxError(f"unexpected {expr[pos:pos + 20]!r} at {pos} in {expr!r}")
        kind = m.lastgroup
        assert kind is not None
        if kind != "space":
            out.append((kind, m.group()))
        pos = m.end()
    return out


def metric_names(expr: str) -> set[str]:
    """Every metric name ``expr`` selects."""
    toks = tokens(expr)
    names: set[str] = set()
    depth_braces = 0
    label_list_depth: int | None = None   # the paren depth of a by (...) list we are inside
    parens = 0
    i = 0
    while i < len(toks):
        kind, text = toks[i]
        nxt = toks[i + 1] if i + 1 < len(toks) else ("", "")
        if text == "{":
            depth_braces += 1
        elif text == "}":
            depth_braces -= 1
        elif text == "(":
            parens += 1
        elif text == ")":
            if label_list_depth == parens:
                label_list_depth = None
            parens -= 1
        elif kind == "ident":
            if text in LABEL_LISTS and nxt[1] == "(":
                label_list_depth = parens + 1
            elif depth_braces:
                if text == "__name__" and nxt[1] == "=" and i + 2 < len(toks) and toks[i + 2][0] == "string":
                    names.add(toks[i + 2][1][1:-1])
            elif (label_list_depth is not None or text in KEYWORDS or nxt[1] == "("
                  or (text in AGGREGATIONS and nxt[1] in ("by", "without"))):
                pass
            else:
                names.add(text)
        i += 1
    if depth_braces or parens:
        raise PromQLSyntaxError(f"unbalanced brackets in {expr!r}")
    return names

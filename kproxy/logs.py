"""Log output: the one place client-supplied strings are made safe to log.

Placeholder until the logging setup lands: ``safe`` escapes control characters and caps length.
"""

from __future__ import annotations


def safe(value: object, limit: int = 200) -> str:
    """``value`` as text that cannot forge log lines: control characters escaped, length capped."""
    if value is None:
        return "-"
    text = str(value)
    cut = len(text) - limit
    if cut > 0:
        text = text[:limit]
    out = text.encode("unicode_escape").decode("ascii") if not text.isprintable() else text
    return f"{out}...(+{cut} chars)" if cut > 0 else out

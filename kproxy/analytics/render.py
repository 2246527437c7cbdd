"""Turns the report's small, already-collected results into one self-contained HTML page.

Charts are matplotlib PNGs embedded as base64 data URIs, styles are inline, and nothing is fetched,
so the file reads the same offline or attached to a ticket. No Spark here: ``job`` hands over plain
rows (lists of dicts) that it collected from the final tables.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import io
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from matplotlib.figure import Figure

Row = Mapping[str, Any]
DASH = "\u2013"  # shown for a value that is absent

_PALETTE = ("#2f6db5", "#e07b39", "#3a9a5b", "#c8423c", "#8a63b8", "#7f7f7f")


@dataclass
class Section:
    title: str
    anchor: str
    intro: str = ""
    parts: list[str] = field(default_factory=list)


# ---- formatting ------------------------------------------------------------------------------

def fmt_bytes(n: float | None) -> str:
    if n is None:
        return DASH
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1024
    raise AssertionError


def fmt_rate(n: float | None) -> str:
    return DASH if n is None else f"{fmt_bytes(n)}/s"


def fmt_int(n: float | None) -> str:
    return DASH if n is None else f"{int(n):,}"


def fmt_ms(n: float | None) -> str:
    if n is None:
        return DASH
    if abs(n) >= 100:
        return f"{n:,.0f} ms"
    return f"{n:.3g} ms"


def fmt_time(t: dt.datetime | None) -> str:
    return DASH if t is None else t.strftime("%Y-%m-%d %H:%M:%S")


def fmt_code(n: int | None) -> str:
    """A top-level error code; 0 means the error was only in partitions."""
    return DASH if not n else str(n)


def fmt_share(x: float | None) -> str:
    return DASH if x is None else f"{100 * x:.1f}%"


def fmt_text(x: Any) -> str:
    if x is None:
        return "(none)"
    if isinstance(x, list | tuple):
        return ", ".join(str(v) for v in x) or DASH
    return str(x)


# ---- charts ------------------------------------------------------------------------------------

def png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return buf.getvalue()


def _figure(height: float = 3.2) -> Figure:
    fig = Figure(figsize=(11.5, height))
    fig.patch.set_facecolor("white")
    return fig


def time_chart(title: str, times: Sequence[dt.datetime], series: Mapping[str, Sequence[float]],
               ylabel: str) -> bytes:
    fig = _figure()
    ax = fig.add_subplot()
    x: Any = list(times)  # matplotlib's stubs want arrays; it converts datetimes itself
    few = len(x) < 4      # a short log: a line through one or two points would not show
    for (name, values), color in zip(series.items(), _PALETTE, strict=False):
        ax.plot(x, values, label=name, color=color, linewidth=1.4, marker="o" if few else None)
    if few and x:
        # matplotlib pads a single date by years; pad by a bucket's width instead.
        step = (x[-1] - x[0]) / max(len(x) - 1, 1) if len(x) > 1 else dt.timedelta(minutes=1)
        ax.set_xlim(x[0] - step, x[-1] + step)
    ax.set_title(title, loc="left", fontsize=11)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    # Above the plot, so it never hides the data.
    ax.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(series), fontsize=8, frameon=False)
    ax.set_ylim(bottom=0)
    fig.autofmt_xdate()
    return png(fig)


def bar_chart(title: str, labels: Sequence[str], series: Mapping[str, Sequence[float]], xlabel: str,
              log: bool = False, stacked: bool = False) -> bytes:
    """Horizontal bars, one group per label (first label on top)."""
    n = len(labels)
    per_label = 0.3 if stacked or len(series) == 1 else 0.18 * len(series) + 0.12
    fig = _figure(max(2.2, per_label * n + 1.0))
    ax = fig.add_subplot()
    k = len(series)
    height = 0.8 if stacked else 0.8 / max(k, 1)
    left = [0.0] * n
    for i, ((name, values), color) in enumerate(zip(series.items(), _PALETTE, strict=False)):
        ys = [n - 1 - j + (0 if stacked else (k - 1 - i) * height - 0.4 + height / 2) for j in range(n)]
        vals = [float(v or 0) for v in values]
        ax.barh(ys, vals, height=height, left=left if stacked else None, label=name, color=color)
        if stacked:
            left = [a + b for a, b in zip(left, vals, strict=True)]
    ax.set_yticks(range(n - 1, -1, -1))
    ax.set_yticklabels([_short(label) for label in labels], fontsize=8)
    ax.set_title(title, loc="left", fontsize=11)
    ax.set_xlabel(xlabel)
    if log:
        ax.set_xscale("log")
    ax.grid(axis="x", alpha=0.3)
    if k > 1:
        ax.legend(loc="lower right", fontsize=8)
    return png(fig)


def _short(label: str, width: int = 38) -> str:
    return label if len(label) <= width else label[: width - 1] + "…"


# ---- HTML --------------------------------------------------------------------------------------

def img(data: bytes, alt: str) -> str:
    b64 = base64.b64encode(data).decode("ascii")
    return f'<img class="chart" alt="{html.escape(alt)}" src="data:image/png;base64,{b64}">'


Column = tuple[str, str, Callable[[Any], str]]  # (row key, header, formatter)


def table(rows: Sequence[Row], columns: Sequence[Column], total: int | None = None, source: str = "") -> str:
    if not rows:
        return '<p class="empty">None in this window.</p>'
    head = "".join(f"<th>{html.escape(h)}</th>" for _, h, _ in columns)
    body = []
    for row in rows:
        cells = []
        for key, _, fmt in columns:
            value = row.get(key)
            num = isinstance(value, int | float) and not isinstance(value, bool)
            cells.append(f'<td{" class=num" if num else ""}>{html.escape(fmt(value))}</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    note = ""
    if total is not None and total > len(rows):
        note = f'<p class="note">Showing {len(rows):,} of {total:,} rows; all of them are in <code>{html.escape(source)}</code>.</p>'
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>{note}"


def cards(items: Iterable[tuple[str, str]]) -> str:
    return '<div class="cards">' + "".join(
        f'<div class="card"><div class="v">{html.escape(v)}</div><div class="k">{html.escape(k)}</div></div>'
        for k, v in items) + "</div>"


def paragraph(text: str) -> str:
    return f"<p>{html.escape(text)}</p>"


_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;color:#1d1d1f;margin:0;background:#f6f7f9}
main{max-width:1180px;margin:0 auto;padding:24px 32px 64px}
h1{font-size:26px;margin:0 0 4px} h2{font-size:20px;margin:36px 0 8px;border-bottom:2px solid #dde2ea;padding-bottom:4px}
h3{font-size:15px;margin:22px 0 6px}
.meta{color:#5b6472;margin:0 0 16px} nav a{margin-right:14px;color:#2f6db5;text-decoration:none}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin:16px 0}
.card{background:#fff;border:1px solid #dde2ea;border-radius:8px;padding:10px 14px;min-width:130px}
.card .v{font-size:19px;font-weight:600} .card .k{color:#5b6472;font-size:12px}
table{border-collapse:collapse;background:#fff;margin:6px 0 4px;font-size:12.5px;width:100%}
th,td{border:1px solid #dde2ea;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#eef1f6;font-weight:600} td:first-child{white-space:nowrap} td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
tbody tr:nth-child(even){background:#fafbfc}
.chart{width:100%;background:#fff;border:1px solid #dde2ea;border-radius:6px;margin:8px 0}
.note,.empty{color:#5b6472;font-size:12.5px} .warn{background:#fff4e5;border:1px solid #f0c27a;padding:8px 12px;border-radius:6px}
pre{background:#fff;border:1px solid #dde2ea;padding:10px;overflow:auto;font-size:12px;max-height:420px}
code{font-size:12.5px}
"""


def page(title: str, meta: str, summary_cards: str, sections: Sequence[Section], footer: str) -> str:
    nav = "".join(f'<a href="#{s.anchor}">{html.escape(s.title)}</a>' for s in sections)
    body = []
    for s in sections:
        body.append(f'<h2 id="{s.anchor}">{html.escape(s.title)}</h2>')
        if s.intro:
            body.append(paragraph(s.intro))
        body.extend(s.parts)
    return ("<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body><main>"
            f"<h1>{html.escape(title)}</h1><p class=\"meta\">{meta}</p><nav>{nav}</nav>{summary_cards}"
            + "".join(body) + f'<h2 id="tables">Tables</h2>{footer}</main></body></html>\n')


def nonzero(values: Iterable[float | None]) -> bool:
    return any(v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v)))

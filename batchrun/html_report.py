"""``batchrun report --html``: one self-contained page (inline CSS and SVG; no scripts, fonts or links).

It draws the latency histogram, the TTFT histogram of a streamed job and throughput over time from
:func:`batchrun.report.job_report` and shows the same tables as the text report.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from html import escape
from typing import Any

from batchrun.report import (
    HTML_GENERATOR,
    MEASURES,
    NO_EXAMPLE,
    NONE,
    PERCENTILES,
    SPLIT,
    SPLIT_PERCENTILES,
    batch_table,
    fmt_money,
    fmt_ms,
    fmt_pct,
    fmt_rate,
    nice_step,
    overview_rows,
)

WIDTH, HEIGHT = 760, 260
LEFT, RIGHT, TOP, BOTTOM = 60, 16, 18, 46

CSS = """
:root { color-scheme: light; --ink: #1f2328; --muted: #656d76; --line: #d0d7de; --bar: #4c78a8;
        --tail: #e45756; --mark: #f58518; --bg: #ffffff; --panel: #f6f8fa; }
* { box-sizing: border-box; }
body { margin: 0 auto; max-width: 980px; padding: 24px; color: var(--ink); background: var(--bg);
       font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
h1 { font-size: 22px; margin: 0 0 4px; }
h2 { font-size: 16px; margin: 28px 0 8px; }
.sub { color: var(--muted); margin: 0; overflow-wrap: anywhere; }
.cards { display: grid; grid-template-columns: repeat(auto-fit, minmax(140px, 1fr)); gap: 10px; margin: 18px 0 6px; }
.card { background: var(--panel); border: 1px solid var(--line); border-radius: 6px; padding: 10px 12px; }
.card .v { font-size: 20px; font-weight: 600; }
.card .k { color: var(--muted); font-size: 12px; }
table { border-collapse: collapse; width: 100%; margin: 4px 0; }
table.narrow { width: auto; min-width: 260px; }
th, td { border-bottom: 1px solid var(--line); padding: 5px 8px; text-align: left; vertical-align: top; }
th { background: var(--panel); font-weight: 600; }
td.n, th.n { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.msg { color: var(--muted); overflow-wrap: anywhere; font-family: ui-monospace, SFMono-Regular, Menlo, monospace;
         font-size: 12px; }
svg { width: 100%; height: auto; display: block; background: var(--panel); border: 1px solid var(--line);
      border-radius: 6px; }
svg text { font: 11px system-ui, sans-serif; fill: var(--muted); }
svg .bar { fill: var(--bar); }
svg .tail { fill: var(--tail); }
svg .axis { stroke: var(--ink); stroke-width: 1; }
svg .grid { stroke: var(--line); stroke-width: 1; }
svg .mark { stroke: var(--mark); stroke-width: 1.5; stroke-dasharray: 4 3; }
svg text.marklabel { fill: var(--mark); font-weight: 600; }
.empty { color: var(--muted); font-style: italic; }
.note { color: var(--muted); font-size: 12px; }
footer { color: var(--muted); font-size: 12px; margin-top: 32px; }
"""


def _num(value: float) -> str:
    """A coordinate: short and locale-free."""
    return f"{value:.1f}".rstrip("0").rstrip(".")


def _tick_label(value: float) -> str:
    if value >= 1000 and value == int(value):
        return f"{int(value):,}"
    return f"{value:g}"


def bar_chart(
    counts: Sequence[int],
    edges: Sequence[float],
    *,
    label: str,
    x_title: str,
    y_title: str,
    tips: Sequence[str],
    tail: int | None = None,
    tail_tip: str = "",
    marks: Sequence[tuple[str, float]] = (),
) -> str:
    """An SVG bar chart: ``counts[i]`` over ``[edges[i], edges[i+1])``, optional overflow bar and markers.

    ``marks`` are (label, x) vertical lines in the units of ``edges``.
    """
    bars = list(counts) + ([tail] if tail else [])
    n = len(bars)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    top = max(bars) if bars and max(bars) > 0 else 1
    step = nice_step(top / 4)
    y_max = math.ceil(top / step) * step
    bar_w = plot_w / max(n, 1)
    out = [
        f'<svg viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{escape(label)}">',
        f"<title>{escape(label)}</title>",
    ]
    # Horizontal grid lines and y labels.
    k = 0
    while k * step <= y_max + 1e-9:
        y = TOP + plot_h - (k * step) / y_max * plot_h
        out.append(f'<line class="grid" x1="{LEFT}" y1="{_num(y)}" x2="{WIDTH - RIGHT}" y2="{_num(y)}"/>')
        out.append(f'<text x="{LEFT - 6}" y="{_num(y + 4)}" text-anchor="end">{_tick_label(k * step)}</text>')
        k += 1
    for i, value in enumerate(bars):
        if value <= 0:
            continue
        h = value / y_max * plot_h
        x = LEFT + i * bar_w
        cls = "tail" if tail and i == n - 1 else "bar"
        tip = tail_tip if cls == "tail" else tips[i]
        out.append(
            f'<rect class="{cls}" x="{_num(x + 0.5)}" y="{_num(TOP + plot_h - h)}" '
            f'width="{_num(max(bar_w - 1, 0.5))}" height="{_num(h)}"><title>{escape(tip)}</title></rect>'
        )
    # X labels at bar edges: at most about eight of them.
    every = max(1, math.ceil(len(counts) / 8))
    for i in range(0, len(counts) + 1, every):
        x = LEFT + i * bar_w
        out.append(f'<line class="axis" x1="{_num(x)}" y1="{TOP + plot_h}" x2="{_num(x)}" y2="{TOP + plot_h + 4}"/>')
        out.append(f'<text x="{_num(x)}" y="{TOP + plot_h + 16}" text-anchor="middle">{_tick_label(edges[i])}</text>')
    if tail:
        x = LEFT + (n - 0.5) * bar_w
        out.append(f'<text x="{_num(x)}" y="{TOP + plot_h + 16}" text-anchor="middle">more</text>')
    span = edges[len(counts)] - edges[0]
    for name, at in marks:
        if span <= 0 or not edges[0] <= at <= edges[len(counts)]:
            continue
        x = LEFT + (at - edges[0]) / span * len(counts) * bar_w
        out.append(f'<line class="mark" x1="{_num(x)}" y1="{TOP}" x2="{_num(x)}" y2="{TOP + plot_h}"/>')
        out.append(f'<text class="marklabel" x="{_num(x + 3)}" y="{TOP + 10}">{escape(name)}</text>')
    out.append(f'<line class="axis" x1="{LEFT}" y1="{TOP + plot_h}" x2="{WIDTH - RIGHT}" y2="{TOP + plot_h}"/>')
    out.append(f'<line class="axis" x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{TOP + plot_h}"/>')
    out.append(f'<text x="{LEFT + plot_w / 2:.0f}" y="{HEIGHT - 8}" text-anchor="middle">{escape(x_title)}</text>')
    out.append(
        f'<text x="14" y="{TOP + plot_h / 2:.0f}" text-anchor="middle" '
        f'transform="rotate(-90 14 {TOP + plot_h / 2:.0f})">{escape(y_title)}</text>'
    )
    out.append("</svg>")
    return "\n".join(out)


def latency_chart(data: dict[str, Any], measure: str = "latency_ms") -> str:
    """The histogram of clean answers' latency, or of their TTFT (``measure="ttft_ms"``: streamed answers)."""
    hist = data.get("ttft_histogram" if measure == "ttft_ms" else "latency_histogram")
    if not hist:
        return '<p class="empty">No clean answer yet.</p>'
    low, width, counts = hist["low_ms"], hist["width_ms"], hist["counts"]
    edges = [low + i * width for i in range(len(counts) + 1)]
    tips = [f"{_tick_label(edges[i])}–{_tick_label(edges[i + 1])} ms: {c:,} requests" for i, c in enumerate(counts)]
    lat = data[measure]
    marks = [(f"p{p}", lat[f"p{p}"]) for p in PERCENTILES if lat[f"p{p}"] is not None]
    what = "time to first token" if measure == "ttft_ms" else "latency"
    chart = bar_chart(
        counts, edges, label=f"{what.capitalize()} histogram of clean answers", x_title=f"{what} (ms)", y_title="requests",
        tips=tips, tail=hist["overflow"],
        tail_tip=f"{_tick_label(hist['overflow_from_ms'])} ms or more: {hist['overflow']:,} requests", marks=marks,
    )
    note = (
        f'<p class="note">{hist["overflow"]:,} slower requests (from {fmt_ms(hist["overflow_from_ms"])} up to '
        f'{fmt_ms(lat["max"])}) are in the last bar.</p>'
        if hist["overflow"]
        else ""
    )
    return chart + note


def throughput_chart(data: dict[str, Any]) -> str:
    line = data.get("throughput_timeline")
    if not line:
        return '<p class="empty">No item has succeeded yet.</p>'
    width, counts = line["width_s"], line["counts"]
    scale, unit = (60.0, "min") if width * len(counts) > 600 else (1.0, "s")
    edges = [i * width / scale for i in range(len(counts) + 1)]
    start = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(line["start"]))
    tips = [
        f"{_tick_label(edges[i])}–{_tick_label(edges[i + 1])} {unit}: {c:,} succeeded ({c / width:,.1f}/s)"
        for i, c in enumerate(counts)
    ]
    chart = bar_chart(
        counts, edges, label="Items succeeded over time", x_title=f"{unit} since the first request ({start})",
        y_title=f"succeeded per {_tick_label(width)} s", tips=tips,
    )
    return chart


def _rows(rows: Sequence[Sequence[tuple[str, str]]]) -> str:
    """Table rows; each cell is (css class, already escaped html)."""
    return "\n".join("<tr>" + "".join(f'<td class="{c}">{v}</td>' if c else f"<td>{v}</td>" for c, v in r) + "</tr>"
                     for r in rows)


def _head(*names: str, numeric: Sequence[int] = ()) -> str:
    return "<tr>" + "".join(
        f'<th class="n">{escape(n)}</th>' if i in numeric else f"<th>{escape(n)}</th>" for i, n in enumerate(names)
    ) + "</tr>"


def render_html(data: dict[str, Any]) -> str:
    """The whole page for one :func:`~batchrun.report.job_report`."""
    e = escape
    title = f"Job {data['job_id']}" + (f" ({data['name']})" if data["name"] else "")
    counts, lat = data["counts"], data["latency_ms"]
    state = data["state"]
    if state == "cancelled":
        state = f"cancelled ({counts['cancelled']:,})"
    cards = [
        (state, "job"),
        (f"{counts['succeeded']:,} / {data['total']:,}", "succeeded / items"),
        (fmt_pct(data["error_rate"]), "error rate (failed or invalid)"),
        (fmt_ms(lat["p50"]), "latency p50"),
        (fmt_ms(lat["p99"]), "latency p99"),
        (fmt_rate(data["throughput_per_s"]), "throughput"),
        (fmt_money(data["cost_usd"]), "cost"),
    ]
    overview = overview_rows(data)
    timing = [
        [("", e(label)), ("n", f"{data[m]['count']:,}")]
        + [("n", e(fmt_ms(data[m][f"p{p}"]))) for p in PERCENTILES]
        + [("n", e(fmt_ms(data[m]["mean"]))), ("n", e(fmt_ms(data[m]["max"])))]
        for m, label in MEASURES.items()
    ]
    split = data.get("latency_split")
    split_section = ""
    if split and split["latency_ms"]["count"]:
        cells = [
            [("", e(label))] + [("n", e(fmt_ms(split[m][f"p{p}"]))) for p in SPLIT_PERCENTILES]
            for m, label in SPLIT.items()
        ]
        split_section = (
            f"<h2>Where the time went</h2>\n<table class=\"narrow\">"
            f"{_head('', *(f'p{p}' for p in SPLIT_PERCENTILES), numeric=range(1, 1 + len(SPLIT_PERCENTILES)))}"
            f"{_rows(cells)}</table>\n<p class=\"note\">Over {split['latency_ms']['count']:,} clean answers: queue wait "
            "is from when the item was ready to when its request was sent; first and last byte are counted from "
            "sending. Without streaming a server sends its headers once the answer is ready, so the two are "
            "close; streamed, the gap between them is the generation.</p>\n"
        )
    ttft_section = ""
    if data.get("ttft_histogram"):
        ttft_section = f"<h2>Time to first token of streamed answers</h2>\n{latency_chart(data, 'ttft_ms')}\n"

    def error_table(key: str, groups: dict[str, dict[str, Any]]) -> str:
        if not groups:
            return '<p class="empty">No errors.</p>'
        rows = [
            [("", e("no response" if name == "none" else name)), ("n", f"{g['attempts']:,}"), ("n", f"{g['items']:,}"),
             ("msg", e(g["example"] or NONE))]
            for name, g in groups.items()
        ]
        note = (
            f'<p class="note">{NONE}: {e(NO_EXAMPLE)}.</p>'
            if any(g["example"] is None for g in groups.values())
            else ""
        )
        head = _head(key, "failed attempts", "items", "example message", numeric=(1, 2))
        return f"<table>{head}{_rows(rows)}</table>{note}"

    attempts = [[("n", e(n)), ("n", f"{items:,}")] for n, items in data["attempts_histogram"].items() if items]
    batches = batch_table(data.get("batch"))
    batch_section = ""
    if batches is not None:
        columns, rows, caption = batches
        cells = [[("n" if i in (0, 4, 5) else "", e(v)) for i, v in enumerate(row)] for row in rows]
        batch_section = (
            f"<h2>Provider batches (batch mode)</h2>\n<table>{_head(*columns, numeric=(0, 4, 5))}{_rows(cells)}</table>"
            f'\n<p class="note">{e(caption)}</p>\n'
        )
    generated = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(data["as_of"]))
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="generator" content="{HTML_GENERATOR}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>batchrun report: {e(title)}</title>
<style>{CSS}</style>
</head>
<body>
<header>
<h1>{e(title)}</h1>
<p class="sub">{e(data['input'])} · {e(data['model'] or '(model as in each input line)')} · generated {e(generated)}</p>
</header>
<section class="cards">
{"".join(f'<div class="card"><div class="v">{e(v)}</div><div class="k">{e(k)}</div></div>' for v, k in cards)}
</section>
<h2>Latency of clean answers</h2>
{latency_chart(data)}
{ttft_section}<h2>Throughput over time</h2>
{throughput_chart(data)}
<h2>Timing</h2>
<table>{_head("", "count", *(f"p{p}" for p in PERCENTILES), "mean", "max", numeric=range(1, 7))}{_rows(timing)}</table>
<p class="note">Latency and TTFT (time to first token, streamed requests only) cover clean answers (no transport,
HTTP or output error); queue wait covers every request, from when the item was ready to when its request was sent.</p>
{split_section}<h2>Job</h2>
<table>{_rows([[("", e(k)), ("", e(v))] for k, v in overview])}</table>
<h2>Errors by class</h2>
{error_table("class", data["errors_by_class"])}
<h2>Errors by HTTP status</h2>
{error_table("status", data["errors_by_status"])}
<h2>Requests per item</h2>
<table class="narrow">{_head("requests", "items", numeric=(0, 1))}{_rows(attempts)}</table>
{batch_section}<footer>batchrun report of job {data['job_id']} · ledger figures as of {e(generated)}</footer>
</body>
</html>
"""

"""Shared plot helpers: one house style, titles and axis labels on every figure."""

from __future__ import annotations

import math
import re
import textwrap
from collections.abc import Sequence

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from lowprec.analysis import RUNAWAY_LOGIT, layer_logit
from lowprec.formats import Format, as_format, bits, round_to
from lowprec.runs import Run

COLOURWAY = [  # the book template's: d3's ten, then ten more that differ from them and from each other
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
    "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#6baed6", "#fd8d3c", "#74c476",
    "#9e9ac8", "#252525",
]  # fmt: skip
FIELD_COLOURS = {"sign": "#d62728", "exponent": "#1f77b4", "significand": "#2ca02c"}
# A table's layout (px): a width at or below the width the book's pages give a figure (688 in a window 1280
# wide, 736 or 790 in others); plotly's 12 px table text: width per character (on average, rounded up), a
# cell's padding either side, height per line; and a row's padding (measured in Chromium)
TABLE_WIDTH, CHAR_WIDTH, CELL_PADDING, LINE_HEIGHT, ROW_PADDING = 680, 6.0, 6, 16, 20


TITLE_CHARS = 80  # characters a title's line holds at the book's narrowest figure width (688 px)
SUBTITLE_CHARS = 100  # and a subtitle's line (a smaller font)


def set_title(fig: go.Figure, title: str, top: int = 60) -> go.Figure:
    """Give `fig` its title, wrapped at TITLE_CHARS characters a line (plotly clips a long one at the
    figure's edge), and `top` px above the plot plus a line's height for each line after the first."""
    lines = [line for part in title.split("<br>") for line in textwrap.wrap(part, TITLE_CHARS) or [""]]
    fig.update_layout(title="<br>".join(lines), margin={"t": top + 22 * (len(lines) - 1)})
    return fig


def add_subtitle(fig: go.Figure, text: str) -> go.Figure:
    """Add `text` to `fig`'s subtitle, wrapped at SUBTITLE_CHARS characters a line, with room above the plot
    for each line."""
    lines = textwrap.wrap(text, SUBTITLE_CHARS)
    before = fig.layout.title.subtitle.text
    fig.update_layout(title_subtitle_text="<br>".join([before, *lines] if before else lines))
    fig.layout.margin.t = (fig.layout.margin.t or 60) + 18 * len(lines) + (0 if before else 4)
    return fig


def new_figure(title: str, x_title: str, y_title: str, **layout) -> go.Figure:
    """An empty figure with a title (`set_title`) and both axis titles (give units in them, e.g. "error
    (ulps)")."""
    fig = go.Figure()
    fig.update_layout(xaxis_title=x_title, yaxis_title=y_title, **layout)
    return set_title(fig, title)


def name_overlaps(fig: go.Figure, share: float = 0.02, most: float = 0.95) -> go.Figure:
    """Name in `fig`'s subtitle the line traces drawn on one another, so that a reader knows of the ones
    hidden under the last drawn: traces of one pair of axes and the same x values whose y values lie within
    `share` of the span of that pair's y values (in decades on a log axis) from the group's first at `most`
    of the points or more (noisy lines that look alike). Traces with gaps (None) are left out."""
    panels: dict[tuple, list] = {}  # (x axis, y axis) -> [(trace, y values)]
    for trace in fig.data:
        if (trace.type == "scatter" and "lines" in (trace.mode or "lines") and trace.y is not None
                and None not in trace.y):
            yaxis = fig.layout["yaxis" + (trace.yaxis or "y")[1:]]
            y = [math.log10(v) if yaxis.type == "log" else v for v in trace.y]
            panels.setdefault((trace.xaxis, trace.yaxis), []).append((trace, y))
    shared = []
    for traces in panels.values():
        values = [v for _, y in traces for v in y]
        tol = share * (max(values) - min(values))
        groups: list[list] = []
        for trace, y in traces:
            same = [g for g in groups if list(g[0][0].x) == list(trace.x)
                    and sum(abs(a - b) <= tol for a, b in zip(g[0][1], y, strict=True)) >= most * len(y)]
            if same:
                same[0].append((trace, y))
            else:
                groups.append([(trace, y)])
        shared += [" = ".join(t.name.replace(" ", "\u00a0") for t, _ in group)  # a name on one line
                   for group in groups if len(group) > 1]
    if shared:
        add_subtitle(fig, f"drawn on one another (within {share:.0%} of the axis at {most:.0%} of the "
                          "points): " + "; ".join(shared))
    return fig


def bit_fields_figure(value: float, formats: list[Format | str]) -> go.Figure:
    """One bar per format, split into sign / exponent / significand fields, labelled with the bits that
    `value` (rounded to nearest in that format) has there."""
    fmts = [as_format(f) for f in formats]
    labels = [str(f) for f in fmts]
    fields = [bits(round_to(torch.tensor([value]), f).item(), f) for f in fmts]
    fig = new_figure(
        f"Bit fields of each format, holding {value} (rounded to nearest)",
        "bits (count from the sign bit)",
        "format",
        barmode="stack",
        height=120 + 55 * len(fmts),
        legend={"orientation": "h", "y": -0.3, "traceorder": "normal"},
    )
    parts = {
        "sign": ([1] * len(fmts), [str(b.sign) for b in fields]),
        "exponent": ([f.exp_bits for f in fmts], [f"{b.exponent:0{b.fmt.exp_bits}b}" for b in fields]),
        "significand": ([f.man_bits for f in fmts], [f"{b.significand:0{b.fmt.man_bits}b}" for b in fields]),
    }
    for name, (widths, text) in parts.items():
        fig.add_bar(
            name=name,
            y=labels,
            x=widths,
            orientation="h",
            text=text,
            textposition="inside",
            insidetextanchor="middle",
            marker_color=FIELD_COLOURS[name],
            textfont={"family": "monospace", "color": "white"},
            hovertemplate=f"{name}: %{{x}} bits<br>%{{text}}<extra>%{{y}}</extra>",
        )
    fig.update_yaxes(autorange="reversed")
    fig.update_xaxes(range=[0, 32.5], dtick=4, tick0=0)
    return fig


def table_figure(title: str, header: Sequence[str], rows: Sequence[Sequence[str]],
                 widths: Sequence[float]) -> go.Figure:
    """A plotly table (cells may hold <b> and the like), columns as wide as `widths` relative to each other,
    and tall enough for every row at TABLE_WIDTH px or wider: plotly wraps a cell's text to its column, but
    would cut off the rows below the figure's height."""

    chars = [max(4, int((w / sum(widths) * TABLE_WIDTH - 2 * CELL_PADDING) / CHAR_WIDTH)) for w in widths]

    def lines(row: Sequence[str]) -> int:
        """Lines of the row's tallest cell at TABLE_WIDTH px (`chars` characters a line per column)."""
        return max(len(textwrap.wrap(re.sub(r"<[^>]+>", "", cell), n)) or 1
                   for cell, n in zip(row, chars, strict=True))

    header = [f"<b>{h}</b>" for h in header]
    fig = go.Figure(go.Table(
        columnwidth=list(widths),
        header={"values": header, "align": "left", "fill_color": "#e8f1fa"},
        cells={"values": [list(col) for col in zip(*rows, strict=True)], "align": "left"},
    ))  # fmt: skip
    fig.update_layout(margin={"l": 10, "r": 10, "b": 10})
    top = set_title(fig, title).layout.margin.t
    body = sum(lines(row) * LINE_HEIGHT + ROW_PADDING for row in [header, *rows])
    fig.update_layout(height=top + body + 10)
    return fig


def logit_figure(title: str, runs: dict[str, Run], colours: dict[str, str] | None = None,
                 dashes: dict[str, str] | None = None, layer: int = 1) -> go.Figure:
    """`layer_logit` of each run (log scale), in its colour and dash where `colours` / `dashes` name one (the
    template's distinct colours otherwise), with the runaway threshold."""
    fig = new_figure(title, "step", f"largest logit of layer index {layer}<br>(over heads and sampled rows)",
                     yaxis_type="log")
    for name, run in runs.items():
        steps, largest = layer_logit(run, layer)
        line = {key: given[name] for key, given in (("color", colours), ("dash", dashes))
                if given and name in given}
        fig.add_scatter(x=steps, y=largest, mode="lines", name=name, line=line)
    fig.add_hline(y=RUNAWAY_LOGIT, line_dash="dot", line_color="black", line_width=1)  # no run's colour
    fig.add_annotation(text="runaway threshold", x=0, xref="paper", xanchor="left",  # early logits are small
                       y=math.log10(RUNAWAY_LOGIT),  # on a log axis, an annotation's y is log10 of its value
                       yanchor="bottom", showarrow=False)
    return fig


def lr_figure(title: str, sweep: dict[str, list[dict]]) -> go.Figure:
    """`analysis.lr_sweep` as two panels against the learning rate (log axis, a tick at each rate): the share
    of runs that ran away, and the median loss at the horizon. One colour per placement, QK-LayerNorm's series
    dotted with open markers; markers shrink series by series, so that series drawn on one another all show,
    and the subtitle names the series with no runaway at any rate (one line at 0)."""
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12,
                        subplot_titles=["share of runs with a runaway", "median loss at the horizon"])
    placements = list(dict.fromkeys(label.split(" + ")[0] for label in sweep))
    for i, (label, rows) in enumerate(sweep.items()):
        qkln = " + " in label
        style = {"line_color": COLOURWAY[placements.index(label.split(" + ")[0]) % len(COLOURWAY)],
                 "line_dash": "dot" if qkln else "solid", "marker_size": max(4, 13 - 2 * i),
                 "marker_symbol": "circle-open" if qkln else "circle", "legendgroup": label}
        lrs = [r["lr"] for r in rows]
        fig.add_scatter(x=lrs, y=[r["runaways"] / r["runs"] for r in rows], mode="lines+markers", name=label,
                        row=1, col=1, customdata=[[r["runaways"], r["runs"]] for r in rows],
                        hovertemplate="lr %{x:g}: %{customdata[0]} of %{customdata[1]} runs<extra></extra>",
                        **style)
        fig.add_scatter(x=lrs, y=[r["loss"] for r in rows], mode="lines+markers", name=label,
                        showlegend=False, row=1, col=2, **style)
    rates = sorted({r["lr"] for rows in sweep.values() for r in rows})
    fig.update_xaxes(type="log", title_text="peak learning rate", tickvals=rates,
                     ticktext=[f"{lr:g}" for lr in rates])
    fig.update_yaxes(title_text="share of runs", range=[-0.05, 1.05], row=1, col=1)
    fig.update_yaxes(title_text="loss (nats per token)", row=1, col=2)
    set_title(fig, title, top=80)
    calm = [label for label, rows in sweep.items() if not any(r["runaways"] for r in rows)]
    if len(calm) > 1:
        add_subtitle(fig, "no runaway at any rate, so one line at 0: " + ", ".join(calm))
    return fig


def survival_figure(title: str, table: dict[str, dict], event: str, horizon: int) -> go.Figure:
    """Kaplan-Meier curves of `event` ("runaway" or "explosion"), one per arm of `table`
    (`analysis.survival_table`), as steps to `horizon`; each arm's legend entry counts its events and runs.
    Arms with no event draw the same line at 1, so the subtitle names them."""
    fig = new_figure(title, "step", "share of runs without the event<br>(Kaplan-Meier)",
                     yaxis_range=[0, 1.05])
    for arm, row in table.items():
        curve = row[event]["curve"]
        fig.add_scatter(x=[t for t, _ in curve] + [horizon], y=[s for _, s in curve] + [curve[-1][1]],
                        mode="lines", line_shape="hv", name=f"{arm}: {row[event]['events']} of {row['runs']}")
    flat = [arm for arm, row in table.items() if row[event]["events"] == 0]
    if len(flat) > 1:
        add_subtitle(fig, f"no {event} by step {horizon:,}, so one line at 1: " + ", ".join(flat))
    return fig

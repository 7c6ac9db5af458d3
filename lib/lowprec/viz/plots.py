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


def new_figure(title: str, x_title: str, y_title: str, **layout) -> go.Figure:
    """An empty figure with a title and both axis titles (give units in them, e.g. "error (ulps)")."""
    fig = go.Figure()
    fig.update_layout(title=title, xaxis_title=x_title, yaxis_title=y_title, margin={"t": 60}, **layout)
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
    top = 60
    height = top + sum(lines(row) * LINE_HEIGHT + ROW_PADDING for row in [header, *rows]) + 10
    fig.update_layout(title=title, height=height, margin={"l": 10, "r": 10, "t": top, "b": 10})
    return fig


def logit_figure(title: str, runs: dict[str, Run], colours: dict[str, str] | None = None,
                 dashes: dict[str, str] | None = None, layer: int = 1) -> go.Figure:
    """`layer_logit` of each run (log scale), in its colour and dash where `colours` / `dashes` name one (the
    template's distinct colours otherwise), with the runaway threshold."""
    fig = new_figure(title, "step", f"largest logit of layer index {layer} (over heads and sampled rows)",
                     yaxis_type="log")
    for name, run in runs.items():
        steps, largest = layer_logit(run, layer)
        line = {key: given[name] for key, given in (("color", colours), ("dash", dashes))
                if given and name in given}
        fig.add_scatter(x=steps, y=largest, mode="lines", name=name, line=line)
    fig.add_hline(y=RUNAWAY_LOGIT, line_dash="dot", line_color="grey")
    fig.add_annotation(text="runaway threshold", x=1, xref="paper", xanchor="right",
                       y=math.log10(RUNAWAY_LOGIT),  # on a log axis, an annotation's y is log10 of its value
                       yanchor="bottom", showarrow=False)
    return fig


def lr_figure(title: str, sweep: dict[str, list[dict]]) -> go.Figure:
    """`analysis.lr_sweep` as two panels against the learning rate (log axis): the share of runs that ran
    away, and the median loss at the horizon; one colour per series in both."""
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12,
                        subplot_titles=["share of runs with a runaway", "median loss at the horizon"])
    for i, (label, rows) in enumerate(sweep.items()):
        colour = COLOURWAY[i % len(COLOURWAY)]
        lrs = [r["lr"] for r in rows]
        fig.add_scatter(x=lrs, y=[r["runaways"] / r["runs"] for r in rows], mode="lines+markers", name=label,
                        legendgroup=label, line_color=colour, row=1, col=1,
                        customdata=[[r["runaways"], r["runs"]] for r in rows],
                        hovertemplate="lr %{x:g}: %{customdata[0]} of %{customdata[1]} runs<extra></extra>")
        fig.add_scatter(x=lrs, y=[r["loss"] for r in rows], mode="lines+markers", name=label,
                        legendgroup=label, showlegend=False, line_color=colour, row=1, col=2)
    fig.update_xaxes(type="log", title_text="peak learning rate")
    fig.update_yaxes(title_text="share of runs", range=[-0.05, 1.05], row=1, col=1)
    fig.update_yaxes(title_text="loss (nats per token)", row=1, col=2)
    fig.update_layout(title=title, margin={"t": 80})
    return fig


def survival_figure(title: str, curves: dict[str, list[tuple[int, float]]], horizon: int) -> go.Figure:
    """Kaplan-Meier curves (`analysis.kaplan_meier`: [(step, S)]), one per arm, as steps to `horizon`."""
    fig = new_figure(title, "step", "share of runs without the event (Kaplan-Meier)", yaxis_range=[0, 1.05])
    for name, curve in curves.items():
        fig.add_scatter(x=[t for t, _ in curve] + [horizon], y=[s for _, s in curve] + [curve[-1][1]],
                        mode="lines", line_shape="hv", name=name)
    return fig

"""Shared plot helpers: one house style, titles and axis labels on every figure."""

from __future__ import annotations

import plotly.graph_objects as go
import torch

from lowprec.formats import Format, as_format, bits, round_to

FIELD_COLOURS = {"sign": "#d62728", "exponent": "#1f77b4", "significand": "#2ca02c"}


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

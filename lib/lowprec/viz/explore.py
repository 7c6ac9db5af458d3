"""Explorers for one rounded addition (chapter 1): a live ipywidgets panel for JupyterLab and its static twin,
a plotly figure whose menu and slider switch between precomputed cases, for the built site."""

from __future__ import annotations

import ipywidgets as widgets
import plotly.graph_objects as go
import torch

from lowprec.formats import FORMATS, AddTrace, Format, add_trace, round_to
from lowprec.viz.plots import new_figure

ROWS = ["grid", "exact sum", "nearest", "toward_zero", "stochastic", "bits"]  # top to bottom
TRACE_STYLES = [  # one per trace that `number_line` returns, in order
    {"symbol": "line-ns-open", "size": 22, "color": "#555"},  # the format's grid
    {"symbol": "line-ns", "size": 30, "color": "#ff7f0e", "line": {"width": 3, "color": "#ff7f0e"}},  # tie
    {"symbol": "diamond", "size": 13, "color": "#000"},  # exact sum
    {"size": 13, "color": "#1f77b4"},  # nearest
    {"size": 13, "color": "#7f7f7f"},  # toward zero
    {"color": "#2ca02c"},  # stochastic: size set per case
    {"size": 1, "color": "rgba(0,0,0,0)"},  # bits: text only
]
EXPLORER_FORMATS = ["bf16", "fp16", "tf32", "fp8_e4m3", "fp8_e5m2", "e8m3", "e8m5"]


def format_named(name: str) -> Format:
    """A FORMATS name, or "e<E>m<M>" for any other IEEE-style format (e.g. "e8m3")."""
    if name in FORMATS:
        return FORMATS[name]
    exp_bits, _, man_bits = name.removeprefix("e").partition("m")
    if not (exp_bits.isdigit() and man_bits.isdigit()):
        raise ValueError(f"format must be one of {sorted(FORMATS)} or 'e<E>m<M>' (e.g. 'e8m3'), got {name!r}")
    return Format(int(exp_bits), int(man_bits))


def _grid_around(t: AddTrace) -> list[float]:
    """fmt's values from about two steps below the sum's neighbours to two steps above them."""
    step = abs(t.away - t.toward)
    start = min(t.toward, t.away)
    candidates = torch.tensor([start + step / 2 * k for k in range(-4, 7)], dtype=torch.float32)
    values = round_to(candidates, t.fmt)
    return sorted(set(values[torch.isfinite(values)].tolist()))


def number_line(t: AddTrace) -> list[dict]:
    """Trace data (x, y, text, marker size) showing where the exact sum sits between its two neighbours in
    fmt, and where each rounding mode takes it; one entry per TRACE_STYLES entry."""
    p = float(t.p_away)
    exact, mid = float(t.exact), (t.toward + t.away) / 2
    grid = _grid_around(t)
    return [
        {"x": grid, "y": ["grid"] * len(grid), "text": None},
        {"x": [mid], "y": ["grid"], "text": ["tie"]},
        {"x": [exact], "y": ["exact sum"], "text": [f"{exact:.10g}"]},
        {"x": [t.rounded], "y": ["nearest"], "text": [f"{t.rounded:.7g}, error {t.error:+.3g}"]},
        {"x": [t.toward], "y": ["toward_zero"], "text": [f"{t.toward:.7g}, error {t.toward - exact:+.3g}"]},
        {
            "x": [t.toward, t.away],
            "y": ["stochastic"] * 2,
            "text": [f"p = {1 - p:.3f}", f"p = {p:.3f}"],
            "size": [6 + 20 * (1 - p), 6 + 20 * p],
        },
        {
            "x": [mid],
            "y": ["bits"],
            "text": [
                f"exact {t.exact_bits}<br>guard {t.guard}, sticky {t.sticky} → nearest {t.rounded_bits}"
            ],
        },
    ]


def _scatter(data: dict, style: dict, visible: bool = True) -> go.Scatter:
    marker = {**style, **({"size": data["size"]} if "size" in data else {})}
    return go.Scatter(
        x=data["x"],
        y=data["y"],
        text=data["text"],
        mode="markers+text",
        marker=marker,
        visible=visible,
        textposition="middle center" if data["y"] == ["bits"] else "top center",
        cliponaxis=False,
        hovertemplate="%{y}: %{x}<extra></extra>",
    )


def _figure(title: str, height: int) -> go.Figure:
    fig = new_figure(title, "value (dimensionless)", "", height=height, showlegend=False)
    fig.update_yaxes(categoryorder="array", categoryarray=ROWS[::-1], range=[-0.7, len(ROWS) - 0.4])
    return fig


def number_line_figure(t: AddTrace) -> go.Figure:
    """The number line of one addition, as its own figure."""
    fig = _figure(f"Rounding the sum to {t.fmt.name or t.fmt}: nearest goes {t.direction}", height=420)
    for data, style in zip(number_line(t), TRACE_STYLES, strict=True):
        fig.add_trace(_scatter(data, style))
    return fig


def static_explorer(a: float, b: float, residuals: list[float], formats: list[str]) -> go.Figure:
    """The explorer for a page without a kernel: a menu picks the format, a slider the residual; every
    (format, residual) case is computed here with add_trace and stored in the figure."""
    cases = {
        (f, r): number_line(add_trace(a, b, format_named(f), residual=r)) for f in formats for r in residuals
    }
    hint = "<br><sup>pick the format (menu) and the residual (slider)</sup>"
    title = f"fp32({a:g} + residual) + ({b:g}), rounded{hint}"
    fig = _figure(title, height=560)
    for i, f in enumerate(formats):
        for data, style in zip(cases[f, residuals[0]], TRACE_STYLES, strict=True):
            fig.add_trace(_scatter(data, style, visible=i == 0))

    def restyle(r: float) -> dict:
        """New data for every trace of every format (the menu only toggles which format's traces show)."""
        lines = [line for f in formats for line in cases[f, r]]
        styles = TRACE_STYLES * len(formats)
        return {
            "x": [d["x"] for d in lines],
            "y": [d["y"] for d in lines],
            "text": [d["text"] for d in lines],
            "marker.size": [d.get("size", s.get("size")) for d, s in zip(lines, styles, strict=True)],
        }

    per_format = len(TRACE_STYLES)
    visible = [[j // per_format == i for j in range(per_format * len(formats))] for i in range(len(formats))]
    fig.update_layout(
        updatemenus=[
            {
                "buttons": [
                    {"label": f, "method": "restyle", "args": [{"visible": v}]}
                    for f, v in zip(formats, visible, strict=True)
                ],
                "x": 1,
                "xanchor": "right",
                "y": 1.02,
                "yanchor": "bottom",
            }
        ],
        sliders=[
            {
                "currentvalue": {"prefix": "residual already in the fp32 running sum: "},
                "pad": {"t": 50},
                "steps": [
                    {"label": f"{r:+.2g}", "method": "restyle", "args": [restyle(r)]} for r in residuals
                ],
            }
        ],
    )
    return fig


def rounding_explorer(
    a: float = -2.40625, b: float = -2.296875, residual: float = -0.0008654594421386719, fmt: str = "bf16"
) -> widgets.VBox:
    """Live panel (needs a kernel): pick a format and operands; shows the bit-level trace and number line."""
    fmt_box = widgets.Dropdown(
        options=EXPLORER_FORMATS, value=fmt, description="format", layout={"width": "180px"}
    )
    boxes = {
        name: widgets.FloatText(value=value, description=name, layout={"width": "230px"})
        for name, value in [("a", a), ("residual", residual), ("b", b)]
    }
    out = widgets.Output()

    def show(_: object = None) -> None:
        with out:
            out.clear_output(wait=True)
            try:
                fmt_now = format_named(fmt_box.value)
                t = add_trace(boxes["a"].value, boxes["b"].value, fmt_now, residual=boxes["residual"].value)
            except ValueError as err:
                print(f"cannot explain this addition: {err}")
                return
            print(t)
            number_line_figure(t).show()

    for box in [fmt_box, *boxes.values()]:
        box.observe(show, names="value")
    show()
    note = widgets.HTML(
        "<i>a + residual is the fp32 running sum, b the next term; the figure shows where each "
        "rounding mode takes the sum.</i>"
    )
    controls = widgets.HBox([fmt_box, *boxes.values()], layout={"flex_flow": "row wrap"})
    return widgets.VBox([controls, note, out])

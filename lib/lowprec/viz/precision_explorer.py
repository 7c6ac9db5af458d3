"""Chapter 2's precision explorer: the signed error that one setting of flash attention leaves on adversarial
rows, from the CPU emulator and the bias harness (`lowprec.instruments.bias`).

A `Setting` is a placement, the rounding of P̄ (the weights), the tile size, an input family of
`lowprec.instruments.bias.CASES` with V's mean, and the Fix (off, or β with ties counted per tile or per row).
`measure` runs `emulated_attention` on the family's rows (built once per family and V mean, float64 reference
included: the harness's `Rows`, as `measure_bias` builds them) and returns the harness's `BiasResult` (t of
the O and δ errors) with the per-row δ errors and P̄ = 1 counts behind it.

`precision_explorer` is the live panel (a kernel recomputes on every change); `precision_twin` is its static
twin: every placement at once, a menu for the rows (family and V mean), a slider for the Fix.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from lowprec.attention.emulated import emulated_attention
from lowprec.attention.fix import Fix
from lowprec.attention.precision import Precision
from lowprec.instruments.bias import CASES, BiasResult, Rows, bias_of, with_v_mean
from lowprec.viz.panels import LivePanel, add_menu_and_slider, dropdown, sig

PLACEMENTS = ("fa2", "paper", "fp32")
WEIGHTS = {  # label -> Rounding spec of the weights point (None: the placement's own)
    "placement's own": None,
    "input (bf16)": "input",
    "e8m3": "e8m3",
    "e8m3@ones": "e8m3@ones",
    "bf16@stochastic": "bf16@stochastic",
}
TILES = (16, 32, 64, 128)
FAMILIES = (  # the CASES whose V mean is the harness's default (the panel sets V's mean itself)
    "unique", "exact-k2", "exact-k4", "exact-k8", "near-k2", "near-k4", "near-k8", "near-k4-neg",
    "near-k4-wide", "exact-k4-huge", "random",
)  # fmt: skip
V_MEANS = (-1.5, -1.0, 3.0)  # mid-binade, at a power of two (O near -1), mid-binade positive
FIXES = {"off": None, "β = 2": 2.0, "β = 7": 7.0}
TIES = ("tile", "row")
COLOURS = {"fa2": "#d62728", "paper": "#1f77b4", "fp32": "#2ca02c"}
BIASED = 4.0  # |t| from here on counts as biased (the book's threshold, lowprec.analysis.BIASED_T)


@dataclass(frozen=True)
class Setting:
    """One point of the explorer; `precision`, `fix` and `case` are what the emulator and harness take."""

    placement: str = "fa2"
    weights: str | None = None
    tile: int = 64
    family: str = "near-k4"
    v_mean: float = -1.5
    beta: float | None = None
    tie: str = "tile"

    @property
    def precision(self) -> Precision:
        return Precision.parse(self.placement + (f":weights={self.weights}" if self.weights else ""))

    @property
    def fix(self) -> Fix | None:
        return None if self.beta is None else Fix(beta=self.beta, tie=self.tie)

    @property
    def label(self) -> str:
        fix = "no Fix" if self.beta is None else f"Fix β={self.beta:g}, ties per {self.tie}"
        return f"{self.precision.spec}, tiles {self.tile}, {fix}"


@dataclass
class Measurement:
    setting: Setting
    result: BiasResult  # the harness's summary: t of the O error and of the δ error over rows
    delta_err: torch.Tensor  # per row: rowsum(dO ∘ (o − o_ref)), float64
    pbar_ones: torch.Tensor  # per row: P̄ entries exactly 1.0 in the P̄V product
    triggered: int  # rows where the Fix moved the shift
    seconds: float


@functools.lru_cache(maxsize=16)
def rows_for(family: str, v_mean: float, rows: int, seed: int = 0) -> Rows:
    """The family's adversarial rows with V's mean set and their float64 reference (cached: the slow part)."""
    if family not in CASES:
        raise ValueError(f"family must be one of {sorted(CASES)}, got {family!r}")
    return Rows.make(with_v_mean(CASES[family], v_mean), rows, seed)


def measure(setting: Setting, rows: int = 1024, seed: int = 0) -> Measurement:
    """Run the emulator in `setting` on `rows` rows of its family and compare with float64 (bias_of)."""
    start = time.perf_counter()
    data = rows_for(setting.family, setting.v_mean, rows, seed)
    generator = torch.Generator().manual_seed(seed + 1)  # for stochastic rounding
    kept: dict = {}

    def impl(q, k, v):
        kept["out"] = emulated_attention(
            q, k, v, causal=False, precision=setting.precision, fix=setting.fix, block_m=setting.tile,
            block_n=setting.tile, generator=generator, return_stats=True,
        )  # fmt: skip
        return kept["out"]

    result = bias_of(impl, data, name=setting.label)
    o, stats = kept["out"]
    err = (o.double() - data.o_ref).flatten(0, 2)[:rows]
    finite = torch.isfinite(err).all(dim=-1)
    delta_err = (data.do.double().flatten(0, 2)[:rows][finite] * err[finite]).sum(dim=-1)
    triggered = int((stats.fix_triggers.flatten()[:rows] > 0).sum())
    return Measurement(setting, result, delta_err, stats.pbar_ones.flatten()[:rows], triggered,
                       time.perf_counter() - start)


def summary_line(m: Measurement) -> str:
    r = m.result
    return (
        f"{m.setting.family}, V mean {m.setting.v_mean:+g} | {m.setting.label}: t(O) {r.o.t:+.1f}, "
        f"t(δ) {r.delta.t:+.1f} over {r.rows} rows; P̄ = 1 entries per row {m.pbar_ones.double().mean():.2f}; "
        f"Fix moved the shift in {m.triggered} rows"
    )


def measurement_figure(m: Measurement) -> go.Figure:
    """The live panel's figure: the per-row δ errors and the P̄ = 1 counts of one setting."""
    r = m.result
    fig = make_subplots(rows=1, cols=2, column_widths=[0.65, 0.35], horizontal_spacing=0.12,
                        subplot_titles=("per-row δ error", "P̄ = 1 entries per row"))
    fig.add_histogram(x=m.delta_err.tolist(), nbinsx=50, marker_color="#1f77b4", name="δ error",
                      histnorm="percent", row=1, col=1)
    fig.add_vline(x=0, line_color="#444", line_dash="dot", row=1, col=1)
    counts = torch.bincount(m.pbar_ones.long().clamp(min=0))
    fig.add_bar(x=list(range(len(counts))), y=(100 * counts / counts.sum()).tolist(), marker_color="#ff7f0e",
                name="P̄ = 1 count", row=1, col=2)
    fig.update_xaxes(title_text="δ_lp − δ_hp (dimensionless)", row=1, col=1)
    fig.update_xaxes(title_text="P̄ = 1 entries (count)", dtick=1, row=1, col=2)
    fig.update_yaxes(title_text="rows (%)", row=1, col=1)
    fig.update_yaxes(title_text="rows (%)", row=1, col=2)
    biased = "biased" if max(abs(r.o.t), abs(r.delta.t)) >= BIASED else "no bias (|t| < 4)"
    title = f"{m.setting.family}, V mean {m.setting.v_mean:+g}: t(O) {r.o.t:+.1f}, t(δ) {r.delta.t:+.1f}"
    fig.update_layout(title=f"{title}, {biased}", showlegend=False, height=380, bargap=0.05)
    return fig


def precision_explorer(rows: int = 1024, setting: Setting = Setting()) -> LivePanel:
    """Live panel (needs a kernel): every control of a `Setting`; about a second per change at 1,024 rows."""
    boxes = {
        "placement": dropdown("placement", PLACEMENTS, setting.placement),
        "weights": dropdown("P̄ rounding", list(WEIGHTS.items()), setting.weights, width="230px"),
        "tile": dropdown("tile", TILES, setting.tile, width="120px"),
        "family": dropdown("rows", FAMILIES, setting.family, width="210px"),
        "v_mean": dropdown("V mean", V_MEANS, setting.v_mean, width="150px"),
        "beta": dropdown("Fix", list(FIXES.items()), setting.beta, width="140px"),
        "tie": dropdown("ties per", TIES, setting.tie, width="150px"),
    }

    def compute(values: dict) -> tuple[str, go.Figure]:
        m = measure(Setting(**values), rows)
        return summary_line(m), measurement_figure(m)

    note = (f"{rows:,} rows of 64 keys each (tiles of 64 and 128 keys are the same here: one tile per row); "
            "t = mean / standard error over rows, |t| ≥ 4 is biased.")
    return LivePanel(boxes, compute, note)


def _histogram(values: torch.Tensor, edges: torch.Tensor) -> list[float]:
    """Share of `values` (%) per bin of `edges`, values outside folded into the end bins; one extra value
    repeats the last bin so that a line with shape "hv" over the edges draws every bin."""
    index = torch.bucketize(values.clamp(edges[0], edges[-1]), edges[1:-1])
    counts = torch.bincount(index, minlength=len(edges) - 1).double()
    share = (100 * counts / max(len(values), 1)).tolist()
    return [*share, share[-1]]


def precision_twin(
    families: tuple[str, ...] = ("unique", "exact-k4", "near-k4", "near-k4-wide"),
    v_means: tuple[float, ...] = (-1.5, -1.0),
    betas: tuple[float | None, ...] = (None, 2.0),
    placements: tuple[str, ...] = PLACEMENTS,
    rows: int = 1024,
    bins: int = 40,
) -> go.Figure:
    """The explorer for a page without a kernel: every placement in one figure, a menu for the rows (family,
    V mean), a slider for the Fix (off or β, ties per tile); fa2-style P̄ rounding and 64-key tiles.
    Every (placement, rows, Fix) case is measured here."""
    groups = [(f, vm) for f in families for vm in v_means]
    cases = {(g, b, p): measure(Setting(placement=p, family=g[0], v_mean=g[1], beta=b), rows)
             for g in groups for b in betas for p in placements}
    edges = {}  # one set of bins per group, shared by its placements and Fix settings
    for g in groups:
        pooled = torch.cat([cases[g, b, p].delta_err for b in betas for p in placements])
        span = float(pooled.abs().quantile(0.995)) or 1e-9
        edges[g] = torch.linspace(-span, span, bins + 1, dtype=torch.float64)

    fig = make_subplots(
        rows=2, cols=2, specs=[[{"colspan": 2}, None], [{}, {}]], row_heights=[0.55, 0.45],
        vertical_spacing=0.2, horizontal_spacing=0.14,
        subplot_titles=("", "signed bias: t over rows", "P̄ = 1 entries per row (mean)"),
    )  # fmt: skip

    def data(g, b) -> dict[str, list]:
        """Trace data of group g at Fix b, in trace order (per placement: histogram, t bars, P̄ = 1 bar)."""
        ys, texts = [], []
        for p in placements:
            m = cases[g, b, p]
            t = [m.result.o.t, m.result.delta.t]
            ones = float(m.pbar_ones.double().mean())
            ys += [sig(_histogram(m.delta_err, edges[g])), sig(t), [sig(ones)]]
            texts += [None, [f"{x:+.1f}" for x in t], [f"{ones:.2f}"]]
        return {"y": ys, "text": texts}

    per_group = 3 * len(placements)
    for i, g in enumerate(groups):
        first = data(g, betas[0])
        edge_x = sig(edges[g].tolist())
        for j, p in enumerate(placements):
            style = {"legendgroup": p, "visible": i == 0}
            fig.add_scatter(x=edge_x, y=first["y"][3 * j], mode="lines", line={"shape": "hv", "width": 2,
                            "color": COLOURS[p]}, name=p, **style, row=1, col=1,
                            hovertemplate="δ error %{x:.3g}: %{y:.2f}% of rows<extra>" + p + "</extra>")
            fig.add_bar(x=["t(O)", "t(δ)"], y=first["y"][3 * j + 1], text=first["text"][3 * j + 1],
                        textposition="outside", marker_color=COLOURS[p], name=p, showlegend=False, **style,
                        row=2, col=1, hovertemplate="%{x} = %{y:+.1f}<extra>" + p + "</extra>")
            fig.add_bar(x=[p], y=first["y"][3 * j + 2], text=first["text"][3 * j + 2], textposition="outside",
                        marker_color=COLOURS[p], name=p, showlegend=False, **style, row=2, col=2,
                        hovertemplate="%{y:.2f} per row<extra>" + p + "</extra>")
    for k in (-BIASED, BIASED):
        fig.add_hline(y=k, line_dash="dot", line_color="#7f7f7f", row=2, col=1)
    fig.add_hline(y=0, line_color="#444", row=2, col=1)

    n = per_group * len(groups)
    menu = [(f"{f}, V mean {vm:+g}", [t // per_group == i for t in range(n)], {})
            for i, (f, vm) in enumerate(groups)]
    slider = []
    for b in betas:
        steps = [data(g, b) for g in groups]
        slider.append(("off" if b is None else f"β = {b:g}",
                       {key: [v for s in steps for v in s[key]] for key in ("y", "text")}))
    add_menu_and_slider(fig, menu, slider, list(range(n)), "the Fix (ties per tile): ")
    fig.update_xaxes(title_text="δ_lp − δ_hp per row (dimensionless)", row=1, col=1)
    fig.update_yaxes(title_text="rows (%)", rangemode="tozero", row=1, col=1)
    fig.update_xaxes(title_text="error of", row=2, col=1)
    fig.update_yaxes(title_text="t (dimensionless)", row=2, col=1)
    fig.update_xaxes(title_text="placement", row=2, col=2)
    fig.update_yaxes(title_text="entries (count per row)", rangemode="tozero", row=2, col=2)
    fig.update_layout(
        title={"text": f"Signed error of each placement on adversarial rows ({rows:,} rows per case)",
               "subtitle": {"text": "pick the rows (menu) and switch the Fix (slider); dotted: |t| = 4"}},
        height=720, margin={"t": 120}, barmode="group", bargap=0.3,
        legend={"orientation": "h", "yref": "paper", "y": 1.02, "yanchor": "bottom", "x": 0},
    )  # fmt: skip
    return fig


__all__ = ["Measurement", "Setting", "measure", "measurement_figure", "precision_explorer", "precision_twin"]

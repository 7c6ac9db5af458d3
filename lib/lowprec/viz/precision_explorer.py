"""Chapter 2's precision explorer: the signed error that one setting of flash attention leaves on adversarial
rows, from the CPU emulator and the bias harness (`lowprec.instruments.bias`).

A `Setting` is a precision (a placement or any spec string of `lowprec.attention.precision`, with the rounding
of any of its six points replaced by a format and a mode, e.g. weights="e8m3@ones"), the tile size, a family
of rows (`FAMILIES`: the harness's cases, and the cure table's rows with maxima on the bf16 grid,
`instruments.cures.Family`) with its number of tied keys, its near-tie window and V's mean, and the Fix (off,
or β with its tolerance, tie scope and variant: `lowprec.attention.fix.Fix`). `measure` runs
`emulated_attention` on the family's rows (built once per family setting, float64 reference included: the
harness's `Rows`) and returns the harness's `BiasResult` (t of the O and δ errors) with the per-row δ errors
and P̄ = 1 counts behind it.

The O measured is the one the backward's δ uses: the stored O (in q's dtype), or with the output point
unrounded the fp32 O, on fp32 copies of the inputs (as `instruments.cures.Cure.impl` measures it).

`precision_explorer` is the live panel (a kernel recomputes on every change); `precision_twin` is its static
twin: a few precisions at once, a menu for the rows (family and V mean), a slider for the Fix.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, replace

import ipywidgets as widgets
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from lowprec.analysis import BIASED_T
from lowprec.attention.emulated import emulated_attention
from lowprec.attention.fix import FIX_VARIANTS, TIE_SCOPES, Fix
from lowprec.attention.precision import PLACEMENTS, POINTS, Precision, Rounding
from lowprec.instruments.bias import CASES, NEAR_WINDOW, SEQ, BiasResult, Case, Rows, bias_of, biased
from lowprec.instruments.cures import FAMILIES as CURE_FAMILIES
from lowprec.instruments.cures import SCALE, Family
from lowprec.viz.panels import LivePanel, add_menu_and_slider, dropdown, sig

FORMATS = (  # a point's format in the panel: (label, Rounding format name; None: the placement's own)
    ("placement's own", None),
    *((name, name) for name in ("input", "bf16", "fp16", "e8m3", "e8m2", "fp8_e4m3", "fp8_e5m2")),
    ("none (fp32)", "none"),
)  # fmt: skip
MODES = {point: ("nearest", "stochastic", "ones") if point == "weights" else ("nearest", "stochastic")
         for point in POINTS} | {"scores": ("nearest",)}  # "ones": weights only; S: the backward recomputes S
TILES = (16, 32, 64, 128)
_CURE_FAMILIES = {family.name: family for family in CURE_FAMILIES}
FAMILIES: dict[str, Case | Family] = {
    "unique": CASES["unique"],
    "exact ties": CASES["exact-k4"],
    "near ties": CASES["near-k4"],
    "near ties, r < 0": CASES["near-k4-neg"],
    "near ties, r on bf16 grid": _CURE_FAMILIES["near, r on bf16 grid"],
    "exact ties, r on bf16 grid": _CURE_FAMILIES["exact, r on bf16 grid"],
    "near ties, r = 0": Family("near ties, r = 0", CASES["near-k4"], 0.0),
    "exact ties, r = 0": Family("exact ties, r = 0", CASES["exact-k4"], 0.0),
    "exact ties, huge r": CASES["exact-k4-huge"],
    "random": CASES["random"],
}
"""The rows: the bias harness's cases (softmax scale 1/√d), the cure table's families whose row maxima r lie
on the bf16 grid (at its scale, cures.SCALE = 1/8, a power of two, so that r is exact in fp32 too), and the
same rows with r = 0 in every row (where the published Fix leaves P̄ = 1 and the closed variant does not). A
Setting's `ties`, `window` and `v_mean` replace the case's own."""
WINDOWS = (1e-3, 0.045)  # the near-tie window slider's range (a Case's window must lie in (0, UNIQUE_GAP))
V_MEANS = (-1.5, -1.0, -0.75, 3.0)  # mid-binade, at a power of two (O near -1), mid-binade either side of 1
BETAS = {"off": None, "β = 2": 2.0, "β = 4": 4.0, "β = 7": 7.0}
TOLS = {"P̄'s round-to-1 window": None, "0 (exact ties)": 0.0, "1e-3 (paper's code)": 1e-3, "1e-2": 1e-2}
LEGEND_ABOVE_PX = 32  # px: the twin's legend, one row right above its plots (below its menu)
TWIN_COLOURS = ("#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")  # one per twin precision


def fix_label(fix: Fix | None) -> str:
    """'no Fix', or the Fix's β and every field that differs from the default, in words."""
    if fix is None:
        return "no Fix"
    default, words = Fix(), [f"Fix β = {fix.beta:g}"]
    if fix.tol != default.tol:
        words.append(f"tol {fix.tol:g}")
    words += [f"ties per {fix.tie}"] + ([fix.variant] if fix.variant != default.variant else [])
    return ", ".join(words)


@dataclass(frozen=True)
class Setting:
    """One point of the explorer; `precision`, `fix` and `case` are what the emulator and harness take."""

    placement: str = "fa2"  # a placement or a precision spec string (Precision.parse)
    scores: str | None = None  # each point: a Rounding spec ("bf16", "e8m3@ones", ...), None: the placement's
    weights: str | None = None
    rowsum: str | None = None
    product: str | None = None
    accumulator: str | None = None
    output: str | None = None
    tile: int = 64
    family: str = "near ties"
    ties: int = 4  # keys at the row maximum or just below it (exact and near families)
    window: float = NEAR_WINDOW  # near ties lie (0.05 to 0.9) x window below the maximum (near families)
    v_mean: float = -1.5
    beta: float | None = None  # None: no Fix
    tol: float | None = None
    tie: str = "tile"
    variant: str = "published"

    @property
    def precision(self) -> Precision:
        changes = {point: getattr(self, point) for point in POINTS if getattr(self, point) is not None}
        return replace(Precision.parse(self.placement), **changes)

    @property
    def fix(self) -> Fix | None:
        return None if self.beta is None else Fix(self.beta, self.tol, self.tie, self.variant)

    def with_fix(self, fix: Fix | str | None) -> Setting:
        """The same setting with `fix` (a Fix, a spec string such as "2:tol=0.001", or None)."""
        fix = Fix.parse(fix) if isinstance(fix, str) else fix
        if fix is None:
            return replace(self, beta=None, tol=None, tie="tile", variant="published")
        return replace(self, beta=fix.beta, tol=fix.tol, tie=fix.tie, variant=fix.variant)

    def _family_case(self) -> Case:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {list(FAMILIES)}, got {self.family!r}")
        base = FAMILIES[self.family]
        return base.case if isinstance(base, Family) else base

    @property
    def case(self) -> Case:
        """The family's case with this setting's tied keys, near-tie window and V mean."""
        case = self._family_case()
        if case.scores in ("exact", "near"):
            case = replace(case, ties=self.ties, window=self.window if case.scores == "near" else case.window)
        return replace(case, v_mean=self.v_mean, name=f"{self.rows_label}, V mean {self.v_mean:+g}")

    @property
    def rows_label(self) -> str:
        scores = self._family_case().scores
        detail = {"exact": f"k = {self.ties}", "near": f"k = {self.ties}, window {self.window:.3g}"}
        return f"{self.family} ({detail[scores]})" if scores in detail else self.family

    @property
    def label(self) -> str:
        return f"{self.precision.spec}, tiles {self.tile}, {fix_label(self.fix)}"


@dataclass
class Measurement:
    setting: Setting
    result: BiasResult  # the harness's summary: t of the O error and of the δ error over rows
    delta_err: torch.Tensor  # per row: rowsum(dO ∘ (o − o_ref)), float64
    pbar_ones: torch.Tensor  # per row: P̄ entries exactly 1.0 in the P̄V product
    triggered: int  # rows where the Fix moved the shift
    seconds: float


@functools.lru_cache(maxsize=32)
def rows_for(family: str, case: Case, rows: int, seed: int = 0) -> tuple[Rows, float | None]:
    """The rows of `case` (family's case as a Setting changes it) with their float64 reference, and the
    softmax scale they are built for (None: the harness's 1/√d). Cached: the slow part."""
    base = FAMILIES[family]
    if isinstance(base, Family):
        return replace(base, case=case).rows(rows, seed), SCALE
    return Rows.make(case, rows, seed), None


def measure(setting: Setting, rows: int = 1024, seed: int = 0) -> Measurement:
    """Run the emulator in `setting` on `rows` rows of its family and compare with float64 (bias_of)."""
    start = time.perf_counter()
    precision, fix = setting.precision, setting.fix  # a bad setting fails here, before any rows are built
    data, scale = rows_for(setting.family, setting.case, rows, seed)
    generator = torch.Generator().manual_seed(seed + 1)  # for stochastic rounding
    kept: dict = {}
    fp32_store = precision.output.fmt is None  # the backward's δ would use the unrounded O: measure that one
    if fp32_store:  # on fp32 copies of the inputs, rounding as they would (cures.Cure.impl does the same)
        try:
            precision = precision.for_dtype(data.q.dtype)
        except ValueError as err:
            raise ValueError(f"an unrounded output point is measured on fp32 copies of the inputs: {err}") \
                from None

    def impl(q, k, v):
        if fp32_store:
            q, k, v = q.float(), k.float(), v.float()
        kept["out"] = emulated_attention(
            q, k, v, causal=False, precision=precision, fix=fix, scale=scale, block_m=setting.tile,
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
        f"{m.setting.rows_label}, V mean {m.setting.v_mean:+g} | {m.setting.label}: t(O) {r.o.t:+.1f}, "
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
    verdict = "biased" if biased(r) else f"no bias (|t| < {BIASED_T:g})"
    title = f"{m.setting.rows_label}, V mean {m.setting.v_mean:+g}: t(O) {r.o.t:+.1f}, t(δ) {r.delta.t:+.1f}"
    fig.update_layout(title={"text": f"{title}, {verdict}", "subtitle": {"text": m.setting.label}},
                      showlegend=False, height=400, margin={"t": 100}, bargap=0.05)
    return fig


def point_spec(placement: str, point: str, fmt: str | None, mode: str) -> str | None:
    """A point's Rounding spec from the panel's format (None: the placement's own) and mode; None when both
    are the placement's."""
    if fmt is None and mode == "nearest":
        return None
    own = getattr(Precision.parse(placement), point).fmt
    return str(Rounding(own if fmt is None else fmt, mode))


def precision_explorer(rows: int = 1024, setting: Setting = Setting()) -> LivePanel:
    """Live panel (needs a kernel): every control of a `Setting` (a point's format and mode from FORMATS and
    MODES); about a second per change at 1,024 rows."""
    slider = {"continuous_update": False, "style": {"description_width": "initial"},
              "layout": {"width": "300px"}}
    boxes = {
        "placement": dropdown("placement", tuple(PLACEMENTS), setting.placement, width="200px"),
        "tile": dropdown("tile", TILES, setting.tile, width="120px"),
    }
    for point in POINTS:
        name, _, mode = (getattr(setting, point) or "").partition("@")
        boxes[f"{point}_format"] = dropdown(point, FORMATS, name or None, width="210px")
        boxes[f"{point}_mode"] = dropdown("@", MODES[point], mode or "nearest", width="140px")
    boxes |= {
        "family": dropdown("rows", list(FAMILIES), setting.family, width="270px"),
        "ties": widgets.IntSlider(value=setting.ties, min=2, max=SEQ // 2, description="tied keys k",
                                  **slider),
        "window": widgets.FloatLogSlider(value=setting.window, min=math.log10(WINDOWS[0]),
                                         max=math.log10(WINDOWS[1]), step=0.01, readout_format=".2g",
                                         description="near-tie window", **slider),
        "v_mean": dropdown("V mean", V_MEANS, setting.v_mean, width="150px"),
        "beta": dropdown("Fix", list(BETAS.items()), setting.beta, width="130px"),
        "tol": dropdown("tol", list(TOLS.items()), setting.tol, width="250px"),
        "tie": dropdown("ties per", TIE_SCOPES, setting.tie, width="140px"),
        "variant": dropdown("variant", FIX_VARIANTS, setting.variant, width="170px"),
    }

    def compute(values: dict) -> tuple[str, go.Figure]:
        points = {point: point_spec(values["placement"], point, values[f"{point}_format"],
                                    values[f"{point}_mode"]) for point in POINTS}
        rest = {name: value for name, value in values.items() if not name.endswith(("_format", "_mode"))}
        m = measure(Setting(**rest, **points), rows)
        return summary_line(m), measurement_figure(m)

    pairs = [name for point in POINTS for name in (f"{point}_format", f"{point}_mode")]
    layout = [["placement", "tile"], pairs[:6], pairs[6:], ["family", "ties", "window", "v_mean"],
              ["beta", "tol", "tie", "variant"]]
    note = (f"{rows:,} rows of {SEQ} keys each (tiles of 64 and 128 keys are the same here: one tile per "
            "row); tied keys k and the near-tie window apply to the families with ties (near ties lie 0.05 "
            f"to 0.9 windows below the maximum); t = mean / standard error over rows, |t| ≥ {BIASED_T:g} is "
            "biased.")
    return LivePanel(boxes, compute, note, layout)


def _histogram(values: torch.Tensor, edges: torch.Tensor) -> list[float]:
    """Share of `values` (%) per bin of `edges`, values outside folded into the end bins; one extra value
    repeats the last bin so that a line with shape "hv" over the edges draws every bin."""
    index = torch.bucketize(values.clamp(edges[0], edges[-1]), edges[1:-1])
    counts = torch.bincount(index, minlength=len(edges) - 1).double()
    share = (100 * counts / max(len(values), 1)).tolist()
    return [*share, share[-1]]


TWIN_ROWS = (
    *(Setting(family=family, window=window, v_mean=v_mean)
      for family, window in (("unique", NEAR_WINDOW), ("exact ties", NEAR_WINDOW), ("near ties", NEAR_WINDOW),
                             ("near ties", 0.025), ("near ties, r on bf16 grid", NEAR_WINDOW))
      for v_mean in (-1.5, -1.0)),
    Setting(family="near ties, r = 0"),
)  # fmt: skip
TWIN_PRECISIONS = (  # (label, precision spec): the bias table's fp32 row stores O in bf16, as here
    ("fa2", "fa2"), ("paper", "paper"), ("fp32, bf16 store", "fp32:output=input"),
    ("fa2, P̄ e8m3@ones", "fa2:weights=e8m3@ones"),
)  # fmt: skip
TWIN_FIXES = ("none", "2", "2:variant=closed", "2:tol=0.001", "2:tol=0", "7")  # Fix spec strings (Fix.parse)


def precision_twin(
    groups: tuple[Setting, ...] = TWIN_ROWS,
    precisions: tuple[tuple[str, str], ...] = TWIN_PRECISIONS,
    fixes: tuple[str, ...] = TWIN_FIXES,
    rows: int = 1024,
    bins: int = 40,
) -> go.Figure:
    """The explorer for a page without a kernel: every precision of `precisions` ((label, spec string) pairs)
    in one figure, a menu for the rows (`groups`: their family, ties, window and V mean), a slider for the Fix
    (`fixes`: Fix spec strings, "none" for off); 64-key tiles. Every (precision, rows, Fix) case is measured
    here."""
    if len(precisions) > len(TWIN_COLOURS):
        raise ValueError(f"precisions must be at most {len(TWIN_COLOURS)} (one colour each), "
                         f"got {len(precisions)}")
    specs = dict(precisions)
    colours = dict(zip(specs, TWIN_COLOURS, strict=False))
    cases = {(g, f, p): measure(replace(g, placement=specs[p]).with_fix(f), rows)
             for g in groups for f in fixes for p in specs}
    edges = {}  # one set of bins per group, shared by its precisions and Fix settings
    for g in groups:
        pooled = torch.cat([cases[g, f, p].delta_err for f in fixes for p in specs])
        span = float(pooled.abs().quantile(0.995)) or 1e-9
        edges[g] = torch.linspace(-span, span, bins + 1, dtype=torch.float64)

    fig = make_subplots(
        rows=2, cols=2, specs=[[{"colspan": 2}, None], [{}, {}]], row_heights=[0.55, 0.45],
        vertical_spacing=0.2, horizontal_spacing=0.14,
        subplot_titles=("", "signed bias: t over rows", "P̄ = 1 entries per row (mean)"),
    )  # fmt: skip

    def data(g, f) -> dict[str, list]:
        """Trace data of group g at Fix f, in trace order (per precision: histogram, t bars, P̄ = 1 bar)."""
        ys, texts = [], []
        for p in specs:
            m = cases[g, f, p]
            t = [m.result.o.t, m.result.delta.t]
            ones = float(m.pbar_ones.double().mean())
            ys += [sig(_histogram(m.delta_err, edges[g])), sig(t), [sig(ones)]]
            texts += [None, [f"{x:+.1f}" for x in t], [f"{ones:.2f}"]]
        return {"y": ys, "text": texts}

    per_group = 3 * len(specs)
    for i, g in enumerate(groups):
        first = data(g, fixes[0])
        edge_x = sig(edges[g].tolist())
        for j, name in enumerate(specs):
            style = {"legendgroup": name, "visible": i == 0, "marker_color": colours[name], "name": name}
            width = 1.5 + 1.2 * (len(specs) - 1 - j)  # each wider than the next: equal histograms all show
            fig.add_scatter(x=edge_x, y=first["y"][3 * j], mode="lines", line={"shape": "hv", "width": width,
                            "color": colours[name]}, **style, row=1, col=1,
                            hovertemplate="δ error %{x:.3g}: %{y:.2f}% of rows<extra>" + name + "</extra>")
            fig.add_bar(x=["t(O)", "t(δ)"], y=first["y"][3 * j + 1], text=first["text"][3 * j + 1],
                        textposition="outside", showlegend=False, **style, row=2, col=1,
                        hovertemplate="%{x} = %{y:+.1f}<extra>" + name + "</extra>")
            label = name.replace(", ", " ").replace(" ", "<br>")  # a word a line: ticks that fit
            fig.add_bar(x=[label], y=first["y"][3 * j + 2],
                        text=first["text"][3 * j + 2], textposition="outside", showlegend=False, **style,
                        row=2, col=2, hovertemplate="%{y:.2f} per row<extra>" + name + "</extra>")
    for k in (-BIASED_T, BIASED_T):
        fig.add_hline(y=k, line_dash="dot", line_color="#7f7f7f", row=2, col=1)
    fig.add_hline(y=0, line_color="#444", row=2, col=1)

    n = per_group * len(groups)
    menu = [(f"{g.rows_label}, V mean {g.v_mean:+g}", [t // per_group == i for t in range(n)], {})
            for i, g in enumerate(groups)]
    slider = []
    for f in fixes:
        steps = [data(g, f) for g in groups]
        fix = Fix.parse(f)
        label = "off" if fix is None else fix_label(fix).removeprefix("Fix ").replace(", ties per tile", "")
        slider.append((label, {key: [v for s in steps for v in s[key]] for key in ("y", "text")}))
    fig.update_xaxes(title_text="δ_lp − δ_hp per row (dimensionless)", row=1, col=1)
    fig.update_yaxes(title_text="rows (%)", rangemode="tozero", row=1, col=1)
    fig.update_xaxes(title_text="error of", row=2, col=1)
    fig.update_yaxes(title_text="t (dimensionless)", row=2, col=1)
    fig.update_xaxes(title_text="precision", tickangle=0, tickfont={"size": 10}, row=2, col=2)
    fig.update_yaxes(title_text="entries (count per row)", rangemode="tozero", row=2, col=2)
    fig.update_layout(
        title={"text": f"Signed error of each precision on adversarial rows ({rows:,} rows per case)",
               "subtitle": {"text": "pick the rows (menu) and the Fix (slider); "
                                    f"dotted: |t| = {BIASED_T:g}, biased beyond"}},
        height=840, barmode="group", bargap=0.3,
        legend={"orientation": "h", "yref": "paper", "y": 1.01, "yanchor": "bottom", "x": 0},
    )  # fmt: skip
    add_menu_and_slider(fig, menu, slider, list(range(n)), "the Fix (ties per tile): ", above=LEGEND_ABOVE_PX)
    fig.layout.sliders[0].pad.t = 95  # below the three-line tick labels and the axis titles
    return fig


__all__ = ["FAMILIES", "Measurement", "Setting", "fix_label", "measure", "measurement_figure", "point_spec",
           "precision_explorer", "precision_twin"]

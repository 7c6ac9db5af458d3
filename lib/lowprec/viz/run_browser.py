"""Chapter 3's run browser: one recorded training run's loss and one layer's per-head telemetry over steps.

Panels: the training loss (moving mean of 20 logged losses), the largest logit (`max_logit`), ‖W_Q,h‖₂ and
‖W_K,h‖₂ (`wq_norm`, `wk_norm`), the running sum of the δ error (`delta_error_cum`), the attention entropy
(`entropy`), and the share of sampled rows whose maximum is tied exactly (`tie_rows`) or nearly
(`near_tie_rows`); telemetry is
`run.telemetry(name)` -> (steps, values[sample][layer][head]), read with `lowprec.runs.load_run`. The two
shares are drawn as trailing means of 5 readings.

`run_browser` is the live panel (any run under a results folder, any layer, one head or all); `run_twin` its
static twin over a few runs: a menu for the run, a slider for the layer, one line per head.
"""

from __future__ import annotations

import functools
from pathlib import Path

import ipywidgets as widgets
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from lowprec.analysis import RUNAWAY_LOGIT, first_past, loss_spike, moving_mean
from lowprec.runs import Run, list_runs, load_run
from lowprec.viz.panels import LivePanel, add_menu_and_slider, dropdown, sig

LOSS_WINDOW = 20  # logged losses per moving mean (logged every 10 steps: 200 steps)
# (telemetry name, panel title, y axis title, log y); the loss panel comes first
PANELS = [
    ("loss", "training loss", "nats per token", False),
    ("max_logit", "largest attention logit", "logit (log scale)", True),
    ("wq_norm", "‖W_Q,h‖₂ of each head", "spectral norm (log scale)", True),
    ("wk_norm", "‖W_K,h‖₂ of each head", "spectral norm (log scale)", True),
    ("delta_error_cum", "running sum of the δ error", "Σ (δ_lp − δ_hp) (dimensionless)", False),
    ("entropy", "attention entropy (mean over rows)", "nats", False),
    ("tie_rows", "exact ties of the row maximum", "sampled rows (%, mean of 5)", False),
    ("near_tie_rows", "near-ties (P̄ rounds to 1)", "sampled rows (%, mean of 5)", False),
]
ROWS = (len(PANELS) + 1) // 2  # two panels a row
SIGNALS = [name for name, *_ in PANELS[1:]]
PER_ROW = {"tie_rows", "near_tie_rows"}  # counts of sampled rows: shown as a share of them
SHARE_WINDOW = 5  # a share is drawn as the mean of its reading and the 4 before (single readings jump 0-100%)
HEAD_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22",
                "#17becf", "#393b79", "#637939", "#8c6d31"]  # fmt: skip
LOSS_COLOUR = "#252525"


def _cell(index: int) -> tuple[int, int]:
    return index // 2 + 1, index % 2 + 1


@functools.lru_cache(maxsize=64)
def cached_run(path: str) -> Run:
    return load_run(path)


def layer_series(run: Run, layer: int) -> tuple[list[int], dict[str, list[list[float]]]]:
    """(steps, {signal: [values over steps] per head}) of one layer; tie counts as % of the sampled rows."""
    steps, _ = run.telemetry(SIGNALS[0])
    rows = run.telemetry("rows")[1]
    out = {}
    for name in SIGNALS:
        _, values = run.telemetry(name)
        heads = len(values[0][layer])
        per_head = [[sample[layer][h] for sample in values] for h in range(heads)]
        if name in PER_ROW:
            per_head = [trailing_mean([100 * v / n if v is not None else None
                                       for v, n in zip(series, rows, strict=True)]) for series in per_head]
        out[name] = per_head
    return steps, out


def trailing_mean(values: list[float | None], window: int = SHARE_WINDOW) -> list[float | None]:
    """Mean of each value and the window - 1 before it that exist (None where all are None); same length."""
    out = []
    for i in range(len(values)):
        kept = [v for v in values[max(0, i - window + 1) : i + 1] if v is not None]
        out.append(sum(kept) / len(kept) if kept else None)
    return out


def smoothed_loss(run: Run) -> tuple[list[int], list[float]]:
    steps, loss = run.series("loss")
    return steps[LOSS_WINDOW - 1 :], moving_mean(loss, LOSS_WINDOW)


def run_note(name: str, run: Run, spec: bool = True, sep: str = "; ") -> str:
    """Steps, the attention spec (if `spec`), runaway and spike steps, parts joined by `sep`."""
    hit, spike = first_past(run), loss_spike(run)["spike_step"]
    attention = f", attention {run.config['model']['attention']!r}" if spec else ""
    runaway = (f"no layer's largest logit passes {RUNAWAY_LOGIT:g}" if hit is None else
               f"a layer's largest logit passes {RUNAWAY_LOGIT:g} at step {hit[0]:,} (layer index {hit[1]})")
    spike = "no loss spike" if spike is None else f"loss spike at step {spike:,}"
    return sep.join([f"{name}: {run.summary.get('steps'):,} steps{attention}", f"{runaway}; {spike}"])


def _frame(title: str, subtitle: str = "", height: int = 1000, top: int = 110) -> go.Figure:
    fig = make_subplots(rows=ROWS, cols=2, shared_xaxes=True, vertical_spacing=0.09, horizontal_spacing=0.13,
                        subplot_titles=[title for _, title, _, _ in PANELS])
    for i, (name, _, y_title, log) in enumerate(PANELS):
        row, col = _cell(i)
        axis = {"type": "log", "dtick": 1} if log else {}
        if name in PER_ROW:
            axis["rangemode"] = "nonnegative"  # a share's axis from 0 (all zeros: 0 to 1, not -1 to 1)
        fig.update_yaxes(title_text=y_title, **axis, row=row, col=col)
        if row == ROWS:
            fig.update_xaxes(title_text="step", row=row, col=col)
    fig.add_hline(y=RUNAWAY_LOGIT, line_dash="dot", line_color="#7f7f7f", row=1, col=2,
                  exclude_empty_subplots=False)
    fig.update_layout(title={"text": title, "subtitle": {"text": subtitle}}, height=height, margin={"t": top},
                      hovermode="x unified")
    return fig


def run_figure(run: Run, layer: int, head: int | None = None, name: str = "") -> go.Figure:
    """The live panel's figure: the run's loss and layer `layer`'s telemetry, every head or one."""
    steps, series = layer_series(run, layer)
    heads = range(len(series[SIGNALS[0]])) if head is None else [head]
    fig = _frame(f"{name or run.path.name}, layer index {layer}" + ("" if head is None else f", head {head}"),
                 "dotted: the runaway threshold")
    fig.add_scatter(x=smoothed_loss(run)[0], y=smoothed_loss(run)[1], mode="lines", name="loss",
                    line={"color": LOSS_COLOUR}, row=1, col=1)
    for h in heads:
        for i, signal in enumerate(SIGNALS, start=1):
            row, col = _cell(i)
            fig.add_scatter(x=steps, y=series[signal][h], mode="lines", name=f"head {h}",
                            legendgroup=f"head {h}", showlegend=i == 1,
                            line={"color": HEAD_COLOURS[h % len(HEAD_COLOURS)]}, row=row, col=col)
    return fig


def run_browser(root: str | Path, run: str | None = None, layer: int = 1) -> LivePanel:
    """Live panel (needs a kernel): a run under `root` (by its path there), a layer, all heads or one."""
    root = Path(root)
    names = [str(Path(r["path"]).relative_to(root)) for r in list_runs(root)]
    if not names:
        raise ValueError(f"no run records under {root}")
    run_box = dropdown("run", names, run or names[0], width="330px")
    layer_box = widgets.IntSlider(value=layer, min=0, max=1, description="layer index",
                                  style={"description_width": "initial"}, layout={"width": "260px"})
    head_box = dropdown("head", [("all", None)], None, width="140px")

    def fit_controls() -> Run:
        """Set the layer and head ranges to the chosen run's model."""
        record = cached_run(str(root / run_box.value))
        model = record.config["model"]
        layer_box.max = model["n_layer"] - 1
        options = [("all", None), *((str(h), h) for h in range(model["n_head"]))]
        if list(head_box.options) != options:
            value = head_box.value if head_box.value is None or head_box.value < model["n_head"] else None
            head_box.options, head_box.value = options, value
        return record

    def compute(v: dict) -> tuple[str, go.Figure]:
        record = fit_controls()
        heads = "all heads" if head_box.value is None else f"head {head_box.value}"
        text = f"{run_note(v['run'], record)}; shown: layer index {layer_box.value}, {heads}"
        return text, run_figure(record, layer_box.value, head_box.value, v["run"])

    fit_controls()
    note = "telemetry every 50 steps on a few sampled sequences; the loss is a moving mean of 200 steps"
    return LivePanel({"run": run_box, "layer": layer_box, "head": head_box}, compute, note)


def thinned(steps: list[int], per_signal: dict[str, list[list[float]]], max_points: int
            ) -> tuple[list[int], dict[str, list[list[float]]]]:
    """`layer_series`'s output with at most about `max_points` samples per line: every k-th sample and the
    last one (the page stays small; the run's last sample stays in)."""
    stride = max(1, -(-len(steps) // max_points))
    keep = list(range(0, len(steps), stride))
    if keep[-1] != len(steps) - 1:
        keep.append(len(steps) - 1)
    return ([steps[i] for i in keep],
            {name: [[line[i] for i in keep] for line in lines] for name, lines in per_signal.items()})


def run_twin(runs: dict[str, Run], layer: int = 1,
             title: str = "Recorded runs: pick the run (menu) and the layer (slider)",
             max_points: int = 100) -> go.Figure:
    """The browser for a page without a kernel: a menu for the run, a slider for the layer (starting at
    `layer`), one line per head in every telemetry panel, at most about `max_points` telemetry samples per
    line (`thinned`). All runs need the same number of layers."""
    if max_points < 2:
        raise ValueError(f"max_points must be at least 2, got {max_points}")
    names = list(runs)
    series = {name: [thinned(*layer_series(runs[name], i), max_points)
                     for i in range(runs[name].config["model"]["n_layer"])]
              for name in names}
    layers = {len(s) for s in series.values()}
    if len(layers) != 1:
        raise ValueError(f"the runs of a twin need one number of layers, got {sorted(layers)}")
    n_layers = layers.pop()
    fig = _frame(title, run_note(names[0], runs[names[0]], False, "<br>"), height=1120)
    restyled, groups = [], []
    for k, name in enumerate(names):
        run, first = runs[name], k == 0
        group = [len(fig.data)]
        steps, loss = smoothed_loss(run)
        fig.add_scatter(x=steps, y=sig(loss), mode="lines", name="loss", line={"color": LOSS_COLOUR},
                        visible=first, row=1, col=1)
        telemetry_steps, per_layer = series[name][layer]
        for h in range(len(per_layer[SIGNALS[0]])):
            for i, signal in enumerate(SIGNALS, start=1):
                row, col = _cell(i)
                restyled.append(len(fig.data))
                group.append(len(fig.data))
                fig.add_scatter(x=telemetry_steps, y=sig(per_layer[signal][h]), mode="lines",
                                name=f"head {h}", legendgroup=f"head {h}", showlegend=i == 1, visible=first,
                                line={"color": HEAD_COLOURS[h % len(HEAD_COLOURS)]}, row=row, col=col)
        groups.append(group)
    total = len(fig.data)
    menu = [(name, [t in group for t in range(total)],
             {"title.subtitle.text": run_note(name, runs[name], False, "<br>")})
            for name, group in zip(names, groups, strict=True)]
    slider = []
    for i in range(n_layers):
        ys = [sig(series[name][i][1][signal][h]) for name in names
              for h in range(len(series[name][i][1][SIGNALS[0]])) for signal in SIGNALS]
        slider.append((str(i), {"y": ys}))
    add_menu_and_slider(fig, menu, slider, restyled, "layer index: ", slider_active=layer, bottom=190)
    return fig

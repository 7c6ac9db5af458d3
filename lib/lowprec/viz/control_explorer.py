"""Chapter 4's explorer of the positive control (`lowprec.instruments.positive_control`): train W_Q in one arm
and watch its drift along R, ⟨W − W(0), R⟩, and the head's task loss as a fraction of its ceiling (1: all
content attention lost).

`control_explorer` is the live panel (placement, arm, optimizer, V's mean, the bias weight, the Fix's β and
the number of steps; about a second per 100 steps, with the float64 reference of the same setting beside it);
`control_twin` its static twin: the arms in one figure, a menu for the optimizer, a slider for V's mean.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import ipywidgets as widgets
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from lowprec.instruments.positive_control import ARMS, OPTIMIZERS, PLACEMENTS, ControlConfig, run_arm
from lowprec.viz.panels import LivePanel, add_menu_and_slider, dropdown, sig

ARM_COLOURS = {"lowp": "#d62728", "fix": "#1f77b4", "fp32pv": "#2ca02c", "reference": "#7f7f7f"}
ARM_NAMES = {"lowp": "no Fix", "fix": "Fix", "fp32pv": "P̄V unrounded", "reference": "float64 reference"}
V_MEANS = (-2.5, -1.5, -1.0, 1.5)
BIAS_WEIGHTS = (0.5, 1.0, 2.0)
BETAS = (2.0, 7.0)


@functools.lru_cache(maxsize=64)
def cached_arm(cfg: ControlConfig, placement: str, arm: str, optimizer: str) -> dict:
    """run_arm, remembered (the reference arm of a setting is shared by every other arm)."""
    return run_arm(cfg, placement, arm, optimizer)


def curves(run: dict) -> tuple[list[float], list[float]]:
    """(drift along R, task loss / ceiling) per step of one run_arm result."""
    s = run["series"]
    return s["w_r"], [t / c for t, c in zip(s["task_hp"], s["task_ceiling"], strict=True)]


def _frame(title: str, subtitle: str = "", height: int = 420, top: int = 100) -> go.Figure:
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12,
                        subplot_titles=("drift of W_Q along R", "task loss / its ceiling"))
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(title_text="⟨W − W(0), R⟩ (dimensionless)", row=1, col=1)
    fig.update_yaxes(title_text="fraction of the ceiling (1 = task lost)", rangemode="tozero", row=1, col=2)
    fig.update_layout(title={"text": title, "subtitle": {"text": subtitle}}, height=height, margin={"t": top})
    return fig


def summary_line(name: str, run: dict) -> str:
    s = run["summary"]
    bias = f"δ error t {s['delta_err_t']:+.1f}, " if "delta_err_t" in s else ""
    collapse = "no collapse" if s["collapse_step"] is None else f"collapse at step {s['collapse_step']}"
    return (f"{name}: {bias}⟨W − W(0), R⟩ {s['w_r_final']:+.3f} at the end, "
            f"‖W_Q‖₂ ×{s['w_norm_growth']:.2f}, task lost {s['task_lost_last']:.0%}, {collapse}")


def control_explorer(
    placement: str = "fa2", arm: str = "lowp", optimizer: str = "adam", v_mean: float = -1.5,
    bias_weight: float = 1.0, beta: float = 2.0, steps: int = 100,
) -> LivePanel:  # fmt: skip
    """Live panel (needs a kernel): one arm of the positive control, trained here, beside the float64
    reference of the same setting (about a second per 100 steps)."""
    boxes = {
        "placement": dropdown("placement", PLACEMENTS, placement, width="160px"),
        "arm": dropdown("arm", [(ARM_NAMES[a], a) for a in ARMS], arm, width="210px"),
        "optimizer": dropdown("optimizer", OPTIMIZERS, optimizer, width="160px"),
        "v_mean": dropdown("V mean", V_MEANS, v_mean, width="150px"),
        "bias_weight": dropdown("bias weight", BIAS_WEIGHTS, bias_weight, width="170px"),
        "beta": dropdown("Fix β", BETAS, beta, width="130px"),
        "steps": widgets.IntSlider(value=steps, min=20, max=300, step=20, description="steps",
                                   continuous_update=False, layout={"width": "260px"}),
    }

    def compute(v: dict) -> tuple[str, go.Figure]:
        cfg = replace(ControlConfig(), steps=v["steps"], v_mean=v["v_mean"], bias_weight=v["bias_weight"],
                      beta=v["beta"] if v["arm"] == "fix" else ControlConfig().beta)
        reference = replace(cfg, beta=ControlConfig().beta)
        shown = {"reference": cached_arm(reference, "fa2", "reference", v["optimizer"])}
        if v["arm"] != "reference":
            shown = {v["arm"]: cached_arm(cfg, v["placement"], v["arm"], v["optimizer"]), **shown}
        title = (f"{v['placement']}, {v['optimizer']}, V mean {v['v_mean']:+g}, "
                 f"bias weight {v['bias_weight']:g}" + (f", β = {v['beta']:g}" if v["arm"] == "fix" else ""))
        fig = _frame(title, "drift along R and the task lost, per step")
        for a, run in shown.items():
            drift, lost = curves(run)
            x = list(range(1, len(drift) + 1))
            style = {"mode": "lines", "legendgroup": a, "line": {"color": ARM_COLOURS[a]}}
            fig.add_scatter(x=x, y=drift, name=ARM_NAMES[a], **style, row=1, col=1)
            fig.add_scatter(x=x, y=lost, name=ARM_NAMES[a], showlegend=False, **style, row=1, col=2)
        return "\n".join(summary_line(ARM_NAMES[a], run) for a, run in shown.items()), fig

    note = "the arm trains here from W_Q(0) on the control's data stream; grey: float64 attention alike"
    return LivePanel(boxes, compute, note)


def control_twin(
    v_means: tuple[float, ...] = (-1.5, -1.0),
    optimizers: tuple[str, ...] = OPTIMIZERS,
    arms: tuple[str, ...] = ("lowp", "fix", "fp32pv"),
    steps: int = 150,
    placement: str = "fa2",
    cfg: ControlConfig | None = None,
    trained: dict[ControlConfig, dict[str, dict]] | None = None,
) -> go.Figure:
    """The explorer for a page without a kernel: every arm in one figure, a menu for the optimizer, a slider
    for V's mean; every (optimizer, V mean, arm) run is trained here, `steps` steps each, except those that
    `trained` holds: runs at least `steps` long by their config (each a dict by
    "<placement>/<optimizer>/<arm>", e.g. recorded_control's), used where cfg with that V mean is their config
    apart from its length (no step depends on cfg.steps, so their first `steps` steps are the same run)."""
    cfg = cfg or ControlConfig()
    base = replace(cfg, steps=steps)

    def run(optimizer: str, v_mean: float, arm: str) -> dict:
        wanted = replace(base, v_mean=v_mean)
        done = next((runs.get(f"{placement}/{optimizer}/{arm}") for config, runs in (trained or {}).items()
                     if replace(config, steps=steps) == wanted), None)
        if done is not None and len(done["series"]["w_r"]) >= steps:
            return {"series": {key: values[:steps] for key, values in done["series"].items()}}
        return cached_arm(wanted, placement, arm, optimizer)

    runs = {(o, vm, a): run(o, vm, a) for o in optimizers for vm in v_means for a in arms}
    fig = _frame(f"Positive control ({placement}): pick the optimizer (menu) and V's mean (slider)",
                 f"{steps} steps from W_Q(0); bias weight {base.bias_weight:g}, Fix β = {base.beta:g}",
                 height=540, top=130)
    x = list(range(1, steps + 1))
    for i, o in enumerate(optimizers):
        for a in arms:
            drift, lost = curves(runs[o, v_means[0], a])
            style = {"mode": "lines", "legendgroup": a, "line": {"color": ARM_COLOURS[a]}, "visible": i == 0}
            fig.add_scatter(x=x, y=sig(drift), name=ARM_NAMES[a], **style, row=1, col=1)
            fig.add_scatter(x=x, y=sig(lost), name=ARM_NAMES[a], showlegend=False, **style, row=1, col=2)
    per_group = 2 * len(arms)
    n = per_group * len(optimizers)
    menu = [(o, [t // per_group == i for t in range(n)], {}) for i, o in enumerate(optimizers)]
    slider = [(f"{vm:+g}", {"y": [sig(c) for o in optimizers for a in arms for c in curves(runs[o, vm, a])]})
              for vm in v_means]
    return add_menu_and_slider(fig, menu, slider, list(range(n)), "V mean (bias channel): ", menu_y=1.1)

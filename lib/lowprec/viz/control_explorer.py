"""The explorers of the positive control (`lowprec.instruments.positive_control`, chapters 4 and 5): train W_Q
in one treatment, or with one of chapter 5's cures (`lowprec.instruments.cures.CURES`), and watch its drift
along R, ⟨W − W(0), R⟩, and the head's task loss as a fraction of its ceiling (1: all content attention lost).
The task is a regression onto a teacher's output, so it has no accuracy; the share of the task lost is its
measure.

`control_explorer` is the live panel (placement, treatment or cure, optimizer, V's mean, the bias weight, the
Fix's β and the number of steps; about a second per 100 steps, with the float64 reference of the same setting
beside it); `control_twin` its static twin for chapter 4 (the treatments in one figure, a menu for the
optimizer and the bias weight, a slider for V's mean) and `cure_twin` the one for chapter 5 (a menu for the
cure, beside fa2 without one; a slider for V's mean). Both twins read recorded runs where they have them
(`trained`) and train the rest.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import ipywidgets as widgets
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from lowprec.instruments.control import FP32_PV, OPTIMIZERS, TREATMENTS, ControlConfig, train_treatment
from lowprec.instruments.cures import CURES, Cure, cure_by_name, train_cure
from lowprec.viz.panels import LivePanel, add_menu_and_slider, dropdown, sig

TREATMENT_COLOURS = {"lowp": "#d62728", "fix": "#1f77b4", "fp32pv": "#2ca02c", "reference": "#7f7f7f"}
TREATMENT_NAMES = {"lowp": "no Fix", "fix": "Fix", "fp32pv": "P̄V unrounded", "reference": "float64 reference"}
CURE_COLOURS = dict(zip((c.name for c in CURES), (  # the first, none (fa2), is the baseline: black
    "#252525", "#636efa", "#ef553b", "#00cc96", "#ab63fa", "#ffa15a", "#19d3f3", "#ff6692", "#8c564b",
    "#bcbd22", "#e377c2"), strict=True))
V_MEANS = (-2.5, -1.5, -1.0, 1.5)
BIAS_WEIGHTS = (0.5, 1.0, 2.0)
BETAS = (2.0, 7.0)
Trained = Mapping[ControlConfig, Mapping[str, dict]]  # recorded runs: config -> {record key: run}


@functools.lru_cache(maxsize=64)
def cached_treatment(cfg: ControlConfig, placement: str, treatment: str, optimizer: str) -> dict:
    """train_treatment, remembered (the reference treatment of a setting is shared by every other one)."""
    return train_treatment(cfg, placement, treatment, optimizer)


@functools.lru_cache(maxsize=32)
def cached_cure(cfg: ControlConfig, cure: Cure, optimizer: str) -> dict:
    """train_cure, remembered."""
    return train_cure(cfg, cure, optimizer)


def cure_named(name: str, beta: float | None = None) -> Cure:
    """The cure of CURES called `name`, its Fix (if it has one) with factor `beta` when given."""
    cure = cure_by_name(name)
    if beta is None or cure.fix is None or cure.fix.beta == beta:
        return cure
    return replace(cure, name=f"{name}, β = {beta:g}", fix=replace(cure.fix, beta=beta))


def curves(run: dict) -> tuple[list[float], list[float]]:
    """(drift along R, task loss / ceiling) per step of one train_treatment result."""
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
    placement: str = "fa2", treatment: str = "lowp", optimizer: str = "adam", v_mean: float = -1.5,
    bias_weight: float = 1.0, beta: float = 2.0, steps: int = 100, cure: str | None = None,
) -> LivePanel:  # fmt: skip
    """Live panel (needs a kernel): one treatment of the positive control, or one cure of CURES (which sets
    its own precision and Fix, so placement and treatment do not apply to it; β sets its Fix's factor),
    trained here beside the float64 reference of the same setting (about a second per 100 steps)."""
    if cure is not None:
        cure_named(cure)  # a ValueError for an unknown name, here rather than in the panel
    boxes = {
        "placement": dropdown("placement", tuple(FP32_PV), placement, width="160px"),
        "treatment": dropdown("treatment", [(TREATMENT_NAMES[t], t) for t in TREATMENTS], treatment,
                              width="210px"),
        "cure": dropdown("cure", [("none: the treatment", None), *((c.name, c.name) for c in CURES)], cure,
                         width="230px"),
        "optimizer": dropdown("optimizer", OPTIMIZERS, optimizer, width="160px"),
        "v_mean": dropdown("V mean", V_MEANS, v_mean, width="150px"),
        "bias_weight": dropdown("bias weight", BIAS_WEIGHTS, bias_weight, width="170px"),
        "beta": dropdown("Fix β", BETAS, beta, width="130px"),
        "steps": widgets.IntSlider(value=steps, min=20, max=300, step=20, description="steps",
                                   continuous_update=False, layout={"width": "260px"}),
    }

    def compute(v: dict) -> tuple[str, go.Figure]:
        cfg = replace(ControlConfig(), steps=v["steps"], v_mean=v["v_mean"], bias_weight=v["bias_weight"])
        shown = {"reference": (TREATMENT_NAMES["reference"], TREATMENT_COLOURS["reference"],
                               cached_treatment(cfg, "fa2", "reference", v["optimizer"]))}
        setting = f"{v['optimizer']}, V mean {v['v_mean']:+g}, bias weight {v['bias_weight']:g}"
        if v["cure"] is not None:
            picked = cure_named(v["cure"], v["beta"])
            fix = f", Fix β = {picked.fix.beta:g}" if picked.fix is not None else ""
            title = f"cure {v['cure']} (precision {picked.precision}{fix}), {setting}"
            shown = {"cure": (picked.name, CURE_COLOURS[v["cure"]], cached_cure(cfg, picked, v["optimizer"])),
                     **shown}
        else:
            treatment = v["treatment"]
            title = f"{v['placement']}, {setting}" + (f", β = {v['beta']:g}" if treatment == "fix" else "")
            if treatment != "reference":
                trained_cfg = replace(cfg, beta=v["beta"]) if treatment == "fix" else cfg
                run = cached_treatment(trained_cfg, v["placement"], treatment, v["optimizer"])
                shown = {treatment: (TREATMENT_NAMES[treatment], TREATMENT_COLOURS[treatment], run), **shown}
        fig = _frame(title, "drift along R and the task lost, per step")
        for key, (name, colour, run) in shown.items():
            drift, lost = curves(run)
            x = list(range(1, len(drift) + 1))
            style = {"mode": "lines", "legendgroup": key, "line": {"color": colour}}
            fig.add_scatter(x=x, y=drift, name=name, **style, row=1, col=1)
            fig.add_scatter(x=x, y=lost, name=name, showlegend=False, **style, row=1, col=2)
        return "\n".join(summary_line(name, run) for name, _, run in shown.values()), fig

    note = ("the treatment or cure trains here from W_Q(0) on the control's data stream; grey: float64 "
            "attention alike; a cure sets its own precision and Fix (placement and treatment then do not "
            "apply)")
    return LivePanel(boxes, compute, note)


def recorded_or_trained(cfg: ControlConfig, key: str, trained: Trained | None) -> dict:
    """The run `key` ("<placement>/<optimizer>/<treatment>" or "cure/<optimizer>/<cure name>", as in the
    records of `lowprec experiment positive-control --series`) of `cfg`: the first cfg.steps steps of a run in
    `trained` whose config is cfg apart from its length (no step depends on cfg.steps, so they are the same
    run), or trained here (remembered) if none is at least that long."""
    done = next((runs.get(key) for config, runs in (trained or {}).items()
                 if replace(config, steps=cfg.steps) == cfg), None)
    if done is not None and len(done["series"]["w_r"]) >= cfg.steps:
        return {"series": {name: values[: cfg.steps] for name, values in done["series"].items()}}
    placement, optimizer, name = key.split("/", 2)
    if placement == "cure":
        return cached_cure(cfg, cure_by_name(name), optimizer)
    return cached_treatment(cfg, "fa2" if placement == "fp64" else placement, name, optimizer)


Line = tuple[str, str, Callable[[float], dict]]  # (legend name, colour, V mean -> run)


def _menu_slider_twin(fig: go.Figure, groups: Mapping[str, Sequence[Line]], v_means: Sequence[float],
                      steps: int, shared: Sequence[Line] = ()) -> go.Figure:
    """Draw the `shared` lines (drift and task lost, shown in every state) and every group's lines into `fig`,
    the first group visible, and add a menu that shows one group and a slider that restyles every line to
    another V mean."""
    lines = [(None, line) for line in shared] + [(g, line) for g, group in groups.items() for line in group]
    runs = {(i, vm): line[2](vm) for i, (_, line) in enumerate(lines) for vm in v_means}
    first = next(iter(groups))
    x = list(range(1, steps + 1))
    owner = []  # the menu entry of each trace (None: every entry)
    for i, (g, (name, colour, _)) in enumerate(lines):
        drift, lost = curves(runs[i, v_means[0]])
        style = {"mode": "lines", "legendgroup": name, "line": {"color": colour},
                 "visible": g in (None, first)}
        fig.add_scatter(x=x, y=sig(drift), name=name, **style, row=1, col=1)
        fig.add_scatter(x=x, y=sig(lost), name=name, showlegend=False, **style, row=1, col=2)
        owner += [g, g]
    menu = [(g, [o in (None, g) for o in owner], {}) for g in groups]
    slider = [(f"{vm:+g}", {"y": [sig(c) for i in range(len(lines)) for c in curves(runs[i, vm])]})
              for vm in v_means]
    return add_menu_and_slider(fig, menu, slider, list(range(len(owner))), "V mean (bias channel): ")


def control_twin(
    v_means: tuple[float, ...] = (-1.5, -1.0),
    optimizers: tuple[str, ...] = OPTIMIZERS,
    treatments: tuple[str, ...] = ("lowp", "fix", "fp32pv"),
    steps: int = 150,
    placement: str = "fa2",
    cfg: ControlConfig | None = None,
    trained: Trained | None = None,
    settings: Sequence[tuple[str, Mapping[str, float]]] | None = None,
) -> go.Figure:
    """The explorer for a page without a kernel: every treatment in one figure, a menu entry per setting, a
    slider for V's mean. A setting is (optimizer, changes of cfg such as {"bias_weight": 2.0}); default: each
    of `optimizers` with cfg as it is. Every (setting, V mean, treatment) run is `steps` steps long, read from
    `trained` where it holds it (recorded_or_trained; e.g. recorded_control's runs, by their config) or
    trained here."""
    cfg = replace(cfg or ControlConfig(), steps=steps)
    settings = settings if settings is not None else [(o, {}) for o in optimizers]

    def label(optimizer: str, changes: Mapping[str, float]) -> str:
        changed = [f"{name.replace('_', ' ')} {value:g}" for name, value in changes.items()]
        return ", ".join([optimizer, *changed])

    def line(optimizer: str, changes: Mapping[str, float], treatment: str) -> Line:
        key = f"{'fp64' if treatment == 'reference' else placement}/{optimizer}/{treatment}"
        return TREATMENT_NAMES[treatment], TREATMENT_COLOURS[treatment], lambda vm: recorded_or_trained(
            replace(cfg, v_mean=vm, **changes), key, trained)

    groups = {label(o, changes): [line(o, changes, a) for a in treatments] for o, changes in settings}
    title = f"Positive control ({placement}): pick the optimizer and bias weight (menu), V's mean (slider)"
    fig = _frame(title, f"{steps} steps from W_Q(0); bias weight {cfg.bias_weight:g} unless the menu says, "
                 f"Fix β = {cfg.beta:g}", height=540)
    return _menu_slider_twin(fig, groups, v_means, steps)


def cure_twin(
    v_means: tuple[float, ...] = (-1.5, -1.0),
    cures: Sequence[str] | None = None,
    optimizer: str = "adam",
    steps: int = 300,
    cfg: ControlConfig | None = None,
    trained: Trained | None = None,
) -> go.Figure:
    """Chapter 5's explorer for a page without a kernel: a menu entry per cure (default: every cure of CURES
    after the first), each drawn beside the first, none (fa2), and a slider for V's mean; every run `steps`
    steps long, read from `trained` where it holds it (recorded_or_trained) or trained here."""
    cfg = replace(cfg or ControlConfig(), steps=steps)
    base, names = CURES[0].name, list(cures if cures is not None else (c.name for c in CURES[1:]))
    for name in names:
        cure_by_name(name)

    def line(name: str) -> Line:
        return name, CURE_COLOURS[name], lambda vm: recorded_or_trained(
            replace(cfg, v_mean=vm), f"cure/{optimizer}/{name}", trained)

    groups = {name: [line(name)] for name in names}
    fig = _frame("Cures in the positive control: pick the cure (menu) and V's mean (slider)",
                 f"{optimizer}, {steps} steps from W_Q(0), bias weight {cfg.bias_weight:g}; black: fa2 "
                 f"without a cure ({base}), in every state", height=540)
    return _menu_slider_twin(fig, groups, v_means, steps, shared=[line(base)])

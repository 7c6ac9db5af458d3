"""The explorers of chapters 2-4 (lowprec.viz): each static twin builds on a tiny grid with working controls,
and each live panel re-renders its output when a control changes (driven in a real kernel, as JupyterLab
would drive it)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import ipywidgets as widgets
import nbclient
import nbformat
import pytest
import torch
from lowprec.attention.fix import Fix
from lowprec.attention.precision import POINTS, Rounding
from lowprec.formats import FORMATS, round_to
from lowprec.instruments.bias import CASES, UNIQUE_GAP, Rows
from lowprec.instruments.control import ControlConfig
from lowprec.instruments.cures import SCALE
from lowprec.instruments.positive_control import train_grid
from lowprec.runs import load_run
from lowprec.viz.control_explorer import cached_treatment, control_twin
from lowprec.viz.precision_explorer import (
    TWIN_PRECISIONS,
    Setting,
    measure,
    point_spec,
    precision_explorer,
    precision_twin,
    rows_for,
)
from lowprec.viz.run_browser import layer_series, run_twin, trailing_mean
from notebook_cells import wait_for

ROOT = Path(__file__).resolve().parents[1]
LEAD = ROOT / "results" / "explode" / "lead-s1337"


def legend_colours(fig) -> list[str]:
    """The colour of every legend entry the figure starts with (visible traces shown in the legend)."""
    colours = []
    for trace in fig.data:
        if trace.visible is False or trace.showlegend is False:
            continue
        line = getattr(trace, "line", None)
        colour = (line.color if line is not None else None) or trace.marker.color
        colours.append(colour)
    return colours


def check_twin(fig, menu_entries: int, slider_steps: int) -> None:
    """A menu with one entry per group, a slider whose steps restyle existing traces with different data,
    a title, axis titles on every axis, and no colour twice among the legend entries."""
    (menu,) = fig.layout.updatemenus
    (slider,) = fig.layout.sliders
    assert len(menu.buttons) == menu_entries and len(slider.steps) == slider_steps
    n = len(fig.data)
    for button in menu.buttons:
        assert len(button.args[0]["visible"]) == n and any(button.args[0]["visible"])
    first = [trace.visible is not False for trace in fig.data]
    assert list(menu.buttons[0].args[0]["visible"]) == first, "the figure starts in the menu's first state"
    datas = []
    for step in slider.steps:
        data, indices = step.args
        assert all(0 <= i < n for i in indices)
        assert all(len(values) == len(indices) for values in data.values())
        datas.append(data)
    assert all(a != b for a, b in zip(datas, datas[1:], strict=False)), "every slider step changes the data"
    assert fig.layout.title.text
    axes = [name for name in fig.layout if name.startswith(("xaxis", "yaxis"))
            and fig.layout[name].showticklabels is not False]  # shared axes label the outer subplot only
    untitled = [name for name in axes if not fig.layout[name].title.text]
    assert axes and not untitled, f"axes without a title: {untitled}"
    colours = legend_colours(fig)
    assert colours and len(colours) == len(set(colours)), colours


def test_precision_measure_matches_the_bias_harness() -> None:
    m = measure(Setting(family="near ties", v_mean=-1.5), rows=128)
    assert m.result.rows == 128 and len(m.delta_err) == 128
    assert abs(float(m.delta_err.mean()) - m.result.delta.mean) < 1e-12
    assert m.pbar_ones.double().mean() == 4.0  # four near-tied P̄ round to 1 in every row (chapter 2)
    fixed = measure(Setting(family="near ties", v_mean=-1.5, beta=2.0), rows=128)
    assert fixed.pbar_ones.sum() == 0 and fixed.triggered == 128
    # the default near ties are the harness's near-k4 rows (chapter 2's table), bit for bit
    data, scale = rows_for("near ties", Setting().case, 128)
    assert scale is None and torch.equal(data.q, Rows.make(CASES["near-k4"], 128).q)


def row_scores(data: Rows, scale: float | None) -> torch.Tensor:
    """(rows, keys) float64 scores q·k·scale of the measured rows (q, k in bf16: exact products)."""
    q, k = data.q.double(), data.k.double()
    s = q @ k.transpose(-1, -2) * (scale or 1 / math.sqrt(q.shape[-1]))
    return s.flatten(0, 2)[: data.rows]


def test_precision_points_and_modes_reach_the_emulator() -> None:
    """Each rounding point takes its own format, the weights a mode; each one changes the measured error."""
    base = measure(Setting(family="unique", v_mean=-1.0), rows=128)
    for point in POINTS:
        m = measure(Setting(family="unique", v_mean=-1.0, **{point: "e8m3"}), rows=128)
        assert getattr(m.setting.precision, point) == Rounding("e8m3") and f"{point}=e8m3" in m.setting.label
        assert not torch.equal(m.delta_err, base.delta_err), point
    near = {spec: measure(Setting(window=0.025, weights=spec), rows=128)
            for spec in ("bf16", "bf16@stochastic", "e8m3", "e8m3@ones")}
    assert len({m.delta_err.sum().item() for m in near.values()}) == 4, "each format and mode its own error"
    ones = {spec: m.pbar_ones.double().mean() for spec, m in near.items()}
    assert ones["e8m3@ones"] == 4 > ones["bf16@stochastic"]
    # the panel's format and mode: None keeps the placement's format
    assert point_spec("fa2", "weights", None, "nearest") is None
    assert point_spec("fa2", "weights", None, "stochastic") == "input@stochastic"
    assert point_spec("paper", "rowsum", "e8m3", "stochastic") == "e8m3@stochastic"
    assert point_spec("fa2", "weights", "e8m3", "ones") == "e8m3@ones"
    with pytest.raises(ValueError, match="'ones'"):
        measure(Setting(rowsum=point_spec("fa2", "rowsum", "e8m3", "ones")), rows=64)
    # an unrounded output point: the fp32 O that the backward's δ uses, not the stored bf16 one
    stored, unrounded = (measure(Setting("fp32", family="unique", output=out), rows=128)
                         for out in ("input", None))
    assert stored.delta_err.abs().mean() > 1e3 * unrounded.delta_err.abs().mean()


def test_precision_row_families() -> None:
    """Tied keys and the near-tie window set the rows; the bf16-grid family has its maxima on the grid."""
    for ties, window in ((2, 1e-3), (7, 0.02), (32, 0.045)):
        setting = Setting(family="near ties", ties=ties, window=window)
        s = row_scores(*rows_for(setting.family, setting.case, 256))
        gap = s.amax(dim=-1, keepdim=True) - s
        assert (gap < window).sum(dim=-1).eq(ties).all() and ((gap < UNIQUE_GAP) & (gap >= window)).sum() == 0
    counts = {ties: measure(Setting(ties=ties), rows=128).pbar_ones.double().mean() for ties in (2, 8, 16)}
    assert counts == {2: 2.0, 8: 8.0, 16: 16.0}, "near ties inside bf16's window: all k round to 1"
    wide = measure(Setting(window=0.025), rows=256).pbar_ones.double().mean()
    assert 1 < wide < 2, "in a window 0.025 wide most near ties lie outside bf16's 1.955e-3"

    bf16 = FORMATS["bf16"]
    grid = Setting(family="near ties, r on bf16 grid")
    data, scale = rows_for(grid.family, grid.case, 512)
    r = row_scores(data, scale).amax(dim=-1)
    assert scale == SCALE and torch.equal(round_to(r.float(), bf16).double(), r), "maxima on the bf16 grid"
    assert len(r.unique()) > 100 and r.min() >= 1 and r.max() <= 3  # drawn in [1, 3], then snapped
    free = row_scores(*rows_for("near ties", Setting().case, 512)).amax(dim=-1)
    assert (round_to(free.float(), bf16).double() != free).double().mean() > 0.9, "elsewhere: off the grid"
    assert not torch.equal(measure(grid, rows=128).delta_err, measure(Setting(), rows=128).delta_err)
    zero = Setting(family="exact ties, r = 0")
    assert row_scores(*rows_for(zero.family, zero.case, 64)).amax(dim=-1).eq(0).all()


def test_precision_fix_tolerance_and_variant_reach_the_fix() -> None:
    setting = Setting(beta=2.0, tol=1e-3, tie="row", variant="closed")
    assert setting.fix == Fix(2.0, 1e-3, "row", "closed") == Setting().with_fix(setting.fix.spec).fix
    assert Setting(beta=2.0).with_fix(None).fix is None
    # near ties 1.25e-3 to 0.0225 below the max, each rounded to 1 by e8m3@ones: the default tol (e8m3's
    # window, 0.0317) sees them all, the paper code's 1e-3 none
    wide = Setting(window=0.025, weights="e8m3@ones", beta=2.0)
    seen, missed = measure(wide, rows=128), measure(replace(wide, tol=1e-3), rows=128)
    assert seen.triggered == 128 and seen.pbar_ones.sum() == 0
    assert missed.triggered == 0 and missed.pbar_ones.double().mean() == 4
    assert missed.result.delta.t > 10 * abs(seen.result.delta.t)
    # r = 0: the published rule keeps the shift at r (P̄ = 1 stays), the closed variant moves it
    published, closed = (measure(Setting(family="exact ties, r = 0", beta=2.0, variant=v), rows=128)
                         for v in ("published", "closed"))
    assert published.triggered == closed.triggered == 128
    assert published.pbar_ones.double().mean() == 4 and closed.pbar_ones.sum() == 0


def test_precision_live_panel_controls() -> None:
    """Every Setting field has a control (a point's format and mode apart), in the rows of the panel's layout;
    the new controls change the figure (outside a kernel, the panel computes on every change all the same)."""
    panel = precision_explorer(rows=64)
    fields = set(Setting.__dataclass_fields__) - set(POINTS)
    assert set(panel.controls) == fields | {f"{p}_{part}" for p in POINTS for part in ("format", "mode")}
    assert len(panel.widget.children) == 1 + 5 + 3  # note, five rows of controls, text note, text, figure
    assert panel.widget.children[-1] is panel.plot
    changes = (
        ("weights_format", "e8m3", "weights=e8m3"), ("weights_mode", "ones", "e8m3@ones"),
        ("family", "near ties, r on bf16 grid", "r on bf16 grid"), ("ties", 6, "k = 6"),
        ("window", 0.02, "window 0.02"), ("beta", 2.0, "β = 2"), ("tol", 0.0, "tol 0"),
        ("variant", "closed", "closed"), ("accumulator_format", "bf16", "accumulator=bf16"),
    )  # fmt: skip
    for name, value, shown in changes:
        before = panel.figure.to_json()
        panel.controls[name].value = value
        title = panel.figure.layout.title
        assert shown in title.text + title.subtitle.text and panel.figure.to_json() != before, name


def test_dropdowns_show_every_option() -> None:
    """A dropdown option whose value is None shows its label (ipywidgets alone shows a blank menu for it),
    whether picked in the menu (its index) or set in code (its value); every live panel's menus are these."""
    from lowprec.viz.control_explorer import control_explorer
    from lowprec.viz.panels import Dropdown, dropdown
    from lowprec.viz.run_browser import run_browser

    menu = dropdown("Fix", [("off", None), ("β = 2", 2.0)])
    assert (menu.index, menu.label, menu.value) == (0, "off", None)
    menu.index = 1
    menu.index = 0
    assert (menu.index, menu.label, menu.value) == (0, "off", None)
    menu.value = 2.0
    menu.value = None
    assert (menu.index, menu.label) == (0, "off")
    assert dropdown("Fix", [("off", None), ("β = 2", 2.0)], 2.0).label == "β = 2"
    panels = {"precision": precision_explorer(rows=64), "run browser": run_browser(LEAD),
              "control": control_explorer(steps=20)}
    for name, panel in panels.items():
        menus = {key: c for key, c in panel.controls.items() if isinstance(c, widgets.Dropdown)}
        assert menus and all(isinstance(c, Dropdown) for c in menus.values()), name
        blank = [key for key, c in menus.items() if c.index is None or not c.label]
        assert not blank, f"{name}: {blank} show no label"


def test_precision_twin() -> None:
    fig = precision_twin(groups=(Setting(family="unique"), Setting(family="near ties, r on bf16 grid")),
                         fixes=("none", "2"), rows=64, bins=8)
    check_twin(fig, menu_entries=2, slider_steps=2)
    assert [t.name for t in fig.data[:: 3][: len(TWIN_PRECISIONS)]] == [label for label, _ in TWIN_PRECISIONS]
    assert [b.label for b in fig.layout.updatemenus[0].buttons] == [
        "unique, V mean -1.5", "near ties, r on bf16 grid (k = 4, window 0.001), V mean -1.5"]
    fixes = precision_twin(groups=(Setting(family="near ties", window=0.025),), fixes=("2", "2:tol=0.001"),
                           precisions=(("fa2", "fa2"),), rows=64, bins=8)
    assert [s.label for s in fixes.layout.sliders[0].steps] == ["β = 2", "β = 2, tol 0.001"]
    check_twin(fixes, menu_entries=1, slider_steps=2)


def test_run_twin() -> None:
    runs = {path.name: load_run(path) for path in sorted(LEAD.iterdir()) if path.is_dir()}
    fig = run_twin(dict(list(runs.items())[:2]), layer=1)
    check_twin(fig, menu_entries=2, slider_steps=6)
    titles = {a.text for a in fig.layout.annotations}
    assert {"‖W_Q,h‖₂ of each head", "‖W_K,h‖₂ of each head", "attention entropy (mean over rows)"} <= titles
    assert fig.layout.sliders[0].active == 1


def test_tie_shares_are_drawn_as_trailing_means() -> None:
    """A share of tied rows jumps between 0 and 100% reading to reading: drawn as the mean of the last 5."""
    assert trailing_mean([0, 100, None, 0, 100, 0, 0], window=5) == [0, 50, 50, 100 / 3, 50, 50, 25]
    assert trailing_mean([None, None, 3.0], window=2) == [None, None, 3.0]
    run = load_run(LEAD / "paper-s1337")
    ties, rows = run.telemetry("tie_rows")[1], run.telemetry("rows")[1]
    raw = [100 * sample[1][0] / n for sample, n in zip(ties, rows, strict=True)]  # layer index 1, head 0
    assert layer_series(run, 1)[1]["tie_rows"][0] == trailing_mean(raw)


def test_run_twin_thins_long_runs_and_keeps_their_ends() -> None:
    """A twin stores at most about `max_points` samples per telemetry line, the last one always."""
    path = next(p for p in sorted(LEAD.iterdir()) if p.is_dir())
    run = load_run(path)
    steps = run.telemetry("max_logit")[0]
    full, thin = run_twin({"a": run}, max_points=len(steps)), run_twin({"a": run}, max_points=10)
    telemetry = [t for t in thin.data if t.name != "loss"]
    assert all(len(t.x) <= 11 and t.x[-1] == steps[-1] for t in telemetry), [len(t.x) for t in telemetry]
    assert all(len(t.x) == len(steps) for t in full.data if t.name != "loss")
    assert len(thin.to_json()) < len(full.to_json()) / 2
    with pytest.raises(ValueError, match="max_points"):
        run_twin({"a": run}, max_points=1)


def test_control_twin() -> None:
    fig = control_twin(v_means=(-1.5, -1.0), optimizers=("adam", "sgd"), treatments=("lowp", "fix"), steps=4)
    check_twin(fig, menu_entries=2, slider_steps=2)
    # longer runs of a configuration stand in for training at its V mean, and only there: the same figure
    default, edge = ControlConfig(steps=6), ControlConfig(steps=6, v_mean=-1.0)
    longer = train_grid(default, ("fa2",), ("lowp", "fix"), ("adam", "sgd"), False)["runs"]
    at_edge = train_grid(edge, ("fa2",), ("fix",), ("sgd",), False)["runs"]
    other = {"fa2/adam/fix": longer["fa2/adam/fix"]}  # stored under a config the twin does not show
    cached_treatment.cache_clear()
    reused = control_twin(v_means=(-1.5, -1.0), optimizers=("adam", "sgd"), treatments=("lowp", "fix"),
                          steps=4,
                          trained={default: {key: run for key, run in longer.items() if "lowp" in key},
                                   edge: at_edge, replace(default, bias_weight=2.0): other})
    assert reused.to_json() == fig.to_json() and cached_treatment.cache_info().misses == 5  # 8 runs, 3 reused


# Each live panel, all in one kernel: build it small, remember its text and figure, change one control,
# compare. The panel's text and figure are Output widgets whose state the kernel sets, so the client (nbclient
# here, JupyterLab for a reader: tests/test_lab.py) must receive the new figure as that widget's state.
LIVE = {
    "precision": (
        "from lowprec.viz.precision_explorer import precision_explorer\npanel = precision_explorer(rows=64)",
        "placement", "'paper'", "| paper, tiles",
    ),
    "run browser": (
        f"from lowprec.viz.run_browser import run_browser\npanel = run_browser({str(LEAD)!r})",
        "layer", "3", "layer index 3",
    ),
    "control": (
        "from lowprec.viz.control_explorer import control_explorer\npanel = control_explorer(steps=20)",
        "optimizer", "'sgd'", "sgd",
    ),
}


def live_cells(build: str, control: str, value: str, expected: str) -> list[str]:
    """One panel's four cells: build it, remember its text and figure, change `control`, compare; the last
    cell prints the figure widget's id and the new figure's title."""
    return [
        build + "\npanel",
        "before = str(panel.text.outputs), panel.figure.to_json()\n"
        "assert 'snapshot' in panel.widget.children[0].value and panel.plot.outputs",
        f"panel.controls[{control!r}].value = {value}",
        "after = str(panel.text.outputs), panel.figure.to_json()\n"
        f"assert after[0] != before[0] and {expected!r} in after[0] + after[1], (before[0], after[0])\n"
        f"assert {expected!r} not in before[0] + before[1] and after[1] != before[1]\n"
        "assert 'cannot compute' not in after[0]\n"
        "print(panel.plot.model_id)\nprint(panel.figure.layout.title.text)",
    ]


# Chapter 1's explorer (a widget box whose output area re-renders, no figure display): its own four cells.
LIVE_EXPLORER = [
    "from lowprec.viz.explore import rounding_explorer\npanel = rounding_explorer()\npanel",
    "fmt_box, out = panel.children[0].children[0], panel.children[2]\n" + wait_for("out.outputs")
    + "before = str(out.outputs)",
    "fmt_box.value = 'fp16'",
    wait_for("str(out.outputs) != before")
    + "after = str(out.outputs)\nassert 'sum in bf16' in before and 'sum in fp16' in after, (before, after)",
]


def test_live_panels_update_in_a_kernel() -> None:
    """Every live panel in turn in one kernel (one start and one set of imports), as a reader runs them:
    changing a control re-renders its output (what a JupyterLab reader sees)."""
    cells = [cell for args in LIVE.values() for cell in live_cells(*args)] + LIVE_EXPLORER
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code) for code in cells])
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3")
    client.execute()
    for i, name in enumerate(LIVE):
        plot, title = notebook.cells[4 * i + 3].outputs[0]["text"].strip().split("\n", 1)
        shown = [o for o in notebook.cells[4 * i].outputs if o["output_type"] == "display_data"]
        assert len(shown) == 1 and "application/vnd.jupyter.widget-view+json" in shown[0]["data"], name
        (figure,) = client.widget_state[plot]["outputs"]
        assert title and title in str(figure["data"]), f"{name}: the client holds the new figure"


def test_control_twin_menu_of_settings_reads_records_of_each() -> None:
    """Chapter 4's twin with a bias weight in its menu: each entry's runs come from a record of that
    configuration (no shorter than the twin's runs) where one exists, and are trained otherwise."""
    from lowprec.viz.panels import sig

    settings = (("adam", {}), ("adam", {"bias_weight": 2.0}))
    fig = control_twin(v_means=(-1.5, -1.0), treatments=("lowp",), steps=4, settings=settings)
    check_twin(fig, menu_entries=2, slider_steps=2)
    assert [b.label for b in fig.layout.updatemenus[0].buttons] == ["adam", "adam, bias weight 2"]
    heavier = cached_treatment(ControlConfig(steps=4, bias_weight=2.0), "fa2", "lowp", "adam")["series"]
    assert list(fig.data[2].y) == sig(heavier["w_r"]) != list(fig.data[0].y)  # drift of the second entry
    series = {"w_r": [1.0, 2.0, 3.0, 4.0, 5.0], "task_hp": [1.0] * 5, "task_ceiling": [2.0] * 5}
    short = {"series": {name: values[:3] for name, values in series.items()}}  # too short: trained instead
    for run, expected in (({"series": series}, [1.0, 2.0, 3.0, 4.0]), (short, sig(heavier["w_r"]))):
        recorded = {ControlConfig(steps=9, bias_weight=2.0): {"fa2/adam/lowp": run}}
        shown = control_twin(v_means=(-1.5, -1.0), treatments=("lowp",), steps=4, settings=settings,
                             trained=recorded)
        assert list(shown.data[2].y) == expected and list(shown.data[0].y) == list(fig.data[0].y)


def test_cure_twin_shows_each_cure_beside_fa2() -> None:
    """Chapter 5's twin: a menu entry per cure, fa2 without a cure in every state, a slider for V's mean;
    recorded cure runs stand in for training."""
    from lowprec.viz.control_explorer import cached_cure, cure_named, cure_twin

    fig = cure_twin(v_means=(-1.5, -1.0), cures=("Fix", "consistent"), steps=4)
    check_twin(fig, menu_entries=2, slider_steps=2)
    assert [t.name for t in fig.data if t.showlegend is not False] == ["none (fa2)", "Fix", "consistent"]
    assert all(list(b.args[0]["visible"][:2]) == [True, True] for b in fig.layout.updatemenus[0].buttons)
    cfg = ControlConfig(steps=6)
    recorded = {f"cure/adam/{name}": cached_cure(cfg, cure_named(name), "adam")
                for name in ("none (fa2)", "Fix", "consistent")}
    cached_cure.cache_clear()
    reused = cure_twin(v_means=(-1.5, -1.0), cures=("Fix", "consistent"), steps=4, trained={cfg: recorded})
    assert reused.to_json() == fig.to_json() and cached_cure.cache_info().misses == 3  # those at V -1.0
    with pytest.raises(ValueError, match="cure must be one of"):
        cure_twin(cures=("no such cure",), steps=2)


def test_control_explorer_trains_a_cure_with_its_beta() -> None:
    """The live panel's cure menu: a cure replaces the arm (its own precision and Fix), β sets its Fix's
    factor, and "none" goes back to the arm."""
    from lowprec.viz.control_explorer import control_explorer

    panel = control_explorer(steps=20, cure="consistent")

    def legend() -> list[str]:
        return [t.name for t in panel.figure.data if t.showlegend is not False]

    assert panel.figure.layout.title.text.startswith("cure consistent (precision consistent)")
    assert legend() == ["consistent", "float64 reference"]
    panel.controls["cure"].value = "Fix"
    panel.controls["beta"].value = 7.0
    assert legend() == ["Fix, β = 7", "float64 reference"] and "Fix β = 7" in panel.figure.layout.title.text
    panel.controls["cure"].value = None
    assert legend() == ["no Fix", "float64 reference"] and panel.figure.layout.title.text.startswith("fa2,")
    with pytest.raises(ValueError, match="cure must be one of"):
        control_explorer(cure="no such cure")

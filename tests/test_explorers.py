"""The explorers of chapters 2-4 (lowprec.viz): each static twin builds on a tiny grid with working controls,
and each live panel re-renders its output when a control changes (driven in a real kernel, as JupyterLab
would drive it)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import nbclient
import nbformat
import pytest
from lowprec.instruments.positive_control import ControlConfig, run_control
from lowprec.runs import load_run
from lowprec.viz.control_explorer import cached_arm, control_twin
from lowprec.viz.precision_explorer import Setting, measure, precision_twin
from lowprec.viz.run_browser import run_twin
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
    m = measure(Setting(family="near-k4", v_mean=-1.5), rows=128)
    assert m.result.rows == 128 and len(m.delta_err) == 128
    assert abs(float(m.delta_err.mean()) - m.result.delta.mean) < 1e-12
    assert m.pbar_ones.double().mean() == 4.0  # four near-tied P̄ round to 1 in every row (chapter 2)
    fixed = measure(Setting(family="near-k4", v_mean=-1.5, beta=2.0), rows=128)
    assert fixed.pbar_ones.sum() == 0 and fixed.triggered == 128


def test_precision_twin() -> None:
    fig = precision_twin(families=("unique", "near-k4"), v_means=(-1.5,), betas=(None, 2.0), rows=64, bins=8)
    check_twin(fig, menu_entries=2, slider_steps=2)


def test_run_twin() -> None:
    runs = {path.name: load_run(path) for path in sorted(LEAD.iterdir()) if path.is_dir()}
    fig = run_twin(dict(list(runs.items())[:2]), layer=1)
    check_twin(fig, menu_entries=2, slider_steps=6)
    titles = {a.text for a in fig.layout.annotations}
    assert {"‖W_Q,h‖₂ of each head", "‖W_K,h‖₂ of each head", "attention entropy (mean over rows)"} <= titles
    assert fig.layout.sliders[0].active == 1


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
    fig = control_twin(v_means=(-1.5, -1.0), optimizers=("adam", "sgd"), arms=("lowp", "fix"), steps=4)
    check_twin(fig, menu_entries=2, slider_steps=2)
    # longer runs of a configuration stand in for training at its V mean, and only there: the same figure
    default, edge = ControlConfig(steps=6), ControlConfig(steps=6, v_mean=-1.0)
    longer = run_control(default, ("fa2",), ("lowp", "fix"), ("adam", "sgd"), False)["runs"]
    at_edge = run_control(edge, ("fa2",), ("fix",), ("sgd",), False)["runs"]
    other = {"fa2/adam/fix": longer["fa2/adam/fix"]}  # stored under a config the twin does not show
    cached_arm.cache_clear()
    reused = control_twin(v_means=(-1.5, -1.0), optimizers=("adam", "sgd"), arms=("lowp", "fix"), steps=4,
                          trained={default: {key: run for key, run in longer.items() if "lowp" in key},
                                   edge: at_edge, replace(default, bias_weight=2.0): other})
    assert reused.to_json() == fig.to_json() and cached_arm.cache_info().misses == 5  # 8 runs, 3 reused


# Each live panel, all in one kernel: build it small, remember its text and figure, change one control,
# compare. The panel's figure is a display (updated in place through its display id), so the panel's first
# output must hold the new figure afterwards, as a Jupyter client shows it.
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
    """One panel's four cells: build it, remember its text and figure, change `control`, compare."""
    return [
        build + "\npanel",
        wait_for("panel.text.outputs")
        + "before = str(panel.text.outputs), panel.figure.to_json()\n"
        "assert 'snapshot' in panel.widget.children[0].value and panel.handle is not None",
        f"panel.controls[{control!r}].value = {value}",
        wait_for("str(panel.text.outputs) != before[0]")
        + "after = str(panel.text.outputs), panel.figure.to_json()\n"
        f"assert after[0] != before[0] and {expected!r} in after[0] + after[1], (before[0], after[0])\n"
        f"assert {expected!r} not in before[0] + before[1] and after[1] != before[1]\n"
        "assert 'cannot compute' not in after[0]\nprint(panel.figure.layout.title.text)",
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
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3").execute()
    for i, name in enumerate(LIVE):
        title = notebook.cells[4 * i + 3].outputs[0]["text"].strip()
        shown = [o for o in notebook.cells[4 * i].outputs if o["output_type"] == "display_data"]
        assert len(shown) == 2, f"{name}: the panel's widgets and its figure"
        assert title and title in str(shown[1]["data"]), f"{name}: the figure output was updated in place"

"""Parts shared by the explorers of chapters 2-5: the live panel (controls, a snapshot note, a line of text,
a figure) and its dropdowns, the static twin's controls (a menu that picks a group of traces, a slider that
restyles them), and rounding of the numbers a twin stores in the page.

A static twin holds every case it can show. Its menu toggles which group of traces is visible (one group
per menu entry); its slider replaces the data of every group's traces at once, so whatever the menu shows,
the slider's choice applies to it (the pattern of chapter 1's `static_explorer`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import ipywidgets as widgets
import plotly.graph_objects as go
from IPython.display import display
from traitlets import observe

SNAPSHOT_NOTE = (
    "<b>Live panel</b>: in JupyterLab (<code>make lab</code>, then open this chapter) it recomputes when you "
    "change a control. On the static site it is a <i>snapshot</i> of the state the book was built with; "
    "the figure after it works here."
)
DIGITS = 4  # significant digits of the numbers a twin stores (the page stays small; the plots are unchanged)
# A twin's top margin (px): the title with its padding, a line of subtitle, the menu with a gap either side,
# and the subplot titles above the plots
TITLE_PX, SUBTITLE_LINE_PX, MENU_PX, SUBPLOT_TITLE_PX = 45, 18, 46, 28


def sig(values: Sequence[float] | float, digits: int = DIGITS):
    """`values` (a number or a flat list) rounded to `digits` significant digits; non-finite values become
    None (a gap in a plotly line)."""

    def one(x: float):
        x = float(x)
        if not math.isfinite(x):
            return None
        return 0.0 if x == 0 else float(f"{x:.{digits}g}")

    if isinstance(values, (int, float)):
        return one(values)
    return [one(x) for x in values]


class Dropdown(widgets.Dropdown):
    """ipywidgets' Dropdown, except that an option whose value is None shows its label when chosen (ipywidgets
    takes the value None for "nothing selected" and shows a blank menu)."""

    @observe("value")
    def _propagate_value(self, change: dict) -> None:
        if change["new"] is None and None in self._options_values:
            self.index = self._options_values.index(None)
            return
        super()._propagate_value(change)


def dropdown(description: str, options, value=None, width: str = "190px") -> Dropdown:
    """A labelled dropdown; `options` as ipywidgets takes them (values, or (label, value) pairs; a value may
    be None)."""
    return Dropdown(
        options=options, description=description, style={"description_width": "initial"},
        layout={"width": width}, **({} if value is None else {"value": value}),
    )  # fmt: skip


def show(out: widgets.Output, output: dict) -> None:
    """Make `out` show one output (an nbformat output dict) instead of what it showed. The widget's state
    changes directly (no output is captured), so a change made in a widget callback reaches JupyterLab, and a
    client that executes the notebook (nbclient, for the book) only records the state."""
    out.outputs = (output,)


class LivePanel:
    """A live panel: controls, a line of text and a figure, all ipywidgets (the text and the figure are
    Output widgets), so that a change of a control redraws them in JupyterLab, and the built page holds the
    state the book was built with.

    compute(values) takes {control name: value} and returns (text, figure); it runs now and on every change
    of a control; a ValueError is shown as text and leaves the figure as it was. In a notebook the panel
    displays itself (the last expression of a cell); `widget` is its ipywidgets part, `figure` the figure
    shown, `text` and `plot` the Output widgets that show the text and the figure. `layout` optionally
    groups the controls into rows (control names, one row each, every control once); by default they share
    one wrapping row.
    """

    def __init__(
        self,
        controls: dict[str, widgets.Widget],
        compute: Callable[[dict], tuple[str, go.Figure]],
        note: str = "",
        layout: Sequence[Sequence[str]] = (),
    ) -> None:
        self.controls, self.compute = controls, compute
        self.text, self.plot = widgets.Output(), widgets.Output()
        self.figure: go.Figure | None = None
        rows = [list(names) for names in layout] or [list(controls)]
        if sorted(name for names in rows for name in names) != sorted(controls):
            raise ValueError(f"layout must name every control once ({sorted(controls)}), got {rows}")
        boxes = [widgets.HBox([controls[name] for name in names], layout={"flex_flow": "row wrap"})
                 for names in rows]
        parts = [widgets.HTML(SNAPSHOT_NOTE), *boxes]
        if note:
            parts.append(widgets.HTML(f"<i>{note}</i>"))
        self.widget = widgets.VBox([*parts, self.text, self.plot])
        for control in controls.values():
            control.observe(self.update, names="value")
        self.update()

    def values(self) -> dict:
        return {name: control.value for name, control in self.controls.items()}

    def update(self, _: object = None) -> None:
        start = time.perf_counter()
        try:
            text, figure = self.compute(self.values())
        except ValueError as err:
            text, figure = f"cannot compute this setting: {err}", None
        line = f"{text} (computed in {time.perf_counter() - start:.1f} s)\n"
        show(self.text, {"output_type": "stream", "name": "stdout", "text": line})
        if figure is not None:
            self.figure = figure
            bundle = figure._repr_mimebundle_()
            show(self.plot, {"output_type": "display_data", "data": bundle, "metadata": {}})

    def _ipython_display_(self) -> None:
        display(self.widget)


def add_menu_and_slider(
    fig: go.Figure,
    menu: Sequence[tuple[str, list[bool], dict]],
    slider: Sequence[tuple[str, dict]],
    restyled: list[int],
    slider_prefix: str,
    slider_active: int = 0,
    above: int = SUBPLOT_TITLE_PX,
    bottom: int = 170,
) -> go.Figure:
    """Add the twin's controls to `fig` (whose height, title and subtitle are set) and lay it out: from the
    top, the title and subtitle, the menu on a row of its own (so that it covers neither them nor a legend),
    `above` px for what sits right above the plots (subplot titles, a legend), the plots, and `bottom` px for
    the axis titles, the slider and the legend below (plotly takes more where they need it).

    menu: (label, visible flag of every trace, layout changes) per entry (method "update"); the figure's
    traces must start in the state of the first entry. slider: (label, data) per step, where data maps a trace
    attribute to one value per trace in `restyled` (method "restyle" on those traces only); the traces must
    start in the state of step `slider_active`.
    """
    subtitle = fig.layout.title.subtitle.text
    lines = subtitle.count("<br>") + 1 if subtitle else 0
    top = TITLE_PX + lines * SUBTITLE_LINE_PX + MENU_PX + above
    plots = fig.layout.height - top - bottom  # px; a menu is placed in the plots' coordinates (paper)
    fig.update_layout(
        title={"yref": "container", "y": 1, "yanchor": "top", "pad": {"t": 15}},
        margin={"t": top, "b": bottom},
        updatemenus=[
            {
                "buttons": [
                    {"label": label, "method": "update", "args": [{"visible": visible}, layout]}
                    for label, visible, layout in menu
                ],
                "direction": "down",
                "x": 0,
                "xanchor": "left",
                "y": 1 + above / plots,
                "yanchor": "bottom",
            }
        ],
        sliders=[
            {
                "active": slider_active,
                "currentvalue": {"prefix": slider_prefix},
                "pad": {"t": 40},
                "steps": [
                    {"label": label, "method": "restyle", "args": [data, restyled]} for label, data in slider
                ],
            }
        ],
    )
    return fig

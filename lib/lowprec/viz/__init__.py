"""Figures and explorers for the book. Call `setup()` once at the top of every chapter.

`setup()` registers the "book" renderer: under BOOK_BUILD=1 (set by `make book`) a figure is an HTML div
without its own plotly.js or MathJax (the `_ext/offline_site.py` Sphinx extension serves one shared
plotly.min.js), since the build drops plotly's own mimetype; elsewhere, e.g. in JupyterLab, figures keep that
mimetype. The "book" template is plotly_white with 20 distinct colours and the legend below the x axis title.
"""

from __future__ import annotations

import os

import plotly.graph_objects as go
import plotly.io as pio
from plotly.io.base_renderers import MimetypeRenderer

from lowprec.viz.plots import COLOURWAY, FIELD_COLOURS, bit_fields_figure, new_figure, set_title, table_figure

__all__ = ["COLOURWAY", "FIELD_COLOURS", "LEGEND_BELOW", "bit_fields_figure", "book_build", "book_template",
           "new_figure", "set_title", "setup", "table_figure"]

FIGURE_HEIGHT = 440
LEGEND_BELOW = {"orientation": "h", "yref": "container", "y": 0, "yanchor": "bottom", "x": 0,
                "xanchor": "left"}  # fmt: skip


def book_template() -> go.layout.Template:
    """plotly_white, COLOURWAY, and the legend below the plot (LEGEND_BELOW)."""
    template = go.layout.Template(pio.templates["plotly_white"])
    template.layout.colorway = COLOURWAY
    template.layout.legend = LEGEND_BELOW
    return template


class BookRenderer(MimetypeRenderer):
    """text/html only: a div and a Plotly.newPlot call that expects plotly.js to be on the page already."""

    def to_mimebundle(self, fig_dict: dict) -> dict:
        html = pio.to_html(
            fig_dict,
            include_plotlyjs=False,
            include_mathjax=False,
            full_html=False,
            default_width="100%",
            default_height=FIGURE_HEIGHT,
            validate=False,
            config={"displaylogo": False},
        )
        return {"text/html": html}


def book_build() -> bool:
    """True while `make book` executes the chapters (BOOK_BUILD=1)."""
    return os.environ.get("BOOK_BUILD", "") not in ("", "0")


def setup() -> None:
    """Pick the plotly renderer for where the chapter runs (book build or JupyterLab) and the house style."""
    pio.renderers["book"] = BookRenderer()
    pio.renderers.default = "book" if book_build() else "plotly_mimetype"
    pio.templates["book"] = book_template()
    pio.templates.default = "book"

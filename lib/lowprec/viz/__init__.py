"""Figures and explorers for the book. Call `setup()` once at the top of every chapter.

plotly 7's default renderer under a kernel emits only the plotly mimetype, which the book build (myst-nb)
drops, so the figures would be silently missing. `setup()` registers a "book" renderer that emits an HTML
div without its own plotly.js or MathJax (the `_ext/plotly_offline` Sphinx extension serves plotly.min.js
once, from the plotly package) and selects it when BOOK_BUILD=1 (set by `make book`); elsewhere, e.g. in
JupyterLab, figures keep plotly's native mimetype.
"""

from __future__ import annotations

import os

import plotly.io as pio
from plotly.io.base_renderers import MimetypeRenderer

from lowprec.viz.plots import FIELD_COLOURS, bit_fields_figure, new_figure

__all__ = ["FIELD_COLOURS", "bit_fields_figure", "book_build", "new_figure", "setup"]

FIGURE_HEIGHT = 440


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
    pio.templates.default = "plotly_white"

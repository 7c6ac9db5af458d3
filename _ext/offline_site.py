"""Sphinx extension: make the built book self-contained and free of console errors when opened offline.

* plotly.js: chapter figures are emitted by lowprec.viz's "book" renderer without their own copy of
  plotly.js; pages whose body calls Plotly.newPlot get one shared `_static/plotly.min.js`, copied from the
  installed plotly package (so it always matches the Python side).
* widgets: `widgets_offline.js` (listed in nb_ipywidgets_js, between require.js and the html-manager) points
  the html-manager's fonts at `_static/html-manager/` and lets it typeset labels with MathJax 3.
* Sphinx 7.4 registers the inline config scripts of sphinx-thebe and sphinx-togglebutton twice; the second
  `const THEBE_JS_URL` throws a SyntaxError in the browser, so duplicate inline scripts are dropped.
* the site's root `index.html`, a redirect to the first page, names an empty icon (`data:,`): the one
  sphinx-external-toc writes names none, so a browser asks the host for /favicon.ico (a 404 in its console),
  and a file named there would be fetched while the redirect leaves the page (an aborted request).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import plotly
from sphinx.application import Sphinx

HERE = Path(__file__).parent
PLOTLY_JS = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
STATIC_FILES = [PLOTLY_JS, HERE / "widgets_offline.js"]


def script_key(script) -> str:
    """Inline scripts are the same whatever their (empty) file name, '' or None."""
    body = getattr(script, "attributes", {}).get("body")
    return f"inline: {body}" if body else str(script)


def on_page(app: Sphinx, pagename: str, templatename: str, context: dict, doctree) -> None:
    if "Plotly.newPlot" in context.get("body", ""):
        app.add_js_file(PLOTLY_JS.name, priority=400)
    seen, scripts = set(), []
    for script in context.get("script_files", []):
        if script_key(script) not in seen:
            seen.add(script_key(script))
            scripts.append(script)
    context["script_files"] = scripts


def copy_static(app: Sphinx, exception: Exception | None) -> None:
    if exception is None and app.builder.format == "html":
        static = Path(app.outdir) / "_static"
        static.mkdir(parents=True, exist_ok=True)
        for source in STATIC_FILES:
            shutil.copyfile(source, static / source.name)


def write_root_redirect(app: Sphinx, exception: Exception | None) -> None:
    """The root index.html: a redirect to the root document that needs no icon from the host (before
    sphinx-external-toc's handler, which then leaves the file as it is)."""
    if exception is None and app.builder.format == "html" and app.config.root_doc != "index":
        target = app.builder.get_target_uri(app.config.root_doc)
        (Path(app.outdir) / "index.html").write_text(
            f'<link rel="icon" href="data:," />\n<meta http-equiv="Refresh" content="0; url={target}" />\n',
            encoding="utf8")


def setup(app: Sphinx) -> dict:
    app.connect("html-page-context", on_page, priority=900)  # after every extension has added its scripts
    app.connect("build-finished", copy_static)
    app.connect("build-finished", write_root_redirect, priority=400)  # sphinx-external-toc's runs at 500
    return {"parallel_read_safe": True, "parallel_write_safe": True}

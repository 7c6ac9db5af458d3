"""JupyterLab's contents manager for the chapters (`make lab`): Jupytext's, so that the lab reads the MyST
chapters (book/*.md) as notebooks, with two changes.

* The site's tags show in the lab: a cell tagged hide-input, remove-input or remove-cell opens with its code
  collapsed (cell metadata `jupyter.source_hidden`, which JupyterLab honours), remove-cell and remove-output
  with its outputs collapsed too (`jupyter.outputs_hidden`). The lab's collapse state is never written into a
  chapter.
* Running a chapter changes no file: a save writes a text notebook only when its text would change (a cell's
  source or tags, the notebook's metadata), not when only outputs or execution counts differ. So the lab
  saves (autosave, Makefile) an executed chapter without touching it, and the chapter is no longer marked
  unsaved.
"""

from __future__ import annotations

import os

import jupytext
import nbformat
from jupytext import AsyncTextFileContentsManager

HIDDEN = {  # tag -> the parts of the cell the site does not show
    "hide-input": ("source_hidden",),
    "remove-input": ("source_hidden",),
    "hide-output": ("outputs_hidden",),
    "remove-output": ("outputs_hidden",),
    "hide-cell": ("source_hidden", "outputs_hidden"),
    "remove-cell": ("source_hidden", "outputs_hidden"),
}
COLLAPSE_KEYS = ("source_hidden", "outputs_hidden")


def collapse_as_tagged(notebook: nbformat.NotebookNode) -> None:
    """Set each cell's `jupyter` collapse flags from its tags (HIDDEN)."""
    for cell in notebook.cells:
        flags = {flag for tag in cell.metadata.get("tags", []) for flag in HIDDEN.get(tag, ())}
        if flags:
            cell.metadata.setdefault("jupyter", {}).update(dict.fromkeys(sorted(flags), True))


def without_collapse(notebook: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """A copy of `notebook` without the lab's collapse flags (an emptied `jupyter` metadata goes too)."""
    notebook = nbformat.from_dict(notebook)
    for cell in notebook.cells:
        lab = cell.metadata.get("jupyter", {})
        for key in COLLAPSE_KEYS:
            lab.pop(key, None)
        if "jupyter" in cell.metadata and not lab:
            del cell.metadata["jupyter"]
    return notebook


def is_text_notebook(model: dict, path: str) -> bool:
    return model.get("type") == "notebook" and os.path.splitext(path)[1] != ".ipynb"


class ChapterContentsManager(AsyncTextFileContentsManager):
    """Jupytext's contents manager, with the chapters' tags shown as collapsed cells and saves that leave a
    text notebook alone unless its text changed."""

    async def get(self, path: str, content: bool = True, type: str | None = None, format: str | None = None,
                  **kwargs) -> dict:  # noqa: A002 (the base class's names)
        model = await super().get(path, content=content, type=type, format=format, **kwargs)
        if content and is_text_notebook(model, path):
            collapse_as_tagged(model["content"])
        return model

    async def save(self, model: dict, path: str = "") -> dict:
        if not (is_text_notebook(model, path) and model.get("content") is not None):
            return await super().save(model, path)
        model = {**model, "content": without_collapse(model["content"])}
        if await self.file_exists(path):
            on_disk = (await super().get(path, content=True, type="notebook"))["content"]
            ext = os.path.splitext(path)[1]
            if jupytext.writes(model["content"], ext) == jupytext.writes(without_collapse(on_disk), ext):
                return await super().get(path, content=False)
        return await super().save(model, path)

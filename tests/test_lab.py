"""The chapters in JupyterLab, as a reader opens them: `make lab` (its settings and _ext/lab_contents.py),
driven in headless Chromium. For each chapter with an explorer: the cells the site hides open collapsed; the
cells the explorer needs run; two of its controls change, and each change redraws its figure with other
data; no dropdown is blank; and once run, the chapter is saved (autosave) with its file unchanged, so that it
closes without asking to save. The contents manager alone: what it reads and when it writes.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import jupytext
import nbformat
import pytest
from lab_contents import HIDDEN
from test_book import CHROMIUM, CHROMIUM_ARGS

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
# The test's own JupyterLab user settings: every cell in the page at once (the lab's default attaches cells
# out of view later, while idle), and no news popup over the page; the workspace (open tabs) starts empty.
# Extensions that nothing here uses are off (MathJax, the table of contents, the debugger, ...: a third of the
# browser's work).
USER_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false"},
}
UNUSED = ("mathjax", "toc", "lsp", "debugger", "completer", "documentsearch", "extensionmanager")
PAGE_CONFIG = {"disabledExtensions": {f"@jupyterlab/{name}-extension": True for name in UNUSED}}


@dataclass(frozen=True)
class Explorer:
    needs: tuple[str, ...]  # the cells to run, each by a line of its source, in order (the explorer's last)
    changes: tuple[tuple[str, str, str], ...]  # (control kind, its label, the option or text to enter)


EXPLORERS = {
    "01-rounding.md": Explorer(
        ("viz.setup()", "from lowprec.viz.explore import", "a, b, residual = ", 'rounding_explorer(a, b'),
        (("select", "format", "fp16"), ("text", "residual", "-0.002")),
    ),
    "02-flash-attention.md": Explorer(
        ("viz.setup()", "precision_explorer()"),
        (("select", "placement", "paper"), ("select", "Fix", "β = 2")),
    ),
    "03-explosion.md": Explorer(
        ("viz.setup()", 'RESULTS = Path("../results/explode")', "run_browser(RESULTS"),
        (("select", "head", "2"), ("select", "run", "lead-s1337/fa2-s1337")),
    ),
    "04-mechanism.md": Explorer(
        ("viz.setup()", "control_explorer()"),
        (("select", "placement", "paper"), ("select", "treatment", "Fix")),
    ),
    "05-fix.md": Explorer(
        ("viz.setup()", 'control_explorer(cure="consistent")'),
        (("select", "cure", "Fix"), ("select", "cure", "none: the treatment")),
    ),
}


def cell_index(cells: list, line: str) -> int:
    found = [i for i, cell in enumerate(cells) if cell.cell_type == "code" and line in cell.source]
    assert len(found) == 1, f"{len(found)} code cells contain {line!r}"
    return found[0]


def test_contents_manager_collapses_tagged_cells_and_writes_only_changed_text(tmp_path: Path) -> None:
    from lab_contents import ChapterContentsManager

    chapter = tmp_path / "chapter.md"
    chapter.write_bytes((BOOK / "02-flash-attention.md").read_bytes())
    manager = ChapterContentsManager(root_dir=str(tmp_path))
    model = asyncio.run(manager.get("chapter.md"))
    cells = model["content"].cells
    for cell in cells:
        flags = cell.metadata.get("jupyter", {})
        tags = set(cell.metadata.get("tags", []))
        assert flags.get("source_hidden", False) == bool(tags & {"hide-input", "remove-input", "remove-cell"})
        assert flags.get("outputs_hidden", False) == bool(tags & {"remove-cell"})
    code = next(c for c in cells if c.cell_type == "code" and "jupyter" not in c.metadata)
    code.outputs = [nbformat.v4.new_output("stream", text="ran\n")]
    code.execution_count = 7
    before = chapter.read_bytes(), chapter.stat().st_mtime_ns
    asyncio.run(manager.save(model, "chapter.md"))  # outputs, execution counts and collapse flags: no change
    assert (chapter.read_bytes(), chapter.stat().st_mtime_ns) == before
    code.source += "\nprint('edited')"
    asyncio.run(manager.save(model, "chapter.md"))
    text = chapter.read_text()
    assert "print('edited')" in text and "source_hidden" not in text and "outputs_hidden" not in text


@dataclass
class Lab:
    url: str
    token: str

    def api(self, method: str, path: str) -> object:
        request = urllib.request.Request(f"{self.url}/api/{path}", method=method,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            body = response.read()
        return json.loads(body) if body else None


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """`make lab` on a free port with a token, its own user settings (USER_SETTINGS, PAGE_CONFIG) and
    workspaces."""
    home = tmp_path_factory.mktemp("lab")
    for name, settings in USER_SETTINGS.items():
        (home / "settings" / name).parent.mkdir(parents=True, exist_ok=True)
        (home / "settings" / name).write_text(json.dumps(settings))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = secrets.token_hex(16)
    args = (f"--no-browser --ip=127.0.0.1 --port={port} --ServerApp.port_retries=0 "
            f"--IdentityProvider.token={token}")
    (home / "config" / "labconfig").mkdir(parents=True)
    (home / "config" / "labconfig" / "page_config.json").write_text(json.dumps(PAGE_CONFIG))
    env = {**os.environ, "JUPYTERLAB_SETTINGS_DIR": str(home / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"), "JUPYTER_CONFIG_DIR": str(home / "config")}
    log = (home / "lab.log").open("w")
    server = subprocess.Popen(["make", "lab", f"LAB_ARGS={args}"], cwd=ROOT, env=env, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    running = Lab(f"http://127.0.0.1:{port}", token)
    try:
        for _ in range(240):
            assert server.poll() is None, f"make lab stopped:\n{(home / 'lab.log').read_text()[-5000:]}"
            try:
                running.api("GET", "status")
                break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail(f"JupyterLab did not start in 120 s:\n{(home / 'lab.log').read_text()[-5000:]}")
        yield running
    finally:  # make, its shell and the server (which shuts its kernels down) form one process group
        os.killpg(server.pid, signal.SIGTERM)
        server.wait()
        for _ in range(60):
            try:
                os.killpg(server.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.5)
        else:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: run `make setup` (apt-get install -y chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


FIGURE_DATA = """(cell) => {
  const graphs = cell.querySelectorAll('.js-plotly-plot');
  const gd = graphs[graphs.length - 1];
  return gd && gd.data ? JSON.stringify(gd.data.map(t => [t.x, t.y, t.z, t.visible])) : null;
}"""
BLANK_MENUS = """(cell) => [...cell.querySelectorAll('.widget-dropdown')].filter(d => {
  const s = d.querySelector('select');
  return s.selectedIndex < 0 || !s.options[s.selectedIndex].text;
}).map(d => d.querySelector('label')?.textContent)"""
COLLAPSED = "cells => cells.flatMap((c, i) => c.querySelector('.jp-InputPlaceholder') ? [i] : [])"
RAN = "(cell) => /\\[\\d+\\]/.test(cell.querySelector('.jp-InputPrompt').textContent)"
QUEUED = "(cell) => /\\[(\\*|\\d+)\\]/.test(cell.querySelector('.jp-InputPrompt').textContent)"


class Chapter:
    """One chapter open in the lab: its tab, its cells, its explorer."""

    def __init__(self, page, name: str) -> None:
        self.page, self.name = page, name
        self.path = BOOK / name
        self.text = self.path.read_bytes()
        self.cells = jupytext.read(self.path).cells
        self.explorer = EXPLORERS[name]
        self.needs = [cell_index(self.cells, line) for line in self.explorer.needs]
        self.tab = page.locator(".lm-TabBar-tab", has_text=name)

    def show(self):
        """Bring the chapter's tab to the front; its notebook panel."""
        self.tab.click()
        panel = self.page.locator(f"#{self.tab.get_attribute('data-id')}")
        panel.locator(f".jp-Cell >> nth={len(self.cells) - 1}").wait_for(state="attached", timeout=60_000)
        return panel

    def run(self) -> None:
        """Check which cells open collapsed, then queue the cells the explorer needs (once the lab's kernel
        is idle; each one's prompt shows it queued)."""
        panel = self.show()
        cells = panel.locator(".jp-Notebook .jp-Cell")
        assert cells.count() == len(self.cells), self.name
        tagged = [i for i, c in enumerate(self.cells)
                  if any("source_hidden" in HIDDEN.get(tag, ()) for tag in c.metadata.get("tags", []))]
        assert cells.evaluate_all(COLLAPSED) == tagged, f"{self.name}: the cells the site hides, collapsed"
        from playwright.sync_api import TimeoutError as PlaywrightTimeout

        panel.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").wait_for(timeout=300_000)
        for i in self.needs:
            cell = cells.nth(i)
            for _ in range(3):
                try:
                    cell.locator(".jp-InputPrompt").first.click()
                except PlaywrightTimeout:  # something covers the cell: say what, if the lab shows a dialog
                    dialog = self.page.locator(".jp-Dialog")
                    shown = f" (a dialog covers it: {dialog.first.inner_text()!r})" if dialog.count() else ""
                    pytest.fail(f"{self.name}: cell {i} could not be clicked{shown}")
                self.page.keyboard.press("Control+Enter")
                try:
                    self.page.wait_for_function(QUEUED, arg=cell.element_handle(), timeout=10_000)
                    break
                except PlaywrightTimeout:
                    continue
            else:
                pytest.fail(f"{self.name}: cell {i} could not be queued")

    def explore(self) -> None:
        """Wait for the explorer's cells to run, then change its controls: each change redraws the figure."""
        from playwright.sync_api import TimeoutError as PlaywrightTimeout

        cells = self.show().locator(".jp-Notebook .jp-Cell")
        for i in self.needs:
            cell = cells.nth(i)
            try:
                self.page.wait_for_function(RAN, arg=cell.element_handle(), timeout=300_000)
            except PlaywrightTimeout:
                prompt = cell.locator(".jp-InputPrompt").first.inner_text()
                pytest.fail(f"{self.name}: cell {i} did not run in 300 s (its prompt: {prompt!r})")
            errors = cell.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
            assert not errors.count(), f"{self.name}, cell {i}: {errors.first.inner_text()}"
        cell = cells.nth(self.needs[-1])
        self.page.wait_for_function(f"(cell) => ({FIGURE_DATA})(cell) !== null", arg=cell.element_handle(),
                                    timeout=60_000)
        for kind, label, value in self.explorer.changes:
            before = cell.evaluate(FIGURE_DATA)
            box = cell.locator(".widget-dropdown" if kind == "select" else ".widget-text").filter(
                has=self.page.locator(f"label:text-is('{label}')"))
            if kind == "select":
                box.locator("select").select_option(label=value)
            else:
                box.locator("input").fill(value)
                box.locator("input").press("Enter")
            self.page.wait_for_function(f"([cell, before]) => ({FIGURE_DATA})(cell) !== before",
                                        arg=[cell.element_handle(), before], timeout=120_000)
            blank = cell.evaluate(BLANK_MENUS)
            assert not blank, f"{self.name}, after {label} = {value}: menus {blank} show no label"

    def close(self) -> None:
        """Once saved (autosave) with its file unchanged, the chapter closes without a question."""
        self.page.wait_for_function("(tab) => !tab.classList.contains('jp-mod-dirty')",
                                    arg=self.tab.element_handle(), timeout=60_000)
        assert self.path.read_bytes() == self.text, f"running {self.name} in the lab changed the file"
        self.tab.locator(".lm-TabBar-tabCloseIcon").click()
        self.page.wait_for_function(  # the tab closes, or a dialog asks something
            "(name) => document.querySelector('.jp-Dialog')"
            " || ![...document.querySelectorAll('.lm-TabBar-tab')].some(t => t.textContent === name)",
            arg=self.name, timeout=60_000)
        assert self.page.locator(".jp-Dialog").count() == 0, f"closing {self.name} asks something"


def test_explorers_follow_their_controls_in_jupyterlab(lab: Lab, browser) -> None:
    """Every chapter with an explorer, open side by side in one lab (their kernels start and run at once)."""
    page = browser.new_page(viewport={"width": 1200, "height": 800})
    try:
        names = list(EXPLORERS)
        page.goto(f"{lab.url}/lab/tree/{names[0]}?token={lab.token}")
        page.locator(".lm-TabBar-tab", has_text=names[0]).wait_for(timeout=60_000)
        for name in names[1:]:
            page.locator(".jp-DirListing-item", has_text=name).dblclick()
            page.locator(".lm-TabBar-tab", has_text=name).wait_for(timeout=60_000)
        chapters = [Chapter(page, name) for name in names]
        for chapter in chapters:
            chapter.run()
        for chapter in chapters:
            chapter.explore()
        for chapter in chapters:
            chapter.close()
    finally:
        page.close()

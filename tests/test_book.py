"""The book: every chapter executes, and the built site is self-contained and renders in a browser offline.

The site is built once per session with `make book` when `_build/html` is missing or older than its sources
(chapters, library, recorded results, configuration). That build is where the chapters execute, once each:
jupyter-book fails on a cell error, and one test per chapter says whether that chapter executed and its page
shows no error output. The browser test opens every page in headless Chromium (Debian's /usr/bin/chromium,
driven by playwright) from a local server and fails on console errors, failed requests, figures that did not
draw and widgets that did not render.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http.server
import itertools
import json
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import nbclient
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "_build" / "html"
CHAPTERS = sorted(p for p in (ROOT / "book").glob("*.md") if "kernelspec:" in p.read_text())
SOURCES = ["book", "lib", "results", "_ext", "_vendor", "_config.yml", "_toc.yml"]
CHROMIUM = "/usr/bin/chromium"
# Offline: every request to a host other than the local server (a name or an IP literal) goes to a proxy on
# the discard port, where nothing listens, and fails (net::ERR_PROXY_CONNECTION_FAILED): a visit reports it as
# a failed request. Playwright's request routing did the same at about a quarter more of Chromium's CPU.
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--no-first-run", "--disable-quic",
    "--proxy-server=http://127.0.0.1:9", "--proxy-bypass-list=127.0.0.1",
]  # fmt: skip


def newest_source_time() -> float:
    files = [
        f
        for name in SOURCES
        for f in ([ROOT / name] if (ROOT / name).is_file() else (ROOT / name).rglob("*"))
    ]
    return max(f.stat().st_mtime for f in files if f.is_file() and "__pycache__" not in f.parts)


@dataclass
class Build:
    ok: bool
    log: str  # make book's output; empty when the site was already current


ANSI = re.compile(r"\x1b\[[0-9;]*m")  # terminal colours (a build's log, a notebook's traceback)


@pytest.fixture(scope="session")
def build() -> Build:
    """`make book`, run if the site is missing or older than any of its sources."""
    index = SITE / "index.html"
    if index.exists() and index.stat().st_mtime >= newest_source_time():
        return Build(ok=True, log="")
    started = time.time()
    env = {k: v for k, v in os.environ.items() if k != "LOWPREC_RUN_CACHE"}  # the build's own (Makefile)
    result = subprocess.run(["make", "book"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode == 0:
        # a no-op rebuild leaves old pages in place: they are current as of the start (not of now, so that a
        # source changed during the build is newer, and the next session builds again)
        os.utime(index, (started, started))
    log = ANSI.sub("", f"{result.stdout}\n{result.stderr}")  # without terminal colours
    return Build(ok=result.returncode == 0, log=log)


@pytest.fixture(scope="session")
def site(build: Build) -> Path:
    """The built site."""
    assert build.ok, f"make book failed:\n{build.log[-10000:]}"
    return SITE


# What a failed chapter leaves: myst-nb's warning and the ExecutionError that jupyter-book reports (both name
# the chapter's file), and on a page an error output (myst-nb gives it the CSS classes "output traceback"; a
# cell tagged raises-exception would show one on purpose, and no chapter has such a cell).
EXECUTION_FAILED = re.compile(r"Executing notebook failed|ExecutionError")
ERROR_OUTPUT = re.compile(r"""class=["'][^"']*\boutput traceback\b""")


def failed_chapters(log: str) -> set[str]:
    lines = [line for line in log.splitlines() if EXECUTION_FAILED.search(line)]
    return {p.name for p in CHAPTERS if any(p.name in line for line in lines)}


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_chapter_executes(build: Build, path: Path) -> None:
    """The chapter executed without error in `make book` and its page shows no error output."""
    failed = failed_chapters(build.log)
    assert path.name not in failed, f"{path.name} failed to execute in make book:\n{build.log[-10000:]}"
    if failed:
        pytest.skip(f"not checked: make book stopped at the error in {', '.join(sorted(failed))}")
    assert build.ok, f"make book failed (not in executing a chapter):\n{build.log[-10000:]}"
    page = SITE / path.relative_to(ROOT).with_suffix(".html")
    assert page.exists(), f"{page} was not built"
    errors = ERROR_OUTPUT.findall(page.read_text(errors="replace"))
    assert not errors, f"{page.relative_to(SITE)} shows {len(errors)} error output(s)"


def test_each_chapter_executes_once(build: Build) -> None:
    """A rebuild executes the chapters side by side (_ext/execute_chapters.py) and the site build renders each
    of them from the execution cache instead of executing it again."""
    if not build.log:
        pytest.skip("the site was current: nothing was executed")
    executed = re.findall(r"execute_chapters: (\S+) executed in", build.log)
    failed = re.findall(r"execute_chapters: (\S+) failed", build.log)
    cached = re.findall(r"/book/(\S+): Using cached notebook", build.log)
    assert set(executed) <= set(cached), "every chapter executed beforehand is rendered from the cache"
    if not failed:
        assert "Executing notebook" not in build.log, "the build executed a chapter again"


def test_stale_caches_go_while_a_reader_keeps_runs(tmp_path: Path) -> None:
    """`make clear-stale` (the start of `make book`) drops the caches when the library is newer than the last
    build while another process keeps runs in the run cache (a JupyterLab kernel, a test: `rm -rf` of a folder
    that gains a file fails), and keeps them when the build is current."""
    shutil.copy(ROOT / "Makefile", tmp_path)
    for folder in ("lib", "results"):
        (tmp_path / folder).mkdir()
    (tmp_path / "lib" / "model.py").write_text("")
    out = tmp_path / "_build"
    cache, executed = out / "run-cache", out / ".jupyter_cache"
    last = out / ".doctrees" / "environment.pickle"  # LAST_BUILD
    stop = threading.Event()

    def reader() -> None:  # keeps one run after another, as `runs.load_run` does under $LOWPREC_RUN_CACHE
        for n in itertools.count():
            if stop.is_set():
                return
            with contextlib.suppress(OSError):
                cache.mkdir(parents=True, exist_ok=True)
                (cache / f"{n}.pickle").write_bytes(b"run")

    def clear_stale(built: float) -> None:
        for folder in (executed, last.parent):
            folder.mkdir(parents=True, exist_ok=True)
        last.touch()
        os.utime(last, (built, built))
        result = subprocess.run(["make", "-s", "clear-stale"], cwd=tmp_path, capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0, result.stderr

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for _ in range(10):
            clear_stale(built=0)  # older than lib/model.py
            assert not executed.exists() and not last.exists() and not (out / "run-cache.old").exists()
    finally:
        stop.set()
        thread.join()
    cache.mkdir(exist_ok=True)
    (cache / "kept.pickle").write_bytes(b"run")
    clear_stale(built=time.time() + 60)  # newer than every source: nothing dropped
    assert executed.is_dir() and last.is_file() and (cache / "kept.pickle").is_file()


ON_GPU = torch.cuda.is_available()


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (kernels compiled, not interpreted)")
@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_chapter_executes_on_gpu(path: Path) -> None:
    """The chapter as a practitioner runs it on a GPU machine: TRITON_INTERPRET unset, kernels compiled; with
    LOWPREC_REMEASURE=1 its parameter cell set to `REMEASURE = True` (`remeasure_notebook`); with
    LOWPREC_CHAPTER_TIMES=DIR its wall time and outcome go to DIR/<chapter>.json (`chapter_time`)."""
    notebook, remeasured = remeasure_notebook(path, os.environ.get("LOWPREC_REMEASURE") == "1")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    client = nbclient.NotebookClient(notebook, timeout=1200, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    start, failure = time.perf_counter(), None
    try:
        client.execute(env=env)
    except nbclient.exceptions.CellExecutionError as exc:
        failure = str(exc)[-5000:]
    if os.environ.get("LOWPREC_CHAPTER_TIMES"):
        chapter_time(Path(os.environ["LOWPREC_CHAPTER_TIMES"]), path, remeasured, time.perf_counter() - start,
                     failure)
    if failure:
        pytest.fail(f"{path.name} failed on the GPU:\n{failure}")


PARAMETER = "REMEASURE = False"


def remeasure_notebook(path: Path, remeasure: bool):
    """(the chapter as a notebook, whether its parameter cell now reads `REMEASURE = True`): with `remeasure`,
    the first code cell holding PARAMETER is set to True; a chapter without that parameter is unchanged."""
    import jupytext

    notebook = jupytext.read(path)
    cell = next((c for c in notebook.cells if c.cell_type == "code" and PARAMETER in c.source), None)
    if remeasure and cell is not None:
        cell.source = cell.source.replace(PARAMETER, "REMEASURE = True", 1)
    return notebook, remeasure and cell is not None


def chapter_time(folder: Path, path: Path, remeasured: bool, seconds: float, failure: str | None) -> None:
    """DIR/<chapter>.json: the chapter, whether it re-measured, its wall time, pass or the error's tail, and
    the machine (`runs.provenance`)."""
    from lowprec.runs import provenance, write_json

    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / f"{path.stem}.json", {
        "chapter": path.name, "remeasure": remeasured, "seconds": round(seconds, 1),
        "passed": failure is None, "error": failure and ANSI.sub("", failure)[-1500:],
        "provenance": provenance()})


def test_remeasure_notebook_sets_the_parameter_and_times_are_recorded(tmp_path: Path) -> None:
    """LOWPREC_REMEASURE's switch and LOWPREC_CHAPTER_TIMES's record, as the GPU test uses them (CPU)."""
    chapter = ROOT / "book" / "03-explosion.md"
    notebook, remeasured = remeasure_notebook(chapter, True)
    sources = [c.source for c in notebook.cells if c.cell_type == "code"]
    assert remeasured and any("REMEASURE = True" in s for s in sources)
    assert not any(PARAMETER in s for s in sources)
    assert remeasure_notebook(chapter, False)[1] is False
    assert remeasure_notebook(ROOT / "book" / "01-rounding.md", True)[1] is False, "no parameter: unchanged"
    chapter_time(tmp_path, chapter, remeasured, 12.34, None)
    record = json.loads((tmp_path / "03-explosion.json").read_text())
    assert (record["chapter"], record["remeasure"], record["seconds"], record["passed"]) == (
        "03-explosion.md", True, 12.3, True) and "git_commit" in record["provenance"]
    chapter_time(tmp_path, chapter, remeasured, 1.0, "\x1b[31mMissingData\x1b[39m: no prepared token data")
    record = json.loads((tmp_path / "03-explosion.json").read_text())
    assert (record["passed"], record["error"]) == (False, "MissingData: no prepared token data"), record


def pages(site: Path) -> list[Path]:
    """Every page Sphinx wrote (theme templates copied into _static are not pages)."""
    return sorted(
        p for p in site.rglob("*.html") if p.relative_to(site).parts[0] not in ("_static", "_sources")
    )


class ExternalAssets(HTMLParser):
    """Collects every script, stylesheet, image or frame a page would fetch from another host."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        url = {
            "script": a.get("src"),
            "img": a.get("src"),
            "iframe": a.get("src"),
            "link": a.get("href"),
        }.get(tag)
        fetched = tag != "link" or {"stylesheet", "preload", "modulepreload", "icon"} & set(
            (a.get("rel") or "").split()
        )
        if url and fetched and re.match(r"(https?:)?//", url):
            self.found.append(f"<{tag}> {url}")


def test_root_page_redirects_and_asks_for_no_icon(site: Path) -> None:
    """The root page, a redirect to the first chapter, names an empty icon: with none a browser asks the host
    for /favicon.ico (a 404 in its console), and a file would be fetched as the redirect leaves the page."""
    html = (site / "index.html").read_text()
    target = re.search(r'url=([^"]+)"', html)
    assert '<link rel="icon" href="data:," />' in html and target and (site / target[1]).is_file(), html


def test_site_loads_nothing_from_outside(site: Path) -> None:
    problems = {}
    for page in pages(site):
        parser = ExternalAssets()
        parser.feed(page.read_text(errors="replace"))
        if parser.found:
            problems[str(page.relative_to(site))] = parser.found
    assert not problems, problems
    assert (site / "_static" / "plotly.min.js").exists()


@pytest.fixture(scope="module")
def server(site: Path) -> Iterator[str]:
    handler = functools.partial(QuietHandler, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        pass


PAGE_CHECK = """() => {
  const graphs = [...document.querySelectorAll('.plotly-graph-div')];
  const views = document.querySelectorAll('script[type="application/vnd.jupyter.widget-view+json"]');
  return {
    graphs: graphs.length,
    undrawn: graphs.filter(g => !g.querySelector('.main-svg')).length,
    widget_views: views.length,
    rendered_widgets: [...views].filter(v => v.parentElement.querySelector('.jupyter-widgets')).length,
    raw_math: document.querySelectorAll('.math:not(:has(mjx-container))').length,
  };
}"""


# What makes a figure hard to read: a menu over a legend entry, the title or the subtitle; an annotation not
# drawn inside the figure (e.g. placed at a log axis's value instead of its log10); a table taller than its
# figure (plotly cuts the rows below off); a category axis that labels only some of its categories (at most
# 60: plotly skips labels that would overlap).
LEGIBLE = """() => {
  const box = e => e.getBoundingClientRect();
  const meet = (a, b) => a.width > 0 && b.width > 0 && a.left < b.right && b.left < a.right
    && a.top < b.bottom && b.top < a.bottom;
  const problems = [];
  for (const gd of document.querySelectorAll('.plotly-graph-div')) {
    if (!gd._fullLayout) continue;
    const name = `figure "${(gd.layout.title?.text ?? '').slice(0, 60)}"`, g = box(gd);
    const menus = [...gd.querySelectorAll('.updatemenu-header')].map(box);
    const covered = [...gd.querySelectorAll('.legend .traces, .gtitle, .gtitle-subtitle')]
      .filter(e => menus.some(m => meet(m, box(e))));
    if (covered.length)
      problems.push(`${name}: its menu covers ${covered.map(e => e.textContent).join(', ')}`);
    const texts = gd._fullLayout.annotations.filter(a => a.visible !== false && a.text).length;
    const drawn = [...gd.querySelectorAll('.annotation')].filter(a => {
      const b = box(a);
      return b.width > 0 && b.top >= g.top - 1 && b.bottom <= g.bottom + 1;
    }).length;
    if (drawn < texts) problems.push(`${name}: ${texts - drawn} of ${texts} annotations not drawn in it`);
    const titles = [...gd.querySelectorAll('.gtitle, .gtitle-subtitle, [class$="title"][class^="x"], '
      + '[class$="title"][class^="y"]')].filter(e => e.textContent && box(e).width > 0);
    for (const t of titles) {
      const b = box(t);
      if (b.left < g.left - 1 || b.right > g.right + 1 || b.top < g.top - 1 || b.bottom > g.bottom + 1)
        problems.push(`${name}: its title "${t.textContent.slice(0, 40)}" runs past the figure's edge`);
      const over = titles.filter(u => u !== t && t.compareDocumentPosition(u) & 4 && meet(b, box(u)));
      const text = e => `"${e.textContent.slice(0, 30)}"`;
      if (over.length) problems.push(`${name}: ${text(t)} overlaps ${text(over[0])}`);
    }
    const cells = [...gd.querySelectorAll('.cell-rect')].map(box);
    if (cells.length && Math.max(...cells.map(c => c.bottom)) > g.bottom + 1)
      problems.push(`${name}: rows cut off`);
    for (const [axis, ax] of Object.entries(gd._fullLayout).filter(([key]) => /^[xy]axis\\d*$/.test(key))) {
      const n = (ax._categories ?? []).length, shown = (ax._vals ?? []).length;
      if (ax.type === 'category' && ax.visible && ax.showticklabels && n <= 60 && shown < n)
        problems.push(`${name}: ${axis} labels ${shown} of its ${n} categories`);
    }
  }
  return problems;
}"""


# MathJax is a deferred script: on a heavy page it may not have started when the network goes idle, so wait
# for its startup promise to exist (up to 30 s) before awaiting the typesetting it stands for.
WAIT_FOR_MATHJAX = """async () => {
  if (!document.querySelector('.math')) return true;
  const sleep = () => new Promise(r => setTimeout(r, 100));
  for (let i = 0; i < 300 && !window.MathJax?.startup?.promise; i++) await sleep();
  await window.MathJax?.startup?.promise;
  return true;
}"""


# Outputs reach the DOM some time after the network is idle (the theme moves them into place, the widgets'
# figures are drawn after their views): wait until the number of figures, drawn figures and widget views has
# not changed for a second (at most 30 s).
SETTLE = """async () => {
  const count = () => document.querySelectorAll('.plotly-graph-div, .main-svg, .jupyter-widgets').length;
  const sleep = () => new Promise(r => setTimeout(r, 200));
  let last = -1, stable = 0;
  for (let i = 0; i < 150 && stable < 5; i++) {
    const now = count();
    stable = now === last && document.readyState === 'complete' ? stable + 1 : 0;
    last = now;
    await sleep();
  }
  return last;
}"""


TWINS = """() => [...document.querySelectorAll('.plotly-graph-div')].map((gd, i) => {
  gd.dataset.twin = i;
  return {index: i, title: gd.layout?.title?.text ?? '', menus: (gd.layout?.updatemenus ?? []).length,
          sliders: (gd.layout?.sliders ?? []).length};
}).filter(g => g.menus || g.sliders)"""
TWIN_STATE = """(i) => JSON.stringify(
  document.querySelector(`[data-twin="${i}"]`).data.map(t => [t.visible, t.x, t.y, t.z, t.text]))"""


CHANGED = f"([i, before]) => ({TWIN_STATE})(i) !== before"
PAGES_AT_ONCE = 3  # tabs visiting at once: a visit is partly waiting (network idle, MathJax, settling)


async def click_centre(page, selector: str) -> None:
    await page.locator(selector).scroll_into_view_if_needed()  # a tall figure's slider may sit lower down
    box = await page.locator(selector).bounding_box()
    assert box, f"{selector} is not on screen"
    await page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)


async def changes(page, index: int, before: str) -> bool:
    """Whether the twin's drawn data differs from `before` within 10 s (a busy machine redraws slowly)."""
    from playwright.async_api import TimeoutError as PlaywrightTimeout

    try:
        await page.wait_for_function(CHANGED, arg=[index, before], timeout=10_000)
    except PlaywrightTimeout:
        return False
    return True


async def drive_twin(page, index: int) -> list[str]:
    """Open the twin's menu and pick its last entry, then click its slider's last tick: each must change the
    drawn data. Returns what did not."""
    graph = f'[data-twin="{index}"]'
    problems = []
    await page.locator(graph).scroll_into_view_if_needed()
    before = await page.evaluate(TWIN_STATE, index)
    if await page.locator(f"{graph} .updatemenu-header").count():
        await click_centre(page, f"{graph} .updatemenu-header")
        await page.locator(f"{graph} .updatemenu-dropdown-button >> nth=-1").wait_for()
        await click_centre(page, f"{graph} .updatemenu-dropdown-button >> nth=-1")
        if not await changes(page, index, before):
            problems.append("menu: picking its last entry changed nothing")
        before = await page.evaluate(TWIN_STATE, index)
    if await page.locator(f"{graph} .slider-tick-rect").count():
        await click_centre(page, f"{graph} .slider-tick-rect >> nth=-1")
        if not await changes(page, index, before):
            problems.append("slider: moving it to its last step changed nothing")
    return problems


@dataclass
class Visit:
    problems: list[str]  # console errors, failed or external requests, undrawn output, illegible figures
    twins: dict[str, list[str]]  # each static twin (its figure index and title) -> what did not respond


async def visit_page(page, url: str) -> Visit:
    """Open one page in the tab `page`, check that everything on it rendered, then drive each static twin.
    What the tab reports counts while the visit runs; then the page's storage is cleared and the tab left on
    about:blank, as a new tab would start the next visit (a new tab for each page started a renderer process
    and Chromium's own tab UI again: half the browser's CPU on a light page)."""
    problems: list[str] = []
    listeners = {
        "console": lambda m: m.type == "error" and problems.append(f"console error: {m.text}"),
        "pageerror": lambda e: problems.append(f"page error: {e}"),
        "requestfailed": lambda r: problems.append(f"request failed: {r.url}"),
    }
    for event, listener in listeners.items():
        page.on(event, listener)
    try:
        await page.goto(url, wait_until="networkidle")
        await page.evaluate(WAIT_FOR_MATHJAX)
        await page.evaluate(SETTLE)
        state = await page.evaluate(PAGE_CHECK)
        problems += await page.evaluate(LEGIBLE)
        twins = {f"figure {twin['index']}, {twin['title']}": await drive_twin(page, twin["index"])
                 for twin in await page.evaluate(TWINS)}  # two twins may share a title
    finally:
        for event, listener in listeners.items():
            page.remove_listener(event, listener)
        await page.evaluate("() => { try { localStorage.clear(); sessionStorage.clear(); } catch {} }")
        await page.goto("about:blank")
    if state["undrawn"]:
        problems.append(f"{state['undrawn']} of {state['graphs']} plotly figures did not draw")
    if state["rendered_widgets"] < state["widget_views"]:
        problems.append(f"only {state['rendered_widgets']} of {state['widget_views']} widgets rendered")
    if state["raw_math"]:
        problems.append(f"{state['raw_math']} math elements were not typeset")
    return Visit(problems, twins)


async def visit_all(urls: dict[str, str]) -> dict[str, Visit]:
    """Every page in `urls` (name -> address), one after another in each of PAGES_AT_ONCE tabs of one headless
    Chromium."""
    from playwright.async_api import async_playwright

    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        todo = list(urls.items())
        visits: dict[str, Visit] = {}

        async def tab() -> None:
            page = await browser.new_page(viewport={"width": 1280, "height": 1000})
            try:
                while todo:
                    name, url = todo.pop(0)
                    visits[name] = await visit_page(page, url)
            finally:
                await page.close()

        try:
            await asyncio.gather(*(tab() for _ in range(PAGES_AT_ONCE)))
            return {name: visits[name] for name in urls}
        finally:
            await browser.close()


@pytest.fixture(scope="module")
def visits(site: Path, server: str) -> dict[str, Visit]:
    """Every page of the site, opened once in headless Chromium."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: run `make setup` (apt-get install -y chromium)")
    pytest.importorskip("playwright.async_api")
    urls = {str(p.relative_to(site)): f"{server}/{p.relative_to(site)}" for p in pages(site)}
    return asyncio.run(visit_all(urls))


def test_every_page_renders_offline_in_chromium(visits: dict[str, Visit]) -> None:
    failures = {name: visit.problems for name, visit in visits.items() if visit.problems}
    assert not failures, failures


def test_every_twin_responds_in_chromium(visits: dict[str, Visit]) -> None:
    """Each static twin (a figure with a menu or a slider) changes its drawn data when a reader uses them."""
    twins = sum(len(visit.twins) for visit in visits.values())
    assert twins >= 4, f"only {twins} static twins on the site (chapters 1-4 have one each)"
    failures = {f"{name}: {title!r}": problems for name, visit in visits.items()
                for title, problems in visit.twins.items() if problems}
    assert not failures, failures

"""Execute the book's chapters side by side into the execution cache that `jupyter-book build` reads.

The build (myst-nb, execution mode "cache") executes a chapter only when the cache holds no notebook with the
same code cells and kernelspec, and it executes them one after another. This script runs first (`make book`):
it reads each chapter the way myst-nb reads it, executes the ones the cache lacks in `--jobs` processes at
once (spawned, longest first, the kernel's working directory is book/, as in the build) and stores each
result from this process only (the cache is one SQLite database: one writer). The build then renders from the
cache. A chapter that fails here is not stored: the build executes it again and reports its error as usual.
Each process forks its chapters' kernels from a warm interpreter (_ext/kernel_zygote.py: about 4 s of CPU
less per chapter).

    python _ext/execute_chapters.py --cache _build/.jupyter_cache --jobs 2 book/*.md
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import sys
import time
from pathlib import Path

import kernel_poll  # this folder (the script's own); spawned workers import this module again
import kernel_zygote
import yaml
from jupyter_cache import get_cache
from jupyter_cache.base import CacheBundleIn
from jupyter_cache.executors.utils import single_nb_execution
from myst_nb.core.read import is_myst_markdown_notebook, read_myst_markdown_notebook
from myst_parser.config.main import MdParserConfig
from nbformat import NotebookNode

kernel_poll.apply()

# per cell, the build's own (_config.yml's execute.timeout; the longest cell takes ~40 s on 2 CPU cores)
CONFIG = Path(__file__).resolve().parents[1] / "_config.yml"
TIMEOUT_S = yaml.safe_load(CONFIG.read_text())["execute"]["timeout"]


def read(path: Path) -> NotebookNode:
    """The notebook myst-nb builds from a MyST chapter (its code cells and kernelspec key the cache)."""
    return read_myst_markdown_notebook(path.read_text(), config=MdParserConfig(), add_source_map=True,
                                       path=str(path))


def start_zygote() -> None:
    """In each worker: the warm interpreter its kernels are forked from (it ends with the worker)."""
    kernel_zygote.ZYGOTE_IN_USE = kernel_zygote.Zygote()


def execute(path: Path, attempts: int = 2) -> tuple[Path, NotebookNode, str | None, float]:
    """Execute one chapter in its own kernel: (path, executed notebook, error text or None, seconds). A kernel
    that does not start (nbclient's RuntimeError: e.g. a port another process took between the kernel's
    choice of it and its bind) is started again, `attempts` times in all; then the error text is returned,
    so that the build runs the chapter in its own kernel."""
    for attempt in range(1, attempts + 1):
        notebook = read(path)
        try:
            result = single_nb_execution(notebook, cwd=str(path.parent), timeout=TIMEOUT_S,
                                         allow_errors=False,
                                         kernel_manager_class=kernel_zygote.ZygoteKernelManager)
        except RuntimeError as exc:
            print(f"execute_chapters: {path.name}: the kernel did not start ({exc}), attempt {attempt} of "
                  f"{attempts}", file=sys.stderr)
            continue
        return path, notebook, result.exc_string if result.err else None, result.time
    return path, notebook, f"the kernel did not start in {attempts} attempts", 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("chapters", nargs="+", type=Path, help="MyST notebooks (other files are skipped)")
    parser.add_argument("--cache", type=Path, required=True, help="the build's execution cache folder")
    parser.add_argument("--jobs", type=int, default=2, help="chapters executed at once")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    missing = [str(path) for path in args.chapters if not path.is_file()]
    if missing:
        parser.error(f"chapters: no such file: {', '.join(missing)}")
    cache = get_cache(str(args.cache))
    todo = []
    for path in args.chapters:
        path = path.resolve()
        if not is_myst_markdown_notebook(path.read_text()):
            continue
        notebook = read(path)  # parsed once here; each worker parses its chapter again for its kernel
        if not notebook.cells:
            continue
        try:
            cache.match_cache_notebook(notebook)
        except KeyError:  # not cached yet
            todo.append(path)
    todo.sort(key=lambda p: p.stat().st_size, reverse=True)  # the longest chapters first
    start = time.perf_counter()
    failed = []
    spawn = multiprocessing.get_context("spawn")  # fresh interpreters: a forked one can hang on its kernel
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=spawn,
                                                initializer=start_zygote) as pool:
        for path, notebook, error, seconds in pool.map(execute, todo):
            if error:
                failed.append(path.name)
                tail = "\n".join(error.strip().splitlines()[-8:])
                print(f"execute_chapters: {path.name} failed after {seconds:.0f} s (the build reruns it):\n"
                      f"{tail}", file=sys.stderr)
                continue
            bundle = CacheBundleIn(notebook, str(path), data={"execution_seconds": seconds})
            cache.cache_notebook_bundle(bundle, check_validity=False, overwrite=True)
            print(f"execute_chapters: {path.name} executed in {seconds:.0f} s")
    print(f"execute_chapters: {len(todo) - len(failed)} of {len(todo)} executed into {args.cache} with "
          f"{args.jobs} jobs in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""_ext/execute_chapters.py: a chapter kernel that fails to start is started again, never ends the build; the
kernels forked from the zygote get the run records it read, and read afresh a folder changed since."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_ext"))
import execute_chapters  # noqa: E402
import kernel_zygote  # noqa: E402
import nbclient  # noqa: E402
import nbformat  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHAPTER = ROOT / "book" / "glossary.md"


@pytest.mark.parametrize("failures, error", [(1, None), (2, "the kernel did not start in 2 attempts")])
def test_a_kernel_that_does_not_start_is_started_again(monkeypatch, capsys, failures: int, error) -> None:
    calls = []

    def fake_execution(notebook, **kwargs):
        calls.append(kwargs["cwd"])
        if len(calls) <= failures:
            raise RuntimeError("Kernel didn't respond in 60 seconds")
        return SimpleNamespace(err=None, exc_string=None, time=1.5)

    monkeypatch.setattr(execute_chapters, "single_nb_execution", fake_execution)
    path, notebook, got, seconds = execute_chapters.execute(CHAPTER)
    assert (path, got) == (CHAPTER, error) and notebook.cells
    assert len(calls) == min(failures + 1, 2) and seconds == (1.5 if error is None else 0.0)
    said = capsys.readouterr().err
    assert "glossary.md: the kernel did not start (Kernel didn't respond in 60 seconds), attempt 1 of 2" \
        in said


def test_a_missing_chapter_is_named_in_one_line(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        execute_chapters.main([str(tmp_path / "04-low-rank.md"), "--cache", str(tmp_path / "cache")])
    assert stop.value.code == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert said[-1].endswith(f"chapters: no such file: {tmp_path / '04-low-rank.md'}")


# in a forked kernel: each folder's final loss, whether load_run found the folder already read (in the
# zygote: the cache's hits), and whether the zygote's objects are frozen out of the collector's passes
READ_BOTH = """
import gc, json
from lowprec import runs
hits = runs._read_folder.cache_info().hits
losses = [runs.load_run(name).summary["final_loss"] for name in ("kept", "changed")]
print(json.dumps([losses, runs._read_folder.cache_info().hits - hits, gc.get_freeze_count() > 0]))
"""


def test_forked_kernels_get_the_zygotes_records_and_read_a_changed_one_afresh(tmp_path, monkeypatch) -> None:
    survival = ROOT / "results" / "explode" / "survival"
    for name, run in (("kept", "fa2-s1"), ("changed", "fa2-s2")):
        shutil.copytree(survival / run, tmp_path / name)
    zygote = kernel_zygote.Zygote(preload=("ipykernel.kernelapp", "lowprec.runs"), records=str(tmp_path))
    monkeypatch.setattr(kernel_zygote, "ZYGOTE_IN_USE", zygote)
    try:
        zygote.wait_ready()  # both folders read: only now is one changed
        shutil.rmtree(tmp_path / "changed")
        shutil.copytree(survival / "fa2-s3", tmp_path / "changed")
        notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(READ_BOTH)])
        nbclient.NotebookClient(notebook, timeout=120, kernel_name="python3", resources={
            "metadata": {"path": str(tmp_path)}}, kernel_manager_class=kernel_zygote.ZygoteKernelManager
        ).execute()
    finally:
        zygote.close()
    assert kernel_zygote.ZYGOTE_IN_USE is zygote, "the kernel was forked, not launched from scratch"
    losses, hits, frozen = json.loads(notebook.cells[0].outputs[0]["text"])
    final = [json.loads((survival / run / "summary.json").read_text())["final_loss"]
             for run in ("fa2-s1", "fa2-s3")]
    assert losses == final and hits == 1 and frozen

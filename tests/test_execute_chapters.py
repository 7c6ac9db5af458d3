"""_ext/execute_chapters.py: a chapter kernel that fails to start is started again, never ends the build."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_ext"))
import execute_chapters  # noqa: E402

CHAPTER = Path(__file__).resolve().parents[1] / "book" / "glossary.md"


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

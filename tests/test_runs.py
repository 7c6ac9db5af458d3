"""Run records: round trip, incremental writing, resume truncation, validation errors, no torch import."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from lowprec.runs import RunRecordError, RunWriter, list_runs, load_run, provenance, round_floats

CONFIG = {"name": "t", "lr": 1e-3, "model": {"n_layer": 2}}


def record(step: int, **extra) -> dict:
    return {"step": step, "tokens": 512 * (step + 1), "loss": 5.0 / (step + 1) + 1e-9, "lr": 1e-3 / 3,
            "grad_norm": 0.123456789, "time_s": 0.5 * step, "tokens_per_s": 1024.0, **extra}


def write_run(path, steps=(0, 5, 10), status="finished") -> RunWriter:
    w = RunWriter(path, CONFIG, command=["lowprec", "train"])
    for s in steps:
        w.log(record(s, telemetry={"wq_norm": [[1.0, 2.0], [3.0, float(s)]]}) if s % 10 == 0 else record(s))
    w.event("checkpoint", 10, path="x/ckpt.pt")
    w.update_summary(status=status, steps=11)
    w.close()
    return w


def test_round_trip(tmp_path):
    write_run(tmp_path / "a")
    run = load_run(tmp_path / "a")
    assert run.config == CONFIG and run.provenance["command"] == ["lowprec", "train"]
    keys = {"git_commit", "git_dirty", "torch", "triton", "cuda", "device", "time", "python"}
    assert keys <= set(run.provenance)
    steps, losses = run.series("loss")
    assert steps == [0, 5, 10] and losses == [5.0, round_floats(5.0 / 6), round_floats(5.0 / 11)]
    assert run.metrics[0]["grad_norm"] == 0.12346 and run.metrics[0]["lr"] == 0.00033333
    assert run.telemetry("wq_norm") == ([0, 10], [[[1.0, 2.0], [3.0, 0.0]], [[1.0, 2.0], [3.0, 10.0]]])
    assert run.events_of("checkpoint")[0]["path"] == "x/ckpt.pt"
    assert run.summary == {"status": "finished", "steps": 11}
    rounded = round_floats({"a": [math.nan, math.inf, 0.0, 123456789.0]})["a"]
    assert math.isnan(rounded[0]) and rounded[1:] == [math.inf, 0.0, 123460000.0]


def test_written_incrementally_and_resume_truncates(tmp_path):
    w = RunWriter(tmp_path, CONFIG)
    w.log(record(0))
    assert load_run(tmp_path).summary["status"] == "running"   # readable while running
    assert len(load_run(tmp_path).metrics) == 1                 # flushed line by line
    w.log(record(5))
    w.close()
    with pytest.raises(ValueError, match="already holds a run"):
        RunWriter(tmp_path, CONFIG)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "tok')  # a crash mid-line
    w = RunWriter(tmp_path, {**CONFIG, "lr": 2e-3}, resume=True)
    w.truncate_after(3)
    w.log(record(4))
    w.close()
    run = load_run(tmp_path)
    assert [m["step"] for m in run.metrics] == [0, 4] and run.config["lr"] == 2e-3
    with pytest.raises(ValueError, match="status must be one of"):
        w.update_summary(status="exploded")


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "metrics.jsonl").write_text((d / "metrics.jsonl").read_text()[:-40]),
     r"metrics.jsonl:3: truncated"),
    (lambda d: (d / "metrics.jsonl").write_text('{"step": 0}\n'),
     r"metrics.jsonl:1: missing keys \['tokens'"),
    (lambda d: (d / "events.jsonl").write_text('{"event": "x", "step": 1}\nnot json\n{}\n'),
     r"events.jsonl:2: corrupt"),
    (lambda d: (d / "summary.json").write_text('{"status": "done"}'), r"summary.json: status must be one of"),
    (lambda d: (d / "summary.json").unlink(), r"summary.json is missing"),
    (lambda d: (d / "config.json").write_text('{"config": {}'), r"config.json: corrupt JSON at line 1"),
    (lambda d: (d / "metrics.jsonl").write_text(json.dumps(record(5)) + "\n" + json.dumps(record(5)) + "\n"),
     r"record 2 has step 5 after step 5"),
])
def test_corrupt_records_name_file_and_line(tmp_path, damage, message):
    write_run(tmp_path)
    damage(tmp_path)
    with pytest.raises(RunRecordError, match=message):
        load_run(tmp_path)


def test_list_runs_and_errors(tmp_path):
    write_run(tmp_path / "exp" / "b", status="diverged")
    write_run(tmp_path / "exp" / "a")
    (tmp_path / "exp" / "not-a-run").mkdir()
    runs = list_runs(tmp_path)
    assert [r["path"] for r in runs] == [str(tmp_path / "exp" / "a"), str(tmp_path / "exp" / "b")]
    assert [r["status"] for r in runs] == ["finished", "diverged"]
    with pytest.raises(ValueError, match="is not a folder"):
        list_runs(tmp_path / "nope")
    with pytest.raises(RunRecordError, match="does not exist"):
        load_run(tmp_path / "nope")
    with pytest.raises(ValueError, match="needs"):
        RunWriter(tmp_path / "c", CONFIG).log({"step": 1})


def test_runs_does_not_import_torch_and_provenance_is_simple():
    code = "import sys, lowprec.runs as r; r.provenance(); assert 'torch' not in sys.modules, 'imports torch'"
    subprocess.run([sys.executable, "-c", code], check=True)
    prov = provenance(["x", "--y"])
    assert prov["command"] == ["x", "--y"] and isinstance(prov["git_dirty"], (bool, type(None)))
    assert json.dumps(prov)


def test_launcher_commit_wins_over_the_copy_s_git(monkeypatch):
    """On the GPU machine the tree's copy may carry stale git metadata: the launcher's commit is recorded."""
    monkeypatch.setenv("LOWPREC_GIT_COMMIT", "0123abcd" * 5)
    monkeypatch.delenv("LOWPREC_GIT_DIRTY", raising=False)
    prov = provenance(["x"])
    assert prov["git_commit"] == "0123abcd" * 5 and prov["git_dirty"] is False
    monkeypatch.setenv("LOWPREC_GIT_DIRTY", "1")
    assert provenance(["x"])["git_dirty"] is True

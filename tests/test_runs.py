"""Run records: round trip, incremental writing, resume truncation, validation errors, no torch import."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from lowprec.runs import (
    RUN_CACHE,
    RunLockedError,
    RunRecordError,
    RunWriter,
    code_matches,
    library_files,
    library_files_at,
    library_sha256,
    list_runs,
    load_run,
    provenance,
    round_floats,
    run_state,
)

RESULTS = Path(__file__).resolve().parents[1] / "results"
CONFIG = {"name": "t", "lr": 1e-3, "model": {"n_layer": 2}}


def record(step: int, **extra) -> dict:
    return {"step": step, "tokens": 512 * (step + 1), "loss": 5.0 / (step + 1) + 1e-9, "lr": 1e-3 / 3,
            "grad_norm": 0.123456789, "time_s": 0.5 * step, "tokens_per_s": 1024.0, **extra}


def unsealed(summary: dict) -> dict:
    """A closed record's summary without its seal (a sha256, checked by load_run)."""
    assert len(summary["record_sha256"]) == 64
    return {k: v for k, v in summary.items() if k != "record_sha256"}


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
    assert unsealed(run.summary) == {"status": "finished", "steps": 11}
    rounded = round_floats({"a": [math.nan, math.inf, 0.0, 123456789.0]})["a"]
    assert math.isnan(rounded[0]) and rounded[1:] == [math.inf, 0.0, 123460000.0]


def test_a_compressed_record_reads_the_same_and_is_not_written_to(tmp_path):
    """A finished record with metrics.jsonl gzipped (as results/ stores them) loads as before and is listed;
    no writer opens it, fresh or resumed."""
    import gzip

    write_run(tmp_path / "a")
    plain = load_run(tmp_path / "a")
    metrics = tmp_path / "a" / "metrics.jsonl"
    metrics.with_name("metrics.jsonl.gz").write_bytes(gzip.compress(metrics.read_bytes(), mtime=0))
    metrics.unlink()
    packed = load_run(tmp_path / "a")
    assert packed.metrics == plain.metrics and packed.summary == plain.summary
    assert [r["path"] for r in list_runs(tmp_path)] == [str(tmp_path / "a")]
    for resume in (False, True):
        with pytest.raises(RunRecordError, match="compressed"):
            RunWriter(tmp_path / "a", CONFIG, resume=resume)
    assert not metrics.exists()


def test_an_unchanged_run_is_read_once_per_process(tmp_path):
    """load_run gives the same Run while the folder's files are unchanged, and reads again after an append
    (a running run) or a rewrite (its summary updated)."""
    w = RunWriter(tmp_path, CONFIG)
    w.log(record(0))
    first = load_run(tmp_path)
    assert load_run(tmp_path) is first
    w.log(record(5))
    appended = load_run(tmp_path)
    assert appended is not first and [m["step"] for m in appended.metrics] == [0, 5]
    w.update_summary(status="finished", steps=6)
    w.close()
    assert load_run(tmp_path).summary["status"] == "finished" and load_run(tmp_path) is load_run(tmp_path)


def test_every_committed_record_fits_the_processs_cache(monkeypatch):
    """A process that reads every committed record twice (test_bottom_line builds the bottom line several
    times) gets the same Runs the second time, none parsed again (a cache smaller than their number misses on
    every pass, as a scan evicts each run just before it is read again)."""
    monkeypatch.delenv("LOWPREC_RUN_CACHE", raising=False)
    folders = [Path(r["path"]) for r in list_runs(RESULTS)]
    assert len(folders) > 128  # more than the cache once held
    first = [load_run(folder) for folder in folders]
    assert all(load_run(folder) is run for folder, run in zip(folders, first, strict=True))


def test_a_folder_read_through_a_link_shares_its_rows(tmp_path, monkeypatch):
    """The same folder by another path (a link, as the tests' copies of results/ make) gives a Run with that
    path and the rows already read, not another copy of them."""
    monkeypatch.delenv("LOWPREC_RUN_CACHE", raising=False)
    write_run(tmp_path / "r")
    (tmp_path / "link").symlink_to(tmp_path / "r")
    direct, linked = load_run(tmp_path / "r"), load_run(tmp_path / "link")
    assert (direct.path, linked.path) == (tmp_path / "r", tmp_path / "link")
    assert linked.metrics is direct.metrics and linked.events is direct.events
    assert load_run(tmp_path / "link") is linked


def test_a_run_kept_by_one_process_is_read_by_the_next(tmp_path, monkeypatch):
    """With $LOWPREC_RUN_CACHE set, a parsed run is kept there and read back by a later process (here: after
    the in-process cache is cleared); a changed record is parsed again, and a damaged kept file is ignored."""
    from lowprec import runs

    def forget() -> None:
        runs._read_run.cache_clear()
        runs._read_folder.cache_clear()

    monkeypatch.setenv(runs.RUN_CACHE, str(tmp_path / "kept"))
    write_run(tmp_path / "r")
    forget()
    first = load_run(tmp_path / "r")
    (kept,) = (tmp_path / "kept").glob("*.pickle")
    forget()
    monkeypatch.setattr(runs, "_parse_run", lambda path: pytest.fail("parsed again"))
    assert load_run(tmp_path / "r") == first
    (tmp_path / "link").symlink_to(tmp_path / "r")  # the same folder by another path: the Run has that path
    assert load_run(tmp_path / "link").path == tmp_path / "link"
    forget()
    assert load_run(tmp_path / "r").path == tmp_path / "r"
    monkeypatch.undo()
    monkeypatch.setenv(runs.RUN_CACHE, str(tmp_path / "kept"))
    kept.write_bytes(b"not a pickle")
    forget()
    assert load_run(tmp_path / "r") == first
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    (tmp_path / "r" / "summary.json").write_text(json.dumps({**summary, "status": "failed"}))
    with pytest.raises(RunRecordError, match="record_sha256"):  # checked, not taken as kept
        load_run(tmp_path / "r")


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


def test_code_matches_says_whether_a_record_ran_the_library_its_commit_holds(tmp_path):
    """A record names its commit and holds its library's digest: the two agree, disagree (the tree sent was
    not that commit's), or cannot be compared (no digest, uncommitted changes, a commit git lacks)."""
    repo = tmp_path / "repo"
    (repo / "lib" / "lowprec" / "attention").mkdir(parents=True)
    (repo / "lib" / "lowprec" / "model.py").write_text("x = 1\n")
    (repo / "lib" / "lowprec" / "attention" / "kernel.py").write_text("y = 2\n")
    (repo / "lib" / "lowprec" / "README.md").write_text("not code\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "one"]):
        subprocess.run([*git, *args], check=True, capture_output=True)
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    package = repo / "lib" / "lowprec"
    files = library_files(package)
    assert sorted(files) == ["attention/kernel.py", "model.py"] and files == library_files_at(commit, repo)
    prov = {"git_commit": commit, "git_dirty": False, "library_sha256": library_sha256(files)}
    assert code_matches(prov, repo) is True
    (repo / "lib" / "lowprec" / "model.py").write_text("x = 3\n")  # the tree sent, not the commit named
    assert code_matches({**prov, "library_sha256": library_sha256(library_files(package))}, repo) is False
    assert library_sha256({"a.py": b"b.py"}) != library_sha256({"a.pyb.py": b""}), "paths and bytes apart"
    for unknown in ({**prov, "library_sha256": None}, {**prov, "git_dirty": True},
                    {**prov, "git_commit": "f" * 40}):
        assert code_matches(unknown, repo) is None
    assert provenance(["x"])["library_sha256"] == library_sha256(library_files()), "each record holds its own"


HOLD = """
import sys
from lowprec.runs import RunWriter
writer = RunWriter(sys.argv[1], {})
print("holding", flush=True)
sys.stdin.read()  # until the test closes stdin (or kills this process)
"""


def test_one_writer_at_a_time_and_a_dead_one_reads_killed(tmp_path):
    """The folder's lock is held by a live writer only: a second one is refused naming the first; a writer
    killed mid-run leaves a "running" record that run_state calls "killed" and that can be resumed."""
    w = RunWriter(tmp_path, CONFIG)
    with pytest.raises(RunLockedError, match=f"being written by process {os.getpid()}"):
        RunWriter(tmp_path, CONFIG, resume=True)
    assert run_state(tmp_path) == "running"
    w.close()
    assert run_state(tmp_path) == "killed"  # closed without a final status: as good as killed

    other = tmp_path / "other"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(other)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "holding\n"
    with pytest.raises(RunLockedError, match=f"process {proc.pid}"):
        RunWriter(other, CONFIG, resume=True)
    assert run_state(other) == "running"
    proc.kill()
    proc.wait()
    assert run_state(other) == "killed"
    RunWriter(other, CONFIG, resume=True).close()  # the OS released the dead writer's lock


def test_failed_runs_are_recorded_and_an_empty_one_can_be_started_again(tmp_path):
    w = RunWriter(tmp_path / "a", CONFIG)
    w.event("failed", 0, reason="RuntimeError: boom")
    w.update_summary(status="failed", reason="RuntimeError: boom")
    w.close()
    run = load_run(tmp_path / "a")
    assert unsealed(run.summary) == {"status": "failed", "reason": "RuntimeError: boom"}
    assert run_state(run.path) == "failed"
    RunWriter(tmp_path / "a", {**CONFIG, "lr": 1.0}).close()  # nothing logged: a fresh start may take it
    assert load_run(tmp_path / "a").config["lr"] == 1.0

    write_run(tmp_path / "b", status="failed")
    with pytest.raises(ValueError, match=r"already holds a run \(status failed\)"):
        RunWriter(tmp_path / "b", CONFIG)


def test_resume_repairs_a_torn_event_line_and_refuses_a_broken_history(tmp_path):
    write_run(tmp_path / "a")
    events = load_run(tmp_path / "a").events
    with open(tmp_path / "a" / "events.jsonl", "a") as f:
        f.write('{"event": "checkpoint", "st')  # a crash mid-line
    w = RunWriter(tmp_path / "a", CONFIG, resume=True)
    w.event("resumed", 11)
    w.close()
    assert load_run(tmp_path / "a").events[:-1] == events

    write_run(tmp_path / "b")
    (tmp_path / "b" / "metrics.jsonl").write_text(json.dumps(record(0)) + "\ngarbage\n")
    before = {p.name: p.read_bytes() for p in (tmp_path / "b").iterdir()}
    with pytest.raises(RunRecordError, match=r"metrics.jsonl:2: corrupt"):
        RunWriter(tmp_path / "b", CONFIG, resume=True)
    assert {p.name: p.read_bytes() for p in (tmp_path / "b").iterdir()} == before  # refused before any write
    (tmp_path / "b" / "metrics.jsonl").unlink()
    with pytest.raises(RunRecordError, match=r"metrics.jsonl is missing \(resuming would lose the run's"):
        RunWriter(tmp_path / "b", CONFIG, resume=True)  # not RunLockedError: the refusal released the lock


def test_the_tests_keep_runs_in_a_cache_of_their_own(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Under `make test` (which exports the book's $LOWPREC_RUN_CACHE) the runs the tests parse are kept in
    the test session's folder (tests/conftest.py), where they go with it."""
    kept = Path(os.environ[RUN_CACHE])
    assert kept.is_relative_to(tmp_path_factory.getbasetemp())

"""The CLI and the records under faults: a second writer (a lock file deleted too), files replaced under a
writer, torn, lost, repeated and changed record lines, corrupt, foreign and missing checkpoints, a full disk,
a resume that would change the run, a killed harness, a killed data prepare, numbers and specs that make no
sense, and entry points given what they cannot take; last, random kills and random damage over many trials.
Every refusal keeps the error contract: one line `lowprec <command>: <message>` and exit status 2, never a
traceback; every resume that goes on ends bit-identical to the run that was never interrupted.

Each command runs as `python -m lowprec.cli` would, in a process of its own: `python -m lowprec.cli` for the
base run and the harnesses, the others (and the full-disk and data-prepare tests' scripts) forked from one
warm interpreter that has imported the command modules (`WARM`), which saves torch's 3 s import per command.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from lowprec.runs import LOCK, RunRecordError, RunWriter, load_run, run_state

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "lib"), "TRITON_INTERPRET": "1"}
RECORD = ("config.json", "metrics.jsonl", "events.jsonl", "summary.json")
# 4 steps, checkpoints at steps 2 and 4 (kept as ckpt-000002.pt and ckpt-000004.pt); about a second
SMOKE = [arg for s in ("max_iters=4", "log_interval=2", "ckpt_interval=2", "ckpt_keep=true",
                       "eval_interval=0", "telemetry_interval=0") for arg in ("--set", s)]

# One command per line on stdin ({"args", "code", "cwd", "env", "fsize", "pipe", "kill_after", "kill_from",
# "stdout", "stderr"}); each runs in a fork, as `python -m lowprec.cli ARGS` runs (`sys.exit(cli.main())`, an
# uncaught exception printed with its traceback and exit status 1), or, given `code`, as `python -c CODE ARGS`
# runs; its exit status goes back on stdout (-9: SIGKILL). `fsize` caps the size of any file it writes;
# `pipe`: its stdout and stderr go to a pipe that the warm interpreter copies into their files (a file size
# limit does not reach a pipe); `kill_after` (seconds, null: never) kills it with SIGKILL if it still runs
# then, counted from its start or from when the file `kill_from` appears.
WARM = """
import fcntl, importlib, json, os, resource, signal, sys, time, traceback
import torch._inductor.config  # what a trainer imports first (1.5 s)
from lowprec import cli
for entry in cli.COMMANDS.values():  # every command's module, imported once before the forks
    for module, _ in [entry] if isinstance(entry, tuple) else entry.values():
        importlib.import_module(module)
for line in sys.stdin:
    job = json.loads(line)
    pipes = {fd: os.pipe() for fd in (1, 2)} if job["pipe"] else {}
    pid = os.fork()
    if pid == 0:
        os.chdir(job["cwd"])
        os.environ.update(job["env"])
        for fd, name in ((1, "stdout"), (2, "stderr")):
            os.dup2(pipes[fd][1] if pipes else os.open(job[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        if job["fsize"]:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (job["fsize"], job["fsize"]))
        sys.argv = ["-c" if job["code"] else "lowprec", *job["args"]]
        try:
            if job["code"]:
                exec(compile(job["code"], "<string>", "exec"), {"__name__": "__main__"})
                code = 0
            else:
                code = cli.main(job["args"])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    copies = {}
    for fd, (read, write) in pipes.items():
        os.close(write)
        fcntl.fcntl(read, fcntl.F_SETFL, os.O_NONBLOCK)
        copies[read] = open(job["stdout" if fd == 1 else "stderr"], "wb")

    def drain():
        for read, copy in copies.items():
            try:
                while chunk := os.read(read, 65536):
                    copy.write(chunk)
            except BlockingIOError:
                pass

    since = None if job["kill_from"] else time.monotonic()
    while not (ended := os.waitpid(pid, os.WNOHANG))[0]:
        drain()
        if since is None and os.path.exists(job["kill_from"]):
            since = time.monotonic()
        if None not in (since, job["kill_after"]) and time.monotonic() - since > job["kill_after"]:
            os.kill(pid, signal.SIGKILL)
            ended = os.waitpid(pid, 0)
            break
        time.sleep(0.001)
    drain()
    for read, copy in copies.items():
        os.close(read)
        copy.close()
    print(os.waitstatus_to_exitcode(ended[1]), flush=True)
"""


@dataclass
class Result:
    code: int
    out: str
    err: str

    def one_line_error(self, command: str, *words: str) -> str:
        """The error line of a failed command, checked: exit status 2, one line, naming each of `words`."""
        lines = self.err.strip().splitlines()
        assert self.code == 2 and len(lines) == 1, (self.code, self.err)
        assert lines[0].startswith(f"lowprec {command}: "), lines[0]
        assert all(w in lines[0] for w in words), (words, lines[0])
        return lines[0]


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    proc = subprocess.Popen([sys.executable, "-c", WARM], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=ENV, cwd=ROOT)
    count = 0

    def lowprec(*args: str, code: str = "", cwd: Path = ROOT, env: dict | None = None, fsize: int = 0,
                pipe: bool = False, kill_after: float | None = None, kill_from: Path | None = None) -> Result:
        nonlocal count
        count += 1
        out, err = logs / f"{count}.out", logs / f"{count}.err"
        job = {"args": [str(a) for a in args], "code": code, "cwd": str(cwd), "env": env or {},
               "fsize": fsize, "pipe": pipe, "kill_after": kill_after, "kill_from": str(kill_from or ""),
               "stdout": str(out), "stderr": str(err)}
        out.touch()  # there even for a command killed before it opened them
        err.touch()
        proc.stdin.write(json.dumps(job) + "\n")
        proc.stdin.flush()
        return Result(int(proc.stdout.readline()), out.read_text(), err.read_text())

    yield lowprec
    proc.stdin.close()
    proc.wait(timeout=60)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A finished 4-step smoke-cpu run, made by `python -m lowprec.cli train` (tests work on copies)."""
    out = tmp_path_factory.mktemp("base") / "run"
    command = [sys.executable, "-m", "lowprec.cli", "train", "--config", "smoke-cpu", "--out", out, *SMOKE]
    subprocess.run(command, env=ENV, cwd=ROOT, check=True, capture_output=True)
    return out


def copy_of(base: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(base, tmp_path / "run"))


def record_bytes(run: Path) -> dict[str, bytes]:
    return {name: (run / name).read_bytes() for name in RECORD}


def losses(run: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in load_run(run).metrics}


def test_a_second_writer_is_refused_naming_the_live_process(warm, base, tmp_path):
    run = copy_of(base, tmp_path)
    writer = RunWriter(run, load_run(run).config, resume=True)  # this process writes the run
    try:
        before = record_bytes(run)
        result = warm("train", "--out", run, "--resume", "--set", "max_iters=6")
        result.one_line_error("train", f"process {os.getpid()}", str(run))
        result = warm("train", "--config", "smoke-cpu", "--out", run, *SMOKE)
        result.one_line_error("train", f"process {os.getpid()}")
        assert record_bytes(run) == before
    finally:
        writer.close()


def test_a_config_that_cannot_run_is_refused_before_the_folder_exists(warm, tmp_path):
    """A block_size beyond the validation split is refused before --out holds a record (not at step 0, leaving
    a "running" one)."""
    run = tmp_path / "run"
    args = ["train", "--config", "smoke-cpu", "--out", run, "--set", "block_size=50000", "--set", "n_embd=8",
            "--set", "n_head=1", "--set", "telemetry_interval=0"]
    warm(*args).one_line_error("train", "block_size", "50000", "val")
    assert not run.exists()


def test_resume_repairs_a_torn_event_line(warm, base, tmp_path):
    run = copy_of(base, tmp_path)
    with open(run / "events.jsonl", "a") as handle:
        handle.write('{"event": "checkpoint", "st')  # killed mid-line
    assert warm("train", "--out", run, "--resume", "--set", "max_iters=6").code == 0
    resumed = load_run(run)
    assert resumed.summary["status"] == "finished" and resumed.summary["steps"] == 6
    assert [e["event"] for e in resumed.events][-2:] == ["checkpoint", "finished"]


def test_a_corrupt_checkpoint_falls_back_to_the_newest_intact_kept_one(warm, base, tmp_path):
    run = copy_of(base, tmp_path)
    ckpt = run / "checkpoint"
    for name in ("ckpt.pt", "ckpt-000004.pt"):  # one flipped byte each (ckpt.pt is a link to the kept copy)
        data = bytearray((ckpt / name).read_bytes())
        data[len(data) // 2] ^= 1
        (ckpt / name).write_bytes(data)
    result = warm("train", "--out", run, "--resume", "--set", "max_iters=6")
    assert result.code == 0, result.err
    assert "ckpt.pt" in result.err and "ckpt-000002.pt" in result.err
    resumed = losses(run)
    assert sorted(resumed) == [0, 2, 4, 5] and resumed[2] == losses(base)[2]  # bit for bit from step 2
    assert load_run(run).events_of("resumed")[0]["step"] == 2


def test_a_checkpoint_without_an_intact_copy_stops_with_one_line(warm, base, tmp_path):
    run = copy_of(base, tmp_path)
    ckpt = run / "checkpoint" / "ckpt.pt"
    ckpt.write_bytes(ckpt.read_bytes()[:1000])  # truncated
    for kept in run.glob("checkpoint/ckpt-*.pt"):
        kept.unlink()
    before = record_bytes(run)
    warm("train", "--out", run, "--resume", "--set", "max_iters=6").one_line_error("train", str(ckpt))
    assert record_bytes(run) == before


def test_a_full_disk_fails_the_run_in_one_line_and_keeps_the_last_checkpoint(warm, base, tmp_path):
    run = copy_of(base, tmp_path)
    ckpt = run / "checkpoint" / "ckpt.pt"
    good = ckpt.read_bytes()
    result = warm("train", "--out", run, "--resume", "--set", "max_iters=6", fsize=200_000)  # ckpt: 1.4 MB
    result.one_line_error("train", str(ckpt))
    assert ckpt.read_bytes() == good
    assert hashlib.sha256(good).hexdigest() in (run / "checkpoint" / "ckpt.pt.sha256").read_text()
    assert not [p for p in run.rglob("*") if p.name.endswith(".tmp")]
    failed = load_run(run)
    assert failed.summary["status"] == "failed" and "ckpt.pt" in failed.summary["reason"]
    assert failed.events[-1]["event"] == "failed"
    assert warm("train", "--out", run, "--resume", "--set", "max_iters=6").code == 0  # room on the disk again
    assert load_run(run).summary["status"] == "finished"


def test_resuming_a_finished_run_changes_nothing(warm, base, tmp_path):
    run = copy_of(base, tmp_path)
    before = record_bytes(run)
    result = warm("train", "--out", run, "--resume")
    assert result.code == 0 and "nothing to do" in result.err, result.err
    assert json.loads(result.out)["final_loss"] == load_run(base).summary["final_loss"] is not None
    assert record_bytes(run) == before


def damage(base: Path, tmp_path: Path, name: str, text: str | None) -> dict[str, Path]:
    """{"run": a copy of the base run with record file `name` replaced by `text` (None: deleted)}."""
    run = copy_of(base, tmp_path)
    if text is None:
        (run / name).unlink()
    else:
        (run / name).write_text(text)
    return {"run": run}


def manifest_without_splits(base: Path, tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "tokens").mkdir()
    (tmp_path / "tokens" / "manifest.json").write_text('{"format": "lowprec-tokens/1"}')
    return {"tokens": tmp_path / "tokens"}


def truncated_gzip(base: Path, tmp_path: Path) -> dict[str, Path]:
    """A copy whose metrics are stored compressed, and cut in half."""
    run = copy_of(base, tmp_path)
    packed = gzip.compress((run / "metrics.jsonl").read_bytes(), mtime=0)
    (run / "metrics.jsonl.gz").write_bytes(packed[:len(packed) // 2])
    (run / "metrics.jsonl").unlink()
    return {"run": run}


def bad_checkpoint(base: Path, tmp_path: Path, rewrite) -> dict[str, Path]:
    """A copy whose ckpt.pt is `rewrite(ckpt.pt)`, saved with a matching sha256, and no kept copy."""
    from lowprec.checkpoint import load_checkpoint, save_atomic

    run = copy_of(base, tmp_path)
    ckpt = run / "checkpoint" / "ckpt.pt"
    rewritten = rewrite(load_checkpoint(ckpt))
    for path in run.glob("checkpoint/ckpt*"):
        path.unlink()
    save_atomic(rewritten, ckpt)
    return {"run": run}


def garbage_checkpoint(base: Path, tmp_path: Path) -> dict[str, Path]:
    """A copy whose ckpt.pt is garbage with its sha256 beside it, and no kept copy."""
    run = copy_of(base, tmp_path)
    for path in run.glob("checkpoint/ckpt*"):
        path.unlink()
    garbage = b"not a checkpoint\n" * 100
    (run / "checkpoint" / "ckpt.pt").write_bytes(garbage)
    (run / "checkpoint" / "ckpt.pt.sha256").write_text(f"{hashlib.sha256(garbage).hexdigest()}  ckpt.pt\n")
    return {"run": run}


def no_checkpoint(base: Path, tmp_path: Path) -> dict[str, Path]:
    """A copy killed during its first checkpoint's write: its record, no checkpoint."""
    run = copy_of(base, tmp_path)
    shutil.rmtree(run / "checkpoint")
    return {"run": run}


def checkpoint_a_folder(base: Path, tmp_path: Path) -> dict[str, Path]:
    run = copy_of(base, tmp_path)
    (run / "checkpoint" / "ckpt.pt").unlink()
    (run / "checkpoint" / "ckpt.pt").mkdir()
    return {"run": run}


def not_utf8(base: Path, tmp_path: Path) -> dict[str, Path]:
    run = copy_of(base, tmp_path)
    lines = (run / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    (run / "metrics.jsonl").write_bytes(lines[0] + lines[1].replace(b'"loss"', b'"lo\xffss"') + lines[2])
    return {"run": run}


NOTHING = lambda base, tmp_path: {}  # noqa: E731
RUN = lambda base, tmp_path: {"run": copy_of(base, tmp_path)}  # noqa: E731
RESUME = ["--out", "{run}", "--resume", "--set", "max_iters=6"]
# name: (setup(base, tmp_path) -> paths the arguments name as {key}, command, arguments, words of the
# message); besides those: {file}, a file, and {tmp}, the test's folder
MISTAKES = {
    "train --out a file": (NOTHING, "train", ["--config", "smoke-cpu", "--out", "{file}"],
                           ["--out", "is a file"]),
    "train --out under a file": (NOTHING, "train", ["--config", "smoke-cpu", "--out", "{file}/run"],
                                 ["--out", "is a file"]),
    "train --out ''": (NOTHING, "train", ["--config", "smoke-cpu", "--out", ""], ["--out", "empty"]),
    "data prepare --out a file": (NOTHING, "data", ["prepare", "--sources", "sotu", "--tokenizer", "bytes",
                                                   "--out", "{file}", "--raw", "{file}/raw"], ["is a file"]),
    "replay --out a file": (lambda base, tmp_path: {"base": base}, "replay",
                            ["{base}", "--from", "2", "--fix", "off", "--out", "{file}"],
                            ["--out", "is a file"]),
    "explode --out a file": (NOTHING, "experiment explode", ["--out", "{file}", "--config", "smoke-cpu",
                                                             "--backend", "emulated", "--gpus", "0"],
                             ["--out", "is a file"]),
    "explode --gpus beyond the machine": (NOTHING, "experiment explode",
                                          ["--out", "{tmp}/x", "--config", "smoke-cpu", "--backend",
                                           "emulated", "--gpus", "3"], ["--gpus 3", "visible"]),
    "positive-control --out a folder": (NOTHING, "experiment positive-control", ["--out", "{tmp}"],
                                        ["--out", "is a folder"]),
    "positive-control --out under a file": (NOTHING, "experiment positive-control",
                                            ["--out", "{file}/x.json"], ["--out", "is a file"]),
    "resume with another model shape": (lambda base, tmp_path: {"run": copy_of(base, tmp_path)}, "train",
                                        ["--out", "{run}", "--resume", "--set", "n_layer=3"],
                                        ["a resume may change only", "model.n_layer (2 -> 3)"]),
    "missing data": (NOTHING, "train", ["--config", "gpu-6l", "--out", "{tmp}/x", "--set", "device=cpu"],
                     ["no prepared token data"]),
    "--set seed=a": (NOTHING, "train", ["--config", "smoke-cpu", "--out", "{tmp}/x", "--set", "seed=a"],
                     ["seed", "int"]),
    "--set grad_clip=-1": (NOTHING, "train", ["--config", "smoke-cpu", "--out", "{tmp}/x", "--set",
                                              "grad_clip=-1"], ["grad_clip"]),
    "resume without metrics.jsonl": (lambda base, tmp_path: damage(base, tmp_path, "metrics.jsonl", None),
                                     "train", ["--out", "{run}", "--resume", "--set", "max_iters=6"],
                                     ["metrics.jsonl", "missing", "history"]),
    "resume with a garbage metrics line": (
        lambda base, tmp_path: damage(base, tmp_path, "metrics.jsonl", "garbage\n{}\n"), "train",
        ["--out", "{run}", "--resume", "--set", "max_iters=6"], ["metrics.jsonl:1"]),
    "resume with a corrupt config.json": (
        lambda base, tmp_path: damage(base, tmp_path, "config.json", '{"config": {'), "train",
        ["--out", "{run}", "--resume"], ["config.json"]),
    "resume with a config.json without config": (
        lambda base, tmp_path: damage(base, tmp_path, "config.json", "{}"), "train",
        ["--out", "{run}", "--resume"], ["config.json", "config"]),
    "resume with a config.json of another version": (
        lambda base, tmp_path: damage(base, tmp_path, "config.json", '{"config": {"model": {"layers": 2}}}'),
        "train", ["--out", "{run}", "--resume"], ["config.json", "layers"]),
    "explode with a seed beyond 2**32": (NOTHING, "experiment explode",
                                         ["--out", "{tmp}/x", "--config", "smoke-cpu", "--backend",
                                          "emulated", "--gpus", "0", "--seeds", "1,4294967296"],
                                         ["seed", "2**32"]),
    "data info on a manifest without splits": (manifest_without_splits, "data", ["info", "{tokens}"],
                                               ["manifest.json", "splits"]),
    # numbers that would train on nonsense, of every command
    "explode --minutes nan": (NOTHING, "experiment explode", ["--out", "{tmp}/x", "--config", "smoke-cpu",
                                                             "--gpus", "0", "--minutes", "nan"],
                              ["--minutes", "> 0 (a finite number)", "'nan'"]),
    "study --slots 0": (NOTHING, "experiment study", ["--queue", "{file}", "--out", "{tmp}/x", "--slots",
                                                      "0"], ["--slots", ">= 1"]),
    "replay --beta inf": (RUN, "replay", ["{run}", "--from", "2", "--fix", "on", "--beta", "inf", "--out",
                                          "{tmp}/x"], ["--beta", "'inf'"]),
    "data prepare --cap-mib inf": (NOTHING, "data prepare", ["--sources", "sotu", "--out", "{tmp}/x",
                                                             "--cap-mib", "inf"], ["--cap-mib", "'inf'"]),
    "bench train --peak-tflops -1": (NOTHING, "bench train", ["--config", "smoke-cpu", "--peak-tflops", "-1"],
                                     ["--peak-tflops", "> 0"]),
    "bench train --out under a file": (NOTHING, "bench train", ["--config", "smoke-cpu", "--out",
                                                                "{file}/bench.json"], ["--out", "is a file"]),
    # records and checkpoints that cannot be read
    "replay on a truncated metrics.jsonl.gz": (truncated_gzip, "replay", ["{run}", "--from", "2", "--fix",
                                                                         "off", "--out", "{tmp}/x"],
                                               ["metrics.jsonl.gz", "cannot be read"]),
    "resume with metrics that are not UTF-8": (not_utf8, "train", RESUME, ["metrics.jsonl:2", "UTF-8"]),
    "resume from garbage that matches its sha256": (garbage_checkpoint, "train", RESUME,
                                                     ["ckpt.pt", "is no checkpoint"]),
    "resume from a pickle that is no checkpoint": (
        lambda base, tmp_path: bad_checkpoint(base, tmp_path, lambda ckpt: ["not", "a", "checkpoint"]),
        "train", RESUME, ["ckpt.pt", "lacks"]),
    "resume from a checkpoint without running_min": (
        lambda base, tmp_path: bad_checkpoint(base, tmp_path, lambda ckpt: {k: v for k, v in ckpt.items()
                                                                            if k != "running_min"}),
        "train", RESUME, ["ckpt.pt", "running_min"]),
    "resume with ckpt.pt a folder": (checkpoint_a_folder, "train", RESUME, ["ckpt.pt", "is a folder"]),
    "resume killed before its first checkpoint": (no_checkpoint, "train", RESUME,
                                                  ["no checkpoint", "remove", "to start it over"]),
    "start again where a run was killed before its first checkpoint": (
        no_checkpoint, "train", ["--config", "smoke-cpu", "--out", "{run}", *SMOKE],
        ["already holds a run", "remove its folder to start it over"]),
}


@pytest.mark.parametrize("name", MISTAKES)
def test_a_user_mistake_is_one_line(warm, base, tmp_path, name):
    setup, command, args, words = MISTAKES[name]
    (tmp_path / "file").write_text("a file, not a folder\n")
    paths = {"file": tmp_path / "file", "tmp": tmp_path, **setup(base, tmp_path)}
    kept = [*base.rglob("*"), *paths.get("run", base).rglob("*")]  # must not change (the lock may)
    before = {p: p.read_bytes() for p in kept if p.is_file() and p.name != LOCK}
    result = warm(*command.split(), *(a.format(**paths) for a in args), cwd=tmp_path,
                  env={"LOWPREC_DATA": str(tmp_path / "no-data")})
    result.one_line_error(command, *words)
    assert {p: p.read_bytes() for p in before} == before  # neither the base run nor a damaged copy changed


# ---- the record checks itself, the lock holds ----

def test_a_deleted_lock_file_does_not_admit_a_second_writer(warm, base, tmp_path):
    """The lock is on the folder itself: deleting writer.lock (the owner's PID) leaves it held."""
    run = copy_of(base, tmp_path)
    writer = RunWriter(run, load_run(run).config, resume=True)  # this process writes the run
    try:
        (run / LOCK).unlink()
        before = record_bytes(run)
        result = warm("train", "--out", run, "--resume", "--set", "max_iters=6")
        result.one_line_error("train", str(run), "being written by another process")
        assert record_bytes(run) == before
    finally:
        writer.close()


def test_a_writer_stops_when_its_files_are_replaced(base, tmp_path):
    """A writer whose metrics.jsonl another process rewrote (an atomic rename onto it) writes nothing more:
    not to the file it holds open, which no name reaches any longer, nor to the summary."""
    run = copy_of(base, tmp_path)
    writer = RunWriter(run, load_run(run).config, resume=True)
    try:
        (tmp_path / "theirs").write_text("")
        os.replace(tmp_path / "theirs", run / "metrics.jsonl")
        row = {"step": 9, "tokens": 1, "loss": 1.0, "lr": 1.0, "grad_norm": 1.0, "time_s": 1.0}
        with pytest.raises(RunRecordError, match="metrics.jsonl was replaced or removed while this process"):
            writer.log(row)
        summary = (run / "summary.json").read_bytes()
        with pytest.raises(RunRecordError, match="replaced"):
            writer.update_summary(status="finished")
        assert (run / "metrics.jsonl").read_text() == "" and (run / "summary.json").read_bytes() == summary
    finally:
        writer.close()


# base's metrics.jsonl holds steps 0, 2 and 3; its checkpoints: ckpt.pt (step 4, counting all three rows) and
# ckpt-000002.pt (counting the first); a resume takes the newest that the rows still fit, or refuses
METRICS_DAMAGE = {  # name: (the lines kept, in order; repaired from ckpt-000002.pt, else refused)
    "emptied": ([], False),
    "the first line only": ([0], True),
    "the second line deleted": ([0, 2], True),
    "the first line twice": ([0, 0, 1, 2], False),
    "the last line twice": ([0, 1, 2, 2], True),
}


@pytest.mark.parametrize("name", METRICS_DAMAGE)
def test_resume_checks_the_metrics_against_the_checkpoint(warm, base, tmp_path, name):
    """Rows lost (a power cut before they reached the disk) or repeated: the resume continues from the newest
    checkpoint whose rows are all there, once, and ends as the uninterrupted run did; or it refuses."""
    kept, repaired = METRICS_DAMAGE[name]
    run = copy_of(base, tmp_path)
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("".join(lines[i] for i in kept))
    before = record_bytes(run)
    result = warm("train", "--out", run, "--resume")
    if repaired:
        assert result.code == 0 and "resuming from the kept copy" in result.err, result.err
        assert "ckpt-000002.pt" in result.err and outcome(run) == outcome(base)
    else:
        result.one_line_error("train", "metrics.jsonl", "no kept copy")
        assert record_bytes(run) == before


@pytest.fixture(scope="module")
def stranger(warm, tmp_path_factory) -> Path:
    """Another run of base's config and length, with another seed."""
    out = tmp_path_factory.mktemp("stranger") / "run"
    made = warm("train", "--config", "smoke-cpu", "--out", out, *SMOKE, "--set", "seed=7")
    assert made.code == 0, made.err
    return out


def test_a_checkpoint_of_another_run_is_refused(warm, base, stranger, tmp_path):
    """Runs sharing a ckpt_dir: the second one's start is refused; another run's ckpt.pt copied in with its
    sha256 is never resumed from (a kept copy of the run's own is, when there is one)."""
    run = copy_of(base, tmp_path)
    shared = warm("train", "--config", "smoke-cpu", "--out", tmp_path / "second", *SMOKE, "--set",
                  f"ckpt_dir={run / 'checkpoint'}")
    shared.one_line_error("train", "already holds checkpoints", "must not share a ckpt_dir")
    for name in ("ckpt.pt", "ckpt.pt.sha256"):
        (run / "checkpoint" / name).unlink()  # ckpt.pt is a second name of ckpt-000004.pt
        shutil.copy(stranger / "checkpoint" / name, run / "checkpoint" / name)
    result = warm("train", "--out", run, "--resume")
    assert result.code == 0 and "belongs to another run" in result.err, result.err
    assert "ckpt-000004.pt" in result.err and outcome(run) == outcome(base)
    for kept in run.glob("checkpoint/ckpt-*"):
        kept.unlink()
    warm("train", "--out", run, "--resume").one_line_error("train", "ckpt.pt", "belongs to another run")


def test_a_resume_changes_only_what_is_safe_and_records_each_change(warm, base, tmp_path):
    run = copy_of(base, tmp_path)
    before = record_bytes(run)
    changed = warm("train", "--out", run, "--resume", "--set", "seed=99")
    changed.one_line_error("train", "a resume may change only max_iters", "seed (1337 -> 99)")
    record = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**record, "config": {**record["config"], "seed": 99}}))
    edited = warm("train", "--out", run, "--resume")
    edited.one_line_error("train", "config.json", "does not match its sha256")
    del record["sha256"]  # a record without its own sha256: the checkpoint's config still tells
    (run / "config.json").write_text(json.dumps({**record, "config": {**record["config"], "seed": 99}}))
    warm("train", "--out", run, "--resume").one_line_error("train", "saved under another config", "seed")
    (run / "config.json").write_bytes(before["config.json"])
    assert record_bytes(run) == before
    resumed = warm("train", "--out", run, "--resume", "--set", "max_iters=6", "--set", "log_interval=1")
    assert resumed.code == 0, resumed.err
    record = load_run(run)
    assert record.events_of("resumed")[0]["changed"] == {"log_interval": [2, 1], "max_iters": [4, 6]}
    assert (record.config["max_iters"], record.config["log_interval"]) == (6, 1)
    assert [m["step"] for m in record.metrics] == [0, 2, 3, 4, 5]


def edit_metric(key: str, value: str):
    """A damage: the first metrics row's `key` given the JSON `value`."""
    def edit(run: Path) -> None:
        lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
        lines[0] = re.sub(f'"{key}":[^,]+', f'"{key}":{value}', lines[0])
        (run / "metrics.jsonl").write_text("".join(lines))
    return edit


def config_x(run: Path) -> None:
    record = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**record, "config": "x"}))


LOAD_DAMAGE = {  # name: (damage, the words of the error)
    "metrics emptied beside a summary of 4 steps": (lambda run: (run / "metrics.jsonl").write_text(""),
                                                    ["summary.json", "finished at step 3", "None"]),
    "a loss that is a string": (edit_metric("loss", '"abc"'), ["metrics.jsonl:1", "loss must be a number"]),
    "a step that is a string": (edit_metric("step", '"0"'), ["metrics.jsonl:1", "step must be an int"]),
    "a config that is a string": (config_x, ["config.json", "'config'"]),
    "a value changed since the run ended": (edit_metric("lr", "1.0"), ["record_sha256", "changed"]),
}


@pytest.mark.parametrize("name", LOAD_DAMAGE)
def test_load_run_says_what_is_wrong(base, tmp_path, name):
    damage_it, words = LOAD_DAMAGE[name]
    run = copy_of(base, tmp_path)
    damage_it(run)
    with pytest.raises(RunRecordError) as error:
        load_run(run)
    assert all(w in str(error.value) for w in words), (words, str(error.value))


FULL_DISK = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1, 1))  # no file takes a byte: a disk full from the start
from lowprec import cli
sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_full_disk_at_the_first_byte_names_the_file(warm, tmp_path):
    """Run with its stderr on a pipe, which a file size limit does not reach."""
    warm("train", "--config", "smoke-cpu", "--out", tmp_path / "run", *SMOKE, code=FULL_DISK,
         pipe=True).one_line_error("train", f"cannot write {tmp_path}")


QUEUE = {"config": "smoke-cpu", "horizon": 100000, "overrides": ["log_interval=1", "telemetry_interval=0",
                                                                 "eval_interval=0", "ckpt_interval=0"],
         "runs": [{"arm": "attn-fp32", "seed": 1}], "estimate_s": {"attn-fp32": 1}}


def test_a_killed_harness_ends_its_runs_and_records_what_happened(tmp_path):
    """`experiment explode` killed with SIGKILL and `experiment study` stopped with SIGTERM: each run they
    started checkpoints and ends "interrupted" (no orphan trains on); explode's experiment.json says it never
    finished, study's log that it stopped, and how its run ended."""
    (tmp_path / "queue.json").write_text(json.dumps(QUEUE))
    cli = [sys.executable, "-m", "lowprec.cli", "experiment"]
    harnesses = {
        "explode": subprocess.Popen([*cli, "explode", "--out", tmp_path / "explode", "--config", "smoke-cpu",
                                     "--arms", "attn-fp32", "--seeds", "1", "--gpus", "0", "--minutes", "10",
                                     *(x for o in QUEUE["overrides"] for x in ("--set", o)),
                                     "--set", "max_iters=100000"], env=ENV, cwd=ROOT,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
        "study": subprocess.Popen([*cli, "study", "--queue", tmp_path / "queue.json", "--out",
                                   tmp_path / "study", "--minutes", "10"], env=ENV, cwd=ROOT,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)}
    runs = {"explode": tmp_path / "explode" / "attn-fp32-s1", "study": tmp_path / "study" / "attn-fp32-s1"}
    try:
        deadline = time.monotonic() + 120
        while not all((r / "metrics.jsonl").is_file() and (r / "metrics.jsonl").stat().st_size
                      for r in runs.values()):
            assert time.monotonic() < deadline, "the runs did not start"
            time.sleep(0.2)
        harnesses["explode"].send_signal(signal.SIGKILL)
        harnesses["study"].send_signal(signal.SIGTERM)
        assert harnesses["study"].wait(timeout=120) == 0
        while any(run_state(r) == "running" for r in runs.values()):
            assert time.monotonic() < deadline + 120, "a run goes on without its harness"
            time.sleep(0.2)
    finally:
        for harness in harnesses.values():
            harness.kill()
    assert [load_run(r).summary["status"] for r in runs.values()] == ["interrupted", "interrupted"]
    assert json.loads((tmp_path / "explode" / "experiment.json").read_text())["state"] == "running"
    log = json.loads(next((tmp_path / "study").glob("study-*.json")).read_text())
    assert log["state"] == "stopped" and log["runs"]["attn-fp32-s1"]["exit_code"] == 130


def test_a_data_prepare_killed_outright_leaves_nothing_behind(warm, tmp_path):
    """SIGKILL mid-write leaves the split files' temporaries; the next writer of the folder removes them."""
    out = tmp_path / "tok"
    result = warm(out, code=KILL_MID_WRITE.replace("signal.SIGTERM", "signal.SIGKILL"))
    assert result.code == -signal.SIGKILL, result.err
    assert sorted(p.name.split(".")[1] for p in out.iterdir()) == ["train", "val"]  # the temporaries
    result = warm(out, code=KILL_MID_WRITE.replace("os.kill", "print"))
    assert result.code == 0, result.err
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "train.bin", "val.bin"]


KILL_MID_WRITE = """
import os, signal, sys
from pathlib import Path
from lowprec.data import get_tokenizer
from lowprec.data.prepare import write_dataset

def sources():
    yield {"name": "a", "terms": "permissive"}, ["six " * 10000, "seven"]
    os.kill(os.getpid(), signal.SIGTERM)  # after one source was written
    yield {"name": "b", "terms": "permissive"}, ["eight"]

write_dataset(Path(sys.argv[1]), sources(), get_tokenizer("bytes"), 0.3, {"v": 2}, "cmd", progress=False)
"""


def test_entry_points_refuse_what_they_cannot_take_and_ignore_what_the_mask_hides():
    import torch
    from lowprec.attention import AttentionSpec, Fix, attention, reference_attention

    for text, words in (("triton/block_m=-5", "block_m"), ("emulated/delta=foo", "delta"),
                        ("sdpa/sdpa_backend=bogus", "sdpa_backend"),
                        ("triton/precision=paper:tile=48", "tile"),
                        ("triton/precision=fa2/precision=paper", "sets precision twice"),
                        ("triton/fix=2/fix=none", "sets fix twice"),
                        ("triton/fix=2:tie=row,tie=tile", "sets tie twice"),
                        ("emulated/precision=fa2:weights=none,weights=bf16", "sets weights twice")):
        with pytest.raises(ValueError, match=re.escape(words)):
            AttentionSpec.parse(text)
    with pytest.raises(ValueError, match="fix must be a string"):
        Fix.parse(None)
    q, k, v = (torch.randn(1, 2, 8, 16, dtype=torch.float64) for _ in range(3))
    for scale in ("0.5", True, float("nan"), -1.0):
        with pytest.raises(ValueError, match="scale must be None"):
            reference_attention(q, k, v, scale=scale)
    poisoned = v.clone()
    poisoned[:, :, -1, 0] = float("nan")  # the last key: only the last query sees it
    o, lse = reference_attention(q, k, poisoned)
    clean, clean_lse = reference_attention(q, k, v)
    assert torch.equal(o[:, :, :-1], clean[:, :, :-1]) and torch.equal(lse, clean_lse)
    assert o[:, :, -1, 0].isnan().all() and o[:, :, -1, 1:].isfinite().all()
    empty = torch.randn(0, 2, 16, 16, requires_grad=True)
    for backend in ("triton", "emulated", "math", "reference"):
        out = attention(empty, empty, empty, backend=backend)
        out.sum().backward()
        assert out.shape == empty.shape == empty.grad.shape


# ---- fault injection: random kills and random damage, then resume and load_run ----

TINY = [arg for s in ("max_iters=8", "log_interval=1", "ckpt_interval=2", "ckpt_keep=true", "eval_interval=0",
                      "telemetry_interval=0", "warmup_iters=2", "block_size=16", "n_embd=16", "n_head=1",
                      "n_layer=1", "batch_size=2") for arg in ("--set", s)]
TRIALS = 24  # one to two seconds each on 2 busy cores
TIMES = ("time_s", "tokens_per_s")  # the wall clock's keys of a metrics row
OUTCOME = ("status", "steps", "tokens", "final_loss", "final_loss_hex", "min_loss_after_warmup", "repetition",
           "weights_sha256")


def outcome(run: Path) -> tuple[dict, list[dict]]:
    """What an uninterrupted run and a resumed one must share: the summary's outcome and every metrics row
    (but its clock)."""
    record = load_run(run)
    rows = [{k: v for k, v in m.items() if k not in TIMES} for m in record.metrics]
    return {k: record.summary.get(k) for k in OUTCOME}, rows


def break_file(rng: random.Random, path: Path) -> str:
    """Damage one file as a crash or a bad disk might: cut it at a random byte, delete or repeat a random
    line, or flip a random bit; returns what it did."""
    data = path.read_bytes()
    kind = rng.choice(("truncate", "delete a line", "repeat a line", "flip a bit"))
    lines = data.splitlines(keepends=True)
    if kind == "truncate":
        data = data[:rng.randrange(len(data) + 1)]
    elif kind == "flip a bit" and data:
        at = rng.randrange(len(data))
        data = data[:at] + bytes([data[at] ^ (1 << rng.randrange(8))]) + data[at + 1:]
    elif lines and kind != "flip a bit":
        at = rng.randrange(len(lines))
        lines[at:at + 1] = [] if kind == "delete a line" else [lines[at]] * 2
        data = b"".join(lines)
    path.write_bytes(data)
    return f"{kind} of {path.name}"


def test_random_kills_and_damage_end_bit_identical_or_refused(warm, tmp_path):
    """Seeded trials: a run SIGKILLed at a random moment (some also during their first resume), 0-2 random
    damages to any file of the record or the checkpoints, then `--resume` and `load_run`. Every resume ends
    bit-identical to the uninterrupted run (summary outcome, weights sha256, every metrics row) or refuses in
    one line; load_run never fails but with a RunRecordError. (Refusals are mostly runs killed before their
    first checkpoint; resumes from a kept copy after damage count as identical.)"""
    rng = random.Random(37)
    assert warm("train", "--config", "smoke-cpu", "--out", tmp_path / "reference", *TINY).code == 0
    expected = outcome(tmp_path / "reference")
    steps_s = load_run(tmp_path / "reference").summary["time_s"]  # its 8 steps' time
    marks = ("metrics.jsonl", *(f"checkpoint/ckpt-{step:06d}.pt" for step in (2, 4, 6)))  # as it goes on

    def kill(run: Path) -> dict:
        """When to kill a run: mostly within about two steps of a random point of its progress (its record
        opening, or a checkpoint appearing), at times from its start, before it opens its record."""
        if rng.random() < 0.1:
            return {"kill_after": rng.uniform(0, 0.5), "kill_from": None}
        return {"kill_after": rng.uniform(0, steps_s / 4), "kill_from": run / rng.choice(marks)}

    tally: dict[str, int] = {"identical": 0, "refused": 0, "killed": 0, "damaged": 0}
    for trial in range(TRIALS):
        run = tmp_path / f"trial-{trial}"
        killed = warm("train", "--config", "smoke-cpu", "--out", run, *TINY, **kill(run))
        tally["killed"] += killed.code == -9
        if run.exists() and rng.random() < 0.3:
            warm("train", "--out", run, "--resume", **kill(run))
        files = sorted(p for p in run.rglob("*") if p.is_file()) if run.exists() else []
        done = [break_file(rng, rng.choice(files)) for _ in range(rng.choice((0, 1, 1, 2)) if files else 0)]
        tally["damaged"] += bool(done)
        resumed = warm("train", "--out", run, "--resume")
        if resumed.code == 0:
            assert outcome(run) == expected, (run, done, resumed.err)
            tally["identical"] += 1
        else:
            resumed.one_line_error("train")
            tally["refused"] += 1
            with contextlib.suppress(RunRecordError):
                load_run(run)
    assert tally["killed"] >= TRIALS / 2 and min(tally["damaged"], tally["identical"]) >= TRIALS / 5, tally

"""The CLI under faults: a second writer, a failed start, torn and deleted record files, corrupt checkpoints,
a full disk, a finished run resumed, and user mistakes. Every case runs `lowprec` in a process of its own and
checks the error contract: one line `lowprec <command>: <message>` and exit status 2, never a traceback.

Each command runs as `python -m lowprec.cli` would, in a process of its own: `python -m lowprec.cli` once (the
base run), the others forked from one warm interpreter that has imported the command modules (`WARM`), which
saves torch's 3 s import per command and keeps this file well under a minute on 2 cores.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from lowprec.runs import LOCK, RunWriter, load_run

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "lib"), "TRITON_INTERPRET": "1"}
RECORD = ("config.json", "metrics.jsonl", "events.jsonl", "summary.json")
# 4 steps, checkpoints at steps 2 and 4 (kept as ckpt-000002.pt and ckpt-000004.pt); about a second
SMOKE = [arg for s in ("max_iters=4", "log_interval=2", "ckpt_interval=2", "ckpt_keep=true",
                       "eval_interval=0", "telemetry_interval=0") for arg in ("--set", s)]

# One command per line on stdin ({"args", "cwd", "env", "fsize", "stdout", "stderr"}); each runs in a fork, as
# `python -m lowprec.cli ARGS` runs (`sys.exit(cli.main())`, an uncaught exception printed with its traceback
# and exit status 1); its exit status goes back on stdout. `fsize` caps the size of any file it writes.
WARM = """
import json, os, resource, signal, sys, traceback
from lowprec import cli
cli.build_parser()  # imports every command's module
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        os.chdir(job["cwd"])
        os.environ.update(job["env"])
        if job["fsize"]:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (job["fsize"], job["fsize"]))
        for fd, name in ((1, "stdout"), (2, "stderr")):
            os.dup2(os.open(job[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.argv = ["lowprec", *job["args"]]
        try:
            code = cli.main(job["args"])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
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

    def lowprec(*args: str, cwd: Path = ROOT, env: dict | None = None, fsize: int = 0) -> Result:
        nonlocal count
        count += 1
        out, err = logs / f"{count}.out", logs / f"{count}.err"
        job = {"args": [str(a) for a in args], "cwd": str(cwd), "env": env or {}, "fsize": fsize,
               "stdout": str(out), "stderr": str(err)}
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


NOTHING = lambda base, tmp_path: {}  # noqa: E731
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

"""scripts/h200-study.sh on the CPU with tiny queues: go over two queues (the first capped by FIRST, a probe's
estimate passed to the queue with its arm), wait within CALL_START's limit, a pack per queue, and a pack taken
back into a results folder (finished runs only, each made by the library its commit holds)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from lowprec.runs import LIBRARY, library_files, library_sha256

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ["block_size=32", "n_embd=32", "batch_size=4", "log_interval=1", "telemetry_interval=4",
          "ckpt_interval=0", "eval_interval=0"]


def queue(folder: Path, runs: list[dict], estimates: dict[str, float]) -> Path:
    folder.mkdir(parents=True)
    (folder / "queue.json").write_text(json.dumps({"config": "smoke-cpu", "horizon": 12, "overrides": RECIPE,
                                                   "runs": runs, "estimate_s": estimates}))
    return folder / "queue.json"


def library_repo(folder: Path, changed: bool = False) -> Path:
    """A git repository whose tag `the-commit-sent` holds this library's Python sources (one changed)."""
    for name, source in library_files().items():
        target = folder / LIBRARY / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(source)
    if changed:
        with open(folder / "lib" / "lowprec" / "model.py", "a") as handle:
            handle.write("# changed\n")
    git = ["git", "-C", str(folder), "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "library"], ["tag", "the-commit-sent"]):
        subprocess.run([*git, *args], check=True, capture_output=True)
    return folder


def copy_of_the_tree(folder: Path) -> Path:
    """What a device call lands: the library, scripts, tests and pyproject.toml in `folder`."""
    for name in ("lib", "scripts", "tests"):
        shutil.copytree(ROOT / name, folder / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", folder)
    return folder


def test_go_over_two_queues_then_wait_and_pack(tmp_path) -> None:
    """The go runs from its own copy of the tree: the next call's copy of the tree, landing while the study
    starts (here: the library gone, the queue files empty), changes nothing it does."""
    cell = {"arm": "attn-fp32", "seed": 1, "tag": "lr8e-3", "overrides": ["lr=8e-3"]}
    first = queue(tmp_path / "grid", [cell], {"attn-fp32": 5})
    second = queue(tmp_path / "survival", [{"arm": "model-fp32", "seed": 1}], {"model-fp32": 1e6})
    work, out, tree = tmp_path / "work", tmp_path / "out", copy_of_the_tree(tmp_path / "tree")
    work.mkdir()
    out.mkdir()
    (work / "time-model-fp32.json").write_text(json.dumps({"projected_s": 10.0}))  # a probe's measurement
    ended = subprocess.Popen(["true"])
    ended.wait()
    (work / "probe.pid").write_text(f"{ended.pid}\n")  # a probe that has ended
    (work / "probe-tests.log").write_text(".\n3 passed, 95 deselected in 27.75s\n")  # its GPU tests
    env = {**os.environ, "WORK": str(work), "OUT": str(out), "QUEUE": f"{first} {second}",
           "PYTHONPATH": str(tree / "lib"), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    script = ["bash", str(tree / "scripts" / "h200-study.sh")]
    # the runs name a commit by a tag that two repositories give different libraries (below, the take)
    go = subprocess.run(script, env={**env, "PHASE": "go", "MINUTES": "4", "FIRST": "1",
                                     "LOWPREC_GIT_COMMIT": "the-commit-sent"}, cwd=tree,
                        capture_output=True, text=True, timeout=120)
    assert go.returncode == 0 and "probe: --estimate model-fp32=70" in go.stdout
    assert "probe tests: 3 passed, 95 deselected in 27.75s" in go.stdout  # seen before the study starts
    queues = {path: path.read_text() for path in (first, second)}
    shutil.rmtree(tree / "lib")  # the next call's copy landing
    (tree / "lib").mkdir()
    for path in queues:
        path.write_text("")
    start = int(time.time())
    wait = subprocess.run(script, env={**env, "PHASE": "wait", "WAIT_S": "540", "CALL_START": str(start)},
                          cwd=tree, capture_output=True, text=True, timeout=620)
    assert wait.returncode == 0, wait.stderr
    for path, text in queues.items():
        path.write_text(text)
    log = (work / "go.log").read_text()
    rest = float(re.search(r"study survival: ([0-9.]+) minutes", log).group(1))  # the first's rest, less 30 s
    assert "study grid: 1 minutes" in log and 0 < rest <= 3.5, log
    assert "start model-fp32-s1 (expected 70 s)" in log  # the measured estimate, not the queue's 1e6
    study_logs = list((work / "grid").glob("study-*.json"))  # its library read whole, not a landing copy's
    assert study_logs and all(json.loads(study_log.read_text())["provenance"]["library_sha256"] ==
                              library_sha256(library_files()) for study_log in study_logs)
    for name, run in (("grid", "attn-fp32-lr8e-3-s1"), ("survival", "model-fp32-s1")):
        with tarfile.open(out / f"{name}.tgz") as pack:
            assert f"{name}/{run}/summary.json" in pack.getnames()

    # PHASE=take, here: a pack's finished runs into the queue's folder, a run still going left out
    packed = work / "grid" / "attn-fp32-lr8e-3-s1"
    going = work / "grid" / "fa2-lr8e-3-s1"
    going.mkdir()
    (going / "summary.json").write_text(json.dumps({"status": "running"}))
    with tarfile.open(out / "grid.tgz", "w:gz") as pack:
        pack.add(work / "grid", arcname="grid")
    into = tmp_path / "results"
    (into / "grid").mkdir(parents=True)
    (into / "grid" / "queue.json").write_text(first.read_text())  # a queue's folder holds its queue
    taking = {**env, "PHASE": "take", "PACK": str(out / "grid.tgz"), "INTO": str(into)}
    other = library_repo(tmp_path / "other", changed=True)  # its tag holds a library unlike the one that ran
    take = subprocess.run(script, env=taking, cwd=other, capture_output=True, text=True, timeout=60)
    assert take.returncode == 0 and not (into / "grid" / "attn-fp32-lr8e-3-s1").exists()
    assert "grid/attn-fp32-lr8e-3-s1: its library is not what its commit the-commit-sent holds" in take.stderr
    take = subprocess.run(script, env=taking, cwd=library_repo(tmp_path / "same"), capture_output=True,
                          text=True, timeout=60)
    assert take.returncode == 0, take.stderr
    kept = into / "grid" / "attn-fp32-lr8e-3-s1"
    assert (kept / "metrics.jsonl.gz").is_file() and not (kept / "metrics.jsonl").exists()
    assert (kept / "summary.json").read_text() == (packed / "summary.json").read_text()
    assert not (into / "grid" / "fa2-lr8e-3-s1").exists() and "still running when packed" in take.stdout
    assert list((into / "grid").glob("study-*.json")), "the study's log comes along"
    (kept / "note.txt").write_text("kept")  # a run here with an outcome is never replaced by a pack's
    again = subprocess.run(script, env=taking, cwd=library_repo(tmp_path / "again"), capture_output=True,
                           text=True, timeout=60)
    assert again.returncode == 0 and (kept / "note.txt").exists(), again.stderr
    assert "grid/attn-fp32-lr8e-3-s1: " in again.stderr and "already holds it with an outcome" in again.stderr


def test_go_counts_its_minutes_from_end_at(tmp_path) -> None:
    """END_AT (epoch seconds) in place of MINUTES: the go ends then, its study getting the seconds left less
    30 (not whole minutes), counted once the probe has ended."""
    first = queue(tmp_path / "survival", [{"arm": "model-fp32", "seed": 1}], {"model-fp32": 1e6})
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    env = {**os.environ, "WORK": str(work), "OUT": str(out), "QUEUE": str(first),
           "PYTHONPATH": str(ROOT / "lib"), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    script = ["bash", str(ROOT / "scripts" / "h200-study.sh")]
    go = subprocess.run(script, env={**env, "PHASE": "go", "END_AT": str(int(time.time()) + 150)}, cwd=ROOT,
                        capture_output=True, text=True, timeout=60)
    assert go.returncode == 0 and re.search(r"seconds to END_AT: 1[45][0-9]\n", go.stdout), go.stdout
    again = subprocess.run(script, env={**env, "PHASE": "go", "END_AT": str(int(time.time()) + 150)},
                           cwd=ROOT, capture_output=True, text=True, timeout=60)  # a second go while one runs
    pid = (work / "go.pid").read_text().strip()
    assert again.returncode == 2 and again.stderr == f"PHASE=go: a go is still running (pid {pid}; its log " \
        f"{work}/go.log): wait for it, or stop it with kill -- -{pid}\n", again.stderr
    wait = subprocess.run(script, env={**env, "PHASE": "wait", "WAIT_S": "60"}, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    log = (work / "go.log").read_text()
    minutes = float(re.search(r"study survival: ([0-9.]+) minutes", log).group(1))
    assert wait.returncode == 0 and 1.5 < minutes <= 2, log


def test_a_queue_named_by_its_folder_is_refused_in_one_line(tmp_path) -> None:
    """QUEUE names queue files by path: a folder's name ("lr-qknorm") is refused before a go or a probe
    starts, and before a wait packs."""
    first = queue(tmp_path / "survival", [{"arm": "model-fp32", "seed": 1}], {"model-fp32": 1e6})
    work = tmp_path / "work"
    env = {**os.environ, "WORK": str(work), "OUT": str(tmp_path), "QUEUE": f"{first} lr-qknorm",
           "MINUTES": "1", "PYTHONPATH": str(ROOT / "lib"),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    for phase in ("go", "probe", "wait"):
        done = subprocess.run(["bash", str(ROOT / "scripts" / "h200-study.sh")], env={**env, "PHASE": phase},
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and "started" not in done.stdout, done.stdout + done.stderr
        assert done.stderr.strip() == ("QUEUE: lr-qknorm is not a queue file (name each by its path, e.g. "
                                       "results/explode/survival/queue.json)"), done.stderr
    assert not work.exists(), "nothing started"


def test_probe_without_the_overhead_bench(tmp_path) -> None:
    """PROBE_BENCH=none skips `bench overhead`; PROBE_EXTRA still runs, with WORK set, in the probe's
    session."""
    work = tmp_path / "work"
    env = {**os.environ, "WORK": str(work), "PHASE": "probe", "ARM": "none", "PROBE_BENCH": "none",
           "PROBE_EXTRA": 'echo measured > "$WORK/bench-extra.json"', "PYTHONPATH": str(ROOT / "lib"),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    probe = subprocess.run(["bash", str(ROOT / "scripts" / "h200-study.sh")], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0 and "probe started" in probe.stdout, probe.stdout + probe.stderr
    pid = int((work / "probe.pid").read_text())
    for _ in range(300):  # the probe runs in its own session: wait for it to end
        if not Path(f"/proc/{pid}").exists():
            break
        time.sleep(0.1)
    assert (work / "bench-extra.json").read_text() == "measured\n"
    log = (work / "probe.log").read_text()
    assert not (work / "overhead.json").exists() and "lowprec" not in log, log  # no bench ran, nor failed


def test_go_takes_two_slots_where_the_probes_pair_gained(tmp_path) -> None:
    """SLOTS=auto: two runs at a time where the probe's two runs at once made at least PAIR_GAIN (1.4) times
    the tokens/s of one alone, else one; one where the probe left no pair; one per GPU on a machine with
    several."""
    first = queue(tmp_path / "survival", [{"arm": "model-fp32", "seed": 1}], {"model-fp32": 1e6})
    script = ["bash", str(ROOT / "scripts" / "h200-study.sh")]
    cases = (("gained", 100, (80, 70), 2), ("not", 100, (70, 60), 1), ("none", 0, (), 1))
    for name, alone, pair, slots in cases:
        work, out = tmp_path / name, tmp_path / f"{name}-out"
        work.mkdir()
        out.mkdir()
        if alone:
            (work / "time-alone.json").write_text(json.dumps({"tokens_per_s": alone}))
        for arm, rate in zip(("a", "b"), pair, strict=False):
            (work / f"time-pair-{arm}.json").write_text(json.dumps({"tokens_per_s": rate}))
        env = {**os.environ, "WORK": str(work), "OUT": str(out), "QUEUE": str(first), "SLOTS": "auto",
               "PHASE": "go", "MINUTES": "2" if name == "gained" else "0", "PYTHONPATH": str(ROOT / "lib"),
               "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}  # 0: no study, the go ends
        go = subprocess.run(script, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert go.returncode == 0 and f"slots: {slots}" in go.stdout, go.stdout + go.stderr
        wait = subprocess.run(script, env={**env, "PHASE": "wait", "WAIT_S": "60"}, cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert wait.returncode == 0
        assert name != "gained" or "2 at a time" in (work / "go.log").read_text(), "the study gets the slots"
    four = {**env, "GPUS": "4", "WORK": str(tmp_path / "none"), "MINUTES": "0"}  # a machine with four GPUs
    several = subprocess.run(script, env=four, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert several.returncode == 0 and "gpus: 4, slots: 4" in several.stdout, several.stdout + several.stderr


def test_take_names_a_pack_without_a_queue_in_one_line(tmp_path) -> None:
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "time-alone.json").write_text("{}")
    with tarfile.open(tmp_path / "probe.tgz", "w:gz") as pack:
        pack.add(probe / "time-alone.json", arcname="time-alone.json")
    with tarfile.open(tmp_path / "stray.tgz", "w:gz") as pack:
        pack.add(probe, arcname="stray")
    env = {**os.environ, "PHASE": "take", "INTO": str(tmp_path / "results"), "PYTHONPATH": str(ROOT / "lib")}
    script = ["bash", str(ROOT / "scripts" / "h200-study.sh")]
    for name, said in (("probe", "no queue folder in it"), ("stray", "stray has no queue here")):
        take = subprocess.run(script, env={**env, "PACK": str(tmp_path / f"{name}.tgz")}, cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert said in take.stderr and "Traceback" not in take.stderr, take.stderr
        assert len(take.stderr.strip().splitlines()) == 1


def test_pack_brings_the_probes_measurements(tmp_path) -> None:
    """PHASE=pack: probe.tgz holds the probe's log and what PROBE_EXTRA wrote (timings, benches, profiles)."""
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    made = ["probe.log", "time-alone.json", "bench-aa.json", "profile-det.txt", "probe-tests.log"]
    for name in [*made, "checkpoint", "notes.md"]:
        (work / name).write_text("x\n")
    (tmp_path / "q.json").write_text("{}")
    env = {**os.environ, "WORK": str(work), "OUT": str(out), "PHASE": "pack",
           "QUEUE": str(tmp_path / "q.json")}  # a queue with no records: no queue pack
    pack = subprocess.run(["bash", str(ROOT / "scripts" / "h200-study.sh")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert pack.returncode == 0, pack.stderr
    with tarfile.open(out / "probe.tgz") as probe:
        assert sorted(probe.getnames()) == sorted(made)

"""`lowprec experiment study` on CPU: a queue of runs made to their horizon, picked up where it stopped."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from lowprec.cli import main as lowprec_main
from lowprec.instruments import study
from lowprec.runs import load_run

REPO = Path(__file__).resolve().parents[1]
RECIPE = ["block_size=32", "n_embd=32", "batch_size=4", "log_interval=1", "telemetry_interval=4",
          "ckpt_interval=0", "eval_interval=0"]


def write_queue(folder, runs, horizon=12, estimate=1.0):
    folder.mkdir(parents=True, exist_ok=True)
    queue = {"config": "smoke-cpu", "horizon": horizon, "overrides": RECIPE, "runs": runs,
             "estimate_s": {"model-fp32": estimate, "attn-fp32": estimate}}
    (folder / "queue.json").write_text(json.dumps(queue))
    return folder / "queue.json"


def test_study_makes_every_planned_run_once_and_reports(tmp_path, capsys):
    runs = [{"arm": "model-fp32", "seed": 1}, {"arm": "attn-fp32", "seed": 1},
            {"arm": "model-fp32", "seed": 2, "tag": "lr1e-2", "overrides": ["lr=1e-2"]}]
    queue = write_queue(tmp_path / "home", runs)
    out = tmp_path / "out"
    assert lowprec_main(["experiment", "study", "--queue", str(queue), "--out", str(out), "--minutes", "5",
                         "--slots", "2"]) == 0
    for name in ("model-fp32-s1", "attn-fp32-s1", "model-fp32-lr1e-2-s2"):
        run = load_run(out / name)
        assert run.summary["status"] == "finished" and run.summary["steps"] == 12
        assert run.config["seed"] == int(name[-1]) and run.config["deterministic"]
    assert load_run(out / "model-fp32-lr1e-2-s2").config["lr"] == 1e-2  # a grid cell's own override
    assert load_run(out / "model-fp32-s1").config["dtype"] == "float32"
    assert load_run(out / "attn-fp32-s1").config["model"]["attention"] == "math/dtype=float32"
    capsys.readouterr()
    # all done: a second call starts nothing; --status counts the runs per arm
    assert lowprec_main(["experiment", "study", "--queue", str(queue), "--out", str(out)]) == 0
    assert "start" not in capsys.readouterr().out
    assert lowprec_main(["experiment", "study", "--queue", str(queue), "--out", str(out), "--status"]) == 0
    report = capsys.readouterr().out
    line = next(line for line in report.splitlines() if line.startswith("model-fp32-lr1e-2-s2 "))
    run = load_run(out / "model-fp32-lr1e-2-s2")
    assert line.split()[:4] == ["model-fp32-lr1e-2-s2", "done", "runaway", "-"]
    assert f"final loss {run.summary['final_loss']:5.2f}" in line and line.endswith(str(out / run.path.name))
    assert any(line.split()[:2] == ["model-fp32", "1"] and "0/1" in line for line in report.splitlines())
    assert "in pieces" not in report, "runs on the CPU are not compiled"
    assert any(line.split()[:2] == ["model-fp32-lr1e-2", "1"] for line in report.splitlines())


def test_study_starts_only_what_fits_and_redoes_a_partial_run(tmp_path, capsys):
    runs = [{"arm": "model-fp32", "seed": 1}]
    queue = write_queue(tmp_path / "home", runs, estimate=3600)
    out = tmp_path / "out"
    study = ["experiment", "study", "--queue", str(queue), "--out", str(out)]
    assert lowprec_main([*study, "--minutes", "5"]) == 0
    assert not (out / "model-fp32-s1").exists()  # an hour's run does not start in five minutes
    capsys.readouterr()  # a measured time in place of the queue's estimate: it would start
    assert lowprec_main([*study, "--minutes", "5", "--dry-run", "--estimate", "model-fp32=60"]) == 0
    assert "would start model-fp32-s1" in capsys.readouterr().out
    for bad in ("fa2=60", "model-fp32=soon", "model-fp32=0"):
        assert lowprec_main([*study, "--dry-run", "--estimate", bad]) == 2
        assert f"--estimate {bad!r}: expected GROUP=SECONDS" in capsys.readouterr().err
    # a record cut short (a budget ended it) has no outcome: it stays planned and starts over
    assert lowprec_main(["train", "--config", "smoke-cpu", "--out", str(out / "model-fp32-s1"),
                         *sum((["--set", o] for o in [*RECIPE, "max_iters=4", "dtype=float32",
                                                      "attention=math"]), [])]) == 0
    queue = write_queue(tmp_path / "home", runs)
    capsys.readouterr()
    assert lowprec_main(["experiment", "study", "--queue", str(queue), "--out", str(out), "--status"]) == 0
    assert "partial" in capsys.readouterr().out
    assert lowprec_main([*study, "--minutes", "5"]) == 0
    assert load_run(out / "model-fp32-s1").summary["steps"] == 12


def test_study_asks_a_runs_pace_again_when_one_ends(tmp_path, capsys):
    """The queue's estimate (1 s) lets the first run start; once it ends, the second is expected to take the
    first's pace plus a process start (over 30 s), which no longer fits the 30-s budget."""
    runs = [{"arm": "model-fp32", "seed": 1}, {"arm": "model-fp32", "seed": 2}]
    queue = write_queue(tmp_path / "home", runs)
    out = tmp_path / "out"
    assert lowprec_main(["experiment", "study", "--queue", str(queue), "--out", str(out), "--minutes",
                         "0.5"]) == 0
    assert "start model-fp32-s1 (expected 1 s)" in capsys.readouterr().out
    assert load_run(out / "model-fp32-s1").summary["steps"] == 12 and not (out / "model-fp32-s2").exists()
    log = json.loads(next(out.glob("study-*.json")).read_text())  # what each run was expected to take
    assert list(log["runs"]) == ["model-fp32-s1"] and log["runs"]["model-fp32-s1"]["expected_s"] == 1.0


def test_expected_times_project_each_pace_to_the_horizon_scaled_to_this_gpu(monkeypatch):
    """A run the stop rule ended early counts at its pace; a group's latest run on this GPU gives its time (a
    change of code shows in it); a group made only elsewhere is scaled by how much longer this GPU took, in
    its latest run, for the groups made on both; a group with no done run gets its estimate."""
    made = {"fa2-a": ("H200", "12:00", 100.0, 1000), "fa2-b": ("H100", "13:00", 200.0, 1000),
            "rowsum-a": ("H200", "12:00", 50.0, 500)}
    monkeypatch.setattr(study, "load_run", lambda name: SimpleNamespace(
        provenance={"device": made[name][0], "time": made[name][1]},
        summary={"time_s": made[name][2], "steps": made[name][3]}))
    rows = [{"name": name, "group": name.split("-")[0], "arm": name.split("-")[0], "state": "done",
             "folder": name} for name in made]
    rows.append({"name": "paper-a", "group": "paper", "arm": "paper", "state": "planned", "folder": None})
    queue = {"horizon": 8000, "estimate_s": {"fa2": 300.0, "rowsum": 300.0, "paper": 300.0}}
    h200, h100 = 0.1 * 8000 + study.START_S, 0.2 * 8000 + study.START_S  # the two fa2 runs, projected
    found = study.expected_s(queue, rows, "H100")
    assert found["rowsum-a"] == pytest.approx(h200 * h100 / h200) and found["paper-a"] == 300.0
    assert found["fa2-a"] == pytest.approx(h100)
    assert study.expected_s(queue, rows, "H200")["rowsum-a"] == pytest.approx(h200)
    # a later fa2 run on the H100 at 0.12 s a step (new code, say): fa2's time and the H100's scale follow it
    made["fa2-c"] = ("H100", "14:00", 120.0, 1000)
    rows.insert(0, {**rows[0], "name": "fa2-c", "folder": "fa2-c"})
    latest = 0.12 * 8000 + study.START_S
    found = study.expected_s(queue, rows, "H100")
    assert found["fa2-a"] == pytest.approx(latest)
    assert found["rowsum-a"] == pytest.approx(h200 * latest / h200), "rowsum's H200 pace times the new scale"


def test_study_stops_starting_runs_when_one_ends_without_an_outcome(tmp_path, capsys):
    """A run whose process ends short of the horizon (here: its corpus is missing) stops the study: the runs
    after it would most likely fail the same way and burn the budget; exit 1, the log says which run."""
    runs = [{"arm": "model-fp32", "seed": 1, "tag": "nodata", "overrides": ["data=missing-corpus"]},
            {"arm": "model-fp32", "seed": 2}]
    queue = write_queue(tmp_path / "home", runs)
    out = tmp_path / "out"
    study = ["experiment", "study", "--queue", str(queue), "--out", str(out), "--minutes", "5"]
    assert lowprec_main(study) == 1
    printed = capsys.readouterr().out
    assert f"study: model-fp32-nodata-s1 ended without an outcome at step 12 (exit 2; its log: " \
           f"{out / 'model-fp32-nodata-s1.log'}): no further run starts" in printed
    assert "start model-fp32-s2" not in printed and not (out / "model-fp32-s2").exists()
    log = json.loads(next(out.glob("study-*.json")).read_text())
    assert log["state"] == "failed" and list(log["runs"]) == ["model-fp32-nodata-s1"]


def test_study_rejects_a_bad_queue(tmp_path, capsys):
    queue = write_queue(tmp_path, [{"arm": "fa3", "seed": 1}])
    assert lowprec_main(["experiment", "study", "--queue", str(queue), "--status"]) == 2
    assert "unknown arm" in capsys.readouterr().err
    (tmp_path / "queue.json").write_text("{")
    assert lowprec_main(["experiment", "study", "--queue", str(queue), "--status"]) == 2
    assert lowprec_main(["experiment", "study"]) == 2
    assert "the following arguments are required: --queue" in capsys.readouterr().err


def test_study_spreads_its_slots_over_the_gpus(tmp_path, capsys, monkeypatch):
    """On a machine with two GPUs (faked: the runs themselves train on the CPU), two slots put one run on each
    GPU, and a run that does not share its GPU is expected at its time alone; the third run takes the GPU
    that a run left. --gpus beyond the machine's is refused in one line."""
    placed = []
    real_launch = study.launch

    def launch(cmd, gpu, log, threads=None):
        placed.append(gpu)
        return real_launch(cmd, None, log, 1)

    monkeypatch.setattr(study, "launch", launch)
    monkeypatch.setattr(study.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(study.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(study.torch.cuda, "get_device_name", lambda *_: "Fake GPU")
    runs = [{"arm": "model-fp32", "seed": seed} for seed in (1, 2, 3)]
    queue = write_queue(tmp_path / "home", runs)
    out = tmp_path / "out"
    args = ["experiment", "study", "--queue", str(queue), "--out", str(out), "--minutes", "5", "--slots", "2"]
    assert lowprec_main(args) == 0
    printed = capsys.readouterr().out
    assert placed[:2] == [0, 1] and len(placed) == 3 and placed[2] in (0, 1)
    assert "start model-fp32-s1 on GPU 0 (expected 1 s)" in printed  # not 2 s: it has its GPU alone
    assert "start model-fp32-s2 on GPU 1 (expected 1 s)" in printed
    log = json.loads(next(out.glob("study-*.json")).read_text())
    assert [log["runs"][f"model-fp32-s{seed}"]["gpu"] for seed in (1, 2, 3)] == placed
    assert all(load_run(out / f"model-fp32-s{seed}").summary["steps"] == 12 for seed in (1, 2, 3))
    assert lowprec_main([*args, "--gpus", "3"]) == 2
    assert "--gpus 3: this machine has 2 visible GPU(s); pass 0..2" in capsys.readouterr().err


def test_broke_graphs_reads_the_compiled_event_else_the_study_log(tmp_path, monkeypatch):
    """A run compiled in pieces: its "compiled" event's graph breaks, else (a record from before that event)
    Dynamo's warning in its study log beside it; None without either."""
    import functools

    import torch
    from lowprec.configs import get_config
    from lowprec.train import train

    home = REPO / "results" / "explode" / "survival"
    assert study.broke_graphs(home / "bf16rowsum-s3") and study.broke_graphs(home / "bf16rowsum-s2") is False
    old = tmp_path / "old"
    shutil.copytree(home / "bf16rowsum-s2", old)
    assert study.broke_graphs(old) is None, "no log beside it"
    warning = f"step 0\n{study.BREAK_WARNING} `torch._C._is_autocast_available.`\n"
    (tmp_path / "old.log").write_text(warning)
    assert study.broke_graphs(old)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch._dynamo.reset()
    train(get_config("smoke-cpu", [*RECIPE, "max_iters=2", "compile=true"]), tmp_path / "new")
    (tmp_path / "new.log").write_text(warning)
    assert study.broke_graphs(tmp_path / "new") is False, "the record's own event decides"
    report = study.status(study.load_queue(home / "queue.json"), home, None)
    lines = {line.split()[0]: line for line in report.splitlines() if line.strip()}
    assert "in pieces" in lines["bf16rowsum-s3"] and "in pieces" not in lines["bf16rowsum-s2"], "--status"

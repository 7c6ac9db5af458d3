"""Replay: kept checkpoints, AttentionSpec.with_fix / GPTConfig.with_fix, bit-exact replay with the run's own
setting, a different loss curve with the Fix switched, the comparison record, and the errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lowprec import cli
from lowprec.attention import AttentionSpec
from lowprec.configs import get_config
from lowprec.model import GPTConfig
from lowprec.replay import compare_runs, find_checkpoint, replay, replay_window
from lowprec.runs import load_run
from lowprec.train import CHECKPOINT, train

# bf16 autocast: with fp32 inputs the fa2 emulator keeps P̄ in fp32, whose tie tolerance (one_threshold of
# fp32) is ~6e-8, so the Fix never triggers and replays with it on and off would be identical.
FLASH = "emulated/precision=fa2"
STEPS, EVERY = 24, 8


def tiny(*overrides: str):
    return get_config("smoke-cpu", ["block_size=32", "n_embd=32", "batch_size=4", f"max_iters={STEPS}",
                                    "log_interval=1", "telemetry_interval=4", f"ckpt_interval={EVERY}",
                                    "dtype=bfloat16", f"attention={FLASH}", *overrides])


def recorder(losses: list[float]):
    return lambda step, entry: losses.append(entry["loss"].item())


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> tuple:
    """A 24-step run keeping its checkpoints at steps 8, 16, 24; its exact per-step losses."""
    out = tmp_path_factory.mktemp("replay") / "run"
    losses: list[float] = []
    train(tiny("ckpt_keep=true"), out, callback=recorder(losses))
    return out, losses


def spec_with_fix(text: str, beta: float | None) -> str:
    return str(AttentionSpec.parse(text).with_fix(beta))


def test_spec_with_fix():
    assert spec_with_fix("emulated/precision=fa2", 2) == "emulated/precision=fa2/fix=2"
    assert spec_with_fix("emulated/precision=fa2", 2.5) == "emulated/precision=fa2/fix=2.5"
    assert (spec_with_fix("triton/fix=7/precision=fa2:weights=e8m3", 2.0)
            == "triton/precision=fa2:weights=e8m3/fix=2")
    assert spec_with_fix("triton/precision=paper/fix=true", None) == "triton/precision=paper"
    assert spec_with_fix("emulated", None) == "emulated/precision=fa2"
    for spec in ("sdpa", "sdpa/sdpa_backend=flash", "math", "reference"):
        with pytest.raises(ValueError, match=f"backend '{spec.split('/')[0]}' cannot take a fix.*emulated"):
            spec_with_fix(spec, 2)
    with pytest.raises(ValueError, match="beta must be a finite number > 1"):
        spec_with_fix("emulated", 1)
    with pytest.raises(ValueError, match="backend must be one of"):
        spec_with_fix("flash", 2)

    mixed = GPTConfig(n_layer=3, attention="math", layer_attention={1: FLASH, 2: "sdpa"})
    fixed = mixed.with_fix(2)
    assert {k: str(v) for k, v in fixed.layer_attention.items()} == {1: FLASH + "/fix=2", 2: "sdpa"}
    assert str(fixed.attention) == "math"
    flash = GPTConfig(n_layer=2, attention=FLASH + "/fix=7", layer_attention={1: "math"})
    unfixed = flash.with_fix(None)
    assert (str(unfixed.attention), {k: str(v) for k, v in unfixed.layer_attention.items()}) == (FLASH,
                                                                                               {1: "math"})
    with pytest.raises(ValueError, match=r"no layer can take the Fix.*\['math', 'sdpa'\]"):
        GPTConfig(n_layer=2, attention="sdpa", layer_attention={0: "math"}).with_fix(2)


def test_ckpt_keep_keeps_every_checkpoint(original):
    out, _ = original
    ckpt_dir = out / "checkpoint"
    kept = sorted(p.name for p in ckpt_dir.glob("ckpt-*.pt"))
    assert kept == ["ckpt-000008.pt", "ckpt-000016.pt", "ckpt-000024.pt"]
    assert torch.load(ckpt_dir / "ckpt-000008.pt", weights_only=False)["step"] == 8
    assert torch.load(ckpt_dir / CHECKPOINT, weights_only=False)["step"] == 24
    events = load_run(out).events_of("checkpoint")
    assert [(e["step"], e["kept"]) for e in events] == [(s, str(ckpt_dir / f"ckpt-{s:06d}.pt"))
                                                          for s in (8, 16, 24)]


def test_replay_with_the_same_setting_is_bit_exact(original, tmp_path):
    out, losses = original
    replayed: list[float] = []
    # ends before the original did: the LR schedule must stay the original's (lr_decay_iters pinned)
    comparison = replay(out, 8, fix=False, end=16, out=tmp_path / "same", callback=recorder(replayed))
    assert replayed == losses[8:16]  # bit-identical floats
    run = load_run(tmp_path / "same")
    assert run.config["lr_decay_iters"] == STEPS and run.config["max_iters"] == 16
    assert run.config["model"]["attention"] == FLASH and run.summary["status"] == "finished"
    (start,) = run.events_of("start")
    assert (start["step"], start["replay_of"], start["from_step"], start["fix"]) == (8, str(out), 8, False)
    assert start["checkpoint"].endswith("ckpt-000008.pt")
    originals = {m["step"]: m for m in load_run(out).metrics}
    assert all(m["lr"] == originals[m["step"]]["lr"] and m["loss"] == originals[m["step"]]["loss"]
               for m in run.metrics)
    assert comparison["identical"] and comparison["first_difference"] is None
    assert (comparison["from_step"], comparison["to_step"], comparison["compared_steps"]) == (8, 15, 8)
    assert comparison["runs"]["original"]["status"] == "finished"
    assert comparison["runs"]["replay"]["max_loss"] == max(originals[s]["loss"] for s in range(8, 16))
    assert json.loads((tmp_path / "same" / "replay.json").read_text()) == json.loads(json.dumps(comparison))


def test_replay_with_the_fix_switched_differs(original, capsys):
    out, _ = original
    assert cli.main(["replay", str(out), "--from", "16", "--fix", "on", "--beta", "3"]) == 0
    printed = capsys.readouterr().out
    folder = out / "replay-from-16-fix-on"
    comparison = json.loads((folder / "replay.json").read_text())
    assert comparison == compare_runs(out, folder)
    assert (comparison["from_step"], comparison["to_step"]) == (16, STEPS - 1)  # default: to the last logged
    assert comparison["first_difference"]["step"] >= 16 and not comparison["identical"]
    assert comparison["runs"]["replay"]["attention"] == FLASH + "/fix=3"
    assert "first difference at step" in printed and "fix=3" in printed
    assert load_run(folder).events_of("start")[0]["beta"] == 3
    assert sorted(p.name for p in (folder / "checkpoint").iterdir()) == [".gitignore", CHECKPOINT,
                                                                        CHECKPOINT + ".sha256"]


def test_find_checkpoint_uses_the_latest_when_nothing_is_kept(tmp_path):
    train(tiny("max_iters=8", "telemetry_interval=0"), tmp_path / "run")
    ckpt_dir = tmp_path / "run" / "checkpoint"
    assert find_checkpoint(ckpt_dir, 8) == ckpt_dir / CHECKPOINT
    with pytest.raises(ValueError, match=r"step 4 .*available steps: \[8\].*ckpt_keep=true"):
        find_checkpoint(ckpt_dir, 4)


def test_replay_errors(original, tmp_path, capsys):
    out, _ = original
    assert cli.main(["replay", str(out), "--from", "12", "--fix", "off", "--out", str(tmp_path / "a")]) == 2
    assert "no checkpoint for step 12" in (err := capsys.readouterr().err) and "[8, 16, 24]" in err
    assert not (tmp_path / "a").exists()
    assert cli.main(["replay", str(out), "--from", "16", "--to", "10", "--fix", "off"]) == 2
    assert "nothing to replay" in capsys.readouterr().err
    assert cli.main(["replay", str(tmp_path / "nope"), "--from", "8", "--fix", "on"]) == 2
    assert "config.json does not exist" in capsys.readouterr().err
    assert cli.main(["replay", str(out), "--from", "8", "--fix", "maybe"]) == 2
    assert "invalid choice: 'maybe'" in capsys.readouterr().err
    assert cli.main(["replay", str(out), "--from", "8", "--fix", "on", "--steps", "2", "--to", "12"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err

    math_run = tmp_path / "math"
    train(tiny("attention=math", "max_iters=8", "telemetry_interval=0", "ckpt_keep=true"), math_run)
    for fix in ("on", "off"):
        assert cli.main(["replay", str(math_run), "--from", "8", "--steps", "2", "--fix", fix]) == 2
        assert "no layer can take the Fix" in capsys.readouterr().err
    sdpa_run = tmp_path / "sdpa"
    sdpa_run.mkdir()
    (sdpa_run / "config.json").write_text(json.dumps({"config": tiny("attention=sdpa").to_dict()}))
    assert cli.main(["replay", str(sdpa_run), "--from", "8", "--steps", "2", "--fix", "on"]) == 2
    assert "['sdpa'] use none of the backends" in capsys.readouterr().err

    args = ["replay", str(out), "--from", "16", "--steps", "2", "--fix", "off", "--out", str(tmp_path / "b")]
    assert cli.main(args) == 0
    assert cli.main(args) == 2
    assert "already holds a run" in capsys.readouterr().err


def test_compare_runs_needs_no_torch():
    code = "import sys, lowprec.replay; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_replay_checks_the_checkpoints_it_reads(original, tmp_path, capsys):
    """A corrupt kept checkpoint stops the replay in one line naming it; a corrupt ckpt.pt is left out, so the
    intact kept ones still serve."""
    run = Path(shutil.copytree(original[0], tmp_path / "run", ignore=shutil.ignore_patterns("replay-*")))

    def flip_a_byte(name: str) -> Path:
        path = run / "checkpoint" / name
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 1
        path.write_bytes(data)
        return path

    kept = flip_a_byte("ckpt-000008.pt")
    assert cli.main(["replay", str(run), "--from", "8", "--steps", "1", "--fix", "off"]) == 2
    assert capsys.readouterr().err == (f"lowprec replay: checkpoint {kept} is corrupt: its sha256 does not "
                                       f"match {kept.name}.sha256 (truncated or changed on disk)\n")
    assert not (run / "replay-from-8-fix-off" / "metrics.jsonl").exists()
    latest = flip_a_byte(CHECKPOINT)
    assert cli.main(["replay", str(run), "--from", "16", "--steps", "1", "--fix", "off"]) == 0
    assert f"replay: checkpoint {latest} is corrupt" in capsys.readouterr().err


def test_replay_window_starts_before_the_stop(original, tmp_path):
    out, _ = original
    assert replay_window(out, 10, 5) is None  # the run did not reach the stop rule
    stopped = tmp_path / "stopped"
    shutil.copytree(out, stopped)
    summary = json.loads((stopped / "summary.json").read_text())
    summary.pop("record_sha256")  # the record is edited: no longer the one the run sealed
    (stopped / "summary.json").write_text(json.dumps({**summary, "status": "diverged", "diverged_step": 20}))
    lines = (stopped / "metrics.jsonl").read_text().splitlines(keepends=True)
    (stopped / "metrics.jsonl").write_text("".join(lines[:21]))  # a diverged run logs up to its stop
    assert replay_window(stopped, 10, 5) == (8, 25)  # kept at 8, 16, 24: the last one <= 20 - 10
    assert replay_window(stopped, 4, 5) == (16, 25)
    assert replay_window(stopped, 15, 5) is None  # none kept by step 5

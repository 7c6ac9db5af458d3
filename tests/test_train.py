"""Trainer: smoke run, bit-exact resume after an interrupt, divergence stop, overrides, CLI, DDP on CPU."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import signal
import socket
from hashlib import sha256

import pytest
import torch
from lowprec import cli
from lowprec.attention import AttentionSpec
from lowprec.checkpoint import CheckpointError, load_checkpoint, save_atomic
from lowprec.configs import CONFIGS, TrainConfig, apply_overrides, get_config, paper_gpt2_small
from lowprec.runs import load_run, run_state
from lowprec.train import CHECKPOINT, lr_at, train


def tiny(**changes) -> TrainConfig:
    """smoke-cpu made even smaller: 1 s or less per run."""
    cfg = get_config("smoke-cpu", ["block_size=32", "n_embd=32", "batch_size=4", "max_iters=24",
                                   "log_interval=1", "telemetry_interval=4", "ckpt_interval=0"])
    return dataclasses.replace(cfg, **changes)


def losses_of(cfg: TrainConfig, out, resume: bool = False, stop_at: int | None = None,
              sig: int = signal.SIGINT) -> list[float]:
    losses: list[float] = []

    def callback(step: int, entry: dict) -> None:
        losses.append(entry["loss"].item())
        if step == stop_at:
            signal.raise_signal(sig)

    train(cfg, out, resume=resume, callback=callback)
    return losses


def params(out) -> dict:
    return torch.load(out / "checkpoint" / CHECKPOINT, weights_only=False)["model"]


def test_smoke_loss_decreases(tmp_path):
    cfg = get_config("smoke-cpu")
    summary = train(cfg, tmp_path)
    run = load_run(tmp_path)
    _, losses = run.series("loss")
    assert summary["status"] == run.summary["status"] == "finished"
    assert sum(losses[-3:]) / 3 < losses[0] - 1.5, losses
    steps, wq = run.telemetry("wq_norm")
    assert steps == list(range(0, cfg.max_iters, cfg.telemetry_interval))
    assert len(wq[0]) == cfg.model.n_layer and len(wq[0][0]) == cfg.model.n_head
    assert run.config["name"] == "smoke-cpu" and run.provenance["command"]
    assert (tmp_path / "checkpoint" / ".gitignore").read_text() == "*\n"
    val_steps, val = run.series("val_loss")
    assert val_steps == [0, 20, 40] and val[-1] < val[0] - 1.0
    corpus = run.events_of("start")[0]["corpus"]
    assert corpus["slices"] and corpus["train_tokens"] > 0 and len(corpus["train_sha256"]) == 64
    epochs = run.summary["tokens"] / corpus["train_tokens"]  # the record keeps 5 significant digits
    assert run.summary["repetition"] == pytest.approx(epochs, rel=1e-4)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_resume_after_interrupt_is_bit_exact(tmp_path, sig):
    cfg = tiny()
    full = losses_of(cfg, tmp_path / "full")
    first = losses_of(cfg, tmp_path / "split", stop_at=9, sig=sig)
    interrupted = load_run(tmp_path / "split")
    assert interrupted.summary["status"] == "interrupted" and interrupted.summary["steps"] == 10
    assert torch.load(tmp_path / "split" / "checkpoint" / CHECKPOINT, weights_only=False)["step"] == 10
    rest = losses_of(cfg, tmp_path / "split", resume=True)
    assert first + rest == full  # bit-identical floats
    a, b = params(tmp_path / "full"), params(tmp_path / "split")
    assert all(torch.equal(a[k], b[k]) for k in a)
    run_full, run_split = load_run(tmp_path / "full"), load_run(tmp_path / "split")
    assert run_split.summary["status"] == "finished"
    assert [m["loss"] for m in run_split.metrics] == [m["loss"] for m in run_full.metrics]
    assert run_split.telemetry("delta_error_cum") == run_full.telemetry("delta_error_cum")
    assert [e["event"] for e in run_split.events].count("resumed") == 1


def test_nan_stops_run_and_keeps_last_good_checkpoint(tmp_path):
    cfg = tiny(debug_nan_step=12, log_interval=5, ckpt_interval=5, telemetry_interval=0)
    summary = train(cfg, tmp_path)
    run = load_run(tmp_path)
    assert summary["status"] == run.summary["status"] == "diverged"
    assert run.summary["diverged_step"] == 12
    (event,) = run.events_of("divergence")
    assert event["step"] == 12 and "non-finite" in event["reason"]
    assert event["batch"]["seed"] == cfg.seed and event["batch"]["data_steps"] == [12]
    assert len(event["batch"]["starts"][0]) == cfg.batch_size
    ckpt = torch.load(tmp_path / "checkpoint" / CHECKPOINT, weights_only=False)
    assert ckpt["step"] == 10
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values())
    assert run.metrics[-1]["step"] == 12  # the offending step is logged even off the interval


def test_loss_ratio_divergence(tmp_path):
    summary = train(tiny(diverge_factor=1.0001, warmup_iters=2, telemetry_interval=0), tmp_path)
    (event,) = load_run(tmp_path).events_of("divergence")
    assert summary["status"] == "diverged" and "minimum since warmup" in event["reason"]


def test_lr_schedule_matches_paper():
    cfg = paper_gpt2_small()
    assert cfg.tokens_per_step == 524_288
    assert lr_at(cfg, 0) == pytest.approx(1e-3 / 2001)
    assert lr_at(cfg, 1999) == pytest.approx(1e-3 * 2000 / 2001)
    assert lr_at(cfg, 2000) == pytest.approx(1e-3)
    assert lr_at(cfg, 7000) == pytest.approx(0.99983e-3, rel=1e-5)
    assert lr_at(cfg, 600_000) == pytest.approx(1e-5)


def test_overrides_type_check_and_list_valid_keys():
    cfg = apply_overrides(get_config("smoke-cpu"), ["lr=0.01", "n_layer=3", "model.bias=true", "compile=none",
                                                    'layer_attention={"1": "sdpa"}', "hp_heads={\"0\": [1]}"])
    assert (cfg.lr, cfg.model.n_layer, cfg.model.bias, cfg.compile) == (0.01, 3, True, None)
    assert cfg.model.layer_attention == {1: AttentionSpec("sdpa")} and cfg.model.hp_heads == {0: [1]}
    with pytest.raises(ValueError, match="unknown key 'nope'.*max_iters.*n_layer"):
        apply_overrides(cfg, ["nope=1"])
    with pytest.raises(ValueError, match="max_iters='ten': expected int"):
        apply_overrides(cfg, ["max_iters=ten"])
    with pytest.raises(ValueError, match="key=value"):
        apply_overrides(cfg, ["max_iters"])
    with pytest.raises(ValueError, match="multiple of log_interval"):
        apply_overrides(cfg, ["telemetry_interval=7"])
    assert set(CONFIGS) == {"smoke-cpu", "gpu-6l", "gpu-12l-narrow", "paper-gpt2-small"}
    for name in CONFIGS:
        get_config(name)


def test_cli_train_resume_and_errors(tmp_path, capsys):
    out = str(tmp_path / "run")
    base = ["train", "--config", "smoke-cpu", "--out", out, "--set", "max_iters=6", "--set", "block_size=16"]
    assert cli.main(base) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"] == 6
    assert cli.main(["train", "--out", out, "--resume", "--set", "max_iters=8"]) == 0
    run = load_run(out)
    assert run.summary["steps"] == 8 and run.config["max_iters"] == 8
    assert cli.main(base) == 2  # the folder already holds a run
    assert "already holds a run" in capsys.readouterr().err
    assert cli.main(["train", "--config", "smoke-cpu", "--out", out + "2", "--set", "wat=1"]) == 2
    assert "valid keys" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank: int, world: int, port: int, cfg: TrainConfig, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        train(cfg, out)
    finally:
        torch.distributed.destroy_process_group()


def test_ddp_two_processes_match_one(tmp_path):
    one = tiny(batch_size=8, grad_accum=1, max_iters=8, telemetry_interval=4)
    two = dataclasses.replace(one, batch_size=4, grad_accum=2)
    assert one.tokens_per_step == two.tokens_per_step
    train(one, tmp_path / "one")
    torch.multiprocessing.spawn(_ddp_worker, args=(2, _free_port(), two, tmp_path / "two"), nprocs=2)
    a, b = load_run(tmp_path / "one"), load_run(tmp_path / "two")
    assert b.summary["status"] == "finished" and b.events_of("start")[0]["world_size"] == 2
    la, lb = a.series("loss")[1], b.series("loss")[1]
    assert la == pytest.approx(lb, rel=1e-5)
    pa, pb = params(tmp_path / "one"), params(tmp_path / "two")
    for k in pa:
        torch.testing.assert_close(pa[k], pb[k], rtol=1e-4, atol=1e-5)


def test_bench_train_runs_on_cpu(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["bench", "train", "--config", "smoke-cpu", "--backends", "math", "sdpa", "--steps", "10",
            "--warmup", "1", "--telemetry-interval", "5", "--set", "block_size=16", "--out", str(out)]
    assert cli.main(args) == 0
    report = json.loads(out.read_text())
    assert [r["attention"] for r in report["results"]] == ["math", "sdpa"]
    assert all(r["tokens_per_s"] > 0 and r["mfu"] is None and r["flops_per_token"] > 0
               for r in report["results"])
    overhead = report["telemetry_overhead"]
    assert overhead["on"]["telemetry_samples"] == 2 and overhead["per_sample"] > 0
    assert report["provenance"]["command"] and "tok/s" in capsys.readouterr().out


def test_a_failing_run_is_recorded_failed_and_frees_its_folder(tmp_path):
    def boom(step: int, entry: dict) -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        train(tiny(), tmp_path, callback=boom)  # fails at step 0, before any metrics
    run = load_run(tmp_path)
    assert run.summary["status"] == run_state(tmp_path) == "failed"
    assert run.summary["reason"] == "RuntimeError: boom" and run.events[-1]["event"] == "failed"
    assert train(tiny(max_iters=2), tmp_path)["status"] == "finished"  # a fresh start may take the folder


def test_config_rejects_what_cannot_run():
    cases = (("grad_clip=-1", "grad_clip must be >= 0"), ("seed=-1", r"seed must be in \[0, 2\*\*32\)"),
             ("seed=4294967296", "seed must be in"))
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            get_config("smoke-cpu", [change])


def test_checkpoints_carry_a_sha256_and_saving_is_atomic(tmp_path, monkeypatch):
    path, sums = tmp_path / "ckpt.pt", tmp_path / "ckpt.pt.sha256"
    save_atomic({"step": 1}, path)
    assert load_checkpoint(path) == {"step": 1}
    assert sums.read_text() == f"{sha256(path.read_bytes()).hexdigest()}  ckpt.pt\n"  # as sha256sum writes
    replace = os.replace

    def full_disk_at(target):
        """os.replace, failing as `target` is renamed in while the sums list the old and the new file."""
        def rename(src, dst):
            if str(dst) == str(target) and len(sums.read_text().splitlines()) == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
            replace(src, dst)
        return rename

    for target, kept in ((path, {"step": 1}), (sums, {"step": 2})):
        save_atomic({"step": 1}, path)
        monkeypatch.setattr(os, "replace", full_disk_at(target))
        with pytest.raises(OSError, match=f"cannot write {target}: No space left"):
            save_atomic({"step": 2}, path)
        monkeypatch.undo()
        assert load_checkpoint(path) == kept  # the old file, or the new one: either verifies
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt", "ckpt.pt.sha256"]  # no temp file

    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match=f"checkpoint {path} is corrupt"):
        load_checkpoint(path)
    sums.unlink()
    with pytest.raises(CheckpointError, match="has no checksum file ckpt.pt.sha256"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "nope.pt")


def test_a_resumed_finished_run_keeps_its_record(tmp_path, capsys):
    summary = train(tiny(max_iters=4), tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    assert train(tiny(max_iters=4), tmp_path, resume=True) == load_run(tmp_path).summary
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before
    assert "nothing to do" in capsys.readouterr().err and summary["final_loss"] is not None


def test_telemetry_leaves_the_weights_bit_identical(tmp_path):
    """A run with telemetry every 4 steps ends with the weights of the same run without it."""
    on = train(tiny(max_iters=12), tmp_path / "on")
    off = train(tiny(max_iters=12, telemetry_interval=0), tmp_path / "off")
    assert load_run(tmp_path / "on").telemetry("max_logit")[0] == [0, 4, 8]
    assert on["weights_sha256"] == off["weights_sha256"] and on["final_loss_hex"] == off["final_loss_hex"]
    other = train(tiny(max_iters=12, seed=2), tmp_path / "seed2")
    assert other["weights_sha256"] != on["weights_sha256"]  # the digest does tell weights apart


def test_deterministic_is_on_for_new_runs_and_off_for_older_records(tmp_path):
    assert tiny().deterministic and not get_config("smoke-cpu", ["deterministic=false"]).deterministic
    old = tiny().to_dict()
    del old["deterministic"]  # a record made before the key existed
    assert TrainConfig.from_dict(old).deterministic is False
    train(tiny(max_iters=2, deterministic=False), tmp_path / "a")
    assert not torch.are_deterministic_algorithms_enabled()
    train(tiny(max_iters=2), tmp_path / "b")
    assert torch.are_deterministic_algorithms_enabled()


def test_a_compiled_run_records_its_graph_breaks(tmp_path, monkeypatch, capsys):
    """The record's "compiled" event: the graphs and graph breaks of the first step (torch.compile with its
    eager backend here); a break put into the GPT's forward is recorded with its reason and said on stderr."""
    import functools

    import lowprec.model as model_module

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    cfg = tiny(compile=True, max_iters=2)
    torch._dynamo.reset()
    train(cfg, tmp_path / "whole")
    (event,) = load_run(tmp_path / "whole").events_of("compiled")
    assert event["step"] == 0 and event["graph_breaks"] == 0 and event["graphs"] >= 1, event
    assert "torch.compile broke" not in capsys.readouterr().err

    embed = model_module.embed

    def breaking(table: torch.nn.Embedding, idx: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return embed(table, idx)

    monkeypatch.setattr(model_module, "embed", breaking)
    torch._dynamo.reset()
    train(cfg, tmp_path / "broken")
    (event,) = load_run(tmp_path / "broken").events_of("compiled")
    assert event["graph_breaks"] >= 1 and "graph_break()" in event["break_reasons"][0], event
    assert "torch.compile broke the model's forward" in capsys.readouterr().err

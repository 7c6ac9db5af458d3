"""`lowprec experiment bias-noise`: the bias-to-noise statistics on synthetic gradients, and the command on a
tiny CPU run."""

from __future__ import annotations

import json
import math

import pytest
import torch
from lowprec.cli import main as lowprec_main
from lowprec.configs import get_config
from lowprec.instruments.bias_noise import bias_noise
from lowprec.train import train


def test_statistics_recover_a_planted_rank1_bias() -> None:
    gen = torch.Generator().manual_seed(0)
    d, c, n, bias, sigma = 8, 12, 400, 0.05, 1.0
    u, v = torch.randn(d, generator=gen), torch.randn(c, generator=gen)
    r = torch.outer(u / u.norm(), v / v.norm())
    g_hp = sigma * torch.randn(n, d, c, generator=gen)
    g_lp = g_hp + bias * r + 0.01 * torch.randn(n, d, c, generator=gen)  # error: rank 1 plus a little noise
    stats, found = bias_noise(g_lp, g_hp, tokens_per_batch=1000, tokens_per_step=4000,
                              adam_v=torch.full((d, c), 4.0), eps=0.0)
    assert abs((found * r).sum()) > 0.99                      # the planted direction
    assert stats.rank1 > 0.9 and stats.bias_norm == pytest.approx(bias, rel=0.05)
    assert stats.t > 100 and stats.biased                     # 400 batches of a clean bias
    assert stats.noise == pytest.approx(sigma, rel=0.1)       # <G_hp, R> ~ N(0, sigma^2)
    assert stats.critical_tokens == pytest.approx(1000 * (sigma / bias) ** 2, rel=0.2)
    # Adam with v = 4: drift bias/2 per unit lr and step, walk sigma/2 per batch of 1000 tokens
    assert stats.drift == pytest.approx(bias / 2, rel=0.05)
    assert stats.walk == pytest.approx(sigma / 2, rel=0.1)
    assert stats.steps_to_drift == pytest.approx((sigma / bias) ** 2 / 4, rel=0.2)
    same, _ = bias_noise(g_hp, g_hp, 1000, 1000)
    assert same.bias_norm == 0 and same.t == 0 and not same.biased
    assert math.isinf(same.critical_tokens) and same.drift is None


def test_command_on_a_tiny_run(tmp_path, capsys) -> None:
    cfg = get_config("smoke-cpu", ["attention=emulated/precision=fa2", "dtype=bfloat16", "max_iters=20",
                                   "ckpt_interval=10", "ckpt_keep=true", "telemetry_interval=0",
                                   "eval_interval=0"])
    train(cfg, tmp_path / "run")
    out = tmp_path / "bn.json"
    ckpts = [str(tmp_path / "run" / "checkpoint" / f"ckpt-{s:06d}.pt") for s in (10, 20)]
    code = lowprec_main(["experiment", "bias-noise", str(tmp_path / "run"), "--ckpt", ckpts[0], "--ckpt",
                         ckpts[1], "--spec", "emulated/precision=fa2", "--spec", "emulated/precision=paper",
                         "--batches", "4", "--batch-size", "2", "--out", str(out)])
    assert code == 0
    record = json.loads(out.read_text())
    assert [c["step"] for c in record["checkpoints"]] == [10, 20]
    last = record["checkpoints"][1]["specs"]
    assert set(last) == {"emulated/precision=fa2", "emulated/precision=paper"}
    heads = last["emulated/precision=paper"]["heads"]
    assert len(heads) == 2 and len(heads[0]) == 2  # smoke-cpu: 2 layers x 2 heads
    assert all(0 < h["rank1"] <= 1 and h["bias_norm"] > 0 and h["steps_to_drift"] > 0 for row in heads
               for h in row)
    assert len(last["emulated/precision=paper"]["alignment"]) == 2  # R compared with the previous checkpoint
    assert "steps to drift" in capsys.readouterr().out
    assert lowprec_main(["experiment", "bias-noise", str(tmp_path / "run"), "--ckpt", ckpts[0],
                         "--batches", "1"]) == 2
    assert "--batches must be >= 2" in capsys.readouterr().err


def test_criterion_predicts_the_positive_control() -> None:
    """Where chapter 4's control drifts (fa2 without the Fix; the paper placement with it), the criterion sees
    a bias along the control's R that beats the noise within a few steps; where it does not, no bias."""
    from lowprec.instruments.positive_control import ControlConfig, criterion_probe

    cfg = ControlConfig()
    lowp = criterion_probe(cfg, "fa2", "lowp", batches=40)
    assert lowp["biased"] and lowp["r_cos"] > 0.99 and lowp["steps_to_drift"] < 20
    for placement, arm in (("fa2", "fix"), ("fa2", "fp32pv"), ("paper", "lowp")):
        assert not criterion_probe(cfg, placement, arm, batches=40)["biased"], (placement, arm)
    assert criterion_probe(cfg, "paper", "fix", batches=40)["biased"]

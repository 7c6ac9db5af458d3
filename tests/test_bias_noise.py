"""`lowprec experiment bias-noise`: the bias-to-noise statistics on synthetic gradients, where R comes from on
planted keys, and the command on a tiny CPU run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from lowprec.attention import AttentionSpec
from lowprec.checkpoint import load_checkpoint
from lowprec.cli import main as lowprec_main
from lowprec.configs import TrainConfig, apply_overrides, get_config
from lowprec.instruments.bias_noise import (
    HeadBias,
    adam_second_moment,
    attention_inputs,
    bias_noise,
    format_table,
    head_sources,
    layer_sources,
    norm_errors,
    projection_grads,
    r_alignment,
    run_batch,
)
from lowprec.instruments.explode import ARMS
from lowprec.instruments.lowrank import key_shares
from lowprec.model import GPT
from lowprec.runs import load_run
from lowprec.telemetry import scores
from lowprec.train import load_tokens, train


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


@pytest.mark.parametrize("batches", [8, 32])
def test_noise_alone_is_not_biased(batches: int) -> None:
    """A gradient error of pure noise in a head-sized slice (64 x 384): the cross-fitted t stays small.
    Projected on the top singular direction of its own mean, the same noise gives t ~ 28 every time."""
    gen = torch.Generator().manual_seed(batches)
    ts = []
    for _ in range(40):
        g_hp = torch.randn(batches, 64, 384, generator=gen)
        stats, _ = bias_noise(g_hp + 0.1 * torch.randn(batches, 64, 384, generator=gen), g_hp, 1000, 1000)
        ts.append(stats.t)
    assert sum(abs(t) >= 4 for t in ts) <= 2, ts
    assert abs(sum(ts) / len(ts)) < 1.0  # centred on 0


def test_sources_tell_a_planted_sink_from_a_shared_mean_key() -> None:
    """Keys and inputs with a common offset each: with a sink at key position 0 that every query attends to,
    key 0 holds M and M's key factor is the sink key, not the mean key; with near-uniform attention M is the
    mean key x the mean input, spread over many positions."""
    gen = torch.Generator().manual_seed(0)
    b, n, d, c = 4, 32, 8, 12
    e = torch.eye(d)
    x = torch.randn(c, generator=gen) + 0.3 * torch.randn(b, n, c, generator=gen)
    keys = e[1] + 0.1 * torch.randn(b, 1, n, d, generator=gen)  # every key: the offset e1 plus a little noise
    sink_keys = keys.clone()
    sink_keys[:, :, 0] = 8 * e[0]  # a sink key along e0, which every query (along e0) attends to
    q_sink = 4 * e[0] + 0.1 * torch.randn(b, 1, n, d, generator=gen)
    (sink,), k_mean, x_mean = layer_sources(x, q_sink, sink_keys)
    assert sink["key0_share"] > 0.99 and sink["top_position"] == 0 and sink["half_positions"] == 1
    assert sink["mean_key_cos"] < 0.3 < 0.99 < sink["mean_input_cos"]  # M = sink key x mean input
    assert sink["dominant_rows"] == 1.0 and sink["early_dominant_rows"] == 0.0  # 32 rows: one 64-key tile
    r = torch.outer(e[0].double(), x_mean / x_mean.norm())  # R = sink key x mean input
    assert r_alignment(r, k_mean[0], x_mean) == pytest.approx({"r_key_cos": sink["mean_key_cos"],
                                                               "r_input_cos": 1.0}, abs=1e-3)

    q_flat = 0.01 * torch.randn(b, 1, n, d, generator=gen)  # near-uniform causal attention: no sink
    (flat,), k_mean, x_mean = layer_sources(x, q_flat, keys)
    assert flat["key0_share"] < 0.2 and flat["half_positions"] >= 5
    assert flat["dominant_rows"] == 1 / n and flat["early_dominant_rows"] == 0.0  # row 0 sees key 0 alone
    assert min(flat["mean_key_cos"], flat["mean_input_cos"], flat["pk_energy"]) > 0.99
    r = torch.outer(k_mean[0] / k_mean[0].norm(), x_mean / x_mean.norm())
    assert r_alignment(r, k_mean[0], x_mean) == pytest.approx({"r_key_cos": 1.0, "r_input_cos": 1.0})
    known = r_alignment(torch.outer(e[0], torch.eye(c)[1]), torch.tensor([3.0, 4, 0, 0, 0, 0, 0, 0]),
                        torch.eye(c)[1] + torch.eye(c)[2])
    assert known == pytest.approx({"r_key_cos": 0.6, "r_input_cos": 1 / math.sqrt(2)})


def test_early_dominant_rows_count_a_dominant_key_in_an_earlier_tile() -> None:
    """130 rows (three 64-key tiles): rows 0-63 attend to key 0 in their own tile; rows 64-129 either to key 0
    (an earlier tile: counted) or, half of them, to themselves (their own tile: dominant, not early)."""
    n = 130
    p = torch.zeros(1, n, n, dtype=torch.float64)
    p[0, :, 0] = 1.0
    for t in range(64, n, 2):
        p[0, t] = 0.0
        p[0, t, t] = 1.0
    (found,) = [head_sources(p, torch.randn(1, n, 4, dtype=torch.float64), torch.randn(1, n, 3))]
    assert found["dominant_rows"] == 1.0
    assert found["early_dominant_rows"] == pytest.approx(33 / n)  # rows 65, 67, ..., 129


def planted_keys(batch: int, seq: int, first: float, second: float | None = None, head_dim: int = 64,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 q, k (batch, 2 heads, seq, head_dim): keys ~ N(0, 1) scores, except key 0 scoring `first` and,
    if given, key 1 scoring `first - second` (a near tie), on coordinates of their own."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, 2, seq, head_dim, generator=g) for _ in range(2))
    q[..., -2:], k[..., -2:] = torch.tensor([1.0, 1.0]), 0.0
    k[:, :, 0], k[:, :, 0, -1] = 0.0, first * math.sqrt(head_dim)
    if second is not None:
        k[:, :, 1], k[:, :, 1, -1] = 0.0, first * math.sqrt(head_dim)
        k[:, :, 1, -2] = -second * math.sqrt(head_dim)
    return q.bfloat16(), k.bfloat16()


def test_norm_errors_see_a_swamped_row_sum_and_fa2s_mismatch() -> None:
    """norm_error = sum(P̄) / l̃ - 1 per head: one dominant key first in 1,024-key causal rows makes a bf16
    running row sum lose the later tiles (O too small in every long row); near-tied maxima make fa2's P̄
    round up to 1 while l keeps the unrounded weights (O too large); nothing rounded, or l summed from the
    rounded weights (consistent): nothing, or fp32 noise."""
    def errors(arm: str, q: torch.Tensor, k: torch.Tensor) -> list[dict]:
        return norm_errors(q, k, AttentionSpec.parse(f"emulated/precision={ARMS.get(arm, arm)}"))

    swamped = planted_keys(4, 1024, first=10.0)  # key 0 holds ~0.93 of a full row's weight
    assert all(h["norm_error"] < -0.005 and h["norm_error_t"] < -10 for h in errors("bf16rowsum", *swamped))
    assert all(h["norm_error"] == 0.0 for arm in ("fp32pv", "fp32") for h in errors(arm, *swamped))
    tied = planted_keys(8, 128, first=6.0, second=2.0**-10)  # key 1's P̄ = e^-(2^-10) rounds to 1.0 in bf16
    assert all(h["norm_error"] > 1e-4 and h["norm_error_t"] > 10 for h in errors("fa2", *tied))
    assert all(abs(h["norm_error"]) < 1e-6 for arm in ("consistent", "fp32pv") for h in errors(arm, *tied))
    ones = AttentionSpec.parse("emulated/precision=fa2:weights=e8m3@ones")
    assert norm_errors(*tied, ones) == [{"norm_error": None, "norm_error_t": None}] * 2


def test_projection_grads_and_moments_split_c_attn_into_w_q_and_w_k() -> None:
    """c_attn's weight rows are [W_Q; W_K; W_V], each n_embd x n_embd and split by head into head_dim rows."""
    model = GPT(get_config("smoke-cpu").model)
    c = model.config
    d = c.n_embd // c.n_head
    optimizer = torch.optim.AdamW(model.parameters())
    for attn in model.attention_layers():
        attn.c_attn.weight.grad = torch.arange(attn.c_attn.weight.numel(), dtype=torch.float32).view_as(
            attn.c_attn.weight)
    g = projection_grads(model)
    assert g.shape == (2, c.n_layer, c.n_head, d, c.n_embd)
    assert g[0, 0, 1, 0, 0] == d * c.n_embd and g[1, 0, 0, 0, 0] == c.n_embd * c.n_embd  # head 1 of W_Q; W_K
    assert adam_second_moment(model, optimizer) is None  # no step taken yet
    optimizer.step()
    v = adam_second_moment(model, optimizer)
    grad = model.attention_layers()[0].c_attn.weight.grad
    assert torch.allclose(v[1, 0, 0, 0], grad[c.n_embd] ** 2)  # bias-corrected after one step: g²


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
    assert all(0 < h["rank1"] <= 1 and math.isfinite(h["bias_norm"]) and h["steps_to_drift"] > 0
               for row in heads for h in row)  # cross-fitted bias_norm: about 0, either sign, without a bias
    assert len(last["emulated/precision=paper"]["alignment"]) == 2  # R compared with the previous checkpoint
    assert all(0 <= h[key] <= 1 + 1e-9 for row in heads for h in row for key in ("r_key_cos", "r_input_cos"))
    assert all(abs(h["norm_error"]) < 0.05 and math.isfinite(h["norm_error_t"]) for row in heads for h in row)
    heads_k = last["emulated/precision=paper"]["heads_k"]  # the same statistics for W_K
    assert [len(row) for row in heads_k] == [2, 2] and set(heads_k[0][0]) == set(HeadBias.__annotations__)
    assert all(0 < h["rank1"] <= 1 and math.isfinite(h["t"]) for row in heads_k for h in row)
    assert heads_k != [[{k: h[k] for k in HeadBias.__annotations__} for h in row] for row in heads]
    # where R comes from (--keys-batches, default 4): per checkpoint, layer and head
    assert record["keys_batches"] == 4
    sources = record["checkpoints"][1]["sources"]
    assert len(sources) == 2 and all(len(row) == 2 for row in sources)
    for s in (s for row in sources for s in row):
        assert 0 <= s["top_position"] < 64 and 1 <= s["half_positions"] <= 64
        assert abs(s["top_share"]) >= abs(s["key0_share"])
        assert all(0 <= s[key] <= 1 + 1e-9 for key in ("mean_key_cos", "mean_input_cos", "pk_energy"))
        assert 0 <= s["early_dominant_rows"] <= s["dominant_rows"] <= 1
    out_text = capsys.readouterr().out
    assert "steps to drift" in out_text and "key0" in out_text and "norm %" in out_text and "W_K" in out_text
    # layer 0 (its X, q, k come before any attention) recomputed from the checkpoint on the same batches:
    # its shares add up to 1 over key positions, and the record holds its numbers
    run = load_run(tmp_path / "run")
    cfg = apply_overrides(TrainConfig.from_dict(run.config), ["batch_size=2"])
    model = GPT(cfg.model)
    model.load_state_dict(load_checkpoint(Path(ckpts[1]))["model"])
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    tokens = load_tokens(cfg.data).train
    layer0 = [attention_inputs(model, run_batch(tokens, cfg, 20, i, "cpu")[0], autocast)[0] for i in range(4)]
    x, q, k = (torch.cat(parts) for parts in zip(*layer0, strict=True))
    p = torch.softmax(scores(q, k)[0], dim=-1)
    shares = key_shares(p, k, x)
    assert shares.sum(-1) == pytest.approx(torch.ones(2, dtype=torch.float64))
    assert shares[:, 0].tolist() == pytest.approx([s["key0_share"] for s in sources[0]], rel=1e-4, abs=1e-9)
    for found, recorded in zip(layer_sources(x, q, k)[0], sources[0], strict=True):
        assert found == pytest.approx(recorded, rel=1e-4, abs=1e-9)  # the record keeps 6 digits
    # a record without the new numbers (--keys-batches 0, or an old record) still prints
    old = {**record, "checkpoints": [{key: value for key, value in c.items() if key != "sources"}
                                     for c in record["checkpoints"]]}
    assert "key0" not in format_table(old) and "steps to drift" in format_table(old)
    assert lowprec_main(["experiment", "bias-noise", str(tmp_path / "run"), "--ckpt", ckpts[0],
                         "--batches", "1"]) == 2
    assert "--batches must be >= 2" in capsys.readouterr().err
    assert lowprec_main(["experiment", "bias-noise", str(tmp_path / "run"), "--ckpt", ckpts[0],
                         "--batches", "4", "--keys-batches", "5"]) == 2
    assert "--keys-batches must be between 0 and --batches (4), got 5" in capsys.readouterr().err


def test_criterion_predicts_the_positive_control() -> None:
    """Where chapter 4's control drifts (fa2 without the Fix; the paper placement with it), the criterion sees
    a bias along the control's R that beats the noise within a few steps; where it does not, no bias."""
    from lowprec.instruments.bias_noise import criterion_probe
    from lowprec.instruments.control import ControlConfig

    cfg = ControlConfig()
    lowp = criterion_probe(cfg, "fa2", "lowp", batches=40)
    assert lowp["biased"] and lowp["r_cos"] > 0.99 and lowp["steps_to_drift"] < 20
    for placement, arm in (("fa2", "fix"), ("fa2", "fp32pv"), ("paper", "lowp")):
        assert not criterion_probe(cfg, placement, arm, batches=40)["biased"], (placement, arm)
    assert criterion_probe(cfg, "paper", "fix", batches=40)["biased"]

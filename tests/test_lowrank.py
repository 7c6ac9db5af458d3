"""The low-rank analysis (lowprec.instruments.lowrank): its definitions agree with the training telemetry's,
the key shares and alignments find what is planted, the record windows and signs are read right, the control
replay is the control's run, and the per-key error split adds up to the kernel's error. Seeded; one core."""

from __future__ import annotations

import math

import pytest
import torch
from lowprec.attention import reference_attention
from lowprec.instruments import lowrank
from lowprec.instruments.bias import CASES, adversarial_inputs
from lowprec.instruments.control import ControlConfig, make_problem, train_treatment
from lowprec.runs import RunWriter, load_run


def causal_inputs(seed: int = 0, b: int = 2, h: int = 2, t: int = 12, d: int = 8, c: int = 16):
    """x (B, T, C) and bf16-valued q, k, v, an output o near the exact one, and a gradient do."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, c, generator=g) + 2.0  # a shared offset, as real inputs have
    q, k, v = (torch.randn(b, h, t, d, generator=g).bfloat16().float() for _ in range(3))
    o = reference_attention(q, k, v, causal=True)[0].bfloat16().float()
    do = torch.randn(b, h, t, d, generator=g)
    return x, q, k, v, o, do


def test_key_shares_find_a_planted_sink_and_add_up_to_one():
    x, q, k, _, _, _ = causal_inputs(seed=1)
    p = torch.zeros(2, 2, 12, 12, dtype=torch.float64)
    p[..., 0] = 0.9  # every row attends to key 0 ...
    p[..., 1:] = 0.1 / 11  # ... and a little to the rest
    shares = lowrank.key_shares(p, k, x)
    torch.testing.assert_close(shares.sum(-1), torch.ones(2, dtype=torch.float64))
    assert (shares[:, 0] > 0.8).all()
    weights = torch.randn(2, 2, 12, generator=torch.Generator().manual_seed(2))
    weighted = lowrank.key_shares(p, k, x, weights)
    torch.testing.assert_close(weighted.sum(-1), torch.ones(2, dtype=torch.float64))


def test_mean_alignment_finds_a_shared_key_offset():
    g = torch.Generator().manual_seed(3)
    offset = torch.randn(8, generator=g)
    k = 4 * offset + 0.3 * torch.randn(2, 1, 12, 8, generator=g)  # keys share a large offset
    x = torch.randn(2, 12, 16, generator=g) + 3.0
    p = torch.softmax(torch.randn(2, 1, 12, 12, generator=g, dtype=torch.float64), -1)  # attention anywhere
    align = lowrank.mean_alignment(p, k, x)
    assert align["key"].item() > 0.99 and align["input"].item() > 0.99 and align["pk_energy"].item() > 0.95
    unshared = lowrank.mean_alignment(p, torch.randn(2, 1, 12, 8, generator=g), x)
    assert unshared["pk_energy"].item() < 0.9


def test_singular_shares_and_cosine():
    rank1 = torch.outer(torch.arange(1.0, 5.0), torch.arange(1.0, 4.0))
    shares = lowrank.singular_shares(rank1)
    assert shares[0].item() == pytest.approx(1.0) and shares[1:].abs().max().item() < 1e-12
    assert lowrank.singular_shares(torch.eye(3)).tolist() == pytest.approx([1 / 3] * 3)
    assert lowrank.cosine(rank1, -2 * rank1) == pytest.approx(-1.0)


def write_record(path, samples: int = 8) -> None:
    """A run whose layer-0 head 0 has a δ error alternating in sign and a δ-weighted cosine that follows
    it."""
    writer = RunWriter(path, {"warmup_iters": 0})
    for i in range(samples):
        sign = 1.0 if i % 2 == 0 else -1.0
        telemetry = {
            "rank1_cos": [[0.6, 0.4], [0.1, 0.1]],
            "rank1_cos_prev": [[None, None], [None, None]] if i == 0 else [[0.9, 0.7], [0.2, 0.2]],
            "delta_term_cos_prev": [[None, None], [None, None]] if i == 0 else [[-1.0, 0.1 * i], [0.0, 0.0]],
            "delta_error": [[sign, 1.0], [1.0, 1.0]],
        }
        writer.log({"step": 10 * i, "tokens": i, "loss": 1.0, "lr": 1.0, "grad_norm": 1.0, "time_s": 1.0,
                    "telemetry": telemetry})
    writer.update_summary(status="finished")
    writer.close()


def test_run_similarity_windows_means_and_signs(tmp_path):
    write_record(tmp_path)
    run = load_run(tmp_path)
    sim = lowrank.run_similarity(run)  # samples 4..7
    assert sim.steps == (40, 70) and sim.samples == 4
    torch.testing.assert_close(sim.mean[0], torch.tensor([0.5, 0.8, (-1.0 * 4 + 0.1 * (4 + 5 + 6 + 7)) / 8],
                                                         dtype=torch.float64))
    assert sim.abs_delta[1].item() == 0.0 and sim.head_t[0, 0].item() == -math.inf
    # head (0, 0): -1 with δe(t)δe(t-1) = -1 (agrees); head (0, 1): + with + (agrees); layer 1: 0 (never)
    assert sim.sign_agreement == pytest.approx(0.5)
    early = lowrank.run_similarity(run, start=0.0, before=30)  # samples 1, 2 (sample 0 has no previous)
    assert early.steps == (10, 20) and early.samples == 2
    with pytest.raises(ValueError, match="fewer than 2"):
        lowrank.run_similarity(run, before=15)


def test_control_replay_is_the_control_run_and_its_error_points_along_minus_r():
    cfg = ControlConfig(steps=12)
    prob = make_problem(cfg)
    weights = lowrank.control_weights(cfg, at=(0, 6, 12))
    recorded = train_treatment(cfg, "fa2", "lowp")["series"]["w_r"]
    assert torch.equal(weights[0], prob.w0)
    for step in (6, 12):
        assert float(((weights[step] - prob.w0) * prob.r).sum()) == recorded[step - 1]
    terms = lowrank.control_terms(cfg, prob.w0, batches=3)
    error = terms["g_lp"] - terms["g_hp"]
    assert (lowrank.singular_shares(error)[:, 0] > 0.999).all()  # rank 1
    assert all(float((e * prob.r).sum()) < 0 for e in error)  # along -R: descent pushes W_Q along +R
    assert (terms["delta_err"].sum((1, 2, 3)) > 0).all()  # the one-signed δ error behind it
    with pytest.raises(ValueError, match="reference"):
        lowrank.control_terms(cfg, prob.w0, treatment="reference", batches=1)


def test_key_errors_add_up_to_the_kernel_error_and_jump_at_rounded_ones():
    near = lowrank.key_errors(*adversarial_inputs(CASES["near-k4"], rows=256, seed=0))
    scale = near["o_kernel"].abs().mean()
    assert (near["o_cum"][:, -1] - near["o_kernel"]).abs().max() < 1e-3 * scale
    assert near["rounded_to_one"].sum(-1).eq(3).all() and near["row_max"].sum(-1).eq(1).all()
    ones = near["rounded_to_one"]
    assert ((near["delta"] * ones).sum(-1) > 0).all()  # V < 0 and dO < 0: a positive δ error at every row
    unique = lowrank.key_errors(*adversarial_inputs(CASES["unique"], rows=64, seed=0))
    assert unique["rounded_to_one"].sum() == 0
    long = [torch.cat([t, t], 2) for t in adversarial_inputs(CASES["unique"], rows=64, seed=0)]
    with pytest.raises(ValueError, match="one tile"):
        lowrank.key_errors(*long)


def test_tiny_lm_terms_shapes_and_eq2():
    model, run = lowrank.train_tiny_lm(lowrank.tiny_lm_config(steps=20))
    assert run.summary["status"] == "finished" and run.summary["steps"] == 20
    layers = lowrank.lm_terms(model, batches=2, batch_size=2)
    c = model.config
    assert len(layers) == c.n_layer
    d, head_dim = layers[1], c.n_embd // c.n_head
    assert d["g_lp"].shape == d["g_hp"].shape == d["pred"].shape == (2, c.n_head, head_dim, c.n_embd)
    assert d["p"].shape == (2, 2, c.n_head, c.block_size, c.block_size)
    torch.testing.assert_close(d["p"].sum(-1), torch.ones_like(d["p"].sum(-1)))  # rows of an exact softmax
    error = d["g_lp"] - d["g_hp"]
    assert all(lowrank.cosine(error[i, h], d["pred"][i, h]) > 0.5 for i in range(2) for h in range(c.n_head))

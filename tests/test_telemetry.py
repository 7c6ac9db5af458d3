"""Telemetry against direct computation on a small model and on crafted scores."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from lowprec.attention import AttentionSpec, reference_attention
from lowprec.attention.fix import ties
from lowprec.model import GPT, GPTConfig
from lowprec.telemetry import SIGNALS, Telemetry, head_weights, layer_signals, scores

NEAR_TIE_GAP = AttentionSpec("math").near_tie_window(torch.bfloat16)  # the window of a bf16 run


def tie_counts(s32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return ties(s32, s32.amax(-1), NEAR_TIE_GAP)

AUTOCAST = torch.autocast("cpu", dtype=torch.bfloat16)


def small_model(seed: int = 0, **kw) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**dict(vocab_size=61, block_size=12, n_layer=2, n_head=3, n_embd=24,
                                   attention="math"), **kw}))


def batch(model: GPT, seqs: int = 2, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(model.config.vocab_size, (seqs, model.config.block_size + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def test_spectral_norms_match_matrix_norm():
    model = small_model()
    tel = Telemetry(model)
    w = head_weights(model)  # (L, 2, H, D, C)
    exact = torch.linalg.matrix_norm(w, ord=2)
    torch.testing.assert_close(tel.spectral_norms(iters=300), exact, rtol=1e-4, atol=0)
    d = 24 // 3
    assert torch.equal(w[1, 1, 2], model.blocks[1].attn.c_attn.weight[24 + 2 * d: 24 + 3 * d])  # W_K, head 2
    # warm start: after the weights move a little, two iterations from the old vectors are enough
    with torch.no_grad():
        model.blocks[0].attn.c_attn.weight.mul_(1.01)
    exact = torch.linalg.matrix_norm(head_weights(model), ord=2)
    torch.testing.assert_close(tel.spectral_norms(iters=2), exact, rtol=1e-3, atol=0)


def test_tie_counts_on_crafted_scores():
    rows = torch.tensor([
        [1.0, 3.0, 3.0, 0.0],                      # exact repeated max
        [1.0, 3.0, 3.0 - 1e-3, 0.0],               # near tie (P̄ rounds to 1.0 in bf16)
        [1.0, 3.0, 3.0 - 3e-3, 0.0],               # not a tie (P̄ = 0.997 rounds below 1)
        [1.0, 3.0, 2.0, float("-inf")],            # unique max, masked entry
    ])
    exact, near = tie_counts(rows)
    assert exact.tolist() == [True, False, False, False]
    assert near.tolist() == [True, True, False, False]
    # the window is exactly where exp(s - max) rounds to 1.0 in bf16
    for gap in (NEAR_TIE_GAP * 0.999, NEAR_TIE_GAP * 1.001):
        one = torch.exp(torch.tensor(-gap)).bfloat16().item() == 1.0
        assert one == (gap < NEAR_TIE_GAP)
    # from crafted q, k (head_dim 1, scale 1): query 3 sees keys [2, 2, 1, 0.5] -> exact tie
    q = torch.ones(1, 1, 4, 1)
    k = torch.tensor([2.0, 2.0, 1.0, 0.5]).view(1, 1, 4, 1)
    s64, s32 = scores(q, k)
    assert s32[0, 0, 3].tolist() == [2.0, 2.0, 1.0, 0.5] and math.isinf(s32[0, 0, 0, 1])
    exact, near = tie_counts(s32)
    assert exact[0, 0].tolist() == [False, True, True, True]


def test_capture_gives_the_autograd_dO_and_leaves_training_state_alone():
    model = small_model()
    x, y = batch(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    captured = Telemetry(model).capture(x, y, AUTOCAST)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    outs = {}

    def keep(layer, x_in, q, k, v, o):
        o.retain_grad()
        outs[layer] = o

    for attn in model.attention_layers():
        attn.probe = keep
    with AUTOCAST:
        _, loss = model(x, y)
    loss.backward()
    for layer, (_, _, _, _, o, do) in enumerate(captured):
        assert torch.equal(o, outs[layer].detach()) and torch.equal(do, outs[layer].grad)


def test_delta_error_and_rank1_terms_match_explicit_computation():
    model = small_model()
    x, y = batch(model)
    tel = Telemetry(model)
    xin, q, k, v, o, do = tel.capture(x, y, AUTOCAST)[1]
    assert o.dtype == torch.bfloat16
    sig = layer_signals(xin, q, k, v, o, do, window=NEAR_TIE_GAP)
    o_hp, _ = reference_attention(q, k, v)
    delta = (do.double() * o.double()).sum(-1) - (do.double() * o_hp).sum(-1)
    torch.testing.assert_close(sig["delta_error"], delta.sum((0, 2)))
    torch.testing.assert_close(sig["delta_error_abs"], delta.abs().sum((0, 2)))
    assert sig["delta_error_abs"].min() > 0  # bf16 O really differs from the fp64 one
    # rank-1 terms (PK)[T]^T X[T], flattened, brute force over token pairs of each sequence
    s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    mask = torch.ones(12, 12, dtype=torch.bool).tril()
    p = torch.softmax(s.masked_fill(~mask, -math.inf), -1)
    pk = p @ k.double()
    for h in range(3):
        cos = []
        for b in range(2):
            terms = [torch.outer(pk[b, h, t], xin[b, t].double()).flatten() for t in range(12)]
            cos += [F.cosine_similarity(terms[i], terms[j], dim=0)
                    for i, j in itertools.permutations(range(12), 2)]
        assert sig["rank1_cos"][h].item() == pytest.approx(torch.stack(cos).mean().item(), rel=1e-4)
        terms = [torch.outer(pk[b, h, t], xin[b, t].double()) for b in range(2) for t in range(12)]
        mean_term = sum(terms) / 24
        torch.testing.assert_close(sig["mean_term"][h].double(), mean_term, rtol=1e-4, atol=1e-7)
        delta_term = sum(delta[b, h, t] * torch.outer(pk[b, h, t], xin[b, t].double())
                         for b in range(2) for t in range(12))
        torch.testing.assert_close(sig["delta_term"][h].double(), delta_term, rtol=1e-3, atol=1e-9)
    assert sig["entropy"].shape == (3,) and (sig["entropy"] > 0).all()
    torch.testing.assert_close(sig["max_logit"], s.masked_fill(~mask, -math.inf).amax((0, 2, 3)))


def test_measure_layout_cumulative_delta_and_previous_cosines():
    model = small_model()
    tel = Telemetry(model)
    x, y = batch(model)
    first = tel.measure(x, y, AUTOCAST)
    assert set(first) == {*SIGNALS, "rows"} and first["rows"] == 24
    assert all(len(first[name]) == 2 and len(first[name][0]) == 3 for name in SIGNALS)
    assert first["rank1_cos_prev"][0][0] is None and first["delta_term_cos_prev"][1][2] is None
    assert first["delta_error_cum"] == first["delta_error"]
    second = tel.measure(*batch(model, seed=2), AUTOCAST)
    cum = torch.tensor(first["delta_error"]) + torch.tensor(second["delta_error"])
    torch.testing.assert_close(torch.tensor(second["delta_error_cum"]), cum)
    assert -1 <= second["rank1_cos_prev"][0][0] <= 1
    state = tel.state_dict()
    fresh = Telemetry(model)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.delta_cum, tel.delta_cum) and fresh.samples == 2


def test_softcap_is_used_in_the_fp64_recomputation():
    model = small_model(attn_softcap=1.5)
    x, y = batch(model)
    with torch.no_grad():
        model.blocks[0].attn.c_attn.weight.mul_(20)  # large logits, so the cap matters
    out = Telemetry(model).measure(x, y)  # fp32 model: O matches the capped fp64 O closely
    assert max(out["max_logit"][0]) <= 1.5
    assert max(abs(e) for e in out["delta_error_abs"][0]) < 1e-6


def test_attention_stats_of_emulated_layers():
    specs = {1: "emulated/precision=fa2", 2: "emulated/precision=fa2/fix=2"}
    model = small_model(n_layer=3, layer_attention=specs, hp_heads={2: [2]})
    x, y = batch(model)
    out = Telemetry(model).measure(x, y, AUTOCAST)
    assert out["pbar_ones"][0] == [None, None, None]       # layer 0 is "math": no stats
    assert min(out["pbar_ones"][1]) >= out["rows"]         # no fix: each row's max enters P̄V as exactly 1.0
    assert out["fix_triggers"][1] == [0.0, 0.0, 0.0]
    assert out["pbar_ones"][2][2] == out["fix_triggers"][2][2] == 0.0  # fp32 head: no P̄ rounding, no fix
    assert all(v >= 0 for v in out["fix_triggers"][2] + out["fix_fallbacks"][2])
    assert all(a.stats is None for a in model.attention_layers())

"""The low-rank analysis of chapter 4 (the paper's §3.3): the rank-1 terms (PK)[T]^T X[T] whose δ-weighted
sum is the W_Q gradient error (Eq. 2), how alike they are across tokens and steps, how close the error is to
rank 1, and which keys build the shared direction R.

Sources: recorded runs' telemetry (`run_similarity`, records only), the positive control (`control_weights`,
`control_terms`), a tiny language model trained here on the CPU (`train_tiny_lm`, `lm_terms`) and the bias
harness's adversarial rows (`key_errors`). The definitions are in the book's appendix "Methods and record
formats".
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass

import torch
from lowprec.analysis import ErrorStats
from lowprec.attention import emulated_attention, reference_attention
from lowprec.attention.emulated import dot, exp_sub, forward, rowsum
from lowprec.attention.plan import plan_call
from lowprec.attention.precision import round_weights
from lowprec.configs import TrainConfig
from lowprec.data import sample_batch as lm_batch
from lowprec.instruments.control import (
    ADAM_BETAS,
    Batch,
    ControlConfig,
    control_batch,
    loss_parts,
    make_problem,
    single_thread,
    treatment_precision,
)
from lowprec.model import GPT, GPTConfig
from lowprec.runs import Run, load_run
from lowprec.train import Trainer, load_tokens

SIMILARITIES = ("rank1_cos", "rank1_cos_prev", "delta_term_cos_prev")
SIMILARITY_NAMES = {"rank1_cos": "token to token", "rank1_cos_prev": "step to step",
                    "delta_term_cos_prev": "δ-weighted, step to step"}
ANALYSIS_SEED = 10_000  # the analysis batches of the control: a stream apart from the training stream


# ---------------------------------------------------------------------------------------------- records


def telemetry_array(run: Run, name: str) -> tuple[list[int], torch.Tensor]:
    """(steps, values (samples, layers, heads) float64) of one telemetry signal; null values become NaN."""
    steps, values = run.telemetry(name)
    return steps, torch.tensor([[[math.nan if v is None else v for v in layer] for layer in sample]
                                for sample in values], dtype=torch.float64)


@dataclass(frozen=True)
class RunSimilarity:
    """The three similarities of one run over a window of its telemetry samples (the appendix defines them).

    mean: (layers, 3) mean over heads and samples of SIMILARITIES, in that order; abs_delta: (layers,) mean of
    |delta_term_cos_prev|; head_t: (layers, heads) t of delta_term_cos_prev over the samples (ErrorStats);
    sign_agreement: the fraction of (sample, layer, head) at which delta_term_cos_prev has the sign of
    δe(t)·δe(t−1), δe the head's summed δ error ("delta_error"); steps: the window's first and last step.
    """

    steps: tuple[int, int]
    samples: int
    mean: torch.Tensor
    abs_delta: torch.Tensor
    head_t: torch.Tensor
    sign_agreement: float


def run_similarity(run: Run, start: float = 0.5, before: int | None = None) -> RunSimilarity:
    """RunSimilarity over the telemetry samples before step `before` (all if None), from fraction `start` of
    them on (0.5: the second half, after the heads have specialised)."""
    if not 0 <= start < 1:
        raise ValueError(f"start must be in [0, 1), got {start}")
    steps, _ = run.telemetry("rank1_cos")
    arrays = {name: telemetry_array(run, name)[1] for name in (*SIMILARITIES, "delta_error")}
    count = sum(1 for step in steps if before is None or step < before)
    keep = list(range(max(1, int(start * count)), count))  # the "_prev" signals need a previous sample
    if len(keep) < 2:
        raise ValueError(f"{run.path}: fewer than 2 telemetry samples in the window")
    idx = torch.tensor(keep)
    window = {name: a[idx] for name, a in arrays.items()}
    mean = torch.stack([window[name].nanmean((0, 2)) for name in SIMILARITIES], dim=1)
    delta = window["delta_term_cos_prev"]
    err = arrays["delta_error"]
    pair_sign = torch.sign(err[idx] * err[idx - 1])
    agree = (torch.sign(delta) == pair_sign)[~delta.isnan()].double().mean()
    head_t = torch.tensor([[ErrorStats.of(delta[:, layer, head]).t for head in range(delta.shape[2])]
                           for layer in range(delta.shape[1])])
    return RunSimilarity((steps[keep[0]], steps[keep[-1]]), len(keep), mean, delta.abs().nanmean((0, 2)),
                         head_t, float(agree))


# ------------------------------------------------------------------------------------------------ terms


def key_shares(p: torch.Tensor, k: torch.Tensor, x: torch.Tensor,
               weights: torch.Tensor | None = None) -> torch.Tensor:
    """(heads, N): the share of each key position in M = Σ_T w[T] (PK)[T]^T X[T], summed over the batch:
    ⟨K[j]^T Σ_T w[T] P[T, j] X[T], M⟩ / ‖M‖²; the shares of a head add up to 1.

    p: (B, H, T, N), k: (B, H, N, D), x: (B, T, C), weights: (B, H, T) (None: all 1, the mean term)."""
    p64, x64 = p.double(), x.double()
    w = torch.ones(p.shape[:3], dtype=torch.float64) if weights is None else weights.double()
    a = torch.einsum("bht,bhtj,btc->bhjc", w, p64, x64)
    parts = torch.einsum("bhjd,bhjc->hjdc", k.double(), a)
    total = parts.sum(1)
    return torch.einsum("hjdc,hdc->hj", parts, total) / (total**2).sum((-1, -2)).unsqueeze(-1)


def mean_alignment(p: torch.Tensor, k: torch.Tensor, x: torch.Tensor,
                   weights: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Per head, how much M = Σ_T w[T] (PK)[T]^T X[T] (summed over the batch) is the outer product of the mean
    key and the mean input: |cos| of M's top left singular vector with the mean key k̄ ("key"), of its top
    right one with the mean input x̄ ("input"), and the share of ‖PK‖² along k̄ ("pk_energy").

    p: (B, H, T, N), k: (B, H, N, D), x: (B, T, C), weights: (B, H, T) (None: all 1)."""
    p64, k64, x64 = p.double(), k.double(), x.double()
    w = torch.ones(p.shape[:3], dtype=torch.float64) if weights is None else weights.double()
    pk = p64 @ k64
    m = torch.einsum("bht,bhtd,btc->hdc", w, pk, x64)
    u, _, vh = torch.linalg.svd(m)
    k_bar = torch.nn.functional.normalize(k64.mean((0, 2)), dim=-1)  # (H, D)
    x_bar = torch.nn.functional.normalize(x64.mean((0, 1)), dim=-1)  # (C,)
    along = torch.einsum("bhtd,hd->bht", pk, k_bar)
    return {
        "key": torch.einsum("hd,hd->h", u[..., 0], k_bar).abs(),
        "input": (vh[:, 0] @ x_bar).abs(),
        "pk_energy": (along**2).sum((0, 2)) / (pk**2).sum((0, 2, 3)),
    }


def singular_shares(g: torch.Tensor) -> torch.Tensor:
    """σ_i² / Σσ² of each matrix in g (..., m, n), largest first: how much of ‖g‖² each rank-1 part holds."""
    s2 = torch.linalg.svdvals(g.double()) ** 2
    return s2 / s2.sum(-1, keepdim=True)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine of two tensors, flattened."""
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


# ---------------------------------------------------------------------------------------- the control


def _lp_loss(cfg: ControlConfig, w: torch.Tensor, batch: Batch, placement: str, treatment: str):
    """The treatment's loss on one batch, as control.step computes it, with its bf16 q and O (their grads
    are kept) and the forward's AttentionStats."""
    precision, fix = treatment_precision(placement, treatment, cfg.beta)
    if precision is None:
        raise ValueError("the low-rank analysis compares a rounded run with float64; treatment must not be "
                         "'reference'")
    q_lp = (batch.x @ w.T)[:, None].bfloat16()
    q_lp.retain_grad()
    o, stats = emulated_attention(q_lp, batch.k.bfloat16(), batch.v.bfloat16(), causal=False,
                                  precision=precision, fix=fix, return_stats=True)
    o.retain_grad()
    task, bias = loss_parts(o.float(), batch.y, cfg)
    return task + bias, q_lp, o, stats


def control_weights(cfg: ControlConfig, placement: str = "fa2", treatment: str = "lowp",
                    at: tuple[int, ...] = (0, 300)) -> dict[int, torch.Tensor]:
    """W_Q after s Adam updates for each s in `at`, replaying control.train_treatment (same init, data stream
    and arithmetic; its per-step float64 telemetry does not touch W_Q's gradient, so it is left out)."""
    if not at or min(at) < 0:
        raise ValueError(f"at must hold steps >= 0, got {at}")
    prob = make_problem(cfg)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    w = prob.w0.clone().requires_grad_(True)
    opt = torch.optim.Adam([w], lr=cfg.lr, betas=ADAM_BETAS)
    out = {0: prob.w0.clone()} if 0 in at else {}
    with single_thread():
        for step in range(1, max(at) + 1):
            opt.zero_grad()
            _lp_loss(cfg, w, control_batch(cfg, prob, gen), placement, treatment)[0].backward()
            opt.step()
            if step in at:
                out[step] = w.detach().clone()
    return out


def control_terms(cfg: ControlConfig, w: torch.Tensor, placement: str = "fa2", treatment: str = "lowp",
                  batches: int = 4, seed: int = ANALYSIS_SEED) -> dict[str, torch.Tensor]:
    """The control's tensors at weights w on `batches` fresh batches (a stream apart from training), each
    with a leading batches dimension: x (B, N, C); p, the exact softmax (B, 1, N, N); k, v, dO and the
    output error O_lp − O_hp (B, 1, N, D); delta_err (B, 1, N); the W_Q gradients g_lp and g_hp (D, C), the
    rounded run's and float64 attention's on the same bf16 q, k, v; pbar_ones (P̄ = 1 entries per row)."""
    prob = make_problem(cfg)
    gen = torch.Generator().manual_seed(seed)
    rows: dict[str, list[torch.Tensor]] = {}
    with single_thread():
        for _ in range(batches):
            batch = control_batch(cfg, prob, gen)
            loss, q_lp, o, stats = _lp_loss(cfg, w.detach().clone().requires_grad_(True), batch, placement,
                                            treatment)
            loss.backward()
            k64, v64 = batch.k.double(), batch.v.double()
            qh = q_lp.detach().double().requires_grad_(True)
            oh, lse = reference_attention(qh, k64, v64, causal=False)
            sum(loss_parts(oh, batch.y, cfg)).backward()
            p = torch.exp(qh.detach() @ k64.transpose(-1, -2) * cfg.scale - lse.detach()[..., None])
            o_err = o.detach().double() - oh.detach()
            totals = stats.totals()
            found = {
                "x": batch.x, "p": p, "k": batch.k, "v": batch.v, "do": o.grad.float(), "o_err": o_err,
                "delta_err": (o.grad.double() * o_err).sum(-1),
                "g_lp": torch.einsum("bnd,bnc->dc", q_lp.grad.double()[:, 0], batch.x.double()),
                "g_hp": torch.einsum("bnd,bnc->dc", qh.grad[:, 0], batch.x.double()),
                "pbar_ones": torch.tensor(totals["pbar_ones"] / totals["rows"]),
            }
            for name, value in found.items():
                rows.setdefault(name, []).append(value)
    return {name: torch.stack(values) for name, values in rows.items()}


# ---------------------------------------------------------------------------------- adversarial rows


def key_errors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               do: torch.Tensor) -> dict[str, torch.Tensor]:
    """The fa2 kernel's output error split by key, on non-causal rows that fit one key tile.

    q, k, v: bf16 (1, H, N, D), do: (1, H, N, D) (lowprec.instruments.bias.adversarial_inputs). Before the
    output rounding the kernel returns O = Σ_j P̄_lp[j] V[j] / ℓ with P̄_lp the bf16 weights and ℓ the sum of
    the unrounded ones, so O − O_hp = Σ_j e_j with e_j = (P̄_lp[j] / ℓ − P[j]) V[j], P the float64 softmax.
    Returns, per row (H·N rows) and key: o (mean over features of e_j) and delta (dO · e_j), their running
    sums over key positions o_cum, delta_cum, the masks rounded_to_one (P̄_lp = 1 where P̄ < 1) and row_max
    (P̄ = 1 exactly); and o_kernel, the mean over features of the emulator's O − O_hp (before its output
    rounding), which o_cum's last column must equal."""
    plan = plan_call(q.dtype, q.shape[-1], False, "fa2", None)
    if k.shape[2] > plan.block_n:
        raise ValueError(f"key_errors needs the keys in one tile: {k.shape[2]} keys > block_n {plan.block_n}")
    s = dot(q.float(), k.float().transpose(-1, -2)) * plan.scale
    pbar = exp_sub(s, s.amax(-1, keepdim=True), natural=False)  # bf16 inputs, as the kernel computes P̄
    pbar_lp = round_weights(pbar, plan.precision, plan.dtype)
    ell = rowsum(pbar).double()
    o_hp, lse = reference_attention(q, k, v, causal=False)
    p = torch.exp(q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1]) - lse[..., None])
    weight = pbar_lp.double() / ell[..., None] - p  # (1, H, rows, keys): e_j = weight[j] V[j]
    o_key = (weight * v.double().mean(-1).unsqueeze(-2)).flatten(0, 2)
    delta_key = (weight * (do.double() @ v.double().transpose(-1, -2))).flatten(0, 2)
    o_raw = forward(q, k, v, plan)[1]
    return {
        "o": o_key, "delta": delta_key, "o_cum": o_key.cumsum(-1), "delta_cum": delta_key.cumsum(-1),
        "rounded_to_one": ((pbar_lp == 1.0) & (pbar < 1.0)).flatten(0, 2),
        "row_max": (pbar == 1.0).flatten(0, 2),
        "o_kernel": (o_raw.double() - o_hp).mean(-1).flatten(),
    }


# -------------------------------------------------------------------------------- a tiny language model


def tiny_lm_config(steps: int = 300, seed: int = 0) -> TrainConfig:
    """A 2-layer, 2-head, 64-wide byte-level GPT (64-token context) on the committed sample, trained in fp32
    with PyTorch's attention: AdamW (0.9, 0.95), lr 1e-2 after 50 warm-up steps, batch 8 x 64, clip 1."""
    model = GPTConfig(vocab_size=257, block_size=64, n_layer=2, n_head=2, n_embd=64, attention="sdpa")
    return TrainConfig(name="tiny-lm", model=model, data="sample:bytes", seed=seed, batch_size=8,
                       max_iters=steps, lr=1e-2, min_lr=1e-3, warmup_iters=50, dtype="float32", device="cpu",
                       compile=False, log_interval=10, ckpt_interval=-1, progress=False)


def train_tiny_lm(cfg: TrainConfig | None = None) -> tuple[GPT, Run]:
    """Train `cfg` (default `tiny_lm_config()`) with the project's trainer on one thread, recording into a
    temporary folder; returns the trained model and the loaded record."""
    cfg = cfg or tiny_lm_config()
    with tempfile.TemporaryDirectory() as out, single_thread():
        trainer = Trainer(cfg, out)
        trainer.run()
        return trainer.model.eval(), load_run(out)


def capture(model: GPT, x: torch.Tensor, y: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """(X, q, k, v, dO) of every attention layer for one forward and backward of `model` on (x, y); dO is
    dloss/dO (no parameter gradient is touched)."""
    saved: dict[int, tuple] = {}

    def probe(layer, x_in, q, k, v, o):
        saved[layer] = (x_in.detach(), q.detach(), k.detach(), v.detach(), o)

    layers = model.attention_layers()
    for attn in layers:
        attn.probe = probe
    try:
        _, loss = model(x, y)
        grads = torch.autograd.grad(loss, [saved[i][4] for i in range(len(layers))])
    finally:
        for attn in layers:
            attn.probe = None
    return [(*saved[i][:4], grads[i]) for i in range(len(layers))]


def lm_terms(model: GPT, batches: int = 8, batch_size: int = 8, precision: str = "fa2",
             data: str = "sample:bytes", seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """Per attention layer, on `batches` validation batches, with each layer's own X, q, k, v and dO: the
    W_Q gradients of every head with the emulated kernel (`precision`, bf16 q, k, v) and with float64
    attention on the same bf16 q, k, v, g_lp and g_hp (batches, heads, D, C); Eq. (2)'s δ-only prediction
    pred = −α Σ_T δerr[T] (PK)[T]^T X[T] of g_lp − g_hp; and the tensors of `rank1_terms`/`key_shares`:
    x (batches, B, T, C), p (batches, B, H, T, T), k (batches, B, H, T, D), delta_err (batches, B, H, T)."""
    tokens = load_tokens(data).val
    block = model.config.block_size
    out: list[dict[str, list[torch.Tensor]]] = [{} for _ in model.attention_layers()]
    with single_thread():
        for i in range(batches):
            x_ids, y_ids = lm_batch(tokens, seed, i, batch_size, block)
            for layer, (x, q, k, v, do) in enumerate(capture(model, x_ids, y_ids)):
                q_lp, k_lp, v_lp = (t.bfloat16() for t in (q, k, v))
                q_lp.requires_grad_(True)
                o = emulated_attention(q_lp, k_lp, v_lp, causal=True, precision=precision)
                o.float().backward(do)
                qh = q_lp.detach().double().requires_grad_(True)
                oh, lse = reference_attention(qh, k_lp.double(), v_lp.double(), causal=True)
                oh.backward(do.double())
                scale = 1.0 / math.sqrt(q.shape[-1])
                s = (qh.detach() @ k_lp.double().transpose(-1, -2)) * scale
                mask = torch.ones(block, block, dtype=torch.bool).triu(1)
                p = torch.exp(s.masked_fill(mask, -math.inf) - lse.detach()[..., None])
                delta_err = (do.double() * (o.detach().double() - oh.detach())).sum(-1)
                found = {
                    "g_lp": torch.einsum("bhtd,btc->hdc", q_lp.grad.double(), x.double()),
                    "g_hp": torch.einsum("bhtd,btc->hdc", qh.grad, x.double()),
                    "pred": -scale * torch.einsum("bht,bhtd,btc->hdc", delta_err, p @ k_lp.double(),
                                                  x.double()),
                    "x": x, "p": p, "k": k_lp.float(), "delta_err": delta_err,
                }
                for name, value in found.items():
                    out[layer].setdefault(name, []).append(value)
    return [{name: torch.stack(values) for name, values in layer.items()} for layer in out]


__all__ = [
    "SIMILARITIES",
    "SIMILARITY_NAMES",
    "RunSimilarity",
    "capture",
    "control_terms",
    "control_weights",
    "cosine",
    "key_errors",
    "key_shares",
    "lm_terms",
    "mean_alignment",
    "run_similarity",
    "singular_shares",
    "telemetry_array",
    "tiny_lm_config",
    "train_tiny_lm",
]

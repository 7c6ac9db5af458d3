"""Positive control: one attention layer in which biased rounding is the ONLY thing that can move W_Q.

(One experiment in one file, design to summary in reading order; hence longer than the ~450-line guide.)

Design (every choice serves one purpose: in exact arithmetic the expected gradient of W_Q is zero):
- Queries q = W_Q x, x = u + noise (a "carrier" u shared by all tokens, like the paper's features 546/678).
  Keys and values are synthetic, fresh each step (no W_K, W_V). `sinks` keys equal one sink key k_s except
  for a tiny component along one axis e_g ⟂ k_s, so their scores differ by ~`near_gap`: near ties inside
  bf16's round-to-1.0 window 2^-9 (fa2's trigger), which the drift along R = k̂_s û^T does not spread out.
  Content keys are random and ⟂ k_s. W_Q starts as a "sink head": the sinks lead every row by ~`sink_score`.
- V has two channels. Bias channel (first half of the dims): every key's value ~ N(v_mean, v_std^2), one
  sign (the paper's mostly negative V[:, 20]); its loss bias_weight * sign(v_mean) * mean(O_A) wants |O_A|
  smaller, a persistent dO with V's sign (as the paper's dO and V in dims 20, 29) that no attention pattern
  can satisfy. Task channel: content values ~ N(0, 1), sinks 0; target y = the float64 output of the initial
  W_Q on the same batch (a teacher); loss 1/2 ||O_B - y||^2.
- So, in exact arithmetic, the task gradient is exactly 0 at W_Q(0) and restoring elsewhere, and the bias
  channel's gradient Σ_j P_j dO_A·(v_j - O) is zero-mean (the value noise is independent of the scores).
- Arms, identical init and data stream: "lowp" (the placement's rounding, no fix), "fix" (the paper's dynamic
  maximum Fix(beta)), "fp32pv" (the placement with P̄, the P̄V result and the running O unrounded),
  "reference" (float64 attention on the fp32 q). Placements Precision.fa2() and Precision.paper(); Adam
  (the paper's betas 0.9/0.95, eps `adam_eps`) and plain SGD, sgd_lr calibrated so that the reference arm's
  mean step size matches Adam's.
- Telemetry per step, against float64 attention on the SAME bf16 q, k, v: Σ_T (δ_lp - δ_hp)[T] (one dO), the
  W_Q gradient error on R, Eq. (2)'s δ-only prediction -α Σ_T δerr[T] (PK)[T]^T x[T], how alike the rank-1
  terms (PK)[T]^T x[T] are across tokens and steps, P̄ = 1 per row, ⟨W - W0, R⟩, ||W||_2, update size and
  direction, the task loss (as a fraction of its ceiling, all content attention lost) and the content mass.

The predictions written before the first training run, and what happened, are in the book's chapter 4.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from lowprec.analysis import ErrorStats
from lowprec.attention import Fix, Precision, emulated_attention, reference_attention
from lowprec.attention.reference import causal_mask, scaled_scores
from tqdm import tqdm

PLACEMENTS = ("fa2", "paper")
ARMS = ("lowp", "fix", "fp32pv", "reference")
OPTIMIZERS = ("adam", "sgd")
FP32_PV = {  # P̄, the P̄V result and the running O unrounded; the rest of the placement unchanged
    "fa2": "fa2:weights=none",
    "paper": "paper:weights=none,product=none,accumulator=none",
}
SINK_KEY_NORM = 3.0
CARRIER_NORM = 2.0
X_NOISE = 0.25
ADAM_BETAS = (0.9, 0.95)
COLLAPSE = 0.1  # "attention collapse": the content mass falls below this fraction of its initial value


@dataclass(frozen=True)
class ControlConfig:
    """Sizes, the synthetic data and the optimizers (module docstring). sgd_lr = 16 makes the reference arm's
    mean step ||ΔW|| match Adam's at lr 3e-3 (0.0139 vs 0.0143 per step, measured with the defaults)."""

    steps: int = 300
    batch: int = 8
    seq: int = 64
    head_dim: int = 16
    d_model: int = 32
    sinks: int = 4
    sink_score: float = 5.0
    near_gap: float = 5e-4
    v_mean: float = -1.5
    v_std: float = 0.1
    bias_weight: float = 1.0
    lr: float = 3e-3
    sgd_lr: float = 16.0
    adam_eps: float = 1e-8
    beta: float = 2.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch", "seq", "d_model"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if not (isinstance(self.head_dim, int) and self.head_dim >= 4 and self.head_dim % 2 == 0):
            raise ValueError(f"head_dim must be an even int >= 4, got {self.head_dim!r}")
        if not 2 <= self.sinks < self.seq:
            raise ValueError(f"sinks must be in [2, seq), got {self.sinks}")
        if self.v_mean == 0:
            raise ValueError("v_mean must be nonzero (same-sign values are the point)")
        for name in ("near_gap", "v_std", "lr", "sgd_lr"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not self.adam_eps > 0:
            raise ValueError(f"adam_eps must be > 0, got {self.adam_eps!r}")

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def bias_dims(self) -> int:
        return self.head_dim // 2


@dataclass
class Problem:
    """The fixed parts: carrier u, sink direction k̂ (⟂ the gap axis, the last dim), W_Q(0), R = k̂ û^T."""

    u: torch.Tensor
    k_hat: torch.Tensor
    w0: torch.Tensor
    r: torch.Tensor
    eta_std: float


def make_problem(cfg: ControlConfig) -> Problem:
    gen = torch.Generator().manual_seed(cfg.seed)
    D, C = cfg.head_dim, cfg.d_model
    u = torch.randn(C, generator=gen)
    u = CARRIER_NORM * u / u.norm()
    k_hat = torch.zeros(D)
    k_hat[:-1] = torch.randn(D - 1, generator=gen)
    k_hat /= k_hat.norm()
    w0 = torch.randn(D, C, generator=gen) / math.sqrt(C)
    # a sink head: add a·k̂ û^T so that the mean sink score α (W0 u)·k_s is sink_score
    a = (cfg.sink_score / (cfg.scale * SINK_KEY_NORM) - k_hat @ w0 @ u) / u.norm()
    w0 += a * torch.outer(k_hat, u / u.norm())
    # gap-axis query component q_g = W0[-1]·x: its rms sets the key offsets that give score gaps of near_gap
    q_g_rms = math.sqrt(float(w0[-1] @ u) ** 2 + X_NOISE**2 * float(w0[-1].norm()) ** 2)
    eta_std = cfg.near_gap / (cfg.scale * q_g_rms * math.sqrt(2.0))
    return Problem(u, k_hat, w0, torch.outer(k_hat, u / u.norm()), eta_std)


@dataclass
class Batch:
    x: torch.Tensor  # (B, N, C) fp32
    k: torch.Tensor  # (B, 1, N, D) bf16-representable fp32
    v: torch.Tensor  # (B, 1, N, D) bf16-representable fp32
    y: torch.Tensor  # (B, 1, N, D - bias_dims) float64 teacher output on the task channel


def sample_batch(cfg: ControlConfig, prob: Problem, gen: torch.Generator) -> Batch:
    B, N, D, C, S, A = cfg.batch, cfg.seq, cfg.head_dim, cfg.d_model, cfg.sinks, cfg.bias_dims
    x = prob.u + X_NOISE * torch.randn(B, N, C, generator=gen)
    k = torch.randn(B, N, D, generator=gen)
    k -= (k @ prob.k_hat)[..., None] * prob.k_hat  # content keys ⟂ k_s: the R-drift moves only sink logits
    k[:, :S] = SINK_KEY_NORM * prob.k_hat
    k[:, :S, -1] = prob.eta_std * torch.randn(B, S, generator=gen)  # near ties along the gap axis
    v = torch.randn(B, N, D, generator=gen)
    v[..., :A] = cfg.v_mean + cfg.v_std * v[..., :A]
    v[:, :S, A:] = 0.0
    k, v = (t.bfloat16().float()[:, None] for t in (k, v))
    q0 = (x.double() @ prob.w0.double().T)[:, None]
    y = reference_attention(q0, k.double(), v.double(), causal=False)[0][..., A:]
    return Batch(x, k, v, y)


def loss_parts(o: torch.Tensor, y: torch.Tensor, cfg: ControlConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(task loss 1/2 ||O_B - y||^2, bias-channel loss bias_weight * sign(v_mean) * mean O_A), both averaged
    over rows: the bias channel's dO has V's sign (the downstream wants |O_A| smaller), as in the paper."""
    A = cfg.bias_dims
    task = 0.5 * ((o[..., A:] - y) ** 2).sum(-1).mean()
    return task, math.copysign(cfg.bias_weight, cfg.v_mean) * o[..., :A].mean()


def arm_precision(placement: str, arm: str, beta: float) -> tuple[Precision | None, Fix | None]:
    """(precision, fix) of an arm; precision None = float64 reference."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if arm not in ARMS:
        raise ValueError(f"arm must be one of {ARMS}, got {arm!r}")
    if arm == "reference":
        return None, None
    precision = Precision.parse(FP32_PV[placement] if arm == "fp32pv" else placement)
    return precision, Fix(beta=beta) if arm == "fix" else None


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    den = float(a.norm() * b.norm())
    return float((a * b).sum()) / den if den > 0 else 0.0


def telemetry(
    cfg: ControlConfig,
    prob: Problem,
    batch: Batch,
    q_lp: torch.Tensor,
    o_lp: torch.Tensor,
    m_first: torch.Tensor | None,
) -> tuple[dict, torch.Tensor]:
    """Compare one lp step with float64 attention on the same bf16 q, k, v (module docstring).

    q_lp, o_lp: the lp arm's bf16 q and output after backward (their .grad hold dq and dO). Returns the row of
    numbers and this step's mean rank-1 direction Σ_T (PK)[T]^T x[T] (m_first: the first step's, or None).
    """
    S = cfg.sinks
    qh = q_lp.detach().double().requires_grad_(True)
    oh, lse = reference_attention(qh, batch.k.double(), batch.v.double(), causal=False)
    sum(loss_parts(oh, batch.y, cfg)).backward()
    p = torch.exp(qh.detach() @ batch.k.double().transpose(-1, -2) * cfg.scale - lse.detach()[..., None])
    pk = (p @ batch.k.double())[:, 0]  # (B, N, D)
    x = batch.x.double()
    delta_err = (o_lp.grad.double() * (o_lp.detach().double() - oh.detach())).sum(-1)[:, 0]  # (B, N)
    g_err = torch.einsum("bnd,bnc->dc", (q_lp.grad.double() - qh.grad)[:, 0], x)
    pred = -cfg.scale * torch.einsum("bn,bnd,bnc->dc", delta_err, pk, x)  # Eq. (2), only δ differing
    m = torch.einsum("bnd,bnc->dc", pk, x)
    token_cos = torch.einsum("bnd,dc,bnc->bn", pk, m, x) / (pk.norm(dim=-1) * x.norm(dim=-1) * m.norm())
    r = prob.r.double()
    row = {
        "delta_err": float(delta_err.sum()),
        "g_err_r": float((g_err * r).sum()),
        "pred_r": float((pred * r).sum()),
        "g_err_cos_pred": cos(g_err, pred),
        "rank1_token_cos": float(token_cos.mean()),
        "rank1_r_cos": cos(m, r),
        "rank1_step_cos": cos(m, m_first) if m_first is not None else 1.0,
        "task_hp": float(loss_parts(oh.detach(), batch.y, cfg)[0]),
        "content_mass": float(1.0 - p[..., :S].sum(-1).mean()),
    }
    return row, m


def step(
    cfg: ControlConfig,
    prob: Problem,
    w: torch.Tensor,
    batch: Batch,
    precision: Precision | None,
    fix: Fix | None,
    m_first: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[dict, torch.Tensor | None]:
    """Loss and backward (w.grad) for one batch in one arm, plus that step's telemetry row; `generator`
    gives the random bits of stochastic rounding."""
    q = (batch.x @ w.T)[:, None]
    if precision is None:
        o = reference_attention(q, batch.k, batch.v, causal=False)[0]
    else:
        q_lp = q.bfloat16()
        q_lp.retain_grad()
        o, stats = emulated_attention(
            q_lp,
            batch.k.bfloat16(),
            batch.v.bfloat16(),
            causal=False,
            precision=precision,
            fix=fix,
            return_stats=True,
            generator=generator,
        )
        o.retain_grad()
    task, bias = loss_parts(o.float(), batch.y, cfg)
    (task + bias).backward()
    row = {
        "task": float(task.detach()),
        "task_ceiling": float(0.5 * (batch.y**2).sum(-1).mean()),
        "sink_score": float((q.detach() @ batch.k[..., : cfg.sinks, :].transpose(-1, -2)).mean() * cfg.scale),
    }
    if precision is None:
        with torch.no_grad():
            p = torch.softmax(q.double() @ batch.k.double().transpose(-1, -2) * cfg.scale, -1)
        return row | {
            "task_hp": row["task"],
            "content_mass": float(1.0 - p[..., : cfg.sinks].sum(-1).mean()),
        }, None
    tel, m = telemetry(cfg, prob, batch, q_lp, o, m_first)
    totals = stats.totals()
    return row | tel | {
        "pbar_ones_per_row": totals["pbar_ones"] / totals["rows"],
        "fix_rows": totals["rows_triggered"] / totals["rows"],
    }, m


@contextlib.contextmanager
def single_thread():
    """Run torch on one thread: these tensors are tiny, and a second thread only adds overhead (and on a
    shared 2-core machine, 5x contention)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@single_thread()
def run_arm(
    cfg: ControlConfig, placement: str, arm: str, optimizer: str = "adam", progress: tqdm | None = None
) -> dict:
    """Train W_Q for cfg.steps in one arm; returns {"series": per-step lists, "summary": numbers}."""
    precision, fix = arm_precision(placement, arm, cfg.beta)
    return train_w_q(cfg, precision, fix, optimizer, progress)


def train_w_q(
    cfg: ControlConfig, precision: Precision | str | None, fix: Fix | None, optimizer: str = "adam",
    progress: tqdm | None = None,
) -> dict:  # fmt: skip
    """Train W_Q for cfg.steps with any precision (None: float64) and Fix, on the same init and data stream
    as every arm; stochastic rounding draws its bits from a generator seeded with cfg.seed + 2."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    precision = None if precision is None else Precision.parse(precision)
    stochastic = precision is not None and precision.stochastic
    rounding_bits = torch.Generator().manual_seed(cfg.seed + 2) if stochastic else None
    prob = make_problem(cfg)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    w = prob.w0.clone().requires_grad_(True)
    opt = (
        torch.optim.Adam([w], lr=cfg.lr, betas=ADAM_BETAS, eps=cfg.adam_eps)
        if optimizer == "adam"
        else torch.optim.SGD([w], lr=cfg.sgd_lr)
    )
    series: dict[str, list[float]] = {}
    m_first, prev_update = None, None
    for _ in range(cfg.steps):
        opt.zero_grad()
        row, m = step(cfg, prob, w, sample_batch(cfg, prob, gen), precision, fix, m_first, rounding_bits)
        m_first = m if m_first is None else m_first
        before = w.detach().clone()
        opt.step()
        update = w.detach() - before
        row |= {
            "w_r": float(((w.detach() - prob.w0) * prob.r).sum()),
            "w_norm": float(torch.linalg.matrix_norm(w.detach(), 2)),
            "update_norm": float(update.norm()),
            "update_cos_r": cos(update, prob.r),
            "update_cos_prev": cos(update, prev_update) if prev_update is not None else float("nan"),
        }
        prev_update = update
        for key, value in row.items():
            series.setdefault(key, []).append(value)
        if progress is not None:
            progress.update(1)
    return {"series": series, "summary": summarize(series, prob, cfg)}


@single_thread()
def bias_probe(cfg: ControlConfig, placement: str, arm: str, batches: int = 100) -> dict:
    """The per-step δ error and W_Q gradient error on R at the initial weights (no training), as t-stats."""
    precision, fix = arm_precision(placement, arm, cfg.beta)
    if precision is None:
        raise ValueError("bias_probe compares an lp arm with float64; arm must not be 'reference'")
    prob = make_problem(cfg)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    rows = []
    for _ in range(batches):
        w = prob.w0.clone().requires_grad_(True)
        rows.append(step(cfg, prob, w, sample_batch(cfg, prob, gen), precision, fix)[0])
    delta, g_err = [r["delta_err"] for r in rows], [r["g_err_r"] for r in rows]
    return {
        "delta_err_mean": sum(delta) / batches,
        "delta_err_t": t_stat(delta),
        "g_err_r_mean": sum(g_err) / batches,
        "g_err_r_t": t_stat(g_err),
        "pbar_ones_per_row": sum(r["pbar_ones_per_row"] for r in rows) / batches,
    }


@single_thread()
def criterion_probe(cfg: ControlConfig, placement: str, arm: str, batches: int = 100) -> dict:
    """`bias_noise.bias_noise` at the initial weights: the arm's W_Q gradients against float64 attention's on
    the same batches, with Adam's second moment v estimated as the mean square of the float64 gradient (what
    Adam's v settles to; its median square root is returned as sqrt_v_median); tokens per step = one batch."""
    from lowprec.instruments.bias_noise import bias_noise

    precision, fix = arm_precision(placement, arm, cfg.beta)
    prob = make_problem(cfg)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    grads: dict[str, list[torch.Tensor]] = {"lp": [], "hp": []}
    for _ in range(batches):
        batch = sample_batch(cfg, prob, gen)
        for key, (prec, fx) in (("lp", (precision, fix)), ("hp", (None, None))):
            w = prob.w0.clone().requires_grad_(True)
            step(cfg, prob, w, batch, prec, fx)
            grads[key].append(w.grad.detach().clone())
    g_lp, g_hp = torch.stack(grads["lp"]), torch.stack(grads["hp"])
    tokens = cfg.batch * cfg.seq
    v = (g_hp.double() ** 2).mean(0)
    stats, r = bias_noise(g_lp, g_hp, tokens, tokens, adam_v=v, eps=cfg.adam_eps)
    return stats.to_dict() | {"r_cos": abs(cos(r, prob.r)), "sqrt_v_median": float(v.sqrt().median())}


def delta_identity(seed: int = 0, seq: int = 64, head_dim: int = 16, d_model: int = 32) -> dict:
    """Check Eq. (1) and (2) on the instrument: two backward passes that differ ONLY in δ.

    fp32 q, k, v (tied sink keys, same-sign V: lowprec.attention.inputs.tied_qkv), precision
    "fp32:output=bf16" (only O is rounded), and the emulator's backward run twice: with δ from the saved
    bf16 O ("lp") and from the unrounded acc/l ("hp", o_for_delta="fp32"). Then dQ_hp - dQ_lp must equal
    α diag(δ_lp - δ_hp) (PK) (Eq. 1) and, with Q = X W^T, dW_hp - dW_lp = α Σ_T (δ_lp - δ_hp)[T]
    (PK)[T]^T X[T] (Eq. 2). Returns the largest |difference| and |difference - prediction| for each.
    """
    from lowprec.attention.inputs import tied_qkv

    gen = torch.Generator().manual_seed(seed)
    q, k, v = tied_qkv((1, 1, seq, head_dim), ties=4, v_mean=-1.5, v_std=0.5, seed=seed, dtype=torch.float32)
    do = -1.0 + torch.randn(q.shape, generator=gen)
    x = torch.randn(seq, d_model, generator=gen)
    grads, outs = {}, {}
    for name, o_for_delta in (("lp", "saved"), ("hp", "fp32")):
        qq = q.clone().requires_grad_(True)
        o = emulated_attention(qq, k, v, causal=True, precision="fp32:output=bf16", o_for_delta=o_for_delta)
        o.backward(do)
        grads[name] = qq.grad.double()[0, 0]
    outs["lp"] = emulated_attention(q, k, v, causal=True, precision="fp32:output=bf16").double()
    outs["hp"] = emulated_attention(q, k, v, causal=True, precision="fp32").double()
    delta = {name: (do.double() * o).sum(-1)[0, 0] for name, o in outs.items()}
    _, lse = reference_attention(q, k, v, causal=True)
    scale = 1.0 / math.sqrt(head_dim)
    s = scaled_scores(q.double(), k.double()).masked_fill(~causal_mask(seq), float("-inf"))
    pk = (torch.exp(s - lse[..., None]) @ k.double())[0, 0]
    d_err = delta["lp"] - delta["hp"]
    dq_diff, dq_pred = grads["hp"] - grads["lp"], scale * d_err[:, None] * pk
    dw_diff, dw_pred = dq_diff.T @ x.double(), scale * torch.einsum("t,td,tc->dc", d_err, pk, x.double())
    return {
        "delta_err_max": float(d_err.abs().max()),
        "dq_diff_max": float(dq_diff.abs().max()),
        "dq_residual_max": float((dq_diff - dq_pred).abs().max()),
        "dw_diff_max": float(dw_diff.abs().max()),
        "dw_residual_max": float((dw_diff - dw_pred).abs().max()),
    }


def t_stat(values: list[float]) -> float:
    """t = mean / standard error of a per-step series (chapter 2's ErrorStats), 0 for a constant series."""
    t = ErrorStats.of(torch.tensor(values, dtype=torch.float64)).t
    return t if math.isfinite(t) else 0.0


def slope(values: list[float]) -> float:
    """Least-squares slope per step."""
    y = torch.tensor(values, dtype=torch.float64)
    t = torch.arange(len(y), dtype=torch.float64)
    t -= t.mean()
    return float((t * (y - y.mean())).sum() / (t * t).sum()) if len(y) > 1 else 0.0


def summarize(series: dict[str, list[float]], prob: Problem, cfg: ControlConfig) -> dict:
    """Drift numbers of one arm: final ⟨W - W0, R⟩ and its slope, t-stats, one-signedness, norm growth."""
    w0_norm = float(torch.linalg.matrix_norm(prob.w0, 2))
    out = {
        "w_r_final": series["w_r"][-1],
        "w_r_slope": slope(series["w_r"]),
        "w_norm_growth": series["w_norm"][-1] / w0_norm,
        "update_cos_r_mean": sum(series["update_cos_r"]) / cfg.steps,
        "update_cos_prev_mean": sum(series["update_cos_prev"][1:]) / max(cfg.steps - 1, 1),
        "task_first": series["task_hp"][0],
        "task_last": sum(series["task_hp"][-10:]) / len(series["task_hp"][-10:]),
        "content_mass_first": series["content_mass"][0],
        "content_mass_last": series["content_mass"][-1],
        "task_lost_last": sum(series["task_hp"][-10:]) / sum(series["task_ceiling"][-10:]),
        "collapse_step": next(
            (i for i, m in enumerate(series["content_mass"]) if m < COLLAPSE * series["content_mass"][0]),
            None,
        ),
    }
    if "delta_err" in series:
        cum = torch.tensor(series["delta_err"], dtype=torch.float64).cumsum(0)
        sign = math.copysign(1.0, float(cum[-1]))
        out |= {
            "delta_err_t": t_stat(series["delta_err"]),
            "delta_err_cum": float(cum[-1]),
            "delta_cum_same_sign_frac": float((cum * sign > 0).double().mean()),
            "g_err_r_t": t_stat(series["g_err_r"]),
            "pred_r_t": t_stat(series["pred_r"]),
            "g_err_cos_pred_mean": sum(series["g_err_cos_pred"]) / cfg.steps,
            "rank1_token_cos_mean": sum(series["rank1_token_cos"]) / cfg.steps,
            "rank1_step_cos_last": series["rank1_step_cos"][-1],
            "pbar_ones_per_row": sum(series["pbar_ones_per_row"]) / cfg.steps,
            "fix_rows": sum(series["fix_rows"]) / cfg.steps,
        }
    return out


def run_control(
    cfg: ControlConfig,
    placements: tuple[str, ...] = PLACEMENTS,
    arms: tuple[str, ...] = ARMS,
    optimizers: tuple[str, ...] = OPTIMIZERS,
    show_progress: bool = True,
) -> dict:
    """Every (placement, optimizer, arm) run on identical init and data: {"config", "runs": {key: run}}.

    Keys are "<placement>/<optimizer>/<arm>"; the reference arm does not depend on the placement and is run
    once per optimizer, under the key "fp64/<optimizer>/reference".
    """
    jobs = [(p, o, a) for o in optimizers for p in placements for a in arms if a != "reference"] + [
        ("fa2", o, "reference") for o in optimizers if "reference" in arms
    ]
    runs = {}
    with tqdm(total=len(jobs) * cfg.steps, disable=not show_progress, desc="positive control") as bar:
        for placement, optimizer, arm in jobs:
            key = f"{'fp64' if arm == 'reference' else placement}/{optimizer}/{arm}"
            runs[key] = run_arm(cfg, placement, arm, optimizer, bar)
    return {"config": asdict(cfg), "runs": runs}


def train_run(cfg: ControlConfig, key: str) -> dict:
    """One run by its record key: "<placement>/<optimizer>/<arm>" (run_arm; placement "fp64" for the
    reference) or "cure/<optimizer>/<name>" (cures.run_cure with that cure of cures.CURES)."""
    placement, optimizer, name = key.split("/", 2)
    if placement != "cure":
        return run_arm(cfg, "fa2" if placement == "fp64" else placement, name, optimizer)
    from lowprec.instruments.cures import cure_by_name, run_cure  # (cures builds on this module)

    return run_cure(cfg, cure_by_name(name), optimizer)


SAME_BUILD_TOL, OTHER_BUILD_TOL = 0.02, 0.10  # relative tolerances of `agrees` (see recorded_control)


def agrees(now: float | None, then: float | None, scale: float, rel_tol: float = SAME_BUILD_TOL) -> bool:
    """A summary number trained again against its record: a collapse step (int) within 2 steps (with a wider
    rel_tol than SAME_BUILD_TOL, within rel_tol of it if that is more), any other number within rel_tol, or
    within 0.1% of `scale` (the largest |value| the record holds for that number, so that a value near zero,
    where another CPU or torch version rounds the last bits differently, is compared at the record's own
    scale), or at least within 1e-4; None and NaN only with themselves."""
    if now is None or then is None:
        return now == then
    if isinstance(then, int):
        return abs(now - then) <= (2 if rel_tol <= SAME_BUILD_TOL else max(2, rel_tol * abs(then)))
    close = math.isclose(now, then, rel_tol=rel_tol, abs_tol=max(1e-4, 1e-3 * scale))
    return close or (math.isnan(now) and math.isnan(then))


def recorded_control(path: str | Path, cfg: ControlConfig, live: str | None) -> dict[str, dict]:
    """The runs of a record written by `lowprec experiment positive-control --series` for `cfg`, by key, with
    run `live` (a key, see train_run) trained again here and checked against the record number by number
    (`agrees`): within 2% where torch is the record's version, within 10% under another (trained again under
    torch 2.11, a run recorded under 2.13 moved by up to 4.3%, a slope near zero aside:
    results/positive-control/cross-build.json).
    live=None only reads the record (for a caller that re-trains one run of several records).
    {key: {"series", "summary"}}; a ValueError names the record when it is of another configuration, lacks
    the series, or is stale."""
    record = json.loads(Path(path).read_text())
    if record["config"] != asdict(cfg):
        raise ValueError(f"{path} records another configuration than {cfg}")
    if "series" not in record:
        raise ValueError(f"{path} has no per-step series: record it with --series")
    runs = {key: {"series": record["series"][key], "summary": s} for key, s in record["summary"].items()}
    if live is None:
        return runs
    if live not in runs:
        raise ValueError(f"live must be one of the record's runs {sorted(runs)}; got {live!r}")
    fresh = train_run(cfg, live)
    numbers = [run["summary"] for run in runs.values()]
    scale = {k: max((abs(s[k]) for s in numbers if isinstance(s.get(k), float) and math.isfinite(s[k])),
                    default=0.0)
             for k in runs[live]["summary"]}
    provenance = record.get("provenance", {})
    built = provenance.get("torch", torch.__version__)
    rel_tol = SAME_BUILD_TOL if built == torch.__version__ else OTHER_BUILD_TOL
    stale = sorted(k for k, then in runs[live]["summary"].items()
                   if not agrees(fresh["summary"][k], then, scale[k], rel_tol))
    if stale:
        command = " ".join(provenance.get("command", ["lowprec experiment ..."]))
        then, now = runs[live]["summary"], fresh["summary"]
        values = ", ".join(f"{k} {then[k]!r} recorded, {now[k]!r} here" for k in stale)
        raise ValueError(f"{path} is stale: {live} trained here differs in {values} (compared within "
                         f"{rel_tol:.0%}: torch {built} recorded, {torch.__version__} here); record it "
                         f"again: {command}")
    runs[live] = fresh
    return runs


def format_summary(result: dict) -> str:
    """One line per run: drift on R, its slope, ||W||_2 growth, t-stats, one-signedness, P̄ = 1 per row,
    fraction of the task lost at the end, content mass first > last, collapse step."""
    nan = float("nan")
    width = max([22, *(len(key) + 1 for key in result["runs"])])
    lines = [
        f"{'run':<{width}}{'<W-W0,R>':>9}{'slope':>10}{'|W|/|W0|':>9}{'t(δerr)':>8}{'t(gerr·R)':>10}"
        f"{'cumδ 1-sign':>12}{'P̄=1/row':>9}{'task lost':>10}{'content mass':>15}{'collapse':>9}"
    ]
    for key, run in result["runs"].items():
        s = run["summary"]
        collapse = "-" if s["collapse_step"] is None else str(s["collapse_step"])
        lines.append(
            f"{key:<{width}}{s['w_r_final']:>+9.3f}{s['w_r_slope']:>+10.2e}{s['w_norm_growth']:>9.2f}"
            f"{s.get('delta_err_t', nan):>+8.1f}{s.get('g_err_r_t', nan):>+10.1f}"
            f"{s.get('delta_cum_same_sign_frac', nan):>12.2f}{s.get('pbar_ones_per_row', nan):>9.2f}"
            f"{s['task_lost_last']:>10.2f}{s['content_mass_first']:>8.3f}>{s['content_mass_last']:<6.3f}"
            f"{collapse:>9}"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------ CLI


def configure(parser: argparse.ArgumentParser) -> None:
    for name, value in asdict(ControlConfig()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    for name, allowed in (("placements", PLACEMENTS), ("arms", ARMS), ("optimizers", OPTIMIZERS)):
        parser.add_argument(
            f"--{name}", type=comma_list(allowed), default=allowed, help=f"comma list of {', '.join(allowed)}"
        )
    parser.add_argument(
        "--out", default=None, help="write the record here (e.g. results/positive-control/x.json)"
    )
    parser.add_argument("--series", action="store_true", help="also store the per-step series in the record")
    parser.add_argument("--cures", action="store_true",
                        help="train every cure of lowprec.instruments.cures.CURES instead of the arms (keys "
                             "cure/<optimizer>/<name>; --placements and --arms are then unused)")


def comma_list(allowed: tuple[str, ...]):
    """An argparse type: "a,b" -> ("a", "b"), each one of `allowed`."""

    def parse(text: str) -> tuple[str, ...]:
        items = tuple(filter(None, text.split(",")))
        if not items or any(i not in allowed for i in items):
            raise argparse.ArgumentTypeError(f"must be a comma list of {', '.join(allowed)}; got {text!r}")
        return items

    return parse


def run(args: argparse.Namespace) -> int:
    from lowprec.runs import check_target, provenance, write_json

    if args.out is not None:
        check_target(args.out, "--out", folder=False)  # before the work, not after it
    cfg = ControlConfig(**{name: getattr(args, name) for name in asdict(ControlConfig())})
    if args.cures:
        from lowprec.instruments.cures import CURES  # (cures builds on this module)

        keys = [f"cure/{optimizer}/{cure.name}" for optimizer in args.optimizers for cure in CURES]
        runs = {key: train_run(cfg, key) for key in tqdm(keys, desc="cures")}
        result = {"config": asdict(cfg), "runs": runs}
    else:
        result = run_control(cfg, args.placements, args.arms, args.optimizers)
    print(format_summary(result))
    if args.out:
        record = {
            "provenance": provenance(),
            "config": result["config"],
            "summary": {key: run["summary"] for key, run in result["runs"].items()},
        }
        if args.series:
            record["series"] = {key: run["series"] for key, run in result["runs"].items()}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_json(args.out, record)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


__all__ = [
    "ARMS",
    "OPTIMIZERS",
    "PLACEMENTS",
    "ControlConfig",
    "bias_probe",
    "delta_identity",
    "format_summary",
    "make_problem",
    "recorded_control",
    "run_arm",
    "run_control",
    "sample_batch",
    "train_run",
]

"""The positive control: one attention layer in which biased rounding is the only thing that can move W_Q.

`train_w_q(cfg, precision, fix, optimizer)` trains W_Q of the problem `ControlConfig` describes with any
precision and Fix (None: float64 attention) and returns {"series": per-step lists, "summary": numbers};
`train_treatment` does it for one treatment of a placement (TREATMENTS). `bias_probe` and `delta_identity`
measure at the initial weights without training. The design, each treatment and every series and summary key
are in the book's appendix "Methods and record formats"; `lowprec experiment positive-control` (the module
positive_control) trains and records them.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from lowprec.analysis import ErrorStats
from lowprec.attention import Fix, Precision, emulated_attention, reference_attention
from lowprec.attention.reference import causal_mask, scaled_scores
from lowprec.checks import number
from tqdm import tqdm

TREATMENTS = ("lowp", "fix", "fp32pv", "reference")  # what a run does to its placement (appendix)
OPTIMIZERS = ("adam", "sgd")
FP32_PV = {  # the placements the control trains, each with P̄, the P̄V result and the running O unrounded
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
    """Sizes, the synthetic data and the optimizers (the appendix explains each field)."""

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
    sgd_lr: float = 16.0  # the reference's mean step ||ΔW|| then matches Adam's at lr 3e-3
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
            number(name, getattr(self, name), float, 0)
        for name in ("sink_score", "v_mean", "bias_weight"):
            number(name, getattr(self, name))
        number("adam_eps", self.adam_eps, float, 0, low_open=True)
        number("beta", self.beta, float, 1, low_open=True)
        number("seed", self.seed, int, 0)

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


def control_batch(cfg: ControlConfig, prob: Problem, gen: torch.Generator) -> Batch:
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


def treatment_precision(placement: str, treatment: str, beta: float) -> tuple[Precision | None, Fix | None]:
    """(precision, fix) of a treatment of a placement; precision None = float64 reference."""
    if placement not in FP32_PV:
        raise ValueError(f"placement must be one of {tuple(FP32_PV)}, got {placement!r}")
    if treatment not in TREATMENTS:
        raise ValueError(f"treatment must be one of {TREATMENTS}, got {treatment!r}")
    if treatment == "reference":
        return None, None
    precision = Precision.parse(FP32_PV[placement] if treatment == "fp32pv" else placement)
    return precision, Fix(beta=beta) if treatment == "fix" else None


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
    """Compare one rounded step with float64 attention on the same bf16 q, k, v (the series keys of the
    appendix). q_lp, o_lp: the bf16 q and output after backward (their .grad hold dq and dO). Returns the row
    and this step's mean rank-1 direction Σ_T (PK)[T]^T x[T] (m_first: the first step's, or None)."""
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
    """Loss and backward (w.grad) for one batch with one precision and Fix, plus that step's telemetry row;
    `generator` gives the random bits of stochastic rounding."""
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
    """Run torch on one thread: these tensors are tiny, and a second thread only adds overhead."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@single_thread()
def train_treatment(
    cfg: ControlConfig, placement: str, treatment: str, optimizer: str = "adam", progress: tqdm | None = None
) -> dict:
    """Train W_Q for cfg.steps with one treatment of a placement (`train_w_q`)."""
    precision, fix = treatment_precision(placement, treatment, cfg.beta)
    return train_w_q(cfg, precision, fix, optimizer, progress)


def train_w_q(
    cfg: ControlConfig, precision: Precision | str | None, fix: Fix | None, optimizer: str = "adam",
    progress: tqdm | None = None,
) -> dict:  # fmt: skip
    """Train W_Q for cfg.steps with any precision (None: float64) and Fix, on the same init and data stream
    as every other run; stochastic rounding draws its bits from a generator seeded with cfg.seed + 2."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    precision = None if precision is None else Precision.parse(precision)
    stochastic = precision is not None and precision.stochastic()
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
        row, m = step(cfg, prob, w, control_batch(cfg, prob, gen), precision, fix, m_first, rounding_bits)
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
def bias_probe(cfg: ControlConfig, placement: str, treatment: str, batches: int = 100) -> dict:
    """The per-step δ error and W_Q gradient error on R at the initial weights (no training), as t-stats."""
    precision, fix = treatment_precision(placement, treatment, cfg.beta)
    if precision is None:
        raise ValueError("bias_probe compares a rounded run with float64; treatment must not be 'reference'")
    return rounding_probe(cfg, precision, fix, batches)


def rounding_probe(cfg: ControlConfig, precision: Precision, fix: Fix | None, batches: int = 100) -> dict:
    """`bias_probe` for any precision and Fix (e.g. one of a placement's rounding points left out)."""
    prob = make_problem(cfg)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    rows = []
    for _ in range(batches):
        w = prob.w0.clone().requires_grad_(True)
        rows.append(step(cfg, prob, w, control_batch(cfg, prob, gen), precision, fix)[0])
    delta, g_err = [r["delta_err"] for r in rows], [r["g_err_r"] for r in rows]
    return {
        "delta_err_mean": sum(delta) / batches,
        "delta_err_t": t_stat(delta),
        "g_err_r_mean": sum(g_err) / batches,
        "g_err_r_t": t_stat(g_err),
        "pbar_ones_per_row": sum(r["pbar_ones_per_row"] for r in rows) / batches,
    }


def delta_identity(seed: int = 0, seq: int = 64, head_dim: int = 16, d_model: int = 32) -> dict:
    """Eq. (1) and (2) checked on tied inputs: two emulator backward passes whose δ alone differs (from the
    bf16 O and from the unrounded acc/l). The largest |difference| and |difference - prediction| of dQ and dW
    (appendix "Methods and record formats")."""
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
    """Drift numbers of one run: final ⟨W - W0, R⟩ and its slope, t-stats, one-signedness, norm growth."""
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



__all__ = [
    "OPTIMIZERS",
    "TREATMENTS",
    "ControlConfig",
    "bias_probe",
    "delta_identity",
    "make_problem",
    "control_batch",
    "train_treatment",
    "train_w_q",
]

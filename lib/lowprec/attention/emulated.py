"""`emulated_attention`: FlashAttention-2 in pure PyTorch, in the Triton kernel's tile order and arithmetic.

The op order and rounding points are those of precision.py (its docstring is the contract). Arithmetic follows
the "exact model", so that the Triton kernel run under TRITON_INTERPRET=1 (with interpreter.py's patch) gives
the same bits:
- every dot product is computed in fp64 from the (exactly representable) operands and rounded once to fp32;
- exp, log and row sums are computed in fp64 and rounded once to fp32;
- everything else is single fp32 ops (+, -, *, /, max, compare, select), never fused.

Tiles: the forward loops over key/value tiles of `block_n` columns in increasing order; all query rows are
processed at once inside a tile (the kernel's query blocks only group rows, they do not change any row's
arithmetic; under causal masking rows that cannot see a tile skip it, which adds nothing). The backward
mirrors the kernel's two loops: dK/dV accumulate over query blocks of `block_m` rows in increasing order, dQ
over key tiles of `block_n` columns in increasing order, each step adding one rounded dot to an fp32 sum.

Backward: delta = rowsum(dO * O) with O the saved (output-rounded) output, or the unrounded acc/l
(`o_for_delta="fp32"`), or delta = rowsum(dP * P) (`delta="dP_P"`): the paper's localisation ablations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lowprec.attention.precision import (
    STAT_NAMES,
    AttentionStats,
    Fix,
    FixParams,
    Precision,
    as_fix,
    dot_dtype,
    fix_shift,
    round_accumulator,
    round_output,
    round_product,
    round_rowsum,
    round_scores,
    round_weights,
)
from lowprec.attention.reference import check_qkv

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DELTAS = ("dO_O", "dP_P")
O_FOR_DELTA = ("saved", "fp32")
DEFAULT_BLOCK = 64
NEG_INF = float("-inf")


def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in fp64, rounded once to fp32 (the exact model of an fp32-accumulating dot)."""
    return (a.double() @ b.double()).float()


def exp(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x.double()).float()


def log(x: torch.Tensor) -> torch.Tensor:
    return torch.log(x.double()).float()


def rowsum(x: torch.Tensor) -> torch.Tensor:
    return x.double().sum(-1).float()


def softmax_scale(head_dim: int) -> float:
    """1/sqrt(head_dim) rounded to fp32 (the value the kernel receives)."""
    return float(torch.tensor(1.0 / math.sqrt(head_dim), dtype=torch.float32))


@dataclass
class Config:
    """Everything the forward and backward need besides the tensors."""

    causal: bool
    precision: Precision
    fix: FixParams | None
    tol: float
    block_m: int
    block_n: int
    delta: str
    o_for_delta: str
    generator: torch.Generator | None
    stats: AttentionStats | None = None


def scores(q: torch.Tensor, k: torch.Tensor, rows: slice, cols: slice, cfg: Config, dtype: torch.dtype):
    """Rounded, scaled, masked scores of rows x cols (fp32; q, k already fp32)."""
    s = dot(q[:, :, rows], k[:, :, cols].transpose(-1, -2)) * softmax_scale(q.shape[-1])
    s = round_scores(s, cfg.precision, dtype, cfg.generator)
    if cfg.causal:
        i = torch.arange(rows.start, rows.stop, device=q.device)[:, None]
        j = torch.arange(cols.start, cols.stop, device=q.device)[None, :]
        s = s.masked_fill(j > i, NEG_INF)
    return s


def count_near(s: torch.Tensor, r: torch.Tensor, tol: float) -> torch.Tensor:
    """Whether more than one score of each row is within tol of the row max r (r finite)."""
    return ((s >= (r - tol)[..., None]).sum(-1) > 1) & (r > NEG_INF)


def top_two(s: torch.Tensor, best: torch.Tensor, second: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge a tile's scores into each row's running (largest, second largest), duplicates counted twice."""
    t1 = s.amax(-1)
    repeated = (s == t1[..., None]).sum(-1) > 1
    t2 = torch.where(repeated, t1, s.masked_fill(s == t1[..., None], NEG_INF).amax(-1))
    return torch.maximum(best, t1), torch.maximum(torch.maximum(torch.minimum(best, t1), second), t2)


def tiles(n: int, size: int) -> list[slice]:
    """Consecutive slices of `size` covering range(n) (the last one may be shorter)."""
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: Config):
    """Returns (o: output-rounded fp32, o_unrounded: acc/l fp32, lse fp32) and sets cfg.stats."""
    dtype = q.dtype
    prec, fp = cfg.precision, cfg.fix
    qf, kf, vd = q.float(), k.float(), v.to(dot_dtype(prec, dtype))
    B, H, N, D = q.shape
    m = torch.full((B, H, N), NEG_INF, device=q.device)
    l = torch.zeros((B, H, N), device=q.device)
    acc = torch.zeros((B, H, N, D), device=q.device)
    counters = {name: torch.zeros((B, H, N), dtype=torch.int32, device=q.device) for name in STAT_NAMES}
    col_tiles = tiles(N, cfg.block_n)
    if fp is not None and fp.whole_row:  # first pass: each row's top two scores over all keys
        best = torch.full((B, H, N), NEG_INF, device=q.device)
        second = best.clone()
        for cols in col_tiles:
            rows = slice(cols.start if cfg.causal else 0, N)
            b, s2 = top_two(scores(qf, kf, rows, cols, cfg, dtype), best[:, :, rows], second[:, :, rows])
            best[:, :, rows], second[:, :, rows] = b, s2
        m, triggered, fallback = fix_shift(best, (second >= best - fp.tol) & (best > NEG_INF), fp)
        m = torch.where(triggered, m, NEG_INF)
        counters["fix_triggers"] += triggered.int()
        counters["fallbacks"] += fallback.int()
    for cols in col_tiles:
        rows = slice(cols.start if cfg.causal else 0, N)
        s = scores(qf, kf, rows, cols, cfg, dtype)
        r = s.amax(-1)
        near = count_near(s, r, cfg.tol)
        shift = r
        if fp is not None and not fp.whole_row:
            shift, triggered, fallback = fix_shift(r, count_near(s, r, fp.tol), fp)
            counters["fix_triggers"][:, :, rows] += triggered.int()
            counters["fallbacks"][:, :, rows] += fallback.int()
        m_old = m[:, :, rows]
        m_new = torch.maximum(m_old, shift)
        alpha = exp(m_old - m_new)
        p = exp(s - m_new[..., None])
        l[:, :, rows] = round_rowsum(l[:, :, rows] * alpha + rowsum(p), prec, dtype, cfg.generator)
        p_lp = round_weights(p, prec, dtype, cfg.generator)
        pv = round_product(dot(p_lp.to(vd.dtype), vd[:, :, cols]), prec, dtype, cfg.generator)
        acc[:, :, rows] = round_accumulator(
            acc[:, :, rows] * alpha[..., None] + pv, prec, dtype, cfg.generator
        )
        m[:, :, rows] = m_new
        counters["pbar_ones"][:, :, rows] += (p_lp == 1.0).sum(-1, dtype=torch.int32)
        counters["tie_tiles"][:, :, rows] += ((s == r[..., None]).sum(-1) > 1).int() * (r > NEG_INF).int()
        counters["near_tie_tiles"][:, :, rows] += near.int()
    o_raw = acc / l[..., None]
    o = round_output(o_raw, prec, dtype, cfg.generator)
    lse = m + log(l)
    cfg.stats = AttentionStats(**counters)
    return o, o_raw, lse


def backward(q, k, v, o, lse, do, cfg: Config):
    """dq, dk, dv (fp32) in the kernel's loop order; o is the O used for delta."""
    dtype = q.dtype
    qf, kf, vf, dof = q.float(), k.float(), v.float(), do.float()
    B, H, N, D = q.shape
    if cfg.delta == "dO_O":
        delta = rowsum(dof * o)
    else:  # rowsum(dP * P), accumulated over key tiles
        delta = torch.zeros((B, H, N), device=q.device)
        for cols in tiles(N, cfg.block_n):
            rows = slice(cols.start if cfg.causal else 0, N)
            p = exp(scores(qf, kf, rows, cols, cfg, dtype) - lse[:, :, rows, None])
            dp = dot(dof[:, :, rows], vf[:, :, cols].transpose(-1, -2))
            delta[:, :, rows] += rowsum(dp * p)
    dq, dk, dv = (torch.zeros((B, H, N, D), device=q.device) for _ in range(3))

    def tile_grads(rows: slice, cols: slice):
        p = exp(scores(qf, kf, rows, cols, cfg, dtype) - lse[:, :, rows, None])
        dp = dot(dof[:, :, rows], vf[:, :, cols].transpose(-1, -2))
        ds = p * (dp - delta[:, :, rows, None])
        return p.to(dtype).float(), ds.to(dtype).float()

    for rows in tiles(N, cfg.block_m):  # dK, dV: query blocks in increasing order
        cols = slice(0, rows.stop if cfg.causal else N)
        p, ds = tile_grads(rows, cols)
        dv[:, :, cols] += dot(p.transpose(-1, -2), dof[:, :, rows])
        dk[:, :, cols] += dot(ds.transpose(-1, -2), qf[:, :, rows])
    for cols in tiles(N, cfg.block_n):  # dQ: key tiles in increasing order
        rows = slice(cols.start if cfg.causal else 0, N)
        _, ds = tile_grads(rows, cols)
        dq[:, :, rows] += dot(ds, kf[:, :, cols])
    scale = softmax_scale(D)
    return dq * scale, dk * scale, dv, delta


class _Emulated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cfg: Config):
        o, o_raw, lse = forward(q, k, v, cfg)
        ctx.cfg = cfg
        ctx.save_for_backward(q, k, v, o_raw if cfg.o_for_delta == "fp32" else o, lse)
        ctx.mark_non_differentiable(lse)
        return o.to(q.dtype), lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv, _ = backward(q, k, v, o, lse, do, ctx.cfg)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def make_config(
    q: torch.Tensor,
    causal: bool,
    precision: Precision | str,
    fix: Fix | float | bool | None,
    block_m: int | None,
    block_n: int | None,
    delta: str = "dO_O",
    o_for_delta: str = "saved",
    generator: torch.Generator | None = None,
) -> Config:
    """Validate the options and resolve them for q's dtype (shared with the Triton backend)."""
    precision = Precision.parse(precision)
    if precision.scores.mode != "nearest":
        raise ValueError(
            "precision.scores must round to nearest (the backward recomputes S and must get the "
            f"forward's values); got {precision.scores}"
        )
    fix = as_fix(fix)
    if delta not in DELTAS:
        raise ValueError(f"delta must be one of {DELTAS}, got {delta!r}")
    if o_for_delta not in O_FOR_DELTA:
        raise ValueError(f"o_for_delta must be one of {O_FOR_DELTA}, got {o_for_delta!r}")
    sizes = {}
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        value = value or precision.tile or DEFAULT_BLOCK
        if not (isinstance(value, int) and value >= 1):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
        sizes[name] = value
    weights_fmt = precision.weights.resolve(q.dtype)
    fp = None if fix is None else fix.resolve(weights_fmt)
    tol = fp.tol if fp is not None else Fix().resolve(weights_fmt).tol
    return Config(
        causal, precision, fp, tol, sizes["block_m"], sizes["block_n"], delta, o_for_delta, generator
    )


def emulated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    precision: Precision | str = "fa2",
    fix: Fix | float | bool | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    delta: str = "dO_O",
    o_for_delta: str = "saved",
    generator: torch.Generator | None = None,
    return_stats: bool = False,
    return_lse: bool = False,
):
    """Tiled FlashAttention-2 forward (and autograd backward) with the rounding of `precision`.

    q, k, v: (batch, heads, seq, head_dim), bf16/fp16/fp32, any device. precision: a Precision or its short
    string ("fa2", "paper", "fa2:weights=e8m3", ...). fix: a Fix (or True / a beta value) for the dynamic
    maximum. block_m / block_n: query / key tile sizes (default: precision.tile or 64). delta, o_for_delta:
    backward variants (module docstring). generator: random bits for stochastic rounding.
    Returns o (q's dtype); with return_lse also lse (fp32, (batch, heads, seq)); with return_stats also an
    AttentionStats of the forward pass, in that order.
    """
    check_qkv(q, k, v, dtypes=DTYPES)
    cfg = make_config(q, causal, precision, fix, block_m, block_n, delta, o_for_delta, generator)
    o, lse = _Emulated.apply(q, k, v, cfg)
    extra = ([lse] if return_lse else []) + ([cfg.stats] if return_stats else [])
    return (o, *extra) if extra else o

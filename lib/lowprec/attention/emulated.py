"""`emulated_attention`: FlashAttention-2 in pure PyTorch, in the Triton kernel's tile order and arithmetic.

The op order and rounding points are precision.py's; every dot, exp, log and row sum is computed in fp64 and
rounded once to fp32 (the "exact model"), so that the kernel under TRITON_INTERPRET=1 gives the same bits.
The backward mirrors the kernel's loops; `o_for_delta="fp32"` and `delta="dP_P"` are the paper's localisation
ablations. Tiles and arithmetic in detail: the book's appendix "Methods and record formats".
"""

from __future__ import annotations

import math

import torch

from lowprec.attention.fix import STAT_NAMES, AttentionStats, Fix, f32, fix_shift, ties
from lowprec.attention.plan import CallPlan, plan_call
from lowprec.attention.precision import (
    Precision,
    round_accumulator,
    round_output,
    round_product,
    round_rowsum,
    round_scores,
    round_weights,
)
from lowprec.attention.reference import autocast_qkv, check_qkv, expand_kv
from lowprec.attention.spec import DELTAS, O_FOR_DELTA

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
NEG_INF = float("-inf")
Generator = torch.Generator | None


def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in fp64, rounded once to fp32 (the exact model of an fp32-accumulating dot)."""
    return (a.double() @ b.double()).float()


LOG2E = f32(1.0 / math.log(2.0))  # log2(e) in fp32


def exp_sub(x: torch.Tensor, m: torch.Tensor, natural: bool) -> torch.Tensor:
    """exp(x - m) as the kernels compute it: exp2(x * log2(e) - m * log2(e)), three fp32 ops and exp2
    (FlashAttention-2's form: on a GPU one FMA and ex2; x == m still gives exactly 1), or with `natural`
    exp(x - m), for weights that stay fp32 (the forward's P̄ unrounded, the backward's P with fp32 inputs).
    exp / exp2 in fp64, rounded once to fp32."""
    if natural:
        return torch.exp((x - m).double()).float()
    return torch.exp2((x * LOG2E - m * LOG2E).double()).float()


def log(x: torch.Tensor) -> torch.Tensor:
    return torch.log(x.double()).float()


def rowsum(x: torch.Tensor) -> torch.Tensor:
    return x.double().sum(-1).float()


def scores(q: torch.Tensor, k: torch.Tensor, rows: slice, cols: slice, plan: CallPlan, gen: Generator = None):
    """Rounded, scaled, masked scores of rows x cols (fp32; q, k already fp32 with the same heads, plan for
    the input dtype); causal: -inf where key j > query i + Nk - Nq."""
    s = dot(q[:, :, rows], k[:, :, cols].transpose(-1, -2)) * plan.scale
    s = round_scores(s, plan.precision, plan.dtype, gen)
    if plan.causal:
        i = torch.arange(rows.start, rows.stop, device=q.device)[:, None]
        j = torch.arange(cols.start, cols.stop, device=q.device)[None, :]
        s = s.masked_fill(j > i + (k.shape[2] - q.shape[2]), NEG_INF)
    return s


def seeing_rows(cols: slice, n_q: int, n_k: int, causal: bool) -> slice:
    """The query rows that see at least one key of `cols` (causal: from the first row seeing cols.start)."""
    return slice(min(max(cols.start - (n_k - n_q), 0), n_q) if causal else 0, n_q)


def seen_cols(rows: slice, n_q: int, n_k: int, causal: bool) -> slice:
    """The keys that at least one query row of `rows` sees (causal: up to the last row's last key)."""
    return slice(0, min(max(rows.stop + (n_k - n_q), 0), n_k) if causal else n_k)


def top_two(s: torch.Tensor, best: torch.Tensor, second: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge a tile's scores into each row's running (largest, second largest), duplicates counted twice."""
    t1 = s.amax(-1)
    repeated = (s == t1[..., None]).sum(-1) > 1
    t2 = torch.where(repeated, t1, s.masked_fill(s == t1[..., None], NEG_INF).amax(-1))
    return torch.maximum(best, t1), torch.maximum(torch.maximum(torch.minimum(best, t1), second), t2)


def tiles(n: int, size: int) -> list[slice]:
    """Consecutive slices of `size` covering range(n) (the last one may be shorter)."""
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CallPlan, gen: Generator = None):
    """Returns (o: output-rounded fp32, o_unrounded: acc/l fp32, lse fp32, the counters: (len(STAT_NAMES), B,
    H, N) int32, as the kernel returns them). k, v may have fewer heads than q (each serves a group of query
    heads); rows that see no key get o = 0, lse = +inf."""
    dtype, prec, fp = plan.dtype, plan.precision, plan.fix
    natural = prec.weights.resolve(dtype) is None  # P̄ stays fp32: exp(s - m) as it is (exp_sub)
    B, H, N, D = q.shape
    n_k = k.shape[2]
    qf, kf, vd = q.float(), expand_kv(k.float(), H), expand_kv(v.to(plan.pv_dtype), H)
    m = torch.full((B, H, N), NEG_INF, device=q.device)
    l = torch.zeros((B, H, N), device=q.device)
    acc = torch.zeros((B, H, N, D), device=q.device)
    counters = {name: torch.zeros((B, H, N), dtype=torch.int32, device=q.device) for name in STAT_NAMES}
    col_tiles = [(cols, rows) for cols in tiles(n_k, plan.block_n)
                 if (rows := seeing_rows(cols, N, n_k, plan.causal)).start < N]
    if fp is not None and fp.whole_row:  # first pass: each row's top two scores over all keys
        best = torch.full((B, H, N), NEG_INF, device=q.device)
        second = best.clone()
        for cols, rows in col_tiles:
            b, s2 = top_two(scores(qf, kf, rows, cols, plan, gen), best[:, :, rows], second[:, :, rows])
            best[:, :, rows], second[:, :, rows] = b, s2
        m, triggered, fallback = fix_shift(best, (second >= best - fp.tol) & (best > NEG_INF), fp)
        m = torch.where(triggered, m, NEG_INF)
        counters["fix_triggers"] += triggered.int()
        counters["fix_fallbacks"] += fallback.int()
    for cols, rows in col_tiles:
        # -- scores, ties, shift --
        s = scores(qf, kf, rows, cols, plan, gen)
        r = s.amax(-1)
        exact, near = ties(s, r, plan.tol)
        shift = r
        if fp is not None and not fp.whole_row:
            shift, triggered, fallback = fix_shift(r, ties(s, r, fp.tol)[1], fp)
            counters["fix_triggers"][:, :, rows] += triggered.int()
            counters["fix_fallbacks"][:, :, rows] += fallback.int()
        # -- online softmax: rescale, row sum, P̄V, running output --
        m_old = m[:, :, rows]
        m_new = torch.maximum(m_old, shift)
        m_use = torch.where(m_new == NEG_INF, 0.0, m_new)  # a row with no key yet: exp(-inf - 0) = 0, not NaN
        alpha = exp_sub(m_old, m_use, natural)
        p = exp_sub(s, m_use[..., None], natural)
        if prec.norm == "exact":
            l[:, :, rows] = round_rowsum(l[:, :, rows] * alpha + rowsum(p), prec, dtype, gen)
        p_lp = round_weights(p, prec, dtype, gen)
        if prec.norm == "rounded":
            l[:, :, rows] = round_rowsum(l[:, :, rows] * alpha + rowsum(p_lp), prec, dtype, gen)
        pv = round_product(dot(p_lp.to(vd.dtype), vd[:, :, cols]), prec, dtype, gen)
        acc[:, :, rows] = round_accumulator(acc[:, :, rows] * alpha[..., None] + pv, prec, dtype, gen)
        m[:, :, rows] = m_new
        # -- counters --
        counters["pbar_ones"][:, :, rows] += (p_lp == 1.0).sum(-1, dtype=torch.int32)
        counters["tie_tiles"][:, :, rows] += exact.int()
        counters["near_tie_tiles"][:, :, rows] += near.int()
    empty = l == 0  # rows that saw no key
    l_safe = torch.where(empty, 1.0, l)
    o_raw = acc / l_safe[..., None]
    o = round_output(o_raw, prec, dtype, gen)
    lse = torch.where(empty, float("inf"), m + log(l_safe))
    return o, o_raw, lse, torch.stack([counters[name] for name in STAT_NAMES])


def backward(q, k, v, o, lse, do, plan: CallPlan, delta_mode: str = "dO_O"):
    """dq, dk, dv (fp32) in the kernel's loop order, and delta; o is the O used for delta. dK, dV of a
    key/value head sum its group of query heads: query heads in increasing order, each over its query blocks
    in increasing order (the kernel's `_dkdv` loops)."""
    B, H, N, D = q.shape
    natural = plan.dtype == torch.float32  # P stays fp32 (it is cast to the input dtype): exp_sub
    H_kv, n_k = k.shape[1], k.shape[2]
    group = H // H_kv
    qf, kf, vf, dof = q.float(), k.float(), v.float(), do.float()
    kx, vx = expand_kv(kf, H), expand_kv(vf, H)
    if delta_mode == "dO_O":
        delta = rowsum(dof * o)
    else:  # rowsum(dP * P), accumulated over key tiles
        delta = torch.zeros((B, H, N), device=q.device)
        for cols in tiles(n_k, plan.block_n):
            rows = seeing_rows(cols, N, n_k, plan.causal)
            p = exp_sub(scores(qf, kx, rows, cols, plan), lse[:, :, rows, None], natural)
            dp = dot(dof[:, :, rows], vx[:, :, cols].transpose(-1, -2))
            delta[:, :, rows] += rowsum(dp * p)

    def tile_grads(q_, k_, v_, do_, lse_, delta_, rows: slice, cols: slice):
        p = exp_sub(scores(q_, k_, rows, cols, plan), lse_[:, :, rows, None], natural)
        dp = dot(do_[:, :, rows], v_[:, :, cols].transpose(-1, -2))
        ds = p * (dp - delta_[:, :, rows, None])
        return p.to(plan.dtype).float(), ds.to(plan.dtype).float()

    dq = torch.zeros((B, H, N, D), device=q.device)
    dk, dv = (torch.zeros((B, H_kv, n_k, D), device=q.device) for _ in range(2))
    grouped = [t.unflatten(1, (H_kv, group)) for t in (qf, dof, lse, delta)]  # query head h = kv * group + g
    for g in range(group):  # dK, dV: the group's query heads, each over its query blocks in increasing order
        q_g, do_g, lse_g, delta_g = (t[:, :, g] for t in grouped)
        for rows in tiles(N, plan.block_m):
            cols = seen_cols(rows, N, n_k, plan.causal)
            if cols.stop == 0:
                continue
            p, ds = tile_grads(q_g, kf, vf, do_g, lse_g, delta_g, rows, cols)
            dv[:, :, cols] += dot(p.transpose(-1, -2), do_g[:, :, rows])
            dk[:, :, cols] += dot(ds.transpose(-1, -2), q_g[:, :, rows])
    for cols in tiles(n_k, plan.block_n):  # dQ: key tiles in increasing order
        rows = seeing_rows(cols, N, n_k, plan.causal)
        if rows.start == N:
            continue
        _, ds = tile_grads(qf, kx, vx, dof, lse, delta, rows, cols)
        dq[:, :, rows] += dot(ds, kx[:, :, cols])
    return dq * plan.scale, dk * plan.scale, dv, delta


class _Emulated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: CallPlan, delta: str, o_for_delta: str, gen: Generator):
        o, o_raw, lse, stats = forward(q, k, v, plan, gen)
        ctx.plan, ctx.delta = plan, delta
        ctx.save_for_backward(q, k, v, o_raw if o_for_delta == "fp32" else o, lse)
        ctx.mark_non_differentiable(lse, stats)
        return o.to(q.dtype), lse, stats

    @staticmethod
    def backward(ctx, do, _dlse, _dstats):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv, _ = backward(q, k, v, o, lse, do, ctx.plan, ctx.delta)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def emulated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    precision: Precision | str = "fa2",
    fix: Fix | float | bool | str | None = None,
    scale: float | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    delta: str = "dO_O",
    o_for_delta: str = "saved",
    generator: torch.Generator | None = None,
    return_stats: bool = False,
    return_lse: bool = False,
):
    """Tiled FlashAttention-2 forward (and autograd backward) with the rounding of `precision`.

    q: (B, H, Nq, D), k, v: (B, H_kv, Nk, D) with H a multiple of H_kv (grouped-query attention),
    bf16/fp16/fp32, any device; causal aligns the mask bottom-right (reference.py). precision: a Precision or
    its short string ("fa2", "paper", "fa2:weights=e8m3", ...). fix: a Fix (or True / a beta value /
    "2:tie=row") for the dynamic maximum. scale: the softmax scale (default 1/sqrt(D); rounded to fp32).
    block_m / block_n: query / key tile sizes (default: precision.tile or 64). delta, o_for_delta: backward
    variants (the paper's localisation ablations). generator: random bits for stochastic rounding.
    Returns o (q's dtype); with return_lse also lse (fp32, (batch, heads, seq)); with return_stats also an
    AttentionStats of the forward pass, in that order. Under autocast q, k and v are first cast to its dtype,
    as torch's SDPA casts them.
    """
    q, k, v = autocast_qkv(q, k, v)
    check_qkv(q, k, v, dtypes=DTYPES)
    if delta not in DELTAS:
        raise ValueError(f"delta must be one of {DELTAS}, got {delta!r}")
    if o_for_delta not in O_FOR_DELTA:
        raise ValueError(f"o_for_delta must be one of {O_FOR_DELTA}, got {o_for_delta!r}")
    plan = plan_call(q.dtype, q.shape[-1], causal, precision, fix, block_m, block_n, scale)
    o, lse, stats = _Emulated.apply(q, k, v, plan, delta, o_for_delta, generator)
    extra = ([lse] if return_lse else []) + ([AttentionStats(*stats.unbind(0))] if return_stats else [])
    return (o, *extra) if extra else o

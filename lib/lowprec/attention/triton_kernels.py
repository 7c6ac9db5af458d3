"""The `@triton.jit` kernels of `flash_attention`: FlashAttention-2 forward and backward with lowprec's
rounding points and Fix. Launch, autotune and autograd are in flash.py; the rounding points, the Fix's shift
and the exp / log / dot helpers, each a mirror of its torch function, in triton_rounding.py.

Design
- Forward (`_fwd`): one program per (query block of BLOCK_M rows, batch*head). It loops over key/value tiles
  of BLOCK_N columns in increasing order (causal: only tiles holding a key <= the block's last query), keeps
  m, l and the output accumulator in fp32 registers, and performs the op sequence of precision.py
  (`_fwd_step`) with each rounding point as a call to `_round` with its code from the constexpr tuple CODES:
  fa2 only casts P̄ to the input dtype before the P̄V dot and the output when it is stored. With the Fix
  (constexpr FIX: 1 = ties per tile, 2 = per whole row, which adds a first pass computing each row's top two
  scores) the row shift follows `_fix_shift`, the mirror of fix.fix_shift; the Fix's numbers come as one
  runtime tuple `fix` = (beta, tol, min_gap, max_gap) (tol is also the counters' near-tie window). Per-row
  int32 counters (P̄ == 1 entries, tie tiles, near-tie tiles, Fix triggers, fallbacks; the tuple `counts`,
  in STAT_NAMES order) are written when WITH_STATS.
- Backward: `_delta` (delta = rowsum(dO * O) from the stored O), `_dkdv` (one program per key block,
  looping over query blocks in increasing order) and `_dq` (one program per query block, looping over key
  tiles in increasing order): dQ is its own loop, so there are no atomics and the result is deterministic;
  dK, dV and dQ accumulate in fp32 and are stored in the input dtype. P and dS are cast to the input dtype
  before their dots (FlashAttention-2); fp32 inputs use IEEE fp32 dots (no TF32).
- Any sequence length (rows/columns beyond N are masked), head dims 16..128 (padded to a power of two,
  BLOCK_D, with masked loads), bf16 / fp16 / fp32 inputs, causal or not. Each loop runs first over the tiles
  that need no mask, then over those that do (MASK, a constexpr of the step functions).
- Arithmetic: everything except loads, stores, casts and tl.dot operands is fp32; exp/log are natural
  (no exp2 with a folded log2(e), so that the emulator's op order stays the same on every device). The op
  order is the emulator's, op for op: under TRITON_INTERPRET=1 (with interpreter.py's patch) the kernels are
  bit-identical to emulated_attention, so any reordering here breaks tests/test_flash_kernel.py.
- Cost of the Fix (tie="tile"): per score one compare that yields 1.0 / 0.0 and one fp32 add (the tie count),
  per row a few selects; the counters are computed and stored only when WITH_STATS.
- The kernels do not specialise on N or B*H (do_not_specialize), so one compiled variant serves every sequence
  length.
"""

from __future__ import annotations

from lowprec.attention import triton_mode  # noqa: F401 (first: it may switch on the interpreter)

# isort: split
import triton
import triton.language as tl

from lowprec.attention.triton_rounding import (
    ACCUMULATOR,
    OUTPUT,
    PRODUCT,
    ROWSUM,
    SCORES,
    WEIGHTS,
    _dot,
    _exp,
    _fix_shift,
    _log,
    _round,
)

# ------------------------------------------------------------------------------------- loads and scores


@triton.jit
def _load(ptr, rows, offs_d, N, D: tl.constexpr, TRANSPOSE: tl.constexpr):
    """Rows `rows` of a row-major (N, D) matrix, zero-padded to BLOCK_D columns: (len(rows), BLOCK_D), or
    (BLOCK_D, len(rows)) when TRANSPOSE."""
    if TRANSPOSE:
        mask = (rows[None, :] < N) & (offs_d[:, None] < D)
        x = tl.load(ptr + rows[None, :] * D + offs_d[:, None], mask=mask, other=0.0)
    else:
        mask = (rows[:, None] < N) & (offs_d[None, :] < D)
        x = tl.load(ptr + rows[:, None] * D + offs_d[None, :], mask=mask, other=0.0)
    return x


@triton.jit
def _scores(q, kt, offs_m, offs_n, N, scale, MASK: tl.constexpr, CAUSAL: tl.constexpr, C_SCORES: tl.constexpr,
            IEEE: tl.constexpr):
    """s = round_scores(dot(q, k^T) * scale), then -inf where masked (only in tiles that need a mask);
    emulated.scores. (BLOCK_M, BLOCK_N) fp32."""
    s = _round(_dot(q, kt, None, IEEE) * scale, C_SCORES, 0, 0, offs_m[:, None])
    if MASK:
        valid = offs_n[None, :] < N
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(valid, s, float("-inf"))
    return s


@triton.jit
def _top_two(s, best, second):
    """Mirror of emulated.top_two: merge a tile's scores into each row's running (largest, second largest),
    duplicates counted twice."""
    t1 = tl.max(s, 1)  # (BLOCK_M,)
    top = s == t1[:, None]  # (BLOCK_M, BLOCK_N)
    t2 = tl.where(tl.sum(top.to(tl.int32), 1) > 1, t1, tl.max(tl.where(top, float("-inf"), s), 1))
    return tl.maximum(best, t1), tl.maximum(tl.maximum(tl.minimum(best, t1), second), t2)


# ----------------------------------------------------------------------------------------------- forward


@triton.jit
def _fwd_step(q, K, V, start_n, offs_m, offs_d, N, scale, m_i, l_i, acc, counts, fix, seed, bh,
              D: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
              FIX: tl.constexpr, WITH_STATS: tl.constexpr, P_FP32: tl.constexpr, NATIVE_P: tl.constexpr,
              IEEE: tl.constexpr, CODES: tl.constexpr):
    """One key/value tile of the forward pass (precision.py's op order, each rounding point a `_round`).
    Returns the updated (m_i, l_i, acc, counts)."""
    n_ones, n_ties, n_near, n_trig, n_fallback = counts  # (BLOCK_M,) int32 each
    tol = fix[1]  # fix = (beta, tol, min_gap, max_gap)
    # -- scores --
    offs_n = start_n + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    kt = _load(K, offs_n, offs_d, N, D, True)  # (BLOCK_D, BLOCK_N)
    s = _scores(q, kt, offs_m, offs_n, N, scale, MASK, CAUSAL, CODES[SCORES], IEEE)  # (BLOCK_M, BLOCK_N)
    r = tl.max(s, 1)  # (BLOCK_M,)
    # -- shift (Fix) --
    if FIX == 1:
        # count in fp32 (a compare that yields 1.0 / 0.0, then FADDs): cheaper on a GPU than an int count
        ties = (tl.sum(tl.where(s >= (r - tol)[:, None], 1.0, 0.0), 1) > 1.0) & (r > float("-inf"))
        shift, triggered, fallback = _fix_shift(r, ties, fix)
        if WITH_STATS:
            n_trig += triggered.to(tl.int32)
            n_fallback += fallback.to(tl.int32)
    else:
        shift = r
    # -- online softmax: rescale, P̄, row sum --
    m_new = tl.maximum(m_i, shift)  # (BLOCK_M,)
    alpha = _exp(m_i - m_new, IEEE)  # (BLOCK_M,)
    p = _exp(s - m_new[:, None], IEEE)  # (BLOCK_M, BLOCK_N)
    row_idx = offs_m * N + start_n  # (BLOCK_M,) element index of the stochastic bits
    l_i = _round(l_i * alpha + tl.sum(p, 1), CODES[ROWSUM], seed, bh * 8 + ROWSUM, row_idx)
    # -- weights: P̄ as it enters the dot --
    v = _load(V, offs_n, offs_d, N, D, False)  # (BLOCK_N, BLOCK_D)
    if NATIVE_P:  # the weights rounding is the cast to V's dtype: do it once
        p_dot = p.to(V.dtype.element_ty)
        p = p_dot.to(tl.float32)
    else:
        p = _round(p, CODES[WEIGHTS], seed, bh * 8 + WEIGHTS, offs_m[:, None] * N + offs_n[None, :])
        if P_FP32:
            p_dot = p
            v = v.to(tl.float32)
        else:
            p_dot = p.to(V.dtype.element_ty)
    # -- P̄V and the running output --
    if (CODES[PRODUCT] == 0) and (CODES[ACCUMULATOR] == 0):
        acc = _dot(p_dot, v, acc * alpha[:, None], IEEE or P_FP32)  # (BLOCK_M, BLOCK_D)
    else:
        acc_idx = row_idx[:, None] * acc.shape[1] + offs_d[None, :]  # (BLOCK_M, BLOCK_D)
        pv = _round(_dot(p_dot, v, None, IEEE or P_FP32), CODES[PRODUCT], seed, bh * 8 + PRODUCT, acc_idx)
        acc = _round(acc * alpha[:, None] + pv, CODES[ACCUMULATOR], seed, bh * 8 + ACCUMULATOR, acc_idx)
    # -- counters --
    if WITH_STATS:
        finite = r > float("-inf")
        n_ones += tl.sum((p == 1.0).to(tl.int32), 1)
        n_ties += ((tl.sum((s == r[:, None]).to(tl.int32), 1) > 1) & finite).to(tl.int32)
        n_near += ((tl.sum((s >= (r - tol)[:, None]).to(tl.int32), 1) > 1) & finite).to(tl.int32)
    return m_new, l_i, acc, (n_ones, n_ties, n_near, n_trig, n_fallback)


@triton.jit(do_not_specialize=["N", "BH", "seed"])
def _fwd(Q, K, V, O, LSE, STATS, N, BH, scale, fix, seed, D: tl.constexpr, BLOCK_D: tl.constexpr,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, FIX: tl.constexpr,
         WITH_STATS: tl.constexpr, P_FP32: tl.constexpr, NATIVE_P: tl.constexpr, IEEE: tl.constexpr,
         CODES: tl.constexpr):
    """Forward of one query block: key tiles without masks first, then the tiles that need one."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)  # B*H folded over the grid's y and z
    if bh >= BH:  # the fold's last row of programs may overshoot
        return
    base = bh.to(tl.int64) * N * D
    Q, K, V, O = Q + base, K + base, V + base, O + base
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    q = _load(Q, offs_m, offs_d, N, D, False)  # (BLOCK_M, BLOCK_D)
    if CAUSAL:  # tiles wholly left of the block's first query need no mask
        full_end = (pid_m * BLOCK_M) // BLOCK_N * BLOCK_N
        hi = tl.minimum((pid_m + 1) * BLOCK_M, N)
    else:
        full_end = N // BLOCK_N * BLOCK_N
        hi = N
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # (BLOCK_M,) running max (the shift)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # (BLOCK_M,) running row sum
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)  # (BLOCK_M, BLOCK_D) running output
    zero = tl.zeros([BLOCK_M], tl.int32)
    counts = (zero, zero, zero, zero, zero)  # n_ones, n_ties, n_near, n_trig, n_fallback
    if FIX == 2:  # whole-row tie detection: each row's top two scores over all keys first
        best = tl.full([BLOCK_M], float("-inf"), tl.float32)  # (BLOCK_M,)
        second = tl.full([BLOCK_M], float("-inf"), tl.float32)  # (BLOCK_M,)
        for start_n in range(0, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            kt = _load(K, offs_n, offs_d, N, D, True)  # (BLOCK_D, BLOCK_N)
            s = _scores(q, kt, offs_m, offs_n, N, scale, True, CAUSAL, CODES[SCORES], IEEE)
            best, second = _top_two(s, best, second)
        ties = (second >= best - fix[1]) & (best > float("-inf"))
        shift, triggered, fallback = _fix_shift(best, ties, fix)
        m_i = tl.where(triggered, shift, float("-inf"))
        counts = (zero, zero, zero, triggered.to(tl.int32), fallback.to(tl.int32))
    for start_n in range(0, full_end, BLOCK_N):
        m_i, l_i, acc, counts = _fwd_step(q, K, V, start_n, offs_m, offs_d, N, scale, m_i, l_i, acc, counts,
                                          fix, seed, bh, D, BLOCK_N, False, CAUSAL, FIX, WITH_STATS, P_FP32,
                                          NATIVE_P, IEEE, CODES)
    for start_n in range(full_end, hi, BLOCK_N):
        m_i, l_i, acc, counts = _fwd_step(q, K, V, start_n, offs_m, offs_d, N, scale, m_i, l_i, acc, counts,
                                          fix, seed, bh, D, BLOCK_N, True, CAUSAL, FIX, WITH_STATS, P_FP32,
                                          NATIVE_P, IEEE, CODES)
    # -- output and lse --
    out_idx = offs_m[:, None] * BLOCK_D + offs_d[None, :]  # (BLOCK_M, BLOCK_D)
    o = tl.div_rn(acc, tl.broadcast_to(l_i[:, None], (BLOCK_M, BLOCK_D)))  # IEEE division, also on GPU
    o = _round(o, CODES[OUTPUT], seed, bh * 8 + OUTPUT, out_idx)
    row_ok = offs_m < N
    tl.store(O + offs_m[:, None] * D + offs_d[None, :], o.to(O.dtype.element_ty),
             mask=row_ok[:, None] & (offs_d[None, :] < D))
    tl.store(LSE + bh.to(tl.int64) * N + offs_m, m_i + _log(l_i, IEEE), mask=row_ok)
    # -- counters: one (batch*head, N) plane each, in STAT_NAMES order --
    if WITH_STATS:
        stats = STATS + bh.to(tl.int64) * N + offs_m
        plane = BH.to(tl.int64) * N  # B*H*N per counter
        for i in tl.static_range(5):
            tl.store(stats + i * plane, counts[i], mask=row_ok)


# ---------------------------------------------------------------------------------------------- backward


@triton.jit(do_not_specialize=["N", "BH"])
def _delta(O, DO, DELTA, N, BH, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta = rowsum(dO * O), fp32 products and sum, O as stored."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)  # B*H folded over the grid's y and z
    if bh >= BH:  # the fold's last row of programs may overshoot
        return
    base = bh.to(tl.int64) * N * D
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o = _load(O + base, offs_m, offs_d, N, D, False).to(tl.float32)  # (BLOCK_M, BLOCK_D)
    do = _load(DO + base, offs_m, offs_d, N, D, False).to(tl.float32)  # (BLOCK_M, BLOCK_D)
    tl.store(DELTA + bh.to(tl.int64) * N + offs_m, tl.sum(o * do, 1), mask=offs_m < N)


@triton.jit
def _dkdv_step(Q, DO, LSE, DELTA, k, v, dk, dv, start_m, offs_n, offs_d, N, scale, D: tl.constexpr,
               BLOCK_M: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
               C_SCORES: tl.constexpr):
    """One query block's contribution to a key block's dK, dV (computed transposed: keys x queries)."""
    offs_m = start_m + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    qt = _load(Q, offs_m, offs_d, N, D, True)  # (BLOCK_D, BLOCK_M)
    do = _load(DO, offs_m, offs_d, N, D, False)  # (BLOCK_M, BLOCK_D)
    lse = tl.load(LSE + offs_m, mask=offs_m < N, other=0.0)  # (BLOCK_M,)
    delta = tl.load(DELTA + offs_m, mask=offs_m < N, other=0.0)  # (BLOCK_M,)
    # -- scores, transposed --
    st = _round(_dot(k, qt, None, IEEE) * scale, C_SCORES, 0, 0, offs_n[:, None])  # (BLOCK_N, BLOCK_M)
    if MASK:
        valid = (offs_m[None, :] < N) & (offs_n[:, None] < N)
        if CAUSAL:
            valid = valid & (offs_n[:, None] <= offs_m[None, :])
        st = tl.where(valid, st, float("-inf"))
    # -- P from the saved lse, then dV --
    pt = _exp(st - lse[None, :], IEEE)  # (BLOCK_N, BLOCK_M)
    dv = _dot(pt.to(DO.dtype.element_ty), do, dv, IEEE)  # (BLOCK_N, BLOCK_D)
    # -- dS = P (dP - delta), then dK --
    dst = pt * (_dot(v, tl.trans(do), None, IEEE) - delta[None, :])  # (BLOCK_N, BLOCK_M)
    dk = _dot(dst.to(Q.dtype.element_ty), tl.trans(qt), dk, IEEE)  # (BLOCK_N, BLOCK_D)
    return dk, dv


@triton.jit(do_not_specialize=["N", "BH"])
def _dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, N, BH, scale, D: tl.constexpr, BLOCK_D: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
          C_SCORES: tl.constexpr):
    """dK, dV of one key block: query blocks in increasing order (diagonal ones masked, then unmasked ones,
    then the tail beyond the last whole block)."""
    pid_n = tl.program_id(0)
    bh = tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)  # B*H folded over the grid's y and z
    if bh >= BH:  # the fold's last row of programs may overshoot
        return
    base = bh.to(tl.int64) * N * D
    Q, K, V, DO, DK, DV = Q + base, K + base, V + base, DO + base, DK + base, DV + base
    LSE, DELTA = LSE + bh.to(tl.int64) * N, DELTA + bh.to(tl.int64) * N
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    offs_d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    k = _load(K, offs_n, offs_d, N, D, False)  # (BLOCK_N, BLOCK_D)
    v = _load(V, offs_n, offs_d, N, D, False)  # (BLOCK_N, BLOCK_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    if CAUSAL:  # query blocks from the one holding this block's first key; unmasked once past its last key
        lo = start_n // BLOCK_M * BLOCK_M
        mid = (start_n + BLOCK_N - 1 + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    else:
        lo = 0
        mid = 0
    end = tl.where(start_n + BLOCK_N <= N, N // BLOCK_M * BLOCK_M, mid)  # end of the unmasked blocks
    for start_m in range(lo, tl.minimum(mid, N), BLOCK_M):
        dk, dv = _dkdv_step(Q, DO, LSE, DELTA, k, v, dk, dv, start_m, offs_n, offs_d, N, scale, D, BLOCK_M,
                            True, CAUSAL, IEEE, C_SCORES)
    for start_m in range(mid, end, BLOCK_M):
        dk, dv = _dkdv_step(Q, DO, LSE, DELTA, k, v, dk, dv, start_m, offs_n, offs_d, N, scale, D, BLOCK_M,
                            False, CAUSAL, IEEE, C_SCORES)
    for start_m in range(tl.maximum(mid, end), N, BLOCK_M):
        dk, dv = _dkdv_step(Q, DO, LSE, DELTA, k, v, dk, dv, start_m, offs_n, offs_d, N, scale, D, BLOCK_M,
                            True, CAUSAL, IEEE, C_SCORES)
    kv_mask = (offs_n[:, None] < N) & (offs_d[None, :] < D)
    tl.store(DK + offs_n[:, None] * D + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + offs_n[:, None] * D + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_step(q, do, lse, delta, K, V, dq, start_n, offs_m, offs_d, N, scale, D: tl.constexpr,
             BLOCK_N: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
             C_SCORES: tl.constexpr):
    """One key tile's contribution to a query block's dQ."""
    offs_n = start_n + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    kt = _load(K, offs_n, offs_d, N, D, True)  # (BLOCK_D, BLOCK_N)
    # -- scores, P from the saved lse --
    s = _scores(q, kt, offs_m, offs_n, N, scale, MASK, CAUSAL, C_SCORES, IEEE)  # (BLOCK_M, BLOCK_N)
    p = _exp(s - lse[:, None], IEEE)  # (BLOCK_M, BLOCK_N)
    # -- dS = P (dP - delta), then dQ --
    vt = _load(V, offs_n, offs_d, N, D, True)  # (BLOCK_D, BLOCK_N)
    ds = p * (_dot(do, vt, None, IEEE) - delta[:, None])  # (BLOCK_M, BLOCK_N)
    return _dot(ds.to(q.dtype), tl.trans(kt), dq, IEEE)  # (BLOCK_M, BLOCK_D)


@triton.jit(do_not_specialize=["N", "BH"])
def _dq(Q, K, V, DO, LSE, DELTA, DQ, N, BH, scale, D: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
        C_SCORES: tl.constexpr):
    """dQ of one query block: key tiles in increasing order, unmasked ones first (no atomics)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)  # B*H folded over the grid's y and z
    if bh >= BH:  # the fold's last row of programs may overshoot
        return
    base = bh.to(tl.int64) * N * D
    Q, K, V, DO, DQ = Q + base, K + base, V + base, DO + base, DQ + base
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    q = _load(Q, offs_m, offs_d, N, D, False)  # (BLOCK_M, BLOCK_D)
    do = _load(DO, offs_m, offs_d, N, D, False)  # (BLOCK_M, BLOCK_D)
    lse = tl.load(LSE + bh.to(tl.int64) * N + offs_m, mask=offs_m < N, other=0.0)  # (BLOCK_M,)
    delta = tl.load(DELTA + bh.to(tl.int64) * N + offs_m, mask=offs_m < N, other=0.0)  # (BLOCK_M,)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if CAUSAL:
        full_end = (pid_m * BLOCK_M) // BLOCK_N * BLOCK_N
        hi = tl.minimum((pid_m + 1) * BLOCK_M, N)
    else:
        full_end = N // BLOCK_N * BLOCK_N
        hi = N
    for start_n in range(0, full_end, BLOCK_N):
        dq = _dq_step(q, do, lse, delta, K, V, dq, start_n, offs_m, offs_d, N, scale, D, BLOCK_N, False,
                      CAUSAL, IEEE, C_SCORES)
    for start_n in range(full_end, hi, BLOCK_N):
        dq = _dq_step(q, do, lse, delta, K, V, dq, start_n, offs_m, offs_d, N, scale, D, BLOCK_N, True,
                      CAUSAL, IEEE, C_SCORES)
    tl.store(DQ + offs_m[:, None] * D + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=(offs_m[:, None] < N) & (offs_d[None, :] < D))

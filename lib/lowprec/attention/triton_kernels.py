"""The `@triton.jit` kernels of `flash_attention`: FlashAttention-2 forward (`_fwd`) and backward (`_delta`,
`_dkdv`, `_dq`) with lowprec's rounding points and Fix.

Each loop performs the op order of precision.py, a rounding point being a call to `_round` with its code from
the constexpr tuple CODES; the mirrors of the torch functions are in triton_rounding.py, the launch in
flash.py. Under TRITON_INTERPRET=1 the kernels are bit-identical to emulated_attention, so any reordering here
breaks tests/test_flash_kernel.py. Programs, masks, arithmetic and the cost of the Fix: the book's appendix
"Methods and record formats".
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
    _exp_sub,
    _fix_shift,
    _log,
    _round,
    _to_bf16,
    _widen_bf16,
)

# ------------------------------------------------------------------------------------- loads and scores


@triton.jit
def _load(ptr, rows, offs_d, n_rows, stride, D: tl.constexpr, TRANSPOSE: tl.constexpr,
          CHECK_ROWS: tl.constexpr = True):
    """Rows `rows` (< n_rows, `stride` elements apart) of an (n_rows, D) matrix with unit column stride,
    zero-padded to BLOCK_D columns: (len(rows), BLOCK_D), or (BLOCK_D, len(rows)) when TRANSPOSE. Without
    CHECK_ROWS the caller guarantees rows < n_rows (a tile that needs no mask), so a head dim that fills
    BLOCK_D loads with no mask."""
    if TRANSPOSE:
        ptrs = ptr + rows[None, :] * stride + offs_d[:, None]
        row_ok, col_ok = rows[None, :] < n_rows, offs_d[:, None] < D
    else:
        ptrs = ptr + rows[:, None] * stride + offs_d[None, :]
        row_ok, col_ok = rows[:, None] < n_rows, offs_d[None, :] < D
    if CHECK_ROWS:
        x = tl.load(ptrs, mask=row_ok & col_ok, other=0.0)
    elif offs_d.shape[0] > D:  # a padded head dim
        x = tl.load(ptrs, mask=col_ok, other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _described(ptr, n_rows, stride, D: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """A tensor descriptor of the head's (n_rows, D) matrix at `ptr` (rows `stride` elements apart, the head
    dim contiguous), loaded (ROWS, BLOCK_D) tiles at a time (`_streamed`)."""
    return tl.make_tensor_descriptor(ptr, shape=[n_rows, D], strides=[stride, 1], block_shape=[ROWS, BLOCK_D])


@triton.jit
def _streamed(ptr, start, rows, offs_d, n_rows, stride, D: tl.constexpr, TRANSPOSE: tl.constexpr,
              CHECK_ROWS: tl.constexpr, TMA: tl.constexpr):
    """A tile a kernel streams (keys, values, queries or dO): `_load` of `rows` (start, start + 1, ...), or
    (TMA) the same tile through `ptr`, a tensor descriptor of the head's (n_rows, D) matrix whose block is
    (len(rows), BLOCK_D): rows past n_rows and columns past D come back as zeros, as `_load` pads them."""
    if TMA:
        x = ptr.load([start, 0])  # (BLOCK_N, BLOCK_D)
        if TRANSPOSE:
            x = tl.trans(x)
    else:
        x = _load(ptr, rows, offs_d, n_rows, stride, D, TRANSPOSE, CHECK_ROWS)
    return x


@triton.jit
def _program(H, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's block and head: (the block's first row, its rows (BLOCK,), the head dim's offsets
    (BLOCK_D,), bh, b, h). B*H is folded over the grid's y and z, so in the fold's last row of programs bh
    may reach B*H: the caller returns then."""
    bh = tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)
    start = tl.program_id(0) * BLOCK
    return start, start + tl.arange(0, BLOCK), tl.arange(0, BLOCK_D), bh, bh // H, bh % H


@triton.jit
def _head(b, h, strides):
    """Element offset (int64) of head h of batch b for strides (batch, head, seq)."""
    return b.to(tl.int64) * strides[0] + h.to(tl.int64) * strides[1]


@triton.jit
def _scores(q, kt, offs_m, offs_n, N_K, offset, scale, MASK: tl.constexpr, CAUSAL: tl.constexpr,
            C_SCORES: tl.constexpr, IEEE: tl.constexpr):
    """s = round_scores(dot(q, k^T) * scale), then -inf where masked (keys >= N_K; causal: key j > query
    i + offset, offset = N_K - N_Q) in tiles that need a mask; emulated.scores. (BLOCK_M, BLOCK_N) fp32."""
    s = _round(_dot(q, kt, None, IEEE) * scale, C_SCORES, 0, 0, offs_m[:, None])
    if MASK:
        valid = offs_n[None, :] < N_K
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None] + offset)
        s = tl.where(valid, s, float("-inf"))
    return s


@triton.jit
def _key_range(m0, N_Q, N_K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """(full_end, hi) for the query block starting at row m0: key tiles below full_end need no mask (every
    row sees every key), the tiles in [full_end, hi) need one, keys >= hi are seen by no row of the block."""
    if CAUSAL:  # row i sees keys j <= i + N_K - N_Q
        last = m0 + N_K - N_Q  # the last key the block's first row sees
        full_end = tl.minimum(tl.maximum(last + 1, 0) // BLOCK_N * BLOCK_N, N_K // BLOCK_N * BLOCK_N)
        hi = tl.minimum(last + BLOCK_M, N_K)
    else:
        full_end = N_K // BLOCK_N * BLOCK_N
        hi = N_K
    return full_end, hi


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
def _fwd_step(q, K, V, start_n, offs_m, offs_d, N_K, offset, sk_n, sv_n, scale, m_i, l_i, acc, counts, fix,
              seed, bh, D: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
              FIX: tl.constexpr, WITH_STATS: tl.constexpr, P_FP32: tl.constexpr, NATIVE_P: tl.constexpr,
              NORM: tl.constexpr, IEEE: tl.constexpr, CODES: tl.constexpr, TMA: tl.constexpr):
    """One key/value tile of the forward pass (precision.py's op order, each rounding point a `_round`).
    K and V: pointers, or (TMA) tensor descriptors. Returns the updated (m_i, l_i, acc, counts)."""
    n_ones, n_ties, n_near, n_trig, n_fallback = counts  # (BLOCK_M,) int32 each
    tol = fix[1]  # fix = (beta, tol, min_gap, max_gap)
    # -- scores --
    offs_n = start_n + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    kt = _streamed(K, start_n, offs_n, offs_d, N_K, sk_n, D, True, MASK, TMA)  # (BLOCK_D, BLOCK_N)
    s = _scores(q, kt, offs_m, offs_n, N_K, offset, scale, MASK, CAUSAL, CODES[SCORES], IEEE)
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
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: exp(-inf - 0) = 0, not NaN
    natural: tl.constexpr = CODES[WEIGHTS] == 0  # P̄ stays fp32: exp(s - m) as it is
    alpha = _exp_sub(m_i, m_use, natural, IEEE)  # (BLOCK_M,)
    p = _exp_sub(s, m_use[:, None], natural, IEEE)  # (BLOCK_M, BLOCK_N)
    row_idx = offs_m * N_K + start_n  # (BLOCK_M,) element index of the stochastic bits
    if NORM == 0:  # "exact": l sums the fp32 P
        l_i = _round(l_i * alpha + tl.sum(p, 1), CODES[ROWSUM], seed, bh * 8 + ROWSUM, row_idx)
    # -- weights: P̄ as it enters the dot --
    v = _streamed(V, start_n, offs_n, offs_d, N_K, sv_n, D, False, MASK, TMA)  # (BLOCK_N, BLOCK_D)
    if NATIVE_P:  # the weights rounding is the cast to V's dtype: do it once
        if (NORM == 1) and (v.dtype == tl.bfloat16):  # P̄ widened again for l: both in pairs
            p_dot = _to_bf16(p)
            p = _widen_bf16(p_dot)
        else:
            p_dot = p.to(v.dtype)
            p = p_dot.to(tl.float32)
    else:
        p = _round(p, CODES[WEIGHTS], seed, bh * 8 + WEIGHTS, offs_m[:, None] * N_K + offs_n[None, :])
        if P_FP32:
            p_dot = p
            v = v.to(tl.float32)
        else:
            p_dot = p.to(v.dtype)
    if NORM == 1:  # "rounded": l sums the P̄ that enter the dot
        l_i = _round(l_i * alpha + tl.sum(p, 1), CODES[ROWSUM], seed, bh * 8 + ROWSUM, row_idx)
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


# Sizes are runtime values (do_not_specialize): Triton would otherwise compile a new variant for a value of 1
# or a multiple of 16; so one compiled variant serves every sequence length, head count and group size.
@triton.jit(do_not_specialize=["N_Q", "N_K", "H", "GROUP", "BH", "seed"])
def _fwd(Q, K, V, O, LSE, STATS, sq, sk, sv, so, N_Q, N_K, H, GROUP, BH, scale, fix, seed, D: tl.constexpr,
         BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
         FIX: tl.constexpr, WITH_STATS: tl.constexpr, P_FP32: tl.constexpr, NATIVE_P: tl.constexpr,
         NORM: tl.constexpr, IEEE: tl.constexpr, CODES: tl.constexpr, TMA: tl.constexpr = False):
    """Forward of one query block of one query head: key tiles without masks first, then the tiles that need
    one. sq, sk, sv, so: (batch, head, seq) strides; the head dim is contiguous. TMA: the key and value
    tiles come through tensor descriptors of the head (16-byte aligned head and row strides: the caller
    checks), bit for bit the same tiles."""
    m0, offs_m, offs_d, bh, b, h = _program(H, BLOCK_M, BLOCK_D)
    if bh >= BH:
        return
    Q, O = Q + _head(b, h, sq), O + _head(b, h, so)
    K, V = K + _head(b, h // GROUP, sk), V + _head(b, h // GROUP, sv)  # the group's key/value head
    if TMA:  # from here on K and V are the head's descriptors, one (BLOCK_N, BLOCK_D) tile a load
        K, V = _described(K, N_K, sk[2], D, BLOCK_N, BLOCK_D), _described(V, N_K, sv[2], D, BLOCK_N, BLOCK_D)
    offset = N_K - N_Q  # causal: row i sees keys j <= i + offset
    q = _load(Q, offs_m, offs_d, N_Q, sq[2], D, False)  # (BLOCK_M, BLOCK_D)
    full_end, hi = _key_range(m0, N_Q, N_K, BLOCK_M, BLOCK_N, CAUSAL)
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
            kt = _streamed(K, start_n, offs_n, offs_d, N_K, sk[2], D, True, True, TMA)  # (BLOCK_D, BLOCK_N)
            s = _scores(q, kt, offs_m, offs_n, N_K, offset, scale, True, CAUSAL, CODES[SCORES], IEEE)
            best, second = _top_two(s, best, second)
        ties = (second >= best - fix[1]) & (best > float("-inf"))
        shift, triggered, fallback = _fix_shift(best, ties, fix)
        m_i = tl.where(triggered, shift, float("-inf"))
        counts = (zero, zero, zero, triggered.to(tl.int32), fallback.to(tl.int32))
    for start_n in range(0, full_end, BLOCK_N):
        m_i, l_i, acc, counts = _fwd_step(q, K, V, start_n, offs_m, offs_d, N_K, offset, sk[2], sv[2], scale,
                                          m_i, l_i, acc, counts, fix, seed, bh, D, BLOCK_N, False, CAUSAL,
                                          FIX, WITH_STATS, P_FP32, NATIVE_P, NORM, IEEE, CODES, TMA)
    for start_n in range(full_end, hi, BLOCK_N):
        m_i, l_i, acc, counts = _fwd_step(q, K, V, start_n, offs_m, offs_d, N_K, offset, sk[2], sv[2], scale,
                                          m_i, l_i, acc, counts, fix, seed, bh, D, BLOCK_N, True, CAUSAL, FIX,
                                          WITH_STATS, P_FP32, NATIVE_P, NORM, IEEE, CODES, TMA)
    # -- output and lse (a row that saw no key: o = 0, lse = +inf) --
    empty = l_i == 0.0  # (BLOCK_M,)
    l_safe = tl.where(empty, 1.0, l_i)
    out_idx = offs_m[:, None] * BLOCK_D + offs_d[None, :]  # (BLOCK_M, BLOCK_D)
    o = tl.div_rn(acc, tl.broadcast_to(l_safe[:, None], (BLOCK_M, BLOCK_D)))  # IEEE division, also on GPU
    o = _round(o, CODES[OUTPUT], seed, bh * 8 + OUTPUT, out_idx)
    row_ok = offs_m < N_Q
    tl.store(O + offs_m[:, None] * so[2] + offs_d[None, :], o.to(O.dtype.element_ty),
             mask=row_ok[:, None] & (offs_d[None, :] < D))
    lse = tl.where(empty, float("inf"), m_i + _log(l_safe, IEEE))
    tl.store(LSE + bh.to(tl.int64) * N_Q + offs_m, lse, mask=row_ok)
    # -- counters: one (batch*head, N_Q) plane each, in STAT_NAMES order --
    if WITH_STATS:
        stats = STATS + bh.to(tl.int64) * N_Q + offs_m
        plane = BH.to(tl.int64) * N_Q  # B*H*N_Q per counter
        for i in tl.static_range(5):
            tl.store(stats + i * plane, counts[i], mask=row_ok)


# ---------------------------------------------------------------------------------------------- backward


@triton.jit(do_not_specialize=["N", "H", "BH"])
def _delta(O, DO, DELTA, so, sdo, N, H, BH, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta = rowsum(dO * O), fp32 products and sum, O as stored."""
    _, offs_m, offs_d, bh, b, h = _program(H, BLOCK_M, BLOCK_D)
    if bh >= BH:
        return
    o = _load(O + _head(b, h, so), offs_m, offs_d, N, so[2], D, False).to(tl.float32)  # (BLOCK_M, BLOCK_D)
    do = _load(DO + _head(b, h, sdo), offs_m, offs_d, N, sdo[2], D, False).to(tl.float32)
    tl.store(DELTA + bh.to(tl.int64) * N + offs_m, tl.sum(o * do, 1), mask=offs_m < N)


@triton.jit
def _dkdv_step(Q, DO, LSE, DELTA, k, v, dk, dv, start_m, offs_n, offs_d, N_Q, N_K, offset, sq_n, sdo_n, scale,
               D: tl.constexpr, BLOCK_M: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
               IEEE: tl.constexpr, C_SCORES: tl.constexpr, TMA: tl.constexpr):
    """One query block's contribution to a key block's dK, dV (computed transposed: keys x queries). Q and DO:
    pointers, or (TMA) tensor descriptors."""
    offs_m = start_m + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    qt = _streamed(Q, start_m, offs_m, offs_d, N_Q, sq_n, D, True, MASK, TMA)  # (BLOCK_D, BLOCK_M)
    do = _streamed(DO, start_m, offs_m, offs_d, N_Q, sdo_n, D, False, MASK, TMA)  # (BLOCK_M, BLOCK_D)
    if MASK:
        lse = tl.load(LSE + offs_m, mask=offs_m < N_Q, other=0.0)  # (BLOCK_M,)
        delta = tl.load(DELTA + offs_m, mask=offs_m < N_Q, other=0.0)  # (BLOCK_M,)
    else:
        lse = tl.load(LSE + offs_m)
        delta = tl.load(DELTA + offs_m)
    # -- scores, transposed --
    st = _round(_dot(k, qt, None, IEEE) * scale, C_SCORES, 0, 0, offs_n[:, None])  # (BLOCK_N, BLOCK_M)
    if MASK:
        valid = (offs_m[None, :] < N_Q) & (offs_n[:, None] < N_K)
        if CAUSAL:
            valid = valid & (offs_n[:, None] <= offs_m[None, :] + offset)
        st = tl.where(valid, st, float("-inf"))
    # -- P from the saved lse, then dV --
    pt = _exp_sub(st, lse[None, :], IEEE, IEEE)  # (BLOCK_N, BLOCK_M)
    dv = _dot(pt.to(do.dtype), do, dv, IEEE)  # (BLOCK_N, BLOCK_D)
    # -- dS = P (dP - delta), then dK --
    dst = pt * (_dot(v, tl.trans(do), None, IEEE) - delta[None, :])  # (BLOCK_N, BLOCK_M)
    dk = _dot(dst.to(qt.dtype), tl.trans(qt), dk, IEEE)  # (BLOCK_N, BLOCK_D)
    return dk, dv


@triton.jit(do_not_specialize=["N_Q", "N_K", "H", "GROUP", "BH"])
def _dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, sq, sk, sv, sdo, sdk, sdv, N_Q, N_K, H, GROUP, BH, scale,
          D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          CAUSAL: tl.constexpr, IEEE: tl.constexpr, C_SCORES: tl.constexpr, GROUPED: tl.constexpr,
          TMA: tl.constexpr = False):
    """dK, dV of one key block of one key/value head (BH = batch x key/value heads): the GROUP query heads
    that read it (GROUPED: GROUP > 1; else the one head, with no loop over heads) in increasing order, each
    over its query blocks in increasing order (diagonal ones masked, then unmasked ones, then the tail beyond
    the last whole block). TMA: the Q and dO tiles through tensor descriptors of the head, as in _fwd."""
    start_n, offs_n, offs_d, bh, b, kvh = _program(H // GROUP, BLOCK_N, BLOCK_D)  # bh: batch x key/value head
    if bh >= BH:
        return
    k = _load(K + _head(b, kvh, sk), offs_n, offs_d, N_K, sk[2], D, False)  # (BLOCK_N, BLOCK_D)
    v = _load(V + _head(b, kvh, sv), offs_n, offs_d, N_K, sv[2], D, False)  # (BLOCK_N, BLOCK_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    offset = N_K - N_Q  # causal: row i sees keys j <= i + offset
    if CAUSAL:  # query blocks from the one holding the first row that sees this block's first key; unmasked
        # once every row sees its last key
        lo = tl.maximum(start_n - offset, 0) // BLOCK_M * BLOCK_M
        mid = (tl.maximum(start_n + BLOCK_N - 1 - offset, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    else:
        lo = 0
        mid = 0
    end = tl.where(start_n + BLOCK_N <= N_K, N_Q // BLOCK_M * BLOCK_M, mid)  # end of the unmasked blocks
    for g in range(0, GROUP if GROUPED else 1):
        h = kvh * GROUP + g
        Qh, DOh = Q + _head(b, h, sq), DO + _head(b, h, sdo)
        if TMA:
            Qh = _described(Qh, N_Q, sq[2], D, BLOCK_M, BLOCK_D)
            DOh = _described(DOh, N_Q, sdo[2], D, BLOCK_M, BLOCK_D)
        LSEh, DELTAh = LSE + (b * H + h).to(tl.int64) * N_Q, DELTA + (b * H + h).to(tl.int64) * N_Q
        for start_m in range(lo, tl.minimum(mid, N_Q), BLOCK_M):
            dk, dv = _dkdv_step(Qh, DOh, LSEh, DELTAh, k, v, dk, dv, start_m, offs_n, offs_d, N_Q, N_K,
                                offset, sq[2], sdo[2], scale, D, BLOCK_M, True, CAUSAL, IEEE, C_SCORES, TMA)
        for start_m in range(mid, end, BLOCK_M):
            dk, dv = _dkdv_step(Qh, DOh, LSEh, DELTAh, k, v, dk, dv, start_m, offs_n, offs_d, N_Q, N_K,
                                offset, sq[2], sdo[2], scale, D, BLOCK_M, False, CAUSAL, IEEE, C_SCORES, TMA)
        for start_m in range(tl.maximum(mid, end), N_Q, BLOCK_M):
            dk, dv = _dkdv_step(Qh, DOh, LSEh, DELTAh, k, v, dk, dv, start_m, offs_n, offs_d, N_Q, N_K,
                                offset, sq[2], sdo[2], scale, D, BLOCK_M, True, CAUSAL, IEEE, C_SCORES, TMA)
    kv_mask = (offs_n[:, None] < N_K) & (offs_d[None, :] < D)
    tl.store(DK + _head(b, kvh, sdk) + offs_n[:, None] * sdk[2] + offs_d[None, :],
             (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + _head(b, kvh, sdv) + offs_n[:, None] * sdv[2] + offs_d[None, :], dv.to(DV.dtype.element_ty),
             mask=kv_mask)


@triton.jit
def _dq_step(q, do, lse, delta, K, V, dq, start_n, offs_m, offs_d, N_K, offset, sk_n, sv_n, scale,
             D: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
             IEEE: tl.constexpr, C_SCORES: tl.constexpr, TMA: tl.constexpr):
    """One key tile's contribution to a query block's dQ. K and V: pointers, or (TMA) tensor descriptors."""
    offs_n = start_n + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    kt = _streamed(K, start_n, offs_n, offs_d, N_K, sk_n, D, True, MASK, TMA)  # (BLOCK_D, BLOCK_N)
    # -- scores, P from the saved lse --
    s = _scores(q, kt, offs_m, offs_n, N_K, offset, scale, MASK, CAUSAL, C_SCORES, IEEE)  # (BLOCK_M, BLOCK_N)
    p = _exp_sub(s, lse[:, None], IEEE, IEEE)  # (BLOCK_M, BLOCK_N)
    # -- dS = P (dP - delta), then dQ --
    vt = _streamed(V, start_n, offs_n, offs_d, N_K, sv_n, D, True, MASK, TMA)  # (BLOCK_D, BLOCK_N)
    ds = p * (_dot(do, vt, None, IEEE) - delta[:, None])  # (BLOCK_M, BLOCK_N)
    return _dot(ds.to(q.dtype), tl.trans(kt), dq, IEEE)  # (BLOCK_M, BLOCK_D)


@triton.jit(do_not_specialize=["N_Q", "N_K", "H", "GROUP", "BH"])
def _dq(Q, K, V, DO, LSE, DELTA, DQ, sq, sk, sv, sdo, sdq, N_Q, N_K, H, GROUP, BH, scale, D: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
        IEEE: tl.constexpr, C_SCORES: tl.constexpr, TMA: tl.constexpr = False):
    """dQ of one query block of one query head: key tiles in increasing order, unmasked ones first (no
    atomics). TMA: the K and V tiles through tensor descriptors of the head, as in _fwd."""
    m0, offs_m, offs_d, bh, b, h = _program(H, BLOCK_M, BLOCK_D)
    if bh >= BH:
        return
    K, V = K + _head(b, h // GROUP, sk), V + _head(b, h // GROUP, sv)
    if TMA:
        K, V = _described(K, N_K, sk[2], D, BLOCK_N, BLOCK_D), _described(V, N_K, sv[2], D, BLOCK_N, BLOCK_D)
    offset = N_K - N_Q
    q = _load(Q + _head(b, h, sq), offs_m, offs_d, N_Q, sq[2], D, False)  # (BLOCK_M, BLOCK_D)
    do = _load(DO + _head(b, h, sdo), offs_m, offs_d, N_Q, sdo[2], D, False)  # (BLOCK_M, BLOCK_D)
    lse = tl.load(LSE + bh.to(tl.int64) * N_Q + offs_m, mask=offs_m < N_Q, other=0.0)  # (BLOCK_M,)
    delta = tl.load(DELTA + bh.to(tl.int64) * N_Q + offs_m, mask=offs_m < N_Q, other=0.0)  # (BLOCK_M,)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    full_end, hi = _key_range(m0, N_Q, N_K, BLOCK_M, BLOCK_N, CAUSAL)
    for start_n in range(0, full_end, BLOCK_N):
        dq = _dq_step(q, do, lse, delta, K, V, dq, start_n, offs_m, offs_d, N_K, offset, sk[2], sv[2], scale,
                      D, BLOCK_N, False, CAUSAL, IEEE, C_SCORES, TMA)
    for start_n in range(full_end, hi, BLOCK_N):
        dq = _dq_step(q, do, lse, delta, K, V, dq, start_n, offs_m, offs_d, N_K, offset, sk[2], sv[2], scale,
                      D, BLOCK_N, True, CAUSAL, IEEE, C_SCORES, TMA)
    tl.store(DQ + _head(b, h, sdq) + offs_m[:, None] * sdq[2] + offs_d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=(offs_m[:, None] < N_Q) & (offs_d[None, :] < D))

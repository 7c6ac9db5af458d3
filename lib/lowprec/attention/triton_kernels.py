"""`flash_attention`: FlashAttention-2 forward and backward in Triton, with lowprec's rounding points and Fix.

Design
- Forward (`_fwd`): one program per (query block of BLOCK_M rows, batch*head). It loops over key/value tiles
  of BLOCK_N columns in increasing order (causal: only tiles holding a key <= the block's last query), keeps
  m, l and the output accumulator in fp32 registers, and performs the op sequence of precision.py with each
  rounding point as a call to `_round` (codes from `_code`): fa2 only casts P̄ to the input dtype before the
  P̄V dot and the output when it is stored. With the Fix (constexpr FIX: 1 = ties per tile, 2 = per whole row,
  which adds a first pass computing each row's top two scores) the row shift follows `_fix_shift`, the
  mirror of precision.fix_shift. Per-row int32 counters (P̄ == 1 entries, tie tiles, near-tie tiles, Fix
  triggers, fallbacks) are written when WITH_STATS.
- Backward: `_delta` (delta = rowsum(dO * O) from the stored O), `_dkdv` (one program per key block,
  looping over query blocks in increasing order) and `_dq` (one program per query block, looping over key
  tiles in increasing order): dQ is its own loop, so there are no atomics and the result is deterministic;
  dK, dV and dQ accumulate in fp32 and are stored in the input dtype. P and dS are cast to the input dtype
  before their dots (FlashAttention-2); fp32 inputs use IEEE fp32 dots (no TF32).
- Any sequence length (rows/columns beyond N are masked), head dims 16..128 (padded to a power of two with
  masked loads), bf16 / fp16 / fp32 inputs, causal or not.
- Arithmetic: everything except loads, stores, casts and tl.dot operands is fp32; exp/log are natural
  (no exp2 with a folded log2(e), so that the emulator's op order stays the same on every device).
- k-bit and stochastic rounding at any point use integer ops on the fp32 bits (`_round_bits`, a mirror of
  lowprec.formats.round_to); bf16/fp16 round-to-nearest use the hardware cast (cvt.rn). Stochastic bits come
  from a counter-based hash of (seed, batch*head, point, element), so a run is reproducible from its seed;
  they are not the bits the emulator draws from its torch.Generator.
- Block sizes: under the interpreter BLOCK_M = BLOCK_N = 64 (or Precision.tile, or block_m/block_n), the same
  tiles as emulated_attention's defaults. On a GPU the kernels are autotuned over a few Hopper configs
  (BLOCK_M, warps, stages; the forward keeps BLOCK_N = 64 so that per-tile tie detection does not depend on
  the chosen config); the Fix and precision constexprs are part of the autotune key. The kernels do not
  specialise on N, so one compiled variant serves every sequence length.
- Cost of the Fix (tie="tile"): per score one compare that yields 1.0 / 0.0 and one fp32 add (the tie count),
  per row a few selects; the counters are computed and stored only when WITH_STATS.

Under TRITON_INTERPRET=1 (CPU) interpreter.py's patch is applied at import, and the kernels are bit-identical
to emulated_attention (o, lse, delta, dq, dk, dv, counters) for round-to-nearest precisions. If CUDA is not
available and TRITON_INTERPRET is unset, importing this module sets TRITON_INTERPRET=1 itself.

What differs on a GPU (so GPU results match the emulator only statistically, not bit for bit):
- tl.dot runs on tensor cores: exact products but a hardware-specific multi-term accumulation with truncated
  alignment, not one rounding of the exact sum; IEEE fp32 dots run as FMA chains, cut into parts of K/4 and
  added to the accumulator once per tile (`_ieee_dot`), which keeps fp32 errors at the level of torch's;
- tl.exp / tl.log lower to ex2.approx / lg2.approx (about 2 ulp, subnormals flushed to zero; the argument is
  first multiplied by log2(e) in fp32, which adds an error growing with |x|); fp32 inputs use libdevice's
  exp / log instead (about 1 ulp);
- tl.sum / tl.max reduce in a tree across lanes and warps;
- the compiler fuses a*b + c into FMAs (e.g. l * alpha + rowsum, s * scale - m), one rounding instead of two;
- (the output division o = acc / l uses tl.div_rn, so it is IEEE-rounded on a GPU too.)
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass

import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") is None:
    # No GPU: run the kernels in Triton's CPU interpreter. Triton decides between compiled and interpreted
    # functions when it decorates them, its own standard library included, so this only works before the
    # first `import triton` (torch._dynamo imports it, for one).
    if "triton" in sys.modules:
        raise RuntimeError(
            "the Triton kernels need Triton's CPU interpreter on a machine without a GPU, but triton was "
            "imported before lowprec could switch it on: set TRITON_INTERPRET=1 in the environment before "
            "starting Python (`make test`, `make book` and `make lab` do)"
        )
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.language.extra import libdevice  # noqa: E402

from lowprec.attention import interpreter  # noqa: E402
from lowprec.attention.emulated import make_config, softmax_scale  # noqa: E402
from lowprec.attention.precision import (  # noqa: E402
    POINTS,
    STAT_NAMES,
    AttentionStats,
    Fix,
    FixParams,
    Precision,
    Rounding,
    dot_dtype,
    fits,
)
from lowprec.attention.reference import check_qkv  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRET:
    interpreter.apply()
# fp32 inputs on a GPU use libdevice's exp / log (~1 ulp) instead of ex2.approx(x * log2 e), whose error
# grows with |x|, and short FMA chains in their dots (`_ieee_dot`); under the interpreter exp / log are the
# patched, exactly rounded functions and a dot is rounded once
GPU = tl.constexpr(not INTERPRET)

HEAD_DIMS = (16, 128)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FWD_BLOCK_N = 64  # on a GPU the forward's key tile is fixed: per-tile tie detection depends on it

# rounding codes: kind | exp_bits << 4 | man_bits << 8 | no_inf << 13 | host kind << 14 ("ones" only: how the
# values that do not round to 1.0 are rounded, NONE / CAST_BF16 / CAST_FP16)
NONE, CAST_BF16, CAST_FP16, NEAREST, STOCHASTIC, ONES = 0, 1, 2, 3, 4, 5
# stream ids of the rounding points (decorrelate their stochastic bits)
WEIGHTS, ROWSUM, PRODUCT, ACCUMULATOR, OUTPUT = (tl.constexpr(i) for i in range(1, 6))


def _code(rounding: Rounding, dtype: torch.dtype) -> int:
    """The kernel's integer code for one rounding point resolved for inputs of `dtype`."""
    fmt = rounding.resolve(dtype)
    if fmt is None:
        return NONE
    if rounding.mode == "nearest" and fmt.torch_dtype is torch.bfloat16:
        return CAST_BF16
    if rounding.mode == "nearest" and fmt.torch_dtype is torch.float16:
        return CAST_FP16
    kind = {"nearest": NEAREST, "stochastic": STOCHASTIC, "ones": ONES}[rounding.mode]
    host = {torch.bfloat16: CAST_BF16, torch.float16: CAST_FP16}.get(dtype, NONE) if kind == ONES else NONE
    return kind | fmt.exp_bits << 4 | fmt.man_bits << 8 | int(fmt.no_inf) << 13 | host << 14


@triton.jit
def _fmix(h):
    """murmur3's 32-bit finaliser (uint32 in, uint32 out)."""
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return h


@triton.jit
def _random_bits(seed, stream, idx):
    """31 random bits (int32) per element from (seed, stream, element index)."""
    key = _fmix(tl.cast(seed, tl.uint32) + _fmix(tl.cast(stream, tl.uint32) * 0x9E3779B1))
    return (_fmix(idx.to(tl.uint32, bitcast=True) ^ key) >> 1).to(tl.int32, bitcast=True)


@triton.jit
def _pow2(q):
    """2**q as fp32 from bits, q int32 in [-149, 127] (subnormals included)."""
    normal = (tl.maximum(q, -126) + 127) << 23
    sub = 1 << tl.minimum(tl.maximum(q + 149, 0), 22)
    return tl.where(q >= -126, normal, sub).to(tl.float32, bitcast=True)


@triton.jit
def _round_bits(x, CODE: tl.constexpr, seed, stream, idx):
    """Round fp32 x to the format in CODE, nearest-even or stochastic: lowprec.formats.round_to in int ops."""
    E: tl.constexpr = (CODE >> 4) & 15
    M: tl.constexpr = (CODE >> 8) & 31
    NO_INF: tl.constexpr = (CODE >> 13) & 1
    BIAS: tl.constexpr = (1 << (E - 1)) - 1
    EMIN: tl.constexpr = 1 - BIAS
    EMAX: tl.constexpr = (1 << E) - 2 + NO_INF - BIAS
    MAX_BITS: tl.constexpr = ((EMAX + 127) << 23) | (((1 << M) - 1 - NO_INF) << (23 - M))
    u = x.to(tl.int32, bitcast=True)
    a = u & 0x7FFFFFFF
    biased = a >> 23
    sig = tl.where(biased > 0, (a & 0x7FFFFF) | 0x800000, a)
    e = tl.maximum(biased, 1) - 127
    q = tl.maximum(e, EMIN) - M
    shift = q - e + 23
    kept = tl.minimum(shift, 25)
    n = sig >> kept
    rem = sig - (n << kept)
    if (CODE & 15) == 4:
        frac = (rem << (31 - kept)) >> tl.minimum(shift - kept, 31)
        n = n + (_random_bits(seed, stream, idx) < frac).to(tl.int32)
    else:
        twice = rem << 1
        step = 1 << kept
        n = n + ((twice > step) | ((twice == step) & ((n & 1) == 1))).to(tl.int32)
    value = n.to(tl.float32) * _pow2(q)
    max_value = tl.full(x.shape, MAX_BITS, tl.int32).to(tl.float32, bitcast=True)
    if NO_INF:  # noqa: SIM108 (a constexpr branch)
        beyond = max_value
    else:
        beyond = tl.full(x.shape, float("inf"), tl.float32)
    value = tl.where(value > max_value, beyond, value)
    signed = (value.to(tl.int32, bitcast=True) | (u & -2147483648)).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, signed)


@triton.jit
def _cast(x, KIND: tl.constexpr):
    """NONE: x; CAST_BF16 / CAST_FP16: x through bf16 / fp16 (round to nearest even) and back to fp32."""
    if KIND == 1:
        return x.to(tl.bfloat16).to(tl.float32)
    elif KIND == 2:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _round(x, CODE: tl.constexpr, seed, stream, idx):
    """One rounding point (precision.py's round_* functions): fp32 in, fp32 values of the format out."""
    if (CODE & 15) <= 2:
        return _cast(x, CODE & 15)
    elif (CODE & 15) == 5:
        # "ones": [1 - 2^-(M+2), 1 + 2^-(M+1)] rounds to 1.0 in the format (both midpoints tie to even 1.0);
        # every other value takes the host's cast
        M: tl.constexpr = (CODE >> 8) & 31
        LO: tl.constexpr = 1.0 - 1.0 / (1 << (M + 2))
        HI: tl.constexpr = 1.0 + 1.0 / (1 << (M + 1))
        return tl.where((x >= LO) & (x <= HI), 1.0, _cast(x, (CODE >> 14) & 3))
    else:
        return _round_bits(x, CODE, seed, stream, idx)


@triton.jit
def _exp(x, IEEE: tl.constexpr):
    """exp in fp32: fast (ex2.approx) for bf16 / fp16 inputs, libdevice's for fp32 inputs on a GPU."""
    if IEEE and GPU:  # noqa: SIM108 (a constexpr branch)
        y = libdevice.exp(x)
    else:
        y = tl.exp(x)
    return y


@triton.jit
def _log(x, IEEE: tl.constexpr):
    """log in fp32, as `_exp` chooses."""
    if IEEE and GPU:  # noqa: SIM108 (a constexpr branch)
        y = libdevice.log(x)
    else:
        y = tl.log(x)
    return y


@triton.jit
def _fix_shift(r, ties, beta, min_gap, max_gap):
    """Mirror of precision.fix_shift: (shift, triggered, fallback) for row maxima r."""
    triggered = ties & (r > float("-inf"))
    want = tl.where(r > 0, r * beta, tl.where(r < 0, 0.0, r))
    want = tl.where(want - r < min_gap, r + min_gap, want)
    fallback = triggered & (want - r > max_gap)
    want = tl.where(want - r > max_gap, r + max_gap, want)
    return tl.where(triggered, want, r), triggered, fallback


@triton.jit
def _split_k(a, b):
    """dot(a, b) = dot(a0, b0) + dot(a1, b1): the even and the odd indices of the contracted dimension."""
    a0, a1 = tl.split(tl.reshape(a, (a.shape[0], a.shape[1] // 2, 2)))
    b0, b1 = tl.split(tl.reshape(tl.trans(b), (b.shape[1], b.shape[0] // 2, 2)))
    return a0, a1, tl.trans(b0), tl.trans(b1)


@triton.jit
def _add(x, y):
    """x + y in fp32 (add.rn), opaque to Triton: its combiner folds `dot(a, b, 0) + y` into `dot(a, b, y)`,
    which would chain the dot's FMAs on y again."""
    return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=f,f,f", [x, y], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def _ieee_dot(a, b):
    """IEEE fp32 dot on a GPU with short FMA chains. Triton lowers it to one chain of K FMAs per output
    element (no tensor cores), each rounding at the running sum's magnitude; so K is cut into up to four
    interleaved parts of >= 16 whose dots are summed pairwise (chains of K/4, not K)."""
    if a.shape[1] >= 64:
        a0, a1, b0, b1 = _split_k(a, b)
        a00, a01, b00, b01 = _split_k(a0, b0)
        a10, a11, b10, b11 = _split_k(a1, b1)
        out = _add(_add(tl.dot(a00, b00, input_precision="ieee"), tl.dot(a01, b01, input_precision="ieee")),
                   _add(tl.dot(a10, b10, input_precision="ieee"), tl.dot(a11, b11, input_precision="ieee")))
    elif a.shape[1] >= 32:
        a0, a1, b0, b1 = _split_k(a, b)
        out = _add(tl.dot(a0, b0, input_precision="ieee"), tl.dot(a1, b1, input_precision="ieee"))
    else:
        out = tl.dot(a, b, input_precision="ieee")
    return out


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """tl.dot with fp32 accumulation; IEEE fp32 products (no TF32) when IEEE. An IEEE dot on a GPU adds a
    tile's dot to acc once (`_ieee_dot`) instead of chaining its FMAs on acc (N roundings at |acc| over a
    loop of N keys or queries, up to ~7x the error of torch's fp32 kernels); in the interpreter it is one
    rounding of the exact dot plus acc, either way."""
    if IEEE and GPU:
        out = _ieee_dot(a, b)
        if acc is not None:
            out = _add(acc, out)
    elif IEEE:
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _load(ptr, rows, offs_d, N, D: tl.constexpr, TRANSPOSE: tl.constexpr):
    """Rows `rows` of a row-major (N, D) matrix, zero-padded to BLOCK_D columns (TRANSPOSE: D x rows)."""
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
    """s = round_scores(dot(q, k^T) * scale), then -inf where masked (only in tiles that need a mask)."""
    s = _round(_dot(q, kt, None, IEEE) * scale, C_SCORES, 0, 0, offs_m[:, None])
    if MASK:
        valid = offs_n[None, :] < N
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(valid, s, float("-inf"))
    return s


@triton.jit
def _fwd_step(q, K, V, start_n, offs_m, offs_d, N, scale, m_i, l_i, acc, n_ones, n_ties, n_near, n_trig,
              n_fallback, beta, tol, min_gap, max_gap, near_tol, seed, bh, D: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
              FIX: tl.constexpr, WITH_STATS: tl.constexpr, P_FP32: tl.constexpr, NATIVE_P: tl.constexpr,
              IEEE: tl.constexpr, C_SCORES: tl.constexpr, C_WEIGHTS: tl.constexpr, C_ROWSUM: tl.constexpr,
              C_PRODUCT: tl.constexpr, C_ACC: tl.constexpr):
    """One key/value tile of the forward pass (precision.py's op order, each rounding point a `_round`)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    kt = _load(K, offs_n, offs_d, N, D, True)
    s = _scores(q, kt, offs_m, offs_n, N, scale, MASK, CAUSAL, C_SCORES, IEEE)
    r = tl.max(s, 1)
    if FIX == 1:
        # count in fp32 (a compare that yields 1.0 / 0.0, then FADDs): cheaper on a GPU than an int count
        ties = (tl.sum(tl.where(s >= (r - tol)[:, None], 1.0, 0.0), 1) > 1.0) & (r > float("-inf"))
        shift, triggered, fallback = _fix_shift(r, ties, beta, min_gap, max_gap)
        if WITH_STATS:
            n_trig += triggered.to(tl.int32)
            n_fallback += fallback.to(tl.int32)
    else:
        shift = r
    m_new = tl.maximum(m_i, shift)
    alpha = _exp(m_i - m_new, IEEE)
    p = _exp(s - m_new[:, None], IEEE)
    row_idx = offs_m * N + start_n
    l_i = _round(l_i * alpha + tl.sum(p, 1), C_ROWSUM, seed, bh * 8 + ROWSUM, row_idx)
    v = _load(V, offs_n, offs_d, N, D, False)
    if NATIVE_P:  # the weights rounding is the cast to V's dtype: do it once
        p_dot = p.to(V.dtype.element_ty)
        p = p_dot.to(tl.float32)
    else:
        p = _round(p, C_WEIGHTS, seed, bh * 8 + WEIGHTS, offs_m[:, None] * N + offs_n[None, :])
        if P_FP32:
            p_dot = p
            v = v.to(tl.float32)
        else:
            p_dot = p.to(V.dtype.element_ty)
    if (C_PRODUCT == 0) and (C_ACC == 0):
        acc = _dot(p_dot, v, acc * alpha[:, None], IEEE or P_FP32)
    else:
        acc_idx = row_idx[:, None] * BLOCK_D + offs_d[None, :]
        pv = _round(_dot(p_dot, v, None, IEEE or P_FP32), C_PRODUCT, seed, bh * 8 + PRODUCT, acc_idx)
        acc = _round(acc * alpha[:, None] + pv, C_ACC, seed, bh * 8 + ACCUMULATOR, acc_idx)
    if WITH_STATS:
        finite = r > float("-inf")
        n_ones += tl.sum((p == 1.0).to(tl.int32), 1)
        n_ties += ((tl.sum((s == r[:, None]).to(tl.int32), 1) > 1) & finite).to(tl.int32)
        n_near += ((tl.sum((s >= (r - near_tol)[:, None]).to(tl.int32), 1) > 1) & finite).to(tl.int32)
    return m_new, l_i, acc, n_ones, n_ties, n_near, n_trig, n_fallback


@triton.jit(do_not_specialize=["N", "seed"])
def _fwd(Q, K, V, O, LSE, STATS, N, scale, beta, tol, min_gap, max_gap, near_tol, seed, D: tl.constexpr,
         BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
         FIX: tl.constexpr, WITH_STATS: tl.constexpr, P_FP32: tl.constexpr, NATIVE_P: tl.constexpr,
         IEEE: tl.constexpr, C_SCORES: tl.constexpr, C_WEIGHTS: tl.constexpr, C_ROWSUM: tl.constexpr,
         C_PRODUCT: tl.constexpr, C_ACC: tl.constexpr, C_OUTPUT: tl.constexpr):
    """Forward of one query block: key tiles without masks first, then the tiles that need one."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    base = bh.to(tl.int64) * N * D
    Q, K, V, O = Q + base, K + base, V + base, O + base
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load(Q, offs_m, offs_d, N, D, False)
    if CAUSAL:  # tiles wholly left of the block's first query need no mask
        full_end = (pid_m * BLOCK_M) // BLOCK_N * BLOCK_N
        hi = tl.minimum((pid_m + 1) * BLOCK_M, N)
    else:
        full_end = N // BLOCK_N * BLOCK_N
        hi = N
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    zero = tl.zeros([BLOCK_M], tl.int32)
    n_ones, n_ties, n_near, n_trig, n_fallback = zero, zero, zero, zero, zero
    if FIX == 2:  # whole-row tie detection: each row's top two scores over all keys first
        best = tl.full([BLOCK_M], float("-inf"), tl.float32)
        second = tl.full([BLOCK_M], float("-inf"), tl.float32)
        for start_n in range(0, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            kt = _load(K, offs_n, offs_d, N, D, True)
            s = _scores(q, kt, offs_m, offs_n, N, scale, True, CAUSAL, C_SCORES, IEEE)
            t1 = tl.max(s, 1)
            top = s == t1[:, None]
            t2 = tl.where(tl.sum(top.to(tl.int32), 1) > 1, t1, tl.max(tl.where(top, float("-inf"), s), 1))
            second = tl.maximum(tl.maximum(tl.minimum(best, t1), second), t2)
            best = tl.maximum(best, t1)
        ties = (second >= best - tol) & (best > float("-inf"))
        shift, triggered, fallback = _fix_shift(best, ties, beta, min_gap, max_gap)
        m_i = tl.where(triggered, shift, float("-inf"))
        n_trig = triggered.to(tl.int32)
        n_fallback = fallback.to(tl.int32)
    for start_n in range(0, full_end, BLOCK_N):
        m_i, l_i, acc, n_ones, n_ties, n_near, n_trig, n_fallback = _fwd_step(
            q, K, V, start_n, offs_m, offs_d, N, scale, m_i, l_i, acc, n_ones, n_ties, n_near, n_trig,
            n_fallback, beta, tol, min_gap, max_gap, near_tol, seed, bh, D, BLOCK_D, BLOCK_N, False, CAUSAL,
            FIX, WITH_STATS, P_FP32, NATIVE_P, IEEE, C_SCORES, C_WEIGHTS, C_ROWSUM, C_PRODUCT, C_ACC)
    for start_n in range(full_end, hi, BLOCK_N):
        m_i, l_i, acc, n_ones, n_ties, n_near, n_trig, n_fallback = _fwd_step(
            q, K, V, start_n, offs_m, offs_d, N, scale, m_i, l_i, acc, n_ones, n_ties, n_near, n_trig,
            n_fallback, beta, tol, min_gap, max_gap, near_tol, seed, bh, D, BLOCK_D, BLOCK_N, True, CAUSAL,
            FIX, WITH_STATS, P_FP32, NATIVE_P, IEEE, C_SCORES, C_WEIGHTS, C_ROWSUM, C_PRODUCT, C_ACC)
    out_idx = offs_m[:, None] * BLOCK_D + offs_d[None, :]
    o = tl.div_rn(acc, tl.broadcast_to(l_i[:, None], (BLOCK_M, BLOCK_D)))  # IEEE division, also on GPU
    o = _round(o, C_OUTPUT, seed, bh * 8 + OUTPUT, out_idx)
    row_ok = offs_m < N
    tl.store(O + offs_m[:, None] * D + offs_d[None, :], o.to(O.dtype.element_ty),
             mask=row_ok[:, None] & (offs_d[None, :] < D))
    tl.store(LSE + bh.to(tl.int64) * N + offs_m, m_i + _log(l_i, IEEE), mask=row_ok)
    if WITH_STATS:
        stats = STATS + bh.to(tl.int64) * N + offs_m
        plane = tl.num_programs(1).to(tl.int64) * N
        tl.store(stats, n_ones, mask=row_ok)
        tl.store(stats + plane, n_ties, mask=row_ok)
        tl.store(stats + 2 * plane, n_near, mask=row_ok)
        tl.store(stats + 3 * plane, n_trig, mask=row_ok)
        tl.store(stats + 4 * plane, n_fallback, mask=row_ok)


@triton.jit(do_not_specialize=["N"])
def _delta(O, DO, DELTA, N, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta = rowsum(dO * O), fp32 products and sum, O as stored."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    base = bh.to(tl.int64) * N * D
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o = _load(O + base, offs_m, offs_d, N, D, False).to(tl.float32)
    do = _load(DO + base, offs_m, offs_d, N, D, False).to(tl.float32)
    tl.store(DELTA + bh.to(tl.int64) * N + offs_m, tl.sum(o * do, 1), mask=offs_m < N)


@triton.jit
def _dkdv_step(Q, DO, LSE, DELTA, k, v, dk, dv, start_m, offs_n, offs_d, N, scale, D: tl.constexpr,
               BLOCK_M: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
               C_SCORES: tl.constexpr):
    """One query block's contribution to a key block's dK, dV (computed transposed: keys x queries)."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    qt = _load(Q, offs_m, offs_d, N, D, True)
    do = _load(DO, offs_m, offs_d, N, D, False)
    lse = tl.load(LSE + offs_m, mask=offs_m < N, other=0.0)
    delta = tl.load(DELTA + offs_m, mask=offs_m < N, other=0.0)
    st = _round(_dot(k, qt, None, IEEE) * scale, C_SCORES, 0, 0, offs_n[:, None])
    if MASK:
        valid = (offs_m[None, :] < N) & (offs_n[:, None] < N)
        if CAUSAL:
            valid = valid & (offs_n[:, None] <= offs_m[None, :])
        st = tl.where(valid, st, float("-inf"))
    pt = _exp(st - lse[None, :], IEEE)
    dv = _dot(pt.to(DO.dtype.element_ty), do, dv, IEEE)
    dst = pt * (_dot(v, tl.trans(do), None, IEEE) - delta[None, :])
    dk = _dot(dst.to(Q.dtype.element_ty), tl.trans(qt), dk, IEEE)
    return dk, dv


@triton.jit(do_not_specialize=["N"])
def _dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, N, scale, D: tl.constexpr, BLOCK_D: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
          C_SCORES: tl.constexpr):
    """dK, dV of one key block: query blocks in increasing order (diagonal ones masked, then unmasked ones,
    then the tail beyond the last whole block)."""
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    base = bh.to(tl.int64) * N * D
    Q, K, V, DO, DK, DV = Q + base, K + base, V + base, DO + base, DK + base, DV + base
    LSE, DELTA = LSE + bh.to(tl.int64) * N, DELTA + bh.to(tl.int64) * N
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load(K, offs_n, offs_d, N, D, False)
    v = _load(V, offs_n, offs_d, N, D, False)
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
    offs_n = start_n + tl.arange(0, BLOCK_N)
    kt = _load(K, offs_n, offs_d, N, D, True)
    s = _scores(q, kt, offs_m, offs_n, N, scale, MASK, CAUSAL, C_SCORES, IEEE)
    p = _exp(s - lse[:, None], IEEE)
    ds = p * (_dot(do, _load(V, offs_n, offs_d, N, D, True), None, IEEE) - delta[:, None])
    return _dot(ds.to(q.dtype), tl.trans(kt), dq, IEEE)


@triton.jit(do_not_specialize=["N"])
def _dq(Q, K, V, DO, LSE, DELTA, DQ, N, scale, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr, C_SCORES: tl.constexpr):
    """dQ of one query block: key tiles in increasing order, unmasked ones first (no atomics)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    base = bh.to(tl.int64) * N * D
    Q, K, V, DO, DQ = Q + base, K + base, V + base, DO + base, DQ + base
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load(Q, offs_m, offs_d, N, D, False)
    do = _load(DO, offs_m, offs_d, N, D, False)
    lse = tl.load(LSE + bh.to(tl.int64) * N + offs_m, mask=offs_m < N, other=0.0)
    delta = tl.load(DELTA + bh.to(tl.int64) * N + offs_m, mask=offs_m < N, other=0.0)
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



# ------------------------------------------------------------------------------------------ launch (Python)


def _tuner_bench(fn, quantiles):
    """The autotuner's timer: short runs (triton's default, 25 + 100 ms per config, dominated benchmarks)."""
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


def _spill_free(configs, nargs, rows: str, **kwargs):
    """Configs whose fp32 accumulators (`rows` x BLOCK_D each) take <= 64 registers per thread: larger ones
    spill on sm_90 (as ptxas reports for compile_for_gpu's builds)."""
    kept = [c for c in configs if c.kwargs[rows] * kwargs["BLOCK_D"] <= 64 * 32 * c.num_warps]
    return kept or configs[:1]


def _tuned(kernel, configs: list[tuple[int, int, int, int]], rows: str, keys=()):
    """`kernel` autotuned over (BLOCK_M, BLOCK_N, warps, stages); one pick per shape and constexpr variant."""
    return triton.autotune(
        [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st) for m, n, w, st in configs],
        key=["N", "D", "CAUSAL", "IEEE", "C_SCORES", *keys], do_bench=_tuner_bench,
        prune_configs_by={"early_config_prune": functools.partial(_spill_free, rows=rows)},
    )(kernel)


# A few configs each (Hopper choices as in Triton's fused-attention tutorial; stages barely matter here): a
# new (head_dim, causal, variant) compiles each once (~1 s), a new N re-times them (~0.1 s). The forward's
# key tile stays FWD_BLOCK_N; the Fix's constexprs are in the key, so Fix on and off get their own picks.
_fwd_tuned = _tuned(
    _fwd, [(128, FWD_BLOCK_N, 8, 3), (128, FWD_BLOCK_N, 4, 3), (64, FWD_BLOCK_N, 4, 3)], "BLOCK_M",
    keys=("FIX", "WITH_STATS", "P_FP32", "NATIVE_P", "C_WEIGHTS", "C_ROWSUM", "C_PRODUCT", "C_ACC",
          "C_OUTPUT"),
)
_dkdv_tuned = _tuned(_dkdv, [(64, 128, 8, 3), (32, 128, 8, 3), (64, 64, 4, 2), (32, 128, 4, 3)], "BLOCK_N")
_dq_tuned = _tuned(_dq, [(128, 64, 8, 3), (64, 128, 8, 3), (64, 64, 4, 3), (128, 64, 4, 2)], "BLOCK_M")


def autotuned_configs() -> dict[str, str]:
    """The autotuner's picks for the latest forward, dK/dV and dQ launches (for benchmark records)."""
    tuned = {"fwd": _fwd_tuned, "dkdv": _dkdv_tuned, "dq": _dq_tuned}
    return {name: str(t.best_config) for name, t in tuned.items() if getattr(t, "best_config", None)}


@dataclass
class _Run:
    """Resolved options of one call (shared by forward and backward)."""

    causal: bool
    scale: float
    codes: dict[str, int]
    p_fp32: bool  # P̄V dot in fp32 (P̄'s format does not fit in the input dtype)
    native_p: bool  # the weights rounding is exactly the cast to the input dtype
    fix: FixParams | None
    tol: float
    blocks: tuple[int, int] | None  # (BLOCK_M, BLOCK_N) fixed, or None = autotune
    seed: int
    with_stats: bool
    stats: AttentionStats | None = None


def _launch(kernel, tuned, run: _Run, n: int, bh: int, rows: str, *args, **constexprs) -> None:
    """Launch with fixed blocks (grid over `rows`-sized blocks) or the autotuned variant."""
    grid = lambda meta: (triton.cdiv(n, meta[rows]), bh)
    if run.blocks is None:
        tuned[grid](*args, **constexprs)
    else:
        kernel[grid](*args, **constexprs, BLOCK_M=run.blocks[0], BLOCK_N=run.blocks[1])


def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, run: _Run):
    B, H, N, D = q.shape
    o = torch.empty_like(q)
    lse = torch.empty((B, H, N), device=q.device, dtype=torch.float32)
    stats = lse  # a placeholder pointer when no counters are asked for
    if run.with_stats:
        stats = torch.zeros((len(STAT_NAMES), B, H, N), device=q.device, dtype=torch.int32)
    fp, c = run.fix, run.codes
    fix_args = (fp.beta, fp.tol, fp.min_gap, fp.max_gap) if fp is not None else (2.0, 0.0, 0.0, 1.0)
    _launch(_fwd, _fwd_tuned, run, N, B * H, "BLOCK_M", q, k, v, o, lse, stats, N, run.scale, *fix_args,
            run.tol, run.seed, D=D, BLOCK_D=_block_d(D), CAUSAL=run.causal,
            FIX=0 if fp is None else 2 if fp.whole_row else 1, WITH_STATS=run.with_stats, P_FP32=run.p_fp32,
            NATIVE_P=run.native_p, IEEE=q.dtype == torch.float32, C_SCORES=c["scores"],
            C_WEIGHTS=c["weights"], C_ROWSUM=c["rowsum"], C_PRODUCT=c["product"], C_ACC=c["accumulator"],
            C_OUTPUT=c["output"])
    run.stats = AttentionStats(*stats.unbind(0)) if run.with_stats else None
    return o, lse


def flash_delta(o: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """delta = rowsum(dO * O) (fp32, (batch, heads, seq)) by the backward's preprocessing kernel."""
    B, H, N, D = o.shape
    delta = torch.empty((B, H, N), device=o.device, dtype=torch.float32)
    _delta[(triton.cdiv(N, 64), B * H)](o.contiguous(), do.contiguous(), delta, N, D=D, BLOCK_D=_block_d(D),
                                        BLOCK_M=64)
    return delta


def _backward(q, k, v, o, lse, do, run: _Run):
    B, H, N, D = q.shape
    do = do.contiguous()
    delta = flash_delta(o, do)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    common = dict(D=D, BLOCK_D=_block_d(D), CAUSAL=run.causal, IEEE=q.dtype == torch.float32,
                  C_SCORES=run.codes["scores"])
    _launch(_dkdv, _dkdv_tuned, run, N, B * H, "BLOCK_N", q, k, v, do, lse, delta, dk, dv, N, run.scale,
            **common)
    _launch(_dq, _dq_tuned, run, N, B * H, "BLOCK_M", q, k, v, do, lse, delta, dq, N, run.scale, **common)
    return dq, dk, dv


class _Flash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, run: _Run):
        o, lse = _forward(q, k, v, run)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.run = run
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        return (*_backward(q, k, v, o, lse, do, ctx.run), None)


# torch.compile must not trace into the kernels: Inductor re-compiles user Triton kernels with its own
# specialisations, which this kernel's constexpr branches do not survive (seen on an H200, torch 2.11). The
# call becomes a graph break; the kernels themselves are already fused.
@torch.compiler.disable
def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    fix: Fix | float | bool | None = None, precision: Precision | str = "fa2",
                    seed: int | None = None, block_m: int | None = None, block_n: int | None = None,
                    return_stats: bool = False, return_lse: bool = False):
    """FlashAttention-2 (Triton) with `precision`'s rounding points and an optional `fix`; autograd backward.

    q, k, v: (batch, heads, seq, head_dim) bf16/fp16/fp32 on a CUDA device, or on CPU under
    TRITON_INTERPRET=1; head_dim 16..128. precision: a Precision or short string (the output point must fit
    in q's dtype; scores round to nearest). fix: a Fix (or True, or a beta). seed: stochastic-rounding seed
    (default: drawn from torch's generator). block_m/block_n: fixed tile sizes (powers of two >= 16, <= 128
    on a GPU; default: Precision.tile, else 64 under the interpreter, else autotuned). Returns o; with
    return_lse also lse (fp32); with return_stats also the forward's AttentionStats, in that order.
    """
    check_qkv(q, k, v, head_dims=HEAD_DIMS, dtypes=DTYPES)
    if not q.is_cuda and not INTERPRET:
        raise ValueError("flash_attention needs CUDA tensors, or TRITON_INTERPRET=1 set before lowprec is "
                         "imported to run the kernels on CPU (e.g. TRITON_INTERPRET=1 python ...)")
    cfg = make_config(q, causal, precision, fix, block_m, block_n)
    prec, dtype = cfg.precision, q.dtype
    if not fits(prec.output.resolve(dtype), dtype):
        raise ValueError(f"precision.output ({prec.output}) must fit in q's dtype {dtype} for the triton "
                         "backend (it stores O in q's dtype); use backend='emulated' for wider outputs")
    blocks = (cfg.block_m, cfg.block_n) if (block_m or block_n or prec.tile or INTERPRET) else None
    for size in blocks or ():
        if size < 16 or size & (size - 1) or (q.is_cuda and size > 128):
            raise ValueError(f"block_m, block_n and precision.tile must be powers of two >= 16 (<= 128 on a "
                             f"GPU), got {blocks}; e.g. precision='paper:tile=64', or backend='emulated'")
    if seed is None:
        seed = int(torch.randint(0, 2**31 - 1, (1,))) if prec.stochastic() else 0
    codes = {name: _code(getattr(prec, name), dtype) for name in POINTS}
    p_fp32 = dot_dtype(prec, dtype) == torch.float32 and dtype != torch.float32
    native_p = not p_fp32 and codes["weights"] == {torch.bfloat16: CAST_BF16, torch.float16: CAST_FP16,
                                                   torch.float32: NONE}[dtype]
    run = _Run(causal, softmax_scale(q.shape[-1]), codes, p_fp32, native_p, cfg.fix, cfg.tol, blocks,
               int(seed), return_stats)
    o, lse = _Flash.apply(q.contiguous(), k.contiguous(), v.contiguous(), run)
    extra = ([lse] if return_lse else []) + ([run.stats] if return_stats else [])
    return (o, *extra) if extra else o


def compile_for_gpu(arch: int = 90, head_dim: int = 128) -> dict[str, int]:
    """Compile the kernels for CUDA sm_<arch> without a GPU (ptxas ships with triton): the bf16 fa2 forward,
    the forward with the Fix and counters, the fp32 forward, dK/dV and dQ, at their first autotune configs.
    Returns each kernel's shared memory in bytes. Needs compiled (not interpreted) kernels: import this module
    with TRITON_INTERPRET=0 (tests/test_flash_kernel.py runs it in a subprocess)."""
    if INTERPRET:
        raise ValueError("compile_for_gpu needs TRITON_INTERPRET=0 when lowprec is imported")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    pointers = {"Q", "K", "V", "O", "DO", "DK", "DV", "DQ"}
    scalars = {"N": "i32", "seed": "i32", "LSE": "*fp32", "DELTA": "*fp32", "STATS": "*i32"}
    base = dict(D=head_dim, BLOCK_D=_block_d(head_dim), CAUSAL=True, IEEE=False, C_SCORES=NONE)
    fwd = dict(base, FIX=0, WITH_STATS=False, P_FP32=False, NATIVE_P=True, C_WEIGHTS=CAST_BF16, C_ROWSUM=NONE,
               C_PRODUCT=NONE, C_ACC=NONE, C_OUTPUT=CAST_BF16)
    builds = {  # name: (kernel, constexprs, input dtype)
        "forward": (_fwd_tuned, fwd, "bf16"),
        "forward+fix": (_fwd_tuned, dict(fwd, FIX=1, WITH_STATS=True), "bf16"),
        "forward fp32": (_fwd_tuned, dict(fwd, IEEE=True, C_WEIGHTS=NONE, C_OUTPUT=NONE), "fp32"),
        "dkdv": (_dkdv_tuned, base, "bf16"),
        "dq": (_dq_tuned, base, "bf16"),
    }
    shared = {}
    for name, (tuned, constexprs, dtype) in builds.items():
        config = tuned.configs[0]
        constexprs = dict(constexprs, **config.kwargs)
        signature = {arg: "constexpr" if arg in constexprs else f"*{dtype}" if arg in pointers
                     else scalars.get(arg, "fp32") for arg in tuned.fn.arg_names}
        kernel = triton.compile(ASTSource(tuned.fn, signature, constexprs), target=target,
                                options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
        shared[name] = kernel.metadata.shared
    return shared

"""The Triton mirror of precision.py's rounding points, fix.py's `fix_shift` and emulated.py's arithmetic.

Each function names the torch function it mirrors (`_round`: precision._round; `_round_bits`:
formats.round_to; `_cast`: a bf16 / fp16 cast; `_fix_shift`: fix.fix_shift; `_exp_sub`, `_log`, `_dot`:
emulated's). A rounding point is resolved on the host into one int code (`_code`); stochastic bits come from a
counter-based hash of (seed, batch*head, point, element). The code's bit layout: the book's appendix "Methods
and record formats".
"""

from __future__ import annotations

from lowprec.attention.triton_mode import GPU  # first: it may switch on the interpreter before triton loads

# isort: split
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from lowprec.attention.precision import POINTS, Precision, Rounding

# rounding kinds (the low 4 bits of a code)
NONE, CAST_BF16, CAST_FP16, NEAREST, STOCHASTIC, ONES = 0, 1, 2, 3, 4, 5
# the rounding points: indices into CODES (precision.POINTS order) and stream ids of their stochastic bits
SCORES, WEIGHTS, ROWSUM, PRODUCT, ACCUMULATOR, OUTPUT = (
    tl.constexpr(POINTS.index(name))
    for name in ("scores", "weights", "rowsum", "product", "accumulator", "output")
)


def _code(rounding: Rounding, dtype: torch.dtype) -> int:
    """The kernel's integer code for one rounding point resolved for inputs of `dtype` (Rounding.resolve)."""
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


def _codes(precision: Precision, dtype: torch.dtype) -> dict[str, int]:
    """The six codes of `precision` for inputs of `dtype`, by point in POINTS order (the forward kernel's
    CODES is tuple(their values))."""
    return {name: _code(getattr(precision, name), dtype) for name in POINTS}


# ------------------------------------------------------------------------------------- k-bit rounding


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
    """31 random bits (int32) per element from (seed, stream, element index); stands in for the
    torch.randint(0, 2**31) draw of formats.round_to's stochastic mode."""
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
    """Mirror of formats.round_to: fp32 x rounded to the format in CODE, nearest-even or stochastic, with
    integer ops on its bits."""
    E: tl.constexpr = (CODE >> 4) & 15
    M: tl.constexpr = (CODE >> 8) & 31
    NO_INF: tl.constexpr = (CODE >> 13) & 1
    BIAS: tl.constexpr = (1 << (E - 1)) - 1
    EMIN: tl.constexpr = 1 - BIAS
    EMAX: tl.constexpr = (1 << E) - 2 + NO_INF - BIAS
    MAX_BITS: tl.constexpr = ((EMAX + 127) << 23) | (((1 << M) - 1 - NO_INF) << (23 - M))
    # -- the grid: x = sig * 2^(e - 23), grid step 2^q (formats._grid) --
    u = x.to(tl.int32, bitcast=True)
    a = u & 0x7FFFFFFF
    biased = a >> 23
    sig = tl.where(biased > 0, (a & 0x7FFFFF) | 0x800000, a)
    e = tl.maximum(biased, 1) - 127
    q = tl.maximum(e, EMIN) - M
    shift = q - e + 23
    # -- whole grid steps toward zero, then up or not --
    kept = tl.minimum(shift, 25)
    n = sig >> kept
    rem = sig - (n << kept)
    if (CODE & 15) == 4:  # STOCHASTIC: up with probability rem / 2^shift
        frac = (rem << (31 - kept)) >> tl.minimum(shift - kept, 31)
        n = n + (_random_bits(seed, stream, idx) < frac).to(tl.int32)
    else:  # NEAREST, ties to even
        twice = rem << 1
        step = 1 << kept
        n = n + ((twice > step) | ((twice == step) & ((n & 1) == 1))).to(tl.int32)
    # -- back to fp32, overflow as the format says, sign and NaN --
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
    """Mirror of formats.round_to(x, bf16 / fp16) (torch's x.to(dtype).float()): NONE: x; CAST_BF16 /
    CAST_FP16: x through bf16 / fp16 (round to nearest even, the hardware cast) and back to fp32."""
    if KIND == 1:
        return x.to(tl.bfloat16).to(tl.float32)
    elif KIND == 2:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _round(x, CODE: tl.constexpr, seed, stream, idx):
    """Mirror of precision._round (round_scores, round_weights, ... round_output: one rounding point): fp32
    in, fp32 values of the format out."""
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


# ---------------------------------------------------------------------------------------------- the Fix


@triton.jit
def _fix_shift(r, ties, fix):
    """Mirror of fix.fix_shift: (shift, triggered, fallback) for row maxima r. `fix` is the tuple (beta, tol,
    min_gap, max_gap) of the call's FixParams (tol is used by the callers' tie tests)."""
    beta, _, min_gap, max_gap = fix
    triggered = ties & (r > float("-inf"))
    want = tl.where(r > 0, r * beta, tl.where(r < 0, 0.0, r))
    want = tl.where(want - r < min_gap, r + min_gap, want)
    fallback = triggered & (want - r > max_gap)
    want = tl.where(want - r > max_gap, r + max_gap, want)
    return tl.where(triggered, want, r), triggered, fallback


# ------------------------------------------------------------------------------- exp, log and dots


LOG2E = tl.constexpr(1.4426950408889634)  # log2(e); rounded to fp32 where it multiplies an fp32 tensor


@triton.jit
def _exp_sub(x, m, NATURAL: tl.constexpr, IEEE: tl.constexpr):
    """Mirror of emulated.exp_sub: exp(x - m) in fp32 as exp2(x * log2(e) - m * log2(e)) (on a GPU one FMA
    and ex2, FlashAttention-2's form), or with NATURAL as exp(x - m); libdevice's exp / exp2 for fp32 inputs
    (IEEE) on a GPU, ex2.approx otherwise. Exactly rounded under the interpreter patch."""
    if NATURAL:  # noqa: SIM108 (a constexpr branch)
        x = x - m
    else:
        x = x * LOG2E - m * LOG2E
    if IEEE and GPU and NATURAL:
        y = libdevice.exp(x)
    elif IEEE and GPU:
        y = libdevice.exp2(x)
    elif NATURAL:
        y = tl.exp(x)
    else:
        y = tl.exp2(x)
    return y


@triton.jit
def _log(x, IEEE: tl.constexpr):
    """Mirror of emulated.log: log in fp32; lg2.approx for bf16 / fp16 inputs on a GPU, libdevice's for fp32
    inputs; exactly rounded under the interpreter patch."""
    if IEEE and GPU:  # noqa: SIM108 (a constexpr branch)
        y = libdevice.log(x)
    else:
        y = tl.log(x)
    return y


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
def _to_bf16(x):
    """x (fp32) rounded to nearest bf16: on a GPU two at a time (cvt.rn.bf16x2.f32, one instruction a pair,
    also where the result is widened again), else a plain cast."""
    if GPU:
        y = tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [x], dtype=tl.bfloat16,
                                      is_pure=True, pack=2)
    else:
        y = x.to(tl.bfloat16)
    return y


@triton.jit
def _widen_bf16(y):
    """y (bf16) as fp32: on a GPU two at a time from their shared register (a shift and a mask), else a
    plain cast."""
    if GPU:
        x = tl.inline_asm_elementwise("shl.b32 $0, $2, 16;\n\tand.b32 $1, $2, 0xFFFF0000;", "=r,=r,r", [y],
                                      dtype=tl.float32, is_pure=True, pack=2)
    else:
        x = y.to(tl.float32)
    return x


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
    """Mirror of emulated.dot (plus acc): tl.dot with fp32 accumulation; IEEE fp32 products (no TF32) when
    IEEE. An IEEE dot on a GPU adds a tile's dot to acc once (`_ieee_dot`) instead of chaining its FMAs on acc
    (N roundings at |acc| over a loop of N keys or queries, up to ~7x the error of torch's fp32 kernels); in
    the interpreter it is one rounding of the exact dot plus acc, either way."""
    if IEEE and GPU:
        out = _ieee_dot(a, b)
        if acc is not None:
            out = _add(acc, out)
    elif IEEE:
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out

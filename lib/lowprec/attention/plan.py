"""`plan_call`: one attention call's options, validated and resolved for q's dtype, shared by the emulator
(emulated.py) and the Triton kernels (flash.py), so that both read the same precision, Fix numbers, tie
window, tiles and scale. Plain Python besides the tensors' attributes (no torch op), so torch.compile traces
it without a graph break."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lowprec.attention.fix import AttentionStats, Fix, FixParams, as_fix, f32
from lowprec.attention.precision import Precision, dot_dtype
from lowprec.attention.reference import check_scale

DEFAULT_BLOCK = 64


def softmax_scale(head_dim: int, scale: float | None = None) -> float:
    """The softmax scale the kernel receives: `scale`, or 1/sqrt(head_dim), rounded to fp32. ValueError unless
    it is a finite number > 0."""
    if check_scale(scale) is None:
        return f32(1.0 / math.sqrt(head_dim))
    return f32(float(scale))


@dataclass
class CallPlan:
    """What the forward and backward of one call need besides the tensors."""

    dtype: torch.dtype         # the input dtype ("input" rounding points resolve to it)
    causal: bool               # bottom-right aligned: query i sees keys j <= i + Nk - Nq
    precision: Precision
    fix: FixParams | None      # the Fix resolved for P̄'s format, or None
    tol: float                 # near-tie window of the counters: the Fix's tol, or the default Fix's
    block_m: int               # query rows per tile
    block_n: int               # keys per tile
    tiles_given: bool          # block_m, block_n or precision.tile was set (else the engine may choose)
    scale: float               # softmax scale, fp32
    pv_dtype: torch.dtype      # dtype of P̄ and V in the P̄V dot
    stats: AttentionStats | None = None  # the forward's counters, when asked for


def plan_call(q: torch.Tensor, causal: bool, precision: Precision | str, fix: Fix | float | bool | str | None,
              block_m: int | None = None, block_n: int | None = None, scale: float | None = None) -> CallPlan:
    """Validate the options of a call on q (batch, heads, seq, head_dim) and resolve them for q's dtype.
    block_m / block_n: None means precision.tile, else DEFAULT_BLOCK; any other value must be an int >= 1.
    scale: None means 1/sqrt(head_dim); either way rounded to fp32."""
    precision = Precision.parse(precision)
    if precision.scores.mode != "nearest":
        raise ValueError("precision.scores must round to nearest (the backward recomputes S and must get the "
                         f"forward's values); got {precision.scores}")
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool, got {causal!r}")
    sizes = []
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if value is None:
            value = precision.tile or DEFAULT_BLOCK
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise ValueError(f"{name} must be a positive int (or None for the default), got {value!r}")
        sizes.append(value)
    weights_fmt = precision.weights.resolve(q.dtype)
    fp = None if (fix := as_fix(fix)) is None else fix.resolve(weights_fmt)
    tol = fp.tol if fp is not None else Fix().resolve(weights_fmt).tol
    tiles_given = block_m is not None or block_n is not None or precision.tile is not None
    return CallPlan(q.dtype, causal, precision, fp, tol, *sizes, tiles_given,
                    softmax_scale(q.shape[-1], scale), dot_dtype(precision, q.dtype))

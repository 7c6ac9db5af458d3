"""`plan_call`: one attention call's options, validated and resolved for q's dtype and head dim, shared by the
emulator (emulated.py) and the Triton kernels (flash.py), so that both read the same precision, Fix numbers,
tie window, tiles and scale. Cached: a training step resolves each distinct call once. Plain Python besides
the tensors' attributes (no torch op)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from lowprec.attention.fix import Fix, FixParams, as_fix, f32
from lowprec.attention.precision import Precision, dot_dtype
from lowprec.attention.reference import check_scale

DEFAULT_BLOCK = 64


def softmax_scale(head_dim: int, scale: float | None = None) -> float:
    """The softmax scale the kernel receives: `scale`, or 1/sqrt(head_dim), rounded to fp32. ValueError unless
    it is a finite number > 0."""
    if check_scale(scale) is None:
        return f32(1.0 / math.sqrt(head_dim))
    return f32(float(scale))


@dataclass(frozen=True)
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


def plan_call(dtype: torch.dtype, head_dim: int, causal: bool, precision: Precision | str,
              fix: Fix | float | bool | str | None, block_m: int | None = None, block_n: int | None = None,
              scale: float | None = None) -> CallPlan:
    """Validate the options of a call on inputs of `dtype` and `head_dim` and resolve them. block_m / block_n:
    None means precision.tile, else DEFAULT_BLOCK; any other value must be an int >= 1. scale: None means
    1/sqrt(head_dim); either way rounded to fp32. Cached on the arguments (typed: True and 1 differ)."""
    args = (dtype, head_dim, causal, precision, fix, block_m, block_n, scale)
    try:
        return _plan(*args)
    except TypeError:  # an unhashable option: resolved uncached, whose ValueError names it
        return _plan.__wrapped__(*args)


@functools.lru_cache(maxsize=256, typed=True)
def _plan(dtype: torch.dtype, head_dim: int, causal: bool, precision: Precision | str,
          fix: Fix | float | bool | str | None, block_m: int | None, block_n: int | None,
          scale: float | None) -> CallPlan:
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
    weights_fmt = precision.weights.resolve(dtype)
    fp = None if (fix := as_fix(fix)) is None else fix.resolve(weights_fmt)
    tol = fp.tol if fp is not None else Fix().resolve(weights_fmt).tol
    tiles_given = block_m is not None or block_n is not None or precision.tile is not None
    return CallPlan(dtype, causal, precision, fp, tol, *sizes, tiles_given, softmax_scale(head_dim, scale),
                    dot_dtype(precision, dtype))

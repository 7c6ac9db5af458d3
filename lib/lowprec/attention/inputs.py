"""Inputs with controlled score maxima: exact or near ties, any sign and size (tests, the book's fix
chapter)."""

from __future__ import annotations

import math

import torch


def tied_qkv(
    shape: tuple[int, int, int, int],
    ties: int = 4,
    max_score: float = 4.0,
    spacing: float = 0.0,
    noise: float = 0.5,
    gap: float = 3.0,
    v_mean: float = 0.0,
    v_std: float = 1.0,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of `shape` (batch, heads, seq, head_dim) whose first `ties` keys are each row's top scores.

    Scores (after the 1/sqrt(head_dim) scale) are s[i, j] = x_i . y + max_score + j * spacing for j < ties
    (the same y for all of them, so spacing = 0 gives bit-exact ties; spacing > 0 gives near ties, up to
    (ties-1)*spacing apart) and x_i . y_j + max_score - gap for the other keys. x, y are N(0, noise^2) (noise
    = 0 puts every row max exactly at max_score, e.g. 0 for the Fix's edge). v ~ N(v_mean, v_std^2): a mean
    far from 0 gives same-sign V columns. All parts are rounded to `dtype`, so ties stay exact after rounding.
    """
    batch, heads, n, d = shape
    if d < 3 or not 1 <= ties <= n:
        raise ValueError(f"need head_dim >= 3 and 1 <= ties <= seq, got shape {shape}, ties {ties}")
    gen = torch.Generator().manual_seed(seed)
    unscale = math.sqrt(d)  # scores are q.k / sqrt(d): write every score term multiplied by sqrt(d)
    q = torch.zeros(shape)
    k = torch.zeros(shape)
    q[..., :-2] = torch.randn(batch, heads, n, d - 2, generator=gen) * noise
    k[..., :-2] = torch.randn(batch, heads, n, d - 2, generator=gen) * noise * unscale
    k[..., :ties, :-2] = k[..., :1, :-2]  # the tied keys share y
    q[..., -2:] = 1.0
    k[..., -1] = (max_score - gap) * unscale
    k[..., :ties, -1] = max_score * unscale
    k[..., :ties, -2] = torch.arange(ties) * spacing * unscale
    v = v_mean + v_std * torch.randn(shape, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)

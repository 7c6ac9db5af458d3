"""Input checks shared by every backend, and the float64 reference attention.

Tensors are (batch, heads, seq, head_dim); q, k and v have one shape, one dtype and one device.
`causal=True` lets query i see keys 0..i (top-left aligned, the GPT convention).
"""

from __future__ import annotations

import math

import torch

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def check_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    head_dims: tuple[int, int] = (1, 1 << 16),
    dtypes: tuple[torch.dtype, ...] = DTYPES,
) -> None:
    """Raise ValueError naming the argument if q, k, v are not matching (batch, heads, seq, head_dim)
    tensors."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have rank 4 (batch, heads, seq, head_dim), got shape {tuple(t.shape)}"
            )
    if not (q.shape == k.shape == v.shape):
        raise ValueError(
            f"q, k and v must have the same shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in dtypes:
        raise ValueError(f"q.dtype must be one of {[str(d) for d in dtypes]}, got {q.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on the same device, got {q.device}, {k.device}, {v.device}")
    lo, hi = head_dims
    if not lo <= q.shape[-1] <= hi:
        raise ValueError(
            f"head_dim (q.shape[-1]) must be in [{lo}, {hi}] for this backend, got {q.shape[-1]}"
        )
    if q.shape[2] < 1:
        raise ValueError("seq (q.shape[2]) must be at least 1")


def causal_mask(n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean (n, n) mask, True where key j is visible to query i (j <= i)."""
    idx = torch.arange(n, device=device)
    return idx[None, :] <= idx[:, None]


def scaled_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q k^T / sqrt(head_dim) in q's dtype, unmasked (B, H, N, N): the scores of every plain attention."""
    return (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention in float64: returns (o, lse), o (B, H, N, D) and lse = logsumexp of scaled scores
    (B, H, N).

    The weights are exp(s - max) / sum(exp(s - max)), exact for any finite scores: normalising by
    exp(s - lse) instead loses the sum where lse = max + log(sum) rounds to max (ties at |s| ~ 1e16).
    Differentiable (autograd through float64 ops), so it also gives reference gradients.
    """
    check_qkv(q, k, v)
    s = scaled_scores(q.double(), k.double())
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[2], q.device), float("-inf"))
    m = s.amax(dim=-1, keepdim=True).detach()  # a shift: softmax and lse do not depend on it
    e = torch.exp(s - m)
    total = e.sum(dim=-1, keepdim=True)
    o = (e / total) @ v.double()
    return o, (m + torch.log(total)).squeeze(-1)

"""Input checks and helpers shared by every backend, and the float64 reference attention.

Tensors are (batch, heads, seq, head_dim). q is (B, H, Nq, D); k and v are (B, H_kv, Nk, D) with H a
multiple of H_kv (grouped-query attention: query head h reads key/value head h // (H // H_kv); H_kv = 1 is
multi-query attention) and any Nk >= 1. All three share one dtype and one device.
`causal=True` aligns the mask bottom-right, as FlashAttention-2 does: query i sees keys j <= i + Nk - Nq (for
Nq == Nk: keys 0..i, the GPT convention; for Nq < Nk the queries are the last Nq positions of the keys'
sequence). With Nq > Nk the first Nq - Nk queries see no key: their output is 0 (and their lse +inf, so that
a flash backward gives them zero gradients), as in FlashAttention-2.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def autocast_qkv(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors (q, k, v, or some of them) in autocast's dtype where autocast is on for the first one's
    device, as torch casts SDPA's inputs (floating tensors other than float64); unchanged otherwise."""
    device = tensors[0].device.type if isinstance(tensors[0], torch.Tensor) else None  # else check_qkv says
    # compiled tensors are on real devices; torch 2.11's Dynamo cannot trace the availability check (a break)
    known = (torch.compiler.is_compiling() or torch.amp.is_autocast_available(device)) if device else False
    if not (known and torch.is_autocast_enabled(device)):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point()
                 and t.dtype != torch.float64 else t for t in tensors)


def constant_result(fn: Callable) -> Callable:
    """`fn` marked as `torch.compiler.assume_constant_result` marks it (torch.compile calls it once while
    tracing and keeps its result as a constant), without the decorator's import of torch._dynamo: 1.2 s of CPU
    in every process that imports the model and never compiles, each `lowprec` command among them
    (tests/test_flash_kernel.py checks that the decorator still sets only this)."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def check_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    head_dims: tuple[int, int] = (1, 1 << 16),
    dtypes: tuple[torch.dtype, ...] = DTYPES,
) -> None:
    """Raise ValueError naming the argument if q, k, v are not (B, H, Nq, D), (B, H_kv, Nk, D),
    (B, H_kv, Nk, D) tensors with H a multiple of H_kv (module docstring)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have rank 4 (batch, heads, seq, head_dim), got shape {tuple(t.shape)}"
            )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch size (dim 0), got {q.shape[0]} and {k.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must have the same head_dim (dim 3), got {q.shape[3]} and {k.shape[3]}")
    if k.shape[1] < 1 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q's heads (dim 1, {q.shape[1]}) must be a multiple of k's and v's heads "
                         f"({k.shape[1]}): grouped-query attention")
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
        raise ValueError("q's seq (q.shape[2]) must be at least 1")
    if k.shape[2] < 1:
        raise ValueError("k's and v's seq (k.shape[2]) must be at least 1")


def causal_mask(n_q: int, device: torch.device | str | None = None, n_k: int | None = None) -> torch.Tensor:
    """Boolean (n_q, n_k) mask (n_k defaults to n_q), True where key j is visible to query i:
    j <= i + n_k - n_q (bottom-right aligned, module docstring)."""
    n_k = n_q if n_k is None else n_k
    i = torch.arange(n_q, device=device)[:, None]
    j = torch.arange(n_k, device=device)[None, :]
    return j <= i + (n_k - n_q)


def expand_kv(k: torch.Tensor, heads: int) -> torch.Tensor:
    """k or v (B, H_kv, N, D) with each head repeated for its group of `heads` // H_kv query heads."""
    return k if k.shape[1] == heads else k.repeat_interleave(heads // k.shape[1], dim=1)


def check_scale(scale: float | None) -> float | None:
    """`scale` if it is None (1/sqrt(head_dim)) or a finite number > 0 (every backend's softmax scale);
    ValueError otherwise."""
    if scale is not None and not (isinstance(scale, (int, float)) and not isinstance(scale, bool)
                                  and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be None (1/sqrt(head_dim)) or a finite number > 0, got {scale!r}")
    return scale


def scaled_scores(q: torch.Tensor, k: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """q k^T * scale (default 1/sqrt(head_dim)) in q's dtype, unmasked (B, H, Nq, Nk), k's heads expanded to
    q's: the scores of every plain attention."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if check_scale(scale) is None else scale
    return (q @ expand_kv(k, q.shape[1]).transpose(-1, -2)) * scale


def masked_product(w: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor:
    """w @ v over the visible keys only (`visible`: the (Nq, Nk) mask, None: all): a key the mask hides adds
    nothing, whatever its value (w @ v alone would add its 0 * NaN = NaN), while a visible one adds w * v
    as IEEE arithmetic does (a NaN value, or an infinite one at weight 0: NaN; +inf with -inf: NaN)."""
    bad = ~torch.isfinite(v)
    o = w @ torch.where(bad, 0.0, v)
    if not bad.any():
        return o
    seen = torch.ones_like(w) if visible is None else visible.to(w.dtype).expand_as(w)
    nan, pos, neg = (x.to(w.dtype) for x in (v.isnan(), v == float("inf"), v == float("-inf")))
    weighted = seen * (w > 0).to(w.dtype)
    n_nan = seen @ nan + (seen * (w == 0).to(w.dtype)) @ (pos + neg)
    n_pos, n_neg = weighted @ pos, weighted @ neg
    o = torch.where(n_pos > 0, float("inf"), torch.where(n_neg > 0, float("-inf"), o))
    return torch.where((n_nan > 0) | ((n_pos > 0) & (n_neg > 0)), float("nan"), o)


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention in float64: returns (o, lse), o (B, H, Nq, D) and lse = logsumexp of scaled scores
    (B, H, Nq); scale defaults to 1/sqrt(head_dim). Rows that see no key (causal, Nq > Nk) give o = 0 and
    lse = +inf.

    The weights are exp(s - max) / sum(exp(s - max)), exact for any finite scores: normalising by
    exp(s - lse) instead loses the sum where lse = max + log(sum) rounds to max (ties at |s| ~ 1e16).
    Differentiable (autograd through float64 ops), so it also gives reference gradients. Only what the mask
    lets through counts: a hidden key's value, NaN included, changes nothing (`masked_product`).
    """
    check_qkv(q, k, v)
    s = scaled_scores(q.double(), k.double(), scale)
    visible = causal_mask(q.shape[2], q.device, k.shape[2]) if causal else None
    if causal:
        s = s.masked_fill(~visible, float("-inf"))
    seen = (s > float("-inf")).any(dim=-1, keepdim=True)  # rows that see at least one key
    m = torch.where(seen, s.amax(dim=-1, keepdim=True), 0.0).detach()  # a shift: o, lse do not depend on it
    e = torch.exp(s - m)
    total = e.sum(dim=-1, keepdim=True)
    o = masked_product(e / torch.where(seen, total, 1.0), expand_kv(v.double(), q.shape[1]), visible)
    lse = torch.where(seen, m + torch.log(torch.where(seen, total, 1.0)), float("inf"))
    return o, lse.squeeze(-1)

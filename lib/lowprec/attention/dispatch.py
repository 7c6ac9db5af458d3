"""`attention(q, k, v, backend=..., causal=True, **kw)`: one entry point for every attention implementation.

`backend` is a name, an `AttentionSpec` or its string ("triton/precision=fa2/fix=2"); keywords add to (and
override) the spec's. Every backend takes and returns (batch, heads, seq, head_dim) tensors (the output in q's
dtype), k and v with fewer heads than q, Nq != Nk (causal mask aligned bottom-right) and `scale`:
"reference" (float64), "math" (plain attention in the input dtype; `dtype="float32"`: in fp32, autocast off,
cast back), "sdpa" (torch's SDPA; `sdpa_backend=` pins one of its kernels), "emulated" (`emulated_attention`)
and "triton" (`flash_attention`).
`spec.BACKENDS` lists the keywords each accepts. Inside torch.compile a spec, or its string, is resolved once
while tracing (no graph break).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from lowprec.attention.reference import (
    causal_mask,
    check_qkv,
    check_scale,
    constant_result,
    expand_kv,
    reference_attention,
    scaled_scores,
)
from lowprec.attention.spec import MATH_DTYPES, SDPA_BACKENDS, AttentionSpec


def math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                   scale: float | None = None, dtype: str | None = None) -> torch.Tensor:
    """Standard (non-flash) attention with every op in the input dtype, or in `dtype` (one of MATH_DTYPES,
    autocast off) and the output cast back to the input dtype (rows that see no key: 0)."""
    check_qkv(q, k, v)
    if dtype is not None:
        if dtype not in MATH_DTYPES:
            raise ValueError(f"math attention's dtype must be one of {MATH_DTYPES}, got {dtype!r}")
        wide = getattr(torch, dtype)
        with torch.autocast(q.device.type, enabled=False):
            return math_attention(q.to(wide), k.to(wide), v.to(wide), causal, scale).to(q.dtype)
    s = scaled_scores(q, k, scale)
    blind = None  # rows that see no key (causal, Nq > Nk): their scores become 0 and their output 0, not NaN
    if causal:
        visible = causal_mask(q.shape[2], q.device, k.shape[2])
        s = s.masked_fill(~visible, float("-inf"))
        if q.shape[2] > k.shape[2]:
            blind = ~visible.any(-1, keepdim=True)
            s = s.masked_fill(blind, 0.0)
    o = torch.softmax(s, dim=-1) @ expand_kv(v, q.shape[1])
    return o if blind is None else o.masked_fill(blind, 0.0)


def sdpa_failure(exc: Exception) -> str:
    """Why an SDPA kernel could not run, in one line for a record (torch raises RuntimeError, its warnings
    naming the reasons, when a pinned kernel cannot take the inputs)."""
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, sdpa_backend: str | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """torch's scaled_dot_product_attention, optionally pinned to one of its kernels (Nq != Nk causal: a
    bottom-right causal bias; grouped-query k, v: enable_gqa, or expanded to q's heads for the kernels that
    lack it)."""
    check_qkv(q, k, v)
    check_scale(scale)
    if sdpa_backend is None:
        ctx = contextlib.nullcontext()
    elif sdpa_backend in SDPA_BACKENDS:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        names = {
            "flash": "FLASH_ATTENTION",
            "efficient": "EFFICIENT_ATTENTION",
            "cudnn": "CUDNN_ATTENTION",
            "math": "MATH",
        }
        ctx = sdpa_kernel(getattr(SDPBackend, names[sdpa_backend]))
    else:
        raise ValueError(f"sdpa_backend must be None or one of {SDPA_BACKENDS}, got {sdpa_backend!r}")
    if sdpa_backend in ("efficient", "cudnn"):  # their kernels take equal head counts only (no enable_gqa)
        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    kw: dict[str, object] = {"scale": scale, "enable_gqa": q.shape[1] != k.shape[1]}
    blind = None  # rows that see no key (causal, Nq > Nk): attend to every key, then output 0 (not NaN)
    if causal and q.shape[2] != k.shape[2]:
        visible = causal_mask(q.shape[2], q.device, k.shape[2])
        if q.shape[2] > k.shape[2]:
            blind = ~visible.any(-1, keepdim=True)
            visible = visible | blind
        kw["attn_mask"] = visible
    else:
        kw["is_causal"] = causal
    with ctx:
        o = F.scaled_dot_product_attention(q, k, v, **kw)
    return o if blind is None else o.masked_fill(blind, 0.0)


def _call_of(spec: AttentionSpec, keywords: tuple[str, ...]) -> tuple[str, tuple[tuple[str, object], ...]]:
    """(backend name, the keywords its function gets) of a spec, after checking the call's `keywords`."""
    spec.accepts(keywords)
    return spec.backend, tuple(spec.kwargs().items())


@constant_result
def _resolve(backend: str, keywords: tuple[str, ...]) -> tuple[str, tuple[tuple[str, object], ...]]:
    """`_call_of` a spec string, as plain constants: torch.compile runs this once while tracing instead of
    parsing the string (no graph break). Only plain values may reach it: torch.compile 2.11 cannot turn a
    frozen dataclass (an AttentionSpec) met while tracing back into a constant."""
    return _call_of(AttentionSpec.parse(backend), keywords)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: AttentionSpec | str = "sdpa",
              causal: bool = True, **kw) -> torch.Tensor:
    """Attention output (q's dtype) from the named backend or spec; see the module docstring for backends and
    keywords.

    "emulated" and "triton" also take return_lse / return_stats: the result is then (o, [lse], [stats]).
    """
    name, call = (_call_of(backend, tuple(kw)) if isinstance(backend, AttentionSpec)
                  else _resolve(backend, tuple(kw)))
    kw = {**dict(call), **kw}
    if name == "reference":
        return reference_attention(q, k, v, causal, **kw)[0].to(q.dtype)
    if name == "math":
        return math_attention(q, k, v, causal, **kw)
    if name == "sdpa":
        return sdpa_attention(q, k, v, causal, **kw)
    if name == "emulated":
        from lowprec.attention.emulated import emulated_attention

        return emulated_attention(q, k, v, causal=causal, **kw)
    from lowprec.attention.flash import flash_attention

    return flash_attention(q, k, v, causal=causal, **kw)

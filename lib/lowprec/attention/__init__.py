"""Attention implementations that share one op order and one set of rounding points.

`attention(q, k, v, backend=spec)` is the one entry point (dispatch.py); `reference_attention` is float64,
`emulated_attention` the FlashAttention-2 emulator (emulated.py), `flash_attention` our Triton kernels
(flash.py, imported lazily: triton loads only when used). `AttentionSpec`, `Precision`, `Fix` and `plan_call`
are a call's options (spec.py, precision.py, fix.py, plan.py).
"""

from lowprec.attention.dispatch import SDPA_BACKENDS, attention, math_attention, sdpa_attention
from lowprec.attention.emulated import emulated_attention
from lowprec.attention.fix import AttentionStats, Fix
from lowprec.attention.precision import Precision, Rounding
from lowprec.attention.reference import check_qkv, reference_attention
from lowprec.attention.spec import BACKENDS, AttentionSpec

__all__ = [
    "BACKENDS",
    "AttentionSpec",
    "SDPA_BACKENDS",
    "AttentionStats",
    "Fix",
    "Precision",
    "Rounding",
    "attention",
    "check_qkv",
    "emulated_attention",
    "flash_attention",
    "math_attention",
    "reference_attention",
    "sdpa_attention",
]


def __getattr__(name: str):
    if name == "flash_attention":
        from lowprec.attention.flash import flash_attention

        return flash_attention
    raise AttributeError(f"module 'lowprec.attention' has no attribute {name!r}")

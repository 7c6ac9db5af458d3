"""Attention implementations that share one op order and one set of rounding points.

- `attention(q, k, v, backend=..., causal=True, **kw)`: the single entry point (dispatch.py); `backend` is a
  name or an `AttentionSpec` (spec.py: backend, precision, Fix and options as one typed value, with the
  table `BACKENDS` of what each backend accepts).
- `reference_attention`: float64 (o, lse).
- `Precision`, `Rounding`: where rounding happens (precision.py); `Fix`, `AttentionStats`: the paper's dynamic
  maximum and the per-row counters (fix.py); `plan_call`: one call's options resolved (plan.py).
- `emulated_attention`: pure-PyTorch tiled FlashAttention-2 with those rounding points (emulated.py).
- `flash_attention`: the Triton kernels (flash.py, which launches triton_kernels.py); bit-identical to the
  emulator under TRITON_INTERPRET=1 thanks to the interpreter patch (interpreter.py). Imported lazily:
  triton is loaded only when it is used.
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

"""Attention implementations that share one op order and one set of rounding points.

- `attention(q, k, v, backend=..., causal=True, **kw)`: the single entry point (dispatch.py).
- `reference_attention`: float64 (o, lse).
- `Precision`, `Rounding`, `Fix`, `AttentionStats`: where rounding happens, the paper's dynamic maximum and
  the per-row counters (precision.py).
- `emulated_attention`: pure-PyTorch tiled FlashAttention-2 with those rounding points (emulated.py).
- `flash_attention`: the Triton kernels (triton_kernels.py); bit-identical to the emulator under
  TRITON_INTERPRET=1 thanks to the interpreter patch (interpreter.py). Imported lazily: triton is loaded only
  when it is used.
"""

from lowprec.attention.dispatch import BACKENDS, SDPA_BACKENDS, attention, math_attention, sdpa_attention
from lowprec.attention.emulated import emulated_attention
from lowprec.attention.precision import AttentionStats, Fix, Precision, Rounding
from lowprec.attention.reference import check_qkv, reference_attention

__all__ = [
    "BACKENDS",
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
        from lowprec.attention.triton_kernels import flash_attention

        return flash_attention
    raise AttributeError(f"module 'lowprec.attention' has no attribute {name!r}")

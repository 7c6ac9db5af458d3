"""Compiled or interpreted Triton: the switch that must run before the first `import triton`.

triton_rounding.py, triton_kernels.py and flash.py import this module before triton. If CUDA is not
available and TRITON_INTERPRET is unset, it sets TRITON_INTERPRET=1, so that the kernels run in Triton's CPU
interpreter. Under TRITON_INTERPRET=1 it applies interpreter.py's patch, which makes the interpreted kernels
bit-identical to emulated_attention; it never touches GPU runs.
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") is None:
    # No GPU: run the kernels in Triton's CPU interpreter. Triton decides between compiled and interpreted
    # functions when it decorates them, its own standard library included, so this only works before the
    # first `import triton` (torch._dynamo imports it, for one).
    if "triton" in sys.modules:
        raise RuntimeError(
            "the Triton kernels need Triton's CPU interpreter on a machine without a GPU, but triton was "
            "imported before lowprec could switch it on: set TRITON_INTERPRET=1 in the environment before "
            "starting Python (`make test`, `make book` and `make lab` do)"
        )
    os.environ["TRITON_INTERPRET"] = "1"

import triton.language as tl  # noqa: E402

from lowprec.attention import interpreter  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRET:
    interpreter.apply()
# fp32 inputs on a GPU use libdevice's exp / log (~1 ulp) instead of ex2.approx(x * log2 e), whose error
# grows with |x|, and short FMA chains in their dots (`_ieee_dot`); under the interpreter exp / log are the
# patched, exactly rounded functions and a dot is rounded once
GPU = tl.constexpr(not INTERPRET)

"""Our Python's host time per eager `flash_attention` call, measured on a CPU: the GPU's launch path (the
autotuner's pick kept, the direct launch of its binary) with every kernel a stub that launches nothing.

    TRITON_INTERPRET=1 python scripts/host_path.py              # (B, H, N, D) = (1, 6, 128, 64)
    TRITON_INTERPRET=1 python scripts/host_path.py --profile    # + cProfile's largest own times

It prints microseconds per forward call (no grad) and per forward+backward call (gradients by
torch.autograd.grad, so nothing accumulates into leaves), the best two of five runs of `--calls` calls, so
that a change to the host path can be measured without a GPU. On a GPU the same path adds Triton's C
launcher and CUDA's allocations (`lowprec bench overhead` measures those against SDPA).
"""

from __future__ import annotations

import argparse
import time

import torch
import triton
from lowprec.attention import flash
from lowprec.instruments.bench_overhead import host_profile


class _Binary:
    """A compiled binary's stand-in: launching it does nothing."""

    def __getitem__(self, grid):
        return lambda *args: None


class _Kernel:
    """A JITFunction's (or its autotuner's) stand-in: the first launch "compiles" to a `_Binary`."""

    def __init__(self, jit: triton.JITFunction):
        self.arg_names = jit.arg_names
        self.best_config = triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=3)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: _Binary()


def stub_gpu_path() -> None:
    """Switch flash.py to its GPU launch path with stub kernels (for this process)."""
    flash.INTERPRET = False  # autotuned tiles and the direct launch, as on a GPU
    flash._lower.cache_clear()
    torch.cuda.current_device = lambda: 0
    for name, (kernel, _) in list(flash._KERNELS.items()):
        flash._KERNELS[name] = (_Kernel(kernel), _Kernel(kernel))
    flash._delta = _Kernel(flash._delta)
    torch.use_deterministic_algorithms(False)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """flash_attention's body without its CUDA check (the tensors here are on the CPU)."""
    q, k, v = flash.autocast_qkv(q, k, v)
    flash.check_qkv(q, k, v, head_dims=flash.HEAD_DIMS, dtypes=flash.DTYPES)
    options, stochastic = flash._kernel_options(q.dtype, q.shape[-1], True, True, None, None, "fa2", None,
                                                None)
    return flash._forward(q, k, v, -1 if stochastic else 0, False, options)[0]


def per_call_us(fn, calls: int) -> list[float]:
    """Microseconds per call of `fn`: the best two of five runs of `calls` calls, after a warm-up."""
    for _ in range(min(calls, 50)):
        fn()
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls * 1e6)
    return sorted(runs)[:2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", type=int, nargs=4, default=[1, 6, 128, 64], metavar=("B", "H", "N", "D"))
    parser.add_argument("--calls", type=int, default=2000, help="calls per timed run (default 2000)")
    parser.add_argument("--profile", action="store_true", help="also cProfile's largest own times")
    args = parser.parse_args()
    stub_gpu_path()
    B, H, N, D = args.shape
    q, k, v = (torch.randn(B, N, H, D).bfloat16().transpose(1, 2).requires_grad_() for _ in range(3))
    do = torch.randn(B, H, N, D).bfloat16()

    def forward() -> None:
        with torch.no_grad():
            attention(q, k, v)

    def forward_backward() -> None:
        torch.autograd.grad(attention(q, k, v), (q, k, v), do)

    for label, fn in (("fwd", forward), ("fwd+bwd", forward_backward)):
        best = per_call_us(fn, args.calls)
        print(f"{label:8s} {best[0]:7.1f} us per call (best two of five: {best[0]:.1f}, {best[1]:.1f})")
    if args.profile:
        print("fwd+bwd, cProfile's 15 largest own times (us per call): own, cumulative, calls, function")
        for r in host_profile(forward_backward, args.calls, top=15):
            print(f"  {r['own_us']:8.2f} {r['cum_us']:8.2f}  x{r['calls']:<5} {r['function']}")


if __name__ == "__main__":
    main()

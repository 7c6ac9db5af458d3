"""`flash_attention`: FlashAttention-2 in Triton with lowprec's rounding points and Fix, forward and backward.

This module launches the kernels of triton_kernels.py (autotune, autograd, the public `flash_attention` and
`flash_delta`) and compiles them ahead of time for a GPU (`compile_for_gpu`); triton_rounding.py holds the
rounding points they call. Importing it imports triton_mode.py first: if CUDA is not available and
TRITON_INTERPRET is unset, that sets TRITON_INTERPRET=1 itself (before triton is imported; a clear error if
triton was imported earlier), and under TRITON_INTERPRET=1 (CPU) it applies interpreter.py's patch, with
which the kernels are bit-identical to emulated_attention (o, lse, delta, dq, dk, dv, counters) for
round-to-nearest precisions.

Launch
- Block sizes: under the interpreter BLOCK_M = BLOCK_N = 64 (or Precision.tile, or block_m/block_n), the same
  tiles as emulated_attention's defaults. On a GPU the kernels are autotuned over a few Hopper configs
  (BLOCK_M, warps, stages; the forward keeps BLOCK_N = 64 so that per-tile tie detection does not depend on
  the chosen config); the Fix, the counters and the rounding codes (constexprs FIX, WITH_STATS, CODES, ...)
  are part of the autotune key, so each variant gets its own pick.
- Kernel arguments: the six rounding codes go in as one constexpr tuple CODES (POINTS order; the backward
  needs only the scores' code, C_SCORES), the Fix's numbers as one fp32 tuple `fix` = (beta, tol, min_gap,
  max_gap) (placeholders without a Fix; tol is also the counters' near-tie window).

What differs on a GPU (so GPU results match the emulator only statistically, not bit for bit):
- tl.dot runs on tensor cores: exact products but a hardware-specific multi-term accumulation with truncated
  alignment, not one rounding of the exact sum; IEEE fp32 dots run as FMA chains, cut into parts of K/4 and
  added to the accumulator once per tile (`_ieee_dot`), which keeps fp32 errors at the level of torch's;
- tl.exp / tl.log lower to ex2.approx / lg2.approx (about 2 ulp, subnormals flushed to zero; the argument is
  first multiplied by log2(e) in fp32, which adds an error growing with |x|); fp32 inputs use libdevice's
  exp / log instead (about 1 ulp);
- tl.sum / tl.max reduce in a tree across lanes and warps;
- the compiler fuses a*b + c into FMAs (e.g. l * alpha + rowsum, s * scale - m), one rounding instead of two;
- (the output division o = acc / l uses tl.div_rn, so it is IEEE-rounded on a GPU too.)
"""

from __future__ import annotations

from lowprec.attention.triton_mode import INTERPRET  # first: it may switch on the interpreter

# isort: split
import functools
from dataclasses import dataclass

import torch
import triton

from lowprec.attention.fix import STAT_NAMES, AttentionStats, Fix, FixParams
from lowprec.attention.plan import plan_call
from lowprec.attention.precision import Precision, fits
from lowprec.attention.reference import check_qkv
from lowprec.attention.triton_kernels import _delta, _dkdv, _dq, _fwd
from lowprec.attention.triton_rounding import CAST_BF16, CAST_FP16, NONE, _codes

HEAD_DIMS = (16, 128)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FWD_BLOCK_N = 64  # on a GPU the forward's key tile is fixed: per-tile tie detection depends on it

__all__ = ["INTERPRET", "autotuned_configs", "compile_for_gpu", "flash_attention", "flash_delta"]

# ----------------------------------------------------------------------------------------------- autotune


def _tuner_bench(fn, quantiles):
    """The autotuner's timer: short runs (triton's default, 25 + 100 ms per config, dominated benchmarks)."""
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


def _spill_free(configs, nargs, rows: str, **kwargs):
    """Configs whose fp32 accumulators (`rows` x BLOCK_D each) take <= 64 registers per thread: larger ones
    spill on sm_90 (as ptxas reports for compile_for_gpu's builds)."""
    kept = [c for c in configs if c.kwargs[rows] * kwargs["BLOCK_D"] <= 64 * 32 * c.num_warps]
    return kept or configs[:1]


def _tuned(kernel, configs: list[tuple[int, int, int, int]], rows: str, keys: tuple[str, ...]):
    """`kernel` autotuned over (BLOCK_M, BLOCK_N, warps, stages); one pick per shape and constexpr variant
    (`keys`: the kernel's variant constexprs, besides N, D, CAUSAL and IEEE)."""
    return triton.autotune(
        [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st) for m, n, w, st in configs],
        key=["N", "D", "CAUSAL", "IEEE", *keys], do_bench=_tuner_bench,
        prune_configs_by={"early_config_prune": functools.partial(_spill_free, rows=rows)},
    )(kernel)


# A few configs each (Hopper choices as in Triton's fused-attention tutorial; stages barely matter here): a
# new (head_dim, causal, variant) compiles each once (~1 s), a new N re-times them (~0.1 s). The forward's
# key tile stays FWD_BLOCK_N; the Fix's constexprs and the rounding codes are in the key, so Fix on and off
# and each precision get their own picks.
_fwd_tuned = _tuned(
    _fwd, [(128, FWD_BLOCK_N, 8, 3), (128, FWD_BLOCK_N, 4, 3), (64, FWD_BLOCK_N, 4, 3)], "BLOCK_M",
    keys=("FIX", "WITH_STATS", "P_FP32", "NATIVE_P", "CODES"),
)
_dkdv_tuned = _tuned(_dkdv, [(64, 128, 8, 3), (32, 128, 8, 3), (64, 64, 4, 2), (32, 128, 4, 3)], "BLOCK_N",
                     keys=("C_SCORES",))
_dq_tuned = _tuned(_dq, [(128, 64, 8, 3), (64, 128, 8, 3), (64, 64, 4, 3), (128, 64, 4, 2)], "BLOCK_M",
                   keys=("C_SCORES",))


def autotuned_configs() -> dict[str, str]:
    """The autotuner's picks for the latest forward, dK/dV and dQ launches (for benchmark records)."""
    tuned = {"fwd": _fwd_tuned, "dkdv": _dkdv_tuned, "dq": _dq_tuned}
    return {name: str(t.best_config) for name, t in tuned.items() if getattr(t, "best_config", None)}


# ------------------------------------------------------------------------------------------------- launch


@dataclass
class _Run:
    """Resolved options of one call (shared by forward and backward)."""

    causal: bool
    scale: float
    codes: dict[str, int]  # rounding codes by point, in POINTS order (the forward's CODES: their values)
    p_fp32: bool  # P̄V dot in fp32 (P̄'s format does not fit in the input dtype)
    native_p: bool  # the weights rounding is exactly the cast to the input dtype
    fix: FixParams | None
    tol: float  # the Fix's tol, or the default Fix's: the counters' near-tie window
    blocks: tuple[int, int] | None  # (BLOCK_M, BLOCK_N) fixed, or None = autotune
    seed: int
    with_stats: bool
    stats: AttentionStats | None = None


GRID_YZ = 65535  # CUDA's limit on a grid's y and z extents


def _fold(bh: int) -> tuple[int, int]:
    """(y, z) grid extents holding `bh` = batch x heads programs, y <= z's limit; the kernels skip
    bh >= B*H (at most one partial row of programs)."""
    y = min(bh, GRID_YZ)
    z = triton.cdiv(bh, y)
    if z > GRID_YZ:
        raise ValueError(f"batch x heads = {bh} exceeds the {GRID_YZ**2:,} programs a grid can address")
    return y, z


def _launch(kernel, tuned, run: _Run, n: int, bh: int, rows: str, *args, **constexprs) -> None:
    """Launch with fixed blocks or the autotuned variant over the grid (`rows`-sized blocks, B*H folded over
    y and z): the blocks of one head run side by side (its K and V stay in L2), and any batch x heads fits."""
    grid = lambda meta: (triton.cdiv(n, meta[rows]), *_fold(bh))
    if run.blocks is None:
        tuned[grid](*args, **constexprs)
    else:
        kernel[grid](*args, **constexprs, BLOCK_M=run.blocks[0], BLOCK_N=run.blocks[1])


def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def _fix_args(run: _Run) -> tuple[float, float, float, float]:
    """The kernel's `fix` tuple (beta, tol, min_gap, max_gap); placeholders besides tol without a Fix."""
    fp = run.fix
    return (fp.beta, run.tol, fp.min_gap, fp.max_gap) if fp is not None else (2.0, run.tol, 0.0, 1.0)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, run: _Run):
    B, H, N, D = q.shape
    o = torch.empty_like(q)
    lse = torch.empty((B, H, N), device=q.device, dtype=torch.float32)
    stats = lse  # a placeholder pointer when no counters are asked for
    if run.with_stats:
        stats = torch.zeros((len(STAT_NAMES), B, H, N), device=q.device, dtype=torch.int32)
    fp = run.fix
    _launch(_fwd, _fwd_tuned, run, N, B * H, "BLOCK_M", q, k, v, o, lse, stats, N, B * H, run.scale,
            _fix_args(run),
            run.seed, D=D, BLOCK_D=_block_d(D), CAUSAL=run.causal,
            FIX=0 if fp is None else 2 if fp.whole_row else 1, WITH_STATS=run.with_stats, P_FP32=run.p_fp32,
            NATIVE_P=run.native_p, IEEE=q.dtype == torch.float32, CODES=tuple(run.codes.values()))
    run.stats = AttentionStats(*stats.unbind(0)) if run.with_stats else None
    return o, lse


def flash_delta(o: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """delta = rowsum(dO * O) (fp32, (batch, heads, seq)) by the backward's preprocessing kernel."""
    B, H, N, D = o.shape
    delta = torch.empty((B, H, N), device=o.device, dtype=torch.float32)
    _delta[(triton.cdiv(N, 64), *_fold(B * H))](o.contiguous(), do.contiguous(), delta, N, B * H, D=D,
                                                 BLOCK_D=_block_d(D), BLOCK_M=64)
    return delta


def _backward(q, k, v, o, lse, do, run: _Run):
    B, H, N, D = q.shape
    do = do.contiguous()
    delta = flash_delta(o, do)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    common = dict(D=D, BLOCK_D=_block_d(D), CAUSAL=run.causal, IEEE=q.dtype == torch.float32,
                  C_SCORES=run.codes["scores"])
    _launch(_dkdv, _dkdv_tuned, run, N, B * H, "BLOCK_N", q, k, v, do, lse, delta, dk, dv, N, B * H,
            run.scale, **common)
    _launch(_dq, _dq_tuned, run, N, B * H, "BLOCK_M", q, k, v, do, lse, delta, dq, N, B * H, run.scale,
            **common)
    return dq, dk, dv


class _Flash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, run: _Run):
        o, lse = _forward(q, k, v, run)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.run = run
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        return (*_backward(q, k, v, o, lse, do, ctx.run), None)


# torch.compile must not trace into the kernels: Inductor re-compiles user Triton kernels with its own
# specialisations, which this kernel's constexpr branches do not survive (seen on an H200, torch 2.11). The
# call becomes a graph break; the kernels themselves are already fused.
@torch.compiler.disable
def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    fix: Fix | float | bool | str | None = None, precision: Precision | str = "fa2",
                    seed: int | None = None, block_m: int | None = None, block_n: int | None = None,
                    return_stats: bool = False, return_lse: bool = False):
    """FlashAttention-2 (Triton) with `precision`'s rounding points and an optional `fix`; autograd backward.

    q, k, v: (batch, heads, seq, head_dim) bf16/fp16/fp32 on a CUDA device, or on CPU under
    TRITON_INTERPRET=1; head_dim 16..128. precision: a Precision or short string (the output point must fit
    in q's dtype; scores round to nearest). fix: a Fix (or True, or a beta). seed: stochastic-rounding seed
    (default: drawn from torch's generator). block_m/block_n: fixed tile sizes (powers of two >= 16, <= 128
    on a GPU; default: Precision.tile, else 64 under the interpreter, else autotuned). Returns o; with
    return_lse also lse (fp32); with return_stats also the forward's AttentionStats, in that order.
    """
    check_qkv(q, k, v, head_dims=HEAD_DIMS, dtypes=DTYPES)
    if not q.is_cuda and not INTERPRET:
        raise ValueError("flash_attention needs CUDA tensors, or TRITON_INTERPRET=1 set before lowprec is "
                         "imported to run the kernels on CPU (e.g. TRITON_INTERPRET=1 python ...)")
    plan = plan_call(q, causal, precision, fix, block_m, block_n)
    prec, dtype = plan.precision, q.dtype
    if not fits(prec.output.resolve(dtype), dtype):
        raise ValueError(f"precision.output ({prec.output}) must fit in q's dtype {dtype} for the triton "
                         "backend (it stores O in q's dtype); use backend='emulated' for wider outputs")
    blocks = (plan.block_m, plan.block_n) if (plan.tiles_given or INTERPRET) else None
    for size in blocks or ():
        if size < 16 or size & (size - 1) or (q.is_cuda and size > 128):
            raise ValueError(f"block_m, block_n and precision.tile must be powers of two >= 16 (<= 128 on a "
                             f"GPU), got {blocks}; e.g. precision='paper:tile=64', or backend='emulated'")
    if seed is None:
        seed = int(torch.randint(0, 2**31 - 1, (1,))) if prec.stochastic() else 0
    codes = _codes(prec, dtype)
    p_fp32 = plan.pv_dtype == torch.float32 and dtype != torch.float32
    native_p = not p_fp32 and codes["weights"] == {torch.bfloat16: CAST_BF16, torch.float16: CAST_FP16,
                                                   torch.float32: NONE}[dtype]
    run = _Run(causal, plan.scale, codes, p_fp32, native_p, plan.fix, plan.tol, blocks, int(seed),
               return_stats)
    o, lse = _Flash.apply(q.contiguous(), k.contiguous(), v.contiguous(), run)
    extra = ([lse] if return_lse else []) + ([run.stats] if return_stats else [])
    return (o, *extra) if extra else o


# ---------------------------------------------------------------------------------- ahead-of-time compile


def compile_for_gpu(arch: int = 90, head_dim: int = 128) -> dict[str, int]:
    """Compile the kernels for CUDA sm_<arch> without a GPU (ptxas ships with triton): the bf16 fa2 forward,
    the forward with the Fix and counters, the fp32 forward, dK/dV and dQ, at their first autotune configs.
    Returns each kernel's shared memory in bytes. Needs compiled (not interpreted) kernels: import this module
    with TRITON_INTERPRET=0 (tests/test_flash_kernel.py runs it in a subprocess)."""
    if INTERPRET:
        raise ValueError("compile_for_gpu needs TRITON_INTERPRET=0 when lowprec is imported")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    pointers = {"Q", "K", "V", "O", "DO", "DK", "DV", "DQ"}
    scalars = {"N": "i32", "BH": "i32", "seed": "i32", "LSE": "*fp32", "DELTA": "*fp32", "STATS": "*i32",
               "fix": ("fp32",) * 4}
    base = dict(D=head_dim, BLOCK_D=_block_d(head_dim), CAUSAL=True, IEEE=False)
    fa2 = Precision.fa2()
    fwd = dict(base, FIX=0, WITH_STATS=False, P_FP32=False, NATIVE_P=True,
               CODES=tuple(_codes(fa2, torch.bfloat16).values()))
    builds = {  # name: (kernel, constexprs, input dtype)
        "forward": (_fwd_tuned, fwd, "bf16"),
        "forward+fix": (_fwd_tuned, dict(fwd, FIX=1, WITH_STATS=True), "bf16"),
        "forward fp32": (_fwd_tuned, dict(fwd, IEEE=True, CODES=tuple(_codes(fa2, torch.float32).values())),
                         "fp32"),
        "dkdv": (_dkdv_tuned, dict(base, C_SCORES=NONE), "bf16"),
        "dq": (_dq_tuned, dict(base, C_SCORES=NONE), "bf16"),
    }
    shared = {}
    for name, (tuned, constexprs, dtype) in builds.items():
        config = tuned.configs[0]
        constexprs = dict(constexprs, **config.kwargs)
        signature = {arg: "constexpr" if arg in constexprs else f"*{dtype}" if arg in pointers
                     else scalars.get(arg, "fp32") for arg in tuned.fn.arg_names}
        kernel = triton.compile(ASTSource(tuned.fn, signature, constexprs), target=target,
                                options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
        shared[name] = kernel.metadata.shared
    return shared

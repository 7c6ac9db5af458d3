"""`flash_attention`: FlashAttention-2 in Triton with lowprec's rounding points and Fix, forward and backward.

This module launches the kernels of triton_kernels.py (autotune, autograd, the public `flash_attention` and
`flash_delta`) and compiles them ahead of time for a GPU (`compile_for_gpu`). It imports triton_mode.py first,
which switches on Triton's interpreter where there is no CUDA; there the kernels are bit-identical to
emulated_attention. q is (B, H, Nq, D), k and v (B, H_kv, Nk, D) with H a multiple of H_kv and D from 16 to
256, any strides with a contiguous head dim; under torch.compile the kernels are two custom ops
(torch.ops.lowprec.flash_forward, flash_backward). On a GPU the tiles are autotuned, or under
torch.use_deterministic_algorithms(True) taken from PINNED. Launch, autotune and what differs on a GPU: the
book's appendix "Methods and record formats".
"""

from __future__ import annotations

from lowprec.attention.triton_mode import INTERPRET  # first: it may switch on the interpreter

# isort: split
import contextlib
import functools
import hashlib
import json
import marshal
import os
import re
import subprocess
import tempfile
from pathlib import Path

import torch
import triton
from torch.autograd import forward_ad
from triton.runtime import _allocation
from triton.runtime.errors import OutOfResources

from lowprec.attention.fix import STAT_NAMES, AttentionStats, Fix
from lowprec.attention.plan import plan_call
from lowprec.attention.precision import POINTS, Precision, fits
from lowprec.attention.reference import autocast_qkv, check_qkv, constant_result
from lowprec.attention.triton_kernels import _delta, _dkdv, _dq, _fwd
from lowprec.attention.triton_rounding import CAST_BF16, CAST_FP16, NONE, _codes

HEAD_DIMS = (16, 256)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FWD_BLOCK_N = 64  # on a GPU the forward's key tile is fixed: per-tile tie detection depends on it
SHARED_MEMORY_LIMIT = 232_448  # bytes of shared memory one block may use on sm_90 (227 KiB)
FIXED_BLOCKS = (64, 64)  # the caller-chosen blocks compile_for_gpu checks (the GPU suite's)

__all__ = ["INTERPRET", "PINNED", "autotuned_configs", "compile_for_gpu", "flash_attention", "flash_delta",
           "launched_tiles"]

# ----------------------------------------------------------------------------------------------- autotune


def _tuner_bench(fn, quantiles):
    """The autotuner's timer: short runs (triton's default, 25 + 100 ms per config, dominated benchmarks)."""
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


# (BLOCK_M, BLOCK_N, warps, stages) -> the BLOCK_D (padded head dims) it is tried for: head dim 256 needs
# smaller tiles (fp32 accumulators of rows x 256 and two-stage K/V buffers of 256 columns; the LARGE configs
# compile without spills for sm_90, see compile_for_gpu), the smaller head dims the larger tiles of Triton's
# fused-attention tutorial. (fp32 inputs: configs beyond the shared memory fail to launch and the autotuner
# skips them.)
SMALL, LARGE = (16, 32, 64, 128), (256,)
_CONFIGS_FOR = {
    "fwd": {(128, FWD_BLOCK_N, 8, 3): SMALL, (128, FWD_BLOCK_N, 4, 3): SMALL, (64, FWD_BLOCK_N, 4, 3): SMALL,
            (64, FWD_BLOCK_N, 8, 2): LARGE, (32, FWD_BLOCK_N, 4, 2): LARGE},
    "dkdv": {(64, 128, 8, 3): SMALL, (32, 128, 8, 3): SMALL, (64, 64, 4, 2): SMALL, (32, 128, 4, 3): SMALL,
             (64, 32, 8, 2): LARGE, (32, 32, 8, 2): LARGE},
    "dq": {(128, 64, 8, 3): SMALL, (64, 128, 8, 3): SMALL, (64, 64, 4, 3): SMALL, (128, 64, 4, 2): SMALL,
           (64, 32, 8, 2): LARGE, (32, 64, 8, 2): LARGE},
}


def _config_key(config: triton.Config) -> tuple[int, int, int, int]:
    return config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages


def _kept_configs(configs, nargs, kernel: str, rows: str, **kwargs):
    """The configs tried for this launch: those meant for its BLOCK_D whose fp32 accumulators (`rows` x
    BLOCK_D each) take <= 64 registers per thread (larger ones spill on sm_90, as ptxas reports for
    compile_for_gpu's builds)."""
    block_d = kwargs["BLOCK_D"]
    meant = [c for c in configs if block_d in _CONFIGS_FOR[kernel][_config_key(c)]] or configs
    kept = [c for c in meant if c.kwargs[rows] * block_d <= 64 * 32 * c.num_warps]
    return kept or meant[:1]


def _tuned(kernel, name: str, rows: str, keys: tuple[str, ...]):
    """`kernel` autotuned over _CONFIGS_FOR[name]; one pick per shape and constexpr variant (`keys`: the
    kernel's variant constexprs, besides N_Q, N_K, D, CAUSAL and IEEE)."""
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
               for m, n, w, st in _CONFIGS_FOR[name]]
    return triton.autotune(
        configs, key=["N_Q", "N_K", "D", "CAUSAL", "IEEE", *keys], do_bench=_tuner_bench,
        prune_configs_by={"early_config_prune": functools.partial(_kept_configs, kernel=name, rows=rows)},
    )(kernel)


# A new (head_dim, causal, variant) compiles each config once (~1 s), a new N re-times them (~0.1 s). The
# forward's key tile stays FWD_BLOCK_N; the Fix's constexprs and the rounding codes are in the key, so Fix on
# and off and each precision get their own picks.
_fwd_tuned = _tuned(_fwd, "fwd", "BLOCK_M",
                    keys=("FIX", "WITH_STATS", "P_FP32", "NATIVE_P", "NORM", "CODES", "TMA"))
_dkdv_tuned = _tuned(_dkdv, "dkdv", "BLOCK_N", keys=("GROUP", "C_SCORES", "TMA"))
_dq_tuned = _tuned(_dq, "dq", "BLOCK_M", keys=("C_SCORES", "TMA"))


_KERNELS = {"fwd": (_fwd, _fwd_tuned), "dkdv": (_dkdv, _dkdv_tuned), "dq": (_dq, _dq_tuned)}

# (BLOCK_M, BLOCK_N, warps, stages) per kernel and BLOCK_D (16-64: the 64 row) in a deterministic run
# (torch.use_deterministic_algorithms(True)): the tiles set the order of the backward's sums, so they must not
# follow the autotuner's timings. These are its picks for causal attention on an H200 (bench.json at 208ab74).
PINNED = {"fwd": {64: (64, FWD_BLOCK_N, 4, 3), 128: (64, FWD_BLOCK_N, 4, 3), 256: (64, FWD_BLOCK_N, 8, 2)},
          "dkdv": {64: (32, 128, 4, 3), 128: (64, 128, 8, 3), 256: (64, 32, 8, 2)},
          "dq": {64: (64, 64, 4, 3), 128: (128, 64, 8, 3), 256: (64, 32, 8, 2)}}
_pinned_launched: dict[str, str] = {}


def autotuned_configs() -> dict[str, dict[str, str]]:
    """The autotuner's picks so far, per kernel ("fwd", "dkdv", "dq"): tuning key -> config (for benchmark
    records)."""
    return {name: {str(key): str(t.cache[key]) for key in t.cache} for name, (_, t) in _KERNELS.items()}


def launched_tiles() -> dict[str, str]:
    """Every kernel configuration launched so far: "<kernel> d<BLOCK_D>" -> "MxNxwarpsxstages" for the pinned
    ones, "<kernel> <tuning key>" -> the config for the autotuned ones (for run records)."""
    tuned = {f"{name} {key}": config for name, picks in autotuned_configs().items()
             for key, config in picks.items()}
    return {**_pinned_launched, **tuned}


# ------------------------------------------------------------------------------------------------- launch


GRID_YZ = 65535  # CUDA's limit on a grid's y and z extents
INT32_MAX = 2**31 - 1


def _cdiv(a: int, b: int) -> int:
    """ceil(a / b) in plain Python (triton.cdiv costs a few microseconds of host time a call)."""
    return -(-a // b)


def _fold(bh: int) -> tuple[int, int]:
    """(y, z) grid extents holding `bh` = batch x heads programs, y <= z's limit; the kernels skip
    bh >= B*H (at most one partial row of programs)."""
    y = min(bh, GRID_YZ)
    z = _cdiv(bh, y)
    if z > GRID_YZ:
        raise ValueError(f"batch x heads = {bh} exceeds the {GRID_YZ**2:,} programs a grid can address")
    return y, z


def _fixed_options(block_d: int) -> dict[str, int]:
    """num_warps and num_stages for caller-chosen blocks: Triton's defaults (4, 3) up to BLOCK_D 128; at 256
    (head dims 129-256) the autotuner's LARGE settings (8, 2). With the defaults, 64 x 64 dK/dV tiles at
    BLOCK_D 256 need 263,168 bytes of shared memory, more than an H200 has (SHARED_MEMORY_LIMIT); with (8, 2)
    the three kernels need at most 197,632 (compile_for_gpu builds them)."""
    return {"num_warps": 8, "num_stages": 2} if block_d >= 256 else {"num_warps": 4, "num_stages": 3}


_picks: dict[tuple, dict] = {}  # per launch key (`_launch`): its constexprs with the autotuner's pick
DIRECT = True  # launch a pick's compiled binary directly (`direct_launch`; False: through Triton's run)
_compiled: dict[tuple, tuple] = {}  # `_direct`'s slot -> (compiled kernel, parameters after args)


@contextlib.contextmanager
def _setting(name: str, on: bool):
    """This module's switch `name` (DIRECT, TMA) set to `on` inside the block, restored after it."""
    was, globals()[name] = globals()[name], on
    try:
        yield
    finally:
        globals()[name] = was


def direct_launch(on: bool = True) -> contextlib.AbstractContextManager:
    """Inside the block, a kernel whose tiles the autotuner has picked is launched through its compiled binary
    (`_signature`; the default), skipping Triton's per-call Python in JITFunction.run (GPU only;
    bit-identical), or with `on=False` through JITFunction.run (bench overhead's A/B)."""
    return _setting("DIRECT", on)


TMA = False  # the kernels' streamed tiles through tensor descriptors (`tma_loads`; False: pointer loads)


def tma_loads(on: bool = True) -> contextlib.AbstractContextManager:
    """Inside the block, the kernels load the tiles they stream (the forward and dQ: key and value tiles;
    dK/dV: query and dO tiles) through tensor descriptors (the Hopper's TMA unit on a GPU) where the layout
    allows it (`_tma_ready`), bit-identical to their pointer loads; `on=False`: pointer loads (the
    default)."""
    return _setting("TMA", on)


def _tma_ready(*tensors: torch.Tensor) -> bool:
    """Whether a tensor descriptor can address every head of each (B, H, N, D) tensor: a contiguous head dim,
    16-byte aligned data and batch, head and row strides."""
    return all(t.stride(3) == 1 and t.data_ptr() % 16 == 0
               and all(stride * t.element_size() % 16 == 0 for stride in t.stride()[:3]) for t in tensors)


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Triton's allocator for the descriptors a kernel makes on the device (`triton.set_allocator`)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _tma(*tensors: torch.Tensor) -> bool:
    """Whether this launch streams the tiles of `tensors` through tensor descriptors: `tma_loads` is on and
    `_tma_ready` holds; on a GPU it then sets Triton's allocator, for the descriptors' device memory, in this
    thread's context where none is set (a user's allocator stays)."""
    on = TMA and _tma_ready(*tensors)
    if on and not INTERPRET and _allocation._allocator.get() is _allocation._NULL_ALLOCATOR:
        triton.set_allocator(_scratch)
    return on


def _signature(args: tuple) -> tuple:
    """What Triton specialises a launch on, or finer: per tensor (the leading arguments) its dtype and
    16-byte alignment, per int after them (inside tuples too) whether it is 1, a multiple of 16 and within
    int32; floats not at all. Launches with one signature share one compiled binary. The other arguments'
    part is kept per their exact values and types (`_classes`), so a launch like an earlier one pays for its
    tensors only."""
    n = 0
    for arg in args:
        if not isinstance(arg, torch.Tensor):
            break
        n += 1
    return (*[(t.dtype, t.data_ptr() % 16 == 0) for t in args[:n]], _classes(args[n:]))


_CLASSES: dict[bytes, tuple] = {}  # `_classes`' results by their arguments' marshal bytes (values and types)
CLASSES_KEPT = 4096


def _classes(rest: tuple) -> tuple:
    """`_signature`'s part for the arguments after the tensors (ints and floats, or tuples of them), kept by
    their marshal bytes, which tell 1 from 1.0 (at most CLASSES_KEPT kept; then they start again)."""
    try:
        key = marshal.dumps(rest, 2)  # version 2: no back-references, so equal values give equal bytes
    except ValueError:
        raise TypeError("a kernel argument holds a tensor inside a tuple or after the numbers: pass the "
                        "tensors first, each on its own") from None
    out = _CLASSES.get(key)
    if out is None:
        out = []
        for arg in rest:
            for item in arg if isinstance(arg, tuple) else (arg,):
                if isinstance(item, int):
                    out.append((item == 1, item % 16 == 0, -INT32_MAX - 1 <= item <= INT32_MAX))
                else:
                    out.append(type(item))
        if len(_CLASSES) >= CLASSES_KEPT:
            _CLASSES.clear()
        out = _CLASSES[key] = tuple(out)
    return out


def _direct(kernel: triton.JITFunction, key: tuple, grid: tuple[int, int, int], args: tuple, kwargs: dict
            ) -> None:
    """Launch `kernel` as kernel[grid](*args, **kwargs) would: the first launch of a (key, `_signature`,
    current device, Triton's debug and instrumentation settings) goes through Triton and keeps the binary it
    returns (loaded on that device) with the values of the kernel's parameters after `args` (`kwargs`, fixed
    by `key`), later ones call that binary with every parameter in order."""
    slot = (key, _signature(args), torch.cuda.current_device(),  # and the options Triton reads at each launch
            triton.knobs.runtime.debug, triton.knobs.compilation.instrumentation_mode)
    found = _compiled.get(slot)
    if found is None:
        compiled = kernel[grid](*args, **kwargs)
        names = kernel.arg_names[len(args):]
        if all(name in kwargs for name in names):  # else (a defaulted parameter) always through Triton
            _compiled[slot] = (compiled, tuple(kwargs[name] for name in names))
    else:
        compiled, rest = found
        compiled[grid](*args, *rest)


def _run(kernel: triton.JITFunction, key: tuple, grid: tuple[int, int, int], args: tuple, kwargs: dict
         ) -> None:
    """kernel[grid](*args, **kwargs), through `_direct` (under `key`) when `direct_launch` is on a GPU."""
    if DIRECT and not INTERPRET:
        _direct(kernel, key, grid, args, kwargs)
    else:
        kernel[grid](*args, **kwargs)


def _launch(name: str, blocks: tuple[int, int], n: int, bh: int, rows: str, *args, sizes: tuple[int, ...],
            **constexprs) -> None:
    """Launch kernel `name` over the grid (`rows`-sized blocks, B*H folded over y and z: the blocks of one
    head run side by side, so its K and V stay in L2, and any batch x heads fits) with the caller's blocks,
    the PINNED ones in a deterministic run, or the autotuner's pick (blocks (0, 0)): once it has picked for
    a key (`sizes`, the kernel's N_Q, N_K, H and GROUP arguments, a superset of its tuning key, with the
    tensors' dtypes and the constexprs), the kernel is launched with that pick directly, without the
    autotuner's per-call Python. An empty batch launches nothing."""
    if bh == 0:
        return
    kernel, tuned = _KERNELS[name]
    y, z = _fold(bh)
    grid = lambda meta: (_cdiv(n, meta[rows]), y, z)
    block_d = constexprs["BLOCK_D"]
    if blocks[0]:
        options = _fixed_options(block_d)
    elif torch.are_deterministic_algorithms_enabled():
        *blocks, warps, stages = PINNED[name][max(block_d, 64)]
        options = {"num_warps": warps, "num_stages": stages}
        _pinned_launched[f"{name} d{block_d}"] = "x".join(map(str, (*blocks, warps, stages)))
    else:
        # the dtypes of q and of the fourth tensor (o forward, dO backward) fix every tensor's (k and v are
        # q's, lse and delta fp32, the counters int32); one call site per kernel: its keywords in one order
        key = (name, sizes, args[0].dtype, args[3].dtype, tuple(constexprs.items()))
        kwargs = _picks.get(key)
        if kwargs is None:
            tuned[grid](*args, **constexprs)
            _picks[key] = {**constexprs, **tuned.best_config.all_kwargs()}
        else:
            _run(kernel, key, (_cdiv(n, kwargs[rows]), y, z), args, kwargs)
        return
    try:
        kernel[grid](*args, **constexprs, BLOCK_M=blocks[0], BLOCK_N=blocks[1], **options)
    except OutOfResources as exc:
        m, n_, dtype = *blocks, " in fp32" if constexprs["IEEE"] else ""
        raise ValueError(f"block_m={m}, block_n={n_} need more {exc.name} than this GPU has at head dim "
                         f"{constexprs['D']}{dtype}: pass smaller ones, or none to autotune") from None


def _block_d(d: int) -> int:
    """The head dim padded to a power of two >= 16 (the kernels' BLOCK_D)."""
    return max(16, 1 << (d - 1).bit_length())


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, head, seq) strides of a (B, H, N, D) tensor, for the kernels."""
    return t.stride()[:3]


def _addressable(t: torch.Tensor) -> torch.Tensor:
    """t itself if the kernels can read it in place (contiguous head dim, every row offset of one head
    within int32), else a contiguous copy."""
    stride = t.stride()
    rows_span = (t.shape[2] - 1) * stride[2] + t.shape[3]
    return t if stride[3] == 1 and rows_span <= INT32_MAX else t.contiguous()


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of t's shape and dtype in t's layout: (B, N, H, D) memory (seen as
    (B, H, N, D)) when t's seq stride exceeds its head stride, as in the model's transposed views; else
    contiguous."""
    B, H, N, D = t.shape
    stride = t.stride()
    if H > 1 and N > 1 and stride[2] > stride[1]:
        return t.new_empty_strided((B, H, N, D), (N * H * D, D, H * D, 1))  # one call, not a view's two
    return t.new_empty((B, H, N, D))


def _flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seed: int, with_stats: bool,
                   causal: bool, scale: float, codes: list[int], norm: int, p_fp32: bool, native_p: bool,
                   fix_mode: int, fix: list[float], block_m: int, block_n: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o, lse, stats): the forward kernel, its options the plain constants of `_kernel_options`. seed < 0:
    drawn from torch's generator; stats: the counters (len(STAT_NAMES), B, H, Nq) int32 when with_stats, else
    an empty tensor."""
    B, H, N, D = q.shape
    if seed < 0:
        seed = int(torch.randint(0, INT32_MAX, (1,)))
    q, k, v = (_addressable(t) for t in (q, k, v))
    o = _empty_like(q)
    lse = torch.empty((B, H, N), device=q.device, dtype=torch.float32)
    stats = (torch.zeros((len(STAT_NAMES), B, H, N), device=q.device, dtype=torch.int32) if with_stats
             else lse.new_empty((0,), dtype=torch.int32))
    sizes = (N, k.shape[2], H, H // k.shape[1])
    tma = _tma(k, v)
    _launch("fwd", (block_m, block_n), N, B * H, "BLOCK_M", q, k, v, o, lse, stats if with_stats else lse,
            *map(_strides, (q, k, v, o)), *sizes, B * H, scale, tuple(fix), seed, sizes=sizes, D=D,
            BLOCK_D=_block_d(D), CAUSAL=causal, FIX=fix_mode, WITH_STATS=with_stats, P_FP32=p_fp32,
            NATIVE_P=native_p, NORM=norm, IEEE=q.dtype == torch.float32, CODES=tuple(codes), TMA=tma)
    return o, lse, stats


_forward_op = torch.library.custom_op("lowprec::flash_forward", _flash_forward, mutates_args=())


@_forward_op.register_fake
def _forward_fake(q, k, v, seed, with_stats, *options):
    B, H, N, _ = q.shape
    shape = (len(STAT_NAMES), B, H, N) if with_stats else (0,)
    return _empty_like(q), q.new_empty((B, H, N), dtype=torch.float32), q.new_empty(shape, dtype=torch.int32)


def flash_delta(o: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """delta = rowsum(dO * O) (fp32, (batch, heads, seq)) by the backward's preprocessing kernel."""
    B, H, N, D = o.shape
    o, do = _addressable(o), _addressable(do)
    delta = torch.empty((B, H, N), device=o.device, dtype=torch.float32)
    if B * H == 0:
        return delta
    _run(_delta, ("delta", o.dtype, do.dtype, D), (_cdiv(N, 64), *_fold(B * H)),
         (o, do, delta, _strides(o), _strides(do), N, H, B * H),
         {"D": D, "BLOCK_D": _block_d(D), "BLOCK_M": 64})
    return delta


def _flash_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                    do: torch.Tensor, causal: bool, scale: float, c_scores: int, block_m: int, block_n: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv): the backward kernels (delta, dK/dV per key/value head, dQ); c_scores: the scores'
    rounding code, the rest as in _flash_forward."""
    B, H, N, D = q.shape
    H_kv, n_k = k.shape[1], k.shape[2]
    q, k, v, do = (_addressable(t) for t in (q, k, v, do))
    delta = flash_delta(o, do)
    dq, dk, dv = _empty_like(q), _empty_like(k), _empty_like(v)
    common = dict(D=D, BLOCK_D=_block_d(D), CAUSAL=causal, IEEE=q.dtype == torch.float32, C_SCORES=c_scores,
                  TMA=_tma(q, k, v, do))
    sizes, blocks = (N, n_k, H, H // H_kv), (block_m, block_n)
    _launch("dkdv", blocks, n_k, B * H_kv, "BLOCK_N", q, k, v, do, lse, delta, dk, dv,
            *map(_strides, (q, k, v, do, dk, dv)), *sizes, B * H_kv, scale, sizes=sizes, GROUPED=H_kv < H,
            **common)
    _launch("dq", blocks, N, B * H, "BLOCK_M", q, k, v, do, lse, delta, dq,
            *map(_strides, (q, k, v, do, dq)), *sizes, B * H, scale, sizes=sizes, **common)
    return dq, dk, dv


_backward_op = torch.library.custom_op("lowprec::flash_backward", _flash_backward, mutates_args=())


@_backward_op.register_fake
def _backward_fake(q, k, v, o, lse, do, *options):
    return _empty_like(q), _empty_like(k), _empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, _seed, _with_stats, causal, scale, codes, *_, block_m, block_n = inputs
    o, lse, stats = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.options = (causal, scale, codes[POINTS.index("scores")], block_m, block_n)
    ctx.mark_non_differentiable(lse, stats)


def _backward_formula(ctx, do, _dlse, _dstats, backward=None):
    """(dq, dk, dv, None for each option) by the backward custom op, or by `backward` (the eager path's
    function)."""
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = (backward or torch.ops.lowprec.flash_backward)(q, k, v, o, lse, do, *ctx.options)
    return dq, dk, dv, *(None,) * 12


_forward_op.register_autograd(_backward_formula, setup_context=_setup_context)


class _EagerFlash(torch.autograd.Function):
    """The custom ops' forward and backward for eager calls, without their dispatch: torch.library's
    autograd wrapper costs ~0.2 ms of host time per call, longer than a short kernel. The plain options come
    as one tuple (autograd inspects every argument of `apply`, a few microseconds for the ten of them)."""

    @staticmethod
    def forward(ctx, q, k, v, seed, with_stats, options):
        ctx.set_materialize_grads(False)  # lse's and the counters' gradients stay None, not zeros
        inputs = (q, k, v, seed, with_stats, *options)
        output = _flash_forward(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, do, dlse, dstats):
        dq, dk, dv, *_ = _backward_formula(ctx, do, dlse, dstats, _flash_backward)
        return dq, dk, dv, None, None, None


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seed: int, with_stats: bool, options: tuple
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o, lse, stats) of `_flash_forward`: through its custom op under torch.compile, through `_EagerFlash`
    where autograd records the call (or forward-mode AD is on, which it refuses), else (no gradient wanted:
    torch.no_grad, inference, inputs without requires_grad) the kernel alone, without autograd's per-call
    cost."""
    if torch.compiler.is_compiling():
        return torch.ops.lowprec.flash_forward(q, k, v, seed, with_stats, *options)
    if (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
            or forward_ad._current_level >= 0):
        return _EagerFlash.apply(q, k, v, seed, with_stats, options)
    return _flash_forward(q, k, v, seed, with_stats, *options)


@constant_result
def _kernel_options(dtype: torch.dtype, head_dim: int, on_gpu: bool, causal: bool, scale: float | None,
                    fix: Fix | float | bool | str | None, precision: Precision | str, block_m: int | None,
                    block_n: int | None) -> tuple:
    """The plan of a call (plan_call) as the forward op's plain constants, after the seed and stats arguments:
    (causal, scale, codes, norm, p_fp32, native_p, fix_mode, fix, block_m, block_n), and whether it rounds
    stochastically. torch.compile runs this once while tracing and keeps its result as constants, so that
    Dynamo never traces the Precision and Fix objects; eager calls find it in a cache, so that a training
    step resolves each distinct call once."""
    args = (dtype, head_dim, on_gpu, causal, scale, fix, precision, block_m, block_n)
    try:
        return _lower(*args)
    except TypeError:  # an unhashable option: lowered uncached, plan_call's ValueError names it
        return _lower.__wrapped__(*args)


@functools.lru_cache(maxsize=256, typed=True)
def _lower(dtype: torch.dtype, head_dim: int, on_gpu: bool, causal: bool, scale: float | None,
           fix: Fix | float | bool | str | None, precision: Precision | str, block_m: int | None,
           block_n: int | None) -> tuple:
    plan = plan_call(dtype, head_dim, causal, precision, fix, block_m, block_n, scale)
    prec = plan.precision
    if not fits(prec.output.resolve(dtype), dtype):
        raise ValueError(f"precision.output ({prec.output}) must fit in q's dtype {dtype} for the triton "
                         "backend (it stores O in q's dtype); use backend='emulated' for wider outputs")
    blocks = (plan.block_m, plan.block_n) if (plan.tiles_given or INTERPRET) else (0, 0)
    for size in blocks if blocks[0] else ():
        if size < 16 or size & (size - 1) or (on_gpu and size > 128):
            raise ValueError(f"block_m, block_n and precision.tile must be powers of two >= 16 (<= 128 on a "
                             f"GPU), got {blocks}; e.g. precision='paper:tile=64', or backend='emulated'")
    codes = tuple(_codes(prec, dtype).values())
    p_fp32 = plan.pv_dtype == torch.float32 and dtype != torch.float32
    native = {torch.bfloat16: CAST_BF16, torch.float16: CAST_FP16, torch.float32: NONE}[dtype]
    native_p = not p_fp32 and codes[POINTS.index("weights")] == native
    fp = plan.fix
    fix_mode = 0 if fp is None else 2 if fp.whole_row else 1
    fix_args = (fp.beta, plan.tol, fp.min_gap, fp.max_gap) if fp is not None else (2.0, plan.tol, 0.0, 1.0)
    options = (causal, plan.scale, codes, int(prec.norm == "rounded"), p_fp32, native_p, fix_mode, fix_args,
               *blocks)
    return options, prec.stochastic()


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    scale: float | None = None, fix: Fix | float | bool | str | None = None,
                    precision: Precision | str = "fa2", seed: int | None = None, block_m: int | None = None,
                    block_n: int | None = None, return_stats: bool = False, return_lse: bool = False):
    """FlashAttention-2 (Triton) with `precision`'s rounding points and an optional `fix`; autograd backward;
    torch.compile traces it without a graph break (module docstring).

    q: (B, H, Nq, D), k, v: (B, H_kv, Nk, D), H a multiple of H_kv; bf16/fp16/fp32 on a CUDA device, or on
    CPU under TRITON_INTERPRET=1; D 16..256; any strides with a contiguous head dim. causal: bottom-right
    aligned (query i sees keys j <= i + Nk - Nq; a row that sees none gets o = 0). scale: softmax scale
    (default 1/sqrt(D); rounded to fp32). precision: a Precision or short string (the output point must fit
    in q's dtype; scores round to nearest). fix: a Fix (or True, or a beta). seed: stochastic-rounding seed
    (default: drawn from torch's generator). block_m/block_n: fixed tile sizes (powers of two >= 16, <= 128
    on a GPU; default: Precision.tile, else 64 under the interpreter, else autotuned). Returns o (laid out
    like q); with return_lse also lse (fp32, (B, H, Nq)); with return_stats also the forward's
    AttentionStats, in that order. Under autocast q, k and v are first cast to its dtype, as torch's SDPA
    casts them.
    """
    q, k, v = autocast_qkv(q, k, v)
    check_qkv(q, k, v, head_dims=HEAD_DIMS, dtypes=DTYPES)
    if not q.is_cuda and not INTERPRET:
        raise ValueError("flash_attention needs CUDA tensors, or TRITON_INTERPRET=1 set before lowprec is "
                         "imported to run the kernels on CPU (e.g. TRITON_INTERPRET=1 python ...)")
    if seed is not None and not (type(seed) is int and 0 <= seed <= INT32_MAX):
        raise ValueError(f"seed must be None or an int in [0, 2**31), got {seed!r}")
    options, stochastic = _kernel_options(q.dtype, q.shape[-1], q.is_cuda, causal, scale, fix, precision,
                                          block_m, block_n)
    seed = (-1 if stochastic else 0) if seed is None else seed
    o, lse, stats = _forward(q, k, v, seed, return_stats, options)
    extra = ([lse] if return_lse else []) + ([AttentionStats(*stats.unbind(0))] if return_stats else [])
    return (o, *extra) if extra else o


# ---------------------------------------------------------------------------------- ahead-of-time compile


def _sass_ops(compiled) -> dict[str, int]:
    """Instructions per opcode (FADD, FSET.BF.GE.AND, ...) in the SASS listing of a build's cubin
    (`compiled.asm["sass"]`, lines "<control>\t[@predicate] OPCODE operands"); kept beside Triton's own
    compile cache (keyed by the cubin and the disassembler, cuobjdump: about 0.7 s a build), as
    `_ptxas_usage` keeps its numbers."""
    from triton import knobs
    from triton.runtime.cache import get_cache_manager

    cubin = compiled.asm["cubin"]
    key = hashlib.sha256(f"{knobs.nvidia.cuobjdump.path} sass ops\n".encode() + cubin).hexdigest()
    cache = get_cache_manager(key)
    if (cached := cache.get_file("sass.json")) is not None:
        return json.loads(Path(cached).read_text())
    ops: dict[str, int] = {}
    for line in compiled.asm["sass"].splitlines():
        words = line.split("\t")[1].split() if line.count("\t") else []
        if words:
            op = (words[1] if words[0].startswith("@") else words[0]).rstrip(";")
            ops[op] = ops.get(op, 0) + 1
    cache.put(json.dumps(ops), "sass.json", binary=False)
    return ops


def _ptxas_usage(ptx: str, arch: int) -> dict[str, int]:
    """Registers per thread and spill bytes (stores + loads) that ptxas reports for `ptx`; kept beside
    Triton's own compile cache (keyed by the PTX and ptxas), as triton.compile keeps its builds."""
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.runtime.cache import get_cache_manager

    ptxas = get_ptxas(arch).path
    key = hashlib.sha256(f"{ptxas} sm_{arch}a\n{ptx}".encode()).hexdigest()
    cache = get_cache_manager(key)
    if (cached := cache.get_file("usage.json")) is not None:
        return json.loads(Path(cached).read_text())
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        log = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}a", src, "-o",
                              os.path.join(tmp, "kernel.cubin")], capture_output=True, text=True, check=True)
    text = log.stdout + log.stderr
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", text))
    usage = {"registers": int(re.search(r"Used (\d+) registers", text)[1]), "spills": spills}
    cache.put(json.dumps(usage), "usage.json", binary=False)
    return usage


def compile_for_gpu(arch: int = 90, head_dims: tuple[int, ...] = (64, 128, 256),
                    every_config: bool = True, variants: bool = True) -> dict[str, dict[str, int]]:
    """Compile the kernels for CUDA sm_<arch> without a GPU (ptxas ships with triton), for each head dim:
    the bf16 fa2 forward, dK/dV and dQ at every autotune config kept for that head dim (every_config; else
    the first), the same three at FIXED_BLOCKS with _fixed_options (what a call with block sizes launches),
    and (with `variants`) the variants at the first kept config: dK/dV for grouped-query attention
    (GROUPED), the forward with the Fix (and with its counters), with rounded-weight normalisation (NORM) and
    in fp32 (sizes, group size included, are runtime arguments), and the three with their streamed tiles
    through tensor descriptors (TMA; at every kept config, the forward with the Fix too). Pointers and
    strides are taken 16-aligned, as the runtime specialises them. Returns, per build "<kernel> d<D>
    <BLOCK_M>x<BLOCK_N>x<warps>x<stages>", its shared memory in bytes, registers per thread, spill bytes, its
    count of ex2.approx instructions in the PTX (all, and the flushing ex2.approx.ftz.f32) and of SASS
    instructions (`sass`, nvdisasm's listing; `sass_ops`, per opcode). Needs compiled (not interpreted)
    kernels: import this module with TRITON_INTERPRET=0 (tests/test_flash_kernel.py runs it in a
    subprocess)."""
    if INTERPRET:
        raise ValueError("compile_for_gpu needs TRITON_INTERPRET=0 when lowprec is imported")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    pointers = {"Q", "K", "V", "O", "DO", "DK", "DV", "DQ", "LSE", "DELTA", "STATS"}
    strides = ("sq", "sk", "sv", "so", "sdo", "sdk", "sdv", "sdq")
    scalars = {"N_Q": "i32", "N_K": "i32", "H": "i32", "GROUP": "i32", "BH": "i32", "seed": "i32",
               "LSE": "*fp32", "DELTA": "*fp32", "STATS": "*i32", "fix": ("fp32",) * 4}
    scalars |= {name: ("i32",) * 3 for name in strides}
    fa2 = Precision.fa2()
    usage = {}
    for head_dim in head_dims:
        base = dict(D=head_dim, BLOCK_D=_block_d(head_dim), CAUSAL=True, IEEE=False)
        fwd = dict(base, FIX=0, WITH_STATS=False, P_FP32=False, NATIVE_P=True, NORM=0,
                   CODES=tuple(_codes(fa2, torch.bfloat16).values()), TMA=False)
        backward = dict(base, C_SCORES=NONE, TMA=False)
        fixed = [triton.Config(dict(zip(("BLOCK_M", "BLOCK_N"), FIXED_BLOCKS, strict=True)),
                               **_fixed_options(_block_d(head_dim)))]
        builds = [  # (name, kernel, rows, constexprs, input dtype, True: every kept config, False: the first,
            # or the configs to build)
            ("forward", _fwd_tuned, "BLOCK_M", fwd, "bf16", every_config),
            ("dkdv", _dkdv_tuned, "BLOCK_N", dict(backward, GROUPED=False), "bf16", every_config),
            ("dq", _dq_tuned, "BLOCK_M", backward, "bf16", every_config),
            ("forward fixed", _fwd_tuned, "BLOCK_M", fwd, "bf16", fixed),
            ("dkdv fixed", _dkdv_tuned, "BLOCK_N", dict(backward, GROUPED=False), "bf16", fixed),
            ("dq fixed", _dq_tuned, "BLOCK_M", backward, "bf16", fixed),
            ("dkdv grouped", _dkdv_tuned, "BLOCK_N", dict(backward, GROUPED=True), "bf16", False),
            ("forward+fix", _fwd_tuned, "BLOCK_M", dict(fwd, FIX=1), "bf16", False),
            ("forward+fix+stats", _fwd_tuned, "BLOCK_M", dict(fwd, FIX=1, WITH_STATS=True), "bf16", False),
            ("forward consistent", _fwd_tuned, "BLOCK_M", dict(fwd, NORM=1), "bf16", False),
            ("forward tma", _fwd_tuned, "BLOCK_M", dict(fwd, TMA=True), "bf16", every_config),
            ("forward+fix tma", _fwd_tuned, "BLOCK_M", dict(fwd, FIX=1, TMA=True), "bf16", False),
            ("dkdv tma", _dkdv_tuned, "BLOCK_N", dict(backward, GROUPED=False, TMA=True), "bf16",
             every_config),
            ("dq tma", _dq_tuned, "BLOCK_M", dict(backward, TMA=True), "bf16", every_config),
            ("forward fp32", _fwd_tuned, "BLOCK_M",
             dict(fwd, IEEE=True, CODES=tuple(_codes(fa2, torch.float32).values())), "fp32", False),
        ]
        for name, tuned, rows, constexprs, dtype, which in builds if variants else builds[:6]:
            kernel = {"forward": "fwd"}.get(name.split()[0].split("+")[0], name.split()[0])
            configs = which if isinstance(which, list) else _kept_configs(tuned.configs, {}, kernel=kernel,
                                                                         rows=rows, **constexprs)
            configs = configs if which is not False else configs[:1]
            args = tuned.fn.arg_names
            aligned = [(args.index(a),) for a in sorted(pointers) if a in args]  # sorted: a stable cache key
            aligned += [(args.index(a), i) for a in strides if a in args for i in range(3)]
            attrs = {path: [["tt.divisibility", 16]] for path in aligned}
            for config in configs:
                full = dict(constexprs, **config.kwargs)
                pointer = f"*{dtype}"
                signature = {arg: "constexpr" if arg in full else scalars.get(arg, pointer if arg in pointers
                                                                               else "fp32") for arg in args}
                options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
                source = ASTSource(tuned.fn, signature, full, attrs)
                compiled = triton.compile(source, target=target, options=options)
                key = f"{name} d{head_dim} {'x'.join(map(str, _config_key(config)))}"
                ptx = compiled.asm["ptx"]
                usage[key] = {"shared": compiled.metadata.shared, **_ptxas_usage(ptx, arch),
                              "ex2": ptx.count("ex2.approx."), "ex2_ftz": ptx.count("ex2.approx.ftz.f32"),
                              "sass": sum((ops := _sass_ops(compiled)).values()), "sass_ops": ops}
    return usage

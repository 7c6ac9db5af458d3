"""The Triton kernels: bit-identical to emulated_attention under TRITON_INTERPRET=1 (with lowprec's
interpreter patch), within FlashAttention's error rule against float64, and a guard that the patch is
active. On a CUDA machine (TRITON_INTERPRET unset) the interpreter-only tests skip and the others run the
compiled kernels on the GPU."""

import functools
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from lowprec.attention import Fix, attention, emulated_attention, math_attention, reference_attention
from lowprec.attention.emulated import rowsum
from lowprec.attention.fix import STAT_NAMES
from lowprec.attention.flash import INTERPRET, flash_attention, flash_delta
from lowprec.attention.inputs import tied_qkv
from lowprec.attention.precision import parse_format
from lowprec.attention.triton_rounding import NEAREST, _round, _to_bf16, _widen_bf16
from lowprec.formats import round_to

triton = pytest.importorskip("triton")
tl = triton.language
on_cpu = pytest.mark.skipif(not INTERPRET, reason="needs the Triton interpreter (TRITON_INTERPRET=1)")
on_gpu = pytest.mark.skipif(INTERPRET, reason="needs a CUDA GPU (compiled kernels)")
DEVICE = "cpu" if INTERPRET else "cuda"  # where the kernels run: the interpreter (CPU) or the GPU


@triton.jit
def _probe(X, Y, A, B, C, E):
    """Y = bf16(X) (a cast), C = A @ B (bf16 dot, fp32 out), E = exp(X)."""
    i = tl.arange(0, 16)
    x = tl.load(X + i)
    tl.store(Y + i, x.to(tl.bfloat16))
    tl.store(E + i, tl.exp(x))
    a = tl.load(A + i[:, None] * 16 + i[None, :])
    b = tl.load(B + i[:, None] * 16 + i[None, :])
    tl.store(C + i[:, None] * 16 + i[None, :], tl.dot(a, b))


@on_cpu
def test_interpreter_patch_is_active():
    """Guard: with the stock 3.6.0 interpreter the cast truncates and the bf16 dot multiplies bit patterns."""
    from lowprec.attention import interpreter

    assert interpreter.active()
    x = 1 + torch.arange(16, dtype=torch.float32) * 3 * 2.0**-9  # halfway and above-halfway cases
    x[0] = 1 + 3 * 2.0**-8  # truncation gives 1.0078125, round-to-nearest-even 1.015625
    y = torch.empty(16, dtype=torch.bfloat16)
    e = torch.empty(16)
    a, b = (torch.randn(16, 16).bfloat16() for _ in range(2))
    c = torch.empty(16, 16)
    _probe[(1,)](x, y, a, b, c, e)
    assert torch.equal(y, x.bfloat16()) and y[0].item() == 1.015625
    assert torch.equal(c, (a.double() @ b.double()).float())
    assert torch.equal(e, torch.exp(x.double()).float())


def run_both(q, k, v, do, **kw):
    """(o, lse, delta, dq, dk, dv) and stats from the emulator and from the kernel."""
    out = {}
    for name, fn in (("emulated", emulated_attention), ("triton", flash_attention)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o, lse, stats = fn(*leaves, return_lse=True, return_stats=True, **kw)
        grads = torch.autograd.grad(o, leaves, do)
        delta = rowsum(do.float() * o.float()) if name == "emulated" else flash_delta(o, do)
        out[name] = ((o, lse, delta, *grads), stats)
    return out["emulated"], out["triton"]


def assert_bit_identical(emulated, triton_out):
    (e_tensors, e_stats), (t_tensors, t_stats) = emulated, triton_out
    for name, a, b in zip(("o", "lse", "delta", "dq", "dk", "dv"), e_tensors, t_tensors, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), (name, (a.double() - b.double()).abs().max().item())
    for name in STAT_NAMES:
        assert torch.equal(getattr(e_stats, name), getattr(t_stats, name)), name


CASES = {  # name: (shape, dtype, causal, tied_qkv options or None for N(0, 1) inputs, attention options)
    "bf16 causal": ((1, 2, 200, 64), torch.bfloat16, True, None, {}),
    "bf16 odd N": ((2, 1, 77, 32), torch.bfloat16, False, None, {}),
    "fp16 head 80": ((1, 2, 100, 80), torch.float16, True, None, {}),
    "fp32": ((1, 1, 96, 16), torch.float32, True, None, {}),
    "repeated max, fix": ((1, 2, 150, 32), torch.bfloat16, True, {}, {"fix": Fix()}),
    "negative max, fix": ((1, 2, 130, 32), torch.bfloat16, False, {"max_score": -4.0}, {"fix": Fix()}),
    "near ties, fix beta 7": (
        (1, 2, 150, 32),
        torch.bfloat16,
        True,
        {"spacing": 2.0**-11},
        {"fix": Fix(beta=7.0)},
    ),
    "same-sign V, row ties": (
        (1, 2, 150, 32),
        torch.bfloat16,
        True,
        {"v_mean": -1.5, "v_std": 0.5},
        {"fix": Fix(tie="row")},
    ),
    "huge logits, fix": (
        (1, 1, 100, 32),
        torch.bfloat16,
        True,
        {"max_score": 1e4, "gap": 50.0},
        {"fix": Fix(beta=7.0)},
    ),
    "edge r=0, closed": (
        (1, 1, 70, 32),
        torch.bfloat16,
        True,
        {"max_score": 0.0, "noise": 0.0},
        {"fix": Fix(variant="closed")},
    ),
    "k-bit weights": (
        (1, 2, 150, 32),
        torch.bfloat16,
        True,
        {},
        {"precision": "fa2:weights=e8m3", "fix": Fix()},
    ),
    "ones-window weights": ((1, 2, 150, 32), torch.bfloat16, True, {},
                            {"precision": "fa2:weights=e8m2@ones"}),
    "ones-window weights, fix": (
        (1, 2, 150, 32),
        torch.bfloat16,
        True,
        {},
        {"precision": "fa2:weights=e8m3@ones", "fix": Fix()},
    ),
    "ones-window weights, fp16": ((1, 1, 90, 32), torch.float16, True, {},
                                  {"precision": "fa2:weights=e5m3@ones"}),
    "paper tiles 64": ((1, 1, 150, 32), torch.bfloat16, True, {}, {"precision": "paper:tile=64"}),
    "paper, fp32 P̄V": ((1, 1, 150, 32), torch.bfloat16, True, {},
                       {"precision": "paper:tile=64,weights=none,product=none,accumulator=none"}),
    "fp32 with bf16 weights": ((1, 1, 90, 32), torch.float32, False, None, {"precision": "fa2:weights=bf16"}),
    # the drop-in features: shape = (q's shape, k's and v's shape) for grouped-query / unequal lengths;
    # "layout": "bshd" passes (B, N, H, D) memory as transposed (B, H, N, D) views, as the model does
    "GQA 4:2, fix": (((1, 4, 150, 32), (1, 2, 150, 32)), torch.bfloat16, True, None, {"fix": Fix()}),
    "MQA 4:1 fp16": (((2, 4, 100, 64), (2, 1, 100, 64)), torch.float16, False, None, {}),
    "Nq < Nk causal, fix": (((1, 2, 70, 32), (1, 2, 200, 32)), torch.bfloat16, True, None, {"fix": Fix()}),
    "Nq < Nk": (((1, 2, 50, 32), (1, 2, 130, 32)), torch.bfloat16, False, None, {}),
    "Nq > Nk causal": (((1, 2, 200, 32), (1, 2, 90, 32)), torch.bfloat16, True, None, {}),
    "Nq > Nk causal, row ties": (((1, 2, 150, 32), (1, 2, 70, 32)), torch.bfloat16, True, None,
                                 {"fix": Fix(tie="row")}),
    "Nq > Nk": (((1, 2, 150, 32), (1, 2, 40, 32)), torch.bfloat16, False, None, {"fix": Fix()}),
    "head 160": ((1, 2, 100, 160), torch.bfloat16, True, None, {}),
    "head 256, fix": ((1, 1, 80, 256), torch.bfloat16, True, None, {"fix": Fix()}),
    "custom scale": ((1, 2, 100, 64), torch.bfloat16, True, None, {"scale": 0.3}),
    "custom scale, fix": ((1, 2, 100, 64), torch.bfloat16, False, {}, {"scale": 0.125, "fix": Fix()}),
    "transposed views": ((2, 3, 90, 32), torch.bfloat16, True, None, {"layout": "bshd"}),
    "transposed views, fix": ((1, 2, 150, 32), torch.bfloat16, True, {}, {"layout": "bshd", "fix": Fix()}),
    "GQA transposed, Nq < Nk": (((1, 4, 60, 32), (1, 2, 130, 32)), torch.float16, True, None,
                                {"layout": "bshd"}),
    # rounded-weight normalisation (Precision.norm = "rounded": l sums the P̄ that enter the P̄V dot)
    "consistent, near ties": ((1, 2, 150, 32), torch.bfloat16, True, {"spacing": 2.0**-11},
                              {"precision": "consistent"}),
    "consistent, near ties, fix": ((1, 2, 150, 32), torch.bfloat16, True, {"spacing": 2.0**-11},
                                   {"precision": "consistent", "fix": Fix()}),
    "consistent fp16, near ties": ((1, 2, 130, 32), torch.float16, False, {"spacing": 2.0**-13},
                                   {"precision": "consistent"}),
    "consistent, k-bit weights": ((1, 1, 150, 32), torch.bfloat16, True, {},
                                  {"precision": "consistent:weights=e8m3"}),
    "paper, rounded norm": ((1, 1, 150, 32), torch.bfloat16, True, {},
                            {"precision": "paper:tile=64,norm=rounded"}),
}


def case_inputs(case: str) -> tuple[tuple[torch.Tensor, ...], bool, dict]:
    """(q, k, v, do), causal and the attention options of CASES[case]."""
    shape, dtype, causal, ties, kw = CASES[case]
    q_shape, kv_shape = shape if isinstance(shape[0], tuple) else (shape, shape)
    gen = torch.Generator().manual_seed(len(case))
    if ties is None:
        q, k, v = (torch.randn(s, generator=gen).to(dtype) for s in (q_shape, kv_shape, kv_shape))
    else:
        q, k, v = tied_qkv(q_shape, dtype=dtype, seed=len(case), **ties)
    do = torch.randn(q_shape, generator=gen).to(dtype)
    kw = dict(kw)
    if kw.pop("layout", None) == "bshd":  # (B, N, H, D) memory, seen as (B, H, N, D): strided views
        q, k, v, do = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, do))
        assert not q.is_contiguous()
    return (q, k, v, do), causal, kw


@on_cpu
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_bit_identical_to_emulator(case):
    (q, k, v, do), causal, kw = case_inputs(case)
    emulated, triton_out = run_both(q, k, v, do, causal=causal, **kw)
    assert_bit_identical(emulated, triton_out)
    assert all(t.isfinite().all() for t in triton_out[0][2:])  # delta and the gradients
    assert triton_out[0][0].isfinite().all()
    if "fix" in kw:
        assert triton_out[1].totals()["rows_triggered"] > 0 or CASES[case][3] is None


@on_cpu
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kernel_bit_identical_several_seeds(seed):
    gen = torch.Generator().manual_seed(seed)
    shape = (1, 2, 67 + 40 * seed, 32)
    q, k, v, do = (torch.randn(shape, generator=gen).bfloat16() for _ in range(4))
    q = q * (1 + seed)  # sharper softmax for later seeds: more P̄ == 1 and near ties
    for causal, fix in ((True, None), (False, Fix())):
        assert_bit_identical(*run_both(q, k, v, do, causal=causal, fix=fix))


@on_cpu
def test_fix_without_counters_is_the_same_forward():
    """The fast path (no counters: WITH_STATS off) computes the same o and lse as the instrumented one."""
    q, k, v = tied_qkv((1, 2, 150, 32), seed=3)
    for causal in (False, True):
        o, lse, stats = flash_attention(q, k, v, causal, fix=Fix(), return_lse=True, return_stats=True)
        fast_o, fast_lse = flash_attention(q, k, v, causal, fix=Fix(), return_lse=True)
        assert torch.equal(o, fast_o) and torch.equal(lse, fast_lse) and stats.totals()["rows_triggered"] > 0


@on_cpu
@pytest.mark.parametrize("n,block_m,block_n", [(1, 64, 128), (17, 16, 16), (100, 32, 64), (129, 64, 32)])
def test_kernel_bit_identical_any_blocks(n, block_m, block_n):
    """Masked and unmasked tile loops, tails and tiny sequences, for unequal query and key block sizes."""
    gen = torch.Generator().manual_seed(n)
    q, k, v, do = (torch.randn(1, 1, n, 16, generator=gen).bfloat16() for _ in range(4))
    blocks = {"block_m": block_m, "block_n": block_n}
    for causal in (True, False):
        assert_bit_identical(*run_both(q, k, v, do, causal=causal, fix=Fix(), **blocks))


def test_tma_loads_are_bit_identical(monkeypatch):
    """`tma_loads`: the kernels' streamed tiles through tensor descriptors give the pointer loads' o, lse,
    counters and gradients bit for bit (under the interpreter, and compiled on a GPU) at the same tiles (on a
    GPU the autotuner picks per variant, and another tile is another summation order): tails past the last
    key, a padded head dim (48 in 64), grouped heads, causal or not, the Fix per tile and per row (whose
    first pass reads the keys too); a view whose row stride is not 16-byte aligned keeps the pointer loads."""
    from lowprec.attention import flash

    device = "cpu" if INTERPRET else "cuda"
    used = []
    launch = flash._launch
    monkeypatch.setattr(flash, "_launch", lambda *a, **kw: (used.append(kw.get("TMA")), launch(*a, **kw))[1])
    gen = torch.Generator().manual_seed(11)
    for n, d, groups in ((100, 48, 2), (64, 32, 1), (17, 16, 4)):
        q = torch.randn(1, 4, n, d, generator=gen).bfloat16().to(device)
        k, v = (torch.randn(1, 4 // groups, n, d, generator=gen).bfloat16().to(device) for _ in range(2))
        do = torch.randn(q.shape, generator=gen).bfloat16().to(device)
        for causal, fix in ((True, None), (False, Fix()), (True, Fix(tie="row"))):
            def run(q=q, k=k, v=v, do=do, causal=causal, fix=fix) -> list[torch.Tensor]:
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                o, lse, *stats = flash_attention(*leaves, causal, fix=fix, return_lse=True, block_m=64,
                                                 block_n=64, return_stats=fix is not None)
                o.backward(do)
                counters = [getattr(s, name) for s in stats for name in STAT_NAMES]
                return [o, lse, *(leaf.grad for leaf in leaves), *counters]
            plain = run()
            with flash.tma_loads():
                tma = run()
            assert all(map(torch.equal, plain, tma)), (n, d, groups, causal)
    assert used.count(True) == used.count(False) > 0 and len(used) == 3 * 3 * 2 * 3  # fwd, dkdv, dq
    wide = torch.randn(1, 2, 40, 17, generator=gen).bfloat16().to(device)[..., :16]  # row stride 34 bytes
    used.clear()
    with flash.tma_loads():
        flash_attention(wide, wide, wide)
    assert used == [False] and not flash._tma_ready(wide) and flash._tma_ready(wide.contiguous())


def assert_within_flash_attention_rule(kernel, q, k, v, do) -> None:
    """FlashAttention's rule: each of o, dq, dk, dv is at most twice as far from the float64 reference as
    plain attention in the same precision, plus a small floor."""
    results = {}
    reference = lambda *t: reference_attention(*t)[0]
    for name, fn in (("kernel", kernel), ("math", math_attention), ("ref", reference)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o = fn(*leaves)
        results[name] = (o, *torch.autograd.grad(o, leaves, do.to(o.dtype)))
    for a, m, r in zip(results["kernel"], results["math"], results["ref"], strict=True):
        assert (a.double() - r).abs().max().item() <= 2 * (m.double() - r).abs().max().item() + 1e-4


def test_kernel_within_flash_attention_rule():
    gen = torch.Generator().manual_seed(7)
    q, k, v, do = (torch.randn(1, 2, 160, 64, generator=gen).bfloat16().to(DEVICE) for _ in range(4))
    assert_within_flash_attention_rule(flash_attention, q, k, v, do)


def test_kernel_stochastic_rounding_is_seeded():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 100, 32, generator=gen).bfloat16().to(DEVICE) for _ in range(3))
    prec = "fa2:weights=e8m3@stochastic"
    a, b, c = (flash_attention(q, k, v, precision=prec, seed=s) for s in (1, 1, 2))
    assert torch.equal(a, b) and not torch.equal(a, c)
    nearest = flash_attention(q, k, v, precision="fa2:weights=e8m3")
    assert not torch.equal(a, nearest)
    ref = reference_attention(q, k, v)[0]
    assert abs((a.double() - ref).mean().item()) < 1e-3


def test_stochastic_bits_are_uniform():
    """Stochastic rounding of 1 + u/8 to 3 significand bits (grid 1, 1.125) rounds up with probability u."""
    x = torch.full((4096,), 1 + 0.3125 / 8, device=DEVICE)
    y = torch.empty_like(x)
    _round_probe[(1,)](x, y, 7)
    assert set(y.unique().tolist()) == {1.0, 1.125}
    assert abs((y == 1.125).float().mean().item() - 0.3125) < 0.03


@triton.jit
def _round_probe(X, Y, seed, CODE: tl.constexpr = 4 | 8 << 4 | 3 << 8):
    i = tl.arange(0, 4096)
    tl.store(Y + i, _round(tl.load(X + i), CODE, seed, 1, i))


@triton.jit
def _pairs_probe(X, Y, Z):
    """Y = `_to_bf16`(X), Z = `_widen_bf16`(Y), on a (64, 64) tile as the forward's P̄."""
    i = tl.arange(0, 64)
    x = tl.load(X + i[:, None] * 64 + i[None, :])
    y = _to_bf16(x)
    tl.store(Y + i[:, None] * 64 + i[None, :], y)
    tl.store(Z + i[:, None] * 64 + i[None, :], _widen_bf16(y))


def test_pairwise_bf16_cast_and_widening_are_the_plain_ones():
    """`consistent`'s cast of P̄ two at a time (cvt.rn.bf16x2.f32 on a GPU) and its widening from the shared
    register (a shift and a mask) give torch's round-to-nearest-even cast and its exact widening, bit for bit,
    each element in its place (specials, halfway cases and subnormals included; under the interpreter the
    patch's casts: its stock widening gets subnormals wrong)."""
    gen = torch.Generator().manual_seed(3)
    scale = torch.exp2(torch.randint(-130, 100, (64, 64), generator=gen).float())
    x = torch.randn(64, 64, generator=gen) * scale
    specials = [0.0, -0.0, float("inf"), -float("inf"), 1 + 2.0**-8, 1 + 3 * 2.0**-8, 2.0**-133, 3.4e38]
    x.view(-1)[: len(specials)] = torch.tensor(specials)
    y = torch.empty(64, 64, dtype=torch.bfloat16, device=DEVICE)
    z = torch.empty(64, 64, device=DEVICE)
    _pairs_probe[(1,)](x.to(DEVICE), y, z)
    assert torch.equal(y.cpu().view(torch.int16), x.bfloat16().view(torch.int16))
    assert torch.equal(z.cpu().view(torch.int32), x.bfloat16().float().view(torch.int32))


@pytest.mark.filterwarnings("ignore:overflow encountered")  # inf inputs overflow n * 2^q, as intended
@pytest.mark.parametrize("fmt", ["e8m3", "fp8_e4m3", "fp8_e5m2", "fp16", "bf16", "e5m6", "e3m2"])
def test_kernel_integer_rounding_matches_round_to(fmt):
    """The kernel's integer-op rounding (`_round_bits`) is lowprec.formats.round_to, bit for bit."""
    fmt = parse_format(fmt)
    gen = torch.Generator().manual_seed(0)
    scale = torch.exp2(torch.randint(-140, 120, (4096,), generator=gen).float())
    x = torch.randn(4096, generator=gen) * scale
    specials = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 464.0, 1.5 * 2.0**-130, 65520.0]
    x[: len(specials)] = torch.tensor(specials)
    y = torch.empty_like(x, device=DEVICE)
    code = NEAREST | fmt.exp_bits << 4 | fmt.man_bits << 8 | int(fmt.no_inf) << 13
    _round_probe[(1,)](x.to(DEVICE), y, 0, CODE=code)
    y = y.cpu()
    expected = round_to(x, fmt)
    assert torch.equal(y.view(torch.int32)[~x.isnan()], expected.view(torch.int32)[~x.isnan()])
    assert y[x.isnan()].isnan().all()


def test_kernels_compile_for_h200():
    """Compiled (not interpreted) kernels build for sm_90 without a GPU: catches code the interpreter accepts
    but the compiler does not. Head dim 128 at the first autotune config of each kernel and variant (Fix,
    rounded-weight normalisation, fp32, grouped-query dK/dV; the Fix adds SASS instructions, its counters
    more), head dim 256's forward, dK/dV and dQ at every
    config they are tuned over, and both head dims' three kernels at the fixed blocks a call with block sizes
    launches (the GPU suite's); every exponential of the bf16 builds is the flushing ex2.approx.ftz.f32 (with
    tl.exp's ex2.approx.f32 the forward was 1.42x slower); the bf16 builds fit in an H200's shared memory
    (Triton's default launch options did not at head dim 256: 263,168 bytes, the H200's OutOfResources
    reproduced here)."""
    code = ("import json; from lowprec.attention.flash import compile_for_gpu; print(json.dumps("
            "{**compile_for_gpu(90, (128,), False), **compile_for_gpu(90, (256,), True, variants=False)}))")
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    from lowprec.attention.flash import SHARED_MEMORY_LIMIT

    builds = json.loads(done.stdout.strip().splitlines()[-1])
    names = {name.split(" d")[0] for name in builds}
    assert names == {"forward", "dkdv", "dq", "forward+fix", "forward+fix+stats", "forward consistent",
                     "forward fp32", "dkdv grouped", "forward fixed", "dkdv fixed", "dq fixed", "forward tma",
                     "forward+fix tma", "dkdv tma", "dq tma"}
    paired = {name: name.replace(" tma", "") for name in builds if " tma " in name}
    assert all(builds[tma][key] <= builds[plain][key] for tma, plain in paired.items() if plain in builds
               for key in ("registers", "spills")), "descriptors: no more registers or spills than pointers"
    assert len([plain for plain in paired.values() if plain in builds]) == 4
    first = next(name for name in builds if name.startswith("forward d128"))
    plain, fixed_fwd = builds[first]["sass"], builds[first.replace("forward", "forward+fix")]["sass"]
    assert plain < fixed_fwd < builds[first.replace("forward", "forward+fix+stats")]["sass"], "the Fix's work"
    ops, fix_ops = builds[first]["sass_ops"], builds[first.replace("forward", "forward+fix")]["sass_ops"]
    assert sum(ops.values()) == plain and ops["MUFU.EX2"] == fix_ops["MUFU.EX2"], "one count, the same exps"
    assert fix_ops["FADD"] > ops["FADD"] and fix_ops.get("FSET.BF.GE.AND", 0) > ops.get("FSET.BF.GE.AND", 0)
    fixed = {f"{kernel} fixed d{d} 64x64x{options}" for d, options in ((128, "4x3"), (256, "8x2"))
             for kernel in ("forward", "dkdv", "dq")}
    assert {name for name in builds if "fixed" in name} == fixed
    assert sum(name.startswith("forward d256") for name in builds) >= 2  # every d256 config of the forward
    for name, usage in builds.items():
        assert usage["registers"] <= 255, (name, usage)
        if "fp32" not in name:  # bf16: every exponential is the flushing ex2 (the other cost 1.42x forward)
            assert usage["ex2"] == usage["ex2_ftz"] > 0, (name, usage)
        if "fp32" not in name:  # fp32 configs beyond the shared memory are skipped by the autotuner
            assert usage["shared"] <= SHARED_MEMORY_LIMIT, (name, usage)


def test_one_compiled_variant_serves_every_size():
    """Triton's launch key (its own binder, as a launch on sm_90 computes it) is the same for every query
    length, key length, head count, group size and B·H, so sizes never compile a new variant; an int argument
    left to Triton's default would key on "1" and "a multiple of 16" (with H and GROUP keyed so, the GPU
    suite's fuzz compiled ~2.9 s of kernels per random configuration). dK/dV alone has two variants, as its
    launch sets GROUPED: one for multi-head attention (group size 1), one for every grouped-query size."""
    from lowprec.attention import triton_kernels
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    backend = make_backend(GPUTarget("cuda", 90, 32))
    x = torch.zeros(64, dtype=torch.bfloat16)
    scalars = {"scale": 0.125, "fix": (0.0,) * 4, "seed": 7}
    strides = {"sq", "sk", "sv", "so", "sdo", "sdk", "sdv", "sdq"}
    sizes = ({"N_Q": 1, "N_K": 1, "N": 1, "H": 1, "GROUP": 1, "BH": 1},
             {"N_Q": 37, "N_K": 1100, "N": 37, "H": 3, "GROUP": 3, "BH": 6},
             {"N_Q": 64, "N_K": 32, "N": 64, "H": 16, "GROUP": 16, "BH": 70_000})
    for kernel in (triton_kernels._fwd, triton_kernels._delta, triton_kernels._dkdv, triton_kernels._dq):
        jit = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)
        bind = create_function_from_signature(jit.signature, jit.params, backend)
        keys = []
        for size in sizes:
            args = {}
            for p in jit.params:
                if p.name == "GROUPED":
                    args[p.name] = size["H"] > size["H"] // size["GROUP"]  # as _flash_backward launches it
                elif p.is_constexpr:
                    args[p.name] = 64 if p.name.startswith(("D", "BLOCK")) else 0
                else:  # sizes, scalars, (batch, head, row) stride tuples, pointers
                    args[p.name] = size.get(p.name, scalars.get(p.name, (4096, 1024, 64) if p.name in strides
                                                                else x))
            keys.append(bind(**args)[1])
        assert keys[1] == keys[2], jit.fn.__name__
        assert (keys[0] == keys[1]) == (kernel is not triton_kernels._dkdv), jit.fn.__name__


def test_dispatch_reaches_the_kernel():
    q, k, v = (torch.randn(1, 2, 40, 16).bfloat16().to(DEVICE) for _ in range(3))
    via_dispatch = attention(q, k, v, backend="triton", fix=Fix())
    assert torch.equal(via_dispatch, flash_attention(q, k, v, fix=Fix()))


def test_a_call_without_gradients_skips_autograd(monkeypatch):
    """Under torch.no_grad, in inference mode, or on inputs that need no gradient the kernel runs without
    autograd's Function (its per-call host cost), with the same output bit for bit; a call whose inputs need
    gradients goes through it and has a backward."""
    from lowprec.attention import flash

    q, k, v = (torch.randn(1, 2, 40, 16).bfloat16().to(DEVICE) for _ in range(3))
    expected, stats = flash_attention(q, k, v, return_stats=True)
    through = []
    apply = flash._EagerFlash.apply
    monkeypatch.setattr(flash._EagerFlash, "apply", lambda *args: through.append(1) or apply(*args))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with torch.no_grad():
        assert torch.equal(flash_attention(*leaves), expected)
    with torch.inference_mode():
        assert torch.equal(flash_attention(q, k, v), expected)
    plain, plain_stats = flash_attention(q, k, v, return_stats=True)
    assert torch.equal(plain, expected) and torch.equal(plain_stats.pbar_ones, stats.pbar_ones)
    assert not through and plain.grad_fn is None
    o = flash_attention(*leaves)
    assert through == [1] and torch.equal(o.detach(), expected) and o.grad_fn is not None
    o.float().sum().backward()
    assert all(t.grad is not None for t in leaves)
    with torch.autograd.forward_ad.dual_level(), pytest.raises(NotImplementedError):  # refused, not dropped
        flash_attention(torch.autograd.forward_ad.make_dual(q, torch.ones_like(q)), k, v)


@pytest.mark.parametrize("backend", ["triton", "emulated"])
def test_under_autocast_fp32_inputs_are_cast_as_sdpa_casts_them(backend):
    """Under bf16 autocast, fp32 q, k, v (RoPE's q and k in a transformers model) give the output and the
    gradients of the same inputs cast to bf16 beforehand, bit for bit; the gradients come back in fp32.
    Without autocast, mixed dtypes stay an error."""
    q, k, v = (torch.randn(1, 4, 40, 16, device=DEVICE) for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    do = torch.randn(1, 4, 40, 16, device=DEVICE).bfloat16()

    def forward_backward(*inputs):
        leaves = [t.clone().requires_grad_() for t in inputs]
        o = attention(*leaves, backend=backend)
        return (o, *torch.autograd.grad(o, leaves, do))

    cast_first = forward_backward(q.bfloat16(), k.bfloat16(), v.bfloat16())
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        under = forward_backward(q, k, v.bfloat16())
    assert under[0].dtype == torch.bfloat16 and all(g.dtype == torch.float32 for g in under[1:3])
    for got, want in zip(under, cast_first, strict=True):
        assert torch.equal(got.bfloat16(), want)
    with pytest.raises(ValueError, match="same dtype"):
        attention(q, k, v.bfloat16(), backend=backend)


def test_kernel_value_errors():
    q, k, v = (torch.randn(1, 1, 32, 16, device=DEVICE).bfloat16() for _ in range(3))
    bad_calls = [
        lambda: flash_attention(*(torch.randn(1, 1, 32, 8, device=DEVICE).bfloat16() for _ in range(3))),
        lambda: flash_attention(*(torch.randn(1, 1, 32, 264, device=DEVICE).bfloat16() for _ in range(3))),
        lambda: flash_attention(q.double(), k.double(), v.double()),
        lambda: flash_attention(q, k, v, precision="fa2:output=fp32"),
        lambda: flash_attention(q, k, v, block_m=48),
        lambda: flash_attention(q, k, v, fix=Fix(beta=0.5)),
        lambda: flash_attention(q, k, v, fix=Fix(tol=-1.0)),
    ]
    for call in bad_calls:
        with pytest.raises(ValueError):
            call()


def test_blocks_beyond_shared_memory_are_a_value_error(monkeypatch):
    """Caller-chosen blocks that do not fit in the GPU's shared memory (Triton's OutOfResources at launch)
    give a one-line ValueError naming the arguments, not Triton's traceback."""
    from lowprec.attention import flash
    from triton.runtime.errors import OutOfResources

    class TooLarge:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise OutOfResources(263_168, 232_448, "shared memory")
            return launch

    monkeypatch.setitem(flash._KERNELS, "fwd", (TooLarge(), flash._KERNELS["fwd"][1]))
    q = torch.randn(1, 1, 32, 16, device=DEVICE).bfloat16()
    with pytest.raises(ValueError, match=r"block_m=64, block_n=32 need more shared memory .* head dim 16"):
        flash_attention(q, q, q, block_m=64, block_n=32)


def test_interpreter_helpers_round_to_nearest_even():
    from lowprec.attention.interpreter import _f32_to_bf16_rne

    x = torch.randn(10000) * 10
    bits = _f32_to_bf16_rne(x.numpy())
    assert np.array_equal(bits, x.bfloat16().view(torch.int16).numpy().view(np.uint16))


@on_gpu
def test_gpu_kernel_matches_emulator_statistically():
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(2, 4, 1000, 128, generator=gen, device="cuda").bfloat16() for _ in range(4))
    for fix in (None, Fix()):
        assert_within_flash_attention_rule(functools.partial(flash_attention, fix=fix), q, k, v, do)


def test_the_autotuners_pick_is_kept_per_shape_and_dtype(monkeypatch):
    """`_launch`'s autotuned branch (kernels stubbed, CPU): a launch key's first call goes through the
    autotuner, later calls launch its pick; another dtype of q or of the fourth tensor, or another size, is
    another key."""
    import triton
    from lowprec.attention import flash

    calls = []

    class Stub:
        best_config = triton.Config({"BLOCK_M": 32, "BLOCK_N": 64}, num_warps=4, num_stages=2)

        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((self.name, kwargs.get("BLOCK_M")))

    monkeypatch.setitem(flash._KERNELS, "fwd", (Stub("kernel"), Stub("tuner")))
    monkeypatch.setattr(flash, "_picks", {})
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        bf16, fp32 = torch.bfloat16, torch.float32
        for dtypes, n in (((bf16, bf16), 64), ((bf16, bf16), 64), ((fp32, fp32), 64), ((bf16, fp32), 64),
                          ((bf16, bf16), 65)):
            q, k, v, o = (torch.empty(1, 1, n, 16, dtype=dtypes[i == 3]) for i in range(4))
            flash._launch("fwd", (0, 0), n, 1, "BLOCK_M", q, k, v, o, sizes=(n, n, 1, 1), D=16, BLOCK_D=16)
    finally:
        torch.use_deterministic_algorithms(was)
    assert calls == [("tuner", None), ("kernel", 32), ("tuner", None), ("tuner", None), ("tuner", None)]


@on_gpu
def test_a_tuned_shape_launches_without_the_autotuner(monkeypatch):
    """Once the autotuner has picked for a launch key, the same shape launches its pick directly (none of
    the autotuner's per-call Python) with bit-identical results; a new length goes through it again."""
    from lowprec.attention import flash

    gen = torch.Generator(device="cuda").manual_seed(3)

    def step(n: int) -> list[torch.Tensor]:
        q, k, v = (torch.randn(2, 4, n, 64, generator=gen, device="cuda").bfloat16().requires_grad_()
                   for _ in range(3))
        o = flash_attention(q, k, v, causal=True)
        o.backward(torch.ones_like(o))
        return [o.detach(), q.grad, k.grad, v.grad]

    tuned = {name: t for name, (_, t) in flash._KERNELS.items()}
    runs = {name: 0 for name in tuned}
    for name, t in tuned.items():
        def counted(*args, _run=t.run, _name=name, **kwargs):
            runs[_name] += 1
            return _run(*args, **kwargs)
        monkeypatch.setattr(t, "run", counted)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)  # the autotuned path (a deterministic run pins its tiles)
    try:
        gen.manual_seed(3)
        first = step(777)
        assert runs == {"fwd": 1, "dkdv": 1, "dq": 1}
        gen.manual_seed(3)
        again = step(777)
        assert runs == {"fwd": 1, "dkdv": 1, "dq": 1}, "the same shape went through the autotuner again"
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
        step(778)
        assert runs == {"fwd": 2, "dkdv": 2, "dq": 2}
    finally:
        torch.use_deterministic_algorithms(was)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled kernels)")
def test_direct_launch_is_bit_identical_and_skips_triton(monkeypatch):
    """With `direct_launch` (the default), a picked kernel's later launches (the backward's delta kernel's
    too) call its compiled binary (no JITFunction.run) and give bit-identical outputs and gradients; a new
    alignment (a view one element in) or a length that is a multiple of 16 goes through Triton again and gets
    its own binary."""
    from lowprec.attention import flash

    def step(shift: int, n: int) -> list[torch.Tensor]:
        gen = torch.Generator(device="cuda").manual_seed(5)
        base = [torch.randn(2, 4, n, 64 + shift, generator=gen, device="cuda").bfloat16() for _ in range(3)]
        q, k, v = (t[..., shift:].requires_grad_() for t in base)  # shift 1: pointers not 16-byte aligned
        o = flash_attention(q, k, v, causal=True)
        o.backward(torch.ones_like(o))
        return [o.detach(), q.grad, k.grad, v.grad]

    runs = {"n": 0}
    for kernel in (*(kernel for kernel, _ in flash._KERNELS.values()), flash._delta):
        def counted(*args, _run=kernel.run, **kwargs):
            runs["n"] += 1
            return _run(*args, **kwargs)
        monkeypatch.setattr(kernel, "run", counted)
    monkeypatch.setattr(flash, "_compiled", {})
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)  # the autotuned path
    try:
        for shift, n in ((0, 777), (1, 777), (0, 784)):
            with flash.direct_launch(False):  # no binary kept (an earlier test may have tuned this shape)
                step(shift, n)  # the autotuner picks
                plain = step(shift, n)  # through JITFunction.run
            with flash.direct_launch():
                before = runs["n"]
                first = step(shift, n)  # a new signature: through Triton once, its binary kept
                assert runs["n"] > before
                before = runs["n"]
                again = step(shift, n)
                assert runs["n"] == before, "a kept binary went through JITFunction.run again"
            assert all(torch.equal(a, b) for a, b in zip(plain, first, strict=True))
            assert all(torch.equal(a, b) for a, b in zip(plain, again, strict=True))
        signatures = {slot[1] for slot in flash._compiled}
        assert len(signatures) >= 3, "aligned, shifted and n % 16 == 0: own binaries"
    finally:
        torch.use_deterministic_algorithms(was)
    assert flash.DIRECT is True


def test_signature_is_at_least_as_fine_as_tritons_specialisation(monkeypatch):
    """Launches share a binary only when Triton would specialise them alike: same dtypes and 16-byte
    alignment of every tensor, same (== 1, % 16 == 0, int32) of every int, tuples item by item."""
    from lowprec.attention import flash

    x = torch.zeros(64, dtype=torch.bfloat16)
    sig = flash._signature
    assert sig((x, 32, (3, 16), 0.5)) == sig((x.clone(), 48, (5, 32), 0.25))
    assert sig((x,)) != sig((x[1:],)), "alignment"
    assert sig((x,)) != sig((x.float(),)), "dtype"
    assert len({sig((n,)) for n in (1, 16, 17, 2**31)}) == 4, "== 1, % 16 == 0, neither, beyond int32"
    assert sig(((3, 16),)) != sig(((3, 17),)), "inside tuples"
    assert sig((x, 16, (2, 0.5))) != sig((x, 16.0, (2.0, 0.5))), "an int and a float of one value"
    with pytest.raises(TypeError, match="tensor inside a tuple"):
        sig(((x, 1),))
    with pytest.raises(TypeError, match="after the numbers"):
        sig((1, x))
    with flash.direct_launch(False):
        assert not flash.DIRECT
    assert flash.DIRECT
    monkeypatch.setattr(flash, "_CLASSES", {})
    monkeypatch.setattr(flash, "CLASSES_KEPT", 3)
    kept = [sig((x, n)) for n in range(10)]
    assert len(flash._CLASSES) <= 3 and kept == [sig((x, n)) for n in range(10)], "bounded, same answers"


def test_direct_keeps_a_binary_per_slot_and_passes_every_parameter(monkeypatch):
    """`_direct` on stand-ins for a JITFunction and its compiled binary (CPU): the first launch of a slot goes
    through the kernel and keeps the binary it returns; a launch with the same signature calls the binary
    with the positional arguments, then the kernel's remaining parameters in order (options such as
    num_warps left out); a new alignment or a changed Triton debug setting goes through the kernel again."""
    import triton
    from lowprec.attention import flash

    calls = []

    class Binary:
        def __getitem__(self, grid):
            return lambda *args: calls.append(("binary", grid, args))

    class Kernel:
        arg_names = ["X", "n", "D", "BLOCK"]

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                calls.append(("jit", grid, args, kwargs))
                return Binary()
            return run

    monkeypatch.setattr(flash, "_compiled", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    x = torch.zeros(64)
    kwargs = {"BLOCK": 16, "D": 4, "num_warps": 4}
    flash._direct(Kernel(), ("k",), (1, 1, 1), (x, 32), kwargs)
    flash._direct(Kernel(), ("k",), (2, 1, 1), (x.clone(), 48), kwargs)  # same signature
    flash._direct(Kernel(), ("k",), (1, 1, 1), (x[1:], 32), kwargs)  # not 16-byte aligned
    monkeypatch.setattr(triton.knobs.runtime, "debug", True)
    flash._direct(Kernel(), ("k",), (1, 1, 1), (x, 32), kwargs)
    assert [c[0] for c in calls] == ["jit", "binary", "jit", "jit"]
    assert calls[0][1:] == ((1, 1, 1), (x, 32), kwargs)
    assert calls[1][0:2] == ("binary", (2, 1, 1)) and calls[1][2][1:] == (48, 4, 16)


def test_the_delta_kernel_launches_directly_and_unused_gradients_stay_none(monkeypatch):
    """The backward's preprocessing (`flash_delta`) goes through `_direct` like the other kernels when the
    direct launch is on (a GPU), and the eager backward gets None, not zero tensors, for the
    non-differentiable lse and counters (no allocation and fill per call)."""
    from lowprec.attention import flash

    direct, seen = [], []
    o, do = torch.randn(2, 1, 2, 24, 16).bfloat16()
    with monkeypatch.context() as patched:
        patched.setattr(flash, "INTERPRET", False)  # as on a GPU: the direct launch's branch
        patched.setattr(flash, "_direct", lambda kernel, key, grid, args, kwargs: (
            direct.append(key), kernel[grid](*args, **kwargs)))
        delta = flash.flash_delta(o, do)
    assert direct == [("delta", torch.bfloat16, torch.bfloat16, 16)]
    assert torch.equal(delta, flash.flash_delta(o, do))
    formula = flash._backward_formula
    monkeypatch.setattr(flash, "_backward_formula", lambda ctx, do, dlse, dstats, backward=None: (
        seen.append((dlse, dstats)), formula(ctx, do, dlse, dstats, backward))[1])
    q, k, v = (torch.randn(1, 2, 16, 16).bfloat16().requires_grad_() for _ in range(3))
    flash_attention(q, k, v, block_m=16, block_n=16).sum().backward()
    assert seen == [(None, None)] and q.grad is not None


def test_late_interpreter_switch_is_a_clear_error():
    """Without a GPU the kernels need TRITON_INTERPRET=1 before triton's first import, else a clear error."""
    if torch.cuda.is_available():
        pytest.skip("only meaningful without a GPU")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import triton\nimport lowprec.attention.flash"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "set TRITON_INTERPRET=1 in the environment" in " ".join(run.stderr.split())


def test_batch_times_heads_is_folded_over_the_grid():
    """B*H programs fold over the grid's y and z (CUDA caps each at 65,535): every (batch, head) is covered
    once, and a fold's overshoot is skipped by the kernels; the kernel stays the emulator on a folded grid."""
    from lowprec.attention.flash import GRID_YZ, _fold

    for bh in (1, 7, GRID_YZ, GRID_YZ + 1, 70_000, 4_000_000):
        y, z = _fold(bh)
        assert y <= GRID_YZ and z <= GRID_YZ and y * z >= bh > y * (z - 1)
    with pytest.raises(ValueError, match="batch x heads"):
        _fold(GRID_YZ**2 + 1)


@on_cpu
def test_kernel_on_a_folded_grid(monkeypatch):
    import lowprec.attention.flash as flash

    monkeypatch.setattr(flash, "GRID_YZ", 4)  # B*H = 6 folds to (4, 2), with two programs skipped
    gen = torch.Generator().manual_seed(5)
    q, k, v, do = (torch.randn((3, 2, 40, 16), generator=gen).bfloat16() for _ in range(4))
    assert_bit_identical(*run_both(q, k, v, do, causal=True, fix=Fix()))


# ------------------------------------------------------------------------------ drop-in features vs float64

FEATURES = {  # name: (q's shape, k's and v's shape, causal, options); the inputs are N(0, 1)
    "GQA 4:2 causal": ((1, 4, 100, 64), (1, 2, 100, 64), True, {}),
    "MQA 4:1": ((2, 4, 90, 32), (2, 1, 90, 32), False, {}),
    "Nq < Nk causal": ((1, 2, 60, 64), (1, 2, 150, 64), True, {}),
    "Nq < Nk": ((1, 2, 60, 64), (1, 2, 150, 64), False, {}),
    "Nq > Nk causal": ((1, 2, 150, 64), (1, 2, 60, 64), True, {}),
    "Nq > Nk": ((1, 2, 150, 64), (1, 2, 60, 64), False, {}),
    "head 160": ((1, 2, 80, 160), (1, 2, 80, 160), True, {}),
    "head 256": ((1, 1, 64, 256), (1, 1, 64, 256), False, {}),
    "scale 0.3": ((1, 2, 100, 64), (1, 2, 100, 64), True, {"scale": 0.3}),
    "transposed views": ((2, 3, 90, 32), (2, 3, 90, 32), True, {"layout": "bshd"}),
}


def explicit_attention(q, k, v, causal: bool, scale: float | None = None, dtype=None):
    """Softmax attention written out with an explicit bottom-right mask (query i sees keys j <= i + Nk - Nq)
    and explicitly repeated key/value heads, in `dtype` (default q's); rows that see no key give 0."""
    dtype = dtype or q.dtype
    q, k, v = (t.to(dtype) for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    n_q, n_k = q.shape[2], k.shape[2]
    i, j = torch.arange(n_q, device=q.device)[:, None], torch.arange(n_k, device=q.device)[None, :]
    visible = (j <= i + n_k - n_q) if causal else torch.ones(n_q, n_k, dtype=torch.bool, device=q.device)
    seen = visible.any(-1, keepdim=True)
    s = (q @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    s = s.masked_fill(~visible, float("-inf")).masked_fill(~seen, 0.0)  # no NaN from rows that see nothing
    return (torch.softmax(s, dim=-1) @ v).masked_fill(~seen, 0.0)


def feature_inputs(name: str, dtype=torch.bfloat16):
    q_shape, kv_shape, causal, kw = FEATURES[name]
    gen = torch.Generator().manual_seed(len(name))
    q, k, v, do = (torch.randn(s, generator=gen).to(dtype).to(DEVICE) for s in (q_shape, kv_shape, kv_shape,
                                                                                  q_shape))
    kw = dict(kw)
    if kw.pop("layout", None) == "bshd":
        q, k, v, do = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, do))
    return (q, k, v, do), causal, kw


def assert_flash_attention_accuracy(fn, q, k, v, do, causal: bool, scale: float | None = None) -> None:
    """FlashAttention's rule against float64 (explicit mask): the output error at most 2x, the gradients'
    at most 3x those of the same computation in the input dtype, plus a small floor."""
    results = {}
    for name, impl in (("flash", fn),
                       ("same dtype", lambda *t: explicit_attention(*t, causal, scale)),
                       ("float64", lambda *t: explicit_attention(*t, causal, scale, torch.float64))):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        o = impl(*leaves)
        results[name] = (o, *torch.autograd.grad(o, leaves, do.to(o.dtype)))
    for name, factor, a, m, r in zip(("o", "dq", "dk", "dv"), (2, 3, 3, 3), results["flash"],
                                     results["same dtype"], results["float64"], strict=True):
        assert a.shape == r.shape and a.isfinite().all(), name
        err, base = (a.double() - r).abs().max().item(), (m.double() - r).abs().max().item()
        assert err <= factor * base + 1e-4, (name, err, base)


@pytest.mark.parametrize("fix", [None, Fix()], ids=["plain", "fix"])
@pytest.mark.parametrize("name", list(FEATURES))
def test_kernel_features_within_flash_attention_rule(name, fix):
    (q, k, v, do), causal, kw = feature_inputs(name)
    kernel = functools.partial(flash_attention, causal=causal, fix=fix, **kw)
    assert_flash_attention_accuracy(kernel, q, k, v, do, causal, kw.get("scale"))


def test_rows_that_see_no_key_give_zero():
    """Causal with Nq > Nk: the first Nq - Nk queries see no key; FlashAttention-2 gives them o = 0 (lse
    +inf), so their dQ is 0 and they add nothing to dK, dV. The kernel, the emulator and the reference
    agree."""
    (q, k, v, do), _, _ = feature_inputs("Nq > Nk causal")
    blind = q.shape[2] - k.shape[2]
    for fn in (flash_attention, emulated_attention):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o, lse = fn(*leaves, causal=True, return_lse=True)
        dq, dk, dv = torch.autograd.grad(o, leaves, do)
        assert (o[:, :, :blind] == 0).all() and (lse[:, :, :blind] == float("inf")).all()
        assert (o[:, :, blind:] != 0).any() and lse[:, :, blind:].isfinite().all()
        assert (dq[:, :, :blind] == 0).all() and all(g.isfinite().all() for g in (dq, dk, dv))
        only_seeing = torch.autograd.grad(fn(leaves[0][:, :, blind:], *leaves[1:], causal=True), leaves[1:],
                                          do[:, :, blind:])
        assert torch.equal(only_seeing[0], dk) and torch.equal(only_seeing[1], dv)
    o_ref, lse_ref = reference_attention(q, k, v, causal=True)
    assert (o_ref[:, :, :blind] == 0).all() and (lse_ref[:, :, :blind] == float("inf")).all()


def test_strided_inputs_are_read_in_place():
    """The model's transposed (B, N, H, D) views go to the kernels with their strides, and the output takes
    their layout (no copies in or out)."""
    from lowprec.attention.flash import _addressable, _empty_like

    x = torch.randn(2, 50, 3 * 4 * 16, device=DEVICE).bfloat16()
    q, k, v = (t.view(2, 50, 4, 16).transpose(1, 2) for t in x.split(4 * 16, dim=2))
    assert all(_addressable(t) is t for t in (q, k, v))
    o = flash_attention(q, k, v)
    assert o.stride() == _empty_like(q).stride() == (50 * 64, 16, 64, 1)
    assert torch.equal(o, flash_attention(q.contiguous(), k.contiguous(), v.contiguous()))
    assert _addressable(q.transpose(-1, -2).contiguous().transpose(-1, -2)).stride(-1) == 1


def test_kernel_shape_errors_name_the_argument():
    q = torch.randn(1, 4, 32, 16, device=DEVICE).bfloat16()
    kv = torch.randn(1, 2, 40, 16, device=DEVICE).bfloat16()
    cases = {
        "heads": (q, kv[:, :1].expand(1, 3, 40, 16), kv[:, :1].expand(1, 3, 40, 16)),
        "k and v": (q, kv, kv[:, :, :39]),
        "batch": (q, kv.expand(2, 2, 40, 16), kv.expand(2, 2, 40, 16)),
        "head_dim": (q, kv[..., :8], kv[..., :8]),
    }
    for words, args in cases.items():
        with pytest.raises(ValueError, match=words):
            flash_attention(*args)
    for bad in (0.0, -1.0, float("nan"), True, "0.1"):
        with pytest.raises(ValueError, match="scale"):
            flash_attention(q, kv, kv, scale=bad)


@on_cpu
def test_custom_op_passes_opcheck():
    """torch.library's checks of the custom op: schema, fake implementation, autograd registration."""
    from lowprec.attention import flash

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 20, 16, generator=gen).bfloat16().requires_grad_()
    k, v = (torch.randn(1, 1, 24, 16, generator=gen).bfloat16().requires_grad_() for _ in range(2))
    options, _ = flash._kernel_options(q.dtype, 16, False, True, 0.25, "2", "consistent", 16, 16)
    args = (q, k, v, 0, True, *options)
    torch.library.opcheck(torch.ops.lowprec.flash_forward.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@on_cpu
@pytest.mark.parametrize("backend", ["triton/precision=consistent/fix=2", "emulated/precision=paper", "sdpa"])
def test_attention_with_a_string_spec_compiles_without_a_graph_break(backend):
    """attention(q, k, v, backend="<spec string>") inside a compiled function: fullgraph (a graph break is an
    error), eager's output bit for bit with aot_eager."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 16, generator=gen).bfloat16() for _ in range(3))

    def call(q, k, v):
        return attention(q, k, v, backend=backend, scale=0.25)

    torch._dynamo.reset()
    try:
        compiled = torch.compile(call, backend="aot_eager", fullgraph=True)
        assert torch.equal(compiled(q, k, v), call(q, k, v))
    finally:
        torch._dynamo.reset()


def test_constant_result_marks_a_function_as_torch_compilers_decorator_does():
    """`constant_result` (attention's `_resolve` and the kernel's `_kernel_options`) leaves a function as
    `torch.compiler.assume_constant_result` leaves it, where the decorator keeps its mark on the function."""
    from lowprec.attention import dispatch, flash
    from lowprec.attention.reference import constant_result

    def ours() -> None: ...
    def theirs() -> None: ...
    assert constant_result(ours) is ours and torch.compiler.assume_constant_result(theirs) is theirs
    assert vars(theirs) and vars(ours) == vars(theirs)
    assert vars(theirs).items() <= vars(dispatch._resolve).items() and \
        vars(theirs).items() <= vars(flash._kernel_options).items()


def test_constant_result_functions_get_plain_values_only(monkeypatch):
    """What attention() and the kernel hand to their torch.compiler.assume_constant_result functions, from
    a GPT whose layers hold AttentionSpec objects: plain values only (torch.compile 2.11 stops with "can't
    reconstruct arbitrary frozen dataclass instances" at a Precision, Fix or AttentionSpec there)."""
    from lowprec.attention import dispatch, flash
    from lowprec.model import GPT, GPTConfig

    seen = []
    def plain(x) -> bool:
        return (x is None or isinstance(x, (str, int, float, bool, torch.dtype))
                or isinstance(x, tuple) and all(map(plain, x)))

    for module, name in ((dispatch, "_resolve"), (flash, "_kernel_options")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name: seen.append((_n, a)) or _f(*a))
    torch.manual_seed(0)
    for spec in ("triton/precision=paper/fix=2", "math/dtype=float32"):
        model = GPT(GPTConfig(vocab_size=97, block_size=16, n_layer=1, n_head=2, n_embd=32, attention=spec))
        model(torch.randint(97, (1, 16)))
    q = torch.randn(1, 2, 16, 16).bfloat16()
    attention(q, q, q, backend="triton/precision=paper/fix=2")
    assert {n for n, _ in seen} == {"_resolve", "_kernel_options"}
    assert all(plain(a) for _, args in seen for a in args), [a for _, a in seen if not all(map(plain, a))]


@on_cpu
@pytest.mark.slow
def test_gpt_compiles_around_the_kernel_without_graph_breaks():
    """torch.compile of a GPT on the Triton backend: no graph break (the kernels are custom ops), Inductor
    compiles the rest, and the loss and gradients are eager's (bit for bit with aot_eager, which does not
    re-fuse the model's other ops; to fp32 rounding with Inductor). fullgraph=True makes a graph break an
    error, and each backend is handed one graph (counted as dynamo hands it over: no torch._dynamo.explain,
    which traced the model a third time)."""
    from lowprec.model import GPT, GPTConfig
    from torch._dynamo.backends.registry import lookup_backend

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=97, block_size=32, n_layer=2, n_head=4, n_embd=64,
                    attention="triton/precision=consistent/fix=2")
    model = GPT(cfg)
    idx, targets = torch.randint(97, (2, 32)), torch.randint(97, (2, 32))

    def loss_and_grads(fn):
        model.zero_grad()
        loss = fn(idx, targets)[1]
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    eager = loss_and_grads(model)
    def counting(backend: str, graphs: list):
        def compile_graph(gm, example_inputs):
            graphs.append(gm)
            return lookup_backend(backend)(gm, example_inputs)
        return compile_graph

    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        graphs = []
        loss, grads = loss_and_grads(torch.compile(model, backend=counting(backend, graphs), fullgraph=True))
        assert len(graphs) == 1, (backend, len(graphs))
        if backend == "aot_eager":
            assert torch.equal(loss, eager[0]) and all(map(torch.equal, grads, eager[1]))
        else:
            torch.testing.assert_close(loss, eager[0], rtol=1e-5, atol=0)
            for a, b in zip(grads, eager[1], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-6)



def test_bench_attention_launch_times_a_loop_of_calls_on_cpu():
    """--launch's rows: microseconds per call of each implementation's fwd and fwd+bwd loop (CUDA graphs
    need a GPU, so on the CPU only the plain loop; a plain torch attention stands in for the kernels here)."""
    from lowprec.instruments.bench_attention import launch_overhead

    rows = launch_overhead({"math": math_attention}, 1, 2, 64, 16, True, "cpu", calls=3)
    assert [(r["impl"], r["mode"], r["calls"]) for r in rows] == [("math", "fwd", 3), ("math", "fwd+bwd", 3)]
    assert all(r["plain_us"] > 0 and "graph_us" not in r and "plain_us_error" not in r for r in rows)


def test_bench_attention_times_the_tma_loads_beside_the_rest(tmp_path, capsys):
    """`lowprec bench attention --tma`: our kernel with its streamed tiles through tensor descriptors, Fix
    off and on, timed with the rest, and their speed-up over the pointer loads per configuration; `--aa`
    times the plain kernel again, last, for the method's spread."""
    from lowprec import cli

    out = tmp_path / "bench.json"
    args = ["bench", "attention", "--smoke", "--tma", "--aa", "--causal", "true", "--out", str(out)]
    assert cli.main(args) == 0
    assert "descriptors: fwd Fix off" in capsys.readouterr().out
    record = json.loads(out.read_text())
    assert {"triton", "triton+fix", "triton-tma", "triton+fix-tma"} <= {r["impl"] for r in record["results"]}
    entry = record["fix_overhead"][0]
    assert entry["fwd_tma_speedup"] > 0 and entry["fwd+bwd_tma_speedup+fix"] > 0
    assert [r["impl"] for r in record["results"]][-1] == "triton-again" and entry["bwd_aa_ratio"] > 0


def test_fix_overhead_reads_the_fix_from_its_forward_and_times_the_same_backward_twice():
    """The Fix enters only the forward: its cost is also read as the forward's extra time over
    forward+backward time, and the backward (the same launches with and without it) gives the timing
    method's spread; the targets judge both readings."""
    from lowprec.instruments.bench_attention import fix_overhead, targets

    shape = {"seq": 4096, "head_dim": 128, "causal": True}
    plain = {"impl": "triton", **shape, "fwd_ms": 1.0, "bwd_ms": 3.0, "fwd+bwd_ms": 4.0}
    fixed = {"impl": "triton+fix", **shape, "fwd_ms": 1.2, "bwd_ms": 2.94, "fwd+bwd_ms": 4.04}
    entry = fix_overhead([plain, fixed])[0]
    assert entry["fwd+bwd_fix_overhead"] == 0.01 and entry["fwd_fix_overhead"] == 0.2
    assert entry["fwd+bwd_fix_from_fwd"] == 0.05 and entry["bwd_fix_ratio"] == 0.98
    no_bwd = [{k: v for k, v in r.items() if k != "bwd_ms"} for r in (plain, fixed)]
    assert "bwd_fix_ratio" not in fix_overhead(no_bwd)[0], "only where every mode was measured"
    again = {**plain, "impl": "triton-again", "fwd_ms": 1.01, "bwd_ms": 2.97, "fwd+bwd_ms": 4.0}
    assert {k: v for k, v in fix_overhead([plain, again])[0].items() if k.endswith("aa_ratio")} == {
        "fwd_aa_ratio": 1.01, "bwd_aa_ratio": 0.99, "fwd+bwd_aa_ratio": 1.0}, "--aa: the method's spread"
    verdict = targets(fix_overhead([plain, fixed]), seqs=(4096,))
    assert verdict["fwd+bwd_fix_from_fwd"] == 0.05 and verdict["met"]["fwd+bwd_fix_overhead"]
    assert verdict["met"]["fwd+bwd_fix_from_fwd"] is False, "5% of forward+backward: over the 2% target"


def test_record_fix_overhead_reads_a_benchmark_or_a_cures_record(tmp_path):
    """A benchmark record's `results` (triton, triton+fix) and a cures record's `cost` (none (fa2), Fix) give
    the same `fix_overhead` entries for the same timings."""
    from lowprec.instruments.bench_attention import fix_overhead, record_fix_overhead

    shape = {"seq": 4096, "head_dim": 128, "causal": True}
    plain = {**shape, "fwd_ms": 1.0, "bwd_ms": 3.0, "fwd+bwd_ms": 4.0}
    fixed = {**shape, "fwd_ms": 1.2, "bwd_ms": 2.94, "fwd+bwd_ms": 4.04}
    (tmp_path / "bench.json").write_text(json.dumps(
        {"results": [{"impl": "triton", **plain}, {"impl": "triton+fix", **fixed}]}))
    (tmp_path / "cures.json").write_text(json.dumps(
        {"bias": [], "cost": [{"cure": "none (fa2)", **plain}, {"cure": "Fix", **fixed}]}))
    expected = fix_overhead([{"impl": "triton", **plain}, {"impl": "triton+fix", **fixed}])
    assert expected and expected[0]["fwd+bwd_fix_from_fwd"] == 0.05
    assert record_fix_overhead(tmp_path / "bench.json") == expected
    assert record_fix_overhead(tmp_path / "cures.json") == expected


def test_timing_rounds_rotate_the_order_over_the_same_inputs():
    """Each round of a benchmark starts one implementation later than the round before, so that no
    implementation is always timed in the same place (an A/A pair timed first and last differed by 3-9%), and
    every implementation reads the same input tensors."""
    from lowprec.instruments.bench_attention import bench_config

    order, inputs = [], set()

    def timed(name):
        def fn(q, k, v, causal):
            order.append(name)
            inputs.add(tuple(x.data_ptr() for x in (q, k, v)))
            return q * 1.0
        return fn

    out = bench_config({n: timed(n) for n in "abc"}, 1, 1, 8, 4, False, "cpu", rounds=4)
    assert set(out) == set("abc") and all("fwd_ms" in row for row in out.values())
    fwd = order[3:3 + 2 * 4 * 3:2]  # after the three preparing calls: each timing is a warm-up and a call
    assert fwd == list("abc" "bca" "cab" "abc")
    assert len(inputs) == 1, "one set of q, k, v for every implementation"


def test_repeated_call_options_are_resolved_once():
    """An eager call finds its kernel constants in one cache lookup: plan_call resolves each distinct set of
    options (precision, Fix, scale, blocks) once, for the kernel and the emulator alike, and the ops resolve
    nothing (resolving takes longer on the host than a short kernel on the GPU). An unhashable option still
    gets its clear error."""
    from lowprec.attention import flash, plan

    flash._lower.cache_clear()
    plan._plan.cache_clear()
    q, k, v = (torch.randn(1, 2, 32, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    options = dict(fix=Fix(beta=3.0), precision="paper:tile=16", scale=0.1)
    for _ in range(3):
        flash_attention(q, k, v, **options).sum().backward()
    emulated_attention(q, k, v, **options).sum().backward()
    assert flash._lower.cache_info().misses == plan._plan.cache_info().misses == 1
    flash_attention(q, k, v, precision="paper:tile=16", scale=0.1)
    assert plan._plan.cache_info().misses == 2
    options = (torch.bfloat16, 64, True, True, 0.1, Fix(beta=3.0), "paper:tile=64", None, None)
    with pytest.raises(ValueError, match="causal"):  # 1 == True, but the cache tells them apart
        flash._kernel_options(*options[:3], 1, *options[4:])
    with pytest.raises(ValueError, match="fix"):
        flash._kernel_options(*options[:5], [3.0], *options[6:])


def test_eager_calls_skip_the_custom_ops_dispatch():
    """An eager call runs the forward and backward through an autograd.Function (torch.library's dispatch
    costs ~0.2 ms of host time a call); under torch.compile the custom ops serve
    (test_gpt_compiles_around_the_kernel_without_graph_breaks)."""
    q, k, v = (torch.randn(1, 2, 64, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    o = flash_attention(q, k, v)
    assert type(o.grad_fn).__name__ == "_EagerFlashBackward"
    o.float().sum().backward()
    assert all(t.grad is not None and t.grad.shape == t.shape for t in (q, k, v))


def test_pinned_tiles_are_configs_the_autotuner_tries():
    """A deterministic run launches PINNED tiles: each one of the autotuner's own configs for its head dims,
    within the register budget it applies."""
    from lowprec.attention import flash

    for name, by_dim in flash.PINNED.items():
        _, tuned = flash._KERNELS[name]
        rows = "BLOCK_N" if name == "dkdv" else "BLOCK_M"
        for block_d, pick in by_dim.items():
            kept = flash._kept_configs(tuned.configs, {}, kernel=name, rows=rows, BLOCK_D=block_d)
            assert pick in [flash._config_key(c) for c in kept], (name, block_d, pick)
    assert set(flash.PINNED["fwd"]) == {64, 128, 256}  # 16-64 share the 64 row

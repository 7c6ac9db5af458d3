"""The Triton kernels: bit-identical to emulated_attention under TRITON_INTERPRET=1 (with lowprec's
interpreter patch), within FlashAttention's error rule against float64, and a guard that the patch is
active. On a CUDA machine (TRITON_INTERPRET unset) the interpreter-only tests skip and the others run the
compiled kernels on the GPU."""

import functools
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
from lowprec.attention.triton_rounding import NEAREST, _round
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
}


@on_cpu
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_bit_identical_to_emulator(case):
    shape, dtype, causal, ties, kw = CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    if ties is None:
        q, k, v = (torch.randn(shape, generator=gen).to(dtype) for _ in range(3))
    else:
        q, k, v = tied_qkv(shape, dtype=dtype, seed=len(case), **ties)
    do = torch.randn(shape, generator=gen).to(dtype)
    emulated, triton_out = run_both(q, k, v, do, causal=causal, **kw)
    assert_bit_identical(emulated, triton_out)
    assert all(t.isfinite().all() for t in triton_out[0])
    if "fix" in kw:
        assert triton_out[1].totals()["rows_triggered"] > 0 or ties is None


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
    but the compiler does not."""
    code = "from lowprec.attention.flash import compile_for_gpu; print(compile_for_gpu(90))"
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dkdv" in done.stdout


def test_dispatch_reaches_the_kernel():
    q, k, v = (torch.randn(1, 2, 40, 16).bfloat16().to(DEVICE) for _ in range(3))
    via_dispatch = attention(q, k, v, backend="triton", fix=Fix())
    assert torch.equal(via_dispatch, flash_attention(q, k, v, fix=Fix()))


def test_kernel_value_errors():
    q, k, v = (torch.randn(1, 1, 32, 16, device=DEVICE).bfloat16() for _ in range(3))
    bad_calls = [
        lambda: flash_attention(*(torch.randn(1, 1, 32, 8, device=DEVICE).bfloat16() for _ in range(3))),
        lambda: flash_attention(*(torch.randn(1, 1, 32, 256, device=DEVICE).bfloat16() for _ in range(3))),
        lambda: flash_attention(q.double(), k.double(), v.double()),
        lambda: flash_attention(q, k, v, precision="fa2:output=fp32"),
        lambda: flash_attention(q, k, v, block_m=48),
        lambda: flash_attention(q, k, v, fix=Fix(beta=0.5)),
        lambda: flash_attention(q, k, v, fix=Fix(tol=-1.0)),
    ]
    for call in bad_calls:
        with pytest.raises(ValueError):
            call()


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

"""lowprec.formats: bit-exact against torch casts, an independent float64 reference for the rest, stochastic
rounding statistics, the paper's worked example, and input validation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from lowprec.formats import FORMATS, MODES, Format, add_trace, as_format, bits, round_to, ulp

TORCH_FORMATS = ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2"]
K_BIT_FORMATS = [Format(8, k) for k in range(3, 8)] + [Format(5, 4), Format(4, 3), Format(3, 2), Format(2, 1)]


def as_bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


def assert_bit_equal(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor) -> None:
    bad = as_bits(got) != as_bits(want)
    if bad.any():
        i = bad.nonzero()[0].item()
        pytest.fail(
            f"{bad.sum().item()} mismatches, e.g. x={x[i].item()!r}: "
            f"got {got[i].item()!r}, want {want[i].item()!r}"
        )


def random_finite_fp32(n: int, seed: int) -> torch.Tensor:
    """Uniformly random fp32 bit patterns, non-finite ones dropped (every exponent equally likely)."""
    g = torch.Generator().manual_seed(seed)
    x = (
        torch.randint(-(2**31), 2**31, (n,), generator=g, dtype=torch.int64)
        .to(torch.int32)
        .view(torch.float32)
    )
    return x[torch.isfinite(x)]


def all_values(fmt: Format) -> torch.Tensor:
    """Every finite non-negative value of a torch-backed format, sorted (from all its bit patterns)."""
    width = torch.finfo(fmt.torch_dtype).bits
    patterns = torch.arange(2 ** (width - 1), dtype=torch.int32).to(
        torch.int16 if width == 16 else torch.int8
    )
    values = patterns.view(fmt.torch_dtype).float()
    return values[torch.isfinite(values)].sort().values


def fp32_neighbours(x: torch.Tensor) -> torch.Tensor:
    return torch.cat(
        [x, torch.nextafter(x, torch.full_like(x, math.inf)), torch.nextafter(x, torch.zeros_like(x))]
    )


def boundary_values(fmt: Format) -> torch.Tensor:
    """Every value of fmt, every midpoint (exact ties) and the fp32 numbers next to them, both signs, plus the
    overflow region (max, the overflow tie, far beyond) and fp32's own extremes."""
    v = all_values(fmt)
    mids = (v[1:] + v[:-1]) / 2  # exact in fp32: fmt has <= 10 significand bits
    above = torch.tensor(
        [fmt.max + ulp(torch.tensor([fmt.max]), fmt).item() / 2, fmt.max * 1.5, 1e30, 3.4e38]
    )
    edges = torch.tensor(
        [1.4e-45, 1.1754942e-38, 1.1754944e-38, fmt.min_subnormal / 2, fmt.min_subnormal / 4]
    )
    x = fp32_neighbours(torch.cat([v, mids, above, edges]))
    return torch.cat([x, -x])


def log_uniform(fmt: Format, n: int, seed: int) -> torch.Tensor:
    """Random fp32 values spread evenly over fmt's binades, from below its subnormals to beyond its max."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = math.log2(fmt.min_subnormal) - 2, min(math.log2(fmt.max) + 2, 127.99)  # finite in fp32
    x = torch.exp2(torch.rand(n, generator=g, dtype=torch.float64) * (hi - lo) + lo).float()
    return torch.where(torch.rand(n, generator=g) < 0.5, x, -x)


def reference_round(x: torch.Tensor, fmt: Format, mode: str = "nearest") -> torch.Tensor:
    """Independent reference in float64/numpy: scale |x| onto fmt's integer grid (exact), np.rint (ties to
    even) or np.trunc, scale back. Overflow as documented: inf (nearest), max (toward_zero), max (no_inf)."""
    a = np.abs(x.double().numpy())
    _, e = np.frexp(a)  # a = m * 2**e with m in [0.5, 1)
    q = np.maximum(e - 1, fmt.emin) - fmt.man_bits
    steps = a / np.exp2(q)
    value = (np.rint(steps) if mode == "nearest" else np.trunc(steps)) * np.exp2(q)
    over = fmt.max if (mode == "toward_zero" or fmt.no_inf) else np.inf
    value = np.where(value > fmt.max, over, value)
    return torch.from_numpy(np.copysign(value, x.double().numpy())).float()


@pytest.mark.parametrize("name", TORCH_FORMATS)
def test_nearest_equals_torch_cast(name: str) -> None:
    fmt = FORMATS[name]
    x = torch.cat(
        [random_finite_fp32(2_000_000, seed=1), boundary_values(fmt), log_uniform(fmt, 1_000_000, seed=2)]
    )
    assert_bit_equal(round_to(x, name), x.to(fmt.torch_dtype).float(), x)


def test_special_values() -> None:
    x = torch.tensor([math.inf, -math.inf, math.nan, 0.0, -0.0])
    for name in TORCH_FORMATS:
        got, want = round_to(x, name), x.to(FORMATS[name].torch_dtype).float()
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)), name  # inf -> +-448 for fp8_e4m3
        assert torch.equal(as_bits(got[3:]), as_bits(x[3:])), "signed zeros keep their sign"
    assert round_to(torch.tensor([1e6, -math.inf]), "fp8_e4m3").tolist() == [448.0, -448.0]
    assert round_to(torch.tensor([1e6]), "fp16", "toward_zero").item() == 65504.0
    beyond_max = round_to(torch.full((1000,), 60000.0), "fp8_e5m2", "stochastic")  # neighbours: max and inf
    assert set(beyond_max.tolist()) == {57344.0, math.inf}
    assert set(round_to(torch.full((1000,), 460.0), "fp8_e4m3", "stochastic").tolist()) == {448.0}


def test_reference_agrees_with_torch() -> None:
    """The float64 reference below is itself checked against torch, so it can judge the other formats."""
    for name in TORCH_FORMATS:
        x = log_uniform(FORMATS[name], 200_000, seed=3)
        assert_bit_equal(reference_round(x, FORMATS[name]), x.to(FORMATS[name].torch_dtype).float(), x)


@pytest.mark.parametrize("fmt", [FORMATS["tf32"], FORMATS["fp32"], *K_BIT_FORMATS], ids=str)
@pytest.mark.parametrize("mode", ["nearest", "toward_zero"])
def test_other_formats_match_reference(fmt: Format, mode: str) -> None:
    x = torch.cat([log_uniform(fmt, 300_000, seed=4), random_finite_fp32(300_000, seed=5)])
    grid = round_to(x, fmt, "toward_zero")  # fmt's values near x, their midpoints and fp32 neighbours
    step = ulp(grid, fmt)
    x = torch.cat([x, fp32_neighbours(torch.cat([grid, grid + step / 2 * grid.sign()]))])
    assert_bit_equal(round_to(x, fmt, mode), reference_round(x, fmt, mode), x)


@pytest.mark.parametrize("mode", MODES)
def test_results_are_representable_and_idempotent(mode: str) -> None:
    x = random_finite_fp32(200_000, seed=6)
    for fmt in [*FORMATS.values(), *K_BIT_FORMATS]:
        y = round_to(x, fmt, mode)
        finite = torch.isfinite(y)
        assert_bit_equal(round_to(y[finite], fmt, mode), y[finite], x[finite])
        assert (y[finite].abs() <= fmt.max).all()


def test_toward_zero_truncates() -> None:
    x = log_uniform(FORMATS["bf16"], 200_000, seed=7)
    y = round_to(x, "bf16", "toward_zero")
    assert (y.abs() <= x.abs()).all()
    up = y + ulp(y, "bf16") * x.sign()  # the next value away from zero is beyond x
    assert (up.abs() > x.abs()).all()


@pytest.mark.parametrize(
    "value,name",
    [
        (1 + 2**-10, "bf16"),
        (-3.3, "bf16"),
        (0.1, "fp8_e4m3"),
        (3e-40, "bf16"),
        (1e-6, "fp16"),
        (1000.7, "fp16"),
        (50000.0, "fp8_e5m2"),
        (2.0**-137 * 1.3, "bf16"),
    ],
)
def test_stochastic_is_unbiased(value: float, name: str) -> None:
    """Mean over n draws is within 4 standard errors of x; every draw is one of x's two neighbours, and the
    fraction rounded up matches the distance to the lower neighbour."""
    n = 400_000
    x = torch.full((n,), value)
    lo = round_to(x[:1], name, "toward_zero")
    step = ulp(lo.abs(), name) * math.copysign(1.0, value)
    hi = lo + step
    y = round_to(x, name, "stochastic", generator=torch.Generator().manual_seed(8))
    assert ((y == lo) | (y == hi)).all()
    p = ((x[:1].double() - lo.double()) / step.double()).item()  # probability of rounding away from zero
    sd = abs(step.item()) * math.sqrt(p * (1 - p))
    err = (y.double() - x.double()).mean().item()
    assert abs(err) < 4 * sd / math.sqrt(n), (err, sd)
    assert abs((y == hi).double().mean().item() - p) < 4 * math.sqrt(p * (1 - p) / n) + 2**-31
    assert 0 < p < 1


def test_stochastic_is_reproducible_and_exact_on_grid() -> None:
    x = random_finite_fp32(100_000, seed=9)
    a = round_to(x, "bf16", "stochastic", torch.Generator().manual_seed(1))
    b = round_to(x, "bf16", "stochastic", torch.Generator().manual_seed(1))
    assert torch.equal(as_bits(a), as_bits(b))
    on_grid = round_to(x, "bf16")
    assert_bit_equal(round_to(on_grid, "bf16", "stochastic"), on_grid, x)


def test_stochastic_is_unbiased_on_many_values() -> None:
    """Summed over many different values the stochastic error stays within 4 standard errors of 0, while
    truncation is biased by about half an ulp per value."""
    x = log_uniform(FORMATS["fp16"], 500_000, seed=10).abs().clamp(max=60000.0)
    y = round_to(x, "fp16", "stochastic", torch.Generator().manual_seed(11))
    step = ulp(round_to(x, "fp16", "toward_zero"), "fp16").double()
    rel = (y.double() - x.double()) / step
    assert abs(rel.mean().item()) < 4 * rel.std().item() / math.sqrt(len(x))
    trunc = ((round_to(x, "fp16", "toward_zero").double() - x.double()) / step).mean().item()
    assert -0.55 < trunc < -0.45


def test_paper_worked_example() -> None:
    t = add_trace(-2.40625, -2.296875, "bf16", residual=-0.0008654594421386719)
    assert float(t.exact) == -4.703990459442139
    assert t.rounded == -4.71875
    assert t.error == -0.014759540557861328
    assert (t.guard, t.sticky, t.carry) == (1, 1, True)
    assert str(bits(-2.40625, "bf16")) == "1 10000000 0011010"
    assert str(t.exact_bits) == "1 10000001 0010110 | 1 000011100010111"
    assert str(t.rounded_bits) == "1 10000001 0010111"
    tie = add_trace(-2.40625, -2.296875, "bf16")
    assert (tie.guard, tie.sticky, tie.rounded, tie.error) == (1, 0, -4.6875, 0.015625)


def test_add_trace_matches_round_to() -> None:
    """add_trace's exact rounding agrees with round_to wherever the sum is an fp32 number."""
    g = torch.Generator().manual_seed(12)
    ab = round_to(torch.randn(200, 2, generator=g) * 3, "bf16")
    for (a, b), fmt in zip(ab.tolist(), ["bf16", "fp16", "fp8_e4m3", "tf32", Format(8, 4)] * 40, strict=True):
        t = add_trace(a, b, fmt)
        exact = torch.tensor([a + b])  # a + b is exact in fp32 here: two bf16 values of similar size
        assert t.rounded == round_to(exact, fmt).item()
        assert t.toward == round_to(exact, fmt, "toward_zero").item()
        assert t.p_away == 0 or t.away == t.toward + ulp(exact.abs(), fmt).item() * math.copysign(1, a + b)
        assert str(t.rounded_bits) == str(bits(t.rounded, fmt))


def test_bits_matches_torch_bit_patterns() -> None:
    patterns = torch.randint(
        0, 2**16, (3000,), generator=torch.Generator().manual_seed(13), dtype=torch.int32
    )
    values = patterns.to(torch.int16).view(torch.bfloat16).float()
    for pattern, value in zip(patterns.tolist(), values.tolist(), strict=True):
        if math.isfinite(value):
            want = f"{pattern >> 15} {(pattern >> 7) & 0xFF:08b} {pattern & 0x7F:07b}"
            assert str(bits(value, "bf16")) == want
    assert str(bits(448.0, "fp8_e4m3")) == "0 1111 110"
    assert str(bits(-math.inf, "fp16")) == "1 11111 0000000000"


def test_format_properties() -> None:
    e4m3 = FORMATS["fp8_e4m3"]
    assert (e4m3.max, e4m3.min_normal, e4m3.min_subnormal, e4m3.torch_dtype) == (
        448.0,
        2**-6,
        2**-9,
        torch.float8_e4m3fn,
    )
    for name in TORCH_FORMATS:
        fmt, info = FORMATS[name], torch.finfo(FORMATS[name].torch_dtype)
        assert (fmt.max, fmt.min_normal, fmt.min_subnormal, fmt.eps) == (
            info.max,
            info.tiny,
            info.smallest_normal * fmt.eps,
            info.eps,
        )
    assert FORMATS["tf32"].torch_dtype is None and FORMATS["tf32"].eps == 2**-10
    assert as_format("bf16") is FORMATS["bf16"] and Format(8, 7) == FORMATS["bf16"]
    assert ulp(torch.tensor([1.0, 3.0, 0.0]), "bf16").tolist() == [2**-7, 2**-6, 2**-133]


@pytest.mark.parametrize(
    "call,words",
    [
        (lambda: round_to(torch.arange(3), "bf16"), ["x", "float32"]),
        (lambda: round_to(torch.ones(3, dtype=torch.float64), "bf16"), ["x", "float32"]),
        (lambda: round_to([1.0], "bf16"), ["x", "float32"]),
        (lambda: round_to(torch.ones(3), "bfloat16"), ["fmt", "bf16", "fp8_e4m3"]),
        (lambda: round_to(torch.ones(3), "bf16", mode="up"), ["mode", "stochastic", "toward_zero"]),
        (lambda: round_to(torch.ones(3), "bf16", "stochastic", 42), ["generator", "torch.Generator"]),
        (lambda: Format(9, 7), ["exp_bits", "2..8"]),
        (lambda: Format(8, 0), ["man_bits", "1..23"]),
        (lambda: bits(1.1, "bf16"), ["x", "round_to"]),
        (lambda: add_trace(1.0, math.nan, "bf16"), ["b", "finite"]),
        (lambda: add_trace(400.0, 200.0, "fp8_e4m3"), ["beyond the range", "448"]),
    ],
)
def test_bad_input_raises_value_error(call, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        call()
    assert all(w in str(info.value) for w in words), str(info.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu() -> None:
    x = random_finite_fp32(1_000_000, seed=14)
    for name in TORCH_FORMATS:
        assert_bit_equal(round_to(x.cuda(), name).cpu(), round_to(x, name), x)
    g = torch.Generator(device="cuda").manual_seed(0)
    y = round_to(x.cuda(), "bf16", "stochastic", generator=g).cpu()
    lo = round_to(x, "bf16", "toward_zero")
    assert ((y == lo) | (y == lo + ulp(lo, "bf16") * x.sign())).all()

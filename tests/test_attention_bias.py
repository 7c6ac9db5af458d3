"""Signed bias of the emulated flash-attention forward on adversarial rows (lowprec.instruments.bias).

Each measurement uses 20,480 seeded rows (320 heads x 64 queries); t-statistics count rows, so |t| > 10 is a
bias far beyond chance and |t| < 5 is indistinguishable from none at this size.
"""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch
from lowprec.attention import Fix, Precision, Rounding
from lowprec.attention.emulated import emulated_attention
from lowprec.instruments.bias import (
    CASES,
    NEAR_WINDOW,
    SEQ,
    BiasResult,
    Case,
    ErrorStats,
    adversarial_inputs,
    bias_table,
    biased,
    dominant_key_scale_error,
    format_table,
    measure_bias,
)
from lowprec.instruments.explode import ARMS

ROWS = 20_480


def emulated(precision: Precision | str = "fa2", fix: Fix | None = None, seed: int | None = None):
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return functools.partial(emulated_attention, causal=False, precision=precision, fix=fix, generator=gen)


def truncating_fa2() -> Precision:
    """fa2 with P̄ rounded toward zero (what an unpatched Triton interpreter does to every bf16 cast)."""
    weights = Rounding("bf16")
    # workaround: precision.ROUNDING_MODES lacks "toward_zero" although lowprec.formats.round_to supports it
    object.__setattr__(weights, "mode", "toward_zero")
    return Precision(weights=weights, output="input")


def scores_of(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The fp32 scores a kernel sees: fp32 dot of the bf16 inputs (exact here), times the fp32 scale."""
    scale = float(torch.tensor(1 / math.sqrt(q.shape[-1])))
    return (q.double() @ k.double().transpose(-1, -2)).float() * scale


def test_inputs_have_the_case_structure():
    for name, ties in (("unique", 1), ("exact-k4", 4), ("exact-k8", 8)):
        q, k, v, do = adversarial_inputs(CASES[name], rows=1000, seed=3)
        assert q.dtype == k.dtype == v.dtype == torch.bfloat16 and do.dtype == torch.float32
        assert q.shape == (1, 16, SEQ, 2 * SEQ)
        s = scores_of(q, k)
        top = s.amax(-1, keepdim=True)
        assert ((s == top).sum(-1) == ties).all(), name  # exact ties are bit-exact in fp32
        assert ((s > top - 0.04).sum(-1) == ties).all(), name  # everything else is well below
    s = scores_of(*adversarial_inputs(CASES["near-k4"], rows=1000, seed=3)[:2])
    top = s.amax(-1, keepdim=True)
    assert ((s > top - NEAR_WINDOW).sum(-1) == 4).all()
    assert ((s == top).sum(-1) == 1).all()  # near-ties are distinct from the max
    assert (top > 0).all() and (s.amax(-1) < 3.01).all()
    neg = scores_of(*adversarial_inputs(CASES["near-k4-neg"], rows=1000, seed=3)[:2])
    assert (neg.amax(-1) < 0).all()


def test_inputs_are_seeded_and_validated():
    a = adversarial_inputs(CASES["near-k4"], rows=100, seed=7)
    b = adversarial_inputs(CASES["near-k4"], rows=100, seed=7)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    with pytest.raises(ValueError, match="scores"):
        Case("bad", scores="almost")
    with pytest.raises(ValueError, match="ties"):
        Case("bad", "exact", ties=1)
    with pytest.raises(ValueError, match="max_range"):
        Case("bad", max_range=(-1.0, 1.0))
    with pytest.raises(ValueError, match="case must be"):
        measure_bias("reference", "no-such-case")
    with pytest.raises(ValueError, match="impl must be"):
        measure_bias(42, "unique", rows=64)


def test_stats_and_json():
    stats = ErrorStats.of(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert stats.mean == 2.5 and stats.n == 4 and stats.t == pytest.approx(2.5 / (stats.std / 2))
    result = measure_bias("reference", "unique", rows=640)
    assert isinstance(result, BiasResult) and result.rows == 640 and result.nonfinite == 0
    back = json.loads(json.dumps(result.to_dict()))
    assert back["o"]["n"] == 640 and back["case"] == "unique" and back["impl"] == "reference"
    assert "reference" in format_table([result])


def test_near_max_bias_in_fa2_and_the_fix_removes_it():
    plain, fixed = bias_table({"fa2": emulated(), "fa2+fix": emulated(fix=Fix())}, ["near-k4"], rows=ROWS)
    # P̄ just below 1 rounds up to 1.0: near-max keys are over-weighted, O moves toward V's sign (negative)
    assert plain.o.t < -10 and plain.delta.t > 10, format_table([plain])
    assert abs(fixed.o.t) < 5 and abs(fixed.delta.t) < 5, format_table([fixed])


def test_fa2_unbiased_with_unique_max_or_exact_ties():
    results = bias_table({"fa2": emulated()}, ["unique", "exact-k4"], rows=ROWS)
    for r in results:
        assert abs(r.o.t) < 5 and abs(r.delta.t) < 5, format_table(results)


def test_paper_placement_is_biased_even_with_a_unique_max():
    # triton-cpu.md §4: V ~ N(-1, 0.5^2), unique max: O biased negative, δ positive (bf16 l, P̄V, running O)
    r = measure_bias(emulated("paper"), "unique-v-1", rows=ROWS, name="paper")
    assert r.o.t < -10 and r.delta.t > 10, format_table([r])


def test_stochastic_rounding_of_pbar_removes_the_bias():
    r = measure_bias(emulated("fa2:weights=bf16@stochastic", seed=1), "near-k4", rows=ROWS, name="fa2-sr")
    assert abs(r.o.t) < 5 and abs(r.delta.t) < 5, format_table([r])


def test_ones_window_amplifies_the_near_tie_bias_and_the_fix_removes_it():
    # near-ties 1e-3..2.3e-2 below the max: bf16 P̄ mostly keeps them below 1 (little bias); e8m3@ones rounds
    # every P̄ >= 1 - 2^-5 up to 1, the paper's error with a wider window; the Fix (tol from e8m3) removes it
    table = bias_table(
        {"fa2": emulated(), "ones": emulated("fa2:weights=e8m3@ones"),
         "ones+fix": emulated("fa2:weights=e8m3@ones", Fix())},
        ["near-k4-wide"], rows=ROWS)
    fa2, ones, fixed = table
    assert abs(fa2.o.t) < 5 and abs(fa2.delta.t) < 5, format_table(table)
    assert ones.o.t < -10 and ones.delta.t > 10, format_table(table)
    assert abs(fixed.o.t) < 5 and abs(fixed.delta.t) < 5, format_table(table)
    unique = measure_bias(emulated("fa2:weights=e8m3@ones"), "unique", rows=ROWS, name="ones-unique")
    assert abs(unique.o.t) < 5 and abs(unique.delta.t) < 5, format_table([unique])


def test_truncating_pbar_is_catastrophically_biased():
    r = measure_bias(emulated(truncating_fa2()), "unique", rows=ROWS, name="fa2-trunc")
    # every P̄ loses up to one ulp downward while l keeps the fp32 sum: O shrinks toward zero (V < 0)
    assert r.o.t > 100 and r.delta.t < -100, format_table([r])


def test_failed_checks_are_rerun_with_sdpa():
    """A failure's config and seed are checked again with SDPA's kernels in place of ours: ratios where the
    kernel runs (its flash kernel has a CPU version), a one-line reason where it does not."""
    from lowprec.instruments.gpu_suite import Check, check, recheck

    c = Check(1, 2, 40, 16, False, v_mean=3.0)
    again = recheck(c, 3, "cpu")
    assert set(again) == {"flash", "efficient"}
    assert again["flash"] == check(c, 3, "cpu", sdpa_backend="flash")["ratio"]
    assert set(again["flash"]) == {"o", "dq", "dk", "dv"}
    assert isinstance(again["efficient"], dict) or "\n" not in again["efficient"]


def test_gpu_suite_correctness_and_fuzz_run_on_cpu(tmp_path):
    """The GPU suite's correctness and fuzz sections at toy sizes, through Triton's interpreter (real numbers
    need a GPU; its bias section and the benchmark run in tests/test_remeasure.py, through chapter 2's
    re-measurement)."""
    from lowprec.cli import main as lowprec_main

    assert lowprec_main(["measure", "suite", "--out", str(tmp_path), "--smoke", "--sections",
                         "correctness,fuzz", "--fuzz", "2"]) == 0
    suite = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert suite["provenance"]["git_commit"] and suite["errors"] == []
    assert all(r["pass"] for r in suite["correctness"]) and suite["fuzz"]["configs"] == 2


def test_bf16_row_sum_swamps_the_tiles_after_a_dominant_key():
    """A running row sum kept in bf16 rounds away (or up by a whole ulp) the small sums of the tiles after a
    dominant key: O's scale is off by percents, one sign per concentration; not with the key in the last tile,
    and not with fa2's fp32 row sum."""
    rowsum = functools.partial(emulated_attention, causal=False, precision=ARMS["bf16rowsum"])
    fa2 = functools.partial(emulated_attention, causal=False, precision="fa2")
    for score, sign in ((10.0, -1), (11.0, 1)):
        first = dominant_key_scale_error(rowsum, score, position=0, heads=2)
        assert sign * first.scale.mean > 0.01 and sign * first.scale.t > 50, first
        assert abs(dominant_key_scale_error(fa2, score, position=0, heads=2).scale.mean) < 2e-4
        assert abs(dominant_key_scale_error(rowsum, score, position=1000, heads=2).scale.mean) < 1e-3
    with pytest.raises(ValueError, match="position"):
        dominant_key_scale_error(rowsum, 1.0, position=1024)


def test_biased_is_the_books_one_threshold_on_either_error():
    """|t| >= BIASED_T (4) for the O error or the δ error, either sign, the threshold itself included."""
    def result(t_o: float, t_delta: float) -> BiasResult:
        return BiasResult("impl", "case", ErrorStats(0.0, 1.0, t_o, 8), ErrorStats(0.0, 1.0, t_delta, 8), 8)

    assert biased(result(4.0, 0.0)) and biased(result(0.0, -4.0)) and biased(result(-9.0, 9.0))
    assert not biased(result(3.99, -3.99)) and not biased(result(0.0, 0.0))

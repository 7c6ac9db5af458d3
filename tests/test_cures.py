"""Cures on one harness (lowprec.instruments.cures): rows with continuous, bf16-grid and shared maxima, the
cures' harness callables, the Fix's own bias at a shared maximum, and the positive control for any cure."""

from __future__ import annotations

import json
import math

import pytest
import torch
from lowprec.analysis import BIASED_T, ErrorStats
from lowprec.attention import Fix, Precision, emulated_attention
from lowprec.attention.flash import INTERPRET
from lowprec.cli import main as lowprec_main
from lowprec.formats import FORMATS, round_to
from lowprec.instruments import cures as cures_module
from lowprec.instruments.bias import CASES, bias_of
from lowprec.instruments.control import ControlConfig, train_treatment
from lowprec.instruments.cures import (
    CURES,
    FAMILIES,
    SCALE,
    Cure,
    Family,
    cure_rows,
    cure_table,
    failure_map,
    pinned,
    row_errors,
    top_weight_error,
    train_cure,
)

BF16 = FORMATS["bf16"]


def scores(rows) -> torch.Tensor:
    """The fp32 scores the kernel computes on `rows` (exact dot of bf16 inputs, times SCALE), one per row."""
    s = (rows.q.double() @ rows.k.double().transpose(-1, -2)).float() * SCALE
    return s.flatten(0, 2)[: rows.rows]


def biased(result) -> bool:
    return max(abs(result.o.t), abs(result.delta.t)) >= BIASED_T


def test_row_maxima_are_exact_scores():
    grid = scores(cure_rows(CASES["exact-k4"], rows=1000, seed=3, maxima="bf16"))
    top = grid.amax(-1)
    assert torch.equal(top, round_to(top, BF16)) and top.min() >= 1 and top.max() <= 3
    assert ((grid == top[:, None]).sum(-1) == 4).all()  # the ties stay exact
    fixed = scores(cure_rows(CASES["near-k4"], rows=128, maxima=(0.5, 5.0)))
    assert (fixed.amax(-1)[:64] == 0.5).all() and (fixed.amax(-1)[64:] == 5.0).all()
    near = fixed - fixed.amax(-1, keepdim=True)
    assert ((near > -1e-3) & (near < 0)).sum(-1).eq(3).all()  # three near ties below each maximum
    assert not torch.equal(scores(cure_rows(CASES["unique"], rows=64)).amax(-1),
                           round_to(scores(cure_rows(CASES["unique"], rows=64)).amax(-1), BF16))


@pytest.mark.parametrize("bad", [{"maxima": "grid"}, {"maxima": (1.0, 2.0, 3.0), "rows": 64},
                                 {"case": "random"}, {"rows": 0}])
def test_cure_rows_rejects_bad_arguments(bad):
    kw = {"case": "exact-k4", "rows": 64, "maxima": "continuous"} | bad
    with pytest.raises(ValueError):
        cure_rows(kw.pop("case"), **kw)


def test_pinned_rounds_fp32_copies_like_the_inputs():
    p = pinned("fa2:weights=bf16@stochastic", torch.bfloat16)
    assert p.weights.fmt == BF16 and p.weights.mode == "stochastic" and p.output.fmt == BF16
    assert pinned("fa2:output=none", torch.bfloat16).output.fmt is None
    assert all(getattr(pinned("paper", torch.bfloat16), point).fmt == BF16 for point in ("scores", "rowsum"))


def test_fp32_store_cure_measures_the_unrounded_output():
    rows = cure_rows(CASES["near-k4"], rows=256)
    cure = Cure("fp32 O", "fa2:output=none")
    assert cure.fp32_store and not Cure("fa2").fp32_store
    o = cure.impl()(rows.q, rows.k, rows.v)
    assert o.dtype == torch.float32
    fa2 = emulated_attention(rows.q, rows.k, rows.v, causal=False, scale=SCALE)
    assert torch.equal(round_to(o, BF16), fa2.float()) and not torch.equal(o, fa2.float())


def test_cure_validates_its_precision():
    with pytest.raises(ValueError):
        Cure("bad", "fa2:weights=nonsense")
    assert len({c.name for c in CURES}) == len(CURES) and len({f.name for f in FAMILIES}) == len(FAMILIES)


def test_row_errors_agree_with_bias_of():
    rows = cure_rows(CASES["near-k4"], rows=512)
    impl = Cure("fa2").impl()
    o_err, d_err = row_errors(impl, rows)
    result = bias_of(impl, rows)
    assert ErrorStats.of(o_err) == result.o and ErrorStats.of(d_err) == result.delta


def test_top_weight_error():
    x = math.exp(-1.0)
    expected = float(round_to(torch.tensor([x]), BF16).double() / torch.tensor([x]).float().double() - 1)
    assert top_weight_error(2.0, 1.0) == expected and 0 < abs(expected) < 2**-8
    assert top_weight_error(3.0, 0.5) == top_weight_error(2.0, 1.0)  # only (beta - 1) r matters
    assert top_weight_error(2.0, 8 * math.log(2)) == pytest.approx(0, abs=1e-6)  # 2^-8 is a bf16 number


def test_the_fix_is_biased_where_rows_share_their_maximum():
    fmap = failure_map([2.0], [5.0, 1.0], rows=2048)
    for j, r in enumerate((5.0, 1.0)):
        o_t, d_t = fmap["o_t"][0][j], fmap["delta_t"][0][j]
        assert abs(o_t) >= BIASED_T and o_t * top_weight_error(2.0, r) < 0 and o_t * d_t < 0, r
    sinks = Family("exact, r = 5", CASES["exact-k4"], 5.0)
    spread = Family("exact, r continuous", CASES["exact-k4"])
    result = {(r.impl, r.case): r for r in cure_table([Cure("fa2"), Cure("Fix", fix=Fix()),
                                                        Cure("consistent + Fix", "consistent", Fix())],
                                                       [sinks, spread], rows=2048)}
    assert biased(result["Fix", sinks.name]) and not biased(result["Fix", spread.name])
    assert not biased(result["fa2", sinks.name]) and not biased(result["consistent + Fix", sinks.name])


def test_consistent_removes_the_near_tie_bias():
    near = Family("near", CASES["near-k4"])
    cures = [Cure("fa2"), Cure("consistent", "consistent")]
    result = {r.impl: r for r in cure_table(cures, [near], rows=4096)}
    assert result["fa2"].o.t <= -BIASED_T and result["fa2"].delta.t >= BIASED_T
    assert not biased(result["consistent"])


def test_train_cure_is_a_run_of_the_positive_control():
    """A cure trains on the treatments' init and data: the fa2 cure is fa2's lowp treatment; stochastic
    rounding is reproducible (its own seeded bits) and departs from rounding to nearest."""
    cfg = ControlConfig(steps=6)
    lowp = train_treatment(cfg, "fa2", "lowp")["series"]["w_r"]
    assert train_cure(cfg, Cure("fa2"))["series"]["w_r"] == lowp
    stochastic = Cure("stochastic", "fa2:weights=bf16@stochastic")
    first, again = train_cure(cfg, stochastic)["series"]["w_r"], train_cure(cfg, stochastic)["series"]["w_r"]
    assert first == again and first != lowp


def test_train_cure_runs_any_precision():
    cfg = ControlConfig(steps=3)
    s = train_cure(cfg, Cure("stochastic", "fa2:weights=bf16@stochastic"))
    assert len(s["series"]["w_r"]) == 3 and s["summary"]["collapse_step"] is None
    assert Precision.parse("consistent").norm == "rounded"
    with pytest.raises(ValueError):
        train_cure(cfg, Cure("fa2"), optimizer="lion")


@pytest.mark.skipif(not INTERPRET, reason="bit identity holds under the Triton interpreter")
def test_kernel_cures_are_the_emulator_bit_for_bit():
    """Every deterministic cure gives the same rows through our Triton kernel as through the emulator (the
    kernel's stochastic bits are its own seeded hash, not the emulator's generator)."""
    family = [FAMILIES[2]]
    deterministic = [c for c in CURES if not Precision.parse(c.precision).stochastic()]
    assert deterministic != list(CURES)
    kernel = cure_table(deterministic, family, rows=64, kernel=True)
    assert cure_table(deterministic, family, rows=64) == kernel


@pytest.mark.skipif(not INTERPRET, reason="the CPU path runs the kernel in the Triton interpreter")
def test_measure_cures_records_bias_and_cost(tmp_path, monkeypatch, capsys):
    picked = (CURES[0], CURES[1], next(c for c in CURES if c.fp32_store))
    monkeypatch.setattr(cures_module, "CURES", picked)
    monkeypatch.setattr(cures_module, "FAMILIES", FAMILIES[:1])
    assert lowprec_main(["measure", "cures", "--out", str(tmp_path), "--smoke"]) == 0
    record = json.loads((tmp_path / "cures.json").read_text())
    assert [r["impl"] for r in record["bias"]] == [c.name for c in picked] and record["bias_errors"] == {}
    assert record["provenance"]["torch"] and set(record["seconds"]) == {"bias", "cost"}
    assert set(record["configs"]) == {"fwd", "dkdv", "dq"}  # the picks (none under the interpreter)
    cost = {(r["cure"], r["causal"]): r for r in record["cost"]}
    assert set(cost) == {(c.name, causal) for c in picked for causal in (False, True)}
    assert cost["none (fa2)", True]["fwd+bwd_vs_fa2"] == 1.0 and cost["Fix", False]["fwd_ms"] > 0
    assert "must fit in q's dtype" in cost[picked[2].name, True]["error"]  # the kernel stores O in bf16
    assert lowprec_main(["measure", "cures", "--out", str(tmp_path), "--smoke", "--rows", "0"]) == 2
    assert capsys.readouterr().err.strip().endswith("--rows must be >= 1, got 0")

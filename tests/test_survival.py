"""Survival statistics of many runs (lowprec.analysis): synthetic records and a textbook data set."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch
from lowprec import analysis
from lowprec.analysis import (
    Outcome,
    detection_power,
    event_times,
    fisher_p,
    kaplan_meier,
    log_rank,
    log_rank_range,
    lr_sweep,
    outcome,
    sign_test,
    stratified_p,
    survival_table,
    wilson,
)
from lowprec.runs import Run
from lowprec.viz.plots import lr_figure

# Freireich et al. (1963), remission times in weeks: 6-MP (False = censored) against placebo; the log-rank
# chi² of these two groups is 16.79 (Cox & Oakes; every survival-analysis textbook) and the Kaplan-Meier
# curve of 6-MP is 0.857, 0.807, 0.753, 0.690, 0.627, 0.538, 0.448 at weeks 6, 7, 10, 13, 16, 22, 23.
MP6 = ([6, 6, 6, 7, 10, 13, 16, 22, 23, 6, 9, 10, 11, 17, 19, 20, 25, 32, 32, 34, 35],
       [True] * 9 + [False] * 12)
PLACEBO = ([1, 1, 2, 2, 3, 4, 4, 5, 5, 8, 8, 8, 8, 11, 11, 12, 12, 15, 17, 22, 23], [True] * 21)


def test_kaplan_meier_matches_the_textbook_curve() -> None:
    curve = kaplan_meier(*MP6)
    assert [t for t, _ in curve] == [0, 6, 7, 10, 13, 16, 22, 23]
    assert [round(s, 3) for _, s in curve] == [1.0, 0.857, 0.807, 0.753, 0.690, 0.627, 0.538, 0.448]


def test_log_rank_matches_the_textbook_chi_square() -> None:
    """21 runs against 21: more splits than LOG_RANK_SPLITS, so p over random splits (seeded), near chi²'s
    4.17e-5 at this many runs."""
    chi2, p = log_rank(MP6, PLACEBO)
    assert chi2 == pytest.approx(16.79, abs=0.01)
    assert 1e-5 < p < 2e-4 and log_rank(MP6, PLACEBO)[1] == p  # seeded: the same p again
    assert log_rank(PLACEBO, MP6)[0] == pytest.approx(chi2) and 1e-5 < log_rank(PLACEBO, MP6)[1] < 2e-4
    assert log_rank(([5, 5], [False, False]), ([5], [False])) == (0.0, 1.0)  # no event anywhere


def test_log_rank_range_covers_every_outcome_of_the_runs_to_come() -> None:
    """Two runaways against one calm run, one run of b still to come: its every outcome, step by step (each
    step before the horizon, or none by it), gives p between the range's ends, and both ends are reached."""
    a, b, horizon = ([10, 20], [True, True]), ([30], [False]), 30
    brute = [log_rank(a, ([30, t], [False, t < horizon]))[1] for t in range(horizon + 1)]
    assert log_rank_range(a, b, 0, 1, horizon) == (min(brute), max(brute))
    calm, early = log_rank(a, ([30, 30], [False, False]))[1], log_rank(a, ([30, 0], [False, True]))[1]
    assert min(brute) == calm < max(brute) == early
    assert log_rank_range(a, b, 0, 0, horizon) == (log_rank(a, b)[1],) * 2  # nothing to come: the p itself
    both = [log_rank(([10, 20, s], [True, True, s < horizon]), ([30, t], [False, t < horizon]))[1]
            for s in range(horizon + 1) for t in range(horizon + 1)]
    assert log_rank_range(a, b, 1, 1, horizon) == (min(both), max(both))
    with pytest.raises(ValueError, match="more runs"):
        log_rank_range(a, b, 8, 8, horizon, limit=100)


def test_log_rank_range_is_kept_per_arguments(monkeypatch) -> None:
    """A range asked for again (as lists or as tuples) comes back without a new `log_rank`; other arguments
    compute theirs."""
    a, b = ([10, 20, 25], [True, True, False]), ([30], [False])
    first = log_rank_range(a, b, 1, 1, 30)
    monkeypatch.setattr(analysis, "log_rank", lambda *_: pytest.fail("computed again"))
    assert log_rank_range(a, b, 1, 1, 30) == first == log_rank_range(tuple(map(tuple, a)), b, 1, 1, 30)
    with pytest.raises(pytest.fail.Exception, match="computed again"):
        log_rank_range(a, b, 1, 2, 30)


def test_tied_runs_count_as_the_splits_they_stand_for() -> None:
    """`log_rank` counts the splits of tied runs (same step, same event) by composition, each weighted by how
    many splits it stands for: the same chi² and p as every split one by one, from far fewer statistics."""
    ways, weight = analysis.log_rank_compositions((8, 1, 1, 1, 5), 8)  # 8 calm, 3 runaways, 5 calm at 2,000
    assert int(weight.sum()) == math.comb(16, 8) and len(ways) < 100 and (ways.sum(1) == 8).all()
    rng = torch.Generator().manual_seed(0)
    for _ in range(40):
        runs = int(torch.randint(2, 13, (1,), generator=rng))
        size = int(torch.randint(1, runs, (1,), generator=rng))
        times = torch.randint(0, 4, (runs,), generator=rng).mul(100).tolist()  # four steps: many ties
        events = [bool(x) for x in torch.randint(0, 2, (runs,), generator=rng)]
        every = torch.zeros(math.comb(runs, size), runs, dtype=torch.bool)
        for row, members in enumerate(itertools.combinations(range(runs), size)):
            every[row, list(members)] = True
        chi2 = analysis.log_rank_statistic(times, events, torch.arange(runs)[None, :] < size).item()
        hits = int((analysis.log_rank_statistic(times, events, every) >= chi2 * (1 - 1e-9)).sum())
        a, b = (times[:size], events[:size]), (times[size:], events[size:])
        assert log_rank(a, b) == ((chi2, hits / len(every)) if any(events) else (0.0, 1.0)), (a, b)


def test_log_rank_is_exact_for_few_runs() -> None:
    """Few runs: p is the share of the pooled runs' splits whose chi² is at least the observed one. 2 against
    2 runs, every event of one group first: the 2 extreme of 6 splits; 8 against 8: 2 of 12,870; events at one
    step only: Fisher's exact test (the tea-tasting table, 34/70); 2 of 8 runaways against none: Fisher's
    7/15, where chi²'s approximation (0.14) would overstate the evidence threefold."""
    first, last = ([1, 2], [True, True]), ([3, 4], [True, True])
    assert log_rank(first, last)[1] == pytest.approx(2 / 6) == log_rank(last, first)[1]
    early, calm = ([100 * i for i in range(1, 9)], [True] * 8), ([8000] * 8, [False] * 8)
    assert log_rank(early, calm)[1] == pytest.approx(2 / 12870)
    tea = log_rank(([10, 10, 10, 20], [True, True, True, False]),
                   ([10, 20, 20, 20], [True, False, False, False]))
    assert tea[1] == pytest.approx(fisher_p(3, 4, 1, 4)) == pytest.approx(34 / 70)
    two = ([3000, 6650] + [8000] * 6, [True, True] + [False] * 6)
    chi2, p = log_rank(two, calm)
    assert p == pytest.approx(fisher_p(2, 8, 0, 8)) == pytest.approx(7 / 15)
    assert math.erfc(math.sqrt(chi2 / 2)) < 0.15 < p


def test_fisher_exact_matches_hand_counts() -> None:
    """Two-sided p by the hypergeometric tables: Fisher's tea-tasting table (3 of 4 against 1 of 4: 34/70),
    3 of 3 against 0 of 3 (2/20) and 0 of 8 against 5 of 8 (112/4368)."""
    assert fisher_p(3, 4, 1, 4) == pytest.approx(34 / 70)
    assert fisher_p(3, 3, 0, 3) == pytest.approx(0.1)
    assert fisher_p(0, 8, 5, 8) == pytest.approx(112 / 4368)
    assert fisher_p(2, 5, 2, 5) == pytest.approx(1.0) and fisher_p(0, 3, 0, 5) == 1.0
    assert fisher_p(5, 8, 0, 8) == fisher_p(0, 8, 5, 8)
    with pytest.raises(ValueError, match="k <= n"):
        fisher_p(4, 3, 0, 3)


def test_sign_test_counts_coin_flips() -> None:
    """3 of 3 one way: 2/8; 9 of 10: 2 * 11/1024; 5 of 10 (or 0 of 0): 1; k is checked."""
    assert sign_test(3, 3) == sign_test(0, 3) == 0.25
    assert sign_test(9, 10) == sign_test(1, 10) == pytest.approx(22 / 1024)
    assert sign_test(5, 10) == sign_test(0, 0) == 1.0
    with pytest.raises(ValueError, match="0 <= k <= n"):
        sign_test(4, 3)


def test_stratified_p_counts_a_seed_once() -> None:
    """Within seeds: 4 seeds of 2 of 2 runaways against 0 of 1 (under equal rates a seed's one survivor is
    each of its 3 runs alike: p = (1/3)^4 = 1/81, where Fisher's test of the pooled 8 of 8 against 0 of 4
    gives 1/495); a seed with one group only, or with an event in every run, tells nothing; one stratum is
    Fisher's test; and the p equals a brute-force count over every placement of each seed's events."""
    assert stratified_p([(2, 2, 0, 1)] * 4) == pytest.approx(1 / 81)
    assert fisher_p(8, 8, 0, 4) == pytest.approx(1 / 495)
    assert stratified_p([(1, 1, 0, 2), (1, 1, 0, 2), (1, 1, 0, 1), (1, 1, 0, 0)]) == pytest.approx(1 / 18)
    assert stratified_p([(2, 2, 0, 1), (2, 2, 1, 1), (0, 3, 0, 2)]) == pytest.approx(1 / 3)
    for table in ((3, 4, 1, 4), (3, 3, 0, 3), (0, 8, 5, 8), (2, 5, 2, 5)):
        assert stratified_p([table]) == pytest.approx(fisher_p(*table))
    strata = [(2, 3, 0, 2), (1, 2, 1, 3), (3, 3, 1, 2)]
    sums: dict[int, int] = {}  # the first group's events summed over strata, over every placement of events
    for picks in itertools.product(*(itertools.combinations(range(n1 + n2), k1 + k2)
                                     for k1, n1, k2, n2 in strata)):
        total = sum(sum(i < n1 for i in pick) for pick, (_, n1, _, _) in zip(picks, strata, strict=True))
        sums[total] = sums.get(total, 0) + 1
    count = sum(sums.values())
    observed = sums[sum(k1 for k1, *_ in strata)]
    assert stratified_p(strata) == pytest.approx(sum(n for n in sums.values() if n <= observed) / count)
    with pytest.raises(ValueError, match="stratified_p needs"):
        stratified_p([(3, 2, 0, 1)])


def test_detection_power_is_exact() -> None:
    """Every-count sums: all against none is told apart surely from 4 runs each (p = 2/70), never with 3
    (p = 0.1); equal rates are told apart at most `alpha` of the time; power grows with runs."""
    assert detection_power(1.0, 0.0, 4) == pytest.approx(1.0)
    assert detection_power(1.0, 0.0, 3) == 0.0
    assert all(detection_power(rate, rate, n) <= 0.05 for rate in (0.2, 0.5) for n in (6, 8, 12))
    powers = [detection_power(0.6, 0.0, n) for n in (4, 6, 8, 12)]
    assert powers == sorted(powers) and powers[0] < 0.5 < powers[-1]
    one = 0.6 ** 4 * 1.0  # n = 4: only 4 of 4 against 0 of 4 reaches p <= 0.05 (2/70)
    assert detection_power(0.6, 0.0, 4) == pytest.approx(one)
    with pytest.raises(ValueError, match="rates in"):
        detection_power(1.5, 0.0, 4)


def test_wilson_interval() -> None:
    assert wilson(0, 7) == pytest.approx((0.0, 3.8415 / (7 + 3.8415)), abs=1e-4)  # z²/(n+z²) at k=0
    lo, hi = wilson(3, 3)
    assert hi == 1.0 and lo == pytest.approx(1 - 3.8415 / (3 + 3.8415), abs=1e-4)
    lo, hi = wilson(7, 12)
    assert lo < 7 / 12 < hi and (lo, hi) == pytest.approx((0.3195, 0.8067), abs=1e-3)
    with pytest.raises(ValueError, match="k <= n"):
        wilson(4, 3)


def fake_run(peaks: dict[int, list[float]], steps: int, diverged: int | None = None) -> Run:
    """A record with telemetry every 50 steps: peaks[step] = each layer's largest logit (one head)."""
    metrics = [{"step": s, "loss": 3.0, "telemetry": {"max_logit": [[x] for x in layers]}}
               for s, layers in sorted(peaks.items())]
    summary = {"status": "diverged" if diverged is not None else "finished", "steps": steps,
               "diverged_step": diverged}
    return Run(Path("synthetic"), {"warmup_iters": 0}, {}, metrics, [], summary)


def test_outcome_finds_the_first_layer_past_the_threshold() -> None:
    calm = {s: [10.0, 20.0, 5.0] for s in range(0, 1000, 50)}
    run = fake_run({**calm, 400: [10.0, 1500.0, 900.0], 450: [2e3, 5e4, 3e3]}, steps=1000)
    assert outcome(run, horizon=1000) == Outcome(runaway=400, layer=1, explosion=None, observed=1000)
    both = fake_run({**calm, 400: [10.0, 1500.0, 3e3]}, steps=1000)  # two past at once: the lower index
    assert outcome(both, horizon=1000) == Outcome(runaway=400, layer=1, explosion=None, observed=1000)
    assert outcome(fake_run(calm, steps=1000), 1000) == Outcome(None, None, None, 1000)
    exploded = outcome(fake_run({**calm, 600: [1e4, 1.0, 1.0]}, steps=720, diverged=720), horizon=1000)
    assert exploded == Outcome(600, 0, 720, 720)
    late = outcome(fake_run({**calm, 600: [1e4, 1.0, 1.0]}, steps=1200, diverged=1100), horizon=500)
    assert late == Outcome(None, None, None, 500)  # both events after the horizon: censored there
    with pytest.raises(ValueError, match="outcome is unknown"):
        outcome(fake_run(calm, steps=700), horizon=1000)  # stopped by a clock: no outcome


def test_survival_table_counts_intervals_and_tests() -> None:
    ran = [Outcome(1000 + 100 * i, 1, 2000 + 100 * i if i % 2 else None,
                   8000 if i % 2 == 0 else 2000 + 100 * i) for i in range(6)]
    calm = [Outcome(None, None, None, 8000) for _ in range(6)]
    table = survival_table({"fa2": ran, "model-fp32": calm}, against=("fa2", "model-fp32"))
    assert table["fa2"]["runs"] == 6 and table["fa2"]["runaway"]["events"] == 6
    assert table["fa2"]["runaway"]["layers"] == {1: 6}
    assert table["fa2"]["explosion"]["events"] == 3
    assert table["model-fp32"]["runaway"]["events"] == 0
    assert table["model-fp32"]["runaway"]["interval"] == pytest.approx(wilson(0, 6))
    assert set(table["fa2"]["runaway"]["log_rank_p"]) == {"model-fp32"}
    p = table["fa2"]["runaway"]["log_rank_p"]["model-fp32"]
    assert p == pytest.approx(log_rank(event_times(ran, "runaway"), event_times(calm, "runaway"))[1])
    assert p < 0.01
    assert table["fa2"]["runaway"]["curve"][-1] == (1500, 0.0)


def grid_run(lr: float, qkln: bool, peak: float, loss: float) -> Run:
    """A 1,000-step run of a learning-rate grid: one layer whose largest logit is `peak` from step 500."""
    run = fake_run({s: [peak if s >= 500 else 10.0] for s in range(0, 1000, 50)}, steps=1000)
    return Run(run.path, {"lr": lr, "model": {"qk_layernorm": qkln}}, {}, run.metrics, [],
               {**run.summary, "final_loss": loss})


def test_lr_sweep_counts_runaways_by_series_and_rate() -> None:
    groups = {"fa2-lr8e-3": [grid_run(8e-3, False, 2e3, 4.0), grid_run(8e-3, False, 50.0, 3.0),
                             grid_run(8e-3, False, 3e3, 5.0)],
              "fa2-lr1e-3": [grid_run(1e-3, False, 40.0, 2.0)],
              "fa2-lr8e-3-qkln": [grid_run(8e-3, True, 30.0, 2.5)]}
    sweep = lr_sweep(groups, horizon=1000)
    assert sweep == {"fa2": [{"lr": 1e-3, "runs": 1, "runaways": 0, "loss": 2.0},
                             {"lr": 8e-3, "runs": 3, "runaways": 2, "loss": 4.0}],
                     "fa2 + QK-LayerNorm": [{"lr": 8e-3, "runs": 1, "runaways": 0, "loss": 2.5}]}
    fig = lr_figure("runaways against the learning rate", sweep)
    shares = [t for t in fig.data if t.xaxis == "x"]
    assert [list(t.y) for t in shares] == [[0.0, 2 / 3], [0.0]]
    assert len({t.line.color for t in shares}) == 1 and [t.line.dash for t in shares] == ["solid", "dot"]
    assert fig.layout.xaxis.type == "log" and list(fig.layout.xaxis.ticktext) == ["0.001", "0.008"]
    assert shares[0].marker.size > shares[1].marker.size  # the later series drawn inside the earlier
    assert not fig.layout.title.subtitle.text  # only fa2 + QK-LayerNorm is flat: nothing hidden
    sweep["attn-fp32"] = [{"lr": 1e-3, "runs": 2, "runaways": 0, "loss": 2.0}]
    assert lr_figure("t", sweep).layout.title.subtitle.text.endswith(
        "one line at 0: fa2 + QK-LayerNorm, attn-fp32")


def test_lr_sweep_reads_a_longer_run_up_to_the_horizon() -> None:
    """A 2,000-step run in a 1,000-step grid: its runaway after the horizon does not count, and its loss is
    the one logged at the horizon, not its last."""
    calm = {s: [10.0] for s in range(0, 2000, 50)}
    run = fake_run({**calm, 1500: [5e3]}, steps=2000)
    run.metrics[:] = [{**m, "loss": 4.0 if m["step"] <= 1000 else 9.0} for m in run.metrics]
    long = Run(run.path, {"lr": 2e-3, "model": {"qk_layernorm": False}}, {}, run.metrics, [],
               {**run.summary, "final_loss": 9.0})
    assert lr_sweep({"fa2-lr2e-3": [long]}, horizon=1000) == {
        "fa2": [{"lr": 2e-3, "runs": 1, "runaways": 0, "loss": 4.0}]}
    assert lr_sweep({"fa2-lr2e-3": [long]}, horizon=2000)["fa2"][0] == {
        "lr": 2e-3, "runs": 1, "runaways": 1, "loss": 9.0}

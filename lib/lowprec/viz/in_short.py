"""The chapters' opening summaries, counted from results/ the way their sections count them: chapter 3's
results (`explosion`), chapter 3b's criterion count over the growing heads (`growing_heads`), chapter 5's
"what to change" box (`what_to_change`). Each claim is checked (`StaleClaim` when a record contradicts it)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from lowprec.analysis import combined_z, criterion, experiment_runs, fastest_head
from lowprec.attention.precision import PLACEMENTS
from lowprec.instruments.explode import ARMS, record_name
from lowprec.runs import Run
from lowprec.viz.bottom_line import (
    GRID_PLACEMENTS,
    LARGE,
    RESULTS,
    SMALL,
    STUDY,
    claim,
    explode_runs,
    grid_cell,
    grid_runs,
    half_rate,
    horizon,
    normed_seeds,
    qk_changed,
    qk_pairs,
    run_rows,
    secondary_tests,
    seeds_per_cell,
    study_groups,
    tally,
)

LEAD_FOLDERS = ("lead-s1337", "lead-s1", "lead-s2", "lead-fa2-s1")  # chapter 3's small-batch comparison


def _events(rows: list[dict], event: str = "runaway") -> int:
    """How many of chapter 3's table rows have `event` ("runaway", "spike", "explosion")."""
    return sum(r[event] is not None for r in rows)


def explosion(results: Path = RESULTS) -> str:
    """Chapter 3's results in four Markdown bullets, counted from the same records as its sections."""
    rows = run_rows(results)

    def of(arm: str, *folders: str) -> list[dict]:
        return [r for r in rows if r["experiment"] in folders and r["arm"] == arm]

    authors, unrounded, fa2 = (of(arm, *LEAD_FOLDERS) for arm in ("paper64", "paper64-fp32pv", "fa2"))
    fixed = of("paper64-fix", "lead-fix")
    pair = {r["arm"]: r["explosion"] for r in rows if r["experiment"] == "bigbatch-fix"}
    big_recipe = next(r["recipe"] for r in rows if r["experiment"] == "bigbatch")
    big = [r for r in rows if r["recipe"] == big_recipe and r["experiment"] not in STUDY]
    big_arms = sorted({r["arm"] for r in big})
    calm = [r for r in big if r["runaway"] is None]  # a run lost with its machine early
    stopped = [r for r in rows if r["explosion"] is not None]
    ahead = [r["explosion"] - r["runaway"] for r in stopped]
    half, high = grid_cell("1e-3", results=results), grid_cell("8e-3", results=results)
    half_bf16, control = half["fa2"] + half["paper64"], half_rate(results).control  # control: no bf16 at all
    steps = horizon("lr-qknorm", results)
    fa2_above = study_groups("survival", results)["fa2"] + grid_cell("4e-3", results=results)["fa2"]
    fa2_other = [r for r in fa2_above if r.runaway and r.runaway <= steps]
    normed_cells = [group for (_, _, on), group in grid_runs(results).items() if on]
    normed = [r for group in normed_cells for r in group]
    claim((_events(authors + unrounded), len(authors + unrounded)) == (6, 6)
          and (_events(fa2), len(fa2)) == (1, 3), "small batch: 6 of 6 bf16 scores and row sum, fa2 1 of 3")
    claim((_events(authors, "spike"), _events(authors, "explosion")) == (3, 0)
          and (_events(fixed), len(fixed)) == (3, 3) == (_events(unrounded), len(unrounded)),
          "the authors' placement: 3 spikes, no explosion; 3 of 3 without P̄V rounding and with the Fix")
    claim(pair["paper64-fix"] < pair["paper64"], "at the large batch the run with the Fix exploded first")
    claim(big_arms == ["fa2", "fp32pv", "paper64", "paper64-fix"]
          and all(any(r["runaway"] is not None for r in big if r["arm"] == arm) for arm in big_arms)
          and [r["explosion"] is not None for r in big if r["arm"] == "fa2"] == [True]
          and [(r["experiment"], r["arm"]) for r in calm] == [("bigbatch-lost", "paper64")],
          "large batch: every arm has a run that ran away, fa2 exploded, one lost run did not")
    claim(all(r["runaway"] is not None and r["runaway"] < r["explosion"] for r in stopped),
          "a runaway before every explosion")
    claim(all(group and tally(group, "runaway")[0] == len(group) for group in high.values()),
          "8e-3: every run of every placement")
    claim(tally(half_bf16, "runaway") == (8, 8) and tally(half["attn-fp32"], "runaway") == (0, 4)
          and tally(control, "runaway") == (0, 2)
          and tally(half["fa2"], "runaway") == (4, 4) and not fa2_other and len(fa2_above) >= 6,
          "1e-3: bf16 8 of 8, fp32 attention 0 of 4, no bf16 at all 0 of 2; fa2 none at 2e-3 and 4e-3")
    claim(tally(normed, "runaway")[0] == 0, "QK-LayerNorm: no runaway")
    return (
        f"- At {SMALL:,} tokens per step, in the three-seed comparison below, every run that rounds the "
        f"scores and the row sum to bf16 ran away ({_events(authors + unrounded)} of "
        f"{len(authors + unrounded)}: the authors' placement `paper64` and `paper64-fp32pv`, {len(authors)} "
        f"seeds each), layer index 1 first; the production placement `fa2` in {_events(fa2)} of {len(fa2)}. "
        f"The authors' placement spiked in {_events(authors, 'spike')} of {len(authors)} seeds, but the stop "
        f"rule fired in none of them.\n"
        f"- The paper's biased rounding of $\\bar P V$ is not needed for this runaway: without it "
        f"(`paper64-fp32pv`) and with the paper's Fix (`paper64-fix`) it came in {_events(fixed)} of "
        f"{len(fixed)} seeds each; at {LARGE:,} tokens per step the run with "
        f"the Fix exploded first (step {pair['paper64-fix']:,} against {pair['paper64']:,}, one pair).\n"
        f"- At {LARGE:,} tokens per step every arm had a run that ran away in seed 1337 ("
        + ", ".join(f"`{arm}`" for arm in big_arms)
        + f"; a third `paper64` run, lost with its machine at step {calm[0]['steps']:,}, had not yet), and "
        f"`fa2` exploded. Each of the "
        f"{len(stopped)} explosions in the table below came after a runaway, {min(ahead):,} to "
        f"{max(ahead):,} steps later.\n"
        f"- Against the learning rate ({steps:,} steps per run): at four times the recipe's rate every "
        f"placement ran away, attention in fp32 included (every run: "
        f"{seeds_per_cell(high.values())} per placement); at half of it every bf16 run ran away "
        f"({tally(half_bf16, 'runaway')[0]} of {len(half_bf16)}, {len(half['fa2'])} seeds) and no run with "
        f"attention in fp32 ({tally(half['attn-fp32'], 'runaway')[0]} of {len(half['attn-fp32'])}), nor the "
        f"model with no bf16 anywhere ({tally(control, 'runaway')[0]} of {len(control)}). By step "
        f"{steps:,} `fa2` ran away in {tally(half['fa2'], 'runaway')[0]} of {len(half['fa2'])} runs at half "
        f"the recipe's rate and in {len(fa2_other)} of {len(fa2_above)} at the recipe's rate and twice it: "
        f"the runaway is not only the growth of a high rate. With QK-LayerNorm none of {len(normed)} runs "
        f"ran away ({normed_seeds(results)} per placement and rate).")


# chapter 3b's growing-head runs: the row-sum runs whose checkpoints were measured by the criterion
GROWING = {"bf16rowsum-s2 (repeat)": ("slow-start", "bf16rowsum-s2"),
           **{f"bf16rowsum-s{s}": ("growing-head2", f"bf16rowsum-s{s}") for s in (8, 9, 10)}}  # folder, run
GROWING_STEPS = (1000, 1500, 2000, 2500)


@dataclass(frozen=True)
class GrowingHeads:
    """Chapter 3b's criterion over the growing-head runs: per run its criterion records (`GROWING_STEPS`),
    its run, its layer-2 head that grows most in the slow phase (`fastest_head`) and each layer-2 head's
    larger combined z of W_Q and W_K; `hits`: (fastest heads with z >= 4, runs, other heads with z >= 4,
    other heads)."""

    records: dict[str, list[dict]]
    runs: dict[str, Run]
    grower: dict[str, int]
    z: dict[str, torch.Tensor]

    @property
    def hits(self) -> tuple[int, int, int, int]:
        others = [float(x) >= 4 for name, head in self.grower.items()
                  for h, x in enumerate(self.z[name]) if h != head]
        fast = sum(float(self.z[name][head]) >= 4 for name, head in self.grower.items())
        return fast, len(self.grower), sum(others), len(others)


@functools.cache
def growing_heads(results: Path = RESULTS) -> GrowingHeads:
    """The criterion records (under the bf16 row sum) and runs of `GROWING`, read once."""
    spec = f"triton/precision={ARMS['bf16rowsum']}"
    explode = Path(results) / "explode"
    records = {name: [criterion(explode / folder, run, step, spec) for step in GROWING_STEPS]
               for name, (folder, run) in GROWING.items()}
    runs = {name: experiment_runs(explode, folder, name=record_name)[run]
            for name, (folder, run) in GROWING.items()}
    z = {name: torch.maximum(*(combined_z(r, projection)[1] for projection in ("heads", "heads_k")))
         for name, r in records.items()}
    return GrowingHeads(records, runs, {name: fastest_head(run) for name, run in runs.items()}, z)


def what_to_change(results: Path = RESULTS) -> str:
    """Chapter 5's "What to change, in short" box, from the same records as chapter 3 and the placements."""
    row_sums = {name: PLACEMENTS[name]().rowsum for name in ("fa2", "paper", "fp32")}
    claim(row_sums["fa2"] == row_sums["fp32"] != row_sums["paper"],
          "fa2 keeps ℓ unrounded (fp32); paper rounds it")
    normed = {key: with_it for key, (_, with_it) in qk_pairs(results).items()}  # (placement, rate): its runs
    normed_runs = [r for group in normed.values() for r in group]
    claim({lr for _, lr in normed} == {8e-3, 4e-3, 2e-3, 1e-3} and tally(normed_runs, "runaway")[0] == 0,
          "QK-LayerNorm: half to four times the recipe's rate, no runaway")
    per_placement = {arm: sum(a == arm for a, _ in normed) for arm in GRID_PLACEMENTS}
    parted, against, parted_p = qk_changed(results)  # same-seed pairs in which one run ran away
    claim(parted and not against, "QK-LayerNorm: of same-seed pairs, only runs without it ran away")
    seeds = normed_seeds(results)
    fast_fp32 = grid_cell("8e-3", results=results)["attn-fp32"]
    wide_fp32 = [r for name, r in explode_runs(results).items()
                 if name.startswith(("fp32pv262k/", "fp32pv5k/"))]
    claim(fast_fp32 and all(r.runaway for r in fast_fp32), "attention in fp32 ran away at 4x the rate")
    claim(len(wide_fp32) == 2 and all(r.runaway and r.tokens_per_step == LARGE for r in wide_fp32),
          "an fp32 row sum ran away at the large batch")
    survival = study_groups("survival", results)
    study_fp32pv = survival["fp32pv"]  # an fp32 row sum at the recipe's batch
    claim(tally(study_fp32pv, "runaway")[0] > 0, "an fp32 row sum ran away in the study")
    trained = {arm: survival[arm] for arm in ("fa2", "fa2-consistent")}
    went = [tally(group, "runaway")[0] for group in trained.values()]
    stops = tally(trained["fa2-consistent"], "explosion")[0]
    claim(went[0] == 0 and went[1] > 0 and stops > 0 and len(trained["fa2"]) >= 4,
          "fa2-consistent: some runs ran away, one or more exploded; fa2 in none of its runs")
    authors = next(test for test in secondary_tests(results) if test.arms == ("paper64", "fa2"))
    claim(authors.corrected < 0.05 and not authors.to_come, "paper64 against fa2: final, below 5% corrected")
    (paper_k, paper_n), (fa2_k, fa2_n) = authors.counts
    return (
        "**What to change, in short** (each point is measured below and in chapter 3):\n\n"
        "- **With FlashAttention-2, SDPA or cuDNN the row sum $\\ell$ is already fp32**: they round as the "
        "`fa2` placement does, only $\\bar P$ and the output (chapter 2); the bf16 row sum is the authors' "
        f"placement's. In chapter 3's study the authors' placement ran away in {paper_k} of {paper_n} runs "
        f"and `fa2` in {fa2_k} of {fa2_n} (a secondary test, corrected p = {authors.corrected:#.2g}).\n"
        "- **QK-LayerNorm is the only change run at several learning rates with no runaway at any of them**: "
        f"{tally(normed_runs, 'runaway')[0]} of {len(normed_runs)} runs ran away, {seeds} per placement and "
        "rate (" + ", ".join(f"`{arm}` at {n} rates" for arm, n in per_placement.items())
        + ", from half to four times the recipe's). Attention in fp32 ran away at four times the rate, and "
        f"an fp32 row sum at {LARGE:,} tokens per step and in {tally(study_fp32pv, 'runaway')[0]} of "
        f"{len(study_fp32pv)} runs of chapter 3's study at {SMALL:,} (`fp32pv`). {len(normed_runs)} runs, "
        f"{seeds} per cell, are not a rate; but in all {parted} same-seed pairs in which one run ran away, "
        f"it was the one without QK-LayerNorm (sign test p = {parted_p:.2g}, chosen after the runs).\n"
        "- **`consistent` is this library's option**, a custom kernel (our Triton kernel's "
        "`precision=\"consistent\"`), not a setting of those kernels. It removes the production placement's "
        f"rounding bias, but in bf16 training `fa2-consistent` ran away in {went[1]} of "
        f"{len(trained['fa2-consistent'])} runs ({stops} of them then exploded), against {went[0]} of "
        f"{len(trained['fa2'])} for `fa2`.")

"""The book's bottom line (`lowprec.viz.bottom_line`): five lines from the committed records, their numbers
against an independent count of the run folders, and a results folder that contradicts a claim raises."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import statistics
from pathlib import Path

import pytest
from lowprec.analysis import (
    event_times,
    largest_logit,
    log_rank,
    outcome,
    outcomes,
    runaway_step,
    sign_test,
    wilson,
)
from lowprec.runs import load_run
from lowprec.viz.bottom_line import (
    RESULTS,
    ROUNDS,
    STUDY,
    RunFacts,
    SecondaryTest,
    StaleClaim,
    bf16_of,
    bias_noise_sources,
    bottom_line,
    common_spikes,
    early_rows,
    explode_records,
    explode_runs,
    hunt_records,
    lr_finding,
    qk_changed,
    record_runs,
    run_rows,
    secondary_tests,
    settled_reading,
    shared_spikes,
    study_groups,
    timed_runs,
    tokens_per_s,
    twins,
)

HEADS = ("**What fails.**", "**Why, as far as the records show.**", "**What to change.**", "**Untested.**",
         "**Where each is shown.**")
EXPLODE = RESULTS / "explode"


def count(folders: list[str]) -> tuple[int, int]:
    """(runs whose layer index 1 passed 1e3, runs), read folder by folder."""
    return sum(runaway_step(load_run(EXPLODE / f)) is not None for f in folders), len(folders)


def stated(k: int, n: int, noun: str) -> str:
    lo, hi = wilson(k, n)
    return f"{k} of {n} {noun} (95% CI {100 * lo:.0f}-{100 * hi:.0f}%)"


@pytest.fixture(scope="module")
def lines() -> list[str]:
    return bottom_line().split("\n\n")


def test_five_lines_in_order(lines: list[str]) -> None:
    assert len(lines) == 5 and all(line.startswith(head) for line, head in zip(lines, HEADS, strict=True))
    for page in re.findall(r"\]\(([\w-]+\.md)\)", lines[4]):
        assert (RESULTS.parent / "book" / page).exists(), page


def test_numbers_match_an_independent_count(lines: list[str]) -> None:
    paper = count(["lead-s1/paper-s1", "lead-s1337/paper-s1337", "lead-s2/paper64-s2"])
    fa2 = count(["lead-s1337/fa2-s1337", "lead-s2/fa2-s2", "lead-fa2-s1/fa2-s1"])
    rowsum = count(["lead-points/bf16rowsum-s1337", "lead-points/bf16rowsum-s1", "rowsum-check/bf16rowsum-s2",
                    "slow-start/bf16rowsum-s2", "rowsum-more/bf16rowsum-s3", "rowsum-more4/bf16rowsum-s4",
                    *(f"growing-head/bf16rowsum-s{s}" for s in (5, 6, 7)),
                    *(f"growing-head2/bf16rowsum-s{s}" for s in (8, 9, 10))])
    fp32pv = count(["fp32pv-lead/fp32pv-s1337", "fp32pv-lead/fp32pv-s1", "rowsum-check/fp32pv-s2",
                    "slow-start/fp32pv-s2", "rowsum-more/fp32pv-s3", "growing-head-fp32/fp32pv-s5",
                    "growing-head2-fp32/fp32pv-s8"])
    assert (paper, fa2, rowsum, fp32pv) == ((3, 3), (1, 3), (7, 12), (0, 7))
    assert stated(*paper, "seeds") in lines[0] and stated(*fa2, "seeds") in lines[0]
    assert stated(*rowsum, "runs") in lines[1] and stated(*fp32pv, "runs") in lines[1]
    # seeds 1, 5 and 1337 (1 of 1 against 0 of 1) and 2 (1 of 2 against 0 of 2) each put their one runaway on
    # the bf16 side with chance 1/2, and 3 and 8 (no runaway) tell nothing: two-sided 2 * (1/2)^4
    assert "(Fisher's exact test p = 0.017; within the 6 seeds that ran both arms p = 0.12;" in lines[1]
    big = [load_run(EXPLODE / f) for f in ("bigbatch/paper64-s1337", "bigbatch-fa2/fa2-s1337")]
    steps = [f"{s:,}" for s in (*(runaway_step(r) for r in big), *(r.summary["diverged_step"] for r in big))]
    stated_steps = f"runaway at steps {steps[0]} and {steps[1]}, the stop rule at {steps[2]} and {steps[3]}"
    assert stated_steps in lines[0]
    queue = json.loads((EXPLODE / "lr-qknorm" / "queue.json").read_text())
    done = [f for f in (EXPLODE / "lr-qknorm").iterdir() if (f / "summary.json").is_file()]
    assert len(done) == len(queue["runs"]) and f"(all {len(done)} runs of that study are done;" in lines[3]
    assert "the learning rate between and beyond the 4 rates measured and past 4,000 steps" in lines[3]
    survival = json.loads((EXPLODE / "survival" / "queue.json").read_text())["runs"]
    per_arm = {arm: sum(r["arm"] == arm for r in survival) for arm in {r["arm"] for r in survival}}
    assert set(per_arm.values()) == {8}
    assert "its 8 runs per arm tell a 60% runaway rate from none only 59%" in lines[3]
    normed = [f for f in done if "-qkln-s" in f.name]
    cells: dict[tuple[str, bool], list[bool]] = {}
    for f in (f for f in done if not f.name.startswith("model-fp32")):  # the grid's placements
        rate = re.search(r"-lr(\d)e-3", f.name).group(1)
        cells.setdefault((rate, "-qkln-" in f.name), []).append(runaway_step(load_run(f)) is not None)
    recipe = [runaway_step(load_run(f)) for arm in ("fa2", "paper64", "attn-fp32")  # the survival runs there
              for f in (EXPLODE / "survival").glob(f"{arm}-s[0-9]") if (f / "summary.json").is_file()]
    went = sum(s is not None and s <= 4000 for s in recipe)
    by_4000 = f"{went} of {len(recipe)} survival runs by step 4,000"
    for rate in {r for r, _ in cells}:
        counts = [f"{sum(cells[rate, q])} of {len(cells[rate, q])}" if (rate, q) in cells
                  else by_4000 if (rate, q) == ("2", False) else "not yet run" for q in (False, True)]
        assert "$" + rate + " \\cdot 10^{-3}$: " + ", ".join(counts) in lines[3], (rate, counts)
    assert not any(runaway_step(load_run(f)) for f in normed)
    assert f"with QK-LayerNorm none of {len(normed)} runs ran away" in lines[2]


def synthetic(tmp_path: Path) -> Path:
    """A results folder that links every committed experiment and copies what a test changes."""
    results = tmp_path / "results"
    (results / "explode").mkdir(parents=True)
    (results / "train").mkdir()
    for item in EXPLODE.iterdir():
        if item.name != "lr-qknorm":
            (results / "explode" / item.name).symlink_to(item)
    shutil.copytree(EXPLODE / "lr-qknorm", results / "explode" / "lr-qknorm")
    shutil.copy(RESULTS / "train" / "reproducibility.json", results / "train")
    shutil.copytree(RESULTS / "train" / "survival-repeat", results / "train" / "survival-repeat")
    return results


def forget() -> None:
    """Drop the records read so far (a test changed them under the same folder)."""
    explode_records.cache_clear()
    explode_runs.cache_clear()
    study_groups.cache_clear()


def test_a_contradicting_record_raises(tmp_path: Path) -> None:
    results = synthetic(tmp_path)
    record = results / "train" / "reproducibility.json"
    repro = json.loads(record.read_text())
    repro["twins"]["default"]["identical_weights"] = True  # default-mode twins that agree: the claim is stale
    record.write_text(json.dumps(repro))
    with pytest.raises(StaleClaim, match="default-mode twins"):
        bottom_line(results)
    shutil.copy(RESULTS / "train" / "reproducibility.json", record)
    lr = results / "explode" / "lr-qknorm"
    shutil.rmtree(lr / "attn-fp32-lr8e-3-s1")  # fp32 attention, 8e-3, no runaway (its calm twin): stale
    (lr / "attn-fp32-lr8e-3-s1").symlink_to(EXPLODE / "lr-qknorm" / "attn-fp32-lr8e-3-qkln-s1")
    forget()
    with pytest.raises(StaleClaim, match="every placement ran away at 8e-3, attention in fp32 included"):
        bottom_line(results)
    (lr / "attn-fp32-lr8e-3-s1").unlink()
    shutil.copytree(EXPLODE / "lr-qknorm" / "attn-fp32-lr8e-3-s1", lr / "attn-fp32-lr8e-3-s1")
    shutil.rmtree(lr / "fa2-lr8e-3-qkln-s1")  # a runaway with QK-LayerNorm: "none ran away" is stale
    (lr / "fa2-lr8e-3-qkln-s1").symlink_to(EXPLODE / "lr-qknorm" / "fa2-lr8e-3-s1")
    forget()
    with pytest.raises(StaleClaim, match="with QK-LayerNorm no run ran away or spiked"):
        bottom_line(results)
    (lr / "fa2-lr8e-3-qkln-s1").unlink()
    shutil.copytree(EXPLODE / "lr-qknorm" / "fa2-lr8e-3-qkln-s1", lr / "fa2-lr8e-3-qkln-s1")
    shutil.rmtree(lr / "attn-fp32-lr4e-3-s1")  # fp32 attention running away at 4e-3: "only paper64" is stale
    (lr / "attn-fp32-lr4e-3-s1").symlink_to(EXPLODE / "lr-qknorm" / "paper64-lr4e-3-s1")
    forget()
    with pytest.raises(StaleClaim, match=r"at 4e-3 \(two seeds\) only paper64 ran away, once"):
        bottom_line(results)


def test_a_repeat_that_parts_raises(tmp_path: Path) -> None:
    results = synthetic(tmp_path)
    repeat = results / "train" / "survival-repeat" / "bf16rowsum-s1"
    shutil.rmtree(repeat)  # another run in the repeat's place: "the same values" is stale
    shutil.copytree(EXPLODE / "survival" / "paper64-s1", repeat)
    with pytest.raises(StaleClaim, match="made twice"):
        bottom_line(results)


def survival_by_link(tmp_path: Path) -> tuple[Path, Path]:
    """`synthetic` results whose survival folder links each of its items one by one (so that a test can put
    another run in one item's place), and that folder."""
    results = synthetic(tmp_path)
    survival = results / "explode" / "survival"
    survival.unlink()
    survival.mkdir()
    for item in (EXPLODE / "survival").iterdir():
        (survival / item.name).symlink_to(item)
    return results, survival


def test_the_primary_test_goes_stale(tmp_path: Path) -> None:
    """Two more fp32pv runaways (8 of 8 against 4 of 8: Fisher p = 0.077): "below 0.05" is stale."""
    results, survival = survival_by_link(tmp_path)
    calm = [f for f in sorted(survival.glob("fp32pv-s[0-9]")) if runaway_step(load_run(f)) is None]
    for folder in calm[:2]:  # the same seed's bf16rowsum run, which ran away, in its place
        folder.unlink()
        folder.symlink_to(EXPLODE / "survival" / folder.name.replace("fp32pv", "bf16rowsum"))
    forget()
    with pytest.raises(StaleClaim, match="the primary test: bf16rowsum runs away more often than fp32pv"):
        bottom_line(results)


def test_the_settled_secondary_tests_go_stale(tmp_path: Path) -> None:
    """paper64's runaways of seeds 5, 7 and 8 replaced by those seeds' calm fa2 runs (4 of 8 against 0 of 8):
    "paper64 against fa2 below 5%, corrected" is stale, in the bottom line and in chapter 5's box."""
    from lowprec.viz import in_short

    results, survival = survival_by_link(tmp_path)
    for seed in (5, 7, 8):
        (survival / f"paper64-s{seed}").unlink()
        (survival / f"paper64-s{seed}").symlink_to(EXPLODE / "survival" / f"fa2-s{seed}")
    forget()
    with pytest.raises(StaleClaim, match="four secondary tests below 5%, every planned run"):
        bottom_line(results)
    with pytest.raises(StaleClaim, match="paper64 against fa2: final, below 5% corrected"):
        in_short.what_to_change(results)


def test_sooner_at_half_the_rate_goes_stale(tmp_path: Path) -> None:
    """paper64's survival run of seed 1 replaced by bf16rowsum's (a runaway at 1,150, the step of paper64's
    half-rate run of that seed, not after it): "sooner at half the rate in each seed" is stale."""
    results, survival = survival_by_link(tmp_path)
    (survival / "paper64-s1").unlink()
    (survival / "paper64-s1").symlink_to(EXPLODE / "survival" / "bf16rowsum-s1")
    forget()
    with pytest.raises(StaleClaim, match="paper64 ran away sooner at 1e-3 than at 2e-3 in every seed"):
        lr_finding(results)


def test_secondary_tests_from_the_folders() -> None:
    """Each arm against fa2 and model-fp32, one test per pair, log-rank p from each folder's own outcome at
    the queue's horizon; each settled test's range over the runs to come holds its p."""
    tests = secondary_tests()
    arms = sorted({f.name.rsplit("-s", 1)[0] for f in (EXPLODE / "survival").glob("*-s[0-9]") if f.is_dir()})
    assert len(tests) == 2 * (len(arms) - 1) - 1 and [t.p for t in tests] == sorted(t.p for t in tests)
    end = json.loads((EXPLODE / "survival" / "queue.json").read_text())["horizon"]
    for test in tests[:3]:
        found = [[outcome(load_run(f), end) for f in sorted((EXPLODE / "survival").glob(f"{arm}-s[0-9]"))]
                 for arm in test.arms]
        assert test.counts == [(sum(o.runaway is not None for o in g), len(g)) for g in found]
        assert test.p == log_rank(*(event_times(g, "runaway") for g in found))[1]
        assert test.corrected == min(1, test.p * len(tests))
    below, text = [test for test in tests if test.corrected < 0.05], bottom_line()
    assert "four are below 5%, every planned run of both arms made: " in text and len(below) == 4
    for test in below:
        low, high = test.ends()
        assert low == test.corrected == high and not test.to_come
        assert f"{test.label}, corrected p = {test.corrected:.2g}" in text


def test_settled_reading_describes_each_arm_where_first_named() -> None:
    tests = [SecondaryTest(arms, ([], []), (0, 0), 8_000, 0.0, 3)
             for arms in (("bf16rowsum", "fa2"), ("bf16rowsum", "model-fp32"), ("paper64", "fa2"))]
    assert settled_reading(tests) == (
        f"{ROUNDS['bf16rowsum']}, ran away more often than {ROUNDS['fa2']}, and than {ROUNDS['model-fp32']}; "
        f"{ROUNDS['paper64']}, ran away more often than `fa2`")
    assert settled_reading(tests[2:]) == f"{ROUNDS['paper64']}, ran away more often than {ROUNDS['fa2']}"
    with pytest.raises(StaleClaim, match="not of fa2-consistent"):
        settled_reading([dataclasses.replace(tests[0], arms=("fa2-consistent", "fa2"))])


def test_a_test_below_5_percent_with_a_run_to_come_goes_stale(tmp_path: Path) -> None:
    """model-fp32 without its seed-8 run: paper64 against model-fp32 is below 5% corrected, yet the run
    still to come could lift it above again; the bottom line's four final tests are stale."""
    results, survival = survival_by_link(tmp_path)
    (survival / "model-fp32-s8").unlink()
    forget()
    test = next(test for test in secondary_tests(results) if test.arms == ("paper64", "model-fp32"))
    low, high = test.ends()
    assert test.counts == [(7, 8), (0, 7)] and low <= test.corrected < 0.05 < high and test.to_come == 1
    with pytest.raises(StaleClaim, match="bf16rowsum and paper64, each against fa2 and against model-fp32"):
        bottom_line(results)


def test_survival_runaways_by_arm(lines: list[str]) -> None:
    arms: dict[str, list[int]] = {}
    for folder in sorted((EXPLODE / "survival").glob("*-s[0-9]*")):
        if folder.is_dir():
            arm = folder.name.rsplit("-s", 1)[0]
            arms.setdefault(arm, []).append(runaway_step(load_run(folder)) is not None)
    for arm, went in arms.items():
        assert f"`{arm}` {sum(went)} of {len(went)}" in lines[3], arm


def test_hunt_records_and_their_bias_noise_sources() -> None:
    records = hunt_records()
    assert "lead-s1337/paper-s1337" in records and not any(name.split("/")[0] in STUDY for name in records)
    assert not any("replay" in name for name in records)
    sources = bias_noise_sources()
    assert ("paper64-s1337", 2000) in sources and ("fa2-s1", 2000) in sources
    assert all(len(heads) == 6 and "mean_key_cos" in heads[0] for heads in sources.values())


def test_shared_spikes_group_a_seeds_runs_by_their_first_spike() -> None:
    """Seed 1 of the survival queue: its runs without a runaway first spiked at one step, the no-bf16 control
    among them (read folder by folder)."""
    step, same = shared_spikes()[1]
    folders = sorted((EXPLODE / "survival").glob("*-s1"))
    spikes = {f.name: outcomes(load_run(f))["spike"] for f in folders if f.is_dir()}
    assert {r.name.split("/")[-1] for r in same} == {name for name, s in spikes.items() if s == step}
    assert "model-fp32-s1" in spikes and spikes["model-fp32-s1"] == step and len(same) >= 3


def test_run_rows_name_every_run_as_the_chapters_do() -> None:
    """A hunt run by today's `<arm>-s<seed>`, a grid cell by its folder (two cells of one arm and seed stay
    apart), one row per run, and the earlier recipes' 25 runs (none of the study's, none exploded)."""
    runs, rows = record_runs(), run_rows()
    assert ("lead-s1337", "paper64-s1337") in runs, "the authors' placement under its current arm name"
    assert {("lr-qknorm", "fa2-lr8e-3-s1"), ("lr-qknorm", "fa2-lr8e-3-qkln-s1")} <= set(runs)
    assert len(rows) == len(runs) and {(r["experiment"], r["run"]) for r in rows} == set(runs)
    assert {r["arm"] for r in rows if r["experiment"] == "lr-qknorm"} >= {"fa2-lr8e-3", "fa2-lr8e-3-qkln"}
    early = early_rows(rows)
    assert len(early) == 25 and not any(r["explosion"] or r["experiment"] in STUDY for r in early)
    assert [bf16_of(frozenset(p)) for p in ({"scores", "rowsum"}, {"scores"}, {"rowsum"}, {"weights"})] == [
        "scores and row sum", "scores", "row sum", "neither"]


def test_common_spikes_per_seed_earliest_of_a_tie() -> None:
    """Synthetic runs: per seed the most common first-spike step of the runs without a runaway, and every run
    that first spiked there; a tie goes to the earlier step; a seed with fewer than two runs without a runaway
    that spiked has none."""
    def run(name: str, seed: int, spike: int | None, runaway: int | None = None) -> RunFacts:
        return RunFacts(name=name, arm=name, seed=seed, config="gpu-6l", lr=2e-3, tokens_per_step=32_768,
                        corpus="c", steps=8000, runaway=runaway, first_layer=None if runaway is None else 1,
                        spike=spike, explosion=None)

    runs = [run("a", 1, 500), run("b", 1, 500), run("c", 1, 300), run("c2", 1, 300, 200),
            run("c3", 1, 300, 100), run("x", 1, 500, 400), run("d", 2, 900), run("e", 2, 700),
            run("f", 3, 100), run("g", 4, None), run("h", 4, None), run("i", 5, 600), run("j", 5, 800, 300)]
    found = common_spikes(runs)
    assert {seed: (step, [r.name for r in same]) for seed, (step, same) in found.items()} == {
        1: (500, ["a", "b", "x"]), 2: (700, ["e"])}


def test_what_fails_names_fa2s_runs_on_each_corpus(lines: list[str]) -> None:
    """The production placement's runs on the larger corpus, read folder by folder, and the explosions by
    batch; the study's runs deterministic, the lead's not."""
    half = [load_run(f) for f in sorted((EXPLODE / "lr-qknorm").glob("fa2-lr1e-3-s[0-9]"))]
    recipe = [load_run(f) for f in sorted((EXPLODE / "survival").glob("fa2-s[0-9]"))]
    assert len(half) == 4 and all(runaway_step(r) is not None for r in half)
    stopped = sum(r.summary["diverged_step"] is not None for r in half)
    assert recipe and not any(runaway_step(r) for r in recipe)
    assert (f"it ran away in none of its {len(recipe)} runs at that learning rate (8,000 steps each) and in "
            f"all {len(half)} at half of it ({stopped} of them then exploded)") in lines[0]
    assert "Of the 25 runs the stop rule ended, 21 were at 32,768 tokens per step." in lines[0]
    assert all(r.config.get("deterministic") for r in half + recipe)
    assert load_run(EXPLODE / "lead-s1337" / "fa2-s1337").config.get("deterministic") is None
    assert "which every run of the study used, a seed fixes a run" in lines[3]


def test_lr_finding_against_the_folders() -> None:
    """The learning-rate paragraph's counts, read folder by folder; twins pair the same seed."""
    text, lr = lr_finding(), EXPLODE / "lr-qknorm"
    at = {rate: [f for f in lr.glob(f"*-lr{rate}-s[0-9]") if (f / "summary.json").is_file()]
          for rate in ("8e-3", "4e-3", "1e-3")}
    went = {rate: [f.name for f in folders if runaway_step(load_run(f)) is not None]
            for rate, folders in at.items()}
    seeds_at_high = sorted({sum(f.name.startswith(f"{arm}-lr") for f in at["8e-3"])
                            for arm in ("fa2", "paper64", "attn-fp32")})
    assert went["8e-3"] and len(went["8e-3"]) == len(at["8e-3"]) and seeds_at_high == [2]
    assert f"({len(at['8e-3'])} of {len(at['8e-3'])} runs, two seeds per placement)" in text
    assert f"{len(went['4e-3'])} of {len(at['4e-3'])} did" in text and went["4e-3"] == ["paper64-lr4e-3-s1"]
    seeds = sorted({int(f.name.rsplit("-s", 1)[1]) for f in at["1e-3"]})
    assert seeds == [1, 2, 3, 4]
    assert sorted(went["1e-3"]) == [f"{arm}-lr1e-3-s{seed}" for arm in ("fa2", "paper64") for seed in seeds]
    stopped = [f.name for f in at["1e-3"] if load_run(f).summary.get("diverged_step") is not None]
    assert sorted(stopped) == ["fa2-lr1e-3-s1", "fa2-lr1e-3-s3", "fa2-lr1e-3-s4", "paper64-lr1e-3-s2"]
    assert "8 of 8 over 4 seeds" in text and f"{len(stopped)} of them then reached the stop rule" in text
    control = [f for f in lr.glob("model-fp32-lr1e-3-s[0-9]") if (f / "summary.json").is_file()]
    assert sorted(f.name for f in control) == ["model-fp32-lr1e-3-s1", "model-fp32-lr1e-3-s2"]
    assert all(runaway_step(load_run(f)) is None for f in control)
    assert "8 of 8 against 0 of 6 gives p = 0.00033" in text  # 1/3003: the one table as extreme
    # seeds 1 and 2: the two runs without a runaway are the two without bf16 in attention (1 in 6); 3-4: 1/3
    assert "the exact test within seeds (the same contrast, seed by seed) gives p = 0.0031" in text
    recipe = [runaway_step(load_run(EXPLODE / "survival" / f"fa2-s{seed}")) for seed in (1, 2, 3, 4)]
    assert recipe == [None, None, None, None] and "fa2-lr4e-3-s1" not in went["4e-3"]
    assert "A lower rate did not prevent it" in text and "`fa2` ran away in 4 of 4 runs" in text
    assert "in 0 of 6 at the recipe's rate" in text and "p = 0.0048" in text  # 1/210
    assert "within seeds p = 0.028" in text  # seeds 1 and 2 (4e-3 too): 1/3 each, seeds 3 and 4: 1/2 each
    onset = {f.name: runaway_step(load_run(f)) for f in at["1e-3"]}
    assert all(onset[f"paper64-lr1e-3-s{s}"] < onset[f"fa2-lr1e-3-s{s}"] for s in seeds)
    recipe_paper = {s: runaway_step(load_run(EXPLODE / "survival" / f"paper64-s{s}")) for s in seeds}
    assert all(recipe_paper[s] is None or onset[f"paper64-lr1e-3-s{s}"] < recipe_paper[s] for s in seeds)
    assert f"placement ran away sooner at half the rate in each of the {len(seeds)} seeds" in text
    assert "before `fa2` in each of them at half the rate" in text
    normed = [f for f in lr.glob("*-qkln-s[0-9]") if (f / "summary.json").is_file()]
    assert f"With QK-LayerNorm none of {len(normed)} runs ran away" in text
    assert text in bottom_line()
    assert "none with attention in fp32, nor any of the 2 runs with no bf16 anywhere; rounding" in \
        bottom_line()
    pairs = twins()
    assert pairs and all(a.seed == b.seed and a.arm == b.arm and a.lr == b.lr for a, b in pairs)
    assert {b.name for _, b in pairs} <= {f"lr-qknorm/{f.name}" for f in normed}


def test_qk_changed_counts_the_same_seed_pairs_from_the_folders(lines: list[str]) -> None:
    """The same-seed pairs that parted on a runaway, read folder by folder: each QK-LayerNorm run beside its
    seed's run without it (same placement and learning rate)."""
    lr = EXPLODE / "lr-qknorm"
    parted = {"without": 0, "with": 0}
    for normed in lr.glob("*-qkln-s[0-9]"):
        plain = lr / normed.name.replace("-qkln", "")
        if (plain / "summary.json").is_file():
            went = [runaway_step(load_run(f)) is not None for f in (plain, normed)]
            if went[0] != went[1]:
                parted["without" if went[0] else "with"] += 1
    k = parted["without"]
    assert parted == {"without": 11, "with": 0}
    assert qk_changed() == (k, 0, sign_test(k, k)) and f"{sign_test(k, k):.2g}" == "0.00098"
    assert [qk_changed(arm=arm)[:2] for arm in ("fa2", "paper64", "attn-fp32")] == [(4, 0), (5, 0), (2, 0)]
    assert f"in the {k} of those pairs in which one run ran away, it was always the one without it" \
        in lines[2]


def test_untested_counts_the_learning_rate_study_while_it_runs(tmp_path: Path) -> None:
    """With a run of the learning-rate queue not yet made, the untested line says how many are done."""
    results = synthetic(tmp_path)
    shutil.rmtree(results / "explode" / "lr-qknorm" / "attn-fp32-lr4e-3-qkln-s2")
    forget()
    try:
        untested = bottom_line(results).split("\n\n")[3]
    finally:
        forget()
    assert "(done: 49 of the 50 runs of that study;" in untested and "are done;" not in untested


def test_untested_counts_the_survival_study_while_it_runs(tmp_path: Path, lines: list[str]) -> None:
    """With the survival queue complete the untested line says so; with a run not yet made it says how many
    are done, and that even complete the arms are small."""
    assert "all 56 runs of the survival study are done (" in lines[3] and "even complete" not in lines[3]
    results, survival = survival_by_link(tmp_path)
    (survival / "attn-fp32-s8").unlink()
    forget()
    try:
        untested = bottom_line(results).split("\n\n")[3]
    finally:
        forget()
    assert "of the survival study's 56 runs, 55 are done (" in untested
    assert "even complete its 8 runs" in untested


def test_lr_finding_goes_stale(tmp_path: Path) -> None:
    results = synthetic(tmp_path)
    lr = results / "explode" / "lr-qknorm"
    shutil.rmtree(lr / "attn-fp32-lr1e-3-s1")  # fp32 attention running away at 1e-3: the lead is stale
    (lr / "attn-fp32-lr1e-3-s1").symlink_to(EXPLODE / "lr-qknorm" / "paper64-lr1e-3-s1")
    forget()
    with pytest.raises(StaleClaim, match="at 1e-3 .every seed. every fa2 and paper64 run ran away"):
        lr_finding(results)
    forget()


def test_lr_finding_counts_the_no_bf16_control_and_no_other_arm(monkeypatch) -> None:
    """The queue's model-fp32 runs at 1e-3 (no bf16 anywhere) join attention in fp32 in Fisher's test and the
    test within seeds; one that ran away, or a run of an arm the paragraph does not count, makes it stale."""
    from lowprec.viz import bottom_line as module

    control_cell = ("model-fp32", 0.001, False)
    cells = {cell: runs for cell, runs in module.grid_runs().items() if cell != control_cell}  # without it
    fp32 = cells["attn-fp32", 0.001, False]
    def with_cells(extra: dict) -> str:
        monkeypatch.setattr(module, "grid_runs", lambda results=RESULTS: cells | extra)
        return lr_finding()

    plain = with_cells({})
    assert "nor the model with no bf16 anywhere" not in plain and "against 0 of 4 gives p = 0.0020;" in plain
    assert "every run with bf16 attention ran away and none with attention in fp32; rounding" in bottom_line()
    control = [dataclasses.replace(r, arm="model-fp32") for r in fp32[:2]]  # two runs that did not run away
    counted = with_cells({("model-fp32", 0.001, False): control})
    peak = max(largest_logit(explode_records()[r.name]) for r in control)
    assert (f"nor the model with no bf16 anywhere (`model-fp32`: fp32 throughout, TF32 off) in any of 2 "
            f"(largest logit at most {peak:.0f}). Fisher's exact test of 8 of 8 against 0 of 6 gives "
            f"p = {1 / 3003:.2g};") in counted  # the pre-registered 1/3003
    assert len({r.seed for r in control}) == 2  # two seeds of 2 of 2 against 0 of 2 (1/6 each), two of 0 of 1
    assert f"within seeds (the same contrast, seed by seed) gives p = {1 / 324:.2g}:" in counted
    assert "none with attention in fp32, nor any of the 2 runs with no bf16 anywhere; rounding" in \
        bottom_line()
    went = [dataclasses.replace(control[0], runaway=1000), control[1]]
    with pytest.raises(StaleClaim, match="no run without bf16 anywhere .model-fp32. ran away"):
        with_cells({("model-fp32", 0.001, False): went})
    for cell in (("model-fp32", 0.002, False), ("fa2-consistent", 0.001, False)):
        with pytest.raises(StaleClaim, match="and of model-fp32 at 1e-3 without QK-LayerNorm only"):
            with_cells({cell: control})


def test_tokens_per_s_is_the_median_over_the_records_of_one_gpu() -> None:
    """The training speed the bottom line and Symptoms compare, read from the runs' summaries directly, over
    the runs made on one GPU (the H200 unless named) and compiled whole: `fa2`'s survival runs came on H100s
    and H200s, and some of `bf16rowsum`'s on the H100 were compiled in pieces."""
    runs = study_groups()["fa2"]
    summaries = [json.loads((EXPLODE / r.name / "summary.json").read_text()) for r in runs]
    gpus = [json.loads((EXPLODE / r.name / "config.json").read_text())["provenance"]["device"] for r in runs]
    on = [s for s, gpu in zip(summaries, gpus, strict=True) if gpu == "NVIDIA H200"]
    timed = timed_runs(runs)
    assert 0 < len(on) < len(runs) and len(timed) == len(on), "both GPUs among fa2's runs"
    assert tokens_per_s(runs) == statistics.median(s["tokens"] / s["time_s"] for s in on)
    assert tokens_per_s(runs) != statistics.median(s["tokens"] / s["time_s"] for s in summaries)
    h100 = [r for r in runs if r not in timed]
    with pytest.raises(ValueError, match="ran on NVIDIA H200"):
        tokens_per_s(h100)
    assert tokens_per_s(h100, device="NVIDIA H100 80GB HBM3") > 0
    rowsum = {r.seed: r for r in study_groups()["bf16rowsum"]}  # on the H100: seeds 3-6 in pieces, 7-8 whole
    whole = [json.loads((EXPLODE / rowsum[seed].name / "summary.json").read_text()) for seed in (7, 8)]
    assert tokens_per_s(list(rowsum.values()), device="NVIDIA H100 80GB HBM3") == \
        statistics.median(s["tokens"] / s["time_s"] for s in whole)
    fp32 = tokens_per_s(study_groups()["attn-fp32"])
    assert f"{tokens_per_s(runs) / fp32:.1f} times `fa2`'s training time per token on the H200" \
        in bottom_line()


def test_the_chapters_summaries_count_from_the_records() -> None:
    """Chapters 3, 3b and 5 open with summaries the library counts: their numbers, read from the same runs."""
    from lowprec.viz import in_short

    text = in_short.explosion()
    assert text.count("\n- ") == 3 and "(6 of 6: the authors' placement `paper64`" in text
    assert "a third `paper64` run, lost with its machine at step 1,221, had not yet" in text
    assert in_short.growing_heads().hits == (3, 4, 2, 20)
    assert in_short.growing_heads() is in_short.growing_heads(), "the criterion records are read once"
    box = in_short.what_to_change()
    assert box.startswith("**What to change, in short**") and "0 of 24 runs ran away" in box
    assert "in all 11 same-seed pairs in which one run ran away, it was the one without QK-LayerNorm" in box
    authors = next(test for test in secondary_tests() if test.arms == ("paper64", "fa2"))
    assert f"`fa2` in 0 of 8 (a secondary test, corrected p = {authors.corrected:#.2g})" in box
    fp32pv = [load_run(f) for f in sorted((EXPLODE / "survival").glob("fp32pv-s[0-9]"))]
    went = sum(runaway_step(r) is not None for r in fp32pv)
    assert went and f"in {went} of {len(fp32pv)} runs of chapter 3's study at 32,768 (`fp32pv`)" in box


def test_why_gives_the_primary_tests_result(lines: list[str]) -> None:
    """The survival study's primary test (bf16rowsum against fp32pv on the larger corpus, 8 seeds each), read
    folder by folder, with Fisher's two-sided exact p computed here from the hypergeometric table."""
    went = {arm: [runaway_step(load_run(f)) is not None
                  for f in sorted((EXPLODE / "survival").glob(f"{arm}-s[0-9]")) if f.is_dir()]
            for arm in ("bf16rowsum", "fp32pv")}
    a, b = went["bf16rowsum"], went["fp32pv"]
    assert len(a) == len(b) == 8 and any(b)
    k, n = sum(a) + sum(b), len(a) + len(b)  # runaways in all; runs in all
    table = {x: math.comb(len(a), x) * math.comb(len(b), k - x) / math.comb(n, k)
             for x in range(max(0, k - len(b)), min(k, len(a)) + 1)}
    p = sum(q for q in table.values() if q <= table[sum(a)] * (1 + 1e-7))
    assert p < 0.05
    assert (f"found {sum(a)} of {len(a)} against {sum(b)} of {len(b)} (Fisher's exact test, two-sided, "
            f"p = {p:#.2g};") in lines[1]


def test_seed_ranges_says_numbers_in_words():
    from lowprec.viz.bottom_line import seed_ranges

    cases = {(1,): "1", (2, 1): "1 and 2", (3, 4, 5): "3 to 5", (1, 2, 6, 7, 8): "1, 2 and 6 to 8",
             (6, 2, 3, 4): "2 to 4 and 6"}
    assert {seeds: seed_ranges(list(seeds)) for seeds in cases} == cases
    with pytest.raises(ValueError, match="at least one"):
        seed_ranges([])


def test_seeds_per_cell_says_the_runs_per_cell_in_words():
    from lowprec.viz.bottom_line import seeds_per_cell

    cases = {(1, 1): "one seed", (2,): "two seeds", (1, 2, 2): "one or two seeds",
             (2, 4, 3): "two to four seeds", (1, 3): "one to three seeds"}
    assert {sizes: seeds_per_cell([[0] * n for n in sizes]) for sizes in cases} == cases
    for sizes in ((), (0, 1), (11,)):
        with pytest.raises(ValueError, match="cells of 1 to 10 runs"):
            seeds_per_cell([[0] * n for n in sizes])

"""The book's bottom line: five Markdown lines (what fails, why as far as the records show, what to change,
what is untested, where each is shown), every number counted from the committed records under results/.

`bottom_line` checks each claim it words against the records and raises `StaleClaim` when one no longer
holds, so the text cannot go stale silently. `explode_records` reads every training run under
results/explode/ once, `explode_runs` makes each a `RunFacts` row (arm, seed, tokens per step, corpus,
runaway, spike, explosion); `record_runs` names every run as the chapters do, `run_rows` makes their table
rows and `early_rows` picks the earlier recipes'; `select`, `tally`, `rate`, `queue_progress`, `study_groups`,
`tokens_per_s` and `shared_spikes` (`common_spikes`) count them for the chapters too; `grid_runs`,
`grid_cell`, `qk_pairs`, `twins` and `qk_changed` read the learning-rate x QK-LayerNorm queue, and
`lr_finding` words what it shows (claims checked) for the intro and chapters 3 to 5 alike.
"""

from __future__ import annotations

import collections
import functools
import json
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from lowprec.analysis import (
    Outcome,
    detection_power,
    event_times,
    first_difference,
    first_layer,
    fisher_p,
    largest_logit,
    log_rank,
    log_rank_range,
    outcome,
    outcomes,
    recipe,
    recipe_label,
    sign_test,
    split_name,
    stratified_p,
    wilson,
)
from lowprec.instruments import study
from lowprec.instruments.explode import arm_of, record_name, rounded_points
from lowprec.runs import REPO, Run, experiments, load_experiment, load_run

RESULTS = REPO / "results"
STUDY = ("survival", "lr-qknorm")  # the attribution study's queues (chapter 3 reads them)
RECIPE = ("gpu-6l", 2e-3)      # the hunt's config and learning rate
SMALL, LARGE = 32_768, 262_144  # tokens per step
LEAD, BIG_CORPUS = "gpt2-permissive", "gpt2-english+code"  # the lead runs' 12.4M tokens; the 336M-token one
MIN_STEPS = 3_500  # a run shorter than this (and not stopped by the explosion rule) has no outcome here


class StaleClaim(AssertionError):
    """A committed record contradicts a claim the bottom line words."""


def claim(holds: bool, what: str) -> None:
    """Raise `StaleClaim` naming `what` unless `holds` (unlike `assert`, it runs under python -O too)."""
    if not holds:
        raise StaleClaim(f"the records no longer support: {what}")


@dataclass(frozen=True)
class RunFacts:
    """One training run under results/explode/. `runaway`: the first telemetry step at which any layer's
    largest logit passed 1e3, `first_layer`: the layer that passed it first; `spike`: the moving-mean
    rule (`analysis.loss_spike`); `explosion`: the trainer's stop rule (None: never)."""

    name: str
    arm: str
    seed: int
    config: str
    lr: float
    tokens_per_step: int
    corpus: str
    steps: int
    runaway: int | None
    first_layer: int | None
    spike: int | None
    explosion: int | None


def seed_ranges(seeds: list[int]) -> str:
    """Whole numbers in words, sorted: "1 and 2", "3 to 5", "1, 2 and 6 to 8" (three or more in a row as a
    range)."""
    if not seeds:
        raise ValueError("seed_ranges needs at least one number")
    parts: list[str] = []
    row: list[int] = []
    for n in [*sorted(seeds), None]:
        if row and (n is None or n != row[-1] + 1):
            parts += [f"{row[0]} to {row[-1]}"] if len(row) > 2 else [str(k) for k in row]
            row = []
        if n is not None:
            row.append(n)
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


NUMBER_WORDS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


def seeds_per_cell(cells: Iterable[list]) -> str:
    """How many runs (seeds) the cells hold, in words: "one seed", "one or two seeds", "two to four seeds"."""
    sizes = sorted({len(cell) for cell in cells})
    if not sizes or not 1 <= sizes[0] <= sizes[-1] <= len(NUMBER_WORDS):
        raise ValueError(f"seeds_per_cell needs cells of 1 to {len(NUMBER_WORDS)} runs, got sizes {sizes}")
    low, high = (NUMBER_WORDS[n - 1] for n in (sizes[0], sizes[-1]))
    if low == high:
        return f"{low} seed" + "s" * (sizes[0] > 1)
    return f"{low} {'or' if sizes[-1] == sizes[0] + 1 else 'to'} {high} seeds"


def latex(lr: float) -> str:
    """A learning rate as the book writes it: $4 \\cdot 10^{-3}$."""
    mantissa, exponent = f"{lr:e}".split("e")
    return f"${float(mantissa):g} \\cdot 10^{{{int(exponent)}}}$"


def last_logit(run: Run) -> float:
    """The largest attention logit of any layer and head at a run's last telemetry sample."""
    return max(map(max, run.telemetry("max_logit")[1][-1]))


def facts(run: Run, name: str) -> RunFacts:
    """The `RunFacts` of one run (`analysis.outcomes`, `analysis.recipe`, `analysis.first_layer`)."""
    events, setting = outcomes(run), recipe(run)
    return RunFacts(name=name, arm=arm_of(run.config["model"]["attention"], run.config["dtype"]),
                    seed=run.config["seed"], config=run.config["name"], lr=setting["lr"],
                    tokens_per_step=setting["tokens_per_step"], corpus=setting["corpus"],
                    steps=events["steps"], runaway=events["runaway"], first_layer=first_layer(run),
                    spike=events["spike"], explosion=events["explosion"])


@functools.cache
def explode_records(results: Path = RESULTS) -> dict[str, Run]:
    """Every training run under results/explode/ (`runs.experiments`, `runs.load_experiment`: replays left
    out) by "<experiment>/<run folder>", or "<experiment>" for a folder that is one run."""
    return {folder.name if run.path == folder else f"{folder.name}/{name}": run
            for folder in experiments(Path(results) / "explode")
            for name, run in load_experiment(folder).items()}


@functools.cache
def explode_runs(results: Path = RESULTS) -> dict[str, RunFacts]:
    """The `RunFacts` of every run of `explode_records`, by the same names."""
    return {name: facts(run, name) for name, run in explode_records(results).items()}


def record_runs(results: Path = RESULTS) -> dict[tuple[str, str], Run]:
    """The runs of `explode_records` by (experiment folder, name): a hunt experiment's runs by
    `<arm>-s<seed>` (`explode.record_name`: today's arm names), a study queue's by its folders'
    `<group>-s<seed>` (a grid cell's tag is in the folder's name only). ValueError if two runs of one
    folder get one name."""
    runs: dict[tuple[str, str], Run] = {}
    for key, run in explode_records(results).items():
        folder, _, name = key.partition("/")
        named = (folder, name if folder in STUDY else record_name(run.config))
        if named in runs:
            raise ValueError(f"{folder}: two runs named {named[1]!r} "
                             f"({runs[named].path.name}, {run.path.name})")
        runs[named] = run
    return runs


def bf16_of(points: frozenset[str]) -> str:
    """Which of the scores and the row sum a set of rounding points (`explode.rounded_points`) rounds to
    bf16: "scores and row sum", "scores", "row sum" or "neither"."""
    return {2: "scores and row sum", 0: "neither"}.get(len(points & {"scores", "rowsum"}),
                                                         "scores" if "scores" in points else "row sum")


def run_rows(results: Path = RESULTS) -> list[dict]:
    """One row per run of `record_runs`: experiment, run, arm (`analysis.split_name`), recipe
    (`analysis.recipe_label`), bf16 (`bf16_of` its attention), and its events (`analysis.outcomes`)."""
    return [{"experiment": folder, "run": name, "arm": split_name(name)[0],
             "recipe": recipe_label(recipe(run)),
             "bf16": bf16_of(rounded_points(run.config["model"]["attention"])), **outcomes(run)}
            for (folder, name), run in record_runs(results).items()]


def early_rows(rows: list[dict]) -> list[dict]:
    """The hunt's rows (no study queue) of its earlier recipes: every recipe but the lead's (`lead-s1337`),
    its eight-fold batch (`bigbatch`) and its other corpus (`corpus32k`)."""
    recipe_of = {r["experiment"]: r["recipe"] for r in rows}
    later = {recipe_of[folder] for folder in ("lead-s1337", "bigbatch", "corpus32k")}
    return [r for r in rows if r["experiment"] not in STUDY and r["recipe"] not in later]


def hunt_records(results: Path = RESULTS) -> dict[str, Run]:
    """The runs of `explode_records` that belong to the explosion hunt: none of the attribution study's."""
    return {name: run for name, run in explode_records(results).items() if name.split("/")[0] not in STUDY}


def bias_noise_sources(results: Path = RESULTS, layer: int = 1) -> dict[tuple[str, int], list[dict]]:
    """The sources of each head's mean rank-1 term M in `layer`, per (run, checkpoint step), from the
    bias-to-noise records of the lead's kept checkpoints (leadck, lead-s2, lead-fa2-s1; run names
    "<arm>-s<seed>")."""
    out = {}
    for folder, seed in (("leadck", "-s1337"), ("lead-s2", ""), ("lead-fa2-s1", "")):  # leadck: no seed
        for path in sorted((Path(results) / "explode" / folder / "bias-noise").glob("*.json")):
            for checkpoint in json.loads(path.read_text())["checkpoints"]:
                out[path.stem.rsplit("-step", 1)[0] + seed, checkpoint["step"]] = checkpoint["sources"][layer]
    return out


def select(runs: dict[str, RunFacts], arm: str, tokens: int = SMALL, corpus: str = LEAD) -> list[RunFacts]:
    """The runs of `arm` in the hunt's recipe at `tokens` per step on `corpus` that have an outcome: they
    reached MIN_STEPS or the stop rule ended them."""
    return [r for r in runs.values() if r.arm == arm and (r.config, r.lr) == RECIPE
            and r.tokens_per_step == tokens and r.corpus == corpus
            and (r.steps >= MIN_STEPS or r.explosion is not None)]


def tally(runs: list[RunFacts] | list[Outcome], event: str) -> tuple[int, int]:
    """(runs with `event`: "runaway", "spike" or "explosion" (an `Outcome` has no spike); runs)."""
    return sum(getattr(r, event) is not None for r in runs), len(runs)


def rate(k: int, n: int, noun: str = "runs") -> str:
    """"k of n <noun> (95% CI lo-hi%)" with the Wilson interval."""
    lo, hi = wilson(k, n)
    return f"{k} of {n} {noun} (95% CI {100 * lo:.0f}-{100 * hi:.0f}%)"


def queue_progress(queue: Path) -> tuple[int, int, list[str]]:
    """(done, queued, the done runs' names) of a study queue, counted as `lowprec experiment study --status`
    counts them (`study.states`: records beside the queue)."""
    rows = study.states(study.load_queue(queue), Path(queue).parent, None)
    done = [row["name"] for row in rows if row["state"] == "done"]
    return len(done), len(rows), done


@functools.cache
def study_groups(queue: str = "survival", results: Path = RESULTS) -> dict[str, list[RunFacts]]:
    """The done runs of one of the attribution study's queues (`STUDY`; `queue_progress`) by group (the arm,
    and a grid cell's tag: "fa2-lr8e-3"), in name order."""
    runs = explode_runs(results)
    _, _, names = queue_progress(Path(results) / "explode" / queue / "queue.json")
    groups: dict[str, list[RunFacts]] = {}
    for name in sorted(names):
        groups.setdefault(split_name(name)[0], []).append(runs[f"{queue}/{name}"])
    return groups


GRID_PLACEMENTS = ("fa2", "paper64", "attn-fp32")  # the lr-qknorm queue's arms
GRID_CONTROL = ("model-fp32", 1e-3, False)  # and its control: no bf16 anywhere, at 1e-3, no QK-LayerNorm


@functools.cache
def horizon(queue: str = "lr-qknorm", results: Path = RESULTS) -> int:
    """A study queue's horizon in steps, as its queue file sets it."""
    return study.load_queue(Path(results) / "explode" / queue / "queue.json")["horizon"]


def grid_runs(results: Path = RESULTS) -> dict[tuple[str, float, bool], list[RunFacts]]:
    """The lr-qknorm queue's done runs (`study_groups`) by (placement, learning rate, QK-LayerNorm on: its
    group's tag ends in "-qkln")."""
    cells: dict[tuple[str, float, bool], list[RunFacts]] = {}
    for name, group in study_groups("lr-qknorm", results).items():
        for r in group:
            cells.setdefault((r.arm, r.lr, name.endswith("-qkln")), []).append(r)
    return cells


def grid_cell(lr: str, qk_layernorm: bool = False, results: Path = RESULTS) -> dict[str, list[RunFacts]]:
    """The lr-qknorm queue's done runs at one learning rate (as its tags write it: "8e-3"), with or without
    QK-LayerNorm, by placement (`GRID_PLACEMENTS`; an empty list where none is done)."""
    cells = grid_runs(results)
    return {arm: cells.get((arm, float(lr), qk_layernorm), []) for arm in GRID_PLACEMENTS}


def qk_pairs(results: Path = RESULTS) -> dict[tuple[str, float], tuple[list[RunFacts], list[RunFacts]]]:
    """Every lr-qknorm cell with a done QK-LayerNorm run: {(placement, learning rate): (the runs without it,
    the runs with it)}, highest learning rate first, placements in `GRID_PLACEMENTS` order."""
    cells = grid_runs(results)
    return {(arm, lr): (cells.get((arm, lr, False), []), cells[arm, lr, True])
            for lr in sorted({lr for _, lr, on in cells if on}, reverse=True) for arm in GRID_PLACEMENTS
            if (arm, lr, True) in cells}


def normed_seeds(results: Path = RESULTS) -> str:
    """How many seeds the lr-qknorm cells with QK-LayerNorm hold, in words (`seeds_per_cell`)."""
    return seeds_per_cell(with_it for _, with_it in qk_pairs(results).values())


def twins(results: Path = RESULTS) -> list[tuple[RunFacts, RunFacts]]:
    """The lr-qknorm queue's same-seed pairs (without QK-LayerNorm, with it) of one placement and learning
    rate (`grid_runs`), in `qk_pairs` order."""
    return [(plain, normed) for without, with_it in qk_pairs(results).values()
            for normed in with_it for plain in without if plain.seed == normed.seed]


def qk_changed(results: Path = RESULTS, arm: str | None = None,
               lr: float | None = None) -> tuple[int, int, float]:
    """Of the same-seed pairs (`twins`; of placement `arm` and learning rate `lr` only, where given): how many
    ran away only without QK-LayerNorm, how many only with it, and the two-sided sign test of those two counts
    (`sign_test`)."""
    pairs = [(a, b) for a, b in twins(results) if arm in (None, a.arm) and lr in (None, a.lr)]
    without = sum(a.runaway is not None and b.runaway is None for a, b in pairs)
    with_it = sum(b.runaway is not None and a.runaway is None for a, b in pairs)
    return without, with_it, sign_test(without, without + with_it)


TIMING_DEVICE = "NVIDIA H200"  # speeds compare runs made on this GPU only (study runs came on H100s too)


def timed_runs(runs: list[RunFacts], results: Path = RESULTS, device: str = TIMING_DEVICE) -> list[RunFacts]:
    """The runs among `runs` whose speeds compare: made on `device` (their record's provenance) and compiled
    whole (`study.broke_graphs`)."""
    records = explode_records(results)
    return [r for r in runs if records[r.name].provenance.get("device") == device
            and study.broke_graphs(records[r.name].path) is False]


def tokens_per_s(runs: list[RunFacts], results: Path = RESULTS, device: str = TIMING_DEVICE) -> float:
    """The median training tokens/s of the `timed_runs` among study runs (each alone on its GPU, deterministic
    mode). ValueError when there is none."""
    timed = timed_runs(runs, results, device)
    if not timed:
        raise ValueError(f"tokens_per_s: none of {[r.name for r in runs]} ran on {device} compiled whole")
    summaries = [explode_records(results)[r.name].summary for r in timed]
    return statistics.median(summary["tokens"] / summary["time_s"] for summary in summaries)


def by_seed(first: list[RunFacts], second: list[RunFacts]) -> list[tuple[int, int, int, int]]:
    """Per seed of either group: (runaways, runs) of `first`, then of `second` (`stratified_p`'s strata)."""
    def count(group: list[RunFacts], seed: int) -> tuple[int, int]:
        runs = [r for r in group if r.seed == seed]
        return sum(r.runaway is not None for r in runs), len(runs)

    return [(*count(first, s), *count(second, s)) for s in sorted({r.seed for r in first + second})]


@dataclass(frozen=True)
class HalfRate:
    """The half-rate contrasts of the learning-rate queue: its runs at 1e-3 without QK-LayerNorm (`bf16`:
    `fa2` and `paper64`; `fp32`: attention in fp32; `control`: `model-fp32`), and `fa2` at 1e-3 against `fa2`
    in the same seeds at the recipe's rate (its survival runs) and twice it; each contrast's runaways by
    Fisher's exact test and by the exact test within seeds."""

    bf16: list[RunFacts]
    fp32: list[RunFacts]
    control: list[RunFacts]
    fa2_half: list[RunFacts]
    fa2_recipe: list[RunFacts]
    fa2_twice: list[RunFacts]

    @property
    def p(self) -> float:
        return fisher_p(*tally(self.bf16, "runaway"), *tally(self.fp32 + self.control, "runaway"))

    @property
    def p_seeds(self) -> float:
        return stratified_p(by_seed(self.bf16, self.fp32 + self.control))

    @property
    def p_fa2(self) -> float:
        return fisher_p(*tally(self.fa2_half, "runaway"), *tally(self.fa2_recipe + self.fa2_twice, "runaway"))

    @property
    def p_fa2_seeds(self) -> float:
        return stratified_p(by_seed(self.fa2_half, self.fa2_recipe + self.fa2_twice))


@dataclass(frozen=True)
class PrimaryTest:
    """The survival study's primary test, as PROTOCOL registered it: runaways by the horizon of `bf16rowsum`
    (only the row sum in bf16) against `fp32pv` (the same arm with it in fp32), Fisher's exact test read on
    its own, the exact test within seeds beside it."""

    bf16: list[RunFacts]
    fp32: list[RunFacts]

    @property
    def counts(self) -> list[tuple[int, int]]:
        return [tally(self.bf16, "runaway"), tally(self.fp32, "runaway")]

    @property
    def p(self) -> float:
        return fisher_p(*self.counts[0], *self.counts[1])

    @property
    def p_seeds(self) -> float:
        return stratified_p(by_seed(self.bf16, self.fp32))


def primary_test(results: Path = RESULTS) -> PrimaryTest:
    """The `PrimaryTest` runs of the survival queue's records (`study_groups`)."""
    groups = study_groups("survival", results)
    return PrimaryTest(groups.get("bf16rowsum", []), groups.get("fp32pv", []))


SECONDARY_CONTROLS = ("fa2", "model-fp32")  # the production placement; no bf16 anywhere


@dataclass(frozen=True)
class SecondaryTest:
    """One of the survival study's secondary tests, as PROTOCOL registered them: an arm's runaways by the
    horizon against a control's (`arms`), the exact log-rank p (`analysis.log_rank`), corrected (Bonferroni)
    for the `tests` such tests; `planned`: each arm's runs in the queue."""

    arms: tuple[str, str]
    outcomes: tuple[list[Outcome], list[Outcome]]
    planned: tuple[int, int]
    horizon: int
    p: float
    tests: int

    @property
    def counts(self) -> list[tuple[int, int]]:
        return [tally(group, "runaway") for group in self.outcomes]

    def bonferroni(self, p: float) -> float:
        """`p` corrected for the `tests` secondary tests."""
        return min(1.0, p * self.tests)

    @property
    def corrected(self) -> float:
        return self.bonferroni(self.p)

    @property
    def label(self) -> str:
        """"`a` against `b` (k of n against k of n)", in Markdown."""
        return (" against ".join(f"`{arm}`" for arm in self.arms) + " ("
                + " against ".join(f"{k} of {n}" for k, n in self.counts) + ")")

    @property
    def more(self) -> tuple[int, int]:
        """Each arm's runs still to be made."""
        return tuple(n - len(group) for n, group in zip(self.planned, self.outcomes, strict=True))

    @property
    def to_come(self) -> int:
        return sum(self.more)

    def ends(self) -> tuple[float, float]:
        """The corrected p's range over every outcome of the two arms' runs still to be made
        (`analysis.log_rank_range`)."""
        low, high = log_rank_range(*(event_times(group, "runaway") for group in self.outcomes), *self.more,
                                   self.horizon)
        return self.bonferroni(low), self.bonferroni(high)

    @property
    def settled(self) -> bool:
        """Below 5% corrected whatever the runs still to be made give (`ends`)."""
        return self.ends()[1] < 0.05


def secondary_tests(results: Path = RESULTS) -> list[SecondaryTest]:
    """The survival queue's secondary tests that its records allow (each arm against each control of
    `SECONDARY_CONTROLS` recorded, one test per pair of arms), smallest p first."""
    path = Path(results) / "explode" / "survival" / "queue.json"
    queue = study.load_queue(path)
    planned = collections.Counter(row["group"] for row in study.states(queue, path.parent, None))
    groups, records = study_groups("survival", results), explode_records(results)
    arms = {group: [outcome(records[r.name], queue["horizon"]) for r in groups[group]]
            for group in planned if group in groups}
    pairs = [(arm, control) for arm in arms for control in SECONDARY_CONTROLS
             if control in arms and control != arm]
    pairs = [(a, c) for i, (a, c) in enumerate(pairs) if (c, a) not in pairs[:i]]  # fa2 v model-fp32 once
    tests = [SecondaryTest((a, c), (arms[a], arms[c]), (planned[a], planned[c]), queue["horizon"],
                           log_rank(event_times(arms[a], "runaway"), event_times(arms[c], "runaway"))[1],
                           len(pairs)) for a, c in pairs]
    return sorted(tests, key=lambda test: test.p)


ROUNDS = {  # each arm a settled secondary test can name, and what it rounds to bf16
    "bf16rowsum": "`bf16rowsum`, which rounds $\\ell$ to bf16 and not $\\bar P$",
    "paper64": "the authors' placement (`paper64`), which rounds $\\ell$ and $\\bar P$ both (and the scores, "
               "the $\\bar P V$ result and the running output)",
    "fa2": "the production placement (`fa2`), which rounds $\\bar P$ and not $\\ell$",
    "model-fp32": "the model with no bf16 anywhere (`model-fp32`)"}


def settled_reading(tests: list[SecondaryTest]) -> str:
    """What the settled `tests` say together, in Markdown: each arm ran away more often than its controls;
    each arm is described (`ROUNDS`) where it is first named."""
    said: set[str] = set()

    def name(arm: str) -> str:
        claim(arm in ROUNDS, f"settled tests of the arms ROUNDS describes, not of {arm}")
        first = arm not in said
        said.add(arm)
        return ROUNDS[arm] if first else f"`{arm}`"

    controls: dict[str, list[str]] = {}
    for test in tests:
        controls.setdefault(test.arms[0], []).append(test.arms[1])
    return "; ".join(f"{name(arm)}, ran away more often than " + ", and than ".join(map(name, against))
                     for arm, against in controls.items())


def half_rate(results: Path = RESULTS) -> HalfRate:
    """The `HalfRate` runs of the records (`lr_finding` checks what it says of them)."""
    half = [r for group in grid_cell("1e-3", False, results).values() for r in group]
    seeds = {r.seed for r in half}
    bf16 = [r for r in half if r.arm != "attn-fp32"]
    return HalfRate(bf16, [r for r in half if r.arm == "attn-fp32"], grid_runs(results).get(GRID_CONTROL, []),
                    [r for r in bf16 if r.arm == "fa2"],
                    [r for r in study_groups("survival", results).get("fa2", []) if r.seed in seeds],
                    grid_cell("4e-3", False, results)["fa2"])


def lr_finding(results: Path = RESULTS) -> str:
    """What the learning-rate x QK-LayerNorm queue shows so far, in one Markdown paragraph that the intro and
    chapters 3 to 5 share (its `model-fp32` runs at 1e-3, the control without bf16, join attention in fp32 in
    the half-rate contrast); `StaleClaim` when a record contradicts it."""
    cells, records = grid_runs(results), explode_records(results)
    steps_per_run = horizon("lr-qknorm", results)
    claim(all(arm in GRID_PLACEMENTS or (arm, lr, on) == GRID_CONTROL for arm, lr, on in cells),
          "the lr-qknorm records hold runs of fa2, paper64 and attn-fp32, and of model-fp32 at 1e-3 without "
          "QK-LayerNorm only")
    contrast = half_rate(results)
    control = contrast.control
    high, twice, half = ([r for group in grid_cell(lr, False, results).values() for r in group]
                         for lr in ("8e-3", "4e-3", "1e-3"))
    claim(len({r.arm for r in high}) == 3 and all(r.runaway is not None for r in high),
          "every placement ran away at 8e-3, attention in fp32 included")
    per_placement = seeds_per_cell(grid_cell("8e-3", False, results).values())  # seeds at 8e-3
    went = [r for r in twice if r.runaway is not None]
    claim([r.arm for r in went] == ["paper64"] and len({r.seed for r in twice}) == 2,
          "at 4e-3 (two seeds) only paper64 ran away, once")
    peak = {r.name: largest_logit(records[r.name]) for r in twice + half + control}
    claim(all(peak[r.name] > 200 and last_logit(records[r.name]) < peak[r.name] / 2 for r in twice),
          "at 4e-3 every run's largest logit climbed past 200 and fell back below half its peak")
    bf16, fp32 = contrast.bf16, contrast.fp32
    seeds = sorted({r.seed for r in half})
    claim(len(seeds) >= 4 and len(bf16) == 2 * len(seeds) and len(fp32) == len(seeds)
          and all(r.runaway is not None for r in bf16) and not any(r.runaway for r in fp32)
          and max(peak[r.name] for r in fp32) < 100,
          "at 1e-3 (every seed) every fa2 and paper64 run ran away, attn-fp32 stayed below 100")
    claim(not any(r.runaway for r in control), "at 1e-3 no run without bf16 anywhere (model-fp32) ran away")
    p, p_seeds = contrast.p, contrast.p_seeds
    claim(p < 0.01 and p_seeds < 0.05, "at 1e-3 bf16 against no bf16 in attention: Fisher's exact test below "
          "0.01, the test within seeds below 0.05")
    nor = "" if not control else (
        ", nor the model with no bf16 anywhere (`model-fp32`: fp32 throughout, TF32 off) in "
        + ("its one run" if len(control) == 1 else f"any of {len(control)}")
        + f" (largest logit at most {max(peak[r.name] for r in control):.0f})")
    recipe_fa2, fa2_twice, fa2_half = contrast.fa2_recipe, contrast.fa2_twice, contrast.fa2_half
    claim(len(recipe_fa2) >= 3 and not any(r.runaway for r in recipe_fa2 + fa2_twice),
          "fa2 in the same seeds: no runaway at the recipe's rate (its survival runs) or at twice it")
    p_fa2, p_fa2_seeds = contrast.p_fa2, contrast.p_fa2_seeds
    claim(all(r.runaway <= steps_per_run for r in fa2_half) and p_fa2 < 0.01,
          "fa2 by the horizon: every run at 1e-3, none at 2e-3 or 4e-3 (Fisher p below 0.01)")
    onset = {(r.arm, r.seed): r.runaway for r in bf16}
    paper_recipe = {r.seed: r.runaway for r in study_groups("survival", results).get("paper64", [])}
    claim(all(s in paper_recipe and (paper_recipe[s] or math.inf) > onset["paper64", s] for s in seeds),
          "paper64 ran away sooner at 1e-3 than at 2e-3 in every seed run at both")
    other_seeds, survival_end = sorted(paper_recipe.keys() - set(seeds)), horizon("survival", results)
    claim(all(onset["paper64", s] < onset["fa2", s] for s in seeds),
          "paper64 before fa2 in every seed at 1e-3")
    stopped = [r for r in half if r.explosion is not None]
    claim(0 < len(stopped) < len(bf16) and all(r in bf16 for r in stopped),
          "at 1e-3 some bf16 runs, not all, and no fp32 run reached the stop rule")
    def steps(arm: str) -> str:
        return ", ".join(f"{r.runaway:,}" for r in sorted(bf16, key=lambda r: r.seed) if r.arm == arm)

    def recipe_steps(seeds: list[int]) -> str:  # paper64's survival runs (2e-3) of these seeds
        said = [f"{paper_recipe[s]:,}" if paper_recipe[s] else f"not by {survival_end:,}" for s in seeds]
        return ", ".join(said[:-1]) + f" and {said[-1]}"

    normed = [r for (_, _, on), group in cells.items() if on for r in group]
    claim(normed and not any(r.runaway or r.spike or r.explosion for r in normed),
          "with QK-LayerNorm no run ran away or spiked")
    lrs = sorted({r.lr for r in normed})
    def listed(group: list[RunFacts]) -> str:
        return ", ".join(str(r.seed) for r in group)

    return (
        f"At half the recipe's learning rate ({latex(1e-3)}, {steps_per_run:,} steps per run) every bf16 run "
        f"ran away ({len(bf16)} of {len(bf16)} over {len(seeds)} seeds: `paper64` at steps "
        f"{steps('paper64')}, `fa2` at {steps('fa2')}; {len(stopped)} of them then reached the stop rule) "
        f"and attention computed entirely in fp32 in none of {len(fp32)} (its largest logit at most "
        f"{max(peak[r.name] for r in fp32):.0f}){nor}. Fisher's exact test of {len(bf16)} of {len(bf16)} "
        f"against 0 of {len(fp32) + len(control)} gives p = {p:#.2g}; the runs of one seed share its initial "
        f"weights and batches, and the exact test within seeds (the same contrast, seed by seed) gives "
        f"p = {p_seeds:#.2g}: at that rate a bf16 rounding point in "
        f"attention starts a runaway that the learning rate alone does not (which rounding point, this "
        f"contrast does not say: the two bf16 placements share several, $\\bar P$ rounded for $\\bar PV$ "
        f"among them). A lower rate did not prevent it and may have brought it forward: by step "
        f"{steps_per_run:,} `fa2` ran away "
        f"in {len(fa2_half)} of {len(fa2_half)} runs at half the recipe's rate and in 0 of "
        f"{len(recipe_fa2) + len(fa2_twice)} at the recipe's rate (seeds {listed(recipe_fa2)}, none by "
        f"{horizon('survival', results):,} either) and twice it (seeds {listed(fa2_twice)}), Fisher's exact "
        f"test p = {p_fa2:#.2g}, within seeds p = {p_fa2_seeds:#.2g}; the authors' placement ran away sooner "
        f"at half the rate in each of the {len(seeds)} seeds (at steps {steps('paper64')}, against "
        f"{recipe_steps(seeds)} at the recipe's rate in its survival runs"
        + (f"; seeds {seed_ranges(other_seeds)} there: {recipe_steps(other_seeds)}" if other_seeds else "")
        + ") and "
        f"before `fa2` in each of them at half the rate (its row sum and scores in bf16 too). "
        f"A high rate is a second growth, bf16 or not: at {latex(8e-3)}, four times the recipe's rate, "
        f"every placement ran away, attention in fp32 included ({len(high)} of {len(high)} runs, "
        f"{per_placement} per placement); "
        f"at {latex(4e-3)} {len(went)} of {len(twice)} did (`paper64`, seed {went[0].seed}, step "
        f"{went[0].runaway:,}), while every run's largest logit climbed (to "
        f"{min(peak[r.name] for r in twice):,.0f}-{max(peak[r.name] for r in twice):,.0f}) and fell back. "
        f"With QK-LayerNorm none of {len(normed)} runs ran away or spiked ({latex(lrs[0])} to "
        f"{latex(lrs[-1])}).")


def shared_spikes(queue: str = "survival", results: Path = RESULTS) -> dict[int, tuple[int, list[RunFacts]]]:
    """Per seed of a study queue's done runs (`study_groups`): the step at which most of its runs without a
    runaway first spiked (`common_spikes`), and every run of the seed that first spiked there."""
    return common_spikes([r for group in study_groups(queue, results).values() for r in group])


def common_spikes(runs: list[RunFacts]) -> dict[int, tuple[int, list[RunFacts]]]:
    """Per seed with at least two runs among `runs` that never ran away and spiked: the step at which most of
    those first spiked (`RunFacts.spike`; of equally common steps the earliest), and every run of the seed
    that first spiked there (a run that ran away spikes for its own reason, so it has no vote); other seeds
    are left out."""
    by_seed: dict[int, list[RunFacts]] = {}
    for r in runs:
        by_seed.setdefault(r.seed, []).append(r)
    out = {}
    for seed, group in sorted(by_seed.items()):
        steps = [r.spike for r in group if r.spike is not None and r.runaway is None]
        if len(steps) > 1:
            step = max(sorted(set(steps)), key=steps.count)
            out[seed] = (step, [r for r in group if r.spike == step])
    return out


def survival_repeats(results: Path = RESULTS) -> dict[str, tuple[Run, Run]]:
    """The survival runs made again on a second machine (results/train/survival-repeat/), by name: (the
    repeat, the run in the queue's folder)."""
    return {path.name: (load_run(path), explode_records(results)[f"survival/{path.name}"])
            for path in sorted((Path(results) / "train" / "survival-repeat").iterdir()) if path.is_dir()}


def bottom_line(results: Path = RESULTS) -> str:
    """Five Markdown paragraphs, each number counted from the records under `results`; `StaleClaim` when a
    record contradicts a claim."""
    results = Path(results)
    runs = explode_runs(results)
    survival_steps, grid_steps = horizon("survival", results), horizon("lr-qknorm", results)
    paper, fa2 = select(runs, "paper64"), select(runs, "fa2")
    for arm, group in (("paper64", paper), ("fa2", fa2)):
        claim(len(group) == 3 and len({r.seed for r in group}) == 3, f"{arm}: three seeds at 32k")
    claim(tally(paper, "runaway")[0] == 3, "paper64 ran away in 3 of 3 at 32k")
    claim(all(r.first_layer == 1 for r in paper), "layer index 1 first in every paper64 runaway")
    claim(tally(paper, "spike")[0] == 3 and tally(paper, "explosion")[0] == 0,
          "paper64 at 32k: a spike in every seed, the stop rule in none")
    claim(tally(fa2, "runaway")[0] == 1 and tally(fa2, "explosion")[0] == 0, "fa2 ran away in 1 of 3 at 32k")
    big_paper, big_fa2 = runs["bigbatch/paper64-s1337"], runs["bigbatch-fa2/fa2-s1337"]
    claim(all(r.tokens_per_step == LARGE and r.explosion is not None and r.runaway is not None
              and r.runaway < r.explosion for r in (big_paper, big_fa2)),
          "both placements exploded at 262k, each after a runaway")
    exploded = [r for r in runs.values() if r.explosion is not None]
    small_stops = [r for r in exploded if r.tokens_per_step == SMALL]
    large_stops = [r for r in exploded if r.tokens_per_step == LARGE]
    claim(len(small_stops) + len(large_stops) == len(exploded) and len(small_stops) > len(large_stops) > 0,
          "most explosions at the small batch, the rest at the large one")
    half_fa2 = grid_cell("1e-3", False, results)["fa2"]
    study_fa2 = study_groups("survival", results).get("fa2", [])
    claim(half_fa2 and all(r.runaway for r in half_fa2) and study_fa2
          and not any(r.runaway for r in study_fa2) and all(r.corpus == LEAD for r in fa2)
          and all(r.corpus == BIG_CORPUS for r in half_fa2 + study_fa2),
          "fa2: every run at 1e-3, no survival run at 2e-3 (both on the large corpus); the lead runs' corpus")
    what = (
        f"**What fails.** A 6-layer GPT-2 ($d = 384$, {SMALL:,} tokens per step, learning rate "
        f"$2 \\cdot 10^{{-3}}$, the `{LEAD}` corpus) trained with the authors' all-bf16 attention placement "
        f"(`paper64`): the paper's layer 2 ran away (its largest logit past $10^3$) in "
        f"{rate(*tally(paper, 'runaway'), 'seeds')} and the loss spiked in {tally(paper, 'spike')[0]}, "
        f"though the trainer's stop rule fired in none; "
        f"the production placement (`fa2`) ran away in {rate(*tally(fa2, 'runaway'), 'seeds')}. At "
        f"{LARGE:,} tokens per step both exploded, one seed each (runaway at steps "
        f"{big_paper.runaway:,} and {big_fa2.runaway:,}, the stop rule at {big_paper.explosion:,} and "
        f"{big_fa2.explosion:,}). `fa2` is how FlashAttention-2, SDPA and cuDNN round; on the larger "
        f"`{BIG_CORPUS}` corpus at {SMALL:,} tokens per step it ran away in none of its "
        f"{len(study_fa2)} runs at that learning rate ({horizon('survival', results):,} steps each) and in "
        f"all {len(half_fa2)} at half of it ({tally(half_fa2, 'explosion')[0]} of them then exploded). Of "
        f"the {len(exploded)} runs the stop rule ended, {len(small_stops)} were at {SMALL:,} tokens per "
        f"step.")

    rowsum, fp32pv, nopv = (select(runs, arm) for arm in ("bf16rowsum", "fp32pv", "paper64-fp32pv"))
    claim(tally(rowsum, "runaway") == (7, 12), "bf16rowsum: 7 of 12 at 32k")
    claim(tally(fp32pv, "runaway") == (0, 7), "fp32pv: 0 of 7 at 32k")
    claim(tally(nopv, "runaway") == (3, 3), "paper64-fp32pv: 3 of 3")
    both = {r.seed for r in rowsum} & {r.seed for r in fp32pv}
    ell_p, ell_p_seeds = fisher_p(*tally(rowsum, "runaway"), *tally(fp32pv, "runaway")), stratified_p(
        by_seed(rowsum, fp32pv))
    claim(ell_p < 0.05 < ell_p_seeds, "bf16rowsum against fp32pv: Fisher below 0.05, within seeds not")
    big_fp32pv = select(runs, "fp32pv", LARGE, BIG_CORPUS)
    claim(len(big_fp32pv) == 2 and {r.seed for r in big_fp32pv} == {1337}
          and all(r.runaway and not r.explosion for r in big_fp32pv),
          "fp32pv at 262k: both runs of seed 1337 ran away, neither exploded")
    study_arms = study_groups("survival", results)
    plain_fa2, plain_fp32 = study_arms.get("fa2", []), study_arms.get("attn-fp32", [])
    claim(plain_fa2 and plain_fp32 and not any(r.runaway for r in (*plain_fa2, *plain_fp32)),
          "fa2 and attn-fp32 at the recipe's learning rate: no survival runaway")
    sv_done, sv_total, _ = queue_progress(results / "explode" / "survival" / "queue.json")
    planned = collections.Counter(r["arm"] for r in study.load_queue(
        results / "explode" / "survival" / "queue.json")["runs"])  # runs per arm
    per_arm = max(planned.values())
    primary = primary_test(results)
    (bf16_k, bf16_n), (fp32_k, fp32_n) = primary.counts
    ell_seeds = {planned[arm] for arm in ("bf16rowsum", "fp32pv")}
    claim(len(ell_seeds) == 1 and bf16_n == fp32_n == min(ell_seeds) and fp32_k > 0,
          "the primary test is made, and fp32pv ran away in it")
    claim(primary.p < 0.05, "the primary test: bf16rowsum runs away more often than fp32pv, p below 0.05")
    secondary = secondary_tests(results)
    settled = [test for test in secondary if test.corrected < 0.05]
    claim([test.arms for test in settled] == [("bf16rowsum", "fa2"), ("bf16rowsum", "model-fp32"),
                                               ("paper64", "fa2"), ("paper64", "model-fp32")]
          and not any(test.to_come for test in settled),
          "four secondary tests below 5%, every planned run of their arms made: bf16rowsum and paper64, each "
          "against fa2 and against model-fp32")
    finding = lr_finding(results)  # its claims include: no run without bf16 anywhere (`control`) ran away
    control = len(half_rate(results).control)
    nor = {0: "", 1: ", nor the one run with no bf16 anywhere"}.get(
        control, f", nor any of the {control} runs with no bf16 anywhere")
    records = explode_records(results)
    pairs = qk_pairs(results)
    normed = [r for _, with_it in pairs.values() for r in with_it]
    compared = twins(results)
    final = {r.name: records[r.name].summary["final_loss"] for pair in compared for r in pair}
    claim(compared and all(final[b.name] < final[a.name] for a, b in compared),
          "QK-LayerNorm: a lower final loss than its same-seed twin without it")
    only_without, only_with, qk_p = qk_changed(results)
    claim(only_without and not only_with, "QK-LayerNorm: of same-seed pairs, only runs without it ran away")
    half = grid_cell("1e-3", False, results)  # lr_finding checked it
    half_went = [arm for arm, group in half.items() if group and all(r.runaway is not None for r in group)]
    normed_logit = [largest_logit(records[r.name]) for r in normed]
    def loss_range(group: Iterable[RunFacts]) -> str:
        losses = [final[r.name] for r in group]
        return f"{min(losses):.2f}-{max(losses):.2f}"
    lrs = sorted({r.lr for r in normed})
    seeds = normed_seeds(results)
    why = (
        "**Why, as far as the records show.** In short: the paper's biased rounding of $\\bar P V$ is not "
        "needed for a runaway; at half the recipe's learning rate every run with bf16 attention ran away and "
        "none with attention in fp32" + nor + "; rounding the row sum $\\ell$ to bf16 made runaways more "
        "likely than keeping it in fp32 (the study's primary test), than the production placement and than "
        "no bf16 anywhere (two secondary tests), and the authors' placement ran away more often than those "
        "two as well (two more); which bf16 rounding point starts the production placement's runaways (its "
        "$\\ell$ is fp32) is open. In full: " + finding
        + " Which rounding point, at the recipe's rate: "
        f"not the paper's biased rounding of $\\bar P V$ alone: with it unrounded (`paper64-fp32pv`) "
        f"{rate(*tally(nopv, 'runaway'), 'seeds')} still ran away. More runs ran away with a bf16 row sum "
        f"$\\ell$: rounding only $\\ell$ (`bf16rowsum`) ran away in {rate(*tally(rowsum, 'runaway'))}, the "
        f"same arm with $\\ell$ in fp32 (`fp32pv`) in {rate(*tally(fp32pv, 'runaway'))} (Fisher's exact "
        f"test p = {ell_p:#.2g}; within the {len(both)} seeds that ran both arms p = {ell_p_seeds:#.2g}; the "
        f"runs are of unequal length, {min(r.steps for r in rowsum + fp32pv):,} to "
        f"{max(r.steps for r in rowsum + fp32pv):,} steps). On the larger `{BIG_CORPUS}` corpus the study's "
        f"primary test of the same two arms ({min(ell_seeds)} seeds each to {survival_steps:,} steps, "
        f"registered before its runs) found {bf16_k} of {bf16_n} against {fp32_k} of {fp32_n} (Fisher's "
        f"exact test, two-sided, p = {primary.p:#.2g}; within seeds p = {primary.p_seeds:#.2g}): rounding "
        f"only $\\ell$ to bf16 made the runaway more likely than keeping it in fp32. Of the study's "
        f"{len(secondary)} secondary tests (each arm's runaways against `fa2` and against `model-fp32`, "
        f"exact log-rank tests corrected for their number) {NUMBER_WORDS[len(settled) - 1]} are below 5%, "
        f"every planned run of both arms made: "
        + "; ".join(f"{test.label}, corrected p = {test.corrected:#.2g}" for test in settled)
        + ". That is, " + settled_reading(settled) + "."
        + " An fp32 $\\ell$ does not rule a runaway out: `fp32pv` ran away in the study too, `fa2` keeps "
        f"$\\ell$ in fp32 and ran away once at {SMALL:,} tokens per step, and at {LARGE:,} `fa2` exploded "
        "and `fp32pv` ran away in both runs of its one seed (without the stop rule). These are counts; no "
        "single run shows a cause. At the recipe's learning rate none "
        f"of the {len(plain_fa2)} `fa2` and {len(plain_fp32)} `attn-fp32` survival runs ran away in "
        f"{survival_steps:,} steps.")

    claim(all(r.runaway is not None and r.runaway < r.explosion for r in exploded),
          "a runaway before every stop")
    ahead = [r.explosion - r.runaway for r in exploded]
    fixed = select(runs, "paper64-fix")
    claim(tally(fixed, "runaway") == (3, 3), "the Fix: paper64-fix ran away in 3 of 3")
    claim(runs["bigbatch-fix/paper64-fix-s1337"].explosion is not None, "the Fix exploded at 262k")
    fp32_attn, fp32_model, cons_fa2 = (study_arms.get(arm, [])
                                       for arm in ("attn-fp32", "model-fp32", "fa2-consistent"))
    fp32_below = [*fp32_attn, *(r for lr in ("4e-3", "1e-3")
                                for r in grid_cell(lr, False, results)["attn-fp32"])]
    claim(not any(r.runaway for r in fp32_below), "attn-fp32: no runaway below 8e-3")
    fp32_cost = tokens_per_s(plain_fa2, results) / tokens_per_s(fp32_attn, results)
    claim(fp32_cost > 1, "attention in fp32 trains slower than fa2")
    claim(fp32_attn and fp32_model and all(r.steps >= survival_steps and r.first_layer is None
                                           for r in (*fp32_attn, *fp32_model)),
          "attn-fp32 and model-fp32: every survival run reached the horizon without a runaway")
    cons_went = [r for r in cons_fa2 if r.runaway is not None]
    cons_stops = [r for r in cons_went if r.explosion is not None]
    claim(cons_stops and plain_fa2 and not any(r.runaway for r in plain_fa2),  # a runaway before each: above
          "fa2-consistent: some survival runs ran away, one or more then exploded; fa2 in none")
    plain, cons = runs["kbit3/kbit3-s3"], runs["kbit3c/kbit3-consistent-s3"]
    claim(plain.spike is not None and cons.spike is None and cons.runaway is not None,
          "consistent: no spike, still a runaway (3-bit, seed 3)")
    change = (
        f"**What to change.** With FlashAttention-2, SDPA or cuDNN your attention rounds like `fa2`: its row "
        f"sum $\\ell$ is already fp32, and `consistent` and the Fix below are not settings of those kernels; "
        f"what is open to you is to watch the logits, normalise queries and keys, or compute attention in "
        f"fp32. Watch every layer's largest logit: in all {len(exploded)} runs the stop rule "
        f"ended, a runaway came first, {min(ahead):,} to {max(ahead):,} steps before it. Against the runaway "
        f"itself, normalise queries and keys: with QK-LayerNorm none of {len(normed)} runs ran away or "
        f"spiked (learning rates {latex(lrs[0])} to {latex(lrs[-1])}, {seeds} per placement and rate; "
        f"largest logit {min(normed_logit):.0f}-{max(normed_logit):.0f}), and each of the {len(compared)} "
        f"that have a same-seed twin without it ended with the lower loss "
        f"({loss_range(b for _, b in compared)} against {loss_range(a for a, _ in compared)}); in the "
        f"{only_without} of those pairs in which one run ran away, it was always the one without it (a "
        f"two-sided sign test, chosen after the runs: p = {qk_p:.2g}): the one change here that held in "
        f"every placement, at {seeds} each. Or compute attention in fp32 "
        f"(`attn-fp32`, {fp32_cost:.1f} times `fa2`'s training time per token on the H200): it ran away in "
        f"none of its {len(fp32_below)} runs below four times the recipe's rate ({grid_steps:,} steps at "
        f"half and twice it, {len(fp32_attn)} survival runs of {survival_steps:,} steps at it), the model "
        f"with no bf16 anywhere (`model-fp32`) in none of its {len(fp32_model) + control} "
        f"({len(fp32_model)} at the recipe's rate, {control} at half): at half the rate, where every bf16 "
        f"run ran away, that contrast holds within seeds too (above); at the recipe's rate `fa2` ran away in "
        f"none of its {len(plain_fa2)} runs either, so there these runs show no gain over the production "
        f"placement. A lower learning rate is no remedy on this evidence: at half the recipe's "
        f"rate both bf16 placements ran away ({', '.join(f'`{arm}`' for arm in half_went)}, "
        f"{len({r.seed for group in half.values() for r in group})} seeds each), sooner than at the "
        f"recipe's. Keep the row sum $\\ell$ and the scores in fp32, as the production placement does (with "
        f"$\\ell$ in bf16 more runs ran away at the recipe's rate, counts above; with it in fp32 `fa2` and "
        f"`fp32pv` still did). Do not count on the paper's Fix: with it "
        f"the authors' placement ran away in {rate(*tally(fixed, 'runaway'), 'seeds')} and exploded at "
        f"{LARGE:,} tokens per step. Summing the rounded weights into $\\ell$ (`consistent`) stopped the "
        f"loss spike of one 3-bit-$\\bar P$ run but not its runaway (one seed), and in bf16 training on the "
        f"production placement (`fa2-consistent`) {rate(*tally(cons_fa2, 'runaway'))} ran away (at steps "
        f"{', '.join(f'{r.runaway:,}' for r in cons_went)}; the stop rule at "
        f"{', '.join(f'{r.explosion:,}' for r in cons_stops)}) where `fa2` did not in {len(plain_fa2)}: no "
        f"evidence that it prevents the runaway.")

    lr_done, lr_total, _ = queue_progress(results / "explode" / "lr-qknorm" / "queue.json")
    went = [r for group in study_arms.values() for r in group if r.runaway is not None]
    claim(all(r.first_layer == 1 for r in went), "every survival runaway began in layer index 1")
    def onsets(group: list[RunFacts]) -> str:
        steps = [f"{r.runaway:,}" for r in group if r.runaway is not None]
        return f" (at step{'s' * (len(steps) > 1)} {', '.join(steps)})" if steps else ""
    def per_group(groups: dict[str, list[RunFacts]]) -> str:
        return "; ".join(f"`{name}` {tally(group, 'runaway')[0]} of {len(group)}{onsets(group)}"
                         for name, group in sorted(groups.items()))
    def by_rate(cells: dict[tuple[str, float, bool], list[RunFacts]]) -> str:
        def count(lr: float, on: bool) -> str:
            group = [r for (arm, rate, with_it), cell in cells.items()
                     if (rate, with_it) == (lr, on) and arm in GRID_PLACEMENTS for r in cell]
            if group:
                return f"{tally(group, 'runaway')[0]} of {len(group)}"
            if (lr, on) == (RECIPE[1], False):  # the survival runs of the grid's placements, to its horizon
                survived = [r for arm in GRID_PLACEMENTS for r in study_arms.get(arm, [])]
                early = sum(r.runaway is not None and r.runaway <= grid_steps for r in survived)
                return f"{early} of {len(survived)} survival runs by step {grid_steps:,}"
            return "not yet run"
        return "; ".join(f"{latex(lr)}: {count(lr, False)}, {count(lr, True)}"
                         for lr in sorted({lr for _, lr, _ in cells}, reverse=True))
    larger = [r.steps for r in runs.values() if r.config != RECIPE[0]]
    claim(max(larger) < 3000, "no larger model trained past 3,000 steps")
    repro = json.loads((results / "train" / "reproducibility.json").read_text())
    det, default = repro["twins"]["deterministic"], repro["twins"]["default"]
    claim(det["identical_weights"] and not default["identical_weights"],
          "deterministic twins agree, default-mode twins do not")
    study_modes = {records[name].config.get("deterministic") for name in runs if name.split("/")[0] in STUDY}
    lead_modes = {records[r.name].config.get("deterministic") for r in paper + fa2 + rowsum + fp32pv}
    claim(study_modes == {True} and True not in lead_modes, "the study's runs deterministic, the hunt's not")
    again = survival_repeats(results)
    claim(len(again) == 2 and all(
        first_difference(run, first, None) is None
        and run.summary["weights_sha256"] == first.summary["weights_sha256"]
        for run, first in again.values()), "two survival runs made twice: same values, same weights")
    grid = grid_runs(results)
    lr_progress = (f"all {lr_total} runs of that study are done" if lr_done == lr_total
                   else f"done: {lr_done} of the {lr_total} runs of that study")
    sv_progress, sv_even = (
        (f"all {sv_total} runs of the survival study are done", "") if sv_done == sv_total
        else (f"of the survival study's {sv_total} runs, {sv_done} are done", "even complete "))
    untested = (
        f"**Untested.** QK-LayerNorm beyond {seeds} per placement and rate, the learning rate between and "
        f"beyond the {len({lr for _, lr, _ in grid})} rates measured and past {grid_steps:,} steps "
        f"({lr_progress}; runaways by learning rate, without and with QK-LayerNorm: {by_rate(grid)}), "
        f"QK-clip, z-loss and larger "
        f"models (none ran past {max(larger):,} steps); {sv_progress} (runaways by arm: "
        f"{per_group(study_arms)}; every one in layer index 1), and {sv_even}its {per_arm} runs per arm tell "
        f"a 60% runaway rate from none only "
        f"{detection_power(0.6, 0.0, per_arm):.0%} of the time (Fisher's exact test at 5%): enough for a "
        f"large effect, not for a modest one. "
        f"Same-seed runs in the older records are not repeatable: two default-mode "
        f"twins' logged losses differ by up to {default['max_logged_loss_gap']} "
        f"within {repro['steps']:,} steps, while the deterministic mode gave one weights hash for "
        f"{len(det['runs'])} runs, and two of the survival runs, made again on a second machine "
        f"({', '.join(f'`{name}`' for name in again)}), logged the same values at every step, to their stop "
        f"rules, and ended with the same weights. So in the deterministic mode, which every run of the "
        f"study used, a seed fixes a run; the earlier runs (the counts at {SMALL:,} tokens per step on "
        f"`{LEAD}` above) were made in the default mode, where two runs of one seed are two samples; an "
        f"arm's onset is a rate over seeds, not one run's step.")

    where = (
        "**Where each is shown.** Runaways, spikes and explosions by placement, batch and Fix: "
        "[chapter 3](03-explosion.md); the rounding's effect on $W^Q$, controlled and in training: "
        "[chapter 4](04-mechanism.md); the cures, their bias and cost: [chapter 5](05-fix.md); what to "
        "do about a symptom: [Symptoms and what to change](symptoms.md); the words: "
        "[Glossary](glossary.md).")
    return "\n\n".join((what, why, change, untested, where))

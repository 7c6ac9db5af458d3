"""Analysis of recorded runs for the book and the experiments: signed-error statistics (`ErrorStats`),
per-head t-scores of the δ error, the paper's signature, the logits' onsets (runaways, `first_past`,
`first_over`, `first_layer`) and growth (`window_growth`, `head_growth`, `fastest_head`), loss spikes, a
run's events, recipe and name (`outcomes`, `recipe`, `recipe_label`, `split_name`), several experiment
folders' runs at once (`experiment_runs`), criterion records (`criterion`, `combined_z`, `layer_t2`), one-line
run summaries, and the survival statistics of many runs (`outcome`, `kaplan_meier`, `log_rank` by permutation,
`wilson`, `fisher_p`, `stratified_p` within seeds, `survival_table`) and a learning-rate grid's (`lr_sweep`).

Reads records through lowprec.runs and computes with torch on small tensors; it imports no model, training or
kernel code, so a chapter that only reads results stays fast.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from lowprec.runs import Run, RunRecordError, load_experiment, load_run

SPIKE_FACTOR = 1.25  # a "spike": the smoothed loss rises this far above its running minimum
SPIKE_WINDOW = 5     # logged records (log_interval steps each) in the moving mean the spike rule uses
RUNAWAY_LOGIT = 1e3  # a "runaway": a layer's largest attention logit passes this
BIASED_T = 4.0       # "biased": a signed error whose |t| (mean / standard error) is at least this


@dataclass(frozen=True)
class ErrorStats:
    """Signed error summary: mean, std, t = mean / (std / √n) and the sample size n."""

    mean: float
    std: float
    t: float
    n: int

    @classmethod
    def of(cls, err: torch.Tensor) -> ErrorStats:
        e = err.detach().double().flatten()
        n = e.numel()
        mean, std = e.mean().item(), e.std().item() if n > 1 else 0.0
        t = mean / (std / math.sqrt(n)) if std > 0 else (0.0 if mean == 0 else math.copysign(math.inf, mean))
        return cls(mean=mean, std=std, t=t, n=n)


def head_t_scores(run: Run, before: int | None = None) -> torch.Tensor:
    """(layers, heads) t-statistic of each head's per-sample signed δ error (`delta_error` telemetry): mean
    over the sampled steps (those before step `before`, if given) / its standard error. Noise gives roughly
    N(0, 1) per head, so Σt² ≈ heads."""
    steps, err = run.telemetry("delta_error")  # err[sample][layer][head]
    kept = [e for s, e in zip(steps, err, strict=True) if before is None or s < before]
    err = torch.tensor(kept, dtype=torch.float64)
    return torch.tensor([[ErrorStats.of(err[:, i, h]).t for h in range(err.shape[2])]
                         for i in range(err.shape[1])])


def signature(run: Run) -> dict:
    """The paper's signature in one run's telemetry, for the head whose δ error is most one-signed.

    That head's t (`head_t_scores`), the fraction of samples at which the running sum `delta_error_cum` has
    its final sign, ‖W_Q,h‖ last / first, and P̄ == 1 entries per sampled row, first and last sample; over all
    heads the largest |t|, Σt² (null: the number of heads) and the largest ‖W_Q,h‖ growth.
    """
    steps = run.telemetry("delta_error")[0]
    if len(steps) < 3:
        return {"samples": len(steps)}
    t = head_t_scores(run)
    cum = torch.tensor(run.telemetry("delta_error_cum")[1], dtype=torch.float64)
    wq = torch.tensor(run.telemetry("wq_norm")[1], dtype=torch.float64)
    ones = torch.tensor(run.telemetry("pbar_ones")[1], dtype=torch.float64)
    rows = run.telemetry("rows")[1]
    layers, heads = t.shape
    layer, head = divmod(int(t.abs().argmax()), heads)
    final_sign = torch.sign(cum[-1, layer, head])
    return {
        "samples": len(steps), "first_step": steps[0], "last_step": steps[-1],
        "heads": layers * heads, "max_abs_t": float(t.abs().max()), "sum_t2": float((t**2).sum()),
        "head": [layer, head], "t": float(t[layer, head]),
        "cum_same_sign_fraction": float((torch.sign(cum[:, layer, head]) == final_sign).double().mean()),
        "wq_growth": float(wq[-1, layer, head] / wq[0, layer, head]),
        "pbar_ones_per_row": [float(ones[0, layer, head]) / rows[0], float(ones[-1, layer, head]) / rows[-1]],
        "max_wq_growth": float((wq[-1] / wq[0]).max()),
    }


def layer_logit(run: Run, layer: int = 1) -> tuple[list[int], list[float]]:
    """(steps, values): `layer`'s largest attention logit (over heads and sampled rows) at each telemetry
    sample; layer 1 is the paper's "layer 2"."""
    steps, logits = run.telemetry("max_logit")  # [sample][layer][head]
    return steps, [max(sample[layer]) for sample in logits]


def largest_logit(run: Run) -> float:
    """The largest attention logit of any layer and head over a run's telemetry."""
    return max(max(map(max, sample)) for sample in run.telemetry("max_logit")[1])


def head_series(run: Run, key: str, layer: int, head: int) -> list[float]:
    """One head's telemetry signal `key` (max_logit, wq_norm, pbar_ones, ...) at each sample."""
    return [sample[layer][head] for sample in run.telemetry(key)[1]]


def first_over(run: Run, layer: int = 1, threshold: float = RUNAWAY_LOGIT) -> dict[int, int]:
    """Telemetry step at which each head of `layer` first passes `threshold`, by head (heads that never do
    are left out)."""
    firsts: dict[int, int] = {}
    for step, sample in zip(*run.telemetry("max_logit"), strict=True):
        for head, logit in enumerate(sample[layer]):
            if logit > threshold:
                firsts.setdefault(head, step)
    return firsts


def first_past(run: Run, threshold: float = RUNAWAY_LOGIT,
               until: int | None = None) -> tuple[int, int] | None:
    """(step, layer) of the first telemetry sample (at most `until`) at which any layer's largest logit passes
    `threshold`, the layer the lowest index of those past it; None if none does."""
    for step, sample in zip(*run.telemetry("max_logit"), strict=True):
        if until is not None and step > until:
            return None
        past = [i for i, layer in enumerate(sample) if max(layer) > threshold]
        if past:
            return step, past[0]
    return None


def runaway_step(run: Run, layer: int | None = None, threshold: float = RUNAWAY_LOGIT) -> int | None:
    """The runaway: first telemetry step at which any layer's largest logit (over heads and sampled rows)
    passes `threshold` (`first_past`), or, given `layer`, that layer's (the first of `first_over`; layer 1
    is the paper's "layer 2"); None if never."""
    if layer is None:
        return (first_past(run, threshold) or (None,))[0]
    return min(first_over(run, layer, threshold).values(), default=None)


def first_layer(run: Run, threshold: float = RUNAWAY_LOGIT) -> int | None:
    """Index of the first layer whose largest logit passes `threshold` (the lowest, if several at one
    sample; None if none does)."""
    return (first_past(run, threshold) or (None, None))[1]


def moving_mean(values: list[float], window: int = SPIKE_WINDOW) -> list[float]:
    """Mean of each value and the window - 1 before it (the first window - 1 values are dropped)."""
    return [sum(values[i - window + 1 : i + 1]) / window for i in range(window - 1, len(values))]


def loss_spike(run: Run, factor: float = SPIKE_FACTOR, window: int = SPIKE_WINDOW) -> dict:
    """First step after warmup where the moving mean of `window` logged losses exceeds `factor` x its running
    minimum (None if never), and the largest such ratio: a loss explosion short of the trainer's stop rule
    (diverge_factor x the minimum, default 3), which a run may recover from."""
    steps, losses = run.series("loss")
    kept = [i for i, s in enumerate(steps) if s >= run.config["warmup_iters"]]
    means = moving_mean([losses[i] for i in kept], window)
    first, worst, low = None, 1.0, math.inf
    for step, mean in zip([steps[i] for i in kept[window - 1 :]], means, strict=True):
        if not math.isfinite(mean):
            return {"spike_step": first if first is not None else step, "max_ratio": math.inf}
        low = min(low, mean)
        worst = max(worst, mean / low)
        if first is None and mean > factor * low:
            first = step
    return {"spike_step": first, "max_ratio": worst}


def smoothed_loss(run: Run, window: int = 20) -> tuple[list[int], list[float]]:
    """(steps, moving mean of `window` logged losses), for plotting."""
    steps, loss = run.series("loss")
    return steps[window - 1 :], moving_mean(loss, window)


def mean_loss(run: Run, start: int, stop: int) -> float:
    """Mean of the logged losses at steps in [start, stop)."""
    window = [v for s, v in zip(*run.series("loss"), strict=True) if start <= s < stop]
    return sum(window) / len(window)


def experiment_runs(root: str | Path, *folders: str,
                    name: Callable[[dict], str] | None = None) -> dict[str, Run]:
    """The runs of some experiment folders under root, in one dict, each by `name(config)` as
    `runs.load_experiment` names it (default: its folder's name). ValueError if two runs get one name."""
    runs: dict[str, Run] = {}
    for folder in folders:
        for key, run in load_experiment(Path(root) / folder, name=name).items():
            if key in runs:
                raise ValueError(f"two runs named {key!r} ({runs[key].path}, {run.path})")
            runs[key] = run
    return runs


TIMINGS = ("time_s", "tokens_per_s", "telemetry_s")  # logged keys that measure the machine, not the run


def first_difference(run: Run, other: Run, keys: tuple[str, ...] | None = ("loss",)) -> int | None:
    """The first logged step (of those both runs logged) at which two runs' `keys` differ (None: every logged
    value but the TIMINGS, telemetry included); None if they agree at every one."""
    def values(row: dict) -> dict:
        return ({k: v for k, v in row.items() if k not in TIMINGS} if keys is None
                else {k: row.get(k) for k in keys})
    theirs = {row["step"]: values(row) for row in other.metrics}
    return next((row["step"] for row in run.metrics
                 if row["step"] in theirs and theirs[row["step"]] != values(row)), None)


def outcomes(run: Run) -> dict:
    """A run's three events and its length: the runaway (`runaway_step`, any layer), the spike
    (`loss_spike`), the explosion (the trainer's stop rule, from its summary) and the steps it reached (from
    its summary, or after its last logged step where the record was cut off while running)."""
    steps = run.summary.get("steps")
    return {"runaway": runaway_step(run), "spike": loss_spike(run)["spike_step"],
            "explosion": run.summary.get("diverged_step"),
            "steps": steps if steps is not None else run.metrics[-1]["step"] + 1}


def recipe(run: Run) -> dict:
    """What experiments differ in: the model (layers x width), tokens per step, the corpus (its folder's
    name; the start event's where the config left it to the default), the peak learning rate and the steps
    of its cosine decay (None: constant)."""
    config, model = run.config, run.config["model"]
    data = config.get("data") or run.events_of("start")[0]["data"]
    return {"model": f"{model['n_layer']}x{model['n_embd']}",
            "tokens_per_step": config["batch_size"] * config["grad_accum"] * model["block_size"],
            "corpus": Path(data).name, "lr": config["lr"],
            "decay_steps": None if config["min_lr"] == config["lr"] else config["lr_decay_iters"]}


def recipe_label(setting: dict) -> str:
    """One line for a recipe (`recipe`): model, tokens per step, corpus, peak learning rate and schedule."""
    schedule = f"cosine over {setting['decay_steps']:,} steps" if setting["decay_steps"] else "constant"
    return (f"{setting['model']} model, {setting['tokens_per_step']:,} tokens per step, {setting['corpus']}, "
            f"lr {setting['lr']:g} ({schedule})")


def split_name(name: str) -> tuple[str, int]:
    """(arm, seed) of a run named `<arm>-s<seed>` (`instruments.explode.run_name`, `record_name`; an arm may
    hold "-s" itself); ValueError for another name."""
    arm, sep, seed = name.rpartition("-s")
    if not (arm and sep and seed.isdigit()):
        raise ValueError(f"{name!r} is not a run name <arm>-s<seed>")
    return arm, int(seed)


# ---- growth of the logits before a runaway ----

def window_growth(steps: list[int], values: list[float], early: tuple[int, int] = (750, 1250),
                  late: tuple[int, int] = (2250, 2750)) -> float:
    """Median of the values at the steps in `late` over their median in `early` (each [start, stop))."""
    median = [statistics.median(x for s, x in zip(steps, values, strict=True) if a <= s < b)
              for a, b in (early, late)]
    return median[1] / median[0]


def head_growth(run: Run, key: str, head: int, late: tuple[int, int] = (2250, 2750), layer: int = 1) -> float:
    """`window_growth` of one head's telemetry `key` (max_logit, wq_norm, wk_norm)."""
    return window_growth(run.telemetry(key)[0], head_series(run, key, layer, head), late=late)


def slow_growth(run: Run, late: tuple[int, int] = (2250, 2750)) -> float:
    """`window_growth` of layer index 1's largest logit (over its heads and sampled rows)."""
    return window_growth(*layer_logit(run), late=late)


def fastest_head(run: Run, layer: int = 1) -> int:
    """The head of `layer` whose largest logit grows most in the slow phase (`head_growth`)."""
    return max(range(len(run.telemetry("max_logit")[1][0][layer])),
               key=lambda head: head_growth(run, "max_logit", head, layer=layer))


def norm_growth_before(run: Run, layer: int = 1) -> dict[str, float]:
    """The first head of `layer` to pass the runaway threshold (`first_over`): growth of its ‖W_Q,h‖ and
    ‖W_K,h‖ from steps 750-1,250 to the 500 steps ending 250 before it passed; ValueError without one."""
    firsts = first_over(run, layer)
    if not firsts:
        raise ValueError(f"{run.path}: no runaway in layer {layer}")
    head = min(firsts, key=firsts.get)
    late = (firsts[head] - 750, firsts[head] - 250)
    return {key: head_growth(run, key, head, late, layer) for key in ("wq_norm", "wk_norm")}


# ---- criterion records (`lowprec experiment bias-noise`) ----

def criterion(folder: Path, name: str, step: int, spec: str | None = None, batches: int = 32,
              tokens_per_batch: int = 8192) -> dict:
    """One run's criterion record at one checkpoint, `<folder>/bias-noise/<name>-step<step>.json`, under
    `spec` (needed where the record tested several): {"heads": [layer][head]} of W_Q, where recorded
    "heads_k" (W_K), and "sources" ([layer][head]: how many rows one key dominates, or None). ValueError if
    the record is of another checkpoint, batch count or batch size."""
    record = json.loads((Path(folder) / "bias-noise" / f"{name}-step{step}.json").read_text())
    (checkpoint,) = record["checkpoints"]
    measured = (checkpoint["step"], record["batches"], record["tokens_per_batch"])
    if measured != (step, batches, tokens_per_batch):
        raise ValueError(f"{name} step {step}: the record is of step {measured[0]}, {measured[1]} batches of "
                         f"{measured[2]} tokens")
    specs = checkpoint["specs"]
    if spec is None and len(specs) != 1:
        raise ValueError(f"{name} step {step}: the record holds specs {sorted(specs)}: name one")
    found = specs[spec] if spec is not None else next(iter(specs.values()))
    return {**found, "sources": checkpoint.get("sources")}


def biased_heads(heads: list[list[dict]]) -> list[tuple[int, int]]:
    """(layer, head) of every head a criterion record calls biased."""
    return [(i, h) for i, layer in enumerate(heads) for h, x in enumerate(layer) if x["biased"]]


def head_t(heads: list[list[dict]], key: str = "t") -> torch.Tensor:
    """(layers, heads) of one statistic of a criterion record's heads (`key`: "t", "norm_error_t", ...)."""
    return torch.tensor([[h[key] for h in layer] for layer in heads], dtype=torch.float64)


def combined_z(records: list[dict], projection: str = "heads", key: str = "t") -> torch.Tensor:
    """(layers, heads): each head's `key` in `projection` ("heads": W_Q, "heads_k": W_K) summed over the
    criterion records of several checkpoints and divided by √(their number), standard normal for independent
    noise."""
    return sum(head_t(r[projection], key) for r in records) / math.sqrt(len(records))


def layer_t2(records: list[dict], projection: str = "heads") -> list[float]:
    """Per layer: the mean t² over its heads and the criterion records of several checkpoints."""
    return torch.stack([head_t(r[projection]) ** 2 for r in records]).mean((0, 2)).tolist()


def run_summary(run_dir: Path) -> dict:
    """Status, explosion step, tokens, time, last loss and signature of one run folder."""
    try:
        run = load_run(run_dir)
    except RunRecordError as exc:
        return {"status": "missing", "error": str(exc)}
    losses = run.series("loss")[1]
    out = {key: run.summary.get(key) for key in ("status", "diverged_step", "steps", "tokens", "time_s")}
    out["last_logged_loss"] = losses[-1] if losses else None
    out.update(loss_spike(run))
    out["signature"] = signature(run)
    return out


def format_runs(runs: dict[str, dict]) -> str:
    """A table: run, status, diverged and spike steps, steps, last loss, the most one-signed head's t, Σt² per
    head and the largest ‖W_Q,h‖ growth."""
    lines = [f"{'run':<18} {'status':<12} {'diverged':>8} {'spike':>7} {'steps':>7} {'loss':>7} "
             f"{'max|t|':>7} {'Σt²/heads':>9} {'WQ x':>6}"]
    for name, r in runs.items():
        sig = r.get("signature") or {}
        ratio = sig.get("sum_t2", math.nan) / sig.get("heads", math.nan) if sig.get("heads") else math.nan
        lines.append(f"{name:<18} {r['status']:<12} {r.get('diverged_step') or '-':>8} "
                     f"{r.get('spike_step') or '-':>7} "
                     f"{r.get('steps') or 0:>7} {r.get('last_logged_loss') or math.nan:>7.3f} "
                     f"{sig.get('max_abs_t', math.nan):>7.1f} {ratio:>9.2f} "
                     f"{sig.get('max_wq_growth', math.nan):>6.2f}")
    return "\n".join(lines)


# ---- survival over many runs at a fixed horizon ----

@dataclass(frozen=True)
class Outcome:
    """One run's events by a fixed horizon (steps are 0-based; None: not reached). `observed`: the steps the
    run was watched for a runaway (the horizon, or the step the stop rule ended it at). `layer`: the first
    layer past the threshold (`first_past`)."""

    runaway: int | None
    layer: int | None
    explosion: int | None
    observed: int


def outcome(run: Run, horizon: int, threshold: float = RUNAWAY_LOGIT) -> Outcome:
    """The runaway (`first_past` by the end of the observed steps) and the
    explosion (the trainer's stop rule) of a run that reached `horizon` steps or exploded before it;
    ValueError for a run that stopped short of both (its outcome is unknown, not "no event")."""
    exploded = run.summary.get("diverged_step")
    steps = run.summary.get("steps") or 0
    if exploded is None and steps < horizon:
        raise ValueError(f"{run.path}: stopped at step {steps} ({run.summary.get('status')}) before the "
                         f"horizon {horizon} without an explosion: its outcome is unknown")
    explosion = exploded if exploded is not None and exploded < horizon else None
    observed = horizon if explosion is None else explosion
    step, layer = first_past(run, threshold, until=observed) or (None, None)
    return Outcome(step, layer, explosion, observed)


def event_times(outcomes: list[Outcome], event: str) -> tuple[list[int], list[bool]]:
    """(times, happened) of `event` ("runaway" or "explosion") per run: its step, or the censoring step."""
    times = [getattr(o, event) if getattr(o, event) is not None else o.observed for o in outcomes]
    return times, [getattr(o, event) is not None for o in outcomes]


def kaplan_meier(times: list[int], events: list[bool]) -> list[tuple[int, float]]:
    """Kaplan-Meier survival curve: [(0, 1.0), (t, S(t)) at each step t where an event happened]."""
    curve, survival = [(0, 1.0)], 1.0
    for t in sorted({t for t, e in zip(times, events, strict=True) if e}):
        at_risk = sum(1 for u in times if u >= t)
        died = sum(1 for u, e in zip(times, events, strict=True) if e and u == t)
        survival *= 1.0 - died / at_risk
        curve.append((t, survival))
    return curve


LOG_RANK_SPLITS = 100_000  # splits of the pooled runs enumerated for an exact p; beyond, this many drawn


def log_rank_statistic(times: list[int], events: list[bool], in_a: torch.Tensor,
                       counts: list[int] | None = None) -> torch.Tensor:
    """The log-rank chi² (1 degree of freedom) of pooled runs split into groups by each row of `in_a`
    (splits, entries): entry j stands for `counts[j]` runs (default 1) with time `times[j]` and event
    `events[j]`, and a row says how many of them are in group a; (splits,) float64, 0 where the variance is
    0. Every sum is of whole numbers, so an entry of tied runs gives the same chi² as the runs one by one."""
    t = torch.tensor(times, dtype=torch.float64)
    e = torch.tensor(events, dtype=torch.bool)
    c = torch.tensor([1] * len(times) if counts is None else counts, dtype=torch.float64)  # runs per entry
    moments = torch.tensor(sorted(set(t[e].tolist())), dtype=torch.float64)  # event times (K,)
    at_risk = (t[None, :] >= moments[:, None]).double()                          # (K, entries)
    died = (e[None, :] & (t[None, :] == moments[:, None])).double()              # (K, entries)
    n, d = at_risk @ c, died @ c                                                 # (K,)
    share = in_a.double() @ at_risk.T / n                                        # (splits, K): n_a / n
    observed = (in_a.double() @ died.T).sum(1)
    expected = (d * share).sum(1)
    variance = (d * share * (1 - share) * (n - d) / (n - 1).clamp(min=1)).sum(1)
    chi2 = (observed - expected) ** 2 / variance
    return torch.where(variance > 0, chi2, torch.zeros_like(chi2))


def log_rank(a: tuple[list[int], list[bool]], b: tuple[list[int], list[bool]]) -> tuple[float, float]:
    """(chi², p) of the log-rank test that two groups' (times, events) share one survival curve, p by
    permutation (valid for a few runs per arm, where chi²'s approximation is not): the share of the pooled
    runs' splits into groups of a's and b's sizes whose chi² is at least the observed one, exact over every
    split up to LOG_RANK_SPLITS of them (counted by `log_rank_compositions`: tied runs are interchangeable),
    else over that many drawn at random (seeded; (hits + 1) / (draws + 1)); p = 1 when neither group has an
    event."""
    (ta, ea), (tb, eb) = a, b
    times, events = list(ta) + list(tb), list(ea) + list(eb)
    if not any(events):
        return 0.0, 1.0
    runs, size = len(times), len(ta)
    splits = math.comb(runs, size)
    if splits > LOG_RANK_SPLITS:  # the observed split first, then the drawn ones
        counts, weight = None, None
        rows = torch.cat([torch.arange(runs)[None, :] < size, log_rank_draws(runs, size)])
    else:  # the observed way first, then every way
        pooled, in_a = Counter(zip(times, events, strict=True)), Counter(zip(ta, ea, strict=True))
        entries = sorted(pooled)                                                 # tied runs: one entry
        times, events = [t for t, _ in entries], [e for _, e in entries]
        counts = [pooled[x] for x in entries]
        ways, weight = log_rank_compositions(tuple(counts), size)
        rows = torch.cat([torch.tensor([[in_a[x] for x in entries]]), ways])
    chi2 = log_rank_statistic(times, events, rows, counts)
    past = chi2[1:] >= chi2[0] * (1 - 1e-9)
    if weight is None:
        return chi2[0].item(), (int(past.sum()) + 1) / (LOG_RANK_SPLITS + 1)
    return chi2[0].item(), int(weight[past].sum()) / splits


@functools.lru_cache(maxsize=64)
def log_rank_compositions(counts: tuple[int, ...], size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every way to take `size` of the pooled runs when entry j holds `counts[j]` interchangeable (tied) runs:
    (ways, entries) long, how many of each entry's runs are taken, and (ways,) long, how many splits of the
    runs one by one each way stands for (the product of binomials; they sum to comb(sum(counts), size)).
    Kept, as `log_rank_range` asks for the same counts many times; read-only."""
    ways, left = torch.zeros(1, 0, dtype=torch.long), sum(counts)
    for count in counts:
        left -= count
        grown = torch.cat([ways.repeat_interleave(count + 1, 0),                  # each way, then each
                           torch.arange(count + 1).repeat(len(ways))[:, None]], 1)  # take from this entry
        taken = grown.sum(1)
        ways = grown[(taken <= size) & (taken + left >= size)]                   # can still make `size`
    binomials = [torch.tensor([math.comb(count, k) for k in range(count + 1)]) for count in counts]
    weight = torch.ones(len(ways), dtype=torch.long)
    for j, table in enumerate(binomials):
        weight *= table[ways[:, j]]
    return ways, weight


@functools.lru_cache(maxsize=16)
def log_rank_draws(runs: int, size: int) -> torch.Tensor:
    """LOG_RANK_SPLITS splits of `runs` pooled runs into a group of `size` and the rest, drawn at random
    (seeded), as (splits, runs) bool (True: the group). Kept per arguments; read-only."""
    draws = torch.rand(LOG_RANK_SPLITS, runs, generator=torch.Generator().manual_seed(0))
    members = draws.argsort(1)[:, :size]
    return torch.zeros(LOG_RANK_SPLITS, runs, dtype=torch.bool).scatter_(1, members, True)


def log_rank_range(a: tuple[list[int], list[bool]], b: tuple[list[int], list[bool]], more_a: int, more_b: int,
                   horizon: int, limit: int = 10_000) -> tuple[float, float]:
    """The smallest and largest `log_rank` p that groups `a` and `b` can have once `more_a` and `more_b` more
    runs are made to `horizon`: each new run is censored at the horizon or has its event before it, at any
    place among the known times (tied with one, between two, before all; the statistic sees only the order).
    ValueError when that makes more than `limit` cases. Kept per arguments: a page states its bottom line
    and its own secondary tests, which ask for the same ranges."""
    return _log_rank_range(tuple(map(tuple, a)), tuple(map(tuple, b)), more_a, more_b, horizon, limit)


@functools.lru_cache(maxsize=64)
def _log_rank_range(a: tuple[tuple[int, ...], tuple[bool, ...]], b: tuple[tuple[int, ...], tuple[bool, ...]],
                    more_a: int, more_b: int, horizon: int, limit: int) -> tuple[float, float]:
    known = sorted(set(a[0]) | set(b[0]) | {horizon})
    places = sorted({known[0] - 1, *known, *((x + y) / 2 for x, y in itertools.pairwise(known))})
    new = [(t, True) for t in places if t < horizon] + [(horizon, False)]  # one new run's possible outcomes
    cases = math.comb(len(new) + more_a - 1, more_a) * math.comb(len(new) + more_b - 1, more_b)
    if cases > limit:
        raise ValueError(f"log_rank_range: {cases:,} cases for {more_a} and {more_b} more runs "
                         f"(limit {limit:,})")
    ps = []
    for extra_a in itertools.combinations_with_replacement(new, more_a):
        for extra_b in itertools.combinations_with_replacement(new, more_b):
            grown = [(list(ta) + [t for t, _ in extra], list(ea) + [e for _, e in extra])
                     for (ta, ea), extra in ((a, extra_a), (b, extra_b))]
            ps.append(log_rank(*grown)[1])
    return min(ps), max(ps)


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval (95% by default) of a proportion k / n."""
    if not 0 <= k <= n or n < 1:
        raise ValueError(f"wilson needs 0 <= k <= n and n >= 1, got k={k}, n={n}")
    p, z2 = k / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def fisher_p(k1: int, n1: int, k2: int, n2: int) -> float:
    """Two-sided p of Fisher's exact test for k1 of n1 against k2 of n2: the probability, under equal rates
    and the observed margins, of a table no more likely than the observed one."""
    if not (0 <= k1 <= n1 and 0 <= k2 <= n2 and n1 and n2):
        raise ValueError(f"fisher_p needs 0 <= k <= n and n >= 1, got {k1}/{n1} and {k2}/{n2}")
    events, total = k1 + k2, n1 + n2
    tables = {k: math.comb(n1, k) * math.comb(n2, events - k) / math.comb(total, events)
              for k in range(max(0, events - n2), min(events, n1) + 1)}
    observed = tables[k1]
    return min(1.0, sum(p for p in tables.values() if p <= observed * (1 + 1e-9)))


def sign_test(k: int, n: int) -> float:
    """Two-sided sign test: for coin flips, the chance of k or more of n pairs one way, or as many the other
    way."""
    if not 0 <= k <= n:
        raise ValueError(f"sign_test needs 0 <= k <= n, got {k} of {n}")
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(max(k, n - k), n + 1)) / 2**n)


def stratified_p(strata: list[tuple[int, int, int, int]]) -> float:
    """Two-sided p of the exact stratified test (the exact form of Cochran-Mantel-Haenszel's) for strata of
    (k1, n1, k2, n2), e.g. one per seed: k1 of n1 runs of one group against k2 of n2 of the other within each
    stratum. The statistic is k1 summed over the strata; under equal rates within each stratum, given its
    margins, each stratum's k1 is hypergeometric, so runs that share a stratum (a seed's initial weights and
    batches) are not counted as independent. p: the probability of a sum no more likely than the observed
    one. A stratum with an empty group tells nothing and is left out; a single stratum gives `fisher_p`."""
    if not strata or not all(0 <= k1 <= n1 and 0 <= k2 <= n2 for k1, n1, k2, n2 in strata):
        raise ValueError(f"stratified_p needs strata of (k1, n1, k2, n2) with 0 <= k <= n, got {strata!r}")
    sums, observed = {0: 1.0}, 0  # the distribution of k1 summed over the strata so far, and its value
    for k1, n1, k2, n2 in strata:
        if not (n1 and n2):
            continue
        events, total = k1 + k2, n1 + n2
        own = {k: math.comb(n1, k) * math.comb(n2, events - k) / math.comb(total, events)
               for k in range(max(0, events - n2), min(events, n1) + 1)}
        merged: dict[int, float] = {}
        for (t, pt), (k, pk) in itertools.product(sums.items(), own.items()):
            merged[t + k] = merged.get(t + k, 0.0) + pt * pk
        sums, observed = merged, observed + k1
    return min(1.0, sum(p for p in sums.values() if p <= sums[observed] * (1 + 1e-9)))


def detection_power(rate1: float, rate2: float, n: int, alpha: float = 0.05) -> float:
    """The chance that Fisher's exact test (`fisher_p`) at `alpha` tells two arms apart when their true event
    rates are `rate1` and `rate2` and each has `n` runs: exact, over every pair of counts."""
    if not (0 <= rate1 <= 1 and 0 <= rate2 <= 1 and n >= 1 and 0 < alpha < 1):
        raise ValueError(f"detection_power needs rates in [0, 1], n >= 1, 0 < alpha < 1; got {rate1}, "
                         f"{rate2}, {n}, {alpha}")

    def binomial(k: int, rate: float) -> float:
        return math.comb(n, k) * rate**k * (1 - rate) ** (n - k)

    return sum(binomial(k1, rate1) * binomial(k2, rate2) for k1 in range(n + 1) for k2 in range(n + 1)
               if fisher_p(k1, n, k2, n) <= alpha)


def survival_table(arms: dict[str, list[Outcome]], against: tuple[str, ...] = ()) -> dict[str, dict]:
    """Per arm and event ("runaway", "explosion"): runs, events, their rate's Wilson interval, the
    Kaplan-Meier curve, the log-rank p against each arm of `against` present (other than itself), and for
    runaways the count per first layer."""
    table = {}
    for arm, outcomes in arms.items():
        row: dict = {"runs": len(outcomes)}
        for event in ("runaway", "explosion"):
            times, happened = event_times(outcomes, event)
            k = sum(happened)
            row[event] = {"events": k, "interval": wilson(k, len(outcomes)),
                          "curve": kaplan_meier(times, happened),
                          "log_rank_p": {other: log_rank((times, happened),
                                                         event_times(arms[other], event))[1]
                                         for other in against if other in arms and other != arm}}
        layers = [o.layer for o in outcomes if o.runaway is not None]
        row["runaway"]["layers"] = {layer: layers.count(layer) for layer in sorted(set(layers))}
        table[arm] = row
    return table


def lr_sweep(groups: dict[str, list[Run]], horizon: int) -> dict[str, list[dict]]:
    """A learning-rate grid's done runs by series ("<arm>" or "<arm> + QK-LayerNorm"; a group is named
    "<arm>-lr<rate>[-qkln]"), each a list by learning rate of {"lr", "runs", "runaways" (by the horizon),
    "loss" (the median over the runs of the loss at the horizon: the last logged one at or before it, or the
    run's last loss where it ended sooner)}; runs longer than the horizon are read up to it."""
    def horizon_loss(run: Run) -> float:
        if run.summary["steps"] <= horizon:
            return run.summary["final_loss"]
        return [v for s, v in zip(*run.series("loss"), strict=True) if s <= horizon][-1]

    series: dict[str, dict[float, list[Run]]] = {}
    for name, runs in groups.items():
        for run in runs:
            label = name.split("-lr")[0] + (" + QK-LayerNorm" if run.config["model"]["qk_layernorm"] else "")
            series.setdefault(label, {}).setdefault(run.config["lr"], []).append(run)
    return {label: [{"lr": lr, "runs": len(runs),
                     "runaways": sum(outcome(run, horizon).runaway is not None for run in runs),
                     "loss": statistics.median(horizon_loss(run) for run in runs)}
                    for lr, runs in sorted(by_lr.items())]
            for label, by_lr in series.items()}

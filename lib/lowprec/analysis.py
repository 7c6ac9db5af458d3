"""Analysis of recorded runs for the book and the experiments: signed-error statistics (`ErrorStats`),
per-head t-scores of the δ error, the paper's signature, loss spikes, runaways, one-line run summaries, and
the survival statistics of many runs (`outcome`, `kaplan_meier`, `log_rank`, `wilson`, `survival_table`).

Reads records through lowprec.runs and computes with torch on small tensors; it imports no model, training or
kernel code, so a chapter that only reads results stays fast.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from lowprec.runs import Run, RunRecordError, load_run

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


def runaway_step(run: Run, layer: int = 1, threshold: float = RUNAWAY_LOGIT) -> int | None:
    """First telemetry step at which `layer`'s largest logit (over heads and sampled rows) passes
    `threshold` (None if never); layer 1 is the paper's "layer 2"."""
    steps, logits = run.telemetry("max_logit")  # [sample][layer][head]
    return next((s for s, sample in zip(steps, logits, strict=True) if max(sample[layer]) > threshold), None)


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
    run was watched for a runaway (the horizon, or the step the stop rule ended it at). `layer`: the layer
    whose largest logit was highest at the runaway."""

    runaway: int | None
    layer: int | None
    explosion: int | None
    observed: int


def outcome(run: Run, horizon: int, threshold: float = RUNAWAY_LOGIT) -> Outcome:
    """The runaway (first telemetry step at which any layer's largest logit passes `threshold`) and the
    explosion (the trainer's stop rule) of a run that reached `horizon` steps or exploded before it;
    ValueError for a run that stopped short of both (its outcome is unknown, not "no event")."""
    exploded = run.summary.get("diverged_step")
    steps = run.summary.get("steps") or 0
    if exploded is None and steps < horizon:
        raise ValueError(f"{run.path}: stopped at step {steps} ({run.summary.get('status')}) before the "
                         f"horizon {horizon} without an explosion: its outcome is unknown")
    explosion = exploded if exploded is not None and exploded < horizon else None
    observed = horizon if explosion is None else explosion
    for step, sample in zip(*run.telemetry("max_logit"), strict=True):
        peaks = [max(layer) for layer in sample]
        if step <= observed and max(peaks) > threshold:
            return Outcome(step, peaks.index(max(peaks)), explosion, observed)
    return Outcome(None, None, explosion, observed)


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


def log_rank(a: tuple[list[int], list[bool]], b: tuple[list[int], list[bool]]) -> tuple[float, float]:
    """(chi², p) of the log-rank test that two groups' (times, events) share one survival curve (1 degree
    of freedom; p = 1 when neither group has an event)."""
    (ta, ea), (tb, eb) = a, b
    observed = expected = variance = 0.0
    for t in sorted({t for t, e in zip(ta + tb, ea + eb, strict=True) if e}):
        na, nb = sum(u >= t for u in ta), sum(u >= t for u in tb)
        da = sum(1 for u, e in zip(ta, ea, strict=True) if e and u == t)
        d = da + sum(1 for u, e in zip(tb, eb, strict=True) if e and u == t)
        n = na + nb
        observed += da
        expected += d * na / n
        variance += d * (na / n) * (nb / n) * (n - d) / max(n - 1, 1)
    if variance == 0:
        return 0.0, 1.0
    chi2 = (observed - expected) ** 2 / variance
    return chi2, math.erfc(math.sqrt(chi2 / 2))


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval (95% by default) of a proportion k / n."""
    if not 0 <= k <= n or n < 1:
        raise ValueError(f"wilson needs 0 <= k <= n and n >= 1, got k={k}, n={n}")
    p, z2 = k / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


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

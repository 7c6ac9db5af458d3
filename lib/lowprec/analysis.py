"""Analysis of recorded runs for the book and the experiments: signed-error statistics (`ErrorStats`),
per-head t-scores of the δ error, the paper's signature, loss spikes, runaways, one-line run summaries.

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

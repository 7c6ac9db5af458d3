"""`lowprec experiment explode`: train several attention arms x seeds side by side and record who explodes.

One training process (`lowprec train`) per (arm, seed), spread over the visible GPUs (several processes per
GPU share it), all with the same config, data and, per seed, the same initialisation and batch order. After
`--minutes` every process still running gets SIGTERM, writes its checkpoint and ends "interrupted"; a run that
explodes stops itself ("diverged": NaN, or a loss above diverge_factor x its minimum since warmup). The
harness then writes `<out>/experiment.json`: the plan, the command, provenance, and per run its status,
explosion step, tokens, time and the paper's signature (`signature`). Run records are `<out>/<arm>-s<seed>/`.

Arms are short names for attention specs (`arm_spec`):
  fa2            our Triton kernel, production rounding placement (P̄ and O in bf16)
  paper          the authors' all-bf16 placement (bf16 S, P̄, l, P̄V, running O; 64-wide tiles on a GPU)
  fp32pv         P̄ not rounded: the P̄V product in fp32 (the paper's "P̄V in high precision" control)
  paper-fp32pv   the paper placement with P̄, the P̄V result and the running O unrounded (S, l and the stored
                 O stay bf16): the paper's biased rounding removed, its other bf16 points kept
  onesK          fa2, but P̄ within 2^-(K+2) of 1 rounds to 1.0 (Precision "fa2:weights=e8mK@ones"): the
                 paper's error, P̄ = 1 for near-maximal scores, with a wider window and nothing else
  kbitK          fa2 with every P̄ rounded to K significand bits ("fa2:weights=e8mK")
  <arm>-fix      the same with the paper's Fix(beta=2) (its tie tolerance follows P̄'s format)
`--backend emulated` swaps the Triton kernel for the pure-PyTorch emulator (CPU tests).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from lowprec.attention.bias import ErrorStats
from lowprec.configs import CONFIGS, get_config
from lowprec.model import FIX_BACKENDS
from lowprec.runs import Run, RunRecordError, load_run, provenance, write_json

PLACEMENTS = {"fa2": "fa2", "paper": "paper:tile=64", "fp32pv": "fa2:weights=none",
              "paper-fp32pv": "paper:tile=64,weights=none,product=none,accumulator=none"}
FIX_BETA = 2.0
POLL_S = 5.0
SPIKE_FACTOR = 1.25  # a "spike": the smoothed loss rises this far above its running minimum (probe.md's rule)
SPIKE_WINDOW = 5     # logged records (log_interval steps each) in the moving mean the spike rule uses


def arm_spec(arm: str, backend: str = "triton") -> str:
    """The attention spec of a named arm (module docstring), e.g. "ones3-fix" ->
    "triton/precision=fa2:weights=e8m3@ones/fix=2.0"."""
    if backend not in FIX_BACKENDS:
        raise ValueError(f"backend must be one of {FIX_BACKENDS}, got {backend!r}")
    base, fix = (arm[:-4], True) if arm.endswith("-fix") else (arm, False)
    match = re.fullmatch(r"(ones|kbit)(\d)", base)
    if match:
        precision = f"fa2:weights=e8m{match[2]}" + ("@ones" if match[1] == "ones" else "")
    elif base in PLACEMENTS:
        precision = PLACEMENTS[base]
    else:
        raise ValueError(f"unknown arm {arm!r}: use fa2, paper, fp32pv, paper-fp32pv, onesK or kbitK "
                         "(K = 1..9 significand bits), optionally with '-fix'")
    return f"{backend}/precision={precision}" + (f"/fix={FIX_BETA}" if fix else "")


def run_name(arm: str, seed: int) -> str:
    return f"{arm}-s{seed}"


def head_t_scores(run: Run) -> torch.Tensor:
    """(layers, heads) t-statistic of each head's per-sample signed δ error (`delta_error` telemetry): mean
    over the sampled steps / its standard error. Noise gives roughly N(0, 1) per head, so Σt² ≈ heads."""
    err = torch.tensor(run.telemetry("delta_error")[1], dtype=torch.float64)  # (samples, layers, heads)
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
    out = {key: run.summary.get(key) for key in ("status", "explosion_step", "steps", "tokens", "time_s")}
    out["last_logged_loss"] = losses[-1] if losses else None
    out.update(loss_spike(run))
    out["signature"] = signature(run)
    return out


def launch(cmd: list[str], gpu: int | None, log: Path) -> subprocess.Popen:
    env = dict(os.environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    with open(log, "w") as handle:
        # own process group: the harness's Ctrl-C reaches the children only through stop_all (one SIGTERM)
        return subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stop_all(procs: dict[str, subprocess.Popen], grace_s: float) -> None:
    """SIGTERM every live process (each finishes its step and checkpoints), then SIGKILL after grace_s."""
    for proc in procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs.values():
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def last_step(run_dir: Path) -> int | None:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    lines = path.read_text().splitlines()
    try:
        return json.loads(lines[-1])["step"] if lines else None
    except (json.JSONDecodeError, KeyError):
        return None


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="experiment folder (one run folder per arm and seed)")
    parser.add_argument("--config", default="gpu-6l", choices=sorted(CONFIGS), help="training config")
    parser.add_argument("--arms", default="ones2,ones2-fix,fp32pv",
                        help="comma-separated arms (module docstring): fa2, paper, fp32pv, paper-fp32pv, "
                             "onesK, kbitK, each optionally with -fix")
    parser.add_argument("--seeds", default="1,2,3", help="comma-separated seeds (init and batch order)")
    parser.add_argument("--minutes", type=float, default=8.0, help="wall-clock budget; then SIGTERM")
    parser.add_argument("--gpus", type=int, default=None,
                        help="GPUs to spread the runs over (default: all visible; 0 = CPU)")
    parser.add_argument("--backend", default="triton", choices=FIX_BACKENDS, help="attention implementation")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="config override for every run (repeatable), e.g. --set lr=3e-3")
    parser.add_argument("--grace", type=float, default=60.0, help="seconds a stopped run may take to save")


def run(args: argparse.Namespace) -> int:
    try:
        arms = [a.strip() for a in args.arms.split(",") if a.strip()]
        specs = {arm: arm_spec(arm, args.backend) for arm in arms}
        try:
            seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        except ValueError:
            raise ValueError(f"--seeds must be comma-separated integers, got {args.seeds!r}") from None
        if not arms or not seeds:
            raise ValueError("--arms and --seeds must each name at least one item")
        if args.minutes <= 0:
            raise ValueError(f"--minutes must be > 0, got {args.minutes}")
        get_config(args.config, args.overrides)  # a bad override fails here, before anything starts
        taken = [run_name(arm, seed) for seed in seeds for arm in arms
                 if (Path(args.out) / run_name(arm, seed) / "metrics.jsonl").exists()]
        if taken:
            raise ValueError(f"--out {args.out} already holds runs {taken}: choose a new --out folder")
    except ValueError as exc:
        print(f"lowprec experiment explode: {exc}", file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count() if args.gpus is None else args.gpus
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs = list(itertools.product(seeds, arms))
    procs: dict[str, subprocess.Popen] = {}
    plan = {"config": args.config, "overrides": args.overrides, "arms": specs, "seeds": seeds,
            "minutes": args.minutes, "gpus": gpus, "command": sys.argv}
    for i, (seed, arm) in enumerate(jobs):
        name = run_name(arm, seed)
        cmd = [sys.executable, "-m", "lowprec.cli", "train", "--config", args.config,
               "--out", str(out / name), "--set", f"seed={seed}", "--set", f"attention={specs[arm]}",
               "--set", "progress=false",
               *itertools.chain.from_iterable(("--set", o) for o in args.overrides)]
        procs[name] = launch(cmd, i % gpus if gpus else None, out / f"{name}.log")
    print(f"explode: {len(procs)} runs ({', '.join(arms)} x seeds {seeds}) on "
          f"{gpus or 'no'} GPU(s) for {args.minutes:g} min -> {out}", flush=True)
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < args.minutes * 60 and any(p.poll() is None for p in procs.values()):
            time.sleep(POLL_S)
            if int(time.monotonic() - t0) % 60 < POLL_S:
                status = "  ".join(f"{n}:{last_step(out / n)}{'' if p.poll() is None else '!'}"
                                   for n, p in procs.items())
                print(f"[{time.monotonic() - t0:5.0f}s] {status}", flush=True)
    except KeyboardInterrupt:
        print("explode: interrupted; stopping the runs (each saves a checkpoint)", flush=True)
    stop_all(procs, args.grace)
    runs = {name: {"arm": arm, "seed": seed, "attention": specs[arm], "exit_code": procs[name].returncode,
                   **run_summary(out / name)}
            for seed, arm in jobs for name in [run_name(arm, seed)]}
    write_json(out / "experiment.json", {"plan": plan, "provenance": provenance(plan["command"]),
                                         "wall_s": time.monotonic() - t0, "runs": runs})
    print(format_runs(runs))
    return 0


def format_runs(runs: dict[str, dict]) -> str:
    """A table: run, status, explosion step, steps, last loss, the most one-signed head's t, ‖W_Q‖ growth."""
    lines = [f"{'run':<16} {'status':<12} {'explode':>8} {'spike':>7} {'steps':>7} {'loss':>7} {'max|t|':>7} "
             f"{'Σt²/heads':>9} {'WQ x':>6}"]
    for name, r in runs.items():
        sig = r.get("signature") or {}
        ratio = sig.get("sum_t2", math.nan) / sig.get("heads", math.nan) if sig.get("heads") else math.nan
        lines.append(f"{name:<16} {r['status']:<12} {r.get('explosion_step') or '-':>8} "
                     f"{r.get('spike_step') or '-':>7} "
                     f"{r.get('steps') or 0:>7} {r.get('last_logged_loss') or math.nan:>7.3f} "
                     f"{sig.get('max_abs_t', math.nan):>7.1f} {ratio:>9.2f} "
                     f"{sig.get('max_wq_growth', math.nan):>6.2f}")
    return "\n".join(lines)

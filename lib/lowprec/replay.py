"""`lowprec replay RUN --from STEP --fix on|off`: re-run the last steps of a recorded run from a kept
checkpoint, with the Fix switched on or off, and compare the loss curves.

    lowprec replay RUN --from 4000 --fix on     # does the Fix keep the steps from 4000 on stable?
    lowprec replay RUN --from 4000 --fix off    # the control: does the spike come back?

RUN must have kept its checkpoints (`--set ckpt_keep=true`); the replay is a fresh record in
<RUN>/replay-from-<STEP>-fix-<on|off> and `compare_runs` (records only, no torch) writes <out>/replay.json.
What a replay keeps equal and how exact it is: the book's appendix "Methods and record formats".
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from lowprec.checks import option
from lowprec.runs import SIGNIFICANT, Run, check_target, load_run, metrics_file, write_json

# ---- comparing records (no torch) ----

def _window(run: Run, start: int, end: int) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in run.metrics if start <= m["step"] < end}


def _same(a: float, b: float, tol: float) -> bool:
    return a == b or abs(a - b) <= tol or (math.isnan(a) and math.isnan(b))


def _describe(run: Run, losses: dict[int, float]) -> dict:
    model = run.config["model"]
    return {"attention": model["attention"], "layer_attention": model["layer_attention"],
            "status": run.summary["status"], "diverged_step": run.summary.get("diverged_step"),
            "logged_steps": len(losses),
            "max_loss": max(losses.values(), key=lambda v: math.inf if math.isnan(v) else v, default=None),
            "last_step": max(losses, default=None), "last_loss": losses[max(losses)] if losses else None}


def compare_runs(original_dir: str | Path, replay_dir: str | Path, tol: float = 1e-6) -> dict:
    """Compare a replay with its original over the replayed steps (the replay's start step to its max_iters).

    Returns {"original", "replay": folders, "from_step", "to_step" (last step of the window), "tolerance",
    "compared_steps" (logged by both), "first_difference": None or {"step", "original", "replay"} (the first
    common step where |loss_replay - loss_original| > tol), "identical" (no such step and both logged the
    same steps), "runs": {"original"|"replay": {attention, layer_attention, status, diverged_step,
    logged_steps, max_loss, last_step, last_loss} over the window}}. Reads records only."""
    original, replay = load_run(original_dir), load_run(replay_dir)
    starts = replay.events_of("start")
    if not starts:
        raise ValueError(f"replay_dir {replay.path} has no start event (not a run started by lowprec train)")
    start, end = starts[0]["step"], replay.config["max_iters"]
    a, b = _window(original, start, end), _window(replay, start, end)
    common = sorted(set(a) & set(b))
    first = next((s for s in common if not _same(a[s], b[s], tol)), None)
    return {"original": str(original.path), "replay": str(replay.path), "from_step": start,
            "to_step": end - 1, "tolerance": tol, "compared_steps": len(common),
            "first_difference": None if first is None else {"step": first, "original": a[first],
                                                            "replay": b[first]},
            "identical": first is None and set(a) == set(b),
            "runs": {"original": _describe(original, a), "replay": _describe(replay, b)}}


def format_comparison(comparison: dict) -> str:
    """A few lines for the terminal: one row per run, then the verdict."""
    c = comparison
    lines = [f"replay of {c['original']} from step {c['from_step']} to step {c['to_step']} -> {c['replay']}",
             f"{'run':9} {'status':9} {'explosion':>9} {'max loss':>10} {'last loss':>10}  attention"]
    for name, r in c["runs"].items():
        attention = r["attention"] + (f" {r['layer_attention']}" if r["layer_attention"] else "")
        explosion, max_loss, last_loss = ("-" if v is None else f"{v:.5g}"
                                          for v in (r["diverged_step"], r["max_loss"], r["last_loss"]))
        lines.append(f"{name:9} {r['status']:9} {explosion:>9} {max_loss:>10} {last_loss:>10}  {attention}")
    diff = c["first_difference"]
    if diff is not None:
        lines.append(f"first difference at step {diff['step']}: loss {diff['original']:.5g} (original) vs "
                     f"{diff['replay']:.5g} (replay), more than {c['tolerance']:g} apart")
    elif c["identical"]:
        lines.append(f"identical over all {c['compared_steps']} logged steps (records keep {SIGNIFICANT} "
                     "significant digits)")
    else:
        lines.append(f"the {c['compared_steps']} steps both runs logged agree, but the runs logged different "
                     "steps (one stopped early)")
    return "\n".join(lines)


# ---- replaying (torch) ----

def available_checkpoints(ckpt_dir: Path) -> dict[int, Path]:
    """step -> checkpoint file in `ckpt_dir`: the kept ckpt-<step>.pt files and the latest ckpt.pt (read for
    its step, which checks its sha256: a corrupt one is left out, said on stderr)."""
    from lowprec.train import CHECKPOINT, CheckpointError, kept_checkpoints, load_checkpoint

    found = {}
    latest = ckpt_dir / CHECKPOINT
    if latest.exists():
        try:
            found[load_checkpoint(latest)["step"]] = latest
        except CheckpointError as exc:
            print(f"replay: {exc}; left out", file=sys.stderr)
    return dict(sorted({**found, **kept_checkpoints(ckpt_dir)}.items()))


def find_checkpoint(ckpt_dir: Path, step: int) -> Path:
    """The checkpoint in `ckpt_dir` that continues at `step`; ValueError listing the steps there are."""
    found = available_checkpoints(ckpt_dir) if ckpt_dir.is_dir() else {}
    if step not in found:
        hint = ("" if len(found) > 1 else "; train with --set ckpt_keep=true to keep every checkpoint "
                "(ckpt-<step>.pt), not only the latest")
        raise ValueError(f"--from {step}: no checkpoint for step {step} in {ckpt_dir}; available steps: "
                         f"{list(found) or 'none'}{hint}")
    return found[step]


def replay_window(run_dir: str | Path, lead: int, after: int) -> tuple[int, int] | None:
    """(from, to) that replay a run which reached the stop rule: its last kept checkpoint at least `lead`
    steps before the stop, to `after` steps past it; None if the run did not stop or kept none that early."""
    from lowprec.train import kept_checkpoints, read_config

    run_dir = Path(run_dir)
    stopped = load_run(run_dir).summary.get("diverged_step")
    if stopped is None:
        return None
    ckpt_dir = Path(read_config(run_dir).ckpt_dir or run_dir / "checkpoint")
    before = [s for s in kept_checkpoints(ckpt_dir) if s <= stopped - lead] if ckpt_dir.is_dir() else []
    return (before[-1], stopped + after) if before else None


def replay(run_dir: str | Path, from_step: int, fix: bool, beta: float = 2.0, end: int | None = None,
           out: str | Path | None = None, overrides: list[str] | None = None,
           command: list[str] | None = None, callback: Callable[[int, dict], None] | None = None) -> dict:
    """Re-run steps from_step .. end-1 of the run in `run_dir` from its checkpoint at `from_step`, with the
    Fix on (beta) or off; end defaults to one past the last step RUN logged, out to
    <run_dir>/replay-from-<from_step>-fix-<on|off>. Returns `compare_runs(run_dir, out)` (also written to
    <out>/replay.json) on rank 0, {} on other ranks. `callback` as in `lowprec.train.train`."""
    from lowprec.configs import apply_overrides
    from lowprec.train import read_config, train

    run_dir = Path(run_dir)
    original = read_config(run_dir)
    default = run_dir / f"replay-from-{from_step}-fix-{'on' if fix else 'off'}"
    out = check_target(out if out is not None else default, "--out")
    if metrics_file(out).exists():
        raise ValueError(f"--out {out} already holds a run (an earlier replay?): remove it or pass another "
                         "--out")
    if end is None:
        logged = load_run(run_dir).metrics
        if not logged:
            raise ValueError(f"RUN {run_dir} has logged no steps; pass --steps or --to")
        end = logged[-1]["step"] + 1
    if end <= from_step:
        raise ValueError(f"nothing to replay: the replay would end (step {end - 1}) before --from "
                         f"{from_step}; pass --steps N or --to STEP past it")
    cfg = replace(original, model=original.model.with_fix(beta if fix else None), max_iters=end,
                  lr_decay_iters=original.lr_decay_iters or original.max_iters,  # lr_at: 0 means max_iters
                  ckpt_interval=0, ckpt_keep=False, ckpt_dir="")
    cfg = apply_overrides(cfg, overrides or [])
    checkpoint = find_checkpoint(Path(original.ckpt_dir or run_dir / "checkpoint"), from_step)
    train(cfg, out, command=command, callback=callback, init_from=checkpoint,
          start_fields={"replay_of": str(run_dir), "from_step": from_step, "fix": fix,
                        "beta": beta if fix else None, "checkpoint": str(checkpoint)})
    if int(os.environ.get("RANK", "0")) != 0:
        return {}
    comparison = compare_runs(run_dir, out)
    write_json(out / "replay.json", comparison)
    return comparison


# ---- CLI ----

def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", metavar="RUN", help="folder of the recorded run (trained with ckpt_keep=true)")
    parser.add_argument("--from", dest="from_step", type=option(int, 0), required=True, metavar="STEP",
                        help="step to start from (a checkpoint of RUN at this step must exist)")
    parser.add_argument("--fix", choices=("on", "off"), required=True,
                        help="the Fix in every attention layer whose backend takes one (emulated, triton)")
    parser.add_argument("--beta", type=option(float, 1, low_open=True), default=2.0,
                        help="the Fix's beta with --fix on (default 2)")
    until = parser.add_mutually_exclusive_group()
    until.add_argument("--steps", type=option(int, 1), metavar="N",
                       help="replay N steps (default: to RUN's last step)")
    until.add_argument("--to", type=option(int, 0), metavar="STEP", help="replay up to and including STEP")
    parser.add_argument("--out", help="replay folder (default <RUN>/replay-from-<STEP>-fix-<on|off>)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="override a field of the replay's config (repeatable), e.g. --set device=cpu")


def run(args: argparse.Namespace) -> int:
    end = (args.from_step + args.steps if args.steps is not None
           else args.to + 1 if args.to is not None else None)
    try:
        comparison = replay(args.run, args.from_step, args.fix == "on", args.beta, end, args.out,
                            args.overrides)
    finally:
        from lowprec.dist import leave_process_group

        leave_process_group()
    if comparison:
        print(format_comparison(comparison))
        print(f"written to {Path(comparison['replay']) / 'replay.json'}")
    return 0

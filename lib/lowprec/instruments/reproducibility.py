"""`lowprec measure reproducibility`: does one seed give one trajectory? Same-seed runs alone, beside other
training processes, with telemetry every 50 / 100 steps or off, with and without `deterministic`.

    lowprec measure reproducibility --config gpu-6l --steps 1000 --set data=... --out results/train/repro.json

The runs go in groups (`GROUPS`); the runs of a group start together and share the GPU, the next group starts
when the last one ends. Each run is `lowprec train` to --steps with the config and overrides; the record
compares their final weights (`weights_sha256`) and last loss (`final_loss_hex`, exact), and gives each run's
steady tokens/s (after its first 100 steps) and each group's total. `--probe` adds an in-process look at
where the difference comes from: the first group's arm computes the gradients of one batch three times from
the same weights, compiled and eager, with and without deterministic algorithms: the parameters whose
gradients differ between repeats.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from lowprec.configs import CONFIGS, TrainConfig, get_config
from lowprec.instruments.explode import FIX_BACKENDS, arm_overrides, launch
from lowprec.runs import load_run, provenance, write_json

# (label, arm, seed, deterministic, telemetry_interval); one list per group of runs that share the GPU
GROUPS = [
    [("det-t50-alone", "fa2", 1, True, 50)],
    [("nondet-t50-alone", "fa2", 1, False, 50)],
    [("nondet-t50-beside", "fa2", 1, False, 50), ("det-t100-beside", "fa2", 1, True, 100)],
    [("det-t50-beside3", "fa2", 1, True, 50), ("det-t0-beside3", "fa2", 1, True, 0),
     ("other-paper64-s2", "paper64", 2, True, 50), ("other-fp32pv-s3", "fp32pv", 3, True, 50)],
]
TWINS = {"deterministic": ["det-t50-alone", "det-t100-beside", "det-t50-beside3", "det-t0-beside3"],
         "default": ["nondet-t50-alone", "nondet-t50-beside"]}
STEADY_FROM = 100  # steps before this include compilation


def steady_tokens_per_s(run_dir: Path) -> float | None:
    """Tokens/s between the first logged step >= STEADY_FROM and the last (None if too short)."""
    rows = [m for m in load_run(run_dir).metrics if m["step"] >= STEADY_FROM]
    if len(rows) < 2 or rows[-1]["time_s"] <= rows[0]["time_s"]:
        return None
    return (rows[-1]["tokens"] - rows[0]["tokens"]) / (rows[-1]["time_s"] - rows[0]["time_s"])


def compare(runs: dict[str, dict], names: list[str]) -> dict:
    """Whether runs `names` end with identical weights and loss, and how far their logged losses part."""
    present = [n for n in names if runs.get(n, {}).get("weights_sha256")]
    losses = {n: {m["step"]: m["loss"] for m in load_run(runs[n]["folder"]).metrics} for n in present}
    first = present[0] if present else None
    gaps = [abs(losses[n][step] - loss) for n in present[1:] for step, loss in losses[first].items()
            if step in losses[n]]
    return {"runs": present, "identical_weights": len({runs[n]["weights_sha256"] for n in present}) == 1,
            "identical_final_loss": len({runs[n]["final_loss_hex"] for n in present}) == 1,
            "max_logged_loss_gap": max(gaps, default=0.0),
            "final_losses": {n: runs[n]["final_loss"] for n in present}}


def gradient_repeats(cfg: TrainConfig, compiled: bool, deterministic: bool) -> dict[str, list[str]]:
    """Parameters whose gradient on one batch, computed three times from the same weights in this process,
    differs between the first and second computation (the first compiles and tunes) and between the second
    and third."""
    from lowprec.data import sample_batch
    from lowprec.model import GPT
    from lowprec.train import load_tokens, set_determinism

    set_determinism(deterministic)
    torch._dynamo.reset()
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model).cuda()
    forward = torch.compile(model) if compiled else model
    x, y = sample_batch(load_tokens(cfg.data).train, cfg.seed, 0, cfg.batch_size, cfg.model.block_size,
                        device="cuda")
    grads = []
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward(x, y)[1]
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return {pair: sorted(n for n in grads[0] if not torch.equal(grads[i][n], grads[i + 1][n]))
            for i, pair in enumerate(("first_vs_second", "second_vs_third"))}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="gpu-6l", choices=sorted(CONFIGS))
    parser.add_argument("--steps", type=int, default=1000, help="steps per run (default 1000)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="config override for every run, as for lowprec train")
    parser.add_argument("--backend", default="triton", choices=FIX_BACKENDS, help="attention implementation")
    parser.add_argument("--probe", action="store_true", help="also the in-process gradient repeats (GPU)")
    parser.add_argument("--runs-dir", default=None, help="keep the run records here (default: a temp folder)")
    parser.add_argument("--out", required=True, help="the record (JSON)")


def run(args: argparse.Namespace) -> int:
    if args.steps <= STEADY_FROM:
        raise ValueError(f"--steps must be > {STEADY_FROM} (the first {STEADY_FROM} include compilation)")
    get_config(args.config, args.overrides)  # a bad override fails here, before anything starts
    gpu = 0 if torch.cuda.is_available() else None
    if args.probe and gpu is None:
        raise ValueError("--probe needs a CUDA GPU")
    record: dict = {"provenance": provenance(sys.argv), "config": args.config, "overrides": args.overrides,
                    "steps": args.steps, "groups": [], "runs": {}}
    with contextlib.ExitStack() as stack:
        runs_dir = Path(args.runs_dir or stack.enter_context(tempfile.TemporaryDirectory()))
        runs_dir.mkdir(parents=True, exist_ok=True)
        if args.probe:
            arm = GROUPS[0][0][1]
            probed = get_config(args.config, [*args.overrides, *arm_overrides(arm, args.backend)])
            record["probe"] = {f"{'compiled' if c else 'eager'}, {'deterministic' if d else 'default'}":
                               gradient_repeats(probed, c, d)
                               for c, d in ((True, False), (True, True), (False, False))}
            print(json.dumps(record["probe"]), flush=True)
        for group in GROUPS:
            procs, t0 = {}, time.monotonic()
            for label, arm, seed, deterministic, interval in group:
                sets = [*args.overrides, f"max_iters={args.steps}", f"seed={seed}",
                        *arm_overrides(arm, args.backend), f"deterministic={deterministic}",
                        f"telemetry_interval={interval}", "progress=false", "ckpt_interval=-1"]
                get_config(args.config, sets)
                cmd = [sys.executable, "-m", "lowprec.cli", "train", "--config", args.config, "--out",
                       str(runs_dir / label), *(x for o in sets for x in ("--set", o))]
                procs[label] = launch(cmd, gpu, runs_dir / f"{label}.log", None if gpu == 0 else 1)
            for proc in procs.values():
                proc.wait()
            wall = time.monotonic() - t0
            for label, *_ in group:
                summary = load_run(runs_dir / label).summary
                record["runs"][label] = {
                    "folder": str(runs_dir / label), "exit_code": procs[label].returncode,
                    **{k: summary.get(k) for k in ("status", "steps", "final_loss", "final_loss_hex",
                                                   "weights_sha256", "time_s", "kernel_tiles")},
                    "tokens_per_s": steady_tokens_per_s(runs_dir / label), "beside": len(group) - 1}
            rates = [record["runs"][label]["tokens_per_s"] or 0.0 for label, *_ in group]
            record["groups"].append({"runs": [g[0] for g in group], "wall_s": wall,
                                     "tokens_per_s": sum(rates)})
            print(f"group of {len(group)}: {wall:.0f} s, {sum(rates):,.0f} tokens/s in all", flush=True)
            write_json(args.out, record)
        record["twins"] = {kind: compare(record["runs"], names) for kind, names in TWINS.items()}
        for row in record["runs"].values():
            row.pop("folder")
        write_json(args.out, record)
    print(json.dumps(record["twins"], indent=1))
    return 0

"""`lowprec bench train`: training throughput per attention backend, model FLOPs utilisation, telemetry cost.

    lowprec bench train --config gpu-6l --backends sdpa math triton/precision=fa2 --steps 200 \
        --out results/bench/train-gpu-6l.json

Each backend spec trains the config for warmup + steps steps through the real trainer, timed after the warmup;
the first backend runs again with telemetry on. A backend that fails is recorded with its error and the others
still run (exit status 1). MFU and the telemetry overhead: the book's appendix "Methods and record formats".
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import torch
from lowprec.checks import option
from lowprec.configs import CONFIGS, TrainConfig, get_config
from lowprec.fsutil import check_target
from lowprec.model import GPT
from lowprec.runs import provenance, write_json
from lowprec.train import train

H200_PEAK_BF16 = 989e12


def peak_flops(override_tflops: float | None) -> tuple[float | None, str]:
    if override_tflops:
        return override_tflops * 1e12, f"--peak-tflops {override_tflops}"
    if torch.cuda.is_available() and "H200" in torch.cuda.get_device_name():
        return H200_PEAK_BF16, "H200 dense bf16 tensor-core peak, 989 TFLOP/s"
    return None, "no peak known for this device (MFU is null); pass --peak-tflops"


def measure(cfg: TrainConfig, warmup: int, steps: int, runs_dir: Path, keep: bool = False) -> dict:
    """Train warmup + steps steps; time the last `steps` (synced); telemetry sample times if any."""
    cfg = dataclasses.replace(cfg, max_iters=warmup + steps, ckpt_interval=-1, eval_interval=0,
                              progress=False)
    marks: dict[str, float] = {}
    telemetry_s: list[float] = []

    def callback(step: int, entry: dict) -> None:
        if "telemetry_s" in entry and step >= warmup:
            telemetry_s.append(entry["telemetry_s"])
        if step in (warmup - 1, warmup + steps - 1):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            marks["start" if step == warmup - 1 else "end"] = time.perf_counter()

    runs_dir.mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix="run-", dir=runs_dir))
    summary = train(cfg, out, callback=callback)
    if summary["status"] != "finished":
        raise RuntimeError(f"benchmark run {out} ended {summary['status']}: see {out / 'events.jsonl'}")
    seconds = marks["end"] - marks["start"]
    result = {"step_s": seconds / steps, "tokens_per_s": steps * cfg.tokens_per_step / seconds,
              "telemetry_samples": len(telemetry_s), "run": str(out) if keep else None}
    if telemetry_s:
        result["telemetry_sample_s"] = sum(telemetry_s) / len(telemetry_s)
    if torch.cuda.is_available():
        result["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    return result


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, choices=sorted(CONFIGS))
    parser.add_argument("--backends", nargs="+", default=["sdpa", "math"], metavar="SPEC",
                        help="attention specs, space separated (e.g. sdpa math emulated/precision=paper "
                             "triton/precision=fa2); default: sdpa math")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per backend (default 50)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first (compile; default 10)")
    parser.add_argument("--telemetry-interval", type=option(int, 0), default=None,
                        help="telemetry interval of the overhead run (default: the config's; 0 skips it)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="config override, as for lowprec train")
    parser.add_argument("--peak-tflops", type=option(float, 0, low_open=True), default=None,
                        help="peak for MFU (default: H200 989)")
    parser.add_argument("--runs-dir", default=None, help="keep the run records here (default: a temp folder)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")


def run(args: argparse.Namespace) -> int:
    if args.steps < 1 or args.warmup < 1:
        raise ValueError("--steps and --warmup must be >= 1")
    if args.out:
        check_target(args.out, "--out", folder=False)  # before the work, not after it
    base = get_config(args.config, args.overrides)
    for spec in args.backends:
        dataclasses.replace(base.model, attention=spec)  # validates the spec
    interval = base.telemetry_interval if args.telemetry_interval is None else args.telemetry_interval
    if interval % base.log_interval:
        raise ValueError(f"--telemetry-interval must be a multiple of log_interval ({base.log_interval})")
    peak, peak_note = peak_flops(args.peak_tflops)
    report = {"provenance": provenance(), "config": base.to_dict(), "overrides": args.overrides,
              "warmup": args.warmup, "steps": args.steps, "tokens_per_step": base.tokens_per_step,
              "peak_flops": peak, "peak_note": peak_note, "results": [], "telemetry_overhead": None}
    with tempfile.TemporaryDirectory() as tmp:
        runs_dir, keep = Path(args.runs_dir or tmp), args.runs_dir is not None
        for index, spec in enumerate(args.backends):
            cfg = dataclasses.replace(base, model=dataclasses.replace(base.model, attention=spec),
                                      telemetry_interval=0)
            with torch.device("meta"):
                flops = GPT(cfg.model).flops_per_token()
            row = {"attention": spec, "flops_per_token": flops}
            try:
                row.update(measure(cfg, args.warmup, args.steps, runs_dir, keep))
            except Exception as exc:  # one failing backend must not lose the others' numbers
                row["error"] = f"{type(exc).__name__}: {exc}"
                print(f"{spec:40s} FAILED: {row['error'][:300]}", flush=True)
            else:
                row["mfu"] = row["tokens_per_s"] * flops / peak if peak else None
                mfu = "n/a" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
                print(f"{spec:40s} {row['tokens_per_s']:>12,.0f} tok/s  step {row['step_s'] * 1e3:8.1f} ms  "
                      f"MFU {mfu}", flush=True)
            report["results"].append(row)
            if index == 0 and interval and "error" not in row:  # right after its telemetry-off twin
                on = measure(dataclasses.replace(cfg, telemetry_interval=interval), args.warmup, args.steps,
                             runs_dir, keep)
                sample_s = on.get("telemetry_sample_s", float("nan"))
                per_step = sample_s / row["step_s"]  # one sample, in steps
                overhead = {"attention": spec, "interval": interval, "on": on,
                            "measured": on["step_s"] / row["step_s"] - 1, "per_sample": per_step / interval,
                            "config_interval": base.telemetry_interval,
                            "per_sample_at_config_interval": (per_step / base.telemetry_interval
                                                              if base.telemetry_interval else None)}
                report["telemetry_overhead"] = overhead
                print(f"telemetry every {interval} steps ({spec}): measured "
                      f"{100 * overhead['measured']:+.1f}% over {args.steps} steps, per-sample estimate "
                      f"{100 * overhead['per_sample']:.2f}% ({sample_s * 1e3:.1f} ms a sample)", flush=True)
            if args.out:  # after every run, so a killed benchmark keeps what it measured
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                write_json(args.out, report)
    return 1 if any("error" in row for row in report["results"]) else 0

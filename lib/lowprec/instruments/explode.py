"""`lowprec experiment explode`: train several attention arms x seeds side by side and record who explodes.

One `lowprec train` process per (arm, seed), spread over the visible GPUs, all with the same config, data and,
per seed, the same initialisation and batch order; after `--minutes` the runs still going are stopped (each
checkpoints). `<out>/experiment.json` holds the plan and, per run, its status, explosion step and signature;
run records are `<out>/<arm>-s<seed>/`. An arm is a short name for an attention spec (`arm_spec`, `ARMS`):
fa2, paper64, fp32pv, paper64-fp32pv, bf16scores, bf16rowsum, onesK, kbitK, each optionally with
"-consistent", then "-fix"; and attn-fp32 (attention in fp32) and model-fp32 (no bf16 anywhere), which set
more than the spec (`arm_overrides`). `--backend emulated` runs the emulator instead of the kernel. The arms:
the book's appendix "Methods and record formats".
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
from lowprec.analysis import format_runs, run_summary
from lowprec.attention import AttentionSpec, Fix, Precision
from lowprec.attention.precision import POINTS
from lowprec.attention.spec import backends_with
from lowprec.checks import option
from lowprec.configs import CONFIGS, get_config
from lowprec.runs import check_target, metrics_file, provenance, write_json

ARMS = {"fa2": "fa2", "paper64": "paper:tile=64", "fp32pv": "fa2:weights=none",
              "paper64-fp32pv": "paper:tile=64,weights=none,product=none,accumulator=none",
              "bf16scores": "fa2:scores=input,weights=none,tile=64",
              "bf16rowsum": "fa2:weights=none,rowsum=input,tile=64"}
FP32_ARMS = {"attn-fp32": ("math/dtype=float32", ()), "model-fp32": ("math", ("dtype=float32",))}
FIX = Fix(beta=2.0)
CONSISTENT = "-consistent"
FIX_BACKENDS = backends_with("fix")
POLL_S = 1.0


@functools.lru_cache(maxsize=256)  # `arm_of` tries every arm for each record it names; the specs are frozen
def arm_spec(arm: str, backend: str = "triton") -> AttentionSpec:
    """The attention spec of a named arm (module docstring), e.g. "ones3-fix" ->
    triton/precision=fa2:weights=e8m3@ones/fix=2."""
    if backend not in FIX_BACKENDS:
        raise ValueError(f"backend must be one of {FIX_BACKENDS}, got {backend!r}")
    if arm in FP32_ARMS:
        return AttentionSpec.parse(FP32_ARMS[arm][0])
    base, fix = (arm.removesuffix("-fix"), True) if arm.endswith("-fix") else (arm, False)
    base, consistent = ((base.removesuffix(CONSISTENT), True) if base.endswith(CONSISTENT)
                        else (base, False))
    match = re.fullmatch(r"(ones|kbit)(\d)", base)
    if match:
        precision = f"fa2:weights=e8m{match[2]}" + ("@ones" if match[1] == "ones" else "")
    elif base in ARMS:
        precision = ARMS[base]
    else:
        raise ValueError(f"unknown arm {arm!r}: use {', '.join(ARMS)}, onesK or kbitK "
                         "(K = 1..9 significand bits), optionally with '-consistent', then '-fix'; or "
                         f"{', '.join(FP32_ARMS)}")
    if consistent:
        precision = replace(Precision.parse(precision), norm="rounded")
    return AttentionSpec(backend, precision, FIX if fix else None)


def arm_overrides(arm: str, backend: str = "triton") -> list[str]:
    """The config overrides (`--set` items) that make a run of `arm`: its attention spec, and for model-fp32
    the model's dtype."""
    extra = FP32_ARMS[arm][1] if arm in FP32_ARMS else ()
    return [f"attention={arm_spec(arm, backend)}", *extra]


def arm_of(spec: AttentionSpec | str, dtype: str = "bfloat16") -> str:
    """The arm that runs an attention spec in a model of `dtype` (the inverse of `arm_overrides`), e.g. for
    records whose folders were named before an arm was renamed; ValueError if no arm does."""
    spec = AttentionSpec.parse(spec)
    fp32 = next((arm for arm, (text, extra) in FP32_ARMS.items()
                 if AttentionSpec.parse(text) == spec and ("dtype=float32" in extra) == (dtype == "float32")),
                None)
    if fp32 is not None:
        return fp32
    if spec.fix not in (None, FIX) or spec.backend not in FIX_BACKENDS:
        raise ValueError(f"no explode arm runs {str(spec)!r}")
    bases = [*ARMS, *(f"{kind}{bits}" for kind in ("ones", "kbit") for bits in range(1, 10))]
    bases += [b + CONSISTENT for b in bases]
    base = next((b for b in bases if arm_spec(b, spec.backend) == spec.with_fix(None)), None)
    if base is None:
        raise ValueError(f"no explode arm runs {str(spec)!r}")
    return base + ("-fix" if spec.fix is not None else "")


def run_name(arm: str, seed: int) -> str:
    return f"{arm}-s{seed}"


def rounded_points(attention: str) -> frozenset[str]:
    """The rounding points (scores, weights, rowsum, product, accumulator, output) an attention spec rounds
    (none for a spec without a Precision, such as `math/dtype=float32`)."""
    precision = AttentionSpec.parse(attention).precision
    if precision is None:
        return frozenset()
    return frozenset(point for point in POINTS if str(getattr(precision, point)) != "none")


def record_name(config: dict) -> str:
    """A recorded run's name, `<arm>-s<seed>`, the arm read from its attention spec and dtype (so records
    made before an arm was renamed read under its current name): `runs.load_experiment`'s `name`."""
    return run_name(arm_of(config["model"]["attention"], config.get("dtype", "bfloat16")), config["seed"])


def launch(cmd: list[str], gpu: int | None, log: Path, threads: int | None = None) -> subprocess.Popen:
    """Start one `lowprec` command: on GPU `gpu`, or on the CPU with `threads` intra-op threads (runs sharing
    the cores each take a share: oversubscribed, torch's threads spin-wait and every run slows many times
    over). It ends with this process, however this one ends (`cli.follow_parent`: SIGTERM, so a trainer
    checkpoints and records "interrupted")."""
    env = {**os.environ, "LOWPREC_PARENT_PID": str(os.getpid())}  # cli.PARENT_ENV
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    if threads is not None:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    with open(log, "w") as handle:
        # own process group: the harness's Ctrl-C reaches the children only through stop_all (one SIGTERM)
        return subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True)


@contextlib.contextmanager
def signals_interrupt() -> Iterator[None]:
    """Within the block SIGTERM and SIGHUP raise KeyboardInterrupt, as Ctrl-C does, so that a harness told to
    stop by a signal stops its runs and writes its record; a second such signal ends it at once (its runs
    still end with it: `launch`)."""
    signals = (signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.getsignal(sig) for sig in signals}

    def interrupt(signum, frame) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        raise KeyboardInterrupt

    for sig in signals:
        signal.signal(sig, interrupt)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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
                        help="comma-separated arms (module docstring): fa2, paper64, fp32pv, "
                             "paper64-fp32pv, bf16scores, bf16rowsum, onesK, kbitK, each optionally with "
                             "-consistent, then -fix; attn-fp32, model-fp32")
    parser.add_argument("--seeds", default="1,2,3", help="comma-separated seeds (init and batch order)")
    parser.add_argument("--minutes", type=option(float, 0, low_open=True), default=8.0,
                        help="wall-clock budget; then SIGTERM")
    parser.add_argument("--gpus", type=option(int, 0), default=None,
                        help="GPUs to spread the runs over (default: all visible; 0 = CPU)")
    parser.add_argument("--backend", default="triton", choices=FIX_BACKENDS, help="attention implementation")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="config override for every run (repeatable), e.g. --set lr=3e-3")
    parser.add_argument("--grace", type=option(float, 0), default=60.0,
                        help="seconds a stopped run may take to save")


def run(args: argparse.Namespace) -> int:
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    specs = {arm: str(arm_spec(arm, args.backend)) for arm in arms}
    sets = {arm: arm_overrides(arm, args.backend) for arm in arms}
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--seeds must be comma-separated integers, got {args.seeds!r}") from None
    if not arms or not seeds:
        raise ValueError("--arms and --seeds must each name at least one item")
    visible = torch.cuda.device_count()
    if args.gpus is not None and args.gpus > visible:
        raise ValueError(f"--gpus {args.gpus}: this machine has {visible} visible GPU(s); pass 0..{visible} "
                         "(0 = CPU)")
    check_target(args.out, "--out")
    for seed in seeds:  # a bad override or seed fails here, before anything starts
        get_config(args.config, [*args.overrides, f"seed={seed}"])
    taken = [run_name(arm, seed) for seed in seeds for arm in arms
             if metrics_file(Path(args.out) / run_name(arm, seed)).exists()]
    if taken:
        raise ValueError(f"--out {args.out} already holds runs {taken}: choose a new --out folder")
    gpus = visible if args.gpus is None else args.gpus
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs = list(itertools.product(seeds, arms))
    procs: dict[str, subprocess.Popen] = {}
    plan = {"config": args.config, "overrides": args.overrides, "arms": specs, "seeds": seeds,
            "minutes": args.minutes, "gpus": gpus, "command": sys.argv}
    record = {"plan": plan, "provenance": provenance(plan["command"]), "state": "running"}
    write_json(out / "experiment.json", record)  # what a harness killed outright leaves; its runs end with it
    t0 = time.monotonic()
    with signals_interrupt():
        try:
            for i, (seed, arm) in enumerate(jobs):
                name = run_name(arm, seed)
                cmd = [sys.executable, "-m", "lowprec.cli", "train", "--config", args.config,
                       "--out", str(out / name), "--set", f"seed={seed}", "--set", "progress=false",
                       *itertools.chain.from_iterable(("--set", o) for o in [*sets[arm], *args.overrides])]
                threads = None if gpus else max(1, (os.cpu_count() or 1) // len(jobs))
                procs[name] = launch(cmd, i % gpus if gpus else None, out / f"{name}.log", threads)
            print(f"explode: {len(procs)} runs ({', '.join(arms)} x seeds {seeds}) on "
                  f"{gpus or 'no'} GPU(s) for {args.minutes:g} min -> {out}", flush=True)
            while time.monotonic() - t0 < args.minutes * 60 and any(p.poll() is None for p in procs.values()):
                time.sleep(POLL_S)
                if int(time.monotonic() - t0) % 60 < POLL_S:
                    status = "  ".join(f"{n}:{last_step(out / n)}{'' if p.poll() is None else '!'}"
                                       for n, p in procs.items())
                    print(f"[{time.monotonic() - t0:5.0f}s] {status}", flush=True)
            record["state"] = "finished"
        except KeyboardInterrupt:
            record["state"] = "stopped"
            print("explode: interrupted; stopping the runs (each saves a checkpoint)", flush=True)
        stop_all(procs, args.grace)
    record["runs"] = {name: {"arm": arm, "seed": seed, "attention": specs[arm],
                             "exit_code": procs[name].returncode, **run_summary(out / name)}
                      for seed, arm in jobs for name in [run_name(arm, seed)] if name in procs}
    record["wall_s"] = time.monotonic() - t0
    write_json(out / "experiment.json", record)
    print(format_runs(record["runs"]))
    return 0

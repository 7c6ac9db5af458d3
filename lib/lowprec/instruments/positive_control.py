"""`lowprec experiment positive-control`: train the control's treatments (lowprec.instruments.control) on
identical init and data, print a summary line per run and record them.

`train_grid` trains every (placement, optimizer, treatment); `recorded_control` reads a record and trains one
of its runs again to check it; a record's keys are in the book's appendix "Methods and record formats".
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from lowprec.checks import comma_list
from lowprec.instruments.control import FP32_PV, OPTIMIZERS, TREATMENTS, ControlConfig, train_treatment
from lowprec.instruments.cures import CURES, train_key
from lowprec.runs import check_target, cpu_vendor, provenance, write_json
from tqdm import tqdm


def train_grid(
    cfg: ControlConfig,
    placements: tuple[str, ...] = tuple(FP32_PV),
    treatments: tuple[str, ...] = TREATMENTS,
    optimizers: tuple[str, ...] = OPTIMIZERS,
    show_progress: bool = True,
) -> dict:
    """Every (placement, optimizer, treatment) run on identical init and data: {"config", "runs": {key: run}}.

    Keys are "<placement>/<optimizer>/<treatment>"; the reference does not depend on the placement and is run
    once per optimizer, under the key "fp64/<optimizer>/reference".
    """
    jobs = [(p, o, t) for o in optimizers for p in placements for t in treatments if t != "reference"] + [
        ("fa2", o, "reference") for o in optimizers if "reference" in treatments
    ]
    runs = {}
    with tqdm(total=len(jobs) * cfg.steps, disable=not show_progress, desc="positive control") as bar:
        for placement, optimizer, treatment in jobs:
            key = f"{'fp64' if treatment == 'reference' else placement}/{optimizer}/{treatment}"
            runs[key] = train_treatment(cfg, placement, treatment, optimizer, bar)
    return {"config": asdict(cfg), "runs": runs}


# relative tolerances of `agrees`: another torch build moves a run by a few percent
# (results/positive-control/cross-build.json), and so does another CPU vendor with the same torch and
# instruction set (MKL's code paths differ: 2.7% and 4.1% on cpu-vmean-1.json's live run, AMD against the
# record's unrecorded CPU); a record that does not name its CPU's vendor counts as another build
SAME_BUILD_TOL, OTHER_BUILD_TOL = 0.02, 0.10


def agrees(now: float | None, then: float | None, scale: float, rel_tol: float = SAME_BUILD_TOL) -> bool:
    """A summary number trained again against its record: a collapse step (int) within 2 steps (with a wider
    rel_tol than SAME_BUILD_TOL, within rel_tol of it if that is more), any other number within rel_tol, or
    within 0.1% of `scale` (the largest |value| the record holds for that number, so that a value near zero,
    where another CPU or torch version rounds the last bits differently, is compared at the record's own
    scale), or at least within 1e-4; None and NaN only with themselves."""
    if now is None or then is None:
        return now == then
    if isinstance(then, int):
        return abs(now - then) <= (2 if rel_tol <= SAME_BUILD_TOL else max(2, rel_tol * abs(then)))
    close = math.isclose(now, then, rel_tol=rel_tol, abs_tol=max(1e-4, 1e-3 * scale))
    return close or (math.isnan(now) and math.isnan(then))


def recorded_control(path: str | Path, cfg: ControlConfig, live: str | None) -> dict[str, dict]:
    """{key: {"series", "summary"}} of a record written by `lowprec experiment positive-control --series` for
    `cfg`, with run `live` (a key, see cures.train_key) trained again here and checked against the record
    number by number (`agrees`: within SAME_BUILD_TOL under the record's torch and CPU kernels,
    OTHER_BUILD_TOL under others); live=None only reads the record. A ValueError names the record when it is
    of another configuration, lacks the series, or is stale."""
    record = json.loads(Path(path).read_text())
    if record["config"] != asdict(cfg):
        raise ValueError(f"{path} records another configuration than {cfg}")
    if "series" not in record:
        raise ValueError(f"{path} has no per-step series: record it with --series")
    runs = {key: {"series": record["series"][key], "summary": s} for key, s in record["summary"].items()}
    if live is None:
        return runs
    if live not in runs:
        raise ValueError(f"live must be one of the record's runs {sorted(runs)}; got {live!r}")
    fresh = train_key(cfg, live)
    numbers = [run["summary"] for run in runs.values()]
    scale = {k: max((abs(s[k]) for s in numbers if isinstance(s.get(k), float) and math.isfinite(s[k])),
                    default=0.0)
             for k in runs[live]["summary"]}
    provenance = record.get("provenance", {})
    built = (f"torch {provenance.get('torch')} on {provenance.get('cpu_capability', 'an unrecorded CPU')} "
             f"({provenance.get('cpu_vendor', 'an unrecorded vendor')})")
    here = f"torch {torch.__version__} on {torch.backends.cpu.get_cpu_capability()} ({cpu_vendor()})"
    rel_tol = SAME_BUILD_TOL if built == here else OTHER_BUILD_TOL
    stale = sorted(k for k, then in runs[live]["summary"].items()
                   if not agrees(fresh["summary"][k], then, scale[k], rel_tol))
    if stale:
        command = " ".join(provenance.get("command", ["lowprec experiment ..."]))
        then, now = runs[live]["summary"], fresh["summary"]
        values = ", ".join(f"{k} {then[k]!r} recorded, {now[k]!r} here" for k in stale)
        raise ValueError(f"{path} is stale: {live} trained here differs in {values} (compared within "
                         f"{rel_tol:.0%}: recorded with {built}, here {here}); record it again: {command}")
    runs[live] = fresh
    return runs


def format_summary(result: dict) -> str:
    """One line per run: drift on R, its slope, ||W||_2 growth, t-stats, one-signedness, P̄ = 1 per row,
    fraction of the task lost at the end, content mass first > last, collapse step."""
    nan = float("nan")
    width = max([22, *(len(key) + 1 for key in result["runs"])])
    lines = [
        f"{'run':<{width}}{'<W-W0,R>':>9}{'slope':>10}{'|W|/|W0|':>9}{'t(δerr)':>8}{'t(gerr·R)':>10}"
        f"{'cumδ 1-sign':>12}{'P̄=1/row':>9}{'task lost':>10}{'content mass':>15}{'collapse':>9}"
    ]
    for key, run in result["runs"].items():
        s = run["summary"]
        collapse = "-" if s["collapse_step"] is None else str(s["collapse_step"])
        lines.append(
            f"{key:<{width}}{s['w_r_final']:>+9.3f}{s['w_r_slope']:>+10.2e}{s['w_norm_growth']:>9.2f}"
            f"{s.get('delta_err_t', nan):>+8.1f}{s.get('g_err_r_t', nan):>+10.1f}"
            f"{s.get('delta_cum_same_sign_frac', nan):>12.2f}{s.get('pbar_ones_per_row', nan):>9.2f}"
            f"{s['task_lost_last']:>10.2f}{s['content_mass_first']:>8.3f}>{s['content_mass_last']:<6.3f}"
            f"{collapse:>9}"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------ CLI


def configure(parser: argparse.ArgumentParser) -> None:
    for name, value in asdict(ControlConfig()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    lists = {"placements": tuple(FP32_PV), "treatments": TREATMENTS, "optimizers": OPTIMIZERS}
    for name, allowed in lists.items():
        spellings = [f"--{name}", "--arms"] if name == "treatments" else [f"--{name}"]  # records say --arms
        parser.add_argument(*spellings, dest=name, type=comma_list(allowed), default=allowed,
                            help=f"comma list of {', '.join(allowed)}")
    parser.add_argument(
        "--out", default=None, help="write the record here (e.g. results/positive-control/x.json)"
    )
    parser.add_argument("--series", action="store_true", help="also store the per-step series in the record")
    parser.add_argument("--cures", action="store_true",
                        help="train every cure of lowprec.instruments.cures.CURES instead of the treatments "
                             "(keys cure/<optimizer>/<name>; --placements and --treatments are then unused)")


def run(args: argparse.Namespace) -> int:
    if args.out is not None:
        check_target(args.out, "--out", folder=False)  # before the work, not after it
    cfg = ControlConfig(**{name: getattr(args, name) for name in asdict(ControlConfig())})
    if args.cures:
        keys = [f"cure/{optimizer}/{cure.name}" for optimizer in args.optimizers for cure in CURES]
        runs = {key: train_key(cfg, key) for key in tqdm(keys, desc="cures")}
        result = {"config": asdict(cfg), "runs": runs}
    else:
        result = train_grid(cfg, args.placements, args.treatments, args.optimizers)
    print(format_summary(result))
    if args.out:
        record = {
            "provenance": provenance(),
            "config": result["config"],
            "summary": {key: run["summary"] for key, run in result["runs"].items()},
        }
        if args.series:
            record["series"] = {key: run["series"] for key, run in result["runs"].items()}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_json(args.out, record)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


__all__ = [
    "OTHER_BUILD_TOL",
    "agrees",
    "format_summary",
    "recorded_control",
    "train_grid",
]

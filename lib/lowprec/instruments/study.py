"""`lowprec experiment study --queue Q --out DIR --minutes M`: make a queue's runs, each to its horizon.

The queue (a JSON file, committed beside its records) names the recipe (a config and overrides), the horizon
in steps, and the runs in the order they should be made: {"arm", "seed"} (arms as in `explode`), optionally
with a "tag" and "overrides" of their own (a grid's cell, e.g. tag "lr4e-3" with ["lr=4e-3"]); a run's group
is its arm and tag ("fa2-lr4e-3"), its record folder "<group>-s<seed>". A run is done
when its record, in the queue's folder or in --out, reached the horizon or the stop rule; every other run is
still planned, so the work picks up where it stopped. The runner starts planned runs in queue order, `--slots`
at a time, spread over `--gpus` (default: every visible GPU; each run goes to the GPU running fewest), each
only if its expected time (`expected_s`: its group's done runs' pace projected to the horizon, on another GPU
scaled by this one's pace, at least the queue's estimate; times the runs that share a GPU, or the CPU) ends
before the budget does; a run still going when the budget ends gets SIGTERM and stays planned (a run has no
outcome until it reaches its horizon); a run whose process ends without an outcome stops the study (exit 1):
the runs after it would most likely fail the same way. `--status` prints every run's state (a done run's
runaway step, largest logit and final loss) and the survival table (`analysis.survival_table`) of the done
ones and exits.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from lowprec.analysis import largest_logit, outcome, survival_table
from lowprec.checks import option
from lowprec.configs import CONFIGS, get_config
from lowprec.instruments.explode import arm_overrides, launch, run_name, signals_interrupt, stop_all
from lowprec.runs import RunRecordError, load_run, provenance, write_json

START_S = 30.0  # a process's start before its first step (imports, data), beside the trainer's own time_s
BREAK_WARNING = "Dynamo does not know how to trace the builtin"  # its warning at such a graph break (2.11)


def load_queue(path: str | Path) -> dict:
    """The queue file, checked: config, horizon, overrides, runs [{arm, seed}], estimate_s {arm: seconds}."""
    path = Path(path)
    try:
        queue = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--queue {path}: not a readable queue file ({exc})") from None
    missing = [k for k in ("config", "horizon", "overrides", "runs", "estimate_s") if k not in queue]
    if missing:
        raise ValueError(f"--queue {path}: lacks {missing}")
    if queue["config"] not in CONFIGS or not isinstance(queue["horizon"], int) or queue["horizon"] < 1:
        raise ValueError(f"--queue {path}: config must be one of {sorted(CONFIGS)}, horizon an int >= 1")
    for item in queue["runs"]:
        arm_overrides(item["arm"])  # an unknown arm fails here
        if group(item) not in queue["estimate_s"] and item["arm"] not in queue["estimate_s"]:
            raise ValueError(f"--queue {path}: no estimate_s for {group(item)!r} or its arm")
    return queue


def group(item: dict) -> str:
    """A queued run's group: its arm, and its tag if it has one."""
    return f"{item['arm']}-{item['tag']}" if item.get("tag") else item["arm"]


def run_overrides(queue: dict, item: dict) -> list[str]:
    """The `--set` items of one run: the recipe, the horizon, the seed, the arm's own and the run's own."""
    return [*queue["overrides"], f"max_iters={queue['horizon']}", f"seed={item['seed']}",
            *arm_overrides(item["arm"]), *item.get("overrides", []), "progress=false"]


def train_command(queue: dict, item: dict, folder: Path) -> list[str]:
    """The `lowprec train` command of one run of the queue (`run_overrides`), its record in `folder`."""
    sets = run_overrides(queue, item)
    return [sys.executable, "-m", "lowprec.cli", "train", "--config", queue["config"], "--out", str(folder),
            *(x for o in sets for x in ("--set", o))]


def run_state(folders: list[Path], horizon: int) -> tuple[str, Path | None]:
    """("done", folder) for the first folder holding a record with an outcome at `horizon`, else ("planned",
    None) (or ("partial", folder) for a record that stopped short)."""
    seen = None
    for folder in folders:
        try:
            run = load_run(folder)
        except RunRecordError:
            continue
        try:
            outcome(run, horizon)
            return "done", folder
        except ValueError:
            seen = folder
    return ("partial", seen) if seen else ("planned", None)


def broke_graphs(folder: Path) -> bool | None:
    """Whether the run in `folder` was compiled in pieces: a "compiled" event of its record (one per process
    that trained it) counts a graph break, or, in a record from before that event, its log (`<folder>.log`,
    the study's) has Dynamo's warning of a call it cannot trace; None where there is neither event nor log."""
    compiled = load_run(folder).events_of("compiled")
    if compiled:
        return any(event["graph_breaks"] > 0 for event in compiled)
    log = folder.parent / f"{folder.name}.log"
    return BREAK_WARNING in log.read_text(errors="replace") if log.exists() else None


def expected_s(queue: dict, rows: list[dict], device: str) -> dict[str, float]:
    """Seconds each run of `rows` (`states`; by name) is expected to take alone on `device`: its group's done
    runs' times projected to the horizon (seconds per step x horizon + START_S: a run the stop rule ended
    counts at its pace): the latest run made on `device` (by start time: its pace now, after any change of
    code), else the median of the group's runs elsewhere scaled by how much longer `device` took for the
    groups made on both (the median over them of the latest run here over the median elsewhere; 1 where no
    group has runs on both); at least the queue's estimate for the group (or its arm)."""
    here: dict[str, tuple[str, float]] = {}  # group -> (start time, projected seconds) of its latest run here
    elsewhere: dict[str, list[float]] = {}  # group -> projected seconds of its runs on other devices
    for r in rows:
        if r["state"] == "done":
            run = load_run(r["folder"])
            seconds = run.summary["time_s"] / max(run.summary["steps"], 1) * queue["horizon"] + START_S
            group, when = r["group"], run.provenance.get("time", "")
            if run.provenance.get("device") == device:
                here[group] = max(here.get(group, ("", 0.0)), (when, seconds))
            else:
                elsewhere.setdefault(group, []).append(seconds)
    ratios = [here[g][1] / statistics.median(times) for g, times in elsewhere.items() if g in here]
    factor = statistics.median(ratios) if ratios else 1.0
    out = {}
    for r in rows:
        group, seconds = r["group"], 0.0
        if group in here:
            seconds = here[group][1]
        elif group in elsewhere:
            seconds = statistics.median(elsewhere[group]) * factor
        estimate = queue["estimate_s"].get(group, queue["estimate_s"].get(r["arm"]))
        out[r["name"]] = max(estimate, seconds)
    return out


def states(queue: dict, home: Path, out: Path | None) -> list[dict]:
    """Every queued run with its state and record folder (the queue's folder first, then --out)."""
    rows = []
    for item in queue["runs"]:
        name = run_name(group(item), item["seed"])
        state, folder = run_state([home / name] + ([out / name] if out else []), queue["horizon"])
        rows.append({**item, "group": group(item), "name": name, "state": state, "folder": folder})
    return rows


def status(queue: dict, home: Path, out: Path | None) -> str:
    """A line per queued run (a done run's runaway step, largest logit, final loss, and "in pieces" where it
    was compiled so: `broke_graphs`), then per group the runaway and explosion counts of the done runs."""
    lines, done = [], {}
    for r in states(queue, home, out):
        found = ""
        if r["state"] == "done":
            run = load_run(r["folder"])
            result = outcome(run, queue["horizon"])
            done.setdefault(r["group"], []).append(result)
            found = (f"runaway {'-' if result.runaway is None else result.runaway:>6}  largest logit "
                     f"{largest_logit(run):>9,.0f}  final loss {run.summary['final_loss']:5.2f}"
                     + ("  in pieces" if broke_graphs(r["folder"]) else ""))
        lines.append(f"{r['name']:<28} {r['state']:<8} {found:<65} {r['folder'] or ''}".rstrip())
    table = survival_table(done, against=("fa2", "model-fp32"))
    lines.append(f"\n{'group':<22} {'runs':>4}  runaway (95% CI)        explosion (95% CI)       first layer")
    for name, row in table.items():
        cells = [f"{row[e]['events']}/{row['runs']} ({row[e]['interval'][0]:.2f}-{row[e]['interval'][1]:.2f})"
                 for e in ("runaway", "explosion")]
        lines.append(f"{name:<22} {row['runs']:>4}  {cells[0]:<23} {cells[1]:<23} {row['runaway']['layers']}")
    return "\n".join(lines)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--queue", required=True, help="queue file (JSON; records beside it count as done)")
    parser.add_argument("--out", help="folder for new run records (one per arm and seed)")
    parser.add_argument("--minutes", type=option(float, 0, low_open=True), default=20.0,
                        help="no run starts that would end after this")
    parser.add_argument("--slots", type=option(int, 1), default=1,
                        help="runs at a time, spread over the GPUs (or sharing the CPU)")
    parser.add_argument("--gpus", type=option(int, 0), default=None,
                        help="GPUs to spread the runs over (default: every visible one; 0: the CPU)")
    parser.add_argument("--status", action="store_true",
                        help="print each run's state and outcome and the table, exit")
    parser.add_argument("--dry-run", action="store_true",
                        help="print what would start, and exit")
    parser.add_argument("--grace", type=option(float, 0), default=30.0,
                        help="seconds a stopped run may take to end")
    parser.add_argument("--estimate", action="append", default=[], metavar="GROUP=SECONDS",
                        help="a group's time alone in seconds, in place of the queue's estimate_s (e.g. one "
                             "measured with scripts/time_arm.py); repeatable")


def estimates(items: list[str], queue: dict) -> dict[str, float]:
    """--estimate's GROUP=SECONDS items as {group: seconds}, each group one of the queue's."""
    groups = {group(item) for item in queue["runs"]}
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        if name not in groups or not seconds > 0:
            raise ValueError(f"--estimate {item!r}: expected GROUP=SECONDS with GROUP one of "
                             f"{sorted(groups)} and SECONDS > 0")
        out[name] = seconds
    return out


def run(args: argparse.Namespace) -> int:
    queue = load_queue(args.queue)
    queue["estimate_s"] = {**queue["estimate_s"], **estimates(args.estimate, queue)}
    home = Path(args.queue).parent
    out = Path(args.out) if args.out else None
    if args.status:
        print(status(queue, home, out))
        return 0
    if out is None:
        raise ValueError("--out is required unless --status")
    for item in queue["runs"]:  # a bad override fails here, before anything starts
        get_config(queue["config"], run_overrides(queue, item))
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.gpus is not None and args.gpus > visible:
        raise ValueError(f"--gpus {args.gpus}: this machine has {visible} visible GPU(s); pass 0..{visible}")
    gpus = visible if args.gpus is None else args.gpus
    sharing = -(-args.slots // gpus) if gpus else args.slots  # runs on one GPU (or the CPU) at a time
    rows = [r for r in states(queue, home, out) if r["state"] != "done"]
    budget = args.minutes * 60
    log = {"queue": str(args.queue), "provenance": provenance(sys.argv), "budget_s": budget, "runs": {},
           "state": "running"}

    def expected() -> dict[str, float]:
        # runs sharing a GPU each take about that many times as long (four at once: 1.12x the tokens/s of one)
        times = expected_s(queue, states(queue, home, out), log["provenance"]["device"])
        return {name: seconds * sharing for name, seconds in times.items()}

    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    procs: dict[str, subprocess.Popen] = {}
    started: dict[str, dict[str, float]] = {}  # name -> its start and expected time, in seconds
    log_path = out / f"study-{time.strftime('%Y%m%dT%H%M%S')}.json"
    if not args.dry_run:
        write_json(log_path, log)  # what a harness killed outright leaves; its runs end with it
    with signals_interrupt():
        try:
            failed = _make_runs(args, queue, rows, expected, budget, out, t0, procs, started, gpus)
            log["state"] = "failed" if failed else "finished"
        except KeyboardInterrupt:
            log["state"] = "stopped"
            print("study: interrupted; stopping the runs", flush=True)
        stop_all(procs, args.grace)
    for name, proc in procs.items():
        state, _ = run_state([out / name], queue["horizon"])
        log["runs"][name] = {**started[name], "exit_code": proc.returncode, "state": state}
    if not args.dry_run:
        log["wall_s"] = time.monotonic() - t0
        write_json(log_path, log)
        print(status(queue, home, out))
    return 1 if log["state"] == "failed" else 0


def _make_runs(args: argparse.Namespace, queue: dict, rows: list[dict],
               expect: Callable[[], dict[str, float]], budget: float, out: Path, t0: float,
               procs: dict[str, subprocess.Popen], started: dict[str, dict[str, float]], gpus: int) -> bool:
    """`run`'s loop: start planned runs in queue order, `--slots` at a time (each on the one of `gpus` GPUs
    running fewest, or on the CPU where `gpus` is 0), each if its expected time
    (`expect`, asked again whenever a run ends: a run made here tells this machine's pace) fits in the budget
    (into `procs` and `started`); returns when none is running and none can start, or the budget is spent
    (False), or when a run's process ended without an outcome at the horizon (True: no further run starts,
    since the next would most likely fail the same way; the runs still going finish)."""
    ended: set[str] = set()
    failed = False
    expected = expect()
    while True:
        now = time.monotonic() - t0
        running = [n for n, p in procs.items() if p.poll() is None]
        just_ended = sorted(set(procs) - set(running) - ended)
        if just_ended:
            expected = expect()
        for name in just_ended:
            ended.add(name)
            if not failed and run_state([out / name], queue["horizon"])[0] != "done":
                failed = True
                rows.clear()
                print(f"study: {name} ended without an outcome at step {queue['horizon']:,} (exit "
                      f"{procs[name].returncode}; its log: {out / f'{name}.log'}): no further run starts",
                      flush=True)
        for r in list(rows):
            if len(running) >= args.slots:
                break
            if now + expected[r["name"]] > budget:
                continue
            rows.remove(r)
            name = r["name"]
            if args.dry_run:
                print(f"would start {name} (expected {expected[name]:.0f} s)")
                running.append(name)
                continue
            folder = out / name
            if folder.exists():  # a partial record of an earlier budget: the run starts over
                shutil.rmtree(folder)
            cmd = train_command(queue, r, folder)
            on = [started[n].get("gpu") for n in running]
            gpu = min(range(gpus), key=on.count) if gpus else None  # the GPU running fewest
            threads = None if gpus else max(1, (os.cpu_count() or 1) // args.slots)
            procs[name] = launch(cmd, gpu, out / f"{name}.log", threads)
            started[name] = {"started_s": now, "expected_s": expected[name], **({"gpu": gpu} if gpus else {})}
            running.append(name)
            where = f" on GPU {gpu}" if gpus > 1 else ""
            print(f"[{now:5.0f}s] start {name}{where} (expected {expected[name]:.0f} s)", flush=True)
        if args.dry_run or not running:
            return failed
        minute = int((time.monotonic() - t0) // 60)
        wake = time.monotonic() + 5  # or as soon as a run ends, so that the next one starts at once
        while time.monotonic() < wake and all(procs[n].poll() is None for n in running):
            time.sleep(0.1)
        if int((time.monotonic() - t0) // 60) > minute:
            print(f"[{time.monotonic() - t0:5.0f}s] running {', '.join(running)}", flush=True)
        if time.monotonic() - t0 > budget:
            print("budget spent: stopping the runs still going (they stay planned)", flush=True)
            return failed

"""Time a few hundred steps of one arm of a study queue's recipe and project its time to the queue's horizon.

    python3 scripts/time_arm.py --queue results/explode/survival/queue.json --arm model-fp32 --steps 300 \
        --work /tmp/study --out FILE [--set data=sample:gpt2]

Runs `lowprec train` with the queue's overrides for (arm, seed 1) and max_iters=steps (then the --set items:
the committed sample in place of a corpus not yet unpacked times the same model and batch), then writes
tokens/s after step 100 (`reproducibility.steady_tokens_per_s`), the seconds to step 100 (compilation
included) and the projected seconds to the horizon, with provenance. The run's own record stays in --work.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
from pathlib import Path

from lowprec.instruments.reproducibility import STEADY_FROM, steady_tokens_per_s
from lowprec.instruments.study import load_queue, train_command
from lowprec.runs import load_run, provenance


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queue", type=Path, required=True)
    parser.add_argument("--arm", default="model-fp32")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--work", type=Path, default=Path("/tmp/study"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override after the queue's (repeatable)")
    args = parser.parse_args()
    if args.steps <= STEADY_FROM:
        parser.error(f"--steps must exceed {STEADY_FROM} (tokens/s is measured after step {STEADY_FROM})")
    queue = load_queue(args.queue)
    folder = args.work / f"time-{args.arm}"
    shutil.rmtree(folder, ignore_errors=True)  # this script's own scratch record: each timing starts afresh
    args.work.mkdir(parents=True, exist_ok=True)
    recipe = {**queue, "horizon": args.steps, "overrides": [*queue["overrides"], *args.set]}
    cmd = train_command(recipe, {"arm": args.arm, "seed": 1}, folder)
    with open(args.work / f"time-{args.arm}.log", "w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True)
    run = load_run(folder)
    rate = steady_tokens_per_s(folder)
    warm = next(m["time_s"] for m in run.metrics if m["step"] >= STEADY_FROM)
    last = run.metrics[-1]
    per_step = last["tokens"] / (last["step"] + 1)  # tokens seen after a step, the step's own included
    record = {"provenance": provenance(), "queue": str(args.queue), "arm": args.arm,
              "extra_overrides": args.set,
              "steps": run.summary.get("steps"), "tokens_per_s": round(rate), "seconds_to_step_100": warm,
              "horizon": queue["horizon"],
              "projected_s": round(warm + (queue["horizon"] - STEADY_FROM) * per_step / rate, 1)}
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

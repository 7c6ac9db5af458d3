"""Live re-measurement for the book's GPU chapters (their `RERUN` parameter cell): the same instruments as
the recorded results, into a temporary folder, returned as records for the chapter to show beside the
committed ones. `smoke=True` runs tiny sizes (on a CPU through Triton's interpreter), which is how the tests
keep this path from rotting; on a GPU machine `smoke=False` re-measures at the recorded sizes."""

from __future__ import annotations

import argparse
import importlib
import json
import tempfile
from pathlib import Path


def invoke(module: str, argv: list[str]) -> int:
    """Run an instrument module as its `lowprec` subcommand would (its configure/run), in this process."""
    mod = importlib.import_module(module)
    parser = argparse.ArgumentParser(prog=module)
    mod.configure(parser)
    return int(mod.run(parser.parse_args(argv)) or 0)


def chapter2(smoke: bool) -> dict:
    """The bias of the real kernels on the adversarial rows (`lowprec measure suite --sections bias`) and the
    attention benchmark (`lowprec bench attention`). Returns {"bias": suite record, "bench": bench record}."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        sizes = ["--smoke", "--rows", "64"] if smoke else []
        invoke("lowprec.instruments.gpu_suite", ["--out", str(out), "--sections", "bias", *sizes])
        bench = ["--smoke"] if smoke else ["--budget", "120"]
        invoke("lowprec.instruments.bench_attention", ["--out", str(out / "bench.json"), *bench])
        return {"bias": json.loads((out / "gpu_suite.json").read_text()),
                "bench": json.loads((out / "bench.json").read_text())}


def chapter3(smoke: bool) -> dict:
    """A short run of the lead's recipe in the authors' placement and in fa2 (`lowprec train`), with
    telemetry: {arm: {"steps", "loss", "layer1_logit"}}. On a GPU, 600 steps each (a few minutes)."""
    from lowprec.configs import get_config
    from lowprec.runs import load_run
    from lowprec.train import train

    if smoke:
        common = ["max_iters=20", "telemetry_interval=10", "eval_interval=0", "ckpt_interval=-1",
                  "progress=false"]
        base = "smoke-cpu"
        specs = {"paper64": "emulated/precision=paper:tile=64", "fa2": "emulated/precision=fa2"}
    else:
        common = ["lr=2e-3", "warmup_iters=200", "lr_decay_iters=30000", "max_iters=600",
                  "telemetry_interval=50", "eval_interval=0", "ckpt_interval=-1", "progress=false"]
        base = "gpu-6l"
        specs = {"paper64": "triton/precision=paper:tile=64", "fa2": "triton/precision=fa2"}
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arm, spec in specs.items():
            train(get_config(base, [*common, f"attention={spec}"]), Path(tmp) / arm)
            run = load_run(Path(tmp) / arm)
            steps, logits = run.telemetry("max_logit")
            layer = min(1, len(logits[0]) - 1)
            result[arm] = {"steps": run.series("loss")[0], "loss": run.series("loss")[1],
                           "telemetry_steps": steps, "layer1_logit": [max(s[layer]) for s in logits]}
    return result

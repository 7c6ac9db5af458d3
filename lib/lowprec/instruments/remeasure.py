"""Live re-measurement for the book's GPU chapters (their `REMEASURE` parameter cell): `chapterN(smoke)` runs
the instruments behind chapter N's records into a temporary folder and returns the records, for the chapter to
show beside the committed ones. `smoke=True` runs tiny sizes (on a CPU through Triton's interpreter; the
tests do); on a GPU machine `smoke=False` re-measures at the recorded sizes."""

from __future__ import annotations

import argparse
import importlib
import json
import tempfile
from pathlib import Path

from lowprec.runs import REPO

RECORDS = REPO / "results" / "book"  # gpu-chapters-<commit>/<page>.json


def last_rerun(page: str, records: Path = RECORDS) -> dict:
    """The newest record of `page` (a book page's file name) run on a GPU with `REMEASURE = True` that passed
    (tests/test_book.py's GPU test writes them to gpu-chapters-<commit>/<page stem>.json): {"seconds",
    "device", "commit", "torch", "note": one sentence for the page}. FileNotFoundError when there is none."""
    found = []
    for path in sorted(records.glob(f"gpu-chapters-*/{Path(page).stem}.json")):
        record = json.loads(path.read_text())
        if record["remeasure"] and record["passed"]:
            found.append(record)
    if not found:
        raise FileNotFoundError(f"no passing GPU re-run of {page} under {records}/gpu-chapters-*")
    record = max(found, key=lambda r: r["provenance"]["time"])
    info = record["provenance"]
    rerun = {"seconds": record["seconds"], "device": info["device"], "commit": info["git_commit"][:7],
             "torch": info["torch"].split("+")[0]}
    minutes = rerun["seconds"] / 60
    return {**rerun, "note": f"With `REMEASURE = True` this page ran in {minutes:.1f} minutes on one "
                             f"{rerun['device']} (torch {rerun['torch']}, commit {rerun['commit']})."}


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
                  "progress=false"]  # a GPU's 600 steps show the trainer's progress bar
        base = "smoke-cpu"
        specs = {"paper64": "emulated/precision=paper:tile=64", "fa2": "emulated/precision=fa2"}
    else:
        common = ["lr=2e-3", "warmup_iters=200", "lr_decay_iters=30000", "max_iters=600",
                  "telemetry_interval=50", "eval_interval=0", "ckpt_interval=-1", "progress=true"]
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


def chapter4(smoke: bool) -> dict:
    """A short run of the lead's recipe in the authors' placement (seed 1337, `lowprec train`) with telemetry
    and a checkpoint at its end, then `lowprec experiment bias-noise` on that checkpoint with the key sources:
    what chapter 4 reads from the lead's records, for layer index 1. Returns {"steps": the similarity window's
    first and last step, "similarity": {signal: mean over heads and the second half of the samples},
    "wq_norm": largest ‖W_Q,h‖₂ at the last sample, "ckpt_step", "sources": the layer's heads (bias_noise's
    sources)}. On a GPU, 600 steps and 4 batches of 8 sequences (a few minutes on one H200)."""
    from lowprec.configs import get_config
    from lowprec.instruments import lowrank
    from lowprec.runs import load_run
    from lowprec.train import train

    if smoke:
        recipe = ["max_iters=20", "telemetry_interval=5", "attention=emulated/precision=paper:tile=64"]
        base, measure = "smoke-cpu", ["--batches", "2", "--keys-batches", "2", "--batch-size", "2"]
    else:
        recipe = ["lr=2e-3", "warmup_iters=200", "lr_decay_iters=30000", "max_iters=600",
                  "telemetry_interval=50", "attention=triton/precision=paper:tile=64"]
        base, measure = "gpu-6l", ["--batches", "4", "--keys-batches", "2", "--batch-size", "8"]
    common = ["seed=1337", "eval_interval=0", "ckpt_interval=0", f"progress={str(not smoke).lower()}"]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "paper64"
        train(get_config(base, [*recipe, *common]), out)
        run = load_run(out)
        invoke("lowprec.instruments.bias_noise",
               [str(out), "--ckpt", str(out / "checkpoint" / "ckpt.pt"), *measure, "--out", f"{tmp}/bn.json"])
        found = json.loads(Path(f"{tmp}/bn.json").read_text())["checkpoints"][-1]
    sim = lowrank.run_similarity(run)
    layer = min(1, sim.mean.shape[0] - 1)
    wq = lowrank.telemetry_array(run, "wq_norm")[1]
    return {"steps": sim.steps, "wq_norm": float(wq[-1, layer].max()), "ckpt_step": found["step"],
            "similarity": dict(zip(lowrank.SIMILARITIES, sim.mean[layer].tolist(), strict=True)),
            "sources": found["sources"][layer]}


def chapter5(smoke: bool) -> dict:
    """The cures through our Triton kernel on the bias harness's families and their cost against plain fa2,
    as `lowprec measure cures` measures them (`cures.cure_table` with kernel=True, `cures.cost_table`),
    shorter: on a GPU every cure on every family at 16,384 rows and one timing round at N = 4,096, d = 128
    (about two minutes on one H200); smoke: three cures on one family at 64 rows and one head of 64 keys for
    the cost. The device is CUDA where there is one. Returns {"device", "rows", "bias": BiasResult dicts,
    "bias_errors", "cost": cost_table's rows}."""
    import torch
    from lowprec.instruments.cures import CURES, FAMILIES, cost_table, cure_table

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cures = [c for c in CURES if c.name in ("none (fa2)", "Fix", "consistent")] if smoke else list(CURES)
    families, rows = (FAMILIES[:1], 64) if smoke else (FAMILIES, 16384)
    errors: dict = {}
    bias = cure_table(cures, families, rows, kernel=True, device=device, errors=errors)
    sizes = ({"seq": 64, "head_dim": 16, "tokens": 64, "hidden": 16} if smoke
             else {"seq": 4096, "head_dim": 128})
    return {"device": device, "rows": rows, "bias": [r.to_dict() for r in bias], "bias_errors": errors,
            "cost": cost_table(cures, device=device, rounds=1, **sizes)}

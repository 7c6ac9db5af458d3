"""Profile one forward+backward call of each attention implementation under Nsight Compute.

Each implementation is warmed up (the autotuner settles) outside the profiled range; then one fwd+bwd call
runs between cudaProfilerStart and Stop inside an NVTX range named after it, so that

    ncu --profile-from-start off --nvtx --clock-control none --csv --page details \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        python3 scripts/profile_attention.py --seq 8192 --head-dim 128 > ncu.csv

gives one row per (kernel, metric) labelled with its implementation. Sizes as `lowprec bench attention`:
batch x seq = 16,384 tokens, heads x head dim = 2,048. `--summarize` turns such CSVs into a small JSON record
(per implementation, its attention kernels' duration, throughput, occupancy and resources), with the
provenance of a record from the same machine and commit:

    python3 scripts/profile_attention.py --summarize ncu.csv ncu-causal.csv --provenance LAUNCH.json --out OUT
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
from pathlib import Path

import torch
from lowprec.instruments.bench_attention import HIDDEN, calls_of, implementations

METRICS = {  # Nsight Compute's metric name -> the record's key
    "Duration": "duration_us",
    "Compute (SM) Throughput": "sm_throughput_pct",
    "Memory Throughput": "memory_throughput_pct",
    "Registers Per Thread": "registers",
    "Dynamic Shared Memory Per Block": "shared_bytes",
    "Block Limit Registers": "blocks_per_sm_by_registers",
    "Block Limit Shared Mem": "blocks_per_sm_by_shared",
    "Theoretical Occupancy": "theoretical_occupancy_pct",
    "Achieved Occupancy": "achieved_occupancy_pct",
    "Warp Cycles Per Issued Instruction": "cycles_per_issue",
}


def summarize(paths: list[Path]) -> list[dict]:
    """Per CSV (one profiled configuration) and kernel of at least 0.1 ms: the implementation whose NVTX range
    launched it (kernels after the range's first take its name), the kernel, grid, block and METRICS."""
    rows = []
    for path in paths:
        text = path.read_text()
        table = list(csv.DictReader(io.StringIO(text[text.index('"ID"'):])))
        nvtx = next(k for k in table[0] if k.startswith("thread Domain"))
        kernels: dict[str, dict] = {}
        impl = "?"
        for r in table:
            if r["ID"] not in kernels:
                if "<default domain>:" in r[nvtx]:
                    impl = r[nvtx].split("<default domain>:")[1].split(":")[0]
                name = re.split(r"[<(]", r["Kernel Name"])[0].removeprefix("void ")
                kernels[r["ID"]] = {"config": path.stem, "impl": impl, "kernel": name, "grid": r["Grid Size"],
                                    "block": r["Block Size"]}
            if r["Metric Name"] in METRICS:
                value = float(r["Metric Value"].replace(",", ""))
                value = value / 1e3 if r["Metric Unit"] == "ns" else value
                kernels[r["ID"]][METRICS[r["Metric Name"]]] = value
        rows += [k for k in kernels.values() if k.get("duration_us", 0) >= 100]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--summarize", nargs="+", type=Path, help="Nsight Compute CSVs to summarize")
    parser.add_argument("--provenance", type=Path, help="with --summarize: a record whose provenance to keep")
    parser.add_argument("--out", type=Path, help="with --summarize: the JSON record")
    args = parser.parse_args()
    if args.summarize:
        if not (args.provenance and args.out):
            parser.error("--summarize needs --provenance and --out")
        record = {"provenance": json.loads(args.provenance.read_text())["provenance"],
                  "command": "ncu --profile-from-start off --nvtx --clock-control none --csv --page details "
                             "--section SpeedOfLight --section Occupancy --section LaunchStats --section "
                             "WarpStateStats python3 scripts/profile_attention.py --seq 8192 --head-dim 128 "
                             "[--causal]",
                  "kernels": summarize(args.summarize)}
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        return
    impls, skipped = implementations("cuda")
    batch, heads = max(1, 16384 // args.seq), HIDDEN // args.head_dim
    for name, fn in impls.items():
        calls, _ = calls_of(fn, batch, heads, args.seq, args.head_dim, args.causal, "cuda")
        for _ in range(3):
            calls["fwd+bwd"]()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        with torch.cuda.nvtx.range(name):
            calls["fwd+bwd"]()
            torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    print({"skipped": skipped})


if __name__ == "__main__":
    main()

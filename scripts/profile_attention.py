"""Profile one forward+backward call of each attention implementation under Nsight Compute.

Each implementation is warmed up (the autotuner settles) outside the profiled range; then one fwd+bwd call
runs between cudaProfilerStart and Stop inside an NVTX range named after it, so that

    ncu --profile-from-start off --nvtx --clock-control none --csv --page details \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        python3 scripts/profile_attention.py --seq 8192 --head-dim 128 > ncu.csv

gives one row per (kernel, metric) labelled with its implementation. Sizes as `lowprec bench attention`:
batch x seq = 16,384 tokens, heads x head dim = 2,048.
"""

from __future__ import annotations

import argparse

import torch
from lowprec.instruments.bench_attention import HIDDEN, calls_of, implementations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()
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

#!/usr/bin/env bash
# Regenerates results/attention/{gpu_suite,bench}.json and results/train/throughput-*.json on a machine with
# two H200s (one GPU each for the attention and the training benchmarks, so neither times the other's work).
# Usage (repo root, prepared data in data/gpt2-permissive):
#   LOWPREC_GIT_COMMIT=$(git rev-parse HEAD) OUT=/tmp/out bash scripts/h200-bench.sh
# With one GPU, run the two halves one after the other: GPUS="0 0".
set -u
export PYTHONPATH=$PWD/lib PYTHONUNBUFFERED=1 LOWPREC_DATA=$PWD/data
read -r GPU_ATTN GPU_TRAIN <<<"${GPUS:-0 1}"
mkdir -p "$OUT/attention" "$OUT/train" /tmp/logs  # logs stay here: at most 8 files come back

attention() {
  export CUDA_VISIBLE_DEVICES=$GPU_ATTN
  timeout 100 python3 -m pytest tests/test_flash_kernel.py -q -p no:cacheprovider > /tmp/logs/pytest.log 2>&1
  timeout 270 python3 -m lowprec.attention.gpu_suite --out "$OUT/attention" > /tmp/logs/gpu_suite.log 2>&1
  timeout 200 python3 -m lowprec.cli bench attention --out "$OUT/attention/bench.json" --budget 180 \
    > /tmp/logs/bench.log 2>&1
}

train() {
  export CUDA_VISIBLE_DEVICES=$GPU_TRAIN
  local b="python3 -m lowprec.cli bench train"
  timeout 330 $b --config gpu-6l --steps 60 --warmup 10 --telemetry-interval 50 \
    --backends sdpa math triton/precision=fa2 triton/precision=fa2/fix=2 \
    --out "$OUT/train/throughput-gpu-6l.json" > /tmp/logs/train-gpu-6l.log 2>&1
  timeout 200 $b --config paper-gpt2-small --steps 12 --warmup 4 --telemetry-interval 0 --set grad_accum=2 \
    --backends sdpa triton/precision=fa2 \
    --out "$OUT/train/throughput-paper-gpt2-small.json" > /tmp/logs/train-paper.log 2>&1
}

attention & train & wait
tail -n 3 /tmp/logs/pytest.log; tail -n 25 /tmp/logs/gpu_suite.log; tail -n 30 /tmp/logs/bench.log
tail -n 8 /tmp/logs/train-*.log
cat /tmp/logs/*.log > "$OUT/logs.txt"

#!/usr/bin/env bash
# Regenerates results/attention/{gpu_suite,bias,bench}.json and results/train/throughput-*.json on a machine
# with two H200s: GPU 0 runs the attention suite and benchmark, GPU 1 the training benchmarks, so neither
# times the other's work. Usage (repo root, prepared data in data/gpt2-permissive):
#   LOWPREC_GIT_COMMIT=$(git rev-parse HEAD) OUT=/tmp/out bash scripts/h200-bench.sh
# With one GPU, run the two halves one after the other: GPUS="0 0" (then they overlap: timings suffer).
set -u
export PYTHONPATH=$PWD/lib PYTHONUNBUFFERED=1 LOWPREC_DATA=$PWD/data
read -r GPU_ATTN GPU_TRAIN <<<"${GPUS:-0 1}"
A=$OUT/attention L=/tmp/logs   # logs stay on the machine (at most 8 files come back), then one copy
mkdir -p "$A/bias" "$OUT/train" $L

attention() {
  export CUDA_VISIBLE_DEVICES=$GPU_ATTN
  # correctness checks share the GPU (none of them is timed); the benchmark runs alone afterwards
  timeout 250 python3 -m pytest tests/test_flash_kernel.py -q -rs -p no:cacheprovider > $L/pytest.log 2>&1 &
  timeout 250 python3 -m lowprec.attention.gpu_suite --out "$A" --sections correctness,fuzz > $L/suite.log 2>&1 &
  timeout 250 python3 -m lowprec.attention.gpu_suite --out "$A/bias" --sections bias > $L/bias.log 2>&1 &
  wait
  timeout 220 python3 -m lowprec.cli bench attention --out "$A/bench.json" --budget 170 \
    --seq 4096,8192,16384,2048,1024 --head-dim 128,64 > $L/bench.log 2>&1
}

train() {
  export CUDA_VISIBLE_DEVICES=$GPU_TRAIN
  local b="python3 -m lowprec.cli bench train"
  timeout 300 $b --config gpu-6l --steps 60 --warmup 10 --telemetry-interval 50 \
    --backends sdpa math triton/precision=fa2 triton/precision=fa2/fix=2 \
    --out "$OUT/train/throughput-gpu-6l.json" > $L/train-gpu-6l.log 2>&1
  timeout 200 $b --config paper-gpt2-small --steps 12 --warmup 4 --telemetry-interval 0 --set grad_accum=2 \
    --backends sdpa triton/precision=fa2 \
    --out "$OUT/train/throughput-paper-gpt2-small.json" > $L/train-paper.log 2>&1
}

attention & train & wait
for f in pytest suite bias; do echo "== $f"; tail -n 14 $L/$f.log; done
echo "== bench"; tail -n 45 $L/bench.log
for f in $L/train-*.log; do echo "== $f"; tail -n 8 "$f"; done
for f in $L/*.log; do echo "===== $f"; cat "$f"; done > "$OUT/logs.txt"

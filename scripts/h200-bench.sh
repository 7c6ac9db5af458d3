#!/usr/bin/env bash
# Regenerates the recorded GPU results on a machine with two H200s:
#   attention: results/attention/gpu_suite.json (correctness + fuzz), results/attention/bias/gpu_suite.json,
#              results/attention/bench.json                                     (GPU 0)
#   train:     results/train/throughput-{gpu-6l,paper-gpt2-small}.json          (GPU 1, at the same time)
#   ddp:       results/train/ddp-paper-gpt2-small/ (the paper's recipe, torchrun on both GPUs, afterwards)
# Usage (repo root, prepared data in data/gpt2-permissive; the GPU machine gets no git history, so pass the
# commit on):  LOWPREC_GIT_COMMIT=$(git rev-parse HEAD) OUT=/tmp/out bash scripts/h200-bench.sh
# PARTS picks a subset ("attention train ddp" by default; "suite" = correctness + fuzz only).
# With one GPU, GPUS="0 0" runs the halves on the same GPU (then they overlap: timings suffer).
set -u
export PYTHONPATH=$PWD/lib PYTHONUNBUFFERED=1 LOWPREC_DATA=$PWD/data
read -r GPU_ATTN GPU_TRAIN <<<"${GPUS:-0 1}"
PARTS=${PARTS:-attention train ddp}
A=$OUT/attention T=$OUT/train L=/tmp/logs   # logs stay on the machine (at most 8 files come back)
mkdir -p "$A/bias" "$T" $L
has() { [[ " $PARTS " == *" $1 "* ]]; }

suite() {  # correctness checks share the GPU (none of them is timed)
  timeout 250 python3 -m lowprec.cli measure suite --out "$A" --sections correctness,fuzz > $L/suite.log 2>&1
}

attention() {
  export CUDA_VISIBLE_DEVICES=$GPU_ATTN
  timeout 250 python3 -m pytest tests/test_flash_kernel.py -q -rs -p no:cacheprovider > $L/pytest.log 2>&1 &
  suite &
  timeout 250 python3 -m lowprec.cli measure suite --out "$A/bias" --sections bias > $L/bias.log 2>&1 &
  wait  # the benchmark runs alone afterwards
  timeout 220 python3 -m lowprec.cli bench attention --out "$A/bench.json" --budget 170 \
    --seq 4096,8192,16384,2048,1024 --head-dim 128,64 > $L/bench.log 2>&1
}

train() {
  export CUDA_VISIBLE_DEVICES=$GPU_TRAIN
  local b="python3 -m lowprec.cli bench train"
  timeout 300 $b --config gpu-6l --steps 60 --warmup 10 --telemetry-interval 50 \
    --backends sdpa math triton/precision=fa2 triton/precision=fa2/fix=2 \
    --out "$T/throughput-gpu-6l.json" > $L/train-gpu-6l.log 2>&1
  timeout 200 $b --config paper-gpt2-small --steps 12 --warmup 4 --telemetry-interval 0 --set grad_accum=2 \
    --backends sdpa triton/precision=fa2 triton/precision=fa2/fix=2 \
    --out "$T/throughput-paper-gpt2-small.json" > $L/train-paper.log 2>&1
}

ddp() {  # the paper's recipe (524,288 tokens/step) on two GPUs: cost per step
  export CUDA_VISIBLE_DEVICES=0,1
  timeout 200 torchrun --standalone --nproc_per_node=2 -m lowprec.cli train --config paper-gpt2-small \
    --out "$T/ddp-paper-gpt2-small" --set max_iters=30 --set log_interval=5 --set eval_interval=100000 \
    --set telemetry_interval=10 --set ckpt_interval=0 --set ckpt_dir=/tmp/ckpt --set progress=false \
    > $L/ddp.log 2>&1
}

if has attention; then attention & elif has suite; then (export CUDA_VISIBLE_DEVICES=$GPU_ATTN; suite) & fi
if has train; then train & fi
wait
if has ddp; then ddp; fi
for f in $L/*.log; do echo "== $f"; tail -n 14 "$f"; done
for f in $L/*.log; do echo "===== $f"; cat "$f"; done > "$OUT/logs.txt"

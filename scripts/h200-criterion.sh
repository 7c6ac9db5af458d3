#!/usr/bin/env bash
# The bias-to-noise criterion at a running experiment's checkpoints (RUNS/NAME/bias-noise/): for each step of
# STEP (one or several, space-separated) and each listed run, waits for the run's kept checkpoint at that step,
# then runs `lowprec experiment bias-noise` on it, one run at a time (three at once ran out of memory beside the
# trainings); a run written OTHER/run belongs to the experiment RUNS/OTHER started beside NAME (its records go
# to RUNS/OTHER/bias-noise/). Start it in its own process session, beside
# `scripts/h200-explode.sh PHASE=start`; that script's finish packs NAME's folder, bias-noise/ included.
# Usage (repo root):
#   NAME=lead-s2 RUNS_LIST="paper64-s2 fa2-s2" STEP=2000 ARGS="--batches 32 --batch-size 8 --keys-batches 2" \
#     setsid nohup bash scripts/h200-criterion.sh > /tmp/criterion.log 2>&1 < /dev/null &
#   (RUNS_LIST="bf16rowsum-s8 growing-head2-fp32/fp32pv-s8" measures a run of a second experiment too)
# Start it with the trainings: its first checkpoint on a fresh machine spends minutes compiling and autotuning
# (5.2 minutes beside four trainings), later ones take ~23 s on the idle GPU; two at once on a fresh machine
# finished nothing in 455 s.
set -u
export PYTHONPATH=${PYTHONPATH:-$PWD/lib} PYTHONUNBUFFERED=1 LOWPREC_DATA=$PWD/data
RUNS=${RUNS:-/tmp/explode}
mkdir -p "$RUNS"
echo $$ > "$RUNS/$NAME.criterion.pid"  # for `scripts/h200-explode.sh PHASE=wait`
for step in $STEP; do
  ckpt=$(printf 'ckpt-%06d.pt' "$step")
  for entry in $RUNS_LIST; do
    case $entry in */*) EXP=$RUNS/${entry%/*} run=${entry#*/} ;; *) EXP=$RUNS/$NAME run=$entry ;; esac
    mkdir -p "$EXP/bias-noise"
    while [ ! -e "$EXP/$run/checkpoint/$ckpt" ]; do sleep 10; done  # kept checkpoints are renamed in whole
    echo "$(date +%T) $run step $step"
    # shellcheck disable=SC2086
    python3 -m lowprec.cli experiment bias-noise "$EXP/$run" --ckpt "$EXP/$run/checkpoint/$ckpt" $ARGS \
      --out "$EXP/bias-noise/$run-step$step.json" > "$EXP/bias-noise/$run-step$step.log" 2>&1
    echo "$(date +%T) $run done (exit $?)"
  done
done

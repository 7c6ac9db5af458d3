#!/usr/bin/env bash
# The paper's recipe at the paper's scale: GPT-2 small (`paper-gpt2-small`, 524,288 tokens per step), one
# explode arm on every GPU of one machine (DDP through torchrun), in phases so that the run outlives one device
# call. The run folder is RUNS/NAME/<arm>-s<seed>/, the layout scripts/h200-explode.sh reads, so its
# PHASE=status and PHASE=pack work on it too (end every device call with PHASE=pack).
#   PHASE=data    unpacks the corpus shards carried in SHARDS (`lowprec data pack` here; re-run after each
#                 transfer: every shard is checked against the pack's index, applied ones are skipped)
#   PHASE=start   starts the training in its own process session and returns
#   PHASE=finish  waits for it; if it reached the stop rule, replays from the last kept checkpoint at least
#                 REPLAY_LEAD steps before that step, to REPLAY_AFTER steps after it, with the Fix off and on
#                 (all GPUs each, one after the other), then packs the records (no checkpoints) into
#                 $OUT/$NAME.tgz
# Usage (repo root; the GPU machine has no git history, so pass the commit):
#   SHARDS=shards PHASE=data bash scripts/h200-paper-scale.sh
#   LOWPREC_GIT_COMMIT=$(git rev-parse HEAD) NAME=paper-scale ARM=paper64 SEED=1337 STEPS=7000 \
#     PHASE=start bash scripts/h200-paper-scale.sh
#   ... PHASE=finish OUT=/tmp/out bash scripts/h200-paper-scale.sh
# A dry run of the whole chain on CPU (two gloo processes): CONFIG=smoke-cpu NPROC=2 DATA=sample:bytes
#   EXTRA="--set device=cpu --set grad_accum=2 --set ckpt_interval=10 --set diverge_factor=1.01" STEPS=60 \
#   REPLAY_LEAD=10 REPLAY_AFTER=10 (the finish phase with EXTRA="--set device=cpu")
set -u
export PYTHONPATH=${PYTHONPATH:-$PWD/lib} PYTHONUNBUFFERED=1 LOWPREC_DATA=${LOWPREC_DATA:-$PWD/data}
RUNS=${RUNS:-/tmp/explode} NAME=${NAME:-paper-scale} ARM=${ARM:-paper64} SEED=${SEED:-1337}
CONFIG=${CONFIG:-paper-gpt2-small} STEPS=${STEPS:-7000} DATA=${DATA:-$LOWPREC_DATA/gpt2-english+code}
REPLAY_LEAD=${REPLAY_LEAD:-300} REPLAY_AFTER=${REPLAY_AFTER:-300} EXTRA=${EXTRA:-}
NPROC=${NPROC:-$(nvidia-smi -L 2>/dev/null | wc -l)}
[ "$NPROC" -gt 0 ] || NPROC=1
RUN=$RUNS/$NAME/$ARM-s$SEED
LOWPREC="torchrun --standalone --nproc_per_node=$NPROC -m lowprec.cli"

case "$PHASE" in
data)
  python3 -m lowprec.cli data unpack "$SHARDS" --out "$DATA"
  ;;
start)
  spec=$(python3 -c "import sys; from lowprec.instruments.explode import arm_spec; print(arm_spec(sys.argv[1]))" \
    "$ARM") || exit
  mkdir -p "$RUNS/$NAME"
  # shellcheck disable=SC2086
  setsid nohup $LOWPREC train --config "$CONFIG" --out "$RUN" --set attention="$spec" --set seed="$SEED" \
    --set max_iters="$STEPS" --set data="$DATA" --set log_interval=10 --set telemetry_interval=100 \
    --set ckpt_interval=500 --set ckpt_keep=true --set progress=false $EXTRA > "$RUNS/$NAME.log" 2>&1 < /dev/null &
  echo "started $ARM-s$SEED on $NPROC process(es): $spec (log $RUNS/$NAME.log)"
  ;;
finish)
  while pgrep -f "[l]owprec.cli train --config $CONFIG --out $RUN" > /dev/null; do sleep 5; done
  tail -n 5 "$RUNS/$NAME.log"
  # the replay window: the last kept checkpoint at least REPLAY_LEAD steps before the stop rule fired
  window=$(python3 -c "import sys; from lowprec.replay import replay_window
w = replay_window(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])); print(*w) if w else None" \
    "$RUN" "$REPLAY_LEAD" "$REPLAY_AFTER")
  if [ -n "$window" ]; then
    read -r from to <<< "$window"
    for fix in off on; do
      # shellcheck disable=SC2086
      $LOWPREC replay "$RUN" --from "$from" --to "$to" --fix $fix --set progress=false $EXTRA \
        > "$RUN-replay-$fix.log" 2>&1
      echo "== replay from $from to $to, Fix $fix (exit $?)"; tail -n 4 "$RUN-replay-$fix.log"
    done
  else
    echo "no replay: the run did not reach the stop rule, wrote no summary, or kept no checkpoint" \
      "$REPLAY_LEAD steps before the stop"
  fi
  tar czf "$OUT/$NAME.tgz" --exclude=checkpoint --exclude=writer.lock -C "$RUNS" "$NAME" "$NAME.log"
  ls -la "$OUT"
  ;;
*)
  echo "PHASE must be data, start or finish (status and pack: scripts/h200-explode.sh)" >&2
  exit 2
  ;;
esac

#!/usr/bin/env bash
# The explosion hunt's GPU runs (results/explode/<NAME>/), in two phases so a run may outlive one device call:
#   PHASE=start   launches `lowprec experiment explode` in its own process session (setsid nohup) and returns
#   PHASE=status  one line per run: last logged step and loss, largest logit per layer at the last telemetry
#   PHASE=wait    waits until every process of NAME (the harness, and a criterion started with
#                 scripts/h200-criterion.sh) has ended or WAIT_S seconds (default 540) have passed, by the pid files
#                 they write (never wait by `pgrep -f PATTERN`: it matches the waiting command's own line)
#   PHASE=pack    packs the records as they stand (no checkpoints) into $OUT/$NAME-partial.tgz without waiting:
#                 end every device call with it, so that a machine given back before the next call (idle
#                 release, a lost turn) loses only the steps since
#   PHASE=watch   starts a watcher in its own process session that replays each run of WATCH (run names of
#                 NAME, e.g. "paper64-s1337") with the Fix off and on as soon as it reaches the stop rule, while
#                 the experiment's other runs go on (the same window as finish; then finish needs REPLAYS=0)
#   PHASE=replay  (used by watch and finish) REPLAY="RUN FROM TO": replays RUN of NAME from FROM to TO with the
#                 Fix off and on, on GPUs GPU and GPU+1 (mod the GPU count), and waits for both
#   PHASE=finish  waits for it, then (unless REPLAYS=0), for every run that diverged and kept checkpoints,
#                 replays from the last kept checkpoint at least REPLAY_LEAD steps before the explosion with the
#                 Fix on and off (`lowprec replay`, one GPU each), and packs the records (no checkpoints) into
#                 $OUT/$NAME.tgz
# NAME may list several experiments started side by side (NAME="a b"); status and finish take them all.
# Usage (repo root, data/gpt2-permissive prepared; the GPU machine has no git history, so pass the commit):
#   LOWPREC_GIT_COMMIT=$(git rev-parse HEAD) NAME=kbit3 ARGS="--arms kbit3,kbit3-fix --seeds 1,2,3 ..." \
#     PHASE=start bash scripts/h200-explode.sh
#   ... PHASE=finish OUT=/tmp/out bash scripts/h200-explode.sh
set -u
export PYTHONPATH=${PYTHONPATH:-$PWD/lib} PYTHONUNBUFFERED=1 LOWPREC_DATA=$PWD/data
export RUNS=${RUNS:-/tmp/explode}; REPLAY_LEAD=${REPLAY_LEAD:-200} REPLAY_AFTER=${REPLAY_AFTER:-300} REPLAYS=${REPLAYS:-1}
if [ "$PHASE" = status ]; then
  for NAME1 in $NAME; do
    python3 - "$RUNS/$NAME1" <<'PY'
import json, sys
from pathlib import Path
for run in sorted(p for p in Path(sys.argv[1]).iterdir() if (p / "metrics.jsonl").exists()):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if not rows:  # started, nothing logged yet
        print(f"{run.name:<18} no step logged yet")
        continue
    tele = [r for r in rows if r.get("telemetry")]
    logits = [max(layer) for layer in tele[-1]["telemetry"]["max_logit"]] if tele else []
    print(f"{run.name:<18} step {rows[-1]['step']:>6} loss {rows[-1]['loss']:7.3f}  max logit per layer "
          + " ".join(f"{x:.3g}" for x in logits))
PY
  done
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
  exit 0
fi
if [ "$PHASE" = wait ]; then
  end=$((SECONDS + ${WAIT_S:-540}))
  alive() { for f in "$@"; do [ -e "$f" ] && kill -0 "$(cat "$f")" 2> /dev/null && return 0; done; return 1; }
  pids=(); for NAME1 in $NAME; do pids+=("$RUNS/$NAME1.pid" "$RUNS/$NAME1.criterion.pid" "$RUNS/$NAME1.watch.pid"); done
  while [ $SECONDS -lt $end ] && alive "${pids[@]}"; do sleep 5; done
  alive "${pids[@]}" && echo "still running after ${WAIT_S:-540} s" || echo "all ended"
  exit 0
fi
if [ "$(echo "$NAME" | wc -w)" -gt 1 ]; then  # several experiments: each phase for each
  for NAME1 in $NAME; do NAME=$NAME1 bash "$0" || exit; done
  exit 0
fi
EXP=$RUNS/$NAME
if [ "$PHASE" = pack ]; then
  tar czf "$OUT/$NAME-partial.tgz" --exclude=checkpoint --exclude=writer.lock -C "$RUNS" "$NAME" "$NAME.log"
  exit 0
fi
if [ "$PHASE" = start ]; then
  mkdir -p "$EXP"
  # shellcheck disable=SC2086
  setsid nohup python3 -m lowprec.cli experiment explode --out "$EXP" $ARGS > "$EXP.log" 2>&1 < /dev/null &
  echo $! > "$EXP.pid"
  echo "started $NAME (pid $!)"
  exit 0
fi
if [ "$PHASE" = replay ]; then
  read -r name from to <<< "$REPLAY"
  ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
  [ "$ngpu" -gt 0 ] || ngpu=1
  gpu=${GPU:-0}
  for fix in off on; do
    CUDA_VISIBLE_DEVICES=$((gpu % ngpu)) python3 -m lowprec.cli replay "$EXP/$name" --from "$from" --to "$to" \
      --fix $fix --set progress=false > "$EXP/$name-replay-$fix.log" 2>&1 &
    gpu=$((gpu + 1))
  done
  wait
  exit 0
fi
if [ "$PHASE" = watch ]; then
  # shellcheck disable=SC2016
  SCRIPT=$(realpath "$0") setsid nohup bash -c '
    EXP=$1 REPLAY_LEAD=$2 REPLAY_AFTER=$3; shift 3; left=("$@")
    while [ ${#left[@]} -gt 0 ]; do
      running=0; kill -0 "$(cat "$EXP.pid")" 2> /dev/null && running=1  # one more look after the harness ends
      waiting=()
      for name in "${left[@]}"; do
        [ -e "$EXP/$name/summary.json" ] || { waiting+=("$name"); continue; }  # written when the run ends
        window=$(python3 -c "import sys; from lowprec.replay import replay_window as w; \
print(*(w(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])) or ()))" "$EXP/$name" "$REPLAY_LEAD" "$REPLAY_AFTER")
        if [ -z "$window" ]; then waiting+=("$name"); continue; fi
        echo "$(date +%T) $name stopped: replays from ${window% *} to ${window#* }"
        REPLAY="$name $window" PHASE=replay bash "$SCRIPT" &
      done
      left=("${waiting[@]}")
      [ $running = 1 ] || break
      sleep 20
    done
    wait' watch "$EXP" "$REPLAY_LEAD" "$REPLAY_AFTER" $WATCH > "$EXP/watch.log" 2>&1 < /dev/null &
  echo $! > "$EXP.watch.pid"
  echo "watching $WATCH of $NAME (pid $!)"
  exit 0
fi
# finish: wait for the harness (it writes experiment.json last)
while kill -0 "$(cat "$EXP.pid")" 2> /dev/null; do sleep 5; done
tail -n 20 "$EXP.log"
[ "$REPLAYS" = 1 ] || : > "$RUNS/replays.txt"
[ "$REPLAYS" = 1 ] && python3 - "$EXP" "$REPLAY_LEAD" "$REPLAY_AFTER" > "$RUNS/replays.txt" <<'PY'
import json, sys
from pathlib import Path
from lowprec.replay import replay_window
exp, lead, after = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
for name, run in json.loads((exp / "experiment.json").read_text())["runs"].items():
    if "-fix" not in run["arm"] and (window := replay_window(exp / name, lead, after)):
        print(name, *window)
PY
cat "$RUNS/replays.txt"
gpu=0
while read -r replay; do
  REPLAY=$replay GPU=$gpu PHASE=replay bash "$0" &
  gpu=$((gpu + 2))
done < "$RUNS/replays.txt"
wait
for f in "$EXP"/*-replay-*.log; do [ -e "$f" ] && { echo "== $f"; tail -n 12 "$f"; }; done
tar czf "$OUT/$NAME.tgz" --exclude=checkpoint --exclude=writer.lock -C "$RUNS" "$NAME" "$NAME.log"
ls -la "$OUT"

#!/usr/bin/env bash
# The attribution study on a GPU machine (results/explode/survival/queue.json), in phases so that its work
# outlives one device call:
#   PHASE=unpack SHARDS=.carry/eN  applies one carried shard folder of the corpus to data/gpt2-english+code
#                                  (`lowprec data pack --shard-mib 16`, one shard and pack.json per folder: a
#                                  call's tree may hold 64 MiB and the tracked files take about 40, growing)
#                                  (DATA=data/gpt2-permissive: the lead's corpus, which chapters 3 and 4 re-run on)
#   PHASE=probe [ARM=model-fp32]   in its own process session, while later shards travel (the GPU idles):
#                                  (PROBE_TESTS set) pytest -k PROBE_TESTS of tests/test_flash_kernel.py, then
#                                  scripts/time_arm.py times 300 steps of ARM (none: skipped) of the first queue
#                                  (the committed sample in place of the corpus: same model and batch), then
#                                  (PROBE_PAIR="A B") PROBE_PAIR_STEPS=400 steps of B alone (time-alone.json),
#                                  then of A and B at once (time-pair-A.json, time-pair-B.json), then
#                                  `lowprec bench overhead PROBE_BENCH` (default --profile; none: skipped)
#                                  into overhead.json, then PROBE_EXTRA (a command line, run with WORK set,
#                                  e.g. a `lowprec bench attention` with --out '$WORK/bench-tma.json':
#                                  bench-*.json, cures.json and profile-*.txt are packed too)
#   PHASE=go MINUTES=M [REPRO=1]   in its own process session: (REPRO=1) `lowprec measure reproducibility`
#                                  (1,000 steps of the recipe, groups of 1, 1, 2 and 4 runs, --probe), then
#                                  `lowprec experiment study` for what is left of M minutes, queue by queue
#                                  (QUEUE may name several, the first for at most FIRST minutes), SLOTS runs at
#                                  a time (default 1; four at once gave 1.12x the tokens/s of one alone on an
#                                  H200; auto: one per GPU where the machine has several (GPUS: their number,
#                                  else counted), else 2 where the probe's pair made PAIR_GAIN=1.4 x one
#                                  alone; the study spreads its runs over the GPUs); after
#                                  a probe (waited for, at most PROBE_WAIT_S=120 s) ARM's estimate is its
#                                  projected time + 60 s; END_AT=<epoch seconds> in place of MINUTES: the
#                                  go ends then (the device budget's end, less the time the last pack needs),
#                                  each queue's study getting the seconds left less 30; a queue whose study
#                                  fails (a run ended without an outcome) ends the go
#   PHASE=wait [WAIT_S=540]        waits for go to end or WAIT_S seconds (or until 580 s after CALL_START, the
#                                  call's start in seconds since the epoch, if set), then packs (below)
#   PHASE=pack                     $OUT/<queue folder>.tgz (the study's records, no checkpoints), $OUT/repro.tgz,
#                                  $OUT/probe.tgz
#   PHASE=take PACK=<queue>.tgz    here, not on the GPU machine: copies a pack's done runs (an outcome at the
#                                  queue's horizon, `study.run_state`) and study logs into INTO/<queue folder>
#                                  (default results/explode, which holds queue.json), metrics gzipped; a run
#                                  whose library is not what its named commit holds (`runs.code_matches`),
#                                  or that INTO already holds with an outcome, is left out
# QUEUE (default results/explode/survival/queue.json; several separated by spaces) names the queues' files by
# path (a name that is not a file is refused); a queue's records go to $WORK/<queue folder>. A probe and a go run
# from their own copy of the tree ($WORK/tree-probe, $WORK/tree-go), so a later call's tree may land meanwhile;
# a go is refused while another runs.
# Usage (repo root; the machine has no git history, so pass the commit):
#   LOWPREC_GIT_COMMIT=$(git rev-parse HEAD) MINUTES=22 REPRO=1 PHASE=go bash scripts/h200-study.sh
set -u
export PYTHONPATH=${PYTHONPATH:-$PWD/lib} PYTHONUNBUFFERED=1
WORK=${WORK:-/tmp/study}; DATA=${DATA:-data/gpt2-english+code}
QUEUE=${QUEUE:-results/explode/survival/queue.json}
if [ "$PHASE" != unpack ] && [ "$PHASE" != take ]; then
  for queue in $QUEUE; do  # a queue's folder name alone would start a go that runs nothing
    [ -f "$queue" ] || { echo "QUEUE: $queue is not a queue file (name each by its path, e.g." \
                              "results/explode/survival/queue.json)" >&2; exit 2; }
  done
fi
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)  # absolute: a probe and a go run from their own tree (below)

snapshot() {
  # The tree a probe or a go runs from, $WORK/tree-$PHASE: lib, scripts, tests and each queue's folder as they
  # are now, data linked. Each device call copies the working tree to the machine again, lib/ and results/
  # replaced while it lands: a study reading them then found neither library nor records, and ran again
  # what was done. QUEUE becomes the copies' paths (relative to the tree).
  local tree="$WORK/tree-$PHASE" queue rel queues=""
  rm -rf "$tree" && mkdir -p "$tree" && cp -a lib scripts tests pyproject.toml "$tree"/ || exit 1
  for queue in $QUEUE; do
    rel=${queue#/}
    mkdir -p "$tree/$(dirname "$rel")" && cp -a "$(dirname "$queue")/." "$tree/$(dirname "$rel")/" || exit 1
    queues="$queues $rel"
  done
  ln -s "$PWD/data" "$tree/data"
  cd "$tree" || exit 1
  export PYTHONPATH="$tree/lib:$PYTHONPATH"
  QUEUE=${queues# }
}

case "$PHASE" in
unpack)
  python3 -m lowprec.cli data unpack "$SHARDS" --out "$DATA" ;;
probe)
  snapshot
  # shellcheck disable=SC2016
  setsid nohup bash -c '
    [ -n "${PROBE_TESTS:-}" ] && python3 -m pytest -q -p no:cacheprovider --noconftest tests/test_flash_kernel.py \
      -k "$PROBE_TESTS" > "$3/probe-tests.log" 2>&1
    [ "$2" != none ] && python3 scripts/time_arm.py --queue "${1%% *}" --arm "$2" --steps 300 --work "$3" \
      --set data=sample:bytes --out "$3/time-$2.json"
    if [ -n "${PROBE_PAIR:-}" ]; then  # two arms: the second alone, then both at once (for SLOTS=auto)
      read -r a b <<< "$PROBE_PAIR"
      pair() { python3 scripts/time_arm.py --queue "${1%% *}" --arm "$2" --steps "${PROBE_PAIR_STEPS:-400}" \
                 --work "$3" --set data=sample:bytes --out "$4"; }
      pair "$1" "$b" "$3/alone" "$3/time-alone.json"
      pair "$1" "$a" "$3/pair" "$3/time-pair-$a.json" & pair "$1" "$b" "$3/pair" "$3/time-pair-$b.json"; wait
    fi
    # shellcheck disable=SC2086
    [ "${PROBE_BENCH:-}" != none ] && python3 -m lowprec.cli bench overhead ${PROBE_BENCH:---profile} \
      --out "$3/overhead.json"
    [ -n "${PROBE_EXTRA:-}" ] && WORK="$3" bash -c "$PROBE_EXTRA"
  ' probe "$QUEUE" "${ARM:-model-fp32}" "$WORK" > "$WORK/probe.log" 2>&1 < /dev/null &
  echo $! > "$WORK/probe.pid"
  echo "probe started (pid $!)" ;;
go)
  if [ -e "$WORK/go.pid" ] && kill -0 "$(cat "$WORK/go.pid")" 2> /dev/null; then  # its tree, its records
    echo "PHASE=go: a go is still running (pid $(cat "$WORK/go.pid"); its log $WORK/go.log): wait for it, or" \
      "stop it with kill -- -$(cat "$WORK/go.pid")" >&2
    exit 2
  fi
  estimate=()
  if [ -e "$WORK/probe.pid" ]; then
    for _ in $(seq "${PROBE_WAIT_S:-120}"); do
      kill -0 "$(cat "$WORK/probe.pid")" 2> /dev/null || break
      sleep 1
    done
    kill -- -"$(cat "$WORK/probe.pid")" 2> /dev/null && echo "probe stopped (it outran ${PROBE_WAIT_S:-120} s)"
    [ -e "$WORK/probe-tests.log" ] && echo "probe tests: $(tail -n 1 "$WORK/probe-tests.log")"
    arm=${ARM:-model-fp32}
    [ -e "$WORK/time-$arm.json" ] && estimate=(--estimate "$arm=$(python3 -c \
      'import json, sys; print(round(json.load(open(sys.argv[1]))["projected_s"] + 60))' "$WORK/time-$arm.json")")
    echo "probe: ${estimate[*]:-no estimate}"
  fi
  if [ "${SLOTS:-1}" = auto ]; then
    # one run per GPU where the machine has several (GPUS, else counted; no nvidia-smi: no GPU, and torch's
    # import is spared), else two at a time where the probe's pair made PAIR_GAIN x one alone's tokens/s
    gpus=${GPUS:-$(command -v nvidia-smi > /dev/null && python3 -c \
      'import torch; print(torch.cuda.device_count())' 2> /dev/null || echo 0)}
    if [ "$gpus" -gt 1 ]; then
      SLOTS=$gpus
      echo "gpus: $gpus, slots: $SLOTS"
    else
      SLOTS=$(python3 -c 'import glob, json, sys
pair = [json.load(open(p))["tokens_per_s"] for p in sorted(glob.glob(sys.argv[1] + "/time-pair-*.json"))]
alone = json.load(open(sys.argv[1] + "/time-alone.json"))["tokens_per_s"] if len(pair) == 2 else 0
gain = sum(pair) / alone if alone else 0
print(f"pair {gain:.2f} x one alone", file=sys.stderr)
print(2 if gain >= float(sys.argv[2]) else 1)' "$WORK" "${PAIR_GAIN:-1.4}" || echo 1)
      echo "slots: $SLOTS"
    fi
    export SLOTS
  fi
  snapshot
  if [ -n "${END_AT:-}" ]; then
    END=$END_AT
    echo "seconds to END_AT: $(( END_AT - $(date +%s) ))"
  else
    END=$(( $(date +%s) + MINUTES * 60 ))
  fi
  # shellcheck disable=SC2016
  setsid nohup bash -c '
    set -u; end=$1; work=$2
    if [ "${REPRO:-0}" = 1 ]; then
      python3 -m lowprec.cli measure reproducibility --steps 1000 --probe --runs-dir "$work/repro" \
        --out "$work/reproducibility.json" --set lr=2e-3 --set warmup_iters=200 --set lr_decay_iters=30000 \
        --set data=data/gpt2-english+code
    fi
    slots=${SLOTS:-1}; first=1
    for queue in $3; do
      left=$(( end - $(date +%s) - 30 ))  # seconds; 30 for a study to stop its runs and write its log
      [ "$left" -gt 0 ] || break
      minutes=$(awk -v s="$left" "BEGIN { printf \"%.2f\", s / 60 }")
      [ "$first" = 1 ] && [ -n "${FIRST:-}" ] && [ $(( FIRST * 60 )) -lt "$left" ] && minutes=$FIRST
      first=0
      extra=()  # the measured estimate goes to the queue that has its arm
      [ $# -gt 4 ] && grep -q "\"arm\": \"$4\"" "$queue" && extra=("${@:5}")
      name=$(basename "$(dirname "$queue")")
      echo "study $name: $minutes minutes, $slots at a time"
      python3 -m lowprec.cli experiment study --queue "$queue" --out "$work/$name" --minutes "$minutes" \
        --slots "$slots" "${extra[@]}" || break  # a run ended without an outcome: the next queue would too
    done
  ' go "$END" "$WORK" "$QUEUE" "${ARM:-model-fp32}" "${estimate[@]}" > "$WORK/go.log" 2>&1 < /dev/null &
  echo $! > "$WORK/go.pid"
  echo "started (pid $!)" ;;
wait|pack)
  if [ "$PHASE" = wait ]; then
    end=$((SECONDS + ${WAIT_S:-540}))
    # CALL_START=$(date +%s) at the head of a device call: the wait ends by 580 s into the call, in time to pack
    [ -n "${CALL_START:-}" ] && end=$(( end < SECONDS + CALL_START + 580 - $(date +%s) ? end
                                        : SECONDS + CALL_START + 580 - $(date +%s) ))
    while [ $SECONDS -lt $end ] && kill -0 "$(cat "$WORK/go.pid")" 2> /dev/null; do sleep 1; done
    tail -n 25 "$WORK/go.log"
  fi
  cd "$WORK" || exit 1
  for queue in $QUEUE; do
    name=$(basename "$(dirname "$queue")")
    [ -d "$name" ] && tar czf "$OUT/$name.tgz" --exclude=checkpoint --exclude=writer.lock "$name"
  done
  [ -e reproducibility.json ] && tar czf "$OUT/repro.tgz" --exclude=checkpoint --exclude=writer.lock \
    reproducibility.json repro go.log
  # shellcheck disable=SC2046
  [ -e probe.log ] && tar czf "$OUT/probe.tgz" --exclude=checkpoint --exclude=writer.lock probe.log \
    $(ls -d time-* overhead.json bench-*.json cures.json profile-*.txt probe-tests.log 2> /dev/null)
  ls -la "$OUT" ;;
take)
  into=${INTO:-results/explode}; tmp=$(mktemp -d)
  tar xzf "$PACK" -C "$tmp" || exit 1
  shopt -s nullglob; folders=("$tmp"/*/)
  if [ ${#folders[@]} = 0 ]; then  # probe.tgz, repro.tgz: measurements, not runs of a queue
    echo "PACK=$PACK: no queue folder in it (a probe or repro pack: open it with tar xzf)" >&2
    rm -rf "$tmp"; exit 2
  fi
  for queue in "${folders[@]}"; do
    name=$(basename "$queue")
    if [ ! -e "$into/$name/queue.json" ]; then
      echo "PACK=$PACK: $name has no queue here ($into/$name/queue.json; INTO names the folder)" >&2; continue
    fi
    # shellcheck disable=SC2016
    python3 -c '
import sys
from pathlib import Path
from lowprec.instruments import study
from lowprec.runs import code_matches, load_record
horizon = study.load_queue(sys.argv[2])["horizon"]
for run in sorted(p for p in Path(sys.argv[1]).iterdir() if p.is_dir()):
    state = study.run_state([run], horizon)[0]
    prov = load_record(run, ("provenance",))["provenance"] if state == "done" else {}
    here = study.run_state([Path(sys.argv[3]) / run.name], horizon)[0]
    print(run.name, state, here, code_matches(prov, Path.cwd()), prov.get("git_commit"))  # cwd: this repo
' "$queue" "$into/$name/queue.json" "$into/$name" | while read -r run_name state here same commit; do
      if [ "$state" != done ]; then
        echo "$name/$run_name: no outcome at the horizon (still running when packed, or stopped), left out"
        continue
      fi
      if [ "$here" = done ]; then
        echo "$name/$run_name: $into/$name already holds it with an outcome (a record is never replaced)," \
          "left out" >&2
        continue
      fi
      if [ "$same" = False ]; then
        echo "$name/$run_name: its library is not what its commit $commit holds (LOWPREC_GIT_COMMIT named" \
          "another commit than the tree sent), left out" >&2
        continue
      fi
      rm -rf "${into:?}/$name/$run_name"
      cp -r "$queue$run_name" "$into/$name/$run_name"
      [ -e "$queue$run_name.log" ] && cp "$queue$run_name.log" "$into/$name/"
      [ -e "$into/$name/$run_name/metrics.jsonl" ] && gzip -n9 -f "$into/$name/$run_name/metrics.jsonl"
      echo "$name/$run_name: done"
    done
    cp "$queue"study-*.json "$into/$name/" 2> /dev/null
  done
  rm -rf "$tmp" ;;
*)
  echo "PHASE must be unpack, probe, go, wait, pack or take" >&2; exit 2 ;;
esac

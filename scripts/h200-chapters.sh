#!/usr/bin/env bash
# Every chapter on a GPU machine as a practitioner runs it (tests/test_book.py::test_chapter_executes_on_gpu:
# nbclient, TRITON_INTERPRET unset, kernels compiled), its parameter cell set to REMEASURE = True where it has one
# (LOWPREC_REMEASURE=1, the default here), one chapter at a time so that each re-measurement has the GPU alone;
# each chapter's wall time and outcome go to $WORK/chapters/<chapter>.json. In phases, as the study's script:
#   PHASE=start [K=...]  installs the notebook stack's wheels (.whl, carried: scripts/notebook-wheels.sh makes
#                        them) under /tmp/site and starts pytest in its own process session (K: a pytest -k
#                        expression narrowing the chapters, e.g. "explosion or mechanism")
#   PHASE=wait           waits for it to end, or until 580 s after CALL_START (the call's start, seconds since the
#                        epoch), then packs $OUT/chapters.tgz (the records and the log)
# Chapters 3 and 4 re-run on the lead's corpus: pack it here (`lowprec data pack data/gpt2-permissive --out
# .carry/p0`, 11 MiB) and unpack it on the machine in an earlier call (it does not fit beside .whl):
#   DATA=data/gpt2-permissive PHASE=unpack SHARDS=.carry/p0 bash scripts/h200-study.sh
# Usage (repo root, carry [".whl"]): LOWPREC_GIT_COMMIT=$(git rev-parse HEAD) PHASE=start bash scripts/h200-chapters.sh
set -u
WORK=${WORK:-/tmp/chapters}
mkdir -p "$WORK/chapters"
case "$PHASE" in
start)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 1
  PYTHONPATH=/tmp/site:$PWD/lib PYTHONUNBUFFERED=1 LOWPREC_REMEASURE=${LOWPREC_REMEASURE:-1} \
    LOWPREC_CHAPTER_TIMES=$WORK/chapters setsid nohup python3 -m pytest -q -p no:cacheprovider -rA \
    tests/test_book.py -k "on_gpu and (${K:-md})" > "$WORK/chapters.log" 2>&1 < /dev/null &
  echo $! > "$WORK/pytest.pid"
  echo "started (pid $!)" ;;
wait)
  end=$(( ${CALL_START:-$(date +%s)} + ${WAIT_S:-580} ))
  while [ "$(date +%s)" -lt "$end" ] && kill -0 "$(cat "$WORK/pytest.pid")" 2> /dev/null; do sleep 1; done
  tail -n 15 "$WORK/chapters.log"
  (cd "$WORK" && tar czf "$OUT/chapters.tgz" chapters chapters.log)
  ls "$WORK/chapters" ;;
*)
  echo "PHASE must be start or wait" >&2; exit 2 ;;
esac

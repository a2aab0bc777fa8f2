#!/usr/bin/env bash
# One device session's plan, run in the background on the GPU machine after the devkit
# install, so that one engine start is never cut by the 10-minute limit of a device call:
#   setsid nohup bash scripts/gpu_session.sh > /tmp/out/session.log 2>&1 &
# Each step writes into /tmp/out (OUT for scripts/gpu_suite.sh) and a marker when done; a
# later call copies /tmp/out to its $OUT. Steps in priority order.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=/tmp/out
mkdir -p "$OUT"
step() {  # step NAME COMMAND...
  local name=$1; shift
  [ -e "$OUT/$name.done" ] && return
  echo "=== $name start $(date +%T)"
  "$@"
  echo "$?" > "$OUT/$name.done"
  echo "=== $name end $(date +%T) rc=$(cat "$OUT/$name.done")"
}
step tests bash scripts/gpu_suite.sh tests tests/gpu/test_engine_gpu.py -k "scv or window"
step scv bash scripts/gpu_suite.sh scv_bench --reps 1
step overhead_dm bash scripts/gpu_suite.sh nwor_overhead --method draft_model --k 4 --L 1.5 3.0
step window bash scripts/gpu_suite.sh draft_window_bench --batches 1 32 128 --reps 1
step overhead_ngram bash scripts/gpu_suite.sh nwor_overhead --method ngram --k 4 --L 1.5 3.0
echo "=== all done $(date +%T)"

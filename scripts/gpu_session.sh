#!/usr/bin/env bash
# One device session's plan, run in the background on the GPU machine after the devkit install,
# so that no benchmark is cut by the 10-minute limit of a device call:
#   setsid nohup bash scripts/gpu_session.sh > /tmp/out/session.log 2>&1 < /dev/null &
# The work is streams of steps (the next session's plan; earlier plans are in git
# history). With n GPUs, GPU g runs streams g, g + n, ... one after
# the other, all GPUs at once, each with its own compile caches. Every step writes
# /tmp/out/<step>.jsonl and .log and a <step>.done marker (a rerun skips finished steps); a
# later call copies /tmp/out back. Streams are in priority order for machines of fewer GPUs.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=/tmp/out
mkdir -p /tmp/pt  # the parent of each pytest --basetemp
mkdir -p "$OUT"
bash scripts/gpu_suite.sh install || exit 1
export NWOR_INSTALLED=1

step() {  # step NAME WHAT ARGS...: one scripts/gpu_suite.sh run, skipped once done
  local name=$1; shift
  [ -e "$OUT/$name.done" ] && return
  echo "=== $name start $(date +%T) gpu ${CUDA_VISIBLE_DEVICES:-all}"
  STEP=$name bash scripts/gpu_suite.sh "$@" > /dev/null 2>&1
  echo "$?" > "$OUT/$name.done"
  echo "=== $name end $(date +%T) rc=$(cat "$OUT/$name.done")"
}

# The last plan, run at d4e2e1a (eagle_mtp_gpu_hits_scv_2026-11-28_h200.json, `scv`; issue 54):
# tests/gpu/test_eagle_gpu.py's SCV cases for EAGLE-3 on both runners again,
# now with the bigram pair's EAGLE-3 head (real partial acceptance; the random head it replaced
# accepted nothing greedy). Four engines a case (vLLM at k = 3 and 1, SCV fixed at chunk 1, SCV
# adaptive), about 4.5 minutes; each pytest gets its own temporary folder (pytest prunes a
# shared one's older runs).
run_case() {  # run_case scv|nwor METHOD-RUNNER
  local tests; [ "$1" = scv ] && tests="scv" || tests="test_nwor_on"
  step "$1_$2" tests tests/gpu/test_eagle_gpu.py -k "$tests and $2" --basetemp="/tmp/pt/$1_$2"
}
stream0() { run_case scv eagle3-v2; }
stream1() { run_case scv eagle3-v1; }

gpus=$(nvidia-smi -L | wc -l)
echo "=== $gpus GPUs"
for g in $(seq 0 $((gpus - 1))); do
  (
    export CUDA_VISIBLE_DEVICES=$g VLLM_CACHE_ROOT=/tmp/cache/$g/vllm
    export TRITON_CACHE_DIR=/tmp/cache/$g/triton TORCHINDUCTOR_CACHE_DIR=/tmp/cache/$g/inductor
    for s in 0 1; do
      [ $((s % gpus)) -eq "$g" ] && declare -F "stream$s" > /dev/null && "stream$s"
    done
  ) &
done
wait
echo "=== all done $(date +%T)"

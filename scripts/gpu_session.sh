#!/usr/bin/env bash
# One device session's plan, run in the background on the GPU machine after the devkit install,
# so that no benchmark is cut by the 10-minute limit of a device call:
#   setsid nohup bash scripts/gpu_session.sh > /tmp/out/session.log 2>&1 < /dev/null &
# The work is four streams of steps (the next session's plan; earlier plans are in git
# history). With n GPUs, GPU g runs streams g, g + n, ... one after
# the other, all GPUs at once, each with its own compile caches. Every step writes
# /tmp/out/<step>.jsonl and .log and a <step>.done marker (a rerun skips finished steps); a
# later call copies /tmp/out back. Streams are in priority order for machines of fewer GPUs.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=/tmp/out
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

# Next plan (four GPUs, priority order): SCV with the cost per token falling with the step's
# size (scv.TOKEN_KNOTS), the issue's comparison in two groups and L=4; a profile of NWOR with
# ngram at k=8, L=9, where NWOR lost 15-19% at batch 1-32; the SCV unit-level GPU tests.
stream0() { step scv_issue scv_bench --policies no_spec fixed_k2 fixed_k4 scv --workloads \
  uniform_L1.5 mixed_L1.2_and_full uniform_L3 --batches 1 32 128 --reps 4; }
stream1() { step scv_L4 scv_bench --policies no_spec fixed_k4 fixed_k8 scv --workloads uniform_L4 \
  --batches 1 32 128 --reps 2
  step scv_b256 scv_bench --policies no_spec fixed_k2 scv --workloads uniform_L1.5 \
  mixed_L1.2_and_full --batches 256 --reps 2; }
stream2() { step nwor_ngram_k8 nwor_overhead --method ngram --k 8 --L k+1 --batches 1 8 32 \
  --reps 3 --min-requests 8 --profile-batches 8 32 --profile-L 9; }
stream3() { step scv_issue2 scv_bench --policies no_spec fixed_k2 fixed_k4 scv --workloads \
  uniform_L1.5 mixed_L1.2_and_full uniform_L3 --batches 1 32 128 --reps 4; }

gpus=$(nvidia-smi -L | wc -l)
echo "=== $gpus GPUs"
for g in $(seq 0 $((gpus - 1))); do
  (
    export CUDA_VISIBLE_DEVICES=$g VLLM_CACHE_ROOT=/tmp/cache/$g/vllm
    export TRITON_CACHE_DIR=/tmp/cache/$g/triton TORCHINDUCTOR_CACHE_DIR=/tmp/cache/$g/inductor
    for s in 0 1 2 3; do
      [ $((s % gpus)) -eq "$g" ] && declare -F "stream$s" > /dev/null && "stream$s"
    done
  ) &
done
wait
echo "=== all done $(date +%T)"

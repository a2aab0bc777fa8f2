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

# The next session's plan. In the thirty-ninth session SCV adaptive with ngram_gpu at batch 128,
# L=4, held chunk 0 in one run (scv_ngram_gpu_profile_b128_L4_2026-11-24_h200.json, 0.76 of
# fixed k=2) and drafted at budgets 0 and 2 in the next (scv_ngram_gpu_trim_wait_..., 0.96 of
# plain decoding): five repetitions with its choices recorded (scv_step_profile now keeps them),
# then the batch-32 benchmark with ngram_gpu, which has not run yet.
stream0() {
  step scv_choice_ngram_b128 scv_step_profile --method ngram_gpu --no-profile \
    --engines no_spec fixed_k2 scv --batches 128 --acceptance-length 4 --reps 5
  step scv_ngram_b32 scv_bench --method ngram_gpu --policies no_spec fixed_k2 fixed_k4 fixed_k8 \
    scv --batches 32 --reps 3 --output-lens 64 192 --memory 0.92
}

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

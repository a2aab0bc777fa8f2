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

# The next session's plan. In the fortieth session SCV held chunk 0 in five runs at batch 128,
# L=4 with ngram_gpu: after the warm-up replaced its estimator, the policy's probe clock (the
# estimator's step count) restarted below the last shared probe step, and no probe came. With
# the policy's own clock: the same profile, the same with draft_model, then batch 128 with
# ngram_gpu over every workload.
stream0() {
  step scv_choice_ngram_b128_clock scv_step_profile --method ngram_gpu --no-profile \
    --engines no_spec fixed_k2 scv --batches 128 --acceptance-length 4 --reps 4
  step scv_choice_draft_b128_clock scv_step_profile --no-profile \
    --engines no_spec fixed_k2 scv --batches 128 --acceptance-length 4 --reps 3
  step scv_ngram_b128_clock scv_bench --method ngram_gpu --policies no_spec fixed_k2 fixed_k4 \
    scv --batches 128 --reps 2 --output-lens 64 192 --memory 0.92
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

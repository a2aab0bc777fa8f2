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

# This plan (the twentieth session's; one GPU runs stream 0 only): first, at batch 128 with
# L=4 and L=3, SCV held at chunk 2 beside vLLM's k=2 (what a drafting step costs SCV's engine
# at this concurrency, against what SCV's cost fit says; the warm-up's steps are kept), then
# L=3, L=4 and the mix at batch 128 and 256 (the nineteenth session's machines were lost
# before this step gave rows), then SCV held at chunk 0 in vLLM's own process layout.
stream0() {
  step b128_fixed2 scv_bench --policies no_spec fixed_k2 scv_fixed2 scv --batches 128 \
    --workloads uniform_L4 uniform_L3 --reps 3
  step scv_large scv_bench --policies no_spec fixed_k2 fixed_k4 scv --batches 128 256 \
    --workloads uniform_L3 uniform_L4 mixed_L1.2_and_full --reps 3
  step chunk0_own8 scv_step_profile --engines no_spec no_spec_v1 scv_chunk0 \
    --batches 128 256 --reps 8 --engine-core-process
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

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

# The next session's plan. The forty-third session measured SCV's policy inside the engine
# (scv_policy_us_per_step: 0.5-0.9 ms a step at batch 128, L=1.5 and the mix, where plain
# decoding's ~7 ms step is bound by the GPU) and cut it; two runs of one commit differed by up
# to 0.32 a cell. Batch 128 again, with SCV held at chunk 0 beside it, so that the rest of
# SCV's chunk-0 step cost (vLLM's speculative runner, the lazy draft sync) is seen apart.
stream0() {
  step scv_b128_chunk0_beside scv_bench --batches 128 --workloads uniform_L1.5 \
    mixed_L1.2_and_full --policies no_spec fixed_k4 scv scv_chunk0 --reps 3 \
    --load-multiple 4 --output-lens 64 192
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

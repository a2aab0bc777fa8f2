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

# This plan (for the twenty-sixth session): NWOR first. The kernel tests on the merge kernel
# whose prefix loads now come before the chunk's loop; the GPU time of a verify step's 32 layers
# replayed as a CUDA graph, vLLM's against NWOR's, for the code before (_before/src, a copy of
# the last commit that travels untracked) and after; NWOR on/off beside an A/A control at batch
# 8 and 32 with the host work per step cut. Then SCV: the settled batch from each request's
# history (13532e8) at batch 128 and 256, then batch 1 and 32.
stream0() {
  step kernels tests tests/gpu/test_kernels.py tests/gpu/test_fallbacks_gpu.py
  [ -d _before/src ] && NWOR_SRC=$PWD/_before step layer_gpu_before nwor_layer_gpu --label before
  step layer_gpu_after nwor_layer_gpu --label after
  step aa_dm_k4 nwor_overhead --method draft_model --k 4 --L 1.5 3.0 --batches 8 32 --reps 3 \
    --min-requests 32 --aa
  step history_b128_b256 scv_bench --policies no_spec fixed_k2 scv --batches 128 256 \
    --workloads uniform_L3 uniform_L4 mixed_L1.2_and_full --reps 2
  step history_b1_b32 scv_bench --policies no_spec fixed_k2 fixed_k4 scv --batches 1 32 \
    --workloads uniform_L1.5 uniform_L3 uniform_L4 mixed_L1.2_and_full --reps 2
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

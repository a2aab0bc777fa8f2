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

# This plan (one GPU), host time: each profile now reports how busy the GPU was (gpu_busy) and
# the plugin's own functions and host syncs (cProfile). The benchmarks keep each engine core in
# the engine's process, so front-end work (output processing, the plugin's front-end telemetry)
# runs in the step loop's thread; vLLM's LLM runs it in a process of its own by default.
# 0. SCV's chunk-0 floor: is the GPU idle between steps (host-bound), and does leaving out the
#    record of a skipped draft pass give it back?
# 1. the same floor with every engine core in its own process;
# 2. NWOR on/off at batch 1 and 8, engine core in-process (profiled) and in its own process.
stream0() { step chunk0_busy scv_step_profile --engines no_spec_v1 scv_chunk0 \
  scv_chunk0_no_record --batches 1 128 --profile-batches 1 128
  step chunk0_own_process scv_step_profile --engines no_spec_v1 scv_chunk0 --batches 1 128 \
  --engine-core-process; }
stream1() { step nwor_host_profile nwor_overhead --method draft_model --k 4 --L 3.0 \
  --batches 1 8 --reps 3 --min-requests 8 --profile-batches 1 8
  step nwor_own_process nwor_overhead --method draft_model --k 4 --L 3.0 --batches 1 8 \
  --reps 3 --min-requests 8 --engine-core-process; }

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

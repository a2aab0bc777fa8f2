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

# This plan (for the twenty-sixth session, second machine): verify attention through scratch
# blocks (vLLM's own FlashAttention call over a block table whose drafting requests' last blocks
# hold the step's chunk) in place of FA over the prefix plus the chunk-and-merge kernel. The
# kernel tests; the engine tests of NWOR on and off (tokens now identical) and of the cache
# audit; the GPU time of a verify step's layers for the code before (_before: the tree of
# dd62e37, run with its own benchmark scripts) and after; NWOR on/off beside an A/A control.
before() {  # before NAME WHAT ARGS...: a step run from the _before tree
  local name=$1; shift
  [ -e "$OUT/$name.done" ] && return
  echo "=== $name start $(date +%T)"
  (cd _before && NWOR_SRC=$PWD STEP=$name bash scripts/gpu_suite.sh "$@" > /dev/null 2>&1
   echo "$?" > "$OUT/$name.done")
  echo "=== $name end $(date +%T) rc=$(cat "$OUT/$name.done")"
}
stream0() {
  step engine tests tests/gpu/test_engine_gpu.py -k "default_settings or draft_model_no_rejected"
  step layer_gpu_after nwor_layer_gpu --label after
  [ -d _before/src ] && before layer_gpu_before nwor_layer_gpu --label before
  step fallbacks tests tests/gpu/test_fallbacks_gpu.py
  step aa_dm_k4 nwor_overhead --method draft_model --k 4 --L 1.5 3.0 --batches 8 32 --reps 3 \
    --min-requests 32 --aa
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

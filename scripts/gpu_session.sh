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

# This plan (for the twenty-seventh session): NWOR's verify attention through scratch blocks
# (a6c4585) where it has not run yet: the layers' GPU time at batch 256; one profiled run of the
# cell that lost 3% under both designs (draft_model, k = 4, L = 1.5, batch 8); all GPU tests;
# NWOR on/off beside an A/A control for ngram and for batch 128; then SCV at batch 128 and 256.
stream0() {
  step layer_gpu nwor_layer_gpu --label scratch
  step profile_dm_b8 nwor_overhead --method draft_model --k 4 --L 1.5 --batches 8 --reps 3 \
    --min-requests 32 --profile-batches 8 --profile-L 1.5
  step tests tests
  step aa_ngram nwor_overhead --method ngram --k 4 8 --L 1.5 k+1 --batches 8 32 128 --reps 3 \
    --min-requests 32 --aa
  step aa_dm_b128 nwor_overhead --method draft_model --k 4 8 --L 1.5 3.0 --batches 128 \
    --reps 3 --min-requests 32 --aa
  step scv_b128_b256 scv_bench --policies no_spec fixed_k2 scv --batches 128 256 \
    --workloads uniform_L3 uniform_L4 mixed_L1.2_and_full --reps 2
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

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

# This plan (for the thirty-second session): the thirty-first ran the fp8 kernel tests and the
# rest of the issue's matrix at batch 8-128 (all 48 distinct cells are now on the scratch-write
# path) and ngram's batch-1 cells. First a profiled draft_model cell at batch 8, where the pool
# puts NWOR's cost at about 2% and the step is host-bound (in the 2026-11-23 profile the GPU was
# busy two thirds of the time): which host work NWOR adds per step. Then draft_model at batch 1,
# six cells of about five minutes each beside A/A, one machine.
stream0() {
  local each=(--reps 2 --min-requests 32 --aa)
  step dm_b8_prof nwor_overhead --method draft_model --k 4 --L 1.5 --batches 8 "${each[@]}" \
    --profile-batches 8 --profile-L 1.5
  step dm_b1_k2 nwor_overhead --method draft_model --k 2 --L 1.5 3.0 --batches 1 "${each[@]}"
  step dm_b1_k4_L3 nwor_overhead --method draft_model --k 4 --L 3.0 --batches 1 "${each[@]}"
  step dm_b1_k8 nwor_overhead --method draft_model --k 8 --L 1.5 3.0 k+1 --batches 1 \
    "${each[@]}"
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

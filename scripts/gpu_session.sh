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

# This plan (the thirty-second session's third machine): the second timed NWOR's host work in
# draft_model steps at batch 8 and 32 at 143-153 µs a step, 1.2-1.4% of the step: the pooled
# cost. The commit's launch now passes addresses (no driver check per tensor), its layout is
# prepared once, and the NVTX range is gone. First the kernel tests (the launch path changed),
# then each part's host time before (39086fd's src, unpacked in before_src/ and carried) and
# after, alternating; then the engine tests of tokens and cache on the GPU; then draft_model at
# batch 8 and 32 beside plugin-off engines, with the host timer.
stream0() {
  step kernels tests tests/gpu/test_kernels.py tests/gpu/test_fallbacks_gpu.py
  if [ ! -e "$OUT/step_host.done" ]; then
    for label in before after before after; do
      if [ "$label" = before ]; then src="$PWD/before_src"; else src=""; fi
      NWOR_SRC="$src" STEP=step_host bash scripts/gpu_suite.sh nwor_step_host --label "$label" \
        > /dev/null 2>&1
    done
    echo 0 > "$OUT/step_host.done"
  fi
  step engine tests tests/gpu/test_engine_gpu.py -k "default_settings or no_rejected_draft"
  step dm_after nwor_overhead --method draft_model --k 4 --L 1.5 --batches 8 32 --reps 4 \
    --min-requests 32 --aa --time-nwor-host
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

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

# The next session's plan. The profile of the thirty-ninth session
# (scv_ngram_gpu_profile_b128_L4_2026-11-24_h200.json) found SCV at chunk 0 with ngram_gpu
# 1.5 ms a step slower than plain decoding, GPU time equal: the host waited every step for the
# drafter's valid-draft counts. patches/ngram_gpu.py skips that wait on steps without drafts;
# scv_chunk0_trim_wait keeps it. Then the GPU tests of SCV with ngram_gpu, and batch 32.
stream0() {
  step ngram_trim_b128 scv_step_profile --method ngram_gpu --no-profile \
    --engines no_spec scv_chunk0 scv_chunk0_trim_wait fixed_k2 scv --batches 32 128 \
    --acceptance-length 4 --reps 3
  step gpu_tests_ngram tests tests/gpu -k ngram
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

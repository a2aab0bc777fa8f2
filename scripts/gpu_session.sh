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

# The thirty-eighth session: SCV with vLLM's ngram_gpu drafter, which proposes all k drafts or
# fails (SCV now asks it for k and cuts every request to its chunk). Its GPU tests, the same
# test against the scheduler patch before the change (NWOR_SRC=.scratch/old: it must fail),
# then the comparison at batch 128, where the mix's 1.15x target is, and at batch 32. (All but
# batch 32 ran, on three machines: scv_ngram_gpu_b128_2026-11-24_h200.json and
# gpu_tests_scv_ngram_gpu_2026-11-24_h200.json. Next: profile SCV and fixed k=2 with ngram_gpu
# at batch 128, L=4, where SCV held budget 2 and its steps were slower.)
stream0() {
  step tests_ngram_gpu tests tests/gpu/test_engine_gpu.py -k ngram_gpu
  step scv_ngram_b128 scv_bench --method ngram_gpu --policies no_spec fixed_k2 fixed_k4 fixed_k8 \
    scv --batches 128 --reps 3 --output-lens 64 192 --memory 0.92
  [ -d .scratch/old/src ] && (export NWOR_SRC=$PWD/.scratch/old
    step tests_ngram_gpu_old tests tests/gpu/test_engine_gpu.py -k "ngram_gpu and True")
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

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

# This plan (twenty-ninth session, third machine): the scratch-write path with vLLM's op called
# directly. Kernel and fallback tests; the eager layers' host time of the Triton-stage code
# (7f63842, unpacked into ab_old/ beside this checkout) and of this one, on one machine, ABBA;
# two engine tests; ngram k = 8 at batch 1 again.
layer_host_old() {  # the Triton-stage checkout's benchmark and plugin, labelled "before"
  [ -e "$OUT/$1.done" ] && return
  echo "=== $1 start $(date +%T)"
  (cd ab_old && PYTHONPATH="$PWD/src:/tmp/site" VLLM_USE_FLASHINFER_SAMPLER=0 \
    python3 benchmarks/nwor_layer_host.py \
    --label before --jsonl "$OUT/layer_host_ab.jsonl" > "$OUT/$1.log" 2>&1)
  echo "$?" > "$OUT/$1.done"
  echo "=== $1 end $(date +%T) rc=$(cat "$OUT/$1.done")"
}
layer_host_new() {
  [ -e "$OUT/$1.done" ] && return
  echo "=== $1 start $(date +%T)"
  PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 python3 benchmarks/nwor_layer_host.py \
    --label after --jsonl "$OUT/layer_host_ab.jsonl" > "$OUT/$1.log" 2>&1
  echo "$?" > "$OUT/$1.done"
  echo "=== $1 end $(date +%T) rc=$(cat "$OUT/$1.done")"
}
stream0() {
  step kernels tests tests/gpu/test_kernels.py tests/gpu/test_fallbacks_gpu.py
  layer_host_old lh1
  layer_host_new lh2
  layer_host_new lh3
  layer_host_old lh4
  step engine2 tests tests/gpu/test_engine_gpu.py -k \
    "test_default_settings_tokens_and_counters or test_draft_model_no_rejected_draft_reaches"
  step ngram_k8_b1 nwor_overhead --method ngram --k 8 --L 1.5 k+1 --batches 1 --reps 3 \
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

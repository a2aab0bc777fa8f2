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

# The next session's plan. In the forty-first session the batch's prior was changed (197cb7f):
# where no request has a whole observation left, it is the other requests' fresh verdicts, not
# the engine's pool alone (a shared probe's verdicts were outweighed by old traffic, and L=3 and
# L=4 after L=1.5 did not draft). First the issue's cells at batch 128 with draft_model, carried
# over in the benchmark's order (L=1.5, L=3, L=4, the mix); then SCV's GPU test with NWOR on the
# probe clock fix and this change; then the same cells with ngram_gpu.
stream0() {
  step scv_b128_prior scv_bench --batches 128 --policies no_spec fixed_k2 fixed_k4 scv --reps 2 \
    --load-multiple 4 --output-lens 64 192
  step gpu_tests_scv_nwor tests tests/gpu/test_engine_gpu.py -k scv_with_nwor
  step scv_ngram_b128_prior scv_bench --method ngram_gpu --batches 128 \
    --policies no_spec fixed_k2 fixed_k4 scv --reps 2 --load-multiple 4 --output-lens 64 192
  # Then: SCV planned budget 2 at L=4 with draft_model, where fixed k=4 ran 1.43x fixed k=2;
  # SCV's machinery held at chunk 2 and at 4 traces both budgets' steps in one run.
  step scv_draft_b128_L4_budgets scv_step_profile --engines no_spec fixed_k2 fixed_k4 scv \
    scv_fixed2 scv_fixed4 --batches 128 --no-profile --acceptance-length 4 --reps 2
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

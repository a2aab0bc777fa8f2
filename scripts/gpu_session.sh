#!/usr/bin/env bash
# One device session's plan, run in the background on the GPU machine after the kit's install,
# so that no benchmark is cut by the 10-minute limit of a device call:
#   setsid nohup bash scripts/gpu_session.sh > /tmp/out/session.log 2>&1 < /dev/null &
# The work is streams of steps (the next session's plan; earlier plans are in git
# history). With n GPUs, GPU g runs streams g, g + n, ... one after
# the other, all GPUs at once, each with its own compile caches. Every step writes
# /tmp/out/<step>.jsonl and .log and a <step>.done marker (a rerun skips finished steps); a
# later call copies /tmp/out back. Streams are in priority order for machines of fewer GPUs.
# To stop a plan, kill its shell and then the GPU's processes by PID
# (nvidia-smi --query-compute-apps=pid --format=csv,noheader): vLLM renames its engine
# processes (VLLM::EngineCore), so a match on "python" misses them and their memory stays held.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=/tmp/out
mkdir -p /tmp/pt  # the parent of each pytest --basetemp
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

# The plan (vLLM 0.32): NWOR's overhead with EAGLE-3 again, every step timed, now that its
# metrics no longer wait for the GPU (the target: 0.99 beside the A/A); whether vLLM's adaptive
# verification runs with EAGLE-3 here (what SCV must beat) and the per-request synthetic
# acceptance on the V2 runner (the mixed traffic SCV's benchmark needs); the soak; the whole
# single-GPU matrix; the GPU tests. On two GPUs, stream 1 runs beside stream 0, then the TP 2
# cases and the soak at TP 2 under KV pressure with chunked prefill.
stream0() {
  step overhead_e3 nwor_overhead --method eagle3 --k 4 --L 1.5 2.5 3.5 --batches 8 32 --reps 2 --aa
  step v2_e3 tests tests/gpu/test_eagle_gpu.py -k "adaptive_verification or per_request_synthetic"
  step soak soak --seconds 120
  step gpu_tests tests
}
stream1() {
  step eq_1gpu equivalence --models /tmp/m0
}
after() {
  step eq_tp2 equivalence --models /tmp/m0 --cases \
    tp2_draft_model,tp2_ngram,tp2_long_prompts_eagle3,tp2_wide_prompts_8b_ngram_in_process
  step soak_tp2 soak --seconds 120 --configs nwor --tensor-parallel-size 2 --pressure
}
gpus=$(nvidia-smi -L | wc -l)
echo "=== $gpus GPUs"
for g in $(seq 0 $((gpus - 1))); do
  (
    export CUDA_VISIBLE_DEVICES=$g VLLM_CACHE_ROOT=/tmp/cache/$g/vllm
    export TRITON_CACHE_DIR=/tmp/cache/$g/triton TORCHINDUCTOR_CACHE_DIR=/tmp/cache/$g/inductor
    for s in 0 1; do
      [ $((s % gpus)) -eq "$g" ] && declare -F "stream$s" > /dev/null && "stream$s"
    done
  ) &
done
wait
[ "$gpus" -ge 2 ] && declare -F after > /dev/null && after
tar -czf "$OUT/traces.tar.gz" -C "$OUT" $(cd "$OUT" && ls -d trace-* 2>/dev/null) 2>/dev/null
echo "=== all done $(date +%T)"

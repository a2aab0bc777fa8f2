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

# The plan (vLLM 0.32), for about 20 minutes of two GPUs: NWOR's overhead with EAGLE-3 again,
# now that its metrics no longer wait for the GPU, with longer runs (96 requests a run) at one
# length (the target: 0.99 beside the A/A); vLLM's adaptive verification with EAGLE-3 and the
# V2 runner's per-request synthetic acceptance (what SCV must beat, and the mixed traffic SCV's
# benchmark needs); the single-GPU rows under load not yet run on vLLM 0.32. On two GPUs, stream
# 1 runs beside stream 0, then the soak at TP 2 under KV pressure with chunked prefill and the
# TP 2 rows under load, one step each so that each finished one comes back.
stream0() {
  step overhead_e3 nwor_overhead --method eagle3 --k 4 --L 2.5 --batches 8 32 --reps 3 \
    --min-requests 96 --aa
  step v2_e3 tests tests/gpu/test_eagle_gpu.py -k "adaptive_verification or per_request_synthetic"
}
stream1() {
  local c
  for c in pressure_eagle3 pressure_eagle3_no_prefix_caching \
           pressure_8b_ngram_no_prefix_caching_in_process pressure_8b_draft_model_in_process; do
    step "eq_$c" equivalence --models /tmp/m0 --cases "$c"
  done
}
after() {
  step soak_tp2 soak --seconds 120 --configs nwor --tensor-parallel-size 2 --pressure
  local c
  for c in tp2_wide_prompts_8b_ngram_in_process tp2_long_prompts_eagle3 \
           tp2_wide_prompts_8b_ngram_no_prefix_caching_in_process \
           tp2_long_prompts_draft_model tp2_long_prompts_eagle3_no_prefix_caching \
           tp2_wide_prompts_8b_draft_model_in_process; do
    step "eq_$c" equivalence --models /tmp/m0 --cases "$c"
  done
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

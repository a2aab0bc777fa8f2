#!/usr/bin/env bash
# One device session's plan, run in the background on the GPU machine after the kit's install,
# so that no benchmark is cut by the 10-minute limit of a device call:
#   setsid nohup bash scripts/gpu_session.sh > /tmp/out/session.log 2>&1 < /dev/null &
# The work is steps (the next session's plan; earlier plans are in git history): on two or
# more GPUs, tp() first, on all of them; then streams, GPU g running streams g, g + n, ... one
# after the other, all GPUs at once, each with its own compile caches. Every step writes
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

# The plan (vLLM 0.32), for about 25 minutes of two GPUs. First, on two GPUs, the soak at TP 2
# under pressure again with its corrected count checks and the TP 2 rows under load not yet run
# on 0.32, one step each so that each finished one comes back. Then, one stream per GPU: the V2
# runner's per-request synthetic acceptance (its probe broke last time) and a first look at SCV
# against vLLM's adaptive verification with EAGLE-3 on the mixed traffic at batch 64; the
# single-GPU rows of the matrix under vLLM's defaults not yet run on 0.32.
tp() {
  step soak_tp2 soak --seconds 120 --configs nwor --tensor-parallel-size 2 --pressure
  local c
  for c in tp2_wide_prompts_8b_ngram_no_prefix_caching_in_process tp2_long_prompts_draft_model \
           tp2_long_prompts_eagle3_no_prefix_caching tp2_wide_prompts_8b_draft_model_in_process; do
    step "eq_$c" equivalence --models /tmp/m0 --cases "$c"
  done
}
stream0() {
  step v2_synthetic tests tests/gpu/test_eagle_gpu.py -k per_request_synthetic
  step scv_e3_b64 scv_bench --method eagle3 --k 4 --policies no_spec vllm_av scv no_spec_aa \
    --batches 64 --workloads mixed_a0.2_0.5_0.8_0.95 --reps 3 --slice-seconds 0.25
}
stream1() {
  local c
  for c in defaults_draft_model defaults_ngram aa_control_draft_model preemption \
           async_scheduling_on structured_output; do
    step "eq_$c" equivalence --models /tmp/m1 --cases "$c"
  done
}
gpus=$(nvidia-smi -L | wc -l)
echo "=== $gpus GPUs"
[ "$gpus" -ge 2 ] && declare -F tp > /dev/null && tp
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
tar -czf "$OUT/traces.tar.gz" -C "$OUT" $(cd "$OUT" && ls -d trace-* 2>/dev/null) 2>/dev/null
echo "=== all done $(date +%T)"

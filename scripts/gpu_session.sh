#!/usr/bin/env bash
# One device session's plan, run in the background on the GPU machine after the devkit install,
# so that no benchmark is cut by the 10-minute limit of a device call:
#   setsid nohup bash scripts/gpu_session.sh > /tmp/out/session.log 2>&1 < /dev/null &
# The work is streams of steps (the next session's plan; earlier plans are in git
# history). With n GPUs, GPU g runs streams g, g + n, ... one after
# the other, all GPUs at once, each with its own compile caches. Every step writes
# /tmp/out/<step>.jsonl and .log and a <step>.done marker (a rerun skips finished steps); a
# later call copies /tmp/out back. Streams are in priority order for machines of fewer GPUs.
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

# The plan (issue 63, next). One GPU: the pressure rows' negative control (the NWOR side 64
# tokens more KV). Two GPUs, after that: at TP 2, does an engine that compiles run other
# kernels than one that loads them from vLLM's cache? An A/A with a cold cache (NWOR off twice:
# the first compiles, the second loads), then the 8B TP 2 pairs again once the default cache is
# warm (both engines load), draft_model beside ngram; and EAGLE-3 at TP 2, which hung last time
# (its probe now reports what it printed when it times out). Earlier plans and what they found:
# benchmarks/results/equivalence_gpu_*_2026-11-28_h200*.json.
stream0() {
  step neg8b equivalence --models /tmp/m0 --cases neg_pressure_8b_ngram_in_process
}
after() {
  step tp2_cold equivalence --models /tmp/m0 --cases aa_tp2_wide_prompts_8b_ngram_cold_cache
  step tp2_warm equivalence --models /tmp/m0 --cases \
    tp2_wide_prompts_8b_ngram_no_prefix_caching_in_process,tp2_wide_prompts_8b_ngram_in_process,tp2_wide_prompts_8b_draft_model_in_process
  step tp2_e3 equivalence --models /tmp/m0 --cases tp2_long_prompts_eagle3,tp2_long_prompts_eagle3_no_prefix_caching
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

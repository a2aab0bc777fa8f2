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

# The next session's plan. The forty-fourth session had no device time left (the try before it,
# cut off, had spent it) and built interleaved runs (scv_bench --slice-seconds): a group's
# engines serve each batch at once, taking turns of a quarter second, so that every engine meets
# the host's speed of the moment. First: does it take the host out of an A/A control at batch
# 128 (whole runs: 0.80-1.30 pair by pair)? SCV beside it, on the cells it has lost. Then the
# same group as whole runs, for the spread of both ways on one machine (--merge's
# paired_by_group has each repetition's ratios). Four 8B engines fit an H200; an H100 (about
# 80 GB) takes three, without fixed k=2.
if [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -ge 100000 ]
then B128_POLICIES="no_spec no_spec_aa fixed_k2 scv"; B128_MEMORY=0.9
else B128_POLICIES="no_spec no_spec_aa scv"; B128_MEMORY=0.95
fi
B128_GROUP="--batches 128 --workloads uniform_L1.5 uniform_L4 mixed_L1.2_and_full \
  --policies $B128_POLICIES --memory $B128_MEMORY --reps 3 --load-multiple 4 --output-lens 64 192"
stream0() {
  # shellcheck disable=SC2086
  step scv_b128_interleaved scv_bench $B128_GROUP --slice-seconds 0.25
  # shellcheck disable=SC2086
  step scv_b128_whole_runs scv_bench $B128_GROUP
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

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

# The next session's plan. The forty-fifth session ran batch 128 interleaved in 0.25 s turns and
# as whole runs (scv_b128_interleaved_2026-11-27_h200.json, scv_b128_whole_runs_...): the A/A
# pairs went from 0.50-1.88 to 0.89-1.11, and fixed k=2 over plain decoding at L=4 read
# 0.85-0.87 interleaved where whole runs and earlier sessions had it ahead. Next: the same group
# at L=1.5 and L=4 in turns of 0.1 s and of 1 s. Whether the A/A spread narrows with shorter
# turns, and whether fixed k=2's ratio moves with the turn's length (a cost per turn that falls
# on speculative engines more would). Four 8B engines fit an H200; an H100 (about 80 GB)
# takes three, without fixed k=2.
if [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -ge 100000 ]
then B128_POLICIES="no_spec no_spec_aa fixed_k2 scv"; B128_MEMORY=0.9
else B128_POLICIES="no_spec no_spec_aa scv"; B128_MEMORY=0.95
fi
B128_GROUP="--batches 128 --workloads uniform_L1.5 uniform_L4 \
  --policies $B128_POLICIES --memory $B128_MEMORY --reps 3 --load-multiple 4 --output-lens 64 192"
stream0() {
  # shellcheck disable=SC2086
  step scv_b128_turns_0.1s scv_bench $B128_GROUP --slice-seconds 0.1
  # shellcheck disable=SC2086
  step scv_b128_turns_1s scv_bench $B128_GROUP --slice-seconds 1.0
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

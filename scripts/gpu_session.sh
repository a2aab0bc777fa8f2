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

# Next plan (four GPUs, priority order): the GPU tests (the commit now reads the verdict in its
# kernel) and SCV's machinery at chunk 2 against vLLM's k=2; NWOR's overhead over the issue's
# whole matrix, draft_model and ngram, and host profiles at batch 1 and 8; the SCV comparison
# with four repetitions, L=4, batch 256.
stream0() { step tests tests
  step scv_diag scv_bench --policies fixed_k2 scv_fixed2 scv --workloads uniform_L1.5 \
  --batches 1 32 --reps 4; }
stream1() { step nwor_dm nwor_overhead --method draft_model --k 2 4 8 --reps 3 --min-requests 8
  step nwor_host nwor_overhead --method draft_model --k 4 --L 3.0 --batches 1 8 --reps 3 \
  --min-requests 8 --profile-batches 1 8; }
stream2() { step nwor_ngram nwor_overhead --method ngram --k 2 4 8 --reps 3 --min-requests 8
  step scv_b256 scv_bench --policies no_spec fixed_k2 vllm_batch_schedule scv --workloads \
  uniform_L1.5 mixed_L1.2_and_full uniform_L4 --batches 256 --reps 2; }
stream3() { step scv_issue scv_bench --policies no_spec fixed_k2 fixed_k4 scv --workloads \
  uniform_L1.5 mixed_L1.2_and_full uniform_L3 --batches 1 32 128 --reps 4
  step scv_L4 scv_bench --policies no_spec fixed_k4 fixed_k8 scv --workloads uniform_L4 \
  --batches 1 32 128 --reps 2; }

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

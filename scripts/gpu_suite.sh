#!/usr/bin/env bash
# Runs on the GPU machine after the vLLM 0.32 kit's install (scripts/gpu_kit/README.md): installs
# this project next to vLLM in /tmp/site032 (NWOR_SITE), then
#   scripts/gpu_suite.sh tests [PATHS]         the GPU tests (PATHS, or tests/gpu), log + junit in $OUT
#   scripts/gpu_suite.sh nwor_overhead ARGS    -m benchmarks.nwor_overhead, $OUT/nwor_overhead.jsonl
#   scripts/gpu_suite.sh nwor_kv_traffic ARGS  -m benchmarks.nwor_kv_traffic (under ncu), $OUT/<name>.jsonl
#   scripts/gpu_suite.sh scv_bench ARGS        -m benchmarks.scv_bench, $OUT/scv_bench.jsonl
#   scripts/gpu_suite.sh draft_window_bench ARGS   -m benchmarks.draft_window_bench
#   scripts/gpu_suite.sh capacity ARGS        -m benchmarks.capacity, $OUT/capacity.jsonl
#   scripts/gpu_suite.sh nwor_layer_host ARGS  -m benchmarks.tools.nwor_layer_host (NWOR_SRC=<dir>:
#                                              the plugin's code from <dir>/src, another version)
#   scripts/gpu_suite.sh nwor_layer_gpu ARGS   -m benchmarks.tools.nwor_layer_gpu (NWOR_SRC as above)
#   scripts/gpu_suite.sh scv_step_profile|nwor_step_host|host_noise ARGS   -m benchmarks.tools.<that>
#   scripts/gpu_suite.sh equivalence ARGS      -m benchmarks.equivalence --out $OUT/<name>.json
#                                              --trace $OUT/trace-<name> (each engine's step trace)
#   scripts/gpu_suite.sh soak ARGS             -m benchmarks.soak --out $OUT/<name>.json
#   scripts/gpu_suite.sh install               the install alone
# Pass NWOR_COMMIT=<sha> (the tree travels without .git); NWOR_INSTALLED=1 skips the install
# (several runs at once share one), STEP=<name> names a benchmark's $OUT/<name>.jsonl and .log. Results come back from $OUT; merge
# a benchmark's into benchmarks/results/ here with
#   python -m benchmarks.<name> --merge <name>.jsonl --result benchmarks/results/...
# (-m benchmarks.tools.<name> for a diagnostic), from the repository root.
set -uo pipefail
cd "$(dirname "$0")/.."
site="${NWOR_SITE:-/tmp/site032}"
# The kit's export line (scripts/gpu_kit/install.sh prints it), and unbuffered output.
export PYTHONPATH="$site" VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
[ -f "$site/.ok-nv" ] || export PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1
[ -n "${NWOR_SRC:-}" ] && PYTHONPATH="$NWOR_SRC/src:$PYTHONPATH"
out="${OUT:-/tmp/out}"
mkdir -p "$out"
python3 -c "import vllm" 2>/dev/null || {
  echo "vLLM is not installed in $site: install the kit first (scripts/gpu_kit/README.md)" >&2; exit 3; }
if [ -z "${NWOR_INSTALLED:-}" ]; then
  python3 -m pip install -q --no-deps --no-build-isolation --target "$site" --upgrade . \
    || exit 1
fi
echo "${NWOR_COMMIT:-unknown}" > "$out/commit.txt"  # the tree travels without .git
# What merges on another machine record as the run's environment (commit, versions, GPU).
python3 -c "import json; from benchmarks.harness.results import environment
print(json.dumps(environment()))" > "$out/environment.json.$$" 2>/dev/null \
  && mv "$out/environment.json.$$" "$out/environment.json" \
  || echo "could not record the environment" >&2  # moved whole: a copy mid-step never sees it empty
what="${1:-tests}"
shift || true
name="${STEP:-$what}"
case "$what" in
  install) ;;
  tests)  # the paths under tests/ given, or all of tests/gpu; other arguments go to pytest
    case " $* " in *" tests/"*) ;; *) set -- tests/gpu "$@" ;; esac
    log="${STEP:-gpu-tests}"
    python3 -m pytest -q -p no:cacheprovider -rs -s --junitxml="$out/$log.xml" "$@" 2>&1 \
      | tee "$out/$log.log" | grep -vE "^(INFO|WARNING|DEBUG) " ;;
  equivalence)
    python3 -m benchmarks.equivalence --out "$out/$name.json" --trace "$out/trace-$name" "$@" \
      2>&1 | tee "$out/$name.log" | grep -vE "^(INFO|DEBUG|WARNING|\[)" ;;
  soak)
    python3 -m benchmarks.soak --out "$out/$name.json" "$@" 2>&1 \
      | tee "$out/$name.log" | grep -vE "^(INFO|DEBUG|WARNING|\[)" ;;
  nwor_overhead|nwor_kv_traffic|scv_bench|draft_window_bench|capacity|scv_step_profile|nwor_layer_host|nwor_layer_gpu|nwor_step_host|host_noise)
    module="benchmarks.$what"
    [ -e "benchmarks/$what.py" ] || module="benchmarks.tools.$what"  # the diagnostics
    python3 -m "$module" --jsonl "$out/$name.jsonl" "$@" 2>&1 \
      | tee "$out/$name.log" | grep -vE "^(INFO|DEBUG) " ;;
  *)
    echo "usage: $0 install|tests|equivalence|soak|nwor_overhead|nwor_kv_traffic|scv_bench|draft_window_bench|capacity|scv_step_profile|nwor_layer_host|nwor_layer_gpu|nwor_step_host|host_noise [args]" >&2; exit 2 ;;
esac

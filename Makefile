# The two commands the README promises: `make demo` and `make test`. Both build .venv first.
PY := .venv/bin/python

.PHONY: env demo demo-random test test-all test-unit lint gpu clean

env:
	bash scripts/bootstrap.sh

# The shipped byte-level pair (models/pystd-*): vLLM alone vs NWOR vs NWOR + SCV; completions,
# per-request acceptance lengths and chunk sizes, counters, throughput, build/demo_pair.png.
demo: env
	$(PY) examples/demo_pair.py

# The first demo: tiny random-weight models written on the spot, NWOR off vs on.
demo-random: env
	$(PY) examples/demo_cpu.py

# `make test`: ruff, the unit tests and each feature's engine tests on the real CPU engine
# (start-up refusals, NWOR's cache and output, plugin off, SCV, telemetry, the draft window, the
# README's `vllm serve`). `make test-all` adds the equivalence matrix under load, tensor
# parallelism, the soak and the other servers, and the benchmarks' configurations; CI runs it.
FAST_TESTS := tests/unit tests/engine/test_compile_hash.py tests/engine/test_config_errors.py \
	tests/engine/test_decode_graphs.py tests/engine/test_decode_graphs_v2.py \
	tests/engine/test_draft_sync.py tests/engine/test_draft_window.py \
	tests/engine/test_equivalence.py tests/engine/test_model_pair.py \
	tests/engine/test_ngram_gpu_trim.py tests/engine/test_no_write_on_reject.py \
	tests/engine/test_patch_inventory.py tests/engine/test_plugin_off.py \
	tests/engine/test_scv_engine.py tests/engine/test_seed_bugs_engine.py \
	tests/engine/test_telemetry_engine.py tests/engine/test_telemetry_scv.py \
	tests/engine/test_v2_verdict.py tests/server/test_readme_serve.py

test: env
	$(PY) -m ruff check src tests benchmarks examples scripts
	$(PY) -m pytest -q $(FAST_TESTS)

test-all: env
	$(PY) -m ruff check src tests benchmarks examples scripts
	$(PY) -m pytest -q tests

test-unit: env
	$(PY) -m pytest -q tests/unit

lint: env
	$(PY) -m ruff check src tests benchmarks examples scripts

clean:
	rm -rf .venv build src/*.egg-info .pytest_cache

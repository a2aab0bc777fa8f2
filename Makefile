# The two commands the README promises: `make demo` and `make test`. Both build .venv first.
PY := .venv/bin/python

.PHONY: env demo demo-random test test-unit lint gpu clean

env:
	bash scripts/bootstrap.sh

# The shipped byte-level pair (models/pystd-*): vLLM alone vs NWOR vs NWOR + SCV; completions,
# per-request acceptance lengths and chunk sizes, counters, throughput, build/demo_pair.png.
demo: env
	$(PY) examples/demo_pair.py

# The first demo: tiny random-weight models written on the spot, NWOR off vs on.
demo-random: env
	$(PY) examples/demo_cpu.py

test: env
	$(PY) -m ruff check src tests benchmarks examples scripts
	$(PY) -m pytest -q tests

test-unit: env
	$(PY) -m pytest -q tests/unit

lint: env
	$(PY) -m ruff check src tests benchmarks examples scripts

clean:
	rm -rf .venv build src/*.egg-info .pytest_cache

# The two commands the README promises: `make demo` and `make test`. Both build .venv first.
PY := .venv/bin/python

.PHONY: env demo demo-pair test test-unit lint gpu clean

env:
	bash scripts/bootstrap.sh

demo: env
	$(PY) examples/demo_cpu.py

# The shipped byte-level pair (models/pystd-*): completions as text, NWOR off vs on.
demo-pair: env
	$(PY) examples/demo_pair.py

test: env
	$(PY) -m ruff check src tests benchmarks examples scripts
	$(PY) -m pytest -q tests

test-unit: env
	$(PY) -m pytest -q tests/unit

lint: env
	$(PY) -m ruff check src tests benchmarks examples scripts

clean:
	rm -rf .venv build src/*.egg-info .pytest_cache

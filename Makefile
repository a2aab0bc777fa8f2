# The two commands the README promises: `make demo` and `make test`. Both build .venv first.
PY := .venv/bin/python

.PHONY: env demo test test-unit lint gpu clean

env:
	bash scripts/bootstrap.sh

demo: env
	$(PY) examples/demo_cpu.py

test: env
	$(PY) -m ruff check src tests benchmarks examples
	$(PY) -m pytest -q tests

test-unit: env
	$(PY) -m pytest -q tests/unit

lint: env
	$(PY) -m ruff check src tests benchmarks examples

clean:
	rm -rf .venv build src/*.egg-info .pytest_cache

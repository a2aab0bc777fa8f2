"""Maintenance scripts, run as files (``python scripts/train_pair.py``) or as modules; a package
so that tests and benchmarks import ``scripts.train_pair`` from the repository root."""

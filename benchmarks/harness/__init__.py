"""What the benchmarks share: ``results`` (environment, result files, a GPU run's jsonl and its
merge) and ``engines`` (engine processes driven over a pipe, dummy 8B-shaped checkpoints,
prompts, timers). The benchmarks import them as ``benchmarks.harness.<module>`` (they run as
``python -m benchmarks.<name>`` from the repository root)."""

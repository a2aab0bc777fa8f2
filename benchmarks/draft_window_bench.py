"""Draft context window on the GPU: its cost against vLLM's draft_model path, and its gain.

Two engines in one run, alternating batches: vLLM's draft_model path, and the same with
``"draft_context_window": W``. The 2-layer draft is told it handles ``--draft-max`` positions.

- ``short`` workload: every prompt fits the draft: vLLM drafts normally, so the ratio is the
  window's own cost (windowed draft attention; FlashAttention's AOT scheduling is off once the
  draft's layers have a window the target's do not).
- ``mixed`` workload: one request in eight is longer than the draft's limit: vLLM zeroes the
  whole batch's drafts while it runs; the window keeps everyone drafting.

Acceptance is real rejection sampling: with dummy weights the draft nearly always agrees with
the target, and vLLM's zeroed drafts are rejected. (Synthetic acceptance would accept zeroed
drafts like real ones and hide the batch-wide drop.)

The window needs vLLM's V1 runner. On vLLM 0.32 a GPU runs draft_model on the V2 runner, where
``draft_context_window`` is refused at start-up; this benchmark does not set
``VLLM_USE_V2_MODEL_RUNNER=0`` and has not run on 0.32.

    python -m benchmarks.draft_window_bench --window 256 --jsonl $OUT/draft_window_bench.jsonl
    python -m benchmarks.draft_window_bench --merge draft_window_bench.jsonl \\
        --result benchmarks/results/draft_window_<date>_<gpu>.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from benchmarks.harness.engines import (
    alternate,
    prompts,
    start_engines,
    stop_engines,
    tokens_per_second,
    write_models,
)
from benchmarks.harness.results import append_jsonl, parse_or_merge, write_json


def engine_kwargs(target: str, draft: str, window: int | None, k: int, max_batch: int) -> dict:
    speculative = {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
    if window:
        speculative["draft_context_window"] = window
    return dict(model=target, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                max_model_len=2048, max_num_seqs=max_batch, gpu_memory_utilization=0.42,
                seed=0, disable_log_stats=False, enable_prefix_caching=False,
                speculative_config=speculative)


def batch_prompts(workload: str, batch: int, seed: int, draft_max: int) -> list[list[int]]:
    short = prompts(batch, seed, length=draft_max // 2)
    if workload == "short":
        return short
    long = prompts(batch, seed + 1, length=min(1800, 3 * draft_max))
    return [long[i] if i % 8 == 0 else short[i] for i in range(batch)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--draft-max", type=int, default=512)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--reps", type=int, default=2)
    args = parse_or_merge(parser, merge)
    if args is None:
        return
    with tempfile.TemporaryDirectory() as root:
        target, draft = write_models(Path(root), draft_max_positions=args.draft_max)
        engines = start_engines({
            label: engine_kwargs(target, draft, window, args.k, max(args.batches))
            for label, window in (("vllm", None), ("window", args.window))})
        try:
            for engine in engines.values():
                engine.run(prompts(2, seed=99))
            for workload in ("short", "mixed"):
                for batch in args.batches:
                    runs = {label: [] for label in engines}
                    for rep in range(args.reps):
                        batch_in = batch_prompts(workload, batch, 1000 * batch + rep,
                                                 args.draft_max)
                        for label, run in alternate(engines, batch_in, rep).items():
                            runs[label].append(run)
                    row = {"workload": workload, "batch": batch, "window": args.window,
                           "draft_max": args.draft_max, "k": args.k}
                    for label in engines:
                        row[f"tok_s_{label}"] = round(statistics.median(
                            tokens_per_second(r) for r in runs[label]), 1)
                        drafted = sum(r["drafted"] for r in runs[label])
                        accepted = sum(r["accepted"] for r in runs[label])
                        row[f"acceptance_{label}"] = round(accepted / max(1, drafted), 4)
                    row["throughput_ratio"] = round(row["tok_s_window"] / row["tok_s_vllm"], 4)
                    print(json.dumps(row), flush=True)
                    append_jsonl(args.jsonl, row)
        finally:
            stop_engines(engines)


def merge(jsonl: Path, result: Path) -> None:
    from benchmarks.harness.results import recorded_environment

    cells = [json.loads(line) for line in jsonl.read_text().splitlines()]
    payload = {**recorded_environment(jsonl), "benchmark": "draft_window",
               "model": "Llama-3-8B shape, dummy weights, bf16; 2-layer draft", "cells": cells}
    write_json(result, payload)
    print(result)


if __name__ == "__main__":
    main()

"""SCV against the alternatives on the GPU: output throughput per batch size and workload.

Policies (each its own engine process, run one after the other on the same GPU):

- ``no_spec``: vLLM without speculation;
- ``fixed_k2``, ``fixed_k4``, ``fixed_k8``: draft_model with a fixed k;
- ``vllm_batch_schedule``: vLLM's ``num_speculative_tokens_per_batch_size`` (k by batch size);
- ``scv``: SCV adaptive, chunks up to 8.

Workloads give each request its own per-draft acceptance rate ``a`` through the benchmark-only
per-request synthetic acceptance (``SamplingParams.extra_args``) on top of vLLM's synthetic
rejection sampling at full acceptance, so a request's acceptance follows ``a`` whatever the
policy's k. Uniform workloads use the ``a`` that gives mean acceptance length L at k = 4;
the heterogeneous mix puts half the requests at L of about 1.2 and half at full acceptance.

    python benchmarks/scv_bench.py --policies no_spec fixed_k4 scv --jsonl $OUT/scv.jsonl
    python benchmarks/scv_bench.py --merge scv_bench.jsonl \
        --result benchmarks/results/scv_<date>_<gpu>.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

from common import append_jsonl  # noqa: E402
from gpu_engines import (  # noqa: E402
    OUTPUT_LEN,
    Engine,
    prompts,
    tokens_per_second,
    write_models,
)

REFERENCE_K = 4
POLICIES = ("no_spec", "fixed_k2", "fixed_k4", "fixed_k8", "vllm_batch_schedule", "scv")
BATCH_SCHEDULE = [[1, 16, 4], [17, 96, 2], [97, 1024, 1]]


def rate_for_length(length: float, k: int = REFERENCE_K) -> float:
    """Per-draft acceptance ``a`` with ``1 + a + ... + a**k == length`` (bisection)."""
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        if 1 + sum(mid**j for j in range(1, k + 1)) < length:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def workloads() -> dict[str, list[float]]:
    """Per-request acceptance rates as a repeating pattern (applied to any batch size)."""
    uniform = {f"uniform_L{length:g}": [rate_for_length(length)] for length in (1.5, 3.0, 4.0)}
    return {**uniform, "mixed_L1.2_and_full": [rate_for_length(1.2), 1.0]}


def engine_kwargs(policy: str, target: str, draft: str, max_batch: int) -> dict:
    kwargs = dict(model=target, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                  max_model_len=768, max_num_seqs=max_batch, gpu_memory_utilization=0.85,
                  seed=0, disable_log_stats=False, enable_prefix_caching=False)
    if policy == "no_spec":
        return kwargs
    k = {"fixed_k2": 2, "fixed_k4": 4}.get(policy, 8)
    speculative = {"method": "draft_model", "model": draft, "num_speculative_tokens": k,
                   "rejection_sample_method": "synthetic",
                   "synthetic_acceptance_length": k + 1.0,
                   "synthetic_acceptance_per_request": True}
    if policy == "vllm_batch_schedule":
        speculative["num_speculative_tokens_per_batch_size"] = BATCH_SCHEDULE
    if policy == "scv":
        speculative["scv"] = "adaptive"
    return {**kwargs, "speculative_config": speculative}


def run_policy(policy: str, target: str, draft: str, batches: list[int], reps: int,
               prompt_len: int) -> dict:
    engine = Engine(policy, engine_kwargs(policy, target, draft, max(batches)))
    results = []
    try:
        engine.run(prompts(4, seed=99))  # warm-up
        for name, pattern in workloads().items():
            for batch in batches:
                rates = [pattern[i % len(pattern)] for i in range(batch)]
                extra = [{"synthetic_acceptance_rate": r} for r in rates]
                runs = [engine.run(prompts(batch, seed=1000 * batch + rep, length=prompt_len),
                                   extra)
                        for rep in range(reps)]
                tok_s = statistics.median(tokens_per_second(r) for r in runs)
                drafted = sum(r["drafted"] for r in runs)
                accepted = sum(r["accepted"] for r in runs)
                row = {"policy": policy, "batch": batch, "workload": name,
                       "tok_s": round(tok_s, 1),
                       "acceptance": round(accepted / drafted, 4) if drafted else None}
                print(json.dumps(row), flush=True)
                results.append(row)
    finally:
        engine.stop()
    return {"policy": policy, "startup_seconds": round(engine.startup_seconds, 1),
            "prompt_len": prompt_len, "reps": reps, "rows": results}


def merge(jsonl: Path, result: Path) -> None:
    from common import environment

    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    table: dict[tuple[int, str], dict[str, float]] = {}
    for record in records:
        for row in record["rows"]:
            table.setdefault((row["batch"], row["workload"]), {})[row["policy"]] = row["tok_s"]
    cells = []
    for (batch, workload), tok_s in sorted(table.items()):
        others = [v for p, v in tok_s.items() if p != "scv"]
        cells.append({
            "batch": batch, "workload": workload, "tok_s": tok_s,
            "scv_over_best_other": round(tok_s["scv"] / max(others), 4)
            if "scv" in tok_s and others else None,
        })
    payload = {**environment(), "benchmark": "scv",
               "workload": {"prompt_len": sorted({r["prompt_len"] for r in records}),
                            "output_len": OUTPUT_LEN,
                            "reps": sorted({r["reps"] for r in records}),
                            "model": "Llama-3-8B shape, dummy weights, bf16; 2-layer draft",
                            "rates": workloads(), "batch_schedule": BATCH_SCHEDULE},
               "startup_seconds": {r["policy"]: r["startup_seconds"] for r in records},
               "cells": cells}
    result.parent.mkdir(parents=True, exist_ok=True)
    result.write_text(json.dumps(payload, indent=1) + "\n")
    print(result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128, 256])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=128,
                        help="prompt tokens (>= 128); short prompts keep the run decode-bound")
    parser.add_argument("--jsonl", type=Path)
    parser.add_argument("--merge", type=Path)
    parser.add_argument("--result", type=Path)
    args = parser.parse_args()
    if args.merge:
        merge(args.merge, args.result)
        return
    with tempfile.TemporaryDirectory() as root:
        target, draft = write_models(Path(root))
        for policy in args.policies:
            append_jsonl(args.jsonl, run_policy(policy, target, draft, args.batches, args.reps,
                                                args.prompt_len))


if __name__ == "__main__":
    main()

"""NWOR's overhead on the GPU: vLLM with NWOR on against vLLM as it is, in one run, alternating.

For each cell (method, k, L) the driver starts two engine processes on the GPU, one after the
other: vLLM with its defaults (CUDA graphs FULL_AND_PIECEWISE) and vLLM with ``"nwor": true``
(which runs verify batches PIECEWISE, see docs/gpu.md). It then sends the same batches to both,
alternating A B B A, and records per batch size:

- output throughput (generated tokens / wall time of ``LLM.generate``), on/off ratio;
- median inter-token latency (per request ``(last - first token) / (tokens - 1)``, median over
  requests), on/off ratio;
- persistent KV bytes the target model wrote per generated token, counted: prompt tokens plus
  every scheduled decode token, minus NWOR's rejected tokens (``tokens_rejected``);
- greedy token agreement between the two engines' outputs.

The model is Llama-3-8B-shaped with random weights (``load_format="dummy"``); acceptance comes
from vLLM's synthetic rejection sampling with mean acceptance length L.

    python benchmarks/nwor_overhead.py --method draft_model --k 4 --L 1.5 3.0 \\
        --batches 1 8 32 128 --jsonl $OUT/cells.jsonl
    python benchmarks/nwor_overhead.py --merge $OUT/cells.jsonl --result <json>
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
    PROMPT_LEN,
    Engine,
    prompts,
    tokens_per_second,
    write_models,
)

KV_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2  # layers x (K, V) x KV heads x head size x bf16


def kv_bytes_per_generated_token(run: dict, batch_prompts: list[list[int]]) -> float:
    """Target KV writes per generated token: prompt + decode steps' tokens - NWOR's rejected.

    A request that generates G tokens runs G - 1 - A decode steps (A accepted drafts), each
    writing its last sampled token and its drafts: P + (G - 1 - A) + D writes per request.
    """
    generated = sum(len(t) for t in run["tokens"])
    prompt = sum(len(p) for p in batch_prompts)
    writes = prompt + generated - len(batch_prompts) - run["accepted"] + run["drafted"]
    writes -= run["rejected_by_nwor"]
    return writes * KV_BYTES_PER_TOKEN / generated


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, list[int]]:
    """Share of identical tokens, and each diverging request's first differing position."""
    same = total = 0
    divergences = []
    for ra, rb in zip(a, b, strict=True):
        pairs = list(zip(ra, rb, strict=True))
        same += sum(x == y for x, y in pairs)
        total += len(pairs)
        first = next((i for i, (x, y) in enumerate(pairs) if x != y), None)
        if first is not None:
            divergences.append(first)
    return same / total, divergences


def engine_kwargs(target: str, draft: str, method: str, k: int, L: float, nwor: bool,
                  max_batch: int) -> dict:
    speculative = {"num_speculative_tokens": k, "rejection_sample_method": "synthetic",
                   "synthetic_acceptance_length": L}
    if method == "draft_model":
        speculative.update(method="draft_model", model=draft)
    else:
        speculative.update(method="ngram", prompt_lookup_max=4, prompt_lookup_min=2)
    if nwor:
        speculative["nwor"] = True
    return dict(model=target, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                max_model_len=PROMPT_LEN + OUTPUT_LEN + 64, max_num_seqs=max_batch,
                gpu_memory_utilization=0.42, seed=0, disable_log_stats=False,
                enable_prefix_caching=False, speculative_config=speculative)


def run_cell(target, draft, method, k, L, batches, reps) -> dict:
    max_batch = max(batches)
    engines: dict[bool, Engine] = {}
    try:
        for nwor in (False, True):
            engines[nwor] = Engine("nwor" if nwor else "vllm",
                                   engine_kwargs(target, draft, method, k, L, nwor, max_batch))
        for engine in engines.values():  # warm-up: JIT compiles, first-call costs
            engine.run(prompts(2, seed=99))
        rows = []
        for batch in batches:
            results = {False: [], True: []}
            for rep in range(reps):
                batch_prompts = prompts(batch, seed=1000 * batch + rep)
                order = (False, True) if rep % 2 == 0 else (True, False)  # A B, then B A
                runs = {nwor: engines[nwor].run(batch_prompts) for nwor in order}
                for nwor in (False, True):
                    runs[nwor]["prompts"] = batch_prompts
                    results[nwor].append(runs[nwor])
            rows.append(summarise(method, k, L, batch, results))
            print(json.dumps({key: v for key, v in rows[-1].items() if key != "runs"}),
                  flush=True)
        return {"startup_seconds": {e.name: round(e.startup_seconds, 1)
                                    for e in engines.values()}, "cells": rows}
    finally:
        for engine in engines.values():
            engine.stop()


def summarise(method, k, L, batch, results) -> dict:
    off, on = results[False], results[True]
    off_tps = statistics.median(tokens_per_second(r) for r in off)
    on_tps = statistics.median(tokens_per_second(r) for r in on)
    off_itl = statistics.median(r["itl_median"] for r in off)
    on_itl = statistics.median(r["itl_median"] for r in on)
    rates, divergences = [], []
    for a, b in zip(off, on, strict=True):
        rate, diverged = agreement(a["tokens"], b["tokens"])
        rates.append(rate)
        divergences += diverged
    drafted = sum(r["drafted"] for r in on)
    accepted = sum(r["accepted"] for r in on)
    return {
        "method": method, "batch": batch, "k": k, "L": L,
        "throughput_ratio": round(on_tps / off_tps, 4),
        "itl_ratio": round(on_itl / off_itl, 4),
        "kv_bytes_per_token_on": round(statistics.mean(
            kv_bytes_per_generated_token(r, r["prompts"]) for r in on)),
        "kv_bytes_per_token_off": round(statistics.mean(
            kv_bytes_per_generated_token(r, r["prompts"]) for r in off)),
        "token_agreement": round(statistics.mean(rates), 5),
        "divergences_first_position": divergences,
        "tok_s": {"off": round(off_tps, 1), "on": round(on_tps, 1)},
        "itl_ms": {"off": round(1000 * off_itl, 3), "on": round(1000 * on_itl, 3)},
        "measured_L": round(1 + accepted / max(1, drafted) * k, 3),
        "nwor_fallbacks": on[-1]["fallbacks"],
        "reps": len(on),
    }


def merge(jsonl: Path, result: Path) -> None:
    from common import environment

    cells, startups = [], []
    for line in jsonl.read_text().splitlines():
        record = json.loads(line)
        cells += record["cells"]
        startups.append(record["startup_seconds"])
    payload = {**environment(), "benchmark": "nwor_overhead",
               "workload": {"prompt_len": PROMPT_LEN, "output_len": OUTPUT_LEN,
                            "model": "Llama-3-8B shape, dummy weights, bf16",
                            "draft": "2-layer Llama, same vocabulary, dummy weights",
                            "acceptance": "vLLM synthetic rejection sampling, mean length L"},
               "startup_seconds": startups, "cells": cells}
    result.parent.mkdir(parents=True, exist_ok=True)
    result.write_text(json.dumps(payload, indent=1) + "\n")
    print(result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--method", choices=["draft_model", "ngram"], default="draft_model")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--L", type=float, nargs="+", default=[1.5, 3.0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--jsonl", type=Path)
    parser.add_argument("--merge", type=Path)
    parser.add_argument("--result", type=Path)
    args = parser.parse_args()
    if args.merge:
        merge(args.merge, args.result)
        return
    with tempfile.TemporaryDirectory() as root:
        target, draft = write_models(Path(root))
        for L in args.L:
            append_jsonl(args.jsonl,
                         run_cell(target, draft, args.method, args.k, L, args.batches, args.reps))


if __name__ == "__main__":
    main()

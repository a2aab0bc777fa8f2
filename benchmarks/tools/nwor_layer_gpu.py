"""What GPU time does NWOR add to a verify step's layers replayed as one CUDA graph?

GPU time of a verify step's layers replayed as one CUDA graph: vLLM's KV write and attention
against NWOR's staged ones, on the GPU, without the engine.

A uniform verify batch (every request with ``k`` drafts) replays a FULL CUDA graph, so no
Python runs in its layers and what NWOR adds to the step is GPU time: per step the plan's launch
(the scratch block table and slots, the committed tokens copied into scratch) and the commit's;
per layer vLLM's own write and FlashAttention call through the plan's slots and block table
(docs/gpu.md). This
benchmark captures 32 layers of an 8B-shaped model (32 query heads, 8 KV heads, head size 128,
each layer its own cache) the way vLLM captures them (NWOR's ``capturing`` flag set, no step
begun), then replays each side's graph step after step, NWOR's with its per-step begin and
commit as the engine does them, and reports the GPU time per step between two events:

- ``vllm_us`` / ``nwor_us``: per step, the median over rounds (each round ``--steps`` steps);
- ``extra_us_per_layer``: ``(nwor_us - vllm_us) / layers``.

Both sides run in one process, alternating, the order flipped every round. Two versions of the
plugin are compared by running this twice (``PYTHONPATH`` chooses a checkout; ``--label`` names
it); the merge reports ``after / before`` of NWOR's GPU time per step where both ran.

    python -m benchmarks.tools.nwor_layer_gpu --label after --jsonl $OUT/layer_gpu.jsonl
    python -m benchmarks.tools.nwor_layer_gpu --merge layer_gpu.jsonl \
        --result benchmarks/results/nwor_layer_gpu_<date>_<gpu>.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from vllm.forward_context import override_forward_context

from benchmarks.harness.results import (
    append_jsonl,
    parse_or_merge,
    recorded_environment,
    write_json,
)
from benchmarks.tools.nwor_layer_host import (
    BLOCK,
    HEAD_SIZE,
    HEADS,
    KV_HEADS,
    NWOR_FORWARD,
    NWOR_UPDATE,
    VLLM_FORWARD,
    VLLM_UPDATE,
    Step,
)
from vllm_nwor.nwor.verify_step import VerifyStep

CASES = [(1, 4), (8, 4), (32, 4), (128, 4), (256, 4), (8, 8), (32, 8)]  # batch, k (uniform)


def _layers(step: Step, nwor: bool) -> None:
    update, forward = (NWOR_UPDATE, NWOR_FORWARD) if nwor else (VLLM_UPDATE, VLLM_FORWARD)
    impl, md = step.impl, step.metadata
    for layer in step.layers:
        update(impl, layer, step.key, step.value, layer.kv_cache, md.slot_mapping)
        forward(impl, layer, step.query, step.key, step.value, layer.kv_cache, md, step.output)


def capture(step: Step, nwor: bool) -> torch.cuda.CUDAGraph:
    """One side's layers as a CUDA graph, captured as vLLM captures a verify batch's: with
    NWOR, ``capturing`` set and no step begun, so the layers take the graph's staged path."""
    interceptor = step.interceptor
    interceptor.capturing = nwor
    try:
        with override_forward_context(step.context):
            interceptor.uploader.rows(step.metadata.num_actual_tokens).fill_(-1)  # no staging
            _layers(step, nwor)  # compiles outside the capture, as vLLM's warm-up runs do
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                _layers(step, nwor)
    finally:
        interceptor.capturing = False
    return graph


def measure(step: Step, graph: torch.cuda.CUDAGraph, nwor: bool, steps: int) -> float:
    """GPU microseconds per step over ``steps`` replays (the host stays ahead of the GPU)."""
    interceptor = step.interceptor
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(steps):
        if nwor:
            interceptor.begin(VerifyStep.from_batch(step.num_draft_tokens, step.qsl_host, "cuda",
                                                    interceptor.uploader))
        graph.replay()
        if nwor:
            interceptor.commit(step.sampled)
    end.record()
    torch.cuda.synchronize()
    return 1e3 * begin.elapsed_time(end) / steps


def merge(jsonl: Path, result: Path) -> None:
    """One cell per case and label (medians over that label's runs); ``after / before`` of
    NWOR's extra GPU time per step where both labels ran."""
    records = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["batch"], r["k"], r["label"]), []).append(r)
    cells = []
    for (batch, k, label), runs in sorted(groups.items()):
        cell = {"batch": batch, "k": k, "label": label, "runs": len(runs),
                "rows": runs[0]["rows"], "layers": runs[0]["layers"]}
        for name in ("vllm_us", "nwor_us", "extra_us_per_layer", "nwor_over_vllm"):
            cell[name] = round(statistics.median(r[name] for r in runs), 3)
        cells.append(cell)
    by_case: dict[tuple, dict] = {}
    for cell in cells:
        by_case.setdefault((cell["batch"], cell["k"]), {})[cell["label"]] = cell
    changes = [{"batch": b, "k": k,
                "nwor_us_after_over_before": round(
                    labels["after"]["nwor_us"] / labels["before"]["nwor_us"], 4),
                "extra_us_per_layer": {"before": labels["before"]["extra_us_per_layer"],
                                       "after": labels["after"]["extra_us_per_layer"]}}
               for (b, k), labels in by_case.items() if {"after", "before"} <= set(labels)]
    payload = {**recorded_environment(jsonl), "benchmark": "nwor_layer_gpu",
               "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_size": HEAD_SIZE,
                         "block_size": BLOCK, "layers": records[0]["layers"],
                         "context": records[0]["context"]},
               "cells": cells, "changes": changes}
    write_json(result, payload)
    print(f"wrote {result}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--label", default="current")
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=8)
    args = parse_or_merge(parser, merge)
    if args is None:
        return
    for batch, k in CASES:
        step = Step(batch, k, 0.0, args.context, args.layers)
        graphs = {nwor: capture(step, nwor) for nwor in (False, True)}
        for nwor in (False, True):
            measure(step, graphs[nwor], nwor, 5)
        times: dict[bool, list[float]] = {False: [], True: []}
        for r in range(args.rounds):
            for nwor in ((False, True) if r % 2 == 0 else (True, False)):
                times[nwor].append(measure(step, graphs[nwor], nwor, args.steps))
        vllm_us, nwor_us = statistics.median(times[False]), statistics.median(times[True])
        row = {"label": args.label, "batch": batch, "k": k, "context": args.context,
               "rows": step.metadata.num_actual_tokens, "layers": args.layers,
               "vllm_us": round(vllm_us, 2), "nwor_us": round(nwor_us, 2),
               "extra_us_per_layer": round((nwor_us - vllm_us) / args.layers, 3),
               "nwor_over_vllm": round(nwor_us / vllm_us, 4),
               "vllm_us_rounds": [round(t, 1) for t in times[False]],
               "nwor_us_rounds": [round(t, 1) for t in times[True]],
               "graph_steps": step.interceptor.graph_steps,
               "fallbacks": dict(step.interceptor.counters().fallbacks)}
        print(json.dumps(row), flush=True)
        append_jsonl(args.jsonl, row)
        del graphs, step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

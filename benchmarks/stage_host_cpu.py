"""Host time of the stage kernel's wrapper per call, its launch left out, on the CPU.

In a verify step that runs outside CUDA graphs, every target layer calls ``stage_kv``: its
Python (argument shapes, strides, the specialization key, constexpr sizes) is host time paid 32
times per step before the compiled launch. This times that Python with the launch replaced by a
no-op, so it runs on any machine; the launch itself and everything on the GPU are
``nwor_layer_host.py``'s and ``nwor_layer_gpu.py``'s. The 8B shape: a batch of 32 requests with
4 drafts each (160 rows), 8 KV heads of 128, K and V as views into one QKV tensor, as in vLLM.

    python benchmarks/stage_host_cpu.py --label after --jsonl /tmp/stage_host.jsonl
    PYTHONPATH=<older checkout>/src python benchmarks/stage_host_cpu.py --label before ...
    python benchmarks/stage_host_cpu.py --merge /tmp/stage_host.jsonl --result <json>
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))

from common import append_jsonl, environment, parse_or_merge  # noqa: E402

ROWS, KV_HEADS, HEAD_SIZE, HEADS, BLOCK = 160, 8, 128, 32, 16


def measure(calls: int, rounds: int) -> float:
    """Median over rounds of the wrapper's µs per call, its launch a no-op."""
    import vllm_nwor.kernels.stage_kv as stage_kv

    stage_kv._STAGE = lambda grid, key, args: None  # the compiled launch, left out
    stage_kv.use_triton = lambda *tensors: True  # the CUDA path's wrapper, on CPU tensors
    qkv = torch.randn(ROWS, (HEADS + 2 * KV_HEADS) * HEAD_SIZE, dtype=torch.bfloat16)
    _, key, value = qkv.split([HEADS * HEAD_SIZE, KV_HEADS * HEAD_SIZE,
                               KV_HEADS * HEAD_SIZE], dim=-1)
    key, value = key.view(ROWS, KV_HEADS, HEAD_SIZE), value.view(ROWS, KV_HEADS, HEAD_SIZE)
    raw = torch.zeros(64, KV_HEADS, BLOCK, 2 * HEAD_SIZE, dtype=torch.bfloat16)
    key_cache, value_cache = raw.transpose(1, 2).split(HEAD_SIZE, dim=-1)
    slots = torch.arange(ROWS, dtype=torch.int64)
    rows = torch.full((ROWS,), -1, dtype=torch.int64)
    staged_key = torch.zeros(128, KV_HEADS, HEAD_SIZE, dtype=torch.bfloat16)
    staged_value = torch.zeros_like(staged_key)
    staged_slots = torch.zeros(128, dtype=torch.int64)
    args = (key, value, key_cache, value_cache, slots, rows, staged_key, staged_value,
            staged_slots, torch.full((ROWS,), -1, dtype=torch.int64))
    call = stage_kv.stage_kv
    for _ in range(calls // 10):
        call(*args, checked=False)
    per_round = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            call(*args, checked=False)
        per_round.append(1e6 * (time.perf_counter() - start) / calls)
    return statistics.median(per_round)


def merge(jsonl: Path, result: Path) -> None:
    records = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    by_label: dict[str, list[float]] = {}
    for record in records:
        by_label.setdefault(record["label"], []).append(record["us_per_call"])
    cells = [{"label": label, "runs": len(values),
              "us_per_call": round(statistics.median(values), 3)}
             for label, values in by_label.items()]
    payload = {**environment(), "benchmark": "stage_host_cpu",
               "shape": {"rows": ROWS, "kv_heads": KV_HEADS, "head_size": HEAD_SIZE,
                         "block_size": BLOCK}, "cells": cells}
    result.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {result}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--label", default="current")
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parse_or_merge(parser, merge)
    if args is None:
        return
    us = measure(args.calls, args.rounds)
    import vllm_nwor

    append_jsonl(args.jsonl, {"label": args.label, "source": os.path.dirname(vllm_nwor.__file__),
                              "us_per_call": round(us, 3)})
    print(f"{args.label}: {us:.2f} µs per call")


if __name__ == "__main__":
    main()

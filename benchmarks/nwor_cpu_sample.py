"""A sample NWOR run on the CPU: counters against vLLM's spec-decode stats, NWOR on vs off.

Not a speed benchmark (the CPU path uses the PyTorch reference attention). It records what the
counters say on a fixed workload, for ngram and draft_model, in
``benchmarks/results/nwor_cpu_sample_<date>.json``.

    .venv/bin/python benchmarks/nwor_cpu_sample.py
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, os.path.dirname(__file__))

from vllm import LLM, SamplingParams  # noqa: E402

import vllm_nwor  # noqa: E402
from common import environment, write_result  # noqa: E402
from vllm_nwor.testing import write_tiny_llama_pair  # noqa: E402

PROMPTS = [[(7 * i + 13 * j) % 500 + 2 for j in range(n)]
           for i, n in enumerate([5, 14, 23, 90, 40, 7, 61, 33])]
ENGINE = dict(skip_tokenizer_init=True, dtype="float32", max_model_len=512, block_size=16,
              max_num_seqs=4, max_num_batched_tokens=64, enforce_eager=True,
              gpu_memory_utilization=0.3, disable_log_stats=False, enable_prefix_caching=False)


def run(target: str, speculative: dict) -> dict:
    llm = LLM(model=target, speculative_config=speculative, **ENGINE)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    metrics = {m.name: m for m in llm.get_metrics()}
    counters = vllm_nwor.get_counters(llm)
    llm.llm_engine.engine_core.shutdown()
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "vllm_draft_tokens": int(metrics["vllm:spec_decode_num_draft_tokens"].value),
        "vllm_accepted_tokens": int(metrics["vllm:spec_decode_num_accepted_tokens"].value),
        "nwor_counters": counters.as_dict() if counters else None,
        "generate_seconds": round(seconds, 3),
    }


def main() -> None:
    cells = []
    with tempfile.TemporaryDirectory() as root:
        target, draft = write_tiny_llama_pair(root, num_layers=3, draft_layers=3, draft_noise=0.08)
        methods = {
            "ngram": {"method": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 1},
            "draft_model": {"method": "draft_model", "model": draft},
        }
        for name, speculative in methods.items():
            speculative = {**speculative, "num_speculative_tokens": 3}
            off = run(target, speculative)
            on = run(target, {**speculative, "nwor": True})
            cells.append({
                "method": name,
                "k": 3,
                "token_agreement": on["tokens"] == off["tokens"],
                "off": {k: v for k, v in off.items() if k != "tokens"},
                "on": {k: v for k, v in on.items() if k != "tokens"},
            })
    payload = {
        **environment(),
        "workload": {"prompts": len(PROMPTS), "prompt_lengths": [len(p) for p in PROMPTS],
                     "max_tokens": 40, "model": "tiny random Llama, 3 layers, fp32",
                     "engine": ENGINE},
        "cells": cells,
    }
    path = write_result(f"nwor_cpu_sample_{payload['date']}.json", payload)
    print(path)
    for cell in cells:
        print(cell["method"], cell["token_agreement"], cell["on"]["nwor_counters"])


if __name__ == "__main__":
    main()

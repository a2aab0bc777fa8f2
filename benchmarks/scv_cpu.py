"""SCV against no speculation and fixed k on the CPU engine: the GPU benchmark's shape, small.

The GPU benchmark (``scv_bench.py``) is what issue 4's targets are about; this runs the same
comparison on a tiny random-weight model on the CPU (fp32) so that a change to SCV's step costs
can be checked without a GPU. vLLM's synthetic rejection sampling does not run on the CPU, so
the draft is the target itself (every draft accepted) and the per-request synthetic acceptance
(the benchmark feature, ``scv_bench.workloads``) thins it to each request's rate. A draft as
costly as the target overstates what drafting costs next to the GPU benchmark's 2-of-32-layer
draft. draft_model, every batch sent at once, engines alternating round by round, median tokens
per second; ``scv_over_best_other`` per cell.

    PYTHONPATH=src .venv/bin/python -m benchmarks.scv_cpu --result scv_cpu_<date>.json
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time

from benchmarks.harness.engines import CPU_ENGINE
from benchmarks.harness.results import environment, write_result
from benchmarks.scv_bench import workloads

POLICIES = ("no_spec", "fixed_k2", "fixed_k4", "scv")
MAX_K = 4


def speculative_config(policy: str, draft: str) -> dict | None:
    if policy == "no_spec":
        return None
    k = {"fixed_k2": 2}.get(policy, MAX_K)
    config = {"method": "draft_model", "model": draft, "num_speculative_tokens": k,
              "synthetic_acceptance_per_request": True}
    return {**config, "scv": "adaptive"} if policy == "scv" else config


def engine_main(conn, policy: str, target: str, draft: str, batch: int, max_tokens: int) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    llm = LLM(model=target, speculative_config=speculative_config(policy, draft),
              max_num_seqs=batch, **CPU_ENGINE)
    conn.send("ready")
    while (message := conn.recv()) != "stop":
        prompts, rates = message
        params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                 extra_args={"synthetic_acceptance_rate": r}) for r in rates]
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        seconds = time.perf_counter() - start
        conn.send({"tok_s": sum(len(o.outputs[0].token_ids) for o in outputs) / seconds,
                   "tokens": [list(o.outputs[0].token_ids) for o in outputs]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--result", required=True)
    args = parser.parse_args()
    from vllm_nwor.testing import write_tiny_llama_pair

    context = mp.get_context("spawn")
    cells = []
    with tempfile.TemporaryDirectory() as root:
        target, _ = write_tiny_llama_pair(root)
        draft = target
        engines = {}
        try:
            for policy in POLICIES:  # one at a time: each sizes its KV cache at start-up
                conn, child = context.Pipe()
                process = context.Process(target=engine_main, args=(
                    child, policy, target, draft, max(args.batches), args.max_tokens))
                process.start()
                child.close()  # a dead engine then ends our reads with EOFError
                if conn.recv() != "ready":
                    raise RuntimeError(f"engine {policy} did not start")
                engines[policy] = (conn, process)
            for workload, pattern in workloads().items():
                for batch in args.batches:
                    rates = [pattern[i % len(pattern)] for i in range(batch)]
                    prompts = [[(7 * i + 13 * j + batch) % 500 + 2 for j in range(32)]
                               for i in range(batch)]
                    runs: dict[str, list[dict]] = {p: [] for p in engines}
                    for rnd in range(args.rounds + 1):  # round 0 warms SCV's cost model up
                        order = list(engines) if rnd % 2 == 0 else list(engines)[::-1]
                        for policy in order:
                            engines[policy][0].send((prompts, rates))
                            run = engines[policy][0].recv()
                            if rnd:
                                runs[policy].append(run)
                    tok_s = {p: round(statistics.median(r["tok_s"] for r in rs), 1)
                             for p, rs in runs.items()}
                    best_other = max(v for p, v in tok_s.items() if p != "scv")
                    cell = {"batch": batch, "workload": workload, "tok_s": tok_s,
                            "scv_over_best_other": round(tok_s["scv"] / best_other, 3),
                            "same_tokens_as_no_spec": all(
                                rs[0]["tokens"] == runs["no_spec"][0]["tokens"]
                                for rs in runs.values())}
                    print(cell, flush=True)
                    cells.append(cell)
        finally:
            for conn, process in engines.values():
                conn.send("stop")
                process.join(timeout=60)
    write_result(args.result, {
        **environment(), "benchmark": "scv_cpu",
        "workload": {"model": "tiny random-weight target (fp32), draft = the target",
                     "method": "draft_model",
                     "max_k": MAX_K, "prompt_len": 32, "max_tokens": args.max_tokens,
                     "rounds": args.rounds, "load": "every batch sent at once",
                     "acceptance": "per-request synthetic (scv_bench.workloads, k=4)"},
        "cells": cells,
    })


if __name__ == "__main__":
    main()

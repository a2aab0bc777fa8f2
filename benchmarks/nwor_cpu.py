"""NWOR's throughput on the CPU engine: ``make demo``'s workload, NWOR on over off, A/A beside.

Three engines at once in this process (the plugin installed in all three): vLLM alone
(``off``), NWOR on (``on``) and vLLM alone again (``off_b``, the A/A control). Each round gives
every engine ``make demo``'s requests (the shipped pair, draft_model k = 3, greedy, 6 requests x
96 tokens, :func:`vllm_nwor.testing.pair_demo_engine_args`) and then steps the engines in turn,
one engine step each, until all three are done, timing each engine's steps; the order turns
round by round. Taking turns step by step puts every engine in the same seconds of the host,
so a slow spell (another tenant on a shared machine) slows all three alike. Per round: each
engine's tokens per second of its own step time, ``on`` over ``off`` and ``off_b`` over ``off``.
The result gives each ratio's geometric mean over the rounds and its 95% interval (Student's t
on the log ratios), and checks that all three engines' greedy tokens are equal.

    python -m benchmarks.nwor_cpu [--rounds 12] [--result nwor_cpu_<date>_cpu.json]
"""

from __future__ import annotations

import argparse
import os
import time

from benchmarks.harness.results import environment, geomean_interval, write_result

ENGINES = {"off": {}, "on": {"nwor": True}, "off_b": {}}


def interleaved(engines: dict, prompts: list[str], params, order: list[str]) -> dict:
    """One round: every engine gets ``prompts``; then one step per engine, in ``order``, until
    all are done. Per engine: its steps' seconds and each request's tokens."""
    seconds = dict.fromkeys(order, 0.0)
    tokens: dict[str, dict[str, list[int]]] = {name: {} for name in order}
    for name in order:
        for i, prompt in enumerate(prompts):
            engines[name].add_request(str(i), prompt, params)
    running = list(order)
    while running:
        for name in list(running):
            engine = engines[name]
            start = time.perf_counter()
            outputs = engine.step()
            seconds[name] += time.perf_counter() - start
            for output in outputs:
                if output.finished:
                    tokens[name][output.request_id] = list(output.outputs[0].token_ids)
            if not engine.has_unfinished_requests():
                running.remove(name)
    return {name: {"seconds": seconds[name],
                   "tokens": [tokens[name][str(i)] for i in range(len(prompts))]}
            for name in order}


def measure(rounds: int) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # each engine core in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    from vllm_nwor.testing import (
        PAIR_DEMO_MAX_TOKENS,
        PAIR_DEMO_PROMPTS,
        pair_demo_engine_args,
        shipped_pair,
    )

    params = SamplingParams(max_tokens=PAIR_DEMO_MAX_TOKENS, temperature=0.0, ignore_eos=True)
    llms = {}
    for name, keys in ENGINES.items():  # one at a time: each sizes its KV cache at start-up
        llms[name] = LLM(**pair_demo_engine_args(*shipped_pair(), keys))
        llms[name].generate(PAIR_DEMO_PROMPTS, params, use_tqdm=False)  # the demo's warm-up
    engines = {name: llm.llm_engine for name, llm in llms.items()}
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    names = list(engines)
    for rnd in range(rounds):
        shift = rnd % len(names)
        result = interleaved(engines, PAIR_DEMO_PROMPTS, params, names[shift:] + names[:shift])
        for name, run in result.items():
            run["tok_s"] = sum(map(len, run["tokens"])) / run["seconds"]
            runs[name].append(run)
    for engine in engines.values():
        engine.engine_core.shutdown()
    tok_s = {name: [round(r["tok_s"], 1) for r in rs] for name, rs in runs.items()}
    same = all(r["tokens"] == runs["off"][0]["tokens"] for rs in runs.values() for r in rs)
    return {
        "rounds": rounds,
        "tok_s": tok_s,
        "on_over_off": geomean_interval(
            [a / b for a, b in zip(tok_s["on"], tok_s["off"], strict=True)]),
        "aa_off_b_over_off": geomean_interval(
            [a / b for a, b in zip(tok_s["off_b"], tok_s["off"], strict=True)]),
        "greedy_tokens_equal": same,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--result", help="the JSON under benchmarks/results/ to write")
    args = parser.parse_args()
    result = measure(args.rounds)
    print({k: v for k, v in result.items() if k != "tok_s"}, flush=True)
    if args.result:
        write_result(args.result, {
            **environment(), "benchmark": "nwor_cpu",
            "workload": "make demo's: the shipped pair (models/), draft_model k = 3, greedy, "
                        "6 requests x 96 tokens at once, fp32, block_size 32, max_num_seqs 8, "
                        "enforce_eager; three engines in one process, taking turns step by "
                        "step; tok_s is tokens over the engine's own step time",
            **result,
        })


if __name__ == "__main__":
    main()

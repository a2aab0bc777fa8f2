"""NWOR's throughput on the CPU engine: ``make demo``'s workload, NWOR on over off, A/A beside.

Three engines at once in this process (the plugin installed in all three): vLLM alone
(``off``), NWOR on (``on``) and vLLM alone again (``off_b``, the A/A control). Each round every
engine generates ``make demo``'s requests once (the shipped pair, draft_model k = 3, greedy, 6
requests x 96 tokens, :func:`vllm_nwor.testing.pair_demo_engine_args`); the order of the engines
turns round by round. Per round: tokens per second of ``on`` over ``off`` and of ``off_b`` over
``off``. The result gives each ratio's geometric mean over the rounds and its 95% interval
(Student's t on the log ratios), and checks that all three engines' greedy tokens are equal.

    python -m benchmarks.nwor_cpu [--rounds 12] [--result nwor_cpu_<date>_cpu.json]
"""

from __future__ import annotations

import argparse
import os
import time

from benchmarks.harness.results import environment, geomean_interval, write_result

ENGINES = {"off": {}, "on": {"nwor": True}, "off_b": {}}


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
    engines = {}
    for name, keys in ENGINES.items():  # one at a time: each sizes its KV cache at start-up
        engines[name] = LLM(**pair_demo_engine_args(*shipped_pair(), keys))
        engines[name].generate(PAIR_DEMO_PROMPTS, params, use_tqdm=False)  # the demo's warm-up
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    names = list(engines)
    for rnd in range(rounds):
        shift = rnd % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            outputs = engines[name].generate(PAIR_DEMO_PROMPTS, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            tokens = [list(o.outputs[0].token_ids) for o in outputs]
            runs[name].append({"tok_s": sum(map(len, tokens)) / seconds, "tokens": tokens})
    for llm in engines.values():
        llm.llm_engine.engine_core.shutdown()
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
                        "enforce_eager; three engines in one process, taking turns",
            **result,
        })


if __name__ == "__main__":
    main()

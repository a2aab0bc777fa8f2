"""NWOR's throughput on the CPU engine: ``make demo``'s workload, NWOR on over off, A/A beside.

Three engines at once in this process (the plugin installed in all three): vLLM alone
(``off``), NWOR on (``on``) and vLLM alone again (``off_b``, the A/A control), on ``make
demo``'s requests (the shipped pair, draft_model k = 3, greedy, 6 requests x 96 tokens,
:func:`vllm_nwor.testing.pair_demo_engine_args`). The engines take turns step by step, each
round with the order turned (:func:`vllm_nwor.testing.pair_demo_throughput`); a round's
throughput is an engine's tokens over its own steps' time. Per round: ``on`` over ``off`` and
``off_b`` over ``off``. The result gives each ratio's geometric mean over the rounds and its 95%
interval (Student's t on the log ratios), and checks that all three engines' greedy tokens are
equal.

    python -m benchmarks.nwor_cpu [--rounds 12] [--result nwor_cpu_<date>_cpu.json]
"""

from __future__ import annotations

import argparse
import os

from benchmarks.harness.results import environment, write_result
from vllm_nwor.testing import pair_demo_throughput

ENGINES = {"off": {}, "on": {"nwor": True}, "off_b": {}}


def measure(rounds: int) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    run = pair_demo_throughput(ENGINES, rounds)  # over "off", the first
    return {
        "rounds": rounds,
        "tok_s": run["tok_s"],
        "on_over_off": run["over_first"]["on"],
        "aa_off_b_over_off": run["over_first"]["off_b"],
        "greedy_tokens_equal": run["greedy_tokens_equal"],
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

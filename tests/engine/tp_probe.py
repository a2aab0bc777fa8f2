"""Run by test_tensor_parallel.py in a fresh process: one engine at tensor_parallel_size 2.

argv: target, draft, "on" or "off" (NWOR), and optionally a JSON object of more plugin keys
(SCV, the draft context window). Prints one ``SUMMARY <json>`` line: the greedy
requests' tokens and logprobs, vLLM's spec-decode stats, and with NWOR on every rank's counters
(read through ``collective_rpc``) and their combination (which raises if the ranks disagree).
"""

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from engine_utils import PROMPTS, engine, spec_config, spec_decode_stats
from vllm import SamplingParams


def main(target: str, draft: str, nwor: str, keys: str = "{}") -> None:
    import vllm_nwor
    from vllm_nwor.inspect import scv_policy

    config = spec_config("draft_model", draft, k=3, **({"nwor": True} if nwor == "on" else {}),
                         **json.loads(keys))
    # tensor_parallel_size=2 is what this test is about; the rest are engine_options' defaults.
    with engine(target, config, tensor_parallel_size=2) as llm:
        greedy = SamplingParams(max_tokens=40, temperature=0.0, logprobs=2)
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        greedy_outputs = llm.generate(prompts, greedy, use_tqdm=False)
        greedy_stats = spec_decode_stats(llm)
        # Then sampled requests, apart so that the greedy batches are the same on both sides:
        # their drafts are mostly rejected, and each rank would draw its own uniforms if the
        # verdict were not shared. Unseeded: a seeded request stops vLLM's CPU engine ("CPU
        # Generator does not use offset"), NWOR off too.
        llm.generate(prompts[:4], SamplingParams(max_tokens=40, temperature=0.8), use_tqdm=False)
        summary = {
            "tokens": [list(o.outputs[0].token_ids) for o in greedy_outputs],
            "logprobs": [[step[t].logprob for t, step in
                          zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)]
                         for o in greedy_outputs],
            "greedy_spec_stats": greedy_stats,
            "spec_stats": spec_decode_stats(llm),
            "rank_counters": llm.collective_rpc("nwor_counters"),
        }
        policy = scv_policy(llm)
        summary["scv_budgets"] = None if policy is None else list(policy.budget_counts)
        counters = vllm_nwor.get_counters(llm)
        summary["counters"] = None if counters is None else counters.as_dict()
    print("SUMMARY " + json.dumps(summary), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:5])

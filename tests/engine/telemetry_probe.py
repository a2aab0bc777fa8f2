"""Run by test_telemetry_engine.py in a fresh process; prints one JSON summary per run.

Two LLMs, one after the other: telemetry on with NWOR off, the engine core in its own process
(``SyncMPClient``) and log stats off (both the LLM defaults); then NWOR on with its default
telemetry, the engine core in this process (``InprocClient``) and log stats on.
argv: target checkpoint path.
"""

import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# vLLM compiles its CPU random sampler at start-up (about 20 s here); eager computes the same.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

from engine_utils import PROMPTS, engine, metric_values, spec_config
from vllm import SamplingParams

import vllm_nwor


def sequences(request_outputs) -> list[dict]:
    return [
        {
            "type": type(o.spec_decode_metrics).__qualname__,
            "index": o.index,
            "n": len(r.outputs),
            "num_tokens": len(o.token_ids),
            "finish_reason": o.finish_reason,
            "acceptance_lengths": o.spec_decode_metrics and o.spec_decode_metrics.per_step_accepted,
            "per_step_drafted": o.spec_decode_metrics and o.spec_decode_metrics.per_step_drafted,
        }
        for r in request_outputs
        for o in r.outputs
    ]


def run(target: str, speculative_config: dict, multiprocessing: bool, log_stats: bool) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocessing else "0"
    with engine(target, speculative_config, disable_log_stats=not log_stats) as llm:
        greedy = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
        )
        sampled = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS[:2]],
            SamplingParams(max_tokens=16, temperature=0.8, ignore_eos=True, n=2),
            use_tqdm=False,
        )
        counters = vllm_nwor.get_counters(llm)
        return {
            "client": type(llm.llm_engine.engine_core).__name__,
            "sequences": sequences([*greedy, *sampled]),
            "metrics": metric_values(llm) if log_stats else None,
            "nwor_counters": None if counters is None else counters.as_dict(),
        }


def main(target: str) -> None:
    runs = {
        "telemetry_only_mp": run(
            target, spec_config("ngram", nwor_telemetry=True), multiprocessing=True,
            log_stats=False,
        ),
        "nwor_inproc": run(
            target, spec_config("ngram", nwor=True), multiprocessing=False, log_stats=True
        ),
    }
    print("SUMMARY " + json.dumps(runs))


if __name__ == "__main__":
    main(sys.argv[1])

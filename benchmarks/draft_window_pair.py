"""Acceptance over a long generation on the shipped pair, and acceptance as a function of W.

The pair (docs/model_pair.md) was trained on 256-byte windows. To generate 2,048 tokens with a
target that stays in its training distribution, the target gets a 256-token sliding window
(``layer_types``/``sliding_window`` in a copy of its config written here); the draft keeps its
256 positions. Cases, each greedy with the same prompts (held-out standard-library code):

- ``plain``: no speculation (the reference tokens);
- ``vllm``: vLLM's draft_model path: once a request is longer than the draft's 256 positions,
  vLLM zeroes the drafts (of the whole batch), and acceptance drops to 0 for the rest of the run;
- ``vllm_full_context``: the draft's config claims 4,096 positions, so vLLM keeps drafting and
  the draft attends to the whole sequence, far beyond what it was trained on;
- ``window_W``: vllm-nwor's ``draft_context_window: W``.

Per case: acceptance (accepted / drafted) in each 256-position segment of the requests, from the
scheduler's per-step outputs, whether the tokens equal ``plain``, and wall time. Acceptance is a
property of the models and the greedy sequence, not of the device; this runs on the CPU (fp32).

    .venv/bin/python -m benchmarks.draft_window_pair \\
        --result benchmarks/results/draft_window_pair_<date>_cpu.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # reach the scheduler in-process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

SEGMENT = 256


def run(target: str, speculative: dict | None, prompts: list[list[int]], new_tokens: int):
    """Greedy tokens, per-request steps (position, drafted, accepted) and seconds."""
    from vllm import LLM, SamplingParams

    from vllm_nwor.inspect import scheduler_of

    llm = LLM(model=target, skip_tokenizer_init=True, dtype="float32",
              max_model_len=max(map(len, prompts)) + new_tokens + 16, max_num_seqs=len(prompts),
              enable_prefix_caching=False, enforce_eager=True, gpu_memory_utilization=0.3,
              seed=0, speculative_config=speculative)
    steps: dict[str, list[tuple[int, int, int]]] = collections.defaultdict(list)
    scheduler = scheduler_of(llm)
    update_from_output = scheduler.update_from_output

    def recording(scheduler_output, model_runner_output):
        sampled = model_runner_output.sampled_token_ids
        for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            row = model_runner_output.req_id_to_index.get(req_id)
            if row is not None and sampled and sampled[row]:
                position = scheduler.requests[req_id].num_tokens
                steps[req_id].append((position, len(drafts), len(sampled[row]) - 1))
        return update_from_output(scheduler_output, model_runner_output)

    scheduler.update_from_output = recording
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    llm.llm_engine.engine_core.shutdown()
    return [list(o.outputs[0].token_ids) for o in outputs], dict(steps), seconds


def by_segment(steps: dict[str, list[tuple[int, int, int]]]) -> list[dict]:
    accepted: collections.Counter = collections.Counter()
    drafted: collections.Counter = collections.Counter()
    for request_steps in steps.values():
        for position, num_drafts, num_accepted in request_steps:
            drafted[position // SEGMENT] += num_drafts
            accepted[position // SEGMENT] += num_accepted
    return [{"from": s * SEGMENT, "drafted": drafted[s], "accepted": accepted[s],
             "acceptance": round(accepted[s] / drafted[s], 4) if drafted[s] else None}
            for s in sorted(drafted)]


def main() -> None:
    from vllm_nwor.testing import held_out_prompt_ids, long_run_pair

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--windows", type=int, nargs="+", default=[16, 32, 64, 128, 192, 256])
    parser.add_argument("--new-tokens", type=int, default=2048)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--result", type=Path, required=True)
    args = parser.parse_args()
    from benchmarks.harness.results import environment, write_json

    prompts = held_out_prompt_ids(args.prompts)
    cases = []
    with tempfile.TemporaryDirectory() as root:
        target, draft, draft_full = long_run_pair(Path(root))
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": args.k}
        configs = {"plain": None, "vllm": spec,
                   "vllm_full_context": {**spec, "model": draft_full},
                   **{f"window_{w}": {**spec, "draft_context_window": w} for w in args.windows}}
        reference = None
        for name, speculative in configs.items():
            tokens, steps, seconds = run(target, speculative, prompts, args.new_tokens)
            reference = reference or tokens
            segments = by_segment(steps)
            late = [s for s in segments if s["from"] >= SEGMENT]
            case = {"case": name, "window": speculative and speculative.get(
                        "draft_context_window"),
                    "tokens_equal_plain": tokens == reference, "seconds": round(seconds, 1),
                    "acceptance_after_256": round(sum(s["accepted"] for s in late)
                                                  / max(1, sum(s["drafted"] for s in late)), 4),
                    "segments": segments}
            print(json.dumps({k: v for k, v in case.items() if k != "segments"}), flush=True)
            cases.append(case)
    payload = {**environment(), "benchmark": "draft_window_pair",
               "workload": {"prompts": len(prompts), "prompt_tokens": [len(p) for p in prompts],
                            "new_tokens": args.new_tokens, "k": args.k, "segment": SEGMENT,
                            "target": "models/pystd-target with a 256-token sliding window",
                            "draft": "models/pystd-draft (256 positions)", "dtype": "float32"},
               "cases": cases}
    write_json(args.result, payload)
    print(args.result)


if __name__ == "__main__":
    main()

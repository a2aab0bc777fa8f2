"""NWOR on the CPU: the same speculative workload with the plugin off and on, side by side.

Writes a tiny random-weight Llama target and a draft model (a noisy copy of it) to a temporary
directory, then runs vLLM 0.26's CPU engine with draft_model speculative decoding twice. It
prints the greedy outputs (identical), vLLM's spec-decode counters and NWOR's counters: every
rejected draft is a KV write the paged cache never received.

Run it with ``make demo-random`` (which builds the environment first).
"""

from __future__ import annotations

import os
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from vllm import LLM, SamplingParams  # noqa: E402

import vllm_nwor  # noqa: E402
from vllm_nwor.testing import write_tiny_llama_pair  # noqa: E402

PROMPTS = [[(7 * i + 13 * j) % 500 + 2 for j in range(n)] for i, n in enumerate([6, 24, 70, 13])]


def run(target: str, draft: str, nwor: bool) -> dict:
    speculative = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
    if nwor:
        speculative["nwor"] = True
    llm = LLM(
        model=target, skip_tokenizer_init=True, dtype="float32", max_model_len=512,
        block_size=32, max_num_seqs=4, max_num_batched_tokens=64, enforce_eager=True,
        gpu_memory_utilization=0.3, disable_log_stats=False, speculative_config=speculative,
    )
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    metrics = {m.name: m for m in llm.get_metrics()}
    result = {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "drafted": int(metrics["vllm:spec_decode_num_draft_tokens"].value),
        "accepted": int(metrics["vllm:spec_decode_num_accepted_tokens"].value),
        "counters": vllm_nwor.get_counters(llm),
        "seconds": elapsed,
    }
    llm.llm_engine.engine_core.shutdown()
    return result


def main() -> None:
    with tempfile.TemporaryDirectory() as root:
        target, draft = write_tiny_llama_pair(root, num_layers=3, draft_layers=3, draft_noise=0.08)
        print("vllm-nwor CPU demo: tiny random Llama, draft_model speculation, k=3\n")
        off = run(target, draft, nwor=False)
        on = run(target, draft, nwor=True)

    for i, tokens in enumerate(on["tokens"]):
        print(f"request {i}: {len(PROMPTS[i])} prompt tokens -> {tokens[:12]} ...")
    same = on["tokens"] == off["tokens"]
    print(f"\ngreedy outputs identical with NWOR on and off: {same}")
    print(f"vLLM spec decode: {on['drafted']} draft tokens, {on['accepted']} accepted")
    counters = on["counters"]
    print("\nNWOR counters (plugin on):")
    for key, value in counters.as_dict().items():
        print(f"  {key:22s} {value}")
    print(f"\nwall time: off {off['seconds']:.2f}s, on {on['seconds']:.2f}s "
          "(CPU reference attention; not a speed benchmark)")
    if not same or counters.tokens_committed != on["accepted"]:
        raise SystemExit("demo check failed")


if __name__ == "__main__":
    main()

"""vLLM 0.32 from the kit, alone (no plugin), on the GPU machine: draft_model and EAGLE-3
speculative decoding with FLASH_ATTN, torch.compile and CUDA graphs (vLLM's defaults for both),
on random-weight pairs written here. Prints one JSON line per method with what the engine
really ran (runner, attention implementation, compilation mode, CUDA graph mode) and what it
did (drafted and accepted tokens from vLLM's metrics, generated tokens, seconds).

    python3 scripts/gpu_kit/smoke.py [--out FILE]
"""

import argparse
import json
import os
import tempfile
import time

# The engine core in this process, to read its runner (one engine at a time on the GPU).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def run(method: str, root: str, backend: str) -> dict:
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    from vllm_nwor.testing import write_bigram_eagle_pair, write_tiny_llama_pair

    shape = dict(hidden_size=256, num_heads=4, num_kv_heads=2)  # head dim 64 for FlashAttention
    if method == "eagle3":
        target, draft = write_bigram_eagle_pair(os.path.join(root, method), eagle3=True, **shape)
    else:
        target, draft = write_tiny_llama_pair(os.path.join(root, method), num_layers=3,
                                              draft_layers=3, draft_noise=0.08, **shape)
    llm = LLM(model=target, skip_tokenizer_init=True, attention_backend=backend,
              speculative_config={"method": method, "model": draft, "num_speculative_tokens": 3},
              gpu_memory_utilization=0.3, disable_log_stats=False, seed=0)
    config = llm.llm_engine.vllm_config
    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    vocab = llm.llm_engine.model_config.get_vocab_size()
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % (vocab - 3) + 3 for j in range(40 + i)]}
               for i in range(32)]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    metrics = {m.name: m for m in llm.get_metrics()}

    def counter(name):
        return getattr(metrics.get(name), "value", None)

    row = {
        "method": method, "vllm": vllm.__version__, "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "runner": type(runner).__module__,
        "attention_backend": str(config.attention_config.backend),
        "compilation_mode": str(config.compilation_config.mode),
        "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
        "cudagraph_capture_sizes": len(config.compilation_config.cudagraph_capture_sizes or []),
        "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
        "drafted": counter("vllm:spec_decode_num_draft_tokens"),
        "accepted": counter("vllm:spec_decode_num_accepted_tokens"),
        "seconds": round(seconds, 2),
    }
    del llm
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="also write the rows here, one JSON per line")
    parser.add_argument("--methods", default="draft_model,eagle3")
    parser.add_argument("--backend", default="FLASH_ATTN", help="CPU_ATTN to try it on a CPU")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="smoke-")
    for method in args.methods.split(","):
        try:
            row = run(method, root, args.backend)
        except Exception as error:  # the other method still runs
            row = {"method": method, "error": f"{type(error).__name__}: {error}"[-3000:]}
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()

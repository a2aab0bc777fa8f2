"""Run by test_plugin_off.py in a fresh process: one engine run, summarised as JSON on stdout.

argv: target checkpoint path. The caller decides (through VLLM_PLUGINS) whether the plugin loads.
"""

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from engine_utils import engine, runner_of, spec_config, spec_decode_stats
from vllm import SamplingParams

from engine_utils import PROMPTS  # isort: skip


def main(target: str) -> None:
    from vllm_nwor.inspect import interceptor_of
    from vllm_nwor.patches import all_patches

    with engine(target, spec_config("ngram")) as llm:
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        runner = runner_of(llm)
        summary = {
            "tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "logprobs": [
                [{str(k): v.logprob for k, v in step.items()} for step in o.outputs[0].logprobs]
                for o in outputs
            ],
            "spec_stats": spec_decode_stats(llm),
            "config_hash": runner.vllm_config.compute_hash(),
            "additional_config": runner.vllm_config.additional_config,
            # what the plugin set on the runner (nothing where it is not loaded)
            "plugin_attributes": sorted(name for name in vars(runner) if "nwor" in name),
            "interceptor": repr(interceptor_of(runner)),
            "patches_applied": sum(p.is_applied() for p in all_patches()),
            "output_types": sorted({type(c).__name__ for o in outputs for c in o.outputs}),
            # vLLM's per-request metrics stay at its default (none) with the plugin off.
            "spec_decode_metrics": sorted({str(c.spec_decode_metrics) for o in outputs
                                           for c in o.outputs}),
            "plugin_metrics": sorted(
                {m.name for m in llm.get_metrics() if m.name.startswith(("vllm:nwor", "vllm:scv"))}
            ),
        }
    print("SUMMARY " + json.dumps(summary))


if __name__ == "__main__":
    main(sys.argv[1])

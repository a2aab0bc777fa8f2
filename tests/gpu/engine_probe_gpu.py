"""Run by test_engine_gpu.py in a fresh process: one GPU engine run, summarised as JSON.

argv: a JSON spec, the output path. The spec: target, draft, method, ``speculative`` (extra
speculative-config keys, plugin keys included), ``engine`` (extra LLM keyword arguments),
``audit`` (per-step cache audit), ``inject_every`` (fail every N-th commit; 0 = never),
``prompts`` (token lists; default PROMPTS), ``max_tokens``, ``draft_model_max_positions`` (a
copy of the draft told it handles that many positions), ``draft_pass_every_step`` (keep vLLM's
draft pass on chunk-0 steps: lazy draft sync off), ``sampling`` (SamplingParams keys over the
greedy default), ``rates`` (per-request synthetic acceptance rates, one per prompt in turn),
``v2`` (the engine must run vLLM's V2 model runner: EAGLE, EAGLE-3 and MTP on a
dense model do by default; the test sets ``VLLM_USE_V2_MODEL_RUNNER=0`` for V1).

Methods: ngram, ngram_gpu, draft_model, eagle and eagle3 (``draft`` is the head), mtp (the
target's own MTP layer).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from vllm import LLM, SamplingParams

import vllm_nwor
from tests.support.cache_audit import (
    CacheAudit,
    is_v2_runner,
    read_flash_attn_tokens,
    runner_of,
)
from tests.support.step_record import record_dispatches
from vllm_nwor.inspect import (
    disable_lazy_draft_sync,
    interceptor_of,
    lazy_draft_sync,
    scheduler_of,
)
from vllm_nwor.inspect import scv_policy as policy_of
from vllm_nwor.patches.nwor.model_runner import attention_layers

PROMPTS = [
    [(7 * i + 13 * j) % 500 + 2 for j in range(length)]
    for i, length in enumerate([5, 14, 23, 90, 40, 7, 61, 33])
]


def _limited_copy(draft: str, max_positions: int) -> str:
    import shutil
    import tempfile

    copy = Path(tempfile.mkdtemp()) / "draft"
    shutil.copytree(draft, copy)
    config = json.loads((copy / "config.json").read_text())
    config["max_position_embeddings"] = max_positions
    (copy / "config.json").write_text(json.dumps(config))
    return str(copy)


def main(spec: dict, out_path: str) -> None:
    audit, inject_every = spec.get("audit", False), spec.get("inject_every", 0)
    if spec["method"] in ("ngram", "ngram_gpu"):
        speculative = {"method": spec["method"], "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    elif spec["method"] == "mtp":
        speculative = {"method": "mtp"}
    elif spec["method"] in ("eagle", "eagle3"):
        speculative = {"method": spec["method"], "model": spec["draft"]}
    else:
        draft = spec["draft"]
        if spec.get("draft_model_max_positions"):
            draft = _limited_copy(draft, spec["draft_model_max_positions"])
        speculative = {"method": "draft_model", "model": draft}
    speculative = {**speculative, "num_speculative_tokens": 3, **spec.get("speculative", {})}
    engine = dict(
        model=spec["target"], skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512,
        block_size=16, max_num_seqs=4, max_num_batched_tokens=64, gpu_memory_utilization=0.15,
        disable_log_stats=False, seed=0,
        # On V1 the audit reads exact per-step KV lengths on the host, which async scheduling
        # defers (V2 keeps them on the GPU, where the audit reads them after each step).
        async_scheduling=False if audit and not spec.get("v2") else None,
    )
    llm = LLM(speculative_config=speculative, **{**engine, **spec.get("engine", {})})
    runner = runner_of(llm)
    if is_v2_runner(runner) != bool(spec.get("v2")):
        raise RuntimeError(f"expected the {'V2' if spec.get('v2') else 'V1'} model runner, "
                           f"got {type(runner).__module__}")
    if spec.get("draft_pass_every_step"):
        disable_lazy_draft_sync(runner)
    layers = attention_layers(runner.get_model())
    cache_audit = CacheAudit(runner, layers, read_flash_attn_tokens, 16) if audit else None
    interceptor = interceptor_of(runner)
    if inject_every and interceptor is not None:
        commit_fn, calls = interceptor.commit_fn, [0]

        def flaky_commit(verdict):
            calls[0] += 1
            if calls[0] % inject_every == 0:
                raise RuntimeError("injected commit failure")
            commit_fn(verdict)

        interceptor.commit_fn = flaky_commit
    dispatches = record_dispatches(runner)
    base = SamplingParams(**{"max_tokens": spec.get("max_tokens", 40), "temperature": 0.0,
                             "ignore_eos": True, **spec.get("sampling", {})})
    params = base
    prompts = spec.get("prompts", PROMPTS)
    if spec.get("rates"):  # per-request synthetic acceptance, one rate per prompt in turn
        rates = spec["rates"]
        params = [base.clone() for _ in prompts]
        for i, p in enumerate(params):
            p.extra_args = {"synthetic_acceptance_rate": rates[i % len(rates)]}
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    policy = policy_of(llm)
    again = None
    if spec.get("idle_then_again"):  # the engine idles, then serves the prompts again
        time.sleep(spec["idle_then_again"])
        before = sum(seconds for _, seconds in policy.budget_seconds)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        again = {"seconds": time.perf_counter() - start,
                 "step_seconds": sum(seconds for _, seconds in policy.budget_seconds) - before}
    metrics = {m.name: m for m in llm.get_metrics()}
    counters = vllm_nwor.get_counters(llm)
    lazy = lazy_draft_sync(runner)
    summary = {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "logprobs": [[step[t].logprob for t, step in
                      zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)]
                     for o in outputs] if base.logprobs is not None else None,
        "runner": type(runner).__module__,
        "acceptance": [getattr(o.outputs[0].spec_decode_metrics, "per_step_accepted", None)
                       for o in outputs],
        "scv_budgets": policy.budget_counts if policy is not None else None,
        "draft_sync": {"skipped_steps": lazy.skipped_steps,
                       "caught_up_tokens": lazy.caught_up_tokens} if lazy else None,
        "drafted": int(metrics["vllm:spec_decode_num_draft_tokens"].value),
        "accepted": int(metrics["vllm:spec_decode_num_accepted_tokens"].value),
        "prefix_cache_hits": int(metrics["vllm:prefix_cache_hits"].value),
        "counters": counters.as_dict() if counters else None,
        "graph_steps": interceptor.graph_steps if interceptor is not None else None,
        "cudagraph_mode": str(runner.compilation_config.cudagraph_mode),
        "dispatches": dispatches,
        "attention_impl": type(layers[0].impl).__name__,
        # Blocks in the workers' cache, and in the scheduler's pool (NWOR keeps its scratch).
        "kv_blocks": {"cache": int(layers[0].kv_cache.shape[0]),
                      "scheduler": scheduler_of(llm).kv_cache_manager.block_pool.num_gpu_blocks},
        "async_scheduling": bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling),
        "again": again,
        "audit": None if cache_audit is None else {
            "violations": cache_audit.violations[:20],
            "num_violations": len(cache_audit.violations),
            "drafted": cache_audit.drafted,
            "accepted": cache_audit.accepted,
            "rejected_drafts": cache_audit.rejected_drafts,
            "checked_tokens": cache_audit.checked_tokens,
        },
    }
    Path(out_path).write_text(json.dumps(summary))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), sys.argv[2])

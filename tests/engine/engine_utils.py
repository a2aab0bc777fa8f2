"""Helpers for engine tests: build an LLM, generate, read vLLM's and NWOR's numbers."""

from __future__ import annotations

import collections
import gc
import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from vllm import LLM, SamplingParams

from tests.support import pythonpath
from tests.support.cache_audit import runner_of
from vllm_nwor.inspect import scheduler_of

# Mixed prompt lengths; the longest exceed max_num_batched_tokens, so they are prefilled in
# chunks while other requests are in verify steps.
PROMPTS = [
    [(7 * i + 13 * j) % 500 + 2 for j in range(length)]
    for i, length in enumerate([5, 14, 23, 90, 40, 7, 61, 33])
]


def spec_config(method: str, draft_path: str | None = None, k: int = 3, **extra) -> dict:
    if method == "ngram":
        config = {"method": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    elif method in ("draft_model", "eagle", "eagle3"):
        config = {"method": method, "model": draft_path}
    else:
        raise ValueError(method)
    return {**config, "num_speculative_tokens": k, **extra}


def engine_options(target: str, speculative_config: dict | None, **kwargs: Any) -> dict:
    """``LLM``'s keyword arguments for the tests' small engines (``kwargs`` override them).

    vLLM's defaults stand (prefix caching on, its choice of scheduling, chunked prefill, EOS
    live) but for a small engine's sizes and one departure: ``enforce_eager``, because the CPU
    engine's torch.compile costs every engine start tens of seconds; compiled engines run in
    test_equivalence.py and the equivalence matrix (benchmarks/equivalence.py)."""
    options = dict(
        model=target,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=512,
        block_size=32,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        disable_log_stats=False,
        seed=0,
    )
    options.update(kwargs)
    return {**options, "speculative_config": speculative_config}


@contextmanager
def engine(target: str, speculative_config: dict | None, **kwargs: Any) -> Iterator[LLM]:
    llm = LLM(**engine_options(target, speculative_config, **kwargs))
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def generate(llm: LLM, prompts=PROMPTS, max_tokens: int = 40) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def generate_with_logprobs(llm: LLM, prompts=PROMPTS,
                           max_tokens: int = 40) -> tuple[list, list, list]:
    """Greedy tokens and each one's logprob, per prompt, and the outputs themselves."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [[step[t].logprob for t, step in zip(ids, o.outputs[0].logprobs, strict=True)]
                for ids, o in zip(tokens, outputs, strict=True)]
    return tokens, logprobs, outputs


def spec_decode_stats(llm: LLM) -> tuple[int, int]:
    """(draft tokens, accepted tokens) from vLLM's own spec-decode counters."""
    metrics = {m.name: m for m in llm.get_metrics()}
    return (
        int(metrics["vllm:spec_decode_num_draft_tokens"].value),
        int(metrics["vllm:spec_decode_num_accepted_tokens"].value),
    )


def target_layers(llm: LLM) -> list:
    from vllm_nwor.patches.nwor.model_runner import attention_layers

    return attention_layers(runner_of(llm).get_model())


def metric_values(llm) -> dict[str, float]:
    """Counters by name; histograms as name_count / name_sum."""
    values = {}
    for metric in llm.get_metrics():
        if hasattr(metric, "count"):
            values[f"{metric.name}_count"] = metric.count
            values[f"{metric.name}_sum"] = metric.sum
        elif hasattr(metric, "value"):
            values[metric.name] = metric.value
    return values


def run_probe(script: str, args: list[str], env: dict[str, str], timeout: int) -> dict:
    """Runs ``script`` (a probe beside these tests) with ``args`` in a fresh process, the
    repository root on its ``PYTHONPATH`` (``tests.support``); returns the JSON of its last
    ``SUMMARY`` line."""
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).parent / script), *args],
        cwd=Path(__file__).parent, env={**env, "PYTHONPATH": pythonpath(env=env)},
        capture_output=True, text=True, timeout=timeout,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("SUMMARY ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("SUMMARY "))


def assert_counters_agree(counters, drafted: int, accepted: int) -> None:
    """NWOR's counters against vLLM's spec-decode stats: every draft staged, the accepted ones
    committed, the rest rejected, no fallback."""
    assert counters.fallbacks == {}
    assert counters.tokens_staged == drafted
    assert counters.tokens_committed == accepted
    assert counters.tokens_rejected == drafted - accepted


def record_chunks(llm) -> dict[str, list[int]]:
    """Per request (by its index in the batch), the drafts scheduled in each of its steps."""
    scheduler = scheduler_of(llm)
    chunks: dict[str, list[int]] = collections.defaultdict(list)
    schedule = scheduler.schedule

    def recording_schedule(*args, **kwargs):
        out = schedule(*args, **kwargs)
        for req_id in out.num_scheduled_tokens:
            drafts = out.scheduled_spec_decode_tokens.get(req_id, ())
            chunks[req_id.split("-")[0]].append(len(drafts))
        return out

    scheduler.schedule = recording_schedule
    return chunks

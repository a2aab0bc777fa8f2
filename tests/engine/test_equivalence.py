"""NWOR on vs off on the real CPU engine: identical greedy tokens, counters that match vLLM's.

Each run mixes prompt lengths, has more prompts than ``max_num_seqs`` (new prompts join while
others verify) and prompts longer than ``max_num_batched_tokens`` (chunked prefill), so verify
steps share batches with prefill chunks. The tests assert that all of this actually happened.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from engine_utils import (
    assert_counters_agree,
    engine,
    generate,
    runner_of,
    spec_config,
    spec_decode_stats,
)

import vllm_nwor

CASES = {
    "ngram": dict(method="ngram", compiled=False),
    "draft_model": dict(method="draft_model", compiled=False),
    # Dynamo traces the model (custom ops stay opaque) with the eager backend, as vLLM's CPU CI.
    "ngram-compiled": dict(method="ngram", compiled=True),
}


def _run(tiny_models, method: str, compiled: bool, nwor: bool) -> dict:
    target, draft = tiny_models
    kwargs = {}
    if compiled:
        os.environ["VLLM_CPU_CI_ENV"] = "1"
        kwargs["enforce_eager"] = False
    speculative = spec_config(method, draft, nwor=True) if nwor else spec_config(method, draft)
    try:
        with engine(target, speculative, **kwargs) as llm:
            steps: list[tuple[tuple[int, ...], np.ndarray]] = []
            runner = runner_of(llm)
            interceptor = vllm_nwor.inspect.interceptor_of(runner)
            if interceptor is not None:
                begin = interceptor.begin

                def recording_begin(step):
                    if step is not None:
                        n = len(step.num_draft_tokens)
                        rows = np.diff(runner.query_start_loc.np[: n + 1])
                        steps.append((step.num_draft_tokens, rows))
                    return begin(step)

                interceptor.begin = recording_begin
            tokens = generate(llm)
            return dict(
                tokens=tokens,
                stats=spec_decode_stats(llm),
                counters=vllm_nwor.get_counters(llm),
                steps=steps,
            )
    finally:
        os.environ.pop("VLLM_CPU_CI_ENV", None)


@pytest.fixture(scope="module", params=list(CASES))
def runs(request, tiny_models):
    case = CASES[request.param]
    return {nwor: _run(tiny_models, nwor=nwor, **case) for nwor in (False, True)}


def test_greedy_tokens_are_identical_with_nwor_on_and_off(runs):
    assert runs[True]["tokens"] == runs[False]["tokens"]
    assert runs[True]["stats"] == runs[False]["stats"]


def test_the_runs_had_accepts_rejects_and_mixed_batches(runs):
    drafted, accepted = runs[True]["stats"]
    assert 0 < accepted < drafted, "need both accepted and rejected drafts"
    steps = runs[True]["steps"]
    assert steps, "no verify step was staged"
    mixed = [
        (drafts, rows)
        for drafts, rows in steps
        if any(d > 0 for d in drafts)
        and any(d == 0 and r > 1 for d, r in zip(drafts, rows, strict=True))
    ]
    assert mixed, "no verify step shared its batch with a prefill chunk"
    assert any(len(drafts) > 1 for drafts, _ in steps), "no verify step had several requests"


def test_counters_agree_with_vllm_spec_decode_stats(runs):
    drafted, accepted = runs[True]["stats"]
    counters = runs[True]["counters"]
    assert_counters_agree(counters, drafted, accepted)
    assert counters.verify_steps_staged == len(runs[True]["steps"])
    # 3 layers x (K + V) x 2 KV heads x head size 32 x fp32
    assert counters.rejected_kv_bytes == (drafted - accepted) * 3 * 2 * 2 * 32 * 4
    assert runs[False]["counters"] is None

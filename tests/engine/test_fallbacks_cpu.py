"""Fallbacks on the real CPU engine: a failure anywhere in a staged step leaves the output exact.

Failures are injected, on some verify steps, into NWOR's own parts of the step (reached through
``vllm_nwor.inspect``): the commit, one layer's stage, one layer's attention through the scratch
blocks. Each is counted by its reason and sends the step to vLLM's write (the kept rows written
back through it), and the greedy tokens and their logprobs equal NWOR off's. The cache audit
checks every step: no committed token is ever missing. A failed commit still writes only the
accepted drafts; a stage or attention failure has no verdict yet, so it writes every draft, as
vLLM does.
"""

from __future__ import annotations

import pytest
from engine_utils import (
    engine,
    generate_with_logprobs,
    runner_of,
    spec_config,
    spec_decode_stats,
    target_layers,
)

import vllm_nwor
from tests.support.cache_audit import CacheAudit, read_cpu_attn_tokens

FAILING_LAYER = 1  # of the tiny target's 3: layers before and after it were staged


def _fail_commit(interceptor, layers) -> None:
    commit, calls = interceptor.commit_fn, [0]

    def failing(verdict):
        calls[0] += 1
        if calls[0] % 3 == 0:
            raise RuntimeError("injected commit failure")
        return commit(verdict)

    interceptor.commit_fn = failing


def _fail_stage(interceptor, layers) -> None:
    stage, calls = interceptor.stage_fn, [0]

    def failing(layer_idx, *args):
        calls[0] += layer_idx == FAILING_LAYER
        if layer_idx == FAILING_LAYER and calls[0] % 4 == 0:
            raise RuntimeError("injected stage failure")
        return stage(layer_idx, *args)

    interceptor.stage_fn = failing


def _fail_attention(interceptor, layers) -> None:
    scratch = vllm_nwor.inspect.layer_binding(layers[FAILING_LAYER]).backend_state
    metadata, calls = scratch.metadata, [0]

    def failing(attn_metadata):
        calls[0] += 1
        if calls[0] % 5 == 0:
            raise RuntimeError("injected attention failure")
        return metadata(attn_metadata)

    scratch.metadata = failing


INJECT = {"commit": (_fail_commit, "commit_error"), "stage": (_fail_stage, "stage_error"),
          "attention": (_fail_attention, "stage_error")}


def _run(tiny_models, inject: str | None) -> dict:
    target, draft = tiny_models
    speculative = spec_config("draft_model", draft, **({"nwor": True} if inject else {}))
    with engine(target, speculative) as llm:
        layers = target_layers(llm)
        block_size = llm.llm_engine.vllm_config.cache_config.block_size
        audit = CacheAudit(runner_of(llm), layers, read_cpu_attn_tokens, block_size)
        if inject:
            INJECT[inject][0](vllm_nwor.inspect.interceptor_of(runner_of(llm)), layers)
        tokens, logprobs, _ = generate_with_logprobs(llm)
        return {
            "tokens": tokens,
            "logprobs": logprobs,
            "stats": spec_decode_stats(llm),
            "counters": vllm_nwor.get_counters(llm),
            "audit": audit,
        }


@pytest.fixture(scope="module")
def plugin_off(tiny_models):
    return _run(tiny_models, None)


@pytest.mark.parametrize("inject", list(INJECT))
def test_a_failed_part_of_a_staged_step_falls_back_exactly(tiny_models, plugin_off, inject):
    run = _run(tiny_models, inject)
    assert run["tokens"] == plugin_off["tokens"]
    assert run["logprobs"] == plugin_off["logprobs"]
    assert run["stats"] == plugin_off["stats"]
    fallbacks = run["counters"].fallbacks
    reason = INJECT[inject][1]
    assert set(fallbacks) == {reason} and fallbacks[reason] > 0, fallbacks
    assert run["counters"].verify_steps_staged > fallbacks[reason], "most steps still staged"
    audit = run["audit"]
    assert audit.checked_tokens > 0
    assert not any("missing" in v for v in audit.violations), audit.violations[:3]
    if inject == "commit":  # the verdict was known: only accepted drafts written
        assert audit.violations == []

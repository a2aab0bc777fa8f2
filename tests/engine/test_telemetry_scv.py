"""Telemetry with SCV on the real CPU engine: chunk-0 steps add no acceptance-length entry.

SCV can give a request no drafts for a step (chunk 0); that step is a plain decode, not a
speculative step, so ``acceptance_lengths`` must skip it, while ``vllm:scv_chunk_size`` counts it
at 0 and ``vllm:scv_chunk_zero_steps`` counts it. The ground truth is read from the scheduler
itself: every step's scheduled drafts and sampled tokens, per request.

draft_model proposes drafts for every request whenever the draft budget is above 0, so here a
decode step without drafts happens exactly when SCV planned chunk 0 (its warm-up explores
budgets and chunk sizes 0 included, from a fixed seed).
"""

from __future__ import annotations

import collections

import pytest
from engine_utils import PROMPTS, engine, metric_values, spec_config
from vllm import SamplingParams

import vllm_nwor
from vllm_nwor.inspect import scheduler_of

pytestmark = pytest.mark.engine


def record_steps(llm) -> dict[str, list[tuple[bool, int, int | None]]]:
    """Per request: (prefill, scheduled drafts, accepted drafts or None) for each of its steps."""
    scheduler = scheduler_of(llm)
    steps: dict[str, list[tuple[bool, int, int | None]]] = collections.defaultdict(list)
    update_from_output = scheduler.update_from_output

    def recording(scheduler_output, model_runner_output):
        sampled = model_runner_output.sampled_token_ids
        rows = model_runner_output.req_id_to_index
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            request = scheduler.requests[req_id]
            # num_computed_tokens already counts this step's scheduled tokens.
            prefill = request.num_computed_tokens - scheduled < request.num_prompt_tokens
            drafts = len(scheduler_output.scheduled_spec_decode_tokens.get(req_id, ()))
            accepted = len(sampled[rows[req_id]]) - 1 if drafts else None
            steps[req_id.split("-")[0]].append((prefill, drafts, accepted))
        return update_from_output(scheduler_output, model_runner_output)

    scheduler.update_from_output = recording
    return steps


@pytest.fixture(scope="module")
def scv_run(tiny_models) -> dict:
    target, draft = tiny_models
    speculative = spec_config("draft_model", draft, scv="adaptive", nwor=True)
    with engine(target, speculative) as llm:
        steps = record_steps(llm)
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
        )
        return {
            "steps": dict(steps),
            "lengths": {o.request_id.split("-")[0]: o.outputs[0].spec_decode_metrics
                        .per_step_accepted for o in outputs},
            "drafted": {o.request_id.split("-")[0]: o.outputs[0].spec_decode_metrics
                        .per_step_drafted for o in outputs},
            "metrics": metric_values(llm),
            "counters": vllm_nwor.get_counters(llm),
        }


def chunk_zero_steps(history) -> int:
    return sum(1 for prefill, drafts, _ in history if not prefill and drafts == 0)


def test_acceptance_lengths_have_one_entry_per_step_with_drafts_and_none_at_chunk_0(scv_run):
    steps, lengths = scv_run["steps"], scv_run["lengths"]
    assert set(lengths) == set(steps)
    for req, history in steps.items():
        expected = [accepted for _, drafts, accepted in history if drafts]
        assert lengths[req] == expected, (req, history)
        assert scv_run["drafted"][req] == [drafts for _, drafts, _ in history if drafts]
    # The workload must put requests at chunk 0 between speculative steps, or this checks
    # nothing: a spurious entry for such a step would land inside the list.
    between = [req for req, history in steps.items()
               if any(not p and d == 0 for p, d, _ in history[1:-1])
               and any(d for _, d, _ in history)]
    assert len(between) >= 2, steps


def test_chunk_size_metrics_count_chunk_0_steps_and_speculative_steps(scv_run):
    steps, metrics = scv_run["steps"].values(), scv_run["metrics"]
    spec_steps = sum(1 for history in steps for _, drafts, _ in history if drafts)
    drafted = sum(drafts for history in steps for _, drafts, _ in history)
    zero = sum(chunk_zero_steps(history) for history in steps)
    assert zero > 0 and spec_steps > 0
    assert metrics["vllm:scv_chunk_zero_steps"] == zero
    assert metrics["vllm:scv_chunk_size_count"] == spec_steps + zero
    assert metrics["vllm:scv_chunk_size_sum"] == drafted
    # vLLM's own counters see the speculative steps only, as acceptance_lengths does.
    assert metrics["vllm:spec_decode_num_drafts"] == spec_steps
    assert metrics["vllm:spec_decode_num_draft_tokens"] == drafted
    # NWOR staged exactly the chunks SCV let through.
    counters = scv_run["counters"]
    assert counters.fallbacks == {} and counters.tokens_staged == drafted

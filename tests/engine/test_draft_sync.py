"""Lazy draft sync on the real CPU engine: chunk-0 steps skip the draft model, and the catch-up
before a request is drafted again leaves the draft exactly as if it had never skipped.

SCV is held at chunk 0 by a pinned cost model and probes every 4 steps, so the draft model is
skipped on most steps (prompt chunks included: the long prompts are prefilled in chunks) and a
request is caught up at its own probes (one not probed at a drafting step stays behind). The
same workload with vLLM's draft pass kept on every step (the runner's lazy-sync state set to
False) must propose the same drafts: the probes accept the same numbers of tokens, request by
request and step by step.
"""

from __future__ import annotations

import pytest
from engine_utils import PROMPTS, engine, spec_config
from vllm import SamplingParams

from tests.support.cache_audit import runner_of
from vllm_nwor.inspect import disable_lazy_draft_sync, lazy_draft_sync, scv_policy
from vllm_nwor.patches.scv.draft_sync import LazyDraftSync

# Probes every 4 steps whatever they cost (scv_probe_cost 1): under this pinned cost model a
# step that drafts only to probe costs more than a plain one, so the default share (1%) would
# leave almost no probes to catch up for.
HELD_AT_ZERO = {"scv": "adaptive", "scv_cost_model": [0.001, 1.0, 1.0], "scv_probe_interval": 4,
                "scv_probe_cost": 1.0}


def run(tiny_models, lazy: bool, fail_catch_up: bool = False, **keys) -> dict:
    target, draft = tiny_models
    with engine(target, spec_config("draft_model", draft, **HELD_AT_ZERO, **keys)) as llm:
        if not lazy:
            disable_lazy_draft_sync(runner_of(llm))  # vLLM's pass on every step
        if fail_catch_up:
            def failing_pass(*args):
                raise RuntimeError("injected catch-up failure")

            LazyDraftSync._draft_pass, saved = failing_pass, LazyDraftSync._draft_pass
        policy, caught_up = scv_policy(llm), []
        plan = policy.plan

        def counted_plan(*args, **kwargs):  # the positions the policy expects caught up
            result = plan(*args, **kwargs)
            caught_up.append(policy.caught_up)
            return result

        policy.plan = counted_plan
        params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
        try:
            outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                   use_tqdm=False)
        finally:
            if fail_catch_up:
                LazyDraftSync._draft_pass = saved
        state = lazy_draft_sync(runner_of(llm))
        return {
            "tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "acceptance": [o.outputs[0].spec_decode_metrics.per_step_accepted for o in outputs],
            "skipped_steps": state.skipped_steps if state else 0,
            "caught_up_tokens": state.caught_up_tokens if state else 0,
            "kept_behind": state.kept_behind if state else 0,
            "policy_caught_up": sum(caught_up),
            "catching_up": policy.cost.coefficients.catching_up,
        }


@pytest.fixture(scope="module")
def runs(tiny_models):
    return {"lazy": run(tiny_models, lazy=True), "every_step": run(tiny_models, lazy=False)}


@pytest.fixture(scope="module")
def windowed_runs(tiny_models):
    """With a draft context window shorter than most requests: the catch-up attends through
    the same sliding window as vLLM's pass."""
    window = {"draft_context_window": 32}
    return {"lazy": run(tiny_models, lazy=True, **window),
            "every_step": run(tiny_models, lazy=False, **window)}


def test_the_draft_model_is_skipped_and_caught_up(runs):
    lazy = runs["lazy"]
    assert lazy["skipped_steps"] > 20
    # More than the decode tokens between probes: prompt chunks were caught up too.
    assert lazy["caught_up_tokens"] > sum(len(p) for p in PROMPTS)
    # Probes back off per request, so some drafting steps leave requests behind at chunk 0
    # (their catch-up waits for their own probe; the drafts test below checks it).
    assert lazy["kept_behind"] > 0
    assert runs["every_step"]["skipped_steps"] == 0


def test_the_policy_counts_the_positions_the_draft_sync_catches_up(runs):
    """SCV prices catch-ups from its own account of each request's positions behind: it
    matches what the runner caught up, prompt chunks included."""
    lazy = runs["lazy"]
    assert lazy["caught_up_tokens"] > 0
    assert lazy["policy_caught_up"] == lazy["caught_up_tokens"]


@pytest.mark.parametrize("which", ["runs", "windowed_runs"])
def test_drafts_after_a_catch_up_are_those_of_a_draft_that_never_skipped(which, request):
    lazy, every_step = (request.getfixturevalue(which)[k] for k in ("lazy", "every_step"))
    assert lazy["skipped_steps"] > 20
    assert lazy["acceptance"] == every_step["acceptance"]
    probes = [a for per_request in lazy["acceptance"] for a in per_request]
    assert len(probes) > 20 and 0 < sum(probes) < len(probes)  # probes accept and reject


def test_greedy_output_is_unchanged(tiny_models, runs):
    target, _ = tiny_models
    with engine(target, None) as llm:
        params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                               use_tqdm=False)
    assert runs["lazy"]["tokens"] == [list(o.outputs[0].token_ids) for o in outputs]


def test_a_failed_catch_up_falls_back_to_the_draft_pass_on_every_step(tiny_models, runs):
    failed = run(tiny_models, lazy=True, fail_catch_up=True)
    assert failed["tokens"] == runs["lazy"]["tokens"]
    assert failed["skipped_steps"] == 0  # the state is gone: vLLM's pass from then on

"""Draft context window: a long request no longer takes the whole batch's drafts with it.

The draft model is told it handles 128 positions. One request is short (20 prompt tokens), one
is longer than that (300). vLLM alone zeroes the drafts of the *whole batch* while the long
request runs; with ``draft_context_window`` both keep drafting, the long one from its last W
tokens. Greedy outputs equal plain decoding in every case.
"""

from __future__ import annotations

import collections

import pytest
from engine_utils import engine, generate

from vllm_nwor.inspect import scheduler_of

PROMPTS = [[(7 * i + 13 * j) % 500 + 2 for j in range(n)] for i, n in enumerate([20, 300])]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from vllm_nwor.testing import write_tiny_llama_pair

    return write_tiny_llama_pair(tmp_path_factory.mktemp("window-pair"), num_layers=3,
                                 draft_layers=3, draft_noise=0.02,
                                 draft_max_position_embeddings=128)


def run(target: str, speculative: dict | None) -> dict:
    with engine(target, speculative) as llm:
        accepted: dict[str, int] = collections.Counter()
        drafted: dict[str, int] = collections.Counter()
        zero_drafts: dict[str, int] = collections.Counter()
        scheduler = scheduler_of(llm)
        update_from_output = scheduler.update_from_output

        def recording(scheduler_output, model_runner_output):
            sampled = model_runner_output.sampled_token_ids
            for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
                row = model_runner_output.req_id_to_index.get(req_id)
                if row is not None and sampled and sampled[row]:
                    index = req_id.split("-")[0]
                    drafted[index] += len(drafts)
                    zero_drafts[index] += sum(1 for t in drafts if t == 0)
                    accepted[index] += len(sampled[row]) - 1
            return update_from_output(scheduler_output, model_runner_output)

        scheduler.update_from_output = recording
        tokens = generate(llm, PROMPTS, max_tokens=60)
    return {"tokens": tokens, "accepted": accepted, "drafted": drafted,
            "zero_drafts": zero_drafts}


@pytest.fixture(scope="module")
def runs(models):
    target, draft = models
    speculative = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
    return {
        "plain": run(target, None),
        "vllm": run(target, speculative),
        "window": run(target, {**speculative, "draft_context_window": 64}),
        "wide_window": run(target, {**speculative, "draft_context_window": 512}),
    }


def test_greedy_outputs_equal_plain_decoding(runs):
    for name in ("vllm", "window", "wide_window"):
        assert runs[name]["tokens"] == runs["plain"]["tokens"], name


def test_vllm_alone_drops_the_long_request_s_drafts_and_the_short_one_s(runs):
    vllm = runs["vllm"]
    assert vllm["drafted"]["0"] > 0  # drafts were scheduled (zeroed ones) ...
    assert vllm["accepted"]["1"] <= 2  # ... and failed; the short request only drafted
    # while the long prompt was still being prefilled below 128 tokens.
    assert vllm["accepted"]["0"] < 0.25 * runs["window"]["accepted"]["0"]


def test_with_the_window_both_requests_keep_drafting(runs):
    window, vllm = runs["window"], runs["vllm"]
    assert window["accepted"]["0"] > 20  # the short one
    # The long one drafts real tokens from its last 64 (vLLM alone schedules zeroed drafts).
    assert vllm["zero_drafts"]["1"] == vllm["drafted"]["1"] > 0
    assert window["zero_drafts"]["1"] < 0.1 * window["drafted"]["1"]


def test_the_window_is_what_the_draft_sees(runs):
    """This toy draft is a noisy copy of the (full-context) target, so a 64-token window costs
    the long request acceptance, and a window covering the whole request restores it."""
    assert runs["wide_window"]["accepted"]["1"] > 10 * max(1, runs["window"]["accepted"]["1"])

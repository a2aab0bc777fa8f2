"""No acceptance collapse over a long generation: 2,048 tokens on the shipped pair.

vLLM 0.26 stops drafting (zeroes the drafts) once a request is longer than the draft's maximum
length, so on the shipped pair (256 trained positions) acceptance drops to 0 for the rest of a
long run: the late-run collapse to all zeros. With ``draft_context_window`` the draft keeps
drafting from the last W tokens: in every 256-token segment to the end of the run its acceptance
is at least 90% of what the same draft reaches when it is told it has 4,096 positions and attends
to the whole sequence (vLLM's path without the limit), and the end of the run accepts no less
than its beginning.
Both runs produce exactly the greedy tokens of plain decoding. The target runs with a 256-token
sliding window so that it stays within its training distribution (``long_run_pair``);
``benchmarks/draft_window_pair.py`` measures the same setup for several W.
"""

from __future__ import annotations

import pytest

from benchmarks.draft_window_pair import SEGMENT, by_segment, run

NEW_TOKENS = 2048


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from vllm_nwor.testing import held_out_prompt_ids, long_run_pair

    target, draft, draft_full = long_run_pair(tmp_path_factory.mktemp("long-run"))
    prompts = held_out_prompt_ids(4)
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
    cases = {"plain": None, "vllm": spec, "full_context": {**spec, "model": draft_full},
             "window": {**spec, "draft_context_window": 192}}
    return {name: run(target, s, prompts, NEW_TOKENS)[:2] for name, s in cases.items()}


def late_segments(steps) -> list[dict]:
    return [s for s in by_segment(steps) if s["from"] >= SEGMENT]


def test_greedy_tokens_equal_plain_decoding(runs):
    plain, _ = runs["plain"]
    assert all(len(t) == NEW_TOKENS for t in plain)
    assert runs["vllm"][0] == plain
    assert runs["window"][0] == plain


def test_vllm_alone_collapses_to_zero_past_the_drafts_length(runs):
    late = late_segments(runs["vllm"][1])
    assert sum(s["drafted"] for s in late) > 0
    assert sum(s["accepted"] for s in late) == 0


def test_window_acceptance_does_not_decay_over_the_run(runs):
    late = late_segments(runs["window"][1])
    full = {s["from"]: s for s in late_segments(runs["full_context"][1])}
    assert late[-1]["from"] >= NEW_TOKENS  # drafting went on to the last tokens
    for segment in late:
        assert segment["acceptance"] > 0, segment
        assert segment["acceptance"] >= 0.9 * full[segment["from"]]["acceptance"], segment
    assert late[-1]["acceptance"] >= late[0]["acceptance"]

"""SCV on the real CPU engine: chunking never changes greedy output, and it adapts per request."""

from __future__ import annotations

import collections

import pytest
from engine_utils import engine, generate, record_chunks, spec_config, spec_decode_stats

import vllm_nwor
from vllm_nwor.inspect import scheduler_of
from vllm_nwor.patches.scv import scheduler as scheduler_patch


def run(tiny_models, method: str, **keys) -> dict:
    target, draft = tiny_models
    with engine(target, spec_config(method, draft, **keys)) as llm:
        chunks = record_chunks(llm)
        tokens = generate(llm)
        return {"tokens": tokens, "stats": spec_decode_stats(llm), "chunks": chunks,
                "counters": vllm_nwor.get_counters(llm)}


@pytest.fixture(scope="module")
def plain_runs(tiny_models):
    return {method: run(tiny_models, method) for method in ("ngram", "draft_model")}


@pytest.mark.parametrize(
    "method, keys",
    [
        ("ngram", {"scv": "adaptive", "nwor": True}),
        ("draft_model", {"scv": "adaptive"}),
        ("draft_model", {"scv": "fixed", "scv_chunk_size": 2, "nwor": True}),
    ],
)
def test_chunking_never_changes_greedy_output(tiny_models, plain_runs, method, keys):
    with_scv = run(tiny_models, method, **keys)
    assert with_scv["tokens"] == plain_runs[method]["tokens"]
    all_chunks = [c for per_request in with_scv["chunks"].values() for c in per_request]
    if keys["scv"] == "fixed":
        assert max(all_chunks) == 2  # k is 3: the chunk size really applied
    else:
        assert len(set(all_chunks)) > 2  # sizes varied (warm-up exploration, then the policy)
    if keys.get("nwor"):  # the chunk's accepted prefix is what NWOR commits
        drafted, accepted = with_scv["stats"]
        counters = with_scv["counters"]
        assert counters.fallbacks == {}
        assert (counters.tokens_staged, counters.tokens_committed) == (drafted, accepted)


@pytest.mark.parametrize("keys", [
    {"scv": "fixed", "scv_chunk_size": 2},
    {"scv": "adaptive", "scv_cost_model": [0.001, 1.0, 1.0]},  # drafts priced high: chunk 0
])
def test_a_drafter_that_proposes_all_k_is_asked_for_k_and_each_request_cut(
    tiny_models, plain_runs, monkeypatch, keys,
):
    """ngram_gpu proposes all k drafts or fails (its GPU test: tests/gpu); the CPU's ngram
    stands in for it here, registered as such a drafter: every step asks it for k = 3, and each
    request still verifies only its chunk."""
    monkeypatch.setattr(scheduler_patch, "WHOLE_K_DRAFTERS", ("ngram",))
    target, draft = tiny_models
    with engine(target, spec_config("ngram", draft, **keys)) as llm:
        scheduler = scheduler_of(llm)
        asked, schedule = [], scheduler.schedule

        def recording_schedule(*args, **kwargs):
            out = schedule(*args, **kwargs)
            asked.append(out.num_spec_tokens_to_schedule)
            return out

        scheduler.schedule = recording_schedule
        chunks = record_chunks(llm)
        tokens = generate(llm)
    assert tokens == plain_runs["ngram"]["tokens"]
    assert set(asked) == {3}
    sizes = collections.Counter(c for per_request in chunks.values() for c in per_request)
    if keys["scv"] == "fixed":
        assert max(sizes) == 2 and sizes[2] > 10, sizes
    else:
        assert sizes[0] > 3 * sum(n for size, n in sizes.items() if size), sizes


def test_an_always_rejected_request_goes_to_chunk_zero_and_a_recovering_one_comes_back(
    tiny_models,
):
    """Per-request synthetic acceptance (benchmark feature) rejects drafts on purpose.

    The cost model is pinned to a compute-bound engine (0.5 ms per verified token), where
    verifying drafts that are always rejected costs throughput, so chunk 0 is the right answer;
    ngram drafts cost nothing. Request 0 never accepts; request 1 never accepts for its first
    40 tokens, then always does; the other six leave ngram's acceptance as it is.
    """
    from vllm import SamplingParams

    target, _ = tiny_models
    speculative = {
        "method": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 1,
        "num_speculative_tokens": 4, "scv": "adaptive", "scv_probe_interval": 2,
        "scv_cost_model": [0.01, 5e-4, 5e-5], "synthetic_acceptance_per_request": True,
    }
    rates = [0.0, [[0, 0.0], [40, 1.0]]] + [1.0] * 6
    prompts = [[(7 * i + 13 * (j % 5)) % 500 + 2 for j in range(10 + i)] for i in range(8)]
    with engine(target, speculative, max_num_seqs=8, max_num_batched_tokens=128) as llm:
        chunks = record_chunks(llm)
        params = [SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True,
                                 extra_args={"synthetic_acceptance_rate": rate})
                  for rate in rates]
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    never, recovers = chunks["0"], chunks["1"]
    # Both never accept at first: after warm-up they sit at chunk 0 but for the odd probe.
    for history in (never[10:40], recovers[10:40]):
        assert history.count(0) >= 0.75 * len(history), history
        assert 0 < sum(history) <= 0.25 * len(history) + 1, history  # probed, not abandoned
    # The recovering request comes back to full chunks; the other one does not.
    assert max(recovers[-8:]) == 4 and sum(recovers[-8:]) >= 16, recovers
    assert max(never[40:60]) <= 1, never

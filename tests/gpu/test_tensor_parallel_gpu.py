"""NWOR at tensor_parallel_size 2 on two GPUs (issue 55): each rank stages and commits its own KV
heads from the first rank's verdict, with FLASH_ATTN, CUDA graphs and custom all-reduce.

Runs the equivalence matrix's ``tp2_draft_model`` and ``tp2_ngram`` cases
(benchmarks/equivalence.py), k=3, on a tiny random-weight bf16 Llama pair (head dim 64 for
FlashAttention 3, 2 KV heads: one a rank) whose draft is a noisy copy of the target. Each engine
is a fresh process with two worker processes, NWOR off and then on, under vLLM's defaults:
torch.compile, CUDA graphs FULL_AND_PIECEWISE, prefix caching, chunked prefill, custom
all-reduce. One departure, as in every equivalence run: the engine core stays in the probe's
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; the workers are processes of their own either way),
so that how many requests a step sees does not hang on timing and both engines meet the same
batches. The workload is the matrix's: shared prefixes, chunked prefill beside verify steps,
stops inside accepted drafts, prefix-cache hits on committed blocks and on a block completed in
the same step, then seeded sampling at temperature 0.8 (one request with ``n=3``).

The audit plugin (tests/support/soak_audit.py) runs in every worker of both engines: after every
step, on every rank, the cache holds the committed tokens and nothing past them, NWOR's counters
moved by exactly that step's verdict, and the worker records its graph dispatches.

With ``NWOR_EQUIVALENCE_OUT=<file>`` the rows go to that result file (commit, versions, GPUs,
every rank's audit and counters), kept across runs of one case at a time
(``-k tp2_ngram``); without it, to a temporary file.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from benchmarks import equivalence

CASES = {case.name: case for case in equivalence.cases(on_cuda=True)
         if case.tensor_parallel_size == 2}

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


@pytest.fixture(scope="module", params=sorted(CASES))
def row(request, tmp_path_factory) -> dict:
    """One case's row: both engines run, compared and checked (equivalence.run_case)."""
    tmp = tmp_path_factory.mktemp("tp2")
    out = Path(os.environ.get("NWOR_EQUIVALENCE_OUT") or tmp / "equivalence_tp2.json")
    payload = equivalence.run_matrix([CASES[request.param]], tmp / "models", out, on_cuda=True,
                                     keep=True)
    (result,) = [r for r in payload["cases"] if r["name"] == request.param]
    assert "error" not in result, result["error"]
    print(request.param, {k: result[k] for k in ("drafted", "accepted", "counters",
                                                 "rank_counters", "seconds")})
    return result


def test_runs_under_vllms_defaults_on_two_gpus(row):
    settings = row["settings"]
    assert settings["tensor_parallel_size"] == 2 and len(settings["gpus"]) == 2
    assert settings["custom_all_reduce"] == [True, True]
    assert settings["attention"] == "FlashAttentionImpl" and settings["runner"] == "V1"
    assert settings["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    assert settings["enable_prefix_caching"] and not settings["async_scheduling"]
    assert row["off"]["settings"]["custom_all_reduce"] == [True, True]
    # one GPU each
    assert [r["worker"]["device_index"] for r in row["audit"]["ranks"]] == [0, 1]


def test_greedy_and_seeded_outputs_are_nwor_offs(row):
    # Verify attention is vLLM's own FlashAttention call over scratch blocks holding the same
    # K/V on each rank, and the all-reduces sum the same partial outputs: bit for bit.
    assert row["greedy_tokens_exact"], row["mismatches"]
    assert row["greedy_logprobs_exact"], "greedy logprobs bit for bit"
    # Seeded sampling: every rank draws with the request's generator; NWOR makes all commit
    # rank 0's. vLLM alone shares no verdict: had its ranks drawn differently, its rank 1 would
    # attend over other tokens, and the comparison would be with a broken baseline (on the CPU,
    # unseeded, one run of two had NWOR off's rank 1 accept one draft more than rank 0).
    off_ranks = {(r["steps"], r["drafted"], r["accepted"]) for r in row["off"]["audit"]["ranks"]}
    assert len(off_ranks) == 1, f"NWOR off: vLLM's ranks saw different verdicts {off_ranks}"
    assert row["sampled_tokens_exact"] and row["sampled_logprobs_exact_to_first_difference"]
    assert row["exact"] and row["agreement"] == 1.0


def test_every_rank_audited_every_step_and_counted_as_vllm(row):
    ranks = row["audit"]["ranks"]
    assert [r["tp_rank"] for r in ranks] == [0, 1]
    for rank in ranks:
        assert rank["verify_steps"] > 0 and rank["rejected"] > 0 and rank["checked_tokens"] > 0
        assert rank["cache_violations"] == 0, rank["violations"]
        assert rank["counter_violations"] == 0, rank["violations"]
        assert rank["fallbacks"] == {}
    # The ranks saw the same steps and verdicts, and counted the same tokens as vLLM's stats.
    assert len({(r["steps"], r["drafted"], r["accepted"]) for r in ranks}) == 1
    drafted, accepted = row["drafted"], row["accepted"]
    assert 0 < accepted < drafted  # drafts accepted and rejected
    assert (row["off"]["drafted"], row["off"]["accepted"]) == (drafted, accepted)
    for counters in row["rank_counters"]:
        assert counters["fallbacks"] == {}
        assert (counters["tokens_staged"], counters["tokens_committed"],
                counters["tokens_rejected"]) == (drafted, accepted, drafted - accepted)
    combined = row["counters"]
    assert combined["rejected_kv_bytes"] == sum(
        c["rejected_kv_bytes"] for c in row["rank_counters"]) > 0
    assert row["prefix_cache_hits"] > 0 and row["hits_beside_verify"] > 0
    assert row["checks_failed"] == []


def test_verify_steps_replay_full_graphs_on_every_rank(row):
    for engine in (row["audit"], row["off"]["audit"]):
        for rank in engine["ranks"]:
            assert rank["worker"]["full_verify_steps"] > 0, rank["worker"]["dispatches"]
    for rank in row["audit"]["ranks"]:
        # Every step NWOR staged in a FULL graph is one of the FULL verify steps.
        worker = rank["worker"]
        assert 0 < worker["nwor_graph_steps"] <= worker["full_verify_steps"], worker


def test_the_audit_finds_vllms_rejected_writes_with_nwor_off(row):
    """The negative control: the same audit in the NWOR-off engine's workers finds, on every
    rank, the rejected drafts vLLM's plain write put in the cache."""
    ranks = row["off"]["audit"]["ranks"]
    assert [r["tp_rank"] for r in ranks] == [0, 1]
    for rank in ranks:
        assert rank["rejected"] > 0 and rank["cache_violations"] > 0
        assert any("beyond the committed length" in v for v in rank["violations"])
        assert rank["counters"] is None  # NWOR off: nothing of NWOR's to count

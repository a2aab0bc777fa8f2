"""Acceptance lengths on RequestOutput (vLLM's per-request metrics, which telemetry switches to
``detailed``), against vLLM's spec-decode counters and the plugin's metrics, in the real engine.

One fresh process (``telemetry_probe.py``) runs two LLMs on the same workload (greedy, then
n=2 with sampling, the long prompts prefilled in chunks): telemetry on with NWOR off, the engine
core in its own process (``SyncMPClient``) and log stats off, as an ``LLM`` runs by default; and
NWOR on with its default telemetry, the engine core in process (``InprocClient``) and log stats
on, whose lists are checked against vLLM's counters. Greedy decoding is the same in both, so
their lists must be too. The server path (``AsyncMPClient``) is tested in ``tests/server``.
"""

from __future__ import annotations

import os

import pytest
from engine_utils import run_probe

pytestmark = pytest.mark.engine
RUNS = ("telemetry_only_mp", "nwor_inproc")


@pytest.fixture(scope="module")
def runs(tiny_models) -> dict:
    target, _ = tiny_models
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    return run_probe("telemetry_probe.py", [target], env, timeout=400)


def totals(run: dict) -> dict[str, int]:
    seqs = run["sequences"]
    return {
        "steps": sum(len(s["acceptance_lengths"]) for s in seqs),
        "accepted": sum(sum(s["acceptance_lengths"]) for s in seqs),
        "drafted": sum(sum(s["per_step_drafted"]) for s in seqs),
        "speculated": sum(1 for s in seqs if s["acceptance_lengths"]),
    }


def test_the_runs_used_the_clients_they_meant_to(runs):
    assert runs["telemetry_only_mp"]["client"] == "SyncMPClient"
    assert runs["nwor_inproc"]["client"] == "InprocClient"


@pytest.mark.parametrize("name", RUNS)
def test_every_sequence_carries_its_acceptance_lengths(runs, name):
    seqs = runs[name]["sequences"]
    assert {s["type"] for s in seqs} == {"RequestSpecDecodeMetrics"}  # vLLM's own
    for s in seqs:
        lengths, drafted = s["acceptance_lengths"], s["per_step_drafted"]
        assert len(lengths) == len(drafted)
        assert all(0 <= a <= d <= 3 for a, d in zip(lengths, drafted, strict=True))
    sampled = [s for s in seqs if s["n"] == 2]
    assert len(sampled) == 4 and sorted(s["index"] for s in sampled) == [0, 0, 1, 1]


def test_sums_equal_vllm_spec_decode_counters(runs):
    total, metrics = totals(runs["nwor_inproc"]), runs["nwor_inproc"]["metrics"]
    assert total["steps"] > 20 and total["accepted"] > 0, "the workload must speculate"
    # One entry per speculative step: prefill chunks and steps without drafts add none, or the
    # sum would exceed vLLM's count of verified request-steps.
    assert total["steps"] == metrics["vllm:spec_decode_num_drafts"]
    assert total["accepted"] == metrics["vllm:spec_decode_num_accepted_tokens"]
    assert total["drafted"] == metrics["vllm:spec_decode_num_draft_tokens"]
    assert metrics["vllm:scv_chunk_size_count"] == total["steps"]
    assert metrics["vllm:scv_chunk_size_sum"] == total["drafted"]
    assert metrics["vllm:nwor_request_mean_acceptance_length_count"] == total["speculated"]


@pytest.mark.parametrize("name", RUNS)
def test_acceptance_lengths_fit_the_tokens_each_request_generated(runs, name):
    # The prefill step samples one token, every speculative step before the last emits its
    # accepted drafts plus one, and the last at least one: an entry too many breaks the bound.
    for s in runs[name]["sequences"]:
        lengths = s["acceptance_lengths"]
        assert s["finish_reason"] == "length"
        if lengths:
            assert s["num_tokens"] >= 1 + sum(a + 1 for a in lengths[:-1]) + 1


def test_nwor_counters_and_their_metrics_agree_with_the_acceptance_lengths(runs):
    run = runs["nwor_inproc"]
    total, metrics, counters = totals(run), run["metrics"], run["nwor_counters"]
    assert counters["fallbacks"] == {}
    assert counters["tokens_committed"] == total["accepted"]
    assert counters["tokens_staged"] == total["drafted"]
    for name in ("verify_steps_staged", "tokens_staged", "tokens_committed", "tokens_rejected",
                 "rejected_kv_bytes"):
        assert metrics[f"vllm:nwor_{name}"] == counters[name], name


def test_lists_do_not_depend_on_nwor_log_stats_or_where_the_engine_core_runs(runs):
    greedy = [[s["acceptance_lengths"] for s in runs[name]["sequences"] if s["n"] == 1]
              for name in RUNS]
    assert greedy[0] == greedy[1]
    assert sum(len(lengths) for lengths in greedy[0]) > 20


def test_telemetry_without_nwor_has_no_nwor_counters(runs):
    run = runs["telemetry_only_mp"]
    assert run["nwor_counters"] is None and run["metrics"] is None

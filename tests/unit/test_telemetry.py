"""Per-request acceptance metrics and the engine-side collector (no vLLM needed)."""

import pytest

from vllm_nwor.telemetry import (
    RequestSpecDecodeMetrics,
    SpecTelemetry,
    combine_rank_counters,
)

# The keys of upstream vLLM's (0.33) per-request summary, ``metrics.speculative_decoding``.
UPSTREAM_SUMMARY_KEYS = {
    "mean_acceptance_length",
    "draft_acceptance_rate",
    "acceptance_histogram",
    "num_spec_steps",
    "num_accepted_draft_tokens",
    "num_draft_tokens",
    "num_spec_tokens",
}


def test_summary_follows_upstream_names_and_definitions():
    metrics = RequestSpecDecodeMetrics.new(3)
    for drafted, accepted in [(3, 3), (3, 0), (2, 1), (3, 2)]:
        metrics.observe(drafted, accepted)
    summary = metrics.to_dict()
    assert set(summary) == UPSTREAM_SUMMARY_KEYS
    assert metrics.acceptance_lengths == [3, 0, 1, 2]
    assert summary["acceptance_histogram"] == [1, 1, 1, 1]
    assert summary["num_spec_steps"] == 4
    assert summary["num_accepted_draft_tokens"] == 6
    assert summary["num_draft_tokens"] == 11
    assert summary["mean_acceptance_length"] == pytest.approx(1 + 6 / 4)
    assert summary["draft_acceptance_rate"] == pytest.approx(6 / 11)
    assert summary["num_spec_tokens"] == 3


def test_a_request_that_never_speculated_reports_an_empty_list():
    metrics = RequestSpecDecodeMetrics.new(4)
    assert metrics.response_fields() == {
        "acceptance_lengths": [],
        "speculative_decoding": {
            "mean_acceptance_length": 1.0,
            "draft_acceptance_rate": 0.0,
            "acceptance_histogram": [0, 0, 0, 0, 0],
            "num_spec_steps": 0,
            "num_accepted_draft_tokens": 0,
            "num_draft_tokens": 0,
            "num_spec_tokens": 4,
        },
    }


def test_copy_is_independent():
    metrics = RequestSpecDecodeMetrics.new(2)
    metrics.observe(2, 1)
    snapshot = metrics.copy()
    metrics.observe(2, 2)
    assert snapshot.acceptance_lengths == [1] and snapshot.histogram == [0, 1, 0]


def test_steps_are_grouped_per_front_end_and_taken_once():
    telemetry = SpecTelemetry(3, collect_stats=False)
    telemetry.observe_verify("a", 3, 2, num_scheduled_drafts=3)
    telemetry.observe_verify("b", 1, 0, num_scheduled_drafts=2, client_index=1)
    telemetry.observe_verify("c", 2, 2, num_scheduled_drafts=2)
    steps = telemetry.take_step()
    assert steps[0].req_ids == ["a", "c"] and steps[0].num_accepted == [2, 2]
    assert steps[0].num_drafted == [3, 2]
    assert steps[1].req_ids == ["b"] and steps[1].num_drafted == [1]
    assert telemetry.take_step() == {}


def test_chunk_sizes_count_scheduled_drafts_including_invalid_ones():
    telemetry = SpecTelemetry(3, collect_stats=True)
    telemetry.observe_verify("a", 2, 1, num_scheduled_drafts=3)  # one draft invalidated
    telemetry.observe_verify("b", 1, 1, num_scheduled_drafts=1)
    stats = telemetry.take_stats(unfinished_requests=True)
    assert stats.chunk_size_counts == [0, 1, 0, 1]
    assert stats.nwor_counters is None
    assert telemetry.take_stats(unfinished_requests=True) is None  # nothing new


def test_no_engine_wide_numbers_without_log_stats():
    telemetry = SpecTelemetry(3, collect_stats=False, wants_nwor_counters=True,
                              read_nwor_counters=lambda: pytest.fail("must not be read"))
    telemetry.observe_verify("a", 3, 1, num_scheduled_drafts=3)
    assert telemetry.take_stats(unfinished_requests=False) is None


def test_scv_chunk_zero_steps_fill_bucket_0_and_no_request_step():
    telemetry = SpecTelemetry(4, collect_stats=True)
    telemetry.observe_chunk_zero(2)
    telemetry.observe_verify("a", 2, 1, num_scheduled_drafts=2)
    telemetry.observe_chunk_zero(0)
    stats = telemetry.take_stats(unfinished_requests=True)
    assert stats.chunk_size_counts == [2, 0, 1, 0, 0]
    assert telemetry.take_step()[0].req_ids == ["a"]  # chunk 0 is not a speculative step


def test_chunk_zero_alone_makes_stats_and_needs_log_stats():
    telemetry = SpecTelemetry(3, collect_stats=True)
    telemetry.observe_chunk_zero(1)
    assert telemetry.take_stats(unfinished_requests=True).chunk_size_counts == [1, 0, 0, 0]
    assert telemetry.take_step() == {}
    quiet = SpecTelemetry(3, collect_stats=False)
    quiet.observe_chunk_zero(3)
    assert quiet.take_stats(unfinished_requests=True) is None


def test_chunk_sizes_beyond_k_grow_the_counts():
    telemetry = SpecTelemetry(2, collect_stats=True)
    telemetry.observe_verify("a", 5, 0, num_scheduled_drafts=5)
    assert telemetry.take_stats(unfinished_requests=True).chunk_size_counts == [0, 0, 0, 0, 0, 1]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_nwor_counters_are_read_when_due_and_when_the_engine_runs_dry():
    clock = FakeClock()
    reads = []

    def read():
        reads.append(clock.now)
        return {"tokens_staged": len(reads)}

    telemetry = SpecTelemetry(3, collect_stats=True, wants_nwor_counters=True,
                              read_nwor_counters=read, nwor_counter_interval_s=1.0, clock=clock)
    telemetry.observe_verify("a", 3, 1, num_scheduled_drafts=3)
    assert telemetry.take_stats(unfinished_requests=True).nwor_counters == {"tokens_staged": 1}
    clock.now += 0.5
    telemetry.observe_verify("a", 3, 1, num_scheduled_drafts=3)
    assert telemetry.take_stats(unfinished_requests=True).nwor_counters is None  # not due yet
    clock.now += 0.1
    stats = telemetry.take_stats(unfinished_requests=False)  # out of requests: read now
    assert stats.nwor_counters == {"tokens_staged": 2}
    assert telemetry.take_stats(unfinished_requests=False) is None  # nothing verified since
    assert reads == [100.0, 100.6]


def test_nwor_counters_are_not_read_when_nwor_is_off():
    telemetry = SpecTelemetry(3, collect_stats=True, wants_nwor_counters=False,
                              read_nwor_counters=lambda: pytest.fail("must not be read"))
    telemetry.observe_verify("a", 3, 1, num_scheduled_drafts=3)
    assert telemetry.take_stats(unfinished_requests=False).nwor_counters is None


def test_rank_counters_sum_kv_bytes_and_check_that_every_token_count_agrees():
    rank = {"tokens_staged": 5, "tokens_committed": 2, "kv_bytes_not_written": 300,
            "fallbacks": {}}
    combined = combine_rank_counters([rank, dict(rank, kv_bytes_not_written=100)])
    assert combined["tokens_staged"] == 5 and combined["kv_bytes_not_written"] == 400
    assert combine_rank_counters([None, None]) is None
    with pytest.raises(RuntimeError, match="tokens_committed is rank 0: 2, rank 1: 3"):
        combine_rank_counters([rank, dict(rank, tokens_committed=3)])
    with pytest.raises(RuntimeError, match="rank 1: None"):
        combine_rank_counters([rank, None])
    with pytest.raises(RuntimeError, match="fallbacks"):
        combine_rank_counters([rank, dict(rank, fallbacks={"no_commit": 1})])

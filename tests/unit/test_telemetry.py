"""The engine-side collector of the plugin's step numbers (no vLLM needed)."""

import pytest

from vllm_nwor.telemetry import SpecTelemetry, combine_rank_counters


def test_chunk_sizes_count_scheduled_drafts_including_invalid_ones():
    telemetry = SpecTelemetry(3, collect_stats=True)
    telemetry.observe_verify(3)  # one draft invalidated
    telemetry.observe_verify(1)
    stats = telemetry.take_stats(unfinished_requests=True)
    assert stats.chunk_size_counts == [0, 1, 0, 1]
    assert stats.nwor_counters is None
    assert telemetry.take_stats(unfinished_requests=True) is None  # nothing new


def test_no_engine_wide_numbers_without_log_stats():
    telemetry = SpecTelemetry(3, collect_stats=False, wants_nwor_counters=True,
                              read_nwor_counters=lambda: pytest.fail("must not be read"))
    telemetry.observe_verify(3)
    assert telemetry.take_stats(unfinished_requests=False) is None


def test_scv_chunk_zero_steps_fill_bucket_0():
    telemetry = SpecTelemetry(4, collect_stats=True)
    telemetry.observe_chunk_zero(2)
    telemetry.observe_verify(2)
    telemetry.observe_chunk_zero(0)
    stats = telemetry.take_stats(unfinished_requests=True)
    assert stats.chunk_size_counts == [2, 0, 1, 0, 0]


def test_chunk_zero_alone_makes_stats_and_needs_log_stats():
    telemetry = SpecTelemetry(3, collect_stats=True)
    telemetry.observe_chunk_zero(1)
    assert telemetry.take_stats(unfinished_requests=True).chunk_size_counts == [1, 0, 0, 0]
    quiet = SpecTelemetry(3, collect_stats=False)
    quiet.observe_chunk_zero(3)
    assert quiet.take_stats(unfinished_requests=True) is None


def test_chunk_sizes_beyond_k_grow_the_counts():
    telemetry = SpecTelemetry(2, collect_stats=True)
    telemetry.observe_verify(5)
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
    telemetry.observe_verify(3)
    assert telemetry.take_stats(unfinished_requests=True).nwor_counters == {"tokens_staged": 1}
    clock.now += 0.5
    telemetry.observe_verify(3)
    assert telemetry.take_stats(unfinished_requests=True).nwor_counters is None  # not due yet
    clock.now += 0.1
    stats = telemetry.take_stats(unfinished_requests=False)  # out of requests: read now
    assert stats.nwor_counters == {"tokens_staged": 2}
    assert telemetry.take_stats(unfinished_requests=False) is None  # nothing verified since
    assert reads == [100.0, 100.6]


def test_nwor_counters_are_not_read_when_nwor_is_off():
    telemetry = SpecTelemetry(3, collect_stats=True, wants_nwor_counters=False,
                              read_nwor_counters=lambda: pytest.fail("must not be read"))
    telemetry.observe_verify(3)
    assert telemetry.take_stats(unfinished_requests=False).nwor_counters is None


def test_rank_counters_sum_kv_bytes_and_check_that_every_token_count_agrees():
    rank = {"tokens_staged": 5, "tokens_committed": 2, "rejected_kv_bytes": 300,
            "fallbacks": {}}
    combined = combine_rank_counters([rank, dict(rank, rejected_kv_bytes=100)])
    assert combined["tokens_staged"] == 5 and combined["rejected_kv_bytes"] == 400
    assert combine_rank_counters([None, None]) is None
    with pytest.raises(RuntimeError, match="tokens_committed is rank 0: 2, rank 1: 3"):
        combine_rank_counters([rank, dict(rank, tokens_committed=3)])
    with pytest.raises(RuntimeError, match="rank 1: None"):
        combine_rank_counters([rank, None])
    with pytest.raises(RuntimeError, match="fallbacks"):
        combine_rank_counters([rank, dict(rank, fallbacks={"no_commit": 1})])

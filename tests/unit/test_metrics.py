"""The plugin's Prometheus families and log line, on a private registry (no vLLM needed)."""

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry

from vllm_nwor.telemetry import SpecStepStats
from vllm_nwor.telemetry.metrics import (
    TelemetryLog,
    TelemetryMetrics,
    mean_acceptance_length_buckets,
    observe_many,
)

LABELS = {"model_name": "m", "engine": "0"}


def counters(staged, committed, fallbacks=None, steps=1, kv=0):
    return {"verify_steps_staged": steps, "tokens_staged": staged, "tokens_committed": committed,
            "tokens_rejected": staged - committed, "rejected_kv_bytes": kv,
            "fallbacks": fallbacks or {}}


@pytest.fixture
def registry():
    return CollectorRegistry()


def value(registry, name, **labels):
    return registry.get_sample_value(name, {**LABELS, **labels})


def test_families_exist_at_zero_for_every_engine(registry):
    TelemetryMetrics("m", [0, 1], 3, registry=registry)
    assert value(registry, "vllm:nwor_tokens_staged_total") == 0
    assert registry.get_sample_value("vllm:scv_chunk_size_count", {**LABELS, "engine": "1"}) == 0
    assert value(registry, "vllm:nwor_request_mean_acceptance_length_count") == 0


def test_cumulative_nwor_counters_advance_by_their_increase(registry):
    metrics = TelemetryMetrics("m", [0], 3, registry=registry)
    metrics.record_step(0, SpecStepStats([0, 0, 0, 0], counters(10, 4, kv=600)))
    metrics.record_step(0, SpecStepStats([0, 0, 0, 0], counters(25, 9, {"overflow": 2}, kv=1600)))
    assert value(registry, "vllm:nwor_tokens_staged_total") == 25
    assert value(registry, "vllm:nwor_tokens_committed_total") == 9
    assert value(registry, "vllm:nwor_tokens_rejected_total") == 16
    assert value(registry, "vllm:nwor_rejected_kv_bytes_total") == 1600
    assert value(registry, "vllm:nwor_fallbacks_total", reason="overflow") == 2


def test_engines_are_tracked_apart(registry):
    metrics = TelemetryMetrics("m", [0, 1], 3, registry=registry)
    metrics.record_step(0, SpecStepStats([], counters(10, 4)))
    metrics.record_step(1, SpecStepStats([], counters(3, 1)))
    metrics.record_step(0, SpecStepStats([], counters(12, 4)))
    assert value(registry, "vllm:nwor_tokens_staged_total") == 12
    assert registry.get_sample_value(
        "vllm:nwor_tokens_staged_total", {**LABELS, "engine": "1"}) == 3


def test_chunk_sizes_fill_the_histogram_and_chunk_zero_counter(registry):
    metrics = TelemetryMetrics("m", [0], 3, registry=registry)
    metrics.record_step(0, SpecStepStats([2, 0, 1, 3]))
    assert value(registry, "vllm:scv_chunk_size_count") == 6
    assert value(registry, "vllm:scv_chunk_size_sum") == 2 + 9
    assert value(registry, "vllm:scv_chunk_size_bucket", le="0.0") == 2
    assert value(registry, "vllm:scv_chunk_size_bucket", le="2.0") == 3
    assert value(registry, "vllm:scv_chunk_zero_steps_total") == 2


def samples(registry):
    return sorted((s.name, tuple(sorted(s.labels.items())), s.value)
                  for family in registry.collect() for s in family.samples
                  if not s.name.endswith("_created"))


@pytest.mark.parametrize("amount", [0, 1, 2.5, 3, 4, 100])
def test_observe_many_is_observe_repeated(amount):
    """The batched observation exposes exactly what ``count`` calls of ``observe`` would."""
    one_by_one, batched = CollectorRegistry(), CollectorRegistry()
    for registry, record in ((one_by_one, None), (batched, observe_many)):
        histogram = prometheus_client.Histogram("h", "d", ["l"], buckets=[0, 1, 2, 3, 4],
                                                registry=registry).labels("x")
        for count in (5, 1, 3):
            if record is None:
                for _ in range(count):
                    histogram.observe(amount)
            else:
                record(histogram, amount, count)
    assert samples(batched) == samples(one_by_one)
    assert ("h_count", (("l", "x"),), 9.0) in samples(batched)


def test_observe_many_falls_back_to_observe_without_the_internals():
    seen = []

    class Plain:
        def observe(self, amount):
            seen.append(amount)

    observe_many(Plain(), 2, 3)
    assert seen == [2, 2, 2]


class Finished:
    """A finished sequence's metrics as the stat logger reads vLLM's RequestSpecDecodeMetrics:
    its ``to_dict()`` summary (two of its keys)."""

    def __init__(self, *accepted: int) -> None:
        self.accepted = accepted

    def to_dict(self) -> dict:
        steps = len(self.accepted)
        return {"num_spec_steps": steps,
                "mean_acceptance_length": 1 + sum(self.accepted) / steps if steps else 1.0}


def test_per_request_histogram_skips_requests_that_never_speculated(registry):
    metrics = TelemetryMetrics("m", [0], 3, registry=registry)
    metrics.record_finished(0, [Finished(2, 1), Finished()])
    assert value(registry, "vllm:nwor_request_mean_acceptance_length_count") == 1
    assert value(registry, "vllm:nwor_request_mean_acceptance_length_sum") == 2.5


def test_buckets_span_one_to_k_plus_one():
    assert mean_acceptance_length_buckets(3) == [1.0 + 0.25 * i for i in range(13)]
    assert mean_acceptance_length_buckets(16)[-1] == 17.0


def test_log_line_only_when_something_happened_and_only_what_is_new():
    log = TelemetryLog()
    assert log.take_line() is None
    log.record_step(0, SpecStepStats([0, 1, 0, 1], counters(10, 4, kv=3 << 20)))
    log.record_finished([Finished(1)])
    line = log.take_line()
    assert "1 requests finished" in line and "mean acceptance length 2.00" in line
    assert "mean chunk size 2.00 over 2 request steps, 0 at chunk 0" in line
    assert "staged 10" in line and "rejected 6 (60.0%)" in line and "3.0 MiB" in line
    assert "fallbacks: none" in line
    assert log.take_line() is None
    log.record_step(0, SpecStepStats([], counters(15, 5, {"no_commit": 1}, kv=4 << 20)))
    line = log.take_line()
    assert "staged 5" in line and "rejected 4" in line and "no_commit 1" in line

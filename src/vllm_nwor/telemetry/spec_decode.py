"""The per-step numbers behind the plugin's metrics.

Nothing here imports vLLM; ``patches/telemetry/engine.py`` and ``patches/telemetry/frontend.py``
wire it in. Per-request acceptance is vLLM's own (``RequestSpecDecodeMetrics``,
``--per-request-spec-decode-metrics``). Terms, as in vLLM:

speculative step
    An engine step in which the scheduler verified drafts of a request (the request is in
    ``SchedulerOutput.scheduled_spec_decode_tokens``). Prefill chunks and steps without drafts
    are not speculative steps of the request.
chunk size
    The number of drafts verified for a request in one step: the request's scheduled drafts
    (SCV cuts them to the size it chose). A speculative step has a chunk of 1 or more; with SCV,
    a decode step of a request SCV gave no drafts is a step at chunk 0 (not a speculative step).

The data path::

    engine core   SpecTelemetry.observe_verify / observe_chunk_zero   per request step
                  -> SpecStepStats (with log stats) per step, on vLLM's scheduler stats
    front end     vllm_nwor.telemetry.metrics (Prometheus, the log line)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SpecStepStats:
    """Engine-wide numbers of one engine step, for the plugin's Prometheus metrics.

    ``chunk_size_counts[c]`` counts the request steps that verified ``c`` drafts: for ``c >= 1``
    the speculative steps, for ``c = 0`` the decode steps SCV gave chunk 0. ``nwor_counters`` is
    the engine's cumulative NWOR counters (:meth:`NworCounters.as_dict`, summed over
    tensor-parallel ranks) when they were read this step, else None.
    """

    chunk_size_counts: list[int] = field(default_factory=list)
    nwor_counters: dict[str, Any] | None = None


def combine_rank_counters(per_rank: Sequence[Mapping[str, Any] | None]) -> dict[str, Any] | None:
    """NWOR counters of all tensor-parallel ranks as one engine's (None when NWOR is off).

    Every rank stages and commits the same tokens, so every count but the bytes must agree; a
    difference means the ranks' caches differ, and raises, naming the ranks and their values.
    Rejected KV bytes are summed, since each rank holds its own heads.
    """
    if all(c is None for c in per_rank):
        return None
    ranks = [dict(c) if c is not None else None for c in per_rank]
    keys = [k for k in next(c for c in ranks if c is not None) if k != "rejected_kv_bytes"]
    for key in keys:
        values = [None if c is None else c.get(key) for c in ranks]
        if any(v != values[0] for v in values):
            by_rank = ", ".join(f"rank {i}: {v!r}" for i, v in enumerate(values))
            raise RuntimeError(f"NWOR counters differ across tensor-parallel ranks: {key} is "
                               f"{by_rank}")
    combined = ranks[0]
    combined["rejected_kv_bytes"] = sum(c["rejected_kv_bytes"] for c in ranks)
    return combined


class SpecTelemetry:
    """The engine core's side: collects each step's speculative steps and engine-wide numbers.

    The scheduler calls :meth:`observe_verify` for every request it verified drafts of, and SCV
    calls :meth:`observe_chunk_zero` for the requests it scheduled without drafts. After each
    step the engine core takes, with log stats, :meth:`take_stats`.

    Args:
        num_spec_tokens: ``num_speculative_tokens`` (k).
        collect_stats: whether engine-wide numbers are wanted (vLLM's log stats are on).
        wants_nwor_counters: whether NWOR is on, so its counters should be read.
        read_nwor_counters: returns the engine's NWOR counters (see
            :func:`combine_rank_counters`); the engine core sets it when it is first needed.
        nwor_counter_interval_s: NWOR counters live in the workers; they are read at most this
            often while requests run, and once more when the engine runs out of requests, so the
            metrics are exact at rest.
    """

    def __init__(
        self,
        num_spec_tokens: int,
        *,
        collect_stats: bool,
        wants_nwor_counters: bool = False,
        read_nwor_counters: Callable[[], dict[str, Any] | None] | None = None,
        nwor_counter_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.num_spec_tokens = num_spec_tokens
        self.collect_stats = collect_stats
        self.wants_nwor_counters = wants_nwor_counters
        self.read_nwor_counters = read_nwor_counters
        self.nwor_counter_interval_s = nwor_counter_interval_s
        self._clock = clock
        self._chunk_sizes = [0] * (num_spec_tokens + 1)
        self._chunk_sizes_dirty = False
        self._nwor_dirty = False
        self._nwor_read_at = float("-inf")

    # -- scheduler side -------------------------------------------------------------------------

    def observe_verify(self, num_scheduled_drafts: int) -> None:
        """One speculative step of a request that verified ``num_scheduled_drafts`` drafts
        (structured output's invalidated drafts included: they were verified all the same):
        the step's chunk size."""
        self._nwor_dirty = True
        if self.collect_stats:
            self._count_chunk(num_scheduled_drafts, 1)

    def observe_chunk_zero(self, num_requests: int) -> None:
        """SCV's hook: ``num_requests`` requests run a decode step at chunk 0 (no drafts).

        Such a step is not a speculative step: it adds to the chunk-size histogram's 0 bucket
        only, never to a request's acceptance lengths.
        """
        if self.collect_stats and num_requests:
            self._count_chunk(0, num_requests)

    def _count_chunk(self, size: int, count: int) -> None:
        if size >= len(self._chunk_sizes):
            self._chunk_sizes.extend([0] * (size + 1 - len(self._chunk_sizes)))
        self._chunk_sizes[size] += count
        self._chunk_sizes_dirty = True

    # -- engine core side -----------------------------------------------------------------------

    def take_stats(self, *, unfinished_requests: bool) -> SpecStepStats | None:
        """This step's engine-wide numbers, or None when there is nothing new.

        ``unfinished_requests``: whether the scheduler still has requests to run after this step.
        """
        counters = None
        if self._nwor_counters_due(unfinished_requests):
            counters = self.read_nwor_counters()  # type: ignore[misc]
            self._nwor_dirty = False
            self._nwor_read_at = self._clock()
        if not self._chunk_sizes_dirty and counters is None:
            return None
        stats = SpecStepStats(chunk_size_counts=self._chunk_sizes, nwor_counters=counters)
        self._chunk_sizes = [0] * len(self._chunk_sizes)
        self._chunk_sizes_dirty = False
        return stats

    def _nwor_counters_due(self, unfinished_requests: bool) -> bool:
        if not (self.wants_nwor_counters and self.collect_stats and self._nwor_dirty):
            return False
        if self.read_nwor_counters is None:
            return False
        return not unfinished_requests or (
            self._clock() - self._nwor_read_at >= self.nwor_counter_interval_s
        )

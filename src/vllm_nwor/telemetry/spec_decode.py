"""Per-request acceptance lengths, and the per-step numbers behind the plugin's metrics.

Nothing here imports vLLM; ``patches/telemetry/engine.py`` and ``patches/telemetry/frontend.py``
wire it in. Terms, as in vLLM:

speculative step
    An engine step in which the scheduler verified drafts of a request (the request is in
    ``SchedulerOutput.scheduled_spec_decode_tokens``). Prefill chunks and steps without drafts
    are not speculative steps of the request.
acceptance length
    The number of drafts of one speculative step that rejection sampling accepted: the
    scheduler's own ``num_accepted``, the number vLLM adds to
    ``vllm:spec_decode_num_accepted_tokens``. The bonus (or recovered) token is not counted.
chunk size
    The number of drafts verified for a request in one step: the request's scheduled drafts
    (SCV cuts them to the size it chose). A speculative step has a chunk of 1 or more; with SCV,
    a decode step of a request SCV gave no drafts is a step at chunk 0 (not a speculative step).

The data path::

    engine core   SpecTelemetry.observe_verify(...)    once per (request, speculative step)
                  -> SpecDecodeStep per front end, SpecStepStats (with log stats) per step
    front end     RequestSpecDecodeMetrics.observe()   per request, step by step
                  -> CompletionOutput.acceptance_lengths / .spec_decode_metrics, responses,
                     and vllm_nwor.telemetry.metrics (Prometheus)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

ACCEPTANCE_LENGTHS = "acceptance_lengths"
"""Response field (per choice, and top level for choice 0): one integer per speculative step."""

SPEC_DECODE_SUMMARY = "speculative_decoding"
"""Response field beside it: the summary, named as upstream vLLM names it (0.33,
``metrics.speculative_decoding`` with ``--per-request-spec-decode-metrics summary``)."""


@dataclass
class RequestSpecDecodeMetrics:
    """One request's speculative decoding, step by step.

    Fields and summary keys follow upstream vLLM's ``RequestSpecDecodeMetrics`` (0.33), so code
    that reads these moves over unchanged: ``histogram[j]`` counts the steps that accepted
    exactly ``j`` drafts; ``num_draft_tokens`` excludes drafts invalidated by structured output,
    as vLLM's ``vllm:spec_decode_num_draft_tokens`` does.
    """

    num_spec_tokens: int
    histogram: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    per_step_accepted: list[int] = field(default_factory=list)
    per_step_drafted: list[int] = field(default_factory=list)

    @classmethod
    def new(cls, num_spec_tokens: int) -> RequestSpecDecodeMetrics:
        return cls(num_spec_tokens=num_spec_tokens, histogram=[0] * (num_spec_tokens + 1))

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Records one speculative step."""
        if num_accepted >= len(self.histogram):
            self.histogram.extend([0] * (num_accepted + 1 - len(self.histogram)))
        self.histogram[num_accepted] += 1
        self.num_draft_tokens += num_draft_tokens
        self.per_step_accepted.append(num_accepted)
        self.per_step_drafted.append(num_draft_tokens)

    @property
    def acceptance_lengths(self) -> list[int]:
        """Drafts accepted in each speculative step, in order."""
        return list(self.per_step_accepted)

    @property
    def num_spec_steps(self) -> int:
        return len(self.per_step_accepted)

    @property
    def num_accepted_draft_tokens(self) -> int:
        return sum(self.per_step_accepted)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per speculative step, bonus token included: ``1 + accepted / steps``."""
        steps = self.num_spec_steps
        return 1.0 + self.num_accepted_draft_tokens / steps if steps else 1.0

    @property
    def draft_acceptance_rate(self) -> float:
        drafted = self.num_draft_tokens
        return self.num_accepted_draft_tokens / drafted if drafted else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The summary, with upstream vLLM's keys."""
        return {
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "acceptance_histogram": list(self.histogram),
            "num_spec_steps": self.num_spec_steps,
            "num_accepted_draft_tokens": self.num_accepted_draft_tokens,
            "num_draft_tokens": self.num_draft_tokens,
            "num_spec_tokens": self.num_spec_tokens,
        }

    def response_fields(self) -> dict[str, Any]:
        """What a response choice carries: ``acceptance_lengths`` and the summary."""
        return {ACCEPTANCE_LENGTHS: self.acceptance_lengths, SPEC_DECODE_SUMMARY: self.to_dict()}

    def copy(self) -> RequestSpecDecodeMetrics:
        return RequestSpecDecodeMetrics(
            self.num_spec_tokens,
            list(self.histogram),
            self.num_draft_tokens,
            list(self.per_step_accepted),
            list(self.per_step_drafted),
        )


@dataclass
class SpecDecodeStep:
    """One engine step's speculative steps, for one front end.

    Request ``req_ids[i]`` verified ``num_drafted[i]`` drafts and accepted ``num_accepted[i]``.
    Requests without drafts in the step are absent.
    """

    req_ids: list[str] = field(default_factory=list)
    num_drafted: list[int] = field(default_factory=list)
    num_accepted: list[int] = field(default_factory=list)


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
    KV bytes not written are summed, since each rank holds its own heads.
    """
    if all(c is None for c in per_rank):
        return None
    ranks = [dict(c) if c is not None else None for c in per_rank]
    keys = [k for k in next(c for c in ranks if c is not None) if k != "kv_bytes_not_written"]
    for key in keys:
        values = [None if c is None else c.get(key) for c in ranks]
        if any(v != values[0] for v in values):
            by_rank = ", ".join(f"rank {i}: {v!r}" for i, v in enumerate(values))
            raise RuntimeError(f"NWOR counters differ across tensor-parallel ranks: {key} is "
                               f"{by_rank}")
    combined = ranks[0]
    combined["kv_bytes_not_written"] = sum(c["kv_bytes_not_written"] for c in ranks)
    return combined


class SpecTelemetry:
    """The engine core's side: collects each step's speculative steps and engine-wide numbers.

    The scheduler calls :meth:`observe_verify` for every request it verified drafts of, with
    the numbers it adds to vLLM's spec-decode stats, and SCV calls :meth:`observe_chunk_zero`
    for the requests it scheduled without drafts. After each step the engine core takes
    :meth:`take_step` (per front end) and, with log stats, :meth:`take_stats`.

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
        self._steps: dict[int, SpecDecodeStep] = {}
        self._chunk_sizes = [0] * (num_spec_tokens + 1)
        self._chunk_sizes_dirty = False
        self._nwor_dirty = False
        self._nwor_read_at = float("-inf")

    # -- scheduler side -------------------------------------------------------------------------

    def observe_verify(
        self,
        req_id: str,
        num_drafted: int,
        num_accepted: int,
        *,
        num_scheduled_drafts: int,
        client_index: int = 0,
    ) -> None:
        """One speculative step of ``req_id``: ``num_accepted`` of ``num_drafted`` accepted.

        ``num_scheduled_drafts`` includes drafts that structured output invalidated (they were
        verified all the same); it is the step's chunk size.
        """
        step = self._steps.get(client_index)
        if step is None:
            step = self._steps[client_index] = SpecDecodeStep()
        step.req_ids.append(req_id)
        step.num_drafted.append(num_drafted)
        step.num_accepted.append(num_accepted)
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

    def take_step(self) -> dict[int, SpecDecodeStep]:
        """This step's speculative steps by front end (client index); empty when none."""
        steps, self._steps = self._steps, {}
        return steps

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

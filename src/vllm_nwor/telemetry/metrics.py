"""The plugin's Prometheus metrics and its periodic log line, kept in vLLM's front end.

``vllm serve`` runs the API server, the engine core and the workers as separate processes; its
``/metrics`` serves the API server's prometheus_client registry. The numbers reach it with each
engine step's stats (``patches/telemetry/engine.py`` puts them there, ``NworStatLogger`` in
``patches/telemetry/frontend.py`` hands them to :class:`TelemetryMetrics`). Every family carries
vLLM's labels ``model_name`` and ``engine``; all start with ``vllm:nwor_`` or ``vllm:scv_``, so
vLLM's own clean-up of ``vllm:`` collectors between engines covers them too.

PromQL, over a 5-minute window:

- share of staged draft tokens kept out of requests' blocks (rejected)::

      rate(vllm:nwor_tokens_rejected_total[5m]) / rate(vllm:nwor_tokens_staged_total[5m])

- fallbacks by reason: ``sum by (reason) (rate(vllm:nwor_fallbacks_total[5m]))``
- NWOR against vLLM's own counter (1.0 when no step fell back; with async scheduling slightly
  above, docs/telemetry.md says why)::

      rate(vllm:nwor_tokens_committed_total[5m])
        / rate(vllm:spec_decode_num_accepted_tokens_total[5m])

- mean chunk size: ``rate(vllm:scv_chunk_size_sum[5m]) / rate(vllm:scv_chunk_size_count[5m])``
- share of request steps SCV gave chunk 0 (plain decoding)::

      rate(vllm:scv_chunk_zero_steps_total[5m]) / rate(vllm:scv_chunk_size_count[5m])

More in docs/telemetry.md.

- median per-request mean acceptance length::

      histogram_quantile(0.5,
        sum by (le) (rate(vllm:nwor_request_mean_acceptance_length_bucket[5m])))
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from typing import Any

import prometheus_client

from vllm_nwor.telemetry.spec_decode import SpecStepStats

_LABELS = ("model_name", "engine")
_NWOR_TOKEN_COUNTERS = (
    "verify_steps_staged",
    "tokens_staged",
    "tokens_committed",
    "tokens_rejected",
    "rejected_kv_bytes",
)
_MIB = 1 << 20


def mean_acceptance_length_buckets(num_spec_tokens: int) -> list[float]:
    """Upper bounds from 1 (nothing accepted) to k + 1 (everything), in steps of 0.25 to 1."""
    k = max(num_spec_tokens, 1)
    step = 0.25 if k <= 8 else 0.5 if k <= 16 else 1.0
    count = int(round(k / step))
    return [1.0 + i * step for i in range(count + 1)]


class TelemetryMetrics:
    """The plugin's metric families for one engine front end (one vLLM ``StatLoggerManager``).

    NWOR counters arrive as the engine's cumulative totals; the families advance by the
    difference to the last totals seen from that engine.
    """

    def __init__(
        self,
        model_name: str,
        engine_indexes: Sequence[int],
        num_spec_tokens: int,
        *,
        registry: prometheus_client.CollectorRegistry | None = None,
    ) -> None:
        reg: dict[str, Any] = {} if registry is None else {"registry": registry}
        self._model_name = model_name
        self._last_nwor: dict[int, dict[str, Any]] = {}

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> prometheus_client.Counter:
            return prometheus_client.Counter(name, doc, labelnames=_LABELS + extra, **reg)

        self.nwor = {
            "verify_steps_staged": counter(
                "vllm:nwor_verify_steps_staged",
                "Verify steps whose drafts NWOR staged and committed.",
            ),
            "tokens_staged": counter(
                "vllm:nwor_tokens_staged",
                "Draft tokens whose K/V NWOR staged instead of writing to the KV cache.",
            ),
            "tokens_committed": counter(
                "vllm:nwor_tokens_committed",
                "Staged draft tokens that were accepted and committed to the KV cache.",
            ),
            "tokens_rejected": counter(
                "vllm:nwor_tokens_rejected",
                "Staged draft tokens that were rejected; their K/V never reached a request's "
                "own blocks (it was written to NWOR's scratch blocks).",
            ),
            "rejected_kv_bytes": counter(
                "vllm:nwor_rejected_kv_bytes",
                "K and V bytes of the rejected drafts (rejected tokens x one token's K and V in "
                "all target layers, summed over tensor-parallel ranks), kept out of requests' "
                "blocks. NWOR wrote them to its scratch blocks: not bytes saved.",
            ),
        }
        self.nwor_fallbacks = counter(
            "vllm:nwor_fallbacks",
            "Verify steps that took vLLM's plain KV write path, by reason.",
            ("reason",),
        )
        self.chunk_size = prometheus_client.Histogram(
            "vllm:scv_chunk_size",
            "Drafts verified per request step: one observation per speculative step (its "
            "scheduled drafts, cut by SCV when it is on), and with SCV one of 0 per decode "
            "step SCV gave no drafts.",
            labelnames=_LABELS,
            buckets=[float(c) for c in range(num_spec_tokens + 1)],
            **reg,
        )
        self.chunk_zero_steps = counter(
            "vllm:scv_chunk_zero_steps",
            "Decode steps of a request that SCV gave no drafts (chunk 0); 0 without SCV.",
        )
        self.request_mean_acceptance_length = prometheus_client.Histogram(
            "vllm:nwor_request_mean_acceptance_length",
            "Per finished request with at least one speculative step: 1 + accepted drafts / "
            "speculative steps.",
            labelnames=_LABELS,
            buckets=mean_acceptance_length_buckets(num_spec_tokens),
            **reg,
        )
        # Create every engine's series at start-up, as vLLM does, so they read 0, not absent.
        for engine_idx in engine_indexes:
            labels = self._labels(engine_idx)
            for family in (*self.nwor.values(), self.chunk_zero_steps):
                family.labels(*labels)
            self.chunk_size.labels(*labels)
            self.request_mean_acceptance_length.labels(*labels)

    def _labels(self, engine_idx: int) -> tuple[str, str]:
        return self._model_name, str(engine_idx)

    def record_step(self, engine_idx: int, stats: SpecStepStats) -> None:
        labels = self._labels(engine_idx)
        chunk_size = self.chunk_size.labels(*labels)
        for size, count in enumerate(stats.chunk_size_counts):
            if count:
                observe_many(chunk_size, size, count)
        if stats.chunk_size_counts and stats.chunk_size_counts[0]:
            self.chunk_zero_steps.labels(*labels).inc(stats.chunk_size_counts[0])
        if stats.nwor_counters is not None:
            self._record_nwor(engine_idx, labels, stats.nwor_counters)

    def _record_nwor(self, engine_idx: int, labels: tuple[str, str], totals: dict) -> None:
        last = self._last_nwor.get(engine_idx, {})
        for name in _NWOR_TOKEN_COUNTERS:
            delta = _increase(last.get(name, 0), totals[name])
            if delta:
                self.nwor[name].labels(*labels).inc(delta)
        last_fallbacks = last.get("fallbacks", {})
        for reason, total in totals["fallbacks"].items():
            delta = _increase(last_fallbacks.get(reason, 0), total)
            if delta:
                self.nwor_fallbacks.labels(*labels, reason).inc(delta)
        self._last_nwor[engine_idx] = totals

    def record_finished(
        self, engine_idx: int, requests: Iterable[Any]
    ) -> None:
        """``requests``: finished sequences' ``RequestSpecDecodeMetrics`` (vLLM's)."""
        histogram = self.request_mean_acceptance_length.labels(*self._labels(engine_idx))
        for mean in spec_means(requests):
            histogram.observe(mean)


def spec_means(requests: Iterable[Any]) -> list[float]:
    """The mean acceptance length of each finished sequence that had speculative steps, from
    vLLM's per-request ``RequestSpecDecodeMetrics`` (its ``to_dict`` summary)."""
    summaries = (request.to_dict() for request in requests)
    return [s["mean_acceptance_length"] for s in summaries if s["num_spec_steps"]]


def observe_many(histogram: prometheus_client.Histogram, amount: float, count: int) -> None:
    """``histogram.observe(amount)``, ``count`` times, at the cost of one.

    A step of a large batch brings one chunk-size observation per request. prometheus_client
    has no call for many equal observations, so this adds them to the sum and to the one
    bucket ``observe`` would pick (the first bound at or above ``amount``), through the
    histogram's value objects (``_sum``, ``_buckets``, ``_upper_bounds``: the same in the
    multiprocess mode vLLM uses with several API servers). A prometheus_client without them
    gets ``count`` observations.
    """
    total = getattr(histogram, "_sum", None)
    buckets = getattr(histogram, "_buckets", None)
    bounds = getattr(histogram, "_upper_bounds", None)
    if total is None or buckets is None or bounds is None or len(buckets) != len(bounds):
        for _ in range(count):
            histogram.observe(amount)
        return
    total.inc(amount * count)
    buckets[bisect.bisect_left(bounds, amount)].inc(count)


def _increase(last: int, total: int) -> int:
    """How far a cumulative counter moved (a total below the last one means it restarted)."""
    return total - last if total >= last else total


class TelemetryLog:
    """The periodic summary line: what changed since the previous line, or nothing at all.

    vLLM calls its stat loggers' ``log()`` every ``VLLM_LOG_STATS_INTERVAL`` seconds; like vLLM's
    spec-decode line, this one is only written when there is something new.
    """

    def __init__(self) -> None:
        self._reset()
        self._last_nwor: dict[int, dict[str, Any]] = {}
        self._nwor: dict[str, int] = {}
        self._fallbacks: dict[str, int] = {}

    def _reset(self) -> None:
        self._requests = 0
        self._mean_sum = 0.0
        self._mean_min = float("inf")
        self._mean_max = 0.0
        self._chunks = 0
        self._chunk_sum = 0
        self._chunk_zero = 0

    def record_step(self, engine_idx: int, stats: SpecStepStats) -> None:
        for size, count in enumerate(stats.chunk_size_counts):
            self._chunks += count
            self._chunk_sum += size * count
        if stats.chunk_size_counts:
            self._chunk_zero += stats.chunk_size_counts[0]
        if stats.nwor_counters is not None:
            last = self._last_nwor.get(engine_idx, {})
            for name in _NWOR_TOKEN_COUNTERS:
                delta = _increase(last.get(name, 0), stats.nwor_counters[name])
                self._nwor[name] = self._nwor.get(name, 0) + delta
            last_fallbacks = last.get("fallbacks", {})
            for reason, total in stats.nwor_counters["fallbacks"].items():
                delta = _increase(last_fallbacks.get(reason, 0), total)
                if delta:
                    self._fallbacks[reason] = self._fallbacks.get(reason, 0) + delta
            self._last_nwor[engine_idx] = stats.nwor_counters

    def record_finished(self, requests: Iterable[Any]) -> None:
        for mean in spec_means(requests):
            self._requests += 1
            self._mean_sum += mean
            self._mean_min = min(self._mean_min, mean)
            self._mean_max = max(self._mean_max, mean)

    def take_line(self) -> str | None:
        """The line for the interval that just ended, or None when nothing happened."""
        parts = []
        if self._requests:
            parts.append(
                f"{self._requests} requests finished, per-request mean acceptance length "
                f"{self._mean_sum / self._requests:.2f} "
                f"(min {self._mean_min:.2f}, max {self._mean_max:.2f})"
            )
        if self._chunks:
            parts.append(
                f"mean chunk size {self._chunk_sum / self._chunks:.2f} over {self._chunks} "
                f"request steps, {self._chunk_zero} at chunk 0"
            )
        staged = self._nwor.get("tokens_staged", 0)
        if staged or self._fallbacks:
            rejected = self._nwor.get("tokens_rejected", 0)
            fallbacks = ", ".join(f"{k} {v}" for k, v in sorted(self._fallbacks.items()))
            parts.append(
                f"NWOR staged {staged} draft tokens, committed "
                f"{self._nwor.get('tokens_committed', 0)}, rejected {rejected} "
                f"({100.0 * rejected / staged if staged else 0.0:.1f}%), "
                f"{self._nwor.get('rejected_kv_bytes', 0) / _MIB:.1f} MiB of rejected "
                f"drafts' KV kept out of requests' blocks, fallbacks: {fallbacks or 'none'}"
            )
        self._reset()
        self._nwor = {}
        self._fallbacks = {}
        return "; ".join(parts) if parts else None

"""Telemetry: per-request acceptance lengths (:mod:`~vllm_nwor.telemetry.spec_decode`), the
plugin's Prometheus metrics and log line (:mod:`~vllm_nwor.telemetry.metrics`) and the fields in
OpenAI responses (:mod:`~vllm_nwor.telemetry.responses`). Nothing here imports vLLM;
:mod:`vllm_nwor.patches.telemetry` wires it in (docs/telemetry.md)."""

from __future__ import annotations

from vllm_nwor.telemetry.spec_decode import (
    RequestSpecDecodeMetrics,
    SpecDecodeStep,
    SpecStepStats,
    SpecTelemetry,
    combine_rank_counters,
)

__all__ = [
    "RequestSpecDecodeMetrics", "SpecDecodeStep", "SpecStepStats", "SpecTelemetry",
    "combine_rank_counters",
]

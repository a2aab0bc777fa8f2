"""Telemetry: the step numbers behind the plugin's metrics
(:mod:`~vllm_nwor.telemetry.spec_decode`) and its Prometheus metrics and log line
(:mod:`~vllm_nwor.telemetry.metrics`). Per-request acceptance is vLLM's own. Nothing here
imports vLLM; :mod:`vllm_nwor.patches.telemetry` wires it in (docs/telemetry.md)."""

from __future__ import annotations

from vllm_nwor.telemetry.spec_decode import SpecStepStats, SpecTelemetry, combine_rank_counters

__all__ = ["SpecStepStats", "SpecTelemetry", "combine_rank_counters"]

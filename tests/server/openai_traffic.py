"""Reading an OpenAI server's responses and /metrics: shared by the server tests."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import openai
from prometheus_client.parser import text_string_to_metric_families

OURS = ("metrics",)
"""vLLM's per-request metrics in OpenAI responses (``metrics.speculative_decoding``), which the
plugin's telemetry asks vLLM for (``--per-request-spec-decode-metrics detailed``)."""
VOLATILE = ("id", "created", "system_fingerprint")
"""Fields that differ between two servers' equal responses."""


PROCESS_METRICS = ("process_", "python_gc_")
"""prometheus_client's own samples of the server process (CPU seconds, memory, garbage
collections): they move with every scrape, traffic or not, and are not vLLM's or the plugin's."""


def scrape(server) -> dict[tuple, float]:
    """/metrics as {(sample name, labels other than model_name and engine): value}, without the
    process's own samples."""
    values = {}
    for family in text_string_to_metric_families(server.metrics_text()):
        for sample in family.samples:
            if sample.name.startswith(PROCESS_METRICS):
                continue
            labels = tuple(sorted((k, v) for k, v in sample.labels.items()
                                  if k not in ("model_name", "engine")))
            values[(sample.name, labels)] = sample.value
    return values


def settled_scrape(server, timeout_s: float = 10.0) -> dict[tuple, float]:
    """A scrape that two reads in a row agree on (stats are recorded as outputs are sent)."""
    deadline = time.monotonic() + timeout_s
    last = scrape(server)
    while time.monotonic() < deadline:
        time.sleep(0.2)
        current = scrape(server)
        if current == last:
            return current
        last = current
    raise TimeoutError("/metrics kept changing with no traffic")


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def spec_metrics(response) -> dict | None:
    """A response's ``metrics.speculative_decoding`` (vLLM's), from the response, or from the
    stream's final usage chunk; None where vLLM reports none (several prompts or sequences, a
    stream without usage)."""
    last = response[-1] if isinstance(response, list) else response
    metrics = (last.model_extra or {}).get("metrics") or {}
    return metrics.get("speculative_decoding")


def request_totals(response) -> tuple[dict, int, int, int]:
    """A request's speculative-decoding metrics (vLLM's, ``detailed``) and from them:
    speculative steps (entries in ``per_step_accepted``), accepted drafts and drafted tokens."""
    spec = spec_metrics(response)
    assert spec is not None, "vLLM reported no per-request metrics"
    accepted = spec.get("per_step_accepted", [])
    return spec, len(accepted), sum(accepted), spec["num_draft_tokens"]


def request_totals_checked(result: dict, name: str) -> tuple[dict, int, int, int]:
    """``request_totals`` of one ``run_traffic`` result, after asserting that vLLM's own
    spec-decode counters moved by exactly those numbers over that request alone."""
    spec, steps, accepted, drafted = request_totals(result["response"])
    before, after = result["before"], result["after"]
    assert delta(before, after, "vllm:spec_decode_num_drafts_total") == steps, name
    assert delta(before, after, "vllm:spec_decode_num_draft_tokens_total") == drafted, name
    assert delta(before, after, "vllm:spec_decode_num_accepted_tokens_total") == accepted, name
    return spec, steps, accepted, drafted


def as_json(response) -> Any:
    if isinstance(response, list):
        return [json.loads(chunk.model_dump_json()) for chunk in response]
    return json.loads(response.model_dump_json())


def keys_anywhere(value: Any) -> set[str]:
    if isinstance(value, dict):
        return set(value).union(*(keys_anywhere(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(keys_anywhere(v) for v in value))
    return set()


def without(value: Any, drop: tuple[str, ...]) -> Any:
    if isinstance(value, dict):
        return {k: without(v, drop) for k, v in value.items() if k not in drop}
    if isinstance(value, list):
        return [without(v, drop) for v in value]
    return value


def run_traffic(server, requests: Callable[[openai.OpenAI, str], dict[str, Callable]]
                ) -> dict[str, dict]:
    """Sends ``requests(client, model)``'s calls one after another, each bracketed by settled
    /metrics scrapes: name -> {"response", "before", "after"}."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    results = {}
    before = settled_scrape(server)
    for name, call in requests(client, server.model).items():
        response = call()
        after = settled_scrape(server)
        results[name] = {"response": response, "before": before, "after": after}
        before = after
    return results

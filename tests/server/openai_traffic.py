"""Reading an OpenAI server's responses and /metrics: shared by the server tests."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import openai
from prometheus_client.parser import text_string_to_metric_families

OURS = ("acceptance_lengths", "speculative_decoding")
"""The plugin's fields in OpenAI responses."""
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


def final_choices(response) -> list[tuple[int, dict]]:
    """(choice index, the choice's extra fields) of each choice's final response or chunk."""
    if isinstance(response, list):
        return [(c.index, c.model_extra) for chunk in response for c in chunk.choices
                if c.finish_reason is not None]
    return [(c.index, c.model_extra) for c in response.choices]


def request_totals(response) -> tuple[list[dict], int, int, int]:
    """A request's choices' extra fields, and over them: speculative steps (entries in
    ``acceptance_lengths``), accepted drafts and drafted tokens."""
    extras = [extra for _, extra in final_choices(response)]
    steps = sum(len(e["acceptance_lengths"]) for e in extras)
    accepted = sum(sum(e["acceptance_lengths"]) for e in extras)
    drafted = sum(e["speculative_decoding"]["num_draft_tokens"] for e in extras)
    return extras, steps, accepted, drafted


def request_totals_checked(result: dict, name: str) -> tuple[list[dict], int, int, int]:
    """``request_totals`` of one ``run_traffic`` result, after asserting that vLLM's own
    spec-decode counters moved by exactly those numbers over that request alone."""
    extras, steps, accepted, drafted = request_totals(result["response"])
    before, after = result["before"], result["after"]
    assert delta(before, after, "vllm:spec_decode_num_drafts_total") == steps, name
    assert delta(before, after, "vllm:spec_decode_num_draft_tokens_total") == drafted, name
    assert delta(before, after, "vllm:spec_decode_num_accepted_tokens_total") == accepted, name
    return extras, steps, accepted, drafted


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

"""Acceptance lengths through a real ``vllm serve``, against /metrics and vLLM's own counters.

Two servers run the same traffic with the ``openai`` client: one with NWOR on (telemetry follows
it by default, and asks vLLM for its per-request metrics at ``detailed``), one with the plugin
installed but not enabled. Completions and chat, plain and streamed, greedy, and n=2 with
sampling. Every request is bracketed by /metrics scrapes, so each request's acceptance lengths
(vLLM's ``metrics.speculative_decoding.per_step_accepted``) are checked against what vLLM's
spec-decode counters and the plugin's counters moved by for that request alone. A third server,
adaptive SCV alone, runs the same traffic afterwards: its chunk-size metrics request by request,
and greedy output unchanged.
"""

from __future__ import annotations

import collections
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
from openai_traffic import (
    OURS,
    VOLATILE,
    as_json,
    delta,
    keys_anywhere,
    request_totals_checked,
    run_traffic,
    spec_metrics,
    without,
)

pytestmark = pytest.mark.engine

GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
SAMPLED = {"temperature": 0.8, "n": 2, "extra_body": {"ignore_eos": True}}
PROMPTS = ["a b c a b c a b c a b c", "one two one two one two one"]
MESSAGES = [{"role": "user", "content": "x y z x y z x y z x y z"}]
REQUEST_TIMEOUT_S = 120
# K and V of one token in all target layers: 3 layers x 2 x 2 KV heads x 32 x 4 bytes (fp32).
KV_BYTES_PER_TOKEN = 3 * 2 * 2 * 32 * 4


def requests(client: openai.OpenAI, model: str) -> dict[str, Any]:
    """The traffic: name -> a callable returning the response or the list of chunks."""
    kw = {"model": model, "max_tokens": 20, "timeout": REQUEST_TIMEOUT_S}
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    return {
        "completion": lambda: client.completions.create(prompt=PROMPTS[0], **kw, **GREEDY),
        "completion_two_prompts": lambda: client.completions.create(
            prompt=PROMPTS, **kw, **GREEDY),
        "chat": lambda: client.chat.completions.create(messages=MESSAGES, **kw, **GREEDY),
        "completion_stream": lambda: list(client.completions.create(
            prompt=PROMPTS[0], **stream, **kw, **GREEDY)),
        "chat_stream": lambda: list(client.chat.completions.create(
            messages=MESSAGES, **stream, **kw, **GREEDY)),
        "completion_n2": lambda: client.completions.create(prompt=PROMPTS[0], **kw, **SAMPLED),
        "chat_n2_stream": lambda: list(client.chat.completions.create(
            messages=MESSAGES, **stream, **kw, **SAMPLED)),
    }


REPORTED = ("completion", "chat", "completion_stream", "chat_stream")
"""The requests vLLM reports per-request metrics for: one sequence (streams: on the usage
chunk). It reports none for several prompts or n > 1."""


@pytest.fixture(scope="module")
def traffic(telemetry_servers):
    """The same traffic on both servers, at the same time (each server's requests in order)."""
    with ThreadPoolExecutor(2) as pool:
        return tuple(pool.map(lambda server: run_traffic(server, requests),
                              telemetry_servers))


def stream_view(chunks: list[dict]) -> dict:
    """What a stream adds up to, whichever engine steps' deltas its chunks merged: each choice's
    joined text and finish reason, the last chunk's usage, and every key any chunk carries."""
    text: dict[int, str] = collections.defaultdict(str)
    finish = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta_ = choice.get("delta") or {}
            text[choice["index"]] += delta_.get("content") or choice.get("text") or ""
            if choice["finish_reason"] is not None:
                finish[choice["index"]] = choice["finish_reason"]
    return {"text": dict(text), "finish": finish, "usage": chunks[-1].get("usage"),
            "keys": keys_anywhere(chunks)}


def test_single_sequence_requests_carry_vllms_metrics_with_acceptance_lengths(traffic):
    on, _ = traffic
    for name, result in on.items():
        summary = spec_metrics(result["response"])
        if name not in REPORTED:
            assert summary is None, name  # vLLM's rule: one sequence only
            continue
        lengths = summary["per_step_accepted"]  # detailed: the plugin asked for it
        assert len(lengths) == summary["num_spec_steps"] == len(summary["per_step_drafted"])
        assert sum(lengths) == summary["num_accepted_draft_tokens"], name
        assert all(0 <= a <= 3 for a in lengths), name
        assert summary["acceptance_histogram"] == [lengths.count(j) for j in range(4)]
        assert summary["num_spec_tokens"] == 3
        steps = summary["num_spec_steps"]
        assert summary["mean_acceptance_length"] == pytest.approx(
            1 + sum(lengths) / steps if steps else 1.0)


def test_streams_carry_them_on_the_usage_chunk_only(traffic):
    on, _ = traffic
    for name in ("completion_stream", "chat_stream"):
        chunks = on[name]["response"]
        carrying = [i for i, c in enumerate(chunks) if (c.model_extra or {}).get("metrics")]
        assert carrying == [len(chunks) - 1], name
        assert not chunks[-1].choices and chunks[-1].usage is not None, name


def test_each_request_agrees_with_vllm_counters_and_plugin_metrics(traffic):
    on, _ = traffic
    totals = {"steps": 0, "accepted": 0}
    for name in REPORTED:
        result = on[name]
        before, after = result["before"], result["after"]
        # vLLM's own spec-decode counters, for this request alone, are checked in here.
        spec, steps, accepted, drafted = request_totals_checked(result, name)
        means = [spec["mean_acceptance_length"]] if steps else []

        def d(metric: str, before=before, after=after) -> float:
            return delta(before, after, metric)

        # The plugin's NWOR counters (no step fell back).
        assert d("vllm:nwor_tokens_staged_total") == drafted, name
        assert d("vllm:nwor_tokens_committed_total") == accepted, name
        assert d("vllm:nwor_tokens_rejected_total") == drafted - accepted, name
        assert d("vllm:nwor_rejected_kv_bytes_total") == \
            (drafted - accepted) * KV_BYTES_PER_TOKEN, name
        assert not any(k[0] == "vllm:nwor_fallbacks_total" and after[k] for k in after), name
        # Chunk sizes (no SCV: the scheduled drafts) and the per-request histogram.
        assert d("vllm:scv_chunk_size_count") == steps, name
        assert d("vllm:scv_chunk_size_sum") == drafted, name
        assert d("vllm:scv_chunk_zero_steps_total") == 0, name
        assert d("vllm:nwor_request_mean_acceptance_length_count") == len(means), name
        assert d("vllm:nwor_request_mean_acceptance_length_sum") == pytest.approx(sum(means))
        totals["steps"] += steps
        totals["accepted"] += accepted
    # The workload must speculate, and accept and reject drafts, or the checks above are empty.
    assert totals["steps"] > 10 and totals["accepted"] > 0


def test_plugin_off_server_has_none_of_the_fields_and_nothing_else_changes(traffic):
    on, off = traffic
    for name in on:
        off_json, on_json = as_json(off[name]["response"]), as_json(on[name]["response"])
        assert spec_metrics(off[name]["response"]) is None, name
        if name.endswith(("_n2", "_n2_stream")):  # sampled: compare the shape only
            assert keys_anywhere(without(on_json, OURS)) == \
                keys_anywhere(without(off_json, OURS)), name
        elif name.endswith("_stream"):  # the frontend merges steps' deltas as timing allows
            assert stream_view(without(on_json, OURS + VOLATILE)) == \
                stream_view(without(off_json, OURS + VOLATILE)), name
        else:
            assert without(on_json, OURS + VOLATILE) == \
                without(off_json, OURS + VOLATILE), name
    metrics_off = off["chat"]["after"]
    assert not [k for k in metrics_off if k[0].startswith(("vllm:nwor_", "vllm:scv_"))]
    for name in ("completion", "chat", "completion_stream", "chat_stream"):
        for counter in ("vllm:spec_decode_num_drafts_total",
                        "vllm:spec_decode_num_accepted_tokens_total"):
            assert delta(off[name]["before"], off[name]["after"], counter) == \
                delta(on[name]["before"], on[name]["after"], counter), (name, counter)


@pytest.fixture(scope="module")
def scv_traffic(scv_server):
    return run_traffic(scv_server, requests)


def test_scv_chunk_metrics_agree_with_acceptance_lengths_request_by_request(scv_traffic):
    totals = {"steps": 0, "zero": 0}
    for name in REPORTED:
        result = scv_traffic[name]
        before, after = result["before"], result["after"]
        # Steps SCV gave chunk 0 are no speculative steps: vLLM's counters and the lists agree.
        _, steps, accepted, drafted = request_totals_checked(result, name)

        def d(metric: str, before=before, after=after, **labels) -> float:
            return delta(before, after, metric, **labels)

        # The histogram has one observation per speculative step plus one 0 per chunk-0 step.
        zero = d("vllm:scv_chunk_zero_steps_total")
        assert d("vllm:scv_chunk_size_count") == steps + zero, name
        assert d("vllm:scv_chunk_size_bucket", le="0.0") == zero, name
        assert d("vllm:scv_chunk_size_sum") == drafted, name
        assert d("vllm:nwor_tokens_staged_total") == 0, name  # NWOR is off here
        totals["steps"] += steps
        totals["zero"] += zero
    # SCV's warm-up explores chunk 0 from a fixed seed: the workload must hit both kinds.
    assert totals["steps"] > 10 and totals["zero"] > 0, totals


def test_scv_server_changes_no_greedy_response(scv_traffic, traffic):
    _, off = traffic
    for name in ("completion", "chat"):
        scv_json, off_json = as_json(scv_traffic[name]["response"]), as_json(off[name]["response"])
        assert without(scv_json, OURS + VOLATILE) == without(off_json, OURS + VOLATILE), name
        assert spec_metrics(scv_traffic[name]["response"]) is not None, name  # follows scv
    # Streams are cut per engine step, and SCV changes how many tokens a step emits: compare
    # what they add up to.
    for name in ("completion_stream", "chat_stream"):
        scv_json, off_json = as_json(scv_traffic[name]["response"]), as_json(off[name]["response"])
        assert stream_view(without(scv_json, OURS + VOLATILE)) == \
            stream_view(without(off_json, OURS + VOLATILE)), name
        assert spec_metrics(scv_traffic[name]["response"]) is not None, name

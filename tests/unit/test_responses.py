"""Acceptance lengths in OpenAI responses and stream chunks (no vLLM needed)."""

import json
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

from vllm_nwor.telemetry import RequestSpecDecodeMetrics
from vllm_nwor.telemetry.responses import StreamAnnotator, annotate_response


def metrics(*accepted: int) -> RequestSpecDecodeMetrics:
    m = RequestSpecDecodeMetrics.new(3)
    for a in accepted:
        m.observe(3, a)
    return m


@dataclass
class Output:
    index: int
    finish_reason: str | None = "length"
    spec_decode_metrics: RequestSpecDecodeMetrics | None = None


class Model(BaseModel):  # like vLLM's OpenAIBaseModel
    model_config = ConfigDict(extra="allow")


class Choice(Model):
    index: int
    text: str = ""


class Response(Model):
    id: str = "cmpl-1"
    choices: list[Choice]


def test_response_choices_and_top_level_get_the_fields():
    response = Response(choices=[Choice(index=0), Choice(index=1)])
    annotate_response(response, {0: Output(0, spec_decode_metrics=metrics(1, 2)),
                                 1: Output(1, spec_decode_metrics=metrics(0))})
    dumped = response.model_dump()
    assert dumped["choices"][0]["acceptance_lengths"] == [1, 2]
    assert dumped["choices"][1]["acceptance_lengths"] == [0]
    assert dumped["acceptance_lengths"] == [1, 2]
    assert dumped["speculative_decoding"]["num_spec_steps"] == 2


def test_outputs_without_metrics_leave_the_response_alone():
    response = Response(choices=[Choice(index=0)])
    before = response.model_dump_json()
    annotate_response(response, {0: Output(0)})
    assert response.model_dump_json() == before


def event(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def test_final_chunk_gets_fields_spliced_and_every_other_byte_kept():
    annotator = StreamAnnotator()
    middle = event({"id": "c", "choices": [{"index": 0, "text": "x", "finish_reason": None}]})
    final = event({"id": "c", "choices": [{"index": 0, "text": "é \"}", "finish_reason": "stop",
                                           "logprobs": {"a": [1.5e-07]}}], "model": "m"})
    assert annotator.rewrite(final) == final  # nothing known yet
    annotator.observe(0, Output(0, finish_reason=None))
    annotator.observe(0, Output(0, spec_decode_metrics=metrics(2, 0)))
    assert annotator.rewrite(middle) == middle
    rewritten = annotator.rewrite(final)
    assert rewritten.startswith("data: ") and rewritten.endswith("\n\n")
    body = json.loads(rewritten[6:])
    assert body["choices"][0]["acceptance_lengths"] == [2, 0]
    assert body["acceptance_lengths"] == [2, 0]
    assert body["choices"][0]["text"] == "é \"}" and body["model"] == "m"
    assert rewritten.count(',"acceptance_lengths":[2,0],"speculative_decoding":{') == 2
    original_choice = final[6:].split('"model"')[0]
    assert rewritten.startswith("data: " + original_choice[:-3])  # the choice's bytes, unchanged


def test_usage_chunk_gets_choice_0s_fields_and_other_choices_only_their_own():
    annotator = StreamAnnotator()
    annotator.observe(1, Output(1, spec_decode_metrics=metrics(3)))
    second = event({"choices": [{"index": 1, "finish_reason": "length"}]})
    body = json.loads(annotator.rewrite(second)[6:])
    assert body["choices"][0]["acceptance_lengths"] == [3] and "acceptance_lengths" not in body
    annotator.observe(0, Output(0, spec_decode_metrics=metrics(1)))
    usage = event({"id": "c", "choices": [], "usage": {"total_tokens": 3}})
    body = json.loads(annotator.rewrite(usage)[6:])
    assert body["acceptance_lengths"] == [1] and body["usage"] == {"total_tokens": 3}


def test_non_json_and_done_events_pass_through():
    annotator = StreamAnnotator()
    annotator.observe(0, Output(0, spec_decode_metrics=metrics(1)))
    for raw in ("data: [DONE]\n\n", 'data: {"error": {"message": "x"}}\n\n', "data: {bad\n\n"):
        assert annotator.rewrite(raw) == raw

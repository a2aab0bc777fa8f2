"""Acceptance lengths in OpenAI-compatible responses (completions and chat completions).

Each choice of a finished sequence gets two fields, and the response gets choice 0's at the top
level (the openai SDK exposes them as ``completion.model_extra[...]``):

- ``acceptance_lengths``: drafts accepted in each speculative step of the sequence;
- ``speculative_decoding``: the summary, with upstream vLLM's keys (see
  :meth:`RequestSpecDecodeMetrics.to_dict`).

Not streaming, they go on the final response. Streaming, a choice's fields go on the chunk
that finishes it (choice 0's also at that chunk's top level), and choice 0's on the trailing
usage chunk when there is one. vLLM serialises each chunk before the plugin sees it, so the
fields are spliced into the JSON text: every other byte of the chunk stays as vLLM wrote it.
Nothing here imports vLLM.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

_DECODER = json.JSONDecoder()
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_SSE_PREFIX = "data: "


def output_fields(output: Any) -> dict[str, Any] | None:
    """The fields a finished output carries, or None (plugin off, or not finished)."""
    metrics = getattr(output, "spec_decode_metrics", None)
    if metrics is None or getattr(output, "finish_reason", None) is None:
        return None
    return metrics.response_fields()


def annotate_response(response: Any, outputs_by_choice: Mapping[int, Any]) -> None:
    """Sets the fields on a non-streaming response's choices (and choice 0's at the top)."""
    for choice in getattr(response, "choices", None) or ():
        fields = output_fields(outputs_by_choice.get(choice.index))
        if fields is None:
            continue
        for name, value in fields.items():
            setattr(choice, name, value)
            if choice.index == 0:
                setattr(response, name, value)


class StreamAnnotator:
    """Adds the fields to one stream's chunks, as they are about to be sent."""

    def __init__(self) -> None:
        self._pending: dict[int, dict[str, Any]] = {}
        self._choice0: dict[str, Any] | None = None

    def observe(self, choice_index: int, output: Any) -> None:
        """Called for every output the stream generator receives, before it makes chunks."""
        fields = output_fields(output)
        if fields is not None:
            self._pending[choice_index] = fields
            if choice_index == 0:
                self._choice0 = fields

    def rewrite(self, event: str) -> str:
        if (not self._pending and self._choice0 is None) or not event.startswith(_SSE_PREFIX):
            return event
        body = event[len(_SSE_PREFIX) :].rstrip("\n")
        if not body.startswith("{"):
            return event
        try:
            spans = _top_level_spans(body)
        except (ValueError, IndexError):
            return event
        if "choices" not in spans:
            return event
        start, end = spans["choices"]
        choices = json.loads(body[start:end])
        if not choices:
            if "usage" in spans and self._choice0 is not None:
                return _event(_splice(body, len(body) - 1, self._choice0))
            return event
        if len(choices) != 1 or choices[0].get("finish_reason") is None:
            return event
        index = choices[0].get("index")
        fields = self._pending.pop(index, None)
        if fields is None:
            return event
        choice_start = _WHITESPACE.match(body, start + 1).end()
        _, choice_end = _DECODER.raw_decode(body, choice_start)
        body = _splice(body, choice_end - 1, fields)
        if index == 0:
            body = _splice(body, len(body) - 1, fields)
        return _event(body)


def _event(body: str) -> str:
    return f"{_SSE_PREFIX}{body}\n\n"


def _splice(body: str, closing_brace: int, fields: dict[str, Any]) -> str:
    """Inserts ``fields`` as the last members of the object that closes at ``closing_brace``."""
    members = json.dumps(fields, separators=(",", ":"), ensure_ascii=False)[1:-1]
    before = body[:closing_brace].rstrip()
    comma = "" if before.endswith("{") else ","
    return f"{before}{comma}{members}{body[closing_brace:]}"


def _top_level_spans(body: str) -> dict[str, tuple[int, int]]:
    """Where each top-level member's value starts and ends in a JSON object's text."""
    spans: dict[str, tuple[int, int]] = {}
    i = _WHITESPACE.match(body, 1).end()
    while body[i] != "}":
        key, i = _DECODER.raw_decode(body, i)
        i = _WHITESPACE.match(body, i).end()
        if body[i] != ":":
            raise ValueError("expected ':'")
        start = _WHITESPACE.match(body, i + 1).end()
        _, end = _DECODER.raw_decode(body, start)
        spans[key] = (start, end)
        i = _WHITESPACE.match(body, end).end()
        if body[i] == ",":
            i = _WHITESPACE.match(body, i + 1).end()
    return spans

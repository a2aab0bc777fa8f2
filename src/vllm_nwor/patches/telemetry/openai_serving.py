"""OpenAI-server patches: acceptance lengths in completions and chat-completions responses.

Applied when the front end builds an ``AsyncLLM`` (``telemetry_frontend.py``), so engine-core
and worker processes never import the server's modules.

Each wrapper runs the original and only adds fields (see ``vllm_nwor.telemetry.responses``); with
telemetry off it hands straight through. The final ``RequestOutput``\\s already carry the data
(``NworCompletionOutput``, ``telemetry_frontend.py``): the non-streaming wrappers read them from
the original's inputs, the streaming ones watch the results stream into the original.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator
from typing import Any

from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

from vllm_nwor.patches._patch import Patch
from vllm_nwor.patches.telemetry.frontend import telemetry_on
from vllm_nwor.telemetry.responses import StreamAnnotator, annotate_response

_ON_ATTR = "_nwor_telemetry_on"


def _enabled(serving: Any) -> bool:
    on = serving.__dict__.get(_ON_ATTR)
    if on is None:
        on = serving.__dict__[_ON_ATTR] = telemetry_on(
            getattr(serving.engine_client, "vllm_config", None)
        )
    return on


def _replace_argument(signature, name: str, args, kwargs, make):
    """``args, kwargs`` for a call with the argument ``name`` replaced by ``make(it)``."""
    bound = signature.bind(*args, **kwargs)
    bound.arguments[name] = make(bound.arguments[name])
    return bound.args, bound.kwargs


def _wrap_completion_response(request_output_to_completion_response):
    def wrapper(self, final_res_batch, *args, **kwargs):
        response = request_output_to_completion_response(self, final_res_batch, *args, **kwargs)
        if _enabled(self):
            outputs = [output for res in final_res_batch for output in res.outputs]
            annotate_response(response, dict(enumerate(outputs)))
        return response

    return wrapper


def _wrap_chat_full_generator(chat_completion_full_generator):
    signature = inspect.signature(chat_completion_full_generator)

    async def wrapper(self, *args, **kwargs):
        if not _enabled(self):
            return await chat_completion_full_generator(self, *args, **kwargs)
        final: list[Any] = []

        async def watched(results: AsyncIterator[Any]):
            async for res in results:
                final[:] = [res]
                yield res

        args, kwargs = _replace_argument(
            signature, "result_generator", (self, *args), kwargs, watched
        )
        response = await chat_completion_full_generator(*args, **kwargs)
        if final:
            annotate_response(response, {o.index: o for o in final[0].outputs})
        return response

    return wrapper


def _wrap_stream_generator(stream_generator, choice_index):
    """``choice_index(result, output, num_choices) -> int`` as the original numbers choices."""
    signature = inspect.signature(stream_generator)

    def wrapper(self, request, *args, **kwargs):
        if not _enabled(self):
            return stream_generator(self, request, *args, **kwargs)
        annotator = StreamAnnotator()
        num_choices = 1 if request.n is None else request.n

        async def watched(results: AsyncIterator[Any]):
            async for result in results:
                res = result[1] if isinstance(result, tuple) else result
                for output in res.outputs:
                    annotator.observe(choice_index(result, output, num_choices), output)
                yield result

        args, kwargs = _replace_argument(
            signature, "result_generator", (self, request, *args), kwargs, watched
        )

        async def annotated():
            async for event in stream_generator(*args, **kwargs):
                yield annotator.rewrite(event)

        return annotated()

    return wrapper


def _completion_choice(result, output, num_choices: int) -> int:
    prompt_idx, _ = result
    return output.index + prompt_idx * num_choices


def _chat_choice(result, output, num_choices: int) -> int:
    return output.index


def _wrap_completion_stream_generator(completion_stream_generator):
    return _wrap_stream_generator(completion_stream_generator, _completion_choice)


def _wrap_chat_stream_generator(chat_completion_stream_generator):
    return _wrap_stream_generator(chat_completion_stream_generator, _chat_choice)


PATCHES = [
    Patch(
        OpenAIServingCompletion,
        "request_output_to_completion_response",
        _wrap_completion_response,
        why="Add acceptance_lengths and the summary to a non-streaming completion.",
    ),
    Patch(
        OpenAIServingCompletion,
        "completion_stream_generator",
        _wrap_completion_stream_generator,
        why="Add them to the chunk that finishes each choice of a streamed completion.",
    ),
    Patch(
        OpenAIServingChat,
        "chat_completion_full_generator",
        _wrap_chat_full_generator,
        why="Add acceptance_lengths and the summary to a non-streaming chat completion.",
    ),
    Patch(
        OpenAIServingChat,
        "chat_completion_stream_generator",
        _wrap_chat_stream_generator,
        why="Add them to the chunk that finishes each choice of a streamed chat completion.",
    ),
]

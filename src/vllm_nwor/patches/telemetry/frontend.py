"""Front-end patches for telemetry: per-request acceptance lengths on outputs, and metrics.

The engine core sends each step's speculative steps on its outputs (``telemetry_engine.py``).
In the front end (the ``LLM`` caller, or ``vllm serve``'s API server):

1. ``MPClient.__init__``: decode the engine core's outputs as the plugin's subclasses, so the
   extra trailing fields are kept (vLLM's own types would drop them).
2. ``LLMEngine.__init__`` / ``AsyncLLM.__init__``: give the engine client and the output
   processor one :class:`FrontendTelemetry` (only these two objects own both). The AsyncLLM one
   also applies the OpenAI-server patches.
3. ``InprocClient.get_output``, ``SyncMPClient.get_output``, ``AsyncMPClient.get_output_async``:
   before a step's outputs are processed, add its speculative steps to each request's
   :class:`RequestSpecDecodeMetrics`. This runs in the thread that processes the outputs, after
   any earlier step: a request the front end finishes (a stop string) has exactly the steps
   whose tokens it returned.
4. ``OutputProcessor.add_request``: every request starts with empty metrics, so one that never
   speculated reports ``acceptance_lengths: []``.
5. ``RequestState._new_completion_output``: a finished ``CompletionOutput`` becomes a
   :class:`NworCompletionOutput` with ``acceptance_lengths`` and ``spec_decode_metrics``.
   ``RequestOutput.add``: when a stream's consumer falls behind, vLLM merges the finished
   output into an earlier one in place; the merged output becomes one too.
6. ``OutputProcessor._update_stats_from_finished``: hand finished requests' metrics to the
   step's ``IterationStats`` for the stat logger.
7. ``StatLoggerManager.__init__``: add :class:`NworStatLogger` (Prometheus and the log line).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from vllm.outputs import CompletionOutput, RequestOutput
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.core_client import AsyncMPClient, InprocClient, MPClient, SyncMPClient
from vllm.v1.engine.llm_engine import LLMEngine
from vllm.v1.engine.output_processor import OutputProcessor, RequestState
from vllm.v1.metrics.loggers import AggregateStatLoggerBase, StatLoggerManager
from vllm.v1.serial_utils import MsgpackDecoder

from vllm_nwor._logging import get_logger
from vllm_nwor.patches._patch import Patch
from vllm_nwor.patches.settings import plugin_config
from vllm_nwor.patches.telemetry.engine import NworEngineCoreOutputs
from vllm_nwor.telemetry.metrics import TelemetryLog, TelemetryMetrics
from vllm_nwor.telemetry.spec_decode import RequestSpecDecodeMetrics

logger = get_logger(__name__)

FRONTEND_ATTR = "_nwor_frontend_telemetry"
"""Set on the engine client and the output processor: their :class:`FrontendTelemetry`."""

REQUEST_ATTR = "_nwor_spec_decode_metrics"
"""Set on each ``RequestState``: its :class:`RequestSpecDecodeMetrics`."""

FINISHED_ATTR = "nwor_finished_spec_decode_metrics"
"""Set on an ``IterationStats``: the metrics of the requests that finished in it."""


def telemetry_on(vllm_config: Any) -> bool:
    """Whether this engine reports acceptance lengths (telemetry on, speculative decoding on)."""
    if vllm_config is None or vllm_config.speculative_config is None:
        return False
    return plugin_config(vllm_config).telemetry


class FrontendTelemetry:
    """Adds each step's speculative steps to the requests' metrics, in the front end."""

    def __init__(self, num_spec_tokens: int, request_states: dict[str, RequestState]) -> None:
        self.num_spec_tokens = num_spec_tokens
        self.request_states = request_states

    def start_request(self, state: RequestState) -> None:
        if REQUEST_ATTR not in state.__dict__:
            state.__dict__[REQUEST_ATTR] = RequestSpecDecodeMetrics.new(self.num_spec_tokens)

    def observe(self, outputs: Any) -> None:
        step = getattr(outputs, "spec_decode_step", None)
        if step is None:
            return
        states = self.request_states
        for req_id, drafted, accepted in zip(
            step.req_ids, step.num_drafted, step.num_accepted, strict=True
        ):
            state = states.get(req_id)
            if state is not None and (metrics := state.__dict__.get(REQUEST_ATTR)) is not None:
                metrics.observe(drafted, accepted)


@dataclass
class NworCompletionOutput(CompletionOutput):
    """vLLM's ``CompletionOutput`` of a finished sequence, with its speculative decoding.

    ``acceptance_lengths[i]`` is the number of drafts accepted in the sequence's i-th
    speculative step; ``spec_decode_metrics`` is the summary (upstream vLLM's name and type).
    """

    acceptance_lengths: list[int] | None = None
    spec_decode_metrics: RequestSpecDecodeMetrics | None = None

    @classmethod
    def of(cls, output: CompletionOutput, metrics: RequestSpecDecodeMetrics):
        values = {f.name: getattr(output, f.name) for f in fields(CompletionOutput)}
        # vLLM 0.32 has the field itself (--per-request-spec-decode-metrics): its own wins.
        values["spec_decode_metrics"] = values.get("spec_decode_metrics") or metrics.copy()
        return cls(**values, acceptance_lengths=metrics.acceptance_lengths)

    def __repr__(self) -> str:
        return (
            f"{CompletionOutput.__repr__(self)[:-1]}, "
            f"acceptance_lengths={self.acceptance_lengths})"
        )


class NworStatLogger(AggregateStatLoggerBase):
    """The plugin's Prometheus metrics and periodic log line, fed with vLLM's step stats."""

    def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
        self.metrics = TelemetryMetrics(
            vllm_config.model_config.served_model_name,
            engine_indexes or [0],
            vllm_config.speculative_config.num_speculative_tokens,
        )
        self.summary = TelemetryLog()

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
        step = getattr(scheduler_stats, "nwor", None)
        if step is not None:
            self.metrics.record_step(engine_idx, step)
            self.summary.record_step(engine_idx, step)
        finished = None if iteration_stats is None else vars(iteration_stats).get(FINISHED_ATTR)
        if finished:
            self.metrics.record_finished(engine_idx, finished)
            self.summary.record_finished(finished)

    def log(self) -> None:
        line = self.summary.take_line()
        if line is not None:
            logger.info("vllm-nwor: %s", line)

    def log_engine_initialized(self) -> None:
        pass


# -- patches ------------------------------------------------------------------------------------


def _wrap_mp_client_init(init):
    def wrapper(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if telemetry_on(self.vllm_config):
            self.decoder = MsgpackDecoder(NworEngineCoreOutputs)

    return wrapper


def _link_frontend(engine: LLMEngine | AsyncLLM) -> bool:
    vllm_config = engine.vllm_config
    if not telemetry_on(vllm_config):
        return False
    frontend = FrontendTelemetry(
        vllm_config.speculative_config.num_speculative_tokens,
        engine.output_processor.request_states,
    )
    engine.output_processor.__dict__[FRONTEND_ATTR] = frontend
    engine.engine_core.__dict__[FRONTEND_ATTR] = frontend
    return True


def _wrap_llm_engine_init(init):
    def wrapper(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _link_frontend(self)

    return wrapper


def _wrap_async_llm_init(init):
    def wrapper(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if _link_frontend(self):
            from vllm_nwor.patches import apply_serving

            apply_serving()

    return wrapper


def _wrap_get_output(get_output):
    def wrapper(self):
        outputs = get_output(self)
        if (frontend := self.__dict__.get(FRONTEND_ATTR)) is not None:
            frontend.observe(outputs)
        return outputs

    return wrapper


def _wrap_get_output_async(get_output_async):
    async def wrapper(self):
        outputs = await get_output_async(self)
        if (frontend := self.__dict__.get(FRONTEND_ATTR)) is not None:
            frontend.observe(outputs)
        return outputs

    return wrapper


def _wrap_add_request(add_request):
    def wrapper(self, request, *args, **kwargs):
        add_request(self, request, *args, **kwargs)
        if (frontend := self.__dict__.get(FRONTEND_ATTR)) is not None:
            if (state := self.request_states.get(request.request_id)) is not None:
                frontend.start_request(state)

    return wrapper


def _wrap_new_completion_output(new_completion_output):
    def wrapper(self, token_ids, finish_reason, stop_reason):
        output = new_completion_output(self, token_ids, finish_reason, stop_reason)
        if finish_reason is not None and (metrics := self.__dict__.get(REQUEST_ATTR)):
            output = NworCompletionOutput.of(output, metrics)
        return output

    return wrapper


def _wrap_request_output_add(add):
    def wrapper(self, next_output, aggregate):
        add(self, next_output, aggregate)
        if not aggregate:  # vLLM keeps next_output's own outputs
            return
        finished = {o.index: o for o in next_output.outputs if isinstance(o, NworCompletionOutput)}
        if finished:
            for i, merged in enumerate(self.outputs):
                done = finished.get(merged.index)
                if done is not None and merged is not done:
                    self.outputs[i] = NworCompletionOutput.of(merged, done.spec_decode_metrics)

    return wrapper


def _wrap_update_stats_from_finished(update_stats_from_finished):
    def wrapper(self, req_state, finish_reason, iteration_stats):
        update_stats_from_finished(self, req_state, finish_reason, iteration_stats)
        if iteration_stats is not None and (metrics := req_state.__dict__.get(REQUEST_ATTR)):
            vars(iteration_stats).setdefault(FINISHED_ATTR, []).append(metrics)

    return wrapper


def _wrap_stat_logger_manager_init(init):
    def wrapper(self, vllm_config, *args, **kwargs):
        init(self, vllm_config, *args, **kwargs)
        if telemetry_on(vllm_config):
            self.stat_loggers.append(NworStatLogger(vllm_config, self.engine_indexes))

    return wrapper


PATCHES = [
    Patch(
        MPClient,
        "__init__",
        _wrap_mp_client_init,
        why="Decode the engine core's outputs as the plugin's subclasses, which keep the "
        "telemetry fields; set before SyncMPClient/AsyncMPClient capture the decoder.",
    ),
    Patch(
        LLMEngine,
        "__init__",
        _wrap_llm_engine_init,
        why="Link the engine client and the output processor of an LLM to one front-end "
        "telemetry object.",
    ),
    Patch(
        AsyncLLM,
        "__init__",
        _wrap_async_llm_init,
        why="Link the engine client and the output processor of vllm serve to one front-end "
        "telemetry object, and apply the OpenAI-server patches (openai_serving.py).",
    ),
    Patch(
        InprocClient,
        "get_output",
        _wrap_get_output,
        why="Record a step's speculative steps before its outputs are processed (engine core "
        "in process).",
    ),
    Patch(
        SyncMPClient,
        "get_output",
        _wrap_get_output,
        why="Record a step's speculative steps before its outputs are processed (LLM).",
    ),
    Patch(
        AsyncMPClient,
        "get_output_async",
        _wrap_get_output_async,
        why="Record a step's speculative steps before its outputs are processed (vllm serve).",
    ),
    Patch(
        OutputProcessor,
        "add_request",
        _wrap_add_request,
        why="Start every request with empty speculative-decoding metrics.",
    ),
    Patch(
        RequestState,
        "_new_completion_output",
        _wrap_new_completion_output,
        why="Put acceptance_lengths and spec_decode_metrics on a finished CompletionOutput. "
        "Retired by CompletionOutput.spec_decode_metrics (vLLM 0.33).",
    ),
    Patch(
        RequestOutput,
        "add",
        _wrap_request_output_add,
        why="Keep them when a stream's outputs are merged because its consumer fell behind "
        "(vLLM merges into the earlier, plain CompletionOutput).",
    ),
    Patch(
        OutputProcessor,
        "_update_stats_from_finished",
        _wrap_update_stats_from_finished,
        why="Hand a finished request's metrics to the step's IterationStats, which the stat "
        "loggers receive.",
    ),
    Patch(
        StatLoggerManager,
        "__init__",
        _wrap_stat_logger_manager_init,
        why="Add the plugin's stat logger next to vLLM's (the vllm.stat_logger_plugins group "
        "reaches AsyncLLM only, and needs an installed entry point).",
    ),
]

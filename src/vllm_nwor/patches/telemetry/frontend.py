"""Front-end patches for telemetry: the plugin's metrics.

Per-request acceptance is vLLM's own (``--per-request-spec-decode-metrics``, which telemetry
sets to ``detailed``: ``CompletionOutput.spec_decode_metrics`` and the responses'
``metrics.speculative_decoding``). The plugin adds its step numbers (chunk sizes, NWOR's
counters), which the engine core sends with vLLM's scheduler stats (``engine.py``):

1. ``MPClient.__init__``: decode the engine core's outputs as the plugin's subclass, so the
   extra trailing field is kept (vLLM's own types would drop it).
2. ``OutputProcessor._update_stats_from_finished``: hand finished requests' metrics (vLLM's)
   to the step's ``IterationStats`` for the stat logger.
3. ``StatLoggerManager.__init__``: add :class:`NworStatLogger` (Prometheus and the log line).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.engine.core_client import MPClient
from vllm.v1.engine.output_processor import OutputProcessor
from vllm.v1.metrics.loggers import AggregateStatLoggerBase, StatLoggerManager
from vllm.v1.serial_utils import MsgpackDecoder

from vllm_nwor._logging import get_logger
from vllm_nwor.patches._patch import Patch
from vllm_nwor.patches.settings import plugin_config
from vllm_nwor.patches.telemetry.engine import NworEngineCoreOutputs
from vllm_nwor.telemetry.metrics import TelemetryLog, TelemetryMetrics

logger = get_logger(__name__)

FINISHED_ATTR = "nwor_finished_spec_decode_metrics"
"""Set on an ``IterationStats``: the metrics of the requests that finished in it."""


def telemetry_on(vllm_config: Any) -> bool:
    """Whether this engine has the plugin's metrics (telemetry on, speculative decoding on)."""
    if vllm_config is None or vllm_config.speculative_config is None:
        return False
    return plugin_config(vllm_config).telemetry


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


def _wrap_update_stats_from_finished(update_stats_from_finished):
    def wrapper(self, req_state, finish_reason, iteration_stats):
        update_stats_from_finished(self, req_state, finish_reason, iteration_stats)
        metrics = req_state.spec_decode_metrics
        if iteration_stats is not None and metrics is not None:
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
        why="Decode the engine core's outputs as the plugin's subclass, which keeps the "
        "step numbers on the scheduler stats; set before SyncMPClient/AsyncMPClient capture "
        "the decoder.",
    ),
    Patch(
        OutputProcessor,
        "_update_stats_from_finished",
        _wrap_update_stats_from_finished,
        why="Hand a finished request's speculative-decoding metrics (vLLM's) to the step's "
        "IterationStats, which the stat loggers receive.",
    ),
    Patch(
        StatLoggerManager,
        "__init__",
        _wrap_stat_logger_manager_init,
        why="Add the plugin's stat logger next to vLLM's (the vllm.stat_logger_plugins group "
        "reaches AsyncLLM only, and needs an installed entry point).",
    ),
]

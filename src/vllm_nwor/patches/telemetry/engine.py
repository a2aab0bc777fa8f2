"""Engine-core patches for telemetry: the step numbers behind the plugin's metrics.

``Scheduler.make_spec_decoding_stats`` receives, per verified request, the drafts it verified:
the plugin counts chunk sizes there (SCV adds its chunk-0 steps). After the step, with vLLM's
log stats on, the engine core attaches them (and NWOR's counters, read from the workers) to the
scheduler stats it sends to its front ends. Per-request acceptance is vLLM's own
(``--per-request-spec-decode-metrics``).

Carriers. ``EngineCoreOutputs`` and ``SchedulerStats`` have fixed fields, so the plugin sends
subclasses: :class:`NworSchedulerStats` adds ``nwor`` (chunk sizes, NWOR counters), and
:class:`NworEngineCoreOutputs` types its ``scheduler_stats`` so that the front end
(``frontend.py``) decodes it. msgspec encodes a subclass instance with its extra trailing
field; a front end that decodes vLLM's own types ignores it. Nothing rides on a field vLLM or
users read, and with telemetry off nothing is built, so the bytes on the wire are vLLM's own.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.engine.core import EngineCore
from vllm.v1.metrics.stats import SchedulerStats

from vllm_nwor._logging import get_logger
from vllm_nwor.patches._patch import Patch
from vllm_nwor.patches.settings import plugin_config
from vllm_nwor.patches.shared import CHUNK_ZERO_ATTR
from vllm_nwor.telemetry.spec_decode import (
    SpecStepStats,
    SpecTelemetry,
    combine_rank_counters,
)

logger = get_logger(__name__)

TELEMETRY_ATTR = "_nwor_telemetry"
"""Set on the scheduler: its :class:`SpecTelemetry`, or None when telemetry is off."""

_UNSET = object()


@dataclass
class NworSchedulerStats(SchedulerStats):
    """vLLM's per-step scheduler stats, plus the plugin's engine-wide numbers."""

    nwor: SpecStepStats | None = None

    @classmethod
    def extend(cls, stats: SchedulerStats, nwor: SpecStepStats) -> NworSchedulerStats:
        if isinstance(stats, cls):
            stats.nwor = nwor
            return stats
        extended = cls.__new__(cls)
        extended.__dict__.update(stats.__dict__)
        extended.nwor = nwor
        return extended


class NworEngineCoreOutputs(
    EngineCoreOutputs,
    array_like=True,  # type: ignore[call-arg]
    omit_defaults=True,  # type: ignore[call-arg]
    gc=False,
):  # type: ignore[call-arg]
    """vLLM's per-step outputs for one front end, its scheduler stats the plugin's."""

    scheduler_stats: NworSchedulerStats | None = None


def telemetry_of(scheduler: Scheduler) -> SpecTelemetry | None:
    """The scheduler's :class:`SpecTelemetry`, made on first use; None when telemetry is off.

    SCV's chunk-0 steps reach it through ``shared.CHUNK_ZERO_ATTR``."""
    telemetry = scheduler.__dict__.get(TELEMETRY_ATTR, _UNSET)
    if telemetry is _UNSET:
        telemetry = _new_telemetry(scheduler)
        scheduler.__dict__[TELEMETRY_ATTR] = telemetry
    return telemetry  # type: ignore[return-value]


def _new_telemetry(scheduler: Scheduler) -> SpecTelemetry | None:
    vllm_config = scheduler.vllm_config
    config = plugin_config(vllm_config)
    if not config.telemetry or vllm_config.speculative_config is None:
        return None
    return SpecTelemetry(
        scheduler.num_spec_tokens,
        collect_stats=scheduler.log_stats,
        wants_nwor_counters=config.nwor,
    )


def _wrap_make_spec_decoding_stats(make_spec_decoding_stats):
    def wrapper(
        self,
        spec_decoding_stats,
        num_draft_tokens,
        num_accepted_tokens,
        num_invalid_spec_tokens,
        request_id,
    ):
        stats = make_spec_decoding_stats(
            self,
            spec_decoding_stats,
            num_draft_tokens=num_draft_tokens,
            num_accepted_tokens=num_accepted_tokens,
            num_invalid_spec_tokens=num_invalid_spec_tokens,
            request_id=request_id,
        )
        telemetry = telemetry_of(self)
        if telemetry is not None and num_draft_tokens:
            telemetry.observe_verify(num_draft_tokens)
        return stats

    return wrapper


def _wrap_update_after_schedule(update_after_schedule):
    def wrapper(self, scheduler_output):
        update_after_schedule(self, scheduler_output)
        chunk_zero = self.__dict__.pop(CHUNK_ZERO_ATTR, 0)  # SCV's count, when SCV is on
        if chunk_zero and (telemetry := telemetry_of(self)) is not None:
            telemetry.observe_chunk_zero(chunk_zero)

    return wrapper


def attach_step(engine_core: EngineCore, outputs: dict[int, EngineCoreOutputs]) -> None:
    """Puts the step's numbers on the scheduler stats the engine core is about to send."""
    telemetry = telemetry_of(engine_core.scheduler)
    if telemetry is None or not telemetry.collect_stats:
        return
    if telemetry.wants_nwor_counters and telemetry.read_nwor_counters is None:
        telemetry.read_nwor_counters = _nwor_counter_reader(engine_core, telemetry)
    # Unfinished, not has_requests(): that also counts requests finished this step whose ids
    # the workers have not been told yet, which would put the last read one step later, on a
    # step without outputs (LLMEngine records no stats for those).
    unfinished = engine_core.scheduler.get_num_unfinished_requests() > 0
    stats = telemetry.take_stats(unfinished_requests=unfinished)
    if stats is None:
        return
    for eco in outputs.values():
        if eco.scheduler_stats is not None:
            eco.scheduler_stats = NworSchedulerStats.extend(eco.scheduler_stats, stats)
            return


def _nwor_counter_reader(engine_core: EngineCore, telemetry: SpecTelemetry):
    """Reads the workers' NWOR counters (``WorkerBase.nwor_counters``) through the executor."""
    executor_ref = weakref.ref(engine_core.model_executor)

    def read() -> dict[str, Any] | None:
        executor = executor_ref()
        if executor is None:
            return None
        try:
            # Not waiting for the GPU: the counts of every step whose outputs the engine has.
            return combine_rank_counters(
                executor.collective_rpc("nwor_counters", kwargs={"wait": False}))
        except Exception:
            logger.warning(
                "vllm-nwor: reading NWOR counters from the workers failed; NWOR metrics stop "
                "here", exc_info=True,
            )
            telemetry.wants_nwor_counters = False
            telemetry.read_nwor_counters = None
            return None

    return read


def _wrap_attach_iteration_details(attach_iteration_details):
    def wrapper(self, outputs, iteration_details):
        attach_iteration_details(self, outputs, iteration_details)
        attach_step(self, outputs)

    return wrapper


PATCHES = [
    Patch(
        Scheduler,
        "_update_after_schedule",
        _wrap_update_after_schedule,
        why="After SCV planned the step (its patch of the same method runs first): count the "
        "requests it scheduled at chunk 0.",
    ),
    Patch(
        Scheduler,
        "make_spec_decoding_stats",
        _wrap_make_spec_decoding_stats,
        why="Its caller, update_from_output, passes each verified request's drafts: count "
        "the step's chunk sizes (vLLM's stats keep only their sum).",
    ),
    Patch(
        EngineCore,
        "_attach_iteration_details",
        _wrap_attach_iteration_details,
        why="Called right after update_from_output in both step() and step_with_batch_queue(), "
        "with the outputs about to be sent: attach the step's numbers to the scheduler stats.",
    ),
]

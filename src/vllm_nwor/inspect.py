"""The plugin's state in a running engine, for tests, benchmarks and demos.

Everything here reads (or, where said, switches) what the patches keep on vLLM's objects, so
that callers need not know the attribute names. Functions that take an ``llm`` need a
``vllm.LLM``; those reading the scheduler need its engine core in the caller's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and raise RuntimeError otherwise. Functions that take a
``model_runner`` run where the runner is: in the worker's process (for example through
``llm.collective_rpc``), or in the caller's when it holds the runner.

Importing this module imports no vLLM; each function imports the patches it reads.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from vllm_nwor.nwor.counters import NworCounters
from vllm_nwor.telemetry.spec_decode import combine_rank_counters

__all__ = [
    "ScvState", "disable_lazy_draft_sync", "get_counters", "interceptor_of", "layer_binding",
    "lazy_draft_sync", "reserved_kv_blocks", "runner_counters", "scheduler_of", "scv_policy",
    "scv_state", "scv_step_clock",
]


# -- NWOR ----------------------------------------------------------------------------------

def get_counters(llm: Any) -> NworCounters | None:
    """NWOR counters of a running ``vllm.LLM`` (None when NWOR is off).

    Token counts are the same on every tensor-parallel rank; rejected KV bytes are summed over
    the ranks, since each holds its own heads.
    """
    combined = combine_rank_counters(llm.collective_rpc("nwor_counters"))
    return None if combined is None else NworCounters(**combined)


def reserved_kv_blocks(llm: Any) -> int:
    """KV blocks NWOR keeps from the scheduler of a ``vllm.LLM`` for verify attention's scratch
    blocks (0 where NWOR is off). vLLM's ``cache_config.num_gpu_blocks``
    is what the scheduler hands out; the workers' caches hold this many more."""
    from vllm_nwor.patches.nwor.engine_core import reserved_blocks

    return reserved_blocks(llm.llm_engine.vllm_config)


def interceptor_of(model_runner: Any) -> Any:
    """The runner's NWOR interceptor (:class:`vllm_nwor.nwor.interceptor.NworInterceptor`: its
    staged layers, verify step and counters), or None when NWOR is off."""
    from vllm_nwor.patches.nwor import binding

    return binding.interceptor_of(model_runner)


def runner_counters(model_runner: Any) -> NworCounters | None:
    """NWOR counters of one model runner, read in its own worker process (None when NWOR is
    off). For code that already runs inside the worker, such as a step-by-step audit."""
    interceptor = interceptor_of(model_runner)
    return None if interceptor is None else interceptor.counters()


def layer_binding(layer: Any) -> Any:
    """A target attention layer's binding to the interceptor
    (:class:`vllm_nwor.patches.nwor.binding.LayerBinding`: the interceptor, the layer's index,
    its backend's state), or None for a layer NWOR did not bind (draft-model layers)."""
    from vllm_nwor.patches.nwor import binding

    return getattr(layer, binding.BINDING_ATTR, None)


# -- SCV -----------------------------------------------------------------------------------

class ScvState(NamedTuple):
    """SCV's plan for the next verify step, and what it planned from."""

    chunks: dict[str, int]
    """Each request's chunk size in the current plan (0: plain decoding)."""
    budget: int
    """The draft budget: the longest planned chunk."""
    acceptance: dict[str, float]
    """Each planned request's estimated probability that its next draft is accepted."""


def scheduler_of(llm: Any) -> Any:
    """The scheduler of a ``vllm.LLM`` whose engine core runs in this process. Raises
    RuntimeError where it runs in a process of its own."""
    from vllm_nwor.patches.scv import scheduler

    return scheduler.scheduler_of(llm)


def scv_policy(llm_or_scheduler: Any) -> Any:
    """SCV's :class:`vllm_nwor.scv.ChunkPolicy` of an in-process engine (an ``LLM``, or its
    scheduler); None when SCV is off."""
    from vllm_nwor.patches.scv import scheduler

    target = llm_or_scheduler
    if hasattr(target, "llm_engine"):
        target = scheduler.scheduler_of(target)
    return scheduler.scheduler_policy(target)


def scv_state(llm_or_scheduler: Any) -> ScvState | None:
    """The current plan's chunk sizes, draft budget and acceptance estimates (None: SCV off)."""
    policy = scv_policy(llm_or_scheduler)
    if policy is None:
        return None
    chunks = dict(policy.current_plan())
    rates = policy.acceptance.rates(list(chunks)) if chunks else []
    return ScvState(chunks, policy.draft_budget(),
                    {req_id: float(rate) for req_id, rate in zip(chunks, rates, strict=True)})


def scv_step_clock(llm_or_scheduler: Any) -> Any:
    """SCV's step clock (:class:`vllm_nwor.patches.scv.scheduler.StepClock`: when each step in
    flight was scheduled, when the last output came; ``shift(seconds)`` moves it past a pause),
    or None when SCV is off."""
    from vllm_nwor.patches.scv import scheduler

    target = llm_or_scheduler
    if hasattr(target, "llm_engine"):
        target = scheduler.scheduler_of(target)
    return scheduler.step_clock(target)


def lazy_draft_sync(model_runner: Any) -> Any:
    """The runner's lazy draft sync (:class:`vllm_nwor.patches.scv.draft_sync.LazyDraftSync`:
    ``skipped_steps``, ``caught_up_tokens``), or None where it is off or not set up yet."""
    from vllm_nwor.patches.scv import draft_sync

    return draft_sync.lazy_draft_sync(model_runner)


def disable_lazy_draft_sync(model_runner: Any) -> None:
    """Switches the lazy draft sync off: the draft model runs on every step, as in vLLM."""
    from vllm_nwor.patches.scv import draft_sync

    draft_sync.disable_lazy_draft_sync(model_runner)

"""Scheduler patches for SCV: size each request's verify chunk; tell the drafter how many to draft.

vLLM's scheduler verifies whatever drafts a request holds in ``spec_token_ids``, and the V1
model runner drafts ``SchedulerOutput.num_spec_tokens_to_schedule`` tokens per request (0 keeps
the drafter's KV in sync but proposes nothing); the V2 runner's speculators draft k every step.
SCV uses exactly these two levers:

- once per step, when the batch is scheduled (``_update_after_schedule``), the policy plans
  the chunk of every request that will get drafts after this step, and
  ``num_spec_tokens_to_schedule`` becomes the longest planned chunk (the draft budget); a
  drafter that can only propose all k (ngram_gpu, :data:`WHOLE_K_DRAFTERS`, and every drafter
  on the V2 runner) is asked for k (:attr:`ScvSettings.drafter_proposes`);
- when those drafts arrive (``update_draft_token_ids``; with async scheduling, when the
  ``AsyncScheduler`` sets draft placeholders), each request's drafts are cut to its chunk size;
- after each step's verdicts (``update_from_output``), the policy observes every request's chunk
  and accepted prefix, and the step's duration; it forgets the requests that finished when the
  next step is scheduled (``SchedulerOutput.finished_req_ids``).

With telemetry on, each step's requests that run at chunk 0 (the plan they were scheduled under
gave them no drafts) are counted for the ``vllm:scv_*`` metrics; the steps with drafts are
counted by the telemetry's own scheduler patch (``patches/telemetry/engine.py``), with vLLM's
counts.

Greedy outputs are unchanged: verifying fewer drafts never changes which tokens are emitted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from vllm.config import CUDAGraphMode
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_nwor._logging import get_logger
from vllm_nwor.patches._patch import Patch
from vllm_nwor.patches.scv.draft_sync import DRAFTED_ATTR
from vllm_nwor.patches.settings import plugin_config
from vllm_nwor.patches.shared import CHUNK_ZERO_ATTR
from vllm_nwor.scv import ChunkPolicy, ScvSettings, SpecChunk

logger = get_logger(__name__)

POLICY_ATTR = "_nwor_scv"
"""Set on the scheduler: its :class:`ChunkPolicy`, or None when SCV is off."""

WHOLE_K_DRAFTERS = ("ngram_gpu", "suffix", "medusa")
"""Speculative methods whose drafter proposes exactly ``num_speculative_tokens`` drafts a step
(vLLM asserts it in their ``propose``), and whose drafting state (ngram_gpu's token ids on
the GPU) moves on every step: SCV asks them for all k and cuts every request to its chunk."""


CLOCK_ATTR = "_nwor_scv_clock"
"""Set on the scheduler with SCV on: its :class:`StepClock`."""


@dataclass
class StepClock:
    """What times SCV's steps: when each step in flight was scheduled (by the id of its
    scheduler output: the time, whether it was planned to learn, the positions it catches up,
    its draft budget), when the last output came, and whether the last plan was one to learn."""

    scheduled_at: dict[int, tuple[float, bool, int, int]] = field(default_factory=dict)
    last_output_at: float = 0.0
    learning_before: bool = False

    def shift(self, seconds: float) -> None:
        """Moves the clock on by a pause of ``seconds`` (a benchmark's pause between runs), so
        that the step in flight across the pause is timed as if there had been none."""
        self.scheduled_at = {key: (at + seconds, *rest)
                             for key, (at, *rest) in self.scheduled_at.items()}
        self.last_output_at += seconds


def scheduler_policy(scheduler: Scheduler) -> ChunkPolicy | None:
    """The scheduler's SCV policy, or None when SCV is off."""
    return getattr(scheduler, POLICY_ATTR, None)


def step_clock(scheduler: Scheduler) -> StepClock | None:
    """The scheduler's SCV step clock, or None when SCV is off."""
    return getattr(scheduler, CLOCK_ATTR, None)


def scheduler_of(llm) -> Scheduler:
    """The scheduler of a ``vllm.LLM`` whose engine core runs in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): what tests and benchmarks read SCV's policy from and
    record steps on. Raises RuntimeError where the engine core is in a process of its own."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        raise RuntimeError("the engine's scheduler is in another process: run the engine core "
                           "in this one (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    return core.scheduler


def policy_of(llm) -> ChunkPolicy | None:
    """SCV's policy in an in-process engine (:func:`scheduler_of`); None when SCV is off."""
    return scheduler_policy(scheduler_of(llm))


def _wrap_init(init):
    def wrapper(self, *args, **kwargs):
        init(self, *args, **kwargs)
        config = plugin_config(self.vllm_config)
        policy = None
        if config.scv != "off" and self.num_spec_tokens > 0:
            method = self.vllm_config.speculative_config.method
            # V2's speculators always draft k (it does not read the draft budget).
            whole_k = method in WHOLE_K_DRAFTERS or self.vllm_config.use_v2_model_runner
            settings = ScvSettings(
                mode=config.scv,
                max_chunk=config.scv_chunk_size or self.num_spec_tokens,
                probe_interval=config.scv_probe_interval,
                probe_cost=config.scv_probe_cost,
                acceptance_window=config.scv_acceptance_window,
                cost_model=tuple(config.scv_cost_model) if config.scv_cost_model else None,
                max_graph_tokens=_max_graph_tokens(self.vllm_config),
                mixed_graphs=_mixed_graphs(self.vllm_config),
                lazy_draft_sync=method == "draft_model" and not whole_k,
                drafter_proposes=self.num_spec_tokens if whole_k else None,
            )
            policy = ChunkPolicy(settings)
            logger.info("SCV active: %s chunks up to %d drafts", settings.mode,
                        settings.max_chunk)
        setattr(self, POLICY_ATTR, policy)
        setattr(self, CLOCK_ATTR, None if policy is None else StepClock())

    return wrapper


def _max_graph_tokens(vllm_config) -> int | None:
    """The most tokens a FULL decode graph takes, or None where decode batches get none."""
    compilation = vllm_config.compilation_config
    mode = compilation.cudagraph_mode
    if (vllm_config.model_config.enforce_eager or mode is None
            or mode.decode_mode() != CUDAGraphMode.FULL):
        return None
    return compilation.max_cudagraph_capture_size


def _mixed_graphs(vllm_config) -> bool:
    """Whether FULL graphs take decode batches of unequal query lengths: ``cudagraph_mode``
    FULL, or a FULL decode mode on the V2 runner, whose varlen decode graphs SCV turns on where
    the attention backends replay them (``decode_graphs_v2.py``). Where the worker shares the
    engine core's process and config (one GPU), this is the mode the runner resolved for the
    attention backend: the engine core builds its scheduler after the runner has. With workers
    in other processes it is the mode asked for; a backend that downgraded it (or, on V2, has
    no varlen graphs) leaves mixed plans priced as on the graphs, which the cost fit then
    meets."""
    mode = vllm_config.compilation_config.cudagraph_mode
    if mode is None:
        return False
    if vllm_config.use_v2_model_runner and mode.decode_mode() == CUDAGraphMode.FULL:
        return True
    return mode.mixed_mode() == CUDAGraphMode.FULL


def _wrap_update_after_schedule(update_after_schedule):
    def wrapper(self, scheduler_output):
        update_after_schedule(self, scheduler_output)
        policy = scheduler_policy(self)
        if policy is None:
            return
        _count_chunk_zero(self, policy, scheduler_output)
        for req_id in scheduler_output.finished_req_ids:  # finished since the last schedule
            policy.forget(req_id)
        # Requests past their prompt after this step get drafts at its end: plan their chunks.
        scheduled, requests = scheduler_output.num_scheduled_tokens, self.requests
        req_ids = [r for r in scheduled if not requests[r].is_prefill_chunk]
        remaining = None
        if policy.settings.lazy_draft_sync:  # (only where the plan prices catch-ups)
            def remaining():
                return [requests[r].max_tokens - requests[r].num_output_tokens for r in req_ids]
        plan = policy.plan(req_ids, remaining=remaining, scheduled=scheduled)
        budget = policy.draft_budget()
        scheduler_output.num_spec_tokens_to_schedule = policy.drafts_asked()
        if budget:
            # The lazy draft sync catches up only these; the rest stay behind.
            setattr(scheduler_output, DRAFTED_ATTR,
                    frozenset(r for r, size in plan.items() if size))
        # A step planned to learn (ChunkPolicy.learning_step) and the next, which verifies its
        # drafts, owe the policy's ledger what they take over a plain step.
        clock = step_clock(self)
        learning = policy.learning_step or clock.learning_before
        clock.learning_before = policy.learning_step
        clock.scheduled_at[id(scheduler_output)] = (time.perf_counter(), learning,
                                                    policy.caught_up, budget)

    return wrapper


def _count_chunk_zero(scheduler: Scheduler, policy: ChunkPolicy, scheduler_output) -> None:
    """For telemetry: the requests of this step that run at chunk 0 (``CHUNK_ZERO_ATTR``).

    Their drafts were cut by the plan of the previous step, still the current one here: a
    request planned at 0 and scheduled now decodes without drafts.
    """
    plan = policy.current_plan()
    scheduler.__dict__[CHUNK_ZERO_ATTR] = sum(
        1 for req_id in scheduler_output.num_scheduled_tokens if plan.get(req_id) == 0)


def _wrap_async_update_after_schedule(update_after_schedule):
    def wrapper(self, scheduler_output):
        # The base method (patched above) plans and sets the budget; the placeholders it
        # sizes are then cut to each request's chunk.
        update_after_schedule(self, scheduler_output)
        policy = scheduler_policy(self)
        if policy is not None:
            _cut_drafts(self, policy)

    return wrapper


def _wrap_update_draft_token_ids(update_draft_token_ids):
    def wrapper(self, draft_token_ids):
        update_draft_token_ids(self, draft_token_ids)
        policy = scheduler_policy(self)
        if policy is not None:
            _cut_drafts(self, policy)

    return wrapper


def _cut_drafts(scheduler: Scheduler, policy: ChunkPolicy) -> None:
    for req_id, size in policy.cuts():
        request = scheduler.requests.get(req_id)
        if request is not None and len(request.spec_token_ids) > size:
            request.spec_token_ids = request.spec_token_ids[:size]


def _wrap_update_from_output(update_from_output):
    def wrapper(self, scheduler_output, model_runner_output):
        policy = scheduler_policy(self)
        if policy is not None:
            _observe(self, policy, scheduler_output, model_runner_output)
        return update_from_output(self, scheduler_output, model_runner_output)

    return wrapper


def _observe(scheduler: Scheduler, policy: ChunkPolicy, scheduler_output,
             model_runner_output) -> None:
    """Feeds the policy this step's chunks (vLLM's own accepted counts) and its duration."""
    sampled = model_runner_output.sampled_token_ids
    index = model_runner_output.req_id_to_index
    chunks = []
    for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
        request = scheduler.requests.get(req_id)
        row = index.get(req_id)
        if request is None or row is None or not sampled or not sampled[row] or not drafts:
            continue
        accepted = len(sampled[row]) - 1  # the scheduler's num_accepted
        first = request.num_computed_tokens - len(drafts)
        chunks.append(SpecChunk(req_id, tuple(drafts), first, accepted))
    policy.observe(chunks)
    # A step's cost is the time its output took to follow whichever came later: the step's
    # scheduling or the previous step's output. Without async scheduling that is from
    # scheduling to output; with it, steps overlap and the interval between outputs is what
    # each step costs the engine's throughput (the latency from scheduling counts the
    # previous step too).
    # A step whose requests all finished before its output came is not one: with async
    # scheduling the engine schedules a step past a run's last tokens, and its output waits
    # in the batch queue until the engine steps again, the next run seconds later (the GPU
    # showed such "steps" of 0.2-18 s in the cost model's window).
    now = time.perf_counter()
    clock = step_clock(scheduler)
    scheduled, learning, caught_up, budget = clock.scheduled_at.pop(
        id(scheduler_output), (None, False, 0, 0))
    previous, clock.last_output_at = clock.last_output_at, now
    live = any(r in scheduler.requests for r in scheduler_output.num_scheduled_tokens)
    if scheduled is not None and sampled and live:
        tokens = scheduler_output.num_scheduled_tokens.values()
        policy.observe_step(len(tokens), scheduler_output.total_num_scheduled_tokens, budget,
                            now - max(scheduled, previous), uniform=min(tokens) == max(tokens),
                            learning=learning, caught_up=caught_up, verified=sum(
                                map(len, scheduler_output.scheduled_spec_decode_tokens.values())))
    else:  # the cost model pairs each step with the next: this one is not there
        policy.cost.interrupt()


PATCHES = [
    Patch(
        Scheduler,
        "__init__",
        _wrap_init,
        why="Create the SCV policy when 'scv' is on. Retired by a scheduler hook for "
        "per-request speculation length.",
    ),
    Patch(
        Scheduler,
        "_update_after_schedule",
        _wrap_update_after_schedule,
        why="Plan every request's chunk once per step and set the draft budget "
        "(num_spec_tokens_to_schedule) for the drafter.",
    ),
    Patch(
        AsyncScheduler,
        "_update_after_schedule",
        _wrap_async_update_after_schedule,
        why="With async scheduling, cut each request's draft placeholders to its chunk.",
    ),
    Patch(
        Scheduler,
        "update_draft_token_ids",
        _wrap_update_draft_token_ids,
        why="Cut each request's new drafts to its planned chunk size.",
    ),
    Patch(
        Scheduler,
        "update_from_output",
        _wrap_update_from_output,
        why="Feed the policy each request's chunk and accepted prefix, and the step time.",
    ),
]

"""What a model runner's steps ran, recorded in the worker process that runs them (engine tests
and benchmarks/equivalence.py; under tensor parallelism through the audit plugin,
``soak_audit.py``, in every worker).

- :func:`record_dispatches`: the CUDA graph mode of each target step, by batch shape. vLLM's V1
  runner picks each step's mode (FULL, PIECEWISE, NONE) and padding in
  ``_determine_batch_execution_and_padding``; its dummy runs (profiling, warm-up, graph capture)
  call it too, so only calls made while ``execute_model`` runs are counted. On the CPU every
  step is NONE. The V2 runner picks them in its CUDA-graph manager's ``dispatch``.
- :class:`StepRecorder`: steps with drafts, and steps in which a request starts from
  prefix-cache hits while another verifies drafts.
- :class:`WorkerRecord`: both, with what the worker runs on (its tensor-parallel rank and
  device, attention backend, graph mode, async scheduling, custom all-reduce) and NWOR's staged
  steps that replayed a FULL graph.
"""

from __future__ import annotations

import inspect

from tests.support.cache_audit import is_v2_runner


def record_dispatches(runner) -> dict[str, int]:
    """Counts the target's graph modes by batch shape from now on: ``"<q>:<mode>"`` for uniform
    batches of ``q`` tokens per request, ``"mixed:<mode>"`` for the others. Returns the dict,
    which fills as steps run."""
    counts: dict[str, int] = {}
    if is_v2_runner(runner):
        return _record_v2_dispatches(runner, counts)
    determine = runner._determine_batch_execution_and_padding
    signature = inspect.signature(determine)
    execute_model = runner.execute_model
    in_step = [False]

    def recording(*args, **kwargs):
        result = determine(*args, **kwargs)
        if in_step[0]:
            bound = signature.bind(*args, **kwargs).arguments
            query_len = bound["max_num_scheduled_tokens"]
            uniform = bound["num_tokens"] == query_len * bound["num_reqs"]
            key = f"{query_len if uniform else 'mixed'}:{result[0].name}"
            counts[key] = counts.get(key, 0) + 1
        return result

    def stepping(*args, **kwargs):
        in_step[0] = True
        try:
            return execute_model(*args, **kwargs)
        finally:
            in_step[0] = False

    runner._determine_batch_execution_and_padding = recording
    runner.execute_model = stepping
    return counts


def _record_v2_dispatches(runner, counts: dict[str, int]) -> dict[str, int]:
    """vLLM's V2 runner: its CUDA-graph manager picks each step's descriptor in ``dispatch``,
    from ``execute_model`` (graph capture builds its descriptors directly; the start-up warm-up
    steps, through ``execute_model``, are counted if this is attached before them)."""
    manager = runner.cudagraph_manager
    dispatch = manager.dispatch

    def recording(num_reqs, num_tokens, uniform_token_count, *args, **kwargs):
        desc = dispatch(num_reqs, num_tokens, uniform_token_count, *args, **kwargs)
        key = f"{uniform_token_count or 'mixed'}:{desc.cg_mode.name}"
        counts[key] = counts.get(key, 0) + 1
        return desc

    manager.dispatch = recording
    return counts


def full_verify_steps(dispatches: dict[str, int]) -> int:
    """Steps of more than one token per request that replayed a FULL graph."""
    return sum(n for key, n in dispatches.items()
               if key.endswith(":FULL") and key.split(":")[0] not in ("1", "mixed"))


def token_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """The share of positions where two runs' token lists (request by request) agree."""
    same = sum(x == y for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))
    return same / sum(len(r) for r in a)


class StepRecorder:
    """Counts, per step, what the equivalence matrix claims to exercise: steps with drafts,
    steps in which a request starts from prefix-cache hits while another request verifies
    drafts, and steps in which a request is scheduled more tokens than a decode with its drafts
    (a prompt chunk) while another verifies drafts."""

    def __init__(self, runner) -> None:
        self.verify_steps = self.hits_beside_verify = self.prefill_beside_verify = 0
        execute_model = runner.execute_model

        def recording(scheduler_output, *args, **kwargs):
            drafts = scheduler_output.scheduled_spec_decode_tokens
            if drafts:
                self.verify_steps += 1
                if any(r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs):
                    self.hits_beside_verify += 1
                if any(n > 1 + len(drafts.get(req_id, ()))
                       for req_id, n in scheduler_output.num_scheduled_tokens.items()):
                    self.prefill_beside_verify += 1
            return execute_model(scheduler_output, *args, **kwargs)

        runner.execute_model = recording


class WorkerRecord:
    """What one worker ran, from now on (:meth:`as_dict`)."""

    def __init__(self, runner, layers: list) -> None:
        self.runner, self.layers = runner, layers
        self.dispatches = record_dispatches(runner)
        self.steps = StepRecorder(runner)

    def as_dict(self) -> dict:
        import torch
        from vllm.distributed.parallel_state import get_tp_group

        import vllm_nwor.inspect

        runner = self.runner
        group = get_tp_group()
        communicator = group.device_communicator
        custom = getattr(communicator, "ca_comm", None)  # vLLM's custom all-reduce (CUDA)
        interceptor = vllm_nwor.inspect.interceptor_of(runner)
        on_cuda = runner.device.type == "cuda"
        return {
            "tp_rank": group.rank_in_group,
            "tp_size": group.world_size,
            "device": torch.cuda.get_device_name(runner.device) if on_cuda else "cpu",
            "device_index": runner.device.index,  # cuda:<rank> under tensor parallelism
            "device_type": runner.device.type,
            "attention": type(self.layers[0].impl).__name__,
            "cudagraph_mode": str(runner.compilation_config.cudagraph_mode),
            "async_scheduling": bool(runner.vllm_config.scheduler_config.async_scheduling),
            "custom_all_reduce": custom is not None and not custom.disabled,
            "dispatches": dict(self.dispatches),
            "full_verify_steps": full_verify_steps(self.dispatches),
            "nwor_graph_steps": None if interceptor is None else interceptor.graph_steps,
            "verify_steps": self.steps.verify_steps,
            "hits_beside_verify": self.steps.hits_beside_verify,
            "prefill_beside_verify": self.steps.prefill_beside_verify,
        }

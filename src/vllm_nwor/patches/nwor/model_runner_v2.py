"""Runner patches for vLLM 0.32's V2 model runner (``vllm/v1/worker/gpu/model_runner.py``), on
which a GPU runs every speculative method by default (draft_model, ngram, EAGLE, EAGLE-3, MTP).
Per step it goes through::

    execute_model:  prepare_inputs -> prepare_attn -> target forward (FULL graph, piecewise
                    or eager; every layer: KV write, attention)
    sample_tokens:  sample (rejection sampling) -> async output copy -> postprocess_sampled
                    -> speculator.propose

The attention side is the V1 runner's (V2 drives the same ``Attention`` layers and
``FlashAttentionImpl``), so only the runner side differs:

- bind once the KV cache exists (``initialize_kv_cache``; not to the cache of vLLM's profiling
  pass, which is thrown away);
- begin each verify step when ``prepare_inputs`` has placed the drafts (batch order, draft
  counts and query starts are on the host there);
- commit right after ``sample``: after the verdict, before ``postprocess_sampled`` advances the
  requests and before the speculator runs. V2's sampled ids are not padded with -1 past each
  request's ``num_sampled`` (those entries are uninitialised), so the verdict is built from
  ``num_sampled`` on the device, with no host sync;
- ``capture_model``: FULL graphs of verify batches are captured with the staged path;
- ``warmup_kernels``: vLLM's start-up warm-up runs a real verify step through the runner (so
  NWOR's kernels are compiled before the first request); NWOR's counters start after it.

The speculator's own layers (EAGLE, EAGLE-3 and MTP heads, a draft model's layers) are not
bound: they keep vLLM's write, and run after the commit. EAGLE heads read the target's hidden
states, not its KV cache.
"""

from __future__ import annotations

import torch
import vllm.v1.worker.gpu_worker as gpu_worker
from vllm.v1.worker.gpu.model_runner import GPUModelRunner as GPUModelRunnerV2

from vllm_nwor.config import NworConfigError
from vllm_nwor.patches._patch import Patch
from vllm_nwor.patches.nwor.binding import interceptor_of, wrap_capture_model
from vllm_nwor.patches.nwor.model_runner import begin_verify_step, bind
from vllm_nwor.patches.shared import one_verdict_v2

PLACEHOLDER = -1  # what the commit's verdict reads as "no token here" (V1's padding)


def _wrap_initialize_kv_cache(initialize_kv_cache):
    def wrapper(self, kv_cache_config, is_profiling: bool = False, **kwargs):
        initialize_kv_cache(self, kv_cache_config, is_profiling=is_profiling, **kwargs)
        if getattr(self, "pcp_manager", None) is not None:
            raise NworConfigError(
                "'nwor': true does not support prefill context parallelism on the V2 model "
                "runner; allowed: prefill_context_parallel_size=1")
        bind(self, profiling=is_profiling)  # the profiling pass's cache is thrown away

    return wrapper


def _wrap_prepare_inputs(prepare_inputs):
    def wrapper(self, scheduler_output, *args, **kwargs):
        input_batch = prepare_inputs(self, scheduler_output, *args, **kwargs)
        interceptor = interceptor_of(self)
        if interceptor is not None:
            begin_verify_step(interceptor, input_batch.num_draft_tokens_per_req,
                              input_batch.query_start_loc_np[: input_batch.num_reqs + 1],
                              self.device, input_batch.num_scheduled_tokens)
        return input_batch

    return wrapper


_POSITIONS: dict[tuple[int, torch.device], torch.Tensor] = {}
"""``arange(width)`` per width and device, made once: not a launch in every verify step."""


def verdict_ids(sampled: torch.Tensor, num_sampled: torch.Tensor) -> torch.Tensor:
    """V2's sampled ids in V1's form: each row's entries past its ``num_sampled`` set to -1."""
    key = (sampled.shape[1], sampled.device)
    positions = _POSITIONS.get(key)
    if positions is None:
        positions = _POSITIONS[key] = torch.arange(key[0], device=key[1])
    return torch.where(positions < num_sampled.unsqueeze(1), sampled, PLACEHOLDER)


def _wrap_sample(sample):
    def wrapper(self, hidden_states, input_batch, grammar_output):
        sampler_output, num_sampled, num_rejected = sample(
            self, hidden_states, input_batch, grammar_output)
        interceptor = interceptor_of(self)
        if interceptor is not None and input_batch.num_draft_tokens:  # same on every rank
            # Under tensor parallelism every rank commits the first rank's verdict.
            one_verdict_v2(sampler_output, num_sampled, num_rejected)
            if interceptor.step is not None:
                interceptor.commit(verdict_ids(sampler_output.sampled_token_ids, num_sampled))
        return sampler_output, num_sampled, num_rejected

    return wrapper


def _wrap_warmup_kernels(warmup_kernels):
    def wrapper(model_runner, *args, **kwargs):
        warmup_kernels(model_runner, *args, **kwargs)
        interceptor = interceptor_of(model_runner)
        if interceptor is not None:
            interceptor.reset_counters()

    return wrapper


PATCHES = [
    Patch(
        GPUModelRunnerV2,
        "initialize_kv_cache",
        _wrap_initialize_kv_cache,
        why="V2 runner: once the KV cache tensors exist, bind the interceptor to the target "
        "model's attention layers (the speculator's layers stay unbound).",
    ),
    Patch(
        GPUModelRunnerV2,
        "prepare_inputs",
        _wrap_prepare_inputs,
        why="V2 runner: begin the verify step once, for all layers, when the drafts' batch rows "
        "are known.",
    ),
    Patch(
        GPUModelRunnerV2,
        "sample",
        _wrap_sample,
        why="V2 runner: commit the accepted drafts right after rejection sampling, before "
        "postprocess_sampled and the speculator. Its only caller is sample_tokens.",
    ),
    Patch(
        GPUModelRunnerV2,
        "capture_model",
        wrap_capture_model,
        why="V2 runner: while vLLM captures its CUDA graphs, bound layers called with more than "
        "one token per request take the staged path, so FULL graphs of verify batches stage "
        "drafts.",
    ),
    Patch(
        gpu_worker,
        "warmup_kernels",
        _wrap_warmup_kernels,
        why="V2 runner: the start-up warm-up's verify step (dummy requests no scheduler saw) "
        "stages and commits like any other, compiling NWOR's kernels; the counters start after "
        "it. The worker calls it by its module-level name.",
    ),
]

"""Per-request synthetic acceptance (a benchmark feature, :mod:`vllm_nwor.synthetic`): the
verdict thinned per request, right after rejection sampling, on either runner.

Its sample hooks (V1's ``_sample``, V2's ``sample``) are registered before NWOR's, so they run
first (innermost): NWOR commits the thinned verdict, and the drafter, vLLM's adaptive
verification and the scheduler see it too. Every tensor-parallel rank takes the first rank's
draw (``shared.one_verdict``, ``shared.one_verdict_v2``). The V2 runner keeps no sampling
parameters per request: its ``add_requests`` hook keeps each request's rate, by the row it
takes in the runner's request state.
"""

from __future__ import annotations

import numpy as np
import torch
from vllm.v1.worker.gpu.model_runner import GPUModelRunner as GPUModelRunnerV2
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_nwor.patches._patch import Patch
from vllm_nwor.patches.settings import plugin_config
from vllm_nwor.patches.shared import one_verdict, one_verdict_v2
from vllm_nwor.synthetic import EXTRA_ARGS_KEY, rate_at, thin_acceptance, thin_counts

SPECS_ATTR = "_nwor_synthetic_specs"
"""On a V2 runner: each request-state row's ``synthetic_acceptance_rate`` (None: none)."""


def _spec(sampling_params):
    extra = sampling_params.extra_args if sampling_params else None
    return extra.get(EXTRA_ARGS_KEY) if extra else None


def _on_device(rates: list[float], device: torch.device) -> torch.Tensor:
    host = torch.tensor(rates, dtype=torch.float32)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _request_rates(runner: GPUModelRunner, num_reqs: int) -> torch.Tensor:
    """Each batch row's synthetic acceptance rate (1 where the request sets none)."""
    rates = []
    for req_id in runner.input_batch.req_ids[:num_reqs]:
        state = runner.requests[req_id]
        rates.append(rate_at(_spec(state.sampling_params), len(state.output_token_ids)))
    return _on_device(rates, runner.device)


def _wrap_sample(sample):
    def wrapper(self, logits, spec_decode_metadata):
        sampler_output = sample(self, logits, spec_decode_metadata)
        if spec_decode_metadata is None or \
                not plugin_config(self.vllm_config).synthetic_acceptance_per_request:
            return sampler_output
        sampled = sampler_output.sampled_token_ids
        sampler_output.sampled_token_ids = thin_acceptance(
            sampled, _request_rates(self, sampled.shape[0]))
        one_verdict(sampler_output)
        return sampler_output

    return wrapper


def _wrap_add_requests_v2(add_requests):
    def wrapper(self, scheduler_output, *args, **kwargs):
        add_requests(self, scheduler_output, *args, **kwargs)
        if not plugin_config(self.vllm_config).synthetic_acceptance_per_request:
            return
        specs = self.__dict__.setdefault(SPECS_ATTR, {})
        index = self.req_states.req_id_to_index
        for new in scheduler_output.scheduled_new_reqs:  # a row reused: its new request's
            specs[index[new.req_id]] = _spec(new.sampling_params)

    return wrapper


def _request_rates_v2(runner, input_batch) -> torch.Tensor:
    """Each batch row's synthetic acceptance rate, by its request-state row (1 where the
    request sets none); its output tokens so far are its computed tokens past its prompt."""
    specs = runner.__dict__.get(SPECS_ATTR, {})
    states = runner.req_states
    rows = input_batch.idx_mapping_np[: input_batch.num_reqs]
    outputs = np.maximum(states.num_computed_tokens_np[rows] - states.prompt_len.np[rows], 0)
    return _on_device([rate_at(specs.get(int(row)), int(made))
                       for row, made in zip(rows, outputs, strict=True)], runner.device)


def _wrap_sample_v2(sample):
    def wrapper(self, hidden_states, input_batch, grammar_output):
        sampler_output, num_sampled, num_rejected = sample(
            self, hidden_states, input_batch, grammar_output)
        if input_batch.num_draft_tokens and \
                plugin_config(self.vllm_config).synthetic_acceptance_per_request:
            thin_counts(num_sampled, num_rejected, _request_rates_v2(self, input_batch),
                        sampler_output.sampled_token_ids.shape[1] - 1)
            one_verdict_v2(sampler_output, num_sampled, num_rejected)
        return sampler_output, num_sampled, num_rejected

    return wrapper


PATCHES = [
    Patch(
        GPUModelRunner,
        "_sample",
        _wrap_sample,
        why="With synthetic_acceptance_per_request (a benchmark feature): thin the verdict per "
        "request right after rejection sampling, before NWOR's commit and the drafter.",
    ),
    Patch(
        GPUModelRunnerV2,
        "add_requests",
        _wrap_add_requests_v2,
        why="V2 runner, with synthetic_acceptance_per_request: keep each new request's rate by "
        "its request-state row (the V2 runner keeps no sampling parameters per request).",
    ),
    Patch(
        GPUModelRunnerV2,
        "sample",
        _wrap_sample_v2,
        why="V2 runner, with synthetic_acceptance_per_request: cut each request's accepted "
        "count per its rate right after rejection sampling, in place, before NWOR's commit, "
        "the speculator and adaptive verification read it.",
    ),
]

"""Per-request synthetic acceptance (a benchmark feature, :mod:`vllm_nwor.synthetic`): the V1
runner's verdict thinned per request, right after rejection sampling.

Its ``_sample`` hook is registered before NWOR's, so it runs first (innermost): NWOR commits the
thinned verdict, and the drafter and the scheduler see it too. Every tensor-parallel rank takes
the first rank's draw (``shared.one_verdict``).
"""

from __future__ import annotations

import torch
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_nwor.patches._patch import Patch
from vllm_nwor.patches.settings import plugin_config
from vllm_nwor.patches.shared import one_verdict
from vllm_nwor.synthetic import EXTRA_ARGS_KEY, rate_at, thin_acceptance


def _request_rates(runner: GPUModelRunner, num_reqs: int) -> torch.Tensor:
    """Each batch row's synthetic acceptance rate (1 where the request sets none)."""
    rates = []
    for req_id in runner.input_batch.req_ids[:num_reqs]:
        state = runner.requests[req_id]
        extra = state.sampling_params.extra_args if state.sampling_params else None
        spec = extra.get(EXTRA_ARGS_KEY) if extra else None
        rates.append(rate_at(spec, len(state.output_token_ids)))
    host = torch.tensor(rates, dtype=torch.float32)
    if runner.device.type == "cuda":
        host = host.pin_memory()
    return host.to(runner.device, non_blocking=True)


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


PATCHES = [
    Patch(
        GPUModelRunner,
        "_sample",
        _wrap_sample,
        why="With synthetic_acceptance_per_request (a benchmark feature): thin the verdict per "
        "request right after rejection sampling, before NWOR's commit and the drafter.",
    ),
]

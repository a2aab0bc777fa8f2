"""What one feature's patches leave on vLLM's objects for another feature's, and what several
features' patches do alike, so that the feature packages (``nwor/``, ``scv/``, ``telemetry/``)
never import each other."""

import torch
from vllm.distributed import get_tp_group

CHUNK_ZERO_ATTR = "_nwor_chunk_zero_requests"
"""Set in the scheduler's ``__dict__`` by SCV in every step it plans: how many of the step's
requests run at chunk 0 (decode without drafts). Telemetry takes it for its chunk-size
histogram; absent without SCV."""

ONE_VERDICT_ATTR = "_nwor_one_verdict"
"""Set on a ``SamplerOutput`` once :func:`one_verdict` (V1) or :func:`one_verdict_v2` has
broadcast it."""


def one_verdict(sampler_output) -> None:
    """Under tensor parallelism, every rank takes the first rank's verdict (V1 runner).

    Each rank samples on its own copy of the all-gathered logits, and the scheduler sees the
    first rank's result. NWOR's commit on every rank must take the same prefix, and the
    synthetic thinning draws on each rank: rather than trust that the ranks' draws agree, the
    accepted tokens are broadcast from the first rank before any consumer on any rank reads
    them (NWOR's commit, the drafter, vLLM's bookkeeping). One small collective per verify
    step, however many features ask for it.
    """
    if sampler_output.__dict__.get(ONE_VERDICT_ATTR):
        return
    group = get_tp_group()
    if group.world_size > 1:
        sampled = sampler_output.sampled_token_ids.contiguous()
        sampler_output.sampled_token_ids = group.broadcast(sampled, src=0)
    sampler_output.__dict__[ONE_VERDICT_ATTR] = True


def one_verdict_v2(sampler_output, num_sampled, num_rejected) -> None:
    """:func:`one_verdict` for the V2 runner, whose verdict is the sampled ids with each
    request's counts of sampled and rejected tokens: the three tensors are broadcast from the
    first rank, packed, and copied in place (``num_sampled`` and ``num_rejected`` are the
    tensors the caller returns), once per step however many features ask."""
    if sampler_output.__dict__.get(ONE_VERDICT_ATTR):
        return
    group = get_tp_group()
    if group.world_size > 1:
        sampled = sampler_output.sampled_token_ids
        width = sampled.shape[1]
        packed = torch.cat([sampled.to(torch.int64), num_sampled.to(torch.int64).unsqueeze(1),
                            num_rejected.to(torch.int64).unsqueeze(1)], dim=1)
        packed = group.broadcast(packed, src=0)
        sampled.copy_(packed[:, :width])
        num_sampled.copy_(packed[:, width])
        num_rejected.copy_(packed[:, width + 1])
    sampler_output.__dict__[ONE_VERDICT_ATTR] = True

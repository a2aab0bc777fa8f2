"""Per-request synthetic acceptance: a benchmark and test feature, never for production traffic.

Real traffic mixes requests that speculate well with requests that do not. To benchmark that on
random-weight models, each request may carry its own acceptance rate::

    SamplingParams(extra_args={"synthetic_acceptance_rate": 0.3})
    SamplingParams(extra_args={"synthetic_acceptance_rate": [[0, 0.0], [40, 1.0]]})

The second form is a schedule: ``[from_output_token, rate]`` pairs, the last one reached applies.
It needs ``"synthetic_acceptance_per_request": true`` in the plugin config. It serves both of
vLLM's model runners: V1's verdict is the sampled ids, -1 past each request's last
(:func:`thin_acceptance`); V2's is each request's count of sampled and rejected tokens
(:func:`thin_counts`).

After rejection sampling, each draft the sampler accepted is kept with probability ``rate``
(given the ones before it were kept); from the first dropped draft on, the request's output ends
with the token sampled at that position. Drafts are only ever *rejected* here, never accepted,
so with greedy sampling the emitted tokens are exactly those without the feature: only how many
arrive per step changes. Combine it with vLLM's ``rejection_sample_method="synthetic"`` at full
acceptance (``synthetic_acceptance_length = k + 1``) to make every request's acceptance follow
its own rate regardless of the draft model.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

EXTRA_ARGS_KEY = "synthetic_acceptance_rate"
PLACEHOLDER_TOKEN_ID = -1


def rate_at(spec: float | Sequence[Sequence[float]] | None, num_output_tokens: int) -> float:
    """The acceptance rate of a request after ``num_output_tokens`` tokens, clipped to [0, 1].

    ``None`` means no thinning (rate 1).
    """
    if spec is None:
        return 1.0
    if isinstance(spec, (int, float)):
        rate = float(spec)
    else:
        rate = 1.0
        for start, value in spec:
            if num_output_tokens >= start:
                rate = float(value)
    return min(1.0, max(0.0, rate))


def thin_acceptance(sampled_token_ids: torch.Tensor, rates: torch.Tensor,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """Rejects accepted drafts at random, per request (see the module docstring).

    ``sampled_token_ids``: ``[num_reqs, max_spec_len + 1]``, -1 where nothing was emitted.
    ``rates``: ``[num_reqs]`` float. Returns a new tensor; stays on the device.
    """
    num_reqs, width = sampled_token_ids.shape
    if width <= 1:
        return sampled_token_ids
    uniform = torch.rand((num_reqs, width - 1), device=sampled_token_ids.device,
                         generator=generator)
    kept = (uniform < rates[:, None]).to(torch.int32).cumprod(dim=1).sum(dim=1)
    columns = torch.arange(width, device=sampled_token_ids.device)
    return torch.where(columns[None, :] > kept[:, None], PLACEHOLDER_TOKEN_ID,
                       sampled_token_ids)


def thin_counts(num_sampled: torch.Tensor, num_rejected: torch.Tensor, rates: torch.Tensor,
                max_drafts: int, generator: torch.Generator | None = None) -> None:
    """:func:`thin_acceptance` for the V2 runner's verdict, in place.

    ``num_sampled``: ``[num_reqs]``, each request's accepted drafts plus one (0 where it
    sampled nothing); ``num_rejected``: its rejected drafts; ``rates``: ``[num_reqs]`` float;
    ``max_drafts``: the most drafts a request verifies. Each accepted draft is kept with
    probability ``rate`` given the ones before it were kept; the dropped ones move from
    sampled to rejected. The emitted tokens are a prefix of those the sampler emitted.
    """
    if max_drafts <= 0 or num_sampled.numel() == 0:
        return
    uniform = torch.rand((num_sampled.shape[0], max_drafts), device=num_sampled.device,
                         generator=generator)
    chain = (uniform < rates[:, None]).to(torch.int32).cumprod(dim=1).sum(dim=1)
    accepted = (num_sampled.to(torch.int32) - 1).clamp(min=0)
    dropped = accepted - torch.minimum(accepted, chain)
    num_sampled.sub_(dropped.to(num_sampled.dtype))
    num_rejected.add_(dropped.to(num_rejected.dtype))
